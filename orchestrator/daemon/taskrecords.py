"""The records of the task table (daemon/tasktable.py): a task, a worker's connection, an
executor pool's queue, a session; and the pure checks and shapes around them (an executor's
options, a ``module:function`` task, what ``tasks`` and ``result`` answer). Loop thread
only, like the table.
"""

from __future__ import annotations

import base64
import collections
import mmap
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, TypedDict

from .. import protocol
from .. import taskwire as w
from ..errors import InvalidSpec
from ..states import Replica
from ..states import TaskState as T
from .reactor import BufferedWriter, Timer
from .taskqueue import TaskQueue

Doc = dict[str, Any]  # a JSON object: a command's arguments, a reply, a task's row
Reply = protocol.ReplyTo
Event = tuple[str, Any, Any, "str | None"]  # (kind, ref, data, task id): TaskTable's module docstring
Sink = Callable[[list[Event]], Any]  # called with a turn's events
OPTION_KEYS = ("max_tasks_per_child", "timeout", "grace", "retries", "memory_max", "target",
               "min_workers", "max_workers", "idle_timeout", "memory_budget", "tenant_weights", "max_wait")
IDLE_TIMEOUT = 60.0  # an elastic pool's worker idle this long above min_workers retires
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1  # a task's priority (a store's INTEGER either way)
TENANT_MAX = 200  # characters of a tenant's name


@dataclass(eq=False, slots=True)
class Task:
    id: str
    n: int
    pool: "ExecPool"
    payload: bytes | None  # the pickled call (or a target's JSON), until the task ends
    ref: Any  # the submitting session's name for it
    session: "Session | None"
    timeout: float | None
    retries: int
    state: T = T.QUEUED
    attempts: int = 0
    worker: "Worker | None" = None
    worker_id: str | None = None  # the replica that runs (or last ran) it
    queued_at: float = 0.0  # wall clock, as every time of a task
    started_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    kind: str | None = None  # how it ended: result, raised, error, timeout, lost, unrun, interrupted, cancelled
    result: bytes | None = None  # the pickled result or exception (kind result or raised)
    timer: Timer | None = None
    slot: int = 0  # its cancel word in its worker (taskwire.WORDS)
    asked_back: bool = False  # its worker was asked to give it back (another is idle): no answer yet
    stopping: bool = False  # it ended while a worker held it: "stopped" is told once that worker is done
    waiters: list[tuple[Reply, Any]] = field(default_factory=list)  # (reply, cmd_id) of `result --wait`s
    priority: int = 0  # higher starts first (taskqueue.py)
    tenant: str | None = None  # whose: tenants share the workers by weight
    aged: bool = False  # it waited its pool's max_wait: above every priority now
    key: str | None = None  # its submitter's name for it (options(key=)): one task of its pool per key
    # Waiting and retrying (taskwait.py): seconds from queued_at past which it is TIMED_OUT
    # wherever it is; the (min, max) seconds of its retry_on's jittered exponential backoff;
    # how many of its attempts ended in a wait (they do not count against ``retries``);
    # while WAITING, the wall clock it is queued again at and why it waits.
    deadline: float | None = None
    backoff: tuple[float, float] | None = None
    waits: int = 0
    wait_until: float | None = None
    wait_reason: str | None = None

    def may_run_again(self) -> bool:
        """Do ``retries`` remain for another attempt (one cut short, or of its retry_on)? The
        attempts that ended in a wait (Retry) do not count."""
        return self.attempts - self.waits <= self.retries
    figures: w.Figures | None = None  # what it took in its worker (taskfigures.py), once it ran

    def record(self) -> Doc:
        """The task's row (store.save_task) and, without payload and result, its listing.
        ``worker``: the replica that runs it or ran it (none while it is QUEUED, even after an
        attempt: that worker is not its any more); ``last_worker``: the latest that did;
        ``figures``: what it took in its worker (``taskwire.Figures``; None until a worker
        answered for it)."""
        return {"id": self.id, "pool": self.pool.name, "n": self.n, "state": self.state.value,
                "attempts": self.attempts, "retries": self.retries, "timeout": self.timeout,
                "worker": self.worker_id if self.state is not T.QUEUED else None, "last_worker": self.worker_id,
                "queued_at": self.queued_at, "started_at": self.started_at,
                "ended_at": self.ended_at, "reason": self.reason,
                "priority": self.priority, "tenant": self.tenant, "key": self.key,
                "deadline": self.deadline, "backoff_min": self.backoff[0] if self.backoff else None,
                "backoff_max": self.backoff[1] if self.backoff else None, "waits": self.waits,
                "wait_until": self.wait_until, "wait_reason": self.wait_reason,
                "payload": self.payload if not self.state.terminal else None,
                "kind": self.kind, "result": self.result, "figures": self.figures}


