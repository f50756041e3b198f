"""What shoal made, where, and for whom: one JSON file, so no place it made is lost track of.

Every worktree, copy, container and ssh mount a session makes is written here when it is
made and struck off when it is given back. What is still listed is either in use (its owner
process is alive and the place is open) or was kept because it holds work: `shoal places`
reads this file, and `shoal places clean` removes only what is safe to remove.

The file is shared by every process of the user; each change is made under an exclusive
lock on a sibling file and written atomically (temp file + rename), so concurrent sessions
and concurrent shoal processes never lose each other's entries.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shoal import homes

Entry = dict[str, Any]


def root() -> Path:
    """shoal's state directory, where the agents' homes are too."""
    return homes.state_dir()


def file() -> Path:
    return root() / "places.json"


def place_dir(place_id: str) -> Path:
    """A private directory for one place (its shell shim, its mount point...)."""
    return root() / "places" / place_id


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:10]}"


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid`: with the pid, it names one process (pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner_alive(entry: Entry) -> bool:
    pid = entry.get("pid")
    return isinstance(pid, int) and _start_time(pid) is not None and _start_time(pid) == entry.get("pid_start")


def in_use(entry: Entry) -> bool:
    """Open and its owner is still running: nothing may touch it."""
    return entry.get("status") == "open" and owner_alive(entry)


@contextlib.contextmanager
def _locked() -> Iterator[dict[str, Entry]]:
    path = file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data: dict[str, Entry] = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, json.JSONDecodeError):
            # a damaged registry must not stop work; keep it aside for a human to read
            with contextlib.suppress(OSError):
                path.replace(path.with_suffix(f".damaged-{os.getpid()}"))
            data = {}
        before = json.dumps(data, sort_keys=True)
        yield data
        if json.dumps(data, sort_keys=True) != before:
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(path)


def add(place_id: str, kind: str, path: str | Path, **fields: Any) -> Entry:
    pid = os.getpid()
    entry: Entry = {
        "id": place_id, "kind": kind, "path": str(path), "status": "open", "pid": pid,
        "pid_start": _start_time(pid),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **fields,
    }
    with _locked() as data:
        data[place_id] = entry
    return entry


def update(place_id: str, **fields: Any) -> None:
    with _locked() as data:
        if place_id in data:
            data[place_id].update(fields)


def remove(place_id: str) -> None:
    with _locked() as data:
        data.pop(place_id, None)


def entries() -> list[Entry]:
    with _locked() as data:
        return sorted((dict(e) for e in data.values()), key=lambda e: (e.get("created", ""), e["id"]))
