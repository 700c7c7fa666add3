"""How many workers an executor pool has: elastic pools (``min_workers`` up to
``max_workers``, ``idle_timeout``, ``memory_budget``). Loop thread only.

The task table (tasktable.py) decides which task goes to which worker; this decides when
the pool needs one more, or one fewer, and asks the supervisor (supervision.py), whose
decision a pool's size is, to ``grow`` it or to ``retire`` a given idle worker. A fixed
pool (``min_workers`` not given, or equal to ``max_workers``) is never touched here.

  * Grow: a dispatch that leaves tasks queued with no free worker asks ``want``: while the
    pool is below ``max_workers``, one new worker (warm, forked by the pool's spawner) per
    queued task that no worker starting already will take. Meanwhile no busy worker is
    sent a second task to hold: the new worker takes it from the queue when it is READY
    (or a busy one that finishes first does), with no ask-back round trip.
  * Budget: with ``memory_budget``, what the pool's workers hold together is measured
    (each worker's cgroup ``memory.current`` where the memory controller exists, else its
    tree's resident memory: taskmemory.TreeMemory) at most once per CHECK_INTERVAL, and a
    new worker starts only if that plus the largest worker's share (what a new one may
    come to hold) stays within the budget. Tasks wait meanwhile; while they do, the
    budget is looked at again every BUDGET_RECHECK (no kernel event says a tree shrank),
    and at every task's end. Every start of a worker is bounded so, not only a grow:
    spawning.py asks ``start_held`` before it starts any (the supervisor's replacement of a
    worker that died, a renewal after max_tasks_per_child, a rolling restart), and one held
    back stays PENDING, with the reason, until there is room. The budget bounds starts, not
    a running worker: a task that allocates is bounded by ``memory_max``.
  * Shrink: a worker that becomes idle arms its own timer (the reactor's, no poll); when
    it fires and the worker is still idle, holds no task and the pool is above
    ``min_workers``, it retires: stopped as a scale-down stops a replica (its pool's stop
    signal, SIGTERM), not replaced. Any task sent to it first cancels its timer; a worker
    being stopped is never sent a task (tasktable._room).

``waiting`` says why a pool's queued tasks wait (``tasks``); ``counts`` is the pool's
workers busy / idle / starting / min / max and its budget (``status``).
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

from ..errors import OrchestratorError
from ..states import Replica
from ..states import ReplicaState as S
from ..states import TaskState as T
from .containment import Tree
from .pools import CRASHLOOP, Pool
from .reactor import Reactor
from .taskmemory import CHECK_INTERVAL, TreeMemory
from .taskrecords import Doc, ExecPool, Worker, size_text

log = logging.getLogger("orchestrator")
BUDGET_RECHECK = 0.1  # seconds between looks at a budget that holds tasks back


class Sizing(Protocol):
    """What is asked of supervision.Supervisor: a pool's size is its decision."""

    def grow(self, pool: Pool, count: int) -> list[str]: ...
    def retire(self, rep: Replica, reason: str) -> bool: ...


class Host(Protocol):
    """What is asked of the engine (tasktable.Table gives it)."""

    @property
    def reactor(self) -> Reactor: ...
    @property
    def supervisor(self) -> Sizing: ...
    @property
    def closing(self) -> bool: ...

    def pool(self, name: str) -> Pool | None: ...
    def proc_of(self, rep: Replica) -> Tree | None: ...


