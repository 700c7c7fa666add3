"""Per-task figures: each ended task's wall time, CPU time (user + system, its children's
included) and its own peak RSS, measured in its worker (orchestrator/taskmeter.py), sent with
its answer (a FIGURES frame), kept in its record (``fut.info()``, ``Client(DIR).task(ID).info()``,
``tasks --json``, the store across a restart) and in per-pool histograms of the metrics.

Both modes end to end (a 200 MB task and a small one on one worker, each with its own
peak; a child's CPU and a daemonized grandchild's; wall time; a cancelled task's figures
after its worker stopped it), the daemon's metrics and its store, the meter alone (the
kernel's figure an exec leaves in ``ru_maxrss``), the table on the fake (the frame taken for
the task its worker runs, and saved again for one that ended first), a store of version 2.
"""

from __future__ import annotations

import functools
import json
import pickle
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

import figurefns
from helpers import DaemonUnderTest, cli, cli_json, wait_for
from orchestrator import Client, Executor, UnknownTask
from orchestrator import taskwire as w
from orchestrator.daemon import metrics as metrics_mod
from orchestrator.daemon import taskfigures
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.taskrecords import Task
from orchestrator.states import TaskState as T
from orchestrator.store import SCHEMA_VERSION, Store
from test_executor import MakeExecutor, make_executor  # noqa: F401  (the fixture)
from test_tasktable_fake import POOL, Harness, make  # noqa: F401  (the fixture)

MiB = 1 << 20
Make = Callable[..., Executor]


@pytest.fixture(params=["embedded", "daemon"])
def executor(request: pytest.FixtureRequest, make_executor: MakeExecutor) -> Make:  # noqa: F811
    """Executors of either mode: embedded, or a pool of a daemon of this test's own."""
    if request.param == "embedded":
        return make_executor
    daemon: DaemonUnderTest = request.getfixturevalue("daemon")
    daemon.start()
    return functools.partial(make_executor, state_dir=str(daemon.state_dir), pool="figs")


def figures(fut: Any) -> w.Figures:
    got = fut.info()["figures"]
    assert got is not None, fut.info()
    return got  # type: ignore[no-any-return]


# -- end to end, both modes ---------------------------------------------------------------


def test_a_200_mb_task_then_a_small_one_on_one_worker_each_with_its_own_peak(executor: Make) -> None:
    ex = executor(max_workers=1)
    big = ex.submit(figurefns.touch, 200)
    small = ex.submit(figurefns.small)
    assert big.result(timeout=60) == small.result(timeout=60)  # one worker ran both
    assert big.info()["last_worker"] == small.info()["last_worker"]
    peak_big, peak_small = figures(big)["peak_rss"], figures(small)["peak_rss"]
    assert peak_big is not None and peak_small is not None
    assert peak_big >= 200 * MiB, peak_big
    # The worker's lifetime peak is above 200 MiB: the small task's is its own, an idle
    # Python worker's size (~15-25 MiB), far below.
    assert peak_small < 100 * MiB and peak_small < peak_big / 4, (peak_small, peak_big)


def test_cpu_time_includes_a_childs_and_a_daemonized_grandchilds(executor: Make, tmp_path: Path) -> None:
    ex = executor(max_workers=1)
    child = ex.submit(figurefns.child_burns, 0.5)
    spent = child.result(timeout=120)
    assert spent >= 0.5
    # The worker itself only waited: without the child's time the figure would be ~0.
    assert figures(child)["cpu"] >= spent, (figures(child), spent)
    assert figures(child)["children_peak_rss"] is not None  # the first child the worker reaped
    orphan = ex.submit(figurefns.orphan_burns, 0.5, str(tmp_path / "orphan-done"))
    spent = orphan.result(timeout=120)
    assert figures(orphan)["cpu"] >= spent, (figures(orphan), spent)


def test_what_the_initializers_children_took_is_no_tasks(executor: Make) -> None:
    ex = executor(max_workers=1, initializer=figurefns.child_burns, initargs=(0.5,))
    fut = ex.submit(figurefns.small)
    fut.result(timeout=120)
    assert figures(fut)["cpu"] < 0.25, figures(fut)  # the initializer's child burned 0.5 s


def test_wall_time_is_the_tasks_own(executor: Make) -> None:
    ex = executor(max_workers=1)
    fut = ex.submit(figurefns.sleeps, 0.3)
    fut.result(timeout=60)
    got = figures(fut)
    assert 0.3 <= got["wall"] < 10, got
    assert got["cpu"] < 0.2, got  # it slept: its CPU time is not its wall time
    tiny = ex.submit(figurefns.small)
    tiny.result(timeout=60)
    assert 0 < figures(tiny)["wall"] < 0.3, figures(tiny)


