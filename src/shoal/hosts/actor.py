"""The far side of a hosted session: one actor per session, on the node the cluster chose.

It holds what a session holds locally — the place (made here, on this node), the backend and
the CLI processes it starts — for the session's life. The caller's side (`ray.py`) asks it to
open the place, start a turn, hand over the turn's events and give the place back. Events go
back in batches through `next()`, a long poll: it answers as soon as there is anything, so a
batch costs one round trip however many events it holds, and it works over Ray Client
(`ray://`), which cannot stream an actor's generator.

Nothing here imports ray: `ray.py` makes this class an actor (`ray.remote(SessionHost)`), so the
module loads, and can be read and tested, without ray.

Dying is the interesting part. `ray.kill`, a node that goes away and the caller's process
ending (an actor dies with its owner) all end this process with SIGKILL, and the CLI processes
it started — each in a process group of its own, on purpose — would live on. So the actor
first starts a reaper: a tiny process holding the read end of a pipe whose write end only the
actor holds (non-inheritable, so no CLI keeps it open). When the actor dies, however it dies,
the pipe closes and the reaper kills every process carrying this actor's tag
(`SHOAL_HOST=<tag>`, put in the backend's environment, so every process a CLI starts inherits
it) and removes the actor's scratch directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from shoal import backends, homes
from shoal.backends.base import Backend, Conversation, Settings
from shoal.errors import TurnFailed
from shoal.hosts.results import Snapshots, push_branch
from shoal.places.base import Place
from shoal.procs import tagged_pids
from shoal.reply import Event

TAG_VAR = "SHOAL_HOST"
MARKS = ".shoal-hosts"  # in the agent's home: which sessions' conversations this home holds
SNAPSHOT_KINDS = ("copy", "worktree")  # places made for the session; others are the user's own directory
MAX_BATCH = 256
CANCEL_WAIT = 30.0  # a cancelled turn stops its CLI in a few seconds (TERM, 2 s grace, KILL)

REAPER = r"""
import os, shutil, signal, sys, time
tag, scratch = sys.argv[1].encode(), sys.argv[2]
if os.fork():
    os._exit(0)  # not a child of the actor: Ray kills a dead worker's children, and this must outlive it
sys.stdin.buffer.read()  # returns at EOF: the actor is gone, or done
me = os.getpid()
for _ in range(10):
    found = False
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if tag in env:
            found = True
            try:
                os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass
    if not found:
        break
    time.sleep(0.2)
shutil.rmtree(scratch, ignore_errors=True)
"""


@dataclass(frozen=True)
class Finished:
    """The turn completed: the conversation's id and what of its state can travel."""

    session_id: str | None
    state: dict[str, Any]
    held: list[int]


@dataclass(frozen=True)
class Stopped:
    """The turn was cancelled on the node."""


@dataclass(frozen=True)
class Failed:
    """The turn raised: the exception, taken apart so it can be put together again as itself.

    Pickling an exception keeps only `args`, and shoal's errors carry more (exit code, stderr,
    status...) as attributes: those travel in `attrs`."""

    kind: type[BaseException]
    args: tuple[Any, ...]
    attrs: dict[str, Any]
    text: str

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        attrs = {k: v for k, v in vars(exc).items() if _picklable(v)}
        kind = type(exc) if _picklable(type(exc)) and _picklable(exc.args) else TurnFailed
        args = exc.args if kind is type(exc) else (f"{type(exc).__name__}: {exc}",)
        return cls(kind, args, attrs if kind is type(exc) else {}, str(exc))

    def exception(self) -> BaseException:
        exc = self.kind.__new__(self.kind)
        exc.args = self.args
        exc.__dict__.update(self.attrs)
        return exc


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def start_reaper(tag: str, scratch: Path) -> int:
    """The reaper (see the module docstring); returns the lifeline's write end."""
    read, write = os.pipe()  # non-inheritable (PEP 446): only this process holds `write`
    # its own session and, once it has forked, no parent here: nothing that ends the actor ends it
    subprocess.run([sys.executable, "-I", "-S", "-c", REAPER, f"{TAG_VAR}={tag}", str(scratch)],
                   stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                   check=True, timeout=60)
    os.close(read)
    return write


