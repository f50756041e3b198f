"""What an unopened session costs: time and memory per session for N opened up front.

    .venv/bin/python bench/sessions.py [N]

Prints per-session figures measured in this run (no CLI is started: that is the point).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import tracemalloc

import shoal


def main(n: int = 10_000) -> None:
    with tempfile.TemporaryDirectory() as d:
        agent = shoal.Agent("opencode")
        threads = threading.active_count()
        tracemalloc.start()
        t0 = time.perf_counter()
        sessions = [agent.session(where=d) for _ in range(n)]
        elapsed = time.perf_counter() - t0
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert threading.active_count() == threads and not any(s.started for s in sessions)
        print(f"{n} sessions opened: {elapsed * 1e6 / n:.1f} µs and {current / n / 1024:.2f} KiB each; "
              f"{threading.active_count() - threads} new threads, no process started")
        agent.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
