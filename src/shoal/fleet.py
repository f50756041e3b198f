"""Batches: one agent over many prompts, with the guardrails an operator would insist on.

One session apiece, none kept; answers in the order asked; everything at once unless
`limit` says otherwise, and every prompt lands either way. A batch is a flow of its own
("batch", each unit a "unit" branch under it), so it is a run in the journal when it is not
already part of one.

Guardrails: a canary (the first unit alone; if it fails, nothing else starts), an acceptance
check run in each unit's place after its turn (with `retries`, the unit is sent the check's
output and tries again in the same session), a stop for a unit that fails the same way twice
in a row (`Stuck`), a cost cap (no new unit starts once reached), and `limit` units in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import re
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shoal.errors import (
    BadArgument,
    BadSetting,
    BudgetExceeded,
    CanaryFailed,
    CheckFailed,
    NotStarted,
    ShoalError,
    Stuck,
    TurnFailed,
    number,
)
from shoal.flows import Flow
from shoal.places.base import Place
from shoal.procs import Proc
from shoal.reply import Check, Reply, Usage
from shoal.scope import current_scope

RETRY_PROMPT = (
    "The acceptance check `{command}` failed with exit code {exit_code}. Its output ends:\n"
    "{output}\nFix what it reports, then stop.\n{retry_directives}"
)
Where = Place | str | Path | Callable[[int, str], Place | str | Path] | None


class _Agent(Protocol):  # what a batch needs of an agent (agent.py is above this module)
    def session(self, where: Any = None, *, name: str | None = None) -> Any: ...


@dataclass
class Unit:
    """One prompt of a batch as it goes: what the live view and the final table show."""

    index: int
    task: str
    prompt: str
    status: str = "queued"  # queued / working / checking / passed / failed / stuck / skipped
    tries: int = 0
    usage: Usage = field(default_factory=Usage)
    seconds: float = 0.0
    place: str = ""
    check: Check | None = None
    error: str = ""
    reply: Reply | None = None
    outcome: Reply | BaseException | None = None
    session: Any = None


@dataclass
class Options:
    where: Where = None
    limit: int | None = None
    suppress: bool = False
    canary: bool = False
    check: str | None = None
    check_timeout: float = 600.0
    retries: int = 0
    retry_prompt: str = RETRY_PROMPT
    retry_directives: str = ""  # appended to retry prompts (the loopback model's script, in tests)
    cost_cap: float | None = None
    on_update: Callable[[list[Unit]], None] | None = None


def options(where: Where, limit: int | None, suppress: bool, guardrails: dict[str, Any]) -> Options:
    """The batch's Options; a guardrail that is not one (a typo) is refused, naming the ones there are."""
    known = [f.name for f in dataclasses.fields(Options) if f.name not in ("where", "limit", "suppress")]
    unknown = sorted(set(guardrails) - set(known))
    if unknown:
        raise BadArgument(f"unknown batch guardrail(s) {', '.join(map(repr, unknown))}; "
                          f"the guardrails are {', '.join(known)}")
    return Options(where=where, limit=limit, suppress=suppress, **guardrails)


def normalise(prompts: Sequence[str | tuple[str, str] | dict[str, str]]) -> list[tuple[str, str]]:
    """(task, prompt) pairs from plain prompts, (task, prompt) tuples or {"task", "prompt"} dicts."""
    if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence):
        raise BadArgument(f"a batch takes a list of prompts (one unit each), got a {type(prompts).__name__}"
                          + (": wrap a single prompt in a list, [prompt]" if isinstance(prompts, str) else ""))
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            task, prompt = f"unit-{i}", p
        elif isinstance(p, dict):
            if "prompt" not in p:
                raise BadSetting(f"prompt {i}: {p!r} has no 'prompt'; a dict prompt is {{'task': ..., 'prompt': ...}}")
            task, prompt = str(p.get("task") or f"unit-{i}"), p["prompt"]
        elif isinstance(p, tuple) and len(p) == 2:
            task, prompt = str(p[0]), p[1]
        else:
            raise BadArgument(f"prompt {i}: {p!r} is not a prompt; a prompt is a str, a (task, prompt) tuple "
                              "or a {'task': ..., 'prompt': ...} dict")
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadSetting(f"prompt {i} ({task}): {prompt!r} is not a prompt (a non-empty str)")
        out.append((task, prompt))
    return out


