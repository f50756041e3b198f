"""Agents' private CLI homes: held while in use, found again when the shoal using one is gone.

An agent's home (its CLIs' config, their own records of its conversations) is made by its
first turn and removed when the agent closes; a shoal that dies outright (SIGKILL, the OOM
killer) leaves it behind. While a process uses a home it holds a shared lock on a file in it
(flock: the kernel lets go when the process ends, however it ends), so `shoal places` tells a
home nobody holds any more from one in use without guessing from pids — and a Ray node's
several actors of one agent can share a home, each holding it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path


def state_dir() -> Path:
    """shoal's own state (agents' homes under `agents/`, the places registry): $SHOAL_HOME, else
    the user's cache. Never the user's own CLI config."""
    if os.environ.get("SHOAL_HOME"):
        return Path(os.environ["SHOAL_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shoal"


def agents_dir() -> Path:
    return state_dir() / "agents"


LOCK = ".shoal-agent.lock"
GRACE = 60.0  # seconds: an unlocked home this fresh may be between its mkdir and its lock
FRESH = 2.0  # seconds: a lock file this fresh may not be locked by its maker yet

_held: dict[Path, tuple[int, set[str]]] = {}  # home -> (descriptor holding the lock, who uses it)
_guard = threading.Lock()


def claim(home: Path, owner: str) -> None:
    """Make `home` if need be and hold it while `owner` (an agent, an actor) uses it here.
    Claiming again is free; the lock goes when the last owner lets go, or the process ends."""
    with _guard:
        if home in _held:
            _held[home][1].add(owner)
            return
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(home / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held[home] = (fd, {owner})


def release(home: Path, owner: str) -> None:
    with _guard:
        fd, owners = _held.get(home, (None, set()))
        owners.discard(owner)
        if fd is None or owners:
            return
        del _held[home]
    os.close(fd)  # closing the descriptor lets go of its lock


def held(home: Path) -> bool:
    """Some live process uses this home (or it is too fresh to tell)."""
    lock = home / LOCK
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        # made by a shoal that did not lock homes, or just now (between its mkdir and its lock)
        with contextlib.suppress(OSError):
            return time.time() - home.stat().st_mtime < GRACE
        return False
    except OSError:
        return True  # cannot tell: leave it be
    try:
        if time.time() - os.fstat(fd).st_mtime < FRESH:
            return True  # made a moment ago: its maker may not hold it yet
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def orphaned(root: Path) -> list[Path]:
    """The homes under `root` (a state directory's `agents/`) that no live process holds."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p not in _held and not held(p))


def size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
