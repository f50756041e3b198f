"""What codex says, as shoal events: items of `codex exec --json` and app-server notifications,
usage, and which errors are the model provider's."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from shoal.errors import ProviderError, TurnFailed
from shoal.reply import Event, Notice, StepUsage, Text, ToolFinished, ToolStarted, Usage

STATUS_OF = {"unauthorized": 401, "rateLimitExceeded": 429, "usageLimitExceeded": 429, "badRequest": 400,
             "internalServerError": 500, "serverOverloaded": 503, "modelNotFound": 404}
# codexErrorInfo values that are not about the model provider (everything else is)
NOT_PROVIDER = {"other", "sandboxError", "threadRollbackFailed", "tooManyDenials", "activeTurnNotSteerable"}
# `codex exec` reports only a message; these are the ones a provider (or the way to it) caused
PROVIDER_MESSAGE = re.compile(r"unexpected status|retry limit|high demand|stream disconnected|error sending request"
                              r"|rate limit|quota|unauthorized", re.I)
REQUEST_ID = re.compile(r"request[ _-]id:?\s*([\w-]+)", re.I)
HTTP_STATUS = re.compile(r"\bstatus:?\s*(\d{3})\b")


class ServerTurn:
    """One app-server turn: its notifications in, shoal events out, one StepUsage at the end."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.done = False
        self._started: set[str] = set()
        self._base: Usage | None = None  # the thread's total before this turn's first model call
        self._total = Usage()
        self._error: dict[str, Any] | None = None

    def feed(self, msg: dict[str, Any], session_id: str | None) -> list[Event]:
        method, params = msg.get("method"), msg.get("params") or {}
        turn = params.get("turn") or {}
        if params.get("turnId", turn.get("id", self.turn_id)) != self.turn_id:
            return []  # a late notification of an earlier (interrupted) turn
        if method in ("item/started", "item/completed"):
            item = _camel_item(params.get("item") or {})
            done = method == "item/completed"
            events = item_events(item, done=done, already=item.get("id") in self._started)
            self._started.add(str(item.get("id")))
            return events
        if method == "thread/tokenUsage/updated":
            usage = params.get("tokenUsage") or {}
            total, last = usage_of(usage.get("total") or {}), usage_of(usage.get("last") or {})
            if self._base is None:
                self._base = Usage(total.input_tokens - last.input_tokens, total.output_tokens - last.output_tokens,
                                   total.cached_tokens - last.cached_tokens)
            self._total = total
            return []
        if method == "error":
            err = params.get("error") or {}
            if params.get("willRetry"):
                return [Notice("retry", f"{err.get('message')}: {err.get('additionalDetails') or ''}".strip(": "))]
            self._error = err
            return []
        if method != "turn/completed":
            return []
        self.done = True
        base = self._base or self._total
        used = Usage(self._total.input_tokens - base.input_tokens, self._total.output_tokens - base.output_tokens,
                     self._total.cached_tokens - base.cached_tokens)
        status = turn.get("status")
        if status == "completed":
            return [StepUsage(used)]
        if status == "interrupted":
            raise TurnFailed("codex turn was interrupted", backend="codex", session_id=session_id)
        raise provider_error(turn.get("error") or self._error or {"message": f"codex turn ended {status}"},
                             session_id)


def _camel_item(item: dict[str, Any]) -> dict[str, Any]:
    """An app-server item in `codex exec`'s spelling, so one mapping serves both transports."""
    kind = {"commandExecution": "command_execution", "fileChange": "file_change", "agentMessage": "agent_message",
            "mcpToolCall": "mcp_tool_call", "webSearch": "web_search"}.get(str(item.get("type")), item.get("type"))
    changes = [{"path": c.get("path"), "kind": _kind(c.get("kind"))} for c in item.get("changes") or []]
    return {**item, "type": kind, "aggregated_output": item.get("aggregatedOutput"),
            "exit_code": item.get("exitCode"), "changes": changes}


def _kind(kind: Any) -> str:
    return str(kind.get("type") if isinstance(kind, dict) else kind)  # {"type": "add"} on the server


