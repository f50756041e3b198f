"""`shoal batch PROMPTS`: one agent over a file of prompts, run like an operator would run it."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from shoal.cli.watch import add_flag, alongside

STYLE = {"queued": "dim", "working": "yellow", "checking": "cyan", "passed": "green", "failed": "red",
         "stuck": "magenta", "skipped": "dim"}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("batch", help="run one agent over many prompts, one session apiece")
    p.add_argument("prompts", type=Path, help="a file: one prompt per line, or JSONL with task and prompt")
    p.add_argument("--agent", default="opencode/loopback", metavar="BACKEND/MODEL")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--worktrees", type=Path, metavar="REPO", help="a git worktree apiece, branch shoal/<task>")
    where.add_argument("--copies", type=Path, metavar="DIR", help="a throwaway copy of DIR apiece")
    where.add_argument("--here", type=Path, metavar="DIR", help="every session in DIR itself")
    p.add_argument("--check", metavar="CMD", help="acceptance check run in each unit's place after its turn")
    p.add_argument("--limit", type=int, help="units in flight at most (default: all at once)")
    p.add_argument("--canary", action="store_true", help="run the first unit alone; if it fails, stop")
    p.add_argument("--retries", type=int, default=0, help="tries again after a failed check, with its output")
    p.add_argument("--cost-cap", type=float, metavar="DOLLARS", help="start no new unit once this is spent")
    add_flag(p)
    p.set_defaults(func=main)


def read_prompts(path: Path) -> list[tuple[str, str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SystemExit(f"shoal batch: cannot read prompts file {path}: {exc.strerror}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"shoal batch: {path} holds no prompts; nothing was started")
    out = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
                prompt = item["prompt"]
                if not isinstance(prompt, str) or not prompt.strip():
                    raise ValueError(f"its prompt is {prompt!r}, not a non-empty string")
                out.append((str(item.get("task") or f"unit-{i}"), prompt.replace("\\n", "\n")))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                why = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                raise SystemExit(f"shoal batch: {path}:{i + 1}: not a JSON object with a prompt ({why})") from None
        else:
            out.append((f"unit-{i}", line.replace("\\n", "\n")))
    return out


def place_factory(args: argparse.Namespace) -> Any:
    import shoal

    if args.worktrees:
        worktree = getattr(shoal, "Worktree", None)
        if worktree is None:
            raise SystemExit("shoal batch: worktrees are not available in this build of shoal")
        probe = subprocess.run(["git", "-C", str(args.worktrees), "rev-parse", "--show-toplevel"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            raise SystemExit(f"shoal batch: {args.worktrees} is not a git repository; nothing was started")
        return lambda i, task: worktree(args.worktrees, task=task)
    if args.copies:
        if not args.copies.is_dir():
            raise SystemExit(f"shoal batch: {args.copies} is not a directory; nothing was started")
        return lambda i, task: shoal.Copy(args.copies, keep="changed")
    if args.here and not args.here.is_dir():
        raise SystemExit(f"shoal batch: {args.here} is not a directory; nothing was started")
    return args.here or Path.cwd()


def table(units: list[Any], title: str, final: bool = False) -> Table:
    t = Table(title=title)
    cols = ["task", "status", "tries", "tokens", "cost $", "seconds"]
    if final:
        cols[2:2] = ["place", "check"]
        cols.append("changes")
    for c in cols:
        t.add_column(c)
    for u in units:
        row = [u.task, f"[{STYLE.get(u.status, 'white')}]{u.status}[/]"]
        if final:
            check = "-" if u.check is None else ("pass" if u.check.passed else f"fail ({u.check.exit_code})")
            row += [_place_label(u), check]
        row += [str(u.tries), str(u.usage.total_tokens), f"{u.usage.cost:.4f}", f"{u.seconds:.1f}"]
        if final:
            row.append(_changes(u))
        t.add_row(*row)
    return t


def _place_label(u: Any) -> str:
    place = getattr(u.session, "place", None)
    branch = getattr(place, "branch", None)
    return str(branch or u.place or "-")


def _changes(u: Any) -> str:
    place = getattr(u.session, "place", None)
    stat = getattr(place, "diffstat", None)
    if callable(stat):
        return str(stat() or "-")
    changes = getattr(place, "changes", None)
    if callable(changes):
        files = changes()
        return f"{len(files)} file(s): {', '.join(files[:3])}" if files else "-"
    return "-"


def main(args: argparse.Namespace) -> int:
    import shoal

    prompts = read_prompts(args.prompts)
    where = place_factory(args)
    backend, _, model = args.agent.partition("/")
    console = Console() if sys.stdout.isatty() else Console(width=200)
    with shoal.Agent(backend, model=model or "loopback") as agent:
        # with --watch the terminal is the view's: no live table, the work on a thread beside it
        with contextlib.nullcontext() if args.watch else Live(console=console, refresh_per_second=4,
                                                              transient=True) as live:

            def on_update(units: list[Any]) -> None:
                if live is not None:
                    counts = {s: sum(u.status == s for u in units) for s in STYLE}
                    cost = sum(u.usage.cost for u in units)
                    summary = "  ".join(f"{k} {v}" for k, v in counts.items() if v) + f"  cost ${cost:.4f}"
                    live.update(table(units, summary))
                seen.extend(u for u in units if u not in seen)

            seen: list[Any] = []

            def work() -> None:
                agent.batch(prompts, where, limit=args.limit, suppress=True, canary=args.canary,
                            check=args.check, retries=args.retries, cost_cap=args.cost_cap, on_update=on_update)

            try:
                alongside(work) if args.watch else work()
            except shoal.CanaryFailed as exc:
                console.print(f"[red]canary failed[/]: {exc}")
                return 1
            except ValueError as exc:
                raise SystemExit(f"shoal batch: {exc}") from None
        units = sorted(seen, key=lambda u: u.index)
        console.print(table(units, f"shoal batch: {len(units)} units, one {backend} agent", final=True))
        failed = [u for u in units if u.status != "passed"]
        for u in failed:  # the table says that a unit failed; this says why
            why = u.error or (str(u.outcome).splitlines()[0] if isinstance(u.outcome, BaseException) else "")
            if why:
                console.print(f"[red]{escape(u.task)}[/]: {escape(why)}", highlight=False)
        total = sum(u.usage.cost for u in units)
        console.print(f"{len(units) - len(failed)} passed, {len(failed)} failed; "
                      f"{sum(u.usage.total_tokens for u in units)} tokens, ${total:.4f}")
    for note in agent.kept:
        console.print(f"[yellow]{note}[/]")
    return 1 if failed else 0
