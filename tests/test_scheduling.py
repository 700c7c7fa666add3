"""Scheduling end to end (daemon/taskqueue.py through a real Executor, embedded and in a
daemon): ``Executor.options()`` and what it refuses, a second tenant starting next while
the first has 1,000 queued, priorities, ``submit --priority --tenant``, ``tasks --json``,
the pool options a joiner must match, and priority and tenant across a daemon's restart.
Tasks are held back by a gate (a FIFO the test opens when it is ready), never by a sleep."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import schedfns
from conftest import TAG_VAR
from helpers import TESTS, DaemonUnderTest, cli, cli_env, one_line_error, wait_for
from orchestrator import Client, Executor, InvalidSpec, TaskTimeoutError
from test_executor import MakeExecutor, make_executor  # noqa: F401  # the fixture


class Gate:
    """A FIFO a task (schedfns.gate) blocks on until ``open()``."""

    def __init__(self, where: Path) -> None:
        self.path = str(where)
        os.mkfifo(self.path)

    def open(self) -> None:
        """Once the task reads it (it has started), let it go."""
        def reader_there() -> bool:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as err:
                if err.errno == errno.ENXIO:  # no reader yet: the task has not started
                    return False
                raise
            os.close(fd)
            return True

        wait_for(reader_there, 30, "the gated task to start")


def queued_in_the_loop(ex: Executor, count: int) -> None:
    """Until the loop holds ``count`` queued tasks: a submit returns before its task reaches
    the loop, and the order is the loop's only once they are all there."""
    def there() -> bool:
        return sum(p.get("tasks", {}).get("queued", 0) for p in ex.orchestrator.status()["pools"]) >= count

    wait_for(there, 60, f"{count} tasks queued in the loop")