@dataclass(eq=False)
class Worker:
    """One connection from a worker process, from its accept until its replica ended."""

    sock: socket.socket
    writer: BufferedWriter
    frames: w.Frames = field(default_factory=w.Frames)
    pid: int = 0  # 0 until its HELLO identified it
    replica: Replica | None = None
    pool: "ExecPool | None" = None
    word: mmap.mmap | None = None
    word_fd: int = -1  # the memfd behind ``word``
    ready: bool = False
    version: int = 1  # its wire version (HELLO): 2 can give a held task back
    tasks: collections.deque[Task] = field(default_factory=collections.deque)  # sent, not answered: [0] runs
    sent: int = 0  # TASK frames sent (a version 1 worker: the k-th uses cancel word k % WORDS)
    next_slot: int = 0  # version 2: the cancel word of the next task sent
    asks: int = 0  # held tasks asked back so far (the ask's number, in its word)
    asked: Task | None = None  # the task asked back, until the worker answers for it
    done: int = 0
    kill_timer: Timer | None = None
    kick_timer: Timer | None = None  # the cancel signal again, while unanswered (tasktable._kick)
    idle_timer: Timer | None = None  # an elastic pool's: it retires when this fires (elastic.py)
    lost_reason: str | None = None  # why the loop killed it, if it did
    over_memory: bool = False  # killed for passing memory_max (its task is not retried)
    closed: bool = False

    @property
    def task(self) -> Task | None:
        """The task it runs now (the first it has not answered), if any."""
        return self.tasks[0] if self.tasks else None


@dataclass(eq=False)
class ExecPool:
    """An executor pool's record in the task table, and the one home of its options and
    initializer: its pool's row stores them (``stored``, pools.ExecutorRow)."""

    name: str
    options: Doc
    init: bytes
    queue: TaskQueue[Task] = field(default_factory=TaskQueue)  # the table gives its own clock (adopt)
    idle: collections.deque[Worker] = field(default_factory=collections.deque)  # workers with no task
    single: collections.deque[Worker] = field(default_factory=collections.deque)  # workers that may take a second
    workers: dict[str, Worker] = field(default_factory=dict)  # replica id -> its connection
    holders: set[Worker] = field(default_factory=set)  # workers that hold a task behind the one they run
    next_n: int = 1
    reserved: int = 0  # task numbers below it are recorded as handed out (the pool's row)
    rss_timer: Timer | None = None
    rss_check: bool = False  # memory_max by RSS: no memory controller here
    said: str | None = None  # the last worker's complaint (its initializer failed)
    closing: bool = False
    on_quiet: Callable[[], None] | None = None  # closing: called once no worker is busy
    ended: collections.Counter[str] = field(default_factory=collections.Counter)  # state -> tasks ended since the start
    about: str | None = None  # what its initializer is, as its first session named it (a joiner's conflict says)
    # An elastic pool's sizing (elastic.py): the workers' memory as last measured (bytes,
    # the largest one's, at monotonic time), why it may not grow now, the re-check's timer,
    # and the ids of its replicas whose start the budget holds back (PENDING meanwhile).
    memory_used: int = 0
    memory_largest: int = 0
    memory_at: float = float("-inf")
    blocked: str | None = None
    budget_timer: Timer | None = None
    held_starts: set[str] = field(default_factory=set)

    def stored(self) -> dict[str, Any]:
        """Its part of the pool's row: options, initializer, the next task number recorded."""
        row: dict[str, Any] = {"options": self.options, "init": base64.b64encode(self.init).decode("ascii"),
                               "next_task": self.reserved}
        if self.about:
            row["about"] = self.about
        return row

    @property
    def max_tasks(self) -> int:
        return self.options.get("max_tasks_per_child") or 0

    @property
    def grace(self) -> float:
        return float(self.options["grace"])

    @property
    def elastic(self) -> bool:
        """Does it grow and shrink (min_workers below max_workers)? Else its size is fixed."""
        return "min_workers" in self.options

    @property
    def min_workers(self) -> int:
        return int(self.options["min_workers"])

    @property
    def max_workers(self) -> int:
        return int(self.options["max_workers"])

    @property
    def idle_timeout(self) -> float:
        return float(self.options.get("idle_timeout", IDLE_TIMEOUT))

    @property
    def memory_budget(self) -> int | None:
        budget = self.options.get("memory_budget")
        return int(budget) if budget is not None else None


