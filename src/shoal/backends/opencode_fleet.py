"""opencode as a fleet: one managed `opencode serve` holds every session of an agent.

Sessions are created over the HTTP API with their own `directory`; a turn is a
`prompt_async` message, and what happens in it is read from the server's event stream
(`opencode_server.Server`). A turn ends when its session goes idle; giving up on one calls
`abort`, and the server stays up for every other session.

The server is replaced when it dies or its memory passes `rss_limit` (opencode grows with
every directory it has seen): the next turn of each session resumes it on a fresh server,
since sessions live in the agent's own OPENCODE_DB, and says so with a `Notice`.

A place that asks for extra environment (a container's or ssh target's shell) gets a server
of its own, since a server's environment is fixed when it starts. Such a server is stopped as
soon as no session is on it and no turn runs on it: a long-lived agent that opens and closes
container sessions one after another would otherwise keep one idle server (~0.6 GB) per place
it ever had. The server for no extra environment stays for the agent's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from shoal.backends.opencode_events import ServerTurn
from shoal.backends.opencode_server import ABORT_TIMEOUT, REQUEST_TIMEOUT, Server
from shoal.errors import BackendCrashed, TurnFailed
from shoal.reply import Event, Notice, Started

log = logging.getLogger("shoal")

SILENCE = 30.0  # a turn this long without an event asks the server whether it is alive
# Measured (opencode 1.18.33): the server idles at ~315 MB, holds ~1.2 GB while 8 sessions in 8
# directories turn at once and grows ~40 MB per directory it has seen (1.36 GB at 24). 2 GB
# leaves a busy fleet alone and still catches the growth that never stops.
RSS_LIMIT = int(os.environ.get("SHOAL_OPENCODE_SERVER_RSS_MB", "2048")) * 1024 * 1024

ErrorMapper = Callable[[dict[str, Any], str | None], TurnFailed]


class ServerPool:
    """The agent's servers: one per distinct extra environment its places ask for (usually one).

    Started on the first turn; replaced when dead or past `rss_limit`. A replaced server
    that still runs turns is retired: it finishes them and is stopped when the last one ends.
    A server for a non-empty extra environment is stopped once the last session on it has
    ended and its last turn is done; the one for no extra environment stays until `close`.
    """

    def __init__(self, cli: str, *, env: dict[str, str], cwd: Path, errors: ErrorMapper,
                 fields: dict[str, Any]) -> None:
        self.cli, self.env, self.cwd, self.errors = cli, env, cwd, errors
        self.fields = fields  # what every prompt carries besides its text: agent, model
        self.rss_limit = RSS_LIMIT
        self._servers: dict[frozenset[tuple[str, str]], Server] = {}
        self._all: set[Server] = set()  # current and retired, until stopped
        self._endings: dict[int, str] = {}  # generation -> why it was replaced
        # id(conv) -> the server that session is on now (since its first turn, until `end`); a
        # session resumed on a fresh server after a crash or a recycle counts on the fresh one
        self._on: dict[int, Server] = {}
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
                try:
                    server = await Server.start(self.cli, env={**self.env, **extra}, cwd=self.cwd,
                                                generation=self._generation)
                except BackendCrashed as exc:
                    if "ServeError" not in exc.stderr_tail and "in use" not in exc.stderr_tail:
                        raise
                    # the free port we picked was taken in the meantime: once more, on another
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
        for attempt in range(2):
            server = await self._get(conv.env)
            # no await since _get: a server counted busy (and used) is never stopped under us
            server.turns += 1
            self._on[id(conv)] = server
            accepted: list[bool] = []  # _drive notes here when the server has taken the prompt
            try:
                async for ev in self._drive(server, conv, prompt, accepted):
                    yield ev
                return
            except BackendCrashed:
                if accepted or attempt or not server.dead:
                    raise
                # gone before it took the prompt (killed a moment ago): start again on a fresh one
            finally:
                server.turns -= 1
                await self._let_go(server)  # retired while this turn ran, or its session ended meanwhile

    async def _let_go(self, server: Server) -> None:
        """Stop `server` if nothing needs it any more: retired and its last turn done, or held for
        an extra environment with no turn running and no session left on it."""
        if server.turns or server not in self._all:
            return
        key = next((k for k, held in self._servers.items() if held is server), None)
        if key is not None:
            if not key or any(held is server for held in self._on.values()):
                return  # the agent's shared server, or one a session is still on
            # out of the pool before any await: a turn for this environment arriving while it
            # stops is given a fresh server
            del self._servers[key]
            log.debug("opencode server %d: its last session ended; stopping it", server.generation)
        self._all.discard(server)
        await server.close()

    async def _drive(self, server: Server, conv: Any, prompt: str, accepted: list[bool]) -> AsyncIterator[Event]:
        directory = str(conv.cwd)
        was = conv.state.get("opencode_server")
        if conv.session_id is None:
            info = await self._call(server, "POST", "/session", directory, {"title": "shoal"}, conv)
            conv.session_id = str(info["id"])
            yield Started(conv.session_id)
        elif was is not None and was != server.generation:
            yield Notice("restart", f"opencode server {was} was replaced ({self._endings.get(was, 'it stopped')}); "
                                    f"session {conv.session_id} resumed on a fresh one")
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
            accepted.append(True)
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
        answers = [m for m in messages or [] if (m.get("info") or {}).get("role") == "assistant"
                   and ((m["info"].get("time") or {}).get("created") or 0) >= started_ms]
        if not answers and not state.busy:
            return []  # not begun yet: a cold directory on a loaded machine can take a while
        state.done = True  # idle, and its record is in the messages: take what we did not hear
        errors = [m["info"]["error"] for m in answers if m["info"].get("error")]
        if errors or not answers:
            state.error = errors[-1] if errors else {"name": "NoAnswer", "data": {
                "message": "the session went idle without answering (and without an event saying why)"}}
        return [ev for m in answers for part in m.get("parts") or [] for ev in state.part(part)]

    async def _abort(self, server: Server, sid: str, directory: str,
                     queue: asyncio.Queue[dict[str, Any] | None], state: ServerTurn) -> None:
        """Stop a turn we gave up on and see its session idle; or stop the server."""
        # An accepted prompt whose loop has not begun would miss an abort and run on into the
        # next turn; one aborted before its answer exists can leave the session swallowing the
        # next prompt (seen on 1.18.33). So wait for its answer to exist, or for its end, first.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ABORT_TIMEOUT):
                while not (state.answering or state.done):
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
        """The session is over: a server held for its place's own environment goes once no other
        session is on it (and its turns are done; else the last of them stops it). On the shared
        server nothing is let go: disposing the session's directory instance gave no memory back
        (measured: 1294 MB before, 1295 MB after closing 12 of 24) and races with a new session
        starting there; recycling is what bounds that server's memory."""
        server = self._on.pop(id(conv), None)
        if server is not None:
            await self._let_go(server)

    async def close(self) -> None:
        servers, self._all = list(self._all), set()
        self._servers.clear()
        self._on.clear()
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)

