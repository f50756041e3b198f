"""OpenAI Responses, as Codex CLI speaks it (full history re-sent, freeform apply_patch)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from shoal.loopback.script import Conversation, FinalMove, ToolMove, shell_write
from shoal.loopback.wire import INPUT_TOKENS, OUTPUT_TOKENS, fill_required, new_id, sse, text_of

RESULT_ITEMS = {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}


class Responses:
    name = "responses"

    def conversation(self, body: dict[str, Any]) -> Conversation:
        conv = Conversation(system_text=str(body.get("instructions") or "") + "\n")
        items = body.get("input") or []
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role == "user":
                    conv.add_user(text_of(item.get("content")))
                elif role in ("developer", "system"):
                    conv.system_text += text_of(item.get("content")) + "\n"
            elif kind in RESULT_ITEMS:
                conv.add_result()
        conv.tools = [str(t.get("name", t.get("type", ""))) for t in body.get("tools") or []]
        return conv

    def _item(self, body: dict[str, Any], move: ToolMove | FinalMove) -> dict[str, Any]:
        if isinstance(move, FinalMove):
            return {"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": move.text, "annotations": []}]}
        tools = {str(t.get("name")): t for t in body.get("tools") or []}
        call_id = new_id("call_")
        if move.kind == "write" and tools.get("apply_patch", {}).get("type") == "custom":
            lines = "".join(f"+{line}\n" for line in move.text.split("\n"))
            patch = f"*** Begin Patch\n*** Add File: {move.path}\n{lines}*** End Patch\n"
            return {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": call_id,
                    "name": "apply_patch", "input": patch, "status": "completed"}
        command = move.command if move.kind == "run" else shell_write(move.path, move.text)
        args: dict[str, Any]
        if "exec_command" in tools:
            name, args = "exec_command", {"cmd": command}
        else:
            name, args = "shell", {"command": ["bash", "-lc", command]}
        args = fill_required((tools.get(name) or {}).get("parameters"), args)
        return {"type": "function_call", "id": new_id("fc_"), "call_id": call_id, "name": name,
                "arguments": json.dumps(args), "status": "completed"}

    def _response(self, rid: str, body: dict[str, Any], status: str, output: list[Any]) -> dict[str, Any]:
        usage = {"input_tokens": INPUT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": OUTPUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS}
        return {"id": rid, "object": "response", "status": status, "model": body.get("model", "loopback"),
                "output": output, "usage": usage if status == "completed" else None}

    def stream(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> Iterator[bytes]:
        rid = new_id("resp_")
        item = self._item(body, move)
        seq = iter(range(1_000_000))

        def ev(kind: str, **fields: Any) -> bytes:
            return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

        yield ev("response.created", response=self._response(rid, body, "in_progress", []))
        yield ev("response.output_item.added", output_index=0, item=item)
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield ev("response.output_text.delta", item_id=item["id"], output_index=0, content_index=0, delta=text)
            yield ev("response.output_text.done", item_id=item["id"], output_index=0, content_index=0, text=text)
        yield ev("response.output_item.done", output_index=0, item=item)
        yield ev("response.completed", response=self._response(rid, body, "completed", [item]))

    def complete(self, body: dict[str, Any], conv: Conversation, move: ToolMove | FinalMove) -> dict[str, Any]:
        return self._response(new_id("resp_"), body, "completed", [self._item(body, move)])

    def error(self, status: int, message: str) -> dict[str, Any]:
        kind = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status, "server_error")
        return {"error": {"message": message, "type": kind, "code": kind}}
