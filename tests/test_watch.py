"""`shoal watch`: the view on Textual's headless pilot, and the real command under tmux."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Log, Static

import shoal
from conftest import BACKENDS
from shoal.journal import Journal
from shoal.watch.app import FullRecord, WatchApp
from shoal.watch.model import SCREEN_LINES, SCREENS, Model
from shoal.watch.source import Source
from shoal.watch.tail import Tail

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv("SHOAL_RUNS", str(d))
    return d


class Fake:
    """A journal written the way a run writes it, for conversations in states chosen by the test."""

    def __init__(self, runs: Path) -> None:
        self.j = Journal(runs)
        self.j.write("run.began", name="fake", pid=os.getpid(), argv=[])
        self.j.write("flow.called", call="root", flow="fake", parent=None, depth=1)

    def conv(self, sid: str, agent: str = "a1", agent_name: str = "coder", call: str = "root") -> None:
        self.j.write("session.adopted", call=call, session=sid)
        self.j.write("session.made", call=call, session=sid, name=sid, agent=agent, agent_name=agent_name,
                     backend="opencode", model="loopback", place=f"/tmp/{sid}")

    def began(self, sid: str, turn: int = 1, prompt: str = "do it") -> None:
        self.j.write("turn.began", call="root", session=sid, turn=turn, prompt=prompt)

    def ended(self, sid: str, turn: int = 1, status: str = "ok") -> None:
        self.j.write("turn.ended", call="root", session=sid, turn=turn, status=status, seconds=1.5,
                     usage={"input_tokens": 2000, "output_tokens": 100, "cost": 0.0024})

    def text(self, sid: str, text: str) -> None:
        self.j.write("text", call="root", session=sid, turn=1, text=text)


def drive(app: WatchApp, script: Callable[[Pilot[None]], Coroutine[Any, Any, None]],
          size: tuple[int, int] = (160, 40)) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await script(pilot)

    asyncio.run(main())


def text_of(app: WatchApp, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


def screen_lines(app: WatchApp) -> list[str]:
    return list(app.query_one("#screen", Log).lines)


# --- the pilot ---------------------------------------------------------------------------------------


def test_header_shows_one_agent_and_k_of_n_per_agent(runs: Path) -> None:
    f = Fake(runs)
    for i in range(5):
        f.conv(f"c{i}")
    for i in range(3):
        f.conv(f"r{i}", agent="a2", agent_name="reviewer")
    app = WatchApp(Source())

    async def script(pilot: Pilot[None]) -> None:
        agents = text_of(app, "#agents").splitlines()
        assert len(agents) == 2  # several agents: several headers
        assert "coder" in agents[0] and "1 of 5" in agents[0]
        assert "reviewer" in agents[1] and "3 conversations" in agents[1] and " of " not in agents[1]
        assert text_of(app, "#title").startswith("c0")
        await pilot.press("right_square_bracket")  # the next agent
        agents = text_of(app, "#agents").splitlines()
        assert "1 of 3" in agents[1] and "5 conversations" in agents[0]
        assert app.current == "r0"

    drive(app, script)


def test_stepping_moves_only_between_working_conversations(runs: Path) -> None:
    f = Fake(runs)
    f.j.write("flow.called", call="done-call", flow="unit", parent="root", depth=2)
    for i in range(7):
        f.conv(f"c{i}", call="done-call" if i == 2 else "root")
    for i in (0, 1, 2, 3, 4, 5):
        f.began(f"c{i}")
    f.ended("c1")  # idle: its turn ended, the conversation goes on
    f.ended("c2")
    f.j.write("flow.returned", call="done-call", status="ok")  # done: its owner returned
    f.ended("c4", status="failed")
    # c0, c3, c5 are working; c6 never began (queued)
    app = WatchApp(Source())

    async def script(pilot: Pilot[None]) -> None:
        m = app.model
        assert m is not None
        assert [m.status(f"c{i}") for i in range(7)] == ["working", "idle", "done", "working", "failed", "working",
                                                         "queued"]
        seen = []
        for _ in range(4):
            await pilot.press("n")
            seen.append(app.current)
        assert seen == ["c3", "c5", "c0", "c3"]
        await pilot.press("p")
        assert app.current == "c0"
        assert "stepping: working" in text_of(app, "#run")
        await pilot.press("a")  # now over all of them
        assert "stepping: all" in text_of(app, "#run")
        await pilot.press("n", "n")
        assert app.current == "c2"
        await pilot.press("a")
        # a conversation that starts working joins the stepping, live
        f.began("c6")
        f.text("c6", "thinking about it")
        app.tick()
        await pilot.press("n")
        assert app.current == "c3"
        await pilot.press("n", "n")
        assert app.current == "c6"
        assert "thinking about it" in screen_lines(app)
        assert "c6" in text_of(app, "#title") and "working" in text_of(app, "#title")

    drive(app, script)


def test_eight_screens_and_two_thousand_lines_are_kept(runs: Path) -> None:
    f = Fake(runs)
    for i in range(10):
        f.conv(f"c{i}")
        f.began(f"c{i}", prompt=f"prompt of c{i}")
    for n in range(3000):
        f.text("c0", f"line {n}")
    app = WatchApp(Source())

    async def script(pilot: Pilot[None]) -> None:
        m = app.model
        assert m is not None
        lines = screen_lines(app)
        assert len(lines) == SCREEN_LINES == 2000
        assert lines[-1] == "line 2999" and lines[0] == "line 1000"  # the last two thousand
        total = m.convs["c0"].lines
        assert m.hidden("c0") == total - 2000 > 1000
        assert f"{total - 2000} earlier lines" in text_of(app, "#title")
        await pilot.press("f")  # the full record, read back from the journal
        assert isinstance(app.screen, FullRecord)
        full = list(app.screen.query_one("#full", Log).lines)
        assert len(full) == total and "> prompt of c0" in full and full[-1] == "line 2999"
        await pilot.press("escape")
        assert not isinstance(app.screen, FullRecord)

        for _ in range(9):  # look at every conversation in turn
            await pilot.press("n")
        assert app.current == "c9"
        assert len(m.kept()) == SCREENS == 8
        assert m.kept() == [f"c{i}" for i in range(2, 10)]  # the last eight looked at
        # a kept screen that is not shown still grows; one not kept only counts its lines
        f.text("c5", "more for c5")
        f.text("c1", "more for c1")
        app.tick()
        assert m.screen("c5")[-1] == "more for c5" and "c1" not in m.kept()[:-1]
        await pilot.press("n")  # c0 again: no longer kept, read back from the journal
        assert app.current == "c0" and screen_lines(app)[-1] == "line 2999" and len(screen_lines(app)) == 2000
        assert "c0" in m.kept() and len(m.kept()) == 8

    drive(app, script)


def test_list_view_shows_every_conversation_and_opens_one(runs: Path) -> None:
    f = Fake(runs)
    for i in range(4):
        f.conv(f"c{i}")
    f.began("c1")
    f.began("c2")
    f.ended("c2", status="failed")
    app = WatchApp(Source())

    async def script(pilot: Pilot[None]) -> None:
        await pilot.press("l")
        table = app.query_one("#list", DataTable)
        assert table.display and table.row_count == 4
        rows = [[str(x) for x in table.get_row_at(i)] for i in range(4)]
        assert [r[1] for r in rows] == ["c0", "c1", "c2", "c3"]
        assert "working" in rows[1][2] and "failed" in rows[2][2] and "queued" in rows[0][2]
        assert rows[2][4] == "2100" and rows[2][5] == "0.0024" and rows[1][3] == "/tmp/c1"
        await pilot.press("down", "down", "enter")
        assert not table.display and app.current == "c2"

    drive(app, script)


def test_a_run_whose_writer_is_gone_reads_as_unfinished(runs: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    j = Journal(runs)
    j.write("run.began", name="killed", pid=gone.pid, argv=[])
    j.write("session.made", call="root", session="c0", name="c0", agent="a1", agent_name="coder")
    j.write("turn.began", call="root", session="c0", turn=1, prompt="never answered")
    app = WatchApp(Source())

    async def script(pilot: Pilot[None]) -> None:
        await pilot.pause(0.2)
        assert "ended unfinished" in text_of(app, "#run")
        assert app.model is not None and app.model.status("c0") == "stopped"

    drive(app, script)


def test_a_batch_unit_is_one_conversation_from_queued_to_stuck(runs: Path) -> None:
    f = Fake(runs)
    unit = {"call": "batch", "task": "fix", "agent": "a1"}
    f.j.write("unit.status", index=0, status="queued", tries=0, session=None, **unit)
    m = Model(f.j.path)
    m.poll()
    assert [m.status(k) for k in m.order()] == ["queued"]  # waiting behind `limit`: no session yet
    f.conv("s1")  # its session is made (and seen) before the unit says it is its own
    f.j.write("unit.status", index=0, status="working", tries=1, session="s1", **unit)
    f.began("s1")
    f.text("s1", "on it")
    ch = m.poll()
    assert ch.shape and list(m.convs) == ["batch#0"] and m.resolve("s1") == "batch#0"
    assert m.status("batch#0") == "working" and m.convs["batch#0"].name == "fix"
    f.ended("s1")
    f.j.write("unit.status", index=0, status="checking", tries=1, session="s1", **unit)
    m.poll()
    assert m.status("batch#0") == "checking"
    f.j.write("unit.status", index=0, status="stuck", tries=2, session="s1", error="failed the same way twice", **unit)
    m.poll()
    assert m.status("batch#0") == "stuck" and m.convs["batch#0"].error == "failed the same way twice"
    screen = list(m.screen("batch#0"))  # read back from the journal: the unit's lines and its session's, in order
    assert screen[0] == "· unit fix: queued" and "on it" in screen and screen[-1].startswith("✗ unit fix: stuck")


def test_a_torn_last_line_waits_for_its_end(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    first = json.dumps({"t": 1.0, "kind": "run.began", "name": "x"}) + "\n"
    second = json.dumps({"t": 2.0, "kind": "run.ended", "status": "ok"}) + "\n"
    path.write_text(first + second[:10])
    tail = Tail(path)
    assert [r["kind"] for _, r in tail.read()] == ["run.began"]
    assert tail.read() == []
    with open(path, "a") as fh:
        fh.write(second[10:] + "not json\n" + first)
    got = tail.read()
    assert [r["kind"] for _, r in got] == ["run.ended", "run.began"]  # the garbled line is skipped
    assert got[0][0] == len(first)  # offsets point at line starts: screens are read back by them


# --- a recorded run ----------------------------------------------------------------------------------


def recorded_batch(runs: Path, workdir: Path) -> Path:
    """A real batch against the loopback model, limit 2 so some units wait their turn."""
    prompts = [("echo", "#! run echo watch-0\n#! say zero"), ("fails", "#! fail 401"),
               ("steps", "#! run seq 1 3\n#! run false\n#! say three"), ("last", "#! say last")]
    with shoal.Agent("codex" if "codex" in BACKENDS else "opencode") as agent:  # the quickest at hand
        agent.batch(prompts, workdir, limit=2, suppress=True)
    (run,) = runs.iterdir()
    return run


def test_replay_of_a_recorded_run(runs: Path, workdir: Path) -> None:
    run = recorded_batch(runs, workdir)
    app = WatchApp(Source(run.name))

    async def script(pilot: Pilot[None]) -> None:
        m = app.model
        assert m is not None and m.over and m.run_status == "ok"
        assert "1 of 4" in text_of(app, "#agents") and "ended ok" in text_of(app, "#run")
        assert [m.convs[k].name for k in m.order()] == ["echo", "fails", "steps", "last"]  # a unit is one conversation
        assert [m.status(k) for k in m.order()] == ["done", "failed", "done", "done"]
        lines = screen_lines(app)
        assert "> #! run echo watch-0" in lines and "$ echo watch-0" in lines and "│ watch-0" in lines
        assert any(x.endswith("exit 0") and x.startswith("✓") for x in lines) and "zero" in lines
        assert any(x.startswith("── turn 1 ok · 2000 in + 100 out tok · $0.0024") for x in lines)
        assert "2100 tok" in text_of(app, "#title") and "done" in text_of(app, "#title")
        await pilot.press("n", "n")  # nothing works in a finished run: stepping goes over all
        assert app.current is not None and m.convs[app.current].name == "steps"
        lines = screen_lines(app)
        assert "$ false" in lines and any(x.startswith("✗") and x.endswith("exit 1") for x in lines)
        await pilot.press("p")
        assert "fails" in text_of(app, "#title") and "failed" in text_of(app, "#title")
        assert any("401" in x for x in screen_lines(app))

    drive(app, script)

    # replayed at a pace: what has happened so far, then all of it
    slow = Model(run / "journal.jsonl", speed=0.001)
    slow.poll()
    assert slow.replaying and not slow.over
    fast = Model(run / "journal.jsonl", speed=1e6)
    fast.poll()  # the replay clock starts at the first record
    time.sleep(0.05)
    fast.poll()
    assert fast.over and not fast.replaying


# --- the real command under tmux ---------------------------------------------------------------------


class Tmux:
    def __init__(self, socket: Path) -> None:
        self.socket = str(socket)

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=30)
        return out.stdout

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target)

    def wait_for(self, target: str, want: Callable[[str], bool], timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while True:
            shown = self.screen(target)
            if want(shown):
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"{target} never showed what was wanted; it shows:\n{shown}")
            time.sleep(0.3)


def current_name(shown: str) -> str:
    """The conversation the view shows: the first word of the line under the agents' header."""
    lines = shown.splitlines()
    at = next(i for i, x in enumerate(lines) if " of 20" in x)
    return lines[at + 1].split()[0]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/setup.sh installs it)")
