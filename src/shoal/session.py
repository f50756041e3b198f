"""A conversation: one place for life, turns one after another, nothing spent until the first.

Opening a session allocates a Python object and nothing else — no process, thread, file or
socket — so ten thousand of them up front are a list, not a bill. The first turn makes the
place and starts the CLI. Turns queue in call order (a ticket taken when the turn begins on
shoal's loop, which is call order for blocking callers on any thread and for awaited ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, cast

from shoal import homes
from shoal.backends.base import Backend, Conversation
from shoal.errors import BadArgument, BadSetting, TurnFailed, TurnTimeout, number
from shoal.places.base import Place
from shoal.prices import priced
from shoal.reply import Event, Notice, Reply, Started, StepUsage, Text, ToolFinished, ToolStarted, Usage
from shoal.runtime import runtime
from shoal.scope import Kept, Scope, current_scope

if TYPE_CHECKING:
    Sink = Callable[[Event], object]

log = logging.getLogger("shoal")


class _Turns:
    """Tickets in the order turns began; each turn waits for its own to come up."""

    def __init__(self) -> None:
        self._issued = 0
        self._head = 0
        self._gone: set[int] = set()
        self._waiters: dict[int, asyncio.Future[None]] = {}

    def take(self) -> int:
        self._issued += 1
        return self._issued - 1

    async def wait(self, n: int) -> None:
        if self._head != n:
            fut = asyncio.get_running_loop().create_future()
            self._waiters[n] = fut
            try:
                await fut
            finally:
                self._waiters.pop(n, None)

    def release(self, n: int) -> None:
        self._gone.add(n)
        while self._head in self._gone:
            self._gone.discard(self._head)
            self._head += 1
        fut = self._waiters.get(self._head)
        if fut is not None and not fut.done():
            fut.set_result(None)


class Session:
    """One conversation of an agent, rooted at one place."""

    def __init__(self, backend: Backend, place: Place, *, name: str | None = None,
                 timeout: float | None = None) -> None:
        self.backend = backend
        self.place = place
        self.id = uuid.uuid4().hex[:12]
        self.name = name or self.id
        self.timeout = timeout
        self.turns = 0
        self.usage = Usage()
        self._conv: Conversation | None = None
        self._queue: _Turns | None = None
        self._running: set[asyncio.Task[object]] = set()
        self.closed = False
        self._log: Kept | None = None  # the backend's own log, kept with the run that journals this session
        self.on_event: Callable[[Session, Event], None] | None = None

    @property
    def session_id(self) -> str | None:
        """The backend's own id for this conversation (None until its first turn)."""
        return self._conv.session_id if self._conv else None

    @property
    def started(self) -> bool:
        return self._conv is not None

    @property
    def cwd(self) -> str | None:
        return str(self._conv.cwd) if self._conv else None

    def __repr__(self) -> str:
        return f"<Session {self.name} {self.backend.name} at {self.place.describe()} turns={self.turns}>"

    # --- the twins -------------------------------------------------------------------------

    def run(self, prompt: str, *, timeout: float | None = None) -> Reply:
        """Run one turn and wait for its Reply here (blocking twin of `arun`)."""
        _check_turn(prompt, timeout)
        return runtime.call(self._turn(prompt, timeout, None))

    async def arun(self, prompt: str, *, timeout: float | None = None) -> Reply:
        """Run one turn; the caller's loop is free meanwhile (awaited twin of `run`)."""
        _check_turn(prompt, timeout)
        return await runtime.acall(self._turn(prompt, timeout, None))

    def stream(self, prompt: str, *, timeout: float | None = None) -> TurnStream:
        """The turn's events as they happen, then its Reply: `for` or `async for` over it."""
        _check_turn(prompt, timeout)
        return TurnStream(self, prompt, timeout)

    def close(self) -> str | None:
        return runtime.call(self.aclose())

    async def aclose(self) -> str | None:
        """End the conversation: stop its turns and what the backend holds, give back the place."""
        return await runtime.acall(self._close())

    # --- the core, on shoal's loop ---------------------------------------------------------

    async def _turn(self, prompt: str, timeout: float | None, sink: Sink | None) -> Reply:
        if self.closed:
            raise TurnFailed(f"session {self.name} is closed", backend=self.backend.name)
        if self._queue is None:
            self._queue = _Turns()
        ticket = self._queue.take()
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            await self._queue.wait(ticket)
            if self._conv is None:
                # held until the agent closes, or this process ends
                homes.claim(self.backend.settings.home, self.backend.settings.agent_id)
                cwd = await self.place.open()
                self._conv = Conversation(cwd=cwd, env=self.place.env())
            limit = timeout if timeout is not None else self.timeout
            try:
                async with asyncio.timeout(limit):
                    try:
                        return await self._drive(prompt, sink)
                    finally:
                        await self.place.after_turn()
            except TimeoutError:
                raise TurnTimeout(f"turn ran past {limit} s and was stopped", backend=self.backend.name,
                                  session_id=self.session_id) from None
        finally:
            self._running.discard(task)
            self._queue.release(ticket)

    async def _drive(self, prompt: str, sink: Sink | None) -> Reply:
        assert self._conv is not None
        scope = current_scope()
        if scope is not None:
            scope.check()
        events: list[Event] = []
        usage = Usage()
        started = time.monotonic()
        self.turns += 1
        turn = self.turns
        note = scope.record if scope is not None else _ignore
        note("turn.began", session=self.id, turn=turn, prompt=prompt[:2000])
        try:
            # every backend's turn is an async generator: closing it runs its own clean-up at once
            events_of = cast(AsyncGenerator[Event, None], self.backend.turn(self._conv, prompt))
            async with contextlib.aclosing(events_of) as stream:
                async for ev in stream:
                    events.append(ev)
                    if isinstance(ev, StepUsage):
                        usage += ev.usage
                    self._note_event(note, turn, ev)
                    if sink is not None:
                        sink(ev)
                    if self.on_event is not None:
                        self.on_event(self, ev)
        except BaseException as exc:
            stopped = isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
            note("turn.ended", session=self.id, turn=turn, status="stopped" if stopped else "failed",
                 error=f"{type(exc).__name__}: {exc}"[:2000], seconds=time.monotonic() - started,
                 usage=asdict(priced(self.backend.settings.model, usage)))
            raise
        if scope is not None and self._log is None:
            self._keep_log(scope, "session.log")  # a backend that writes its log only once a turn ran
        usage = priced(self.backend.settings.model, usage)
        self.usage += usage
        reply = Reply(
            text=_final_text(events),
            session_id=self._conv.session_id or "",
            backend=self.backend.name,
            model=self.backend.settings.model,
            usage=usage,
            seconds=time.monotonic() - started,
            events=tuple(events),
        )
        note("turn.ended", session=self.id, turn=turn, status="ok", seconds=reply.seconds,
             usage=asdict(usage), text=reply.text[:2000])
        if scope is not None:
            scope.charge(usage)  # may raise BudgetExceeded: the turn is done, the budget is not
        return reply

    def _keep_log(self, scope: Scope, kind: str | None) -> str | None:
        """Link the backend's own log of this conversation into the run's record (once)."""
        assert self._conv is not None
        source = self.backend.log(self._conv)
        if source is None:
            return None
        try:
            self._log = scope.keep_log(source)
        except OSError as exc:  # a record that cannot link the log is still a record; the turn goes on
            log.warning("could not link %s into the run's record: %s", source, exc)
            return None
        if self._log is not None and kind is not None:
            scope.record(kind, session=self.id, log=self._log.link, source=str(source))
        return self._log.link if self._log is not None else None

    def _note_event(self, note: Callable[..., None], turn: int, ev: Event) -> None:
        if isinstance(ev, Started):
            settings = self.backend.settings
            scope = current_scope()
            link = self._keep_log(scope, None) if scope is not None and self._log is None else None
            note("session.opened", session=self.id, name=self.name, agent=settings.agent_id,
                 backend=self.backend.name, model=settings.model, place=self.place.describe(),
                 cwd=self.cwd, backend_session=ev.session_id, transport=settings.transport, log=link)
        elif isinstance(ev, ToolStarted):
            note("tool.started", session=self.id, turn=turn, tool_call=ev.call_id, tool=ev.tool,
                 input=_short(ev.input))
        elif isinstance(ev, ToolFinished):
            note("tool.finished", session=self.id, turn=turn, tool_call=ev.call_id, tool=ev.tool,
                 exit_code=ev.exit_code, ok=ev.ok, output=ev.output[-500:])
        elif isinstance(ev, Text):
            note("text", session=self.id, turn=turn, text=ev.text[:4000])
        elif isinstance(ev, Notice):
            note("notice", session=self.id, turn=turn, what=ev.kind, message=ev.message)

    async def _close(self) -> str | None:
        self.closed = True
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running), timeout=30)
        if self._conv is None:
            return None
        try:
            await self.backend.end(self._conv)  # the CLI has finished writing its log after this
        finally:
            kept, self._log = self._log, None  # once: a log shared by sessions is copied after the last
            if kept is not None:
                await asyncio.to_thread(kept.settle, self.backend.log(self._conv))
        return await self.place.close()


