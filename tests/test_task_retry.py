"""Retry later, end to end, embedded and in a daemon (daemon/taskwait.py; the racy timing
is on the fake too: test_taskwait_fake.py): ``raise Retry(after=)`` parks a task holding no
worker (a one-worker pool runs another task meanwhile), ``WAITING`` with its reason and time
in the task's record; a ``deadline`` ends a waiting and a running task ``TIMED_OUT``;
``retry_on`` re-runs with backoff and raises the last exception after ``retries``; bad input
is refused in one line; a parked task survives a daemon's restart."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import retryfns
from conftest import TAG_VAR
from helpers import TESTS, DaemonUnderTest, cli, cli_env, wait_for
from orchestrator import Client, Executor, Retry, TaskTimeoutError
from test_executor import MakeExecutor, make_executor  # noqa: F401  # the fixture


@dataclass
class Pool:
    """A one-worker executor of either mode, and how to read a task's record there."""

    ex: Executor
    info: Callable[[str], dict[str, Any]]
    daemon: DaemonUnderTest | None


@pytest.fixture(params=["embedded", "daemon"])
def pool(request: pytest.FixtureRequest, make_executor: MakeExecutor) -> Iterator[Pool]:
    if request.param == "embedded":
        ex = make_executor(1, cwd=str(TESTS))
        yield Pool(ex, lambda task_id: ex.orchestrator.call("tasks", {"id": task_id})[0], None)
        return
    daemon: DaemonUnderTest = request.getfixturevalue("daemon")
    daemon.start()
    ex = make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS), env={TAG_VAR: cli_env()[TAG_VAR]})
    with Client(daemon.state_dir) as client:
        yield Pool(ex, lambda task_id: client.task(task_id).info(), daemon)


def waiting(pool: Pool, task_id: str | None, log: str) -> dict[str, Any]:
    """The task's record once it is WAITING (bounded). Asked once its first attempt began
    (``log``): a daemon's client sends its submits in batches, and the daemon does not
    know a task whose submit has not reached it yet."""
    assert task_id is not None
    rows: list[dict[str, Any]] = []
    wait_for(lambda: bool(retryfns.starts(log)), 60, f"{task_id} to start")

    def parked() -> bool:
        rows[:] = [pool.info(task_id)]
        return rows[0]["state"] == "WAITING"

    wait_for(parked, 60, f"{task_id} to wait")
    return rows[0]


def test_a_parked_task_holds_no_worker_and_runs_again_at_its_time(pool: Pool, tmp_path: Path) -> None:
    log = str(tmp_path / "parked.log")
    parked = pool.ex.submit(retryfns.park_once, log, 4.0, "the upstream is rate limited")
    row = waiting(pool, parked.task_id, log)
    assert row["wait_reason"] == "the upstream is rate limited" and row["waits"] == 1
    (first,) = retryfns.starts(log)
    assert first + 4.0 <= row["wait_until"] < time.time() + 4.0
    if pool.daemon is not None:  # what `tasks` shows of it, while the daemon runs
        (shown,) = [r for r in json.loads(cli(pool.daemon.state_dir, "tasks", "--json").stdout)
                    if r["id"] == parked.task_id]
        assert (shown["state"], shown["waiting"], shown["wait_until"]) == (
            "WAITING", "the upstream is rate limited", row["wait_until"])
        table = cli(pool.daemon.state_dir, "tasks").stdout
        assert "waiting until" in table and "the upstream is rate limited" in table
    # The pool's one worker is free: another task runs and ends while the first one waits.
    assert pool.ex.submit(retryfns.now).result(timeout=30) < row["wait_until"]
    assert pool.info(parked.task_id)["state"] == "WAITING"
    began = parked.result(timeout=60)
    assert began >= row["wait_until"] - 0.05  # not before its time (the host's one wall clock)
    done = pool.info(parked.task_id)
    assert (done["state"], done["attempts"], done["wait_until"]) == ("DONE", 2, None)