def test_a_task_cancelled_while_it_runs_has_its_figures_once_its_worker_stopped(executor: Make,
                                                                              tmp_path: Path) -> None:
    ex = executor(max_workers=1)
    started = tmp_path / "started"
    fut = ex.submit(figurefns.held, str(started), 60.0)
    wait_for(started.exists, 60, "the task to start")
    assert fut.cancel()
    assert fut.wait_stopped(timeout=60)
    info = fut.info()
    assert info["state"] == T.CANCELLED.value
    assert info["figures"] is not None and 0 < info["figures"]["wall"] < 50, info


def test_a_future_whose_call_could_not_be_pickled_has_no_record(make_executor: MakeExecutor) -> None:  # noqa: F811
    ex = make_executor(max_workers=1)
    fut = ex.submit(figurefns.small, (i for i in range(3)))  # a generator: neither pickle nor dill
    with pytest.raises(pickle.PicklingError):
        fut.result(timeout=60)
    assert fut.task_id is None
    with pytest.raises(UnknownTask):
        fut.info()


# -- the daemon: its listing, its store, its metrics --------------------------------------


def test_the_daemon_keeps_the_figures_across_a_restart_and_counts_them_per_pool(daemon: DaemonUnderTest) -> None:
    daemon.start()
    with Client(daemon.state_dir) as client:
        for pool, mib in (("figa", 60), ("figb", 1)):
            ex = client.executor(pool, max_workers=1)
            try:
                ex.submit(figurefns.touch, mib).result(timeout=60)
                ex.submit(figurefns.sleeps, 0.05).result(timeout=60)
            finally:
                ex.shutdown(wait=True)
        listed = {t["id"]: t for t in client.call("tasks", {"all": True})}
    assert listed["figa/1"]["figures"]["peak_rss"] >= 60 * MiB
    text = cli(daemon.state_dir, "metrics").stdout
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("orchestrator_task_wall_seconds", "orchestrator_task_cpu_seconds",
                 "orchestrator_task_peak_rss_bytes"):
        counts = {s.labels["pool"]: s.value for s in fams[name].samples if s.name == name + "_count"}
        assert counts == {"figa": 2.0, "figb": 2.0}, (name, counts)
    sums = {s.labels["pool"]: s.value for s in fams["orchestrator_task_wall_seconds"].samples
            if s.name == "orchestrator_task_wall_seconds_sum"}
    assert sums["figa"] >= 0.05 and sums["figb"] >= 0.05
    peaks = {s.labels["pool"]: s.value for s in fams["orchestrator_task_peak_rss_bytes"].samples
             if s.name == "orchestrator_task_peak_rss_bytes_sum"}
    assert peaks["figa"] >= 60 * MiB

    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    down = {t["id"]: t for t in cli_json(daemon.state_dir, "tasks", "--all")}  # read from state.db
    assert down["figa/1"]["figures"] == listed["figa/1"]["figures"]
    daemon.start()
    again = {t["id"]: t for t in cli_json(daemon.state_dir, "tasks", "--all")}
    assert {i: t["figures"] for i, t in again.items()} == {i: t["figures"] for i, t in listed.items()}
    with Client(daemon.state_dir) as client:
        assert client.task("figb/2").info()["figures"] == listed["figb/2"]["figures"]


# -- the meter alone ----------------------------------------------------------------------

# A process exec'd from a parent that holds 300 MiB: the kernel folds the parent's mark into
# the child's ru_maxrss for its whole life (the exec's figure). The child meters a task that
# allocates nothing, after one that made 100 MiB resident.
EXEC_FLOOR = textwrap.dedent("""
    import json, mmap, resource, subprocess, sys
    held = mmap.mmap(-1, 300 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    held[::mmap.PAGESIZE] = b"\\1" * ((300 << 20) // mmap.PAGESIZE)
    child = '''
    import json, resource, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import figurefns
    from orchestrator import taskwire as w
    from orchestrator.taskmeter import Meter
    meter = Meter()
    out = {{"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10}}
    for name, call in (("big", lambda: figurefns.touch(100)), ("small", figurefns.small)):
        meter.start()
        call()
        kind, n, payload = w.Frames().feed(meter.frame(7))[0]
        assert (kind, n) == (w.FIGURES, 7)
        out[name] = w.read_figures(payload)
    print(json.dumps(out))
    '''
    print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
""")