def test_a_second_tenants_task_starts_next_while_the_first_has_a_thousand_queued(
        make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(1)
    gate = Gate(tmp_path / "gate")
    first = ex.submit(schedfns.gate, gate.path)
    wait_for(first.running, 30, "the gated task to start")
    alice = ex.options(tenant="alice")
    a = [alice.submit(schedfns.now) for _ in range(1000)]
    b = ex.options(tenant="bob").submit(schedfns.now)
    queued_in_the_loop(ex, 1001)
    gate.open()
    assert first.result(timeout=60) == "open"
    ran_b = b.result(timeout=60)
    ran_a = [f.result(timeout=120) for f in a]
    # The one worker held a[0] behind the gated task; bob's is the next handed out after it.
    assert sum(t < ran_b for t in ran_a) <= 1, sorted(ran_a).index(min(ran_a, key=lambda t: abs(t - ran_b)))
    assert ran_a == sorted(ran_a)  # FIFO within alice's


def test_a_higher_priority_starts_first(make_executor: MakeExecutor, tmp_path: Path) -> None:
    ex = make_executor(1)
    gate = Gate(tmp_path / "gate")
    first = ex.submit(schedfns.gate, gate.path)
    wait_for(first.running, 30, "the gated task to start")
    held = ex.submit(schedfns.now)  # held by the busy worker behind the gated one
    low = [ex.options(priority=-1).submit(schedfns.now) for _ in range(3)]
    plain = [ex.submit(schedfns.now) for _ in range(3)]
    urgent = ex.options(priority=10).submit(schedfns.now)
    queued_in_the_loop(ex, 8)
    gate.open()
    assert first.result(timeout=60) == "open"
    order = sorted((f.result(timeout=60), name) for name, f in
                   [("held", held), ("urgent", urgent)] + [("plain", f) for f in plain] + [("low", f) for f in low])
    assert [name for _, name in order] == ["held", "urgent", "plain", "plain", "plain", "low", "low", "low"]


def test_the_view_applies_its_options_and_refuses_bad_ones(make_executor: MakeExecutor) -> None:
    ex = make_executor(1)
    # The plain submit is the standard library's: every keyword is fn's, none is ours.
    assert ex.submit(dict, priority=3, tenant="t", timeout=1).result(timeout=30) == {"priority": 3, "tenant": "t",
                                                                                    "timeout": 1}
    view = ex.options(tenant="alice").options(priority=2)
    assert view.submit(dict, key="k").result(timeout=30) == {"key": "k"}
    assert list(view.map(schedfns.sleep, [0, 0, 0], chunksize=2)) == [0, 0, 0]
    assert "tenant='alice', priority=2" in repr(view) and view.executor is ex
    with pytest.raises(TaskTimeoutError):
        ex.options(timeout=0.3).submit(schedfns.sleep, 30).result(timeout=30)
    for bad, kind, line in [
        (dict(retry_on="OSError"), TypeError, "options(): retry_on must be an exception type or a tuple of them"),
        (dict(deadline=-5.0), ValueError, "options(): deadline must be a number of seconds from the submit above 0"),
        (dict(priority="1"), TypeError, "options(): priority must be a whole number, got '1'"),
        (dict(priority=True), TypeError, "options(): priority must be a whole number, got True"),
        (dict(tenant=3), TypeError, "options(): tenant must be a name of 1 to 200 characters, got 3"),
        (dict(tenant=""), TypeError, "options(): tenant must be a name of 1 to 200 characters, got ''"),
        (dict(timeout=-1), ValueError, "options(): timeout must be a number of seconds above 0 or None, got -1"),
        (dict(retries=-1), ValueError, "options(): retries must be a whole number of at least 0, got -1"),
    ]:
        with pytest.raises(kind) as info:
            view.options(**bad)
        assert str(info.value).startswith(line) and "\n" not in str(info.value), (bad, str(info.value))
    with pytest.raises(TypeError):
        ex.options(3)  # type: ignore[misc]  # keywords only: a positional is a mistake, not a priority
    with pytest.raises(InvalidSpec) as weights:
        make_executor(1, tenant_weights={"alice": 0})
    assert str(weights.value) == "tenant_weights: the weight of 'alice' must be a number above 0, got 0"


def test_cli_submit_priority_tenant_tasks_json_and_a_restart_carries_them(daemon: DaemonUnderTest,
                                                                        make_executor: MakeExecutor,
                                                                        tmp_path: Path) -> None:
    daemon.start()
    env = {TAG_VAR: cli_env()[TAG_VAR]}
    ex = make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS), env=env,
                       tenant_weights={"alice": 2}, max_wait=600)
    with pytest.raises(InvalidSpec) as conflict:  # a joiner with other weights changes how tasks share
        with Client(daemon.state_dir) as client:
            client.executor("jobs", max_workers=1, cwd=str(TESTS), env=env, tenant_weights={"alice": 3},
                            max_wait=600)
    assert "tenant_weights={'alice': 2}, not {'alice': 3}" in str(conflict.value)
    gate = Gate(tmp_path / "gate")
    first = ex.submit(schedfns.gate, gate.path)
    wait_for(lambda: any(r["state"] == "RUNNING" for r in json.loads(cli(daemon.state_dir, "tasks", "--json").stdout)),
             30, "the gated task to run")
    ids = {}
    for prio, tenant in (("0", "bob"), ("5", "alice"), ("-3", "carol")):
        got = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "schedfns:now", "--priority", prio,
                  "--tenant", tenant)
        assert got.returncode == 0, got.stderr
        ids[got.stdout.strip()] = (int(prio), tenant)
    bad = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "schedfns:now", "--priority", "high")
    assert "--priority: must be a whole number, got 'high'" in one_line_error(bad, 2)

    def shown() -> dict[str, tuple[int, str]]:
        proc = cli(daemon.state_dir, "tasks", "--json", "--all")
        assert proc.returncode in (0, 3), proc.stderr
        return {r["id"]: (r["priority"], r["tenant"]) for r in json.loads(proc.stdout) if r["id"] in ids}

    assert shown() == ids
    table = cli(daemon.state_dir, "tasks").stdout.splitlines()
    assert table[0].split()[:4] == ["ID", "STATE", "PRIO", "TENANT"]
    assert any(line.split()[:4] == [task_id, "QUEUED", "5", "alice"] for task_id in ids for line in table), table
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    assert shown() == ids  # the daemon down: as the store has them
    daemon.start()
    assert shown() == ids  # restored with their priority and tenant
    gate_lost = first.exception(timeout=60)  # the gated one was cut short by the stop
    assert gate_lost is not None
    with Client(daemon.state_dir) as client:
        ran = {task_id: client.task(task_id).result(timeout=60) for task_id in ids}
    assert sorted(ids, key=lambda i: ran[i]) == sorted(ids, key=lambda i: -ids[i][0])  # by priority after it
