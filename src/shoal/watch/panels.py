"""The words on `shoal watch`'s bars and list rows, as plain functions of the model.

Kept apart from the widgets so what the screen says can be read (and tested) without a
terminal: Rich markup strings in, Textual shows them.
"""

from __future__ import annotations

from rich.markup import escape

from shoal.watch.model import Model

STYLE = {"working": "bold yellow", "starting": "yellow", "checking": "cyan", "queued": "dim", "idle": "blue",
         "done": "green", "failed": "bold red", "stuck": "bold magenta", "stopped": "red", "skipped": "dim"}
ORDER = ("working", "starting", "checking", "queued", "idle", "done", "failed", "stuck", "stopped", "skipped")
MAX_AGENT_LINES = 5


def styled(status: str) -> str:
    return f"[{STYLE.get(status, 'white')}]{status}[/]"


def clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def run_line(m: Model | None, waiting_for: str, working_only: bool) -> str:
    if m is None:
        return f"[b]shoal watch[/]  waiting for {escape(waiting_for)}"
    if m.over:
        state = f"[{'green' if m.run_status == 'ok' else 'red'}]ended {m.run_status}[/] — q leaves"
    else:
        state = "[yellow]replaying[/]" if m.replaying else "[yellow]live[/]"
    tokens = sum(c.tokens for c in m.convs.values())
    cost = sum(c.cost for c in m.convs.values())
    working = len(m.working())
    stepping = "working" if working_only else "all"
    if working_only and not working:
        stepping = "working (none now: all)"
    return (f"[b]shoal watch[/]  run {escape(m.path.parent.name)} {escape(m.run_name)}  {state}  "
            f"{clock(m.now() - m.run_began) if m.run_began else ''}  {len(m.convs)} conversations  "
            f"{tokens} tok  ${cost:.4f}  ·  stepping: {stepping}")


def agent_lines(m: Model, current: str | None) -> list[str]:
    """One line per agent: `k of N` for the agent of the conversation shown (N: all it holds)."""
    ids = m.agent_ids()
    mine = m.convs[current].agent if current in m.convs else (ids[0] if ids else "")
    if len(ids) > MAX_AGENT_LINES:  # the current agent always shows; the rest as far as they fit
        start = ids.index(mine) if mine in ids else 0
        shown = [ids[(start + i) % len(ids)] for i in range(MAX_AGENT_LINES - 1)]
        rest = len(ids) - len(shown)
    else:
        shown, rest = ids, 0
    out = []
    for a in shown:
        keys = m.of_agent(a)
        counts = m.counts(keys)
        figures = "  ".join(f"{styled(s)} {counts[s]}" for s in ORDER if counts.get(s))
        label = escape(m.agent(a).label)
        if a == mine and current in keys:
            out.append(f"[reverse] ▶ {label} [/]  [b]{keys.index(current) + 1} of {len(keys)}[/]  {figures}")
        else:
            out.append(f"   {label}  {len(keys)} conversations  {figures}")
    if rest:
        out.append(f"   … and {rest} more agents (] and [ step between agents)")
    return out


def title_line(m: Model, key: str) -> str:
    c = m.convs[key]
    status = m.status(key)
    turn = f"  turn {c.turns}" if c.turns else ""
    place = f"  @ {escape(c.place)}" if c.place else ""
    hidden = m.hidden(key)
    more = f"  [dim]({hidden} earlier lines: f shows the full record)[/]" if hidden else ""
    error = f"  [red]{escape(c.error[:80])}[/]" if c.error and status in ("failed", "stuck", "stopped") else ""
    return (f"[b]{escape(c.name)}[/]  {styled(status)}{turn}{place}  {c.tokens} tok  ${c.cost:.4f}  "
            f"{clock(c.seconds(m.now()))}{error}{more}")


COLUMNS = ("agent", "conversation", "status", "place", "tokens", "cost $", "time", "doing")


def row(m: Model, key: str) -> tuple[str, ...]:
    c = m.convs[key]
    return (m.agent(c.agent).name or c.agent[:6], c.name, styled(m.status(key)), _tail(c.place, 40), str(c.tokens),
            f"{c.cost:.4f}", clock(c.seconds(m.now())), escape(c.doing[:60]))


def _tail(text: str, width: int) -> str:
    return escape(text if len(text) <= width else "…" + text[-(width - 1):])
