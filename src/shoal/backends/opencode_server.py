"""opencode as a fleet: one managed `opencode serve` holds every session of an agent.

Sessions are created over the HTTP API with their own `directory`; a turn is a
`prompt_async` message, and what happens in it is read from the server's one event stream
(`GET /global/event`, server-sent events naming their `sessionID`). One reader task owns
that stream and hands each event to the queue of the session it names, so sessions never
wait on each other. A turn ends when its session goes idle; giving up on one calls `abort`.

The server is replaced when it dies or its memory passes `rss_limit` (opencode grows with
every directory it has seen): the next turn of each session resumes it on a fresh server,
since sessions live in the agent's own OPENCODE_DB, and says so with a `Notice`.

Security as opencode's server page orders it: the server binds 127.0.0.1 and always gets a
generated password (`OPENCODE_SERVER_PASSWORD`, basic auth as user `opencode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from shoal.backends.opencode_events import ServerTurn
from shoal.errors import BackendCrashed, TurnFailed
from shoal.procs import Proc
from shoal.reply import Event, Notice, Started

log = logging.getLogger("shoal")

USER = "opencode"
START_TIMEOUT = 60.0  # a cold `opencode serve` listens in ~1.5 s; on a loaded 2-core box, a few more
REQUEST_TIMEOUT = 30.0  # every call but the event stream answers within milliseconds
ABORT_TIMEOUT = 10.0  # abort, and the session going idle that confirms it
SILENCE = 30.0  # a turn this long without an event asks the server whether it is alive
# opencode serve idles at ~315 MB and was seen at 1.6 GB after ~15 directories
RSS_LIMIT = int(os.environ.get("SHOAL_OPENCODE_SERVER_RSS_MB", "1500")) * 1024 * 1024
LISTENING = re.compile(r"listening on (https?://\S+)")

ErrorMapper = Callable[[dict[str, Any], str | None], TurnFailed]


def check_bind(host: str, password_explicit: bool) -> str | None:
    """Refuse a non-loopback bind without a password the user chose; else the warning to give."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    if not password_explicit:
        raise ValueError(
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
        self.dirs: Counter[str] = Counter()  # open sessions per directory, to let go of unused ones
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
            async with asyncio.timeout(START_TIMEOUT):
                await server._connected.wait()  # the event stream is open: no turn's events can slip past
        except TimeoutError:
            await proc.stop()
            raise BackendCrashed(f"opencode serve did not start in {START_TIMEOUT:.0f} s", backend="opencode",
                                 stderr_tail=proc.stderr_tail()) from None
        except BaseException:
            await proc.stop()
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
        if queue is None:
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



class ServerPool:
    """The agent's servers: one per distinct extra environment its places ask for (usually one).

    Started on the first turn; replaced when dead or past `rss_limit`. A replaced server
    that still runs turns is retired: it finishes them and is stopped when the last one ends.
    """

    def __init__(self, cli: str, *, env: dict[str, str], cwd: Path, errors: ErrorMapper,
                 fields: dict[str, Any]) -> None:
        self.cli, self.env, self.cwd, self.errors = cli, env, cwd, errors
        self.fields = fields  # what every prompt carries besides its text: agent, model
        self.rss_limit = RSS_LIMIT
        self._servers: dict[frozenset[tuple[str, str]], Server] = {}
        self._all: set[Server] = set()  # current and retired, until stopped
        self._endings: dict[int, str] = {}  # generation -> why it was replaced
        self._generation = 0
        self._lock = asyncio.Lock()

    def pids(self) -> list[int]:
        """The server processes this pool holds open by design (not a turn's leftovers)."""
        return [s.proc.pid for s in self._all if s.proc.returncode is None]

    def servers(self) -> list[Server]:
        return [s for s in self._all if not s.dead]

    async def _get(self, extra: dict[str, str]) -> Server:
        key = frozenset(extra.items())
        async with self._lock:  # turns of many sessions arriving at once share one start
            server = self._servers.get(key)
            if server is not None and server.alive() and (rss := server.rss()) > self.rss_limit:
                server.ended = f"its memory reached {rss >> 20} MB, over the limit of {self.rss_limit >> 20} MB"
                await self._retire(server)
            elif server is not None and server.dead:
                await self._retire(server)
            server = self._servers.get(key)
            if server is None:
                self._generation += 1
                server = await Server.start(self.cli, env={**self.env, **extra}, cwd=self.cwd,
                                            generation=self._generation)
                self._servers[key] = server
                self._all.add(server)
            return server

    async def _retire(self, server: Server) -> None:
        self._endings[server.generation] = server.ended or "it stopped"
        for key, held in list(self._servers.items()):
            if held is server:
                del self._servers[key]
        if server.dead:
            log.warning("opencode server %d: %s; the next turns resume on a fresh one", server.generation,
                        server.ended)
        if server.turns == 0 or server.dead:
            self._all.discard(server)
            await server.close()

    async def turn(self, conv: Any, prompt: str) -> AsyncIterator[Event]:
        server = await self._get(conv.env)
        server.turns += 1  # no await since _get: a server counted busy is never stopped under us
        try:
            async for ev in self._drive(server, conv, prompt):
                yield ev
        finally:
            server.turns -= 1
            if server.turns == 0 and server not in self._servers.values() and server in self._all:
                self._all.discard(server)
                await server.close()  # retired while this turn ran: it was the last one

    async def _drive(self, server: Server, conv: Any, prompt: str) -> AsyncIterator[Event]:
        directory = str(conv.cwd)
        was = conv.state.get("opencode_server")
        if conv.session_id is None:
            info = await self._call(server, "POST", "/session", directory, {"title": "shoal"}, conv)
            conv.session_id = str(info["id"])
            yield Started(conv.session_id)
        elif was is not None and was != server.generation:
            yield Notice("restart", f"opencode server {was} was replaced ({self._endings.get(was, 'it stopped')}); "
                                    f"session {conv.session_id} resumed on a fresh one")
        if was != server.generation:
            server.dirs[directory] += 1
            conv.state["opencode_server"] = server.generation
        sid = str(conv.session_id)
        queue = server.subscribe(sid)  # before the prompt: none of its events can slip past
        state = ServerTurn()
        sent = True  # from here on a turn may be running on the server, until we know better
        started_ms = time.time() * 1000
        try:
            try:
                await self._call(server, "POST", f"/session/{sid}/prompt_async", directory,
                                 {**self.fields, "parts": [{"type": "text", "text": prompt}]}, conv)
            except TurnFailed:
                sent = False  # refused, or the server is gone: no turn to abort
                raise
            while not state.done:
                try:
                    payload = await asyncio.wait_for(queue.get(), SILENCE)
                except TimeoutError:
                    for ev in await self._silent(server, conv, state, started_ms):
                        yield ev
                    continue
                if payload is None:
                    raise server.crashed("in the middle of a turn", sid)
                for ev in state.feed(payload):
                    yield ev
            if state.error is not None:
                raise self.errors(state.error, sid)
        finally:
            if sent and not state.done and not server.dead:
                await self._abort(server, sid, directory, queue, state)
            server.unsubscribe(sid)

    async def _call(self, server: Server, method: str, path: str, directory: str, body: Any, conv: Any) -> Any:
        try:
            return await server.call(method, path, directory, body)
        except TimeoutError:
            server.ended = f"it did not answer {method} {path} in {REQUEST_TIMEOUT:.0f} s"
            await self._retire(server)  # stuck: the next turn gets a new one
            raise server.crashed("answering", conv.session_id) from None

    async def _silent(self, server: Server, conv: Any, state: ServerTurn, started_ms: float) -> list[Event]:
        """No event for SILENCE seconds: a long tool call, a stuck server, or an idle we missed."""
        directory, sid = str(conv.cwd), str(conv.session_id)
        status = await self._call(server, "GET", "/session/status", directory, None, conv)
        if (status.get(sid) or {}).get("type", "idle") != "idle":
            return []  # still working on it
        messages = await self._call(server, "GET", f"/session/{sid}/message", directory, None, conv)
        state.done = True  # idle, and its record is in the messages: take what we did not hear
        return [ev for m in messages or [] if (m.get("info") or {}).get("role") == "assistant"
                and ((m["info"].get("time") or {}).get("created") or 0) >= started_ms
                for part in m.get("parts") or [] for ev in state.part(part)]

    async def _abort(self, server: Server, sid: str, directory: str,
                     queue: asyncio.Queue[dict[str, Any] | None], state: ServerTurn) -> None:
        """Stop a turn we gave up on and see its session idle; or stop the server."""
        # An accepted prompt whose loop has not begun yet would miss an abort and run on
        # after it (into the next turn): wait for it to begin, or finish, first.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ABORT_TIMEOUT):
                while not (state.busy or state.done):
                    if (payload := await queue.get()) is None:
                        return
                    state.feed(payload)
        if state.done:
            return
        try:
            async with asyncio.timeout(ABORT_TIMEOUT):
                await server.call("POST", f"/session/{sid}/abort", directory, timeout=ABORT_TIMEOUT)
                while True:
                    status = await server.call("GET", "/session/status", directory, timeout=ABORT_TIMEOUT)
                    if (status.get(sid) or {}).get("type", "idle") == "idle":
                        return
                    await asyncio.sleep(0.05)
        except (TimeoutError, TurnFailed):
            # the turn would not stop: only stopping the server guarantees it does nothing more
            server.ended = "it did not stop an aborted turn"
            await self._retire(server)
            await server.close()

    async def end(self, conv: Any) -> None:
        """The session is over: a directory no open session uses is let go (its memory with it)."""
        gen, directory = conv.state.get("opencode_server"), str(conv.cwd)
        for server in self.servers():
            if server.generation == gen and server.dirs[directory] > 0:
                server.dirs[directory] -= 1
                if server.dirs[directory] == 0:
                    del server.dirs[directory]
                    with contextlib.suppress(TimeoutError, TurnFailed):
                        await server.call("POST", "/instance/dispose", directory, timeout=ABORT_TIMEOUT)

    async def close(self) -> None:
        servers, self._all = list(self._all), set()
        self._servers.clear()
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)