class Unarrived:
    """The task numbers of one pool granted to a session whose submits have not arrived:
    [first, end) ranges in order, never a set of numbers (a block is one range; a submit
    mostly takes the first number of the first one, and one that comes out of order splits
    its range in two)."""

    __slots__ = ("ranges",)

    def __init__(self) -> None:
        self.ranges: list[list[int]] = []

    def __contains__(self, n: int) -> bool:
        return any(first <= n < end for first, end in self.ranges)

    def add(self, first: int, end: int) -> None:
        """[first, end) granted (above what it holds, unless numbers were given back or a
        client named them again after a restart: merged with what it overlaps)."""
        at = len(self.ranges)
        while at and self.ranges[at - 1][0] > first:
            at -= 1
        self.ranges.insert(at, [first, end])
        i = max(at - 1, 0)
        while i + 1 < len(self.ranges):  # from the one before it: merge what touches
            here, after = self.ranges[i], self.ranges[i + 1]
            if after[0] <= here[1]:
                here[1] = max(here[1], after[1])
                del self.ranges[i + 1]
            elif i >= at:
                break
            else:
                i += 1

    def take(self, n: int) -> bool:
        """``n``'s submit arrived: no longer on its way. False if it was not."""
        ranges = self.ranges
        if ranges and ranges[0][0] == n and ranges[0][1] > n + 1:  # the common case: in the order taken
            ranges[0][0] = n + 1
            return True
        for i, r in enumerate(ranges):
            first, end = r
            if n < first:
                return False
            if n >= end:
                continue
            if n == first:
                r[0] += 1
                if r[0] == end:
                    del self.ranges[i]
            elif n == end - 1:
                r[1] -= 1
            else:
                r[1] = n
                self.ranges.insert(i + 1, [n + 1, end])
            return True
        return False

    def remove(self, first: int, end: int) -> None:
        """[first, end) given back: none of them will arrive."""
        kept: list[list[int]] = []
        for a, b in self.ranges:
            if a < first:
                kept.append([a, min(b, first)])
            if b > end:
                kept.append([max(a, end), b])
        self.ranges = kept


