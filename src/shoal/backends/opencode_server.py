"""One running `opencode serve`: its process, its HTTP client and its event stream.

Every call has a timeout; the event stream (`GET /global/event`, server-sent events naming
their `sessionID`) has none, and ends when the server does. One reader task owns that
stream and hands each event to the queue of the session it names, so sessions never wait
on each other. The turns themselves are driven by `opencode_fleet.ServerPool`.

Security as opencode's server page orders it: the server binds 127.0.0.1 and always gets a
password (`OPENCODE_SERVER_PASSWORD`, basic auth as user `opencode`), generated unless given;
a non-loopback bind is refused unless the user chose the password (`check_bind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from shoal.errors import BackendCrashed, BadSetting, TurnFailed
from shoal.procs import Proc

USER = "opencode"
START_TIMEOUT = 60.0  # a cold `opencode serve` listens in ~1.5 s; on a loaded 2-core box, a few more
REQUEST_TIMEOUT = 30.0  # every call but the event stream answers within milliseconds
ABORT_TIMEOUT = 10.0  # abort, and the session going idle that confirms it
# the events a turn is told about (the rest, deltas and diffs, repeat what these say in full)
TOLD = {"message.part.updated", "message.updated", "session.status", "session.idle", "session.error",
        "permission.asked", "question.asked"}
LISTENING = re.compile(r"listening on (https?://\S+)")


def check_bind(host: str, password_explicit: bool) -> str | None:
    """Refuse a non-loopback bind without a password the user chose; else the warning to give."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    if not password_explicit:
        raise BadSetting(
            f"refusing to bind opencode's server to {host}: anything that reaches it can run commands "
            "on this machine. Keep it on 127.0.0.1 and forward the port over ssh, or set "
            "OPENCODE_SERVER_PASSWORD yourself (and put TLS in front of it)."
        )
    return (f"opencode's server listens on {host} with basic auth, which sends the password and every "
            "prompt unencrypted: put TLS in front of it (a reverse proxy), or use ssh port forwarding.")


