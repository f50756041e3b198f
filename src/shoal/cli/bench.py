"""`shoal bench`: per backend, how many conversations still run at half the speed of one."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="measure each backend's concurrency width against the loopback model")
    p.add_argument("--backends", default="opencode,claude,codex",
                   help="comma-separated backends, each optionally backend:transport (default: all three)")
    p.add_argument("--max-n", type=int, default=16, help="top of the ladder (default 16)")
    p.add_argument("--reps", type=int, default=3, help="repeats per rung (default 3)")
    p.add_argument("--out", type=Path, help="write concurrency.json and concurrency.md here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from shoal.concurrency import bench

    targets = [t.strip() for t in args.backends.split(",") if t.strip()]
    if not targets:
        raise SystemExit("shoal bench: --backends names no backend; e.g. --backends opencode,claude")
    if args.max_n < 1 or args.reps < 1:
        raise SystemExit(f"shoal bench: --max-n and --reps must be at least 1 (got {args.max_n} and {args.reps})")
    if args.out is not None:
        try:  # now, not after the whole ladder has run: the results would have nowhere to go
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"shoal bench: cannot write results to --out {args.out}: {exc.strerror}") from None
    results = asyncio.run(bench(targets, args.max_n, args.reps, args.out))
    # a rung that left a process behind fails the run
    return 1 if any(r.leftovers for r in results) or any(not r.control.ok for r in results) else 0
