"""The executor keeps its word where a request server lives: no task waits behind another
while a worker is idle (a held task is taken back), a large argument or result is flushed
however large, a shutdown gives each running task one exception (Terminated) and lets its
cleanup finish, and a task's leftover processes are ended before the next task starts."""

from __future__ import annotations

import os
import pickle
import signal
import time
from concurrent.futures import wait
from pathlib import Path

import psutil
import pytest

import wordfns
from helpers import DaemonUnderTest, wait_for
from orchestrator import Executor, WorkerLost
from test_executor import MakeExecutor, make_executor  # noqa: F401  # the fixture
from test_tasks_cli import executors, make_pool  # noqa: F401  # the fixture

MTPC = [None, 1]


def _alive(pid: int, since: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() <= since and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("mtpc", MTPC)
def test_a_short_task_never_waits_behind_a_long_one_while_a_worker_is_free(
        make_executor: MakeExecutor, tmp_path: Path, mtpc: int | None) -> None:
    """Two warm workers: a long task, a shorter one, then a tiny one. The tiny one may be
    held by either busy worker; when the shorter one ends, its worker is free and the tiny
    one runs there, while the long one still runs (ProcessPoolExecutor does the same)."""
    ex = make_executor(max_workers=2, max_tasks_per_child=mtpc)
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30)  # warm
    long = ex.submit(wordfns.block_until, str(tmp_path / "long"), str(tmp_path / "release-long"))
    short = ex.submit(wordfns.block_until, str(tmp_path / "short"), str(tmp_path / "release-short"))
    wait_for(lambda: (tmp_path / "long").exists() and (tmp_path / "short").exists(), 30, "both to start")
    tiny = ex.submit(wordfns.pid_of_worker)
    (tmp_path / "release-short").touch()
    assert tiny.result(timeout=30) != int((tmp_path / "long").read_text())
    assert not long.done()
    (tmp_path / "release-long").touch()
    long.result(timeout=30)


def test_two_tasks_right_after_the_start_run_on_two_workers(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=2)
    first = ex.submit(wordfns.block_until, str(tmp_path / "a"), str(tmp_path / "release"))
    second = ex.submit(wordfns.pid_of_worker)
    assert second.result(timeout=30) > 0  # ran although the first never ends on its own
    wait_for((tmp_path / "a").exists, 30, "the first task to start")
    assert second.result() != int((tmp_path / "a").read_text())
    (tmp_path / "release").touch()
    first.result(timeout=30)


def test_a_task_submitted_after_a_death_runs_on_the_replacement(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=2)
    a = ex.submit(wordfns.block_until, str(tmp_path / "a"), str(tmp_path / "release"))
    b = ex.submit(wordfns.block_until, str(tmp_path / "b"), str(tmp_path / "never"))
    wait_for(lambda: (tmp_path / "a").exists() and (tmp_path / "b").exists(), 30, "both to start")
    os.kill(int((tmp_path / "b").read_text()), signal.SIGKILL)
    c = ex.submit(wordfns.pid_of_worker)  # held by the busy worker, or queued: either way
    with pytest.raises(WorkerLost):
        b.result(timeout=30)
    assert c.result(timeout=30) not in (int((tmp_path / "a").read_text()), int((tmp_path / "b").read_text()))
    assert not a.done()
    (tmp_path / "release").touch()
    a.result(timeout=30)


def test_take_back_under_churn_runs_every_task_exactly_once(make_executor: MakeExecutor, tmp_path: Path) -> None:
    """Tiny and short tasks mixed, so that workers go idle while others hold tasks over
    and over: every task runs once (its marker file is made exclusively)."""
    ex = make_executor(max_workers=3)
    marks = tmp_path / "marks"
    marks.mkdir()
    futures = [ex.submit(wordfns.mark_once, str(marks / str(i)), str(tmp_path / "log"), 0.02 if i % 7 == 0 else 0.0)
               for i in range(300)]
    assert [f.result(timeout=60) for f in futures] == list(range(300))
    assert sorted(int(p.name) for p in marks.iterdir()) == list(range(300))


@pytest.mark.parametrize("size", [300 << 10, 50 << 20])
def test_large_arguments_and_results_are_flushed(make_executor: MakeExecutor, size: int) -> None:
    ex = make_executor(max_workers=2)
    data = os.urandom(size)
    assert ex.submit(wordfns.size_of, data).result(timeout=60) == size
    assert ex.submit(wordfns.echo, data).result(timeout=60) == data
    # several at once, to both workers, one held behind another
    futures = [ex.submit(wordfns.size_of, data) for _ in range(4)]
    assert [f.result(timeout=120) for f in futures] == [size] * 4


