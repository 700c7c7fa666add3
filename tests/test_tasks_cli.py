"""The task commands of the CLI (submit, tasks, cancel, result) against a real daemon, as
an operator drives them: targets imported from the submitter's cwd, JSON and non-JSON
results, bad input refused in one line while the daemon runs on, a cancel from the shell of
a task a Python client waits on, and a finished task's result read back after ``stop``."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Iterator

import pytest

import taskfns
from conftest import TAG_VAR
from helpers import TESTS, DaemonUnderTest, cli, cli_env, one_line_error, read_lines, wait_for
from orchestrator import Client, Executor

pytestmark = pytest.mark.timeout(120)

MODULE = textwrap.dedent('''
    import decimal

    def add(a, b=0):
        return a + b

    def money(text):
        return decimal.Decimal(text)      # not JSON: printed as its repr

    def boom(message):
        raise ValueError(message)

    def big(n):
        return "x" * n
''')


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A directory holding the module ``mytasks`` (found from the cwd of the submitter)."""
    where = tmp_path / "work"
    where.mkdir()
    (where / "mytasks.py").write_text(MODULE)
    return where


@pytest.fixture
def executors(orch_test_tag: str) -> Iterator[list[Executor]]:
    """Python clients' executors on the daemon's pools, shut down at the end."""
    made: list[Executor] = []
    yield made
    for ex in made:
        ex.shutdown(wait=True, cancel_futures=True)


def make_pool(d: DaemonUnderTest, made: list[Executor], name: str = "jobs", workers: int = 1) -> Executor:
    """An executor pool in the daemon (made by a Python client; its workers import
    tests/taskfns.py), its replicas recorded for the no-leftover check."""
    with Client(d.state_dir) as client:
        ex = client.executor(name, max_workers=workers, cwd=str(TESTS), env={TAG_VAR: cli_env()[TAG_VAR]})
    made.append(ex)
    wait_for(lambda: sum(r["pool"] == name and r["state"] == "RUNNING" for r in d.status()["replicas"]) == workers,
             30, "the pool's workers to run")
    return ex