def test_the_exec_figure_in_ru_maxrss_is_no_tasks_peak() -> None:
    tests = Path(__file__).resolve().parent
    code = EXEC_FLOOR.replace("{root!r}", repr(str(tests.parent))).replace("{tests!r}", repr(str(tests)))
    code = code.replace("{{", "{").replace("}}", "}")
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    assert got["maxrss"] >= 300 * MiB  # the floor is there: ru_maxrss alone would say 300 MiB
    assert got["big"]["peak_rss"] >= 100 * MiB
    assert got["small"]["peak_rss"] < 100 * MiB, got


# -- the table on the fake ----------------------------------------------------------------


class Figured(Metrics):
    """The real metrics, which record what the table handed them too."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[str, w.Figures]] = []

    def task_figures(self, pool: str, figures: w.Figures) -> None:
        self.got.append((pool, figures))
        super().task_figures(pool, figures)


class SavingStore:
    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []

    def save_task(self, rec: dict[str, Any]) -> None:
        self.saved.append(dict(rec))

    def tasks(self, **_: Any) -> list[dict[str, Any]]:
        return []

    def task_numbers(self) -> dict[str, int]:
        return {}


def payload(wall: float, cpu: float, peak: int, children: int = 0) -> bytes:
    return w.FIGURES_PAYLOAD.pack(wall, cpu, peak, children)


def test_the_table_takes_the_figures_of_the_task_the_worker_runs(make: Callable[..., Harness]) -> None:  # noqa: F811
    h = make()
    h.engine.metrics = metrics = Figured()
    worker = h.worker()
    first, second = h.submit(), h.submit()
    assert worker.tasks_sent(2) == [first.n, second.n]
    worker.send(w.FIGURES, second.n, payload(1.0, 1.0, 1 << 30))  # not the task it runs: ignored
    worker.send(w.FIGURES, first.n, payload(0.25, 0.125, 40 * MiB) + b"more, from a later worker")
    worker.send(w.RESULT, first.n, b"r")
    assert first.state is T.DONE and second.figures is None
    assert first.record()["figures"] == {"wall": 0.25, "cpu": 0.125, "peak_rss": 40 * MiB, "children_peak_rss": None}
    assert metrics.got == [(POOL, first.figures)]
    worker.send(w.FIGURES, second.n, b"short")  # not a payload of ours: ignored
    worker.send(w.RESULT, second.n, b"r")
    assert second.state is T.DONE and second.figures is None
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render({}, {}))}
    count = [s.value for s in fams["orchestrator_task_peak_rss_bytes"].samples
             if s.name == "orchestrator_task_peak_rss_bytes_count"]
    assert count == [1.0]


def test_a_task_that_ended_first_is_saved_again_with_its_figures(make: Callable[..., Harness]) -> None:  # noqa: F811
    h = make()
    store = SavingStore()
    h.engine.store = store  # type: ignore[assignment]
    worker = h.worker()
    task = h.submit()
    assert worker.tasks_sent(1) == [task.n]
    assert h.tasks.cancel(task) and state(task) is T.CANCELLED
    saved = len(store.saved)
    assert store.saved[-1]["figures"] is None
    worker.send(w.FIGURES, task.n, payload(0.5, 0.25, 30 * MiB, 50 * MiB))
    worker.send(w.STOPPED, task.n, bytes([w.CANCEL]))
    assert len(store.saved) == saved + 1
    assert store.saved[-1]["state"] == "CANCELLED"
    assert store.saved[-1]["figures"] == {"wall": 0.5, "cpu": 0.25, "peak_rss": 30 * MiB,
                                          "children_peak_rss": 50 * MiB}
    assert h.kinds(task.ref)[-1] == "stopped"


def test_the_stand_in_of_an_upgrade_leaves_the_stored_record_as_it_is(make: Callable[..., Harness]) -> None:  # noqa: F811
    """The next image of an upgrade knows a task its worker still answers for (it ended
    first: a cancel) by a stand-in with no record: its figures are counted, its row is not
    overwritten with the stand-in's."""
    h = make()
    metrics, store = Figured(), SavingStore()
    stand_in = Task("px/9", 9, h.xp, None, None, None, None, 0, state=T.CANCELLED)
    taskfigures.attach(stand_in, payload(0.5, 0.25, 30 * MiB), metrics, store)
    assert stand_in.figures is not None and [p for p, _ in metrics.got] == [POOL]
    assert store.saved == []


