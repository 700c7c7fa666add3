"""Waiting tasks on the task table's fake (test_tasktable_fake.py: the real reactor on a
fake clock, socket "workers" that speak the wire): ``Retry(after=)`` parks a task holding no
worker until its time, ``retry_on``'s backoff, a deadline queued, held, waiting and
running, a cancel while waiting, and a waiting task across a restart and an upgrade's
hand-over (daemon/taskwait.py)."""

from __future__ import annotations

import json
import pickle
from typing import Any, Callable

import pytest

from orchestrator import taskwire as w
from orchestrator.daemon.pools import Pool
from orchestrator.daemon.taskcarry import TaskCarry
from orchestrator.daemon.taskrecords import Doc, Task
from orchestrator.daemon.tasktable import TaskTable
from orchestrator.errors import InvalidSpec
from orchestrator.states import TaskState as T
from test_tasktable_fake import POOL, FakeEngine, FakeStore, FakeWorker, Harness, hand_over, make, state  # noqa: F401


def submit(h: Harness, *, deadline: float | None = None, retries: int = 0,
           backoff: tuple[float, float] | None = None) -> Task:
    n = len(h.tasks.live) + len(h.tasks.ended) + 1
    task = Task("", 0, h.xp, b"call %d" % n, n, h.session, None, retries, deadline=deadline, backoff=backoff)
    h.tasks.submit(h.xp, task)
    h.turn()
    return task


def retry(after: float | None, reason: str, exc: BaseException | None = None) -> bytes:
    """A RETRY payload as the worker makes it (taskworker._retry, _raised)."""
    raised = w.raised(f"{type(exc).__name__}: {exc}", pickle.dumps((exc, "tb"))) if exc is not None else b""
    return w.retry_payload({"after": after, "reason": reason}, raised)


def parked(h: Harness, after: float, reason: str, *, deadline: float | None = None) -> tuple[FakeWorker, Task]:
    """A worker, and a task it ran that raised Retry(after=, reason=)."""
    w1 = h.worker()
    task = submit(h, deadline=deadline)
    assert w1.tasks_sent(1) == [task.n]
    w1.send(w.RETRY, task.n, retry(after, reason))
    return w1, task


def test_retry_parks_the_task_without_its_worker_until_its_time(make: Callable[..., Harness]) -> None:
    h = make()
    w1, task = parked(h, 5.0, "upstream  rate\nlimited")
    assert task.state is T.WAITING and task.worker is None and task not in h.xp.queue
    assert task.wait_until == h.engine.time() + 5.0 and task.wait_reason == "upstream rate limited"
    row = h.commands.commands()["tasks"]({}, lambda m: None, 1)[0]
    assert (row["state"], row["waiting"], row["wait_until"]) == ("WAITING", "upstream rate limited",
                                                                  h.engine.time() + 5.0)
    assert h.commands.pool_counts(POOL)["waiting"] == 1  # status and the metrics count it
    other = submit(h)  # the one worker is free: the next task runs on it at once
    assert w1.tasks_sent(1) == [other.n] and other.state is T.RUNNING
    w1.send(w.RESULT, other.n, b"r")
    h.advance(4.9)
    assert task.state is T.WAITING and w1.nothing_sent()
    h.advance(0.2)  # its time: queued again first, and the idle worker takes it
    assert w1.tasks_sent(1) == [task.n] and state(task) is T.RUNNING
    assert (task.attempts, task.waits, task.wait_until, task.wait_reason) == (2, 1, None, None)
    w1.send(w.RESULT, task.n, b"done")
    # The second attempt's "started" is folded into its end (it came within STARTED_HOLD).
    assert state(task) is T.DONE and h.kinds(task.ref) == ["started", "result"]


