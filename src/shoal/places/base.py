"""Where a session works. One Protocol; one file per kind of place.

A place is checked when the session is opened (cheap: a missing directory is an error right
there), made by the session's first turn (`open`), and given back when the session or its
agent ends (`close`). A place that holds work it cannot prove is kept elsewhere is never
deleted silently: `close` keeps it and says where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from shoal.errors import BadArgument, BadSetting

KEEPS = ("changed", "always", "never")


def check_keep(keep: object) -> None:
    """`keep=` of a Copy or a Worktree: a misspelt one must not decide that work is deleted."""
    if keep not in KEEPS:
        raise BadSetting(f"keep={keep!r} is not one of {', '.join(repr(k) for k in KEEPS)} "
                         "('changed', the default, keeps a place that holds work)")


def check_path(what: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (str, Path)) or not str(value):
        raise BadArgument(f"{what} must be a directory path (str or Path), got {value!r}")


@runtime_checkable
class Place(Protocol):
    kind: str

    def check(self) -> None:
        """Raise `PlaceError` now if this place can never be made (no I/O beyond a stat)."""
        ...

    async def open(self) -> Path:
        """Make the place (first turn only) and return the directory the CLI runs in."""
        ...

    def env(self) -> dict[str, str]:
        """Extra environment for the CLI working here (after `open`); most places need none."""
        ...

    async def after_turn(self) -> None:
        """Called after every turn (e.g. to carry edits to a remote target); most do nothing."""
        ...

    async def close(self) -> str | None:
        """Give the place back. Returns a note when something was kept (and why), else None."""
        ...

    def describe(self) -> str: ...
