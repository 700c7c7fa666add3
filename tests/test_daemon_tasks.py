"""Tasks in the daemon: they outlive the client that submitted them, a clean stop keeps
the queued ones for the next start, a kill -9 of the daemon makes the running ones LOST
(or runs them again with retries), ids never repeat, and a client waiting on a task whose
daemon died (and does not come back) gets an error within its reconnect window, not a hang.
A client that outlives its daemon's restart: tests/test_executor_daemon.py."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import DaemonUnderTest, cli, wait_for
from orchestrator import ChannelError, Client, InvalidSpec, UnknownPool
from orchestrator.taskwire import loads

JOBS = textwrap.dedent("""
    import os, time
    from pathlib import Path

    def slow(seconds, value, started=None):
        if started:
            Path(started + ".tmp").write_text(str(os.getpid()))
            os.rename(started + ".tmp", started)
        time.sleep(seconds)
        return value

    def add(a, b):
        return a + b
""")


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A module of task targets, in a dir of its own (the submitter's PYTHONPATH)."""
    where = tmp_path / "code"
    where.mkdir()
    (where / "jobsmod.py").write_text(JOBS)
    return where


def _pool(daemon: DaemonUnderTest, jobs: Path, name: str = "jobs", size: int = 1, **options: object) -> None:
    """An executor pool in the daemon, made by a Python client that then leaves."""
    with Client(daemon.state_dir) as client:
        ex = client.executor(name, max_workers=size, **options)
        ex.shutdown(wait=True)  # the session ends; the pool stays


def _submit(client: Client, jobs: Path, target: str, *args: object, pool: str = "jobs", **extra: object) -> str:
    return client.call("task_submit", {"pool": pool, "target": f"jobsmod:{target}", "args": list(args),
                                       "pythonpath": [str(jobs)], "cwd": str(jobs), **extra})


def _result(client: Client, task_id: str, timeout: float = 30) -> dict:
    return client.call("task_result", {"id": task_id, "wait": True, "timeout": timeout}, timeout=timeout + 10)


