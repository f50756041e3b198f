"""opencode's server transport: one secured `opencode serve` holding every session of an agent.

Real opencode against the loopback model. The shared behaviour suite covers turns, streams,
cancelling and crashes on both transports; these are the server's own promises.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import shoal
from conftest import leftovers, stray
from shoal.backends import opencode_fleet
from shoal.backends.base import Conversation, Settings
from shoal.backends.opencode import OpenCode
from shoal.backends.opencode_server import Server, check_bind
from shoal.loopback import LoopbackModel
from shoal.places import Here
from shoal.reply import Notice, ToolFinished

pytestmark = pytest.mark.skipif("opencode" not in shoal.backends.REGISTRY, reason="no opencode backend")


def servers(agent: shoal.Agent) -> list[Server]:
    backend = agent.backend
    assert isinstance(backend, OpenCode) and backend.server is not None
    return backend.server.servers()


def serve_pids(agent: shoal.Agent) -> list[int]:
    """Tagged processes of this agent that are opencode servers."""
    out = []
    for pid in shoal.procs.tagged_pids(f"SHOAL_AGENT={agent.id}"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"\0serve\0" in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* spells them) listening on this port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hexport = local.rpartition(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.append(addr)
    return found


def test_eight_sessions_in_eight_directories_share_one_secured_server(tmp_path: Path) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(8)]
    for d in dirs:
        d.mkdir()

    async def main(agent: shoal.Agent) -> list[shoal.Reply]:
        sessions = [agent.session(where=d) for d in dirs]
        return await asyncio.gather(*(s.arun(f"#! run pwd > where.txt\n#! say {i}") for i, s in enumerate(sessions)))

    with shoal.Agent("opencode") as agent:
        replies = asyncio.run(main(agent))
        assert [r.text for r in replies] == [str(i) for i in range(8)]
        assert [(d / "where.txt").read_text().strip() for d in dirs] == [str(d) for d in dirs]
        assert len({r.session_id for r in replies}) == 8
        assert len(serve_pids(agent)) == 1 and len(servers(agent)) == 1
        server = servers(agent)[0]

        # always a password, even on loopback; basic auth as user `opencode`
        assert httpx.get(f"{server.url}/session", timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/session", auth=("opencode", "wrong"), timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/session", auth=("opencode", server.password), timeout=10).status_code == 200
        # and it listens on 127.0.0.1 only
        port = int(server.url.rsplit(":", 1)[1])
        assert listeners(port) == ["0100007F"]
    assert leftovers(agent.id) == []


def test_a_non_loopback_bind_needs_the_users_own_password() -> None:
    assert check_bind("127.0.0.1", False) is None and check_bind("::1", False) is None
    with pytest.raises(shoal.BadSetting, match="refusing to bind"):
        check_bind("0.0.0.0", False)
    assert "TLS" in (check_bind("0.0.0.0", True) or "")
    env = {k: v for k, v in os.environ.items() if k != "OPENCODE_SERVER_PASSWORD"}
    out = subprocess.run([sys.executable, "-m", "shoal.cli.main", "opencode", "serve", "--host", "0.0.0.0"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "refusing to bind" in out.stderr


def test_shoal_opencode_serve_prints_how_to_attach(tmp_path: Path, loopback: LoopbackModel) -> None:
    env = {**os.environ, "SHOAL_HOME": str(tmp_path / "state")}
    env.pop("OPENCODE_SERVER_PASSWORD", None)
    port = shoal.backends.opencode_server.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "opencode", "serve", "--port", str(port),
                             "--dir", str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(5)]
        text = "".join(lines)
        password = lines[0].rsplit("password ", 1)[1].rstrip(")\n")
        assert f"attach http://127.0.0.1:{port} --password {password}" in text
        assert f"ssh -N -L {port}:127.0.0.1:{port} " in text
        url = f"http://127.0.0.1:{port}/session"
        assert httpx.get(url, auth=("opencode", password), timeout=10).status_code == 200
        assert httpx.get(url, timeout=10).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert listeners(port) == []


HOLDER = """
import shoal, sys, time
agent = shoal.Agent("opencode")
agent.session(where=sys.argv[1]).run("#! say held")
print(agent.id, flush=True)
time.sleep(120)
"""


def test_a_killed_shoal_leaves_no_server_behind(workdir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    agent_id = proc.stdout.readline().strip()
    assert agent_id and shoal.procs.tagged_pids(f"SHOAL_AGENT={agent_id}")  # its server runs
    proc.kill()  # nothing of shoal runs to stop it: the kernel has to
    proc.wait(timeout=30)
    assert leftovers(agent_id, settle=10) == []


def test_cancel_aborts_the_turn_and_the_server_keeps_serving(workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"abort-{time.time_ns()}"

    async def main() -> None:
        async with shoal.Agent("opencode") as agent:
            s, other = agent.session(where=workdir), agent.session(where=workdir)
            await other.arun("#! say warm")
            before = serve_pids(agent)
            task = asyncio.create_task(s.arun(f"{tag}\n#! run sleep 30 && echo late > late.txt"))
            while not any(tag in r.prompt for r in list(loopback.requests)):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the sleep is running now, under the server
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stray(agent) == []  # the turn's command is gone...
            assert serve_pids(agent) == before  # ...and the server is the same one
            assert (await other.arun("#! say still serving")).text == "still serving"
            assert (await s.arun("#! say me too")).text == "me too"

    asyncio.run(main())
    assert not (workdir / "late.txt").exists()


def test_killed_server_is_replaced_and_the_next_turn_resumes(workdir: Path) -> None:
    with shoal.Agent("opencode") as agent:
        s = agent.session(where=workdir)
        s.run("remember: osprey\n#! say noted")
        [old] = serve_pids(agent)
        os.kill(old, signal.SIGKILL)
        r = s.run("#! recall")
        assert "osprey" in r.text
        notices = [e for e in r.events if isinstance(e, Notice)]
        assert [n.kind for n in notices] == ["restart"] and "replaced" in notices[0].message
        assert len(serve_pids(agent)) == 1 and serve_pids(agent) != [old]
    assert leftovers(agent.id) == []


def test_server_is_recycled_past_its_memory_limit(workdir: Path) -> None:
    with shoal.Agent("opencode") as agent:
        s = agent.session(where=workdir)
        s.run("remember: kestrel\n#! say noted")
        [old] = serve_pids(agent)
        backend = agent.backend
        assert isinstance(backend, OpenCode) and backend.server is not None
        backend.server.rss_limit = 1 << 20  # 1 MB: any server is past it
        r = s.run("#! recall")
        assert "kestrel" in r.text
        assert any(isinstance(e, Notice) and e.kind == "restart" and "memory" in e.message for e in r.events)
        assert len(serve_pids(agent)) == 1 and old not in serve_pids(agent)
    assert leftovers(agent.id) == []


class Tagged(Here):
    """A directory whose sessions ask for extra environment, as a container's or ssh place's
    shell does: the Place protocol's `env()`, one variable naming the place."""

    def __init__(self, path: Path, tag: str) -> None:
        super().__init__(path)
        self.tag = tag

    def env(self) -> dict[str, str]:
        return {"SHOAL_TEST_PLACE": self.tag}


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def by_place(agent: shoal.Agent) -> dict[str, int]:
    """The agent's running servers by the SHOAL_TEST_PLACE they were started with ("" for none),
    read from each process's own environment; every one of them must be held by the backend."""
    found: dict[str, int] = {}
    for pid in serve_pids(agent):
        if not running(pid):
            continue
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        tag = env.get(b"SHOAL_TEST_PLACE", b"").decode()
        assert tag not in found, f"two servers for {tag!r}"
        found[tag] = pid
    assert sorted(found.values()) == sorted(agent.backend.held_pids())  # type: ignore[attr-defined]
    assert len(servers(agent)) == len(found)
    return found