def validate(units: list[tuple[str, str]], opts: Options) -> None:
    """Bad input is refused before anything starts."""
    number("limit", opts.limit, minimum=1, above=False, integer=True, hint="; None runs every unit at once")
    number("retries", opts.retries, minimum=0, above=False, integer=True, optional=False)
    number("cost_cap (dollars)", opts.cost_cap, hint="; None means no cap")
    number("check_timeout (seconds)", opts.check_timeout, optional=False)
    if opts.check is not None and not isinstance(opts.check, str):
        raise BadArgument(f"check must be a shell command (a str), e.g. 'pytest -q'; got {opts.check!r}")
    if opts.on_update is not None and not callable(opts.on_update):
        raise BadArgument(f"on_update must be callable (it is called with the units), got {opts.on_update!r}")
    if not isinstance(opts.retry_directives, str):
        raise BadArgument(f"retry_directives must be a str, got {opts.retry_directives!r}")
    try:
        opts.retry_prompt.format(command="", exit_code=0, output="", prompt="", retry_directives="")
    except (AttributeError, KeyError, IndexError, ValueError) as exc:
        raise BadSetting(f"retry_prompt {opts.retry_prompt!r} cannot be filled in ({type(exc).__name__}: {exc}); "
                         "it may use {command}, {exit_code}, {output}, {prompt} and {retry_directives} "
                         "(double other braces: {{ }})") from None
    if opts.where is not None and not callable(opts.where) and not isinstance(opts.where, (str, Path)) \
            and not callable(getattr(opts.where, "check", None)):
        raise BadArgument(f"where= must be a directory, a place, or a function (index, task) -> place; "
                          f"got {opts.where!r}")
    if opts.check:
        try:
            first = shlex.split(opts.check)[0]
        except (ValueError, IndexError):
            raise BadSetting(f"check command {opts.check!r} cannot be parsed") from None
        if "/" not in first and shutil.which(first) is None and first not in _SHELL_WORDS:
            raise BadSetting(f"check command {first!r} was not found on PATH; nothing was started")


_SHELL_WORDS = {"test", "[", "true", "false", "cd", "exit", "!", "{", "if", "for"}


async def run_batch(agent: _Agent, prompts: Sequence[Any], opts: Options) -> list[Reply | BaseException]:
    pairs = normalise(prompts)
    validate(pairs, opts)
    units = [Unit(i, task, prompt) for i, (task, prompt) in enumerate(pairs)]
    return await Flow(_batch, name="batch")(agent, units, opts)  # type: ignore[no-any-return]


async def _batch(agent: _Agent, units: list[Unit], opts: Options) -> list[Reply | BaseException]:
    gate = asyncio.Semaphore(opts.limit) if opts.limit else None
    spent = [0.0]
    unit_flow = Flow(_unit, name="unit")

    scope = current_scope()  # the batch's own branch
    said: dict[int, str] = {}

    def update() -> None:
        # each unit's status goes on the run's record as it changes, so a view reading the
        # journal (`shoal watch`, perhaps in another terminal) sees queued and stuck units too
        if scope is not None:
            for u in units:
                if said.get(u.index) != u.status:
                    said[u.index] = u.status
                    scope.record("unit.status", index=u.index, task=u.task, status=u.status, tries=u.tries,
                                 session=getattr(u.session, "id", None), agent=getattr(agent, "id", None),
                                 error=u.error[:500])
        if opts.on_update is not None:
            opts.on_update(units)

    async def one(unit: Unit) -> None:
        if gate is not None:
            await gate.acquire()
        try:
            if opts.cost_cap is not None and spent[0] >= opts.cost_cap:
                unit.status = "skipped"
                unit.outcome = NotStarted(f"unit {unit.task!r} not started: cost cap ${opts.cost_cap:g} reached")
                update()
                return
            before = unit.usage.cost
            try:
                await unit_flow.options(name=f"unit {unit.task}")(agent, unit, opts, update)
            except BudgetExceeded:
                raise  # a flow's budget ran out: that stops the batch, not just this unit
            except ShoalError as exc:  # e.g. its place could not be made: this unit failed
                _fail(unit, exc, "failed")
            finally:
                spent[0] += unit.usage.cost - before
        finally:
            if gate is not None:
                gate.release()

    update()
    rest = units
    if opts.canary and units:
        await one(units[0])
        if isinstance(units[0].outcome, BaseException):
            for u in units[1:]:
                u.status, u.outcome = "skipped", NotStarted("not started: the canary failed")
            update()
            raise CanaryFailed(f"canary unit {units[0].task!r} failed, so none of the other "
                               f"{len(units) - 1} were started: {units[0].outcome}") from units[0].outcome
        rest = units[1:]
    # every unit lands before anything is raised: a failure let out early would leave the
    # rest running with nobody waiting for them
    await asyncio.gather(*(one(u) for u in rest))
    answers: list[Reply | BaseException] = [u.outcome if u.outcome is not None else u.reply for u in units]  # type: ignore[misc]
    if not opts.suppress:
        for a in answers:
            if isinstance(a, BaseException):
                raise a
    return answers


