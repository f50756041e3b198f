"""The hook through which a session tells whoever is running it what happened.

Flows (and batches) install a `Scope` in a context variable; a session looks it up when a
turn begins — on shoal's loop, where the caller's context travels with the call — and
reports to it: sessions it opened, turns, tool calls, what they cost. The session never
knows what a flow is; this module is the whole of what the two share.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol

from shoal.reply import Usage


class Kept(Protocol):
    """A backend's own log, kept with the record: `link` names it there."""

    link: str

    def settle(self, source: Path | None = None) -> None:
        """The session is over: keep the log as it is now (it may go with the agent's home).
        `source`: where the backend now says the log is, if it knows better than at the start."""
        ...


class Scope(Protocol):
    def adopt(self, session: Any) -> None:
        """A session was opened while this scope was current: it belongs to this scope."""
        ...

    def record(self, kind: str, **fields: Any) -> None:
        """Write down one thing that happened (a journal line)."""
        ...

    def check(self) -> None:
        """Raise if no more turns may start here (a budget already spent)."""
        ...

    def charge(self, usage: Usage) -> None:
        """Count a finished turn's usage here and above; raise if that exceeded a budget."""
        ...

    def keep_log(self, source: Path) -> Kept | None:
        """The backend keeps its own record of a session at `source`: keep it with this one."""
        ...


current: ContextVar[Scope | None] = ContextVar("shoal_scope", default=None)


def current_scope() -> Scope | None:
    return current.get()