@dataclass(eq=False)
class Session:
    """One submitter: where its tasks' ends are told. An embedded ``Executor`` gives a
    ``sink`` (called in the loop); a client of the daemon polls ``task_events`` instead, and
    its events wait here (bounded) until it does. Ends with ``executor_close``, or when a
    polling client has not polled for SESSION_IDLE seconds (it died: its tasks go on)."""

    name: str
    sink: Sink | None
    tasks: dict[Any, Task] = field(default_factory=dict)  # ref -> task, until it ended
    events: collections.deque[tuple[int, list[Any]]] = field(default_factory=collections.deque)  # (seq, event)
    seq: int = 0
    held: int = 0  # bytes of the events waiting
    outbox: list[Event] = field(default_factory=list)  # a sink's events of this turn, handed over at its end
    poll: tuple[Reply, Any, Timer] | None = None  # a task_events waiting for an event
    flushing: bool = False  # its poll's answer is scheduled
    started_timer: Timer | None = None  # a sink's lone STARTED events, held for their ends (tasktable._tell)
    waiting_events: bool = False  # its submitter takes WAITING events (it asked when it opened)
    idle_timer: Timer | None = None
    # Its task numbers on their way (granted, their submits not arrived yet), by pool: a
    # cancel by id of one lands at once (tasktable.cancel_unarrived), one outside them is
    # unknown at once; and the tasks so cancelled (by id) and the ``result --wait``s
    # (reply, cmd_id, monotonic deadline) of such numbers, until their submits arrive.
    granted: dict[str, Unarrived] = field(default_factory=dict)
    early: dict[str, Task] = field(default_factory=dict)
    awaited: dict[str, list[tuple[Reply, Any, float]]] = field(default_factory=dict)


