"""``orchestrator.Executor``: a ``concurrent.futures.Executor`` over a supervised pool.

    with Executor(max_workers=4, preload=["myapp"]) as ex:
        fut = ex.submit(handle, request)
        fut.cancel()      # True even while it runs: Cancelled is raised in that task alone
        fut.result()      # concurrent.futures.CancelledError

Where the parts are: this module is the submitting side (futures, pickling, one thread
that turns what the loop reports into future states); the control loop keeps the queue and
hands each task to a worker (daemon/tasktable.py): an embedded ``Orchestrator`` with its
watchdog (``_Embedded``), or a running daemon reached over its channel (``Remote``, with
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

A face, beside ``__init__.py``: the public ``Executor``, and the public ``Client`` (the
command channel's client, ``client/channel.py``, with its door to a daemon's executor:
``Client(DIR).executor(P)`` is ``Executor(state_dir=DIR, pool=P)``, the one way to a
daemon's pool). It puts the sides together (the embedded loop, a daemon's channel), so
nothing in the package imports it and the channel never needs it (``tests/test_layout.py``).
"""

from __future__ import annotations

import atexit
import base64
import enum
import functools
import itertools
import os
import pickle
import queue
import secrets
import sys
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import _base as futures_base
from typing import Any, Callable, Iterator, Mapping, Sequence

from . import taskwire as w
from .client import channel
from .errors import (
    ChannelError, DaemonNotRunning, InvalidSpec, NotFound, OrchestratorError, ShuttingDown, TaskInterrupted,
    TaskTimeoutError, WorkerLost,
)
from .paths import LOGS_NAME, Paths
from .taskfutures import TaskFuture, fail, remote_exception, resolve
from .taskremote import EMBEDDED_BLOCK, FIRST_BLOCK, Answer, Backend, Numbers, NumbersAsk, Place, Remote, Submit

__all__ = ["Client", "Executor"]

_WORKER_TARGET = "orchestrator.taskworker:main"
_STOP = ("stop", None, None, None)


class _Pools(enum.Enum):
    POOLS = "the pool's"  # an option a view leaves as its pool has it


