"""orchestrator.integrations.joblib: the backend "orchestrator" runs ``joblib.Parallel``
work in an executor's workers (results in order, a pid check), with the executor's
``timeout``, ``memory_max`` and ``max_tasks_per_child``; an error in one task cancels the
rest (Cancelled raised in those that run); the pool is gone when the call ends."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("joblib")

from joblib import Parallel, delayed, parallel_backend  # noqa: E402

import integrationfns  # noqa: E402
import taskfns  # noqa: E402
from conftest import TAG_VAR, ProcessTracker  # noqa: E402
from helpers import Ident, wait_gone  # noqa: E402
from orchestrator import TaskTimeoutError, WorkerLost  # noqa: E402
from orchestrator.integrations.joblib import NAME, OrchestratorBackend  # noqa: E402


@pytest.fixture
def tagged(procs: ProcessTracker, orch_test_tag: str) -> Iterator[dict[str, Any]]:
    """The backend's keywords every test gives: the test's tag in the workers' environment
    (``procs`` finds a leftover by it)."""
    yield {"env": {TAG_VAR: orch_test_tag}}


def pool_processes(backend: OrchestratorBackend) -> tuple[list[int], set[Ident]]:
    """The pids of the backend's executor's workers, and every process of its pool (the
    workers, spawner and watchdog) by identity."""
    assert backend.executor is not None
    orch = backend.executor.orchestrator
    workers = [r["pid"] for r in orch.status()["replicas"] if r.get("pid")]
    pids = {*workers, orch.watchdog_pid, *orch.spawner_pids}
    return workers, {ident for pid in pids if pid and (ident := Ident.of(pid)) is not None}


def test_parallel_runs_in_the_pools_workers_and_the_pool_goes_with_the_call(tagged: dict[str, Any]) -> None:
    with parallel_backend(NAME, n_jobs=2, **tagged) as (backend, _):
        with Parallel() as parallel:  # one pool for the calls of the block
            squares = parallel(delayed(taskfns.square)(i) for i in range(50))
            pids = parallel(delayed(integrationfns.pid)(i) for i in range(10))
            threads = parallel(delayed(integrationfns.environ)(var) for var in ("OMP_NUM_THREADS", TAG_VAR))
            workers, pool = pool_processes(backend)
    assert squares == [i * i for i in range(50)]
    assert set(pids) <= set(workers) and os.getpid() not in pids, (pids, workers)
    # loky's thread limit (the CPUs over n_jobs, or what this process sets), beside `env`'s own
    assert threads == [os.environ.get("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // 2, 1))),
                       tagged["env"][TAG_VAR]]
    assert backend.executor is None
    assert not wait_gone(pool, 10), "the pool outlived its Parallel block"


def test_a_call_of_one_job_runs_here_as_joblib_runs_it_for_any_backend(tagged: dict[str, Any]) -> None:
    with parallel_backend(NAME, n_jobs=1, **tagged) as (backend, _):
        assert Parallel()(delayed(integrationfns.pid)(i) for i in range(3)) == [os.getpid()] * 3
        assert backend.executor is None  # no pool made for it, none left behind


def test_an_error_in_one_task_cancels_the_rest(tagged: dict[str, Any], tmp_path: Path) -> None:
    log = tmp_path / "cancelled.log"
    calls = [delayed(integrationfns.fail_after)(0.2, "boom")]
    calls += [delayed(taskfns.record_cancel)(token, str(log), 60) for token in (1, 2, 3)]
    with parallel_backend(NAME, n_jobs=4, **tagged), Parallel() as parallel:
        started = time.monotonic()
        with pytest.raises(ValueError, match="^boom$"):
            parallel(calls)
        took = time.monotonic() - started
        assert parallel(delayed(taskfns.square)(i) for i in range(4)) == [0, 1, 4, 9]  # the pool goes on
    assert sorted(log.read_text().split()) == ["1", "2", "3"], "a running task was not cancelled"
    assert took < 30, f"the call waited for the tasks it should have cancelled ({took:.1f} s)"


def test_the_executors_timeout_stops_a_task_that_runs_past_it(tagged: dict[str, Any], tmp_path: Path) -> None:
    marker = tmp_path / "timed"
    started = time.monotonic()
    with parallel_backend(NAME, n_jobs=2, timeout=1.0, **tagged), \
            pytest.raises(TaskTimeoutError, match="/2 ran past its timeout of 1 s"):  # the second call's task
        Parallel()([delayed(taskfns.square)(3), delayed(taskfns.timed)(str(marker))])
    assert marker.read_text() == "TaskTimeout"  # raised inside the task, which sleeps 60 s
    assert time.monotonic() - started < 30


def test_memory_max_kills_a_task_past_it_and_fails_the_call_with_worker_lost(tagged: dict[str, Any]) -> None:
    with parallel_backend(NAME, n_jobs=2, memory_max=64 << 20, **tagged), \
            pytest.raises(WorkerLost, match="memory limit 64 MiB exceeded"):
        Parallel()([delayed(taskfns.square)(2), delayed(taskfns.allocate)(256, 30)])


def test_max_tasks_per_child_makes_each_call_a_task_in_a_fresh_process(tagged: dict[str, Any]) -> None:
    with parallel_backend(NAME, n_jobs=2, max_tasks_per_child=1, **tagged):
        pids = Parallel()(delayed(integrationfns.pid)(i) for i in range(6))  # no batches: one call a task
    assert len(set(pids)) == 6, pids


def test_the_backend_refuses_what_the_executor_does_not_take() -> None:
    with pytest.raises(TypeError, match="orchestrator.Executor takes no keyword memory_limit$"):
        parallel_backend(NAME, n_jobs=2, memory_limit=1)
    with pytest.raises(TypeError, match="the pool's size is n_jobs, not max_workers"):
        parallel_backend(NAME, max_workers=2)
