"""The client's side of a task's future: ``TaskFuture`` (a standard ``Future`` whose
``cancel()`` also reaches a task that runs), how the loop's report of a task's end goes into
it (``resolve``, ``fail``), and an exception from a worker with its traceback's text
(``remote_exception``). Shared by the executor (executor.py) and a task found again by id
(client/taskhandle.py).
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as futures_base
from typing import Any, Callable, Protocol

from . import taskwire as w
from .errors import UnknownTask


class RemoteTraceback(Exception):
    """The text of an exception's traceback in the worker, as its ``__cause__``."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


_ENDED = (futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED, futures_base.FINISHED)


class Canceller(Protocol):
    """What a future's ``cancel()`` and ``info()`` ask: the executor (or a task handle) that
    made it."""

    def cancel_ref(self, ref: int) -> bool: ...
    def task_info(self, task_id: str) -> dict[str, Any]: ...


class TaskFuture(Future[Any]):
    """A standard Future whose ``cancel()`` also reaches a task that runs."""

    def __init__(self, executor: Canceller | None, ref: int, task_id: str | None = None) -> None:
        super().__init__()
        self._executor: Canceller | None = executor
        self._ref = ref
        # The task's id (``<pool>/<n>``), set by ``submit`` before it returns: any process
        # finds the task again with it (``Client(DIR).task(ID)``). None for a future that
        # failed before its task was made (it could not be pickled).
        self.task_id: str | None = task_id

    # Whether the loop's report of the task's end has been taken in (a cancel() ends the
    # future first), and whether a worker still runs the task then (its "stopping").
    _reported = False
    _stop_pending = False

    def info(self) -> dict[str, Any]:
        """Its task's record, as ``Client(DIR).task(fut.task_id).info()`` and ``orchestrator
        tasks --json`` show it: state, attempts, worker, times, reason, and once a worker
        answered for it its ``figures``, what it took there: ``wall`` and ``cpu`` seconds
        (user + system, its child processes' included), ``peak_rss`` bytes (its worker's
        own peak while it ran, not the worker's lifetime peak), ``children_peak_rss`` (or
        None); a task that ran more than once (Retry, retry_on) has its attempts' added
        (the peaks: the largest). One call to the loop (embedded: while the executor is open, for the latest
        1,000 ended tasks; a daemon's store keeps more). A task cancelled or timed out while
        it ran has its figures once ``wait_stopped()`` returned. UnknownTask: no record
        (a future whose task was never made, or ended long ago)."""
        if self.task_id is None or self._executor is None:
            raise UnknownTask("this future has no task (its call could not be pickled)")
        return self._executor.task_info(self.task_id)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait until no worker runs this future's task any more; True if so (False: the
        timeout passed). ``cancel()`` returns once the task is cancelled, while the task's
        cleanup (its ``finally:`` blocks) may still run in its worker: this returns once the
        worker has answered for it, or its tree was killed after ``grace``. At once for a
        task that ended on its own; for one that had not started (one held by a busy worker
        never starts once it is cancelled), once the loop has said so."""
        with self._condition:
            return self._condition.wait_for(self._stopped, timeout)

    def _stopped(self) -> bool:
        # Done too: resolve and fail mark it reported just before they set its state.
        return self._reported and not self._stop_pending and self._state in _ENDED

    def expect_stop(self) -> None:
        """Its task ends while a worker still runs it: ``wait_stopped`` waits for ``mark_stopped``."""
        with self._condition:
            self._stop_pending = True

    def reported(self) -> None:
        """The loop's report of its task's end (or this side's own failure of it) is in."""
        if not self._reported:  # resolve and fail mark it, and their state's change notifies
            self._tell_reported()

    def _tell_reported(self) -> None:
        with self._condition:
            self._reported = True
            self._condition.notify_all()

    def mark_stopped(self) -> None:
        with self._condition:
            self._reported, self._stop_pending = True, False
            self._condition.notify_all()

    def finish_pickled(self, data: bytes, task_id: str | None) -> bool:
        """Its task's result, ``data`` still pickled: the future is done now (from the
        embedded loop's thread, with no hop through the collector), its value unpickled
        by the first thread that reads it (``result``, ``exception``: user code never runs
        in the loop). Only while nothing is to run at its end: False if a done-callback
        was added (those run in the collector, which resolves it then) or it is no longer
        pending (a cancel came first)."""
        with self._condition:
            if self._done_callbacks or self._state not in _OPEN:  # type: ignore[attr-defined]
                return False
            if task_id is not None:
                self.task_id = task_id
            self._reported = True
            self._result = _Pickled(data)
            self._state = futures_base.FINISHED
            for waiter in self._waiters:
                waiter.add_result(self)
            self._condition.notify_all()
        return True

    def result(self, timeout: float | None = None) -> Any:
        value = super().result(timeout)
        if isinstance(value, _Pickled):
            self._unpickle()
            return super().result(0)
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        err = super().exception(timeout)
        if err is None and isinstance(self._result, _Pickled):
            self._unpickle()
            return super().exception(0)
        return err

    def _unpickle(self) -> None:
        """A result left pickled by ``finish_pickled``, unpickled once; one that cannot be
        is this future's exception, as the collector makes it (executor._end)."""
        with self._condition:
            held = self._result
            if not isinstance(held, _Pickled):
                return  # another thread did it
            try:
                self._result = w.loads(held.data)
            except BaseException as err:  # a __reduce__ raising SystemExit too: this future's error
                self._result = None
                self._exception = pickle.UnpicklingError(
                    f"task {self.task_id}: its result cannot be unpickled here: {type(err).__name__}: {err}")

    def not_running(self) -> None:
        """Its task waits for its time (``Retry``, ``retry_on``) on no worker: pending again,
        as a queued one is, until it starts again."""
        with self._condition:
            if self._state == futures_base.RUNNING:
                self._state = futures_base.PENDING

    def cancel(self) -> bool:
        with self._condition:
            if self._state in (futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED):
                return True
            if self._state == futures_base.FINISHED:
                return False
        executor = self._executor
        if executor is None or not executor.cancel_ref(self._ref):
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


class _Pickled:
    """A task's result as its worker pickled it, until a reader unpickles it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


_OPEN = (futures_base.PENDING, futures_base.RUNNING)


def resolve(fut: Future[Any], value: Any) -> None:
    """The result of ``fut``'s task (a TaskFuture: reported, see ``TaskFuture.reported``)."""
    _set(fut, fut.set_result, value)


def fail(fut: Future[Any], err: BaseException) -> None:
    """As ``resolve``, with the task's exception."""
    _set(fut, fut.set_exception, err)


def _set(fut: Future[Any], setter: Callable[[Any], None], value: Any) -> None:
    ours = fut if isinstance(fut, TaskFuture) else None
    if ours is not None:
        # Marked first: the setter's own notify wakes wait_stopped (one lock and notify per
        # task, not two: a tiny task's collector pays for each).
        ours._reported = True
    try:
        setter(value)
    except InvalidStateError:  # cancelled in the meantime: a cancel that was accepted stands
        if ours is not None:
            ours._tell_reported()  # no change of state notified it


def remote_exception(task_id: str | None, data: bytes) -> BaseException:
    try:
        exc, tb = w.loads(data)
    except BaseException as err:  # SystemExit from a __reduce__ too: this future's error, not the collector's end
        return pickle.UnpicklingError(f"task {task_id}: its exception cannot be unpickled here: "
                                      f"{type(err).__name__}: {err}")
    if isinstance(exc, BaseException):
        exc.__cause__ = RemoteTraceback(tb)
        return exc
    return RuntimeError(f"task {task_id} raised {exc!r}")
