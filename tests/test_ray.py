"""Sessions hosted on a real Ray cluster: a head and a second node, both on this machine.

The cluster is started by the tests (`ray start --head` on 127.0.0.2, a second node on
127.0.0.3: two loopback addresses, so the nodes are told apart by address as on a real
cluster, and no traffic leaves the loopback), with custom resources "head" and "node2" to
place sessions by. Real codex turns against the loopback model, which runs in this process
on 127.0.0.1 and which the actors reach from their nodes.

Every test checks that the agent left no process behind (`leftovers`, which scans /proc for
the agent's tag: CLI processes on every node of this machine).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shoal
from conftest import leftovers, stray, wait_for_request
from shoal.loopback import LoopbackModel

HEAD_IP, NODE2_IP = "127.0.0.2", "127.0.0.3"
BACKEND = "codex"  # the fastest CLI here: each turn is a real one, a fraction of a second


def test_importing_shoal_does_not_import_ray() -> None:
    code = "import sys, shoal; shoal.Ray(); sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_without_ray_the_agent_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import shoal.hosts.ray

    monkeypatch.setattr(shoal.hosts.ray, "installed", lambda: False)
    with pytest.raises(shoal.HostError, match=r"shoal\[ray\]"):
        shoal.Agent(BACKEND, hosts=shoal.Ray())


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    from shoal.hosts.local_cluster import LocalCluster

    state = Path(tempfile.mkdtemp(prefix="shoal-ray-state-"))
    env = pytest.MonkeyPatch()
    # shoal's state (agents' homes, the places registry, kept patches) in a directory of the
    # test's own, here and on the nodes, which inherit it from `ray start`
    env.setenv("SHOAL_HOME", str(state))
    local = LocalCluster([{"head": 4}, {"node2": 4}], env={"SHOAL_HOME": str(state)})
    try:
        local.start()
        ray.init(address=local.address, namespace="shoal", log_to_driver=False, logging_level="WARNING")
        local.wait_for_nodes(2)
        yield {"address": local.address, "nodes": local.node_ids(), "ray": ray, "client_port": local.client_port}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        local.stop()
        env.undo()
        shutil.rmtree(state, ignore_errors=True)


def hosted(cluster: dict[str, Any], **host: Any) -> shoal.Agent:
    host.setdefault("num_cpus", 0.25)  # a codex turn is light; four sessions fit on a 2-CPU node
    return shoal.Agent(BACKEND, hosts=shoal.Ray(address=cluster["address"], **host))


def kill(ray: Any, actor: Any) -> None:
    """ray.kill, and wait until the actor is dead (the kill itself is asynchronous)."""
    ray.kill(actor, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(actor.ready.remote(), timeout=60)
            time.sleep(0.1)


def git(cwd: Path, *argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    return path


# --- placement, streaming, the answers ---------------------------------------------------------


def test_sessions_land_on_the_nodes_their_resources_name(cluster: dict[str, Any], tmp_path: Path) -> None:
    on_head, on_node2 = hosted(cluster, resources={"head": 1}), hosted(cluster, resources={"node2": 1})
    try:
        for agent, ip in ((on_head, HEAD_IP), (on_node2, NODE2_IP)):
            work = tmp_path / ip
            work.mkdir()
            s = agent.session(where=work)
            r = s.run("remember: pelican\n#! write notes/a.txt hello from ray\n#! run cat notes/a.txt")
            assert s.place.where["ip"] == ip and s.place.where["node_id"] == cluster["nodes"][ip]
            assert (work / "notes" / "a.txt").read_text().strip() == "hello from ray"
            assert r.text == "ok" and r.session_id == s.session_id
            assert any("hello from ray" in t.output for t in r.tool_calls)
            assert r.usage.input_tokens > 0 and r.usage.cost > 0  # usage came back, priced here
            assert "pelican" in s.run("#! recall").text
            assert f"ray node {ip}" in s.place.describe()
    finally:
        on_head.close()
        on_node2.close()
    assert leftovers(on_head.id) == [] and leftovers(on_node2.id) == []


def test_opencode_too(cluster: dict[str, Any], workdir: Path) -> None:
    with shoal.Agent("opencode", hosts=shoal.Ray(address=cluster["address"], num_cpus=0,
                                                 resources={"node2": 1})) as agent:
        s = agent.session(where=workdir)
        r = s.run("remember: kestrel\n#! write a.txt from opencode on node2\n#! run cat a.txt")
        assert s.place.where["ip"] == NODE2_IP and r.text == "ok" and r.usage.cost > 0
        assert (workdir / "a.txt").read_text().strip() == "from opencode on node2"
        assert "kestrel" in s.run("#! recall").text
        assert stray(agent) == []  # its server is held by design, on the node; nothing else is left
    assert leftovers(agent.id) == []


def test_many_sessions_at_once_spread_over_both_nodes(cluster: dict[str, Any], tmp_path: Path) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()

    async def main(agent: shoal.Agent) -> tuple[list[shoal.Reply], set[str]]:
        sessions = [agent.session(where=d) for d in dirs]
        replies = await asyncio.gather(*(s.arun(f"#! write out.txt {i}\n#! say done {i}")
                                         for i, s in enumerate(sessions)))
        return replies, {s.place.where["ip"] for s in sessions}

    with hosted(cluster, strategy="SPREAD") as agent:
        replies, ips = asyncio.run(main(agent))
    assert [r.text for r in replies] == [f"done {i}" for i in range(4)]
    assert [(d / "out.txt").read_text().strip() for d in dirs] == ["0", "1", "2", "3"]
    assert ips == {HEAD_IP, NODE2_IP}
    assert leftovers(agent.id) == []


def test_events_stream_back_and_errors_keep_their_names(cluster: dict[str, Any], workdir: Path) -> None:
    with hosted(cluster) as agent:
        s = agent.session(where=workdir)
        items = list(s.stream("#! run echo streamed\n#! say fin"))
        assert isinstance(items[-1], shoal.Reply) and items[-1].text == "fin"
        assert any(isinstance(i, shoal.Started) for i in items)
        assert any(isinstance(i, shoal.ToolFinished) and "streamed" in i.output for i in items)
        with pytest.raises(shoal.ProviderError) as info:
            s.run("#! fail 401")
        assert info.value.status == 401 or "401" in str(info.value)  # the error's own fields came back
        assert s.run("#! say recovered").text == "recovered"
        nowhere = agent.session(where=shoal.Worktree(workdir, task="x"))  # checked on the node, not here
        with pytest.raises(shoal.NotAGitRepo):
            nowhere.run("#! say never")
    assert leftovers(agent.id) == []


def test_a_driver_through_ray_client(cluster: dict[str, Any], workdir: Path) -> None:
    # another process: this one is connected to the cluster directly already
    code = f"""if True:
        import shoal
        host = shoal.Ray(address="ray://{HEAD_IP}:{cluster['client_port']}", num_cpus=0, resources={{"node2": 1}})
        with shoal.Agent("{BACKEND}", hosts=host) as agent:
            s = agent.session(where="{workdir}")
            r = s.run("remember: wren\\n#! run echo through the client")
            print(r.text, s.place.where["ip"], r.tool_calls[-1].output.strip())
            print(s.run("#! recall").text)
            print(agent.id)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert lines[:2] == [f"ok {NODE2_IP} through the client", "recalled: wren"], (lines, out.stderr[-3000:])
    assert leftovers(lines[2]) == []


