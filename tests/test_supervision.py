"""Keeping pools alive, on the fake OS with a fake clock: the restart policy, backoff, crash
loops, slots and ports, start_secs, a pool's one spec, rolling restarts, delete, signal.
The real-process version of the same promises is in test_supervision_cli.py."""

from __future__ import annotations

import signal

import pytest

from fakes import SPEC, later, launch, live, pool, run

S_ALWAYS = {"restart": "always", "backoff": [1, 8], "max_restarts": [5, 60]}


# -- the restart policy ------------------------------------------------------------------


def test_a_failed_replica_is_replaced_in_its_slot_after_the_backoff(h):
    (rid,) = launch(h)  # default policy: on-failure, backoff 0.1..30
    pid = run(h, rid)
    h.fake.exit(pid, 3)
    h.turn()
    assert h.state(rid) == "FAILED"
    assert pool(h)["state"] == "backoff" and pool(h)["desired"] == 1
    assert live(h) == []
    later(h, 0.1)
    (new,) = live(h)
    assert new["id"] == "web-2" and new["slot"] == 0 and new["restarts"] == 1
    assert pool(h)["state"] == "ok" and pool(h)["restarts"] == 1 and pool(h)["desired"] == 1
    assert h.fake.procs[new["pid"]].env["ORCHESTRATOR_SLOT"] == "0"


@pytest.mark.parametrize("mode, code, replaced", [
    ("on-failure", 0, False), ("on-failure", 1, True), ("on-failure", -9, True),
    ("always", 0, True), ("never", 1, False), ("never", 0, False),
])
def test_restart_modes(h, mode, code, replaced):
    (rid,) = launch(h, policy={"restart": mode, "backoff": [0, 0]})
    h.fake.exit(run(h, rid), code)
    h.turn()
    h.turn()
    assert bool(live(h)) is replaced
    assert pool(h)["desired"] == (1 if replaced else 0)


def test_the_backoff_grows_per_slot_and_resets_once_healthy(h):
    policy = {"restart": "always", "backoff": [1, 8], "healthy_after": 10, "max_restarts": [100, 60]}
    (rid,) = launch(h, policy=policy)
    delays = []
    for _ in range(5):
        h.fake.exit(run(h, rid), 1)
        h.turn()
        waited = 0.0
        while not live(h):
            later(h, 0.25)
            waited += 0.25
        delays.append(waited)
        (row,) = live(h)
        rid = row["id"]
    # exponential from MIN, jittered, capped at MAX
    assert delays[0] <= 1.0 < delays[1] < delays[2] and 6.0 <= max(delays) <= 8.25, delays
    run(h, rid)
    later(h, 10.5)  # healthy: the next failure waits the minimum again
    h.fake.exit(h.rep(rid)["pid"], 1)
    h.turn()
    later(h, 1.0)
    assert live(h), "after a healthy run the backoff starts over at MIN"


def test_a_crash_loop_stops_replacing_until_an_operator_scales(h):
    (rid,) = launch(h, count=2, policy={"restart": "always", "backoff": [0, 0], "max_restarts": [3, 60]})[:1]
    for _ in range(3):
        h.fake.exit(run(h, rid), 1)
        h.turn()
        h.turn()
        rid = [r["id"] for r in live(h) if r["slot"] == 0][0]
    h.fake.exit(run(h, rid), 1)  # the 4th within 60 s
    h.turn()
    h.turn()
    p = pool(h)
    assert p["state"] == "crashloop" and "3 restarts within 60 s" in p["reason"]
    assert [r["slot"] for r in live(h)] == [1] and p["desired"] == 1
    result = h.ok("scale", pool="web", n=2)
    assert pool(h)["state"] == "ok" and pool(h)["reason"] is None
    assert len(result["launched"]) == 1 and sorted(r["slot"] for r in live(h)) == [0, 1]


def test_a_crash_long_after_running_counts_toward_the_loop_too(h):
    (rid,) = launch(h, policy={"restart": "always", "backoff": [0, 0], "max_restarts": [2, 600],
                               "healthy_after": 1})
    for _ in range(2):
        run(h, rid)
        later(h, 120)  # long healthy runs
        h.fake.exit(h.rep(rid)["pid"], 1)
        h.turn()
        h.turn()
        (row,) = live(h)
        rid = row["id"]
    run(h, rid)
    later(h, 120)
    h.fake.exit(h.rep(rid)["pid"], 1)
    h.turn()
    h.turn()
    assert pool(h)["state"] == "crashloop"