def test_a_deadline_ends_a_waiting_task(pool: Pool, tmp_path: Path) -> None:
    log = str(tmp_path / "never.log")
    fut = pool.ex.options(deadline=2.0).submit(retryfns.always_park, log, 0.5)
    err = fut.exception(timeout=60)
    assert isinstance(err, TaskTimeoutError) and "passed its deadline of 2 s" in str(err)
    starts = retryfns.starts(log)
    assert len(starts) >= 2 and starts[-1] - starts[0] < 2.0  # it ran again while time remained
    assert fut.task_id is not None and pool.info(fut.task_id)["state"] == "TIMED_OUT"


def test_a_deadline_ends_a_running_task_with_the_timeouts_exception(pool: Pool) -> None:
    began = time.monotonic()
    fut = pool.ex.options(deadline=1.0).submit(retryfns.sleep, 60)
    err = fut.exception(timeout=60)
    assert isinstance(err, TaskTimeoutError) and "passed its deadline of 1 s" in str(err)
    assert time.monotonic() - began < 30
    # TaskTimeout was raised in it: its worker stopped it and takes the next task.
    assert pool.ex.submit(retryfns.sleep, 0).result(timeout=30) == 0


def test_retry_on_reruns_with_backoff_and_raises_the_last_exception(pool: Pool, tmp_path: Path) -> None:
    view = pool.ex.options(retry_on=(ConnectionError,), retries=3, backoff=(0.4, 0.8))
    log = str(tmp_path / "flaky.log")
    assert view.submit(retryfns.flaky, log, 2).result(timeout=60) == 3
    starts = retryfns.starts(log)
    assert len(starts) == 3 and all(b - a >= 0.4 for a, b in zip(starts, starts[1:]))  # at least MIN apart
    log = str(tmp_path / "hopeless.log")
    with pytest.raises(ConnectionError, match="attempt 4"):  # the last of 1 + 3 attempts
        view.submit(retryfns.flaky, log, 10).result(timeout=60)
    assert len(retryfns.starts(log)) == 4
    log = str(tmp_path / "other.log")
    with pytest.raises(ValueError, match="not a connection problem"):  # not of retry_on: no re-run
        view.submit(retryfns.wrong, log).result(timeout=60)
    assert len(retryfns.starts(log)) == 1


def test_bad_input_is_refused_in_one_line(pool: Pool) -> None:
    ex = pool.ex
    for kwargs, error in (({"deadline": 0}, ValueError), ({"deadline": -1}, ValueError),
                          ({"deadline": "soon"}, ValueError), ({"backoff": (2, 1)}, ValueError),
                          ({"backoff": (-1, 1)}, ValueError), ({"backoff": 1}, ValueError),
                          ({"retry_on": 42}, TypeError), ({"retry_on": ("ConnectionError",)}, TypeError),
                          ({"retry_on": ()}, TypeError)):
        with pytest.raises(error) as got:
            ex.options(**kwargs)
        assert "\n" not in str(got.value) and list(kwargs)[0] in str(got.value)
    for after in (-1, "soon", float("nan")):
        with pytest.raises(ValueError, match="Retry: after must be a number of seconds") as got:
            Retry(after=after)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="Retry: after must be"):  # raised in the task: the task fails
            ex.submit(retryfns.bad_retry, after).result(timeout=60)


def park_in_a_daemon(daemon: DaemonUnderTest, make_executor: MakeExecutor, log: str,
                     reason: str) -> tuple[Future[Any], dict[str, Any]]:
    """A started daemon's one-worker pool with a task parked for 6 s (deadline 600 s): its
    future, and its record once it waits."""
    daemon.start()
    ex = make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS), env={TAG_VAR: cli_env()[TAG_VAR]})
    parked = ex.options(deadline=600).submit(retryfns.park_once, log, 6.0, reason)
    with Client(daemon.state_dir) as client:
        return parked, waiting(Pool(ex, lambda task_id: client.task(task_id).info(), daemon), parked.task_id, log)