def test_shoal_watch_under_tmux_while_a_real_batch_runs(tmp_path: Path) -> None:
    """`shoal batch --watch` in one terminal, `shoal watch` attached from another, 20 real opencode
    conversations against the loopback model: ten sleep (working), ten answer at once (done)."""
    work = tmp_path / "work"
    work.mkdir()
    prompts = tmp_path / "prompts.jsonl"
    slow = [f"s{i:02d}" for i in range(0, 20, 2)]
    units = [{"task": f"s{i:02d}", "prompt": f"#! run echo hello-{i}\n#! sleep 30\n#! say slept-{i}"} if i % 2 == 0
             else {"task": f"q{i:02d}", "prompt": f"#! say quick-{i}"} for i in range(20)]
    prompts.write_text("\n".join(json.dumps(u) for u in units))
    tmux = Tmux(tmp_path / "tmux.sock")
    # the size said outright too: a pane's size can reach a process that starts at once late
    env = {"SHOAL_RUNS": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT / "src"), "TERM": "xterm-256color",
           "COLUMNS": "200", "LINES": "50"}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    shoal_cmd = f"{exports} {shlex.quote(sys.executable)} -m shoal.cli.main"
    batch = f"{shoal_cmd} batch {prompts} --here {work} --watch; echo BATCH-EXIT $?; sleep 60"
    tmux("new-session", "-d", "-s", "batch", "-x", "200", "-y", "50", "-c", str(tmp_path), batch)
    try:
        # the view comes up in place and shows the batch's one agent and its twenty conversations
        tmux.wait_for("batch", lambda s: " of 20" in s and "hello-" in s)
        # another terminal attaches to the same run, live
        tmux("new-session", "-d", "-s", "view", "-x", "200", "-y", "50", "-c", str(tmp_path),
             f"{shoal_cmd} watch; sleep 60")
        shown = tmux.wait_for("view", lambda s: "1 of 20" in s and "working 10" in s and "done 10" in s
                              and "│ hello-0" in s)
        assert "live" in shown
        first = current_name(shown)
        assert first == "s00" and "$ echo hello-0" in shown and "> #! sleep 30" in shown
        names = [first]
        for _ in range(10):  # stepping skips the ten that are done
            tmux("send-keys", "-t", "view", "n")
            # (the screen changes on its own too, its clocks: wait for another conversation)
            shown = tmux.wait_for("view", lambda s, was=names[-1]: " of 20" in s and current_name(s) != was)  # type: ignore[misc]
            names.append(current_name(shown))
        names = names[1:]
        assert sorted(names) == slow and names[-1] == "s00"
        tmux("send-keys", "-t", "view", "l")
        listed = tmux.wait_for("view", lambda s: "q19" in s and "s18" in s)
        assert "working" in listed and "done" in listed
        tmux("send-keys", "-t", "view", "q")
        # leaving the view in place does not stop the batch: it runs to its end and prints its table
        tmux("send-keys", "-t", "batch", "q")
        done = tmux.wait_for("batch", lambda s: "BATCH-EXIT" in s, timeout=120)
        assert "20 passed, 0 failed" in done and "BATCH-EXIT 0" in done
    finally:
        tmux("kill-server")
