"""``Client(DIR).task(ID)``: a task of an executor pool of the daemon, found again from any
process by its id (``fut.task_id`` in the submitter, what ``submit`` prints) or by its key
(``POOL/@KEY``: the task that key names now; the handle keeps that task's id).

    handle = Client(state_dir).task("jobs/7")
    handle.info()            # its record, as `tasks --json` shows it
    handle.cancel()          # as future.cancel() in the submitter: Cancelled raised in that task alone
    handle.result(timeout)   # its value, or the exception its future raises
    handle.future()          # a concurrent.futures.Future that ends when the task does
    handle.log(lines=20)     # the last lines of its own stdout (stderr=True: its stderr)

The outcome means here what it means to the submitter's future (``Executor``): the task's
exception, ``CancelledError``, ``TaskTimeoutError``, ``WorkerLost``, ``TaskInterrupted``.
A call that finds the daemon away (a restart) waits for it, up to ``reconnect_timeout``.
"""

from __future__ import annotations

import base64
import pickle
import sys
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from .. import taskwire as w
from ..errors import (
    AWAY, InvalidSpec, OrchestratorError, TaskInterrupted, TaskTimeoutError, UnknownTask, WorkerLost,
)
from ..states import TaskState
from ..taskfutures import TaskFuture, fail, remote_exception, resolve

if TYPE_CHECKING:
    from ..paths import Paths

R = TypeVar("R")


class _Client(Protocol):
    """What a handle asks of its ``Client`` (channel.py, which makes it)."""

    @property
    def paths(self) -> Paths: ...
    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any: ...
    def close_thread(self) -> None: ...
    def through_restart(self, attempt: Callable[[], R], err: OrchestratorError, window: float,
                        stop: threading.Event | None = None) -> R: ...

WAIT_CHUNK = 30.0  # a wait is a series of bounded waits: a daemon that goes away is noticed within one


class TaskHandle:
    """See the module docstring. Made by ``Client.task`` (``client``: that ``Client``, as
    ``_Client`` names what is asked of it: this module does not import channel.py); UnknownTask (one line) if the
    daemon has no such task."""

    def __init__(self, client: _Client, task_id: str, *, reconnect_timeout: float = 30.0) -> None:
        if not isinstance(task_id, str) or "/" not in task_id:
            raise InvalidSpec(f"not a task id (POOL/N or POOL/@KEY): {task_id!r}")
        self.client = client
        self.id = task_id
        self.reconnect_timeout = reconnect_timeout
        # An unknown id is an error now, not at the first result(); a key is its task's id
        # from now on (a later task of that key, once this one's record is gone, is another).
        # An id whose submit has not reached the daemon (its submitter may hand it on at
        # once) is known there as on its way: QUEUED, cancelled or waited for at once.
        self.id = str(self.info()["id"])

    def __repr__(self) -> str:
        return f"<TaskHandle {self.id}>"

    def info(self) -> dict[str, Any]:
        """The task's record, as ``orchestrator tasks --json`` shows it (id, pool, n, state,
        attempts, worker, queued/started/ended times, reason, kind, and ``figures``: what it
        took in its worker, ``TaskFuture.info`` says what each is)."""
        (row,) = self._call("tasks", {"id": self.id})
        return dict(row)

    def cancel(self) -> bool:
        """Cancel the task, as ``future.cancel()`` does in the submitter: True if it is
        cancelled (now, or before: a running one gets ``Cancelled`` raised in it alone, and
        the submitter's future ends cancelled), False if it had ended otherwise (its result
        stands). It returns before the task's cleanup ran: ``result()`` then raises
        CancelledError at once, ``info()["ended_at"]`` says when it was cancelled."""
        (cancelled,) = self._call("task_cancel", {"ids": [self.id]})
        return bool(cancelled)

    def result(self, timeout: float | None = None) -> Any:
        """The task's value once it has ended, or the exception its future raises;
        TimeoutError if it has not ended within ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_CHUNK if deadline is None else max(0.0, min(WAIT_CHUNK, deadline - time.monotonic()))
            got = self._call("task_result", {"id": self.id, "wait": True, "timeout": left}, timeout=left + 10.0)
            if TaskState(got["state"]).terminal:
                return outcome_value(got)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"task {self.id} has not ended within {timeout:g} s (it is {got['state']})")

    def log(self, *, stderr: bool = False, lines: int | None = None) -> list[str]:
        """The last ``lines`` lines (None: all) of the task's own stdout (``stderr``: its
        stderr), read from the daemon's files (``orchestrator logs ID``); [] if it has
        written nothing yet. Its log lives as long as its record."""
        from ..logread import tail

        return tail(self.client.paths.logs, self.id, stream="err" if stderr else "out",
                    lines=sys.maxsize if lines is None else lines)

    def future(self) -> TaskFuture:
        """A ``concurrent.futures.Future`` of the task: it ends when the task does, as the
        submitter's future would (its ``cancel()`` is this handle's). A thread of this
        process waits for it."""
        fut = TaskFuture(_HandleCanceller(self), 0, self.id)
        fut.set_running_or_notify_cancel()
        threading.Thread(target=self._resolve, args=(fut,), name=f"task-{self.id}", daemon=True).start()
        return fut

    def _resolve(self, fut: Any) -> None:
        try:
            value = self.result()
        except CancelledError:
            fut._cancelled_now()
            fut.reported()
        except BaseException as err:  # the task's exception, or the daemon's: the future's either way
            fail(fut, err)
        else:
            resolve(fut, value)
        finally:
            self.client.close_thread()

    def _call(self, op: str, args: dict[str, Any], timeout: float | None = None) -> Any:
        try:
            return self.client.call(op, args, timeout)
        except AWAY as err:
            return self.client.through_restart(lambda: self.client.call(op, args, timeout), err,
                                               self.reconnect_timeout)


class _HandleCanceller:
    """What a handle's future cancels through."""

    def __init__(self, handle: TaskHandle) -> None:
        self.handle = handle

    def cancel_ref(self, ref: int) -> bool:
        return self.handle.cancel()

    def task_info(self, task_id: str) -> dict[str, Any]:
        return self.handle.info()


def outcome_value(got: dict[str, Any]) -> Any:
    """An ended task's outcome (``task_result``'s answer) as its future ends: its value, or
    the exception raised here."""
    task_id, state, kind, reason = got["id"], TaskState(got["state"]), got.get("kind"), got.get("reason") or ""
    data = base64.b64decode(got["result"]) if got.get("result") else b""
    if state is TaskState.DONE:
        try:
            return w.loads(data)
        except Exception as err:
            raise pickle.UnpicklingError(f"task {task_id}: its result cannot be unpickled here: "
                                         f"{type(err).__name__}: {err}") from None
    if state is TaskState.CANCELLED:
        raise CancelledError()
    if state is TaskState.TIMED_OUT:
        raise TaskTimeoutError(reason, task=task_id, timeout=got.get("timeout"))
    if kind == "raised" and data:
        raise remote_exception(task_id, data)
    if kind == "error":
        raise pickle.PicklingError(reason)
    if kind == "interrupted":
        raise TaskInterrupted(f"task {task_id} was {reason}", reason=reason, task=task_id)
    if kind == "unrun":
        raise WorkerLost(f"task {task_id} did not run: {reason}", reason=reason, task=task_id)
    raise WorkerLost(f"task {task_id}: its worker was lost: {reason}", reason=reason, task=task_id)