def parse_options(raw: Any) -> Doc:
    """An executor's options from the wire or a config file, checked (InvalidSpec, one
    line); the defaults filled in."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidSpec("options must be an object")
    unknown = set(raw) - set(OPTION_KEYS)
    if unknown:
        raise InvalidSpec(f"unknown executor option {sorted(unknown)[0]!r}")
    out: dict[str, Any] = {}
    mtpc = raw.get("max_tasks_per_child")
    if mtpc is not None:
        out["max_tasks_per_child"] = protocol.count(mtpc, what="max_tasks_per_child")
    if raw.get("timeout") is not None:
        out["timeout"] = protocol.seconds(raw["timeout"], "timeout")
    out["grace"] = protocol.seconds(raw.get("grace", 5.0), "grace")
    retries = raw.get("retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidSpec(f"retries must be a whole number of at least 0, got {retries!r}")
    out["retries"] = retries
    mem = raw.get("memory_max")
    if mem is not None:
        if isinstance(mem, bool) or not isinstance(mem, int) or mem < 1 << 20:
            raise InvalidSpec(f"memory_max must be a number of bytes of at least 1 MiB, got {mem!r}")
        out["memory_max"] = mem
    target = raw.get("target")
    if target is not None:
        if not isinstance(target, str) or ":" not in target:
            raise InvalidSpec(f"target must be MODULE:FUNCTION, got {target!r}")
        out["target"] = target  # what a task given without one runs
    weights = raw.get("tenant_weights")
    if weights is not None:
        out["tenant_weights"] = tenant_weights(weights)
    if raw.get("max_wait") is not None:
        wait = protocol.seconds(raw["max_wait"], "max_wait")
        if not wait:
            raise InvalidSpec("max_wait must be a number of seconds above 0")
        out["max_wait"] = wait
    out.update(_elastic(raw, mem))
    return out


def _elastic(raw: Doc, memory_max: int | None) -> Doc:
    """An elastic pool's options (``min_workers`` below ``max_workers``, ``idle_timeout``,
    ``memory_budget``), checked; none for a fixed pool (``min_workers`` not given, or equal
    to ``max_workers``: its options stay exactly a fixed pool's)."""
    low, high = raw.get("min_workers"), raw.get("max_workers")
    budget = raw.get("memory_budget")
    if high is not None and (isinstance(high, bool) or not isinstance(high, int) or high < 1):
        raise InvalidSpec(f"max_workers must be a whole number of at least 1, got {high!r}")
    if low is not None:
        if isinstance(low, bool) or not isinstance(low, int) or low < 0:
            raise InvalidSpec(f"min_workers must be a whole number of at least 0, got {low!r}")
        if high is None:
            raise InvalidSpec("min_workers needs max_workers (the pool's size)")
        if low > high:
            raise InvalidSpec(f"min_workers {low} is above max_workers {high}")
    idle = protocol.seconds(raw["idle_timeout"], "idle_timeout") if raw.get("idle_timeout") is not None else None
    if idle is not None and idle <= 0:
        raise InvalidSpec(f"idle_timeout must be more than 0 seconds, got {raw['idle_timeout']!r}")
    elastic = low is not None and high is not None and low < high
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1 << 20:
            raise InvalidSpec(f"memory_budget must be a number of bytes of at least 1 MiB, got {budget!r}")
        if memory_max is not None and budget < memory_max:
            raise InvalidSpec(f"memory_budget {size_text(budget)} is below one worker's memory_max "
                              f"{size_text(memory_max)}")
        if not elastic:
            raise InvalidSpec("memory_budget bounds the workers an elastic pool starts: give min_workers "
                              "below max_workers")
    if not elastic:
        return {}
    out: Doc = {"min_workers": low, "max_workers": high, "idle_timeout": IDLE_TIMEOUT if idle is None else idle}
    if budget is not None:
        out["memory_budget"] = budget
    return out


def tenant_weights(raw: Any) -> dict[str, float]:
    """``{tenant: weight}``, each weight a number above 0 (InvalidSpec, one line)."""
    if not isinstance(raw, dict):
        raise InvalidSpec(f"tenant_weights must be an object of tenant: weight, got {raw!r}")
    out: dict[str, float] = {}
    for name, weight in raw.items():
        if not isinstance(name, str) or not name or len(name) > TENANT_MAX:
            raise InvalidSpec(f"tenant_weights: a tenant must be a name of 1 to {TENANT_MAX} characters, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise InvalidSpec(f"tenant_weights: the weight of {name!r} must be a number above 0, got {weight!r}")
        out[name] = weight
    return out


class QueuePlace(TypedDict):
    priority: int
    tenant: str | None
    key: str | None


def queue_place(row: Doc) -> QueuePlace:
    """A stored or carried task's priority, tenant and key (a row of an earlier version
    has none: 0 and None)."""
    return {"priority": int(row.get("priority") or 0), "tenant": row.get("tenant") or None,
            "key": row.get("key") or None}


class WaitFields(TypedDict):
    deadline: float | None
    backoff: tuple[float, float] | None
    waits: int
    wait_until: float | None
    wait_reason: str | None
    figures: w.Figures | None  # its earlier attempts', which the next one's are added to


def wait_fields(row: Doc) -> WaitFields:
    """A stored or carried task's deadline, backoff, wait and its attempts' figures so far
    (a row of an earlier version has none of them)."""
    low, high = row.get("backoff_min"), row.get("backoff_max")
    return {"deadline": row.get("deadline"), "backoff": (float(low), float(high)) if low is not None and high is not None
            else None, "waits": int(row.get("waits") or 0), "wait_until": row.get("wait_until"),
            "wait_reason": row.get("wait_reason"), "figures": _figures(row.get("figures"))}


def _figures(raw: Any) -> w.Figures | None:
    """A stored or carried record's figures, if they are what taskwire.Figures says."""
    if not isinstance(raw, dict):
        return None
    try:
        return {"wall": float(raw["wall"]), "cpu": float(raw["cpu"]),
                "peak_rss": None if raw.get("peak_rss") is None else int(raw["peak_rss"]),
                "children_peak_rss": None if raw.get("children_peak_rss") is None else int(raw["children_peak_rss"])}
    except (KeyError, TypeError, ValueError):
        return None


def deadline(raw: Any) -> float | None:
    """A task's deadline: seconds from its submit, above 0 (None: none; InvalidSpec, one line)."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < float("inf"):
        raise InvalidSpec(f"deadline must be a number of seconds from the submit above 0, got {raw!r}")
    return float(raw)


def backoff(raw: Any) -> tuple[float, float] | None:
    """A task's retry_on backoff: [MIN, MAX] seconds, 0 <= MIN <= MAX (None: the default;
    InvalidSpec, one line)."""
    if raw is None:
        return None
    if (not isinstance(raw, (list, tuple)) or len(raw) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf") for v in raw)
            or raw[0] > raw[1]):
        raise InvalidSpec(f"backoff must be [MIN, MAX] seconds with 0 <= MIN <= MAX, got {raw!r}")
    return float(raw[0]), float(raw[1])


def priority(raw: Any) -> int:
    """A task's priority: a whole number (InvalidSpec, one line)."""
    if isinstance(raw, bool) or not isinstance(raw, int) or not PRIORITY_MIN <= raw <= PRIORITY_MAX:
        raise InvalidSpec(f"priority must be a whole number, got {raw!r}")
    return raw


def tenant(raw: Any) -> str | None:
    """A task's tenant: a name (None: no tenant; InvalidSpec, one line)."""
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw or len(raw) > TENANT_MAX:
        raise InvalidSpec(f"tenant must be a name of 1 to {TENANT_MAX} characters, got {raw!r}")
    return raw


def target_payload(one: Doc) -> bytes:
    """A task given as ``module:function`` and JSON arguments (``submit --target``): the
    worker imports the target itself, from the submitter's PYTHONPATH and cwd."""
    target = one.get("target")
    if not isinstance(target, str) or ":" not in target:
        raise InvalidSpec(f"target must be MODULE:FUNCTION, got {target!r}")
    call: w.TargetCall = {"target": target, "args": one.get("args") or [], "kwargs": one.get("kwargs") or {},
            "pythonpath": one.get("pythonpath") or [], "cwd": one.get("cwd")}
    if not isinstance(call["args"], list) or not isinstance(call["kwargs"], dict):
        raise InvalidSpec("args must be a list and kwargs an object")
    try:
        return w.target_payload(call)
    except (TypeError, ValueError) as err:
        raise InvalidSpec(f"the task's arguments are not JSON: {err}") from None


def listing(row: Doc) -> Doc:
    """A task's record as ``tasks`` shows it: no payload, no result bytes."""
    return {k: v for k, v in row.items() if k not in ("payload", "result", "retire_key")}


def outcome(row: Doc) -> Doc:
    """What ``result`` answers for a task record."""
    return {"id": row["id"], "state": row["state"], "kind": row.get("kind"), "result": as_text(row.get("result")),
            "reason": row.get("reason"), "timeout": row.get("timeout")}


def as_bytes(value: Any, what: str) -> bytes:
    """Bytes given in-process, or as base64 text over the channel (JSON carries no bytes)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise InvalidSpec(f"{what} is not base64") from None
    raise InvalidSpec(f"{what} must be bytes (base64 text over the channel)")


def as_text(data: Any) -> Any:
    return base64.b64encode(data).decode("ascii") if isinstance(data, bytes) else data


def ended_kind(task: Task) -> str:
    """How an ended task ended, as its end event says it (a row of an earlier version may
    not say: its state does)."""
    if task.kind:
        return task.kind
    return {T.DONE: "result", T.CANCELLED: "cancelled", T.TIMED_OUT: "timeout"}.get(
        task.state, "raised" if task.result else "lost")


def ended_data(task: Task) -> Any:
    """What an ended task's end event carries (TaskTable.end): the result's or the
    exception's bytes, [line, limit] for a timeout, else the reason."""
    if task.kind in ("result", "raised"):
        return task.result
    if task.kind == "timeout":
        return [task.reason, task.timeout]
    return task.reason


def how_it_ended(rep: Replica) -> str:
    """A worker's end as WorkerLost says it: ``exited with 3``, ``killed by SIGKILL``,
    ``OOM-killed``."""
    code = rep.exit_code
    if code is not None and code >= 0 and rep.reason == f"exit code {code}":
        return f"exited with {code}"
    return rep.reason or "ended"


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def received_fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            out.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    return out
