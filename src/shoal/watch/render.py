"""One journal record as the lines a conversation's screen shows.

Plain strings, one per screen line: the screen keeps two thousand of them per conversation,
so they must be cheap to hold and to count. The first character says what a line is (see
`MARKS`), which is all the screen needs to colour it.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

# the first character of a line -> what it is (the screen's colours key on these)
MARKS = {"─": "turn", ">": "prompt", "$": "command", "│": "output", "✓": "ok", "✗": "failed",
         "!": "notice", "·": "info", "⚙": "tool"}
WIDTH = 400  # a line longer than this is cut: the full record (`f`) has it whole


def lines(rec: dict[str, Any]) -> list[str]:
    """The screen lines for one record ([] for records a conversation's screen does not show)."""
    kind = rec.get("kind")
    fn = _RENDER.get(str(kind))
    return [_cut(x) for x in fn(rec)] if fn else []


def _cut(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 1] + "…"


def _split(text: object) -> list[str]:
    return str(text or "").rstrip("\n").splitlines() or [""]


def _turn_began(r: dict[str, Any]) -> list[str]:
    return [f"── turn {r.get('turn', '?')} ──", *("> " + x for x in _split(r.get("prompt")))]


def _text(r: dict[str, Any]) -> list[str]:
    return _split(r.get("text"))


def command_of(value: object) -> str | None:
    """The shell command a tool call ran, when its input says (`command`, `cmd`, a list or a string)."""
    if isinstance(value, dict):
        value = value.get("command", value.get("cmd"))
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        # codex spells commands as argv, often `bash -lc "..."`: show what the shell ran
        if len(value) == 3 and value[1] in ("-c", "-lc"):
            return value[2]
        return shlex.join(value)
    return value if isinstance(value, str) else None


def _tool_started(r: dict[str, Any]) -> list[str]:
    command = command_of(r.get("input"))
    if command is not None:
        first, *rest = _split(command)
        return [f"$ {first}", *(f"  {x}" for x in rest)]
    shown = r.get("input")
    text = shown if isinstance(shown, str) else json.dumps(shown, default=str)
    return [f"⚙ {r.get('tool', 'tool')} {text}"]


def _tool_finished(r: dict[str, Any]) -> list[str]:
    out = [f"│ {x}" for x in str(r.get("output") or "").rstrip("\n").splitlines()]
    ok, code, tool = r.get("ok", True), r.get("exit_code"), r.get("tool", "tool")
    mark = "✓" if ok and code in (None, 0) else "✗"
    out.append(f"{mark} {tool} exit {code}" if code is not None else f"{mark} {tool} {'done' if ok else 'failed'}")
    return out


def usage_line(usage: dict[str, Any]) -> str:
    tin, tout = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
    cached = int(usage.get("cached_tokens", 0))
    cost = float(usage.get("cost", 0))
    return f"{tin} in + {tout} out tok" + (f" ({cached} cached)" if cached else "") + f" · ${cost:.4f}"


def _turn_ended(r: dict[str, Any]) -> list[str]:
    status = r.get("status", "ok")
    head = (f"── turn {r.get('turn', '?')} {status} · {usage_line(r.get('usage') or {})}"
            f" · {float(r.get('seconds') or 0):.1f} s ──")
    error = str(r.get("error") or "")
    return [head, *(f"✗ {x}" for x in _split(error)[:5])] if error else [head]


def _notice(r: dict[str, Any]) -> list[str]:
    return [f"! {r.get('what', 'notice')}: {x}" for x in _split(r.get("message"))[:3]]


def _opened(r: dict[str, Any]) -> list[str]:
    transport = f", {r['transport']} transport" if r.get("transport") else ""
    return [f"· {r.get('backend', '?')}/{r.get('model', '?')} at {r.get('place') or r.get('cwd') or '?'}"
            f"{transport}; {r.get('backend', '')} session {r.get('backend_session') or '?'}"]


def _made(r: dict[str, Any]) -> list[str]:
    return [f"· conversation {r.get('name', '?')} of {r.get('agent_name') or r.get('agent', '?')}, "
            f"at {r.get('place') or '?'}"]


def _unit(r: dict[str, Any]) -> list[str]:
    error = f": {r['error']}" if r.get("error") else ""
    tries = f" (try {r['tries']})" if int(r.get("tries") or 0) > 1 else ""
    mark = {"failed": "✗", "stuck": "✗", "passed": "✓"}.get(str(r.get("status")), "·")
    return [f"{mark} unit {r.get('task', '?')}: {r.get('status', '?')}{tries}{error}"]


def _kept(r: dict[str, Any]) -> list[str]:
    return [f"· {x}" for x in _split(r.get("note"))]


def _close_failed(r: dict[str, Any]) -> list[str]:
    return [f"✗ closing failed: {r.get('error', '')}"]


_RENDER = {
    "turn.began": _turn_began, "text": _text, "tool.started": _tool_started, "tool.finished": _tool_finished,
    "turn.ended": _turn_ended, "notice": _notice, "session.opened": _opened, "session.made": _made,
    "unit.status": _unit, "place.kept": _kept, "session.close_failed": _close_failed,
}
