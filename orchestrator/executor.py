"""``orchestrator.Executor``: a ``concurrent.futures.Executor`` over a supervised pool.

    with Executor(max_workers=4, preload=["myapp"]) as ex:
        fut = ex.submit(handle, request)
        fut.cancel()      # True even while it runs: Cancelled is raised in that task alone
        fut.result()      # concurrent.futures.CancelledError

Where the parts are: this module is the submitting side (futures, pickling, one thread
that turns what the loop reports into future states); the control loop (an embedded
``Orchestrator``, with its watchdog) keeps the queue and hands each task to a worker
(daemon/tasks.py); each worker is a replica running ``orchestrator.taskworker``. Tasks
and results cross as pickled bytes that only this side and the worker load.

Differences from ``ProcessPoolExecutor``, each deliberate (README, "Executor"):
``cancel()`` of a running task returns True and raises ``orchestrator.Cancelled`` in it;
a worker that dies fails only its task (``WorkerLost``, or runs it again with
``retries``) and is replaced: the executor never breaks; ``timeout`` per task; nothing
outlives ``shutdown()``, nor the host's SIGKILL (the watchdog).
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import queue
import secrets
import threading
import weakref
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as futures_base
from typing import Any, Callable, Sequence

from . import taskwire as w
from .errors import InvalidSpec, ShuttingDown, TaskTimeoutError, WorkerLost

__all__ = ["Executor"]

_WORKER_TARGET = "orchestrator.taskworker:main"
_STOP = ("stop", None, None, None)


class RemoteTraceback(Exception):
    """The text of an exception's traceback in the worker, as its ``__cause__``."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class _TaskFuture(Future):
    """A standard Future whose ``cancel()`` also reaches a task that runs."""

    def __init__(self, executor: "Executor", ref: int) -> None:
        super().__init__()
        self._executor: Executor | None = executor
        self._ref = ref
        self.task_id: str | None = None  # the loop's id (``<pool>/<n>``), once it has one

    def cancel(self) -> bool:
        with self._condition:
            if self._state in (futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED):
                return True
            if self._state == futures_base.FINISHED:
                return False
        executor = self._executor
        if executor is None or not executor._cancel(self._ref):
            return False
        return self._cancelled_now()

    def _cancelled_now(self) -> bool:
        with self._condition:
            if self._state == futures_base.FINISHED:
                return False
            if self._state in (futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED):
                return True
            self._state = futures_base.CANCELLED
            self._condition.notify_all()
            self.set_running_or_notify_cancel()  # -> CANCELLED_AND_NOTIFIED: wait() sees it done
        self._invoke_callbacks()  # type: ignore[attr-defined]  # Future's own, as its cancel() calls it
        return True


