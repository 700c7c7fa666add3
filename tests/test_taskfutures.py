"""TaskFuture.finish_pickled (taskfutures.py): a result the embedded loop puts into its
future itself, left pickled for the thread that reads it. No processes: the future alone,
as the loop's thread and a reader's use it."""

from __future__ import annotations

import concurrent.futures as cf
import pickle
import threading

import pytest

from orchestrator import taskwire as w
from orchestrator.taskfutures import TaskFuture


class Unpicklable:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_boom, ())


class Accepts:
    """The executor's side of a cancel: the loop took it."""

    def cancel_ref(self, ref: int) -> bool:
        return True


def _boom() -> None:
    raise SystemExit("no")


def test_a_result_is_done_at_once_and_unpickled_by_its_reader() -> None:
    fut = TaskFuture(None, 1, "px/1")
    waiter = threading.Thread(target=lambda: got.append(fut.result(timeout=10)))
    got: list[object] = []
    waiter.start()
    assert fut.finish_pickled(w.dumps({"a": [1, 2]}), "px/1")
    waiter.join(10)
    assert got == [{"a": [1, 2]}] and fut.done() and fut.exception() is None
    assert fut.wait_stopped(0)  # its end is reported: nothing runs it any more
    done, _ = cf.wait([fut], timeout=0)
    assert done == {fut}


def test_a_result_that_cannot_be_unpickled_is_the_futures_exception_both_ways() -> None:
    fut = TaskFuture(None, 2, "px/2")
    assert fut.finish_pickled(w.dumps(Unpicklable()), None)
    err = fut.exception(timeout=0)
    assert isinstance(err, pickle.UnpicklingError) and "px/2: its result cannot be unpickled here: SystemExit" in str(err)
    with pytest.raises(pickle.UnpicklingError):
        fut.result(timeout=0)


def test_not_with_a_done_callback_nor_once_cancelled() -> None:
    fut = TaskFuture(None, 3)
    fut.add_done_callback(lambda f: None)
    assert not fut.finish_pickled(w.dumps(1), None) and not fut.done()  # the collector runs callbacks
    cancelled = TaskFuture(Accepts(), 4)
    assert cancelled.cancel()
    assert not cancelled.finish_pickled(w.dumps(1), None) and cancelled.cancelled()
    later = TaskFuture(None, 5)
    assert later.finish_pickled(w.dumps(7), None)
    seen: list[object] = []
    later.add_done_callback(lambda f: seen.append(f.result()))  # added after: runs at once, here
    assert seen == [7] and not later.cancel()
