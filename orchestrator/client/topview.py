"""``orchestrator top``'s screen, in Textual (the ``tui`` extra): client/top.py is the entry
that checks the extra is there and loads this module; what is shown comes from
client/topfeed.py, whose loop runs in a Textual worker thread and posts each new View to
the UI thread as a message (never blocking on it).

    ┌ header: daemon, filter, "gone" ─────────────────────────────────┐
    │ pools        state, size/desired, restarts, CPU, RSS, tasks      │  the cursor picks a pool
    │ replicas     of the selected pool                                │  ... and a replica
    │ tasks        of the selected pool, if it is an executor pool     │  ... and a task
    │ log          tail of the selected replica's (or task's) log      │
    │ events       the latest of the journal                           │
    │ message line: what the last key did; the keys                    │
    └──────────────────────────────────────────────────────────────────┘

A key acts through the same client API as the CLI (channel.Client, verbs.py), in a thread
of its own (a rolling restart waits for its new replicas): the screen stays live, and the
answer shows in the message line. Those are plain daemon threads, not Textual's thread
workers: these run in asyncio's default executor, which is joined at exit, so ``q`` would
wait for a rolling restart to end. The feed's loop is a Textual worker: it stops at its
next tick once the app is closing.
"""

from __future__ import annotations

import threading
from typing import Callable, ClassVar, Sequence

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static
from textual.widgets.data_table import CellDoesNotExist

from ..errors import OrchestratorError
from ..paths import Paths
from .channel import Client
from .display import clock, size_text
from .topfeed import Feed, PoolRow, ReplicaRow, Selection, TaskRow, View, uptime

# What each key does, on screen (80 columns): r a rolling restart of the pool, +/- its size,
# t terminate the replica, s a signal to it, c cancel the task, d delete the pool (asked first).
KEYS = ("[b]r[/] restart  [b]+[/]/[b]-[/] scale  [b]t[/] term  [b]s[/] signal  [b]c[/] cancel  "
        "[b]d[/] delete  [b]/[/] filter  [b]q[/] quit")

# Widths that fit 80 columns with the cell padding and the scrollbar.
POOL_COLUMNS = (("POOL", 12), ("STATE", 9), ("SIZE", 7), ("RESTARTS", 8), ("CPU%", 5), ("RSS", 7),
                ("QUEUED", 6), ("RUNNING", 7))
REPLICA_COLUMNS = (("ID", 16), ("STATE", 11), ("PID", 7), ("UPTIME", 7), ("RESTARTS", 8), ("CPU%", 5),
                   ("RSS", 7))
TASK_COLUMNS = (("TASK", 14), ("STATE", 10), ("WORKER", 14), ("TRIES", 5), ("REASON", 20))
# Rows a table holds at most: a DataTable measures every cell of every row it is given
# (~0.5 ms a row, more under load), so a pool of 2,000 replicas took seconds to show. Beyond
# this many, the title says how many match, and the filter narrows them down.
ROWS_SHOWN = 100


class Fresh(Message):
    """A new View from the feed's thread."""

    def __init__(self, view: View) -> None:
        super().__init__()
        self.view = view


class Said(Message):
    """The answer to an operator's key, one line (from an action's thread)."""

    def __init__(self, text: str, error: bool) -> None:
        super().__init__()
        self.text = text
        self.error = error


