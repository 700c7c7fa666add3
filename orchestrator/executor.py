"""``orchestrator.Executor``: a ``concurrent.futures.Executor`` over a supervised pool.

    with Executor(max_workers=4, preload=["myapp"]) as ex:
        fut = ex.submit(handle, request)
        fut.cancel()      # True even while it runs: Cancelled is raised in that task alone
        fut.result()      # concurrent.futures.CancelledError

Where the parts are: this module is the submitting side (futures, pickling, one thread
that turns what the loop reports into future states); the control loop keeps the queue and
hands each task to a worker (daemon/tasks.py): an embedded ``Orchestrator`` with its
watchdog (``_Embedded``), or a running daemon reached over its channel (``_Remote``, with
``state_dir``); each worker is a replica running ``orchestrator.taskworker``. Tasks and
results cross as pickled bytes that only this side and the worker load.

Differences from ``ProcessPoolExecutor``, each deliberate (README, "Executor"):
``cancel()`` of a running task returns True and raises ``orchestrator.Cancelled`` in it;
a worker that dies fails only its task (``WorkerLost``, or runs it again with
``retries``) and is replaced: the executor never breaks; ``timeout`` per task; nothing
outlives ``shutdown()``, nor the host's SIGKILL (the watchdog).
"""

from __future__ import annotations

import atexit
import base64
import functools
import itertools
import os
import pickle
import queue
import secrets
import threading
import weakref
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as futures_base
from typing import Any, Callable, Iterator, Sequence

