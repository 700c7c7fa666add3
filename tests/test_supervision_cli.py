"""A supervised pool end to end, as a user drives it: real HTTP servers on loopback, kill -9
of a worker, a rolling restart that keeps the pool serving, probes that fail, and the
restart, delete and signal commands, all through the CLI."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import DaemonUnderTest, cli, free_port_range, serves, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def daemon(daemon: DaemonUnderTest) -> DaemonUnderTest:
    """conftest's daemon, started with a grace of 2 s."""
    daemon.start("--grace", "2")
    return daemon


def status(d: DaemonUnderTest) -> dict:
    return d.status()


def pool(d: DaemonUnderTest, name: str) -> dict:
    (row,) = [p for p in status(d)["pools"] if p["name"] == name]
    return row


def running(d: DaemonUnderTest, name: str) -> list[dict]:
    return [r for r in status(d)["replicas"] if r["pool"] == name and r["state"] == "RUNNING"]


WEB = [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"]


def test_a_supervised_web_pool(daemon: DaemonUnderTest) -> None:
    base = free_port_range(3)
    launched = cli(daemon.state_dir, "launch", "--pool", "web", "--count", "3", "--port-base", str(base),
                   "--ready", "http://127.0.0.1:{port}/", "--restart", "always", "--backoff", "0.1:1",
                   "--wait", "--timeout", "60", "--", *WEB)
    assert launched.returncode == 0, launched.stderr
    ids = launched.stdout.split()
    reps = running(daemon, "web")
    assert sorted(r["slot"] for r in reps) == [0, 1, 2] and all(r["ready"] for r in reps)
    assert all(serves(base + s) for s in range(3))
    p = pool(daemon, "web")
    assert p["state"] == "ok" and p["policy"]["restart"] == "always" and p["spec"]["command"][:3] == WEB[:3]

    # kill -9 of one worker: replaced, same slot, new id, ready again; the size stays 3
    victim = [r for r in reps if r["slot"] == 1][0]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: any(r["slot"] == 1 and r["id"] != victim["id"] for r in running(daemon, "web")), 30,
             "the replacement to be ready")
    assert pool(daemon, "web")["desired"] == 3 and pool(daemon, "web")["restarts"] == 1
    assert serves(base + 1)
    events = [json.loads(line) for line in cli(daemon.state_dir, "events", "--json").stdout.splitlines()]
    restarts = [e for e in events if e["kind"] == "restart"]
    assert restarts and restarts[-1]["data"]["replica"] == victim["id"] and "delay" in restarts[-1]["data"]

    # a rolling restart never has fewer than 2 of 3 ready
    low = [3]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            low[0] = min(low[0], sum(serves(base + s) for s in range(3)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        done = cli(daemon.state_dir, "restart", "--pool", "web", "--json")
    finally:
        stop.set()
        watcher.join(30)
    assert done.returncode == 0, done.stderr
    replaced = json.loads(done.stdout)["replaced"]
    assert len(replaced) == 3 and not set(replaced.values()) & set(ids)
    assert low[0] >= 2, low
    wait_for(lambda: len(running(daemon, "web")) == 3, 30, "three ready")


def test_launch_wait_exits_1_when_a_replica_fails(daemon: DaemonUnderTest) -> None:
    proc = cli(daemon.state_dir, "launch", "--pool", "f", "--restart", "never", "--start-secs", "1",
               "--wait", "--", "false")
    assert proc.returncode == 1 and proc.stdout.split() == ["f-1"], (proc.stdout, proc.stderr)
    assert "f-1 FAILED: exited during start" in proc.stderr


def test_a_probe_that_never_answers_fails_the_replica(daemon: DaemonUnderTest) -> None:
    port = free_port_range(1)
    proc = cli(daemon.state_dir, "launch", "--pool", "deaf", "--restart", "never", "--ready",
               f"tcp:127.0.0.1:{port}", "--ready-timeout", "1", "--wait", "--", "sleep", "1000")
    assert proc.returncode == 1, proc.stderr
    assert "not ready within 1 s" in proc.stderr and "connection refused" in proc.stderr
    (rep,) = [r for r in status(daemon)["replicas"] if r["pool"] == "deaf"] or [None]
    assert rep is None  # FAILED, its process stopped and reaped


def test_a_wait_that_times_out_says_which_are_not_ready(daemon: DaemonUnderTest) -> None:
    proc = cli(daemon.state_dir, "launch", "--pool", "slow", "--start-secs", "30", "--count", "2",
               "--wait", "--timeout", "0.5", "--", "sleep", "1000")
    assert proc.returncode == 1
    assert proc.stdout.split() == ["slow-1", "slow-2"]
    assert "not yet ready: slow-1, slow-2" in proc.stderr


def test_liveness_failure_replaces_the_replica(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    flag = tmp_path / "alive"
    flag.write_text("")
    proc = cli(daemon.state_dir, "launch", "--pool", "live", "--live", f"exec:test -e {flag}",
               "--live-interval", "0.2", "--live-failures", "2", "--backoff", "0.1:0.1", "--wait", "--",
               "sleep", "1000")
    assert proc.returncode == 0, proc.stderr
    (first,) = proc.stdout.split()
    flag.unlink()
    wait_for(lambda: any(r["id"] != first for r in running(daemon, "live")), 30, "a replacement")
    rows = {r["id"]: r for r in status(daemon, )["replicas"]}
    assert first not in rows
    old = [r for r in daemon.status(all=True)["replicas"] if r["id"] == first][0]
    assert old["reason"].startswith("liveness probe failed") or old["state"] == "TERMINATED"
    flag.write_text("")


def test_a_replica_that_is_never_live_ends_in_a_crash_loop(daemon: DaemonUnderTest) -> None:
    """Liveness failures count against --max-restarts like crashes do: replacements after
    the backoff, then crashloop, not a replacement every few seconds forever."""
    proc = cli(daemon.state_dir, "launch", "--pool", "dead", "--live", "exec:false", "--live-interval", "0.1",
               "--live-failures", "1", "--backoff", "0.05:0.05", "--max-restarts", "2/60", "--grace", "0.5",
               "--", "sleep", "1000")
    assert proc.returncode == 0, proc.stderr

    def pool() -> dict:
        return next(p for p in status(daemon)["pools"] if p["name"] == "dead")

    wait_for(lambda: pool()["state"] == "crashloop", 30, "the pool to enter a crash loop")
    assert "liveness probe failed" in pool()["reason"]
    events = [json.loads(line) for line in cli(daemon.state_dir, "events", "--json").stdout.splitlines()]
    restarts = [e for e in events if e["kind"] == "restart"]
    assert len(restarts) == 2 and all(e["data"]["reason"] == "liveness probe failed" for e in restarts), restarts


def test_delete_signal_env_file_and_cwd(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    env_file = tmp_path / "app.env"
    env_file.write_text("# settings\nGREETING=hello\nexport QUOTED='a b'\n")
    work = tmp_path / "work"
    work.mkdir()
    script = "trap 'echo hup >> got' HUP; echo \"$GREETING/$QUOTED/$(pwd)\" > seen; while :; do sleep 0.1; done"
    proc = cli(daemon.state_dir, "launch", "--pool", "app", "--env-file", str(env_file), "--cwd", str(work),
               "--wait", "--", "sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    wait_for((work / "seen").exists, 10, "the worker's output")
    assert (work / "seen").read_text().strip() == f"hello/a b/{work}"
    sent = cli(daemon.state_dir, "signal", "HUP", "--pool", "app")
    assert sent.returncode == 0 and "SIGHUP" in sent.stdout, sent.stderr
    wait_for(lambda: (work / "got").exists(), 10, "the HUP to arrive")
    assert cli(daemon.state_dir, "launch", "--pool", "app", "--", "sleep", "1").returncode == 1  # another spec
    gone = cli(daemon.state_dir, "delete", "app")
    assert gone.returncode == 0, gone.stderr
    wait_for(lambda: not [r for r in status(daemon)["replicas"] if r["pool"] == "app"], 10, "the pool to empty")
    assert [p["name"] for p in status(daemon)["pools"]] == []
    assert cli(daemon.state_dir, "delete", "app").returncode == 1
    assert cli(daemon.state_dir, "stop").returncode == 0
    daemon.start()
    assert [p["name"] for p in status(daemon)["pools"]] == []  # it does not come back


@pytest.mark.parametrize("flags, words", [
    (["--restart", "sometimes"], "invalid choice"),
    (["--backoff", "5"], "--backoff takes A:B"),
    (["--max-restarts", "3/0"], "max_restarts S"),
    (["--ready", "http://192.0.2.1:80/"], "loopback"),
    (["--stop-signal", "NOPE"], "not a signal"),
])
def test_bad_policy_flags_are_one_line(daemon: DaemonUnderTest, flags: list[str], words: str) -> None:
    proc = cli(daemon.state_dir, "launch", "--pool", "x", *flags, "--", "sleep", "1")
    assert proc.returncode in (1, 2) and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