class SessionHost:
    """One session's place, backend and CLI processes, on the node that hosts it."""

    def __init__(self, settings: Settings, tag: str, locate: Callable[[], dict[str, Any]]) -> None:
        self.tag = tag
        self.settings = replace(settings, env={**settings.env, TAG_VAR: tag})
        self.locate = locate
        self.scratch = Path(tempfile.mkdtemp(prefix="shoal-host-"))
        self._lifeline = start_reaper(tag, self.scratch)
        self.backend: Backend | None = None
        self.place: Place | None = None
        self.conv: Conversation | None = None
        self.snapshots: Snapshots | None = None
        self._items: asyncio.Queue[object] | None = None
        self._task: asyncio.Task[None] | None = None

    async def ready(self) -> dict[str, Any]:
        """Where this actor runs (answered as soon as a node has taken it)."""
        return self.locate()

    async def open(self, place: Place, slot: str, session_id: str | None, state: dict[str, Any],
                   patch: str) -> dict[str, Any]:
        """Make the place on this node; pick up the conversation if this node's home holds it."""
        home = self.settings.home
        homes.claim(home, str(id(self)))  # every actor of the agent on this node holds it while it lives
        self.backend = backends.make(self.settings)  # the CLI as installed on this node
        cwd = await place.open()
        self.place = place
        mark = home / MARKS / slot
        # a conversation lives in the agent's home: a fresh actor on a machine that does not
        # share that home (no mark of this session in it) cannot pick it up
        resumable = session_id is None or mark.exists()
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
        self.conv = Conversation(cwd=cwd, session_id=session_id if resumable else None,
                                 state=dict(state) if resumable else {}, env=place.env())
        if place.kind in SNAPSHOT_KINDS:
            self.snapshots = Snapshots(cwd, self.scratch)
            await asyncio.to_thread(self.snapshots.start)
            if patch:  # the work of an earlier node, onto this fresh place
                await asyncio.to_thread(self.snapshots.apply, patch)
        return {**self.locate(), "cwd": str(cwd), "resumable": resumable, "scratch": str(self.scratch)}

    # --- turns -----------------------------------------------------------------------------

    async def start(self, prompt: str) -> None:
        if self._task is not None and not self._task.done():
            raise TurnFailed("a turn is already running on this session's node")  # sessions queue turns
        self._items = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(prompt, self._items))

    async def _pump(self, prompt: str, items: asyncio.Queue[object]) -> None:
        assert self.backend is not None and self.conv is not None
        try:
            turn = cast(AsyncGenerator[Event, None], self.backend.turn(self.conv, prompt))  # a generator, always
            async with contextlib.aclosing(turn) as events:
                async for ev in events:
                    items.put_nowait(ev)
        except asyncio.CancelledError:
            items.put_nowait(Stopped())
            raise
        except Exception as exc:
            items.put_nowait(Failed.of(exc))
            return
        # what the backend keeps of its processes *in this actor* (`Backend.process_bound`) means
        # nothing to a fresh actor; a server generation carried over would make one believe a
        # thread is already open on its own new server. The rest travels (claude's "resume",
        # codex's usage total), so a fresh actor resumes exactly as a restarted CLI does here.
        bound = self.backend.process_bound
        state = {k: v for k, v in self.conv.state.items() if k not in bound and _picklable(v)}
        items.put_nowait(Finished(self.conv.session_id, state, self.held()))

    async def next(self, wait: float) -> list[object]:
        """The turn's next events: at least one, or none after `wait` seconds."""
        items = self._items
        if items is None:
            return [Stopped()]
        try:
            out = [await asyncio.wait_for(items.get(), wait)]
        except TimeoutError:
            return []
        while not items.empty() and len(out) < MAX_BATCH:
            out.append(items.get_nowait())
        return out

    async def cancel(self) -> None:
        """Stop the running turn and wait until its CLI is stopped."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=CANCEL_WAIT)

    # --- the place and the end -------------------------------------------------------------

    async def after_turn(self) -> str | None:
        """The place's own after-turn step, then the work so far as a patch (None: not taken)."""
        if self.place is not None:
            await self.place.after_turn()
        return await asyncio.to_thread(self.snapshots.patch) if self.snapshots is not None else None

    async def end(self) -> None:
        if self.backend is not None and self.conv is not None:
            await self.backend.end(self.conv)

    async def close(self, push: str | None, branch: str, message: str) -> dict[str, Any]:
        """Give the place back: its last patch, the branch pushed (if asked), the place's note."""
        out: dict[str, Any] = {"patch": None, "pushed": None, "note": None, "push_failed": None}
        if self.place is None or self.conv is None:
            return out
        if self.snapshots is not None:
            out["patch"] = await asyncio.to_thread(self.snapshots.patch)
        if push and self.place.kind in SNAPSHOT_KINDS:
            branch = str(getattr(self.place, "branch", None) or branch)  # a worktree's own shoal/<task>
            try:
                commit = await asyncio.to_thread(push_branch, self.conv.cwd, push, branch, message)
                out["pushed"] = f"{branch} at {commit[:12]} to {push}"
            except Exception as exc:  # the place is still given back by its own rules (kept: it holds work)
                out["push_failed"] = str(exc)
        out["note"] = await self.place.close()
        self.place = None
        return out

    async def shutdown(self, remove_home: bool) -> None:
        """The session or its agent is done: stop everything, then let the reaper sweep."""
        await self.cancel()
        if self.backend is not None:
            with contextlib.suppress(Exception):
                await self.backend.aclose()
        homes.release(self.settings.home, str(id(self)))
        if remove_home:  # a home shoal made for the agent, on a machine the caller is not on
            await asyncio.to_thread(shutil.rmtree, self.settings.home, True)
        with contextlib.suppress(OSError):
            os.close(self._lifeline)  # the reaper sweeps (nothing should be left) and removes the scratch

    def held(self) -> list[int]:
        held = getattr(self.backend, "held_pids", None)
        return list(held()) if callable(held) else []

    def pids(self) -> list[int]:
        """Every live process this actor's CLIs started (for tests and `shoal` tools)."""
        return tagged_pids(f"{TAG_VAR}={self.tag}")
