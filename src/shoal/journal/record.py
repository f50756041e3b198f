"""Writing a run's record: one JSONL line per thing that happened, flushed as it is written."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shoal.journal.kept import KeptLog


def runs_dir(base: Path | None = None) -> Path:
    if base is not None:
        return base
    if os.environ.get("SHOAL_RUNS"):
        return Path(os.environ["SHOAL_RUNS"])
    return Path.cwd() / ".shoal" / "runs"


class Journal:
    """Writes one run's record. Thread-safe; every line is flushed before `write` returns."""

    def __init__(self, base: Path | None = None, run_id: str | None = None) -> None:
        self.run_id = run_id or uuid.uuid4().hex[:8]
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        self.dir = runs_dir(base) / f"{stamp}-{self.run_id}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "journal.jsonl"
        self._lock = threading.Lock()
        self._kept: dict[Path, KeptLog] = {}
        self._names: set[str] = set()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "kind": kind, **fields}, default=str)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    # --- the backends' own logs, kept with the run ------------------------------------------

    def keep_log(self, source: Path) -> KeptLog:
        """Link a backend's own log into `logs/` now; `settle()` replaces the link with a copy.

        The CLI's own record lives in the agent's private home, which goes when the agent
        closes; the run keeps a copy so the journal's link still opens afterwards. While the
        session runs the link is a symlink to the live file (`tail -f` works on it).
        """
        source = source.absolute()
        with self._lock:
            kept = self._kept.get(source)
            if kept is None:
                name, n = source.name, 1
                while name in self._names:
                    n += 1
                    name = f"{n}-{source.name}"
                self._names.add(name)
                kept = self._kept[source] = KeptLog(self.dir, f"logs/{name}", source)
        kept.hold()
        return kept
