"""The task table on a fake: the real reactor on a fake clock, a fake engine (the ``Table``
the table asks), and "workers" that are sockets of this process connected to the table's
real listener, speaking the wire (taskwire frames, a memfd of cancel words sent with
HELLO). No process is started: who a connection is, is what the fake engine says the
connecting pid is (``FakeEngine.connecting``), and the cancel signal is recorded, not sent.

What it shows: dispatch order (idle first, one held per busy worker, a held task asked
back for an idle worker), the two cancel words, retries after a worker's death, a
hopeless pool, the backlog bounds, task numbers reserved across a restore, a few commands,
and an upgrade's hand-over between two tables of this process.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
from typing import Any, Callable, Iterator

import pytest

from orchestrator import protocol, signals
from orchestrator import taskwire as w
from orchestrator.daemon import tasktable
from orchestrator.daemon.pools import CRASHLOOP, Pool
from orchestrator.daemon.containment import Tree
from orchestrator.daemon.reactor import Reactor
from orchestrator.daemon.taskcarry import TaskCarry
from orchestrator.daemon.taskcommands import TaskCommands
from orchestrator.daemon.taskrecords import Doc, Event, ExecPool, Reply, Session, Task, parse_options
from orchestrator.daemon.tasktable import STARTED_HOLD, TaskTable
from orchestrator.errors import InvalidSpec, UnknownTask
from orchestrator.states import Replica, ReplicaState
from orchestrator.states import TaskState as T
from orchestrator.taskwire import TaskEvent

POOL = "px"


def state(task: Task) -> T:
    """A task's state now (read again after the loop turned; mypy narrows an attribute it saw)."""
    return task.state


class FakeProc:
    """A replica's process as the engine holds it (engine.Proc): what the table reads."""

    def __init__(self, pid: int, replica: Replica) -> None:
        self.pid, self.replica = pid, replica
        self.reaped = self.killed = False
        self.cgroup: str | None = None
        self.escaped: list[tuple[int, int]] = []
        self.kill_timer: Any = None


class FakeStore:
    """The store's task reads (restore): rows as store.tasks gives them."""

    def __init__(self, rows: list[Doc], numbers: dict[str, int]) -> None:
        self.rows, self.numbers = rows, numbers

    def task_numbers(self) -> dict[str, int]:
        return self.numbers

    def tasks(self, *, pool: str | None = None, include_terminal: bool = False,
              task_id: str | None = None) -> list[Doc]:
        return [r for r in self.rows if (pool is None or r["pool"] == pool) and (task_id is None or r["id"] == task_id)]

    def save_task(self, rec: Doc) -> None:
        pass


