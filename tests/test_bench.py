"""A smoke rung of the concurrency benchmark (N=1 and 2, one rep) so the harness keeps working."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from conftest import BACKENDS
from shoal.concurrency import Rung, Sample, bench, make_fixture

BACKEND = "codex" if "codex" in BACKENDS else "opencode"


def test_smoke_rung_validates_every_turn_and_writes_results(tmp_path: Path) -> None:
    lines: list[str] = []
    results = asyncio.run(bench([BACKEND], max_n=2, reps=1, out=tmp_path, log=lines.append))
    (r,) = results
    assert r.control.ok and all(g.ok for g in r.rungs), [s.problem for g in r.rungs for s in g.samples]
    assert [g.n for g in r.rungs][:2] == [1, 2] and r.leftovers == []
    assert r.width in (0, 1, 2)
    data = json.loads((tmp_path / "concurrency.json").read_text())
    cond = data["conditions"]
    assert cond["nproc"] and cond["clis"][BACKEND] and cond["date"]
    assert data["results"][0]["backend"] == BACKEND and len(data["results"][0]["control"]) == 1
    md = (tmp_path / "concurrency.md").read_text()
    assert f"| {BACKEND} |" in md and "CPUs" in md


def test_a_wrong_turn_fails_its_rung(tmp_path: Path) -> None:
    d = make_fixture(tmp_path / "f")
    assert (d / "fixture.txt").exists() and (d / "checker.py").exists()
    rung = Rung(2, [Sample(2, 0, 1.0, 0.1, 0.0, True), Sample(2, 0, 1.0, 0.1, 0.0, False, "marker not recalled")])
    assert not rung.ok and rung.stat("cold", 0.5) == 1.0
