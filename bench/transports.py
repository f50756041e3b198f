"""Held-open vs per-turn transports, per backend, side by side in one run.

    .venv/bin/python bench/transports.py [ROUNDS] [BACKENDS]

For 1 and 4 sessions at once (each in its own directory, against the loopback model), every
backend runs ROUNDS warm turns per session (write a file, run a command, answer) after one
cold turn, on its held-open transport and on its per-turn one, interleaved so both see the
same machine. Prints the median warm turn latency of each and the ratio held-open / per-turn.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import shoal

HELD = {"opencode": "server", "claude": "held", "codex": "server"}
PER_TURN = "run"
SIZES = (1, 4)
PROMPT = "#! write out.txt {i}\n#! run cat out.txt\n#! say done"


async def warm_latencies(backend: str, transport: str, n: int, rounds: int, root: Path) -> list[float]:
    dirs = [Path(tempfile.mkdtemp(dir=root)) for _ in range(n)]
    async with shoal.Agent(backend, transport=transport) as agent:
        sessions = [agent.session(where=d) for d in dirs]
        await asyncio.gather(*(s.arun("#! say cold") for s in sessions))  # starts are not the question
        seconds: list[float] = []
        for r in range(rounds):
            replies = await asyncio.gather(*(s.arun(PROMPT.format(i=r)) for s in sessions))
            seconds += [rep.seconds for rep in replies]
    return seconds


async def main(rounds: int, backends: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"{'backend':9} {'N':>2}  {'held-open':>10}  {'per-turn':>10}  held/per-turn")
        for backend in backends:
            for n in SIZES:
                held: list[float] = []
                per: list[float] = []
                for _ in range(2):  # interleaved, so a noisy moment falls on both
                    held += await warm_latencies(backend, HELD[backend], n, rounds, root)
                    per += await warm_latencies(backend, PER_TURN, n, rounds, root)
                h, p = statistics.median(held), statistics.median(per)
                print(f"{backend:9} {n:>2}  {h:>9.3f}s  {p:>9.3f}s  {h / p:>6.2f}x")


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["claude", "codex", "opencode"]
    asyncio.run(main(rounds, names))
