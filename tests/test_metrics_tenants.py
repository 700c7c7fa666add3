"""Metrics per tenant of an executor pool (daemon/metrics.py): the ``tenant_tasks`` gauges
(queued and running by tenant, from the task table at scrape time, as ``status`` gives
them) and the ``tenant_task_queue_wait_seconds`` histogram (observed at each start), on the
fake table of test_tasktable_fake.py with the real ``Metrics``; and the bound on the tenant
labels (MAX_TENANTS per pool, the rest "other"); why a queued task waits (``tasks``) in a
fixed pool; and the README's table naming every metric rendered."""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

from orchestrator import taskwire as w
from orchestrator.daemon.metrics import MAX_TENANTS, Metrics
from orchestrator.daemon.taskrecords import Task
from orchestrator.states import TaskState as T
from test_tasktable_fake import POOL, Harness, make  # noqa: F401


def submit(h: Harness, tenant: str | None) -> Task:
    n = len(h.tasks.live) + len(h.tasks.ended) + 1
    task = Task("", 0, h.xp, b"call %d" % n, n, h.session, None, 0, tenant=tenant)
    h.tasks.submit(h.xp, task)
    return task


def scrape(h: Harness, metrics: Metrics) -> dict[str, Any]:
    """The exposition of ``metrics`` with the pool's row as ``status`` has it, parsed back."""
    status = {"pools": [{"name": POOL, "kind": "executor", "tasks": h.commands.pool_counts(POOL)}]}
    return {f.name: f for f in text_string_to_metric_families(metrics.render(status, {}))}


def values(fam: Any, sample: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == sample}


def test_queued_running_and_waits_by_tenant_after_a_run_with_two_tenants(make: Callable[..., Harness]) -> None:
    h = make()
    metrics = Metrics()
    h.engine.metrics = metrics  # the real one, fed by the table
    w1, w2 = h.worker(), h.worker()
    tasks = [submit(h, "alice") for _ in range(4)] + [submit(h, "bob") for _ in range(2)] + [submit(h, None)]
    h.turn()
    sent = {1: w1.tasks_sent(2), 2: w2.tasks_sent(2)}  # each runs one and holds one
    h.advance(2.0)  # what starts from now on waited 2 s
    first = next(t for t in tasks if t.n == sent[1][0])
    w1.send(w.RESULT, first.n, b"r")  # its held task starts; one more is sent to hold
    assert len(w1.tasks_sent(1)) == 1

    unfinished = collections.Counter((t.tenant or "", t.state.value) for t in tasks if not t.state.terminal)
    started = [t for t in tasks if t.started_at is not None]
    assert sum(n for (_, s), n in unfinished.items() if s == "RUNNING") == 2 and len(started) == 3
    assert {t.tenant for t in tasks if t.state is T.QUEUED} >= {"alice", "bob"}  # both still wait

    fams = scrape(h, metrics)
    gauges = values(fams["orchestrator_tenant_tasks"], "orchestrator_tenant_tasks")
    for tenant in ("alice", "bob", ""):
        for state in ("QUEUED", "RUNNING"):
            key = (("pool", POOL), ("state", state), ("tenant", tenant))
            assert gauges.get(key, 0) == unfinished[(tenant, state)], (key, gauges)
    assert sum(gauges.values()) == len([t for t in tasks if not t.state.terminal])
    pool_gauges = values(fams["orchestrator_tasks"], "orchestrator_tasks")
    assert pool_gauges[(("pool", POOL), ("state", "QUEUED"))] == unfinished[("alice", "QUEUED")] + \
        unfinished[("bob", "QUEUED")] + unfinished[("", "QUEUED")]

    waits = fams["orchestrator_tenant_task_queue_wait_seconds"]
    counts = values(waits, "orchestrator_tenant_task_queue_wait_seconds_count")
    sums = values(waits, "orchestrator_tenant_task_queue_wait_seconds_sum")
    inf = values(waits, "orchestrator_tenant_task_queue_wait_seconds_bucket")
    by_tenant = collections.Counter(t.tenant or "" for t in started)
    assert {dict(k)["tenant"]: v for k, v in counts.items()} == dict(by_tenant)
    for tenant, n in by_tenant.items():
        assert inf[(("le", "+Inf"), ("pool", POOL), ("tenant", tenant))] == n
        waited = sum(t.started_at - t.queued_at for t in started if (t.tenant or "") == tenant)
        assert abs(sums[(("pool", POOL), ("tenant", tenant))] - waited) < 1e-6
    assert max(t.started_at - t.queued_at for t in started) == 2.0  # the one started after the clock moved
    per_pool = values(fams["orchestrator_task_queue_wait_seconds"], "orchestrator_task_queue_wait_seconds_count")
    assert per_pool == {(("pool", POOL),): 3.0}  # the pool's own histogram counts every start still