def test_terminate_is_never_replaced_and_lowers_the_size(h):
    ids = launch(h, count=2, policy=S_ALWAYS)
    for rid in ids:
        run(h, rid)
    h.ok("terminate", ids=[ids[0]])
    h.fake.exit(h.rep(ids[0])["pid"], -15)
    h.turn()
    later(h, 10)
    assert [r["id"] for r in live(h)] == [ids[1]] and pool(h)["desired"] == 1


def test_a_scheduled_replacement_is_cancelled_by_scale(h):
    (rid,) = launch(h, policy={"restart": "always", "backoff": [5, 5]})
    h.fake.exit(run(h, rid), 1)
    h.turn()
    assert pool(h)["state"] == "backoff"
    h.ok("scale", pool="web", n=0)
    later(h, 10)
    assert live(h) == [] and pool(h)["state"] == "ok" and pool(h)["desired"] == 0


# -- slots, ports, start_secs ---------------------------------------------------------------


def test_slots_ports_and_expansion(h):
    spec = {"command": ["sleep", "{port}"], "env": {"WHERE": "slot-{slot}", "RAW": "{x}"}}
    ids = launch(h, count=3, spec=spec, policy={"port_base": 8100})
    envs = [h.fake.procs[h.rep(i)["pid"]] for i in ids]
    assert [p.argv for p in envs] == [("sleep", "8100"), ("sleep", "8101"), ("sleep", "8102")]
    assert [(p.env["ORCHESTRATOR_SLOT"], p.env["PORT"], p.env["WHERE"]) for p in envs] == [
        ("0", "8100", "slot-0"), ("1", "8101", "slot-1"), ("2", "8102", "slot-2")]
    assert envs[0].env["RAW"] == "{x}"  # only {slot} and {port} are ours
    h.ok("terminate", ids=[ids[1]])
    (new,) = launch(h, spec=spec, policy={"port_base": 8100})
    assert h.rep(new)["slot"] == 1  # the lowest free slot


def test_start_secs(h):
    policy = {"start_secs": 2, "restart": "never"}
    a, b = launch(h, count=2, policy=policy)
    for rid in (a, b):
        h.fake.ready(h.rep(rid)["pid"])
    h.turn()
    assert h.state(a) == "STARTING"
    h.fake.exit(h.rep(b)["pid"], 0)
    h.turn()
    assert h.state(b) == "FAILED" and h.rep(b)["reason"].startswith("exited during start")
    later(h, 2.0)
    assert h.state(a) == "RUNNING" and h.rep(a)["ready"] is True


# -- one spec per pool, rolling restarts ------------------------------------------------------


def test_a_launch_with_another_spec_or_policy_is_refused(h):
    launch(h)
    reply = h.cmd("launch", pool="web", spec={"command": ["sleep", "5"]})
    assert not reply["ok"] and "--replace" in reply["error"]
    reply = h.cmd("launch", pool="web", spec=SPEC, policy={"restart": "never"})
    assert not reply["ok"] and "--replace" in reply["error"]
    assert h.ok("launch", pool="web", spec=SPEC, policy={}) == ["web-2"]  # the same: added


def test_restart_of_ids_is_surge_first(h):
    ids = launch(h, count=2)
    pids = [run(h, i) for i in ids]
    box = h.send("restart", ids=ids)
    assert box == []  # its reply waits until the new ones are ready
    news = [r for r in live(h) if r["id"] not in ids]
    assert sorted(r["slot"] for r in news) == [0, 1]
    assert all(h.state(i) == "RUNNING" for i in ids)  # the old ones still serve
    for r in news:
        h.fake.ready(r["pid"])
    h.turn()
    assert all(h.state(i) == "STOPPING" for i in ids)
    for pid in pids:
        h.fake.exit(pid, -15)
    h.turn()
    assert pool(h)["desired"] == 2 and len(live(h)) == 2


def test_a_new_replica_that_fails_while_its_old_one_stops_is_replaced(h):
    """Found by the stress suite (a pool settled one short, ~1 run in 15): a rolling
    restart's new replica is ready, its old one is asked to stop, and a signal to the pool
    kills the new one before the old one has gone. The old one, on its way out, must not
    count as holding the slot: the new one is replaced, and the pool keeps its size."""
    (old,) = launch(h, policy={"restart": "always", "backoff": [0, 0]})
    old_pid = run(h, old)
    h.send("restart", ids=[old])
    (new,) = [r for r in live(h) if r["id"] != old]
    h.fake.ready(new["pid"])
    h.turn()
    assert h.state(old) == "STOPPING" and h.state(new["id"]) == "RUNNING"
    h.fake.exit(new["pid"], -signal.SIGUSR1)
    h.turn()
    h.fake.exit(old_pid, -15)
    h.turn()
    later(h, 0)
    running = [r for r in live(h) if r["state"] in ("STARTING", "RUNNING")]
    assert len(running) == 1 and running[0]["slot"] == 0, live(h)
    assert pool(h)["desired"] == 1


