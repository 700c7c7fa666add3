"""An executor pool's queue (the task table's, loop thread only): which queued task starts next.

The order, the "Scheduling contract" of the README's Executor section:

- **Priority.** A task of a higher ``priority`` starts before any of a lower one.
- **Tenants share by weight.** Within one priority, the tenants with queued tasks take
  turns: weighted fair queuing (start-time fair queuing, as a network scheduler shares a
  link). Each tenant's share has a virtual ``finish`` time; the next task is the oldest of
  the share with the least one, which then moves on by ``1 / weight``. A tenant that
  starts queueing joins at the lane's virtual time now (the ``finish`` of the latest
  start), so it is served at the next start, however many tasks another tenant holds;
  with weights 2:1, two of the first start for each of the second. FIFO within a tenant.
  Tasks without a tenant are one tenant (``None``) of weight 1.
- **Aging.** With ``max_wait`` (seconds), a task queued that long moves above every
  priority (still shared between tenants by weight, FIFO within one): nothing waits forever
  behind a stream of higher-priority work. It is checked when the next task is chosen (no
  timer: the order matters only then), on the wall clock of ``queued_at``, which a restart
  carries.
- **A task given back** (a held task a worker gave back unstarted, one whose worker died
  before it started, one queued again after a lost attempt): first again in its priority,
  ``push_front``.

A task that ends while queued (cancelled) is ``discard``-ed: ``len`` counts only what still
waits.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, Mapping, Protocol, TypeVar


class Queued(Protocol):
    """What the queue reads of a task (taskrecords.Task), and ``aged``, which it sets."""

    priority: int
    tenant: str | None
    queued_at: float  # wall clock
    aged: bool


Task = TypeVar("Task", bound=Queued)

AGED = (1, 0)  # the lane of tasks that waited max_wait: above every priority


def lane_key(task: Queued) -> tuple[int, int]:
    """Where ``task`` waits: (1, 0) once aged, else (0, its priority); higher starts first."""
    return AGED if task.aged else (0, task.priority)


@dataclass(slots=True, eq=False)
class _Share(Generic[Task]):
    """One tenant's tasks in one lane, and its place in the lane's turns."""

    tasks: collections.deque[Task]
    step: float  # 1 / its weight: how far a start moves its finish on
    finish: float  # the virtual time of its next start
    order: int  # ties between equal finishes: who joined first (a task given back: first)
    active: bool = True  # it has tasks waiting (an entry in its lane's turns)


@dataclass(slots=True, eq=False)
class _Lane(Generic[Task]):
    """The tasks of one priority: tenants' shares, taken in turn by weight."""

    key: tuple[int, int]
    now: float = 0.0  # the lane's virtual time: the finish of its latest start
    # Every tenant's share, those with nothing waiting too (idle): a tenant that just had
    # its turns comes back with the finish it had, not ahead of one that waits.
    shares: dict[str | None, _Share[Task]] = field(default_factory=dict)
    turns: list[tuple[float, int, str | None]] = field(default_factory=list)  # heap of (finish, order, tenant)
    idle: int = 0  # shares with nothing waiting
    listed: bool = False  # its key is in TaskQueue._keys


IDLE_KEPT = 1024  # idle shares a lane remembers (then those with no turn owed to anyone go)
EMPTY_KEPT = 64  # empty lanes remembered (then they go: their tenants start even again)