POOLS = _Pools.POOLS


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
    ``tenant_weights`` (``{"alice": 2}``; a tenant not named weighs 1) and ``max_wait``
    (seconds): how queued tasks share the workers (``options(priority=, tenant=)``, the
    README's "Priorities and tenants").
    ``min_workers`` (default: ``max_workers``, a fixed pool): an elastic pool, which starts
    with ``min_workers`` and grows up to ``max_workers``: a task that finds no idle worker
    starts a new one (forked warm by the pool's spawner); a worker idle for
    ``idle_timeout`` seconds (60) while the pool is above ``min_workers`` retires.
    ``memory_budget``: bytes, the elastic pool's workers together (each worker's cgroup
    memory where the memory controller exists, else its tree's resident memory): no new
    worker starts while what they hold plus the largest one's share would pass it; tasks
    wait meanwhile, and ``tasks`` says why. It bounds starts; ``memory_max`` bounds a
    worker that allocates.
    ``memory_max``: bytes per worker, its whole process tree counted. Where the cgroup
    memory controller is enabled for worker cgroups it is the cgroup's ``memory.max``:
    exact, the kernel never lets the tree pass it. Elsewhere it is a poll of the tree's
    resident memory, every 20 ms while a task runs (every second while the pool is idle):
    an allocation faster than that passes the limit by up to its rate x 20 ms before the
    kill (measured: benchmarks/README.md), and pages the tree's processes
    share count once for each.
    Either way the worker is killed with its tree and its task fails with
    ``WorkerLost("memory limit N MiB exceeded")``. ``env``, ``cwd``: the workers'
    environment additions and working directory.

    ``state_dir``: None, the control loop runs in this process (an ``Orchestrator`` with its
    watchdog) and the pool goes with ``shutdown()``; a state dir, the pool lives in that
    running daemon and outlives this executor (until ``delete``). A pool that runs already
    is joined as it is (its size, which an operator may have scaled, and its preload);
    where a keyword would change how tasks run there (``initializer``/``initargs``,
    ``timeout``, ``grace``, ``retries``, ``memory_max``, ``max_tasks_per_child``,
    ``tenant_weights``, ``max_wait``, an elastic
    pool's ``min_workers``/``max_workers``/``idle_timeout``/``memory_budget``, ``env``,
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
        state_dir: str | os.PathLike[str] | None = None,
        pool: str | None = None,
        max_tasks_per_child: int | None = None,
        preload: Sequence[str] = (),
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        timeout: float | None = None,
        grace: float = 5.0,
        retries: int = 0,
        memory_max: int | None = None,
        min_workers: int | None = None,
        idle_timeout: float | None = None,
        memory_budget: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        reconnect_timeout: float = 30.0,
        tenant_weights: dict[str, float] | None = None,
        max_wait: float | None = None,
        task_logs: str | os.PathLike[str] | None = None,
    ) -> None:
        if task_logs is not None and state_dir is not None:
            raise ValueError("task_logs= is for an embedded executor: a daemon's pool keeps each task's log "
                             "in its state dir already (Executor.task_log, orchestrator logs POOL/N)")
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
                                   "grace": grace, "retries": retries, "memory_max": memory_max,
                                   "tenant_weights": tenant_weights, "max_wait": max_wait}
        if min_workers is not None or memory_budget is not None:  # an elastic pool (daemon/elastic.py)
            options.update(min_workers=min_workers, max_workers=max_workers, idle_timeout=idle_timeout,
                           memory_budget=memory_budget)
        init = _init_payload(initializer, tuple(initargs), embedded=state_dir is None)
        # The worker's own module is preloaded too: each fresh worker starts with it imported
        # (a process per task would otherwise import it every time).
        spec = make_spec(target=_WORKER_TARGET, env=env, cwd=os.getcwd() if cwd is None else cwd,
                         preload=("orchestrator.taskworker", *preload)).to_wire()
        self._futures: dict[int, TaskFuture] = {}
        self._unstopped: dict[int, TaskFuture] = {}  # ended while a worker still ran them ("stopping")
        self._refs = itertools.count(1)
        self._lock = threading.Lock()
        self._shutdown = False
        self._closed = threading.Event()
        self._events: queue.SimpleQueue[tuple[Any, ...] | list[Any]] = queue.SimpleQueue()
        self._session = secrets.token_hex(8)
        self._stopping = False
        self._after = 0  # the session's events read so far (daemon mode)
        self._finished = False  # the session ended (shutdown, or left at exit)
        self._numbers = Numbers()
        # Where each task's log is: the daemon's logs/, or the dir an embedded one was given.
        self._logs_dir: str | None = (os.path.join(os.path.abspath(state_dir), LOGS_NAME) if state_dir is not None
                                      else os.path.abspath(task_logs) if task_logs is not None else None)
        self._backend: Backend = (_Embedded(grace, self._logs_dir) if state_dir is None
                                  else _remote(state_dir, reconnect_timeout))
        args = {"pool": self._pool, "size": max_workers, "spec": spec, "options": options, "init": init,
                "init_about": _about(initializer, initargs), "session": self._session,
                "waiting_events": True,  # a task that waits for its time (Retry) is told: not running() then
                # Embedded, the pool is this session's alone: one block that never runs out
                # (a grant would wait behind the submits the loop has still to take).
                "numbers": FIRST_BLOCK if state_dir is not None else EMBEDDED_BLOCK}
        if isinstance(self._backend, _Embedded):
            args["sink"] = self._deliver  # in this process: the loop hands each turn's events over at once
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
        try:
            self._collector.start()
        except BaseException:  # no thread (at interpreter shutdown): nothing of the pool may stay behind
            try:
                self._backend.call("executor_close", {"pool": self._pool, "session": self._session, "cancel": True,
                                                      "delete": isinstance(self._backend, _Embedded)},
                                   timeout=None, retry=False)
            except OrchestratorError:
                pass
            finally:
                self._backend.close()
            raise
        _LIVE.add(self)

    @property
    def pool(self) -> str:
        """The pool's name, as ``status``, ``logs`` and the metrics show it."""
        return self._pool

    def task_log(self, task_id: str, *, stderr: bool = False, lines: int | None = None) -> list[str]:
        """The last ``lines`` lines (None: all) of a task's stdout (``stderr``: its stderr),
        e.g. ``fut.task_id``'s, its rotated files included; [] if it has written nothing.
        Each task's output is kept in a daemon's pool, and in an embedded one made with
        ``task_logs=DIR``; without, its workers write to this process's stdout and stderr,
        as a ProcessPoolExecutor's do, and this raises ``ValueError``."""
        from .logread import tail

        if self._logs_dir is None:
            raise ValueError(f"executor {self._pool} keeps no task logs: its tasks write to this process's "
                             f"stdout and stderr (Executor(task_logs=DIR) keeps each task's)")
        return tail(self._logs_dir, task_id, stream="err" if stderr else "out",
                    lines=sys.maxsize if lines is None else lines)

    @property
    def orchestrator(self) -> Any:
        """What runs the pool: the embedded ``Orchestrator`` (``status()``, ``watchdog_pid``),
        or the daemon's ``Client`` for an executor made with ``state_dir``."""
        return self._backend.handle

    # -- the Executor API ---------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> TaskFuture:
        return self._submit(fn, args, kwargs, None, ())

    def options(self, *, priority: int = 0, tenant: str | None = None, timeout: float | None | _Pools = POOLS,
                retries: int | _Pools = POOLS, key: str | None = None, retry_on: Any = None,
                deadline: float | None = None, backoff: tuple[float, float] | None = None) -> Options:
        """A view of this executor whose ``submit`` and ``map`` give each task these
        options (README, "Executor"): ``priority`` (a whole number; higher starts first),
        ``tenant`` (a name: tenants with queued tasks share the workers by the pool's
        ``tenant_weights``, FIFO within one), ``timeout`` (seconds, None: none) and
        ``retries`` for its tasks instead of the pool's. ``deadline``: seconds from the
        submit that bound every wait and retry of the task (past it: TIMED_OUT, its future
        raises TaskTimeoutError, queued, waiting or running). ``retry_on``: an exception
        type or a tuple of them; a task that raises one runs again (``retries`` times, then
        its future raises the last one), after ``backoff=(MIN, MAX)`` seconds (MIN * 2**k,
        at most MAX, jittered; default (0.1, 10)). ``key`` (a str of 1 to 200 bytes, no
        ``/``): it names one task of the pool among its unfinished and kept ones, so that a
        second submit with that key (from this executor, another one, or a client that
        restarted) returns a future of that same task, never a second run; its submit waits
        for the loop's answer (one round trip). A view's ``options()`` narrows it further."""
        return Options(self, {}).options(priority=priority, tenant=tenant, timeout=timeout, retries=retries,
                                         key=key, retry_on=retry_on, deadline=deadline, backoff=backoff)

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                place: Place | None, retry_on: tuple[type[BaseException], ...]) -> TaskFuture:
        """``submit``; ``place``: the task's options of a view (``options``), on the wire;
        ``retry_on`` goes in the pickled call, for the worker to match (taskwire.py)."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            ref = next(self._refs)
            fut = TaskFuture(self, ref)
            self._futures[ref] = fut
        try:
            call = (fn, args, kwargs, retry_on) if retry_on else (fn, args, kwargs)
            payload = w.dumps(call, by_value=_by_value(fn))
        except BaseException as err:
            self._futures.pop(ref, None)  # nothing waits on it at shutdown
            fail(fut, _pickling_error("the task", err))  # reported too: no task, nothing to wait_stopped for
            if not isinstance(err, Exception):
                raise  # a Ctrl-C (or SystemExit) while it pickled is the caller's, not the task's
            return fut
        if place is not None and "key" in place:
            return self._submit_keyed(fut, ref, payload, place)
        try:
            n = self._number()
            if n is not None:
                fut.task_id = f"{self._pool}/{n}"
            args_: Submit = {**(place or Place()), "pool": self._pool, "session": self._session, "ref": ref,
                             "payload": payload, "n": n}
            self._backend.submit(args_, lambda msg: self._submitted(ref, msg))
        except OrchestratorError as err:
            self._futures.pop(ref, None)
            fail(fut, err)
        return fut

    def _submit_keyed(self, fut: TaskFuture, ref: int, payload: bytes, place: Place) -> TaskFuture:
        """A submit with a key: the loop says which task the key names (a new one, or the
        one it named already), and whether this future hears of it (``shared``: another
        future does; this executor's own is returned, else one that follows the task by id,
        as ``Client(DIR).task(ID).future()``). A new task takes the next number of the
        session's block; a key of a task there already leaves that number unused."""
        answered = threading.Event()
        box: list[Mapping[str, Any]] = []

        def on_reply(msg: Mapping[str, Any]) -> None:
            box.append(msg)
            answered.set()

        try:
            self._backend.submit({**place, "pool": self._pool, "session": self._session, "ref": ref,
                                  "payload": payload, "n": self._number()}, on_reply)
        except OrchestratorError as err:
            self._futures.pop(ref, None)
            fail(fut, err)
            return fut
        answered.wait()  # bounded: the loop answers, or the channel gives up (reconnect_timeout)
        msg = box[0]
        if not msg.get("ok"):
            from .protocol import raise_reply

            self._futures.pop(ref, None)
            try:
                raise_reply(dict(msg))
            except Exception as err:
                fail(fut, err)
            return fut
        got = msg["result"]
        task_id = got["id"]
        if not got.get("shared"):
            fut.task_id = task_id
            return fut
        self._futures.pop(ref, None)  # the loop tells this ref nothing: another future has the task
        with self._lock:
            mine = next((f for f in list(self._futures.values()) if f.task_id == task_id), None)
        if mine is not None:
            return mine
        from .client.taskhandle import TaskHandle

        client = self._backend.handle if isinstance(self._backend, Remote) else _LoopClient(self._backend.handle)
        try:
            return TaskHandle(client, task_id).future()
        except OrchestratorError as err:
            fail(fut, err)
            return fut

    def map(self, fn: Callable[..., Any], *iterables: Any, timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        """As ProcessPoolExecutor's: the results in order; ``chunksize`` items per task
        (one round trip and one pickling for each chunk, which fails whole if one item
        raises); ``timeout`` seconds from this call."""
        return _map(super().map, fn, iterables, timeout, chunksize)

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
                                 daemon=isinstance(self._backend, Remote)).start()
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
        if isinstance(self._backend, Remote):  # a close of shutdown(wait=False) ends first
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
            remote = self._backend if isinstance(self._backend, Remote) else None
            try:
                if remote is not None:
                    if cancel:  # never sent: cancelled here, as the standard library's queued ones
                        for ref in remote.take_back():
                            fut = self._futures.pop(ref, None)
                            if fut is not None:
                                fut._cancelled_now()
                                fut.mark_stopped()
                    remote.drain()  # what was submitted reaches the daemon before the session ends
                    self._give_back()
                    self._stopping = True  # before the close: its answer to the poll ends the poller
                    remote.gone.set()
                # Embedded, the pool is this executor's and goes with it; a daemon's pool
                # outlives its clients (until `delete`): only this session ends.
                self._backend.call("executor_close", {"pool": self._pool, "session": self._session, "cancel": cancel,
                                                      "delete": remote is None}, timeout=None, retry=False)
            except (ShuttingDown, ChannelError, DaemonNotRunning, NotFound):  # its pool or session is gone already
                pass
            finally:
                self._stopping = True
                self._backend.close()
        finally:
            self._events.put(_STOP)
            if self._collector is not threading.current_thread():
                self._collector.join()
            for fut in list(self._futures.values()):  # the loop ended first (it failed): nothing waits forever
                fail(fut, ShuttingDown(why))
            for fut in self._unstopped.values():  # embedded: the pool is gone; a daemon's: not ours to follow
                fut.mark_stopped()
            self._futures.clear()
            self._unstopped.clear()
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
                ask: NumbersAsk = {"pool": self._pool, "session": self._session, "count": numbers.next_size()}
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

    def _rejoin(self, join: dict[str, Any], timeout: float) -> None:
        """After a reconnect: the session registered again (``join``: this executor's
        ``executor`` command), counting its events on from where this side read them; made
        anew (the daemon restarted, or dropped it), it takes this side's tasks back by their
        ids. A task the daemon has no record of fails (its submit had been acknowledged)."""
        assert isinstance(self._backend, Remote)
        remote = self._backend
        # The numbers whose submits the daemon has yet to see (unused, or not acknowledged):
        # a daemon that restarted knows them again as on their way (a cancel by id lands).
        coming = self._numbers.held() + [[n, n + 1] for n in remote.unacknowledged()]
        got = remote.raw_call("executor", {**join, "numbers": None, "rejoin": True, "after": self._after,
                                           "on_its_way": coming}, timeout)
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
                fail(fut, ChannelError(f"task {task_id}: the daemon has no record of it (after it restarted)"))

    def cancel_ref(self, ref: int) -> bool:
        """Cancel the task of this executor's future ``ref`` (its ``cancel()``)."""
        if isinstance(self._backend, Remote) and self._backend.unsend(ref):
            fut = self._futures.pop(ref, None)
            if fut is not None:
                fut.mark_stopped()  # never sent: no worker ever had it
            return True  # never sent: cancelled here
        try:
            (cancelled,) = self._backend.call("task_cancel", {"session": self._session, "refs": [ref]})
        except (ShuttingDown, ChannelError, DaemonNotRunning):
            return False
        return bool(cancelled)

    def task_info(self, task_id: str) -> dict[str, Any]:
        """The record of this executor's task ``task_id`` (its future's ``info()``)."""
        (row,) = self._backend.call("tasks", {"id": task_id})
        return dict(row)

    def _poll(self) -> None:
        """A daemon's pool: what its loop reports, fetched (long polls on the channel) and
        handed to the collector. A daemon that goes away is waited for (``Remote.call``:
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
                        fail(fut, err if isinstance(err, ChannelError) else ChannelError(f"the daemon went away: {err}"))
                    self._futures.clear()
                    break
                self._after = got["next"]
                for event in got["events"]:
                    self._on_event(event)
        finally:
            self._backend.handle.close_thread()  # the Client's close() closes only its caller's

    def _submitted(self, ref: int, msg: Mapping[str, Any]) -> None:
        if not msg.get("ok"):  # refused by the loop (its pool is gone): that future's error
            if isinstance(self._backend, _Embedded):
                self._events.put(("refused", ref, msg, None))  # from the loop's thread: the collector's to handle
            else:
                self._on_event(("refused", ref, msg, None))

    def _deliver(self, events: list[Any]) -> None:
        """The embedded loop's sink, in its thread, once per turn: a task's result goes
        into its future here (``TaskFuture.finish_pickled``: left pickled for the thread
        that reads it), one wake-up fewer per task than through the collector; the other
        events, and a future with a done-callback, are the collector's."""
        rest = []
        for event in events:
            if event[0] == "result" and isinstance(event[2], bytes):
                fut = self._futures.get(event[1])
                if fut is not None and fut.finish_pickled(event[2], event[3]):
                    self._futures.pop(event[1], None)
                    continue
            rest.append(event)
        if rest:
            self._events.put(rest)

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

    def _on_event(self, event: tuple[Any, ...] | list[Any]) -> bool:
        """One report of the loop into its future; False for the end of the reports."""
        kind, ref, data, task_id = event
        if kind == "stop":
            return False
        if kind == w.TaskEvent.STOPPED:  # a task that ended while it ran: its worker is done with it now
            stopped = self._unstopped.pop(ref, None)
            if stopped is not None:
                stopped.mark_stopped()
            return True
        fut = self._futures.get(ref)
        if fut is None:
            return True
        if kind == w.TaskEvent.STOPPING:  # its end comes next, while a worker still runs it
            fut.expect_stop()
            self._unstopped[ref] = fut
            return True
        if kind == w.TaskEvent.STARTED:
            fut.task_id = task_id
            with fut._condition:
                if fut._state == futures_base.PENDING:
                    fut.set_running_or_notify_cancel()
            return True
        if kind == w.TaskEvent.WAITING:
            fut.task_id = task_id
            fut.not_running()
            return True
        if self._futures.pop(ref, None) is None:
            return True  # another thread ended it (a refusal and a report cannot both come)
        if task_id is not None:
            fut.task_id = task_id
        try:
            self._end(fut, kind, data, task_id)
        except BaseException as err:  # this thread resolves every future: it must outlive any one report
            futures_base.LOGGER.exception("the report of task %s could not be handled", task_id)
            fail(fut, RuntimeError(f"task {task_id}: its report could not be handled: {type(err).__name__}: {err}"))
        fut.reported()
        return True

    def _end(self, fut: TaskFuture, kind: str, data: Any, task_id: str | None) -> None:
        """The end the loop reported for a task, into its future."""
        if isinstance(data, str) and kind in ("result", "raised"):
            data = base64.b64decode(data)  # from a daemon: base64 over its JSON channel
        if kind == "result":
            try:
                value = w.loads(data)
            except BaseException as err:  # a __reduce__ raising SystemExit too: this future's error alone
                fail(fut, pickle.UnpicklingError(f"task {task_id}: its result cannot be unpickled here: "
                                                  f"{type(err).__name__}: {err}"))
            else:
                resolve(fut, value)
        elif kind == "raised":
            fail(fut, remote_exception(task_id, data))
        elif kind == "error":
            fail(fut, pickle.PicklingError(data))
        elif kind == "timeout":
            line, limit = data
            fail(fut, TaskTimeoutError(line, task=task_id, timeout=limit))
        elif kind == "lost":
            fail(fut, WorkerLost(f"task {task_id}: its worker was lost: {data}", reason=data, task=task_id))
        elif kind == "unrun":
            fail(fut, WorkerLost(f"task {task_id} did not run: {data}", reason=data, task=task_id))
        elif kind == "interrupted":
            fail(fut, TaskInterrupted(f"task {task_id} was {data}", reason=data, task=task_id))
        elif kind == "cancelled":
            fut._cancelled_now()
        elif kind == "refused":
            from .protocol import raise_reply

            try:
                raise_reply(data)
            except Exception as err:
                fail(fut, err)


