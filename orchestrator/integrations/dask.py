"""``orchestrator.integrations.dask``: an ``orchestrator.Executor`` inside each Dask worker.

    import dask
    from distributed import Client
    from orchestrator.integrations.dask import ExecutorPlugin

    client.register_plugin(ExecutorPlugin(timeout=600, memory_max=4 << 30))
    with dask.annotate(executor="orchestrator"):
        fut = client.submit(render, page)   # runs in a worker process of that Dask worker's pool
    fut.cancel()                            # Cancelled is raised in the running task

One Dask worker, its executor and a task, and who calls whom::

    scheduler --compute-task--> Worker.execute --submit(run_task, spec, data)--> DaskSide
        --submit--> orchestrator.Executor --> the task in a worker process of the pool
    scheduler --free-keys--> the worker's state machine: executing -> released
        --> ExecutorPlugin.transition --> DaskSide.cancel(key) --> TaskFuture.cancel()
    the task's end --> its TaskFuture --> the plain Future that Worker.execute awaits:
        the task's own result or failure (run_task caught it), a failure of its worker
        (WorkerLost, TaskTimeoutError, as the Dask task's error), a cancel (Reschedule)

Why the transition hook: Dask's worker never stops a task that runs. When the scheduler no
longer wants it (``Future.cancel()``, or its key released), the worker's state machine moves
it from ``executing`` to ``cancelled`` and lets it run to its end (``WorkerState.
_transition_executing_released``: "We can't stop executing a task just because the
scheduler asked us to"). Worker code hears of that in one place, a WorkerPlugin's
``transition(key, "executing", "released")``, called in the worker's event loop as the
state machine makes the move. The other cancel Dask has, an asyncio cancel of the coroutine
that awaits the executor, comes only when the worker closes; it reaches the task too, by
the Future that coroutine awaits.

Why that Future is a plain one and not the TaskFuture: asyncio's ``wrap_future`` turns a
cancelled Future into a ``CancelledError`` in ``Worker.execute``, which then ends without the
event Dask's state machine waits for (the worker would count the task as running forever, its
thread slot taken). So a task cancelled here ends the Future Dask awaits as Dask's own
``Reschedule`` would: a cancelled task is released, and one the scheduler asked for again
meanwhile (``cancelled -> waiting`` resumes the same run) is scheduled again rather than given a
``Cancelled`` it did not ask for.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from concurrent.futures import Executor as FuturesExecutor
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Hashable

from distributed import Reschedule, WorkerPlugin
from distributed.core import error_message

from ..errors import OrchestratorError
from ..executor import Executor
from ..taskfutures import TaskFuture

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["DEFAULT_NAME", "DaskSide", "ExecutorPlugin"]

DEFAULT_NAME = "orchestrator"
# A Dask worker's own executors: a plugin's under one of these names would take their work.
_DASK_NAMES = frozenset({"default", "offload", "actor"})
_EXECUTOR_KEYWORDS = inspect.signature(Executor).parameters

log = logging.getLogger("orchestrator.integrations.dask")


class ExecutorPlugin(WorkerPlugin):
    """A ``distributed`` WorkerPlugin: each Dask worker it is registered on gets an
    ``orchestrator.Executor(**executor_keywords)`` under ``name`` (tasks go to it with
    ``dask.annotate(executor=name)``), made when the plugin is set up there and shut down
    when the worker closes or the plugin is removed. ``max_workers`` defaults to the Dask
    worker's ``nthreads`` (Dask runs that many of its tasks at a time); every other keyword
    is the executor's (``timeout``, ``memory_max``, ``retries``, ``max_tasks_per_child``,
    ``preload``, ...), but for ``state_dir``: the pool is the Dask worker's own, in its
    process (with its watchdog), never a daemon's. A keyword the executor does not take is
    refused here, in one line; a value it refuses fails ``register_plugin`` with the
    executor's error.

    A Dask ``Future.cancel()`` of a task running there raises ``orchestrator.Cancelled``
    in that task; a task whose process dies fails its Dask future with ``WorkerLost``
    (``reason``: ``killed by SIGKILL``, ``memory limit 200 MiB exceeded``), and the Dask
    worker runs its next task in the pool's replacement process. The task runs in another
    process: what needs the Dask worker itself there (``get_worker()``,
    ``worker_client()``, ``secede()``) is not available in it, as in a
    ProcessPoolExecutor's."""

    def __init__(self, *, name: str = DEFAULT_NAME, **executor_keywords: Any) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"ExecutorPlugin(): name must be a non-empty str, got {name!r}")
        if name in _DASK_NAMES:
            raise ValueError(f"ExecutorPlugin(): name {name!r} is one of the Dask worker's own executors "
                             f"({', '.join(sorted(_DASK_NAMES))}); give another")
        unknown = sorted(set(executor_keywords) - set(_EXECUTOR_KEYWORDS))
        if unknown:
            raise TypeError(f"ExecutorPlugin(): orchestrator.Executor takes no keyword {', '.join(unknown)}")
        if "state_dir" in executor_keywords:
            raise TypeError("ExecutorPlugin(): each Dask worker's pool is its own (embedded, gone with the "
                            "worker), not a daemon's: state_dir is not taken")
        self.executor_name = name
        # Dask keys its workers' plugins by this name: registering another plugin for the
        # same executor name replaces this one (its executor shut down first).
        self.name = f"orchestrator-executor-{name}"
        self.keywords = dict(executor_keywords)
        self.side: DaskSide | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Dask pickles the plugin to send it to each worker: the keywords travel, an
        # executor set up in some process never does.
        return {**self.__dict__, "side": None}

    @property
    def executor(self) -> Executor | None:
        """This worker's executor, once the plugin is set up here (None before)."""
        return self.side.executor if self.side is not None else None

    async def setup(self, worker: Worker) -> None:
        keywords = dict(self.keywords)
        keywords.setdefault("max_workers", worker.state.nthreads)
        # Every task Dask hands an executor is distributed.worker's run_task: imported once
        # in the pool's spawner, a fresh worker (a replacement, max_tasks_per_child) has it
        # already, instead of seconds of imports before its first task.
        keywords["preload"] = ("distributed.worker", *keywords.get("preload", ()))
        # Executor() starts the pool's control loop, watchdog and spawner and waits for
        # them (about a second): off the event loop, which keeps the worker's heartbeats
        # and comms going meanwhile.
        executor = await asyncio.to_thread(functools.partial(Executor, **keywords))
        self.side = DaskSide(executor)
        worker.executors[self.executor_name] = self.side

    async def teardown(self, worker: Worker) -> None:
        side, self.side = self.side, None
        if side is None:
            return
        if worker.executors.get(self.executor_name) is side:
            del worker.executors[self.executor_name]  # the worker's close would shut it down again
        # Bounded by the executor's grace: what still runs gets Terminated, then SIGKILL.
        await asyncio.to_thread(side.shutdown, wait=True, cancel_futures=True)

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        side = self.side
        if side is None:
            return
        if start == "executing" and finish == "released":  # the scheduler let go of a running task
            side.cancel(key)
        elif start == "cancelled":  # resumed, or its run ended: a cancel for it no longer stands
            side.forget(key)