def _check_turn(prompt: object, timeout: object) -> None:
    """A turn that could only fail (or be wasted) is refused before it starts."""
    if not isinstance(prompt, str):
        raise BadArgument(f"a prompt is a str, got {prompt!r} ({type(prompt).__name__})")
    if not prompt.strip():
        raise BadSetting("the prompt is empty; a turn needs something to do (nothing was sent)")
    number("timeout (seconds)", timeout, hint="; None means the agent's turn_timeout")


def _ignore(kind: str, **fields: object) -> None:
    return None


def _short(value: object, limit: int = 500) -> object:
    text = json.dumps(value, default=str)
    return value if len(text) <= limit else text[:limit] + "..."


def _final_text(events: list[Event]) -> str:
    """The answer is the text after the last tool call (earlier text was thinking aloud)."""
    last_tool = max((i for i, e in enumerate(events) if isinstance(e, ToolFinished)), default=-1)
    return "".join(e.text for e in events[last_tool + 1:] if isinstance(e, Text)).strip()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class TurnStream:
    """One turn's events, ending in exactly one Reply. Iterate with `for` or `async for`."""

    def __init__(self, session: Session, prompt: str, timeout: float | None) -> None:
        self._session, self._prompt, self._timeout = session, prompt, timeout
        self.reply: Reply | None = None

    async def _produce(self, put: Callable[[object], object]) -> None:
        try:
            reply = await self._session._turn(self._prompt, self._timeout, put)
        except BaseException as exc:
            put(_Failure(exc))
            raise
        put(reply)

    def _take(self, item: object) -> Event | Reply:
        if isinstance(item, _Failure):
            raise item.exc
        if isinstance(item, Reply):
            self.reply = item
        return item  # type: ignore[return-value]

    async def __aiter__(self) -> AsyncIterator[Event | Reply]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[object] = asyncio.Queue()
        cancel: Callable[[], object]
        if runtime.on_loop():
            task = loop.create_task(self._produce(items.put_nowait))
            cancel = task.cancel
        else:
            job = runtime.submit(self._produce(lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
            cancel = job.cancel
        done = False
        try:
            while not done:
                raw = await items.get()
                done = isinstance(raw, (Reply, _Failure))
                yield self._take(raw)
        finally:
            if not done:
                cancel()
                with contextlib.suppress(BaseException):
                    while not isinstance(await items.get(), (Reply, _Failure)):
                        pass  # wait for the turn to unwind: its processes are gone after this

    def __iter__(self) -> Iterator[Event | Reply]:
        items: queue.SimpleQueue[object] = queue.SimpleQueue()
        job = runtime.submit(self._produce(items.put))
        done = False
        try:
            while not done:
                raw = items.get()
                done = isinstance(raw, (Reply, _Failure))
                yield self._take(raw)
        finally:
            if not done:
                job.cancel()
                with contextlib.suppress(BaseException):
                    job.future.exception(timeout=30)
