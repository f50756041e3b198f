"""Anthropic Messages, as Claude Code speaks it.

Claude Code 2.1.332 sends its context (environment with "Primary working directory", model
notes, skills, date, remaining-token counters) as `<system-reminder>` text blocks inside *user*
messages, next to the real prompt and even in a later turn's message. Those blocks are context,
not the user speaking: they are moved to the system text block by block, so a prompt without
directives ("remember: apple") still counts as a user text. Older builds put the environment
in a `role: system` message entry; that is still accepted.

Claude Code's Write refuses to overwrite a file the conversation has not Read (or that changed
since). So `#! write` on a file that already exists first calls Read on it; that call is not a
step of the script (its result is not counted), and the next request makes the Write.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shoal.loopback.script import Conversation, FinalMove, ToolMove, absolute, shell_write
from shoal.loopback.wire import INPUT_TOKENS, OUTPUT_TOKENS, fill_required, new_id, sse, text_of

# Context Claude Code wraps into user messages (see the module docstring).
REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL)


@dataclass
class ClaudeConversation(Conversation):
    read: set[str] = field(default_factory=set)  # files Read since the latest user text

    def add_user(self, text: str) -> None:
        said = len(self.user_texts)
        super().add_user(text)
        if len(self.user_texts) != said:
            self.read.clear()


class Messages:
    name = "messages"

    def conversation(self, body: dict[str, Any]) -> Conversation:
        conv = ClaudeConversation(system_text=text_of(body.get("system")) + "\n")
        reads: dict[str, str] = {}  # tool_use id of a Read -> its file
        for msg in body.get("messages") or []:
            role, content = msg.get("role"), msg.get("content")
            if role == "system":  # older builds put their environment block here
                conv.system_text += text_of(content) + "\n"
            elif role == "assistant" and isinstance(content, list):
                for b in content:
                    if isinstance(b, dict) and b.get("type") == "tool_use" and b.get("name") == "Read":
                        reads[str(b.get("id"))] = str((b.get("input") or {}).get("file_path", ""))
            elif role == "user":
                blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
                for b in blocks:
                    if not isinstance(b, dict):
                        continue
                    if b.get("type") == "tool_result" and str(b.get("tool_use_id")) in reads:
                        conv.read.add(reads[str(b.get("tool_use_id"))])  # a Read before a write
                    elif b.get("type") == "tool_result":
                        conv.add_result()
                    elif b.get("type") == "text":
                        text = str(b.get("text", ""))
                        conv.system_text += "".join(REMINDER.findall(text)) + "\n"
                        # One block, one prompt: a turn that got no answer (a failed one) is
                        # merged by Claude Code into the next turn's message as an earlier block.
                        if spoken := REMINDER.sub("", text).strip():
                            conv.add_user(spoken)
        conv.tools = [str(t.get("name", "")) for t in body.get("tools") or []]
        return conv

    def _block(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> dict[str, Any]:
        if isinstance(move, FinalMove):
            return {"type": "text", "text": move.text}
        schemas = {t.get("name"): t.get("input_schema") for t in body.get("tools") or []}
        path = absolute(move.path, conv.cwd)
        read = conv.read if isinstance(conv, ClaudeConversation) else set()
        if move.kind == "write" and "Read" in schemas and os.path.isfile(path) and path not in read:
            name, args = "Read", {"file_path": path}  # Write overwrites only what was Read
        elif move.kind == "write" and "Write" in schemas:
            name = "Write"
            args = {"file_path": path, "content": move.text + "\n"}
        else:
            name = "Bash"
            args = {"command": move.command if move.kind == "run" else shell_write(move.path, move.text)}
        return {"type": "tool_use", "id": new_id("toolu_"), "name": name,
                "input": fill_required(schemas.get(name), args)}

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def stream(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> Iterator[bytes]:
        block = self._block(body, conv, move)
        stop = "tool_use" if block["type"] == "tool_use" else "end_turn"
        message: dict[str, Any] = {
            "id": new_id("msg_"), "type": "message", "role": "assistant", "model": body.get("model"),
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**self._usage(), "output_tokens": 1}}
        yield sse({"type": "message_start", "message": message}, "message_start")
        if block["type"] == "tool_use":
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        yield sse({"type": "content_block_start", "index": 0, "content_block": start}, "content_block_start")
        yield sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
        yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        yield sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                   "usage": self._usage()}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    def complete(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> dict[str, Any]:
        block = self._block(body, conv, move)
        return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": body.get("model"),
                "content": [block], "stop_reason": "tool_use" if block["type"] == "tool_use" else "end_turn",
                "stop_sequence": None, "usage": self._usage()}

    def error(self, status: int, message: str) -> dict[str, Any]:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