def test_a_places_own_server_stops_with_its_last_session(tmp_path: Path) -> None:
    dirs = {n: tmp_path / n for n in ("a1", "a2", "b", "plain", "plain2")}
    for d in dirs.values():
        d.mkdir()
    with shoal.Agent("opencode") as agent:
        a1, a2 = agent.session(where=Tagged(dirs["a1"], "alpha")), agent.session(where=Tagged(dirs["a2"], "alpha"))
        b, plain = agent.session(where=Tagged(dirs["b"], "beta")), agent.session(where=dirs["plain"])
        unused = agent.session(where=Tagged(dirs["b"], "gamma"))  # no turn: never reaches a server

        async def main() -> list[shoal.Reply]:
            return await asyncio.gather(*(s.arun(f"#! run echo \"[$SHOAL_TEST_PLACE]\" > tag.txt\n#! say {i}")
                                          for i, s in enumerate((a1, a2, b, plain))))

        assert [r.text for r in asyncio.run(main())] == ["0", "1", "2", "3"]
        # each command ran under the server started with its place's environment
        assert [(dirs[n] / "tag.txt").read_text().strip() for n in ("a1", "a2", "b", "plain")] == \
            ["[alpha]", "[alpha]", "[beta]", "[]"]
        pids = by_place(agent)
        assert set(pids) == {"alpha", "beta", ""} and all(running(p) for p in pids.values())

        unused.close()
        a1.close()  # a2 is still on alpha's server
        assert by_place(agent) == pids
        a2.close()  # the last session on it
        assert not running(pids["alpha"])
        assert by_place(agent) == {"beta": pids["beta"], "": pids[""]}

        plain.close()  # the shared server stays for the agent's life...
        assert running(pids[""]) and by_place(agent) == {"beta": pids["beta"], "": pids[""]}
        assert agent.session(where=dirs["plain2"]).run("#! say reused").text == "reused"
        assert by_place(agent) == {"beta": pids["beta"], "": pids[""]}  # ...and the next plain session uses it

        b.close()
        assert not running(pids["beta"]) and by_place(agent) == {"": pids[""]}
    assert leftovers(agent.id) == []


