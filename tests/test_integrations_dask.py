"""orchestrator.integrations.dask: the executor inside a Dask worker, on a real
``distributed.LocalCluster`` (worker processes, loopback, one worker of one thread): tasks
run in the executor's workers, a Dask cancel raises Cancelled in the running task within
100 ms, a kill -9 of a task's process fails only its Dask future and the worker runs the
next one, a kill -9 of the Dask worker leaves none of its pool's processes, and closing the
client and the cluster leaves no process. Then the side Dask
awaits (``DaskSide``) on a fake executor: the orders of a cancel, a resume and a submit that
race in a worker."""

from __future__ import annotations

import contextlib
import copyreg
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import warnings
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

import integrationfns
from conftest import TAG_VAR, ProcessTracker
from helpers import Ident, wait_gone
from orchestrator import WorkerLost
from orchestrator.taskfutures import TaskFuture, fail, resolve

if importlib.util.find_spec("distributed") is None:
    pytest.skip("distributed is not installed (the test extra has it)", allow_module_level=True)

NAME = "orchestrator"  # the plugin's default executor name
PLUGIN = f"orchestrator-executor-{NAME}"
WAIT = 30.0  # every wait on the cluster or a task: bounded, and generous on a loaded host


@pytest.fixture(scope="module")
def dk() -> Iterator[SimpleNamespace]:
    """distributed and the integration, imported for this module's tests alone, and what
    that import changes in this process undone after them:

    * ``import distributed`` installs tblib's pickling of every exception class in the
      process (``copyreg``); a process forked from it later pickles a ``SystemExit`` that
      arrives without its ``code`` (a ProcessPoolExecutor test of this xdist worker saw
      it). So nothing here is imported at collection, and the dispatch table is put back.
    * The standard library's resource tracker, which a LocalCluster's Nanny starts (for its
      queues), runs from before any test's ``procs`` looks, so that no test's sweep takes it
      for its own and kills it (the next Nanny would warn: an error here); it is stopped
      after the module's clusters are gone, so that the session's sweep does not find it
      either (``_stop`` is how CPython's own tests end it: it closes the pipe and reaps the
      tracker, which has exited once no process holds the pipe: every cluster's have)."""
    from multiprocessing import resource_tracker

    dispatch = dict(copyreg.dispatch_table)
    with warnings.catch_warnings():
        # One an earlier test of this xdist worker started was ended by that test's sweep:
        # started again here, as wanted, not an error of this module's.
        warnings.filterwarnings("ignore", "resource_tracker: process died unexpectedly", UserWarning)
        resource_tracker.ensure_running()
    try:
        import dask
        from distributed import Client, LocalCluster, Reschedule

        from orchestrator.integrations.dask import DEFAULT_NAME, DaskSide, ExecutorPlugin

        assert DEFAULT_NAME == NAME
        yield SimpleNamespace(dask=dask, Client=Client, LocalCluster=LocalCluster, Reschedule=Reschedule,
                              DaskSide=DaskSide, ExecutorPlugin=ExecutorPlugin)
    finally:
        resource_tracker._resource_tracker._stop()
        copyreg.dispatch_table.clear()
        copyreg.dispatch_table.update(dispatch)


@contextlib.contextmanager
def dask_cluster(dk: SimpleNamespace, procs: ProcessTracker, tag: str,
                 tmp_path: Path) -> Iterator[tuple[Any, set[Ident]]]:
    """A one-worker, one-thread LocalCluster on loopback with the plugin registered (the
    scheduler's and the workers' scratch space in ``tmp_path``, not the shared
    /tmp/dask-scratch-space), and a set for the processes the test saw (``seen``: the test
    adds them, its last look once it is done with the worker; at the exit the scheduler may
    not know yet of a worker the test killed); at exit the client and the cluster close, and
    every process in ``seen`` must be gone."""
    seen: set[Ident] = set()
    with dk.dask.config.set({"temporary-directory": str(tmp_path / "dask")}):
        cluster = dk.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address="127.0.0.1:0")
    client = dk.Client(cluster)
    try:
        client.register_plugin(dk.ExecutorPlugin(env={TAG_VAR: tag}))
        yield client, seen
    finally:
        client.close()
        cluster.close()
    for ident in seen:
        procs.track(ident.pid)
    left = wait_gone(seen, 10)
    assert not left, f"left after the client and the cluster closed: {left}"


def worker_trees(client: Any) -> set[Ident]:
    return {ident for pids in client.run(integrationfns.tree).values() for pid in pids
            if (ident := Ident.of(pid)) is not None}


@contextlib.contextmanager
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    """A unix socket the tasks of ``integrationfns`` report on (accepts bounded by WAIT)."""
    path = tmp_path / "tasks.sock"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(str(path))
        srv.listen()
        srv.settimeout(WAIT)
        yield srv


def read_line(conn: socket.socket) -> str:
    conn.settimeout(WAIT)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(256)
        if not chunk:
            raise EOFError(f"the task closed its socket after {data!r}")
        data += chunk
    return data.decode().strip()


