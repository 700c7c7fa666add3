"""The order of pools (policy ``after``) on the fake OS: a pool's replicas stay PENDING,
with the reason, until the pools it starts after meet their condition (ready, started,
completed); a failed dependency holds them; cycles and unknown pools are refused; a
shutdown stops dependents before what they depend on. The real-process version is
test_order_cli.py."""

from __future__ import annotations

import signal

import pytest

from fakes import SPEC, Harness

NEVER = {"restart": "never"}


def launch(h: Harness, pool: str, count: int = 1, **policy) -> list[str]:
    return h.ok("launch", pool=pool, count=count, spec=SPEC, policy={**NEVER, **policy})


def pid_of(h: Harness, rid: str) -> int:
    return h.rep(rid)["pid"]


def run(h: Harness, rid: str) -> None:
    h.fake.ready(pid_of(h, rid))
    h.turn()
    assert h.state(rid) == "RUNNING", h.rep(rid)


def pool(h: Harness, name: str) -> dict:
    (row,) = [p for p in h.status()["pools"] if p["name"] == name]
    return row


def settle(h: Harness) -> None:
    h.turn()
    h.turn()


def test_a_dependent_waits_pending_until_every_replica_it_starts_after_is_ready(h):
    db = launch(h, "db", 2)
    (web,) = launch(h, "web", after=["db"])
    settle(h)
    assert h.state(web) == "PENDING" and h.rep(web)["pid"] is None
    assert h.rep(web)["reason"] == "waiting for db (0 of 2 ready)"
    assert pool(h, "web")["waiting"] == "waiting for db (0 of 2 ready)"
    assert pool(h, "web")["after"] == ["db:ready"]
    run(h, db[0])
    settle(h)
    assert h.state(web) == "PENDING" and h.rep(web)["reason"] == "waiting for db (1 of 2 ready)"
    run(h, db[1])
    settle(h)
    assert h.state(web) == "STARTING" and h.rep(web)["reason"] is None
    assert pool(h, "web")["waiting"] is None
    # dependencies first in status
    assert [p["name"] for p in h.status()["pools"]] == ["db", "web"]


def test_started_is_met_once_each_replica_was_spawned(h):
    (db,) = launch(h, "db")
    (web,) = launch(h, "web", after=["db:started"])
    h.turn()
    assert h.state(db) == "STARTING"
    settle(h)
    assert h.state(web) == "STARTING"


def test_a_dependent_of_a_pool_with_nothing_to_wait_for_starts_at_once(h):
    (db,) = launch(h, "db")
    run(h, db)
    (web,) = launch(h, "web", after=["db"])
    settle(h)
    assert h.state(web) == "STARTING"


def test_completed_waits_for_the_job_to_exit_zero(h):
    (job,) = launch(h, "migrate")
    (web,) = launch(h, "web", after=["migrate:completed"])
    run(h, job)
    settle(h)
    assert h.rep(web)["reason"] == "waiting for migrate to complete (1 still to run)"
    h.fake.exit(pid_of(h, job), 0)
    settle(h)
    assert h.state(job) == "EXITED"
    assert h.state(web) == "STARTING"


def test_a_failed_completed_job_holds_its_dependents_until_an_operator_acts(h):
    (job,) = launch(h, "migrate")
    (web,) = launch(h, "web", after=["migrate:completed"])
    run(h, job)
    h.fake.exit(pid_of(h, job), 3)
    settle(h)
    assert h.state(job) == "FAILED"
    for _ in range(3):
        settle(h)
    assert h.state(web) == "PENDING"
    assert h.rep(web)["reason"] == "waiting for migrate: migrate-1 FAILED (exit code 3)"
    # the operator runs the job again: its dependents start once it completes
    h.ok("scale", pool="migrate", n=1)
    h.turn()
    (again,) = [r["id"] for r in h.status(all=False)["replicas"] if r["pool"] == "migrate"]
    assert h.rep(web)["reason"] == "waiting for migrate to complete (1 still to run)"
    run(h, again)
    h.fake.exit(pid_of(h, again), 0)
    settle(h)
    assert h.state(web) == "STARTING"


