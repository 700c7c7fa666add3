"""The queue discipline of the task table (daemon/taskqueue.py) on the fake table of
test_tasktable_fake.py (the real reactor on a fake clock, socket "workers" speaking the
wire): priorities, tenants by weight, FIFO within a tenant, max_wait aging, a held task
given back keeping its place, and priority and tenant carried across a restore. The order
is read from the TASK frames the workers are sent, in the order they are sent."""

from __future__ import annotations

import collections
from typing import Callable

import pytest

from orchestrator import taskwire as w
from orchestrator.daemon.pools import Pool
from orchestrator.daemon.taskcarry import TaskCarry
from orchestrator.daemon.taskqueue import TaskQueue
from orchestrator.daemon.taskrecords import Doc, ExecPool, Task, parse_options
from orchestrator.daemon.tasktable import TaskTable
from orchestrator.errors import InvalidSpec
from orchestrator.states import TaskState as T
from test_tasktable_fake import POOL, FakeEngine, FakeStore, FakeWorker, Harness, hand_over, make  # noqa: F401


def submit(h: Harness, *, priority: int = 0, tenant: str | None = None) -> Task:
    n = len(h.tasks.live) + len(h.tasks.ended) + 1
    task = Task("", 0, h.xp, b"call %d" % n, n, h.session, None, 0, priority=priority, tenant=tenant)
    h.tasks.submit(h.xp, task)
    return task


def run_all(h: Harness, worker: FakeWorker, count: int) -> list[int]:
    """The numbers of the next ``count`` tasks ``worker`` is sent, in that order, each
    answered with a result as soon as it runs (the worker holds one more behind it)."""
    worker.send(w.READY, 0)
    sent = worker.tasks_sent(min(2, count))
    running = collections.deque(sent)
    while len(sent) < count:
        worker.send(w.RESULT, running.popleft(), b"r")
        more = worker.tasks_sent(1)
        sent += more
        running += more
    return sent


def test_a_higher_priority_starts_first_with_every_worker_busy(make: Callable[..., Harness]) -> None:
    h = make()
    wk = h.worker(ready=False)  # busy until READY: everything below waits in the queue
    low, high, mid, high2, low2 = (submit(h, priority=p) for p in (0, 5, 2, 5, 0))
    h.turn()
    assert run_all(h, wk, 5) == [high.n, high2.n, mid.n, low.n, low2.n]
    assert [t.priority for t in (low, high, mid)] == [0, 5, 2]


def test_a_second_tenant_starts_next_while_the_first_holds_a_thousand(make: Callable[..., Harness]) -> None:
    h = make()
    w1, w2 = h.worker(), h.worker()
    a = [submit(h, tenant="alice") for _ in range(1000)]
    h.turn()
    assert w1.tasks_sent(2) == [a[0].n, a[2].n] and w2.tasks_sent(2) == [a[1].n, a[3].n]  # each runs one, holds one
    b = submit(h, tenant="bob")
    h.turn()
    assert w1.nothing_sent() and w2.nothing_sent() and state(b) is T.QUEUED
    w2.send(w.RESULT, a[1].n, b"r")  # the next worker frees: bob's is the next task handed out
    assert w2.tasks_sent(1) == [b.n]
    w1.send(w.RESULT, a[0].n, b"r")
    assert w1.tasks_sent(1) == [a[4].n]  # then alice's again, in her order
    assert len(h.xp.queue) == 995


def state(task: Task) -> T:
    return task.state


def test_tenants_share_by_weight_two_to_one_and_each_is_fifo(make: Callable[..., Harness]) -> None:
    h = make(options={"tenant_weights": {"alice": 2}})
    wk = h.worker(ready=False)
    by_n: dict[int, str] = {}
    for _ in range(300):  # interleaved submits: the order of arrival is no help to either
        for tenant in ("bob", "alice"):
            by_n[submit(h, tenant=tenant).n] = tenant
    h.turn()
    order = run_all(h, wk, 300)
    window = collections.Counter(by_n[n] for n in order[:90])
    assert window == {"alice": 60, "bob": 30}, window
    for tenant in ("alice", "bob"):
        mine = [n for n in order if by_n[n] == tenant]
        assert mine == sorted(mine)  # FIFO within a tenant
    # Every 3 starts in a row hold 2 of alice's: shared all along, not in long runs.
    assert all(sum(by_n[n] == "alice" for n in order[i:i + 3]) == 2 for i in range(0, 270, 3))


