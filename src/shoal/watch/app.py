"""The terminal view: a run's agents and `k of N` above, one conversation's stream below.

Every tick (a twentieth of a second) folds what the journal grew by into the model, appends the
new lines of the conversation shown, and rewrites the bars; the list of all conversations is
redrawn at most twice a second, and only the rows that moved. Nothing else is drawn, so two
hundred conversations streaming cost the reading of their lines and one screen's worth of
drawing.

Keys: n / p the next / previous conversation with a turn in flight (a toggles stepping over
all of them), ] / [ the next / previous agent, l the list (enter opens a row), f the full
record of the conversation shown (read back from the journal), q leaves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rich.highlighter import Highlighter
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.coordinate import Coordinate
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Log, Static

from shoal.watch import panels, render
from shoal.watch.model import SCREEN_LINES, Model
from shoal.watch.source import Source, alive

TICK = 0.05  # seconds between reads of the journal
LIST_EVERY = 0.5  # seconds between redraws of the list
GONE_AFTER = 3.0  # seconds between asking whether a quiet run's writer is still there
COLOURS = {"turn": "bold cyan", "prompt": "bold", "command": "yellow", "tool": "yellow", "output": "grey62",
           "ok": "green", "failed": "bold red", "notice": "magenta", "info": "grey50"}

Probe = Callable[[str, float], None]


class LineColours(Highlighter):
    """Colours a screen line by its first character (see `render.MARKS`)."""

    def highlight(self, text: Text) -> None:
        colour = COLOURS.get(render.MARKS.get(text.plain[:1], ""))
        if colour:
            text.stylize(colour)


def screen_log(max_lines: int | None, id: str) -> Log:
    log = Log(highlight=True, max_lines=max_lines, id=id)
    log.highlighter = LineColours()
    return log


class FullRecord(Screen[None]):
    """One conversation's whole record, read back from the journal (the screen keeps only its tail)."""

    BINDINGS = [Binding("escape,q,f", "app.pop_screen", "back")]

    def __init__(self, title: str, lines: list[str]) -> None:
        super().__init__()
        self.title_text, self.lines = title, lines

    def compose(self) -> ComposeResult:
        yield Static(self.title_text, id="full-title")
        yield screen_log(None, "full")
        yield Footer()

    def on_mount(self) -> None:
        log = self.query_one("#full", Log)
        log.auto_scroll = False
        log.write_lines(self.lines)
        log.scroll_home(animate=False)


