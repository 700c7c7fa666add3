"""A daemon-mode Executor as a request server uses it: it outlives its daemon's restarts
(stop + start, kill -9 + start) without failing a future whose task still runs, each task
runs once however often its submit is sent, a future's ``task_id`` is set at submit and
finds the task again from any process (``Client(DIR).task(ID)``), ids continue without a
jump at each start, a client may leave its tasks to the daemon, and a joiner takes a pool
as it runs unless a keyword really conflicts."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from helpers import DaemonUnderTest, cli, module_of_tasks, wait_for
from orchestrator import (
    ChannelError, Client, Executor, InvalidSpec, OrchestratorError, TaskInterrupted, UnknownTask, WorkerLost,
)

JOBS = textwrap.dedent("""
    import os, time
    from pathlib import Path

    def mark(path, text):
        Path(path + ".tmp").write_text(text)
        os.rename(path + ".tmp", path)

    def record(log, value):
        # One line per run: a task that ran twice shows it.
        with open(log, "a") as f:
            f.write(f"{value}\\n")
        return value

    def held(started, release, value, limit=120):
        # Runs until the test releases it (a file appears), at most ``limit`` seconds.
        mark(started, str(os.getpid()))
        end = time.monotonic() + limit
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.02)
        return value

    def cancellable(started, marker):
        mark(started, str(os.getpid()))
        try:
            time.sleep(120)
        except BaseException as err:
            mark(marker, type(err).__name__)
            raise

    def fails(text):
        raise ValueError(text)

    def setup(*args):
        pass
""")


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A module of tasks, importable here (pickled by reference) and on the PYTHONPATH an
    executor pool made here records for its workers."""
    with module_of_tasks(tmp_path / "code", "clientjobs", JOBS, monkeypatch) as module:
        yield module


def _lines(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _kill_9(daemon: DaemonUnderTest) -> None:
    daemon.snapshot()
    assert daemon.pid is not None
    os.kill(daemon.pid, signal.SIGKILL)
    wait_for(lambda: cli(daemon.state_dir, "status").returncode == 3, 30, "the daemon to be gone")


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_a_waiting_client_outlives_a_restart_of_its_daemon(daemon: DaemonUnderTest, jobs: object, tmp_path: Path,
                                                           how: str) -> None:
    """One task running and four queued under a waiting client: after the restart the queued
    ones end with their results (each ran once), the running one fails with its real end,
    and the same executor goes on; a handle of another client waits through it too."""
    daemon.start()
    started, log = tmp_path / "started", tmp_path / "log"
    ex = Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=1)
    other = Client(daemon.state_dir)
    try:
        running = ex.submit(jobs.cancellable, str(started), str(tmp_path / "marker"))  # type: ignore[attr-defined]
        queued = [ex.submit(jobs.record, str(log), i) for i in range(4)]  # type: ignore[attr-defined]
        wait_for(started.exists, 30, "the first task to run")
        elsewhere = other.task(queued[-1].task_id).future()
        if how == "stop":
            assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
        else:
            _kill_9(daemon)
        assert not any(f.done() for f in queued)  # not failed: those tasks are still the daemon's
        daemon.start()
        assert [f.result(timeout=60) for f in queued] == [0, 1, 2, 3]
        assert elsewhere.result(timeout=30) == 3
        if how == "stop":
            with pytest.raises(TaskInterrupted) as interrupted:
                running.result(timeout=30)
            assert interrupted.value.reason == "interrupted: the daemon stopped"
            assert interrupted.value.task == running.task_id
            assert not isinstance(interrupted.value, WorkerLost)
        else:
            with pytest.raises(WorkerLost) as lost:
                running.result(timeout=30)
            assert lost.value.reason == "the daemon died while it ran"
        assert sorted(_lines(log)) == ["0", "1", "2", "3"]  # each ran once
        assert ex.submit(jobs.record, str(log), 9).result(timeout=30) == 9  # type: ignore[attr-defined]
    finally:
        ex.shutdown(wait=True)
        other.close()


def test_a_task_with_retries_interrupted_by_stop_runs_again(daemon: DaemonUnderTest, jobs: object,
                                                              tmp_path: Path) -> None:
    daemon.start()
    started, release = tmp_path / "started", tmp_path / "release"
    with Client(daemon.state_dir).executor("jobs", max_workers=1, retries=1) as ex:
        fut = ex.submit(jobs.held, str(started), str(release), "again")  # type: ignore[attr-defined]
        wait_for(started.exists, 30, "the task to run")
        first = started.read_text()
        started.unlink()
        assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
        daemon.start()
        wait_for(started.exists, 30, "the task to run again")
        assert started.read_text() != first
        release.touch()
        assert fut.result(timeout=30) == "again"