def test_results_outlive_a_submitter_killed_with_sigkill(daemon: DaemonUnderTest, jobs: Path, tmp_path: Path) -> None:
    daemon.start()
    _pool(daemon, jobs, "jobs", 1)
    started = tmp_path / "started"
    submitter = textwrap.dedent(f"""
        import sys
        from orchestrator import Client
        with Client({str(daemon.state_dir)!r}) as c:
            ex = c.executor("jobs", max_workers=1)
            fut = ex.submit(__import__("jobsmod").slow, 1.0, "survived", {str(started)!r})
            while fut.task_id is None:
                pass
            print(fut.task_id, flush=True)
            import time; time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", submitter], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(jobs)})
    try:
        task_id = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert task_id.startswith("jobs/")
        wait_for(started.exists, 30, "the task to run")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
    with Client(daemon.state_dir) as other:
        outcome = _result(other, task_id)
    assert outcome["state"] == "DONE"
    assert loads(base64.b64decode(outcome["result"])) == "survived"


def test_stop_keeps_queued_tasks_for_the_next_start(daemon: DaemonUnderTest, jobs: Path, tmp_path: Path) -> None:
    daemon.start()
    _pool(daemon, jobs, "jobs", 1)
    started = tmp_path / "started"
    with Client(daemon.state_dir) as client:
        running = _submit(client, jobs, "slow", 60, "never", str(started))
        queued = [_submit(client, jobs, "add", i, 1) for i in range(3)]
        wait_for(started.exists, 30, "the first task to run")
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    daemon.start()
    with Client(daemon.state_dir) as client:
        assert [_result(client, t)["state"] for t in queued] == ["DONE"] * 3
        cut = client.call("task_result", {"id": running})
        assert cut["state"] == "FAILED" and cut["reason"] == "interrupted: the daemon stopped"
        later = _submit(client, jobs, "add", 2, 2)
    assert int(later.split("/")[1]) > max(int(t.split("/")[1]) for t in queued)  # ids continue


@pytest.mark.parametrize("retries", [0, 1])
def test_kill_9_of_the_daemon_makes_running_tasks_lost_or_runs_them_again(
        daemon: DaemonUnderTest, jobs: Path, tmp_path: Path, retries: int) -> None:
    daemon.start()
    _pool(daemon, jobs, "jobs", 1, retries=retries)
    started = tmp_path / "started"
    with Client(daemon.state_dir) as client:
        running = _submit(client, jobs, "slow", 2.0 if retries else 60, "again", str(started))
        queued = _submit(client, jobs, "add", 40, 2)
        wait_for(started.exists, 30, "the task to run")
    daemon.snapshot()
    first = int(started.read_text())
    started.unlink()
    assert daemon.pid is not None
    os.kill(daemon.pid, signal.SIGKILL)
    wait_for(lambda: cli(daemon.state_dir, "status").returncode == 3, 30, "the daemon to be gone")
    daemon.start()
    with Client(daemon.state_dir) as client:
        outcome = _result(client, running)
        assert _result(client, queued)["state"] == "DONE"
    if retries:
        assert outcome["state"] == "DONE"
        assert int(started.read_text()) != first  # it ran again, in a new worker
    else:
        assert outcome["state"] == "LOST" and outcome["reason"] == "the daemon died while it ran"


def test_a_client_waiting_on_a_task_whose_daemon_died_gets_an_error(daemon: DaemonUnderTest, jobs: Path,
                                                                    tmp_path: Path) -> None:
    daemon.start()
    started = tmp_path / "started"
    import jobsmod  # type: ignore[import-not-found]  # tmp_path/code, on sys.path (the fixture below)

    with Client(daemon.state_dir) as client:
        ex = client.executor("jobs", max_workers=1, reconnect_timeout=1)
        try:
            fut = ex.submit(jobsmod.slow, 60, "never", str(started))
            wait_for(started.exists, 30, "the task to run")
            daemon.snapshot()
            assert daemon.pid is not None
            os.kill(daemon.pid, signal.SIGKILL)
            began = time.monotonic()
            with pytest.raises(ChannelError):
                fut.result(timeout=50)  # an error, not this time-out
            assert time.monotonic() - began < 5  # the window (1 s), and a poll's bound
        finally:
            ex.shutdown(wait=True)


@pytest.fixture(autouse=True)
def _jobsmod_importable(jobs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task module is importable here (tasks pickled by reference) and is on the
    PYTHONPATH an executor pool made here records for its workers."""
    monkeypatch.syspath_prepend(str(jobs))
    monkeypatch.setenv("PYTHONPATH", str(jobs))


def test_task_metrics_status_and_events(daemon: DaemonUnderTest, jobs: Path) -> None:
    daemon.start()
    _pool(daemon, jobs, "jobs", 1)
    with Client(daemon.state_dir) as client:
        ids = [_submit(client, jobs, "add", i, 1) for i in range(3)]
        assert [_result(client, t)["state"] for t in ids] == ["DONE"] * 3
        pool = [p for p in client.status()["pools"] if p["name"] == "jobs"][0]
    assert pool["kind"] == "executor" and pool["tasks"] == {"queued": 0, "running": 0, "waiting": 0, "done": 3, "failed": 0,
                                                                "cancelled": 0, "timed_out": 0, "lost": 0,
                                                                "tenants": {}}
    text = cli(daemon.state_dir, "metrics").stdout
    assert 'orchestrator_tasks_ended_total{pool="jobs",state="DONE"} 3.0' in text
    assert 'orchestrator_task_run_seconds_count{pool="jobs"} 3.0' in text
    assert 'orchestrator_task_queue_wait_seconds_count{pool="jobs"} 3.0' in text
    assert 'orchestrator_tasks{pool="jobs",state="QUEUED"} 0.0' in text
    events = cli(daemon.state_dir, "events", "--json").stdout
    ends = [line for line in events.splitlines() if '"task"' in line and ids[0] in line]
    assert any('"to":"DONE"' in line.replace(" ", "") for line in ends), ends


def test_an_executor_pool_declared_in_the_config_file(daemon: DaemonUnderTest, jobs: Path, tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    conf.write_text(textwrap.dedent(f"""
        [pools.jobs]
        kind = "executor"
        size = 2
        target = "jobsmod:add"
        cwd = {str(jobs)!r}
        max_tasks_per_child = 5
        retries = 1
    """))
    daemon.start("--config", str(conf))
    with Client(daemon.state_dir) as client:
        task = client.call("task_submit", {"pool": "jobs", "args": [40, 2]})  # the pool's own target
        outcome = _result(client, task)
        assert outcome["state"] == "DONE" and loads(base64.b64decode(outcome["result"])) == 42
        pool = [p for p in client.status()["pools"] if p["name"] == "jobs"][0]
        assert pool["kind"] == "executor" and pool["desired"] == 2
    conf.write_text(conf.read_text().replace("size = 2", "size = 3"))
    assert "resized" in cli(daemon.state_dir, "reload", "--json").stdout
    conf.write_text(conf.read_text().replace('target = "jobsmod:add"', 'target = "jobsmod:add"\ncommand = ["x"]'))
    refused = cli(daemon.state_dir, "reload")
    assert refused.returncode == 1 and "command" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    with Client(daemon.state_dir) as client:
        assert _result(client, _submit(client, jobs, "add", 1, 1))["state"] == "DONE"  # still running


def test_a_second_client_joins_the_pool_or_is_refused(daemon: DaemonUnderTest, jobs: Path) -> None:
    daemon.start()
    import jobsmod  # type: ignore[import-not-found]

    with Client(daemon.state_dir) as client:
        first = client.executor("jobs", max_workers=2, retries=1)
        try:
            with client.executor("jobs", max_workers=2, retries=1) as second:  # the same keywords: joined
                assert second.submit(jobsmod.add, 2, 3).result(timeout=30) == 5
            with client.executor("jobs", max_workers=3, retries=1) as third:  # another size: the pool's taken
                assert third.submit(jobsmod.add, 3, 3).result(timeout=30) == 6
            with pytest.raises(InvalidSpec, match="'jobs' runs with retries=1, not 2"):
                client.executor("jobs", max_workers=2, retries=2)
            assert first.submit(jobsmod.add, 1, 1).result(timeout=30) == 2  # the first one goes on
        finally:
            first.shutdown()
        assert cli(daemon.state_dir, "delete", "jobs").returncode == 0
        with pytest.raises(UnknownPool, match="unknown executor pool"):
            client.call("task_submit", {"pool": "jobs", "target": "jobsmod:add", "args": [1, 2]})


def test_cancels_right_after_submit_through_the_daemon(daemon: DaemonUnderTest, jobs: Path) -> None:
    daemon.start()
    import jobsmod  # type: ignore[import-not-found]

    with Client(daemon.state_dir) as client:
        with client.executor("jobs", max_workers=2) as ex:
            futs = [ex.submit(jobsmod.slow, 0.01, i) for i in range(60)]
            outcomes = [f.cancel() if i % 2 else None for i, f in enumerate(futs)]
            for i, (fut, cancelled) in enumerate(zip(futs, outcomes)):
                if cancelled:
                    assert fut.cancelled()
                else:
                    assert fut.result(timeout=60) == i  # a cancel that came too late leaves the result
            assert ex.submit(jobsmod.add, 1, 2).result(timeout=30) == 3
        assert cli(daemon.state_dir, "delete", "jobs").returncode == 0
        with client.executor("jobs2", max_workers=1) as ex2:
            assert cli(daemon.state_dir, "delete", "jobs2").returncode == 0
            refused = ex2.submit(jobsmod.add, 1, 2)
            with pytest.raises(UnknownPool, match="unknown executor pool"):
                refused.result(timeout=30)


def test_an_upgrade_carries_executor_pools_and_their_tasks(daemon: DaemonUnderTest, jobs: Path, tmp_path: Path) -> None:
    """`upgrade` with a task running, one queued and a client waiting on both: the task
    finishes in the same worker, the queued one runs, the client never notices, and a
    cancel after the upgrade still reaches the running task alone."""
    daemon.start()
    import jobsmod  # type: ignore[import-not-found]

    started = tmp_path / "started"
    with Client(daemon.state_dir) as client:
        with client.executor("jobs", max_workers=1) as ex:
            running = ex.submit(jobsmod.slow, 2.0, "finished", str(started))
            queued = ex.submit(jobsmod.add, 20, 22)
            wait_for(started.exists, 30, "the task to run")
            worker = int(started.read_text())
            before = {r["id"]: r["pid"] for r in daemon.status()["replicas"] if r["pool"] == "jobs"}
            got = cli(daemon.state_dir, "upgrade")
            assert got.returncode == 0, got.stderr
            assert running.result(timeout=60) == "finished" and queued.result(timeout=60) == 42
            after = {r["id"]: r["pid"] for r in daemon.status()["replicas"] if r["pool"] == "jobs"}
            assert after == before and worker in after.values()  # the same worker, not restarted
            started.unlink()
            again = ex.submit(jobsmod.slow, 60, "never", str(started))
            wait_for(started.exists, 30, "a task to run after the upgrade")
            assert again.cancel() and again.cancelled()
            assert ex.submit(jobsmod.add, 1, 1).result(timeout=30) == 2
            assert {r["id"]: r["pid"] for r in daemon.status()["replicas"] if r["pool"] == "jobs"} == before


def test_submit_without_a_target_runs_the_pools_own(daemon: DaemonUnderTest, jobs: Path, tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    conf.write_text(textwrap.dedent(f"""
        [pools.jobs]
        kind = "executor"
        target = "jobsmod:add"
        cwd = {str(jobs)!r}

        [pools.bare]
        kind = "executor"
        cwd = {str(jobs)!r}
    """))
    daemon.start("--config", str(conf))
    got = cli(daemon.state_dir, "submit", "--pool", "jobs", "--arg", "40", "--arg", "2", "--wait")
    assert got.returncode == 0 and got.stdout.strip() == "42", got.stderr
    refused = cli(daemon.state_dir, "submit", "--pool", "bare", "--arg", "1")
    assert refused.returncode == 1 and "no target of its own" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_cancel_by_id_from_another_process_lands_before_the_submit_arrives(
        daemon: DaemonUnderTest, jobs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The submitter's batch is held (its sender thread waits) while a second process
    cancels the task by its id: answered at once (the daemon has the number on its way),
    and the submit, once it arrives, is that task, cancelled: it never runs."""
    from concurrent.futures import CancelledError

    from orchestrator.taskremote import Remote

    daemon.start()
    import jobsmod  # type: ignore[import-not-found]

    hold = threading.Event()
    send_batch = Remote._send_batch

    def held(self: Remote, *args: Any) -> None:
        hold.wait(60)
        send_batch(self, *args)

    monkeypatch.setattr(Remote, "_send_batch", held)
    started = tmp_path / "started"
    canceller = textwrap.dedent("""
        import sys, time
        from orchestrator import Client
        began = time.monotonic()
        handle = Client(sys.argv[1]).task(sys.argv[2])
        state = handle.info()["state"]
        print(state, handle.cancel(), handle.info()["state"], round(time.monotonic() - began, 3))
    """)
    with Client(daemon.state_dir) as client:
        with client.executor("jobs", max_workers=1) as ex:
            fut = ex.submit(jobsmod.slow, 0, "ran", str(started))
            assert fut.task_id is not None
            out = subprocess.run([sys.executable, "-c", canceller, str(daemon.state_dir), fut.task_id],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            before, cancelled, after, _took = out.stdout.split()
            assert (before, cancelled, after) == ("QUEUED", "True", "CANCELLED")
            hold.set()
            with pytest.raises(CancelledError):
                fut.result(timeout=30)
            assert fut.cancelled()
            assert ex.submit(jobsmod.add, 1, 2).result(timeout=30) == 3
        assert not started.exists()  # the cancelled task never ran
        unknown = subprocess.run([sys.executable, "-c", canceller, str(daemon.state_dir), "jobs/100000"],
                                 capture_output=True, text=True, timeout=60)
        assert unknown.returncode == 1 and "unknown task 'jobs/100000'" in unknown.stderr
