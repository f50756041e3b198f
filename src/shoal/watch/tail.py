"""Following a file that another process appends JSON lines to.

Only whole lines are read: a line the writer has half written (or a writer killed mid-line
left) waits until its newline comes; a line that never parses is skipped. Each record comes
with the offset its line starts at, so a reader can go back for it later.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import IO, Any

READ_LIMIT = 4 << 20  # bytes read per call, so a long backlog never freezes the view


class Tail:
    """Reads whole lines appended to a file since the last read; a torn last line waits for its end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0  # where the next unread byte is
        self._partial = b""
        self._file: IO[bytes] | None = None

    def read(self, limit: int = READ_LIMIT) -> list[tuple[int, dict[str, Any]]]:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - held while following
            except FileNotFoundError:
                return []
        self._file.seek(self.pos + len(self._partial))
        data = self._file.read(limit)
        if not data:
            return []
        buf = self._partial + data
        out = []
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            # a line torn by a killed writer and then written past is skipped: the rest still reads
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                out.append((self.pos + start, json.loads(buf[start:end])))
            start = end + 1
        self.pos += start
        self._partial = buf[start:]
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
