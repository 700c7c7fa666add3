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

In daemon mode the client outlives its daemon's restarts: a call that finds the daemon
gone (or restarted: a new auth key, no such session) reconnects, registers the session
again and attaches its tasks to it by their ids, within ``reconnect_timeout``; each task's
number is this side's own (blocks granted by the loop), so that a batch sent again can never
run a task twice.
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
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as futures_base
from typing import Any, Callable, Protocol, Sequence

from . import taskwire as w
from .client.channel import AWAY
from .errors import (
    ChannelError, DaemonNotRunning, InvalidSpec, OrchestratorError, ShuttingDown, TaskInterrupted, TaskTimeoutError,
    UnknownReplica, WorkerLost,
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


class _Canceller(Protocol):
    def _cancel(self, ref: int) -> bool: ...


class _TaskFuture(Future):
    """A standard Future whose ``cancel()`` also reaches a task that runs."""

    def __init__(self, executor: _Canceller | None, ref: int, task_id: str | None = None) -> None:
        super().__init__()
        self._executor: _Canceller | None = executor
        self._ref = ref
        # The task's id (``<pool>/<n>``), set by ``submit`` before it returns: any process
        # finds the task again with it (``Client(DIR).task(ID)``). None for a future that
        # failed before its task was made (it could not be pickled).
        self.task_id: str | None = task_id

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


class _Numbers:
    """A session's task numbers: the block in use, [next, end), and in daemon mode the next
    block (``spare``), asked for with a batch of submits as soon as the one before it is
    taken into use, so that a burst of submits does not wait for a grant of its own. Blocks
    start small (a client that submits a few tasks and leaves skips few numbers; it gives
    the rest back) and double up to _BLOCK_MAX. ``lock`` is held by whoever takes one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.came = threading.Condition(self.lock)  # a spare asked for came (or will not)
        self.next = self.end = self.size = 0
        self.spare: list[int] | None = None
        self.asked = False  # a spare is on its way (asked for with a batch)

    def use(self, block: list[int]) -> None:
        first, count = block
        self.next, self.end, self.size = first, first + count, count

    def next_size(self) -> int:
        return max(min(self.size * 2, _BLOCK_MAX), self.size)

    def use_spare(self) -> bool:
        """The spare taken into use; one asked for is waited for (its batch's reply is on its
        way: a grant of its own would take as long), a bounded while."""
        self.came.wait_for(lambda: not self.asked, timeout=_SPARE_WAIT)
        if self.spare is None:
            return False
        block, self.spare = self.spare, None
        self.use(block)
        return True

    def add_spare(self, block: list[int] | None) -> None:
        """What the batch that asked brought (None: nothing, it failed; the sender's thread)."""
        with self.lock:
            self.asked = False
            if block:
                self.spare = block
            self.came.notify_all()

    def unused(self) -> list[int] | None:
        """[first, end] of the numbers granted and not used, if they are one range that
        ends with the latest grant (the spare follows the block in use unless another
        session took numbers in between); forgotten here."""
        with self.lock:
            latest = self.spare if self.spare is not None else [self.next, self.end - self.next]
            first, end = latest[0], latest[0] + latest[1]
            if self.spare is not None and self.spare[0] == self.end:
                first = self.next
            self.spare, self.next, self.end = None, 0, 0
        return [first, end] if first < end else None


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

    ``state_dir``: None, the control loop runs in this process (an ``Orchestrator`` with its
    watchdog) and the pool goes with ``shutdown()``; a state dir, the pool lives in that
    running daemon and outlives this executor (until ``delete``). A pool that runs already
    is joined as it is (its size, which an operator may have scaled, and its preload);
    where a keyword would change how tasks run there (``initializer``/``initargs``,
    ``timeout``, ``grace``, ``retries``, ``memory_max``, ``max_tasks_per_child``, ``env``,
    ``cwd``, the import path) and differs, InvalidSpec names it with both values.

    ``reconnect_timeout`` (daemon mode; 30 s): how long the executor waits for its daemon
    when it is gone (``stop`` then ``start``, a kill -9 then ``start``, an upgrade): it
    reconnects by itself, registers its session again and goes on waiting on the tasks the
    daemon kept (a future fails only with its task's real end: ``WorkerLost`` after a kill
    -9, ``TaskInterrupted`` after a ``stop``, unless ``retries`` queue it again). Submits and
    cancels made meanwhile wait for it. Once the window passes, every pending future fails
    with ``ChannelError``, and so does every later call: the executor is done.

    Each future's ``task_id`` (``<pool>/<n>``) is set when ``submit`` returns; in daemon mode
    ``Client(DIR).task(ID)`` finds the task again from any process. Leaving: in daemon mode
    ``shutdown(wait=False)`` returns at once and the interpreter's exit does not wait for the
    tasks (they are the daemon's; any client fetches their results); ``shutdown(wait=True)``
    waits for them, as the standard library's does. Embedded, the exit waits for them.
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
        reconnect_timeout: float = 30.0,
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
        init = w.dumps((initializer, tuple(initargs)), by_value=_by_value(initializer)) if initializer else b""
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
        self._after = 0  # the session's events read so far (daemon mode)
        self._finished = False  # the session ended (shutdown, or left at exit)
        self._numbers = _Numbers()
        self._backend: _Backend = _Embedded(grace) if state_dir is None else _Remote(state_dir, reconnect_timeout)
        args = {"pool": self._pool, "size": max_workers, "spec": spec, "options": options, "init": init,
                "init_about": _about(initializer, initargs), "session": self._session,
                # Embedded, the pool is this session's alone: one block that never runs out
                # (a grant would wait behind the submits the loop has still to take).
                "numbers": _FIRST_BLOCK if state_dir is not None else _EMBEDDED_BLOCK}
        if isinstance(self._backend, _Embedded):
            args["sink"] = self._events.put  # in this process: the loop hands each event over at once
        else:
            self._backend.rejoin = functools.partial(self._rejoin, args)
        try:
            got = self._backend.call("executor", args, retry=False)  # a daemon away now: this error
        except BaseException:
            self._backend.close()
            raise
        if isinstance(got, dict) and got.get("numbers"):  # a daemon of an earlier version grants none
            self._numbers.use(got["numbers"])
            self._numbers.asked = True
            self._backend.ask_numbers({"pool": self._pool, "session": self._session,
                                       "count": self._numbers.next_size()}, self._numbers.add_spare)
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
        except Exception as err:
            self._futures.pop(ref, None)
            fut.set_exception(pickle.PicklingError(f"the task cannot be pickled: {type(err).__name__}: {err}"))
            return fut
        try:
            n = self._number()
            if n is not None:
                fut.task_id = f"{self._pool}/{n}"
            args_ = {"pool": self._pool, "session": self._session, "ref": ref, "payload": payload, "n": n}
            self._backend.submit(args_, lambda msg: self._submitted(ref, msg))
        except OrchestratorError as err:
            self._futures.pop(ref, None)
            fut.set_exception(err)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As the standard library's: ``wait`` waits for the pending futures (after
        cancelling the queued ones, with ``cancel_futures``), then ends the session. Without
        ``wait`` it returns at once; the futures still end while this process runs. In
        daemon mode the tasks are the daemon's: an interpreter that exits leaves them there
        (``Client(DIR).task(ID)`` fetches a result later) instead of waiting for them."""
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
        if first:
            if wait:
                self._close(cancel_futures)
            else:
                # Daemon mode: a daemon thread, so that the interpreter's exit never waits
                # for it (the exit leaves the tasks to the daemon: _leave).
                threading.Thread(target=self._close, args=(cancel_futures,), name=f"executor-{self._pool}-close",
                                 daemon=isinstance(self._backend, _Remote)).start()
        if wait:
            self._closed.wait()

    # -- the loop's side ----------------------------------------------------------------

    def _close(self, cancel: bool) -> None:
        if not cancel:
            futures_base.wait(list(self._futures.values()))  # as the standard library: pending work runs
        self._end_session(cancel, "the executor shut down")

    def _leave(self) -> None:
        """The interpreter exits (daemon mode): what was submitted is delivered (bounded by
        ``reconnect_timeout`` if the daemon is away), the session ends and the tasks stay
        the daemon's; nothing waits for them to end."""
        with self._lock:
            self._shutdown = True
        self._end_session(False, "the interpreter exited: the task was left to the daemon")
        if isinstance(self._backend, _Remote):  # a close of shutdown(wait=False) ends first
            self._closed.wait(self._backend.reconnect_timeout + POLL_TIMEOUT)

    def _end_session(self, cancel: bool, why: str) -> None:
        """Once (a close after a leave, or the other way round, does nothing more): the
        session ends (embedded, the pool with it), then the threads, and what is still
        pending fails with ShuttingDown(``why``)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        try:
            remote = self._backend if isinstance(self._backend, _Remote) else None
            try:
                if remote is not None:
                    if cancel:  # never sent: cancelled here, as the standard library's queued ones
                        for ref in remote.take_back():
                            fut = self._futures.pop(ref, None)
                            if fut is not None:
                                fut._cancelled_now()
                    remote.drain()  # what was submitted reaches the daemon before the session ends
                    self._give_back()
                    self._stopping = True  # before the close: its answer to the poll ends the poller
                    remote.gone.set()
                # Embedded, the pool is this executor's and goes with it; a daemon's pool
                # outlives its clients (until `delete`): only this session ends.
                self._backend.call("executor_close", {"pool": self._pool, "session": self._session, "cancel": cancel,
                                                      "delete": remote is None}, timeout=None, retry=False)
            except (ShuttingDown, ChannelError, DaemonNotRunning, UnknownReplica):
                pass
            finally:
                self._stopping = True
                self._backend.close()
        finally:
            self._events.put(_STOP)
            if self._collector is not threading.current_thread():
                self._collector.join()
            for fut in list(self._futures.values()):  # the loop ended first (it failed): nothing waits forever
                _fail(fut, ShuttingDown(why))
            self._futures.clear()
            self._closed.set()
            _LIVE.discard(self)

    def _number(self) -> int | None:
        """The number of the next task (its id is ``<pool>/<number>``), from this session's
        block; None from a daemon that grants none (the id then comes when the task starts)."""
        numbers = self._numbers
        with numbers.lock:
            if numbers.next >= numbers.end:
                if not numbers.size:
                    return None
                ask = {"pool": self._pool, "session": self._session, "count": numbers.next_size()}
                if not numbers.use_spare():  # none came in time: a round trip of its own
                    numbers.use(self._backend.call("task_numbers", ask))
                numbers.asked = True  # the next block, asked for now: it comes while this one is used
                try:
                    self._backend.ask_numbers({**ask, "count": numbers.next_size()}, numbers.add_spare)
                except OrchestratorError:
                    numbers.asked = False  # the loop is closing: this submit fails below
            numbers.next += 1
            return numbers.next - 1

    def _give_back(self) -> None:
        """The unused end of the latest block goes back, so that the next ids continue
        without a gap (when no other session took numbers after it); best effort."""
        back = self._numbers.unused()
        if back is None:
            return
        try:
            self._backend.call("task_numbers", {"pool": self._pool, "session": self._session, "give_back": back},
                               retry=False)
        except OrchestratorError:
            pass

    def _rejoin(self, join: dict, timeout: float) -> None:
        """After a reconnect: the session registered again (``join``: this executor's
        ``executor`` command), counting its events on from where this side read them; made
        anew (the daemon restarted, or dropped it), it takes this side's tasks back by their
        ids. A task the daemon has no record of fails (its submit had been acknowledged)."""
        assert isinstance(self._backend, _Remote)
        remote = self._backend
        got = remote.raw_call("executor", {**join, "numbers": None, "rejoin": True, "after": self._after}, timeout)
        if not got.get("fresh"):
            return
        pending = [(ref, fut.task_id) for ref, fut in remote.acknowledged(list(self._futures.items()))
                   if fut.task_id is not None]
        if not pending:
            return
        known = remote.raw_call("task_attach", {"pool": self._pool, "session": self._session,
                                                "tasks": [[ref, task_id] for ref, task_id in pending]}, timeout)
        for (ref, task_id), ok in zip(pending, known):
            fut = None if ok else self._futures.pop(ref, None)
            if fut is not None:
                _fail(fut, ChannelError(f"task {task_id}: the daemon has no record of it (after it restarted)"))

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
        handed to the collector. A daemon that goes away is waited for (``_Remote.call``:
        reconnected, the session joined again); one that does not come back within
        ``reconnect_timeout`` fails every pending future with ChannelError."""
        try:
            while not self._stopping:
                try:
                    got = self._backend.call("task_events", {"session": self._session, "after": self._after,
                                                             "timeout": 1.0}, timeout=POLL_TIMEOUT)
                except OrchestratorError as err:
                    if self._stopping:
                        break
                    for fut in list(self._futures.values()):
                        _fail(fut, err if isinstance(err, ChannelError) else ChannelError(f"the daemon went away: {err}"))
                    self._futures.clear()
                    break
                self._after = got["next"]
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
        if isinstance(data, str) and kind in ("result", "raised"):
            data = base64.b64decode(data)  # from a daemon: base64 over its JSON channel
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
        elif kind == "interrupted":
            _fail(fut, TaskInterrupted(f"task {task_id} was {data}", reason=data, task=task_id))
        elif kind == "cancelled":
            fut._cancelled_now()
        elif kind == "refused":
            from .protocol import raise_reply

            try:
                raise_reply(data)
            except Exception as err:
                _fail(fut, err)
        return True


class _Backend:
    """How an executor reaches the control loop that runs its pool."""

    handle: Any

    def call(self, op: str, args: dict, timeout: float | None = None, *, retry: bool = True) -> Any:
        raise NotImplementedError

    def submit(self, args: dict, on_reply: Callable[[dict], None]) -> None:
        raise NotImplementedError

    def ask_numbers(self, args: dict, deliver: Callable[[list[int] | None], None]) -> None:
        """Ask for a block of task numbers (``task_numbers`` with ``args``) without waiting:
        ``deliver`` gets it (or None) when it comes."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Embedded(_Backend):
    """The loop in this process (an ``Orchestrator`` with its watchdog); submits do not wait."""

    def __init__(self, grace: float) -> None:
        from .daemon.embedded import Orchestrator

        self.handle = Orchestrator(grace=grace, watchdog=True, inherit_output=True)
        self.handle.start()

    def call(self, op: str, args: dict, timeout: float | None = None, *, retry: bool = True) -> Any:
        return self.handle.call(op, args, timeout)

    def submit(self, args: dict, on_reply: Callable[[dict], None]) -> None:
        self.handle.send("task_submit", args, on_reply)

    def ask_numbers(self, args: dict, deliver: Callable[[list[int] | None], None]) -> None:
        self.handle.send("task_numbers", args, lambda msg: deliver(msg.get("result") if msg.get("ok") else None))

    def close(self) -> None:
        self.handle.close()


class _Remote(_Backend):
    """A running daemon, over its command channel (``Client``). Submits are sent in batches
    by a thread of their own: each waits for nothing, and a burst costs one round trip per
    batch, not per task.

    A daemon that goes away does not end this client: the call that finds it away waits
    (``recover``) while one thread reconnects (the daemon's new key, a new connection) and
    registers the session again (``rejoin``, the executor's), for up to
    ``reconnect_timeout`` seconds; then every waiting call tries again. A batch whose reply
    did not come is sent again (``resend``): the daemon knows each task by the number this
    side gave it, so a task that arrived the first time is not queued twice."""

    def __init__(self, state_dir: str | os.PathLike, reconnect_timeout: float) -> None:
        from .client.channel import Client

        if isinstance(reconnect_timeout, bool) or not isinstance(reconnect_timeout, (int, float)) or \
                not 0 <= reconnect_timeout < float("inf"):
            raise ValueError(f"reconnect_timeout must be a finite number of seconds, got {reconnect_timeout!r}")
        self.handle = Client(state_dir)
        self.reconnect_timeout = float(reconnect_timeout)
        self.rejoin: Callable[[float], None] = lambda timeout: None  # the executor's
        self.gone = threading.Event()  # the executor is closing: a reconnect gives up
        self._link = threading.Condition()
        self._generation = 0  # reconnects so far
        self._recovering = False
        self._broken: OrchestratorError | None = None  # the window passed: every call fails with it
        self._unsent: list[tuple[dict, Callable[[dict], None]]] = []
        self._inflight: set[int] = set()  # the refs of the batch on its way
        self._want_numbers = 0  # task numbers to ask for with the next batch...
        self._on_numbers: Callable[[list[int] | None], None] = lambda block: None  # ...and where they go
        self._wake = threading.Condition()
        self._sending = threading.Lock()  # held while a batch is on its way
        self._closed = False
        self._sender = threading.Thread(target=self._send, name="executor-submit", daemon=True)
        self._sender.start()

    def raw_call(self, op: str, args: dict, timeout: float | None = None) -> Any:
        """One call, as it goes: no waiting for a daemon that is away."""
        if op == "executor" and isinstance(args.get("init"), bytes):
            args = {**args, "init": base64.b64encode(args["init"]).decode("ascii")}  # JSON carries no bytes
        return self.handle.call(op, args, timeout)

    def call(self, op: str, args: dict, timeout: float | None = None, *, retry: bool = True) -> Any:
        """A call; one that finds the daemon away is made again once this client is back
        with it (``recover``), unless ``retry`` is False."""
        while True:
            seen = self._generation
            try:
                return self.raw_call(op, args, timeout)
            except AWAY as err:
                if not retry:
                    raise
                self.recover(seen, err)

    def recover(self, seen: int, err: OrchestratorError) -> None:
        """A call made at reconnect ``seen`` failed with ``err``, as a call to a daemon that
        is away does. Returns once this client is back with its daemon (the caller tries
        again); raises the error that ends this executor once ``reconnect_timeout`` has
        passed (or at once, if it has passed already, or the executor is closing)."""
        with self._link:
            while True:
                if self._broken is not None:
                    raise self._broken
                if self._generation != seen:
                    return  # another thread reconnected meanwhile
                if self.gone.is_set():
                    raise ShuttingDown("the executor is shutting down")
                if not self._recovering:
                    self._recovering = True
                    break
                self._link.wait()
        broken: OrchestratorError | None = ChannelError("the executor shut down while it reconnected")
        try:
            broken = self._reconnect(err)
        finally:
            with self._link:
                self._recovering = False
                if broken is None:
                    self._generation += 1
                else:
                    self._broken = broken
                self._link.notify_all()
        if broken is not None:
            raise broken

    def _reconnect(self, err: OrchestratorError) -> OrchestratorError | None:
        """Until the daemon takes this session again (None), or the error that ends this
        executor: the window passed (ChannelError), or the daemon refuses the session (its
        pool was deleted meanwhile)."""
        deadline = time.monotonic() + self.reconnect_timeout

        def rejoin() -> None:
            self.rejoin(max(1.0, min(deadline - time.monotonic(), 30.0)))

        try:
            self.handle.through_restart(rejoin, err, self.reconnect_timeout, self.gone)
        except OrchestratorError as end:
            return end
        return None

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

    def take_back(self) -> list[int]:
        """Every task not sent yet, taken back (a shutdown that cancels): their refs."""
        with self._sending, self._wake:
            taken, self._unsent = self._unsent, []
        return [args["ref"] for args, _ in taken]

    def ask_numbers(self, args: dict, deliver: Callable[[list[int] | None], None]) -> None:
        """With the next batch of submits: no round trip of its own."""
        with self._wake:
            self._want_numbers, self._on_numbers = args["count"], deliver

    def acknowledged(self, items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """Of (ref, future) ``items``, those whose submit the daemon acknowledged (not
        waiting to be sent, nor on their way: those are sent again, to the daemon as it is)."""
        with self._wake:
            waiting = self._inflight | {args["ref"] for args, _ in self._unsent}
        return [(ref, fut) for ref, fut in items if ref not in waiting]

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
                    self._inflight = {args["ref"] for args, _ in batch}
                    want, self._want_numbers = self._want_numbers, 0
                    deliver = self._on_numbers
                try:
                    self._send_batch(batch, want, deliver)
                finally:
                    with self._wake:
                        self._inflight = set()
                    self._sending.release()
        finally:
            self.handle.close_thread()  # its own connection: the Client's close() closes only its caller's

    def _send_batch(self, batch: list[tuple[dict, Callable[[dict], None]]], want: int,
                    deliver: Callable[[list[int] | None], None]) -> None:
        first = batch[0][0]
        tasks = [{"payload": base64.b64encode(args["payload"]).decode("ascii"), "ref": args["ref"], "n": args["n"]}
                 for args, _ in batch]
        request: dict[str, Any] = {"pool": first["pool"], "session": first["session"], "tasks": tasks}
        if want:
            request["numbers"] = want
        try:
            while True:
                seen = self._generation
                try:
                    got = self.raw_call("task_submit", request)
                    if want:  # None from a daemon that grants none with a batch
                        deliver(got.get("numbers") if isinstance(got, dict) else None)
                        want = 0
                    return
                except AWAY as err:
                    # Perhaps it arrived, perhaps not: sent again once back, each task
                    # named by its number (the daemon takes a task it has as that one).
                    self.recover(seen, err)
                    request["resend"] = True
        except OrchestratorError as err:  # refused, or the daemon did not come back: each future's error
            msg = {"ok": False, "error": str(err), "code": getattr(err, "code", "error")}
            for _, on_reply in batch:
                on_reply(msg)
        finally:
            if want:
                deliver(None)  # none came: a submit that waits for them asks itself

    def drain(self) -> None:
        """No more submits; returns once the sender delivered what it holds (or gave up)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._sender.join()

    def close(self) -> None:
        self.drain()
        self.gone.set()
        with self._link:
            self._link.notify_all()
        self.handle.close()


POLL_TIMEOUT = 4.0  # a poll waits 1 s in the daemon: a daemon that went away is noticed within this
_FIRST_BLOCK = 16  # task numbers a session is granted first; each next block twice as many...
_BLOCK_MAX = 1024  # ...up to this
_EMBEDDED_BLOCK = 1 << 31
_SPARE_WAIT = 5.0  # the next block, asked for with a batch, is waited for this long at most


_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """An embedded executor, as the standard library's: an interpreter that exits first
    lets the submitted tasks finish, then stops the workers (none is left behind). A
    daemon's: its tasks are left to the daemon (delivered first), nothing waits for them."""
    for executor in list(_LIVE):
        if isinstance(executor._backend, _Remote):
            executor._leave()
        else:
            executor.shutdown(wait=True)


def _about(initializer: Callable[..., Any] | None, initargs: tuple) -> str | None:
    """An initializer as a joiner's conflict names it: ``module.name(args)``, short."""
    if initializer is None:
        return None
    name = f"{getattr(initializer, '__module__', '?')}.{getattr(initializer, '__qualname__', repr(initializer))}"
    args = repr(tuple(initargs))
    return name + (args if len(args) <= 80 else args[:77] + "...")


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

