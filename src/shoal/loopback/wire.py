"""What the three wire formats share: SSE framing, fixed usage, filling a tool's arguments."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from shoal.loopback.script import Conversation, FinalMove, ToolMove

# Every request reports this usage, so a turn's tokens (and so its cost) are predictable.
INPUT_TOKENS = 1000
OUTPUT_TOKENS = 50
MODEL = "loopback"


class WireFormat(Protocol):
    name: str

    def conversation(self, body: dict[str, Any]) -> Conversation: ...

    def stream(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> Iterator[bytes]: ...

    def complete(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> dict[str, Any]: ...

    def error(self, status: int, message: str) -> dict[str, Any]: ...


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def fill_required(schema: dict[str, Any] | None, args: dict[str, Any]) -> dict[str, Any]:
    """CLIs validate tool input: give any required field we do not set a harmless value."""
    if not schema:
        return args
    props = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name in args:
            continue
        kind = (props.get(name) or {}).get("type")
        args[name] = {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}.get(
            str(kind), "loopback step"
        )
    return args


def text_of(content: Any) -> str:
    """Text of a message content that is a string or a list of typed parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""