def test_a_node_that_cannot_take_the_session_is_named(cluster: dict[str, Any], workdir: Path) -> None:
    with hosted(cluster, resources={"gpu-node": 1}, start_timeout=3) as agent, \
            pytest.raises(shoal.HostError, match="no Ray node took"):
        agent.session(where=workdir).run("#! say never")
    assert leftovers(agent.id) == []


# --- cancel and faults -------------------------------------------------------------------------


def test_cancelling_a_turn_stops_the_remote_cli(cluster: dict[str, Any], workdir: Path,
                                                loopback: LoopbackModel) -> None:
    tag = f"ray-cancel-{time.time_ns()}"

    async def main() -> str:
        async with hosted(cluster, resources={"node2": 1}) as agent:
            s = agent.session(where=workdir)
            task = asyncio.create_task(s.arun(f"{tag}\n#! run sleep 30 && echo late > late.txt"))
            await asyncio.to_thread(wait_for_request, loopback, tag)
            await asyncio.sleep(0.5)  # the sleep command is running now, under the CLI on node2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stray(agent) == []
            with pytest.raises(shoal.TurnTimeout):  # a turn timed out here stops over there too
                await s.arun("#! run sleep 30", timeout=3)
            assert stray(agent) == []
            text = (await s.arun("#! say still here")).text
        assert leftovers(agent.id) == []
        return text

    assert asyncio.run(main()) == "still here"
    assert not (workdir / "late.txt").exists()


