"""Flows: coroutines that gather turns and whole flows, each call a branch of the run.

    @shoal.flow
    async def review(task: str, coder: shoal.Agent) -> str: ...

Calling a flow is awaiting it; `asyncio.gather` and `TaskGroup` are the whole vocabulary.
Every call is a `Branch`: its own journal record, its own sessions (closed when it ends),
its own budget under what remains of its caller's, its own unwinding when stopped. The
branch lives in a context variable, so gathered siblings never see each other and
`shoal.current()` is always the branch the asking code is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal import scope
from shoal.errors import BadArgument, BudgetExceeded, FlowArguments, FlowDepthExceeded, FlowError, number
from shoal.journal import Journal, KeptLog
from shoal.reply import Usage

MAX_DEPTH = 64


@dataclass(frozen=True)
class Budget:
    """Limits for one call and everything under it. None means no limit of that kind."""

    cost: float | None = None  # dollars
    tokens: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        # a budget that could never be met (or compared) is refused here, not when the first turn ends
        number("Budget cost (dollars)", self.cost, hint="; None means no limit")
        number("Budget tokens", self.tokens, integer=True, hint="; None means no limit")
        number("Budget seconds", self.seconds, hint="; None means no limit")


class _Run:
    """What every branch of one run shares: the journal and the lock spending is counted under."""

    def __init__(self, name: str, base: Path | None) -> None:
        self.journal = Journal(base)
        self.lock = threading.Lock()  # charges arrive from whichever thread ran the turn
        self.journal.write("run.began", name=name, pid=os.getpid(), argv=sys.argv)


class Branch:
    """One call of a flow. Implements `shoal.scope.Scope` for the sessions it drives."""

    def __init__(self, run: _Run, flow: str, parent: Branch | None, budget: Budget | None) -> None:
        self.run, self.flow, self.parent = run, flow, parent
        self.id = uuid.uuid4().hex[:10]
        self.depth: int = parent.depth + 1 if parent else 1
        self.chain: tuple[str, ...] = (*parent.chain, flow) if parent else (flow,)
        self.budget = budget or Budget()
        self.spent = Usage()
        self.sessions: list[Any] = []
        # tasks of branches gathered under this one; this branch does not end before they do
        self.children: set[asyncio.Task[Any]] = set()
        self.task: asyncio.Task[Any] | None = None  # the task this call runs on
        own = time.monotonic() + self.budget.seconds if self.budget.seconds is not None else None
        inherited = parent.deadline if parent else None
        self.deadline: float | None = min((d for d in (own, inherited) if d is not None), default=None)
        self.own_deadline = own is not None and (inherited is None or own < inherited)

    def __repr__(self) -> str:
        return f"<Branch {' > '.join(self.chain)} depth={self.depth}>"

    @property
    def run_dir(self) -> Path:
        return self.run.journal.dir

    def lineage(self) -> list[Branch]:
        out: list[Branch] = []
        b: Branch | None = self
        while b is not None:
            out.append(b)
            b = b.parent
        return out

    # --- Scope -------------------------------------------------------------------------------

    def adopt(self, session: Any) -> None:
        self.sessions.append(session)
        self.record("session.adopted", session=session.id)

    def record(self, kind: str, **fields: Any) -> None:
        self.run.journal.write(kind, call=self.id, **fields)

    def check(self) -> None:
        for b in self.lineage():
            for kind, limit, spent in (("cost", b.budget.cost, b.spent.cost),
                                       ("tokens", b.budget.tokens, b.spent.total_tokens)):
                if limit is not None and spent >= limit:
                    raise BudgetExceeded(
                        f"flow {b.flow!r} spent {spent:g} of its {kind} budget of {limit:g} "
                        f"(charged by {' > '.join(self.chain)})",
                        kind=kind, flow=b.flow, limit=float(limit), spent=float(spent),
                    )

    def keep_log(self, source: Path) -> KeptLog:
        return self.run.journal.keep_log(source)

    def charge(self, usage: Usage) -> None:
        with self.run.lock:
            for b in self.lineage():
                b.spent += usage
        self.check()


_current: ContextVar[Branch | None] = ContextVar("shoal_branch", default=None)


def current() -> Branch | None:
    """The branch the calling code is on (None outside any flow)."""
    return _current.get()


def _missing(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Names of the required parameters these arguments leave without a value."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
    given = {p.name for p in positional} | set(kwargs)
    return [p.name for p in params if p.default is p.empty and p.name not in given]


class Flow:
    """An `async def` made a flow. Calling it returns the coroutine of one branch."""

    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]], *, name: str | None = None,
                 budget: Budget | None = None, runs: Path | None = None) -> None:
        if not inspect.iscoroutinefunction(fn):
            code = getattr(fn, "__code__", None)
            where = f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)
            raise FlowError(f"{where}: {getattr(fn, '__name__', fn)!r} is not an `async def`; a flow is a coroutine")
        self.fn = fn
        self.name = name or fn.__name__
        self.budget = budget
        self.runs = runs
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<Flow {self.name}>"

    def options(self, *, budget: Budget | None = None, timeout: float | None = None,
                name: str | None = None, runs: Path | None = None) -> Flow:
        """This flow with a budget, a deadline (`timeout` seconds), a name or a runs directory."""
        number("timeout (seconds)", timeout, hint="; None means no deadline")
        if budget is not None and not isinstance(budget, Budget):
            raise BadArgument(f"budget must be a shoal.Budget(cost=..., tokens=..., seconds=...), got {budget!r}")
        if timeout is not None:
            base = budget or self.budget or Budget()
            budget = Budget(base.cost, base.tokens, seconds=timeout)
        return Flow(self.fn, name=name or self.name, budget=budget or self.budget, runs=runs or self.runs)

    def check(self, *args: Any, **kwargs: Any) -> None:
        """Raise FlowArguments unless the flow takes these arguments (nothing runs)."""
        try:
            inspect.signature(self.fn).bind(*args, **kwargs)
        except TypeError as exc:
            code = getattr(self.fn, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
            raise FlowArguments(f"flow {self.name!r}{where}: {exc}",
                                missing=_missing(self.fn, args, kwargs)) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        self.check(*args, **kwargs)  # wrong arguments: said here, at the call, as for a function
        return self._branch(args, kwargs)

    async def _branch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        parent = _current.get()
        if parent is not None and parent.depth >= MAX_DEPTH:
            chain = (*parent.chain, self.name)
            shown = " > ".join(chain[:3]) + f" > ... ({len(chain) - 6} more) > " + " > ".join(chain[-3:])
            raise FlowDepthExceeded(
                f"calling flow {self.name!r} would go {len(chain)} calls deep; the bottom is {MAX_DEPTH}. "
                f"Chain: {shown}. A recursion without a base case?"
            )
        run = parent.run if parent else _Run(self.name, self.runs)
        branch = Branch(run, self.name, parent, self.budget)
        task = asyncio.current_task()
        # a gathered call runs on a task of its own; one awaited directly shares its caller's
        own_task = parent is not None and task is not None and task is not parent.task
        if own_task and parent is not None and task is not None:
            parent.children.add(task)
        branch.task = task
        tokens = (_current.set(branch), scope.current.set(branch))
        branch.record("flow.called", flow=self.name, parent=parent.id if parent else None,
                      depth=branch.depth, args=_describe(args, kwargs))
        status, error = "ok", ""
        try:
            if branch.own_deadline and branch.deadline is not None:
                loop_deadline = asyncio.get_running_loop().time() + (branch.deadline - time.monotonic())
                cm = asyncio.timeout_at(loop_deadline)
                try:
                    async with cm:
                        return await self.fn(*args, **kwargs)
                except TimeoutError:
                    if not cm.expired():
                        raise
                    limit = self.budget.seconds if self.budget else 0.0
                    raise BudgetExceeded(f"flow {self.name!r} ran past its deadline of {limit:g} s; "
                                         "everything under it was stopped",
                                         kind="seconds", flow=self.name, limit=limit or 0.0,
                                         spent=limit or 0.0) from None
            return await self.fn(*args, **kwargs)
        except BudgetExceeded as exc:
            status, error = "over_budget", str(exc)
            raise
        except (asyncio.CancelledError, KeyboardInterrupt):
            status = "stopped"  # being stopped is not a failure
            raise
        except BaseException as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await _join_children(branch)
            await _close_sessions(branch)
            branch.record("flow.returned", status=status, error=error[:2000],
                          tokens=branch.spent.total_tokens, cost=branch.spent.cost)
            _current.reset(tokens[0])
            scope.current.reset(tokens[1])
            if own_task and parent is not None and task is not None:
                parent.children.discard(task)
            if parent is None:
                run.journal.write("run.ended", status=status)
                run.journal.close()


async def _join_children(branch: Branch) -> None:
    """No branch outlives its caller: `gather` returns at the first cancelled child, so the
    rest are cancelled here and waited for before this branch records its end."""
    pending = [t for t in branch.children if not t.done()]
    for t in pending:
        t.cancel()
    while pending:
        # stopping us again changes nothing: we are already stopping them
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(pending)
        pending = [t for t in pending if not t.done()]


async def _close_sessions(branch: Branch) -> None:
    for s in branch.sessions:
        try:
            note = await asyncio.shield(s.aclose())
        except (Exception, asyncio.CancelledError) as exc:  # closing must not hide the real outcome
            branch.record("session.close_failed", session=s.id, error=str(exc))
            continue
        if note:
            branch.record("place.kept", session=s.id, note=note)


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    text = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    return text if len(text) < 500 else text[:500] + "..."


def flow(fn: Callable[..., Coroutine[Any, Any, Any]] | None = None, *, name: str | None = None,
         budget: Budget | None = None) -> Any:
    """Mark an `async def` as a flow: `@shoal.flow` or `@shoal.flow(budget=shoal.Budget(cost=1))`."""
    if fn is None:
        return lambda f: Flow(f, name=name, budget=budget)
    return Flow(fn, name=name, budget=budget)