def test_a_scale_down_during_a_rolling_restart_counts_a_slot_held_twice_once(h):
    """Found by the stress suite (a pool settled short of its size, ~1 run in 15 at 8 runs
    at once): a rolling restart's new replica starts beside the old one in its slot, and a
    scale down meanwhile counted that slot twice, so it stopped one slot too many; once the
    rollout ended, the pool ran one replica fewer than its size."""
    ids = launch(h, count=3, policy={"restart": "always", "backoff": [0, 0]})
    for i in ids:
        run(h, i)
    h.send("restart", ids=[ids[0]])  # surge: its new replica starts in slot 0 beside it
    (new,) = [r for r in live(h) if r["id"] not in ids]
    assert new["slot"] == 0
    h.ok("scale", pool="web", n=2)
    h.fake.ready(new["pid"])
    for _ in range(4):  # the rollout stops the old one; every stopped one exits
        h.turn()
        for r in live(h):
            if r["state"] == "STOPPING" and r["pid"] in h.fake.procs and not h.fake.procs[r["pid"]].exited:
                h.fake.exit(r["pid"], -15)
    later(h, 0)
    running = sorted((r["slot"], r["state"]) for r in live(h))
    assert running == [(0, "RUNNING"), (1, "RUNNING")], live(h)
    assert pool(h)["desired"] == 2


def test_a_rolling_restart_starts_a_replacement_that_waited_its_backoff(h):
    """Found by the stress suite: a replica failed, its replacement waited out its backoff,
    and a rolling restart of the pool cancelled that replacement; nothing filled its slot
    again. It starts at once instead (the operator acted), on the spec rolled to."""
    a, b = launch(h, count=2, policy={"restart": "always", "backoff": [30, 30], "max_restarts": [10, 60]})
    run(h, a)
    pid_b = run(h, b)
    h.fake.exit(pid_b, 1)
    h.turn()
    assert pool(h)["state"] == "backoff"
    h.send("restart", pool="web")
    (fresh,) = [r for r in live(h) if r["id"] not in (a, b) and r["slot"] == 1]
    assert pool(h)["state"] == "ok"
    for _ in range(4):  # new replicas ready, the rolled one gone
        for r in live(h):
            if r["state"] == "STARTING":
                h.fake.ready(r["pid"])
            elif r["state"] == "STOPPING" and not h.fake.procs[r["pid"]].exited:
                h.fake.exit(r["pid"], -15)
        h.turn()
    assert sorted((r["slot"], r["state"]) for r in live(h)) == [(0, "RUNNING"), (1, "RUNNING")], live(h)
    assert h.state(fresh["id"]) == "RUNNING"


def test_overlapping_restarts_and_a_terminate_leave_the_pool_at_its_size(h):
    """Found by the stress suite: a second restart of a pool while the first is replacing a
    slot, and a terminate of an old replica while its replacement starts, each left a
    replica more than the pool's size. Once the rollouts are over, the surplus is stopped,
    a slot held twice first."""
    ids = launch(h, count=3)
    pids = {i: run(h, i) for i in ids}
    h.send("restart", pool="web", max_unavailable=3)
    h.send("restart", pool="web", max_unavailable=3)  # the first one's new replicas count as old
    assert h.ok("terminate", ids=[ids[0]]) == [ids[0]]  # desired 3 -> 2, its replacement starting
    h.fake.exit(pids[ids[0]], -15)
    h.turn()
    for _ in range(6):  # every new replica ready, every stopped one gone, until it settles
        for r in live(h):
            if r["state"] == "STARTING":
                h.fake.ready(r["pid"])
            elif r["state"] == "STOPPING" and r["pid"] in h.fake.procs:
                h.fake.exit(r["pid"], -15)
        h.turn()
        h.turn()
    running = [r for r in live(h) if r["state"] == "RUNNING"]
    assert pool(h)["desired"] == 2
    assert len(running) == 2, running
    assert sorted(r["slot"] for r in running) == sorted({r["slot"] for r in running})  # no slot twice


