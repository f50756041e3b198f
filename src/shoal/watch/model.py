"""What `shoal watch` knows of a run: its journal read as it grows, one state per conversation.

Every conversation keeps a summary (status, place, tokens, cost, time) and where its records
sit in the file. Screens — the lines a conversation shows — are kept for the last eight
conversations looked at, the last two thousand lines of each; any other is read back from
the journal by offset when it is looked at, and `full` reads one back whole. So two hundred
streaming conversations cost two hundred summaries, not two hundred transcripts.

A conversation is a session; a batch unit that has no session yet (queued behind `limit`)
is one too, and becomes its session's when the unit says which it got.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.watch import render
from shoal.watch.tail import Tail

SCREENS = 8  # conversations whose screens are kept
SCREEN_LINES = 2000  # lines kept of each

# a batch unit's own words -> the view's (a unit that passed is done)
UNIT = {"passed": "done", "checking": "checking", "failed": "failed", "stuck": "stuck", "skipped": "skipped"}
STATUSES = ("working", "starting", "checking", "queued", "idle", "done", "failed", "stuck", "stopped", "skipped")


@dataclass
class AgentInfo:
    id: str
    name: str = ""
    backend: str = ""
    model: str = ""

    @property
    def label(self) -> str:
        what = f"{self.backend}/{self.model}" if self.backend else ""
        name = self.name or (f"agent {self.id[:6]}" if self.id else "agent not known yet")
        return f"{name} ({what})" if what and what not in name else name


@dataclass
class Conv:
    key: str
    name: str
    agent: str = ""
    call: str | None = None  # the flow call that owns it: when that returns, it is closed
    place: str = ""
    tokens: int = 0
    cost: float = 0.0
    turns: int = 0
    in_flight: float | None = None  # when the turn in flight began (journal time)
    turn_seconds: float = 0.0  # of the turns that ended
    last_turn: str = ""  # how the last turn ended
    unit: str = ""  # a batch unit's status
    error: str = ""
    doing: str = ""  # its latest line, for the list
    closed: bool = False
    lines: int = 0  # every line its screen ever had, kept or not
    offsets: list[int] = field(default_factory=list)  # where its records are in the journal

    def status(self, run_over: bool = False) -> str:
        if self.in_flight is not None:
            return "working"
        unit = UNIT.get(self.unit)
        if unit:
            return unit
        if self.last_turn in ("failed", "stopped"):
            return self.last_turn
        if self.turns == 0:
            return "starting" if self.unit == "working" else "queued"
        return "done" if self.closed or run_over else "idle"

    def seconds(self, now: float) -> float:
        return self.turn_seconds + (now - self.in_flight if self.in_flight is not None else 0.0)


@dataclass
class Changes:
    """What one poll brought: which conversations moved and the new lines of kept screens."""

    records: int = 0
    moved: set[str] = field(default_factory=set)
    lines: dict[str, list[str]] = field(default_factory=dict)  # kept screens only
    latest: dict[str, float] = field(default_factory=dict)  # conversation -> newest record time
    newest: float = 0.0  # newest record time of all
    oldest: float = 0.0  # oldest record time of all (0 when none)
    rebuilt: set[str] = field(default_factory=set)  # screens dropped, to be read back whole
    shape: bool = False  # conversations or agents came, went or regrouped
    run: bool = False  # the run began or ended


class Model:
    """The run as the journal has told it so far. Only the view's thread touches it."""

    def __init__(self, path: Path, *, speed: float | None = None) -> None:
        self.path = path
        self.tail = Tail(path)
        self.speed = speed  # replay at this many times the recorded pace (None: as fast as it reads)
        self.convs: dict[str, Conv] = {}
        self.agents: dict[str, AgentInfo] = {}
        self.alias: dict[str, str] = {}  # session id -> the unit conversation it became
        self.run_name = ""
        self.run_began = 0.0
        self.run_ended: float | None = None
        self.run_status = ""  # "" while it runs
        self.pid: int | None = None
        self.last_record = 0.0  # journal time of the newest record read
        self._owner_done: set[str] = set()  # flow calls that returned
        self._order: list[str] | None = None
        self._screens: OrderedDict[str, deque[str]] = OrderedDict()
        self._pending: deque[tuple[int, dict[str, Any]]] = deque()
        self._clock: tuple[float, float] | None = None  # (first record time, wall time) when replaying

    # --- reading -------------------------------------------------------------------------------

    def poll(self) -> Changes:
        """Read what was appended since the last poll and fold it in."""
        ch = Changes()
        self._pending.extend(self.tail.read())
        if self.speed is None:
            due, self._pending = self._pending, deque()
        else:
            due = self._due()
        for offset, rec in due:
            self._apply(offset, rec, ch)
        ch.records = len(due)
        return ch

    def _due(self) -> deque[tuple[int, dict[str, Any]]]:
        if not self._pending:
            return deque()
        if self._clock is None:
            self._clock = (float(self._pending[0][1].get("t", 0)), time.monotonic())
        t0, wall0 = self._clock
        until = t0 + (time.monotonic() - wall0) * (self.speed or 1.0)
        due: deque[tuple[int, dict[str, Any]]] = deque()
        while self._pending and float(self._pending[0][1].get("t", 0)) <= until:
            due.append(self._pending.popleft())
        return due

    @property
    def replaying(self) -> bool:
        return bool(self._pending)

    def _apply(self, offset: int, r: dict[str, Any], ch: Changes) -> None:
        kind, t = r.get("kind"), float(r.get("t", 0))
        self.last_record = max(self.last_record, t)
        ch.newest = max(ch.newest, t)
        ch.oldest = min(ch.oldest, t) if ch.oldest else t
        if kind == "run.began":
            self.run_name, self.run_began, self.pid, ch.run = str(r.get("name", "")), t, r.get("pid"), True
            return
        if kind == "run.ended":
            self.run_ended, self.run_status, ch.run = t, str(r.get("status", "ok")), True
            ch.moved.update(self.convs)
            return
        if kind == "flow.returned":
            call = str(r.get("call"))
            self._owner_done.add(call)
            for c in self.convs.values():
                if c.call == call and not c.closed:
                    c.closed = True
                    ch.moved.add(c.key)
            return
        if kind == "unit.status":
            conv = self._unit(r, ch)
        elif "session" in r:
            conv = self._session(str(r["session"]), r, ch)
        else:
            return
        if conv is None:
            return
        self._fold(conv, kind, r, t, ch)
        self._note(conv, offset, r, t, ch)

    def _session(self, sid: str, r: dict[str, Any], ch: Changes) -> Conv | None:
        key = self.alias.get(sid, sid)
        conv = self.convs.get(key)
        if conv is None:
            if r.get("kind") == "session.adopted":
                conv = self._new(sid, sid, "", ch)  # its name and agent come with session.made
            else:
                conv = self._new(sid, str(r.get("name") or sid), str(r.get("agent") or ""), ch)
        if conv.call is None and r.get("call"):
            conv.call = str(r["call"])
            conv.closed = conv.call in self._owner_done
        return conv

    def _unit(self, r: dict[str, Any], ch: Changes) -> Conv | None:
        key = f"{r.get('call')}#{r.get('index')}"
        conv = self.convs.get(key) or self._new(key, str(r.get("task") or key), str(r.get("agent") or ""), ch)
        sid = r.get("session")
        if sid and sid not in self.alias:
            self.alias[str(sid)] = key
            if str(sid) in self.convs:
                self._merge(self.convs.pop(str(sid)), conv)
                ch.shape = True
                ch.rebuilt.add(key)
                ch.lines.pop(key, None)
        return conv

    def _merge(self, src: Conv, dst: Conv) -> None:
        """A unit's session was seen before the unit said it was its: one conversation, not two."""
        dst.offsets = sorted(dst.offsets + src.offsets)
        for name in ("call", "closed", "place", "tokens", "cost", "turns", "in_flight", "turn_seconds", "last_turn",
                     "doing"):
            setattr(dst, name, getattr(src, name))
        dst.agent, dst.lines = dst.agent or src.agent, dst.lines + src.lines
        self._screens.pop(src.key, None)
        self._screens.pop(dst.key, None)  # rebuilt from the journal, in order, when next looked at
        self._order = None

    def _new(self, key: str, name: str, agent: str, ch: Changes) -> Conv:
        conv = self.convs[key] = Conv(key, name, agent)
        self._order = None
        ch.shape = True
        return conv

    def _fold(self, conv: Conv, kind: object, r: dict[str, Any], t: float, ch: Changes) -> None:
        agent = str(r.get("agent") or "")
        if kind == "session.made":
            conv.name = str(r.get("name") or conv.name)
            conv.place = conv.place or str(r.get("place") or "")
        if agent and kind in ("session.made", "session.opened", "unit.status"):
            info = self.agents.get(agent)
            if info is None:
                info = self.agents[agent] = AgentInfo(agent)
                self._order, ch.shape = None, True
            info.name = str(r.get("agent_name") or info.name)
            info.backend = str(r.get("backend") or info.backend)
            info.model = str(r.get("model") or info.model)
            if conv.agent != agent:
                conv.agent, self._order, ch.shape = agent, None, True
        if kind == "session.opened":
            conv.place = str(r.get("cwd") or r.get("place") or conv.place)
        elif kind == "turn.began":
            conv.turns, conv.in_flight, conv.last_turn = max(conv.turns, int(r.get("turn", 1))), t, ""
        elif kind == "turn.ended":
            usage = r.get("usage") or {}
            conv.tokens += int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
            conv.cost += float(usage.get("cost", 0.0))
            conv.turn_seconds += float(r.get("seconds") or 0.0)
            conv.in_flight, conv.last_turn = None, str(r.get("status", "ok"))
            conv.error = str(r.get("error") or "").split("\n")[0]
        elif kind == "unit.status":
            conv.unit = str(r.get("status") or "")
            conv.error = str(r.get("error") or conv.error)
        ch.moved.add(conv.key)

    def _note(self, conv: Conv, offset: int, r: dict[str, Any], t: float, ch: Changes) -> None:
        new = render.lines(r)
        if not new:
            return
        conv.offsets.append(offset)
        conv.lines += len(new)
        conv.doing = new[-1]
        screen = self._screens.get(conv.key)
        if screen is not None:
            screen.extend(new)
            ch.lines.setdefault(conv.key, []).extend(new)
            ch.latest[conv.key] = t

    # --- asking --------------------------------------------------------------------------------

    @property
    def over(self) -> bool:
        return self.run_ended is not None

    def status(self, key: str) -> str:
        return self.convs[key].status(self.over)

    def resolve(self, key: str | None) -> str | None:
        """The conversation a key names now (a session may have become a unit's)."""
        if key is None:
            return None
        key = self.alias.get(key, key)
        return key if key in self.convs else None

    def order(self) -> list[str]:
        """Every conversation, agent by agent (in the order agents appeared), then as they appeared."""
        if self._order is None:
            rank = {a: i for i, a in enumerate(self.agents)}
            keys = list(self.convs)
            pos = {k: i for i, k in enumerate(keys)}
            self._order = sorted(keys, key=lambda k: (rank.get(self.convs[k].agent, len(rank)), pos[k]))
        return self._order

    def of_agent(self, agent: str) -> list[str]:
        return [k for k in self.order() if self.convs[k].agent == agent]

    def agent_ids(self) -> list[str]:
        """Agents in order, and "" last when some conversation's agent is not known yet."""
        ids = [a for a in self.agents if any(c.agent == a for c in self.convs.values())]
        return ids + ([""] if any(c.agent not in self.agents for c in self.convs.values()) else [])

    def agent(self, agent: str) -> AgentInfo:
        return self.agents.get(agent) or AgentInfo(agent)

    def working(self) -> list[str]:
        return [k for k in self.order() if self.convs[k].in_flight is not None]

    def step(self, current: str | None, delta: int, working_only: bool) -> str | None:
        """The next conversation after `current` (cyclic); with `working_only`, only those with a turn in flight."""
        order = self.order()
        pool = {k for k in order if self.convs[k].in_flight is not None} if working_only else set(order)
        if not pool:
            return None
        current = self.resolve(current)
        if current is None:
            return next(k for k in (order if delta > 0 else reversed(order)) if k in pool)
        i, n = order.index(current), len(order)
        for j in range(1, n + 1):
            k = order[(i + delta * j) % n]
            if k in pool:
                return k
        return None

    # --- screens -------------------------------------------------------------------------------

    def screen(self, key: str) -> deque[str]:
        """The last SCREEN_LINES lines of a conversation; one of the last SCREENS looked at."""
        screen = self._screens.get(key)
        if screen is None:
            screen = deque(maxlen=SCREEN_LINES)
            for rec in self.records(key):
                screen.extend(render.lines(rec))
            self._screens[key] = screen
            while len(self._screens) > SCREENS:
                self._screens.popitem(last=False)
        self._screens.move_to_end(key)
        return screen

    def kept(self) -> list[str]:
        """The conversations whose screens are kept, oldest first."""
        return list(self._screens)

    def hidden(self, key: str) -> int:
        """Lines of this conversation no longer on its screen (read them with `full`)."""
        screen = self._screens.get(key)
        return self.convs[key].lines - len(screen) if screen is not None else 0

    def records(self, key: str) -> list[dict[str, Any]]:
        """Every record of one conversation, read back from the journal."""
        out = []
        with open(self.path, "rb") as f:
            for offset in self.convs[key].offsets:
                f.seek(offset)
                try:
                    out.append(json.loads(f.readline()))
                except json.JSONDecodeError:
                    continue
        return out

    def full(self, key: str) -> list[str]:
        """The whole record of one conversation, however long."""
        return [line for rec in self.records(key) for line in render.lines(rec)]

    # --- figures -------------------------------------------------------------------------------

    def counts(self, keys: list[str] | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.convs if keys is None else keys:
            s = self.convs[k].status(self.over)
            out[s] = out.get(s, 0) + 1
        return out

    def now(self) -> float:
        """The run's clock: the wall clock while it runs, its end once it ended, replay time when replaying."""
        if self.run_ended is not None:
            return self.run_ended
        if self.speed is not None:
            return self.last_record
        return time.time()

    def abandon(self) -> None:
        """Its writer is gone without saying the run ended (killed outright): it is over, unfinished."""
        self.run_ended, self.run_status = self.last_record, "unfinished"
        for c in self.convs.values():
            if c.in_flight is not None:
                c.turn_seconds += self.last_record - c.in_flight
                c.in_flight, c.last_turn = None, "stopped"

    def close(self) -> None:
        self.tail.close()
