"""Agent and session set-up: laziness, bad input, closing. Backend-independent where it can be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import shoal
from conftest import BACKENDS, leftovers, wait_for_request
from shoal.backends import REGISTRY
from shoal.loopback import LoopbackModel


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(shoal.UnknownBackend) as info:
        shoal.Agent("copilot")
    for name in REGISTRY:
        assert name in str(info.value)


def test_missing_cli_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_OPENCODE_BIN", "/nonexistent/opencode")
    with pytest.raises(shoal.CLINotFound) as info:
        shoal.Agent("opencode")
    assert "npm" in str(info.value) and "opencode-ai" in str(info.value)


def test_bad_model_name_is_refused_up_front() -> None:
    with pytest.raises(shoal.BadModel) as info:
        shoal.Agent("opencode", model="nonsense")
    assert "provider/model" in str(info.value)


def test_unknown_model_fails_the_turn_by_name(workdir: Path) -> None:
    with shoal.Agent("opencode", model="nosuch/model") as agent, pytest.raises(shoal.TurnFailed) as info:
        agent.session(where=workdir).run("hello")
    assert "nosuch/model" in str(info.value)


def test_missing_directory_is_an_error_at_open(tmp_path: Path) -> None:
    with shoal.Agent("opencode") as agent, pytest.raises(shoal.PlaceError) as info:
        agent.session(where=tmp_path / "nope")
    assert "does not exist" in str(info.value)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_ten_thousand_sessions_cost_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    agent = shoal.Agent("opencode", home=home)
    threads, fds, children = threading.active_count(), _fds(), shoal.procs.tagged_pids(f"SHOAL_AGENT={agent.id}")
    sessions = [agent.session(where=tmp_path) for _ in range(10_000)]
    assert len(sessions) == 10_000 and all(not s.started for s in sessions)
    assert threading.active_count() == threads
    assert _fds() == fds
    assert shoal.procs.tagged_pids(f"SHOAL_AGENT={agent.id}") == children == []
    assert not home.exists()  # not even the agent's home directory
    agent.close()


def test_closing_the_agent_stops_running_turns(workdir: Path) -> None:
    import asyncio

    async def main() -> None:
        agent = shoal.Agent("opencode")
        task = asyncio.create_task(agent.session(where=workdir).arun("#! sleep 30"))
        await asyncio.sleep(2)
        await agent.aclose()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert leftovers(agent.id, settle=1.0) == []
        with pytest.raises(shoal.AgentClosed, match="clone"):  # a ShoalError that says what to do
            agent.session(where=workdir)

    asyncio.run(main())


def test_clone_is_a_new_agent_with_changed_settings() -> None:
    with shoal.Agent("opencode") as a:
        b = a.clone(turn_timeout=5)
        assert b.id != a.id and b.settings.turn_timeout == 5 and b.settings.model == a.settings.model
        b.close()


def test_ask_permissions_become_deny() -> None:
    with shoal.Agent("opencode", permissions={"webfetch": "ask"}) as a:
        assert a.settings.permissions["webfetch"] == "deny"
        assert "ask" not in a.settings.permissions.values()


def test_blocking_call_inside_shoals_loop_is_refused(workdir: Path) -> None:
    import asyncio

    from shoal.runtime import runtime

    async def inner() -> None:
        agent = shoal.Agent("opencode")
        try:
            with pytest.raises(shoal.WrongLoop):
                agent.session(where=workdir).run("#! say hi")
        finally:
            await agent.aclose()

    asyncio.run(runtime.acall(inner()))


def test_a_turn_needs_no_network_beyond_loopback(workdir: Path) -> None:
    """In a network namespace holding only `lo`, a real turn still completes."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a private network namespace")
    script = (
        "import shoal\n"
        "with shoal.Agent('opencode') as a:\n"
        f"    print(a.session({str(workdir)!r}).run('#! write x.txt offline\\n#! say fine').text)\n"
    )
    out = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"$0\"", script],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "fine"
    assert (workdir / "x.txt").read_text().strip() == "offline"


WAITER = """
import shoal, sys
name, _, transport = sys.argv[1].partition(":")
agent = shoal.Agent(name, transport=transport or None, base_url=sys.argv[3])
print(agent.id, flush=True)
agent.session(where=sys.argv[2]).run(sys.argv[4] + "\\n#! sleep 120\\n#! say late")
"""


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.endswith(":run")])
def test_a_killed_shoal_takes_its_per_turn_cli_with_it(backend: str, workdir: Path, loopback: LoopbackModel) -> None:
    """SIGKILL shoal mid-turn: nothing of it runs to stop the CLI, which would wait on its model
    (served from here, so still up) for two minutes; the kernel ends it with shoal."""
    marker = f"orphan-{os.getpid()}-{backend}"
    proc = subprocess.Popen([sys.executable, "-c", WAITER, backend, str(workdir), loopback.url, marker],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        agent_id = proc.stdout.readline().strip()
        wait_for_request(loopback, marker)
        assert shoal.procs.tagged_pids(f"SHOAL_AGENT={agent_id}")  # the CLI is waiting on the model
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert leftovers(agent_id, settle=10) == []


HOLDER = """
import shoal, sys, time
agent = shoal.Agent("opencode")
agent.session(where=sys.argv[1]).run("#! say held")
print(agent.settings.home, flush=True)
time.sleep(300)
"""


def test_the_home_of_an_agent_whose_shoal_was_killed_is_found_and_cleaned(workdir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "SHOAL_HOME": str(tmp_path / "state")}
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    try:
        live_home, dead_home = (Path(p.stdout.readline().strip()) for p in procs if p.stdout is not None)
        assert live_home.is_dir() and dead_home.is_dir()
        procs[1].kill()  # nothing of that shoal runs to close its agent: its home stays behind
        procs[1].wait(timeout=30)
        for home in (live_home, dead_home):  # past the moment a fresh lock is given to settle
            os.utime(home / shoal.homes.LOCK, (time.time() - 60, time.time() - 60))

        def places(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "shoal.cli.main", "places", *args], capture_output=True,
                                  text=True, timeout=60, env=env)

        listed = [json.loads(line) for line in places("--json").stdout.splitlines()]
        assert [e["path"] for e in listed if e["kind"] == "agent-home"] == [str(dead_home)]  # not the live one
        out = places("clean")
        assert out.returncode == 0 and f"removed  agent home {dead_home}" in out.stdout, out.stdout + out.stderr
        assert not dead_home.exists() and live_home.is_dir()  # the home in use stays
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
