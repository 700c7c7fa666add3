"""Rough edges an operator meets with executor pools in the daemon: an idle client's polls
are not journaled (``events`` keeps the real history), ``status`` counts each way a task
ends apart, a task queued again shows no worker, and ``events --replica`` of a replica
nobody knows is a one-line error."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from helpers import TESTS, DaemonUnderTest, cli, cli_json, one_line_error, wait_for
from orchestrator import Client, Executor
from orchestrator.daemon.taskrecords import ExecPool, Task
from orchestrator.states import TaskState as T
from test_tasks_cli import executors, make_pool  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


def _commands(text: str, op: str) -> float:
    """orchestrator_commands_total of ``op`` (ok) in the metrics' text."""
    found = re.search(rf'^orchestrator_commands_total{{op="{op}",outcome="ok"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _submit(client: Client, target: str, *args: Any, **extra: Any) -> str:
    return client.call("task_submit", {"pool": "jobs", "target": f"taskfns:{target}", "args": list(args),
                                       "pythonpath": [str(TESTS)], "cwd": str(TESTS), **extra})


def _ended(client: Client, task_id: str) -> str:
    return client.call("task_result", {"id": task_id, "wait": True, "timeout": 30}, timeout=40)["state"]


def test_an_idle_clients_polls_are_not_journaled(daemon: DaemonUnderTest, executors: list[Executor]) -> None:  # noqa: F811
    daemon.start()
    make_pool(daemon, executors)  # its client polls task_events about once a second, idle
    wait_for(lambda: _commands(cli(daemon.state_dir, "metrics").stdout, "task_events") >= 3, 30,
             "three task_events polls")
    with Client(daemon.state_dir) as client:  # and other reads: tasks, task_result
        client.call("tasks", {})
    events = [json.loads(line) for line in cli(daemon.state_dir, "events", "--json").stdout.splitlines()]
    ops = [e["data"].get("op") for e in events if e["kind"] == "command"]
    assert "executor" in ops, ops  # what changed something is journaled...
    assert not {"task_events", "tasks", "task_result"} & set(ops), ops  # ...reads and polls are not


def test_status_counts_each_end_apart(daemon: DaemonUnderTest, executors: list[Executor]) -> None:  # noqa: F811
    daemon.start("--grace", "1")
    make_pool(daemon, executors)
    with Client(daemon.state_dir) as client:
        assert _ended(client, _submit(client, "square", 3)) == "DONE"
        assert _ended(client, _submit(client, "fail", "no")) == "FAILED"
        assert _ended(client, _submit(client, "sleep_then", 30, 0, timeout=0.2)) == "TIMED_OUT"
        slow = _submit(client, "sleep_then", 30, 0)
        wait_for(lambda: client.call("task_result", {"id": slow})["state"] == "RUNNING", 30, "the task to run")
        assert client.call("task_cancel", {"ids": [slow]}) == [True]
    counts = [p for p in cli_json(daemon.state_dir, "status")["pools"] if p["name"] == "jobs"][0]["tasks"]
    assert counts == {"queued": 0, "running": 0, "waiting": 0, "done": 1, "failed": 1, "cancelled": 1, "timed_out": 1, "lost": 0,
                      "tenants": {}}
    line = [ln for ln in cli(daemon.state_dir, "status").stdout.splitlines() if ln.startswith("pool jobs:")][0]
    assert line.endswith("tasks 0 queued, 0 running, 1 done, 1 failed, 1 cancelled, 1 timed out"), line


def test_a_task_queued_again_shows_no_worker(daemon: DaemonUnderTest, executors: list[Executor]) -> None:  # noqa: F811
    """Interrupted by ``stop`` with a retry left, it waits QUEUED for the next start: the
    worker that ran it is gone and is not shown as its worker."""
    daemon.start("--grace", "1")
    make_pool(daemon, executors)
    with Client(daemon.state_dir) as client:
        task = _submit(client, "sleep_then", 30, 0, retries=1)
        wait_for(lambda: client.call("task_result", {"id": task})["state"] == "RUNNING", 30, "the task to run")
        running = [r for r in client.call("tasks", {}) if r["id"] == task][0]
    assert running["worker"] == "jobs-1"
    stopped = cli(daemon.state_dir, "stop", "--timeout", "30")
    assert stopped.returncode == 0, stopped.stderr
    rows = json.loads(cli(daemon.state_dir, "tasks", "--json").stdout)
    assert [(r["id"], r["state"], r["worker"]) for r in rows] == [(task, "QUEUED", None)]
    assert running.get("last_worker") == "jobs-1"


def test_a_queued_tasks_record_keeps_its_last_worker_apart() -> None:
    task = Task("jobs/1", 1, ExecPool("jobs", {}, b""), b"x", None, None, None, 1, state=T.QUEUED,
                attempts=1, worker_id="jobs-1")
    assert (task.record()["worker"], task.record()["last_worker"]) == (None, "jobs-1")
    task.state = T.RUNNING
    assert (task.record()["worker"], task.record()["last_worker"]) == ("jobs-1", "jobs-1")


def test_events_of_an_unknown_replica_is_a_one_line_error(daemon: DaemonUnderTest, state_dir: Path,
                                                          executors: list[Executor]) -> None:  # noqa: F811
    never = cli(state_dir, "events", "--replica", "nosuch")  # no journal yet
    assert never.returncode == 1 and one_line_error(never) == "orchestrator: unknown replica 'nosuch'"
    daemon.start()
    make_pool(daemon, executors)
    proc = cli(daemon.state_dir, "events", "--replica", "nosuch")
    assert proc.returncode == 1 and one_line_error(proc) == "orchestrator: unknown replica 'nosuch'"
    assert proc.stdout == ""
    known = cli(daemon.state_dir, "events", "--replica", "jobs-1")
    assert known.returncode == 0 and "jobs-1" in known.stdout, known.stderr
