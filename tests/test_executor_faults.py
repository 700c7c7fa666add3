"""orchestrator.Executor where a value or a callback misbehaves, and the standard
library's gaps: a deserialization or callback fault (SystemExit, KeyboardInterrupt, any
BaseException) fails that one future, never the executor; a worker that cannot pickle a
result lives on; a Ctrl-C in ``submit`` leaves no future behind; a manager's proxy works in
a worker (embedded and in the daemon); a ``multiprocessing.Queue`` in ``initargs`` is
refused in one line that says what to use; an instance of a class of the caller's
``__main__`` travels by value; ``map`` honours ``chunksize`` as ProcessPoolExecutor does."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import multiprocessing.managers
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import multiprocess  # type: ignore[import-untyped]
import multiprocess.managers  # type: ignore[import-untyped]
import pytest

import faultfns
import taskfns
from conftest import TAG_VAR
from helpers import wait_for
from helpers import DaemonUnderTest, cli
from orchestrator import Client, Executor, WorkerLost
from test_executor import MakeExecutor, any_executor, make_executor  # noqa: F401  (fixtures)

KINDS = ["SystemExit", "KeyboardInterrupt", "GeneratorExit"]


# -- item 10: a fault fails that one future ---------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_result_or_exception_whose_unpickling_raises_fails_that_future_alone(make_executor: MakeExecutor,
                                                                               kind: str) -> None:
    """The collector thread unpickles every result: a BaseException there must fail that
    future and leave it running for the others, submitted before and after."""
    ex = make_executor(max_workers=2)
    slow = ex.submit(taskfns.sleep_then, 0.5, "slow")  # ends after the bad one: its report comes later
    bad = ex.submit(faultfns.returns_unloadable, kind)
    with pytest.raises(pickle.UnpicklingError, match=rf"task \S+: its result cannot be unpickled here: {kind}"):
        bad.result(timeout=30)
    bad_exc = ex.submit(faultfns.raises_unloadable, kind)
    with pytest.raises(pickle.UnpicklingError, match=rf"task \S+: its exception cannot be unpickled here: {kind}"):
        bad_exc.result(timeout=30)
    assert slow.result(timeout=30) == "slow"
    assert [f.result(timeout=30) for f in [ex.submit(taskfns.square, i) for i in range(4)]] == [0, 1, 4, 9]
    worker = ex.submit(faultfns.pid).result(timeout=30)
    in_worker = ex.submit(faultfns.returns, faultfns.ExplodesOnLoad(kind)).exception(timeout=30)
    assert type(in_worker) is faultfns._EXCEPTIONS[kind]  # the task's exception there, as one it raised
    assert ex.submit(faultfns.pid).result(timeout=30) == worker


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "ValueError"])
def test_a_done_callback_that_raises_is_logged_as_the_standard_library_does(make_executor: MakeExecutor,
                                                                            caplog: pytest.LogCaptureFixture,
                                                                            kind: str) -> None:
    ex = make_executor(max_workers=1)
    seen: list[str] = []
    fut = ex.submit(taskfns.sleep_then, 0.2, "value")

    def bad(f: cf.Future) -> None:
        seen.append("bad")
        faultfns._raise(kind)

    fut.add_done_callback(bad)
    fut.add_done_callback(lambda f: seen.append(f.result()))  # the next callback still runs
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        assert fut.result(timeout=30) == "value"
        assert ex.submit(taskfns.square, 3).result(timeout=30) == 9  # the collector lives on
        # As in the standard library, result() may return before the callbacks have run
        # (they run after the waiters are woken, in the thread that set the result).
        wait_for(lambda: len(seen) == 2, 30, "the second callback")
    assert seen == ["bad", "value"]
    logged = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert len(logged) == 1 and logged[0].getMessage().startswith("exception calling callback for <")
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is faultfns._EXCEPTIONS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_a_result_or_exception_whose_pickling_raises_fails_its_task_and_the_worker_lives(
        make_executor: MakeExecutor, kind: str) -> None:
    ex = make_executor(max_workers=1)
    worker = ex.submit(faultfns.pid).result(timeout=30)
    with pytest.raises(pickle.PicklingError, match=f"its result .ExplodesOnDump. cannot be pickled: {kind}"):
        ex.submit(faultfns.returns_undumpable, kind).result(timeout=30)
    with pytest.raises(pickle.PicklingError, match=f"it raised DumpError: {kind}, which cannot be pickled .{kind}"):
        ex.submit(faultfns.raises_undumpable, kind).result(timeout=30)
    assert ex.submit(faultfns.pid).result(timeout=30) == worker


def test_sigterm_while_a_result_is_pickled_still_ends_the_worker(make_executor: MakeExecutor) -> None:
    """``Terminated`` (the worker's SIGTERM) raised in the result's pickling is not the
    task's error: the worker ends, as it does anywhere else, and is replaced."""
    ex = make_executor(max_workers=1)
    worker = ex.submit(faultfns.pid).result(timeout=30)
    with pytest.raises(WorkerLost):
        ex.submit(faultfns.returns_undumpable, "Terminated").result(timeout=30)
    assert ex.submit(faultfns.pid).result(timeout=30) != worker


@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit"])
def test_a_ctrl_c_while_submit_pickles_reaches_the_caller_and_leaves_no_future(make_executor: MakeExecutor,
                                                                               kind: str) -> None:
    ex = make_executor(max_workers=1)
    with pytest.raises(faultfns._EXCEPTIONS[kind]):
        ex.submit(faultfns.returns, faultfns.ExplodesOnDump(kind))
    broken = ex.submit(faultfns.returns, faultfns.ExplodesOnDump("ValueError"))  # an Exception: that future's
    with pytest.raises(pickle.PicklingError, match="the task cannot be pickled: ValueError"):
        broken.result(timeout=5)
    assert ex.submit(taskfns.square, 4).result(timeout=30) == 16
    closer = threading.Thread(target=ex.shutdown, kwargs={"wait": True})
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "shutdown waits for the future the interrupted submit made"


# -- item 11: a manager's proxy, a Queue in initargs --------------------------------------------

def test_the_workers_have_the_callers_authkey(any_executor: Callable[..., cf.Executor]) -> None:  # noqa: F811
    """As a forked (or spawned) child of the caller: ``current_process().authkey`` in a task
    is the caller's, what a manager started here and reached by address needs."""
    with any_executor(max_workers=1) as ex:
        assert ex.submit(faultfns.authkey).result(timeout=30) == bytes(multiprocessing.current_process().authkey)


@pytest.mark.parametrize("package", ["multiprocessing", "multiprocess"])
def test_a_managers_proxy_as_an_argument_works_in_the_worker(make_executor: MakeExecutor, package: str) -> None:
    ex = make_executor(max_workers=1)
    with _manager(package) as manager:
        shared = manager.dict()
        worker = ex.submit(faultfns.store, shared, "answer", 42).result(timeout=30)
        assert worker != os.getpid() and dict(shared) == {"answer": 42}
        items = manager.list()
        assert list(ex.map(faultfns.append, [items] * 3, "abc", timeout=30)) == [1, 2, 3]
        assert list(items) == ["a", "b", "c"]
        keyed = _manager(package, authkey=b"not this process's key")
        with keyed:
            other = keyed.list()
            assert ex.submit(faultfns.append, other, "x").result(timeout=30) == 1  # its own key travels with it


def test_a_managers_queue_in_initargs_takes_the_workers_logs(make_executor: MakeExecutor) -> None:
    """The logging cookbook's pattern, with what works here: a QueueHandler in each worker
    on a ``Manager().Queue()`` (a ``multiprocessing.Queue`` is refused, below)."""
    with multiprocessing.Manager() as manager:
        logs = manager.Queue()
        ex = make_executor(max_workers=2, initializer=faultfns.log_to, initargs=(logs,))
        pids = {ex.submit(faultfns.log, f"request {i}").result(timeout=30) for i in range(4)}
        records = [logs.get(timeout=30) for _ in range(4)]
        assert sorted(r.getMessage() for r in records) == [f"request {i}" for i in range(4)]
        assert {r.process for r in records} == pids
        ex.shutdown(wait=True)


def test_a_multiprocessing_queue_in_initargs_is_refused_in_one_line(make_executor: MakeExecutor) -> None:
    """Our workers are forked from the pool's spawner, not from the caller: a
    ``multiprocessing.Queue`` (its pipe and semaphores are inherited or nothing) cannot
    reach them. Refused at ``Executor()``, saying what to use instead."""
    for ctx in (multiprocessing, multiprocess):
        queue = ctx.Queue()
        with pytest.raises(pickle.PicklingError) as info:
            make_executor(max_workers=1, initializer=faultfns.log_to, initargs=(queue,))
        line = str(info.value)
        assert "\n" not in line and "Queue objects should only be shared" in line
        assert "Manager().Queue()" in line
        queue.close()
        queue.join_thread()
    ex = make_executor(max_workers=1)  # the same, for a task's argument: that future's error
    queue = multiprocessing.Queue()
    with pytest.raises(pickle.PicklingError, match=r"the task cannot be pickled: .*Manager\(\)\.Queue\(\)"):
        ex.submit(faultfns.returns, queue).result(timeout=5)
    queue.close()
    queue.join_thread()


def test_a_managers_proxy_works_in_a_daemons_pool_for_each_client(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    """The daemon's pool serves clients with other authkeys (another process, a restarted
    app): each proxy carries its own manager's key, and the daemon never unpickles it."""
    daemon.start()
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, sys
        import multiprocess
        import faultfns
        from orchestrator import Client

        if __name__ == "__main__":
            with Client({str(daemon.state_dir)!r}) as client, client.executor("jobs", max_workers=1) as ex:
                for manager in (multiprocessing.Manager(), multiprocess.Manager()):
                    with manager:
                        shared = manager.dict()
                        ex.submit(faultfns.store, shared, "from", sys.argv[1]).result(timeout=30)
                        print(shared["from"], end=" ")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in ("first", "second"):  # two processes: two authkeys, one pool
        done = subprocess.run([sys.executable, str(script), name], capture_output=True, text=True, timeout=90,
                              env=env, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [name, name]
    with Client(daemon.state_dir) as client, multiprocessing.Manager() as manager:
        logs = manager.Queue()  # the logging cookbook's queue, in a daemon's pool's initargs
        with client.executor("logged", max_workers=1, initializer=faultfns.log_to, initargs=(logs,)) as logged:
            logged.submit(faultfns.log, "in the daemon").result(timeout=30)
            assert logs.get(timeout=30).getMessage() == "in the daemon"
            # What a daemon client's poller unpickles: a fault there fails that future alone.
            with pytest.raises(pickle.UnpicklingError, match="its result cannot be unpickled here: SystemExit"):
                logged.submit(faultfns.returns_unloadable, "SystemExit").result(timeout=30)
            assert logged.submit(taskfns.square, 5).result(timeout=30) == 25
    for pool in ("jobs", "logged"):
        assert cli(daemon.state_dir, "delete", pool).returncode == 0


# -- item 11: __main__'s classes, map's chunksize -----------------------------------------------

def test_an_instance_of_a_class_of_the_scripts_main_travels_by_value(tmp_path: Path, orch_test_tag: str) -> None:
    """A function of a module (here copy.deepcopy, and those of faultfns) given an instance
    of a class the script defines: pickle names ``__main__.Point``, which a worker's
    ``__main__`` does not have; by value it arrives, and what comes back (a result, however
    deep in it, or an exception) is of the caller's own class, as from a forked worker."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import copy
        import faultfns
        from orchestrator import Executor

        class Point:
            def __init__(self, x):
                self.x = x

        class Oops(Exception):
            pass

        if __name__ == "__main__":
            with Executor(max_workers=1, env={{{TAG_VAR!r}: {orch_test_tag!r}}}) as ex:
                back = ex.submit(copy.deepcopy, Point(7)).result(timeout=30)
                print(type(back) is Point, back.x)
                same = ex.submit(faultfns.returns, [Point(1), {{"p": Point(2)}}]).result(timeout=30)
                print(type(same[0]) is Point and type(same[1]["p"]) is Point, same[0].x + same[1]["p"].x)
                print(list(ex.map(faultfns.returns, [Point(3), Point(4)], chunksize=2, timeout=30))[1].x)
                try:
                    ex.submit(faultfns.raise_it, Oops("raised there")).result(timeout=30)
                except Oops as err:
                    print("caught", err)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True 7", "True 3", "4", "caught raised there"]


def test_only_what_names_main_goes_by_dill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common case stays plain pickle (the scan for ``__main__`` is all it costs)."""
    from orchestrator import taskwire

    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    Point.__module__, Point.__qualname__ = "__main__", "Point"  # as a class of a script run as a program
    monkeypatch.setattr(sys.modules["__main__"], "Point", Point, raising=False)  # where pickle finds it
    assert taskwire.dumps((taskfns.square, (list(range(1000)),), {}))[:1] == b"p"
    assert taskwire.dumps((taskfns.square, (Point(1),), {}))[:1] == b"d"
    assert type(taskwire.loads(taskwire.dumps(Point(1)))) is Point


def test_map_chunksize_is_checked_and_honoured_as_the_standard_library_does(
        any_executor: Callable[..., cf.Executor]) -> None:  # noqa: F811
    with any_executor(max_workers=1) as ex:
        with pytest.raises(ValueError, match=r"^chunksize must be >= 1\.$"):
            ex.map(faultfns.arrived_by_then, range(3), chunksize=0)
        items = [faultfns.Arrives(i) for i in range(7)]
        # One task per chunk: a task's items arrive in the worker together, before any runs.
        assert list(ex.map(faultfns.arrived_by_then, items, chunksize=3, timeout=60)) == [
            (0, 2), (1, 2), (2, 2), (3, 5), (4, 5), (5, 5), (6, 6)]
        assert list(ex.map(faultfns.arrived_by_then, items[:3], timeout=60)) == [(0, 0), (1, 1), (2, 2)]
        assert list(ex.map(taskfns.square, [], chunksize=4)) == []
        assert list(ex.map(pow, [2, 3], [5, 2], chunksize=5, timeout=60)) == [32, 9]  # several iterables
        with pytest.raises(ValueError, match="boom"):
            list(ex.map(taskfns.fail, ["boom"], chunksize=2, timeout=60))


def test_map_timeout_counts_from_the_call(any_executor: Callable[..., cf.Executor]) -> None:  # noqa: F811
    with any_executor(max_workers=2) as ex:
        ex.submit(taskfns.square, 1).result(timeout=60)  # the workers are up: the timeout is the tasks'
        start = time.monotonic()
        results = ex.map(taskfns.sleep_then, [0.0, 0.0, 6.0], ["a", "b", "c"], chunksize=2, timeout=1.5)
        assert next(results) == "a" and next(results) == "b"
        with pytest.raises(cf.TimeoutError):
            next(results)
        assert 1.5 <= time.monotonic() - start < 5  # not the task's 6 s


# -- helpers -------------------------------------------------------------------------------------

def _manager(package: str, authkey: bytes | None = None) -> Any:
    return (multiprocessing if package == "multiprocessing" else multiprocess).managers.SyncManager(authkey=authkey)
