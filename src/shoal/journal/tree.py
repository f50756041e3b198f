"""Reading a run's record back as the tree it ran as: calls, their sessions, their turns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import RunNotFound
from shoal.journal.record import runs_dir


@dataclass
class Turn:
    session: str
    number: int
    prompt: str
    began: float
    ended: float | None = None
    status: str = "running"
    tokens: int = 0
    cost: float = 0.0
    error: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return (self.ended or self.began) - self.began


@dataclass
class SessionNode:
    id: str
    name: str = ""
    agent: str = ""
    backend: str = ""
    model: str = ""
    place: str = ""
    backend_session: str = ""
    log: Path | None = None  # the backend's own record of it, kept in the run's `logs/`
    turns: list[Turn] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.turns)

    @property
    def cost(self) -> float:
        return sum(t.cost for t in self.turns)

    @property
    def status(self) -> str:
        return self.turns[-1].status if self.turns else "idle"


@dataclass
class Call:
    """One flow call: its own record, its sessions, the calls it made."""

    id: str
    flow: str
    parent: str | None
    began: float
    ended: float | None = None
    status: str = "running"
    error: str = ""
    children: list[Call] = field(default_factory=list)
    sessions: list[SessionNode] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return (self.ended or self.began) - self.began

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sessions) + sum(c.tokens for c in self.children)

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.sessions) + sum(c.cost for c in self.children)

    def walk(self) -> list[Call]:
        out = [self]
        for c in self.children:
            out.extend(c.walk())
        return out


@dataclass
class Run:
    id: str
    dir: Path
    began: float
    ended: float | None = None
    status: str = "unfinished"  # what a run killed outright reads as
    name: str = ""
    roots: list[Call] = field(default_factory=list)
    sessions: list[SessionNode] = field(default_factory=list)  # opened outside any flow call

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.roots) + sum(s.tokens for s in self.sessions)

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.roots) + sum(s.cost for s in self.sessions)

    @property
    def seconds(self) -> float:
        return (self.ended or self.began) - self.began

    def calls(self) -> list[Call]:
        return [c for r in self.roots for c in r.walk()]

    def all_sessions(self) -> list[SessionNode]:
        return self.sessions + [s for c in self.calls() for s in c.sessions]


def lines(path: Path) -> list[dict[str, Any]]:
    """Every whole line of a journal; a torn last line (a killed writer) is left out."""
    out = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if not raw.endswith("\n"):
                break
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                break
    return out


def find(ref: str | Path | None = None, base: Path | None = None) -> Path:
    """A run's directory: a path, a run id (or its suffix), or the latest run when None."""
    if ref is not None and Path(ref).is_dir():
        return Path(ref)
    root = runs_dir(base)
    runs = sorted(p for p in root.glob("*-*") if (p / "journal.jsonl").exists()) if root.is_dir() else []
    if ref is None:
        if not runs:
            raise RunNotFound(f"no runs under {root} yet: `shoal run` or a batch writes one there "
                              f"(or name a run directory, or set SHOAL_RUNS to where yours are)")
        return runs[-1]
    matches = [p for p in runs if p.name.endswith(str(ref)) or p.name == str(ref)]
    if not matches:
        known = ", ".join(p.name for p in runs[-3:])
        raise RunNotFound(f"no run {ref!r} under {root}" + (f" (the latest: {known})" if known else " (none yet)"))
    return matches[-1]


