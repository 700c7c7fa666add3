"""Elastic executor pools (daemon/elastic.py) on the fake task table of
test_tasktable_fake.py: the real reactor on a fake clock, socket "workers" speaking the
wire, and a fake supervisor that records what the table asks of it (``grow``,
``retire``). A worker's memory is its "cgroup"'s ``memory.current``, a file the test
writes.

What it shows: a pool grows on demand up to max_workers and no busy worker holds a task
while it does; a memory budget holds growth back (the reason shown) until there is room;
an idle worker retires after idle_timeout on the fake clock, never below min_workers and
never one that runs or holds a task, and a worker being stopped is sent nothing; a fixed
pool is untouched; bad values are refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from orchestrator import signals
from orchestrator import taskwire as w
from orchestrator.daemon.config import ConfigError, parse
from orchestrator.daemon.elastic import BUDGET_RECHECK
from orchestrator.daemon.pools import Pool
from orchestrator.daemon.taskcarry import TaskCarry
from orchestrator.daemon.tasktable import TaskTable
from orchestrator.daemon.taskrecords import Doc, parse_options
from orchestrator.errors import InvalidSpec
from orchestrator.states import Replica, ReplicaState
from orchestrator.states import TaskState as T

import test_tasktable_fake as fake
from test_tasktable_fake import POOL, FakeEngine, FakeWorker, Harness

MiB = 1 << 20


class SizingEngine(FakeEngine):
    """The fake engine, and a supervisor that sizes pools as supervision.Supervisor does
    (through the Pool's methods), recording each ask."""

    def __init__(self) -> None:
        super().__init__()
        self.grown: list[int] = []
        self.retired: list[str] = []

    def grow(self, pool: Pool, count: int) -> list[str]:
        self.grown.append(count)
        pool.grow(count)
        return [f"{pool.name}-new{len(self.grown)}"]

    def retire(self, rep: Replica, reason: str) -> bool:
        self.retired.append(rep.id)
        rep.state = ReplicaState.STOPPING  # engine.stop: the stop signal is on its way
        pool = self.pools[rep.pool]
        pool.lower()
        return True


class ElasticHarness(Harness):
    engine: SizingEngine

    def __init__(self, *, options: Doc | None = None, size: int = 1) -> None:
        super().__init__(options=options)  # its engine a SizingEngine (the fixture)
        self.pool.scale_to(size)  # what the supervisor opened it with (min_workers)


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., ElasticHarness]]:
    made: list[ElasticHarness] = []
    monkeypatch.setattr(signals, "to_child", lambda pid, sig: True)  # the fake pids are no processes
    monkeypatch.setattr(fake, "FakeEngine", SizingEngine)  # the harness makes this engine

    def factory(**kw: Any) -> ElasticHarness:
        h = ElasticHarness(**kw)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


def elastic(low: int, high: int, **more: Any) -> Doc:
    return {"min_workers": low, "max_workers": high, **more}


def memory(h: ElasticHarness, worker: FakeWorker, tmp: Path, used: int) -> None:
    """``worker``'s cgroup holds ``used`` bytes (its memory.current)."""
    group = tmp / worker.rep.id
    group.mkdir(exist_ok=True)
    (group / "memory.current").write_text(f"{used}\n")
    h.engine.procs[worker.rep.id].cgroup = str(group)


