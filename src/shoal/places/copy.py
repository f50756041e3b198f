"""A throwaway copy of a directory, one per session, made on the session's first turn.

The copy is reflinked where the filesystem can (`cp --reflink=auto`), so a copy of a large
tree costs little until it is written to. When it is given back it is deleted only if it
holds nothing new; a copy with changes — files added, removed or modified, or (for a copy of
a git repository) commits or refs the source does not have — is kept and its path reported
(never lose work), unless the caller said `keep="never"`. Every copy is in shoal's registry
until it is deleted, so `shoal places` lists the kept ones and `shoal places clean` removes
the ones that turn out to hold nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

from shoal.errors import PlaceError
from shoal.places import registry
from shoal.places.base import check_keep, check_path

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


def _same(a: Path, b: Path) -> bool:
    sa, sb = a.lstat(), b.lstat()
    if sa.st_size != sb.st_size:
        return False
    if sa.st_mtime_ns == sb.st_mtime_ns:
        return True  # `cp -a` keeps mtimes; an edit changes it (rsync's own rule)
    if a.is_symlink() or b.is_symlink():
        return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
    return _digest(a) == _digest(b)


def _git_state(root: Path) -> str | None:
    """HEAD and every ref of a git repository at `root` (None when it is not one)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "for-each-ref", "--format=%(refname) %(objectname)"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout + out.stdout


def changed_files(source: Path, copy: Path) -> list[str]:
    """Relative paths added, removed or modified in `copy` compared with `source`; a copy of a
    git repository whose commits or refs moved also lists ".git"."""
    a, b = _files(source), _files(copy)
    changed = sorted(set(a) ^ set(b))
    changed += [rel for rel in set(a) & set(b) if not _same(a[rel], b[rel])]
    if _git_state(copy) != _git_state(source):
        changed.append(".git")
    return sorted(changed)


def summary(changed: list[str]) -> str:
    files = [c for c in changed if c != ".git"]
    git = ", commits or refs its git history does not have" if ".git" in changed else ""
    return f"{len(files)} changed file(s){git}"


class Copy:
    kind = "copy"

    def __init__(self, source: str | Path, *, keep: Keep = "changed", root: str | Path | None = None) -> None:
        check_path("Copy's source", source)
        check_path("Copy's root", root, optional=True)
        check_keep(keep)
        self.source = Path(source).expanduser().absolute()
        self.keep = keep
        self.root = Path(root) if root else None
        self.path: Path | None = None
        self.id = registry.new_id("copy")

    def check(self) -> None:
        if not self.source.is_dir():
            raise PlaceError(f"cannot copy {self.source}: it is not a directory")
        if self.root is not None and self.root.exists() and not self.root.is_dir():
            raise PlaceError(f"cannot put copies under {self.root}: it is not a directory; pass another root=")

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
        try:
            _, err = await proc.communicate()
        except BaseException:
            proc.kill()
            await proc.wait()
            shutil.rmtree(dest, ignore_errors=True)  # a half-made copy holds no work yet
            raise
        if proc.returncode != 0:
            shutil.rmtree(dest, ignore_errors=True)  # nothing half-made is left behind
            raise PlaceError(f"copying {self.source} to {dest} failed: {err.decode().strip()}")
        self.path = dest
        registry.add(self.id, self.kind, dest, source=str(self.source))
        return dest

    def changes(self) -> list[str]:
        # a copy given back (removed: it held nothing) has no changes, not every file missing
        return changed_files(self.source, self.path) if self.path and self.path.exists() else []

    def env(self) -> dict[str, str]:
        return {}

    async def after_turn(self) -> None:
        return None

    async def close(self) -> str | None:
        if self.path is None or not self.path.exists():
            registry.remove(self.id)
            return None
        changed = await asyncio.to_thread(self.changes) if self.keep == "changed" else []
        if self.keep == "always" or changed:
            what = f"{summary(changed)} vs {self.source}"
            registry.update(self.id, status="kept", holds=what)
            return f"kept copy {self.path} ({what})"
        await asyncio.to_thread(shutil.rmtree, self.path, True)
        registry.remove(self.id)
        return None

    def describe(self) -> str:
        return str(self.path) if self.path else f"copy of {self.source}"


async def clean(entry: registry.Entry) -> tuple[bool, str]:
    """`shoal places clean`: remove a copy only if it holds nothing new. (removed?, why)"""
    path, source = Path(entry["path"]), Path(entry["source"])
    if not source.is_dir():
        return False, f"its source {source} is gone, so what it holds cannot be told apart; left as it is"
    changed = await asyncio.to_thread(changed_files, source, path)
    if changed:
        return False, f"holds work: {summary(changed)} vs {source} (e.g. {changed[0]})"
    await asyncio.to_thread(shutil.rmtree, path, True)
    return True, "removed (nothing new in it)"


async def holds(entry: registry.Entry) -> str:
    path, source = Path(entry["path"]), Path(entry["source"])
    if not source.is_dir():
        return f"copy of {source} (source gone)"
    changed = await asyncio.to_thread(changed_files, source, path)
    return f"copy of {source}: {summary(changed)}" if changed else f"copy of {source}: nothing new"
