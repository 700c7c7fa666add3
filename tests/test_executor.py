"""orchestrator.Executor: the standard library's behaviours (the same test bodies run
against ProcessPoolExecutor), then what only ours does: cancel of a running task, a dead
worker failing only its task, timeouts, retries, a process per task, the initializer,
memory_max, and nothing left behind after shutdown or the host's SIGKILL."""

from __future__ import annotations

import concurrent.futures as cf
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import taskfns
from conftest import TAG_VAR, ProcessTracker
from helpers import Ident, wait_for, wait_gone
from orchestrator import Cancelled, Executor, TaskTimeout, TaskTimeoutError, Terminated, WorkerLost

MakeExecutor = Callable[..., Executor]


@pytest.fixture
def make_executor(procs: ProcessTracker, orch_test_tag: str) -> Iterator[MakeExecutor]:
    """Started Executors with the test's tag in their workers' environment; each is shut
    down at teardown (a second shutdown is a no-op), then ``procs`` sweeps."""
    made: list[Executor] = []

    def make(*args: Any, **kwargs: Any) -> Executor:
        kwargs["env"] = {**kwargs.get("env", {}), TAG_VAR: orch_test_tag}
        ex = Executor(*args, **kwargs)
        made.append(ex)
        if kwargs.get("state_dir") is None:  # embedded: its watchdog and spawners are this test's
            procs.track(ex.orchestrator.watchdog_pid)
            procs.exempt.append(lambda: ex.orchestrator.spawner_pids)
        return ex

    try:
        yield make
    finally:
        for ex in made:
            ex.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(params=["ours", "ProcessPoolExecutor"])
def any_executor(request: pytest.FixtureRequest, make_executor: MakeExecutor) -> Iterator[Callable[..., cf.Executor]]:
    """A factory of either executor, for the behaviours both must share."""
    made: list[cf.Executor] = []

    def make(**kwargs: Any) -> cf.Executor:
        if request.param == "ours":
            return make_executor(**kwargs)
        ex = cf.ProcessPoolExecutor(**kwargs)
        made.append(ex)
        return ex

    try:
        yield make
    finally:
        for ex in made:
            ex.shutdown(wait=True, cancel_futures=True)


# -- the standard library's behaviours ------------------------------------------------------

def test_submit_map_and_exceptions(any_executor: Callable[..., cf.Executor]) -> None:
    with any_executor(max_workers=2) as ex:
        assert ex.submit(taskfns.square, 7).result(timeout=30) == 49
        assert list(ex.map(taskfns.square, range(20), timeout=30)) == [i * i for i in range(20)]
        fut = ex.submit(taskfns.fail, "boom")
        with pytest.raises(ValueError, match="boom"):
            fut.result(timeout=30)
        assert isinstance(fut.exception(), ValueError)
        with pytest.raises(ValueError, match="boom"):
            list(ex.map(taskfns.fail, ["boom"], timeout=30))
        assert ex.submit(taskfns.square, x=3).result(timeout=30) == 9  # keyword arguments


def test_a_task_that_raises_system_exit(any_executor: Callable[..., cf.Executor]) -> None:
    with any_executor(max_workers=1) as ex:
        before = ex.submit(taskfns.pid).result(timeout=30)
        err = ex.submit(taskfns.exits, 3).exception(timeout=30)
        assert isinstance(err, SystemExit) and err.code == 3  # the task's exception, not the worker's end
        assert ex.submit(taskfns.pid).result(timeout=30) == before


def test_wait_as_completed_and_callbacks(any_executor: Callable[..., cf.Executor]) -> None:
    with any_executor(max_workers=2) as ex:
        futs = [ex.submit(taskfns.sleep_then, 0.01 * i, i) for i in range(6)]
        seen: list[int] = []
        futs[0].add_done_callback(lambda f: seen.append(f.result()))
        assert sorted(f.result() for f in cf.as_completed(futs, timeout=30)) == list(range(6))
        done, not_done = cf.wait(futs, timeout=30)
        assert len(done) == 6 and not not_done
        assert seen == [0]
        first = ex.submit(taskfns.square, 2)
        done, _ = cf.wait([first], timeout=30, return_when=cf.FIRST_COMPLETED)
        assert done == {first}


