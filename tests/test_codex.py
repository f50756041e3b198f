"""Codex CLI specifics, driving the real `codex` against the loopback model on both transports.

The behaviour every backend owes is in test_behaviour.py (default transport, "server");
here: the "run" transport too, one app-server shared by many sessions, a server killed and
resumed, error mapping, cancelling without leftovers, and a CLI of the wrong version.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import shoal
from conftest import leftovers
from shoal.backends.base import DEFAULT_PERMISSIONS
from shoal.backends.codex import LOOPBACK_SLUG, sandbox_mode
from shoal.loopback import INPUT_TOKENS, OUTPUT_TOKENS, LoopbackModel
from shoal.procs import tagged_pids

TRANSPORTS = ["server", "run"]


def proc_tags(agent_id: str) -> set[str]:
    """The distinct shoal.procs tags among the agent's live processes: one per spawned CLI."""
    tags = set()
    for pid in tagged_pids(f"SHOAL_AGENT={agent_id}"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        tags |= {item.split(b"=", 1)[1].decode() for item in env if item.startswith(b"SHOAL_PROC=")}
    return tags


def cmdlines(agent_id: str) -> list[str]:
    out = []
    for pid in tagged_pids(f"SHOAL_AGENT={agent_id}"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


async def wait_for_prompt(loopback: LoopbackModel, marker: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(marker in r.prompt for r in list(loopback.requests)):
        assert time.monotonic() < deadline, f"no request with {marker!r} reached the loopback model"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_write_run_and_recall(transport: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"wr-{transport}-{time.time_ns()}"
    with shoal.Agent("codex", transport=transport) as agent:
        s = agent.session(where=workdir)
        r = s.run(f"remember: {tag}\n#! write sub/a.txt hello codex\n#! run cat sub/a.txt\n#! say done")
        assert (workdir / "sub" / "a.txt").read_text() == "hello codex\n"
        assert r.text == "done" and r.session_id == s.session_id
        assert [type(e).__name__ for e in r.events] == [
            "Started", "ToolStarted", "ToolFinished", "ToolStarted", "ToolFinished", "Text", "StepUsage"]
        patch, shell = r.tool_calls
        assert patch.tool == "apply_patch" and patch.ok
        assert patch.input == {"changes": [{"path": str(workdir / "sub" / "a.txt"), "kind": "add"}]}
        assert shell.tool == "shell" and shell.input == {"command": "cat sub/a.txt"}
        assert shell.output == "hello codex\n" and shell.exit_code == 0 and shell.ok
        # exactly one StepUsage, holding the turn's three model calls
        assert r.usage.input_tokens == 3 * INPUT_TOKENS and r.usage.output_tokens == 3 * OUTPUT_TOKENS
        sent = [q for q in loopback.requests if tag in q.prompt]
        assert [q.move for q in sent] == ["tool:write", "tool:run", "final"]
        assert {q.model for q in sent} == {LOOPBACK_SLUG}  # the slug that brings the apply_patch tool
        again = s.run("#! recall")
        assert tag in again.text
        assert again.usage.input_tokens == INPUT_TOKENS  # this turn's usage, not the thread's total
        assert not any(isinstance(e, shoal.Started) for e in again.events)
        home = agent.settings.home / "codex"
        assert 'wire_api = "responses"' in (home / "config.toml").read_text()
    assert leftovers(agent.id) == []
    assert not home.exists()


def test_sessions_share_one_app_server(tmp_path: Path) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()

    async def main() -> tuple[list[shoal.Reply], float, set[str]]:
        async with shoal.Agent("codex") as agent:
            sessions = [agent.session(where=d) for d in dirs]
            t0 = time.monotonic()
            turns = asyncio.gather(*(s.arun(f"#! sleep 1\n#! write out.txt {i}\n#! say s{i}")
                                     for i, s in enumerate(sessions)))
            await asyncio.sleep(0.7)
            tags = proc_tags(agent.id)  # every turn is under way now
            replies = await turns
            wall = time.monotonic() - t0
            assert agent.backend.server.server is not None and agent.backend.server.server.generation == 1
            return replies, wall, tags

    replies, wall, tags = asyncio.run(main())
    assert [r.text for r in replies] == [f"s{i}" for i in range(4)]
    assert [(d / "out.txt").read_text().strip() for d in dirs] == ["0", "1", "2", "3"]
    assert len(tags) == 1  # one app-server for all four
    assert wall < 2.8  # four one-second turns overlapped instead of queueing behind each other
    assert len({r.session_id for r in replies}) == 4


def test_killed_server_is_named_then_the_thread_resumes(workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"kill-{time.time_ns()}"

    async def main() -> None:
        async with shoal.Agent("codex") as agent:
            s = agent.session(where=workdir)
            await s.arun("remember: osprey\n#! say noted")
            server = agent.backend.server.server
            assert server is not None
            turn = asyncio.create_task(s.arun(f"{tag}\n#! sleep 5\n#! say late"))
            await wait_for_prompt(loopback, tag)
            os.killpg(server.proc.pid, signal.SIGKILL)
            with pytest.raises(shoal.BackendCrashed) as info:
                await asyncio.wait_for(turn, 5)
            assert "app-server" in str(info.value) and info.value.exit_code == -signal.SIGKILL
            assert "osprey" in (await s.arun("#! recall")).text  # a new server, the same thread
            assert agent.backend.server.server.generation == 2
        assert leftovers(agent.id) == []

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_provider_error_is_mapped(transport: str, workdir: Path, loopback: LoopbackModel) -> None:
    with shoal.Agent("codex", transport=transport) as agent:
        s = agent.session(where=workdir)
        with pytest.raises(shoal.ProviderError) as info:
            s.run("#! fail 401")
        err = info.value
        assert err.status == 401 and "401" in str(err) and err.backend == "codex"
        assert err.request_id in {r.request_id for r in loopback.requests}
        assert err.session_id == s.session_id
        assert s.run("#! say recovered").text == "recovered"
    assert leftovers(agent.id) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cancelled_turn_leaves_nothing(transport: str, workdir: Path, loopback: LoopbackModel) -> None:
    tag = f"cancel-{transport}-{time.time_ns()}"

    async def main() -> None:
        async with shoal.Agent("codex", transport=transport) as agent:
            s = agent.session(where=workdir)
            turn = asyncio.create_task(s.arun(f"remember: {tag}\n#! sleep 5\n#! say late"))
            await wait_for_prompt(loopback, tag)
            t0 = time.monotonic()
            turn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await turn
            assert time.monotonic() - t0 < 3
            assert leftovers(agent.id, settle=1.0) == []
            assert (await agent.session(where=workdir).arun("#! say other")).text == "other"
            assert tag in (await s.arun("#! recall")).text
        assert leftovers(agent.id) == []

    asyncio.run(main())


def test_cancel_kills_its_command_but_keeps_the_busy_server(tmp_path: Path, loopback: LoopbackModel) -> None:
    tag = f"busy-{time.time_ns()}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    async def main() -> None:
        async with shoal.Agent("codex") as agent:
            a, b = agent.session(where=tmp_path / "a"), agent.session(where=tmp_path / "b")
            other = asyncio.create_task(a.arun(f"{tag}-a\n#! sleep 2.5\n#! say a done"))
            doomed = asyncio.create_task(b.arun(f"{tag}-b\n#! run sleep 30 && touch late.txt"))
            await wait_for_prompt(loopback, f"{tag}-b")
            await asyncio.sleep(0.5)  # `sleep 30` runs now, under the app-server
            assert any(c.startswith("sleep 30") for c in cmdlines(agent.id))
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
            await asyncio.sleep(0.3)
            assert not any(c.startswith("sleep 30") for c in cmdlines(agent.id))
            assert len(proc_tags(agent.id)) == 1  # the server stays: session a still runs on it
            assert (await other).text == "a done"
            assert (await b.arun("#! say b again")).text == "b again"
            assert agent.backend.server.server.generation == 1
        assert leftovers(agent.id) == []
        assert not (tmp_path / "b" / "late.txt").exists()

    asyncio.run(main())


def _fake_codex(path: Path, version: str, app_server: str) -> str:
    version_check = f'if [ "$1" = "--version" ]; then echo "codex-cli {version}"; exit 0; fi'
    path.write_text(f"#!/bin/sh\n{version_check}\n{app_server}\n")
    path.chmod(0o755)
    return str(path)


def test_wrong_version_is_a_protocol_mismatch(tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_CODEX_BIN", _fake_codex(tmp_path / "codex", "0.99.1", "sleep 60"))
    for transport in TRANSPORTS:
        with shoal.Agent("codex", transport=transport) as agent, pytest.raises(shoal.ProtocolMismatch) as info:
            agent.session(where=workdir).run("#! say hi")
        assert "0.99.1" in str(info.value) and "0.171.0" in str(info.value)
        assert leftovers(agent.id) == []


def test_silent_app_server_is_a_protocol_mismatch(tmp_path: Path, workdir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the right version string, but the process never answers `initialize`
    monkeypatch.setenv("SHOAL_CODEX_BIN", _fake_codex(tmp_path / "codex", "0.171.0", "exec sleep 60"))
    with shoal.Agent("codex") as agent:
        agent.backend.server.init_timeout = 1.0
        t0 = time.monotonic()
        with pytest.raises(shoal.ProtocolMismatch) as info:
            agent.session(where=workdir).run("#! say hi")
        assert time.monotonic() - t0 < 5
        assert "handshake" in str(info.value)
    assert leftovers(agent.id) == []


def test_permissions_choose_the_sandbox() -> None:
    assert sandbox_mode(DEFAULT_PERMISSIONS) == "danger-full-access"
    assert sandbox_mode({**DEFAULT_PERMISSIONS, "bash": "deny"}) == "read-only"
    assert sandbox_mode({**DEFAULT_PERMISSIONS, "edit": "deny"}) == "read-only"
    assert sandbox_mode({**DEFAULT_PERMISSIONS, "sandbox": "workspace-write"}) == "workspace-write"
    agent = shoal.Agent("codex", permissions={"edit": "deny"}, transport="run")
    config = agent.backend._config()
    assert 'sandbox_mode = "read-only"' in config and 'approval_policy = "never"' in config
    assert f'model = "{LOOPBACK_SLUG}"' in config and "[analytics]\nenabled = false" in config
    assert "--dangerously-bypass-approvals-and-sandbox" not in agent.backend._argv(shoal.backends.Conversation(Path()))
    agent.close()


def test_bad_transport_and_model_are_refused_up_front() -> None:
    with pytest.raises(shoal.BadSetting, match="transport"):
        shoal.Agent("codex", transport="held")
    with pytest.raises(shoal.BadModel):
        shoal.Agent("codex", model="openai/")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_thread_codex_never_saved_is_replaced(transport: str, workdir: Path) -> None:
    # a first turn killed between thread/start and its first turn leaves a thread with no rollout
    with shoal.Agent("codex", transport=transport) as agent:
        s = agent.session(where=workdir)
        s.run("#! say hi")
        assert s._conv is not None
        s._conv.session_id = "01a22900-aef9-7d03-9b90-be97061c2705"  # a thread id codex never saved
        s._conv.state["codex_server"] = 0  # as if opened on an earlier app-server
        r = s.run("#! say again")
        assert r.text == "again"
        assert any(isinstance(e, shoal.Notice) and e.kind == "new-thread" for e in r.events)
        assert s.session_id not in (None, "01a22900-aef9-7d03-9b90-be97061c2705")
        assert s.run("#! say and on").text == "and on"
    assert leftovers(agent.id) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_retried_429_is_a_notice(transport: str, workdir: Path) -> None:
    with shoal.Agent("codex", transport=transport) as agent:
        r = agent.session(where=workdir).run("#! fail 429 1")  # one 429, then the model's "ok"
        assert r.text == "ok"
        assert any(isinstance(e, shoal.Notice) and e.kind == "retry" for e in r.events)