def test_importing_orchestrator_imports_no_integration() -> None:
    code = ("import sys, orchestrator\n"
            "orchestrator.Executor, orchestrator.Cancelled\n"
            "print(' '.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=60).stdout.split()
    heads = {name.split(".")[0] for name in loaded}
    assert not heads & {"dask", "distributed", "joblib"}, sorted(heads & {"dask", "distributed", "joblib"})
    assert not [m for m in loaded if m.startswith("orchestrator.integrations")]


def test_the_plugin_refuses_what_the_executor_does_not_take(dk: SimpleNamespace) -> None:
    with pytest.raises(TypeError, match="orchestrator.Executor takes no keyword max_worker$"):
        dk.ExecutorPlugin(max_worker=2)
    with pytest.raises(ValueError, match="'default' is one of the Dask worker's own executors"):
        dk.ExecutorPlugin(name="default")
    plugin = dk.ExecutorPlugin(name="isolated", timeout=5)
    assert (plugin.name, plugin.keywords, plugin.executor) == ("orchestrator-executor-isolated", {"timeout": 5}, None)


def test_dask_tasks_run_in_the_pool_and_a_cancel_raises_cancelled_within_100ms(
        dk: SimpleNamespace, procs: ProcessTracker, orch_test_tag: str, tmp_path: Path) -> None:
    with dask_cluster(dk, procs, orch_test_tag, tmp_path) as (client, seen), listener(tmp_path) as srv:
        ((address, dask_pid),) = client.run(os.getpid).items()
        with pytest.raises(ValueError, match="^max_workers must be greater than 0$"):  # the executor's own word
            client.register_plugin(dk.ExecutorPlugin(name="refused", max_workers=0))
        with dk.dask.annotate(executor=NAME):
            ran = client.gather(client.map(integrationfns.pid, range(3)))
        replicas = client.run(integrationfns.replica_pids, plugin=PLUGIN)[address]
        assert set(ran) <= set(replicas) and dask_pid not in ran, (ran, replicas, dask_pid)
        seen |= worker_trees(client)

        latencies = []
        for i in range(3):
            with dk.dask.annotate(executor=NAME):
                fut = client.submit(integrationfns.announce_then_sleep, str(srv.getsockname()), 60, i, pure=False)
            conn, _ = srv.accept()
            with conn:
                assert int(read_line(conn)) in client.run(integrationfns.replica_pids, plugin=PLUGIN)[address]
                asked = time.monotonic()
                fut.cancel()
                word, at = read_line(conn).split()
            assert word == "cancelled"
            latencies.append(float(at) - asked)
        print(f"\nDask Future.cancel() -> Cancelled raised in the task: "
              f"{', '.join(f'{s * 1000:.1f}' for s in latencies)} ms (median {statistics.median(latencies) * 1000:.1f})")
        assert max(latencies) < 0.100, latencies
        # The worker's thread is free again: the next task runs.
        with dk.dask.annotate(executor=NAME):
            assert client.submit(integrationfns.pid, "after").result(timeout=WAIT) in client.run(
                integrationfns.replica_pids, plugin=PLUGIN)[address]
        seen |= worker_trees(client)  # the replacements too


def test_a_killed_task_process_fails_only_its_future_and_a_killed_dask_worker_leaves_no_pool(
        dk: SimpleNamespace, procs: ProcessTracker, orch_test_tag: str, tmp_path: Path) -> None:
    with dask_cluster(dk, procs, orch_test_tag, tmp_path) as (client, seen), listener(tmp_path) as srv:
        ((address, dask_pid),) = client.run(os.getpid).items()
        seen |= worker_trees(client)
        with dk.dask.annotate(executor=NAME):
            doomed = client.submit(integrationfns.announce_then_sleep, str(srv.getsockname()), 60)
            queued = client.submit(integrationfns.pid, "queued")  # behind it, on the one thread
        conn, _ = srv.accept()
        with conn:
            victim = int(read_line(conn))
            os.kill(victim, signal.SIGKILL)
            err = doomed.exception(timeout=WAIT)
        assert isinstance(err, WorkerLost), repr(err)
        assert err.reason == "killed by SIGKILL", err.reason
        assert queued.result(timeout=WAIT) != victim  # the pool's replacement ran it
        with dk.dask.annotate(executor=NAME):
            assert client.submit(integrationfns.pid, "next").result(timeout=WAIT) != victim
        assert client.run(os.getpid) == {address: dask_pid}, "the Dask worker was replaced"
        # The Dask worker itself SIGKILLed: its pool's watchdog kills the pool's processes.
        # Its nanny is told first not to start another (as a cluster's own shutdown does),
        # which would only slow the close down.
        pool = worker_trees(client) - {Ident.of(dask_pid)}
        assert len(pool) >= 3, pool  # a watchdog, a spawner and a worker at least
        seen |= pool
        client.run(integrationfns.no_restart, nanny=True)
        os.kill(dask_pid, signal.SIGKILL)
        left = wait_gone(pool, 10)
        assert not left, f"the pool outlived its Dask worker: {left}"


# -- DaskSide on a fake executor: what the Dask worker's event loop and the executor's
#    collector thread do, in the orders they may come ------------------------------------


class FakeExecutor:
    """Submits become TaskFutures the test ends itself; a cancel is recorded and ends the
    future as the executor's does once its loop accepts it."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, tuple[Any, ...], TaskFuture]] = []
        self.cancelled: list[int] = []
        self.cancel_seen = threading.Event()
        self.shut: list[tuple[bool, bool]] = []

    def submit(self, fn: Any, /, *args: Any) -> TaskFuture:
        fut = TaskFuture(self, len(self.submitted))
        self.submitted.append((fn, args, fut))
        return fut

    def cancel_ref(self, ref: int) -> bool:
        self.cancelled.append(ref)
        self.cancel_seen.set()
        return True

    def task_info(self, task_id: str) -> dict[str, Any]:
        raise AssertionError("not asked")

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.shut.append((wait, cancel_futures))


class Spec:
    """What Dask passes first to the executor's submit: a task spec with its key."""

    def __init__(self, key: str) -> None:
        self.key = key


def run_task(spec: Spec, data: dict[str, Any], delay: float) -> dict[str, Any]:
    raise AssertionError("the fake executor runs nothing")


@pytest.fixture
def side(dk: SimpleNamespace) -> Iterator[tuple[Any, FakeExecutor]]:
    fake = FakeExecutor()
    side = dk.DaskSide(fake)
    try:
        yield side, fake
    finally:
        side.shutdown(wait=True)


def test_a_task_result_and_failure_reach_the_future_dask_awaits(side: tuple[Any, FakeExecutor]) -> None:
    ds, fake = side
    ok, lost = ds.submit(run_task, Spec("a"), {}, 0.0), ds.submit(run_task, Spec("b"), {}, 0.0)
    resolve(fake.submitted[0][2], {"op": "task-finished", "result": 1})
    fail(fake.submitted[1][2], WorkerLost("task p/2: its worker was lost: killed by SIGKILL", reason="killed by SIGKILL"))
    assert ok.result(timeout=5) == {"op": "task-finished", "result": 1}
    got = lost.result(timeout=5)
    assert got["op"] == "task-erred" and isinstance(got["actual_exception"], WorkerLost)
    assert got["actual_exception"].reason == "killed by SIGKILL"


def test_a_cancel_of_a_running_key_cancels_its_task_and_dask_gets_a_reschedule(
        dk: SimpleNamespace, side: tuple[Any, FakeExecutor]) -> None:
    ds, fake = side
    outer = ds.submit(run_task, Spec("k"), {}, 0.0)
    ds.cancel("k")
    assert fake.cancel_seen.wait(5) and fake.cancelled == [0]
    got = outer.result(timeout=5)
    assert got["op"] == "task-erred" and isinstance(got["actual_exception"], dk.Reschedule)


def test_a_key_released_before_its_submit_never_runs_unless_it_is_wanted_again(
        dk: SimpleNamespace, side: tuple[Any, FakeExecutor]) -> None:
    ds, fake = side
    ds.cancel("early")  # the state machine's move came a turn before the coroutine's submit
    outer = ds.submit(run_task, Spec("early"), {}, 0.0)
    assert fake.submitted == [] and isinstance(outer.result(timeout=0)["actual_exception"], dk.Reschedule)
    ds.cancel("again")
    ds.forget("again")  # cancelled -> waiting: the same run is wanted again
    ds.submit(run_task, Spec("again"), {}, 0.0)
    assert [args[0].key for _, args, _ in fake.submitted] == ["again"]
    ds.submit(run_task, Spec("early"), {}, 0.0)  # the unwanted word was used up by its submit
    assert len(fake.submitted) == 2


def test_a_cancel_of_the_future_dask_awaits_cancels_the_task(side: tuple[Any, FakeExecutor]) -> None:
    ds, fake = side
    outer = ds.submit(run_task, Spec("closing"), {}, 0.0)
    assert outer.cancel()  # asyncio's, as the worker closes and cancels the coroutine awaiting it
    assert fake.cancel_seen.wait(5) and fake.cancelled == [0]
    assert outer.cancelled()  # the task's end after it changes nothing there


def test_a_cancel_for_a_key_that_already_ended_does_nothing(side: tuple[Any, FakeExecutor]) -> None:
    ds, fake = side
    outer = ds.submit(run_task, Spec("done"), {}, 0.0)
    resolve(fake.submitted[0][2], {"op": "task-finished", "result": None})
    assert outer.result(timeout=5)["op"] == "task-finished"
    ds.cancel("done")  # released after its end: the key is no task's any more...
    ds.forget("done")  # ...and its cancelled -> released drops the word
    assert fake.cancelled == []
    assert isinstance(ds.submit(run_task, Spec("done"), {}, 0.0), Future) and len(fake.submitted) == 2


def test_shutdown_shuts_the_executor_down(side: tuple[Any, FakeExecutor]) -> None:
    ds, fake = side
    ds.shutdown(wait=True, cancel_futures=True)
    assert fake.shut == [(True, True)]
