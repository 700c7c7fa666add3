"""The order of pools (``--after``, key ``after``) through the CLI, with real processes: each
replica writes when it started, became ready, was asked to stop and ended (workers.stamped),
and the order of those times is what is checked: starts after what a pool starts after is
ready (or completed), stops before it, from the command line, from a config file and after
a kill -9 of the daemon; a failed job holds its dependents; cycles and unknown pools are
refused in one line. The state-machine version is test_order.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from helpers import DaemonUnderTest, Ident, cli, wait_for
from helpers import one_line_error as _one_line_error

pytestmark = pytest.mark.timeout(120)


def one_line_error(proc) -> str:
    return _one_line_error(proc).removeprefix("orchestrator: ")


def launch(d: DaemonUnderTest, stamps: Path, pool: str, *flags: str, env: dict[str, str] | None = None) -> list[str]:
    env_flags = [f"--env={k}={v}" for k, v in {"STAMPS": str(stamps), **(env or {})}.items()]
    proc = cli(d.state_dir, "launch", "--pool", pool, "--target", "workers:stamped", *env_flags, *flags)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def ready_probe(stamps: Path, pool: str) -> list[str]:
    return ["--ready", f"exec:test -f {stamps}/{pool}.slot{{slot}}.ready"]


def stamp(stamps: Path, rid: str, what: str) -> float:
    return float((stamps / f"{rid}.{what}").read_text())


def replicas(d: DaemonUnderTest, pool: str) -> list[dict]:
    return [r for r in d.status()["replicas"] if r["pool"] == pool]


def pool_row(d: DaemonUnderTest, name: str) -> dict:
    (row,) = [p for p in d.status()["pools"] if p["name"] == name]
    return row


def stopped(d: DaemonUnderTest) -> None:
    assert cli(d.state_dir, "stop", "--timeout", "60").returncode == 0


def test_launch_after_starts_once_ready_and_stop_goes_backwards(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start("--grace", "5")
    stamps, go = tmp_path / "stamps", tmp_path / "go"
    stamps.mkdir()
    db = launch(daemon, stamps, "db", "--count", "2", *ready_probe(stamps, "db"), env={"GO": str(go)})
    (web,) = launch(daemon, stamps, "web", "--after", "db", env={"STOP_SECS": "0.5"})

    # db cannot be ready before `go` exists: web waits, and says why
    wait_for(lambda: all(r["state"] == "STARTING" for r in replicas(daemon, "db")), 30, "db to start")
    (row,) = replicas(daemon, "web")
    assert row["state"] == "PENDING" and row["pid"] is None
    assert row["reason"] == "waiting for db (0 of 2 ready)"
    web_pool = pool_row(daemon, "web")
    assert web_pool["after"] == ["db:ready"] and web_pool["policy"]["after"] == ["db:ready"]
    assert web_pool["waiting"] == "waiting for db (0 of 2 ready)"
    assert [p["name"] for p in daemon.status()["pools"]] == ["db", "web"]
    text = cli(daemon.state_dir, "status").stdout
    assert "pool web: ok, size 1, restarts 0, after db:ready; waiting for db (0 of 2 ready)" in text
    assert not (stamps / f"{web}.start").exists()

    go.touch()
    wait_for(lambda: [r["state"] for r in replicas(daemon, "web")] == ["RUNNING"], 30, "web to run")
    assert stamp(stamps, web, "start") > max(stamp(stamps, r, "ready") for r in db)

    # stop: web first (it takes 0.5 s to end), db only once web has ended
    stopped(daemon)
    web_ended = stamp(stamps, web, "end")
    assert all(stamp(stamps, r, "term") > web_ended for r in db)


def test_a_failed_job_leaves_its_dependents_pending_with_the_reason(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    (job,) = launch(daemon, stamps, "migrate", "--restart", "never", env={"EXIT": "3"})
    (web,) = launch(daemon, stamps, "web", "--after", "migrate:completed")
    wait_for(lambda: not replicas(daemon, "migrate"), 30, "the job to end")
    (row,) = [r for r in daemon.status(all=True)["replicas"] if r["id"] == job]
    assert row["state"] == "FAILED"
    wait_for(lambda: (replicas(daemon, "web")[0]["reason"] or "").startswith("waiting for migrate:"), 10,
             "web's reason")
    (row,) = replicas(daemon, "web")
    assert row["state"] == "PENDING" and row["reason"] == f"waiting for migrate: {job} FAILED (exit code 3)"
    assert not (stamps / f"{web}.start").exists()


def test_a_cycle_or_an_unknown_pool_is_refused_in_one_line(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    proc = cli(daemon.state_dir, "launch", "--pool", "web", "--after", "db", "--", "sleep", "60")
    assert one_line_error(proc) == "after: unknown pool 'db' (pool web starts after it)"
    launch(daemon, stamps, "db")
    launch(daemon, stamps, "web", "--after", "db")
    proc = cli(daemon.state_dir, "launch", "--pool", "db", "--replace", "--after", "web:started",
               "--target", "workers:stamped", f"--env=STAMPS={stamps}")
    assert one_line_error(proc) == "after: a cycle: db -> web -> db (each starts after the next)"
    proc = cli(daemon.state_dir, "launch", "--pool", "x", "--after", "db:later", "--", "sleep", "60")
    assert one_line_error(proc) == "after: 'db:later': the condition must be one of ready, started, completed"
    proc = cli(daemon.state_dir, "delete", "db")
    assert "pool 'db' is in the after of web" in one_line_error(proc)
    assert cli(daemon.state_dir, "health").returncode == 0
    assert [p["name"] for p in daemon.status()["pools"]] == ["db", "web"]


CONFIG = """\
[pools.web]
target = "workers:stamped"
size = 2
env = {{ STAMPS = "{stamps}", STOP_SECS = "0.5" }}
after = ["db", "migrate:completed"]

