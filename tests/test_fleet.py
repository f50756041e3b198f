"""Batches and guardrails, on real opencode against the loopback model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shoal
from conftest import leftovers, stray
from shoal import journal
from shoal.loopback import INPUT_TOKENS, OUTPUT_TOKENS, LoopbackModel
from shoal.prices import PRICES

BACKEND = "opencode"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv("SHOAL_RUNS", str(d))
    return d


def tag() -> str:
    return f"t{time.time_ns()}"


def test_answers_come_back_in_the_order_asked(workdir: Path, runs: Path) -> None:
    with shoal.Agent(BACKEND) as agent:
        replies = agent.batch(["#! sleep 2\n#! say first", "#! say second", "#! sleep 1\n#! say third"], workdir)
    assert [r.text for r in replies] == ["first", "second", "third"]
    assert [r.task for r in replies] == ["unit-0", "unit-1", "unit-2"]
    run = journal.read(base=runs)  # a batch is a run of its own, each unit a branch under it
    assert run.roots[0].flow == "batch" and sorted(c.flow for c in run.roots[0].children) == [
        "unit unit-0", "unit unit-1", "unit unit-2"]
    assert leftovers(agent.id) == []


def test_limit_is_never_exceeded_and_every_prompt_lands(workdir: Path) -> None:
    peak = [0]

    def on_update(units: list[shoal.fleet.Unit]) -> None:
        peak[0] = max(peak[0], sum(u.status in ("working", "checking") for u in units))

    with shoal.Agent(BACKEND) as agent:
        replies = agent.batch([f"#! sleep 0.5\n#! say {i}" for i in range(4)], workdir, limit=2, on_update=on_update)
    assert [r.text for r in replies] == ["0", "1", "2", "3"]
    assert peak[0] == 2


def test_first_failure_is_raised_only_once_every_turn_landed(workdir: Path) -> None:
    with shoal.Agent(BACKEND) as agent:
        prompts = ["#! say fine", "#! fail 401", "#! sleep 3\n#! write slow.txt landed"]
        with pytest.raises(shoal.ProviderError):
            agent.batch(prompts, workdir)
        assert (workdir / "slow.txt").read_text().strip() == "landed"  # it was waited for


def test_suppress_returns_failures_in_their_place(workdir: Path) -> None:
    with shoal.Agent(BACKEND) as agent:
        out = agent.batch([("a", "#! say A"), ("b", "#! fail 401"), ("c", "#! say C")], workdir, suppress=True)
    assert isinstance(out[0], shoal.Reply) and out[0].text == "A" and out[0].task == "a"
    assert isinstance(out[1], shoal.ProviderError)
    assert isinstance(out[2], shoal.Reply) and out[2].text == "C"


def test_being_stopped_is_not_suppressed_and_leaves_no_process(workdir: Path, loopback: LoopbackModel) -> None:
    mark = tag()

    async def main() -> None:
        async with shoal.Agent(BACKEND) as agent:
            task = asyncio.create_task(
                agent.abatch([f"{mark}-{i}\n#! run sleep 30" for i in range(2)], workdir, suppress=True))
            while sum(mark in r.prompt for r in list(loopback.requests)) < 2:
                await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stray(agent) == []  # every turn's processes are gone; a held server may stay
        assert leftovers(agent.id) == []  # and nothing at all once the agent is closed

    asyncio.run(main())


def test_a_failed_canary_starts_nothing_else(workdir: Path, loopback: LoopbackModel) -> None:
    mark = tag()
    with shoal.Agent(BACKEND) as agent, pytest.raises(shoal.CanaryFailed) as info:
        agent.batch([f"{mark}-0\n#! fail 401", f"{mark}-1\n#! say no", f"{mark}-2\n#! say no"], workdir,
                    canary=True, suppress=True)
    assert "2" in str(info.value)
    assert {r.prompt.split("\n")[0] for r in loopback.requests if mark in r.prompt} == {f"{mark}-0"}


def test_check_pass_fail_and_retry(tmp_path: Path) -> None:
    dirs = [tmp_path / f"u{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    check = "test -f done.txt && cat done.txt"
    with shoal.Agent(BACKEND) as agent:
        out = agent.batch(["#! write done.txt at once", "#! say nothing done"], lambda i, task: dirs[i],
                          check=check, retries=1, retry_directives="#! write done.txt on retry")
        assert [r.tries for r in out] == [1, 2]
        assert all(r.check is not None and r.check.passed for r in out)
        assert out[0].check.output.strip() == "at once" and out[1].check.output.strip() == "on retry"
        assert out[1].usage.input_tokens == 3 * INPUT_TOKENS  # both tries are counted to the unit
        failed = agent.batch(["#! say nothing"], dirs[2], check=check, suppress=True)
    assert isinstance(failed[0], shoal.CheckFailed) and not isinstance(failed[0], shoal.Stuck)
    assert failed[0].check.exit_code == 1 and failed[0].tries == 1  # type: ignore[union-attr]


def test_a_unit_failing_the_same_way_twice_is_stopped(workdir: Path) -> None:
    with shoal.Agent(BACKEND) as agent:
        out = agent.batch(["#! say trying"], workdir, check="test -f never.txt", retries=5, suppress=True)
    assert isinstance(out[0], shoal.Stuck) and out[0].tries == 2  # not 6


def test_cost_sums_are_the_loopback_models_fixed_usage(workdir: Path) -> None:
    units: list[shoal.fleet.Unit] = []

    def keep(latest: list[shoal.fleet.Unit]) -> None:
        units[:] = latest

    with shoal.Agent(BACKEND) as agent:
        replies = agent.batch([f"#! say {i}" for i in range(3)], workdir, on_update=keep)
    price = PRICES["loopback"]
    one = (INPUT_TOKENS * price.input + OUTPUT_TOKENS * price.output) / 1e6
    assert [r.usage.cost for r in replies] == pytest.approx([one] * 3)
    assert sum(u.usage.cost for u in units) == pytest.approx(3 * one)


def test_cost_cap_stops_starting_new_units(workdir: Path) -> None:
    with shoal.Agent(BACKEND) as agent:
        out = agent.batch(["#! say a", "#! say b", "#! say c"], workdir, limit=1, cost_cap=0.001, suppress=True)
    assert isinstance(out[0], shoal.Reply)
    assert all(isinstance(o, shoal.NotStarted) for o in out[1:])


def test_bad_input_starts_nothing(workdir: Path) -> None:
    with shoal.Agent(BACKEND) as agent:
        with pytest.raises(shoal.BadSetting, match="not found on PATH"):
            agent.batch(["#! say x"], workdir, check="no-such-checker --all")
        with pytest.raises(shoal.BadSetting, match="limit"):
            agent.batch(["#! say x"], workdir, limit=0)
        assert agent.sessions == []


def shoal_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal.cli.main", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_shoal_batch_command_with_copies(tmp_path: Path, runs: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "README").write_text("sample\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"task": f"t{i}", "prompt": f"#! write out{i}.txt {i}"}) for i in range(2)))
    scratch = tmp_path / "tmp"  # where the copies go: kept ones go with the test's own directory
    scratch.mkdir()
    out = shoal_cli("batch", str(prompts), "--copies", str(project), "--check", "ls out*.txt", cwd=tmp_path,
                    env={"TMPDIR": str(scratch)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed, 0 failed" in out.stdout and "out0.txt" in out.stdout and "t1" in out.stdout
    assert "kept copy" in out.stdout  # copies holding work are kept and said so
    kept = sorted(scratch.glob("shoal-copy-project-*"))
    assert len(kept) == 2 and sorted(p.name for d in kept for p in d.glob("out*.txt")) == ["out0.txt", "out1.txt"]


def test_shoal_batch_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = shoal_cli("batch", str(empty), cwd=tmp_path)
    assert out.returncode != 0 and "no prompts" in out.stderr
    out = shoal_cli("batch", str(tmp_path / "missing.txt"), cwd=tmp_path)
    assert out.returncode != 0 and "cannot read" in out.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text("#! say hi\n")
    out = shoal_cli("batch", str(prompts), "--worktrees", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and ("not a git repository" in out.stderr or "not available" in out.stderr)
    out = shoal_cli("batch", str(prompts), "--check", "no-such-checker", cwd=tmp_path)
    assert out.returncode != 0 and "not found on PATH" in out.stderr


def test_shoal_batch_command_with_a_worktree_apiece(tmp_path: Path, runs: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (repo / "app.py").write_text("VALUE = 1\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"task": f"fix-{i}", "prompt": f"#! write app.py VALUE = {i + 2}"})
                                 for i in range(2)))
    out = shoal_cli("batch", str(prompts), "--worktrees", str(repo), "--check", "grep -q VALUE app.py", cwd=tmp_path,
                    env={"SHOAL_HOME": str(tmp_path / "state")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed, 0 failed" in out.stdout
    assert "shoal/fix-0" in out.stdout and "shoal/fix-1" in out.stdout  # branches named after the tasks
    assert "1 file changed" in out.stdout  # the diff stat for review
    for i in range(2):  # the work stays on its branch's worktree, kept and said so
        kept = repo / ".shoal" / "worktrees" / f"fix-{i}" / "app.py"
        assert kept.read_text().strip() == f"VALUE = {i + 2}"
    assert "kept worktree" in out.stdout
