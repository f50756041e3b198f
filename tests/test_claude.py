"""The Claude Code backend, driving the real pinned `claude` CLI against the loopback model."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

import shoal
from conftest import leftovers
from shoal.backends.base import DEFAULT_PERMISSIONS, Settings
from shoal.backends.claude import LOOPBACK_MODEL, PINNED, Claude
from shoal.loopback import INPUT_TOKENS, OUTPUT_TOKENS, LoopbackModel

TRANSPORTS = ["held", "run"]


def agent(transport: str | None = None, **kw: object) -> shoal.Agent:
    return shoal.Agent("claude", model="loopback", transport=transport, **kw)  # type: ignore[arg-type]


def held_pid(s: shoal.Session) -> int | None:
    """The pid of the session's held-open claude process, if it has one."""
    assert s._conv is not None
    proc = s._conv.state.get("proc")
    return proc.pid if proc is not None and proc.returncode is None else None


def gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_write_and_run(transport: str, workdir: Path, loopback: LoopbackModel) -> None:
    with agent(transport) as a:
        s = a.session(where=workdir)
        r = s.run("#! write notes/a.txt hello claude\n#! run cat notes/a.txt; sh -c 'exit 3'\n#! say done")
        assert (workdir / "notes" / "a.txt").read_text() == "hello claude\n"
        assert r.text == "done"
        write, run = r.tool_calls
        assert (write.tool, write.ok, write.exit_code) == ("Write", True, None)
        assert write.input["file_path"] == str(workdir / "notes" / "a.txt")
        assert (run.tool, run.ok, run.exit_code) == ("Bash", False, 3)
        assert "hello claude" in run.output
        # one usage per turn, from the result line: three model calls, counted once
        (step,) = [e.usage for e in r.events if isinstance(e, shoal.StepUsage)]
        assert (step.input_tokens, step.output_tokens, step.cached_tokens) == (3 * INPUT_TOKENS, 3 * OUTPUT_TOKENS, 0)
        assert r.usage.input_tokens == 3 * INPUT_TOKENS and r.usage.cost > 0
        started = [e for e in r.events if isinstance(e, shoal.Started)]
        assert started == [shoal.Started(s.session_id or "")] and uuid.UUID(s.session_id or "")
        # what claude sent: our model name, the user's own prompt (not its system reminders)
        sent = loopback.requests_for(s.session_id or "")
        assert [q.move for q in sent] == ["tool:write", "tool:run", "final"]
        assert {q.model for q in sent} == {LOOPBACK_MODEL}
        assert all(q.prompt.startswith("#! write notes/a.txt") for q in sent)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recall_across_turns(transport: str, workdir: Path) -> None:
    with agent(transport) as a:
        s = a.session(where=workdir)
        assert s.run("remember: apple").text == "ok"
        assert s.run("remember: pear\n#! say noted").text == "noted"
        r = s.run("#! recall")
        assert r.text == "recalled: apple pear"
        assert not any(isinstance(e, shoal.Started) for e in r.events)  # only the first turn starts


def test_held_transport_reuses_one_process(workdir: Path) -> None:
    with agent() as a:  # held is the default
        s = a.session(where=workdir)
        s.run("remember: fig")
        pid = held_pid(s)
        assert pid is not None
        for _ in range(3):
            assert s.run("#! recall").text == "recalled: fig"
            assert held_pid(s) == pid
        assert leftovers(a.id, settle=0)  # it is held open between turns...
    assert leftovers(a.id) == []  # ...and gone with the agent


def test_run_transport_holds_nothing_between_turns(workdir: Path) -> None:
    with agent("run") as a:
        s = a.session(where=workdir)
        s.run("#! say hi")
        assert held_pid(s) is None
        assert leftovers(a.id) == []


def test_killed_between_turns_resumes(workdir: Path) -> None:
    with agent("held") as a:
        s = a.session(where=workdir)
        s.run("remember: plum")
        pid = held_pid(s)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert gone(pid)
        time.sleep(0.2)  # let shoal's loop reap it
        r = s.run("#! recall")
        assert r.text == "recalled: plum"
        assert any(isinstance(e, shoal.Notice) and e.kind == "restart" for e in r.events)
        assert held_pid(s) not in (None, pid)
    assert leftovers(a.id) == []


def test_killed_mid_turn_raises_then_resumes(workdir: Path, loopback: LoopbackModel) -> None:
    async def main() -> None:
        async with agent("held") as a:
            s = a.session(where=workdir)
            await s.arun("remember: kiwi")
            pid = held_pid(s)
            assert pid is not None
            turn = asyncio.create_task(s.arun("#! sleep 3\n#! say too late"))
            while not any("sleep" in q.prompt for q in loopback.requests_for(s.session_id or "")):
                await asyncio.sleep(0.05)  # the model call is under way
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(shoal.BackendCrashed) as err:
                await turn
            assert err.value.exit_code == -signal.SIGKILL and err.value.session_id == s.session_id
            assert (await s.arun("#! recall")).text == "recalled: kiwi"
            assert held_pid(s) not in (None, pid)
            aid = a.id
        assert leftovers(aid) == []

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_401_is_a_provider_error_at_once(transport: str, workdir: Path) -> None:
    with agent(transport) as a:
        s = a.session(where=workdir)
        s.run("remember: lime")
        t = time.monotonic()
        with pytest.raises(shoal.ProviderError) as err:
            s.run("#! fail 401")
        assert time.monotonic() - t < 10  # not claude's ten backed-off retries
        assert err.value.status == 401 and err.value.backend == "claude"
        assert err.value.session_id == s.session_id
        assert leftovers(a.id) == []  # the failed turn's process is gone
        assert s.run("#! recall").text == "recalled: lime"  # and the session goes on


