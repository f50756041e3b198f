"""The concurrency benchmark: how many conversations a backend holds at half speed.

Every conversation does real work against the loopback model: a cold turn that reads files,
edits a source file and runs a checker that writes a proof holding a nonce; then a warm turn
in the same conversation that must recall a marker given only in the cold turn. Every turn
is validated; a wrong turn fails its rung whatever its speed.

For each backend (and transport), N conversations run at once for N on a ladder, each rung
repeated, against a serial control measured in the same run. The width is the largest N at
which p50 and p95 turn latency, cold and warm, all stay within 2x the control.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import shoal
from shoal.procs import tagged_pids

LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SLOWDOWN = 2.0
FIXTURE = "do not touch: fixture line\n"
CHECKER = """import hashlib, pathlib, re
src = pathlib.Path("src/app.py").read_text()
nonce = re.search(r'VALUE = "([^"]+)"', src).group(1)
pathlib.Path("proof.txt").write_text(hashlib.sha256(nonce.encode()).hexdigest() + "\\n")
print("proof written")
"""


@dataclass
class Sample:
    n: int
    rep: int
    cold: float
    warm: float
    overhead: float  # seconds outside the backend's turn (queueing, place, bridging, journal)
    ok: bool
    problem: str = ""


@dataclass
class Rung:
    n: int
    samples: list[Sample] = field(default_factory=list)

    def stat(self, which: str, q: float) -> float:
        values = sorted(getattr(s, which) for s in self.samples)
        return _quantile(values, q)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.samples)


@dataclass
class Result:
    backend: str
    transport: str
    control: Rung
    rungs: list[Rung]
    width: int
    stopped_because: str
    leftovers: list[int] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        c = self.control
        return {"backend": self.backend, "transport": self.transport, "width": self.width,
                "control_cold_p50": c.stat("cold", 0.5), "control_warm_p50": c.stat("warm", 0.5),
                "overhead_p50": statistics.median([s.overhead for r in self.rungs for s in r.samples] or [0.0]),
                "stopped_because": self.stopped_because}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def make_fixture(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text('VALUE = "unset"\n')
    (root / "fixture.txt").write_text(FIXTURE)
    (root / "checker.py").write_text(CHECKER)
    return root


async def conversation(agent: shoal.Agent, where: Path, n: int, rep: int) -> Sample:
    nonce = uuid.uuid4().hex[:12]
    marker = f"marker-{nonce}"
    cold_prompt = (f"remember: {marker}\n#! run cat src/app.py fixture.txt\n"
                   f'#! write src/app.py VALUE = "{nonce}"\n#! run python3 checker.py\n#! say done')
    session = agent.session(where=where)
    t0 = time.monotonic()
    cold = await session.arun(cold_prompt)
    t1 = time.monotonic()
    warm = await session.arun("#! recall")
    t2 = time.monotonic()
    problems = []
    proof = where / "proof.txt"
    if not proof.exists() or proof.read_text().strip() != hashlib.sha256(nonce.encode()).hexdigest():
        problems.append("proof missing or wrong")
    if nonce not in (where / "src" / "app.py").read_text():
        problems.append("source not changed")
    if (where / "fixture.txt").read_text() != FIXTURE:
        problems.append("fixture touched")
    if marker not in warm.text:
        problems.append("marker not recalled")
    overhead = (t1 - t0 - cold.seconds) + (t2 - t1 - warm.seconds)
    return Sample(n, rep, t1 - t0, t2 - t1, max(overhead, 0.0), not problems, "; ".join(problems))


async def rung(backend: str, transport: str | None, n: int, rep: int, scratch: Path) -> tuple[list[Sample], list[int]]:
    """N conversations at once on a fresh agent; returns their samples and any process left."""
    run = uuid.uuid4().hex[:6]
    dirs = [make_fixture(scratch / f"n{n}-r{rep}-{run}-{i}") for i in range(n)]
    agent = shoal.Agent(backend, model="loopback", transport=transport)
    try:
        results = await asyncio.gather(*(conversation(agent, d, n, rep) for d in dirs), return_exceptions=True)
    finally:
        await agent.aclose()
    samples = []
    for r in results:
        if isinstance(r, BaseException):
            samples.append(Sample(n, rep, float("nan"), float("nan"), 0.0, False, f"{type(r).__name__}: {r}"[:300]))
        else:
            samples.append(r)
    await asyncio.sleep(0.2)
    left = tagged_pids(f"SHOAL_AGENT={agent.id}")
    return samples, left


async def measure(backend: str, transport: str | None, max_n: int, reps: int, scratch: Path,
                  log: Any = print) -> Result:
    label = f"{backend}:{transport or 'default'}"
    control = Rung(1)
    for rep in range(reps):
        samples, left = await rung(backend, transport, 1, rep, scratch)
        control.samples += samples
        if left:
            return Result(backend, transport or "default", control, [], 0, f"control left processes {left}", left)
    log(f"{label}: serial control cold p50 {control.stat('cold', 0.5):.2f}s warm p50 {control.stat('warm', 0.5):.2f}s")
    rungs: list[Rung] = []
    width, why = 1 if control.ok else 0, "" if control.ok else "control turns were wrong"
    for n in [x for x in LADDER if x <= max_n]:
        if not control.ok:
            break
        r = Rung(n)
        for rep in range(reps):
            samples, left = await rung(backend, transport, n, rep, scratch)
            r.samples += samples
            if left:
                rungs.append(r)
                return Result(backend, transport or "default", control, rungs, width,
                              f"N={n} left processes behind: {left}", left)
        rungs.append(r)
        within = all(r.stat(w, q) <= SLOWDOWN * control.stat(w, q) for w in ("cold", "warm") for q in (0.5, 0.95))
        log(f"{label}: N={n:>3} ok={r.ok} cold p50 {r.stat('cold', 0.5):.2f}s p95 {r.stat('cold', 0.95):.2f}s "
            f"warm p50 {r.stat('warm', 0.5):.2f}s p95 {r.stat('warm', 0.95):.2f}s within={within}")
        if not r.ok:
            why = f"N={n}: a turn was wrong ({next(s.problem for s in r.samples if not s.ok)})"
            break
        if not within:
            why = f"N={n}: latency past {SLOWDOWN:g}x the serial control"
            break
        width = n
    else:
        why = why or f"reached --max-n {max_n}"
    return Result(backend, transport or "default", control, rungs, width, why or "reached --max-n")


def conditions() -> dict[str, Any]:
    quota = "none"
    try:
        raw = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if raw and raw[0] != "max":
            quota = f"{int(raw[0]) / int(raw[1]):g} CPUs"
    except (OSError, ValueError, IndexError):
        pass
    mem = 0
    with contextlib.suppress(OSError, StopIteration, ValueError):
        mem = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal")).split()[1]) // 1024
    from shoal.backends.base import find_cli

    versions = {}
    for cli, pkg in (("opencode", "opencode-ai"), ("claude", "@anthropic-ai/claude-code"), ("codex", "@openai/codex")):
        try:
            import subprocess

            out = subprocess.run([find_cli(cli, pkg), "--version"], capture_output=True, text=True, timeout=30)
            versions[cli] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
        except Exception as exc:  # a missing CLI is a condition too
            versions[cli] = f"unavailable ({type(exc).__name__})"
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "nproc": os.cpu_count(), "cpu_quota": quota,
            "memory_mb": mem, "machine": platform.machine(), "python": platform.python_version(),
            "shoal": shoal.__version__, "clis": versions}


def markdown(results: list[Result], cond: dict[str, Any]) -> str:
    lines = [f"Measured {cond['date']} on {cond['nproc']} CPUs (cgroup quota: {cond['cpu_quota']}), "
             f"{cond['memory_mb']} MB, shoal {cond['shoal']}; CLIs: "
             + ", ".join(f"{k} {v}" for k, v in cond["clis"].items()) + ".", "",
             "| backend | transport | width (N at ≤2x) | control cold p50 | control warm p50 | shoal overhead p50 "
             "| stopped because |", "|---|---|---|---|---|---|---|"]
    for r in results:
        row = r.row()
        lines.append(f"| {row['backend']} | {row['transport']} | {row['width']} | {row['control_cold_p50']:.2f} s "
                     f"| {row['control_warm_p50']:.2f} s | {row['overhead_p50'] * 1000:.0f} ms "
                     f"| {row['stopped_because']} |")
    return "\n".join(lines) + "\n"


async def bench(targets: list[str], max_n: int, reps: int, out: Path | None, log: Any = print) -> list[Result]:
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    try:
        for target in targets:
            backend, _, transport = target.partition(":")
            results.append(await measure(backend, transport or None, max_n, reps, scratch, log))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cond = conditions()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        payload = {"conditions": cond, "results": [
            {**r.row(), "control": [asdict(s) for s in r.control.samples],
             "rungs": [{"n": g.n, "samples": [asdict(s) for s in g.samples]} for g in r.rungs]} for r in results]}
        (out / "concurrency.json").write_text(json.dumps(payload, indent=1, default=str))
        (out / "concurrency.md").write_text(markdown(results, cond))
    log(markdown(results, cond))
    return results