def test_no_tenant_is_one_tenant_of_weight_one(make: Callable[..., Harness]) -> None:
    h = make()
    wk = h.worker(ready=False)
    plain = [submit(h) for _ in range(4)]
    named = [submit(h, tenant="t") for _ in range(2)]
    h.turn()
    assert run_all(h, wk, 6) == [plain[0].n, named[0].n, plain[1].n, named[1].n, plain[2].n, plain[3].n]


def test_a_task_that_waited_max_wait_goes_above_every_priority(make: Callable[..., Harness]) -> None:
    h = make(options={"max_wait": 10})
    wk = h.worker(ready=False)
    old = submit(h, priority=0)
    h.advance(6)
    urgent = [submit(h, priority=9) for _ in range(4)]
    h.turn()
    wk.send(w.READY, 0)
    assert wk.tasks_sent(2) == [urgent[0].n, urgent[1].n]  # 6 s waited: not yet
    h.advance(5)  # 11 s: it waited past max_wait; the urgent ones only 5 s
    wk.send(w.RESULT, urgent[0].n, b"r")
    assert wk.tasks_sent(1) == [old.n] and old.aged
    wk.send(w.RESULT, urgent[1].n, b"r")
    assert wk.tasks_sent(1) == [urgent[2].n]
    assert h.tasks.task(old.id) is old and old.record()["priority"] == 0  # its own priority is what it shows


def test_without_max_wait_a_low_priority_waits_behind_the_stream(make: Callable[..., Harness]) -> None:
    h = make()
    wk = h.worker(ready=False)
    old = submit(h, priority=0)
    h.advance(3600)
    urgent = [submit(h, priority=9) for _ in range(3)]
    h.turn()
    assert run_all(h, wk, 4) == [urgent[0].n, urgent[1].n, urgent[2].n, old.n] and not old.aged