def test_a_crash_looping_dependency_holds_its_dependents_with_the_reason(h):
    (db,) = launch(h, "db", restart="always", max_restarts=[0, 60])
    (web,) = launch(h, "web", after=["db"])
    run(h, db)
    h.fake.exit(pid_of(h, db), 1)
    settle(h)
    assert pool(h, "db")["state"] == "crashloop"
    assert h.state(web) == "PENDING"
    assert h.rep(web)["reason"].startswith("waiting for db: crash loop (0 restarts within 60 s")


def test_a_chain_starts_one_pool_after_the_other(h):
    (a,) = launch(h, "a")
    (b,) = launch(h, "b", after=["a"])
    (c,) = launch(h, "c", after=["b"])
    settle(h)
    assert [h.state(x) for x in (a, b, c)] == ["STARTING", "PENDING", "PENDING"]
    run(h, a)
    settle(h)
    assert [h.state(x) for x in (b, c)] == ["STARTING", "PENDING"]
    assert h.rep(c)["reason"] == "waiting for b (0 of 1 ready)"
    run(h, b)
    settle(h)
    assert h.state(c) == "STARTING"
    assert [p["name"] for p in h.status()["pools"]] == ["a", "b", "c"]


@pytest.mark.parametrize("after, message", [
    (["nosuch"], "after: unknown pool 'nosuch' (pool web starts after it)"),
    (["web"], "after: a cycle: web -> web (each starts after the next)"),
    (["db:whenever"], "after: 'db:whenever': the condition must be one of ready, started, completed"),
])
def test_an_unknown_pool_or_a_cycle_is_refused_in_one_line(h, after, message):
    launch(h, "db")
    reply = h.cmd("launch", pool="web", count=1, spec=SPEC, policy={"after": after})
    assert not reply["ok"] and reply["error"] == message
    assert [p["name"] for p in h.status()["pools"]] == ["db"]


def test_a_cycle_through_a_replace_is_refused(h):
    launch(h, "db")
    launch(h, "web", after=["db"])
    reply = h.cmd("launch", pool="db", count=1, spec=SPEC, policy={**NEVER, "after": ["web"]}, replace=True)
    assert not reply["ok"]
    assert reply["error"] == "after: a cycle: db -> web -> db (each starts after the next)"


def test_delete_of_a_pool_others_start_after_is_refused(h):
    launch(h, "db")
    launch(h, "web", after=["db"])
    reply = h.cmd("delete", pool="db")
    assert not reply["ok"] and "pool 'db' is in the after of web: delete that first" in reply["error"]
    h.ok("delete", pool="web")
    h.ok("delete", pool="db")


def test_shutdown_stops_dependents_before_what_they_depend_on(h, fake):
    (db,) = launch(h, "db")
    run(h, db)
    (web,) = launch(h, "web", after=["db"])
    settle(h)
    run(h, web)
    (other,) = launch(h, "other")
    run(h, other)
    pids = {r: pid_of(h, r) for r in (db, web, other)}
    fake.procs[pids[db]].on_term = fake.procs[pids[other]].on_term = "die"
    signalled_before_web_ended: list[int] = []

    def web_ends_a_turn_after_its_signal() -> None:
        if not signalled_before_web_ended and any(p == pids[web] for p, _, _ in fake.signals):
            signalled_before_web_ended.extend(p for p, _, _ in fake.signals)
            fake.exit(pids[web], 0)

    h.engine.reactor.at_turn_end(web_ends_a_turn_after_its_signal)
    h.engine.shutdown()
    terms = [p for p, sig, _ in fake.signals if sig == signal.SIGTERM]
    assert set(terms[:2]) == {pids[web], pids[other]} and terms[2:] == [pids[db]]
    assert pids[db] not in signalled_before_web_ended
    assert [h.state(r) for r in (db, web, other)] == ["TERMINATED"] * 3