from . import taskwire as w
from .errors import (
    ChannelError, DaemonNotRunning, InvalidSpec, OrchestratorError, ShuttingDown, TaskTimeoutError, UnknownReplica,
    WorkerLost,
)

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
        self._invoke_callbacks()
        return True

    def _invoke_callbacks(self) -> None:
        """Future's own, but a callback that raises SystemExit (any BaseException) is
        reported as one that raises an Exception (``exception calling callback for``, on
        the concurrent.futures logger): Future's catches Exception only, and it runs in the
        thread that resolves every future of the executor."""
        for callback in self._done_callbacks:  # type: ignore[attr-defined]
            try:
                callback(self)
            except BaseException:
                futures_base.LOGGER.exception("exception calling callback for %r", self)


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
    the queued tasks with WorkerLost; a ``multiprocessing.Queue``, Lock or Value in
    ``initargs`` is refused, PicklingError: the workers are not this process's children and
    inherit nothing from it, a ``Manager()``'s proxy works). ``timeout``: seconds a task may
    run from its start (``TaskTimeout`` raised in it; its future raises ``TaskTimeoutError``). ``grace``:
    seconds from the exception raised inside a task (cancel, timeout) to SIGKILL of its
    worker's whole process tree. ``retries``: times a task whose worker died runs again on
    another worker (not after a kill for ``memory_max``: it would pass it again).
    ``memory_max``: bytes per worker, its whole process tree counted. Where the cgroup
    memory controller is enabled for worker cgroups it is the cgroup's ``memory.max``:
    exact, the kernel never lets the tree pass it. Elsewhere it is a poll of the tree's
    resident memory, every 20 ms while a task runs (every second while the pool is idle):
    an allocation faster than that passes the limit by up to its rate x 20 ms before the
    kill (measured: up to 53 MiB past it at ~2 GiB/s), and pages the tree's processes
    share count once for each.
    Either way the worker is killed with its tree and its task fails with
    ``WorkerLost("memory limit N MiB exceeded")``. ``env``, ``cwd``: the workers'
    environment additions and working directory.

    ``state_dir``: None, the control loop runs in this process (an ``Orchestrator`` with its
    watchdog) and the pool goes with ``shutdown()``; a state dir, the pool lives in that
    running daemon, outlives this executor (until ``delete``), and is joined if it exists
    with the same keywords.
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
        from .spec import make_spec

        self._pool = pool or f"tasks-{secrets.token_hex(4)}"
        options: dict[str, Any] = {"max_tasks_per_child": max_tasks_per_child, "timeout": timeout,
                                   "grace": grace, "retries": retries, "memory_max": memory_max}
        init = _init_payload(initializer, tuple(initargs), embedded=state_dir is None)
        # The worker's own module is preloaded too: each fresh worker starts with it imported
        # (a process per task would otherwise import it every time).
        spec = make_spec(target=_WORKER_TARGET, env=env, cwd=os.getcwd() if cwd is None else cwd,
                         preload=("orchestrator.taskworker", *preload)).to_wire()
        self._futures: dict[int, _TaskFuture] = {}
        self._refs = itertools.count(1)
        self._lock = threading.Lock()
        self._shutdown = False
        self._closed = threading.Event()
        self._events: queue.SimpleQueue[tuple | list] = queue.SimpleQueue()
        self._session = secrets.token_hex(8)
        self._stopping = False
        self._backend: _Backend = _Embedded(grace) if state_dir is None else _Remote(state_dir)
        args = {"pool": self._pool, "size": max_workers, "spec": spec, "options": options, "init": init,
                "session": self._session}
        if isinstance(self._backend, _Embedded):
            args["sink"] = self._events.put  # in this process: the loop hands each event over at once
        try:
            self._backend.call("executor", args)
        except BaseException:
            self._backend.close()
            raise
        target = self._collect if isinstance(self._backend, _Embedded) else self._poll
        self._collector = threading.Thread(target=target, name=f"executor-{self._pool}", daemon=True)
        self._collector.start()
        _LIVE.add(self)

    @property
    def pool(self) -> str:
        """The pool's name, as ``status``, ``logs`` and the metrics show it."""
        return self._pool

    @property
    def orchestrator(self) -> Any:
        """What runs the pool: the embedded ``Orchestrator`` (``status()``, ``watchdog_pid``),
        or the daemon's ``Client`` for an executor made with ``state_dir``."""
        return self._backend.handle

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
        except BaseException as err:
            self._futures.pop(ref, None)  # nothing waits on it at shutdown
            fut.set_exception(_pickling_error("the task", err))
            if not isinstance(err, Exception):
                raise  # a Ctrl-C (or SystemExit) while it pickled is the caller's, not the task's
            return fut
        args_ = {"pool": self._pool, "session": self._session, "ref": ref, "payload": payload}
        try:
            self._backend.submit(args_, lambda msg: self._submitted(ref, msg))
        except OrchestratorError as err:
            self._futures.pop(ref, None)
            fut.set_exception(err)
        return fut

    def map(self, fn: Callable[..., Any], *iterables: Any, timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        """As ProcessPoolExecutor's: the results in order; ``chunksize`` items per task
        (one round trip and one pickling for each chunk, which fails whole if one item
        raises); ``timeout`` seconds from this call."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if chunksize == 1:
            return super().map(fn, *iterables, timeout=timeout)
        from .taskworker import run_chunk

        chunks = super().map(functools.partial(run_chunk, fn), _chunks(iterables, chunksize), timeout=timeout)
        return (result for chunk in chunks for result in chunk)

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
                # Embedded, the pool is this executor's and goes with it; a daemon's pool
                # outlives its clients (until `delete`): only this session ends.
                self._backend.call("executor_close", {"pool": self._pool, "session": self._session, "cancel": cancel,
                                                      "delete": isinstance(self._backend, _Embedded)}, timeout=None)
            except (ShuttingDown, ChannelError, DaemonNotRunning):
                pass
            finally:
                self._stopping = True
                self._backend.close()
        finally:
            self._events.put(_STOP)
            if self._collector is not threading.current_thread():
                self._collector.join()
            for fut in list(self._futures.values()):  # the loop ended first (it failed): nothing waits forever
                _fail(fut, ShuttingDown("the executor shut down"))
            self._futures.clear()
            self._closed.set()
            _LIVE.discard(self)

    def _cancel(self, ref: int) -> bool:
        if isinstance(self._backend, _Remote) and self._backend.unsend(ref):
            self._futures.pop(ref, None)
            return True  # never sent: cancelled here
        try:
            (cancelled,) = self._backend.call("task_cancel", {"session": self._session, "refs": [ref]})
        except (ShuttingDown, ChannelError, DaemonNotRunning):
            return False
        return bool(cancelled)

    def _poll(self) -> None:
        """A daemon's pool: what its loop reports, fetched (long polls on the channel) and
        handed to the collector. A daemon that went away fails every pending future."""
        after = 0
        try:
            while not self._stopping:
                try:
                    got = self._backend.call("task_events", {"session": self._session, "after": after,
                                                             "timeout": 1.0}, timeout=POLL_TIMEOUT)
                except OrchestratorError as err:
                    if self._stopping:
                        break
                    for fut in list(self._futures.values()):
                        _fail(fut, err if isinstance(err, (ChannelError, DaemonNotRunning)) else
                              ChannelError(f"the daemon went away: {err}"))
                    self._futures.clear()
                    break
                after = got["next"]
                for event in got["events"]:
                    self._on_event(event)
        finally:
            self._backend.handle.close_thread()  # the Client's close() closes only its caller's

    def _submitted(self, ref: int, msg: dict) -> None:
        if not msg.get("ok"):  # refused by the loop (its pool is gone): that future's error
            if isinstance(self._backend, _Embedded):
                self._events.put(("refused", ref, msg, None))  # from the loop's thread: the collector's to handle
            else:
                self._on_event(("refused", ref, msg, None))

    def _collect(self) -> None:
        """The one thread that moves what the embedded loop reports into the futures (a
        list of events per turn of the loop, or one event of this side's own)."""
        get, on_event = self._events.get, self._on_event
        while True:
            got = get()
            if isinstance(got, list):
                for event in got:
                    on_event(event)
            elif not on_event(got):
                return

    def _on_event(self, event: tuple | list) -> bool:
        """One report of the loop into its future; False for the end of the reports."""
        kind, ref, data, task_id = event
        if kind == "stop":
            return False
        fut = self._futures.get(ref)
        if fut is None:
            return True
        if kind == "started":
            fut.task_id = task_id
            with fut._condition:
                if fut._state == futures_base.PENDING:
                    fut.set_running_or_notify_cancel()
            return True
        if self._futures.pop(ref, None) is None:
            return True  # another thread ended it (a refusal and a report cannot both come)
        if task_id is not None:
            fut.task_id = task_id
        try:
            self._end(fut, kind, data, task_id)
        except BaseException as err:  # this thread resolves every future: it must outlive any one report
            futures_base.LOGGER.exception("the report of task %s could not be handled", task_id)
            _fail(fut, RuntimeError(f"task {task_id}: its report could not be handled: {type(err).__name__}: {err}"))
        return True

    def _end(self, fut: _TaskFuture, kind: str, data: Any, task_id: str | None) -> None:
        """The end the loop reported for a task, into its future."""
        if isinstance(data, str) and kind in ("result", "raised"):
            data = base64.b64decode(data)  # from a daemon: base64 over its JSON channel
        if kind == "result":
            try:
                value = w.loads(data)
            except BaseException as err:  # a __reduce__ raising SystemExit too: this future's error alone
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


class _Backend:
    """How an executor reaches the control loop that runs its pool."""

    handle: Any

    def call(self, op: str, args: dict, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def submit(self, args: dict, on_reply: Callable[[dict], None]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Embedded(_Backend):
    """The loop in this process (an ``Orchestrator`` with its watchdog); submits do not wait."""

    def __init__(self, grace: float) -> None:
        from .daemon.embedded import Orchestrator

        # A cgroup per worker where this process may make them (memory_max then is the
        # cgroup's memory.max where that controller is enabled); else process groups.
        self.handle = Orchestrator(grace=grace, watchdog=True, inherit_output=True, cgroup="auto")
        self.handle.start()

    def call(self, op: str, args: dict, timeout: float | None = None) -> Any:
        return self.handle.call(op, args, timeout)

    def submit(self, args: dict, on_reply: Callable[[dict], None]) -> None:
        self.handle.send("task_submit", args, on_reply)

    def close(self) -> None:
        self.handle.close()


class _Remote(_Backend):
    """A running daemon, over its command channel (``Client``). Submits are sent in batches
    by a thread of their own: each waits for nothing, and a burst costs one round trip per
    batch, not per task."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        from .client.channel import Client

        self.handle = Client(state_dir)
        self._unsent: list[tuple[dict, Callable[[dict], None]]] = []
        self._wake = threading.Condition()
        self._sending = threading.Lock()  # held while a batch is on its way
        self._closed = False
        self._sender = threading.Thread(target=self._send, name="executor-submit", daemon=True)
        self._sender.start()

    def call(self, op: str, args: dict, timeout: float | None = None) -> Any:
        if op == "executor" and isinstance(args.get("init"), bytes):
            args = {**args, "init": base64.b64encode(args["init"]).decode("ascii")}  # JSON carries no bytes
        return self.handle.call(op, args, timeout)

    def submit(self, args: dict, on_reply: Callable[[dict], None]) -> None:
        with self._wake:
            if self._closed:
                raise ShuttingDown("the executor is shutting down")
            self._unsent.append((args, on_reply))
            self._wake.notify()

    def unsend(self, ref: int) -> bool:
        """Take a task back before it was sent (its cancel); False if it has been sent,
        in which case the daemon has it by the time this returns."""
        with self._sending, self._wake:
            for i, (args, _) in enumerate(self._unsent):
                if args["ref"] == ref:
                    del self._unsent[i]
                    return True
        return False

    def _send(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._unsent and not self._closed:
                        self._wake.wait()
                    if not self._unsent:
                        return
                    self._sending.acquire()  # before the batch leaves _unsent: unsend() waits for it
                    batch, self._unsent = self._unsent, []
                try:
                    self._send_batch(batch)
                finally:
                    self._sending.release()
        finally:
            self.handle.close_thread()  # its own connection: the Client's close() closes only its caller's

    def _send_batch(self, batch: list[tuple[dict, Callable[[dict], None]]]) -> None:
        first = batch[0][0]
        tasks = [{"payload": base64.b64encode(args["payload"]).decode("ascii"), "ref": args["ref"]}
                 for args, _ in batch]
        try:
            self.handle.call("task_submit", {"pool": first["pool"], "session": first["session"], "tasks": tasks})
        except OrchestratorError as err:  # refused, or the daemon is gone: each future's error
            msg = {"ok": False, "error": str(err), "code": getattr(err, "code", "error")}
            for _, on_reply in batch:
                on_reply(msg)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._sender.join()
        self.handle.close()


POLL_TIMEOUT = 4.0  # a poll waits 1 s in the daemon: a dead daemon is an error within this


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


def _init_payload(initializer: Callable[..., Any] | None, initargs: tuple, *, embedded: bool) -> bytes:
    """The pool's WELCOME payload: the pickled (initializer, initargs); embedded, the
    caller's multiprocessing authkey with it (the workers are this caller's alone: they
    get its key as a forked child would; a daemon's pool serves clients with other keys,
    where each proxy carries its own, see taskwire.dumps)."""
    try:
        init = w.dumps((initializer, initargs), by_value=_by_value(initializer)) if initializer else b""
    except RuntimeError as err:
        raise _pickling_error("initargs", err) from None
    if not embedded:
        return init
    import multiprocessing.process

    return w.with_authkey(init, bytes(multiprocessing.process.current_process().authkey))


def _pickling_error(what: str, err: BaseException) -> pickle.PicklingError:
    line = f"{what} cannot be pickled: {type(err).__name__}: {err}"
    if "through inheritance" in str(err):  # multiprocessing's Queue, Lock, Value...: context.assert_spawning
        line += (" (the workers are not forked from this process, so they inherit nothing from it:"
                 " pass a multiprocessing.Manager()'s proxy instead, e.g. Manager().Queue())")
    return pickle.PicklingError(line)


def _chunks(iterables: tuple, chunksize: int) -> Iterator[tuple]:
    """ProcessPoolExecutor's: the argument tuples of ``map``, ``chunksize`` at a time."""
    items = zip(*iterables)
    while chunk := tuple(itertools.islice(items, chunksize)):
        yield chunk


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
    except BaseException as err:  # SystemExit from a __reduce__ too: this future's error, not the collector's end
        return pickle.UnpicklingError(f"task {task_id}: its exception cannot be unpickled here: "
                                      f"{type(err).__name__}: {err}")
    if isinstance(exc, BaseException):
        exc.__cause__ = RemoteTraceback(tb)
        return exc
    return RuntimeError(f"task {task_id} raised {exc!r}")