def test_rolling_restart_with_ports_stops_first_one_slot_at_a_time(h):
    ids = launch(h, count=3, policy={"port_base": 9000})
    for i in ids:
        run(h, i)
    h.send("restart", pool="web", max_unavailable=1)
    replaced = {}
    for _ in range(3):
        stopping = [i for i in ids if h.state(i) == "STOPPING"]
        assert len(stopping) == 1
        running = [r for r in live(h) if r["state"] == "RUNNING"]
        assert len(running) >= 2
        old = stopping[0]
        h.fake.exit(h.rep(old)["pid"], -15)
        h.turn()
        h.turn()
        (new,) = [r for r in live(h) if r["state"] == "STARTING"]
        assert new["slot"] == h.rep(old)["slot"]
        h.fake.ready(new["pid"])
        h.turn()
        replaced[old] = new["id"]
    box = h.send("ping")
    assert box[0]["result"] == "pong"
    assert len(replaced) == 3 and pool(h)["desired"] == 3


def test_launch_replace_rolls_the_pool_onto_the_new_spec(h):
    ids = launch(h, count=2)
    for i in ids:
        run(h, i)
    box = h.send("launch", pool="web", spec={"command": ["sleep", "7"]}, replace=True)
    assert box == []
    for _ in range(2):
        (new,) = [r for r in live(h) if r["state"] == "STARTING"]
        assert h.fake.procs[new["pid"]].argv == ("sleep", "7")
        h.fake.ready(new["pid"])
        h.turn()
        for i in ids:
            if h.state(i) == "STOPPING" and h.rep(i)["pid"]:
                h.fake.exit(h.rep(i)["pid"], -15)
        h.turn()
    assert pool(h)["spec"]["command"] == ["sleep", "7"] and pool(h)["desired"] == 2


def test_a_failed_new_replica_stops_the_rollout(h):
    ids = launch(h, count=2)
    for i in ids:
        run(h, i)
    box: list[dict] = []
    h.engine.handle({"id": 99, "op": "restart", "args": {"pool": "web"}}, box.append)
    h.turn()
    (new,) = [r for r in live(h) if r["state"] == "STARTING"]
    h.fake.cannot_start(new["pid"], b"exec failed")
    h.turn()
    h.turn()
    assert box and box[0]["ok"] is False and "failed" in box[0]["error"]
    assert all(h.state(i) == "RUNNING" for i in ids)  # the old ones were kept


# -- delete, signal -----------------------------------------------------------------------------


def test_delete_terminates_and_forgets_the_pool_but_not_its_ids(h):
    ids = launch(h, count=2, policy=S_ALWAYS)
    for i in ids:
        run(h, i)
    result = h.ok("delete", pool="web")
    assert sorted(result["terminated"]) == ids
    for i in ids:
        h.fake.exit(h.rep(i)["pid"], -15)
    h.turn()
    later(h, 30)
    assert [p["name"] for p in h.status()["pools"]] == [] and live(h) == []
    reply = h.cmd("delete", pool="web")
    assert not reply["ok"] and "unknown pool" in reply["error"]
    assert launch(h) == ["web-3"]  # a new pool of that name: ids are never reused


def test_signal_reaches_replicas(h, fake):
    ids = launch(h, count=2)
    pids = [run(h, i) for i in ids]
    result = h.ok("signal", signal="HUP", pool="web")
    assert result == {"signal": "SIGHUP", "sent": ids}
    assert [fake.signals_to(p) for p in pids] == [[(signal.SIGHUP, "alive")]] * 2
    assert h.ok("signal", signal="USR1", ids=[ids[0]])["sent"] == [ids[0]]
    reply = h.cmd("signal", signal="NOPE", ids=[ids[0]])
    assert not reply["ok"] and "not a signal" in reply["error"]


def test_the_stop_signal_and_grace_are_the_pools(h, fake):
    (rid,) = launch(h, policy={"stop_signal": "INT", "grace": 1})
    pid = run(h, rid)
    h.ok("terminate", ids=[rid])
    assert fake.signals_to(pid) == [(signal.SIGINT, "alive")]
    later(h, 1.0)
    assert (signal.SIGKILL, "alive") in fake.signals_to(pid)


@pytest.mark.parametrize("policy, words", [
    ({"restart": "sometimes"}, "restart must be"), ({"backoff": [5, 1]}, "backoff MAX"),
    ({"max_restarts": [1, 0]}, "max_restarts S"), ({"ready": "ftp://x"}, "probe"),
    ({"ready": "http://10.0.0.1:80/"}, "loopback"), ({"stop_signal": "NOPE"}, "not a signal"),
    ({"port_base": 70000}, "port_base"), ({"nope": 1}, "unknown policy key"),
    ({"ready": "tcp:127.0.0.1:{port}"}, "port"), ({"grace": float("inf")}, "grace"),
])
def test_bad_policies_are_refused(h, policy, words):
    reply = h.cmd("launch", pool="web", spec=SPEC, policy=policy)
    assert not reply["ok"] and words in reply["error"], reply
    assert h.status()["pools"] == []
