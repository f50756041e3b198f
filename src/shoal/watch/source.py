"""Which run `shoal watch` follows: one named, the latest, or the one this process is starting.

The journal is the only thing the view and the run share, so a view can attach from another
terminal, or come up before the run it shows has written its first line (`--watch`, where the
work starts on a thread beside the view): then the view waits for a run whose `run.began`
carries this process's pid.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shoal import journal


class Source:
    def __init__(self, ref: str | Path | None = None, *, base: Path | None = None, pid: int | None = None) -> None:
        self.base = base
        self.pid = pid
        self.path: Path | None = None  # the journal, once known
        self._before: set[str] = set()
        if ref is not None:
            self.path = journal.find(ref, base) / "journal.jsonl"  # FileNotFoundError: say so before any screen
        elif pid is not None:
            self._before = {p.name for p in self._runs()}  # what existed is not what we are starting
        else:
            self.locate()  # the latest now; if there is none, the first to appear

    @property
    def waiting_for(self) -> str:
        root = journal.runs_dir(self.base)
        return f"this process's run under {root}" if self.pid is not None else f"a run under {root}"

    def _runs(self) -> list[Path]:
        root = journal.runs_dir(self.base)
        return sorted(p for p in root.glob("*-*") if (p / "journal.jsonl").exists()) if root.is_dir() else []

    def locate(self) -> Path | None:
        """The journal to follow, or None while it does not exist yet."""
        if self.path is not None:
            return self.path
        for run in self._runs():
            if self.pid is None or (run.name not in self._before and _began_by(run, self.pid)):
                self.path = run / "journal.jsonl"
        return self.path


def _began_by(run: Path, pid: int) -> bool:
    try:
        with open(run / "journal.jsonl", encoding="utf-8") as f:
            first = f.readline()
        return first.endswith("\n") and json.loads(first).get("pid") == pid
    except (OSError, json.JSONDecodeError):
        return False


def alive(pid: int | None) -> bool:
    """Whether the process that wrote a run is still there (a run killed outright never says it ended)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
