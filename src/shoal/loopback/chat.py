"""OpenAI Chat Completions, as opencode speaks it (via @ai-sdk/openai-compatible)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from shoal.loopback.script import Conversation, FinalMove, ToolMove, absolute, shell_write
from shoal.loopback.wire import INPUT_TOKENS, OUTPUT_TOKENS, fill_required, new_id, now, sse, text_of


class Chat:
    name = "chat"

    def conversation(self, body: dict[str, Any]) -> Conversation:
        conv = Conversation()
        for msg in body.get("messages") or []:
            role = msg.get("role")
            if role == "system":
                conv.system_text += text_of(msg.get("content")) + "\n"
            elif role == "user":
                conv.add_user(text_of(msg.get("content")))
            elif role == "tool":
                conv.add_result()
        conv.tools = [t.get("function", {}).get("name", "") for t in body.get("tools") or []]
        return conv

    def _call(self, body: dict[str, Any], conv: Conversation, move: ToolMove) -> tuple[str, dict[str, Any]]:
        schemas = {
            t.get("function", {}).get("name"): t.get("function", {}).get("parameters")
            for t in body.get("tools") or []
        }
        if move.kind == "write" and "write" in schemas:
            args = {"filePath": absolute(move.path, conv.cwd), "content": move.text + "\n"}
            return "write", fill_required(schemas["write"], args)
        command = move.command if move.kind == "run" else shell_write(move.path, move.text)
        return "bash", fill_required(schemas.get("bash"), {"command": command, "description": "loopback step"})

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": INPUT_TOKENS,
            "completion_tokens": OUTPUT_TOKENS,
            "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS,
        }

    def stream(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> Iterator[bytes]:
        cid, model, created = new_id("chatcmpl-"), body.get("model", "loopback"), now()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        yield chunk({"role": "assistant", "content": ""})
        if isinstance(move, ToolMove):
            name, args = self._call(body, conv, move)
            call = {"index": 0, "id": new_id("call_"), "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}
            yield chunk({"tool_calls": [call]})
            yield chunk({}, "tool_calls")
        else:
            yield chunk({"content": move.text})
            yield chunk({}, "stop")
        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": self._usage()})
        yield sse("[DONE]")

    def complete(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if isinstance(move, ToolMove):
            name, args = self._call(body, conv, move)
            message["tool_calls"] = [{"id": new_id("call_"), "type": "function",
                                      "function": {"name": name, "arguments": json.dumps(args)}}]
            finish = "tool_calls"
        else:
            message["content"], finish = move.text, "stop"
        return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(),
                "model": body.get("model", "loopback"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": self._usage()}

    def error(self, status: int, message: str) -> dict[str, Any]:
        kind = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status, "server_error")
        return {"error": {"message": message, "type": kind, "code": kind}}
