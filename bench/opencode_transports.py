"""opencode's two transports side by side: one managed `opencode serve` vs `opencode run` per turn.

    .venv/bin/python bench/opencode_transports.py [ROUNDS]

For 1, 4 and 8 sessions (each in its own directory, against the loopback model) it runs
ROUNDS rounds of one turn per session at once (write a file, run a command, answer) and
prints the median turn latency and the peak memory (PSS) of all the agent's processes, then the
ratios run/serve. Everything is measured in this one run; the first round includes the
server's cold start (and the run transport's cold database), as a first turn would.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import shoal
from shoal.procs import tagged_pids

SIZES = (1, 4, 8)


def pss_of(pids: list[int]) -> int:
    """Summed proportional set size: a tool's process forked from a 1 GB server shares its pages,
    and summing RSS would count them twice."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
        except OSError:
            continue
    return total


class PeakMemory:
    """Samples the summed PSS of every process carrying the agent's tag, every 50 ms."""

    def __init__(self, agent_id: str) -> None:
        self.needle, self.peak = f"SHOAL_AGENT={agent_id}", 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, pss_of(tagged_pids(self.needle)))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(transport: str, n: int, rounds: int, root: Path) -> tuple[float, int]:
    dirs = [root / f"{transport}-{n}-{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()

    async def main(agent: shoal.Agent) -> list[float]:
        sessions = [agent.session(where=d) for d in dirs]
        seconds: list[float] = []
        for k in range(rounds):
            replies = await asyncio.gather(*(
                s.arun(f"#! write r{k}.txt {i}\n#! run cat r{k}.txt\n#! say done {i}") for i, s in enumerate(sessions)))
            assert [r.text for r in replies] == [f"done {i}" for i in range(n)], [r.text for r in replies]
            seconds += [r.seconds for r in replies]
        return seconds

    with shoal.Agent("opencode", transport=transport) as agent, PeakMemory(agent.id) as peak:
        seconds = asyncio.run(main(agent))
    return statistics.median(seconds), peak.peak


def main(rounds: int = 3) -> None:
    results: dict[tuple[str, int], tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as d:
        for n in SIZES:
            for transport in ("server", "run"):
                t0 = time.monotonic()
                results[transport, n] = measure(transport, n, rounds, Path(d))
                lat, mem = results[transport, n]
                print(f"{transport:>6} x{n}: median turn {lat:6.2f} s, peak memory {mem / 2**20:6.0f} MB "
                      f"({time.monotonic() - t0:.0f} s for {rounds} rounds)", flush=True)
    print("\nsessions  turn serve  turn run  run/serve  |  mem serve  mem run  run/serve")
    for n in SIZES:
        (ls, ms), (lr, mr) = results["server", n], results["run", n]
        print(f"{n:>8}  {ls:9.2f}s  {lr:7.2f}s  {lr / ls:8.1f}x  |  {ms / 2**20:7.0f}MB  {mr / 2**20:5.0f}MB  "
              f"{mr / ms:8.1f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
