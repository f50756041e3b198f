"""What opencode's server says about a turn, as shoal events.

The server's event stream reports every part of a message each time it changes: a tool
part goes pending, running, completed (or error); a text part is created empty and updated
until its `time.end` is set. `ServerTurn` keeps what it has already said, so each tool call,
text and step is yielded once, and knows the turn is over when its session goes idle.
"""

from __future__ import annotations

from typing import Any

from shoal.reply import Event, Notice, StepUsage, Text, ToolFinished, ToolStarted, Usage

# the words of opencode's refusal of a tool call that a permission rule denies
REFUSAL = "rule which prevents you"


def usage_of(part: dict[str, Any]) -> Usage:
    """Usage of one step-finish part (the same shape in `run --format json` and on the server)."""
    tokens = part.get("tokens") or {}
    cache = tokens.get("cache") or {}
    return Usage(int(tokens.get("input", 0)), int(tokens.get("output", 0)),
                 int(cache.get("read", 0)), float(part.get("cost") or 0.0))

def refused(tool: str, args: dict[str, Any], error: str) -> list[Event]:
    """A Notice naming what a permission rule refused, if that is why a tool call failed."""
    if REFUSAL not in error:
        return []
    target = args.get("filePath") or args.get("command") or args.get("url") or args.get("pattern") or ""
    return [Notice("refused", f"a permission rule refused {tool} {target}".strip())]


class ServerTurn:
    """Turns one session's server events into shoal events, each once, and knows when it ended."""

    def __init__(self) -> None:
        self.done = False
        self.busy = False  # an idle counts only after the session was seen busy with this turn
        self.answering = False  # the turn's answer (an assistant message) exists
        self._idle = False
        self.error: dict[str, Any] | None = None
        self._users: set[str] = set()  # the prompt's own message: its text is not an answer
        self._others: set[str] = set()  # answers to earlier prompts: theirs, not this turn's
        self._seen: set[str] = set()

    def feed(self, payload: dict[str, Any]) -> list[Event]:
        kind = payload.get("type")
        props = payload.get("properties") or {}
        if kind == "message.part.updated":
            return self.part(props.get("part") or {})
        if kind == "message.updated":
            info = props.get("info") or {}
            if info.get("role") == "user":
                self._users.add(str(info.get("id")))
            elif info.get("role") == "assistant" and info.get("parentID") in self._users:
                self.answering = True
            elif info.get("role") == "assistant":
                self._others.add(str(info.get("id")))  # an earlier turn's, updated late (an abort)
        elif kind == "session.status":
            status = (props.get("status") or {}).get("type")
            self.busy = self.busy or status in ("busy", "retry")
            self._idle = self._idle or (status == "idle" and self.busy)
        elif kind == "session.idle":
            self._idle = self._idle or self.busy
        elif kind == "session.error":
            error = props.get("error") or {}
            if error.get("name") != "MessageAbortedError":  # our own abort is not the turn's failure
                self.error = error
        # Idle with neither an answer nor an error is not an end yet: opencode can report a
        # broken loop as idle first and its error just after.
        self.done = self.done or (self._idle and (self.answering or self.error is not None))
        if kind == "permission.asked":
            what = f"{props.get('permission')} {' '.join(props.get('patterns') or [])}".strip()
            return [Notice("refused", f"opencode asked permission for {what}; refused, as nothing may wait "
                                      "for a human in a headless run (allow it in the agent's permissions)")]
        if kind == "question.asked":
            return [Notice("refused", "opencode's question tool asked the user something; refused, as "
                                      "nothing may wait for a human in a headless run")]
        return []

    def part(self, part: dict[str, Any]) -> list[Event]:
        message = str(part.get("messageID"))
        if message in self._users or message in self._others:
            return []
        kind, pid = part.get("type"), str(part.get("id"))
        if kind == "text" and (part.get("time") or {}).get("end") and part.get("text") and self._once(pid):
            return [Text(part["text"])]
        if kind == "step-finish" and self._once(pid):
            return [StepUsage(usage_of(part))]
        if kind != "tool":
            return []
        state = part.get("state") or {}
        status = state.get("status")
        call, tool, args = str(part.get("callID", "")), str(part.get("tool", "")), state.get("input") or {}
        out: list[Event] = []
        if status in ("running", "completed", "error") and self._once("start " + call):
            out.append(ToolStarted(call, tool, args))
        if status in ("completed", "error") and self._once("end " + call):
            failed = status == "error"
            exit_code = (state.get("metadata") or {}).get("exit")
            output = str(state.get("error") if failed else state.get("output", ""))
            out.append(ToolFinished(call, tool, args, output, exit_code, ok=not failed and exit_code in (None, 0)))
            out += refused(tool, args, output) if failed else []
        return out

    def _once(self, key: str) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