def item_events(item: dict[str, Any], *, done: bool, already: bool = False) -> list[Event]:
    """ToolStarted / ToolFinished / Text for one codex item (exec spelling), started or completed."""
    kind, call_id, status = item.get("type"), str(item.get("id", "")), item.get("status")
    args: dict[str, Any]
    if kind == "agent_message":
        return [Text(str(item["text"]))] if done and item.get("text") else []
    if kind == "command_execution":
        tool, args = "shell", {"command": _unwrap(str(item.get("command", "")))}
        code = item.get("exit_code")
        ok = code == 0 if code is not None else status == "completed"
        finished = ToolFinished(call_id, tool, args, str(item.get("aggregated_output") or ""), code, ok)
    elif kind == "file_change":
        changes = [{"path": str(c.get("path")), "kind": str(c.get("kind"))} for c in item.get("changes") or []]
        tool, args = "apply_patch", {"changes": changes}
        summary = "\n".join(f"{c['kind']} {c['path']}" for c in changes)
        finished = ToolFinished(call_id, tool, args, summary, None, status == "completed")
    elif kind == "mcp_tool_call":
        tool, args = f"{item.get('server')}.{item.get('tool')}", dict(item.get("arguments") or {})
        output = json.dumps(item.get("result") or item.get("error"))
        finished = ToolFinished(call_id, tool, args, output, None, status == "completed")
    elif kind == "web_search":
        tool, args = "web_search", {"query": str(item.get("query", ""))}
        finished = ToolFinished(call_id, tool, args, "", None, True)
    elif kind == "error" and done:
        return [Notice("warning", str(item.get("message", "")))]
    else:
        return []
    started = ToolStarted(call_id, tool, args)
    if not done:
        return [started]
    return [finished] if already else [started, finished]


def _unwrap(command: str) -> str:
    """`/bin/bash -lc 'cat a.txt'` -> `cat a.txt`: the command as the model wrote it."""
    try:
        parts = shlex.split(command)
    except ValueError:
        return command
    if len(parts) == 3 and parts[0].rsplit("/", 1)[-1] in ("bash", "sh", "zsh") and parts[1] in ("-lc", "-c"):
        return parts[2]
    return command


def usage_of(u: dict[str, Any], *, snake: bool = False) -> Usage:
    keys = ("input_tokens", "output_tokens", "cached_input_tokens") if snake else (
        "inputTokens", "outputTokens", "cachedInputTokens")
    return Usage(*(int(u.get(k) or 0) for k in keys))


def provider_error(err: dict[str, Any], session_id: str | None, *, exit_code: int | None = None,
                   stderr: str = "") -> TurnFailed:
    """A codex error (TurnError / exec `turn.failed`) as ProviderError when a provider said no."""
    message = str(err.get("message") or "codex reported an error")
    hay = f"{message} {err.get('additionalDetails') or ''}"
    info = err.get("codexErrorInfo")
    status: int | None = None
    if isinstance(info, dict):  # {"httpConnectionFailed": {"httpStatusCode": 401}} and its kin
        for detail in info.values():
            if isinstance(detail, dict) and detail.get("httpStatusCode"):
                status = int(detail["httpStatusCode"])
    elif isinstance(info, str):
        status = STATUS_OF.get(info)
    if status is None and (m := HTTP_STATUS.search(hay)):
        status = int(m.group(1))
    from_provider = (status is not None or isinstance(info, dict)
                     or (isinstance(info, str) and info not in NOT_PROVIDER) or bool(PROVIDER_MESSAGE.search(hay)))
    rid = m.group(1) if (m := REQUEST_ID.search(hay)) else None
    common: dict[str, Any] = {"backend": "codex", "exit_code": exit_code, "stderr_tail": stderr,
                              "request_id": rid, "session_id": session_id}
    if from_provider:
        hint = {401: " (check the provider's API key)", 429: " (rate limited; retry later)"}.get(status or 0, "")
        return ProviderError(f"provider error {status or ''}: {message}{hint}".replace(" :", ":"), status=status,
                             **common)
    return TurnFailed(f"codex: {message}", **common)