class DaskSide(FuturesExecutor):
    """What a Dask worker's ``executors`` holds under the plugin's name: each submit (Dask's
    ``run_task(spec, data, delay)``, whose spec carries the task's key) becomes a task of
    ``executor``; the Future returned, the one Dask awaits, mirrors it (module docstring).
    ``cancel(key)`` cancels that task from a thread of its own, never the caller's: the
    caller is the Dask worker's event loop, and a cancel is a round trip to the pool's loop
    (a daemon's pool: through its reconnects)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._lock = threading.Lock()
        self._tasks: dict[Hashable, TaskFuture] = {}
        # Keys the scheduler let go of before their submit came (both from the event loop:
        # the state machine's move, then the coroutine that submits, a turn later).
        self._unwanted: set[Hashable] = set()
        self._canceller: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        key = getattr(args[0], "key", None) if args else None
        outer: Future[Any] = Future()
        started = time.time()
        with self._lock:
            if key is not None and key in self._unwanted:
                self._unwanted.discard(key)
                outer.set_result(_failure(Reschedule(), started))
                return outer
        task = self.executor.submit(fn, *args, **kwargs)
        if key is not None:
            with self._lock:
                self._tasks[key] = task
        # Left PENDING, so that asyncio's cancel of the coroutine awaiting it (the worker
        # closes) can cancel it, and with it the task.
        outer.add_done_callback(functools.partial(self._outer_done, task))
        task.add_done_callback(functools.partial(self._task_done, key, outer, started))
        return outer

    def cancel(self, key: Hashable) -> None:
        """The scheduler let go of ``key``'s running task: it is cancelled (``Cancelled``
        raised in it), and Dask's Future for it ends as a ``Reschedule``."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None:
                self._unwanted.add(key)
                return
        self._cancel_soon(task)

    def forget(self, key: Hashable) -> None:
        """``key`` is wanted again, or its run has ended: a cancel that found no task drops."""
        with self._lock:
            self._unwanted.discard(key)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)
        with self._lock:
            canceller, self._canceller = self._canceller, None
        if canceller is not None:
            canceller.shutdown(wait=wait)

    def _cancel_soon(self, task: TaskFuture) -> None:
        with self._lock:
            if self._canceller is None:
                self._canceller = ThreadPoolExecutor(1, thread_name_prefix="orchestrator-dask-cancel")
            canceller = self._canceller
        try:
            canceller.submit(_cancel, task)
        except RuntimeError:  # shut down meanwhile: the executor's shutdown ends the task
            pass

    def _outer_done(self, task: TaskFuture, outer: Future[Any]) -> None:
        if outer.cancelled():
            self._cancel_soon(task)

    def _task_done(self, key: Hashable, outer: Future[Any], started: float, task: TaskFuture) -> None:
        """In the executor's collector thread: the task's end into the Future Dask awaits."""
        if key is not None:
            with self._lock:
                if self._tasks.get(key) is task:
                    del self._tasks[key]
        if task.cancelled():
            value = _failure(Reschedule(), started)
        else:
            err = task.exception()
            value = _failure(err, started) if err is not None else task.result()
        try:
            outer.set_result(value)
        except InvalidStateError:  # cancelled by the worker's close: nobody awaits it now
            pass


def _cancel(task: TaskFuture) -> None:
    try:
        task.cancel()
    except OrchestratorError as err:  # the pool is closing: its shutdown ends the task
        log.info("cancel of task %s not sent: %s", task.task_id, err)


def _failure(err: BaseException, started: float) -> dict[str, Any]:
    """A task that did not end on its own, as Dask's ``run_task`` reports a task that
    raised (``distributed.worker._run_task_simple``): ``Worker.execute`` turns a
    ``Reschedule`` into a reschedule, anything else into that task's error."""
    msg: dict[str, Any] = dict(error_message(err))
    msg.update(op="task-erred", actual_exception=err, start=started, stop=time.time(),
               thread=threading.get_ident())
    return msg