async def _unit(agent: _Agent, unit: Unit, opts: Options, update: Callable[[], None]) -> None:
    where = opts.where(unit.index, unit.task) if callable(opts.where) else opts.where
    session = agent.session(where=where, name=unit.task)
    unit.session = session
    prompt, last_failure = unit.prompt, None
    started = time.monotonic()
    try:
        while True:
            unit.tries += 1
            unit.status = "working"
            update()
            try:
                reply = await session.arun(prompt)
            except TurnFailed as exc:
                unit.usage, unit.place = session.usage, session.cwd or ""
                failure = _signature(type(exc).__name__, str(exc))
                if failure == last_failure:
                    return _fail(unit, Stuck(f"unit {unit.task!r} failed the same way twice: {exc}",
                                             tries=unit.tries), "stuck")
                if unit.tries > opts.retries:
                    return _fail(unit, exc, "failed")
                last_failure = failure
                continue  # the same prompt again, in the same session
            unit.usage, unit.reply = session.usage, reply
            unit.place = session.cwd or ""
            if not opts.check:
                unit.status, unit.outcome = "passed", _finish(reply, unit, None)
                return
            unit.status = "checking"
            update()
            check = await run_check(opts.check, Path(session.cwd or "."), opts.check_timeout)
            unit.check = check
            if check.passed:
                unit.status, unit.outcome = "passed", _finish(reply, unit, check)
                return
            failure = _signature(str(check.exit_code), check.output)
            if failure == last_failure:
                return _fail(unit, Stuck(f"unit {unit.task!r}: check `{check.command}` failed the same way "
                                         f"twice (exit {check.exit_code}); stopped", reply=reply, check=check,
                                         tries=unit.tries), "stuck")
            if unit.tries > opts.retries:
                return _fail(unit, CheckFailed(f"unit {unit.task!r}: check `{check.command}` failed "
                                               f"(exit {check.exit_code})", reply=_finish(reply, unit, check),
                                               check=check, tries=unit.tries), "failed")
            last_failure = failure
            prompt = opts.retry_prompt.format(command=check.command, exit_code=check.exit_code,
                                              output=check.output, prompt=unit.prompt,
                                              retry_directives=opts.retry_directives)
    finally:
        unit.seconds = time.monotonic() - started
        update()


def _finish(reply: Reply, unit: Unit, check: Check | None) -> Reply:
    return dataclasses.replace(reply, check=check, tries=unit.tries, task=unit.task, usage=unit.usage)


def _fail(unit: Unit, exc: BaseException, status: str) -> None:
    unit.status, unit.outcome, unit.error = status, exc, str(exc).splitlines()[0]


def _signature(kind: str, text: str) -> str:
    """What makes two failures 'the same way': the kind and the output, numbers masked."""
    masked = re.sub(r"\d+(\.\d+)?", "#", text[-2000:])
    return hashlib.sha1(f"{kind}\0{masked}".encode()).hexdigest()


async def run_check(command: str, cwd: Path, timeout: float) -> Check:
    """Run `command` with bash in `cwd`; its process group is stopped if we are."""
    started = time.monotonic()
    proc = await Proc.spawn(["bash", "-c", command], cwd=cwd, env=os.environ)
    out: list[str] = []
    code: int | None = None
    try:
        async with asyncio.timeout(timeout):
            while line := await proc.readline():
                out.append(line.decode(errors="replace").rstrip("\n"))
            code = await proc.wait()
    except TimeoutError:
        await proc.stop()  # a check that ran too long failed: the unit's failure, not the batch's
        out.append(f"shoal: the check ran past its {timeout:g} s (check_timeout) and was stopped")
    except BaseException:
        await proc.stop()
        raise
    tail = "\n".join((out + proc.stderr_tail(30).splitlines())[-30:])
    return Check(command, code == 0, code, tail, time.monotonic() - started)


__all__ = ["Options", "ShoalError", "Unit", "run_batch", "run_check"]
