"""systemctl's verbs on a pool: stop POOL, start POOL, show, is-active, reset-failed.

Part 1 drives the supervisor on the fake OS with a fake clock (tests/fakes.py), where the
races are: a replacement scheduled when the stop lands, a replica that ends while its pool
stops, a grace that runs out, a reload or a restore of a stopped pool. Part 2 runs the
verbs through the CLI against a real daemon, across a restart, a reload and an upgrade.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from fakes import SPEC, Harness, later, launch, live, pool, run
from helpers import DaemonUnderTest, cli, one_line_error, wait_for

ALWAYS = {"restart": "always", "backoff": [1, 8], "max_restarts": [5, 60]}


def active(h: Harness, name: str = "web") -> str:
    got = h.ok("is_active", pool=name)
    assert got["active"] is (got["state"] == "active")
    return got["state"]


# -- part 1: the fake engine ---------------------------------------------------------------


def test_a_stopped_pool_keeps_its_size_and_nothing_replaces_its_replicas(h):
    ids = launch(h, count=2, policy=ALWAYS)
    pids = [run(h, rid) for rid in ids]
    assert active(h) == "active"
    result = h.ok("stop_pools", pools=["web"])
    assert result == {"stopped": ["web"], "terminating": ids}
    assert [h.state(i) for i in ids] == ["STOPPING", "STOPPING"]
    assert all(h.fake.signals_to(pid)[0][0] == signal.SIGTERM for pid in pids)
    assert active(h) == "deactivating"
    for pid in pids:
        h.fake.exit(pid, -signal.SIGTERM)
    h.turn()
    later(h, 120)  # far past every backoff: a replacement would have been made by now
    assert live(h) == [] and [h.state(i) for i in ids] == ["TERMINATED", "TERMINATED"]
    p = pool(h)
    assert (p["state"], p["stopped"], p["desired"], p["restarts"]) == ("stopped", True, 2, 0)
    assert p["spec"] == SPEC and p["policy"]["restart"] == "always"
    assert active(h) == "inactive"

    started = h.ok("start_pools", pools=["web"])
    assert started["started"] == ["web"] and len(started["launched"]) == 2
    assert sorted(r["slot"] for r in live(h)) == [0, 1]
    assert active(h) == "activating"
    for rid in started["launched"]:
        run(h, rid)
    assert active(h) == "active" and pool(h)["state"] == "ok" and pool(h)["stopped"] is False
    again = h.ok("start_pools", pools=["web"])  # started already: left as it is
    assert again == {"started": [], "launched": []}


def test_a_start_while_replicas_still_stop_waits_for_them_and_keeps_the_slots(h):
    ids = launch(h, count=2, policy={**ALWAYS, "port_base": 9100})
    pids = [run(h, rid) for rid in ids]
    h.ok("stop_pools", pools=["web"])
    box: list[dict] = []
    h.engine.handle({"id": 5, "op": "start_pools", "args": {"pools": ["web"]}}, box.append)
    h.turn()
    assert box == [] and [r["id"] for r in live(h)] == ids  # nothing new while the old ones hold slots 0 and 1
    h.fake.exit(pids[0], -signal.SIGTERM)
    h.turn()
    assert box == [] and [r["id"] for r in live(h)] == ids[1:]
    h.fake.exit(pids[1], -signal.SIGTERM)
    h.turn()
    h.turn()
    assert len(box) == 1 and box[0]["ok"], box
    launched = box[0]["result"]["launched"]
    assert len(launched) == 2 and sorted(r["slot"] for r in live(h)) == [0, 1]
    assert sorted(h.fake.procs[r["pid"]].env["PORT"] for r in live(h)) == ["9100", "9101"]


def test_a_replacement_waiting_for_its_backoff_is_cancelled_by_the_stop(h):
    (rid,) = launch(h, policy=ALWAYS)
    h.fake.exit(run(h, rid), 1)
    h.turn()
    assert pool(h)["state"] == "backoff" and active(h) == "activating"
    h.ok("stop_pools", pools=["web"])
    later(h, 60)
    assert live(h) == [] and pool(h)["desired"] == 1 and pool(h)["state"] == "stopped"


def test_a_replica_that_fails_while_its_pool_stops_is_not_replaced(h):
    ids = launch(h, count=2, policy=ALWAYS)
    run(h, ids[0])  # the second is still STARTING: interrupted by the stop, signalled
    pid0 = h.rep(ids[0])["pid"]
    h.ok("stop_pools", pools=["web"])
    assert h.state(ids[1]) == "INTERRUPTED"
    h.fake.exit(pid0, 1)  # ends with a failure during its grace
    h.fake.exit(h.rep(ids[1])["pid"], 1)
    h.turn()
    later(h, 60)
    assert live(h) == [] and pool(h)["desired"] == 2 and pool(h)["restarts"] == 0


def test_the_stop_kills_after_the_pools_grace(h):
    (rid,) = launch(h, policy={**ALWAYS, "grace": 2})
    pid = run(h, rid)
    h.ok("stop_pools", pools=["web"])
    later(h, 1.9)
    assert [s for s, _ in h.fake.signals_to(pid)] == [signal.SIGTERM]
    later(h, 0.2)
    sent = [s for s, _ in h.fake.signals_to(pid)]
    assert sent[0] == signal.SIGTERM and set(sent[1:]) == {signal.SIGKILL}, sent


def test_stop_with_wait_replies_once_the_replicas_have_ended(h):
    (rid,) = launch(h, policy=ALWAYS)
    pid = run(h, rid)
    box: list[dict] = []
    h.engine.handle({"id": 7, "op": "stop_pools", "args": {"pools": ["web"], "wait": True, "timeout": 30}},
                    box.append)
    h.turn()
    h.turn()
    assert box == [] and h.state(rid) == "STOPPING"  # it waits for the replica
    h.fake.exit(pid, -signal.SIGTERM)
    h.turn()
    h.turn()
    assert box == [{"id": 7, "ok": True, "result": {"stopped": ["web"], "terminating": [rid]}}]


def test_stop_with_wait_says_when_the_replicas_outlast_its_timeout(h):
    (rid,) = launch(h, policy={**ALWAYS, "grace": 60})
    run(h, rid)
    box: list[dict] = []
    h.engine.handle({"id": 8, "op": "stop_pools", "args": {"pools": ["web"], "wait": True, "timeout": 1}},
                    box.append)
    h.turn()
    later(h, 1.5)
    h.turn()
    assert len(box) == 1 and not box[0]["ok"] and "not all stopped within 1 s" in box[0]["error"], box
    assert h.state(rid) == "STOPPING" and pool(h)["stopped"] is True


def test_scale_and_a_reload_of_a_stopped_pool_change_its_size_and_start_nothing(h):
    launch(h, count=1, policy=ALWAYS)
    h.ok("stop_pools", pools=["web"])
    got = h.ok("scale", pool="web", n=3)
    assert got["launched"] == [] and got["stopped"] is True
    h.turn()
    assert live(h) == [] and pool(h)["desired"] == 3
    # the config file's declaration (reload): a new size and a new spec, kept stopped
    what = h.engine.supervisor.declare("web", {"command": ["sleep", "2000"]}, ALWAYS, 4)
    h.turn()
    assert what == "changed" and live(h) == []
    p = pool(h)
    assert (p["desired"], p["state"], p["spec"]["command"]) == (4, "stopped", ["sleep", "2000"])
    started = h.ok("start_pools", pools=["web"])
    assert len(started["launched"]) == 4
    assert all(h.fake.procs[r["pid"]].argv == ("sleep", "2000") for r in live(h))


def test_launch_and_restart_of_a_stopped_pool_are_refused_in_one_line(h):
    launch(h, policy=ALWAYS)
    h.ok("stop_pools", pools=["web"])
    for op, args in (("launch", {"pool": "web", "spec": SPEC, "policy": ALWAYS}),
                     ("restart", {"pool": "web"})):
        reply = h.cmd(op, **args)
        assert not reply["ok"] and "stopped" in reply["error"] and "\n" not in reply["error"], reply
    assert live(h) == []


def test_an_unknown_pool_changes_nothing(h):
    (rid,) = launch(h, policy=ALWAYS)
    run(h, rid)
    for op in ("stop_pools", "start_pools", "reset_failed"):
        reply = h.cmd(op, pools=["web", "nope"])
        assert not reply["ok"] and reply["code"] == "unknown_pool" and "'nope'" in reply["error"], reply
    for op in ("show", "is_active"):
        reply = h.cmd(op, pool="nope")
        assert not reply["ok"] and reply["code"] == "unknown_pool", reply
    reply = h.cmd("stop_pools", pools=[])
    assert not reply["ok"] and reply["code"] == "invalid"
    assert h.state(rid) == "RUNNING" and pool(h)["state"] == "ok"


def test_reset_failed_ends_a_crash_loop_and_its_counters_and_fills_the_slots(h):
    ids = launch(h, count=2, policy={"restart": "always", "backoff": [0, 0], "max_restarts": [2, 60]})
    rid = ids[0]
    for _ in range(2):
        h.fake.exit(run(h, rid), 1)
        h.turn()
        h.turn()
        rid = [r["id"] for r in live(h) if r["slot"] == 0][0]
    h.fake.exit(run(h, rid), 1)  # the 3rd within 60 s: a crash loop
    h.turn()
    h.turn()
    p = pool(h)
    assert (p["state"], p["desired"], p["restarts"]) == ("crashloop", 1, 2)
    assert active(h) == "failed"
    got = h.ok("reset_failed", pools=["web"])
    assert got["reset"] == ["web"] and len(got["launched"]) == 1
    p = pool(h)
    assert (p["state"], p["reason"], p["desired"], p["restarts"]) == ("ok", None, 2, 0)
    assert sorted(r["slot"] for r in live(h)) == [0, 1]
    (new,) = [r for r in live(h) if r["slot"] == 0]
    assert new["restarts"] == 0
    for row in live(h):
        if row["state"] != "RUNNING":
            run(h, row["id"])
    assert active(h) == "active"


def test_reset_failed_starts_a_failed_replica_of_a_never_pool_again(h):
    (rid,) = launch(h, policy={"restart": "never"})
    h.fake.exit(run(h, rid), 3)
    h.turn()
    assert pool(h)["desired"] == 0 and active(h) == "failed"
    got = h.ok("reset_failed", pools=["web"])
    assert len(got["launched"]) == 1 and pool(h)["desired"] == 1
    run(h, got["launched"][0])
    assert active(h) == "active"


def test_show_gives_every_property_with_the_defaults_resolved(h):
    launch(h, count=1, policy={"restart": "always"}, pool="db")
    launch(h, count=2, policy={"restart": "never", "after": ["db"]})
    shown = h.ok("show", pool="web")
    eff = shown["effective"]
    assert eff["grace"] == 5.0  # the daemon's (the harness's), the pool sets none
    assert eff["restart"] == "never" and eff["backoff"] == [0.1, 30.0] and eff["stop_signal"] == "TERM"
    assert shown["policy"] == {"restart": "never", "after": ["db:ready"]}  # as declared
    assert shown["after_pools"] == {"db": "ready"} and h.ok("show", pool="db")["required_by"] == ["web"]
    assert shown["counts"]["PENDING"] == 2 and shown["desired"] == 2 and shown["running"] == 0
    assert shown["waiting"] == "waiting for db (0 of 1 ready)"
    assert shown["active_state"] == "activating" and shown["stopped"] is False
    assert shown["start_position"] == 2 and shown["sockets"] == []


def test_a_dependent_waits_while_the_pool_it_starts_after_is_stopped(h):
    (db,) = launch(h, policy={"restart": "always"}, pool="db")
    run(h, db)
    h.ok("stop_pools", pools=["db"])
    (web,) = launch(h, policy={"after": ["db"]})
    assert h.state(web) == "PENDING"
    assert h.ok("show", pool="web")["waiting"] == "waiting for db: stopped (start db)"


def test_a_stopped_pool_is_restored_stopped_with_its_size(h, make_h):
    launch(h, count=3, policy=ALWAYS)
    h.ok("stop_pools", pools=["web"])
    row = h.engine.pool("web").stored()
    assert row["stopped"] is True
    other = make_h()
    other.engine.supervisor.restore([{"name": "web", "spec": row, "desired": 3, "next_n": 4}])
    other.turn()
    assert [r for r in other.status(all=False)["replicas"]] == []
    (p,) = other.status()["pools"]
    assert (p["state"], p["desired"]) == ("stopped", 3)
    started = other.ok("start_pools", pools=["web"])
    assert started["launched"] == ["web-4", "web-5", "web-6"]


# -- part 2: through the CLI, a real daemon --------------------------------------------------

E2E = pytest.mark.timeout(180)  # a real daemon, started and stopped more than once


def _config(path: Path, size: int) -> None:
    path.write_text(f"""