class TaskQueue(Generic[Task]):
    """The queued tasks of one executor pool, in the order they start (module docstring):
    ``push``, ``push_front``, ``pop`` (the next, or None), ``discard`` (ended while queued),
    ``len``/``bool`` (what waits), ``tenants`` (what waits, counted by tenant), iteration
    (what waits, about in start order), and
    ``configure`` (the pool's ``tenant_weights`` and ``max_wait``)."""

    def __init__(self, clock: Callable[[], float] = time.time, *, weights: Mapping[str, float] | None = None,
                 max_wait: float | None = None) -> None:
        """``clock``: the wall clock of ``Task.queued_at`` (the engine's ``time``)."""
        self._clock = clock
        self._weights: Mapping[str, float] = dict(weights or {})
        self._max_wait = max_wait
        self._lanes: dict[tuple[int, int], _Lane[Task]] = {}
        self._keys: list[tuple[int, int]] = []  # the keys of lanes with tasks, ascending (the last starts first)
        self._where: dict[Task, _Lane[Task]] = {}  # each task waiting -> its lane
        self._order = itertools.count()
        # With max_wait, when each task waiting comes due: in the order they were queued
        # (a deque: queued_at grows), those out of that order (restored, given back) in a heap.
        self._due: collections.deque[tuple[float, Task]] = collections.deque()
        self._late: list[tuple[float, int, Task]] = []

    def configure(self, weights: Mapping[str, float] | None, max_wait: float | None) -> None:
        """The pool's options now (a config reload): a tenant's weight counts from its next
        turn after it had nothing queued; ``max_wait`` counts for every task waiting."""
        self._weights = dict(weights or {})
        if max_wait != self._max_wait:
            self._max_wait = max_wait
            self._due.clear()
            self._late = []
            if max_wait is not None:
                for task in self._where:
                    self._will_age(task)

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, task: object) -> bool:
        return task in self._where

    def tenants(self) -> collections.Counter[str | None]:
        """How many tasks wait, by tenant (None: no tenant); walked when asked (a metrics
        scrape, ``status``), not kept up on each push and pop."""
        return collections.Counter(task.tenant for task in self._where)

    def __iter__(self) -> Iterator[Task]:
        """What waits: the lanes from the highest, each tenant's tasks in its turn order."""
        for key in reversed(self._keys):
            lane = self._lanes[key]
            for tenant in sorted(lane.shares, key=lambda t: (lane.shares[t].finish, lane.shares[t].order)):
                yield from (t for t in lane.shares[tenant].tasks if self._where.get(t) is lane)

    def push(self, task: Task) -> None:
        """``task`` waits last of its tenant in its priority."""
        self._put(task, front=False)
        if self._max_wait is not None:
            self._will_age(task)

    def push_front(self, task: Task) -> None:
        """``task`` (given back, or queued again) starts next of its priority."""
        self._put(task, front=True)
        if self._max_wait is not None:
            self._will_age(task)

    def discard(self, task: Task) -> None:
        """``task`` no longer waits (it ended while queued); its entry is dropped when its
        turn comes."""
        self._where.pop(task, None)

    def pop(self) -> Task | None:
        """The next task to start, taken out of the queue; None if none waits."""
        if self._due or self._late:
            now = self._clock()
            if self._due and self._due[0][0] <= now or self._late and self._late[0][0] <= now:
                self._age(now)
        while self._keys:
            lane = self._lanes[self._keys[-1]]
            task = self._take(lane)
            if task is not None:
                return task
            self._keys.pop()  # empty: its tasks all started or ended
            lane.listed = False
            if len(self._lanes) - len(self._keys) > EMPTY_KEPT:
                for key in [k for k, ln in self._lanes.items() if not ln.listed]:
                    del self._lanes[key]
        return None

    def _lane(self, key: tuple[int, int]) -> _Lane[Task]:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane[Task](key)
        if not lane.listed:
            bisect.insort(self._keys, key)
            lane.listed = True
        return lane

    def _put(self, task: Task, *, front: bool) -> None:
        lane = self._lane(lane_key(task))
        self._where[task] = lane
        tenant = task.tenant
        share = lane.shares.get(tenant)
        if share is None or not share.active:
            # It joins the turns now: its next start is the lane's next, or where its last
            # turns left it if that is later (a task given back: the next, whatever it owes).
            order = -next(self._order) if front else next(self._order)
            if share is None:
                weight = self._weights.get(tenant, 1) if tenant is not None else 1
                share = lane.shares[tenant] = _Share[Task](collections.deque(), 1.0 / weight, lane.now, order)
            else:
                lane.idle -= 1
                weight = self._weights.get(tenant, 1) if tenant is not None else 1
                share.step = 1.0 / weight  # the weights may have changed since (configure)
                share.finish = lane.now if front else max(share.finish, lane.now)
                share.order, share.active = order, True
            heapq.heappush(lane.turns, (share.finish, share.order, tenant))
        elif front and (share.finish, share.order) > (lane.now, 0):
            # Given back: it had its turn already; it takes the next one again.
            share.finish, share.order = lane.now, -next(self._order)
            heapq.heappush(lane.turns, (share.finish, share.order, tenant))  # its older entry is stale now
        if front:
            share.tasks.appendleft(task)
        else:
            share.tasks.append(task)

    def _take(self, lane: _Lane[Task]) -> Task | None:
        """The next task of ``lane`` (None: none waits there), its tenant's turn moved on."""
        turns, where = lane.turns, self._where
        while turns:
            finish, order, tenant = turns[0]
            share = lane.shares.get(tenant)
            if share is None or not share.active or share.order != order or share.finish != finish:
                heapq.heappop(turns)  # a stale entry: its share left, or took an earlier turn
                continue
            tasks = share.tasks
            while tasks:
                task = tasks.popleft()
                if where.get(task) is lane:
                    del where[task]
                    lane.now = finish
                    share.finish = finish + share.step
                    if tasks:
                        heapq.heapreplace(turns, (share.finish, order, tenant))
                    else:
                        heapq.heappop(turns)
                        self._idle(lane, share)
                    return task
            heapq.heappop(turns)  # only tasks that ended or moved were left
            self._idle(lane, share)
        return None

    @staticmethod
    def _idle(lane: _Lane[Task], share: _Share[Task]) -> None:
        """``share`` has nothing waiting: remembered (its finish), within IDLE_KEPT."""
        share.active = False
        lane.idle += 1
        if lane.idle > IDLE_KEPT:  # forget those owed nothing (back, they would join at now anyway)...
            for tenant in [t for t, sh in lane.shares.items() if not sh.active and sh.finish <= lane.now]:
                del lane.shares[tenant]
            if sum(not sh.active for sh in lane.shares.values()) > IDLE_KEPT:  # ...and then any
                for tenant in [t for t, sh in lane.shares.items() if not sh.active]:
                    del lane.shares[tenant]
            lane.idle = sum(not sh.active for sh in lane.shares.values())

    def _will_age(self, task: Task) -> None:
        """``task`` (just put in the queue) ages once it has waited max_wait."""
        assert self._max_wait is not None
        if task.aged:
            return
        due = task.queued_at + self._max_wait
        if not self._due or self._due[-1][0] <= due:
            self._due.append((due, task))
        else:
            heapq.heappush(self._late, (due, next(self._order), task))

    def _age(self, now: float) -> None:
        """Tasks queued for ``max_wait`` move to the lane above every priority, in the order
        they came due."""
        while True:
            if self._due and self._due[0][0] <= now and (not self._late or self._due[0][0] <= self._late[0][0]):
                task = self._due.popleft()[1]
            elif self._late and self._late[0][0] <= now:
                task = heapq.heappop(self._late)[2]
            else:
                return
            lane = self._where.get(task)
            if lane is None or lane.key == AGED:
                continue  # it started, ended or aged already
            task.aged = True
            self._put(task, front=False)  # its entry in the old lane is stale now