def test_shutdown_gives_each_running_task_one_terminated_and_its_cleanup(
        make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=4, grace=10)
    futures = [ex.submit(wordfns.cleans_up, str(tmp_path / f"s{i}"), str(tmp_path / f"m{i}"), 0.5) for i in range(4)]
    wait_for(lambda: all((tmp_path / f"s{i}").exists() for i in range(4)), 30, "four tasks to start")
    queued = ex.submit(wordfns.pid_of_worker)  # held by a busy worker: no worker is free
    workers = [int((tmp_path / f"s{i}").read_text()) for i in range(4)]
    began = time.monotonic()
    ex.shutdown(wait=True, cancel_futures=True)
    took = time.monotonic() - began
    assert [(tmp_path / f"m{i}").read_text() for i in range(4)] == ["Terminated none"] * 4
    assert all(f.cancelled() for f in futures) and queued.cancelled()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers)
    assert took < 10, took  # it returned once the tasks had reacted, not after the grace


@pytest.mark.parametrize("daemonize", [False, True])
def test_processes_a_task_leaves_are_ended_before_the_next_task(
        make_executor: MakeExecutor, tmp_path: Path, daemonize: bool) -> None:
    ex = make_executor(max_workers=1)
    record = tmp_path / "child"
    since = time.time()
    assert ex.submit(wordfns.leaves_children, str(record), daemonize).result(timeout=30) == "done"
    wait_for(record.exists, 10, "the child's pid")
    child = int(record.read_text())
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30)
    assert not _alive(child, time.time()), "the task's child outlived it"
    assert since <= time.time()


def test_a_leftover_that_ignores_sigterm_is_killed_after_the_grace(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=1, grace=0.5)
    record = tmp_path / "child"
    assert ex.submit(wordfns.leaves_a_child_that_ignores_term, str(record)).result(timeout=30) == "done"
    child = int(record.read_text())
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30)
    assert not _alive(child, time.time())


def test_a_cancelled_tasks_children_are_ended_and_the_worker_reused(make_executor: MakeExecutor,
                                                                    tmp_path: Path) -> None:
    ex = make_executor(max_workers=1)
    record, started = tmp_path / "child", tmp_path / "started"
    fut = ex.submit(wordfns.leaves_child_then_cancelled, str(record), str(started))
    wait_for(started.exists, 30, "the task to start")
    worker = int(started.read_text())
    child = int(record.read_text())
    assert fut.cancel()
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30) == worker  # the same worker, reused
    assert not _alive(child, time.time())


def test_the_initializers_own_processes_are_not_a_tasks_leftovers(make_executor: MakeExecutor,
                                                                  tmp_path: Path) -> None:
    record = tmp_path / "helper"
    ex = make_executor(max_workers=1, initializer=wordfns.leaves_children, initargs=(str(record), False))
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30)
    helper = int(record.read_text())
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30)
    assert _alive(helper, time.time())


@pytest.mark.long
def test_an_argument_at_the_wires_limit_runs_and_one_byte_more_is_refused(make_executor: MakeExecutor) -> None:
    """The documented limit (1 GiB pickled) holds exactly: at it the task runs; one byte
    over, its future fails with one line and the executor carries on."""
    from orchestrator import taskwire

    ex = make_executor(max_workers=1)
    overhead = len(taskwire.dumps((wordfns.size_of, (bytes(1 << 20),), {}))) - (1 << 20)
    size = taskwire.MAX_FRAME - overhead
    data = bytes(size)
    assert len(taskwire.dumps((wordfns.size_of, (data,), {}))) == taskwire.MAX_FRAME
    assert ex.submit(wordfns.size_of, data).result(timeout=120) == size
    del data
    over = ex.submit(wordfns.size_of, bytes(size + 1))
    with pytest.raises(Exception, match="over the task wire's limit of 1 GiB") as err:
        over.result(timeout=120)
    assert "\n" not in str(err.value)
    assert ex.submit(wordfns.pid_of_worker).result(timeout=30)