class Confirm(ModalScreen[bool]):
    """y / n, for what cannot be undone (delete)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("y", "answer(True)", "yes"), Binding("n", "answer(False)", "no"),
                                             Binding("escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        yield Static(f"{self.question}\n\n[b]y[/] yes   [b]n[/] no", id="question")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class Ask(ModalScreen[str | None]):
    """One line of input (a signal's name), Enter to send, Esc to give up."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "cancel")]

    def __init__(self, prompt: str, value: str) -> None:
        super().__init__()
        self.prompt = prompt
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(id="question"):
            yield Static(self.prompt)
            yield Input(value=self.value, id="answer")

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _cpu(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _rss(value: int | None) -> str:
    return "" if value is None else size_text(value)


def pool_cells(p: PoolRow) -> tuple[str, ...]:
    return (p.name, p.state, f"{p.live}/{p.desired}", str(p.restarts), _cpu(p.cpu), _rss(p.rss),
            "" if p.queued is None else str(p.queued), "" if p.running is None else str(p.running))


def replica_cells(r: ReplicaRow) -> tuple[str, ...]:
    return (r.id, r.state, str(r.pid or ""), uptime(r.since) if r.state == "RUNNING" else "", str(r.restarts),
            _cpu(r.cpu), _rss(r.rss))


def task_cells(t: TaskRow) -> tuple[str, ...]:
    return (t.id, t.state, t.worker, str(t.attempts or ""), t.reason)


def sync_table(table: DataTable[str], rows: Sequence[tuple[str, tuple[str, ...]]]) -> None:
    """Make ``table`` show ``rows`` (key, cells) in order, changing only what changed, and
    keep the cursor on the row it was on (by key) when that row is still there."""
    wanted = [key for key, _ in rows]
    have = [str(k.value) for k in table.rows]
    if wanted != have:
        current = _cursor_key(table)
        table.clear()
        for key, cells in rows:
            table.add_row(*cells, key=key)
        if current in wanted:
            table.move_cursor(row=wanted.index(current), animate=False)
        return
    columns = [str(c.value) for c in table.columns]
    for key, cells in rows:
        old = table.get_row(key)
        for column, before, after in zip(columns, old, cells):
            if before != after:
                table.update_cell(key, column, after)


def _cursor_key(table: DataTable[str]) -> str | None:
    if table.row_count == 0:
        return None
    try:
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
    except CellDoesNotExist:  # a cursor past a table just emptied: no row
        return None


def _table(name: str, columns: Sequence[tuple[str, int]]) -> DataTable[str]:
    table: DataTable[str] = DataTable(id=name, cursor_type="row", zebra_stripes=False, show_cursor=True)
    for label, width in columns:
        table.add_column(label, width=width, key=label)
    return table


class TopApp(App[int]):
    """The screen. ``paths``: the daemon's state dir; ``client`` for the keys' commands;
    ``feed`` what is shown (its client bounded by its own timeout), primed or not."""

    TITLE = "orchestrator top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #header { height: 1; background: $primary-background; }
    #header.gone { background: $error; color: $text; }
    .pane { border-top: solid $secondary; border-title-align: left; border-title-color: $text;
            border-title-style: bold; height: 1fr; }
    DataTable { scrollbar-size-vertical: 1; scrollbar-size-horizontal: 0; }
    #pools { height: auto; max-height: 9; min-height: 3; }
    #replicas { height: 3fr; min-height: 4; }
    #tasks { height: 3fr; min-height: 4; display: none; }
    #tasks.shown { display: block; }
    #log { height: 2fr; min-height: 3; overflow: hidden hidden; }
    #events { height: 2fr; min-height: 3; overflow: hidden hidden; }
    #message { height: 1; color: $text-muted; }
    #message.error { color: $error; }
    #keys { height: 1; background: $primary-background; }
    #filter { height: 1; border: none; display: none; padding: 0 1; }
    #filter.shown { display: block; }
    Confirm, Ask { align: center middle; }
    #question { width: 60; height: auto; padding: 1 2; border: round $warning; background: $surface; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("r", "restart", "rolling restart"),
        Binding("plus,equals_sign", "scale(1)", "scale up"),
        Binding("minus", "scale(-1)", "scale down"),
        Binding("t", "terminate", "terminate"),
        Binding("s", "signal", "signal"),
        Binding("c", "cancel_task", "cancel task"),
        Binding("d", "delete", "delete"),
        Binding("slash", "filter", "filter"),
        Binding("e", "stream", "stdout/stderr", show=False),
        Binding("escape", "clear_filter", show=False),
    ]

    def __init__(self, paths: Paths, client: Client, feed: Feed) -> None:
        super().__init__()
        self.paths = paths
        self.client = client
        self.feed = feed
        self.last: View = feed.view
        self.filter = ""
        self.stream = "out"
        self.problem: str | None = None  # the feed's, as last shown
        self._stop = threading.Event()

    # -- layout ----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("orchestrator top: connecting ...", id="header")
        yield Input(placeholder="filter: a part of a name or a state; Enter keeps it, Esc clears it", id="filter")
        pools = _table("pools", POOL_COLUMNS)
        pools.add_class("pane")
        pools.border_title = "pools"
        yield pools
        replicas = _table("replicas", REPLICA_COLUMNS)
        replicas.add_class("pane")
        replicas.border_title = "replicas"
        yield replicas
        tasks = _table("tasks", TASK_COLUMNS)
        tasks.add_class("pane")
        tasks.border_title = "tasks"
        yield tasks
        log = Static("", id="log", classes="pane", markup=False)
        log.border_title = "log"
        yield log
        events = Static("", id="events", classes="pane", markup=False)
        events.border_title = "events"
        yield events
        yield Static("", id="message", markup=False)
        yield Static(KEYS, id="keys")

    def on_mount(self) -> None:
        self.query_one("#pools", DataTable).focus()
        self.show(self.last)  # what prime() read, if it ran: the first frame has data
        self.run_worker(self._feed_loop, name="feed", thread=True, exit_on_error=False)

    def on_unmount(self) -> None:
        self._stop.set()

    def _feed_loop(self) -> None:
        def publish(view: View) -> None:
            self.post_message(Fresh(view))  # thread-safe, and never waits for the UI

        self.feed.run(publish, self._stop)

    # -- what the feed says ------------------------------------------------------------

    def on_fresh(self, message: Fresh) -> None:
        self.last = message.view
        self.show(message.view)

    def on_said(self, message: Said) -> None:
        line = self.query_one("#message", Static)
        line.update(message.text)
        line.set_class(message.error, "error")

    def matches(self, *cells: str) -> bool:
        want = self.filter.lower()
        return not want or any(want in c.lower() for c in cells)

    def show(self, view: View) -> None:
        header = self.query_one("#header", Static)
        text = view.daemon if view.gone is None else f"{view.gone}  ({view.daemon})"
        if self.filter:
            text += f"  filter: {self.filter}"
        header.update(Text(text))
        header.set_class(view.gone is not None, "gone")
        pools = [(p.name, pool_cells(p)) for p in view.pools]
        self._fill(self.query_one("#pools", DataTable), "pools", pools)
        self._show_pool(view)
        log = self.query_one("#log", Static)
        log.border_title = view.log_title or "log"
        height = max(1, log.size.height or 3)
        log.update(Text("\n".join(line[:400] for line in view.log[-height:]), no_wrap=True, overflow="ellipsis"))
        events = self.query_one("#events", Static)
        shown = [f"{clock(e.ts)[11:]} {e.kind:<10} {e.who:<14} {e.text}" for e in view.events]
        shown = [line for line in shown if self.matches(line)]
        height = max(1, events.size.height or 3)
        events.update(Text("\n".join(shown[-height:]), no_wrap=True, overflow="ellipsis"))
        if view.problem is not None and view.problem != self.problem:
            self.post_message(Said(view.problem, True))
        self.problem = view.problem

    def _show_pool(self, view: View) -> None:
        """The replicas (and tasks) of the pool under the cursor."""
        pool = self.selected_pool()
        rows = [(r.id, replica_cells(r)) for r in view.replicas if r.pool == pool]
        self._fill(self.query_one("#replicas", DataTable), f"replicas of {pool}" if pool else "replicas", rows)
        tasks = self.query_one("#tasks", DataTable)
        executor = any(p.name == pool and p.kind == "executor" for p in view.pools)
        tasks.set_class(executor, "shown")
        rows = [(t.id, task_cells(t)) for t in view.tasks] if view.tasks_pool == pool else []
        self._fill(tasks, f"tasks of {pool}" if executor else "tasks", rows)
        self._tell_feed()

    def _fill(self, table: DataTable[str], title: str, rows: Sequence[tuple[str, tuple[str, ...]]]) -> None:
        """The rows that pass the filter, ROWS_SHOWN at most (the title says when more match)."""
        shown = [(k, c) for k, c in rows if self.matches(*c)]
        table.border_title = title if len(shown) <= ROWS_SHOWN else f"{title}: {ROWS_SHOWN} of {len(shown)} (/ filters)"
        sync_table(table, shown[:ROWS_SHOWN])

    # -- the cursor ---------------------------------------------------------------------

    def _key_of(self, name: str) -> str | None:
        return _cursor_key(self.query_one(f"#{name}", DataTable))

    def selected_pool(self) -> str | None:
        return self._key_of("pools")

    def selected_replica(self) -> str | None:
        return self._key_of("replicas")

    def selected_task(self) -> str | None:
        tasks = self.query_one("#tasks", DataTable)
        return self._key_of("tasks") if tasks.has_class("shown") else None

    def _tell_feed(self) -> None:
        tasks = self.query_one("#tasks", DataTable)
        log_of = "task" if self.focused is tasks and tasks.has_class("shown") else "replica"
        self.feed.select(Selection(pool=self.selected_pool(), replica=self.selected_replica(),
                                   task=self.selected_task(), log_of=log_of, stream=self.stream))

    @on(DataTable.RowHighlighted)
    def highlighted(self, event: DataTable.RowHighlighted) -> None:
        table = event.data_table.id
        if table == "pools":
            self._show_pool(self.last)
        self._tell_feed()

    def on_descendant_focus(self) -> None:
        self._tell_feed()  # the log pane shows the task's log while the tasks have the focus

    # -- the keys -------------------------------------------------------------------------

    def act(self, what: str, call: Callable[[], str]) -> None:
        """Run ``call`` (a command through the client) in a thread; its line, or its error,
        in the message line; then a refresh."""
        self.post_message(Said(f"{what} ...", False))

        def work() -> None:
            try:
                text, error = call(), False
            except OrchestratorError as err:
                text, error = f"{what}: {err}", True
            self.feed.poke()
            self.post_message(Said(text, error))

        threading.Thread(target=work, name=f"top: {what}", daemon=True).start()

    def _need(self, what: str, value: str | None) -> str | None:
        if value is None:
            self.post_message(Said(f"no {what} selected", True))
        return value

    def action_restart(self) -> None:
        pool = self._need("pool", self.selected_pool())
        if pool is not None:
            def call() -> str:
                done = self.client.restart(pool=pool)
                pairs = ", ".join(f"{a} -> {b}" for a, b in done["replaced"].items())
                return f"restarted {pool}: {pairs or 'nothing to replace'}"
            self.act(f"rolling restart of {pool}", call)

    def action_scale(self, by: int) -> None:
        pool = self._need("pool", self.selected_pool())
        row = next((p for p in self.last.pools if p.name == pool), None)
        if pool is None or row is None:
            return
        n = max(0, row.desired + by)

        def call() -> str:
            done = self.client.scale(pool, n)
            return f"{pool}: desired {done['desired']}"
        self.act(f"scale {pool} to {n}", call)

    def action_terminate(self) -> None:
        rid = self._need("replica", self.selected_replica())
        if rid is not None:
            self.act(f"terminate {rid}", lambda: f"terminated {', '.join(self.client.terminate(rid)) or rid}")

    def action_signal(self) -> None:
        rid = self._need("replica", self.selected_replica())
        if rid is None:
            return

        def send(sig: str | None) -> None:
            if sig:
                self.act(f"signal {sig} to {rid}",
                         lambda: f"{sig} -> {', '.join(self.client.signal(sig, rid)['sent']) or 'nobody'}")
        self.push_screen(Ask(f"Signal for {rid} (a name or a number: HUP, USR1, TERM, 9):", "HUP"), send)

    def action_cancel_task(self) -> None:
        task = self._need("task", self.selected_task())
        if task is not None:
            def call() -> str:
                done = self.client.call("task_cancel", {"ids": [task]})
                return f"cancelled {task}" if done and done[0] else f"{task} had ended already: not cancelled"
            self.act(f"cancel {task}", call)

    def action_delete(self) -> None:
        pool = self._need("pool", self.selected_pool())
        if pool is None:
            return
        live = sum(r.pool == pool for r in self.last.replicas)

        def answer(yes: bool | None) -> None:
            if yes:
                self.act(f"delete {pool}", lambda: f"deleted pool {self.client.delete(pool)['pool']}")
            else:
                self.post_message(Said(f"{pool} kept", False))
        self.push_screen(Confirm(f"Delete pool {pool} and terminate its {live} replica(s)?"), answer)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.value = self.filter
        box.focus()

    @on(Input.Submitted, "#filter")
    def filter_submitted(self, event: Input.Submitted) -> None:
        self.set_filter(event.value.strip())

    def set_filter(self, text: str) -> None:
        self.filter = text
        box = self.query_one("#filter", Input)
        box.remove_class("shown")
        self.query_one("#pools", DataTable).focus()
        self.show(self.last)

    def action_clear_filter(self) -> None:
        self.set_filter("")

    def action_stream(self) -> None:
        self.stream = "err" if self.stream == "out" else "out"
        self._tell_feed()

    async def action_quit(self) -> None:
        self._stop.set()
        self.exit(0)


def run(paths: Paths, client: Client, feed: Feed) -> int:
    app = TopApp(paths, client, feed)
    code = app.run()
    return 0 if code is None else int(code)


__all__ = ["Confirm", "Ask", "TopApp", "run", "sync_table"]