def run(d: DaemonUnderTest, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI from ``cwd`` (where ``mytasks`` is)."""
    return subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(d.state_dir), *args],
                          capture_output=True, text=True, timeout=60, env=cli_env(), cwd=cwd,
                          stdin=subprocess.DEVNULL)


def tasks_json(d: DaemonUnderTest, *args: str) -> list[dict]:
    proc = cli(d.state_dir, "tasks", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def still_running(d: DaemonUnderTest) -> None:
    assert cli(d.state_dir, "health").returncode == 0


def test_submit_and_result_of_targets_from_the_submitters_cwd(daemon: DaemonUnderTest, work: Path,
                                                              executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    done = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:add", "--arg", "2",
               "--kwarg", "b=40", "--wait")
    assert (done.returncode, done.stdout, done.stderr) == (0, "42\n", "")
    done = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:add", "--arg", '["a"]',
               "--arg", '["b", {"c": null}]', "--wait")
    assert (done.returncode, json.loads(done.stdout)) == (0, ["a", "b", {"c": None}])
    done = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:money", "--arg", '"1.50"', "--wait")
    assert (done.returncode, done.stdout) == (0, "Decimal('1.50')\n"), done.stderr

    # without --wait: the id, then the result from another command (and as JSON)
    queued = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:add", "--arg", "1", "--arg", "2")
    assert queued.returncode == 0, queued.stderr
    (task_id,) = queued.stdout.split()
    assert task_id.startswith("jobs/")
    got = cli(daemon.state_dir, "result", task_id, "--wait", "--timeout", "30")
    assert (got.returncode, got.stdout) == (0, "3\n"), got.stderr
    got = cli(daemon.state_dir, "result", task_id, "--json")
    assert json.loads(got.stdout) == {"id": task_id, "state": "DONE", "kind": "result", "result": 3,
                                        "repr": None, "reason": None}

    # a task that raises: exit 1, one line that says why; --json says it on stdout too
    failed = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:boom", "--arg", '"no luck"', "--wait")
    assert one_line_error(failed).endswith("FAILED: ValueError: no luck"), failed.stderr
    failed = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:boom", "--arg", '"x"', "--wait",
                 "--json")
    assert failed.returncode == 1
    outcome = json.loads(failed.stdout)
    assert outcome["state"] == "FAILED" and outcome["reason"] == "ValueError: x" and outcome["result"] is None
    still_running(daemon)


def test_a_pythonpath_relative_to_the_submitter_is_made_absolute(daemon: DaemonUnderTest, work: Path,
                                                                 executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    env = cli_env()
    env["PYTHONPATH"] = "work" + ":" + env["PYTHONPATH"]
    done = subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "submit",
                           "--pool", "jobs", "--target", "mytasks:add", "--arg", "5", "--wait"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=work.parent,
                          stdin=subprocess.DEVNULL)
    assert (done.returncode, done.stdout) == (0, "5\n"), done.stderr


def test_bad_input_is_one_line_and_the_daemon_runs_on(daemon: DaemonUnderTest, work: Path,
                                                      executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    for bad in (["--arg", "{not json"], ["--arg", "NaN"], ["--kwarg", "novalue"], ["--kwarg", "k={"],
                ["--kwarg", "1x=2"], ["--retries", "-1"], ["--timeout", "nan"]):
        proc = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:add", *bad)
        line = one_line_error(proc, 2)
        assert "error:" in line, (bad, line)
    proc = run(daemon, work, "submit", "--pool", "nosuch", "--target", "mytasks:add", "--arg", "1")
    assert "unknown executor pool 'nosuch'" in one_line_error(proc)
    proc = run(daemon, work, "submit", "--pool", "jobs", "--target", "no-colon")
    assert "MODULE:FUNCTION" in one_line_error(proc)
    for command in (["result", "jobs/999"], ["result", "nosuch/1"], ["result", "garbage"],
                    ["cancel", "jobs/999"], ["tasks", "--pool", "nosuch"]):
        proc = cli(daemon.state_dir, *command)
        assert "unknown" in one_line_error(proc), command
    assert tasks_json(daemon, "--all") == []  # nothing was queued by any of them
    still_running(daemon)


def test_a_target_that_cannot_be_imported_fails_its_task_and_the_worker_lives_on(
        daemon: DaemonUnderTest, work: Path, executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    first = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:pid", "--wait")
    assert first.returncode == 0, first.stderr
    for target in ("nosuchmodule:f", "mytasks:nosuchfunction"):
        proc = run(daemon, work, "submit", "--pool", "jobs", "--target", target, "--wait")
        line = one_line_error(proc)
        assert "FAILED" in line and ("cannot import module 'nosuchmodule'" in line or "no attribute" in line), line
    again = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:pid", "--wait")
    assert again.returncode == 0 and again.stdout == first.stdout, (first.stdout, again.stdout, again.stderr)
    rows = tasks_json(daemon, "--all", "--pool", "jobs")
    assert [r["state"] for r in rows] == ["DONE", "FAILED", "FAILED", "DONE"]
    assert len({r["worker"] for r in rows}) == 1


def test_cancel_from_the_cli_of_a_running_task_a_python_client_waits_on(
        daemon: DaemonUnderTest, tmp_path: Path, executors: list[Executor]) -> None:
    daemon.start("--grace", "2")
    ex = make_pool(daemon, executors)
    started, marker = tmp_path / "started", tmp_path / "marker"
    fut = ex.submit(taskfns.wait_for_cancel, str(started), str(marker))
    queued = ex.submit(taskfns.square, 3)
    wait_for(started.exists, 30, "the task to start")
    rows = tasks_json(daemon)
    assert [r["state"] for r in rows] == ["RUNNING", "QUEUED"], rows
    running_id, queued_id = rows[0]["id"], rows[1]["id"]
    assert rows[0]["worker"] and rows[0]["started_at"] and rows[1]["started_at"] is None

    proc = cli(daemon.state_dir, "cancel", running_id)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(CancelledError):
        fut.result(timeout=30)
    wait_for(lambda: marker.exists() and marker.read_text() == "Cancelled", 30, "Cancelled raised in the task")
    assert queued.result(timeout=30) == 9  # the next task ran, and was not hit by the cancel

    again = cli(daemon.state_dir, "cancel", running_id, queued_id)  # one cancelled, one DONE: no-ops
    assert again.returncode == 0, again.stderr
    got = cli(daemon.state_dir, "result", running_id)
    assert "CANCELLED" in one_line_error(got)
    states = {r["id"]: r["state"] for r in tasks_json(daemon, "--all")}
    assert states == {running_id: "CANCELLED", queued_id: "DONE"}
    assert tasks_json(daemon) == []
    events = [json.loads(line) for line in cli(daemon.state_dir, "events", "--json").stdout.splitlines()]
    assert any(e["kind"] == "task" and e["data"]["task"] == running_id and e["data"]["to"] == "CANCELLED"
               for e in events)


def test_cancel_of_queued_tasks_and_result_without_wait(daemon: DaemonUnderTest, work: Path,
                                                        executors: list[Executor], tmp_path: Path) -> None:
    daemon.start("--grace", "2")
    make_pool(daemon, executors)
    started = tmp_path / "started"
    running = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:wait_for_cancel",
                  "--arg", json.dumps(str(started)), "--arg", json.dumps(str(tmp_path / "marker")))
    assert running.returncode == 0, running.stderr
    wait_for(started.exists, 30, "the task to start")
    queued = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:add", "--arg", "1")
    (running_id,), (queued_id,) = running.stdout.split(), queued.stdout.split()
    unfinished = cli(daemon.state_dir, "result", queued_id)
    assert "QUEUED" in one_line_error(unfinished)
    waited = cli(daemon.state_dir, "result", running_id, "--wait", "--timeout", "0.5")
    assert "RUNNING" in one_line_error(waited)

    table = cli(daemon.state_dir, "tasks")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:5] == ["ID", "STATE", "PRIO", "TENANT", "WORKER"], lines
    assert [line.split()[:2] for line in lines[1:]] == [[running_id, "RUNNING"], [queued_id, "QUEUED"]]

    proc = cli(daemon.state_dir, "cancel", queued_id, running_id)
    assert proc.returncode == 0, proc.stderr
    for task_id in (queued_id, running_id):
        got = cli(daemon.state_dir, "result", task_id, "--wait", "--timeout", "30")
        assert "CANCELLED" in one_line_error(got), task_id

    timed = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:sleep_then", "--arg", "60",
                "--arg", "1", "--timeout", "0.5", "--wait")
    assert "TIMED_OUT" in one_line_error(timed)
    assert "TIMED_OUT" in cli(daemon.state_dir, "tasks", "--all").stdout


def test_tasks_watch_redraws_until_ctrl_c(daemon: DaemonUnderTest, executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    done = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:square", "--arg", "4", "--wait")
    assert done.stdout == "16\n", done.stderr
    with subprocess.Popen([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "tasks",
                           "--all", "--watch", "--interval", "0.2"], stdout=subprocess.PIPE, env=cli_env(),
                          stdin=subprocess.DEVNULL) as proc:
        try:
            assert proc.stdout is not None
            seen = read_lines(proc.stdout.fileno(), 4)
            assert any("jobs/" in line and "DONE" in line for line in seen), seen
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0


def test_status_shows_each_executor_pools_counts(daemon: DaemonUnderTest, executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    for n in (1, 2):
        assert cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:square", "--arg", str(n),
                   "--wait").returncode == 0
    text = cli(daemon.state_dir, "status").stdout
    (line,) = [line for line in text.splitlines() if line.startswith("pool jobs:")]
    assert "tasks 0 queued, 0 running, 2 done" in line, line


def test_a_finished_tasks_result_after_stop_comes_from_the_store(daemon: DaemonUnderTest,
                                                                 executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    done = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:square", "--arg", "7")
    (task_id,) = done.stdout.split()
    assert cli(daemon.state_dir, "result", task_id, "--wait", "--timeout", "30").stdout == "49\n"
    failed = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:fail", "--arg", '"bad"')
    (failed_id,) = failed.stdout.split()
    assert one_line_error(cli(daemon.state_dir, "result", failed_id, "--wait", "--timeout", "30"))
    for ex in executors:
        ex.shutdown(wait=True)
    assert cli(daemon.state_dir, "stop").returncode == 0

    got = cli(daemon.state_dir, "result", task_id)
    assert (got.returncode, got.stdout) == (0, "49\n"), got.stderr
    got = cli(daemon.state_dir, "result", task_id, "--json")
    assert json.loads(got.stdout)["result"] == 49
    assert "ValueError: bad" in one_line_error(cli(daemon.state_dir, "result", failed_id))
    assert "no daemon is running" in one_line_error(cli(daemon.state_dir, "result", "jobs/999"), 3)
    assert "no daemon is running" in one_line_error(cli(daemon.state_dir, "cancel", task_id), 3)
    assert "no daemon is running" in one_line_error(cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "a:b"), 3)
    listed = cli(daemon.state_dir, "tasks", "--all", "--json")
    assert listed.returncode == 3
    assert {r["id"]: r["state"] for r in json.loads(listed.stdout)} == {task_id: "DONE", failed_id: "FAILED"}


def test_an_oversized_result_fails_its_task_in_one_line(daemon: DaemonUnderTest, work: Path,
                                                        executors: list[Executor]) -> None:
    daemon.start("--result-max-bytes", "1K")
    make_pool(daemon, executors)
    proc = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:big", "--arg", "5000", "--wait")
    line = one_line_error(proc)
    assert "FAILED" in line and "--result-max-bytes" in line, line
    ok = run(daemon, work, "submit", "--pool", "jobs", "--target", "mytasks:big", "--arg", "10", "--wait")
    assert (ok.returncode, ok.stdout) == (0, '"xxxxxxxxxx"\n'), ok.stderr
    still_running(daemon)



def test_a_python_clients_executor_closes_its_connections(daemon: DaemonUnderTest,
                                                          executors: list[Executor]) -> None:
    """The thread that polls the daemon for a Python client's executor closes its own
    connection when it ends (a socket left to the garbage collector: a ResourceWarning)."""
    daemon.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = make_pool(daemon, executors)
        assert ex.submit(taskfns.square, 5).result(timeout=30) == 25
        ex.shutdown(wait=True)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_wait_on_a_task_whose_daemon_is_killed_ends_in_one_line(daemon: DaemonUnderTest,
                                                                   executors: list[Executor]) -> None:
    pid = daemon.start()
    make_pool(daemon, executors)
    queued = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "taskfns:sleep_then", "--arg", "60",
                 "--arg", "1")
    (task_id,) = queued.stdout.split()
    wait_for(lambda: [r["state"] for r in tasks_json(daemon)] == ["RUNNING"], 30, "the task to run")
    with subprocess.Popen([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "result",
                           task_id, "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=cli_env(), stdin=subprocess.DEVNULL) as waiting:
        daemon.snapshot()
        os.kill(pid, signal.SIGKILL)
        out, err = waiting.communicate(timeout=30)  # the contract's bound is 5 s; 30 is the test's
    assert waiting.returncode in (1, 3) and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert out == "", out