def test_submits_while_the_daemon_is_down_wait_for_it(daemon: DaemonUnderTest, jobs: object, tmp_path: Path) -> None:
    daemon.start()
    log = tmp_path / "log"
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=1) as ex:
        assert ex.submit(jobs.record, str(log), "before").result(timeout=30) == "before"  # type: ignore[attr-defined]
        assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
        began = time.monotonic()
        futs = [ex.submit(jobs.record, str(log), f"down{i}") for i in range(3)]  # type: ignore[attr-defined]
        assert time.monotonic() - began < 1.0  # submit does not wait for the daemon
        assert all(f.task_id is not None for f in futs)
        daemon.start()
        assert [f.result(timeout=60) for f in futs] == ["down0", "down1", "down2"]
    assert sorted(_lines(log)) == ["before", "down0", "down1", "down2"]


def test_a_cancel_by_id_lands_while_a_client_back_after_a_restart_has_yet_to_resend(
        daemon: DaemonUnderTest, jobs: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submits made while the daemon is down reach the restarted daemon after the client
    registered again; it named their numbers then, so a cancel by id from another process
    in between lands at once (not "unknown"), and that task never runs."""
    daemon.start()
    log = tmp_path / "log"
    futs: list[cf.Future[str]] = []
    said: list[str] = []
    rejoin = Executor._rejoin

    def rejoined(self: Executor, join: dict[str, object], timeout: float) -> None:
        rejoin(self, join, timeout)
        if futs and not said:  # the first reconnect: the submits are not sent again yet
            out = subprocess.run([sys.executable, "-c", "import sys; from orchestrator import Client; "
                                  "print(Client(sys.argv[1]).task(sys.argv[2]).cancel())",
                                  str(daemon.state_dir), str(futs[1].task_id)], capture_output=True, text=True,
                                 timeout=60)
            said.append(out.stdout.strip() or out.stderr)

    monkeypatch.setattr(Executor, "_rejoin", rejoined)
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=1) as ex:
        assert ex.submit(jobs.record, str(log), "before").result(timeout=30) == "before"  # type: ignore[attr-defined]
        assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
        futs.extend(ex.submit(jobs.record, str(log), f"down{i}") for i in range(3))  # type: ignore[attr-defined]
        daemon.start()
        assert [futs[0].result(timeout=60), futs[2].result(timeout=60)] == ["down0", "down2"]
        with pytest.raises(cf.CancelledError):
            futs[1].result(timeout=30)
    assert said == ["True"]
    assert sorted(_lines(log)) == ["before", "down0", "down2"]


def test_a_client_whose_daemon_never_returns_gets_its_error_within_the_window(
        daemon: DaemonUnderTest, jobs: object, tmp_path: Path) -> None:
    daemon.start()
    started = tmp_path / "started"
    ex = Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=1, reconnect_timeout=2)
    try:
        fut = ex.submit(jobs.cancellable, str(started), str(tmp_path / "marker"))  # type: ignore[attr-defined]
        wait_for(started.exists, 30, "the task to run")
        _kill_9(daemon)
        began = time.monotonic()
        with pytest.raises(ChannelError, match="reconnect_timeout") as info:
            fut.result(timeout=30)  # an error, not this time-out
        assert time.monotonic() - began < 2 + 5.0  # the window, and a poll's bound
        assert len(str(info.value).splitlines()) == 1
        late = ex.submit(jobs.record, str(tmp_path / "log"), 1)  # type: ignore[attr-defined]
        with pytest.raises(ChannelError):
            late.result(timeout=10)
    finally:
        ex.shutdown(wait=True)


def test_a_resent_submit_is_the_same_task(daemon: DaemonUnderTest, jobs: object, tmp_path: Path) -> None:
    """What a reconnecting client does: it sends a batch again, each task with the number
    it was granted; the daemon returns the task it has, before and after a restart."""
    daemon.start()
    log = tmp_path / "log"
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=1):
        pass  # the pool, made and left
    where = str(tmp_path / "code")
    one = {"target": "clientjobs:record", "args": [str(log), "once"], "pythonpath": [where], "cwd": where}
    with Client(daemon.state_dir) as client:
        first, count = client.call("task_numbers", {"pool": "jobs", "count": 2})
        assert count == 2
        task = {**one, "n": first}
        (task_id,) = client.call("task_submit", {"pool": "jobs", "tasks": [task]})
        assert task_id == f"jobs/{first}"
        assert client.call("task_submit", {"pool": "jobs", "tasks": [task], "resend": True}) == [task_id]
        assert client.call("task_result", {"id": task_id, "wait": True, "timeout": 30})["state"] == "DONE"
        assert client.call("task_submit", {"pool": "jobs", "tasks": [task]}) == [task_id]
        with pytest.raises(InvalidSpec, match="was not handed out"):
            client.call("task_submit", {"pool": "jobs", "tasks": [{**one, "n": first + 100}]})
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    daemon.start()
    with Client(daemon.state_dir) as client:
        assert client.call("task_submit", {"pool": "jobs", "tasks": [task], "resend": True}) == [task_id]
        second = client.call("task_submit", {"pool": "jobs", "tasks": [{**one, "n": first + 1}], "resend": True})
        assert client.call("task_result", {"id": second[0], "wait": True, "timeout": 30})["state"] == "DONE"
    assert _lines(log) == ["once", "once"]  # the first number ran once, the second once


def _n(task_id: str | None) -> int:
    assert task_id is not None
    return int(task_id.rpartition("/")[2])


def test_task_ids_are_set_at_submit_and_continue_after_a_restart(daemon: DaemonUnderTest, jobs: object,
                                                                 tmp_path: Path) -> None:
    daemon.start()
    log = str(tmp_path / "log")
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=2) as ex:
        futs = [ex.submit(jobs.record, log, i) for i in range(40)]  # type: ignore[attr-defined]
        ids = [f.task_id for f in futs]  # before any of them started
        assert [_n(i) for i in ids] == list(range(1, 41))  # past the first blocks of numbers, no gap
        assert [f.result(timeout=60) for f in futs] == list(range(40))
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    daemon.start()
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=2) as ex:
        assert _n(ex.submit(jobs.record, log, "next").task_id) == 41  # type: ignore[attr-defined]
    got = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "clientjobs:record", "--arg", f'"{log}"',
              "--arg", '"cli"')
    assert got.returncode == 0 and _n(got.stdout.strip()) == 42, got.stderr
    _kill_9(daemon)
    daemon.start()
    got = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "clientjobs:record", "--arg", f'"{log}"',
              "--arg", '"cli"')
    assert got.returncode == 0 and _n(got.stdout.strip()) == 43, got.stderr


def test_task_ids_are_set_at_submit_embedded(jobs: object, tmp_path: Path) -> None:
    with Executor(max_workers=1) as ex:
        futs = [ex.submit(jobs.record, str(tmp_path / "log"), i) for i in range(50)]  # type: ignore[attr-defined]
        assert [f.task_id for f in futs] == [f"{ex.pool}/{n}" for n in range(1, 51)]
        assert [f.result(timeout=60) for f in futs] == list(range(50))


def test_a_task_found_again_from_another_client(daemon: DaemonUnderTest, jobs: object, tmp_path: Path) -> None:
    daemon.start()
    started, marker = tmp_path / "started", tmp_path / "marker"
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=2) as ex:
        done = ex.submit(jobs.record, str(tmp_path / "log"), "value")  # type: ignore[attr-defined]
        raised = ex.submit(jobs.fails, "no such thing")  # type: ignore[attr-defined]
        running = ex.submit(jobs.cancellable, str(started), str(marker))  # type: ignore[attr-defined]
        assert done.result(timeout=30) == "value"
        with Client(daemon.state_dir) as other:
            handle = other.task(done.task_id)
            assert handle.result(timeout=10) == "value"
            assert handle.future().result(timeout=10) == "value"
            info = handle.info()
            assert info["id"] == done.task_id and info["state"] == "DONE" and "payload" not in info
            with pytest.raises(ValueError, match="no such thing"):
                other.task(raised.task_id).result(timeout=30)
            wait_for(started.exists, 30, "the task to run")
            far = other.task(running.task_id)
            with pytest.raises(TimeoutError):
                far.result(timeout=0.2)
            waiting = far.future()
            assert far.info()["state"] == "RUNNING"
            assert far.cancel() is True
            wait_for(marker.exists, 30, "Cancelled raised in the task")
            assert marker.read_text() == "Cancelled"
            with pytest.raises(cf.CancelledError):
                running.result(timeout=30)  # the submitter's future: cancelled, as its own cancel() does
            with pytest.raises(cf.CancelledError):
                far.result(timeout=10)
            wait_for(waiting.done, 10, "the handle's future to end")
            assert waiting.cancelled()
            assert far.cancel() is True and handle.cancel() is False  # as future.cancel(): ended is False
            with pytest.raises(UnknownTask) as unknown:
                other.task("jobs/100000")
            assert len(str(unknown.value).splitlines()) == 1


def test_a_handle_future_cancels_its_task(daemon: DaemonUnderTest, jobs: object, tmp_path: Path) -> None:
    daemon.start()
    started, marker = tmp_path / "started", tmp_path / "marker"
    with Executor(state_dir=daemon.state_dir, pool="jobs", max_workers=1) as ex:
        fut = ex.submit(jobs.cancellable, str(started), str(marker))  # type: ignore[attr-defined]
        wait_for(started.exists, 30, "the task to run")
        with Client(daemon.state_dir) as other:
            remote = other.task(fut.task_id).future()
            assert remote.cancel() and remote.cancelled()
        with pytest.raises(cf.CancelledError):
            fut.result(timeout=30)
        wait_for(marker.exists, 30, "Cancelled raised in the task")


@pytest.mark.parametrize("how", ["exit", "shutdown(wait=False)"])
def test_a_client_that_leaves_leaves_its_tasks_to_the_daemon(daemon: DaemonUnderTest, jobs: object, tmp_path: Path,
                                                              how: str) -> None:
    daemon.start()
    started, release = tmp_path / "started", tmp_path / "release"
    script = textwrap.dedent(f"""
        from orchestrator import Executor
        import clientjobs
        ex = Executor(state_dir={str(daemon.state_dir)!r}, pool="jobs", max_workers=1)
        fut = ex.submit(clientjobs.held, {str(started)!r}, {str(release)!r}, "left")
        print(fut.task_id, flush=True)
        {"ex.shutdown(wait=False)" if how != "exit" else ""}
    """)
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "code")})
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - began < 15  # it did not wait for a task that runs until released
    task_id = proc.stdout.strip()
    wait_for(started.exists, 30, "the task to run after its client left")
    with Client(daemon.state_dir) as client:
        handle = client.task(task_id)
        assert handle.info()["state"] == "RUNNING"
        release.touch()
        assert handle.result(timeout=30) == "left"


def test_a_joiner_takes_the_pool_as_it_runs_or_names_the_conflict(daemon: DaemonUnderTest, jobs: object,
                                                                  tmp_path: Path) -> None:
    daemon.start()
    with Client(daemon.state_dir) as client:
        first = client.executor("jobs", max_workers=2, retries=1)
        try:
            assert cli(daemon.state_dir, "scale", "jobs", "3").returncode == 0  # an operator's
            with client.executor("jobs", max_workers=1, retries=1, preload=["json"]) as joined:  # no conflict
                assert joined.submit(jobs.record, str(tmp_path / "log"), 5).result(timeout=30) == 5  # type: ignore[attr-defined]
            pool = [p for p in client.status()["pools"] if p["name"] == "jobs"][0]
            assert pool["desired"] == 3  # the joiner did not resize it
            with pytest.raises(InvalidSpec) as info:
                client.executor("jobs", max_workers=2, retries=2, timeout=9)
            line = str(info.value)
            assert len(line.splitlines()) == 1
            assert "'jobs'" in line and "retries=1, not 2" in line and "timeout=None, not 9.0" in line
            with pytest.raises(InvalidSpec, match=r"initializer=none, not clientjobs\.setup\('a',\)"):
                client.executor("jobs", retries=1, initializer=jobs.setup, initargs=("a",))  # type: ignore[attr-defined]
            with pytest.raises(InvalidSpec, match="cwd="):
                client.executor("jobs", retries=1, cwd=str(tmp_path))
            assert first.submit(jobs.record, str(tmp_path / "log"), 6).result(timeout=30) == 6  # type: ignore[attr-defined]
        finally:
            first.shutdown()


def test_a_conflicting_initializer_is_named_with_both_values(daemon: DaemonUnderTest, jobs: object) -> None:
    daemon.start()
    with Client(daemon.state_dir) as client:
        with client.executor("jobs", max_workers=1, initializer=jobs.setup, initargs=("a",)):  # type: ignore[attr-defined]
            with pytest.raises(InvalidSpec, match=r"initializer=clientjobs\.setup\('a',\), not clientjobs\.setup\('b',\)"):
                client.executor("jobs", max_workers=1, initializer=jobs.setup, initargs=("b",))  # type: ignore[attr-defined]


def test_task_interrupted_is_its_own_error() -> None:
    import orchestrator

    assert orchestrator.TaskInterrupted is TaskInterrupted and "TaskInterrupted" in orchestrator.__all__
    assert issubclass(TaskInterrupted, OrchestratorError) and not issubclass(TaskInterrupted, WorkerLost)
    import pickle

    err = pickle.loads(pickle.dumps(TaskInterrupted("task p/1 was interrupted: x", reason="interrupted: x", task="p/1")))
    assert isinstance(err, TaskInterrupted) and err.reason == "interrupted: x" and err.task == "p/1"