def free_port(host: str = "127.0.0.1") -> int:
    # opencode's own `--port 0` tries 4096 first: leave that to the user's own servers
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Server:
    """One running `opencode serve`, its HTTP client and the sessions listening to it."""

    def __init__(self, proc: Proc, url: str, password: str, generation: int, username: str = USER) -> None:
        self.proc, self.url, self.password, self.generation = proc, url, password, generation
        self.client = httpx.AsyncClient(base_url=url, auth=(username, password), trust_env=False,
                                        timeout=REQUEST_TIMEOUT)
        self._subs: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.dead = False
        self.ended = ""  # why this server is (to be) replaced, for the Notice
        self.turns = 0  # turns in flight (kept by ServerPool)
        self._connected = asyncio.Event()
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        for coro in (self._read(), self._drain(), self._watch()):
            self._spawn(coro)

    @classmethod
    async def start(cls, cli: str, *, env: Mapping[str, str], cwd: Path, generation: int, host: str = "127.0.0.1",
                    port: int | None = None, password: str | None = None) -> Server:
        password = password or env.get("OPENCODE_SERVER_PASSWORD") or secrets.token_urlsafe(24)
        argv = [cli, "serve", "--hostname", host, "--port", str(port if port is not None else free_port()),
                "--print-logs", "--log-level", "WARN"]
        proc = await Proc.spawn(argv, cwd=cwd, env={**env, "OPENCODE_SERVER_PASSWORD": password})
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while not (m := LISTENING.search(line := (await proc.readline()).decode(errors="replace"))):
                    if not line:
                        raise BackendCrashed("opencode serve exited before it listened", backend="opencode",
                                             exit_code=await proc.wait(), stderr_tail=proc.stderr_tail())
            url = m.group(1).replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://127.0.0.1:")
            server = cls(proc, url, password, generation, env.get("OPENCODE_SERVER_USERNAME") or USER)
        except TimeoutError:
            await proc.stop()
            raise BackendCrashed(f"opencode serve did not listen in {START_TIMEOUT:.0f} s", backend="opencode",
                                 stderr_tail=proc.stderr_tail()) from None
        except BaseException:
            await proc.stop()
            raise
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await server._connected.wait()  # the event stream is open: no turn's events can slip past
            if server.dead:
                raise server.crashed("before its event stream opened")
        except BaseException:
            await server.close()
            raise
        return server

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    # --- calls ---------------------------------------------------------------------------------

    async def call(self, method: str, path: str, directory: str | None = None, body: Any = None,
                   timeout: float = REQUEST_TIMEOUT) -> Any:
        """One HTTP call: its JSON answer, TurnFailed if refused, BackendCrashed if the server is gone."""
        if self.dead:
            raise self.crashed(f"before {method} {path}")
        params = {"directory": directory} if directory else None
        try:
            r = await self.client.request(method, path, params=params, json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise TimeoutError(f"{method} {path}") from None
        except httpx.HTTPError as exc:
            self._die("it stopped answering")  # on loopback, a refused or dropped connection is a dead server
            raise self.crashed(f"during {method} {path}") from exc
        if r.status_code >= 400:
            raise TurnFailed(f"opencode server refused {method} {path}: HTTP {r.status_code} {r.text[:300]}",
                             backend="opencode")
        return r.json() if r.content else None

    def alive(self) -> bool:
        """Whether the process still runs: a server killed a moment ago is known here before
        its exit has been reaped and reported."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                alive = f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except OSError:
            alive = False
        if not alive:
            self._die("it exited")
        return alive and not self.dead

    def rss(self) -> int:
        """The server's resident memory in bytes (0 once it is gone)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def crashed(self, when: str, session_id: str | None = None) -> BackendCrashed:
        why = f" ({self.ended})" if self.ended else ""
        return BackendCrashed(f"opencode server stopped {when}{why}", backend="opencode",
                              exit_code=self.proc.returncode, stderr_tail=self.proc.stderr_tail(),
                              session_id=session_id)

    # --- events --------------------------------------------------------------------------------

    def subscribe(self, session_id: str) -> asyncio.Queue[dict[str, Any] | None]:
        """The session's events from now on; `None` means the server is gone."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        if self.dead:
            queue.put_nowait(None)
        self._subs[session_id] = queue
        return queue

    def unsubscribe(self, session_id: str) -> None:
        self._subs.pop(session_id, None)

    async def _read(self) -> None:
        try:
            async with self.client.stream("GET", "/global/event",
                                          timeout=httpx.Timeout(REQUEST_TIMEOUT, read=None)) as r:
                data: list[str] = []
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif not line and data:
                        with contextlib.suppress(ValueError):
                            self._dispatch(json.loads("\n".join(data)))
                        data = []
        except (httpx.HTTPError, OSError):
            pass  # the server went away; the watcher says how
        finally:
            self._die("its event stream ended")

    def _dispatch(self, msg: dict[str, Any]) -> None:
        payload = msg.get("payload") or msg
        kind = payload.get("type")
        props = payload.get("properties") or {}
        if kind == "server.connected":
            self._connected.set()
            return
        queue = self._subs.get(props.get("sessionID") or "")
        if queue is None or kind not in TOLD:
            return
        queue.put_nowait(payload)
        # Nothing may wait for a human in a headless run: whatever still asks is refused now
        # (the refusal reaches the turn as a Notice naming it).
        directory = msg.get("directory")
        if kind == "permission.asked":
            self._spawn(self._answer(f"/permission/{props['id']}/reply", directory, {"reply": "reject"}))
        elif kind == "question.asked":
            self._spawn(self._answer(f"/question/{props['id']}/reject", directory, None))

    async def _answer(self, path: str, directory: str | None, body: Any) -> None:
        with contextlib.suppress(TimeoutError, TurnFailed):
            await self.call("POST", path, directory, body, timeout=ABORT_TIMEOUT)

    async def _drain(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            while await self.proc.readline():
                pass  # stdout says nothing more after "listening"; read it so it never fills

    async def _watch(self) -> None:
        code = await self.proc.wait()
        self._die(f"it exited with code {code}")

    def _die(self, why: str) -> None:
        if self.dead:
            return
        self.dead = True
        self.ended = self.ended or why
        self._connected.set()
        for queue in self._subs.values():
            queue.put_nowait(None)

    async def close(self) -> None:
        """Stop the process (and everything it started), the reader and the client. Once."""
        if self._closed:
            return
        self._closed = True
        self._die("it was stopped")
        await self.proc.stop()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.client.aclose()
