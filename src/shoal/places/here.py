"""A directory as it is: every session rooted there works on the directory itself."""

from __future__ import annotations

from pathlib import Path

from shoal.errors import PlaceError


class Here:
    kind = "here"

    def __init__(self, path: str | Path = ".") -> None:
        self.path = Path(path).expanduser().absolute()

    def check(self) -> None:
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise PlaceError(f"session directory {self.path} {what}; create it first or pass another `where=`")

    async def open(self) -> Path:
        self.check()  # it may have gone away since the session was opened
        return self.path

    def env(self) -> dict[str, str]:
        return {}

    async def after_turn(self) -> None:
        return None

    async def close(self) -> str | None:
        return None

    def describe(self) -> str:
        return str(self.path)