class _Embedded(Backend):
    """The loop in this process (an ``Orchestrator`` with its watchdog); submits do not wait."""

    def __init__(self, grace: float, logs: str | None) -> None:
        from .daemon.embedded import Orchestrator

        # A cgroup per worker where this process may make them (memory_max then is the
        # cgroup's memory.max where that controller is enabled); else process groups.
        # The workers write to this process's stdout and stderr, unless each task's output
        # is to be kept (``logs``: the workers' and each task's files there).
        self.handle = Orchestrator(grace=grace, watchdog=True, inherit_output=logs is None, cgroup="auto", logs=logs)
        self.handle.start()

    def call(self, op: str, args: Mapping[str, Any], timeout: float | None = None, *, retry: bool = True) -> Any:
        return self.handle.call(op, args, timeout)

    def submit(self, args: Submit, on_reply: Answer) -> None:
        self.handle.send("task_submit", args, on_reply)

    def ask_numbers(self, args: NumbersAsk, deliver: Callable[[list[int] | None], None]) -> None:
        self.handle.send("task_numbers", args, lambda msg: deliver(msg.get("result") if msg.get("ok") else None))

    def close(self) -> None:
        self.handle.close()


POLL_TIMEOUT = 4.0  # a poll waits 1 s in the daemon: a daemon that went away is noticed within this
_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """An embedded executor, as the standard library's: an interpreter that exits first
    lets the submitted tasks finish, then stops the workers (none is left behind). A
    daemon's: its tasks are left to the daemon (delivered first), nothing waits for them."""
    for executor in list(_LIVE):
        if isinstance(executor._backend, Remote):
            executor._leave()
        else:
            executor.shutdown(wait=True)


