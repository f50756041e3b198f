"""The CLIs' own logs of a run's sessions, kept in the run's `logs/` so its links still open."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger("shoal")


class KeptLog:
    """One backend log kept in a run's `logs/`; shared by the sessions that write to it."""

    def __init__(self, run_dir: Path, link: str, source: Path) -> None:
        self.link, self.source, self.path = link, source, run_dir / link
        self.holders = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        """One more session writes to it: the link is to the live file until the last settles."""
        with self._lock:
            self.path.parent.mkdir(exist_ok=True)
            if not self.path.is_symlink():
                tmp = self.path.with_name(f".{self.path.name}.link")
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                tmp.symlink_to(self.source)  # may not exist yet: the CLI writes it on its first turn
                os.replace(tmp, self.path)
            self.holders += 1

    def settle(self, source: Path | None = None) -> None:
        """One holder is done; the last one swaps the link for a copy of the file as it is now."""
        with self._lock:
            if source is not None and source.exists() and not self.source.exists():
                self.source = source.absolute()  # the first guess of its path was wrong
            self.holders -= 1
            if self.holders > 0 or not self.path.is_symlink():
                return
            if not self.source.exists():
                log.warning("%s was never written; %s is left pointing at it", self.source, self.path)
                return
            tmp = self.path.with_name(f".{self.path.name}.copy")
            try:
                if self.source.suffix in (".db", ".sqlite"):
                    _copy_sqlite(self.source, tmp)  # a consistent snapshot, write-ahead log included
                else:
                    shutil.copyfile(self.source, tmp)
                os.replace(tmp, self.path)
            except (OSError, sqlite3.Error) as exc:
                log.warning("could not keep %s in the run (%s); %s still points at it", self.source, exc, self.path)
                with contextlib.suppress(OSError):
                    tmp.unlink()


def _copy_sqlite(source: Path, dest: Path) -> None:
    src = sqlite3.connect(source, timeout=30)
    try:
        dst = sqlite3.connect(dest)
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()
