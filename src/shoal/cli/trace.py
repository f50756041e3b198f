"""`shoal trace [RUN] [--perfetto out.json]`: a run read back as the tree it ran as."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.tree import Tree

STYLE = {"ok": "green", "failed": "red", "stopped": "yellow", "over_budget": "magenta", "running": "cyan",
         "unfinished": "yellow", "idle": "dim"}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("trace", help="print a run as a tree (latest run by default)")
    p.add_argument("run", nargs="?", help="run directory or id (default: the latest under .shoal/runs)")
    p.add_argument("--perfetto", type=Path, metavar="OUT.json", help="also write Chrome trace-event JSON")
    p.add_argument("--json", action="store_true", help="print the tree as JSON (for jq and scripts)")
    p.set_defaults(func=main)


def _figures(status: str, seconds: float, tokens: int, cost: float) -> str:
    return f"[{STYLE.get(status, 'white')}]{status}[/]  {seconds:.1f}s  {tokens} tok  ${cost:.4f}"


def render(run) -> Tree:  # type: ignore[no-untyped-def]
    root = Tree(f"run {run.id} {run.name}  " + _figures(run.status, run.seconds, run.tokens, run.cost))

    def add_sessions(node: Tree, sessions) -> None:  # type: ignore[no-untyped-def]
        for s in sessions:
            head = f"session {s.name or s.id} ({s.backend}/{s.model}) @ {s.place}"
            secs = sum(t.seconds for t in s.turns)
            branch = node.add(f"{head}  " + _figures(s.status, secs, s.tokens, s.cost))
            if s.log is not None:
                branch.add(f"[dim]log {s.log.relative_to(run.dir) if s.log.is_relative_to(run.dir) else s.log}[/]")
            for t in s.turns:
                first = (t.prompt.strip().splitlines() or [""])[0][:60]
                line = f"turn {t.number}  " + _figures(t.status, t.seconds, t.tokens, t.cost) + f"  {first!r}"
                leaf = branch.add(line)
                if t.error:
                    leaf.add(f"[red]{t.error.splitlines()[0][:160]}[/]")

    def add_call(node: Tree, call) -> None:  # type: ignore[no-untyped-def]
        branch = node.add(f"flow {call.flow}  " + _figures(call.status, call.seconds, call.tokens, call.cost))
        if call.error:
            branch.add(f"[red]{call.error.splitlines()[0][:160]}[/]")
        add_sessions(branch, call.sessions)
        for child in call.children:
            add_call(branch, child)

    add_sessions(root, run.sessions)
    for call in run.roots:
        add_call(root, call)
    return root


def main(args: argparse.Namespace) -> int:
    from shoal import journal, perfetto

    run = journal.read(args.run)
    console = Console(stderr=args.json)  # with --json, stdout holds the JSON alone
    if args.json:
        print(json.dumps(journal.as_dict(run)))
    else:
        console.print(render(run))
    if args.perfetto:
        perfetto.export(run, args.perfetto)
        console.print(f"perfetto trace: {args.perfetto} (open it at ui.perfetto.dev)")
    return 0