def test_a_pool_grows_on_demand_up_to_max_workers_holding_nothing_meanwhile(make: Callable[..., ElasticHarness]
                                                                              ) -> None:
    h = make(options=elastic(1, 3), size=1)
    w1 = h.worker()
    t1, t2 = h.submit(), h.submit()
    assert w1.tasks_sent(1) == [t1.n] and w1.nothing_sent()  # t2 is the new worker's, not held behind t1
    assert h.engine.grown == [1] and h.pool.desired == 2
    assert h.tasks.waiting(t2) == "worker starting"
    t3, t4 = h.submit(), h.submit()
    assert h.engine.grown == [1, 1] and h.pool.desired == 3  # one per task no starting worker takes...
    assert h.tasks.waiting(t4) == "2 workers starting"
    t5 = h.submit()
    assert h.engine.grown == [1, 1] and h.pool.desired == 3  # ...and never past max_workers
    w2 = h.worker()
    assert w2.tasks_sent(1) == [t2.n] and state(t2) is T.RUNNING
    w3 = h.worker()
    assert w3.tasks_sent(1) == [t3.n]
    # At max_workers with none starting: busy workers hold the next task again (throughput).
    assert w1.tasks_sent(1) == [t4.n] and w2.tasks_sent(1) == [t5.n]
    t6, t7 = h.submit(), h.submit()
    assert w3.tasks_sent(1) == [t6.n] and h.engine.grown == [1, 1]
    assert h.tasks.waiting(t4) == "held by px-1, behind the task it runs"
    assert h.tasks.waiting(t7) == "all 3 workers busy (at max_workers 3)"
    assert h.tasks.workers(h.xp) == {"busy": 3, "idle": 0, "starting": 0, "min": 1, "max": 3}
    rows: list[Doc] = []
    listed = h.commands.commands()["tasks"]({}, rows.append, 1)
    assert {r["id"]: r["waiting"] for r in listed} == {
        t1.id: None, t2.id: None, t3.id: None, t4.id: "held by px-1, behind the task it runs",
        t5.id: "held by px-2, behind the task it runs", t6.id: "held by px-3, behind the task it runs",
        t7.id: "all 3 workers busy (at max_workers 3)"}


def state(task: Any) -> T:
    return task.state  # type: ignore[no-any-return]


def test_no_worker_starts_at_the_memory_budget_until_there_is_room(make: Callable[..., ElasticHarness],
                                                                     tmp_path: Path) -> None:
    h = make(options=elastic(1, 3, memory_budget=100 * MiB), size=1)
    w1 = h.worker()
    memory(h, w1, tmp_path, 60 * MiB)
    t1, t2 = h.submit(), h.submit()
    assert w1.tasks_sent(1) == [t1.n]
    # 60 MiB held, and a new worker may come to hold as much as the largest: 120 > 100.
    assert h.engine.grown == []
    assert h.tasks.waiting(t2) == "memory budget 100 MiB reached (60 MiB used)"
    assert h.tasks.workers(h.xp)["budget"] == {"used": 60 * MiB, "limit": 100 * MiB}
    h.advance(BUDGET_RECHECK * 3)
    assert h.engine.grown == [] and state(t2) is T.QUEUED  # looked at again: still no room
    memory(h, w1, tmp_path, 30 * MiB)  # the task freed what it had allocated
    h.advance(BUDGET_RECHECK)
    assert h.engine.grown == [1]  # 30 + 30 fits
    assert h.tasks.waiting(t2) == "worker starting"


def test_the_budget_counts_starting_workers_at_the_largest_share(make: Callable[..., ElasticHarness],
                                                                   tmp_path: Path) -> None:
    h = make(options=elastic(1, 4, memory_budget=100 * MiB), size=1)
    w1 = h.worker()
    memory(h, w1, tmp_path, 30 * MiB)
    tasks = [h.submit() for _ in range(4)]
    assert w1.tasks_sent(1) == [tasks[0].n]
    assert h.engine.grown == [1, 1]  # 30 held, 2 x 30 starting: a third would make 120
    assert h.tasks.waiting(tasks[3]) == "2 workers starting; memory budget 100 MiB reached (30 MiB used)"