class WatchApp(App[None]):
    CSS = """
    #run { height: 1; background: $panel; }
    #agents { height: 1; background: $boost; }
    #title { height: 1; background: $primary-background; }
    #full-title { height: 1; background: $primary-background; }
    #screen, #full { height: 1fr; }
    #list { height: 1fr; display: none; }
    """
    BINDINGS = [
        Binding("n", "step(1)", "next working"),
        Binding("p", "step(-1)", "previous"),
        Binding("a", "toggle_all", "working/all"),
        Binding("right_square_bracket", "agent(1)", "next agent"),
        Binding("left_square_bracket", "agent(-1)", "prev agent", show=False),
        Binding("l", "toggle_list", "list"),
        Binding("f", "full", "full record"),
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),  # as in any terminal program
    ]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, source: Source, *, speed: float | None = None, stop_when: Callable[[], bool] | None = None,
                 probe: Probe | None = None) -> None:
        super().__init__()
        self.source = source
        self.speed = speed
        self.stop_when = stop_when  # the work behind `--watch` ended without ever starting a run
        self.probe = probe  # bench: told, after the refresh, the write time of records it put on screen
        self.model: Model | None = None
        self.current: str | None = None
        self.working_only = True
        self.listing = False
        self._list_at = 0.0
        self._rows: dict[str, tuple[str, ...]] = {}
        self._row_order: list[str] = []
        self._asked = -GONE_AFTER  # when we last asked whether the run's writer is alive
        self._told_end = False
        self._said: dict[str, str] = {}

    def compose(self) -> ComposeResult:
        # held, not queried: a query asks the screen on top, which is not this one while the
        # full record is shown, and ticks go on under it
        self._bar = {f"#{name}": Static(id=name) for name in ("run", "agents", "title")}
        self._screen_log = screen_log(SCREEN_LINES, "screen")
        self._table: DataTable[str] = DataTable(id="list", cursor_type="row", zebra_stripes=True)
        yield from self._bar.values()
        yield self._screen_log
        yield self._table
        yield Footer()

    def on_ready(self) -> None:
        # on Ready, not Mount: the widgets the first tick fills are all there by then
        self._table.add_columns(*panels.COLUMNS)
        self.tick()
        self.set_interval(TICK, self.tick)

    # --- following the journal --------------------------------------------------------------------

    def tick(self) -> None:
        """Read what the run wrote since the last tick and show it."""
        if self.model is None:
            path = self.source.locate()
            if path is None:
                if self.stop_when is not None and self.stop_when():
                    self.exit()
                self._bars()
                return
            self.model = Model(path, speed=self.speed)
        m = self.model
        ch = m.poll()
        now = time.monotonic()
        if not ch.records and not m.over and not m.replaying and now - self._asked > GONE_AFTER:
            self._asked = now  # caught up with a run that has not ended: is its writer still there?
            if not alive(m.pid):
                m.abandon()
                ch.run = True
        if m.over and not self._told_end:
            self._told_end = True
            self.notify(f"the run ended ({m.run_status}); q leaves", timeout=5)
        shown = self.current
        if self.current is None or ch.shape:
            self._keep_current()
        if self.current is not None and self.current == shown and self.current in ch.rebuilt:
            self.show(self.current)  # its screen was merged with its unit's: read it back whole
        elif self.current is not None and self.current == shown and self.current in ch.lines:
            self._screen_log.write_lines(ch.lines[self.current])
            if self.probe is not None:
                self.call_after_refresh(self.probe, "screen", ch.latest[self.current])
        self._bars()
        if self.listing and (ch.shape or now - self._list_at >= LIST_EVERY):
            self._draw_list(ch.shape)
        if self.probe is not None and ch.records:
            self.call_after_refresh(self.probe, "view", ch.oldest)  # the longest any record of this tick waited

    def _keep_current(self) -> None:
        """After conversations came, went or merged: still the same one, or the first there is."""
        assert self.model is not None
        key = self.model.resolve(self.current)
        if key is None:
            order = self.model.order()
            if not order:
                return
            key = order[0]
        if key != self.current:
            self.show(key)

    def _bars(self) -> None:
        m = self.model
        self._put("#run", panels.run_line(m, self.source.waiting_for, self.working_only))
        if m is None:
            return
        agents = panels.agent_lines(m, self.current)
        bar = self._bar["#agents"]
        if bar.styles.height is None or bar.styles.height.value != len(agents):
            bar.styles.height = len(agents)  # one line per agent, set rather than measured on every redraw
        self._put("#agents", "\n".join(agents))
        if self.current is not None:
            self._put("#title", panels.title_line(m, self.current))

    def _put(self, selector: str, text: str) -> None:
        # drawing is most of what the view costs: a bar is redrawn only when its words change,
        # and never changes the layout (each bar's height is set, not measured)
        if self._said.get(selector) != text:
            self._said[selector] = text
            self._bar[selector].update(text, layout=False)

    # --- what is shown ----------------------------------------------------------------------------

    def show(self, key: str) -> None:
        """Show one conversation: its kept screen, or its tail read back from the journal."""
        assert self.model is not None
        self.current = key
        log = self._screen_log
        log.clear()
        log.write_lines(list(self.model.screen(key)))
        self._bars()

    def _draw_list(self, reshaped: bool) -> None:
        assert self.model is not None
        m, table = self.model, self._table
        self._list_at = time.monotonic()
        order = m.order()
        if reshaped or order != self._row_order:
            table.clear()
            self._rows = {k: panels.row(m, k) for k in order}
            for k in order:
                table.add_row(*self._rows[k], key=k)
            self._row_order = list(order)
            return
        for i, k in enumerate(order):
            new = panels.row(m, k)
            old = self._rows.get(k)
            if new != old:
                for column, (a, b) in enumerate(zip(old or (), new, strict=False)):
                    if a != b:
                        table.update_cell_at(Coordinate(i, column), b)
                self._rows[k] = new

    # --- keys --------------------------------------------------------------------------------------

    def action_step(self, delta: int) -> None:
        if self.model is None:
            return
        # with nothing working (a finished run), stepping goes over all rather than nowhere
        key = self.model.step(self.current, delta, self.working_only) or self.model.step(self.current, delta, False)
        if key is not None:
            self.show(key)
            self._follow_in_list()

    def action_toggle_all(self) -> None:
        self.working_only = not self.working_only
        self._bars()

    def action_agent(self, delta: int) -> None:
        m = self.model
        if m is None or self.current is None:
            return
        ids = m.agent_ids()
        mine = m.convs[self.current].agent
        if len(ids) < 2 or mine not in ids:
            return
        keys = m.of_agent(ids[(ids.index(mine) + delta) % len(ids)])
        working = [k for k in keys if m.convs[k].in_flight is not None]
        self.show((working or keys)[0])

    def action_toggle_list(self) -> None:
        if self.model is None:
            return
        self.listing = not self.listing
        table = self._table
        self._screen_log.display = not self.listing
        table.display = self.listing
        if self.listing:
            self._draw_list(True)
            self._follow_in_list()
            table.focus()

    def _follow_in_list(self) -> None:
        if self.listing and self.current in self._row_order:
            self._table.move_cursor(row=self._row_order.index(self.current))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        key = event.row_key.value
        if key is not None and self.model is not None and key in self.model.convs:
            self.show(key)
            self.action_toggle_list()

    def action_full(self) -> None:
        if self.model is None or self.current is None:
            return
        c = self.model.convs[self.current]
        lines = self.model.full(self.current)
        self.push_screen(FullRecord(f"[b]{c.name}[/]: the full record, {len(lines)} lines (esc goes back)", lines))

    def on_unmount(self) -> None:
        if self.model is not None:
            self.model.close()


def watch(ref: str | Path | None = None, *, base: Path | None = None, speed: float | None = None) -> None:
    """Open the view on a run (the latest when `ref` is None) and return when it is left."""
    WatchApp(Source(ref, base=base), speed=speed).run()