class Options(futures_base.Executor):
    """``Executor.options(...)``: the executor with options for the tasks submitted
    through it (its ``submit`` and ``map``; ``options()`` narrows it again). It owns
    nothing: its ``shutdown`` does nothing, the executor's own ends the pool."""

    def __init__(self, executor: Executor, place: Place, retry_on: tuple[type[BaseException], ...] = ()) -> None:
        self._executor = executor
        self._place = place  # what each task's submit carries: priority, tenant, timeout, retries, key, deadline, backoff
        self._retry_on = retry_on  # in each task's pickled call: the worker matches an exception against it

    def options(self, *, priority: int | None = None, tenant: str | None = None,
                timeout: float | None | _Pools = POOLS, retries: int | _Pools = POOLS, key: str | None = None,
                retry_on: Any = None, deadline: float | None = None,
                backoff: tuple[float, float] | None = None) -> Options:
        """This view with these options too (each one given replaces this view's)."""
        place = Place(**self._place)
        if key is not None:
            from .protocol import task_key

            try:
                place["key"] = task_key(key)
            except InvalidSpec as err:
                raise InvalidSpec(f"options(): {err}") from None
        retry_types = self._retry_on if retry_on is None else _exception_types(retry_on)
        if deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < float("inf"):
                raise ValueError(f"options(): deadline must be a number of seconds from the submit above 0, "
                                 f"got {deadline!r}")
            place["deadline"] = float(deadline)
        if backoff is not None:
            if (not isinstance(backoff, (tuple, list)) or len(backoff) != 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")
                               for v in backoff) or backoff[0] > backoff[1]):
                raise ValueError(f"options(): backoff must be (MIN, MAX) seconds with 0 <= MIN <= MAX, got {backoff!r}")
            place["backoff"] = [float(backoff[0]), float(backoff[1])]
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, int) or not -(1 << 31) <= priority < 1 << 31:
                raise TypeError(f"options(): priority must be a whole number, got {priority!r}")
            if priority or "priority" in place:
                place["priority"] = priority
        if tenant is not None:
            if not isinstance(tenant, str) or not tenant or len(tenant) > 200:
                raise TypeError(f"options(): tenant must be a name of 1 to 200 characters, got {tenant!r}")
            place["tenant"] = tenant
        if timeout is not POOLS:
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or not 0 < timeout < float("inf")):
                raise ValueError(f"options(): timeout must be a number of seconds above 0 or None, got {timeout!r}")
            place["timeout"] = timeout
        if retries is not POOLS:
            if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
                raise ValueError(f"options(): retries must be a whole number of at least 0, got {retries!r}")
            place["retries"] = retries
        return Options(self._executor, place, retry_types)

    @property
    def executor(self) -> Executor:
        """The executor this is a view of."""
        return self._executor

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> TaskFuture:
        return self._executor._submit(fn, args, kwargs, self._place, self._retry_on)

    def map(self, fn: Callable[..., Any], *iterables: Any, timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        """As ``Executor.map``, each task with this view's options (not a key: it names one task)."""
        if "key" in self._place:
            raise TypeError("map() of a view with a key: a key names one task, give each submit its own")
        return _map(super().map, fn, iterables, timeout, chunksize)

    def __repr__(self) -> str:
        shown = ", ".join([f"{k}={v!r}" for k, v in self._place.items()]
                          + [f"retry_on={self._retry_on!r}"] * bool(self._retry_on)) or "as its pool"
        return f"<options of executor {self._executor.pool}: {shown}>"


def _exception_types(raw: Any) -> tuple[type[BaseException], ...]:
    """``retry_on``: an exception type or a tuple of them (as ``except`` takes), checked
    here (TypeError, one line): the worker matches what a task raises against it."""
    found = w.exception_types(raw)
    if not found:
        raise TypeError(f"options(): retry_on must be an exception type or a tuple of them, got {raw!r}")
    return found


def _map(base: Callable[..., Iterator[Any]], fn: Callable[..., Any], iterables: tuple[Any, ...],
         timeout: float | None, chunksize: int) -> Iterator[Any]:
    """``map`` over ``base`` (the standard library's, submitting through its executor):
    ``chunksize`` items per task."""
    if chunksize < 1:
        raise ValueError("chunksize must be >= 1.")
    if chunksize == 1:
        return base(fn, *iterables, timeout=timeout)
    from .taskworker import run_chunk

    chunks = base(functools.partial(run_chunk, fn), _chunks(iterables, chunksize), timeout=timeout)
    return (result for chunk in chunks for result in chunk)


class _LoopClient:
    """The embedded loop as a ``TaskHandle`` asks of its client (the handle that follows a
    task another future of this executor had: ``_submit_keyed``)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    @property
    def paths(self) -> Paths:
        raise ValueError("an embedded executor's task logs are read with its task_log(ID), not a handle's log()")

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.loop.call(op, args, timeout)

    def close_thread(self) -> None:
        pass

    def through_restart(self, attempt: Callable[[], Any], err: OrchestratorError, window: float,
                        stop: threading.Event | None = None) -> Any:
        raise err  # the loop in this process does not come back


class Client(channel.Client):
    """``orchestrator.Client``: a running daemon's client (its commands, ``task(ID)``: see
    ``client/channel.py``), and ``executor()``, the same door to its pools as
    ``Executor(state_dir=...)``. The CLI uses the channel's ``Client`` itself: it makes no executor."""

    def executor(self, pool: str | None = None, **keywords: Any) -> Executor:
        """An ``orchestrator.Executor`` whose pool ``pool`` lives in this daemon (made, or
        joined as it runs where the keywords do not conflict: see ``Executor``): it outlives
        this client until ``delete``."""
        return Executor(state_dir=self.paths.state_dir, pool=pool, **keywords)


