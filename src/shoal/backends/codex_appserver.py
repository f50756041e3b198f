"""One `codex app-server` per agent: every session's thread on it, their turns at once.

The server speaks JSON-RPC over stdio, one JSON object per line and no "jsonrpc" field.
`turn/start` answers at once; the turn's progress then arrives as notifications naming
their thread (`threadId`). One reader task owns stdout and hands each line to whoever
waits for it: a response to the request with its id, a notification to its thread's queue.
Queues are unbounded and fed with `put_nowait`, so a slow consumer never holds up the
reader and sessions never wait on each other.

If the server dies, every pending request and every subscribed thread hears about it at
once (`None` on a queue). The next turn starts a new server and resumes its thread there
(`thread/resume`): history lives in CODEX_HOME's rollout files, not in the process.

A turn given up on (cancelled, timed out) is interrupted (`turn/interrupt`) and its
commands killed (`thread/backgroundTerminals/clean`); if no other turn is running on the
server, the server is stopped too, so nothing of the turn can live on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from shoal.errors import BackendCrashed, ProtocolMismatch, TurnFailed
from shoal.procs import Proc
from shoal.reply import Event, Notice, Started

INIT_TIMEOUT = 20.0  # a cold app-server answers `initialize` in ~0.4 s; 20 s means it never will
REQUEST_TIMEOUT = 30.0  # thread/start, thread/resume, turn/start all answer within milliseconds
NO_ROLLOUT = "no rollout found"  # codex's answer to resuming a thread it never saved
INTERRUPT_TIMEOUT = 5.0  # for turn/interrupt *and* the turn/completed that confirms it
# Deltas repeat what item/completed carries in full; not parsing them keeps the reader cheap
# when hundreds of sessions stream at once.
OPT_OUT = [
    "item/agentMessage/delta", "item/commandExecution/outputDelta", "item/reasoning/textDelta",
    "item/reasoning/summaryTextDelta", "item/reasoning/summaryPartAdded", "item/fileChange/outputDelta",
    "turn/diff/updated", "account/rateLimits/updated", "thread/status/changed", "item/plan/delta",
]


class RpcError(Exception):
    """The server answered a request with a JSON-RPC error."""

    def __init__(self, method: str, error: dict[str, Any]) -> None:
        self.code = error.get("code")
        self.message = str(error.get("message", ""))
        super().__init__(f"codex app-server refused {method}: {self.message} (code {self.code})")


class AppServer:
    """One running `codex app-server` process and the requests and threads waiting on it."""

    def __init__(self, proc: Proc, generation: int) -> None:
        self.proc = proc
        self.generation = generation  # threads remember which server they were opened on
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._threads: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self._write_lock = asyncio.Lock()
        self.dead = False
        self._mourned = False  # waiters were told (once) that the server is gone
        self.turns = 0  # turns in flight (kept by ServerTransport)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, argv: list[str], *, cwd: Path, env: dict[str, str], generation: int,
                    version: str, pinned: str, init_timeout: float = INIT_TIMEOUT) -> AppServer:
        proc = await Proc.spawn(argv, cwd=cwd, env=env, stdin=True)
        server = cls(proc, generation)
        try:
            await server.request("initialize", {
                "clientInfo": {"name": "shoal", "title": "shoal", "version": "0.1.0"},
                # experimentalApi: for thread/backgroundTerminals/clean, the only way to stop the
                # commands of a turn we interrupt (codex keeps them running for the thread otherwise)
                "capabilities": {"optOutNotificationMethods": OPT_OUT, "experimentalApi": True},
            }, timeout=init_timeout)
            await server._send({"method": "initialized"})
        except (TimeoutError, RpcError) as exc:
            await server.close()
            raise ProtocolMismatch(
                f"codex {version} did not complete the app-server handshake ({exc or 'no answer'}); shoal "
                f"speaks the protocol of codex {pinned}. Install the pinned CLI with `bash scripts/setup.sh` "
                f"in the shoal checkout, or use transport='run'.\n{proc.stderr_tail()}"
            ) from exc
        except BaseException:
            await server.close()
            raise
        return server

    # --- requests ------------------------------------------------------------------------------

    async def request(self, method: str, params: dict[str, Any], *, timeout: float = REQUEST_TIMEOUT) -> Any:
        """Send a request and wait for its answer: the result, or RpcError / BackendCrashed / TimeoutError."""
        if self.dead:
            raise self.crashed(f"before {method}")
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (method, fut)
        try:
            await self._send({"id": rid, "method": method, "params": params})
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pending.pop(rid, None)

    async def _send(self, msg: dict[str, Any]) -> None:
        try:
            async with self._write_lock:
                await self.proc.write((json.dumps(msg) + "\n").encode())
        except (BrokenPipeError, ConnectionResetError, RuntimeError) as exc:
            raise self.crashed(f"while sending {msg.get('method')}") from exc

    # --- threads -------------------------------------------------------------------------------

    def subscribe(self, thread_id: str) -> asyncio.Queue[dict[str, Any] | None]:
        """Notifications for this thread from now on; `None` means the server died."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        if self.dead:
            queue.put_nowait(None)
        self._threads[thread_id] = queue
        return queue

    def unsubscribe(self, thread_id: str) -> None:
        self._threads.pop(thread_id, None)

    # --- the reader ----------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while line := await self.proc.readline():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # stray log output; every protocol message is one JSON object
                if isinstance(msg, dict):
                    self._dispatch(msg)
            # its output ended: wait for its exit status, which says how it went (a signal...)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 2)
        except (ValueError, OSError):
            pass  # a line over the stream limit or a broken pipe: the server is no use any more
        finally:
            self._die()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        method = msg.get("method")
        if method is not None and "id" in msg:
            # A request from the server (an approval, a question). Approval policy "never" means
            # none should come; answering at once keeps a turn from waiting on a human forever.
            task = asyncio.get_running_loop().create_task(self._refuse(msg["id"], str(method)))
            self._tasks.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._tasks.discard)
        elif method is not None:
            params = msg.get("params") or {}
            thread_id = params.get("threadId") or (params.get("thread") or {}).get("id")
            queue = self._threads.get(thread_id) if thread_id else None
            if queue is not None:
                queue.put_nowait(msg)
        elif "id" in msg:
            method_fut = self._pending.get(msg["id"])
            if method_fut is None or method_fut[1].done():
                return  # an answer nobody waits for any more (its request timed out or was cancelled)
            name, fut = method_fut
            if "error" in msg:
                fut.set_exception(RpcError(name, msg.get("error") or {}))
            else:
                fut.set_result(msg.get("result"))

    async def _refuse(self, rid: Any, method: str) -> None:
        with contextlib.suppress(TurnFailed):
            await self._send({"id": rid, "error": {"code": -32601, "message": f"shoal does not answer {method}"}})

    def _die(self) -> None:
        if self._mourned:
            return
        self.dead = self._mourned = True
        for _method, fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(self.crashed("with a request pending"))
        for queue in self._threads.values():
            queue.put_nowait(None)

    def crashed(self, when: str, session_id: str | None = None) -> BackendCrashed:
        return BackendCrashed(f"codex app-server exited {when}", backend="codex", exit_code=self.proc.returncode,
                              stderr_tail=self.proc.stderr_tail(), session_id=session_id)

    async def close(self) -> None:
        """Stop the process (and everything it started) and the reader."""
        self.dead = True
        await self.proc.stop()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        self._die()


