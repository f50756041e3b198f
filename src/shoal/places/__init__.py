"""Places a session can be rooted at."""

from __future__ import annotations

from pathlib import Path

from shoal.errors import BadArgument
from shoal.places.base import Place
from shoal.places.container import Container
from shoal.places.copy import Copy
from shoal.places.here import Here
from shoal.places.ssh import SSH
from shoal.places.worktree import Worktree


def as_place(where: Place | str | Path | None) -> Place:
    """A place from what a user passes as `where=`: a Place, or a directory path."""
    if where is None:
        return Here(Path.cwd())
    if isinstance(where, (str, Path)):
        return Here(where)
    if not all(callable(getattr(where, m, None)) for m in ("check", "open", "close", "describe")):
        raise BadArgument(f"where= must be a directory (str or Path) or a place such as shoal.Copy(...) or "
                          f"shoal.Worktree(...); got {where!r}")
    return where


__all__ = ["SSH", "Container", "Copy", "Here", "Place", "Worktree", "as_place"]
