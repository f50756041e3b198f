"""The run record: an append-only JSONL file per run, and reading it back as the tree it ran as.

    .shoal/runs/<sortable UTC timestamp>-<run id>/journal.jsonl
    .shoal/runs/<sortable UTC timestamp>-<run id>/logs/      the CLIs' own logs of its sessions

Each line is one thing that happened, flushed as it is written, so a run killed outright
leaves a record that reads back up to its last whole line. Gathered calls interleave in the
file; a call id pairs each `flow.called` with its `flow.returned`, and `parent` rebuilds
the tree. `record.py` writes it, `kept.py` keeps the CLIs' logs with it, `tree.py` reads it.
"""

from shoal.journal.kept import KeptLog
from shoal.journal.record import Journal, runs_dir
from shoal.journal.tree import Call, Run, SessionNode, Turn, as_dict, find, lines, read

__all__ = ["Call", "Journal", "KeptLog", "Run", "SessionNode", "Turn", "as_dict", "find", "lines", "read",
           "runs_dir"]