def read(ref: str | Path | None = None, base: Path | None = None) -> Run:
    """Read a run back as the tree it ran as."""
    d = find(ref, base)
    if not (d / "journal.jsonl").is_file():
        raise RunNotFound(f"{d} holds no journal.jsonl: it is not a shoal run directory")
    records = lines(d / "journal.jsonl")
    run = Run(id=d.name.rsplit("-", 1)[-1], dir=d, began=records[0]["t"] if records else 0.0)
    calls: dict[str, Call] = {}
    sessions: dict[str, SessionNode] = {}
    owner: dict[str, str | None] = {}  # session id -> call id that opened it
    turns: dict[tuple[str, int], Turn] = {}
    for r in records:
        kind = r.get("kind")
        if kind == "run.began":
            run.name = r.get("name", "")
        elif kind == "run.ended":
            run.ended, run.status = r["t"], r.get("status", "ok")
        elif kind == "flow.called":
            call = Call(r["call"], r.get("flow", "?"), r.get("parent"), r["t"])
            calls[call.id] = call
            parent = calls.get(call.parent or "")
            (parent.children if parent else run.roots).append(call)
        elif kind == "flow.returned" and r.get("call") in calls:
            c = calls[r["call"]]
            c.ended, c.status, c.error = r["t"], r.get("status", "ok"), r.get("error", "")
        elif kind == "session.adopted":
            owner[r["session"]] = r.get("call")
        elif kind == "session.opened":
            node = _session(r["session"], sessions, owner, calls, run)
            for key in ("name", "agent", "backend", "model", "place", "backend_session"):
                setattr(node, key, r.get(key) or "")
            if r.get("log"):
                node.log = d / r["log"]
        elif kind == "session.log":  # a log the backend made only after the session opened
            _session(r["session"], sessions, owner, calls, run).log = d / r["log"]
        elif kind == "turn.began":
            node = _session(r["session"], sessions, owner, calls, run)
            turn = Turn(r["session"], r["turn"], r.get("prompt", ""), r["t"])
            turns[(r["session"], r["turn"])] = turn
            node.turns.append(turn)
        elif kind == "turn.ended" and (r["session"], r["turn"]) in turns:
            turn = turns[(r["session"], r["turn"])]
            usage = r.get("usage") or {}
            turn.ended, turn.status, turn.error = r["t"], r.get("status", "ok"), r.get("error", "")
            turn.tokens = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
            turn.cost = float(usage.get("cost", 0.0))
        elif kind in ("tool.started", "tool.finished") and (r["session"], r.get("turn")) in turns:
            tools = turns[(r["session"], r["turn"])].tools
            if kind == "tool.started":
                tools.append({"call": r.get("tool_call"), "tool": r.get("tool"), "input": r.get("input"),
                              "began": r["t"], "ended": None})
            else:
                match = next((t for t in reversed(tools) if t["call"] == r.get("tool_call")), None)
                if match is None:
                    match = {"call": r.get("tool_call"), "tool": r.get("tool"), "began": r["t"]}
                    tools.append(match)
                match.update(ended=r["t"], exit_code=r.get("exit_code"), ok=r.get("ok"))
    return run


def _session(sid: str, sessions: dict[str, SessionNode], owner: dict[str, str | None],
             calls: dict[str, Call], run: Run) -> SessionNode:
    if sid not in sessions:
        node = sessions[sid] = SessionNode(sid)
        call = calls.get(owner.get(sid) or "")
        (call.sessions if call else run.sessions).append(node)
    return sessions[sid]


def as_dict(run: Run) -> dict[str, Any]:
    """The run as plain data (for `shoal trace --json`): every node with its figures rolled up."""

    def session(s: SessionNode) -> dict[str, Any]:
        return {"id": s.id, "name": s.name, "agent": s.agent, "backend": s.backend, "model": s.model,
                "place": s.place, "backend_session": s.backend_session, "log": str(s.log) if s.log else None,
                "status": s.status, "tokens": s.tokens, "cost": s.cost,
                "turns": [{"number": t.number, "prompt": t.prompt, "status": t.status, "began": t.began,
                           "ended": t.ended, "seconds": t.seconds, "tokens": t.tokens, "cost": t.cost,
                           "error": t.error, "tools": t.tools} for t in s.turns]}

    def call(c: Call) -> dict[str, Any]:
        return {"id": c.id, "flow": c.flow, "status": c.status, "error": c.error, "began": c.began,
                "ended": c.ended, "seconds": c.seconds, "tokens": c.tokens, "cost": c.cost,
                "sessions": [session(s) for s in c.sessions], "calls": [call(k) for k in c.children]}

    return {"id": run.id, "dir": str(run.dir), "name": run.name, "status": run.status, "began": run.began,
            "ended": run.ended, "seconds": run.seconds, "tokens": run.tokens, "cost": run.cost,
            "sessions": [session(s) for s in run.sessions], "calls": [call(c) for c in run.roots]}
