"""A run as Chrome trace-event JSON, which ui.perfetto.dev opens.

One track per flow call and one per session; a slice per call, per turn and per tool call
(tool slices sit inside their turn's slice on the session's track).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoal.errors import CannotWrite
from shoal.journal import Run


def events(run: Run) -> list[dict[str, Any]]:
    t0 = run.began
    end = run.ended or max([run.began] + [t.ended or t.began for s in run.all_sessions() for t in s.turns])

    def us(t: float | None) -> int:
        return int(((t if t is not None else end) - t0) * 1e6)

    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                                  "args": {"name": f"shoal run {run.id}"}}]
    tid = 0
    for call in run.calls():
        tid += 1
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": f"flow {call.flow}"}})
        out.append({"ph": "X", "name": call.flow, "cat": "flow", "pid": 1, "tid": tid, "ts": us(call.began),
                    "dur": max(us(call.ended) - us(call.began), 0),
                    "args": {"status": call.status, "tokens": call.tokens, "cost": call.cost, "error": call.error}})
    for session in run.all_sessions():
        tid += 1
        label = f"session {session.name or session.id} ({session.backend}/{session.model})"
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": label}})
        for turn in session.turns:
            out.append({"ph": "X", "name": f"turn {turn.number}", "cat": "turn", "pid": 1, "tid": tid,
                        "ts": us(turn.began), "dur": max(us(turn.ended) - us(turn.began), 0),
                        "args": {"status": turn.status, "tokens": turn.tokens, "cost": turn.cost,
                                 "prompt": turn.prompt[:200], "error": turn.error}})
            for tool in turn.tools:
                began = us(tool["began"])
                ended = us(tool.get("ended") or turn.ended)
                out.append({"ph": "X", "name": str(tool.get("tool")), "cat": "tool", "pid": 1, "tid": tid,
                            "ts": began, "dur": max(ended - began, 0),
                            "args": {"exit_code": tool.get("exit_code"), "input": tool.get("input")}})
    return out


def export(run: Run, path: Path) -> Path:
    text = json.dumps({"traceEvents": events(run), "displayTimeUnit": "ms"})
    try:
        path.write_text(text)
    except OSError as exc:
        raise CannotWrite(f"cannot write the perfetto trace to {path}: {exc.strerror or exc}; "
                          "pass a path in a directory that exists and can be written") from None
    return path