def test_a_task_that_ran_twice_has_both_attempts_figures_and_each_is_counted(make: Callable[..., Harness]) -> None:  # noqa: F811
    h = make()
    metrics = Figured()
    task = Task("px/9", 9, h.xp, None, None, None, None, 0, state=T.RUNNING)
    taskfigures.attach(task, payload(0.5, 0.25, 30 * MiB), metrics, None)  # the attempt that raised Retry
    taskfigures.attach(task, payload(1.0, 0.5, 20 * MiB, 40 * MiB), metrics, None)  # the one after it
    assert task.figures == {"wall": 1.5, "cpu": 0.75, "peak_rss": 30 * MiB, "children_peak_rss": 40 * MiB}
    assert [f["wall"] for _, f in metrics.got] == [0.5, 1.0]
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render({}, {}))}
    counts = [s.value for s in fams["orchestrator_task_wall_seconds"].samples
              if s.name == "orchestrator_task_wall_seconds_count"]
    assert counts == [2.0]


def test_the_figures_kept_between_scrapes_are_all_counted_at_the_next() -> None:
    metrics = Metrics()
    wall = [0.0001 * i for i in range(metrics_mod.FOLD_AT + 10)]  # one fold on the way, ten kept for the scrape
    for i, seconds in enumerate(wall):
        metrics.task_figures("px", {"wall": seconds, "cpu": float("nan") if i == 3 else seconds,
                                    "peak_rss": None if i % 2 else 20 * MiB, "children_peak_rss": None})
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render({}, {}))}

    def value(family: str, sample: str, le: str | None = None) -> float:
        got = [s.value for s in fams[family].samples if s.name == sample and (le is None or s.labels["le"] == le)]
        assert len(got) == 1, (family, sample, got)
        return got[0]

    name = "orchestrator_task_wall_seconds"
    assert value(name, name + "_count") == len(wall)
    assert value(name, name + "_sum") == pytest.approx(sum(wall))
    assert value(name, name + "_bucket", "0.0005") == sum(1 for x in wall if x <= 0.0005)
    cpu = "orchestrator_task_cpu_seconds"
    assert value(cpu, cpu + "_sum") == pytest.approx(sum(wall) - wall[3])  # NaN counted as 0, as observe does
    peak = "orchestrator_task_peak_rss_bytes"
    assert value(peak, peak + "_count") == (len(wall) + 1) // 2
    metrics.forget_pool("px")
    metrics.task_figures("px", {"wall": 1.0, "cpu": 1.0, "peak_rss": None, "children_peak_rss": None})
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render({}, {}))}
    assert value(name, name + "_count") == 1


def state(task: Any) -> T:
    return task.state  # type: ignore[no-any-return]


# -- the store ----------------------------------------------------------------------------

V2_TASKS = """CREATE TABLE tasks (
    id TEXT PRIMARY KEY, pool TEXT NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL,
    attempts INTEGER NOT NULL, retries INTEGER NOT NULL, timeout REAL, worker TEXT, queued_at REAL,
    started_at REAL, ended_at REAL, reason TEXT, payload BLOB, kind TEXT, result BLOB, retire_key REAL,
    priority INTEGER, tenant TEXT
) WITHOUT ROWID"""  # the tasks table of schema version 2, as a file of that version has it


def test_a_file_of_schema_2_is_read_as_it_is_and_migrated_by_the_writer(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    conn.execute(V2_TASKS)
    now = time.time()  # ended now: retention keeps it
    conn.execute("INSERT INTO tasks(id, pool, n, state, attempts, retries, queued_at, ended_at, retire_key, tenant) "
                 "VALUES ('jobs/1', 'jobs', 1, 'DONE', 1, 0, ?, ?, ?, 'alice')", (now, now, now))
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    with Store(db, readonly=True) as r:
        (row,) = r.tasks(include_terminal=True)
        assert (row["id"], row["tenant"], row["figures"]) == ("jobs/1", "alice", None)
    figs = {"wall": 0.5, "cpu": 0.25, "peak_rss": 30 * MiB, "children_peak_rss": None}
    with Store(db) as s:
        (row,) = s.tasks(include_terminal=True)
        s.save_task({**row, "figures": figs})
        s.commit()
        assert [r["figures"] for r in s.tasks(include_terminal=True)] == [figs]
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    assert json.loads(conn.execute("SELECT figures FROM tasks").fetchone()[0]) == figs  # JSON text in the file
    conn.close()
    with Store(db, readonly=True) as r:
        assert r.tasks(task_id="jobs/1")[0]["figures"] == figs


def test_wire_figures_round_trip() -> None:
    data = w.frame(w.FIGURES, 3, payload(1.5, 0.5, 0, 0))
    ((kind, n, got),) = w.Frames().feed(data)
    assert (kind, n) == (w.FIGURES, 3) and len(data) == w.HEADER.size + w.FIGURES_PAYLOAD.size
    assert w.read_figures(got) == {"wall": 1.5, "cpu": 0.5, "peak_rss": None, "children_peak_rss": None}
    assert w.read_figures(got[:-1]) is None
