"""A turn's answer (`Reply`) and the events a turn yields while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cached_tokens + other.cached_tokens,
            self.cost + other.cost,
        )

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Started:
    """The backend's own conversation id is known (first event of a session's first turn)."""

    session_id: str = field(compare=False)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ToolStarted:
    call_id: str = field(compare=False)
    tool: str
    input: dict[str, Any]


@dataclass(frozen=True)
class ToolFinished:
    call_id: str = field(compare=False)
    tool: str
    input: dict[str, Any]
    output: str
    exit_code: int | None = None
    ok: bool = True


@dataclass(frozen=True)
class StepUsage:
    """Usage reported by the backend for one model call (or a whole turn)."""

    usage: Usage


@dataclass(frozen=True)
class Notice:
    """Something worth knowing that is not a failure (a retry, a restarted process)."""

    kind: str
    message: str


Event = Started | Text | ToolStarted | ToolFinished | StepUsage | Notice


@dataclass(frozen=True)
class Check:
    """An acceptance check run in a session's place after its turn."""

    command: str
    passed: bool
    exit_code: int | None
    output: str  # the tail of stdout and stderr together
    seconds: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class Reply:
    """What a turn answered. Equal for the blocking and the awaited twin (ids and timing aside)."""

    text: str
    session_id: str = field(compare=False)  # equal answers from two conversations are equal
    backend: str
    model: str
    usage: Usage = field(default_factory=Usage)
    seconds: float = field(default=0.0, compare=False)
    events: tuple[Event, ...] = ()
    # set by a batch: the acceptance check of this unit's last try, how many tries it took and
    # the unit's task name; a batch's `usage` is the unit's over all its tries
    check: Check | None = None
    tries: int = 1
    task: str = ""

    @property
    def tool_calls(self) -> list[ToolFinished]:
        return [e for e in self.events if isinstance(e, ToolFinished)]