def test_retry_does_not_spend_retries_and_a_lost_worker_still_may(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    task = submit(h, retries=1)
    w1.tasks_sent(1)
    for _ in range(3):
        w1.send(w.RETRY, task.n, retry(0.0, "again"))
        h.advance(0.0)  # a wait of 0 s: the next turn
        assert w1.tasks_sent(1) == [task.n]
    assert (task.attempts, task.waits) == (4, 3) and task.may_run_again()
    w1.die(9)  # cut short: its one retry is left, the waits did not spend it
    assert state(task) is T.QUEUED


def test_retry_on_backs_off_exponentially_then_fails_with_the_last_exception(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    task = submit(h, retries=2, backoff=(1.0, 8.0))
    waits = []
    for attempt in (1, 2, 3):
        assert w1.tasks_sent(1) == [task.n] and task.attempts == attempt
        w1.send(w.RETRY, task.n, retry(None, f"ConnectionError: down {attempt}", ConnectionError(f"down {attempt}")))
        if attempt == 3:
            break
        assert task.state is T.WAITING and task.wait_until is not None
        waits.append(task.wait_until - h.engine.time())
        assert task.wait_reason == f"retry {attempt} of 2 after ConnectionError: down {attempt}"
        h.advance(waits[-1] - 0.01)
        assert state(task) is T.WAITING
        h.advance(0.02)
    assert waits[0] == 1.0 and 1.0 <= waits[1] <= 2.0  # MIN, then MIN * 2 jittered down to no less than MIN
    assert state(task) is T.FAILED and task.kind == "raised" and task.reason == "ConnectionError: down 3"
    exc, _ = pickle.loads(task.result or b"")
    assert isinstance(exc, ConnectionError) and str(exc) == "down 3"
    assert task.waits == 0 and w1.nothing_sent()


def test_the_backoff_stops_at_its_max(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    task = submit(h, retries=20, backoff=(1.0, 3.0))
    for _ in range(6):
        w1.tasks_sent(1)
        w1.send(w.RETRY, task.n, retry(None, "E: x", ValueError("x")))
        assert task.wait_until is not None and task.wait_until - h.engine.time() <= 3.0
        h.advance(3.0)


def test_a_deadline_ends_a_queued_a_waiting_and_a_running_task(make: Callable[..., Harness]) -> None:
    h = make(options={"grace": 2.0})
    w1 = h.worker()
    running = submit(h, deadline=10.0)
    held = submit(h, deadline=4.0)  # sent to the busy worker, not started
    queued = submit(h, deadline=3.0)
    assert w1.tasks_sent(2) == [running.n, held.n] and queued in h.xp.queue
    h.advance(3.01)
    assert state(queued) is T.TIMED_OUT and queued not in h.xp.queue
    assert [d for k, r, d, _ in h.heard if r == queued.ref] == [
        [f"task {queued.id} passed its deadline of 3 s from its submit", 3.0]]
    h.advance(1.0)  # the held one: marked in its own word, stopped as soon as it starts
    assert state(held) is T.TIMED_OUT and w1.word(held.slot) == w.cancel_word(held.n, w.TIMEOUT)
    w1.send(w.RETRY, running.n, retry(30.0, "later"))  # waits past its deadline: the deadline ends it
    assert state(running) is T.WAITING and h.commands.pool_counts(POOL)["waiting"] == 1
    w1.send(w.STOPPED, held.n, bytes([w.TIMEOUT]))  # the held one started, saw its word, stopped
    h.advance(6.0)
    assert state(running) is T.TIMED_OUT and running.reason == (
        f"task {running.id} passed its deadline of 10 s from its submit while it waited (later)")
    again = submit(h, deadline=5.0)
    assert w1.tasks_sent(1) == [again.n] and state(again) is T.RUNNING
    h.advance(5.01)  # running: the timeout's cause in its word, the signal, the kill after the grace
    assert state(again) is T.TIMED_OUT and w1.word(again.slot) == w.cancel_word(again.n, w.TIMEOUT)
    assert h.signalled[-1] == h.engine.procs[w1.rep.id].pid
    h.advance(2.1)
    assert h.engine.killed == [h.engine.procs[w1.rep.id].pid]


def test_a_cancel_while_waiting_ends_it_and_its_time_does_nothing(make: Callable[..., Harness]) -> None:
    h = make()
    w1, task = parked(h, 2.0, "x", deadline=20.0)
    assert h.tasks.cancel(task) is True and state(task) is T.CANCELLED
    h.advance(30.0)  # neither its wake-up nor its deadline acts on it any more
    # No clock moved between its start and the cancel: the end says both (STARTED_HOLD).
    assert state(task) is T.CANCELLED and w1.nothing_sent() and h.kinds(task.ref) == ["cancelled"]


def test_a_bad_retry_frame_fails_its_task_and_the_worker_goes_on(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    task = submit(h)
    w1.tasks_sent(1)
    w1.send(w.RETRY, task.n, w.retry_payload({"after": -1.0, "reason": "x"}))  # type: ignore[typeddict-item]
    assert state(task) is T.FAILED and task.kind == "error" and "bad head" in (task.reason or "")
    nxt = submit(h)
    assert w1.tasks_sent(1) == [nxt.n]


def test_bad_deadlines_and_backoffs_are_refused_in_one_line(make: Callable[..., Harness]) -> None:
    h = make()
    submit_ = h.commands.commands()["task_submit"]
    for bad, match in (({"deadline": 0}, "deadline must be"), ({"deadline": -3}, "deadline must be"),
                       ({"deadline": "soon"}, "deadline must be"), ({"backoff": [2, 1]}, "backoff must be"),
                       ({"backoff": [-1, 1]}, "backoff must be"), ({"backoff": 3}, "backoff must be")):
        with pytest.raises(InvalidSpec, match=match) as err:
            submit_({"pool": POOL, "payload": b"x", **bad}, lambda m: None, 1)
        assert "\n" not in str(err.value)
    assert not h.tasks.live


def _restored(h: Harness, rows: list[Doc]) -> tuple[FakeEngine, TaskTable]:
    engine = FakeEngine()
    engine.now = h.engine.now
    engine.pools[POOL] = Pool(POOL, None, stored_executor=h.pool.executor.stored() if h.pool.executor else None)
    table = TaskTable(engine)
    TaskCarry(table, engine).restore([engine.pools[POOL]], FakeStore(rows, {POOL: len(rows)}))
    return engine, table


def test_a_restart_keeps_a_waiting_task_waiting_until_its_time(make: Callable[..., Harness]) -> None:
    h = make()
    _, task = parked(h, 10.0, "later", deadline=60.0)
    earlier: w.Figures = {"wall": 0.5, "cpu": 0.25, "peak_rss": 1 << 24, "children_peak_rss": None}
    row = {**task.record(), "figures": json.loads(json.dumps(earlier))}  # as the store gives it back
    gone = {**row, "id": f"{POOL}/2", "n": 2, "wait_until": h.engine.time() - 1.0}  # its time passed meanwhile
    late = {**row, "id": f"{POOL}/3", "n": 3, "queued_at": h.engine.time() - 61.0}  # its deadline too
    engine, table = _restored(h, [row, gone, late])
    try:
        xp = table.pools[POOL]
        again = table.live[task.id]
        assert (again.state, again.wait_reason, again.deadline, again.waits) == (T.WAITING, "later", 60.0, 1)
        assert again.figures == earlier  # its first attempt's: the next one's are added to them
        engine.reactor.run_once(0.0)
        assert [t.id for t in xp.queue] == [f"{POOL}/2"] and table.ended[f"{POOL}/3"].state is T.TIMED_OUT
        engine.now += 9.9
        engine.reactor.run_once(0.0)
        assert again.state is T.WAITING
        engine.now += 0.2
        engine.reactor.run_once(0.0)
        assert state(again) is T.QUEUED and [t.id for t in xp.queue] == [task.id, f"{POOL}/2"]
    finally:
        table.close()
        engine.reactor.close()


def test_an_upgrade_carries_a_waiting_task_and_its_deadline(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    waiting, other = submit(h, deadline=30.0), submit(h, deadline=8.0)
    w1.tasks_sent(2)
    w1.send(w.RETRY, waiting.n, retry(12.0, "later"))
    engine, table = hand_over(h, later=5.0)
    try:
        after, running = table.live[waiting.id], table.live[other.id]
        assert after.state is T.WAITING and running.state is T.RUNNING
        engine.now += 3.01  # 8 s from its submit, not from the hand-over
        engine.reactor.run_once(0.0)
        assert state(running) is T.TIMED_OUT
        engine.now += 3.9
        engine.reactor.run_once(0.0)
        assert after.state is T.WAITING
        engine.now += 0.2
        engine.reactor.run_once(0.0)
        assert state(after) is T.QUEUED
    finally:
        table.close()
        engine.reactor.close()


def test_the_wire_carries_a_retry_head_and_refuses_a_bad_one() -> None:
    payload = w.retry_payload({"after": 1.5, "reason": "r"}, b"rest")
    assert w.split_retry(payload) == ({"after": 1.5, "reason": "r"}, b"rest")
    for bad in (b"", b"\x00\x05nope!", w.retry_payload({"after": "1", "reason": "r"}),  # type: ignore[typeddict-item]
                w.retry_payload({"after": float("inf"), "reason": "r"})):
        with pytest.raises(ValueError):
            w.split_retry(bad)
    assert json.loads(payload[2:2 + int.from_bytes(payload[:2], "big")]) == {"after": 1.5, "reason": "r"}


def test_a_parked_tasks_record_and_event_say_why_and_until_when(make: Callable[..., Harness]) -> None:
    h = make()
    _, task = parked(h, 2.0, "busy")
    rec: Any = task.record()
    assert (rec["state"], rec["wait_reason"], rec["waits"]) == ("WAITING", "busy", 1)
    assert h.tasks.waiting(task) == "busy"


def test_a_session_that_asked_hears_a_task_wait_and_start_again(make: Callable[..., Harness]) -> None:
    h = make()
    h.tasks.open_session("s1", None, waiting_events=True)  # the Executor's ask, when it opens its pool
    w1, task = parked(h, 1.0, "not yet")
    h.advance(0.01)  # the turn's events handed over
    assert h.kinds(task.ref)[-1] == "waiting"  # its first "started" folded into it: it was never running
    h.advance(1.0)
    assert w1.tasks_sent(1) == [task.n] and state(task) is T.RUNNING
    h.advance(0.01)  # a lone "started" is handed over after STARTED_HOLD
    assert h.kinds(task.ref)[-1] == "started"
    w1.send(w.RESULT, task.n, b"done")
    assert state(task) is T.DONE and h.kinds(task.ref) == ["waiting", "started", "result"]


def test_a_session_that_did_not_ask_hears_no_wait(make: Callable[..., Harness]) -> None:
    """An Executor of a version before the WAITING event would take it for the task's end."""
    h = make()
    w1, task = parked(h, 1.0, "not yet")
    h.advance(0.01)
    assert "waiting" not in h.kinds(task.ref)