def test_a_held_task_given_back_keeps_its_place(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    first, held = submit(h, tenant="alice"), submit(h, tenant="alice")
    h.turn()
    assert w1.tasks_sent(2) == [first.n, held.n]
    later = [submit(h, tenant="alice") for _ in range(3)]
    h.turn()
    w2 = h.worker()  # idle now: w2 takes bob's first, and the held one is asked back (it was before it)
    assert w2.tasks_sent(2) == [later[0].n, later[1].n]
    assert held.asked_back
    w1.send(w.STOPPED, 1, bytes([w.REVOKE]))  # the answer to ask 1: given back, unstarted
    assert state(held) is T.QUEUED and not held.asked_back
    assert w1.tasks_sent(1) == [held.n]  # handed out again first, ahead of the one queued after it
    assert [t.n for t in h.xp.queue] == [later[2].n], [t.n for t in h.xp.queue]


def test_a_cancelled_queued_task_leaves_the_queue(make: Callable[..., Harness]) -> None:
    h = make()
    wk = h.worker(ready=False)
    tasks = [submit(h, tenant=t) for t in ("a", "b", "a")]
    assert len(h.xp.queue) == 3
    assert h.tasks.cancel(tasks[1]) and len(h.xp.queue) == 2
    assert h.commands.pool_counts(POOL)["queued"] == 2  # type: ignore[index]
    h.turn()
    assert run_all(h, wk, 2) == [tasks[0].n, tasks[2].n]


def test_a_restore_keeps_each_tasks_priority_and_tenant(make: Callable[..., Harness]) -> None:
    h = make()
    engine = FakeEngine()
    pool = Pool(POOL, None, stored_executor=h.pool.executor.stored() if h.pool.executor is not None else None)
    engine.pools[POOL] = pool

    def row(n: int, priority: int | None, tenant: str | None) -> Doc:
        return {"id": f"{POOL}/{n}", "pool": POOL, "n": n, "payload": b"p", "timeout": None, "retries": 0,
                "state": "QUEUED", "attempts": 0, "worker": None, "queued_at": 1.0, "started_at": None,
                "priority": priority, "tenant": tenant}

    rows = [row(1, None, None), row(2, 3, "alice"), row(3, 3, "bob"), row(4, 7, None)]  # 1: a row of version 1
    table = TaskTable(engine)
    try:
        TaskCarry(table, engine).restore([pool], FakeStore(rows, {POOL: 4}))
        xp: ExecPool = table.pools[POOL]
        assert [t.id for t in xp.queue] == [f"{POOL}/4", f"{POOL}/2", f"{POOL}/3", f"{POOL}/1"]
        assert [(r["priority"], r["tenant"]) for r in (table.live[f"{POOL}/{n}"].record() for n in (1, 2))] == [
            (0, None), (3, "alice")]
    finally:
        table.close()
        engine.reactor.close()


def test_the_next_image_keeps_the_queues_order_priority_and_tenant(make: Callable[..., Harness]) -> None:
    h = make(options={"tenant_weights": {"alice": 2}})
    w1 = h.worker(ready=False)
    low = submit(h, priority=0, tenant="bob")
    high = [submit(h, priority=4, tenant="alice") for _ in range(2)]
    h.turn()
    engine, table = hand_over(h)
    try:
        xp = table.pools[POOL]
        assert [t.id for t in xp.queue] == [high[0].id, high[1].id, low.id]
        assert [(table.live[t.id].priority, table.live[t.id].tenant) for t in (low, high[0])] == [
            (0, "bob"), (4, "alice")]
        w1.sock.sendall(w.frame(w.READY, 0))
        engine.reactor.run_once(0.0)
        assert w1.tasks_sent(2) == [high[0].n, high[1].n]  # the next image hands them out in that order
    finally:
        table.close()
        engine.reactor.close()


@pytest.mark.parametrize("options, line", [
    ({"tenant_weights": {"alice": -2}}, "tenant_weights: the weight of 'alice' must be a number above 0, got -2"),
    ({"tenant_weights": {"alice": True}}, "tenant_weights: the weight of 'alice' must be a number above 0, got True"),
    ({"tenant_weights": [1]}, "tenant_weights must be an object of tenant: weight, got [1]"),
    ({"max_wait": 0}, "max_wait must be a number of seconds above 0"),
])
def test_bad_pool_options_are_one_line(options: Doc, line: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_options(options)
    assert str(info.value) == line


@pytest.mark.parametrize("one, line", [
    ({"priority": "high"}, "priority must be a whole number, got 'high'"),
    ({"priority": True}, "priority must be a whole number, got True"),
    ({"priority": 1.5}, "priority must be a whole number, got 1.5"),
    ({"tenant": 7}, "tenant must be a name of 1 to 200 characters, got 7"),
    ({"tenant": ""}, "tenant must be a name of 1 to 200 characters, got ''"),
])
def test_a_submit_with_a_bad_priority_or_tenant_is_refused_in_one_line(make: Callable[..., Harness], one: Doc,
                                                                       line: str) -> None:
    h = make()
    with pytest.raises(InvalidSpec) as info:
        h.commands.commands()["task_submit"]({"pool": POOL, "payload": "eA==", **one}, lambda msg: None, 1)
    assert str(info.value) == line
    assert not h.tasks.live


def test_the_queue_alone_on_a_clock() -> None:
    """The queue without a table: pop order, weights changed by configure, aging on the
    clock it is given."""
    now = [0.0]
    queue: TaskQueue[Task] = TaskQueue(lambda: now[0], max_wait=5.0)
    xp = ExecPool("q", {}, b"", queue)

    def task(n: int, priority: int = 0, tenant: str | None = None) -> Task:
        t = Task(f"q/{n}", n, xp, b"", n, None, None, 0, queued_at=now[0], priority=priority, tenant=tenant)
        queue.push(t)
        return t

    a1, a2 = task(1, tenant="a"), task(2, tenant="a")
    now[0] = 4.0
    b1 = task(3, priority=1, tenant="b")
    assert len(queue) == 3 and queue.pop() is b1
    now[0] = 6.0  # a1 and a2 waited past 5 s
    c1 = task(4, priority=3)
    assert queue.pop() is a1 and queue.pop() is a2 and queue.pop() is c1 and queue.pop() is None and not queue


def test_a_reload_changes_weights_and_max_wait_for_what_waits(make: Callable[..., Harness]) -> None:
    h = make()
    wk = h.worker(ready=False)
    old = submit(h, priority=0)
    h.advance(100)
    later = [submit(h, priority=1) for _ in range(2)]
    h.tasks.set_options(h.xp, parse_options({"max_wait": 50, "tenant_weights": {"a": 3}}))  # a config reload
    h.turn()
    assert run_all(h, wk, 3) == [old.n, later[0].n, later[1].n]  # it had waited 100 s: over the new max_wait
    queue = h.xp.queue
    tasks = {t: [Task(f"{POOL}/x{t}{i}", 10_000 + i, h.xp, b"", None, None, None, 0, priority=1, tenant=t,
                      queued_at=h.engine.time()) for i in range(12)] for t in ("a", "b")}
    for i in range(12):
        queue.push(tasks["b"][i])
        queue.push(tasks["a"][i])
    first8 = [queue.pop() for _ in range(8)]
    assert sum(t is not None and t.tenant == "a" for t in first8) == 6  # weight 3 against 1, as reloaded