def test_an_actor_killed_mid_turn_is_host_lost_and_the_next_turn_resumes(
        cluster: dict[str, Any], tmp_path: Path, loopback: LoopbackModel) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "README.md").write_text("the source\n")
    tag = f"ray-kill-{time.time_ns()}"
    with hosted(cluster) as agent:
        s = agent.session(where=shoal.Copy(source, root=tmp_path / "copies"))
        s.run("remember: heron\n#! write notes.txt kept across nodes")
        first_copy, lost, scratch = s.cwd, s.place.actor, Path(s.place.where["scratch"])
        assert "notes.txt" in s.place.patch  # the work so far is here, not only on the node

        def kill_mid_turn() -> None:
            wait_for_request(loopback, tag)
            time.sleep(0.3)
            cluster["ray"].kill(lost, no_restart=True)

        threading.Thread(target=kill_mid_turn, daemon=True).start()
        with pytest.raises(shoal.HostLost, match="died"):
            s.run(f"{tag}\n#! run sleep 20")
        assert leftovers(agent.id, settle=10) == []  # the reaper took the dead actor's CLI with it
        deadline = time.monotonic() + 10
        while scratch.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not scratch.exists()  # and its scratch directory
        r = s.run("#! run cat notes.txt\n#! recall")
        assert "heron" in r.text  # the conversation was resumed from the agent's home
        assert any("kept across nodes" in t.output for t in r.tool_calls)  # the place, restored
        assert any(isinstance(e, shoal.Notice) and e.kind == "host" for e in r.events)
        assert s.cwd != first_copy and s.place.moves == 1
        assert not (source / "notes.txt").exists()
        kill(cluster["ray"], s.place.actor)  # lost between turns: the next turn just moves
        r = s.run("#! recall")
        assert "heron" in r.text and s.place.moves == 2
        assert any(isinstance(e, shoal.Notice) and e.kind == "host" for e in r.events)
        notes = agent.close()
    assert any("kept as a patch" in n for n in notes)
    assert leftovers(agent.id) == []


def test_a_node_without_the_conversation_says_why(cluster: dict[str, Any], workdir: Path) -> None:
    with hosted(cluster) as agent:
        s = agent.session(where=workdir)
        s.run("remember: ibis")
        # as if the fresh actor landed on a machine that does not share the agent's home
        marks = agent.settings.home / ".shoal-hosts"
        shutil.rmtree(marks)
        kill(cluster["ray"], s.place.actor)
        with pytest.raises(shoal.HostLost, match="cannot resume"):
            s.run("#! recall")
        r = s.run("#! recall")  # a new conversation in the same place
        assert "ibis" not in r.text and r.text
    assert leftovers(agent.id) == []


# --- places on nodes, and the end ----------------------------------------------------------------


def test_copies_and_worktrees_come_back_as_patches_and_branches(cluster: dict[str, Any], tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    remote = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    with hosted(cluster, resources={"node2": 1}, push=str(remote)) as agent:
        wt = agent.session(where=shoal.Worktree(repo, task="hosted-fix"))
        cp = agent.session(where=shoal.Copy(repo, root=tmp_path / "copies"))
        wt.run("#! write fix.txt fixed on node2")
        cp.run("#! write copy.txt copied on node2")
        assert str(repo / ".shoal" / "worktrees") in str(wt.cwd)
        assert wt.close() and cp.close()
    for s, name, text in ((wt, "fix.txt", "fixed on node2"), (cp, "copy.txt", "copied on node2")):
        place = s.place
        assert place.saved is not None and name in place.saved.read_text()
        assert place.pushed is not None
        branch = place.pushed.split()[0]
        assert git(remote, "show", f"{branch}:{name}").strip() == text
        place.saved.unlink()
    assert git(remote, "branch", "--list", "shoal/hosted-fix").strip()
    assert not (repo / "fix.txt").exists() and not (repo / "copy.txt").exists()
    assert leftovers(agent.id) == []


def test_a_push_that_fails_keeps_the_work(cluster: dict[str, Any], tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with hosted(cluster, push=str(tmp_path / "no-such-remote.git")) as agent:
        s = agent.session(where=shoal.Worktree(repo, task="unpushed"))
        s.run("#! write work.txt not lost")
        note = s.close() or ""
    assert "could not push" in note and "kept worktree" in note and "kept as a patch" in note
    assert s.place.saved is not None and "work.txt" in s.place.saved.read_text()
    assert leftovers(agent.id) == []


def test_no_actor_outlives_its_agent(cluster: dict[str, Any], tmp_path: Path) -> None:
    ray = cluster["ray"]
    agent = hosted(cluster, strategy="SPREAD")
    for i in range(3):
        d = tmp_path / f"s{i}"
        d.mkdir()
        agent.session(where=d).run("#! say hi")
    agent.session(where=tmp_path)  # never started: no actor at all
    actors = list(agent.backend.actors)
    assert len(actors) == 3
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert sum(n.startswith(f"shoal-{agent.id}") for n in names) == 3
    agent.close()
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not any(n.startswith(f"shoal-{agent.id}") for n in names)
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ready.remote(), timeout=60)
    assert leftovers(agent.id) == []
