"""``orchestrator.integrations.joblib``: the joblib parallel backend ``"orchestrator"``,
registered by importing this module.

    import orchestrator.integrations.joblib  # registers "orchestrator"
    from joblib import Parallel, delayed, parallel_backend

    with parallel_backend("orchestrator", n_jobs=4, timeout=60, memory_max=2 << 30):
        squares = Parallel()(delayed(square)(i) for i in range(1000))

Each ``Parallel`` call runs its tasks in an ``orchestrator.Executor`` of ``n_jobs`` workers,
made for that call and shut down at its end (``with Parallel(...) as parallel:`` keeps one
across the calls made in the block, as joblib does with its other backends); the backend's
keywords are the executor's (``timeout``, ``memory_max``, ``max_tasks_per_child``,
``retries``, ``preload``, ...). An error in one task (its exception, a ``WorkerLost``, a
``TaskTimeoutError``) cancels the rest: joblib's ``abort_everything`` cancels every future
the call still has, and those that run get ``orchestrator.Cancelled`` raised in them.

Batches: joblib groups quick calls into one task (its auto-batching, as with loky), except
where a keyword is counted per task: with ``timeout`` or ``max_tasks_per_child`` each call is
a task of its own, so that the limit means what it says of one call (``Parallel(batch_size=N)``
still groups N). A call of ``n_jobs=1`` joblib runs in the calling process itself, whatever
the backend: no pool, none of the executor's keywords.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from joblib.parallel import AutoBatchingMixin, ParallelBackendBase, register_parallel_backend

from ..errors import TaskTimeoutError
from ..executor import Executor
from ..taskfutures import TaskFuture

__all__ = ["NAME", "OrchestratorBackend"]

NAME = "orchestrator"
_EXECUTOR_KEYWORDS = inspect.signature(Executor).parameters
# Counted per task by the executor: with one of these, each call is a task of its own.
_PER_TASK = ("timeout", "max_tasks_per_child")
# Past the grace, for the kill of a task's tree that ignores its stop to be reported.
_STOP_MARGIN = 2.0


# joblib publishes no type information, so mypy sees its base classes as Any.
class OrchestratorBackend(AutoBatchingMixin, ParallelBackendBase):  # type: ignore[misc]
    """joblib's backend ``"orchestrator"``: ``parallel_backend("orchestrator", n_jobs=N,
    **executor_keywords)``. ``n_jobs`` is the pool's size (-1: every CPU, -2: all but one, as
    joblib counts); every other keyword goes to ``orchestrator.Executor`` (one it does not
    take is refused here, in one line; ``max_workers`` is ``n_jobs``). The workers get the
    thread limits joblib's loky backend gives its own (``OMP_NUM_THREADS`` and its kind: the
    CPUs over ``n_jobs``, or ``inner_max_num_threads``), unless this process's environment
    or ``env`` sets them."""

    supports_retrieve_callback = True  # results reach joblib by each future's done-callback
    supports_inner_max_num_threads = True
    supports_sharedmem = False  # the tasks run in other processes: require="sharedmem" falls back to threads
    uses_threads = False
    default_n_jobs = -1

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None,
                 **executor_keywords: Any) -> None:
        unknown = sorted(set(executor_keywords) - set(_EXECUTOR_KEYWORDS))
        if unknown:
            raise TypeError(f"joblib backend {NAME!r}: orchestrator.Executor takes no keyword {', '.join(unknown)}")
        if "max_workers" in executor_keywords:
            raise TypeError(f"joblib backend {NAME!r}: the pool's size is n_jobs, not max_workers")
        if "state_dir" in executor_keywords:
            raise TypeError(f"joblib backend {NAME!r}: a pool of its own for each Parallel call, not a daemon's "
                            f"(state_dir): use the daemon's executor directly")
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self.executor_keywords = dict(executor_keywords)
        self.executor: Executor | None = None
        self._size = 0
        self._lock = threading.Lock()
        self._pending: set[TaskFuture] = set()  # submitted and not ended: what an abort cancels
        self._stopping: list[TaskFuture] = []  # ended while their task ran (a cancel, a timeout)

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if n_jobs < 0:
            return max((os.cpu_count() or 1) + 1 + n_jobs, 1)
        return n_jobs

    def configure(self, n_jobs: int | None = 1, parallel: Any = None, prefer: str | None = None,
                  require: str | None = None, **_memmapping: Any) -> int:
        # joblib's memmapping options (max_nbytes, mmap_mode, temp_folder) are the loky
        # backend's: arguments here travel pickled with their task, whatever their size.
        size = self.effective_n_jobs(n_jobs)
        if self.executor is not None and self._size != size:
            self.terminate()
        # joblib runs a call of one job in this process itself, whatever the backend (and
        # never terminates the backend after it): no pool to make, none to leave behind.
        if self.executor is None and size > 1:
            # Every task joblib hands a backend is a joblib.parallel.BatchedCalls: imported
            # once in the pool's spawner, it is not imported in each fresh worker's first
            # task (where its hundreds of ms counted against that task's timeout).
            preload = ("joblib.parallel", *self.executor_keywords.get("preload", ()))
            self.executor = Executor(max_workers=size, **{**self.executor_keywords, "env": self._env(size),
                                                          "preload": preload})
            self._size = size
        self.parallel = parallel
        return size

    def _env(self, size: int) -> dict[str, str]:
        """The workers' environment: the caller's ``env``, over loky's thread limits for a
        pool of ``size`` (each limit this process's environment sets is inherited as it is)."""
        threads = self.inner_max_num_threads or max((os.cpu_count() or 1) // size, 1)
        limits = {var: str(threads) for var in self.MAX_NUM_THREADS_VARS
                  if self.inner_max_num_threads is not None or var not in os.environ}
        return {**limits, **(self.executor_keywords.get("env") or {})}

    def submit(self, func: Callable[[], Any], callback: Callable[[Future[Any]], Any] | None = None) -> TaskFuture:
        if self.executor is None:
            raise RuntimeError(f"joblib backend {NAME!r}: submit before configure (or after terminate)")
        fut = self.executor.submit(func)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._ended)
        if callback is not None:
            fut.add_done_callback(callback)
        return fut

    def _ended(self, fut: Future[Any]) -> None:
        # A task that ended on its own (a result, an exception, its worker's death) is no
        # worker's any more; a cancelled or timed-out one may still run its cleanup.
        stopping = fut.cancelled() or isinstance(fut.exception(), TaskTimeoutError)
        with self._lock:
            self._pending.discard(fut)
            if stopping and isinstance(fut, TaskFuture):
                self._stopping.append(fut)

    def retrieve_result_callback(self, out: TaskFuture) -> Any:
        return out.result()

    def compute_batch_size(self) -> int:
        if any(self.executor_keywords.get(k) is not None for k in _PER_TASK):
            return 1
        return int(super().compute_batch_size())

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A task failed: every other one of the call is cancelled (``Cancelled`` raised in
        those that run); the pool stays as it is, ready for the next call."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.cancel()

    def terminate(self) -> None:
        """The call (or the ``with Parallel`` block) ended: its pool is shut down, every
        worker gone when this returns. joblib ends a call once each of its tasks has ended
        or been cancelled (``abort_everything``); a task that still runs its cleanup after a
        cancel or its ``timeout`` is waited for first, up to the executor's ``grace`` (after
        which the executor kills its tree), so that its ``finally:`` blocks are not cut short
        by the pool's end."""
        executor, self.executor = self.executor, None
        with self._lock:
            stopping, self._stopping = self._stopping, []
            self._pending.clear()
        if executor is not None:
            grace = self.executor_keywords.get("grace", _EXECUTOR_KEYWORDS["grace"].default)
            deadline = time.monotonic() + grace + _STOP_MARGIN
            for fut in stopping:
                fut.wait_stopped(max(0.0, deadline - time.monotonic()))
            executor.shutdown(wait=True)
        self.reset_batch_stats()


register_parallel_backend(NAME, OrchestratorBackend)