class Executor(futures_base.Executor):
    """A ``concurrent.futures.Executor`` whose tasks run in a supervised pool of worker
    processes. Every keyword is optional:

    ``max_workers``: workers in the pool (``os.cpu_count()``). ``pool``: its name, as
    ``status``, ``logs`` and the metrics show it (a unique ``tasks-…``).
    ``max_tasks_per_child``: a worker is replaced after that many tasks; 1 is a fresh
    process per task (None: reused until it dies). ``preload``: modules imported once in
    the pool's spawner, so that a fresh worker starts warm. ``initializer(*initargs)``: run
    once in each worker before its first task; one that raises fails that worker (the pool
    replaces it under its backoff; one that always fails ends in a crash loop, which fails
    the queued tasks with WorkerLost). ``timeout``: seconds a task may run from its start
    (``TaskTimeout`` raised in it; its future raises ``TaskTimeoutError``). ``grace``:
    seconds from the exception raised inside a task (cancel, timeout) to SIGKILL of its
    worker's whole process tree. ``retries``: times a task whose worker died runs again on
    another worker. ``memory_max``: bytes per worker (cgroup ``memory.max`` where that
    controller is enabled, else its RSS checked every second). ``env``, ``cwd``: the
    workers' environment additions and working directory.

    ``state_dir``: None, the control loop runs in this process; a pool in a running
    daemon is not available yet (InvalidSpec).
    """

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        state_dir: str | os.PathLike | None = None,
        pool: str | None = None,
        max_tasks_per_child: int | None = None,
        preload: Sequence[str] = (),
        initializer: Callable[..., Any] | None = None,
        initargs: tuple = (),
        timeout: float | None = None,
        grace: float = 5.0,
        retries: int = 0,
        memory_max: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> None:
        if max_workers is None:
            max_workers = os.cpu_count() or 1
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None and (
                isinstance(max_tasks_per_child, bool) or not isinstance(max_tasks_per_child, int)
                or max_tasks_per_child < 1):
            raise ValueError("max_tasks_per_child must be >= 1")
        if state_dir is not None:
            raise InvalidSpec("Executor(state_dir=...) is not supported yet: leave it out to run the pool "
                              "in this process")
        from .spec import make_spec

        self._pool = pool or f"tasks-{secrets.token_hex(4)}"
        options: dict[str, Any] = {"max_tasks_per_child": max_tasks_per_child, "timeout": timeout,
                                   "grace": grace, "retries": retries, "memory_max": memory_max}
        init = w.dumps((initializer, tuple(initargs)), by_value=_by_value(initializer)) if initializer else b""
        # The worker's own module is preloaded too: each fresh worker starts with it imported
        # (a process per task would otherwise import it every time).
        spec = make_spec(target=_WORKER_TARGET, env=env, cwd=os.getcwd() if cwd is None else cwd,
                         preload=("orchestrator.taskworker", *preload)).to_wire()
        self._timeout = timeout
        self._futures: dict[int, _TaskFuture] = {}
        self._refs = itertools.count(1)
        self._lock = threading.Lock()
        self._shutdown = False
        self._closed = threading.Event()
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._session = secrets.token_hex(8)
        from .daemon.embedded import Orchestrator  # the control loop, in this process

        self._orch = Orchestrator(grace=grace, watchdog=True, inherit_output=True)
        self._orch.start()
        try:
            self._orch.call("executor", {"pool": self._pool, "size": max_workers, "spec": spec,
                                         "options": options, "init": init, "session": self._session,
                                         "sink": self._events.put})
        except BaseException:
            self._orch.close()
            raise
        self._collector = threading.Thread(target=self._collect, name=f"executor-{self._pool}", daemon=True)
        self._collector.start()
        _LIVE.add(self)

    @property
    def pool(self) -> str:
        """The pool's name, as ``status``, ``logs`` and the metrics show it."""
        return self._pool

    @property
    def orchestrator(self) -> Any:
        """The embedded ``Orchestrator`` that runs the pool (``status()``, ``watchdog_pid``)."""
        return self._orch

    # -- the Executor API ---------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            ref = next(self._refs)
            fut = _TaskFuture(self, ref)
            self._futures[ref] = fut
        try:
            payload = w.dumps((fn, args, kwargs), by_value=_by_value(fn))
        except Exception as err:
            self._futures.pop(ref, None)
            fut.set_exception(pickle.PicklingError(f"the task cannot be pickled: {type(err).__name__}: {err}"))
            return fut
        args_ = {"pool": self._pool, "session": self._session, "ref": ref, "payload": payload}
        try:
            self._orch.send("task_submit", args_, lambda msg: self._submitted(ref, msg))
        except ShuttingDown as err:
            self._futures.pop(ref, None)
            fut.set_exception(err)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
        if first:
            if wait:
                self._close(cancel_futures)
            else:
                threading.Thread(target=self._close, args=(cancel_futures,), name=f"executor-{self._pool}-close").start()
        if wait:
            self._closed.wait()

    # -- the loop's side ----------------------------------------------------------------

    def _close(self, cancel: bool) -> None:
        try:
            if not cancel:
                futures_base.wait(list(self._futures.values()))  # as the standard library: pending work runs
            try:
                self._orch.call("executor_close", {"pool": self._pool, "session": self._session, "cancel": cancel},
                                timeout=None)
            except ShuttingDown:
                pass
            finally:
                self._orch.close()
        finally:
            self._events.put(_STOP)
            self._collector.join()
            for fut in list(self._futures.values()):  # the loop ended first (it failed): nothing waits forever
                _fail(fut, ShuttingDown("the executor shut down"))
            self._futures.clear()
            self._closed.set()
            _LIVE.discard(self)

    def _cancel(self, ref: int) -> bool:
        try:
            (cancelled,) = self._orch.call("task_cancel", {"session": self._session, "refs": [ref]})
        except ShuttingDown:
            return False
        return bool(cancelled)

    def _submitted(self, ref: int, msg: dict) -> None:
        if not msg.get("ok"):  # refused by the loop (its pool is gone): that future's error
            self._events.put(("refused", ref, msg, None))

    def _collect(self) -> None:
        """The one thread that moves what the loop reports into the futures."""
        get = self._events.get
        while True:
            kind, ref, data, task_id = get()
            if kind == "stop":
                return
            fut = self._futures.get(ref)
            if fut is None:
                continue
            if kind == "started":
                fut.task_id = task_id
                with fut._condition:
                    if fut._state == futures_base.PENDING:
                        fut.set_running_or_notify_cancel()
                continue
            del self._futures[ref]
            if kind == "result":
                try:
                    value = w.loads(data)
                except Exception as err:
                    _fail(fut, pickle.UnpicklingError(f"task {task_id}: its result cannot be unpickled here: "
                                                      f"{type(err).__name__}: {err}"))
                else:
                    _resolve(fut, value)
            elif kind == "raised":
                _fail(fut, _remote_exception(task_id, data))
            elif kind == "error":
                _fail(fut, pickle.PicklingError(data))
            elif kind == "timeout":
                line, limit = data
                _fail(fut, TaskTimeoutError(line, task=task_id, timeout=limit))
            elif kind == "lost":
                _fail(fut, WorkerLost(f"task {task_id}: its worker was lost: {data}", reason=data, task=task_id))
            elif kind == "unrun":
                _fail(fut, WorkerLost(f"task {task_id} did not run: {data}", reason=data, task=task_id))
            elif kind == "cancelled":
                fut._cancelled_now()
            elif kind == "refused":
                from .protocol import raise_reply

                try:
                    raise_reply(data)
                except Exception as err:
                    _fail(fut, err)


_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """As the standard library's executors: an interpreter that exits first lets the
    submitted tasks finish, then stops the workers (none is left behind)."""
    for executor in list(_LIVE):
        executor.shutdown(wait=True)


def _by_value(fn: Any) -> bool:
    """Functions of ``__main__`` travel by value: a worker's ``__main__`` is not the caller's."""
    return getattr(fn, "__module__", None) == "__main__"


def _resolve(fut: Future, value: Any) -> None:
    try:
        fut.set_result(value)
    except InvalidStateError:
        pass  # cancelled in the meantime: a cancel that was accepted stands


def _fail(fut: Future, err: BaseException) -> None:
    try:
        fut.set_exception(err)
    except InvalidStateError:
        pass


def _remote_exception(task_id: str | None, data: bytes) -> BaseException:
    try:
        exc, tb = w.loads(data)
    except Exception as err:
        return pickle.UnpicklingError(f"task {task_id}: its exception cannot be unpickled here: "
                                      f"{type(err).__name__}: {err}")
    if isinstance(exc, BaseException):
        exc.__cause__ = RemoteTraceback(tb)
        return exc
    return RuntimeError(f"task {task_id} raised {exc!r}")

