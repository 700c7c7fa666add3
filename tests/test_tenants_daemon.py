"""A config file's ``tenant_weights`` and ``max_wait`` in force in a running daemon
(``start --config FILE`` with executor pools of one worker): a joiner that asks for other
ones is refused naming them, a gated run starts tenants' tasks by the file's weights, a
task queued past the file's ``max_wait`` starts before a higher priority, ``tasks --json``
says why a queued task waits, the metrics count queued tasks and waits by tenant, and a
``reload`` of the file's new weights is what a joiner must match then.
Tasks are held back by a gate (a FIFO the test opens), never by a sleep."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import TESTS, DaemonUnderTest, cli, wait_for
from orchestrator import Client, InvalidSpec
from test_scheduling import Gate

CONFIG = f"""
    [pools.shares]
    kind = "executor"
    size = 1
    cwd = {str(TESTS)!r}
    tenant_weights = {{ alice = 2 }}
    max_wait = 600

    [pools.aging]
    kind = "executor"
    size = 1
    cwd = {str(TESTS)!r}
    max_wait = 1
"""


def submit(client: Client, pool: str, target: str, *args: Any, **place: Any) -> str:
    task_id: str = client.call("task_submit", {"pool": pool, "target": f"schedfns:{target}", "args": list(args),
                                               "pythonpath": [str(TESTS)], "cwd": str(TESTS), **place})
    return task_id


def running(client: Client, task_id: str) -> bool:
    return bool(client.call("task_result", {"id": task_id})["state"] == "RUNNING")


def metric(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    where = tmp_path / "orchestrator.toml"
    where.write_text(textwrap.dedent(CONFIG))
    return where


def test_the_files_weights_share_the_worker_and_a_joiner_with_others_is_refused(daemon: DaemonUnderTest,
                                                                                conf: Path, tmp_path: Path) -> None:
    daemon.start("--config", str(conf))
    with Client(daemon.state_dir) as client:
        with pytest.raises(InvalidSpec) as refused:
            client.executor("shares", max_workers=1, cwd=str(TESTS), tenant_weights={"alice": 3}, max_wait=600)
        assert "tenant_weights={'alice': 2}, not {'alice': 3}" in str(refused.value)
        with pytest.raises(InvalidSpec) as refused:
            client.executor("shares", max_workers=1, cwd=str(TESTS), tenant_weights={"alice": 2}, max_wait=60)
        assert "max_wait=600" in str(refused.value) and "not 60" in str(refused.value)

        gate = Gate(tmp_path / "gate")
        first = submit(client, "shares", "gate", gate.path)
        wait_for(lambda: running(client, first), 60, "the gated task to run")
        # alice's first is held behind the gate at once; then the queue decides the rest.
        ids = {submit(client, "shares", "now", tenant="alice"): "alice" for _ in range(4)}
        ids.update({submit(client, "shares", "now", tenant="bob"): "bob" for _ in range(2)})
        rows = json.loads(cli(daemon.state_dir, "tasks", "--json", "--pool", "shares").stdout)
        waits = {r["id"]: r["waiting"] for r in rows if r["state"] == "QUEUED"}
        assert set(waits) == set(ids), rows
        assert sorted(set(waits.values())) == ["held by shares-1, behind the task it runs",
                                               "its one worker busy"], waits
        text = cli(daemon.state_dir, "metrics").stdout
        for tenant, queued, running_now in (("alice", 4, 0), ("bob", 2, 0), ("", 0, 1)):
            assert metric(text, "orchestrator_tenant_tasks", pool="shares", tenant=tenant, state="QUEUED") == queued
            assert metric(text, "orchestrator_tenant_tasks", pool="shares", tenant=tenant,
                          state="RUNNING") == running_now
        lines = cli(daemon.state_dir, "status").stdout.splitlines()
        at = next(i for i, x in enumerate(lines) if x.startswith("pool shares:"))
        assert lines[at + 1] == "  tenants (queued/running): alice 4/0, bob 2/0, (none) 0/1", lines
        gate.open()
        ran = {task_id: client.task(task_id).result(timeout=60) for task_id in ids}
    order = [ids[task_id] for task_id in sorted(ids, key=lambda i: ran[i])]
    # Weights 2:1 (the file's): bob's first joins at the next start, then two of alice's for
    # each of bob's. With both at weight 1 it would be alice, bob, alice, bob, alice, alice.
    assert order == ["alice", "bob", "alice", "alice", "bob", "alice"], order
    text = cli(daemon.state_dir, "metrics").stdout
    for tenant, started in (("alice", 4), ("bob", 2), ("", 1)):
        assert metric(text, "orchestrator_tenant_task_queue_wait_seconds_count", pool="shares",
                      tenant=tenant) == started
    assert metric(text, "orchestrator_task_queue_wait_seconds_count", pool="shares") == 7
    conf.write_text(conf.read_text().replace("alice = 2", "alice = 3"))  # a reload takes the file's new weights
    reloaded = cli(daemon.state_dir, "reload")
    assert reloaded.returncode == 0, reloaded.stderr
    with Client(daemon.state_dir) as client:
        with pytest.raises(InvalidSpec) as refused:
            client.executor("shares", max_workers=1, cwd=str(TESTS), tenant_weights={"alice": 2}, max_wait=600)
        assert "tenant_weights={'alice': 3}, not {'alice': 2}" in str(refused.value)


def test_a_task_queued_past_the_files_max_wait_starts_before_a_higher_priority(daemon: DaemonUnderTest,
                                                                             conf: Path, tmp_path: Path) -> None:
    daemon.start("--config", str(conf))
    with Client(daemon.state_dir) as client:
        gate = Gate(tmp_path / "gate")
        first = submit(client, "aging", "gate", gate.path)
        wait_for(lambda: running(client, first), 60, "the gated task to run")
        held = submit(client, "aging", "now", priority=9)  # held behind the gate by the worker
        low = submit(client, "aging", "now", priority=0, tenant="carol")
        queued_at = client.call("tasks", {"id": low})[0]["queued_at"]
        # The file's max_wait is 1 s: once low has waited that long (the daemon's wall
        # clock, the one queued_at is on), it goes above every priority.
        wait_for(lambda: time.time() > queued_at + 1.5, 10, "low to wait past max_wait")
        high = submit(client, "aging", "now", priority=5)
        gate.open()
        ran = {name: client.task(task_id).result(timeout=60) for name, task_id in
               (("held", held), ("low", low), ("high", high))}
    assert sorted(ran, key=lambda n: ran[n]) == ["held", "low", "high"], ran


def test_the_status_text_names_the_busiest_tenants_and_sums_the_rest() -> None:
    from orchestrator.client.display import TENANTS_SHOWN, format_status

    def text(tenants: dict[str, dict[str, int]]) -> list[str]:
        pool = {"name": "px", "kind": "executor", "desired": 1, "tasks": {"queued": 0, "running": 0,
                                                                          "tenants": tenants}}
        data = {"daemon": {"running": False}, "state_dir": "/x", "pools": [pool], "replicas": []}
        return format_status(data).splitlines()

    assert not any("tenants" in x for x in text({"": {"queued": 3, "running": 1}}))  # no tenant: nothing more
    many = {f"t{i:02d}": {"queued": i, "running": 1} for i in range(TENANTS_SHOWN + 3)}
    line = next(x for x in text(many) if x.startswith("  tenants"))
    shown = [f"t{i:02d} {i}/1" for i in range(TENANTS_SHOWN + 2, 2, -1)]
    assert line == f"  tenants (queued/running): {', '.join(shown)}, 3 more 3/3"
