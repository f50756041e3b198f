"""A throwaway copy of a directory, one per session, made on the session's first turn.

The copy is reflinked where the filesystem can (`cp --reflink=auto`), so a copy of a large
tree costs little until it is written to. When it is given back it is deleted only if it
holds nothing new; a copy with changes is kept and its path reported (never lose work),
unless the caller said `keep="never"`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from shoal.errors import PlaceError

Keep = Literal["changed", "always", "never"]


def _digest(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]  # not work
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p
    return out


def changed_files(source: Path, copy: Path) -> list[str]:
    """Relative paths added, removed or modified in `copy` compared with `source`."""
    a, b = _files(source), _files(copy)
    changed = sorted(set(a) ^ set(b))
    for rel in set(a) & set(b):
        pa, pb = a[rel], b[rel]
        if pa.stat().st_size != pb.stat().st_size or _digest(pa) != _digest(pb):
            changed.append(rel)
    return sorted(changed)


class Copy:
    kind = "copy"

    def __init__(self, source: str | Path, *, keep: Keep = "changed", root: str | Path | None = None) -> None:
        self.source = Path(source).expanduser().absolute()
        self.keep = keep
        self.root = Path(root) if root else None
        self.path: Path | None = None

    def check(self) -> None:
        if not self.source.is_dir():
            raise PlaceError(f"cannot copy {self.source}: it is not a directory")

    async def open(self) -> Path:
        self.check()
        if self.path is not None:
            return self.path
        parent = self.root or Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=f"shoal-copy-{self.source.name}-", dir=parent))
        proc = await asyncio.create_subprocess_exec(
            "cp", "-a", "--reflink=auto", f"{self.source}/.", str(dest),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            shutil.rmtree(dest, ignore_errors=True)  # nothing half-made is left behind
            raise PlaceError(f"copying {self.source} to {dest} failed: {err.decode().strip()}")
        self.path = dest
        return dest

    def changes(self) -> list[str]:
        return changed_files(self.source, self.path) if self.path else []

    def env(self) -> dict[str, str]:
        return {}

    async def after_turn(self) -> None:
        return None

    async def close(self) -> str | None:
        if self.path is None or not self.path.exists():
            return None
        changed = await asyncio.to_thread(self.changes) if self.keep == "changed" else []
        if self.keep == "always" or changed:
            return f"kept copy {self.path} ({len(changed)} changed file(s) vs {self.source})"
        await asyncio.to_thread(shutil.rmtree, self.path, True)
        return None

    def describe(self) -> str:
        return str(self.path) if self.path else f"copy of {self.source}"
