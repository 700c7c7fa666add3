"""Tasks that wait for their time: ``Retry(after=)``, a ``retry_on`` backoff, a deadline.
The task table's (tasktable.py composes it), loop thread only.

    RUNNING ─► RETRY(after=S) ─────────────────────────► WAITING ─► at its time ─► QUEUED
       │       RETRY(exception of retry_on), retries left ─┘ (backoff)   (first of its priority)
       │       ...no retries left ─► FAILED, with that last exception
    deadline: queued_at + deadline seconds ─► TIMED_OUT, queued, waiting or running (a
              running one gets the timeout's exception, TaskTimeout, as at its timeout)

A waiting task holds no worker: its attempt has ended and its worker takes the next task.
What wakes it is a timer of the reactor (no polling), one per waiting task, and one per
task with a deadline. Both times are wall clock in the task's record (``wait_until``;
``queued_at`` plus ``deadline``), so a restart (taskcarry.restore) or an upgrade arms them
again from the record, and a time that passed while no daemon ran fires at once.

The decision is here, the state changes are the table's: ``answer`` reads a worker's RETRY
frame and says park (for how long, why) or end (how); the table moves the task and calls
``park`` / ``forget``; the timers call the table back (``resume``, ``expire``).

Backoff (retry_on): the k-th re-run after an exception of retry_on waits MIN * 2**k seconds,
at most MAX, jittered down to as little as half of that (never below MIN), so that the
tasks a failure hit together do not come back together. An attempt that ended in
``Retry`` does not count against ``retries`` (``Task.may_run_again``) and has no backoff:
the task said when.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Any, Callable

from .. import taskwire as w
from ..states import TaskState as T
from .reactor import Reactor, Timer
from .taskrecords import Task

BACKOFF = (0.1, 10.0)  # seconds: a task with retry_on and no backoff of its own
REASON_MAX = 500  # characters of a wait's reason kept


@dataclass(frozen=True, slots=True)
class Park:
    """The task waits ``delay`` seconds, for ``why``; ``counted``: an attempt of its
    retries (retry_on), not one the task asked to repeat (Retry)."""

    delay: float
    why: str
    counted: bool


@dataclass(frozen=True, slots=True)
class End:
    """The task ends (``TaskTable.end``'s kind and data), its reason ``reason``."""

    kind: str
    data: Any
    reason: str | None = None


class TaskWait:
    """The timers of waiting tasks and of deadlines (see the module docstring).
    ``resume(task)``: its wait is over; ``expire(task)``: its deadline passed."""

    def __init__(self, reactor: Reactor, clock: Callable[[], float], resume: Callable[[Task], None],
                 expire: Callable[[Task], None], *, jitter: Callable[[float, float], float] = random.uniform) -> None:
        self._reactor = reactor
        self._clock = clock  # wall clock: the task's times are
        self._resume = resume
        self._expire = expire
        self._jitter = jitter
        self._due: dict[Task, Timer | None] = {}  # a WAITING task -> its wake-up (None: its deadline ends it)
        self._deadlines: dict[Task, Timer] = {}

    def count(self, pool: str) -> int:
        """Tasks of executor pool ``pool`` waiting for their time now."""
        return sum(1 for task in self._due if task.pool.name == pool)

    def watch(self, task: Task) -> None:
        """A task the table took (submitted, restored, carried): its deadline's timer, and
        if it is WAITING its wake-up, from its record's times."""
        if task.deadline is not None and task not in self._deadlines:
            left = task.queued_at + task.deadline - self._clock()
            self._deadlines[task] = self._reactor.call_later(max(0.0, left), lambda: self._deadline(task))
        if task.state is T.WAITING and task not in self._due:
            if task.wait_until is None:  # a row that lost its time: its wait is over
                task.wait_until = self._clock()
            self._arm(task, task.wait_until - self._clock())

    def answer(self, task: Task, payload: bytes) -> Park | End:
        """What a RETRY frame from ``task``'s worker means for it."""
        try:
            head, raised = w.split_retry(payload)
        except ValueError as err:
            return End("error", f"task {task.id}: {err}")
        reason = " ".join(head["reason"].split())[:REASON_MAX]
        if head["after"] is not None:
            return Park(head["after"], reason or "it raised Retry", counted=False)
        if not task.may_run_again():
            try:
                line, pickled = w.split_raised(raised)
            except struct.error:
                line, pickled = reason, raised
            return End("raised", pickled, line)
        low, high = task.backoff or BACKOFF
        retried = max(0, task.attempts - task.waits - 1)  # its attempts cut short or raised so far
        full = min(high, low * 2.0 ** min(retried, 60))
        delay = self._jitter(max(low, full / 2), full) if full > low else full
        return Park(delay, f"retry {retried + 1} of {task.retries} after {reason}", counted=True)

    def park(self, task: Task, delay: float, why: str) -> None:
        """``task``, WAITING now, is queued again in ``delay`` seconds (unless its deadline
        comes first: that ends it)."""
        task.wait_until = self._clock() + delay
        task.wait_reason = why
        self._arm(task, delay)

    def forget(self, task: Task) -> None:
        """``task`` waits no longer (queued again, or ended): its wake-up goes, and once it
        has ended, its deadline too."""
        timer = self._due.pop(task, None)
        if timer is not None:
            timer.cancel()
        task.wait_until = None
        if task.state.terminal:
            timer = self._deadlines.pop(task, None)
            if timer is not None:
                timer.cancel()

    def _arm(self, task: Task, delay: float) -> None:
        if task.deadline is not None and task.wait_until is not None \
                and task.wait_until >= task.queued_at + task.deadline:
            self._due[task] = None  # it would start past its deadline: that timer ends it
            return
        self._due[task] = self._reactor.call_later(max(0.0, delay), lambda: self._wake(task))

    def _wake(self, task: Task) -> None:
        self._due.pop(task, None)
        self._resume(task)

    def _deadline(self, task: Task) -> None:
        self._deadlines.pop(task, None)
        if not task.state.terminal:
            self._expire(task)


def deadline_line(task: Task, waiting: bool) -> str:
    """What a task that passed its deadline ends with (its future's TaskTimeoutError)."""
    line = f"task {task.id} passed its deadline of {task.deadline:g} s from its submit"
    return line + (f" while it waited ({task.wait_reason})" if waiting and task.wait_reason else "")
