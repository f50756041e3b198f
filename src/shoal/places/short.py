"""Short commands a place runs for itself, and stopping what its session's commands left running.

`run_short` is the one way a place runs a command to its end (an engine probe, an ssh call
over the held connection). The rest is the place's side of the shim's bookkeeping (shim.py):
every command the shim sends to the target carries `SHOAL_PLACE_CMD=<token>` in its
environment (a token starts with the place's id), and its token is a file in the place's
directory while it runs (`runs/run/`) and after its main process ended (`runs/done/`), until
the end of the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shoal.places import shim

SWEEP_TIMEOUT = 15.0


async def run_short(argv: Sequence[str], *, timeout: float, cwd: str | Path | None = None,
                    env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """Run a short command to its end: (exit code, stdout, stderr). However else the wait ends
    (past `timeout`: TimeoutError; a cancel), the command is killed and reaped first."""
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=cwd, env=None if env is None else dict(env))
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def sweep(config: dict[str, Any], tokens: list[str] | None = None) -> bool:
    """Stop, in the target, the commands of `tokens` and everything they started (None: every
    command of the place). True when the target said so."""
    patterns = [f"{config['id']}."] if tokens is None else tokens
    env = {**os.environ, **config.get("env", {})}
    with contextlib.suppress(OSError, TimeoutError):
        code, _, _ = await run_short(shim.sweep_argv(config, patterns), timeout=SWEEP_TIMEOUT, env=env)
        return code == 0
    return False


async def end_turn(config: dict[str, Any]) -> bool:
    """A place's `after_turn`: stop in the target what the turn's commands left running. Returns
    whether the turn ran any command there.

    Always stopped: a command whose main process still runs when its turn is over — the turn
    was cancelled or timed out and its shim (here) was killed, perhaps before it could stop
    the command itself, or the CLI gave up on it. The shim stops its command on SIGTERM/INT/HUP
    already; this is the backstop for a shim killed outright (SIGKILL).

    The grey zone, what a command deliberately left in the background (`server &`) after its
    main process ended: stopped when the turn was cancelled or timed out (cancelling a turn
    stops everything it started); left running after a turn that ended normally, since an
    agent may start a server in one turn to use it in the next, as it can here. It stops when
    the place is given back (the container removed; an ssh place sweeps its commands).
    """
    runs = Path(config["runs"])
    running, done = _tokens(runs / "run"), _tokens(runs / "done")
    task = asyncio.current_task()
    cancelled = task is not None and task.cancelling() > 0
    tokens = running + (done if cancelled else [])
    if tokens:
        await sweep(config, tokens)
    for sub, names in (("run", running), ("done", done)):
        for name in names:
            with contextlib.suppress(OSError):
                (runs / sub / name).unlink()
    return bool(running or done)


def _tokens(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []
