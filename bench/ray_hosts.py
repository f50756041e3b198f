"""Sessions hosted on Ray against local ones: throughput with 1 and 2 nodes, and the per-turn cost.

(Not `bench/ray.py`: run as a script, a file of that name would be imported as `ray` itself.)

    .venv/bin/python bench/ray_hosts.py [N conversations, default 8] [K turns each, default 3]

Starts a Ray cluster of two nodes on this machine (`LocalCluster`), then, side by side in one
run and interleaved (local, 1 node, 2 nodes, again...) so the machine's load falls on all alike:

- throughput: N conversations at once, each a first (cold) turn, timed apart — a hosted one
  starts an actor and a CLI of its own — then K more turns each (write a file, run a command,
  answer: three model calls against the loopback model), as turns per minute;
- overhead: one conversation, turns one after another, the median turn (cold one left out)
  hosted over local, as a ratio and in milliseconds; and the cold first turn apart (a hosted
  session's first turn starts its actor and makes its place on the node).

Be honest about what "2 nodes" means here: both nodes are processes on the same 2 cores, so a
second node adds no CPU. It shows what spreading costs or saves in Ray's own machinery, not
what a second machine would give; on a real cluster each node brings its own cores.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import shoal
from shoal.hosts.local_cluster import LocalCluster

BACKEND = "codex"  # the lightest CLI here; a turn is mostly the CLI's own start-up and work
REPS = 2
OVERHEAD_TURNS = 8


def agents(address: str) -> dict[str, Callable[[], shoal.Agent]]:
    # num_cpus=0: this bench asks how fast, not how many fit; Ray would otherwise cap a 2-CPU
    # node at two sessions
    return {
        "local": lambda: shoal.Agent(BACKEND),
        "ray, 1 node": lambda: shoal.Agent(BACKEND, hosts=shoal.Ray(address=address, num_cpus=0,
                                                                    resources={"head": 0.01})),
        "ray, 2 nodes": lambda: shoal.Agent(BACKEND, hosts=shoal.Ray(address=address, num_cpus=0, strategy="SPREAD")),
    }


async def throughput(make: Callable[[], shoal.Agent], n: int, k: int, root: Path) -> tuple[float, float, set[str]]:
    """n conversations at once: (seconds for every first turn, warm turns per minute over k more each)."""
    dirs = [Path(tempfile.mkdtemp(dir=root)) for _ in range(n)]
    async with make() as agent:
        sessions = [agent.session(where=d) for d in dirs]

        async def converse(i: int, s: shoal.Session, turns: range) -> None:
            for t in turns:
                r = await s.arun(f"#! write out.txt {i}-{t}\n#! run cat out.txt\n#! say done {i}-{t}")
                assert r.text == f"done {i}-{t}", r.text

        t0 = time.perf_counter()
        await asyncio.gather(*(converse(i, s, range(1)) for i, s in enumerate(sessions)))  # cold: actors, CLIs
        t1 = time.perf_counter()
        await asyncio.gather(*(converse(i, s, range(1, k + 1)) for i, s in enumerate(sessions)))
        t2 = time.perf_counter()
        nodes = {getattr(s.place, "where", {}).get("ip", "here") for s in sessions}
    return t1 - t0, n * k / (t2 - t1) * 60, nodes


async def latency(make: Callable[[], shoal.Agent], root: Path) -> tuple[float, float]:
    """(cold first turn, median of the warm turns) of one conversation, in seconds."""
    async with make() as agent:
        s = agent.session(where=Path(tempfile.mkdtemp(dir=root)))
        times = []
        for t in range(OVERHEAD_TURNS + 1):
            t0 = time.perf_counter()
            await s.arun(f"#! run echo {t}\n#! say ok")
            times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def conditions() -> str:
    import ray

    codex = subprocess.run([str(Path(shoal.__file__).resolve().parents[2] / "node_modules" / ".bin" / "codex"),
                            "--version"], capture_output=True, text=True).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs (both Ray nodes share them), load average {load} at the start; "
            f"{codex}, ray {ray.__version__}, Python {sys.version.split()[0]}; loopback model in this process")


def main(n: int = 8, k: int = 3) -> None:
    import ray

    with LocalCluster([{"head": 100}, {"node2": 100}]) as cluster, tempfile.TemporaryDirectory() as d:
        ray.init(address=cluster.address, namespace="shoal", log_to_driver=False, logging_level="WARNING")
        cluster.wait_for_nodes(2)
        root = Path(d)
        print(f"conditions: {conditions()}")
        makers = agents(cluster.address)
        rates: dict[str, list[float]] = {name: [] for name in makers}
        starts: dict[str, list[float]] = {name: [] for name in makers}
        spread: dict[str, set[str]] = {name: set() for name in makers}
        cold: dict[str, list[float]] = {name: [] for name in makers}
        warm: dict[str, list[float]] = {name: [] for name in makers}
        for rep in range(REPS):
            for name, make in makers.items():
                start, rate, nodes = asyncio.run(throughput(make, n, k, root))
                starts[name].append(start)
                rates[name].append(rate)
                spread[name] |= nodes
                first, median = asyncio.run(latency(make, root))
                cold[name].append(first)
                warm[name].append(median)
                print(f"  rep {rep + 1} {name:13s} {n} first turns {start:.2f} s, then {rate:6.1f} turns/min; "
                      f"one conversation: cold {first:.2f} s, "
                      f"warm {median * 1000:.0f} ms", flush=True)
        ray.shutdown()

    base_rate, base_warm = statistics.mean(rates["local"]), statistics.mean(warm["local"])
    print(f"\nthroughput, {n} conversations at once, {k} warm turns each after a first one (mean of {REPS}):")
    for name in makers:
        rate, start = statistics.mean(rates[name]), statistics.mean(starts[name])
        print(f"  {name:13s} {rate:6.1f} turns/min  ({rate / base_rate:.2f}x local); the {n} first turns took "
              f"{start:.2f} s; on {sorted(spread[name])}")
    print(f"\nper turn, one conversation, median of {OVERHEAD_TURNS} warm turns (mean of {REPS}):")
    for name in makers:
        w, c = statistics.mean(warm[name]), statistics.mean(cold[name])
        print(f"  {name:13s} {w * 1000:6.0f} ms  ({w / base_warm:.2f}x local, {(w - base_warm) * 1000:+.0f} ms); "
              f"cold first turn {c:.2f} s")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
