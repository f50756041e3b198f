"""shoal's own event loop, on a thread of its own, and the bridges the two twins cross.

Every turn runs here. A blocking call submits a coroutine and waits on a future; an awaited
call submits the same coroutine and awaits that future from its own loop, which is handed
straight back meanwhile. Either way, giving up on a call (Ctrl-C, a cancelled task) cancels
the coroutine *and waits for it to unwind*, so the CLI processes it started are gone before
the caller goes on. The loop thread starts with the first turn, not at import.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import threading
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from shoal import procs
from shoal.errors import WrongLoop

T = TypeVar("T")


class Job(Generic[T]):
    """One coroutine running on shoal's loop, waitable from any thread or loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> None:
        self.loop = loop
        # resolves only once the task has *finished*, cancelled or not: that is the point
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._task: asyncio.Task[T] | None = None
        self._cancelled = False
        context = contextvars.copy_context()  # flows' context vars travel with the call
        loop.call_soon_threadsafe(self._start, coro, context)

    def _start(self, coro: Coroutine[Any, Any, T], context: contextvars.Context) -> None:
        if self._cancelled:
            coro.close()
            self.future.set_exception(asyncio.CancelledError())
            return
        self._task = self.loop.create_task(coro, context=context)
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            self.future.set_exception(asyncio.CancelledError())
        elif (exc := task.exception()) is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(task.result())

    def cancel(self) -> None:
        self.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()

    def wait(self) -> T:
        """Block for the result; Ctrl-C cancels the job, waits for it to unwind, then re-raises."""
        try:
            return self.future.result()
        except KeyboardInterrupt:
            self.cancel()
            concurrent.futures.wait([self.future], timeout=30)
            raise

    async def await_(self) -> T:
        """Await from another loop; cancelling the awaiting task cancels the job and waits for it."""
        fut = asyncio.wrap_future(self.future)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.cancel()
            await asyncio.wait([fut], timeout=30)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: the job's own ending is not news to anyone
            raise


class Runtime:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-loop", daemon=True)
                self._thread.start()
            return self._loop

    def on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> Job[T]:
        return Job(self.loop, coro)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """The blocking twin: run `coro` on shoal's loop and wait for it here."""
        if self.on_loop():
            coro.close()
            raise WrongLoop("a blocking shoal call was made from inside shoal's event loop "
                            "(from a flow or a callback); use the awaited twin (`await ...arun(...)`)")
        return self.submit(coro).wait()

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        """The awaited twin: the same coroutine on shoal's loop, awaited from the caller's."""
        if self.on_loop():
            return await coro
        return await self.submit(coro).await_()


runtime = Runtime()


@atexit.register
def _stop_everything() -> None:
    # The loop thread is a daemon: at exit it would die with CLI processes still running.
    procs.kill_all()