def test_the_tenant_labels_are_bounded_per_pool() -> None:
    m = Metrics()
    extra = 30
    for i in range(MAX_TENANTS + extra):
        m.task_started("big", 0.01, f"t{i:03d}")
    m.task_started("big", 0.01, "t000")  # one tracked before the bound keeps its own series
    m.task_started("big", 0.01, None)  # past the bound: no tenant too is "other" here
    m.task_started("small", 0.5, None)
    tenants = {f"t{i:03d}": {"queued": i, "running": 1} for i in range(MAX_TENANTS + extra)}
    status = {"pools": [{"name": "big", "tasks": {"queued": 0, "running": 0, "tenants": tenants}}]}
    fams = {f.name: f for f in text_string_to_metric_families(m.render(status, {}))}

    counts = values(fams["orchestrator_tenant_task_queue_wait_seconds"],
                    "orchestrator_tenant_task_queue_wait_seconds_count")
    big = {dict(k)["tenant"]: v for k, v in counts.items() if dict(k)["pool"] == "big"}
    assert len(big) == MAX_TENANTS + 1 and big["other"] == extra + 1 and big["t000"] == 2
    assert all(f"t{i:03d}" in big for i in range(MAX_TENANTS))
    assert {dict(k)["tenant"]: v for k, v in counts.items() if dict(k)["pool"] == "small"} == {"": 1}
    per_pool = values(fams["orchestrator_task_queue_wait_seconds"], "orchestrator_task_queue_wait_seconds_count")
    assert per_pool[(("pool", "big"),)] == MAX_TENANTS + extra + 2

    gauges = values(fams["orchestrator_tenant_tasks"], "orchestrator_tenant_tasks")
    queued = {dict(k)["tenant"]: v for k, v in gauges.items() if dict(k)["state"] == "QUEUED"}
    running = {dict(k)["tenant"]: v for k, v in gauges.items() if dict(k)["state"] == "RUNNING"}
    assert len(queued) == MAX_TENANTS + 1  # the ones with the most tasks, and the rest summed
    assert "t129" in queued and "t000" not in queued
    assert queued["other"] == sum(range(extra)) and running["other"] == extra
    assert sum(queued.values()) == sum(range(MAX_TENANTS + extra))
    m.forget_pool("big")
    fams = {f.name: f for f in text_string_to_metric_families(m.render({}, {}))}
    counts = values(fams["orchestrator_tenant_task_queue_wait_seconds"],
                    "orchestrator_tenant_task_queue_wait_seconds_count")
    assert {dict(k)["pool"] for k in counts} == {"small"}


def test_tasks_says_why_a_task_waits_behind_higher_priorities_and_other_tenants(make: Callable[..., Harness]) -> None:
    # A fixed pool (no min_workers): what waits behind busy workers, whatever the order
    # that put it there, says so; one held behind a running task names its worker.
    h = make(options={"tenant_weights": {"alice": 3}})
    w1, w2 = h.worker(), h.worker()
    urgent = [Task("", 0, h.xp, b"u", n, h.session, None, 0, priority=5, tenant="alice") for n in (1, 2, 3, 4)]
    for task in urgent:
        h.tasks.submit(h.xp, task)
    late = submit(h, "bob")  # priority 0, another tenant: behind all of alice's
    mine = submit(h, None)
    h.turn()
    assert w1.tasks_sent(2) == [1, 3] and w2.tasks_sent(2) == [2, 4]
    rows = h.commands.commands()["tasks"]({}, lambda msg: None, 1)
    waiting = {r["id"]: r["waiting"] for r in rows}
    assert waiting == {urgent[0].id: None, urgent[1].id: None,
                       urgent[2].id: "held by px-1, behind the task it runs",
                       urgent[3].id: "held by px-2, behind the task it runs",
                       late.id: "all 2 workers busy", mine.id: "all 2 workers busy"}
    w1.send(w.RESULT, 1, b"r")  # the held one starts, bob's is sent to be held behind it
    assert w1.tasks_sent(1) == [late.n]
    assert h.tasks.waiting(late) == "held by px-1, behind the task it runs" and h.tasks.waiting(urgent[2]) is None
    w1.send(w.RESULT, 3, b"r")
    assert h.tasks.waiting(late) is None and state(late) is T.RUNNING


def state(task: Task) -> T:
    return task.state  # read again after the loop turned


def test_the_readme_names_every_metric_the_daemon_renders() -> None:
    class Lag:
        last = 0.0

        def max_recent(self) -> float:
            return 0.0

    m = Metrics(lag=Lag())  # render reads only these two of a LagMonitor
    m.task_started("px", 0.1, "alice")
    status = {"pools": [{"name": "px", "kind": "executor", "tasks": {"queued": 0, "running": 0, "tenants": {}}}]}
    rendered = {f.name for f in text_string_to_metric_families(m.render(status, {"started_at": 1.0, "version": "1"}))}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("The metric names, all prefixed `orchestrator_`")[1].split("\n\n")[1]
    named = {name.removesuffix("_total") for name in re.findall(r"`([a-z_]+)(?:\{[a-z_,]*\})?`", table)}
    assert {n.removeprefix("orchestrator_") for n in rendered} <= named, sorted(rendered)