def test_a_place_server_is_let_go_where_its_session_is_now_and_a_newcomer_gets_one(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    with shoal.Agent("opencode") as agent:
        s = agent.session(where=Tagged(one, "delta"))
        s.run("remember: heron\n#! say noted")
        first = by_place(agent)["delta"]
        os.kill(first, signal.SIGKILL)
        r = s.run("#! recall")  # resumed on a fresh server: the session counts there now
        assert "heron" in r.text and any(isinstance(e, Notice) and e.kind == "restart" for e in r.events)
        second = by_place(agent)["delta"]
        assert second != first and running(second)

        newcomer = agent.session(where=Tagged(two, "delta"))

        async def race() -> str:
            # the session's close stops the server while a new session for the same environment
            # asks for one: it must get a working server (a fresh one)
            closing = asyncio.ensure_future(s.aclose())
            await asyncio.sleep(0)
            reply = await newcomer.arun("#! run echo \"[$SHOAL_TEST_PLACE]\" > tag.txt\n#! say arrived")
            await closing
            return reply.text

        assert asyncio.run(race()) == "arrived"
        assert (two / "tag.txt").read_text().strip() == "[delta]"
        third = by_place(agent)["delta"]
        assert not running(second) and running(third) and third not in (first, second)
        newcomer.close()
        assert not running(third) and by_place(agent) == {}
    assert leftovers(agent.id) == []


@pytest.mark.parametrize("transport", ["server", "run"])
def test_write_outside_the_directory_is_refused_with_a_named_event(transport: str, tmp_path: Path) -> None:
    work, allowed, outside = tmp_path / "work", tmp_path / "allowed", tmp_path / "outside"
    for d in (work, allowed, outside):
        d.mkdir()
    # "ask" is never left to wait for a human; a path pattern opens one directory, and only it
    perms = {"external_directory": "ask", f"external_directory:{allowed}/*": "allow"}
    with shoal.Agent("opencode", permissions=perms, transport=transport) as agent:
        r = agent.session(where=work).run(
            f"#! write {outside}/x.txt no\n#! write {allowed}/y.txt yes\n#! say after", timeout=120)
    assert r.text == "after"
    assert not (outside / "x.txt").exists() and (allowed / "y.txt").read_text().strip() == "yes"
    refused = [e for e in r.events if isinstance(e, ToolFinished) and not e.ok]
    assert len(refused) == 1 and str(outside) in str(refused[0].input)
    assert any(isinstance(e, Notice) and e.kind == "refused" and f"{outside}/x.txt" in e.message for e in r.events)


def test_an_ask_left_in_a_raw_config_is_refused_not_waited_on(tmp_path: Path) -> None:
    with shoal.Agent("opencode") as plain:
        config = plain.backend._config()  # type: ignore[attr-defined]
    config["permission"]["external_directory"] = "ask"  # as if the user's raw config said so
    with shoal.Agent("opencode", env={"OPENCODE_CONFIG_CONTENT": json.dumps(config)}) as agent:
        r = agent.session(where=tmp_path).run(f"#! write {tmp_path.parent}/asked.txt x\n#! say end", timeout=60)
    assert not (tmp_path.parent / "asked.txt").exists()
    assert any(isinstance(e, Notice) and e.kind == "refused" and "external_directory" in e.message
               for e in r.events)
    assert any(isinstance(e, ToolFinished) and not e.ok and "rejected" in e.output for e in r.events)


def test_a_missed_idle_is_caught_by_asking_the_server(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(opencode_fleet, "SILENCE", 1.0)
    hear = Server._dispatch

    def deaf(self: Server, msg: dict[str, Any]) -> None:  # the end of every turn goes unheard
        if (msg.get("payload") or msg).get("type") not in ("session.idle", "session.status"):
            hear(self, msg)

    monkeypatch.setattr(Server, "_dispatch", deaf)
    with shoal.Agent("opencode") as agent:
        r = agent.session(where=workdir).run("#! run echo heard\n#! say fin", timeout=60)
    assert r.text == "fin" and any(isinstance(e, ToolFinished) and "heard" in e.output for e in r.events)


def test_run_transport_retries_a_locked_database(workdir: Path) -> None:
    with shoal.Agent("opencode", transport="run") as agent:
        s = agent.session(where=workdir)
        s.run("#! say first")  # the database exists now
        path = agent.backend.env["OPENCODE_DB"]  # type: ignore[attr-defined]
        held = threading.Event()

        def hold() -> None:
            db = sqlite3.connect(path, timeout=30, isolation_level=None)
            db.execute("BEGIN EXCLUSIVE")
            held.set()
            time.sleep(9)  # past opencode's own 5 s busy timeout
            db.execute("COMMIT")
            db.close()

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(10)
        r = s.run("#! say through", timeout=120)
        holder.join()
    assert r.text == "through"
    assert any(isinstance(e, Notice) and e.kind == "retry" and "busy" in e.message for e in r.events)


def test_agent_and_model_pass_through_to_each_prompt(tmp_path: Path) -> None:
    def settings(args: list[str], model: str = "loopback") -> Settings:
        return Settings(backend="opencode", model=model, base_url="http://127.0.0.1:9", home=tmp_path,
                        agent_id="x", args=args)

    server = OpenCode(settings(["--agent", "plan", "--model=anthropic/claude-x"])).server
    assert server is not None and server.fields == {
        "agent": "plan", "model": {"providerID": "anthropic", "modelID": "claude-x"}}
    server = OpenCode(settings([], model="openai/gpt-x")).server
    assert server is not None and server.fields == {"model": {"providerID": "openai", "modelID": "gpt-x"}}
    with pytest.raises(shoal.BadSetting, match="transport='run'"):
        OpenCode(settings(["--print-logs"]))
    run = OpenCode(Settings(**{**vars(settings(["--agent", "plan"])), "transport": "run"}))
    assert run.server is None and run._argv(Conversation(cwd=tmp_path))[-2:] == ["--agent", "plan"]
