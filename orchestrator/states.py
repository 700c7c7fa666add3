"""Replica states and the one transition table.

Every state change of a replica goes through :func:`transition`, which checks the edge
against :data:`TRANSITIONS` and records when and why. An illegal edge is a bug in the
caller and raises :class:`IllegalTransition`. Terminal states have no outgoing edges,
so a terminal record can never change again (an INTERRUPTED cannot be overwritten by a
late reap, the failure this table exists to rule out).

This module imports nothing of ours.

    PENDING ──► STARTING ──► RUNNING ──► STOPPING ──► TERMINATED
       │            │           ├──────────────────► EXITED   (exit code 0 on its own)
       │            │           └──────────────────► FAILED   (non-zero exit or signal)
       ├────────────┴──► INTERRUPTED  (terminate asked before RUNNING)
       └────────────┴──► FAILED       (could not start)
    any non-terminal ──► LOST  (its daemon died)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class ReplicaState(str, enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    TERMINATED = "TERMINATED"
    EXITED = "EXITED"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"
    LOST = "LOST"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


S = ReplicaState
TERMINAL: frozenset[ReplicaState] = frozenset(
    {S.TERMINATED, S.EXITED, S.FAILED, S.INTERRUPTED, S.LOST}
)

TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    S.PENDING: frozenset({S.STARTING, S.INTERRUPTED, S.FAILED, S.LOST}),
    S.STARTING: frozenset({S.RUNNING, S.INTERRUPTED, S.FAILED, S.LOST}),
    S.RUNNING: frozenset({S.STOPPING, S.EXITED, S.FAILED, S.LOST}),
    # A replica being stopped that dies of our signal or exits on its own while we wait
    # is TERMINATED either way: the user asked for it to end.
    S.STOPPING: frozenset({S.TERMINATED, S.LOST}),
    **{t: frozenset() for t in TERMINAL},
}


class IllegalTransition(RuntimeError):
    """A state change that the table does not allow: always a bug in the caller."""

    def __init__(self, replica_id: str, old: ReplicaState, new: ReplicaState) -> None:
        super().__init__(f"replica {replica_id}: illegal transition {old} -> {new}")
        self.replica_id, self.old, self.new = replica_id, old, new


@dataclass(eq=False)
class Replica:
    """One replica's record. Mutated only by the control loop, through transition()."""

    id: str
    pool: str
    n: int
    state: ReplicaState = S.PENDING
    pid: int | None = None
    start_time: int | None = None  # kernel start time (ticks); with pid, the identity
    exit_code: int | None = None
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    slot: int | None = None
    restarts: int = 0  # replacements of its slot before it
    ready: bool = False  # has been ready (RUNNING) at least once
    started_at: float | None = None  # wall clock when it became RUNNING
    # What it was made from: its pool's (runtime, policy) at its launch; not stored. A
    # reload compares it with what the pool declares now, so it rolls what still runs an
    # older spec, whatever happened to the rollouts before it.
    made_from: tuple[Any, Any] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pool": self.pool,
            "state": self.state.value,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "created_at": self.created_at,
            "ended_at": self.ended_at,
            "slot": self.slot,
            "restarts": self.restarts,
            "ready": self.ready,
            "started_at": self.started_at,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> "Replica":
        """A replica from the store's row (recovery: the record of an earlier daemon)."""
        return cls(
            rec["id"], rec["pool"], int(rec["n"]), ReplicaState(rec["state"]),
            pid=rec.get("pid"), start_time=rec.get("start_time"), exit_code=rec.get("exit_code"),
            reason=rec.get("reason"), created_at=rec.get("created_at") or 0.0, ended_at=rec.get("ended_at"),
            slot=rec.get("slot"), restarts=rec.get("restarts") or 0, ready=bool(rec.get("ready")),
            started_at=rec.get("started_at"),
        )

    def to_record(self) -> dict[str, Any]:
        """The store's row: to_dict plus what recovery needs."""
        d = self.to_dict()
        d["n"] = self.n
        d["start_time"] = self.start_time
        return d


def transition(
    replica: Replica,
    new: ReplicaState,
    reason: str | None = None,
    *,
    exit_code: int | None = None,
    clock: Callable[[], float] = time.time,
) -> ReplicaState:
    """Move ``replica`` to ``new``; return the old state. Raises IllegalTransition."""
    old = replica.state
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(replica.id, old, new)
    replica.state = new
    if reason is not None:
        replica.reason = reason
    if exit_code is not None:
        replica.exit_code = exit_code
    if new in TERMINAL:
        replica.ended_at = clock()
    return old


def exit_reason(code: int) -> str:
    """How a process ended, from its returncode (-N: killed by signal N), as a reason says it."""
    if code < 0:
        import signal  # only here: most importers of this module never need it

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


# -- tasks of an Executor -------------------------------------------------------------------

class TaskState(str, enum.Enum):
    """A task's states, with their own table (the same rules as a replica's: terminal is
    sticky, so a result that arrives after a cancel or a timeout can never overwrite it).

        QUEUED ──► RUNNING ──► DONE | FAILED | CANCELLED | TIMED_OUT
          │   ◄──────┘ its worker died (or its daemon stopped) and retries remain
          │   ◄── WAITING ◄┘ it raised Retry(after=), or an exception of its retry_on
          │          └──► CANCELLED | FAILED | TIMED_OUT   (its deadline) before it ran again
          └──► CANCELLED | FAILED | TIMED_OUT   before it ran
        QUEUED, RUNNING ──► LOST           its daemon died while it ran

    WAITING holds no worker: a timer queues it again at its time (daemon/taskwait.py).
    """

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    WAITING = "WAITING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    LOST = "LOST"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self not in (TaskState.QUEUED, TaskState.RUNNING, TaskState.WAITING)


_T = TaskState
TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    _T.QUEUED: frozenset({_T.RUNNING, _T.CANCELLED, _T.FAILED, _T.TIMED_OUT, _T.LOST}),
    _T.RUNNING: frozenset({_T.QUEUED, _T.WAITING, _T.DONE, _T.FAILED, _T.CANCELLED, _T.TIMED_OUT, _T.LOST}),
    # Parked (Retry, a retry_on backoff): it holds no worker, so nothing of it can be lost.
    _T.WAITING: frozenset({_T.QUEUED, _T.CANCELLED, _T.FAILED, _T.TIMED_OUT}),
    **{t: frozenset() for t in _T if t.terminal},
}


def task_transition(task_id: str, old: TaskState, new: TaskState) -> TaskState:
    """The state after ``old -> new``; IllegalTransition (a bug in the caller) if the table
    does not allow it."""
    if new not in TASK_TRANSITIONS[old]:
        raise IllegalTransition(task_id, old, new)  # type: ignore[arg-type]
    return new