def test_a_replacement_never_starts_at_the_budget(make: Callable[..., ElasticHarness], tmp_path: Path) -> None:
    """Not only a grow: any start of a worker (here the supervisor's replacement of one that
    died) is asked of start_held first, which spawning.py does for every start."""
    h = make(options=elastic(1, 2, memory_budget=100 * MiB), size=2)
    w1, w2 = h.worker(), h.worker()
    memory(h, w1, tmp_path, 60 * MiB)
    memory(h, w2, tmp_path, 20 * MiB)
    t1, t2 = h.submit(), h.submit()
    assert w1.tasks_sent(1) == [t1.n] and w2.tasks_sent(1) == [t2.n]
    w2.die(-9)
    assert state(t2) is T.FAILED
    h.advance(1.0)  # the 20 MiB it held are no longer measured
    spare = Replica(f"{POOL}-3", POOL, 3)  # PENDING, as the supervisor's replacement is launched
    h.pool.add(spare)
    t3 = h.submit()
    assert h.tasks.start_held(spare, 0) == "memory budget 100 MiB reached (60 MiB used)"  # 60 + 60 > 100
    assert h.tasks.waiting(t3) == "memory budget 100 MiB reached (60 MiB used)"  # not "worker starting"
    assert h.tasks.workers(h.xp)["budget"] == {"used": 60 * MiB, "limit": 100 * MiB, "held": 1}
    assert h.engine.grown == []  # nor does the pool grow around it (at max_workers anyway)
    memory(h, w1, tmp_path, 30 * MiB)
    h.advance(BUDGET_RECHECK)
    assert h.tasks.start_held(spare, 0) is None  # 30 + 30 fits: it starts
    assert h.tasks.workers(h.xp)["budget"] == {"used": 30 * MiB, "limit": 100 * MiB}
    # Those started in spawning's batch, and those started but not READY, count at the
    # largest share: 30 held + 2 x 30 fits in 100, a third would not.
    more = [Replica(f"{POOL}-{n}", POOL, n) for n in (4, 5)]
    for rep in more:
        h.pool.add(rep)
    assert h.tasks.start_held(more[0], 1) is None
    spare.state = ReplicaState.STARTING
    assert h.tasks.start_held(more[0], 1) == "memory budget 100 MiB reached (30 MiB used)"
    assert h.tasks.start_held(more[1], 0) is None  # spare starting, this one: 30 + 60


def test_an_idle_worker_retires_after_idle_timeout_never_below_min_workers(make: Callable[..., ElasticHarness]
                                                                            ) -> None:
    h = make(options=elastic(1, 3, idle_timeout=5), size=2)
    w1, w2 = h.worker(), h.worker()
    h.advance(4.9)
    assert h.engine.retired == []
    h.advance(0.2)
    assert h.engine.retired == ["px-1"] and h.pool.desired == 1  # the other is the pool's floor
    h.advance(60)
    assert h.engine.retired == ["px-1"]
    # The one being stopped is never sent a task: the next goes to the one that stays.
    t = h.submit()
    assert w2.tasks_sent(1) == [t.n] and w1.nothing_sent()


def test_a_busy_worker_never_retires(make: Callable[..., ElasticHarness]) -> None:
    h = make(options=elastic(1, 2, idle_timeout=5), size=2)
    w1, w2 = h.worker(), h.worker()
    h.advance(3)
    t = h.submit()
    assert w1.tasks_sent(1) == [t.n]  # its idle clock stops
    h.advance(2.1)
    assert h.engine.retired == ["px-2"]  # idle 5 s: retired; px-1 runs a task
    h.advance(30)
    assert h.engine.retired == ["px-2"] and state(t) is T.RUNNING
    w1.send(w.RESULT, t.n, b"r")
    h.advance(5.1)
    assert h.engine.retired == ["px-2"] and h.pool.desired == 1  # idle again, but min_workers 1
    assert h.tasks.workers(h.xp) == {"busy": 0, "idle": 1, "starting": 0, "min": 1, "max": 2}


def test_a_fixed_pool_neither_grows_nor_retires(make: Callable[..., ElasticHarness]) -> None:
    h = make(options={"min_workers": 2, "max_workers": 2}, size=1)  # min = max: fixed
    assert "min_workers" not in h.xp.options  # stored exactly as a fixed pool's
    w1 = h.worker()
    t1, t2, t3 = h.submit(), h.submit(), h.submit()
    assert w1.tasks_sent(2) == [t1.n, t2.n]  # held behind the one it runs, as ever
    assert h.engine.grown == []
    assert h.tasks.waiting(t3) == "its one worker busy"
    h.advance(600)
    assert h.engine.retired == []


