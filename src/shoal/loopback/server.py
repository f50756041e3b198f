"""The loopback model: a real HTTP server on 127.0.0.1 speaking all three wire formats.

It runs on a thread of its own (stdlib `ThreadingHTTPServer`, one thread per request) so
that a test, the demo or `shoal loopback` can hold one for its whole life and every CLI
process on the machine can share it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from shoal.loopback.chat import Chat
from shoal.loopback.messages import Messages
from shoal.loopback.responses import Responses
from shoal.loopback.script import FailMove, ToolMove, plan
from shoal.loopback.wire import MODEL, WireFormat, new_id

FORMATS: dict[str, WireFormat] = {"chat/completions": Chat(), "responses": Responses(), "messages": Messages()}
CONVERSATION_HEADERS = ("x-session-id", "session-id", "x-claude-code-session-id")


@dataclass
class Request:
    """One logged request: what arrived, for which conversation, and what the model did."""

    t: float
    path: str
    format: str
    conversation: str
    step: int
    move: str
    prompt: str
    model: str
    request_id: str


class LoopbackModel:
    """`with LoopbackModel() as model: model.url` — the server lives as long as the block."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log_path: Path | None = None) -> None:
        self.host, self.port = host, port
        self.requests: list[Request] = []
        self._log_path = log_path
        self._lock = threading.Lock()
        self._fail_counts: dict[tuple[str, str, int], int] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL without the `/v1` suffix (Anthropic clients add it themselves)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> LoopbackModel:
        handler = type("Handler", (_Handler,), {"model": self})
        self._server = ThreadingHTTPServer((self.host, self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="shoal-loopback", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> LoopbackModel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Block until interrupted (for `shoal loopback`); starts the server if need be."""
        if self._server is None:
            self.start()
        assert self._thread is not None
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        finally:
            self.stop()

    def requests_for(self, conversation: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.conversation == conversation]

    def log(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)
            if self._log_path is not None:
                with open(self._log_path, "a") as f:
                    f.write(json.dumps(asdict(req)) + "\n")

    def should_fail(self, key: tuple[str, str, int], times: int | None) -> bool:
        with self._lock:
            n = self._fail_counts.get(key, 0)
            self._fail_counts[key] = n + 1
            return times is None or n < times


class _Handler(BaseHTTPRequestHandler):
    model: LoopbackModel
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the record; stderr noise would drown the CLIs' own

    def do_HEAD(self) -> None:
        self._json(200, {})

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            data = [{"id": MODEL, "object": "model", "created": 0, "owned_by": "shoal",
                     "type": "model", "display_name": "shoal loopback model"}]
            self._json(200, {"object": "list", "data": data, "has_more": False})
        else:
            self._json(200, {"ok": True})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        length = int(self.headers.get("content-length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self._json(400, {"error": {"message": "request body is not JSON"}})
            return
        if path.endswith("/count_tokens"):
            self._json(200, {"input_tokens": 1000})
            return
        fmt = next((f for suffix, f in FORMATS.items() if path.endswith("/" + suffix)), None)
        if fmt is None:
            self._json(404, {"error": {"message": f"loopback model has no route {path}"}})
            return
        self._answer(path, fmt, body)

    def _answer(self, path: str, fmt: WireFormat, body: dict[str, Any]) -> None:
        conv = fmt.conversation(body)
        step = plan(conv)
        cid = self._conversation_id(body, conv.user_texts)
        rid = new_id("req_")
        move = step.move
        label = type(move).__name__.removesuffix("Move").lower()
        if isinstance(move, ToolMove):
            label += ":" + move.kind
        elif isinstance(move, FailMove):
            label += ":" + move.status
        self.model.log(Request(time.time(), path, fmt.name, cid, step.step, label,
                               conv.prompt[:500], str(body.get("model", "")), rid))
        if step.sleep > 0:
            time.sleep(step.sleep)
        if isinstance(move, FailMove):
            key = (cid, hashlib.sha1(conv.prompt.encode()).hexdigest(), step.step)
            if self.model.should_fail(key, move.times):
                self._fail(fmt, move.status, rid)
                return
            move = plan(conv, skip_fails=True).move  # the failure was spent: the script goes on
            assert not isinstance(move, FailMove)  # skip_fails: the plan has moved past every failure
        if body.get("stream"):
            self._stream(fmt, body, conv, move, rid)
        else:
            self._json(200, fmt.complete(body, conv, move), rid)

    def _conversation_id(self, body: dict[str, Any], user_texts: list[str]) -> str:
        for h in CONVERSATION_HEADERS:
            if self.headers.get(h):
                return str(self.headers[h])
        meta = body.get("metadata") or {}
        try:
            sid = json.loads(meta.get("user_id", "")).get("session_id")
            if sid:
                return str(sid)
        except (ValueError, AttributeError):
            pass
        first = user_texts[0] if user_texts else ""
        return "h-" + hashlib.sha1(first.encode()).hexdigest()[:12]

    def _fail(self, fmt: WireFormat, status: str, rid: str) -> None:
        if status == "drop":
            self.close_connection = True
            self.connection.close()
            return
        code = int(status) if status.isdigit() else 500
        self._json(code, fmt.error(code, f"loopback model: scripted failure {code} (request {rid})"), rid)

    def _stream(self, fmt: WireFormat, body: dict[str, Any], conv: Any, move: Any, rid: str) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("x-request-id", rid)
        self.send_header("request-id", rid)
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for chunk in fmt.stream(body, conv, move):
                self.wfile.write(chunk)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the CLI went away (a cancelled turn): nothing to answer

    def _json(self, status: int, payload: dict[str, Any], rid: str = "") -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if rid:
            self.send_header("x-request-id", rid)
            self.send_header("request-id", rid)
        if status == 429:
            self.send_header("retry-after", "0")  # codex retries a 429 only when told when it may
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)


_shared: LoopbackModel | None = None
_shared_lock = threading.Lock()


def shared() -> LoopbackModel:
    """The process's one embedded loopback model, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LoopbackModel().start()
        return _shared