# -- a config file: one line, FILE:LINE: pools.NAME.after: what ----------------------------


@pytest.mark.parametrize("text, line, message", [
    ('[pools.db]\ncommand = ["x"]\nafter = ["web"]\n\n[pools.web]\ncommand = ["x"]\nafter = ["db"]\n', 3,
     "pools.db.after: a cycle: db -> web -> db (each starts after the next)"),
    ('[pools.web]\ncommand = ["x"]\n\nafter = ["web:started"]\n', 4,
     "pools.web.after: a cycle: web -> web (each starts after the next)"),
    ('[pools.web]\ncommand = ["x"]\nafter = ["db"]\n', 3,
     "pools.web.after: unknown pool 'db': not a pool of this file"),
    ('[pools.web]\ncommand = ["x"]\nafter = ["db:soon"]\n\n[pools.db]\ncommand = ["x"]\n', 3,
     "pools.web.after: 'db:soon': the condition must be one of ready, started, completed"),
    ('[pools.web]\ncommand = ["x"]\nafter = "db"\n', 3,
     "pools.web.after: must be a list of POOL[:CONDITION], got 'db'"),
])
def test_a_config_file_with_a_cycle_or_an_unknown_pool_is_refused_at_its_line(tmp_path, text, line, message):
    from orchestrator.daemon.config import ConfigError, load

    path = tmp_path / "orchestrator.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f"{path}:{line}: {message}"


def test_a_config_file_declares_the_order():
    from orchestrator.daemon.config import parse

    cfg = parse('[pools.web]\ncommand = ["x"]\nafter = ["migrate:completed", "db"]\n\n'
                '[pools.db]\ncommand = ["x"]\n\n[pools.migrate]\ncommand = ["x"]\nafter = ["db:started"]\n')
    assert cfg.pools["web"].policy["after"] == ["db:ready", "migrate:completed"]
    assert cfg.pools["migrate"].policy["after"] == ["db:started"]


def test_the_example_file_declares_an_order():
    from pathlib import Path

    from orchestrator.daemon.config import load
    from orchestrator.policy import after_order

    cfg = load(Path(__file__).resolve().parent.parent / "examples" / "ordering.toml")
    graph = {name: [e.split(":")[0] for e in decl.policy.get("after", ())] for name, decl in cfg.pools.items()}
    assert after_order(graph) == [["db"], ["migrate"], ["web"]]


def test_a_reload_that_removes_a_pool_and_its_dependent_stops_the_dependent_first(h, fake):
    sup = h.engine.supervisor
    assert sup.declare("db", SPEC, NEVER, 1) == "added"
    assert sup.declare("web", SPEC, {**NEVER, "after": ["db"]}, 1) == "added"
    h.turn()
    (db,) = [r["id"] for r in h.status()["replicas"] if r["pool"] == "db"]
    run(h, db)
    settle(h)
    (web,) = [r["id"] for r in h.status()["replicas"] if r["pool"] == "web"]
    run(h, web)
    assert sorted(sup.undeclare_missing(set())) == ["db", "web"]
    h.turn()
    assert h.state(web) == "STOPPING" and h.state(db) == "RUNNING"
    assert h.status()["pools"] == []  # both deleted at once
    assert fake.signals_to(pid_of(h, db)) == []
    fake.exit(pid_of(h, web), 0)
    settle(h)
    assert h.state(web) == "TERMINATED" and h.state(db) == "STOPPING"
    assert [sig for sig, _ in fake.signals_to(pid_of(h, db))] == [signal.SIGTERM]
    fake.exit(pid_of(h, db), 0)
    settle(h)
    assert h.state(db) == "TERMINATED"