def test_cancel_of_a_queued_task_and_shutdown(any_executor: Callable[..., cf.Executor], tmp_path: Path) -> None:
    ex = any_executor(max_workers=1)
    started = tmp_path / "started"
    busy = ex.submit(taskfns.sleep_then, 1.0, "busy")
    queued = [ex.submit(taskfns.square, i) for i in range(3)]
    assert queued[-1].cancel()
    assert queued[-1].cancelled() and queued[-1].done()
    with pytest.raises(cf.CancelledError):
        queued[-1].result(timeout=5)
    done, _ = cf.wait(queued[-1:], timeout=5)
    assert done == {queued[-1]}  # wait() sees a cancelled future as done
    ex.shutdown(wait=True)
    assert busy.result() == "busy"
    assert [f.result() for f in queued[:-1]] == [0, 1]
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(taskfns.square, 1)
    ex.shutdown()  # again: a no-op
    assert not started.exists()


def test_shutdown_cancel_futures_cancels_the_queued(any_executor: Callable[..., cf.Executor]) -> None:
    ex = any_executor(max_workers=1)
    first = ex.submit(taskfns.sleep_then, 0.5, "first")
    wait_for(first.running, 30, "the first task to run")
    queued = [ex.submit(taskfns.square, i) for i in range(5)]
    ex.shutdown(wait=True, cancel_futures=True)
    # As the standard library: what had not started is cancelled (ProcessPoolExecutor may have
    # handed one or two to its call queue already: those run).
    assert all(f.cancelled() or f.result() == i * i for i, f in enumerate(queued))
    assert all(f.cancelled() for f in queued[2:])
    assert first.done()


def test_initializer_runs_in_each_worker(any_executor: Callable[..., cf.Executor]) -> None:
    with any_executor(max_workers=2, initializer=taskfns.init, initargs=("warm",)) as ex:
        results = [ex.submit(taskfns.initialized).result(timeout=30) for _ in range(4)]
        assert all(r == ["warm"] for r in results)


def test_max_tasks_per_child_one_is_a_process_per_task(any_executor: Callable[..., cf.Executor]) -> None:
    with any_executor(max_workers=2, max_tasks_per_child=1) as ex:
        pids = [ex.submit(taskfns.pid).result(timeout=60) for _ in range(6)]
    assert len(set(pids)) == 6


def test_bad_arguments(any_executor: Callable[..., cf.Executor]) -> None:
    with pytest.raises(ValueError):
        any_executor(max_workers=0)
    with pytest.raises(TypeError):
        any_executor(max_workers=1, initializer=3)


# -- ours alone: cancel -------------------------------------------------------------------

def test_cancel_of_a_running_task_raises_cancelled_in_it(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=1)
    started, marker = tmp_path / "started", tmp_path / "marker"
    fut = ex.submit(taskfns.wait_for_cancel, str(started), str(marker))
    wait_for(started.exists, 30, "the task to start")
    # The loop tells the future its task started as the worker's word of it arrives, and
    # the collector thread marks it: that may come just after the task's own first write.
    wait_for(fut.running, 10, "the future to say it runs")
    assert fut.cancel() is True
    assert fut.cancelled() and fut.done()
    with pytest.raises(cf.CancelledError):
        fut.result(timeout=5)
    wait_for(marker.exists, 10, "the task's finally: to run")
    assert marker.read_text() == "Cancelled"
    # the worker lived on: the next task runs in the same process
    assert ex.submit(taskfns.pid).result(timeout=30) == int(started.read_text())
    assert fut.cancel() is True  # again: still cancelled


def test_cancel_after_the_result_returns_false(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=1)
    fut = ex.submit(taskfns.square, 5)
    assert fut.result(timeout=30) == 25
    assert fut.cancel() is False
    assert fut.result() == 25


def test_200_cancels_racing_completion_never_land_in_another_task(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=2)
    log = tmp_path / "cancelled.log"
    outcomes: dict[int, bool] = {}
    futs = {}
    for token in range(200):
        futs[token] = ex.submit(taskfns.record_cancel, token, str(log), 0.002 * (token % 4))
        if token % 2 == 0:
            time.sleep(0.001 * (token % 3))
            outcomes[token] = futs[token].cancel()
    cf.wait(list(futs.values()), timeout=120)
    landed = {int(line) for line in log.read_text().split()} if log.exists() else set()
    cancelled = {t for t, ok in outcomes.items() if ok}
    assert landed <= cancelled, f"Cancelled reached tasks never cancelled: {sorted(landed - cancelled)}"
    for token, fut in futs.items():
        if token in cancelled:
            assert fut.cancelled()
        else:
            assert fut.result(timeout=5) == token  # a failed cancel leaves the result standing
    assert ex.submit(taskfns.square, 3).result(timeout=30) == 9