class FakeEngine:
    """The engine's side of the task table (tasktable.Table), with a clock the test moves:
    it is its own os, supervisor, containment, journal and metrics, and records what the
    table asked of them."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reactor = Reactor(clock=lambda: self.now)
        self.os = self.containment = self.supervisor = self.journal = self.metrics = self
        self.store: FakeStore | None = None
        self.closing = False
        self.pools: dict[str, Pool] = {}
        self.replicas: dict[str, Replica] = {}
        self.procs: dict[str, FakeProc] = {}
        self.connecting: Replica | None = None  # who the next connection of this process is
        self.renewed: list[tuple[str, str]] = []
        self.killed: list[int] = []  # pids whose tree was killed
        self.saved: list[Doc] = []  # the executor part of each save_pool, as it was then

    # os
    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def monotonic(self) -> float:
        return self.now

    # containment: no memory controller here (memory_max is not used by these tests)
    def check_limits(self, limits: Doc) -> None:
        raise InvalidSpec("no memory controller")

    def kill_after_grace(self, tree: Tree) -> None:
        self.killed.append(tree.pid)

    # supervisor
    def renew(self, rep: Replica, reason: str, *, now: bool = False) -> None:
        self.renewed.append((rep.id, reason))

    def open_pool(self, name: str, spec: Doc, policy: Doc, size: int) -> tuple[Pool, list[str]]:
        raise AssertionError("not used here: the tests make their pool themselves")

    def declare(self, name: str, spec: Doc, policy: Doc, size: int) -> str:
        raise AssertionError("not used here")

    def delete_pool(self, name: str) -> list[str]:
        raise AssertionError("not used here")

    # journal, metrics
    def event(self, kind: str, doc: Doc) -> None:
        pass

    def task_started(self, pool: str, waited: float, tenant: str | None) -> None:
        pass

    def task_ended(self, pool: str, state: str, ran: float | None) -> None:
        pass

    def task_figures(self, pool: str, figures: w.Figures) -> None:
        pass

    # the Table
    def pool(self, name: Any) -> Pool | None:
        return self.pools.get(name)

    def replica(self, rid: str) -> Replica | None:
        return self.replicas.get(rid)

    def save_pool(self, pool: Pool) -> None:
        self.saved.append(pool.executor.stored() if pool.executor is not None else {})

    def proc_by_pid(self, pid: int) -> FakeProc | None:
        rep = self.connecting
        return self.procs[rep.id] if pid == os.getpid() and rep is not None else None

    def proc_of(self, rep: Replica) -> FakeProc | None:
        return self.procs.get(rep.id)

    def changed(self) -> None:
        pass

    def reply(self, reply: Reply, msg: Doc, durable: bool) -> None:
        reply(msg)

    def wait_for(self, ids: Any, until: str, reply: Reply, cmd_id: Any, timeout: float) -> Any:
        raise AssertionError("not used here")


class FakeWorker:
    """One worker: a socket of this process connected to the table's listener, its cancel
    words in a memfd it handed over with HELLO."""

    def __init__(self, h: Harness, rep: Replica, version: int) -> None:
        self.h, self.rep = h, rep
        fd = os.memfd_create("test-cancel-words", os.MFD_CLOEXEC)
        os.ftruncate(fd, w.WORD.size * w.WORDS)
        self.words = mmap.mmap(fd, w.WORD.size * w.WORDS)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5.0)  # every read of the loop's frames is bounded
        self.sock.connect("\0" + h.tasks.address[1:])
        self.frames = w.Frames()
        self.got: list[tuple[int, int, bytes]] = []
        h.engine.connecting = rep
        h.turn()  # accepted: it is a live replica of an executor pool
        socket.send_fds(self.sock, [w.frame(w.HELLO, os.getpid(), bytes([version]))], [fd])
        os.close(fd)
        h.turn()
        h.engine.connecting = None
        kinds = [k for k, _, _ in self.read(2 if version >= 2 else 1)]
        assert kinds == ([w.CONFIG, w.WELCOME] if version >= 2 else [w.WELCOME])

    def read(self, count: int) -> list[tuple[int, int, bytes]]:
        """The next ``count`` frames the loop sent (bounded: the socket's timeout)."""
        while len(self.got) < count:
            data = self.sock.recv(1 << 16)
            assert data, f"{self.rep.id}: the loop closed its connection"
            self.got.extend(self.frames.feed(data))
        out, self.got = self.got[:count], self.got[count:]
        return out

    def tasks_sent(self, count: int) -> list[int]:
        frames = self.read(count)
        assert all(k == w.TASK for k, _, _ in frames), frames
        return [n for _, n, _ in frames]

    def nothing_sent(self) -> bool:
        self.sock.setblocking(False)
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            data = b""
        finally:
            self.sock.settimeout(5.0)
        self.got.extend(self.frames.feed(data))
        return not self.got

    def word(self, slot: int) -> int:
        return int(w.WORD.unpack_from(self.words, slot * w.WORD.size)[0])

    def send(self, kind: int, number: int, payload: bytes = b"") -> None:
        self.sock.sendall(w.frame(kind, number, payload))
        self.h.turn()

    def die(self, code: int) -> None:
        """Its process exits with ``code``: the connection closes, the engine records the
        end and tells the table (engine._record_end)."""
        self.sock.close()
        self.rep.state, self.rep.exit_code, self.rep.reason = ReplicaState.FAILED, code, f"exit code {code}"
        self.h.pool.live.pop(self.rep.id, None)
        self.h.engine.procs[self.rep.id].reaped = True
        self.h.tasks.worker_ended(self.rep)
        self.h.turn()


class Harness:
    def __init__(self, *, options: Doc | None = None) -> None:
        self.engine = FakeEngine()
        self.tasks = TaskTable(self.engine, stop_reason="interrupted: the test stopped")
        self.commands = TaskCommands(self.tasks, self.engine)
        self.pool = Pool(POOL, None, desired=0)
        self.engine.pools[POOL] = self.pool
        self.tasks.listen()
        self.xp = self.tasks.adopt(self.pool, parse_options(options or {}), b"")
        self.heard: list[Event] = []
        self.session = self.tasks.open_session("s1", self.heard.extend)
        self.workers: list[FakeWorker] = []
        self.signalled: list[int] = []
        self.table_closed = False  # its fds are closed once only: another table may hold their numbers

    def turn(self) -> None:
        """One turn of the real reactor (no wait: what the workers sent is there already),
        and the turn its call_soon callbacks (a sink's delivery) asked for."""
        self.engine.reactor.run_once(0.0)
        self.engine.reactor.run_once(0.0)

    def advance(self, seconds: float) -> None:
        self.engine.now += seconds
        self.turn()

    def worker(self, *, version: int = 2, ready: bool = True) -> FakeWorker:
        n = len(self.workers) + 1
        rep = Replica(f"{POOL}-{n}", POOL, n, state=ReplicaState.RUNNING)
        self.engine.replicas[rep.id] = rep
        self.engine.procs[rep.id] = FakeProc(900_000 + n, rep)
        self.pool.live[rep.id] = rep
        worker = FakeWorker(self, rep, version)
        self.workers.append(worker)
        if ready:
            worker.send(w.READY, 0)
        return worker

    def submit(self, *, ref: Any = None, timeout: float | None = None, retries: int = 0) -> Task:
        n = len(self.tasks.live) + len(self.tasks.ended) + 1
        task = Task("", 0, self.xp, b"call %d" % n, ref if ref is not None else n, self.session, timeout, retries)
        self.tasks.submit(self.xp, task)
        self.turn()
        return task

    def kinds(self, ref: Any) -> list[str]:
        return [str(kind) for kind, r, _, _ in self.heard if r == ref]

    def close(self) -> None:
        if not self.table_closed:
            self.tasks.close()
        for worker in self.workers:
            worker.sock.close()
            worker.words.close()
        self.engine.reactor.close()


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []
    signalled: list[int] = []

    def to_child(pid: int, sig: int) -> bool:
        assert sig == w.CANCEL_SIGNAL
        signalled.append(pid)
        return True

    monkeypatch.setattr(signals, "to_child", to_child)  # the fake pids are no processes

    def factory(**kw: Any) -> Harness:
        h = Harness(**kw)
        h.signalled = signalled
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


# -- dispatch order -----------------------------------------------------------------------


def test_idle_workers_first_then_one_held_task_per_busy_worker(make: Callable[..., Harness]) -> None:
    h = make()
    w1, w2 = h.worker(), h.worker()
    t = [h.submit() for _ in range(5)]
    assert w1.tasks_sent(2) == [t[0].n, t[2].n]  # idle first: 1 and 2 to the two idle workers
    assert w2.tasks_sent(2) == [t[1].n, t[3].n]  # then one more each, held behind what runs
    assert [x.state for x in t] == [T.RUNNING, T.RUNNING, T.QUEUED, T.QUEUED, T.QUEUED]
    assert list(h.xp.queue) == [t[4]]
    assert h.commands.pool_counts(POOL) == {"queued": 3, "running": 2, "waiting": 0, "done": 0, "failed": 0, "cancelled": 0,
                                            "timed_out": 0, "lost": 0, "tenants": {"": {"queued": 3, "running": 2}}}
    assert h.kinds(t[0].ref) == []  # a lone start waits STARTED_HOLD for its task's end to come with it
    h.advance(STARTED_HOLD)
    assert h.kinds(t[0].ref) == ["started"] and h.kinds(t[2].ref) == []
    w1.send(w.RESULT, t[0].n, b"r1")
    assert t[0].state is T.DONE and t[2].state is T.RUNNING  # the held one started as its predecessor ended
    assert w1.tasks_sent(1) == [t[4].n]  # and the queued one is held behind it now
    assert h.kinds(t[0].ref) == ["started", "result"] and h.kinds(t[2].ref) == ["started"]
    assert [d for k, r, d, _ in h.heard if k == "result"] == [b"r1"]
    assert h.tasks.cancel(t[0]) is False and t[0].state is T.DONE  # its result stands


def test_a_held_task_is_asked_back_for_an_idle_worker(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    first, held = h.submit(), h.submit()
    assert w1.tasks_sent(2) == [first.n, held.n]
    assert w1.word(held.slot) == 0
    w2 = h.worker()  # idle now, while w1 holds a task it may not have begun
    assert w1.word(held.slot) == w.revoke_word(1) and h.signalled == [900_001]
    assert w2.nothing_sent()  # not before w1 said it had not started it
    w1.send(w.STOPPED, 1, bytes([w.REVOKE]))
    assert w2.tasks_sent(1) == [held.n] and held.state is T.RUNNING and held.worker_id == w2.rep.id
    assert w1.word(held.slot) == 0  # the ask's word cleared before that slot carries another task


def test_a_start_waits_briefly_for_its_end_one_hand_over_per_short_task(make: Callable[..., Harness]) -> None:
    h = make()
    handed: list[list[Any]] = []
    h.session.sink = handed.append  # each call is one wake-up of the submitter's collector
    w1 = h.worker()
    short, long = h.submit(), h.submit()
    assert w1.tasks_sent(2) == [short.n, long.n]
    assert handed == []  # the start alone is held
    w1.send(w.RESULT, short.n, b"r")  # within STARTED_HOLD: one hand-over, its end saying both
    assert [[(k, r) for k, r, _, _ in batch] for batch in handed] == [[("result", short.ref), ("started", long.ref)]]
    h.advance(STARTED_HOLD * 0.9)
    assert len(handed) == 1  # the next one's start was in it already: nothing more held
    w1.send(w.RESULT, long.n, b"r")
    assert [(k, r) for k, r, _, _ in handed[-1]] == [("result", long.ref)]
    slow = h.submit()
    assert w1.tasks_sent(1) == [slow.n] and len(handed) == 2
    h.advance(STARTED_HOLD * 0.9)
    assert len(handed) == 2
    h.advance(STARTED_HOLD * 0.2)  # a task that runs longer: its start is told STARTED_HOLD late at most
    assert [(k, r) for k, r, _, _ in handed[-1]] == [("started", slow.ref)]


def test_a_held_task_that_had_started_stays_with_its_worker(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    first, held = h.submit(), h.submit()
    w1.tasks_sent(2)
    w1.send(w.RESULT, first.n, b"")  # ended: the held one starts there...
    w2 = h.worker()
    assert held.state is T.RUNNING and held.worker_id == w1.rep.id and w2.nothing_sent()


def test_the_asked_worker_keeps_a_task_it_began(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    first, held = h.submit(), h.submit()
    w1.tasks_sent(2)
    w2 = h.worker()
    assert w1.word(held.slot) == w.revoke_word(1)
    w1.send(w.RESULT, first.n, b"")  # its result crossed the ask: the held one may have begun
    w1.send(w.KEPT, 1)
    assert held.state is T.RUNNING and held.worker_id == w1.rep.id and w2.nothing_sent()
    assert w1.word(held.slot) == 0


# -- the two cancel words -----------------------------------------------------------------


def test_each_task_a_worker_holds_has_its_own_cancel_word(make: Callable[..., Harness]) -> None:
    h = make(options={"grace": 3.0})
    w1 = h.worker()
    running, held = h.submit(), h.submit()
    w1.tasks_sent(2)
    assert {running.slot, held.slot} == {0, 1}
    assert h.tasks.cancel(held) is True
    h.turn()
    # The held one is marked in its own word; the running one's is untouched, and no
    # signal: the worker sees the word when it starts that task.
    assert w1.word(held.slot) == w.cancel_word(held.n, w.CANCEL) and w1.word(running.slot) == 0
    assert h.signalled == [] and held.state is T.CANCELLED
    assert h.kinds(held.ref) == ["cancelled"]
    assert h.tasks.cancel(running) is True
    assert w1.word(running.slot) == w.cancel_word(running.n, w.CANCEL) and h.signalled == [900_001]
    h.turn()
    assert h.kinds(running.ref) == ["started", TaskEvent.STOPPING, "cancelled"]
    h.advance(2.9)
    assert h.engine.killed == []
    w1.send(w.STOPPED, running.n, bytes([w.CANCEL]))  # it stopped on the exception, in time
    h.advance(1.0)
    assert h.engine.killed == [] and h.kinds(running.ref)[-1] == TaskEvent.STOPPED
    assert h.tasks.cancel(running) is True  # cancelled before: still so


def test_a_cancel_the_worker_does_not_answer_is_signalled_again_then_no_more(make: Callable[..., Harness]) -> None:
    """A cancel signal that lands just before the task's blocking call leaves its handler
    pending until the call returns (CPython's race): while the worker has not answered, the
    signal is sent again (50 ms, 250 ms, 1 s after the first), never once it has."""
    h = make(options={"grace": 3.0})
    w1 = h.worker()
    running = h.submit()
    w1.tasks_sent(1)
    assert h.tasks.cancel(running) is True and h.signalled == [900_001]
    h.advance(0.06)
    assert h.signalled == [900_001] * 2
    h.advance(0.25)
    assert h.signalled == [900_001] * 3
    h.advance(1.0)
    assert h.signalled == [900_001] * 4
    h.advance(1.0)
    assert h.signalled == [900_001] * 4  # three more at most, however long it takes
    w1.send(w.STOPPED, running.n, bytes([w.CANCEL]))
    h.turn()
    other = h.submit()
    w1.tasks_sent(1)
    assert h.tasks.cancel(other) is True and h.signalled == [900_001] * 5
    w1.send(w.STOPPED, other.n, bytes([w.CANCEL]))  # answered at once: not signalled again
    h.advance(2.0)
    assert h.signalled == [900_001] * 5


def test_a_timeout_writes_its_cause_and_the_tree_is_killed_after_the_grace(make: Callable[..., Harness]) -> None:
    h = make(options={"grace": 2.0})
    w1 = h.worker()
    task = h.submit(timeout=5.0)
    w1.tasks_sent(1)
    h.advance(4.9)
    assert task.state is T.RUNNING
    h.advance(0.2)
    assert state(task) is T.TIMED_OUT and w1.word(task.slot) == w.cancel_word(task.n, w.TIMEOUT)
    assert [d for k, r, d, _ in h.heard if k == "timeout"] == [[f"task {task.id} ran past its timeout of 5 s", 5.0]]
    h.advance(2.1)  # it did not answer within the grace
    assert h.engine.killed == [h.engine.procs[w1.rep.id].pid]
    assert h.engine.renewed == [(w1.rep.id, f"task {task.id} still ran 2 s after its timeout")]


# -- a worker's death ---------------------------------------------------------------------


def test_a_task_cut_short_by_its_workers_death_runs_again_while_retries_remain(make: Callable[..., Harness]) -> None:
    h = make()
    w1, w2 = h.worker(), h.worker()
    task = h.submit(retries=1)
    behind = [h.submit(), h.submit(), h.submit()]  # w2 runs one, each holds one
    assert w1.tasks_sent(2) == [task.n, behind[1].n]
    w2.tasks_sent(2)
    w1.die(3)
    # Retried first (the attempt counted), then the one it held but never began (no attempt).
    assert task.state is T.QUEUED and task.attempts == 1 and list(h.xp.queue)[:2] == [task, behind[1]]
    assert behind[1].attempts == 0 and behind[1].state is T.QUEUED
    w3 = h.worker()
    assert w3.tasks_sent(2) == [task.n, behind[1].n] and state(task) is T.RUNNING and task.attempts == 2
    w3.die(3)
    assert state(task) is T.FAILED and task.kind == "lost" and task.reason == "exited with 3"
    assert [d for k, r, d, _ in h.heard if r == task.ref and k == "lost"] == ["exited with 3"]


def test_a_result_a_dead_worker_sent_first_stands(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    task = h.submit(retries=3)
    w1.tasks_sent(1)
    w1.sock.sendall(w.frame(w.RESULT, task.n, b"done"))  # and then it died, before the loop read it
    w1.die(0)
    assert task.state is T.DONE and task.result == b"done" and task.attempts == 1


# -- a hopeless pool ----------------------------------------------------------------------


def test_a_pool_that_stopped_replacing_its_workers_fails_what_it_has_queued(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker(ready=False)
    w1.send(w.UNPICKLABLE, 0, b"ImportError: no module named app")  # its initializer failed
    queued = [h.submit(), h.submit()]
    h.tasks.settle()
    assert all(t.state is T.QUEUED for t in queued)  # its worker may still come up
    w1.die(1)
    h.pool.state, h.pool.reason = CRASHLOOP, "5 crashes in 60 s"
    h.tasks.settle()
    h.turn()
    why = f"executor pool {POOL} stopped replacing its workers: 5 crashes in 60 s (ImportError: no module named app)"
    assert [(t.state, t.kind, t.reason) for t in queued] == [(T.FAILED, "unrun", why)] * 2
    assert h.kinds(queued[0].ref) == ["unrun"]
    later = h.submit()  # and a task submitted to it now fails at once
    assert later.state is T.FAILED and later.kind == "unrun"


def test_a_stopping_daemon_keeps_its_queue_for_the_next_start(make: Callable[..., Harness]) -> None:
    h = make()
    task = h.submit()
    h.pool.state, h.pool.reason = CRASHLOOP, "crashed"
    h.engine.closing = True
    h.tasks.settle()
    assert task.state is T.QUEUED


# -- the backlog bounds -------------------------------------------------------------------


def test_a_session_that_does_not_poll_keeps_only_its_latest_events(make: Callable[..., Harness],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasktable, "SESSION_BACKLOG", 3)
    h = make()
    polling = h.tasks.open_session("poller", None)
    made = []
    for ref in range(5):
        task = Task("", 0, h.xp, b"x", ref, polling, None, 0)
        made.append(h.tasks.submit(h.xp, task))
    for task in made:
        h.tasks.cancel(task)
    assert [(seq, ev[0], ev[1]) for seq, ev in polling.events] == [(3, "cancelled", 2), (4, "cancelled", 3),
                                                                    (5, "cancelled", 4)]
    answers: list[Doc] = []
    got = h.tasks.poll(polling, 3, 1.0, answers.append, 7)  # what it read already is forgotten
    assert got == {"events": [["cancelled", 3, "cancelled", made[3].id], ["cancelled", 4, "cancelled", made[4].id]],
                   "next": 5}
    json.dumps(got)  # the channel's form


def test_a_sessions_held_results_are_bounded_in_bytes(make: Callable[..., Harness],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasktable, "SESSION_BACKLOG_BYTES", 20)
    h = make()
    polling = h.tasks.open_session("poller", None)
    w1 = h.worker()
    for ref in range(3):
        task = h.tasks.submit(h.xp, Task("", 0, h.xp, b"x", ref, polling, None, 0))
        h.turn()
        w1.tasks_sent(1)
        w1.send(w.RESULT, task.n, b"0123456789")  # 16 bytes of base64 each
    assert polling.held <= 20
    assert [ev[:2] for _, ev in polling.events] == [["started", 2], ["result", 2]]


def test_the_ended_tasks_kept_in_memory_are_bounded(make: Callable[..., Harness],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasktable, "KEEP_ENDED", 2)
    h = make()
    made = [h.submit() for _ in range(4)]
    for task in made:
        h.tasks.cancel(task)
    assert list(h.tasks.ended) == [made[2].id, made[3].id]
    assert h.tasks.task(made[0].id) is None and h.tasks.task(made[3].id) is made[3]


def test_a_poll_waits_for_an_event_and_expires_on_the_clock(make: Callable[..., Harness]) -> None:
    h = make()
    polling = h.tasks.open_session("poller", None)
    answers: list[Doc] = []
    assert h.tasks.poll(polling, 0, 2.0, answers.append, 1) is protocol.DEFERRED
    task = h.tasks.submit(h.xp, Task("", 0, h.xp, b"x", "a", polling, None, 0))
    h.tasks.cancel(task)
    h.turn()
    assert [a["result"]["events"] for a in answers] == [[["cancelled", "a", "cancelled", task.id]]]
    assert h.tasks.poll(polling, 1, 2.0, answers.append, 2) is protocol.DEFERRED
    h.advance(1.9)
    assert len(answers) == 1
    h.advance(0.2)
    assert answers[1]["result"] == {"events": [], "next": 1}


def test_a_poll_that_expires_in_the_turn_an_event_came_answers_with_it(make: Callable[..., Harness]) -> None:
    """The poll's timer and an event's timer (a waiting task's resume, a timeout) fall in one
    turn, the event's first: its flush is only due (call_soon) when the poll expires. The
    expired poll must carry it: answered empty with ``next`` past it, the client reading on
    from there would never see it (a future that stayed not running, in a daemon)."""
    h = make()
    polling = h.tasks.open_session("poller", None)
    answers: list[Doc] = []
    task = h.tasks.submit(h.xp, Task("", 0, h.xp, b"x", "a", polling, None, 0))  # no worker: it waits
    h.turn()
    assert h.tasks.poll(polling, 0, 1.0, answers.append, 1) is protocol.DEFERRED
    h.engine.reactor.call_later(0.999, lambda: h.tasks.cancel(task))
    h.advance(1.0)
    assert [a["result"] for a in answers] == [{"events": [["cancelled", "a", "cancelled", task.id]], "next": 1}]
    assert h.tasks.poll(polling, 1, 1.0, answers.append, 2) is protocol.DEFERRED  # nothing twice


# -- task numbers -------------------------------------------------------------------------


def test_granted_numbers_are_recorded_before_the_reply_and_a_restore_continues_after_them(
        make: Callable[..., Harness]) -> None:
    h = make()
    h.engine.saved.clear()
    assert h.tasks.grant(h.xp, 100) == [1, 100]
    assert h.engine.saved[-1]["next_task"] == 101  # in the turn's commit, before any reply
    assert h.tasks.give_back(h.xp, 51, 101) is True  # nothing handed out after it: taken back
    assert h.engine.saved[-1]["next_task"] == 51
    assert h.tasks.grant(h.xp, 10) == [51, 10]
    assert h.tasks.give_back(h.xp, 1, 51) is False  # not the latest block's end
    # A new start: the pool's row says 61; the store's tasks say less (pruned) or more.
    for numbers, expect in (({}, 61), ({POOL: 70}, 71)):
        engine = FakeEngine()
        pool = Pool(POOL, None, stored_executor=h.pool.executor.stored() if h.pool.executor is not None else None)
        engine.pools[POOL] = pool
        table = TaskTable(engine)
        TaskCarry(table, engine).restore([pool], FakeStore([], numbers))
        try:
            assert table.pools[POOL].next_n == expect
            assert table.grant(table.pools[POOL], 1) == [expect, 1]
        finally:
            table.close()
            engine.reactor.close()


def test_a_restore_requeues_or_loses_what_ran_and_keeps_the_queue(make: Callable[..., Harness]) -> None:
    h = make()
    engine = FakeEngine()
    pool = Pool(POOL, None, stored_executor=h.pool.executor.stored() if h.pool.executor is not None else None)
    engine.pools[POOL] = pool

    def row(n: int, state: T, retries: int, attempts: int) -> Doc:
        return {"id": f"{POOL}/{n}", "pool": POOL, "n": n, "payload": b"p", "timeout": None, "retries": retries,
                "state": state.value, "attempts": attempts, "worker": None, "queued_at": 1.0, "started_at": None}

    rows = [row(1, T.QUEUED, 0, 0), row(2, T.RUNNING, 1, 1), row(3, T.RUNNING, 1, 2), row(4, T.QUEUED, 0, 0)]
    table = TaskTable(engine)
    try:
        TaskCarry(table, engine).restore([pool], FakeStore(rows, {POOL: 4}))
        xp: ExecPool = table.pools[POOL]
        assert [t.id for t in xp.queue] == [f"{POOL}/2", f"{POOL}/1", f"{POOL}/4"]  # the retried one first
        lost = table.ended[f"{POOL}/3"]
        assert (lost.state, lost.reason) == (T.LOST, "the daemon died while it ran")
        assert xp.next_n == 5 and set(table.live) == {f"{POOL}/1", f"{POOL}/2", f"{POOL}/4"}
    finally:
        table.close()
        engine.reactor.close()


# -- the events' names --------------------------------------------------------------------


def test_task_events_keep_their_words_on_the_wire() -> None:
    assert [e.value for e in TaskEvent] == ["started", "waiting", "stopping", "stopped"]
    assert json.dumps([TaskEvent.STARTED, "r", None, "p/1"]) == '["started", "r", null, "p/1"]'
    assert json.loads('"stopping"') == TaskEvent.STOPPING  # what the executor compares a JSON event with


def test_a_session_dropped_has_its_poll_answered_and_its_tasks_run_on(make: Callable[..., Harness]) -> None:
    h = make()
    polling: Session = h.tasks.open_session("poller", None)
    answers: list[Doc] = []
    h.tasks.poll(polling, 0, 5.0, answers.append, 9)
    task = h.tasks.submit(h.xp, Task("", 0, h.xp, b"x", "a", polling, None, 0))
    h.tasks.drop_session(polling)
    assert answers == [{"id": 9, "ok": True, "result": {"events": [], "next": 0}}]
    assert "poller" not in h.tasks.sessions and task.session is None and task.state is T.QUEUED


# -- the commands, on the same fake -------------------------------------------------------


def test_a_batch_sent_again_is_the_same_tasks_not_a_second_run(make: Callable[..., Harness]) -> None:
    h = make()
    cmd = h.commands.commands()
    assert cmd["task_numbers"]({"pool": POOL, "count": 10}, lambda m: None, 1) == [1, 10]
    batch = {"pool": POOL, "session": "s1", "tasks": [{"payload": b"a", "n": 1, "ref": "a"},
                                                      {"payload": b"b", "n": 2, "ref": "b"}]}
    assert cmd["task_submit"](batch, lambda m: None, 2) == [f"{POOL}/1", f"{POOL}/2"]
    assert cmd["task_submit"]({**batch, "resend": True}, lambda m: None, 3) == [f"{POOL}/1", f"{POOL}/2"]
    assert list(h.tasks.live) == [f"{POOL}/1", f"{POOL}/2"] and len(h.xp.queue) == 2
    with pytest.raises(InvalidSpec, match="task number 11 was not handed out"):
        cmd["task_submit"]({"pool": POOL, "payload": b"c", "n": 11}, lambda m: None, 4)


def test_a_cancel_naming_an_id_never_handed_out_cancels_nothing(make: Callable[..., Harness]) -> None:
    h = make()
    task = h.submit()
    with pytest.raises(UnknownTask, match="unknown task"):
        h.commands.commands()["task_cancel"]({"ids": [task.id, f"{POOL}/99"]}, lambda m: None, 1)
    assert task.state is T.QUEUED
    assert h.commands.commands()["task_cancel"]({"ids": [task.id]}, lambda m: None, 2) == [True]
    assert state(task) is T.CANCELLED


def test_a_result_wait_is_answered_at_the_end_or_at_its_timeout(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    slow, other = h.submit(), h.submit()
    w1.tasks_sent(2)
    answers: list[Doc] = []
    result = h.commands.commands()["task_result"]
    assert result({"id": slow.id, "wait": True, "timeout": 10}, answers.append, 1) is protocol.DEFERRED
    assert result({"id": other.id, "wait": True, "timeout": 10}, answers.append, 2) is protocol.DEFERRED
    w1.send(w.RESULT, slow.n, b"v")
    assert [(a["id"], a["result"]["state"], a["result"]["result"]) for a in answers] == [(1, "DONE", "dg==")]
    h.advance(10.1)
    assert [(a["id"], a["result"]["state"]) for a in answers[1:]] == [(2, "RUNNING")]


# -- an upgrade's hand-over, both images in this process ----------------------------------


def hand_over(h: Harness, *, later: float = 0.0) -> tuple[FakeEngine, TaskTable]:
    """What ``h``'s table carries (through JSON, as it crosses the exec), taken over by a
    new table on a new engine ``later`` seconds on; ``h``'s table is closed. The exec keeps
    the fds' numbers; here the next image gets copies, as the first image's own close as its
    process would end."""
    doc = json.loads(json.dumps(TaskCarry(h.tasks, h.engine).carried()))
    for item in doc["workers"]:
        for key in ("sock", "out", "word"):
            item[key] = os.dup(item[key])
    doc["listener"] = os.dup(doc["listener"])
    h.tasks.close()
    h.table_closed = True
    engine = FakeEngine()
    engine.now = h.engine.now + later  # one host, one monotonic clock
    engine.replicas, engine.procs = h.engine.replicas, h.engine.procs
    engine.pools[POOL] = Pool(POOL, None, stored_executor=h.pool.executor.stored() if h.pool.executor is not None else None, live=dict(h.pool.live))
    table = TaskTable(engine)
    TaskCarry(table, engine).take_over(doc)
    return engine, table


def test_the_next_image_goes_on_with_the_workers_and_tasks_the_first_handed_over(
        make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    running, held = h.submit(timeout=30.0), h.submit()
    w1.tasks_sent(2)
    h.tasks.grant(h.xp, 5)
    engine, table = hand_over(h, later=10.0)
    try:
        xp = table.pools[POOL]
        after, behind = table.live[running.id], table.live[held.id]
        assert (after.state, behind.state, xp.next_n) == (T.RUNNING, T.QUEUED, held.n + 6)
        assert [t.id for t in xp.workers[w1.rep.id].tasks] == [running.id, held.id]
        w1.sock.sendall(w.frame(w.RESULT, running.n, b"v"))
        engine.reactor.run_once(0.0)
        assert (after.state, after.result, behind.state) == (T.DONE, b"v", T.RUNNING)
        engine.now += 30.0  # the first's timeout, carried, went with its end: nothing times out
        engine.reactor.run_once(0.0)
        assert behind.state is T.RUNNING and w1.nothing_sent()
        assert table.cancel(behind) and w1.word(behind.slot) == w.cancel_word(behind.n, w.CANCEL)
    finally:
        table.close()
        engine.reactor.close()


def test_a_running_tasks_timeout_goes_on_across_the_hand_over(make: Callable[..., Harness]) -> None:
    h = make()
    w1 = h.worker()
    task = h.submit(timeout=30.0)
    w1.tasks_sent(1)
    h.advance(20.0)
    engine, table = hand_over(h)
    try:
        after = table.live[task.id]
        engine.now += 9.9
        engine.reactor.run_once(0.0)
        assert after.state is T.RUNNING
        engine.now += 0.2  # 30 s after it started, not 30 s after the hand-over
        engine.reactor.run_once(0.0)
        assert state(after) is T.TIMED_OUT and w1.word(after.slot) == w.cancel_word(task.n, w.TIMEOUT)
    finally:
        table.close()
        engine.reactor.close()


# -- a cancel by id of a task whose submit has not arrived ----------------------------------


def test_a_cancel_by_id_of_a_granted_number_not_arrived_lands_at_once_and_it_never_runs(
        make: Callable[..., Harness]) -> None:
    h = make()
    cmd = h.commands.commands()
    polling = h.tasks.open_session("s2", None)
    first, count = cmd["task_numbers"]({"pool": POOL, "session": "s2", "count": 4}, lambda m: None, 1)
    on_way, other = f"{POOL}/{first}", f"{POOL}/{first + 1}"
    # Known at once as on its way: QUEUED, not an unknown task; an id never granted is unknown at once.
    (row,) = cmd["tasks"]({"id": on_way}, lambda m: None, 2)
    assert (row["state"], row["waiting"]) == ("QUEUED", "its submit has not arrived yet")
    with pytest.raises(UnknownTask, match="unknown task"):
        cmd["task_cancel"]({"ids": [f"{POOL}/{first + count}"]}, lambda m: None, 3)
    waits: list[Doc] = []
    assert cmd["task_result"]({"id": on_way, "wait": True, "timeout": 30}, waits.append, 4) is protocol.DEFERRED
    assert cmd["task_cancel"]({"ids": [on_way]}, lambda m: None, 5) == [True]
    assert [(m["id"], m["result"]["state"]) for m in waits] == [(4, "CANCELLED")]  # the wait, answered
    assert cmd["task_result"]({"id": on_way}, lambda m: None, 6)["state"] == "CANCELLED"
    assert cmd["task_cancel"]({"ids": [on_way]}, lambda m: None, 7) == [True]  # again: as a cancelled task's
    w1 = h.worker()
    batch = {"pool": POOL, "session": "s2", "tasks": [{"payload": b"a", "n": first, "ref": "a"},
                                                      {"payload": b"b", "n": first + 1, "ref": "b"}]}
    assert cmd["task_submit"](batch, lambda m: None, 8) == [on_way, other]
    h.turn()
    assert w1.tasks_sent(1) == [first + 1] and w1.nothing_sent()  # the cancelled one is never sent
    assert [ev[:2] for _, ev in polling.events if ev[1] == "a"] == [["cancelled", "a"]]  # its future: cancelled
    cancelled = h.tasks.task(on_way)
    assert cancelled is not None and cancelled.state is T.CANCELLED and cancelled.attempts == 0
    assert h.tasks.granted_to(on_way) is None and h.tasks.granted_to(other) is None
    assert h.tasks.granted_to(f"{POOL}/{first + 2}") is polling  # the rest still on its way


def test_a_result_wait_on_a_number_not_arrived_follows_its_task_once_it_comes(make: Callable[..., Harness]) -> None:
    h = make()
    cmd = h.commands.commands()
    h.tasks.open_session("s2", None)
    first, _ = cmd["task_numbers"]({"pool": POOL, "session": "s2", "count": 2}, lambda m: None, 1)
    task_id = f"{POOL}/{first}"
    waits: list[Doc] = []
    cmd["task_result"]({"id": task_id, "wait": True, "timeout": 10}, waits.append, 2)
    h.advance(4.0)
    w1 = h.worker()
    cmd["task_submit"]({"pool": POOL, "session": "s2", "tasks": [{"payload": b"a", "n": first, "ref": "a"}]},
                       lambda m: None, 3)
    h.turn()
    assert w1.tasks_sent(1) == [first] and waits == []
    w1.send(w.RESULT, first, b"v")
    assert [(m["id"], m["result"]["state"], m["result"]["result"]) for m in waits] == [(2, "DONE", "dg==")]
    # One that never comes: its state at the wait's timeout, and an error once its session ends.
    cmd["task_result"]({"id": f"{POOL}/{first + 1}", "wait": True, "timeout": 5}, waits.append, 4)
    cmd["task_result"]({"id": f"{POOL}/{first + 1}", "wait": True, "timeout": 50}, waits.append, 5)
    h.advance(5.1)
    assert (waits[1]["id"], waits[1]["result"]["state"]) == (4, "QUEUED")
    h.tasks.drop_session(h.tasks.sessions["s2"])
    assert (waits[2]["id"], waits[2]["ok"]) == (5, False) and "its session ended" in waits[2]["error"]


def test_a_sessions_numbers_on_their_way_are_ranges_freed_when_it_ends(make: Callable[..., Harness]) -> None:
    h = make()
    cmd = h.commands.commands()
    session = h.tasks.open_session("s2", None)
    block = cmd["task_numbers"]({"pool": POOL, "session": "s2", "count": 1 << 20}, lambda m: None, 1)
    first, end = block[0], block[0] + block[1]
    spare = cmd["task_numbers"]({"pool": POOL, "session": "s2", "count": 16}, lambda m: None, 2)
    assert session.granted[POOL].ranges == [[first, end + 16]]  # a million numbers: one range
    h.tasks.expect(h.xp, session, first + 10, first + 20)  # inside it: nothing new
    assert session.granted[POOL].ranges == [[first, end + 16]]
    for n in (first, first + 1, first + 5):  # in order, then one out of order: a split
        h.tasks.arrived(h.xp, session, n)
    assert session.granted[POOL].ranges == [[first + 2, first + 5], [first + 6, end + 16]]
    cmd["task_numbers"]({"pool": POOL, "session": "s2", "give_back": [spare[0], spare[0] + 16]}, lambda m: None, 3)
    assert session.granted[POOL].ranges == [[first + 2, first + 5], [first + 6, end]]
    assert cmd["task_cancel"]({"ids": [f"{POOL}/{first + 3}"]}, lambda m: None, 4) == [True]
    assert list(session.early) == [f"{POOL}/{first + 3}"]
    cmd["executor_close"]({"pool": POOL, "session": "s2"}, lambda m: None, 5)
    assert not session.granted and not session.early  # its ranges freed, the cancel waiting for it forgotten
    with pytest.raises(UnknownTask, match="never submitted"):  # no session has it on its way: unknown at once
        cmd["tasks"]({"id": f"{POOL}/{first + 4}"}, lambda m: None, 6)
    assert cmd["task_cancel"]({"ids": [f"{POOL}/{first + 3}"]}, lambda m: None, 7) == [True]  # its record stays


def test_numbers_on_their_way_and_their_cancels_cross_an_upgrade(make: Callable[..., Harness]) -> None:
    h = make()
    cmd = h.commands.commands()
    h.tasks.open_session("s2", None)
    first, _ = cmd["task_numbers"]({"pool": POOL, "session": "s2", "count": 3}, lambda m: None, 1)
    cmd["task_cancel"]({"ids": [f"{POOL}/{first}"]}, lambda m: None, 2)
    engine, table = hand_over(h)
    try:
        session = table.sessions["s2"]
        assert table.granted_to(f"{POOL}/{first + 1}") is session and table.granted_to(f"{POOL}/{first + 3}") is None
        commands = TaskCommands(table, engine).commands()
        got = commands["task_submit"]({"pool": POOL, "session": "s2",
                                       "tasks": [{"payload": b"a", "n": first, "ref": "a"}]}, lambda m: None, 3)
        assert got == [f"{POOL}/{first}"] and not table.live  # that task, cancelled: nothing queued
        assert [ev[:2] for _, ev in session.events] == [["cancelled", "a"]]
        assert commands["task_cancel"]({"ids": [f"{POOL}/{first + 2}"]}, lambda m: None, 4) == [True]
    finally:
        table.close()
        engine.reactor.close()


def test_a_session_back_after_a_restart_has_its_numbers_on_their_way_again(make: Callable[..., Harness]) -> None:
    """A client that registers again (``executor`` with ``rejoin``) names the numbers it
    still has to send: a cancel by id of one lands at once; numbers never handed out do not count."""
    h = make()
    h.tasks.grant(h.xp, 40)  # handed out before the restart (the pool's row says so)
    session = h.tasks.open_session("back", None)
    for first, end in ([30, 41], [12, 13], [35, 99]):
        h.tasks.expect(h.xp, session, first, end)
    assert session.granted[POOL].ranges == [[12, 13], [30, 41]]  # overlaps merged, clipped at 41
    assert h.tasks.granted_to(f"{POOL}/12") is session and h.tasks.granted_to(f"{POOL}/41") is None
    cmd = h.commands.commands()
    assert cmd["task_cancel"]({"ids": [f"{POOL}/12"]}, lambda m: None, 1) == [True]
    cmd["task_submit"]({"pool": POOL, "session": "back", "resend": True,
                        "tasks": [{"payload": b"a", "n": 12, "ref": "a"}]}, lambda m: None, 2)
    assert not h.tasks.live and [ev[:2] for _, ev in session.events] == [["cancelled", "a"]]


def test_numbers_on_their_way_as_ranges_are_the_numbers_granted_less_those_arrived() -> None:
    import random

    from orchestrator.daemon.taskrecords import Unarrived

    rng = random.Random(31)
    for _ in range(500):
        on_way, want = Unarrived(), set()
        for _ in range(rng.randint(1, 6)):
            first = rng.randint(1, 40)
            end = first + rng.randint(1, 10)
            on_way.add(first, end)
            want |= set(range(first, end))
        for n in rng.sample(range(1, 60), 20):
            assert on_way.take(n) == (n in want)
            want.discard(n)
            assert {n for a, b in on_way.ranges for n in range(a, b)} == want
            assert all(a[1] < b[0] for a, b in zip(on_way.ranges, on_way.ranges[1:]))  # apart, in order