def test_failure_after_retries_carries_status_and_request_id(workdir: Path) -> None:
    with agent("held", env={"CLAUDE_CODE_MAX_RETRIES": "0"}) as a:
        s = a.session(where=workdir)
        with pytest.raises(shoal.ProviderError) as err:
            s.run("#! fail 500")
        assert err.value.status == 500
        assert (err.value.request_id or "").startswith("req_")
        assert "scripted failure 500" in str(err.value)
        assert s.run("#! say still here").text == "still here"


def test_retry_then_success_is_a_notice(workdir: Path) -> None:
    with agent("held") as a:
        r = a.session(where=workdir).run("#! fail 429 1")  # one 429, then the model's "ok"
        assert r.text == "ok"
        assert any(isinstance(e, shoal.Notice) and e.kind == "retry" for e in r.events)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_stops_the_turn_and_its_process(transport: str, workdir: Path) -> None:
    with agent(transport) as a:
        s = a.session(where=workdir)
        s.run("remember: date")
        t = time.monotonic()
        with pytest.raises(shoal.TurnTimeout):
            s.run("#! sleep 5\n#! say late", timeout=1)
        assert time.monotonic() - t < 4.5  # the 5 s sleep was cut short
        assert leftovers(a.id) == []  # no stale process whose late output a next turn could read
        assert s.run("#! recall").text == "recalled: date"


def test_cancelled_task_leaves_no_process(workdir: Path, loopback: LoopbackModel) -> None:
    async def main() -> str:
        a = agent("held")
        s = a.session(where=workdir)
        turn = asyncio.create_task(s.arun("#! sleep 5\n#! say late"))
        while not s.session_id or not loopback.requests_for(s.session_id):
            await asyncio.sleep(0.05)
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        assert leftovers(a.id) == []
        # the first turn was cut off mid-way; the conversation still starts cleanly
        assert (await s.arun("#! say again")).text == "again"
        await a.aclose()
        return a.id

    assert leftovers(asyncio.run(main())) == []


def test_concurrent_sessions_keep_their_own_history(tmp_path: Path) -> None:
    async def main() -> list[str]:
        async with agent("held") as a:
            for i in range(3):
                (tmp_path / f"s{i}").mkdir()
            sessions = [a.session(where=tmp_path / f"s{i}") for i in range(3)]
            await asyncio.gather(*(s.arun(f"remember: w{i}") for i, s in enumerate(sessions)))
            replies = await asyncio.gather(*(s.arun("#! recall") for s in sessions))
            return [r.text for r in replies]

    assert asyncio.run(main()) == ["recalled: w0", "recalled: w1", "recalled: w2"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_overwriting_a_file_and_a_slow_command(transport: str, workdir: Path) -> None:
    (workdir / "old.txt").write_text("from before\n")  # not read in this conversation
    with agent(transport) as a:
        r = a.session(where=workdir).run("#! write old.txt new\n#! run sleep 1 && cat old.txt")
        assert (workdir / "old.txt").read_text() == "new\n"
        assert [(t.tool, t.ok) for t in r.tool_calls] == [("Read", True), ("Write", True), ("Bash", True)]
        assert r.tool_calls[-1].output == "new"  # a leading sleep is not refused


def test_writes_outside_the_session_directory_are_denied(workdir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    with agent("held") as a:
        r = a.session(where=workdir).run(f"#! write {outside} nope\n#! say done")
        (write,) = r.tool_calls
        assert not write.ok and not outside.exists()
        assert any(isinstance(e, shoal.Notice) and e.kind == "permission_denied" for e in r.events)


def test_permissions_map_to_tool_flags(tmp_path: Path) -> None:
    def args(**perms: str) -> list[str]:
        s = Settings("claude", "loopback", None, tmp_path, "x", permissions={**DEFAULT_PERMISSIONS, **perms})
        return Claude(s)._permission_args()

    assert args() == ["--permission-mode", "acceptEdits", "--allowedTools=Bash",
                      "--disallowedTools=WebFetch,WebSearch,AskUserQuestion"]
    assert "--disallowedTools=Bash,WebFetch,WebSearch,AskUserQuestion" in args(bash="deny")
    assert args(external_directory="allow")[:2] == ["--permission-mode", "bypassPermissions"]
    assert "--allowedTools=Bash,Bash(git *)" in args(**{"Bash(git *)": "allow"})
    assert "--disallowedTools=Edit,Write,NotebookEdit,WebFetch,WebSearch,AskUserQuestion" in args(edit="deny")
    with pytest.raises(shoal.BadSetting, match="transports"):
        Claude(Settings("claude", "loopback", None, tmp_path, "x", transport="server"))


FAKE_CLI = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "0.9.1 (Claude Code)"; exit 0; fi
{body}
"""


@pytest.mark.parametrize("body", ["echo 'Welcome to claude!'; sleep 30",
                                  "echo 'error: unknown option --input-format' >&2; exit 1"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_unexpected_cli_is_a_protocol_mismatch(
    transport: str, body: str, workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "claude"
    fake.write_text(FAKE_CLI.format(body=body))
    fake.chmod(0o755)
    monkeypatch.setenv("SHOAL_CLAUDE_BIN", str(fake))
    with agent(transport) as a:
        with pytest.raises(shoal.ProtocolMismatch, match=rf"0\.9\.1(.|\n)*{PINNED}"):
            a.session(where=workdir).run("#! say hi", timeout=20)
        assert leftovers(a.id) == []