def _remote(state_dir: str | os.PathLike[str], reconnect_timeout: float) -> Remote:
    client = channel.Client(state_dir)
    try:
        return Remote(client, reconnect_timeout)
    except BaseException:
        client.close()
        raise


def _about(initializer: Callable[..., Any] | None, initargs: tuple[Any, ...]) -> str | None:
    """An initializer as a joiner's conflict names it: ``module.name(args)``, short."""
    if initializer is None:
        return None
    name = f"{getattr(initializer, '__module__', '?')}.{getattr(initializer, '__qualname__', repr(initializer))}"
    args = repr(tuple(initargs))
    return name + (args if len(args) <= 80 else args[:77] + "...")


def _by_value(fn: Any) -> bool:
    """Functions of ``__main__`` travel by value: a worker's ``__main__`` is not the caller's."""
    return getattr(fn, "__module__", None) == "__main__"


def _init_payload(initializer: Callable[..., Any] | None, initargs: tuple[Any, ...], *, embedded: bool) -> bytes:
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


def _chunks(iterables: tuple[Any, ...], chunksize: int) -> Iterator[tuple[Any, ...]]:
    """ProcessPoolExecutor's: the argument tuples of ``map``, ``chunksize`` at a time."""
    items = zip(*iterables)
    while chunk := tuple(itertools.islice(items, chunksize)):
        yield chunk