def test_a_parked_task_survives_a_daemon_restart(daemon: DaemonUnderTest, make_executor: MakeExecutor,
                                                 tmp_path: Path) -> None:
    log = str(tmp_path / "parked.log")
    parked, row = park_in_a_daemon(daemon, make_executor, log, "come back later")
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    stored = json.loads(cli(daemon.state_dir, "tasks", "--json").stdout)  # the daemon down: as the store has it
    assert [(r["id"], r["state"], r["wait_reason"], r["deadline"], r["wait_until"]) for r in stored] == [
        (row["id"], "WAITING", "come back later", 600.0, row["wait_until"])]
    daemon.start()
    began = parked.result(timeout=90)  # the client reconnected; the restarted daemon ran it at its time
    assert began >= row["wait_until"] - 0.05 and len(retryfns.starts(log)) == 2


def test_a_parked_task_waits_on_across_an_upgrade(daemon: DaemonUnderTest, make_executor: MakeExecutor,
                                                  tmp_path: Path) -> None:
    log = str(tmp_path / "parked.log")
    parked, row = park_in_a_daemon(daemon, make_executor, log, "after the upgrade")
    got = cli(daemon.state_dir, "upgrade")
    assert got.returncode == 0, got.stderr
    with Client(daemon.state_dir) as client:
        after = client.task(row["id"]).info()
    assert after["state"] in ("WAITING", "QUEUED", "RUNNING", "DONE")  # its time may have come meanwhile
    if after["state"] == "WAITING":
        assert (after["wait_until"], after["wait_reason"]) == (row["wait_until"], "after the upgrade")
    began = parked.result(timeout=90)  # the new image queued it at its time
    assert began >= row["wait_until"] - 0.05 and len(retryfns.starts(log)) == 2


def test_the_command_lines_deadline_bounds_a_targets_waits(daemon: DaemonUnderTest, make_executor: MakeExecutor,
                                                          tmp_path: Path) -> None:
    daemon.start()
    make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS), env={TAG_VAR: cli_env()[TAG_VAR]})
    log = str(tmp_path / "never.log")
    bad = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "retryfns:now", "--deadline", "0")
    assert bad.returncode == 2 and "--deadline: must be more than 0" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    got = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "retryfns:always_park", "--arg",
              json.dumps(log), "--arg", "0.3", "--deadline", "1.5", "--wait", "--json")
    assert got.returncode == 1, got.stderr
    outcome = json.loads(got.stdout)
    assert outcome["state"] == "TIMED_OUT" and "passed its deadline of 1.5 s" in outcome["reason"]
    assert len(retryfns.starts(log)) >= 2  # it waited and ran again until its deadline


def test_a_waiting_tasks_future_is_not_running_and_cancels_as_a_queued_ones(pool: Pool, tmp_path: Path) -> None:
    log = str(tmp_path / "parked.log")
    fut = pool.ex.submit(retryfns.always_park, log, 60.0)
    waiting(pool, fut.task_id, log)
    # The future hears of the wait just after the record says it (the same turn of the loop).
    wait_for(lambda: not fut.running(), 10, "its future not to be running")
    assert not fut.done()
    assert fut.cancel() and fut.cancelled()
    assert fut.task_id is not None
    wait_for(lambda: pool.info(fut.task_id)["state"] == "CANCELLED", 30, "its record to say CANCELLED")
    assert len(retryfns.starts(log)) == 1  # it never ran again


def test_a_waiting_task_that_runs_again_is_running_again(pool: Pool, tmp_path: Path) -> None:
    log = str(tmp_path / "parked.log")
    go = str(tmp_path / "go")
    os.mkfifo(go)
    fut = pool.ex.submit(retryfns.park_then_hold, log, go, 1.0)
    waiting(pool, fut.task_id, log)
    wait_for(lambda: not fut.running(), 10, "its future not to be running")
    wait_for(lambda: len(retryfns.starts(log)) == 2, 30, "its second attempt")
    wait_for(fut.running, 10, "its future to be running again")
    with open(go, "w") as f:  # the second attempt reads it to its end
        f.write("go")
    assert fut.result(timeout=30) == 2
