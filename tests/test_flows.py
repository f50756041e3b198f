"""Flows: branches, the tree a run reads back as, depth, budgets, deadlines, stops, loading."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import shoal
from conftest import BACKENDS, leftovers, stray
from shoal import journal, perfetto


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv("SHOAL_RUNS", str(d))
    return d


@shoal.flow
async def leaf(task: str, agent: shoal.Agent, where: Path) -> list[str]:
    sessions = [agent.session(where=where, name=f"{task}-{i}") for i in range(4)]
    replies = await asyncio.gather(*(s.arun(f"#! say {task}-{i}") for i, s in enumerate(sessions)))
    return [r.text for r in replies]


@shoal.flow
async def fan(task: str, agent: shoal.Agent, where: Path) -> list[list[str]]:
    return await asyncio.gather(*(leaf(f"{task}{k}", agent, where) for k in "abc"))


def test_a_flow_of_flows_reads_back_as_the_tree_it_ran_as(runs: Path, workdir: Path) -> None:
    with shoal.Agent("codex" if "codex" in BACKENDS else "opencode") as agent:  # the quickest at hand
        out = shoal.run(fan, "t", agent, workdir)
    assert out == [[f"t{k}-{i}" for i in range(4)] for k in "abc"]
    run = journal.read(base=runs)
    assert run.status == "ok" and len(run.roots) == 1
    root = run.roots[0]
    assert root.flow == "fan" and root.status == "ok" and root.sessions == []
    assert sorted(c.flow for c in root.children) == ["leaf"] * 3
    for child in root.children:
        assert child.children == [] and len(child.sessions) == 4
        assert all(len(s.turns) == 1 and s.turns[0].status == "ok" for s in child.sessions)
    names = {s.name for c in root.children for s in c.sessions}
    assert names == {f"t{k}-{i}" for k in "abc" for i in range(4)}
    assert root.tokens == sum(c.tokens for c in root.children) > 0
    assert run.cost == pytest.approx(sum(s.cost for s in run.all_sessions()))
    assert leftovers(agent.id) == []


def test_siblings_do_not_see_each_other_and_branch_sessions_close_with_the_branch(runs: Path, workdir: Path) -> None:
    seen: dict[str, object] = {}

    @shoal.flow
    async def child(tag: str, agent: shoal.Agent) -> None:
        me = shoal.current()
        assert me is not None
        agent.session(where=workdir, name=tag)
        await asyncio.sleep(0.05)
        seen[tag] = (me.id, me.flow, me.depth, [s.name for s in me.sessions])

    @shoal.flow
    async def parent(agent: shoal.Agent) -> None:
        mine = agent.session(where=workdir, name="parent's")
        await asyncio.gather(child("x", agent), child("y", agent))
        assert not mine.closed  # the children's ends did not touch the caller's session
        seen["parent"] = shoal.current().depth  # type: ignore[union-attr]

    with shoal.Agent("opencode") as agent:
        shoal.run(parent, agent)
        assert [s.closed for s in agent.sessions] == [True, True, True]  # each closed by its own branch
    x, y = seen["x"], seen["y"]
    assert x[0] != y[0] and x[2] == y[2] == 2 and seen["parent"] == 1  # type: ignore[index]
    assert x[3] == ["x"] and y[3] == ["y"]  # type: ignore[index]
    assert shoal.current() is None


def test_clone_gives_a_branch_an_agent_of_its_own() -> None:
    with shoal.Agent("opencode") as agent:
        mine = agent.clone(name="reviewer")
        assert mine.id != agent.id and mine.sessions == [] and mine.settings.backend == "opencode"
        mine.close()


def test_depth_64_passes_and_65_is_named(runs: Path) -> None:
    @shoal.flow
    async def dive(n: int) -> int:
        return n if n == 1 else await dive(n - 1)

    assert shoal.run(dive, 64) == 1
    with pytest.raises(shoal.FlowDepthExceeded) as info:
        shoal.run(dive, 65)
    assert "dive" in str(info.value) and "64" in str(info.value)
    assert not isinstance(info.value, RecursionError)


def test_budget_exceeded_in_a_grandchild_is_charged_to_every_ancestor(runs: Path, workdir: Path) -> None:
    spent: dict[str, float] = {}

    @shoal.flow
    async def grandchild(agent: shoal.Agent) -> None:
        s = agent.session(where=workdir)
        await s.arun("#! say one")  # one model call: 0.0012 $ at the loopback price
        await s.arun("#! say two")  # passes the budget: raises
        await s.arun("#! say never")

    @shoal.flow
    async def child(agent: shoal.Agent) -> None:
        try:
            await grandchild.options(budget=shoal.Budget(cost=0.002))(agent)
        finally:
            spent["child"] = shoal.current().spent.cost  # type: ignore[union-attr]

    @shoal.flow
    async def top(agent: shoal.Agent) -> None:
        try:
            await child(agent)
        finally:
            spent["top"] = shoal.current().spent.cost  # type: ignore[union-attr]

    with shoal.Agent("opencode") as agent, pytest.raises(shoal.BudgetExceeded) as info:
        shoal.run(top, agent)
    assert info.value.kind == "cost" and info.value.flow == "grandchild"
    assert spent["child"] == spent["top"] == pytest.approx(0.0024)
    run = journal.read(base=runs)
    gc = run.roots[0].children[0].children[0]
    assert gc.flow == "grandchild" and gc.status == "over_budget"
    assert [t.prompt for s in gc.sessions for t in s.turns] == ["#! say one", "#! say two"]
    assert run.roots[0].status == "over_budget" and run.status == "over_budget"


def test_a_deadline_above_cancels_running_turns_and_their_clis(runs: Path, workdir: Path) -> None:
    @shoal.flow
    async def slow(agent: shoal.Agent, i: int) -> None:
        await agent.session(where=workdir).arun(f"#! run sleep 30 # {i}")

    @shoal.flow
    async def boss(agent: shoal.Agent) -> None:
        await asyncio.gather(*(slow(agent, i) for i in range(2)))

    with shoal.Agent("opencode") as agent:
        t0 = time.monotonic()
        with pytest.raises(shoal.BudgetExceeded) as info:
            shoal.run(boss.options(timeout=6), agent)
        assert time.monotonic() - t0 < 25  # it did not wait for the sleeps
        assert info.value.kind == "seconds"
        assert stray(agent) == []
    run = journal.read(base=runs)
    assert [c.status for c in run.roots[0].children] == ["stopped", "stopped"]
    assert all(t.status == "stopped" for s in run.all_sessions() for t in s.turns)


def test_a_taskgroup_losing_a_branch_cancels_the_rest(runs: Path, workdir: Path) -> None:
    class Broken(Exception):
        pass

    @shoal.flow
    async def breaks() -> None:
        await asyncio.sleep(0.5)
        raise Broken("boom")

    @shoal.flow
    async def waits(agent: shoal.Agent) -> None:
        await agent.session(where=workdir).arun("#! run sleep 30")

    @shoal.flow
    async def group(agent: shoal.Agent) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(breaks())
            tg.create_task(waits(agent))

    with shoal.Agent("opencode") as agent:
        try:
            shoal.run(group, agent)
        except* Broken as eg:
            assert [type(e) for e in eg.exceptions] == [Broken]
        assert stray(agent) == []
    statuses = {c.flow: c.status for c in journal.read(base=runs).roots[0].children}
    assert statuses == {"breaks": "failed", "waits": "stopped"}


FLOW_FILE = """
import asyncio
import shoal