TurnMapper = Callable[[str], Any]  # makes the per-turn state that turns notifications into events


class ServerTransport:
    """Starts the agent's one app-server lazily, restarts it after a crash, drives turns on it."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], thread_params: dict[str, Any],
                 version: Callable[[], str], pinned: str, mapper: TurnMapper) -> None:
        self.argv, self.cwd, self.env = argv, cwd, env
        self.thread_params = thread_params  # approvalPolicy, sandbox: the same for every thread
        self._version, self.pinned, self._mapper = version, pinned, mapper
        self.server: AppServer | None = None
        self._generation = 0
        self._lock = asyncio.Lock()
        self.init_timeout = INIT_TIMEOUT

    async def _get(self) -> AppServer:
        async with self._lock:  # turns of many sessions arriving at once share one start
            if self.server is None or self.server.dead:
                if self.server is not None:
                    await self.server.close()
                self._generation += 1
                self.server = await AppServer.start(
                    self.argv, cwd=self.cwd, env=self.env, generation=self._generation,
                    version=self._version(), pinned=self.pinned, init_timeout=self.init_timeout)
            return self.server

    async def _open(self, server: AppServer, conv: Any) -> AsyncIterator[Event]:
        """Start the session's thread, or resume it if it was opened on an earlier server."""
        params = {"cwd": str(conv.cwd), **self.thread_params}
        if conv.env:
            # one server holds every thread, so a place's environment (e.g. the shell shim of a
            # container) is given per thread: codex sets it for every command the thread runs
            params["config"] = {f"shell_environment_policy.set.{k}": v for k, v in conv.env.items()}
        if conv.session_id is None:
            result = await self._call(server, "thread/start", params, conv)
            conv.session_id = str(result["thread"]["id"])
            conv.state["codex_server"] = server.generation
            yield Started(conv.session_id)
        elif conv.state.get("codex_server") != server.generation:
            try:
                await self._call(server, "thread/resume",
                                 {"threadId": conv.session_id, "excludeTurns": True, **params}, conv)
            except TurnFailed as exc:
                if NO_ROLLOUT not in str(exc):
                    raise
                # Codex saves a thread with its first turn; one whose server died before that
                # has no history to lose. A new thread keeps the session usable.
                old = conv.session_id
                result = await self._call(server, "thread/start", params, conv)
                conv.session_id = str(result["thread"]["id"])
                yield Notice("new-thread", f"codex thread {old} was never saved; continuing in {conv.session_id}")
            conv.state["codex_server"] = server.generation

    async def _call(self, server: AppServer, method: str, params: dict[str, Any], conv: Any) -> Any:
        try:
            return await server.request(method, params)
        except TimeoutError:
            await server.close()  # a server that stops answering is stuck: the next turn gets a new one
            raise BackendCrashed(f"codex app-server did not answer {method} in {REQUEST_TIMEOUT:.0f} s; "
                                 "it was stopped", backend="codex", stderr_tail=server.proc.stderr_tail(),
                                 session_id=conv.session_id) from None
        except RpcError as exc:
            raise TurnFailed(str(exc), backend="codex", session_id=conv.session_id) from exc

    async def turn(self, conv: Any, prompt: str) -> AsyncIterator[Event]:
        server = await self._get()
        server.turns += 1  # no await since _get: a server counted busy is never retired under us
        try:
            async for ev in self._drive(server, conv, prompt):
                yield ev
        finally:
            server.turns -= 1

    async def _drive(self, server: AppServer, conv: Any, prompt: str) -> AsyncIterator[Event]:
        async for ev in self._open(server, conv):
            yield ev
        thread_id = str(conv.session_id)
        queue = server.subscribe(thread_id)  # before turn/start: no notification can slip past
        state: Any = None
        sent = True  # from here on a turn may be running on the server, until we know better
        try:
            try:
                result = await self._call(server, "turn/start", {
                    "threadId": thread_id, "input": [{"type": "text", "text": prompt, "text_elements": []}]}, conv)
            except TurnFailed:
                sent = False  # refused, or the server is gone: no turn to interrupt
                raise
            state = self._mapper(str(result["turn"]["id"]))
            while not state.done:
                msg = await queue.get()
                if msg is None:
                    raise server.crashed("in the middle of a turn", conv.session_id)
                for ev in state.feed(msg, conv.session_id):
                    yield ev
        finally:
            if sent and (state is None or not state.done) and not server.dead:
                await self._interrupt(server, thread_id, state.turn_id if state else None, queue)
                if server.turns == 1:
                    # Given up on, and nothing else runs here: stopping the server is the surest way
                    # that nothing of this turn lives on, and costs the next turn one cold start.
                    await server.close()
            server.unsubscribe(thread_id)

    async def _interrupt(self, server: AppServer, thread_id: str, turn_id: str | None,
                         queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        """Stop the turn we are giving up on, within INTERRUPT_TIMEOUT, or stop the server."""
        try:
            async with asyncio.timeout(INTERRUPT_TIMEOUT):
                while turn_id is None:  # cancelled before turn/start answered: its turn/started names it
                    msg = await queue.get()
                    if msg is None:
                        return
                    if msg.get("method") == "turn/started":
                        turn_id = str(msg["params"]["turn"]["id"])
                with contextlib.suppress(RpcError):  # "no active turn": it ended on its own meanwhile
                    await server.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id})
                while (msg := await queue.get()) is not None:
                    params = msg.get("params") or {}
                    if msg.get("method") == "turn/completed" and (params.get("turn") or {}).get("id") == turn_id:
                        break
                await self._clean(server, thread_id)
        except (TimeoutError, TurnFailed):
            # The turn would not stop: only stopping the server guarantees it does nothing more.
            await server.close()

    @staticmethod
    async def _clean(server: AppServer, thread_id: str) -> None:
        """Kill the thread's background terminals: commands an interrupted turn left running."""
        with contextlib.suppress(RpcError):
            await server.request("thread/backgroundTerminals/clean", {"threadId": thread_id},
                                 timeout=INTERRUPT_TIMEOUT)

    async def forget(self, thread_id: str) -> None:
        """The session is over: stop its commands, let the server unload its thread (bounded)."""
        server = self.server
        if server is None or server.dead:
            return
        server.unsubscribe(thread_id)
        with contextlib.suppress(TimeoutError, RpcError, TurnFailed):
            await self._clean(server, thread_id)
            await server.request("thread/unsubscribe", {"threadId": thread_id}, timeout=INTERRUPT_TIMEOUT)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