def test_a_task_that_ignores_cancel_is_killed_with_its_setsid_grandchild(make_executor: MakeExecutor,
                                                                           tmp_path: Path) -> None:
    ex = make_executor(max_workers=1, grace=0.5)
    started = tmp_path / "started"
    fut = ex.submit(taskfns.ignores_cancel_with_grandchild, str(started))
    wait_for(lambda: started.exists() and " " in started.read_text(), 30, "the task and its grandchild")
    worker, grandchild = (Ident.of(int(p)) for p in started.read_text().split())
    assert worker is not None and grandchild is not None
    assert fut.cancel()
    assert not wait_gone([worker, grandchild], 15), "the worker's tree outlived the grace"
    assert fut.cancelled()
    assert ex.submit(taskfns.square, 4).result(timeout=30) == 16  # a new worker serves


def test_timeout_raises_task_timeout_inside_and_a_timeout_error_outside(make_executor: MakeExecutor,
                                                                        tmp_path: Path) -> None:
    ex = make_executor(max_workers=1, timeout=0.5)
    marker = tmp_path / "marker"
    fut = ex.submit(taskfns.timed, str(marker))
    with pytest.raises(TaskTimeoutError, match="timeout of 0.5 s") as info:
        fut.result(timeout=30)
    assert isinstance(info.value, TimeoutError) and info.value.timeout == 0.5
    wait_for(marker.exists, 10, "TaskTimeout inside the task")
    assert ex.submit(taskfns.square, 6).result(timeout=30) == 36


def test_the_exceptions_raised_inside_tasks() -> None:
    for exc in (Cancelled, TaskTimeout):
        assert issubclass(exc, Terminated) and not issubclass(exc, Exception)
    assert issubclass(TaskTimeoutError, TimeoutError)


# -- ours alone: workers that die -----------------------------------------------------------

def test_kill_9_of_a_busy_worker_fails_only_its_task(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=2)
    started = tmp_path / "started"
    victim = ex.submit(taskfns.wait_for_cancel, str(started), str(tmp_path / "marker"))
    others = [ex.submit(taskfns.sleep_then, 0.05, i) for i in range(19)]
    wait_for(started.exists, 30, "the victim to run")
    os.kill(int(started.read_text()), signal.SIGKILL)
    with pytest.raises(WorkerLost) as info:
        victim.result(timeout=30)
    assert info.value.reason == "killed by SIGKILL"
    assert [f.result(timeout=60) for f in others] == list(range(19))
    assert ex.submit(taskfns.square, 5).result(timeout=30) == 25


