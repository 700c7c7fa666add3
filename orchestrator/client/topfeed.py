"""What ``orchestrator top`` shows, gathered in the client's process: the data side of the
screen (client/top.py draws it with Textual; this module imports no UI library).

    daemon                          top's feed thread (a Textual worker)        the UI thread
    ──────                          ──────────────────────────────────          ─────────────
    journal: state.db  ─ read-only ─►  tail of the events (after_seq), 10 Hz
                                        │ new events → a status refresh due
    control loop ◄── status / tasks ──  │ (coalesced: one per STATUS_GAP)
                                        │ psutil: CPU and RSS of live pids ─────►  View (frozen)
    logs/<id>.out  ─── read ─────────►  tail of the selected replica's log    ──►  drawn

Why the journal and not ``status`` at a high rate: every change the daemon makes (a
transition, a task's, a command applied, a pool in crash loop) is an event committed in the
turn that made it, and reading the tail of state.db costs the daemon nothing, as ``events
--follow`` reads it. The daemon is asked for ``status`` (and the selected executor pool's
``tasks``) only once something happened, so an idle host with 2,000 replicas is not asked
at all; the CPU and RSS columns are read from /proc here, by pid, never by the daemon.

The daemon going away (``stop``, a crash, kill -9) is seen as its pid file no longer naming
its pid: the last view is kept and says so; a daemon that comes back is followed again.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import DaemonNotRunning, OrchestratorError
from ..paths import Paths, running_pid
from .display import duration, size_text

if TYPE_CHECKING:
    from ..store import Store
    from .channel import Client

TICK = 0.1  # seconds between two reads of the journal's tail (a transition shows within 1 s)
STATUS_GAP = 0.25  # at most one status refresh per this many seconds, however many events come
USAGE_EVERY = 2.0  # seconds between two samples of the replicas' CPU and RSS
LOG_EVERY = 0.5  # seconds between two looks at the selected replica's log
PID_EVERY = 1.0  # seconds between two looks at the daemon's pid file (a kill -9 leaves no event)
EVENTS_KEPT = 200  # the latest events shown
ENDED_TASKS_KEPT = 20  # tasks seen ending (in the journal) shown below the unfinished ones
LOG_LINES = 100

# A reader of a log: (paths, id, stream, lines) -> its last lines, by whose it is: "replica"
# and "task" both read the daemon's captured files (a task's own: logs POOL/N).
LogReader = Callable[[Paths, str, str, int], list[str]]


def captured_log(paths: Paths, log_id: str, stream: str, lines: int) -> list[str]:
    from ..logread import tail

    return tail(paths.logs, log_id, stream=stream, lines=lines)


@dataclass(frozen=True)
class PoolRow:
    name: str
    kind: str  # "executor" or "" (a pool of replicas)
    state: str  # ok, crashloop, stopped, ...
    reason: str
    live: int  # replicas not ended
    desired: int
    restarts: int
    cpu: float | None  # percent of a core, summed over its live replicas (None: not sampled yet)
    rss: int | None  # bytes, summed
    queued: int | None  # tasks (executor pools only)
    running: int | None


@dataclass(frozen=True)
class ReplicaRow:
    id: str
    pool: str
    state: str
    pid: int | None
    since: float | None  # wall clock it started (for its uptime)
    restarts: int
    reason: str
    cpu: float | None
    rss: int | None


@dataclass(frozen=True)
class TaskRow:
    id: str
    state: str
    worker: str
    attempts: int
    reason: str


@dataclass(frozen=True)
class EventLine:
    seq: int
    ts: float
    kind: str
    who: str  # the replica, task or pool it is about ("" for the daemon's own)
    text: str


@dataclass(frozen=True)
class Selection:
    """What the screen has its cursor on: the feed reads more of it (its tasks, its log)."""

    pool: str | None = None
    replica: str | None = None
    task: str | None = None
    log_of: str = "replica"  # whose log the log pane shows: "replica" or "task"
    stream: str = "out"


@dataclass(frozen=True)
class View:
    """One consistent picture, handed to the UI thread whole (nothing in it changes)."""

    daemon: str  # the header: pid, uptime, containment
    pools: tuple[PoolRow, ...] = ()
    replicas: tuple[ReplicaRow, ...] = ()  # live ones, every pool's
    tasks_pool: str | None = None  # whose tasks ``tasks`` are
    tasks: tuple[TaskRow, ...] = ()
    events: tuple[EventLine, ...] = ()
    log_title: str = ""
    log: tuple[str, ...] = ()
    gone: str | None = None  # why the daemon is not there: this is its last view
    problem: str | None = None  # a read that failed (the journal, a command), one line
    made: float = field(default_factory=time.monotonic)


def event_line(ev: Mapping[str, Any]) -> EventLine:
    """An event of the journal as one short line (``events`` prints the whole JSON)."""
    raw = ev.get("data")
    data: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    kind = str(ev.get("kind"))
    who = str(ev.get("replica") or data.get("task") or data.get("pool") or "")
    if kind in ("transition", "task"):
        text = f"{data.get('from') or 'new'} -> {data.get('to')}"
        if data.get("reason"):
            text += f" ({data['reason']})"
    elif kind == "command":
        text = f"{data.get('op')} " + ("ok" if data.get("ok") else f"failed: {data.get('error')}")
    elif kind == "restart":
        who = str(data.get("replica") or who)
        text = f"replaced in {data.get('delay')} s"
    else:
        text = " ".join(f"{k}={v}" for k, v in data.items() if k not in ("pool",))
    return EventLine(int(ev.get("seq") or 0), float(ev.get("ts") or 0.0), kind, who, text)


class Usage:
    """CPU (percent of a core since the last sample; at the first, since the process
    started) and RSS of processes, by pid, from one read of ``/proc/PID/stat`` each (psutil
    reads two files and makes an object per pid: 2,000 replicas every 2 s cost top ~3x
    more CPU with it). A pid whose start time changed (reused) starts over."""

    TICKS = os.sysconf("SC_CLK_TCK")
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, float, int]] = {}  # pid -> (start ticks, when, busy ticks)
        self.sample: dict[int, tuple[float, int]] = {}  # pid -> (cpu %, rss bytes)

    def take(self, pids: Sequence[int]) -> None:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])  # seconds since boot: where start times count from
        now = time.monotonic()
        last, self._last, sample = self._last, {}, {}
        for pid in pids:
            fields = _stat_fields(pid)
            if fields is None:
                continue
            busy, born, rss = int(fields[11]) + int(fields[12]), int(fields[19]), int(fields[21]) * self.PAGE
            before = last.get(pid)
            if before is not None and before[0] == born and now > before[1]:
                cpu = 100.0 * (busy - before[2]) / self.TICKS / (now - before[1])
            else:
                cpu = 100.0 * busy / self.TICKS / max(uptime - born / self.TICKS, 1e-3)
            self._last[pid] = (born, now, busy)
            sample[pid] = (cpu, rss)
        self.sample = sample


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat`` from its 3rd field (state) on: [11] utime, [12] stime, [19] start
    time, [21] rss pages; None if there is no such process. The 2nd (comm, in parentheses)
    may hold anything, so the rest starts after its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:  # gone, or reaped between the open and the read
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return fields if len(fields) > 21 else None


class Feed:
    """Reads the daemon for ``top``: ``run`` is its loop (a thread of the client's own),
    ``select`` and ``poke`` are called from the UI thread, ``view`` is the latest picture.
    ``log_readers``: how a log is read, by whose it is ("replica"; "task" when a task is
    selected): the captured files by default, a test's stand-in otherwise. ``daemon_pid``: who holds
    the state dir's pid file (paths.running_pid; a test's stand-in)."""

    def __init__(self, paths: Paths, client: Client, *, tick: float = TICK,
                 log_readers: Mapping[str, LogReader] | None = None,
                 daemon_pid: Callable[[Paths], int | None] = running_pid) -> None:
        self.paths = paths
        self.client = client
        self.tick = tick
        self.daemon_pid = daemon_pid
        self.log_readers: dict[str, LogReader] = {"replica": captured_log, "task": captured_log, **(log_readers or {})}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._running = threading.Lock()  # prime() and run(): one at a time, in order
        self._next_pid = self._next_status = 0.0
        self._selection = Selection()
        self._status_due = True
        self._tasks_due = True
        self._log_due = True
        self._pid = daemon_pid(paths)
        self._store: Store | None = None
        self._seq = 0
        self._events: list[EventLine] = []
        self._ended: dict[str, TaskRow] = {}  # tasks seen ending in the journal, by pool/... id
        self._status: dict[str, Any] | None = None
        self._tasks: tuple[str | None, tuple[TaskRow, ...]] = (None, ())
        self._log: tuple[str, tuple[str, ...]] = ("", ())
        self._usage = Usage()
        self._gone: str | None = None
        self._problem: str | None = None
        self.view = View(daemon="connecting ...")

    # -- from the UI thread ----------------------------------------------------------

    def select(self, selection: Selection) -> None:
        with self._lock:
            if selection == self._selection:
                return
            pool_changed = selection.pool != self._selection.pool
            self._selection = selection
            self._log_due = True
            self._tasks_due = self._tasks_due or pool_changed
        self._wake.set()

    def poke(self) -> None:
        """Refresh now (an action of the operator was answered)."""
        with self._lock:
            self._status_due = self._tasks_due = self._log_due = True
        self._wake.set()

    # -- the loop --------------------------------------------------------------------

    def prime(self) -> None:
        """The first reads (the journal's tail, ``status``), so that the first frame has
        data: top.py runs this while the UI library is being imported."""
        with self._running:
            now = time.monotonic()
            self._tail()
            self._check_daemon()
            self._refresh_status()
            self._refresh_tasks(self._selection)
            self._next_pid = now + PID_EVERY
            self._next_status = now + STATUS_GAP
            self.view = self._make_view()

    def run(self, publish: Callable[[View], None], stop: threading.Event) -> None:
        """Until ``stop`` is set: read what changed and ``publish`` a new View when the
        picture changed. Every call it makes is bounded (the client's timeout)."""
        with self._running:
            try:
                self._loop(publish, stop)
            finally:
                if self._store is not None:
                    self._store.close()
                    self._store = None

    def _loop(self, publish: Callable[[View], None], stop: threading.Event) -> None:
        # The CPU and RSS are read after the first frame is out (psutil's import, /proc).
        next_usage, next_log = time.monotonic() + 0.2, 0.0
        while not stop.is_set():
            now = time.monotonic()
            changed = self._tail()
            if now >= self._next_pid:
                self._next_pid = now + PID_EVERY
                changed |= self._check_daemon()
            with self._lock:
                status_due, tasks_due, log_due = self._status_due, self._tasks_due, self._log_due
                selection = self._selection
            if status_due and now >= self._next_status and self._gone is None:
                self._next_status = now + STATUS_GAP
                changed |= self._refresh_status()
            if tasks_due and self._gone is None:
                changed |= self._refresh_tasks(selection)
            if now >= next_usage and self._status is not None and self._gone is None:
                next_usage = now + USAGE_EVERY
                self._usage.take([r["pid"] for r in self._status["replicas"] if r.get("pid")])
                changed = True
            if log_due or now >= next_log:
                next_log = now + LOG_EVERY
                changed |= self._read_log(selection)
            if changed:
                self.view = self._make_view()
                publish(self.view)
            self._wake.wait(self.tick)
            self._wake.clear()

    def _tail(self) -> bool:
        """The journal's new events; True if there were any. A status refresh is due after
        any, a tasks refresh after one of the selected pool's tasks."""
        from ..store import Store, StoreError

        try:
            if self._store is None:
                if not self.paths.db.exists():
                    return False
                self._store = Store(self.paths.db, readonly=True)
                last = self._store.last_seq()
                self._seq = max(0, last - EVENTS_KEPT)
            rows = self._store.events(after_seq=self._seq)
        except (StoreError, OSError) as err:
            if self._store is not None:
                self._store.close()
                self._store = None
            self._problem = f"journal: {err}"
            return True
        if not rows:
            return False
        with self._lock:
            pool = self._selection.pool
        tasks_due = False
        for ev in rows:
            self._seq = max(self._seq, int(ev["seq"]))
            line = event_line(ev)
            self._events.append(line)
            data = ev["data"] if isinstance(ev["data"], dict) else {}
            if ev["kind"] == "task":
                self._task_seen(data)
                tasks_due |= data.get("pool") == pool
        del self._events[:-EVENTS_KEPT]
        with self._lock:
            self._status_due = True
            self._tasks_due |= tasks_due
        return True

    def _task_seen(self, data: Mapping[str, Any]) -> None:
        task_id, state = str(data.get("task")), str(data.get("to"))
        if state in ("DONE", "FAILED", "CANCELLED", "TIMED_OUT", "LOST"):
            self._ended.pop(task_id, None)
            self._ended[task_id] = TaskRow(task_id, state, str(data.get("worker") or "-"), 0,
                                           str(data.get("reason") or ""))
            while len(self._ended) > ENDED_TASKS_KEPT * 8:  # over all pools; each shows its last few
                self._ended.pop(next(iter(self._ended)))
        else:
            self._ended.pop(task_id, None)

    def _check_daemon(self) -> bool:
        """Has the daemon gone, or come back? True if that changed."""
        try:
            pid = self.daemon_pid(self.paths)
        except OrchestratorError:
            pid = None
        if self._gone is None:
            if pid is not None and pid == self._pid:
                return False
            self._gone = (f"the daemon (pid {self._pid}) is gone since {time.strftime('%H:%M:%S')}"
                          f"; this is its last view")
            return True
        if pid is None or pid == self._pid:
            return False
        try:  # another daemon runs in this state dir now: follow it
            self.client.renew()
        except DaemonNotRunning:
            return False
        self._pid, self._gone = pid, None
        with self._lock:
            self._status_due = self._tasks_due = True
        return True

    def _refresh_status(self) -> bool:
        with self._lock:
            self._status_due = False
        try:
            self._status = self.client.status()
            self._problem = None
        except DaemonNotRunning:
            self._check_daemon()
        except OrchestratorError as err:
            self._problem = f"status: {err}"
            self._check_daemon()
        return True

    def _refresh_tasks(self, selection: Selection) -> bool:
        with self._lock:
            self._tasks_due = False
        pool = selection.pool
        kinds = {p["name"]: p.get("kind") for p in (self._status or {}).get("pools", [])}
        if pool is None or kinds.get(pool) != "executor":
            changed = self._tasks != (None, ())
            self._tasks = (None, ())
            return changed
        try:
            rows = self.client.call("tasks", {"pool": pool})
        except OrchestratorError as err:
            self._problem = f"tasks: {err}"
            return True
        self._tasks = (pool, tuple(TaskRow(str(r["id"]), str(r["state"]), str(r.get("worker") or "-"),
                                           int(r.get("attempts") or 0),
                                           str(r.get("reason") or (f"waiting: {r['waiting']}" if r.get("waiting") else "")))
                                   for r in rows))
        return True

    def _read_log(self, selection: Selection) -> bool:
        with self._lock:
            self._log_due = False
        whose = selection.task if selection.log_of == "task" else selection.replica
        if whose is None:
            log: tuple[str, tuple[str, ...]] = ("log", ())
        else:
            title = f"log of {whose} ({'stderr' if selection.stream == 'err' else 'stdout'})"
            reader = self.log_readers.get(selection.log_of)
            if reader is None:
                log = (title, (f"a {selection.log_of}'s log is not captured by this version",))
            else:
                try:
                    log = (title, tuple(reader(self.paths, whose, selection.stream, LOG_LINES)))
                except (OrchestratorError, OSError, ValueError) as err:
                    log = (title, (f"cannot read it: {err}",))
        if log == self._log:
            return False
        self._log = log
        return True

    def _make_view(self) -> View:
        status = self._status or {"pools": [], "replicas": [], "daemon": {}}
        sample = self._usage.sample
        replicas = []
        for r in status["replicas"]:
            cpu, rss = sample.get(r["pid"], (None, None)) if r.get("pid") else (None, None)
            replicas.append(ReplicaRow(str(r["id"]), str(r["pool"]), str(r["state"]), r.get("pid"),
                                       r.get("started_at"), int(r.get("restarts") or 0), str(r.get("reason") or ""),
                                       cpu, rss))
        pools = []
        for p in status["pools"]:
            mine = [r for r in replicas if r.pool == p["name"]]
            cpus = [r.cpu for r in mine if r.cpu is not None]
            rsss = [r.rss for r in mine if r.rss is not None]
            tasks = p.get("tasks") if isinstance(p.get("tasks"), dict) else None
            pools.append(PoolRow(str(p["name"]), str(p.get("kind") or ""), str(p.get("state") or "ok"),
                                 str(p.get("reason") or p.get("waiting") or ""), len(mine), int(p["desired"]),
                                 int(p.get("restarts") or 0), sum(cpus) if cpus else None,
                                 sum(rsss) if rsss else None,
                                 int(tasks["queued"]) if tasks else None, int(tasks["running"]) if tasks else None))
        tasks_pool, tasks = self._tasks
        if tasks_pool is not None:
            unfinished = {t.id for t in tasks}
            ended = [t for t in self._ended.values() if t.id.startswith(tasks_pool + "/") and t.id not in unfinished]
            tasks = (*tasks, *ended[::-1][:ENDED_TASKS_KEPT])
        return View(daemon=_daemon_line(status.get("daemon") or {}, self.paths), pools=tuple(pools),
                    replicas=tuple(replicas), tasks_pool=tasks_pool, tasks=tasks, events=tuple(self._events),
                    log_title=self._log[0], log=self._log[1], gone=self._gone, problem=self._problem)


def _daemon_line(d: Mapping[str, Any], paths: Paths) -> str:
    if not d.get("pid"):
        return f"connecting to {paths.state_dir} ..."
    up = duration(time.time() - d["started_at"]) if d.get("started_at") else "?"
    return f"daemon {d['pid']} up {up}, {d.get('containment', 'process-group')}  {paths.state_dir}"


def uptime(since: float | None) -> str:
    """How long since ``since`` (wall clock), as ``status`` shows it; "" for none."""
    return duration(time.time() - since) if since else ""


__all__ = ["EventLine", "Feed", "LogReader", "PoolRow", "ReplicaRow", "Selection", "TaskRow", "Usage", "View",
           "event_line", "captured_log", "uptime"]
