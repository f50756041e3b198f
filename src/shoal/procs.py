"""Spawning and stopping CLI processes. Nothing else in shoal spawns a long-lived process.

Each process starts a process group of its own and carries a tag in its environment
(`SHOAL_PROC`), inherited by everything it starts. Stopping kills the group, then sweeps
/proc for anything still carrying the tag: a child that called setsid() or was re-parented
escapes the group but not its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import shutil
import signal
import sys
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
STDOUT_LIMIT = 64 * 1024 * 1024  # one JSON event can carry a whole file's tool output
TAG = "SHOAL_PROC"
_live: set[Proc] = set()  # every process not yet reaped, for the last-resort stop at exit


def kill_all() -> None:
    """Kill every process shoal started and everything they started (at interpreter exit)."""
    for proc in list(_live):
        proc._signal_group(signal.SIGKILL)
        proc._sweep(signal.SIGKILL)


def tagged_pids(needle: str) -> list[int]:
    """Pids of live processes whose environment contains `needle` (e.g. "SHOAL_AGENT=ab12")."""
    raw = needle.encode()
    found: list[int] = []
    me = os.getpid()
    if not os.path.isdir("/proc"):
        return found  # no /proc (macOS): process groups alone stop what shoal started
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and any(item == raw for item in env.split(b"\0")):
            found.append(int(entry.name))
    return found


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv") if sys.platform.startswith("linux") else None


def _tied(argv: Sequence[str], sig: signal.Signals) -> tuple[list[str], Callable[[], None] | None]:
    """`argv` made to die when the thread that starts it goes (Linux's PR_SET_PDEATHSIG; shoal
    starts processes from its own loop thread, which lives as long as shoal does).

    util-linux's `setpriv --pdeathsig` sets it and execs the CLI, which keeps it. A Python
    `preexec_fn` would do the same but makes every spawn a full fork() of shoal, on the loop
    thread, whose cost grows with shoal's memory (bench/spawn.py: 5 ms at 50 MB, 70 ms at
    2 GB, against 2 ms through setpriv): the fallback where setpriv is missing."""
    setpriv = _setpriv()
    if setpriv is not None:
        return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--", *argv], None
    return list(argv), _dies_with(os.getpid(), sig)


def _dies_with(parent: int, sig: signal.Signals = signal.SIGKILL) -> Callable[[], None] | None:
    """For a child, before exec: be killed when the thread that started it goes (Linux's
    PR_SET_PDEATHSIG; shoal starts processes from its own loop thread, which lives as long as
    shoal does). prctl is looked up here, in the parent: the child only calls it. Elsewhere
    than Linux there is no such thing, and process groups are what stops a CLI."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # shoal died before the line above: nothing will signal us
            os._exit(1)

    return arm


class Proc:
    """One running CLI process, its output streams and its whole family of descendants."""

    def __init__(self, proc: asyncio.subprocess.Process, tag: str, argv: Sequence[str]) -> None:
        self._proc = proc
        self.tag = tag
        self.argv = list(argv)
        self.pid = proc.pid
        self._stderr: deque[str] = deque(maxlen=200)
        self._stderr_task = asyncio.get_running_loop().create_task(self._drain_stderr())
        _live.add(self)

    @classmethod
    async def spawn(cls, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], stdin: bool = False,
                    dies_with: signal.Signals = signal.SIGKILL) -> Proc:
        """Start `argv` in a process group of its own. It gets `dies_with` when shoal dies, even
        killed outright with nothing of it left to stop it: a server held between turns, and a
        per-turn CLI too, which would otherwise wait on its model until its turn timed out.
        (SIGTERM for a process that must clean up on the way out, as sshfs unmounts.)"""
        tag = uuid.uuid4().hex
        command, arm = _tied(argv, dies_with)
        creating = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *command,
            cwd=str(cwd),
            env={**env, TAG: tag},
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=STDOUT_LIMIT,
            preexec_fn=arm,
        ))
        try:
            return cls(await asyncio.shield(creating), tag, argv)
        except asyncio.CancelledError:
            # cancelled while the process was being made: it exists all the same, so stop it
            with contextlib.suppress(Exception):
                await cls(await creating, tag, argv).stop()
            raise

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def readline(self) -> bytes:
        assert self._proc.stdout is not None
        return await self._proc.stdout.readline()

    async def write(self, data: bytes, *, close: bool = False) -> None:
        stdin = self._proc.stdin
        if stdin is None:
            raise RuntimeError("process was spawned without stdin")
        stdin.write(data)
        await stdin.drain()
        if close:
            stdin.close()

    async def wait(self) -> int:
        code = await self._proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._stderr_task), 2)
        self._sweep(signal.SIGKILL)  # the CLI is done: nothing it started may outlive it
        _live.discard(self)
        return code

    def stderr_tail(self, lines: int = 20) -> str:
        return "\n".join(list(self._stderr)[-lines:])

    async def stop(self, grace: float = 2.0) -> None:
        """TERM the group, give it `grace` seconds, then KILL the group and every tagged straggler."""
        if self._proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), grace)
        self._signal_group(signal.SIGKILL)
        self._sweep(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            await asyncio.shield(self._proc.wait())
        _live.discard(self)
        self._stderr_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._stderr_task

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def _sweep(self, sig: int) -> None:
        for pid in tagged_pids(f"{TAG}={self.tag}"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    async def _drain_stderr(self) -> None:
        stream = self._proc.stderr
        assert stream is not None
        while True:
            line = await stream.readline()
            if not line:
                return
            self._stderr.append(line.decode(errors="replace").rstrip())