[pools.migrate]
target = "workers:stamped"
restart = "never"
env = {{ STAMPS = "{stamps}", READY_AFTER = "0.3", EXIT = "0" }}
after = ["db"]

[pools.db]
target = "workers:stamped"
env = {{ STAMPS = "{stamps}", READY_AFTER = "0.3" }}
ready = "exec:test -f {stamps}/db.slot{{slot}}.ready"
"""


def test_a_config_file_starts_and_stops_in_order(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    conf = tmp_path / "orchestrator.toml"
    conf.write_text(CONFIG.format(stamps=stamps))
    daemon.start("--config", str(conf), "--grace", "5")
    wait_for(lambda: len([r for r in replicas(daemon, "web") if r["state"] == "RUNNING"]) == 2, 30, "web to run")
    everything = daemon.status(all=True)["replicas"]
    ids = {p: [r["id"] for r in everything if r["pool"] == p] for p in ("db", "migrate", "web")}
    (db,), (job,) = ids["db"], ids["migrate"]
    assert stamp(stamps, job, "start") > stamp(stamps, db, "ready")
    job_done = stamp(stamps, job, "ready")  # it exits 0 right after
    assert all(stamp(stamps, w, "start") > job_done for w in ids["web"])
    assert [p["name"] for p in daemon.status()["pools"]] == ["db", "migrate", "web"]

    # a cycle in a reload: one line, the running config stays
    conf.write_text(CONFIG.format(stamps=stamps) + 'after = ["web"]\n')
    proc = cli(daemon.state_dir, "reload")
    assert one_line_error(proc) == (f"{conf}:5: pools.web.after: a cycle: web -> db -> web "
                                    "(each starts after the next)")
    assert cli(daemon.state_dir, "health").returncode == 0

    stopped(daemon)
    last_web_end = max(stamp(stamps, w, "end") for w in ids["web"])
    assert stamp(stamps, db, "term") > last_web_end


def test_a_config_file_with_a_cycle_is_refused_at_start(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    conf.write_text('[pools.a]\ncommand = ["sleep", "60"]\nafter = ["b"]\n\n'
                    '[pools.b]\ncommand = ["sleep", "60"]\nafter = ["a:started"]\n')
    proc = cli(daemon.state_dir, "start", "--config", str(conf))
    assert one_line_error(proc) == f"{conf}:3: pools.a.after: a cycle: a -> b -> a (each starts after the next)"


def test_a_restart_after_kill_9_of_the_daemon_follows_the_order(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    launch(daemon, stamps, "db", *ready_probe(stamps, "db"), env={"READY_AFTER": "0.5"})
    launch(daemon, stamps, "web", "--after", "db")
    wait_for(lambda: [r["state"] for r in replicas(daemon, "web")] == ["RUNNING"], 30, "web to run")
    daemon.snapshot()
    assert daemon.pid is not None
    fd = os.pidfd_open(daemon.pid)
    try:
        assert Ident.of(daemon.pid) in daemon.seen
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
    wait_for(lambda: cli(daemon.state_dir, "status").returncode == 3, 30, "the daemon to be gone")
    (stamps / "db.slot0.ready").unlink()  # db-1's: its probe must not find it for db-2
    daemon.start()  # waits for the watchdog's sweep; the journal's pools come back
    wait_for(lambda: [r["state"] for r in replicas(daemon, "web")] == ["RUNNING"], 30, "web to run again")
    (db,), (web,) = [r["id"] for r in replicas(daemon, "db")], [r["id"] for r in replicas(daemon, "web")]
    assert (db, web) == ("db-2", "web-2")  # new replicas, after the lost ones
    assert stamp(stamps, web, "start") > stamp(stamps, db, "ready")