[daemon]
grace = 2.0

[pools.jobs]
command = ["sleep", "1000"]
size = {size}
restart = "always"
""")


def _pool(d: DaemonUnderTest, name: str) -> dict:
    (row,) = [p for p in d.status()["pools"] if p["name"] == name]
    return row


def _live(d: DaemonUnderTest, name: str) -> list[dict]:
    return [r for r in d.status()["replicas"] if r["pool"] == name]


def _all_running(d: DaemonUnderTest, name: str, n: int) -> bool:
    reps = _live(d, name)
    return len(reps) == n and all(r["state"] == "RUNNING" for r in reps)


@E2E
def test_stop_and_start_a_pool_across_a_restart_a_reload_and_an_upgrade(daemon: DaemonUnderTest,
                                                                          tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    _config(conf, 2)
    daemon.start("--config", str(conf), "--grace", "2", "--http", "off")  # the daemon's flags still parse
    wait_for(lambda: _all_running(daemon, "jobs", 2), 30, "the declared pool")
    assert cli(daemon.state_dir, "is-active", "jobs").returncode == 0

    stopped = cli(daemon.state_dir, "stop", "jobs")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines()[0] == "stopped pool jobs"
    assert _live(daemon, "jobs") == []  # stop waits until they have ended
    p = _pool(daemon, "jobs")
    assert (p["state"], p["stopped"], p["desired"]) == ("stopped", True, 2)
    assert "pool jobs: stopped, size 2" in cli(daemon.state_dir, "status").stdout
    quiet = cli(daemon.state_dir, "is-active", "jobs")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (3, "", "")
    assert cli(daemon.state_dir, "is-active", "-v", "jobs").stdout == "inactive\n"

    # a restart of the daemon: still stopped, its size kept
    assert cli(daemon.state_dir, "stop").returncode == 0
    down = cli(daemon.state_dir, "status", "--json")
    assert down.returncode == 3 and json.loads(down.stdout)["pools"][0]["state"] == "stopped"
    daemon.start("--config", str(conf))
    p = _pool(daemon, "jobs")
    assert (p["state"], p["desired"]) == ("stopped", 2) and _live(daemon, "jobs") == []

    # a reload with a new size: the size changes, nothing starts
    _config(conf, 3)
    reloaded = cli(daemon.state_dir, "reload", "--json")
    assert reloaded.returncode == 0 and json.loads(reloaded.stdout)["resized"] == ["jobs"], reloaded.stderr
    assert _live(daemon, "jobs") == [] and _pool(daemon, "jobs")["desired"] == 3

    # an upgrade carries the flag
    upgraded = cli(daemon.state_dir, "upgrade", timeout=150)
    assert upgraded.returncode == 0, upgraded.stderr
    assert _pool(daemon, "jobs")["state"] == "stopped" and _live(daemon, "jobs") == []

    started = cli(daemon.state_dir, "start", "jobs")  # waits until they run
    assert started.returncode == 0, started.stderr
    assert started.stdout.splitlines()[0] == "started pool jobs"
    assert _all_running(daemon, "jobs", 3)
    assert cli(daemon.state_dir, "is-active", "jobs").returncode == 0

    shown = cli(daemon.state_dir, "show", "jobs")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert {"Name=jobs", "State=ok", "ActiveState=active", "Desired=3", "Stopped=no", "Grace=2",
            "Restart=always", "ExecStart=sleep 1000", "ReplicasRunning=3", "Declared=yes"} <= set(lines), lines
    assert all("=" in line for line in lines)
    data = json.loads(cli(daemon.state_dir, "show", "jobs", "--json").stdout)
    assert data["effective"]["grace"] == 2.0 and data["effective"]["log_backups"] == 3


@E2E
def test_reset_failed_through_the_cli(daemon: DaemonUnderTest) -> None:
    daemon.start("--grace", "1")
    got = cli(daemon.state_dir, "launch", "--pool", "bad", "--restart", "never", "--", sys.executable, "-c",
              "import sys; sys.exit(3)")
    assert got.returncode == 0, got.stderr
    wait_for(lambda: _pool(daemon, "bad")["desired"] == 0, 30, "the failure")
    failed = cli(daemon.state_dir, "is-active", "--json", "bad")
    assert failed.returncode == 3 and json.loads(failed.stdout) == {"pool": "bad", "active": False, "state": "failed"}
    reset = cli(daemon.state_dir, "reset-failed", "bad", "--json")
    assert reset.returncode == 0, reset.stderr
    assert len(json.loads(reset.stdout)["launched"]) == 1


@E2E
def test_the_verbs_refuse_bad_input_in_one_line(daemon: DaemonUnderTest) -> None:
    sd = daemon.state_dir
    assert "no daemon is running" in one_line_error(cli(sd, "start", "jobs"), 3)  # no daemon: nothing to start a pool in
    assert one_line_error(cli(sd, "is-active", "jobs"), 3)
    daemon.start()
    assert cli(sd, "launch", "--pool", "jobs", "--", "sleep", "1000").returncode == 0
    assert "unknown pool 'nope'" in one_line_error(cli(sd, "is-active", "nope"), 4)
    for verb in (("stop", "jobs", "nope"), ("start", "nope"), ("show", "nope"), ("reset-failed", "nope")):
        assert "unknown pool 'nope'" in one_line_error(cli(sd, *verb), 1), verb
    assert "start the daemon" in one_line_error(cli(sd, "start", "jobs", "--config", "x.toml"), 2)
    assert one_line_error(cli(sd, "stop", "--no-block"), 2)
    assert one_line_error(cli(sd, "show"), 2)
    assert "jobs" in [p["name"] for p in daemon.status()["pools"]] and _pool(daemon, "jobs")["state"] == "ok"