class Elastic:
    """The sizing of the task table's elastic pools (see the module docstring); ``run``
    hands out a pool's queue again (a budget that has room now)."""

    def __init__(self, host: Host, memory: TreeMemory, run: Callable[[ExecPool], None]) -> None:
        self.host = host
        self.memory = memory
        self.run = run
        self._said: set[str] = set()  # pools whose being held back is logged already

    # -- the task table's hooks -----------------------------------------------------------

    def idle(self, xp: ExecPool, worker: Worker) -> None:
        """``worker`` has no task now: it retires after ``idle_timeout`` if it stays so."""
        if not xp.elastic or xp.closing:
            return
        if worker.idle_timer is not None:
            worker.idle_timer.cancel()
        worker.idle_timer = self.host.reactor.call_later(xp.idle_timeout, lambda: self._idle_for_long(xp, worker))

    @staticmethod
    def busy(worker: Worker) -> None:
        """``worker`` is sent a task (or is gone): it is not idle."""
        if worker.idle_timer is not None:
            worker.idle_timer.cancel()
            worker.idle_timer = None

    def may_hold(self, xp: ExecPool) -> bool:
        """May a busy worker be sent a second task to hold? Not while the pool grows: a new
        worker will take it first."""
        if not xp.elastic:
            return True
        pool = self.host.pool(xp.name)
        if pool is None or xp.blocked is not None:
            return True
        return pool.desired >= xp.max_workers and self._starting(xp, pool) == 0

    def want(self, xp: ExecPool) -> None:
        """Tasks are queued and no worker is free: grow the pool by what they need, within
        max_workers and the memory budget."""
        if not xp.elastic or xp.closing or self.host.closing:
            return
        pool = self.host.pool(xp.name)
        if pool is None or pool.deleted or pool.stopped or pool.state == CRASHLOOP:
            return
        room = xp.max_workers - pool.desired
        starting = self._starting(xp, pool) if room > 0 else 0
        count = min(self._waiting_tasks(xp, room + starting) - starting, room)
        if count <= 0:
            self._free(xp)  # at max_workers, or enough are starting: nothing holds it back
            return
        budget = xp.memory_budget
        if budget is not None:
            count = min(count, self._fits(xp, pool, budget))
            if count <= 0:
                self._blocked(xp, self._budget_text(xp, budget))
                return
        try:
            self.host.supervisor.grow(pool, count)
        except OrchestratorError as err:  # the control plane's reserve: the tasks wait for a free worker
            self._blocked(xp, f"no worker can start: {err}")
            return
        self._free(xp)

    def start_held(self, xp: ExecPool, pool: Pool, rep: Replica, begun: int) -> str | None:
        """Why ``rep``, a worker of ``xp`` about to start (PENDING), may not start now; None:
        it may. Spawning asks before every start of an executor pool's worker, whoever
        launched it (a grow, the supervisor's replacement of a worker that died or retired
        after max_tasks_per_child, a rolling restart), so no worker starts while the pool
        is at its memory budget: what the workers hold, those starting (``begun`` of them in
        spawning's batch now, not READY yet) at the largest one's share, and this one at that
        share too. Held back, it stays PENDING with the reason, looked at again every
        BUDGET_RECHECK (and at each turn's end); its pool's queued tasks wait, saying why."""
        budget = xp.memory_budget
        if budget is None or xp.closing:
            return None
        self._measure(xp, pool)
        share, used = xp.memory_largest, xp.memory_used
        starting = begun + sum(1 for r in pool.live.values() if r.id != rep.id and self._unready(xp, r))
        if (used < budget) if share <= 0 else used + (starting + 1) * share <= budget:
            xp.held_starts.discard(rep.id)
            return None
        if rep.id not in xp.held_starts:
            xp.held_starts.add(rep.id)
            # No longer a worker about to start: a busy one may hold a queued task now
            # (may_hold), so the queue is handed out again, after spawning's batch.
            self.host.reactor.call_soon(lambda: None if xp.closing else self.run(xp))
        why = self._budget_text(xp, budget)
        if xp.budget_timer is None:  # no kernel event says a tree shrank: a look again soon
            xp.budget_timer = self.host.reactor.call_later(BUDGET_RECHECK, lambda: self._recheck(xp))
        return why

    def stop(self, xp: ExecPool) -> None:
        """The pool closes: nothing of its sizing is due any more."""
        if xp.budget_timer is not None:
            xp.budget_timer.cancel()
            xp.budget_timer = None
        for worker in xp.workers.values():
            self.busy(worker)

    # -- what is shown --------------------------------------------------------------------

    def waiting(self, xp: ExecPool) -> str:
        """Why ``xp``'s queued tasks wait, in a few words (``tasks``: field ``waiting``)."""
        pool = self.host.pool(xp.name)
        if xp.closing or pool is None or pool.deleted:
            return "the pool is closing"
        if pool.stopped:
            return f"the pool is stopped (start {pool.name})"
        if pool.state == CRASHLOOP:
            return f"the pool stopped replacing its workers: {pool.reason}"
        starting = self._starting(xp, pool)
        said = ["worker starting" if starting == 1 else f"{starting} workers starting"] if starting else []
        if xp.blocked is not None:
            said.append(xp.blocked)  # those the starting ones will not take wait for it
        elif self._held(xp, pool) and xp.memory_budget is not None:  # a replacement held back, say
            said.append(self._budget_text(xp, xp.memory_budget))
        if said:
            return "; ".join(said)
        busy = sum(1 for wk in xp.workers.values() if wk.tasks and not wk.closed)
        text = "its one worker busy" if busy == 1 else f"all {busy} workers busy"
        if xp.elastic and pool.desired >= xp.max_workers:
            return f"{text} (at max_workers {xp.max_workers})"
        return text

    def counts(self, xp: ExecPool) -> Doc:
        """The pool's workers for ``status``: busy, idle, starting, min, max, and its memory
        budget (used, limit; measured now if the last look is older than CHECK_INTERVAL)."""
        pool = self.host.pool(xp.name)
        desired = pool.desired if pool is not None else 0
        busy = idle = 0
        for wk in xp.workers.values():
            if wk.closed or not wk.ready:
                continue
            if wk.tasks:
                busy += 1
            elif self.takes_tasks(wk):
                idle += 1
        out: Doc = {"busy": busy, "idle": idle, "starting": self._starting(xp, pool) if pool is not None else 0,
                    "min": xp.min_workers if xp.elastic else desired,
                    "max": xp.max_workers if xp.elastic else desired}
        budget = xp.memory_budget
        if budget is not None and pool is not None:
            self._measure(xp, pool)
            out["budget"] = {"used": xp.memory_used, "limit": budget}
            if held := self._held(xp, pool):  # workers whose start it holds back (start_held)
                out["budget"]["held"] = held
        return out

    @staticmethod
    def takes_tasks(worker: Worker) -> bool:
        """Is ``worker`` one that may be sent tasks: not being stopped (an idle worker that
        retires, a scale-down, a rolling restart)? tasktable._room holds to the same."""
        rep = worker.replica
        return rep is None or rep.state is not S.STOPPING

    # -- inside -------------------------------------------------------------------------

    def _idle_for_long(self, xp: ExecPool, worker: Worker) -> None:
        worker.idle_timer = None
        rep = worker.replica
        pool = self.host.pool(xp.name)
        if (xp.closing or self.host.closing or pool is None or rep is None or worker.closed or worker.tasks
                or not worker.ready or xp.workers.get(rep.id) is not worker or rep.state is not S.RUNNING):
            return  # busy again, or going anyway: never a worker that holds or runs a task
        if pool.desired <= xp.min_workers:
            return  # the pool's floor: it stays (a later idle spell arms its timer again)
        self.host.supervisor.retire(rep, f"idle for {xp.idle_timeout:g} s")

    def _starting(self, xp: ExecPool, pool: Pool) -> int:
        """Workers the pool has (or is about to have) that are not READY yet, but for those
        whose start the budget holds back (start_held): they are no help to a queued task."""
        ready = sum(1 for wk in xp.workers.values() if wk.ready and not wk.closed and self.takes_tasks(wk))
        return max(0, pool.desired - ready - self._held(xp, pool))

    @staticmethod
    def _held(xp: ExecPool, pool: Pool) -> int:
        """``xp``'s replicas whose start the budget holds back now (still PENDING)."""
        if not xp.held_starts:
            return 0
        xp.held_starts = {rid for rid in xp.held_starts
                          if (r := pool.live.get(rid)) is not None and r.state is S.PENDING}
        return len(xp.held_starts)

    @staticmethod
    def _unready(xp: ExecPool, rep: Replica) -> bool:
        """Is ``rep`` started (its process exists) but not a READY worker yet? What it will
        hold is not measured: the budget counts it at the largest worker's share."""
        if rep.state is S.STARTING:
            return True
        worker = xp.workers.get(rep.id)
        return rep.state is S.RUNNING and (worker is None or not worker.ready)

    @staticmethod
    def _budget_text(xp: ExecPool, budget: int) -> str:
        return f"memory budget {size_text(budget)} reached ({xp.memory_used / (1 << 20):.0f} MiB used)"

    @staticmethod
    def _waiting_tasks(xp: ExecPool, enough: int) -> int:
        """Tasks no worker runs yet (queued, and held behind a busy worker), counted up to
        ``enough``: a long queue is not walked at each dispatch."""
        found = 0
        for wk in xp.holders:
            found += sum(1 for t in list(wk.tasks)[1:] if t.state is T.QUEUED)
        for task in xp.queue:
            if found >= enough:
                break
            found += task.state is T.QUEUED
        return found

    def _fits(self, xp: ExecPool, pool: Pool, budget: int) -> int:
        """How many more workers the budget has room for: what the workers hold now, those
        starting counted at the largest one's share, and each new one at that share too
        (none measured yet: one may start)."""
        self._measure(xp, pool)
        share = xp.memory_largest
        if share <= 0:
            return 1 if xp.memory_used < budget else 0
        left = budget - xp.memory_used - self._starting(xp, pool) * share
        return max(0, left // share)

    def _measure(self, xp: ExecPool, pool: Pool) -> None:
        """The pool's workers' memory together, and the largest one's, at most once per
        CHECK_INTERVAL (a burst's dispatches reuse it)."""
        now = self.host.reactor.monotonic()
        if now - xp.memory_at < CHECK_INTERVAL:
            return
        used = largest = 0
        for rep in pool.live.values():
            proc = self.host.proc_of(rep)
            if proc is None or proc.reaped:
                continue
            one = self.memory.used(proc.pid, proc.cgroup)
            used += one
            largest = max(largest, one)
        xp.memory_used, xp.memory_largest, xp.memory_at = used, largest, now

    def _free(self, xp: ExecPool) -> None:
        xp.blocked = None
        self._said.discard(xp.name)

    def _blocked(self, xp: ExecPool, why: str) -> None:
        """The pool may not grow now (``why``): its queue is handed out again in
        BUDGET_RECHECK (a worker's memory may have shrunk; a task's end does it sooner)."""
        if xp.name not in self._said:  # once per spell, not at each re-check
            self._said.add(xp.name)
            log.info("executor pool %s: %s; tasks wait", xp.name, why)
        xp.blocked = why
        if xp.budget_timer is None:
            xp.budget_timer = self.host.reactor.call_later(BUDGET_RECHECK, lambda: self._recheck(xp))

    def _recheck(self, xp: ExecPool) -> None:
        xp.budget_timer = None
        xp.blocked = None  # looked at anew: its dispatch asks ``want`` again if tasks still wait
        if not xp.closing:
            self.run(xp)
