"""`shoal watch [RUN]`: a terminal view of a run, and `--watch` for the commands that start one.

With no RUN it attaches to the latest run under .shoal/runs (or $SHOAL_RUNS) and follows its
journal as it grows, so a run started in another terminal can be watched live; with RUN
(a directory or an id) it shows that one, whole, or replayed at `--speed` times its pace.

`--watch` on `shoal batch`, `shoal run` and `shoal demo` runs the work on a thread and the
view in front, following the run this process starts. When the run ends the view stays, so
its last state can be read, until `q`; leaving it earlier does not stop the work: the command
goes on to its end (Ctrl-C stops it) and prints its usual summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("watch", help="a terminal view of a run: the latest, live, by default")
    p.add_argument("run", nargs="?", help="run directory or id (default: the latest, followed as it grows)")
    p.add_argument("--speed", type=float, metavar="X",
                   help="replay the run at X times the pace it was recorded at (default: show it at once)")
    p.set_defaults(func=main)


def add_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true",
                   help="open the terminal view of this run in place while it runs (q leaves it)")


def main(args: argparse.Namespace) -> int:
    from shoal.watch.app import WatchApp
    from shoal.watch.source import Source

    if args.speed is not None and args.speed <= 0:
        raise SystemExit("shoal watch: --speed must be more than 0")
    try:
        source = Source(args.run)
    except FileNotFoundError as exc:
        raise SystemExit(f"shoal watch: {exc}") from None
    WatchApp(source, speed=args.speed).run()
    return 0


def alongside(work: Callable[[], T]) -> T:
    """Run `work` on a thread with the view in front, following the run it starts; its result or error."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("shoal: --watch needs a terminal; running without the view", file=sys.stderr)
        return work()
    from shoal.watch.app import WatchApp
    from shoal.watch.source import Source

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the main thread, which raises it as the command would
            outcome["error"] = exc

    source = Source(pid=os.getpid())  # taken before the work starts: runs already there are not ours
    thread = threading.Thread(target=run, name="shoal-work", daemon=True)
    thread.start()
    WatchApp(source, stop_when=lambda: not thread.is_alive()).run()
    if thread.is_alive():
        print("shoal: the view is closed; the run goes on to its end (Ctrl-C stops it)", file=sys.stderr, flush=True)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]