def test_with_retries_a_dead_worker_loses_nothing(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(max_workers=2, retries=1)
    started = tmp_path / "started"
    victim = ex.submit(taskfns.wait_for_cancel, str(started), str(tmp_path / "marker"))
    others = [ex.submit(taskfns.sleep_then, 0.05, i) for i in range(19)]
    wait_for(started.exists, 30, "the victim to run")
    first = int(started.read_text())
    started.unlink()
    os.kill(first, signal.SIGKILL)
    wait_for(started.exists, 30, "the victim to run again")
    assert int(started.read_text()) != first
    assert victim.cancel()  # it runs again, on another worker: cancel it there
    assert [f.result(timeout=60) for f in others] == list(range(19))


def test_a_worker_that_exits_fails_its_task_with_the_code(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=1)
    with pytest.raises(WorkerLost, match="exited with 3") as info:
        ex.submit(taskfns.exit_with, 3).result(timeout=30)
    assert info.value.reason == "exited with 3"
    assert ex.submit(taskfns.square, 2).result(timeout=30) == 4


def test_a_failing_initializer_fails_the_queued_tasks_not_silently(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=1, initializer=taskfns.init_fails)
    fut = ex.submit(taskfns.square, 2)
    with pytest.raises(WorkerLost, match="initializer failed: RuntimeError: no database"):
        fut.result(timeout=60)
    pool = [p for p in ex.orchestrator.status()["pools"] if p["name"] == ex.pool][0]
    assert pool["state"] == "crashloop"


def test_memory_max_kills_the_worker_that_passes_it(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=1, memory_max=100 << 20)
    with pytest.raises(WorkerLost) as info:
        ex.submit(taskfns.allocate, 300, 5.0).result(timeout=60)
    assert info.value.reason == "memory limit 100 MiB exceeded"
    assert ex.submit(taskfns.allocate, 10, 0).result(timeout=30) == 10 << 20


def test_results_and_exceptions_that_cannot_be_pickled(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=1)
    before = ex.submit(taskfns.pid).result(timeout=30)
    with pytest.raises(pickle.PicklingError, match="cannot be pickled"):
        ex.submit(taskfns.unpicklable_result).result(timeout=30)
    assert ex.submit(taskfns.pid).result(timeout=30) == before  # the worker lives on
    fut = ex.submit(taskfns.fail, "with a traceback")
    err = fut.exception(timeout=30)
    assert isinstance(err, ValueError)
    assert "in fail" in str(err.__cause__)  # the remote traceback's text
    scale = 3
    assert ex.submit(lambda x: x * scale, 5).result(timeout=30) == 15  # a closure, by dill


def test_workers_are_replicas_of_the_pool(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=2, pool="api-tasks")
    ex.submit(taskfns.square, 1).result(timeout=30)
    status = ex.orchestrator.status()
    assert [p["name"] for p in status["pools"]] == ["api-tasks"]
    assert sorted(r["id"] for r in status["replicas"]) == ["api-tasks-1", "api-tasks-2"]


def test_shutdown_leaves_no_worker(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_workers=2, max_tasks_per_child=3)
    pids = {f.result(timeout=30) for f in [ex.submit(taskfns.pid) for _ in range(8)]}
    idents = [i for p in pids if (i := Ident.of(p)) is not None]
    ex.shutdown(wait=True)
    assert all(not i.alive() for i in idents)
    assert not ex.orchestrator.spawner_pids


def test_sigkill_of_the_host_leaves_no_worker_or_grandchild(tmp_path: Path, procs: ProcessTracker,
                                                            orch_test_tag: str) -> None:
    started = tmp_path / "started"
    host = tmp_path / "host.py"
    host.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import taskfns
        from orchestrator import Executor
        ex = Executor(max_workers=2, env={{{TAG_VAR!r}: {orch_test_tag!r}}})
        fut = ex.submit(taskfns.ignores_cancel_with_grandchild, {str(started)!r})
        ex.submit(taskfns.sleep_then, 300, 0)
        print(ex.orchestrator.watchdog_pid, flush=True)
        time.sleep(300)
    """))
    proc = subprocess.Popen([sys.executable, str(host)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        watchdog = procs.track(int(proc.stdout.readline()))  # type: ignore[union-attr]
        wait_for(lambda: started.exists() and " " in started.read_text(), 60, "the task and its grandchild")
        worker, grandchild = (Ident.of(int(p)) for p in started.read_text().split())
        assert worker is not None and grandchild is not None
        everything = [i for i in (worker, grandchild, watchdog) if i is not None]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert not wait_gone(everything, 30), "something outlived the host's SIGKILL"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]


def test_a_function_of_the_scripts_main_keeps_the_modules_it_uses(tmp_path: Path, orch_test_tag: str) -> None:
    """A task defined in the script being run travels by value (a worker's ``__main__`` is
    not the script): the modules and globals it names travel with it, as they do to a
    ProcessPoolExecutor's forked worker."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from orchestrator import Executor
        SUFFIX = "!"

        def task(x):
            return f"{{os.getpid() != os.getppid()}} {{x}}{{SUFFIX}}"

        if __name__ == "__main__":
            with Executor(max_workers=1, env={{{TAG_VAR!r}: {orch_test_tag!r}}}) as ex:
                print(ex.submit(task, 7).result(timeout=30))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True 7!"


def test_a_task_waiting_in_a_busy_worker_is_cancelled_or_handed_on(make_executor: MakeExecutor, tmp_path: Path) -> None:
    """One worker holds the task it runs and the next one: a cancel of the waiting task
    never reaches the running one, and a worker's death hands the waiting task on."""
    ex = make_executor(max_workers=1)
    a_started, a_marker = tmp_path / "a", tmp_path / "a.marker"
    b_started, b_marker = tmp_path / "b", tmp_path / "b.marker"
    a = ex.submit(taskfns.wait_for_cancel, str(a_started), str(a_marker))
    b = ex.submit(taskfns.wait_for_cancel, str(b_started), str(b_marker))
    wait_for(a_started.exists, 30, "the first task to run")
    assert not b.running()  # it waits: QUEUED, in the worker or not
    assert b.cancel() and b.cancelled()
    assert not a.done() and not a_marker.exists()  # the running task was not touched
    assert a.cancel()
    wait_for(a_marker.exists, 10, "Cancelled in the first task")
    assert a_marker.read_text() == "Cancelled"
    worker = int(a_started.read_text())
    assert ex.submit(taskfns.pid).result(timeout=30) == worker  # B never ran; the worker lives on
    assert not b_started.exists()
    # kill -9 of a worker that runs one task and holds the next: the next runs elsewhere
    c_started = tmp_path / "c"
    c = ex.submit(taskfns.wait_for_cancel, str(c_started), str(tmp_path / "c.marker"))
    d = ex.submit(taskfns.pid)
    wait_for(c_started.exists, 30, "the third task to run")
    os.kill(int(c_started.read_text()), signal.SIGKILL)
    with pytest.raises(WorkerLost):
        c.result(timeout=30)
    assert d.result(timeout=30) not in (worker, None)  # ran, in the new worker
