"""How `shoal watch` keeps up with two hundred conversations streaming at once.

    .venv/bin/python bench/watch.py [--conversations 200] [--seconds 20] [--rate 4]

A writer process appends journal lines the way a run does (turns, text, tool calls and their
output, usage) for every conversation, `rate` records a second each, for `seconds`, then ends
the run. The view follows that journal in this process (Textual's headless driver: everything
but the bytes to a terminal), stepping to the next working conversation every second (each
step reads a screen back from the journal) and showing the list of all of them for a while.

Prints the event-to-screen lag (a record's write time to the end of the refresh that showed
it: the newest line of the conversation shown, and the oldest record of each refresh, which
every conversation's moves reach the bars and the list by) and the CPU the view spent (this
process; the writer is another).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.journal import Journal


def write(base: Path, n: int, seconds: float, rate: float) -> None:
    """The writer: n conversations, each a turn after another of prompt, text, a tool call, usage."""
    j = Journal(base)
    j.write("run.began", name="bench", pid=os.getpid(), argv=sys.argv)
    j.write("flow.called", call="root", flow="bench", parent=None, depth=1)
    for i in range(n):
        j.write("session.adopted", call="root", session=f"s{i:03d}")
        j.write("session.made", call="root", session=f"s{i:03d}", name=f"c{i:03d}", agent="a1",
                agent_name="bench", backend="opencode", model="loopback", place=f"/tmp/bench/c{i:03d}")
    step = [0] * n
    turn = [0] * n
    gap = 1.0 / rate
    due = [time.monotonic() + gap * i / n for i in range(n)]  # spread, so the stream is steady
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        for i in range(n):
            if due[i] > now:
                continue
            due[i] += gap
            sid, k = f"s{i:03d}", step[i] % 6
            if k == 0:
                turn[i] += 1
                j.write("turn.began", call="root", session=sid, turn=turn[i], prompt=f"task {i}: make it so\n#! run")
            elif k in (1, 4):
                j.write("text", call="root", session=sid, turn=turn[i],
                        text=f"thinking about step {step[i]} of c{i:03d}\nand a second line of it")
            elif k == 2:
                j.write("tool.started", call="root", session=sid, turn=turn[i], tool_call=f"t{step[i]}", tool="bash",
                        input={"command": f"pytest -q tests/test_{i}.py"})
            elif k == 3:
                j.write("tool.finished", call="root", session=sid, turn=turn[i], tool_call=f"t{step[i]}",
                        tool="bash", exit_code=0, ok=True, output="".join(f"line {x}\n" for x in range(8)))
            else:
                j.write("turn.ended", call="root", session=sid, turn=turn[i], status="ok", seconds=6 * gap,
                        usage={"input_tokens": 2000, "output_tokens": 100, "cost": 0.0024})
            step[i] += 1
        time.sleep(0.005)
    for i in range(n):
        if step[i] % 6:
            j.write("turn.ended", call="root", session=f"s{i:03d}", turn=turn[i], status="ok", seconds=0.0,
                    usage={"input_tokens": 2000, "output_tokens": 100, "cost": 0.0024})
    j.write("flow.returned", call="root", status="ok")
    j.write("run.ended", status="ok")
    j.close()
    print(sum(step) + 3 * n + 4, flush=True)  # how many records it wrote


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


async def view(base: Path, args: argparse.Namespace) -> None:
    from shoal.watch.app import WatchApp
    from shoal.watch.source import Source

    writer = subprocess.Popen([sys.executable, __file__, "--writer", str(base), "--conversations",
                               str(args.conversations), "--seconds", str(args.seconds), "--rate", str(args.rate)],
                              stdout=subprocess.PIPE, text=True)
    while not any(base.glob("*/journal.jsonl")):
        await asyncio.sleep(0.01)
    lags: dict[str, list[float]] = {"screen": [], "view": []}

    def probe(kind: str, t: float) -> None:
        lags[kind].append(time.time() - t)

    app = WatchApp(Source(base=base), probe=probe)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    wall0 = time.monotonic()
    async with app.run_test(size=(200, 50)) as pilot:
        second = 0
        while writer.poll() is None:
            await asyncio.sleep(1.0)
            second += 1
            if second % 8 in (5, 7):  # the list of all conversations, for two seconds in eight
                await pilot.press("l")
            elif second % 8 != 6:
                await pilot.press("n")  # the next working one: its screen is read back from the journal
        await asyncio.sleep(1.0)  # the last lines reach the screen
        m = app.model
        assert m is not None and m.over, "the view did not see the run end"
        shown = len(m.convs)
    wall = time.monotonic() - wall0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    written = int((writer.stdout.read() if writer.stdout else "0").strip() or 0)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(f"shoal watch, {shown} conversations streaming for {args.seconds:g} s: {written} records "
          f"({written / args.seconds:.0f}/s, {args.rate:g}/s each)")
    for kind, what in (("screen", "the conversation shown"), ("view", "bars and list, oldest record of each refresh")):
        xs = sorted(x * 1000 for x in lags[kind])
        if xs:
            print(f"  event-to-screen lag, {what}: p50 {pct(xs, 50):.0f} ms, p95 {pct(xs, 95):.0f} ms, "
                  f"max {xs[-1]:.0f} ms over {len(xs)} refreshes")
    print(f"  CPU of the view: {cpu:.1f} s over {wall:.1f} s = {100 * cpu / wall:.0f}% of one core; "
          f"max RSS {cpu1.ru_maxrss / 1024:.0f} MiB (the writer: {child.ru_utime + child.ru_stime:.1f} s CPU)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=4.0, help="records a second per conversation")
    p.add_argument("--writer", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.writer:
        write(args.writer, args.conversations, args.seconds, args.rate)
        return
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(view(Path(d), args))


if __name__ == "__main__":
    main()