@shoal.flow
async def main(task, coder):
    s = coder.session(where={where!r})
    await s.arun("#! say first " + task)
    print("STARTED", flush=True)
    await asyncio.sleep(60)
"""


def _start_run(tmp_path: Path, workdir: Path, runs: Path) -> subprocess.Popen[str]:
    flow_file = tmp_path / "flowfile.py"
    flow_file.write_text(FLOW_FILE.format(where=str(workdir)))
    env = {**os.environ, "SHOAL_RUNS": str(runs)}
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "run", str(flow_file), "go",
                             "-a", "coder=opencode/loopback"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "STARTED" in line, line
    return proc


def test_sigterm_stops_a_run_which_reads_as_stopped(tmp_path: Path, workdir: Path, runs: Path) -> None:
    proc = _start_run(tmp_path, workdir, runs)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    run = journal.read(base=runs)
    assert run.status == "stopped" and run.roots[0].status == "stopped"
    assert run.roots[0].sessions[0].turns[0].status == "ok"


def test_sigkill_leaves_a_journal_that_reads_back(tmp_path: Path, workdir: Path, runs: Path) -> None:
    proc = _start_run(tmp_path, workdir, runs)
    proc.kill()
    proc.wait(timeout=30)
    path = journal.find(base=runs) / "journal.jsonl"
    with open(path, "a") as f:
        f.write('{"t": 1, "kind": "turn.be')  # a torn last line, as a kill mid-write leaves
    run = journal.read(base=runs)
    assert run.status == "unfinished" and run.roots[0].status == "running"
    assert run.roots[0].sessions[0].turns[0].status == "ok"


def test_trace_prints_the_tree_and_exports_perfetto(tmp_path: Path, runs: Path, workdir: Path) -> None:
    with shoal.Agent("opencode") as agent:
        shoal.run(fan.options(name="fanout"), "p", agent, workdir)
    out = subprocess.run([sys.executable, "-m", "shoal.cli.main", "trace", "--perfetto", str(tmp_path / "t.json")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "SHOAL_RUNS": str(runs),
                                                                          "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "flow fanout" in out.stdout and out.stdout.count("flow leaf") == 3 and out.stdout.count("turn 1") == 12
    assert out.stdout.count("log logs/opencode.db") == 12  # every session links the agent's kept database
    data = json.loads((tmp_path / "t.json").read_text())
    evs = data["traceEvents"]
    assert all({"ph", "pid", "tid", "name"} <= set(e) for e in evs)
    slices = [e for e in evs if e["ph"] == "X"]
    assert all(isinstance(e["ts"], int) and e["dur"] >= 0 for e in slices)
    turns = [e for e in slices if e["cat"] == "turn"]
    assert len(turns) == 12 and len({e["tid"] for e in turns}) == 12  # one track per session
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sum(n.startswith("session ") for n in names) == 12
    assert perfetto.events(journal.read(base=runs)) == evs

    out = subprocess.run([sys.executable, "-m", "shoal.cli.main", "trace", "--json"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SHOAL_RUNS": str(runs)})
    tree = json.loads(out.stdout)  # one JSON document, nothing else on stdout
    (root,) = tree["calls"]
    assert root["flow"] == "fanout" and [c["flow"] for c in root["calls"]] == ["leaf"] * 3
    assert [len(c["sessions"]) for c in root["calls"]] == [4, 4, 4]
    assert all(s["turns"][0]["status"] == "ok" and s["log"] for c in root["calls"] for s in c["sessions"])
    assert tree["tokens"] == root["tokens"] == sum(c["tokens"] for c in root["calls"]) > 0


def test_trace_of_a_run_that_is_not_there_says_so(tmp_path: Path, runs: Path) -> None:
    env = {**os.environ, "SHOAL_RUNS": str(runs)}
    for args, said in ((["trace"], "no runs under"), (["trace", "nosuch"], "no run 'nosuch'"),
                       (["trace", str(tmp_path)], "not a shoal run directory")):
        out = subprocess.run([sys.executable, "-m", "shoal.cli.main", *args], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
    with pytest.raises(shoal.RunNotFound):
        journal.read(base=runs)


def test_flow_files_that_are_wrong_say_where(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import shoal\n\nx = (\n")
    with pytest.raises(shoal.FlowError) as info:
        shoal.load(broken)
    assert f"{broken}:3" in str(info.value)

    raises = tmp_path / "raises.py"
    raises.write_text("import shoal\n\n\nraise RuntimeError('nope')\n")
    with pytest.raises(shoal.FlowError) as info:
        shoal.load(raises)
    assert f"{raises}:4" in str(info.value) and "nope" in str(info.value)

    plain = tmp_path / "plain.py"
    plain.write_text(textwrap.dedent("""
        import shoal

        def main(task):
            return task
    """))
    with pytest.raises(shoal.FlowError) as info:
        shoal.load(plain)
    assert f"{plain}:4" in str(info.value) and "async" in str(info.value)

    good = tmp_path / "good.py"
    good.write_text("import shoal\n\n@shoal.flow\nasync def hello(task):\n    return 'hi ' + task\n")
    with pytest.raises(shoal.FlowError) as info:
        shoal.load(f"{good}:nothing")
    assert "nothing" in str(info.value) and "hello" in str(info.value)
    with pytest.raises(shoal.FlowError):
        shoal.load("no_such_module_anywhere:flow")
    with pytest.raises(shoal.FlowError) as info:
        shoal.flow(lambda: None)
    assert "not an `async def`" in str(info.value)


def test_wrong_arguments_are_named_at_the_call_before_anything_runs(tmp_path: Path, runs: Path) -> None:
    with pytest.raises(shoal.FlowArguments) as info:
        fan("t")  # `agent` and `where` missing: said at the call, as a plain function would
    assert "'fan'" in str(info.value) and "test_flows.py" in str(info.value)
    assert info.value.missing == ["agent", "where"] and isinstance(info.value, TypeError)
    with pytest.raises(shoal.FlowArguments, match="unexpected keyword argument 'colour'"):
        shoal.run(fan, "t", None, None, colour="red")
    assert not runs.exists()  # no run began

    flow_file = tmp_path / "needs.py"
    flow_file.write_text("import shoal\n\n@shoal.flow\nasync def main(task, coder, reviewer):\n    return task\n")
    out = subprocess.run([sys.executable, "-m", "shoal.cli.main", "run", str(flow_file), "go", "-a", "coder=opencode"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "SHOAL_RUNS": str(runs)})
    assert out.returncode == 2, out.stderr
    assert f"{flow_file}:3" in out.stderr and "pass -a reviewer=BACKEND/MODEL" in out.stderr
    assert "Traceback" not in out.stderr and "journal:" not in out.stderr
    assert not runs.exists()


def test_load_by_file_package_and_module(tmp_path: Path, runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good.py").write_text("import shoal\n\n@shoal.flow\nasync def hello(task):\n    return 'hi ' + task\n")
    pkg = tmp_path / "pkgflow"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("async def main(task):\n    return 'pkg ' + task\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert shoal.run(shoal.load(tmp_path / "good.py"), "a") == "hi a"
    assert shoal.run(shoal.load(str(pkg)), "b") == "pkg b"
    assert shoal.run("good:hello", "c") == "hi c"


@shoal.flow
async def two_talks(agent: shoal.Agent, where: Path) -> list[tuple[str, bool, bool]]:
    """Two sessions, a turn each; what the run's record links to while they are still open."""
    talks = [agent.session(where=where, name=f"talk{i}") for i in range(2)]
    await asyncio.gather(*(s.arun(f"#! say remembered-{i}") for i, s in enumerate(talks)))
    branch = shoal.current()
    assert branch is not None
    live = journal.read(branch.run_dir).all_sessions()
    return [(str(n.log), n.log is not None and n.log.is_symlink(), n.log is not None and n.log.exists())
            for n in sorted(live, key=lambda n: n.name)]


