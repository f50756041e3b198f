"""`shoal demo`: the README's main job, with a live view while it runs and a table after."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from shoal.cli.watch import add_flag, alongside
from shoal.demo.run import Conversation, Outcome, demo
from shoal.flows import Flow

STYLE = {"queued": "dim", "working": "yellow", "done": "green", "failed": "red"}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="one agent, many conversations at once, against the loopback model")
    p.add_argument("-n", "--conversations", type=int, default=12, help="how many conversations (default 12)")
    p.add_argument("--backend", default="opencode", help="which coding-agent CLI (default opencode)")
    add_flag(p)
    p.set_defaults(func=main)


def live_table(convs: list[Conversation], title: str) -> Table:
    t = Table(title=title, expand=False)
    for col in ("conversation", "status", "doing"):
        t.add_column(col)
    for c in convs:
        t.add_row(f"c{c.index:02d}", f"[{STYLE[c.status]}]{c.status}[/]", c.doing[:50])
    return t


def final_table(out: Outcome) -> Table:
    t = Table(title=f"shoal demo: {len(out.conversations)} conversations, one {out.backend} agent")
    for col in ("conversation", "ok", "place", "files changed", "tokens", "cost $", "seconds"):
        t.add_column(col, justify="right" if col in ("tokens", "cost $", "seconds") else "left")
    for c in out.conversations:
        t.add_row(f"c{c.index:02d}", "[green]yes[/]" if c.ok else f"[red]no[/] {c.problem[:40]}", Path(c.place).name,
                  ", ".join(c.files_changed) or "-", str(c.tokens), f"{c.cost:.4f}", f"{c.seconds:.1f}")
    return t


def main(args: argparse.Namespace) -> int:
    if args.conversations < 1:
        raise SystemExit(f"shoal demo: -n must be at least 1 (got {args.conversations})")
    console = Console() if sys.stdout.isatty() else Console(width=160)  # a log keeps whole rows

    async def run() -> Outcome:
        # with --watch the terminal is the view's: no live table
        with contextlib.nullcontext() if args.watch else Live(console=console, refresh_per_second=4,
                                                              transient=True) as live:

            def on_change(convs: list[Conversation]) -> None:
                working = sum(c.status == "working" for c in convs)
                if live is not None:
                    live.update(live_table(convs, f"one agent: {working} of {len(convs)} conversations working"))

            # a flow, so the demo is a run in the journal that `shoal watch` can follow
            return await Flow(demo, name="demo")(args.conversations, args.backend, on_change)  # type: ignore[no-any-return]

    out = alongside(lambda: asyncio.run(run())) if args.watch else asyncio.run(run())
    console.print(final_table(out))
    ok = sum(c.ok for c in out.conversations)
    tokens = sum(c.tokens for c in out.conversations)
    cost = sum(c.cost for c in out.conversations)
    console.print(
        f"{ok}/{len(out.conversations)} conversations correct; {tokens} tokens, ${cost:.4f}. "
        f"Wall time {out.wall:.1f} s against {out.turn_seconds:.1f} s of turns "
        f"({out.turn_seconds / out.wall:.1f}x from running them at once)."
    )
    console.print("The copies were throwaway and have been removed.")
    return 0 if ok == len(out.conversations) else 1