@pytest.mark.parametrize(("options", "error"), [
    (elastic(3, 2), "min_workers 3 is above max_workers 2"),
    ({"min_workers": 1}, "min_workers needs max_workers"),
    (elastic(-1, 2), "min_workers must be a whole number of at least 0"),
    (elastic(1, 2, idle_timeout=0), "idle_timeout must be more than 0 seconds"),
    ({"memory_budget": 64 * MiB}, "memory_budget bounds the workers an elastic pool starts"),
    (elastic(1, 2, memory_budget=64 * MiB, memory_max=128 * MiB), "is below one worker's memory_max 128 MiB"),
    (elastic(1, 2, memory_budget=1000), "memory_budget must be a number of bytes of at least 1 MiB"),
])
def test_bad_elastic_values_are_refused_in_one_line(options: Doc, error: str) -> None:
    with pytest.raises(InvalidSpec, match=error) as err:
        parse_options(options)
    assert "\n" not in str(err.value)


def test_elastic_options_filled_and_kept() -> None:
    got = parse_options(elastic(0, 4, memory_budget=256 * MiB))
    assert got["min_workers"] == 0 and got["max_workers"] == 4 and got["idle_timeout"] == 60.0
    assert got["memory_budget"] == 256 * MiB
    assert parse_options(got) == got  # as the pool's row stores them, read back at a restart


def test_a_config_files_elastic_executor_pool() -> None:
    text = """
[pools.tasks]
kind = "executor"
size = 4
min_workers = 1
idle_timeout = 30
memory_budget = "512M"
"""
    decl = parse(text, "orchestrator.toml").pools["tasks"]
    assert decl.size == 4
    assert decl.executor == {"grace": 5.0, "retries": 0, "min_workers": 1, "max_workers": 4, "idle_timeout": 30.0,
                             "memory_budget": 512 * MiB}
    with pytest.raises(ConfigError, match=r"orchestrator.toml:\d+: pools.tasks.min_workers: .*above max_workers 4"):
        parse(text.replace("min_workers = 1", "min_workers = 5"), "orchestrator.toml")


def test_an_elastic_pools_options_and_idle_clocks_carry_across_restart_and_upgrade(
        make: Callable[..., ElasticHarness]) -> None:
    h = make(options=elastic(1, 3, idle_timeout=5, memory_budget=64 * MiB), size=2)
    h.worker(), h.worker()
    stored = h.pool.executor.stored() if h.pool.executor is not None else None
    # A restart: the pool's row gives the options back.
    engine = SizingEngine()
    pool = Pool(POOL, None, stored_executor=stored)
    engine.pools[POOL] = pool
    table = TaskTable(engine)
    try:
        TaskCarry(table, engine).restore([pool], None)
        xp = table.pools[POOL]
        assert (xp.elastic, xp.min_workers, xp.max_workers, xp.idle_timeout, xp.memory_budget) == (
            True, 1, 3, 5.0, 64 * MiB)
    finally:
        table.close()
        engine.reactor.close()
    # An upgrade: the workers' idle clocks start again in the next image.
    h.advance(3)
    engine, table = fake.hand_over(h)
    assert isinstance(engine, SizingEngine)
    try:
        engine.pools[POOL].scale_to(2)  # the pool's size, carried by handover.py (Pool.carried)
        assert table.pools[POOL].elastic
        engine.now += 4.9
        engine.reactor.run_once(0.0)
        assert engine.retired == []
        engine.now += 0.2
        engine.reactor.run_once(0.0)
        assert engine.retired == ["px-1"] and engine.pools[POOL].desired == 1
    finally:
        table.close()
        engine.reactor.close()