def test_cancels_racing_take_backs_land_only_where_they_were_aimed(make_executor: MakeExecutor,
                                                                    tmp_path: Path) -> None:
    """Three workers, tasks of mixed lengths (workers go idle while others hold tasks, so
    held tasks are asked back all the time), a third of them cancelled at random moments:
    every task runs at most once, every one not cancelled runs exactly once and returns,
    and no Cancelled reaches a task that was not cancelled."""
    import random

    rng = random.Random(7)
    ex = make_executor(max_workers=3)
    marks, log = tmp_path / "marks", tmp_path / "cancelled.log"
    marks.mkdir()
    futures: list = []
    for wave in range(40):  # in waves: the queue drains, and workers free while others hold
        first = len(futures)
        for i in range(first, first + 6):
            futures.append(ex.submit(wordfns.mark_once, str(marks / str(i)), str(log),
                                     rng.choice([0.0, 0.0, 0.002, 0.03])))
        for _ in range(2):
            futures[rng.randrange(first, first + 6)].cancel()
        wait(futures[first:], timeout=60)
    ended = [(i, f.cancelled(), None if f.cancelled() else f.result(timeout=60)) for i, f in enumerate(futures)]
    assert sum(1 for _, cancelled, _ in ended if cancelled) > 20
    for i, cancelled, value in ended:
        if not cancelled:
            assert value == i
            assert (marks / str(i)).exists()
    landed = {int(line) for line in log.read_text().split()} if log.exists() else set()
    assert landed <= {i for i, cancelled, _ in ended if cancelled}


def test_a_process_per_task_never_loses_a_worker_that_connected_early(make_executor: MakeExecutor,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """With a fresh worker per task, a worker forked warm may connect before the loop has
    read its spawner's answer: it waits, unread, and is taken once its pid is known."""
    import logging

    caplog.set_level(logging.WARNING, logger="orchestrator")
    ex = make_executor(max_workers=2, max_tasks_per_child=1)
    pids = [f.result(timeout=60) for f in [ex.submit(wordfns.pid_of_worker) for _ in range(150)]]
    assert len(set(pids)) == 150
    assert not [r for r in caplog.records if "no worker of an executor pool" in r.getMessage()]


def test_wait_stopped_returns_once_a_cancelled_tasks_cleanup_has_run(make_executor: MakeExecutor,
                                                                     tmp_path: Path) -> None:
    """cancel() returns at once, while the task's finally: still runs in its worker;
    wait_stopped() returns once the worker is done with it."""
    ex = make_executor(max_workers=1)
    started, marker = tmp_path / "started", tmp_path / "marker"
    fut = ex.submit(wordfns.cleans_up, str(started), str(marker), 1.0)
    wait_for(started.exists, 30, "the task to start")
    assert fut.cancel() and fut.cancelled()
    assert not marker.exists()  # its cleanup runs on after cancel() returned
    assert fut.wait_stopped(30)
    assert marker.read_text() == "Cancelled none"
    queued = ex.submit(wordfns.pid_of_worker)
    assert queued.result(timeout=30) and queued.wait_stopped(0)  # ended on its own: at once
    never = ex.submit(wordfns.block_until, str(tmp_path / "b"), str(tmp_path / "release"))
    held = ex.submit(wordfns.pid_of_worker)
    assert held.cancel() and held.wait_stopped(30)  # it never ran: no cleanup to wait for
    (tmp_path / "release").touch()
    never.result(timeout=30)
    unpicklable = ex.submit(wordfns.pid_of_worker, (i for i in ()))  # fails at submit: it never had a task
    assert isinstance(unpicklable.exception(0), pickle.PicklingError) and unpicklable.wait_stopped(0)


def test_an_executor_that_cannot_start_its_thread_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch,
                                                                         orch_test_tag: str) -> None:
    """As at interpreter shutdown (CPython's test_python_finalization_error): Executor()
    raises the RuntimeError, and its loop, watchdog, spawners and workers are gone."""
    import threading

    import orchestrator.executor as executor_module
    from orchestrator import Executor

    real = threading.Thread

    class NoCollector(real):  # type: ignore[misc, valid-type]
        def start(self) -> None:
            if self.name.startswith("executor-"):
                raise RuntimeError("can't create new thread at interpreter shutdown")
            super().start()

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    monkeypatch.setattr(executor_module.threading, "Thread", NoCollector)
    with pytest.raises(RuntimeError, match="can't create new thread"):
        Executor(max_workers=2, env={"ORCH_TEST_TAG": orch_test_tag})
    monkeypatch.setattr(executor_module.threading, "Thread", real)
    wait_for(lambda: {p.pid for p in psutil.Process().children(recursive=True)} <= before, 30,
             "the pool's processes to end")
    assert not [t for t in threading.enumerate() if t.name.startswith("orchestrator")], threading.enumerate()


def test_wait_stopped_in_daemon_mode(daemon: DaemonUnderTest, executors: list[Executor], tmp_path: Path) -> None:
    """The daemon's session tells the client when a cancelled task's worker is done with it."""
    daemon.start()
    ex = make_pool(daemon, executors)
    started, marker = tmp_path / "started", tmp_path / "marker"
    fut = ex.submit(wordfns.cleans_up, str(started), str(marker), 1.0)
    wait_for(started.exists, 30, "the task to start")
    assert fut.cancel()
    assert not marker.exists()
    assert fut.wait_stopped(30)
    assert marker.read_text() == "Cancelled none"