@pytest.mark.parametrize("name", [b for b in BACKENDS if ":" not in b])
def test_session_record_links_the_backends_own_log_kept_after_the_agent_closes(
        name: str, runs: Path, workdir: Path) -> None:
    with shoal.Agent(name) as agent:
        live = shoal.run(two_talks, agent, workdir)
        home = agent.settings.home
    assert not home.exists()  # the agent's private home went with it...
    # ...while the run is on, the record links the CLI's live file in that home
    assert all(is_link and exists for _, is_link, exists in live), live
    run = journal.read(base=runs)
    nodes = sorted(run.all_sessions(), key=lambda n: n.name)
    assert [str(n.log) for n in nodes] == [path for path, _, _ in live]
    for i, node in enumerate(nodes):
        # ...and after it, a copy in the run's own directory that still opens
        assert node.log is not None and node.log.parent == run.dir / "logs"
        assert node.log.is_file() and not node.log.is_symlink()
        if name == "opencode":  # one database for all of an agent's sessions: opencode reads the copy
            out = subprocess.run(
                [str(Path(shoal.__file__).parents[2] / "node_modules/.bin/opencode"), "export", node.backend_session],
                capture_output=True, text=True, timeout=120, cwd=workdir,
                env={**os.environ, "OPENCODE_DB": str(node.log), "HOME": str(runs / "h"),
                     "XDG_DATA_HOME": str(runs / "h")})
            assert out.returncode == 0, out.stderr
            text = out.stdout
        else:
            text = node.log.read_text()
        assert node.backend_session in text
        assert f"remembered-{i}" in text and f"remembered-{1 - i}" not in text
    if name == "opencode":
        assert nodes[0].log == nodes[1].log  # kept once, not once per session
    else:
        assert nodes[0].log != nodes[1].log
