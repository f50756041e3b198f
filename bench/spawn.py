"""What tying a CLI to shoal's life costs per spawn, side by side in one run.

    .venv/bin/python bench/spawn.py [MB ...]

Every CLI shoal starts must die with it (PR_SET_PDEATHSIG). Two ways to ask for that: a
Python `preexec_fn` that calls prctl in the child (which makes the spawn a full fork() of
shoal, on its loop thread), or util-linux's `setpriv --pdeathsig KILL -- CLI` (which lets
Python use vfork and costs one exec more). For a shoal holding MB of memory, this prints the
median time to start and reap `true` plainly, through setpriv, and with preexec_fn, and the
ratios. The spawn happens on the event loop: while it lasts, no other session moves.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import time

from shoal.procs import _dies_with

ROUNDS = 40


async def spawn_once(kind: str, setpriv: str) -> float:
    argv, arm = ["true"], None
    if kind == "setpriv":
        argv = [setpriv, "--pdeathsig", "KILL", "--", "true"]
    elif kind == "preexec_fn":
        arm = _dies_with(os.getpid())
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, preexec_fn=arm, start_new_session=True,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)
    await proc.wait()
    return time.perf_counter() - started


async def measure(mb: int, setpriv: str) -> dict[str, float]:
    ballast = bytearray(mb * 1024 * 1024)
    for i in range(0, len(ballast), 4096):  # touched, so fork() has page tables to copy
        ballast[i] = 1
    times: dict[str, list[float]] = {"plain": [], "setpriv": [], "preexec_fn": []}
    for _ in range(ROUNDS):  # interleaved: every kind sees the same machine
        for kind, samples in times.items():
            samples.append(await spawn_once(kind, setpriv))
    del ballast
    return {kind: statistics.median(samples) * 1000 for kind, samples in times.items()}


def main() -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None or not sys.platform.startswith("linux"):
        raise SystemExit("bench/spawn.py: needs Linux and util-linux's setpriv")
    sizes = [int(a) for a in sys.argv[1:]] or [50, 500, 2000]
    print(f"{'shoal MB':>9} {'plain ms':>9} {'setpriv ms':>11} {'preexec_fn ms':>14} {'preexec/setpriv':>16}")
    for mb in sizes:
        m = asyncio.run(measure(mb, setpriv))
        print(f"{mb:>9} {m['plain']:>9.2f} {m['setpriv']:>11.2f} {m['preexec_fn']:>14.2f} "
              f"{m['preexec_fn'] / m['setpriv']:>15.1f}x")


if __name__ == "__main__":
    main()
