"""The daemon as a user drives it: the real CLI, the Manager channel, signals, bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from helpers import (
    DaemonUnderTest, Ident, cli, cli_env, cli_json, kill_all, manager_proxies, sized, survivors, tree, wait_for,
)
from orchestrator import ChannelError, Client, DaemonNotRunning, InvalidSpec, ShuttingDown, UnknownReplica

pytestmark = pytest.mark.timeout(120)


def _running(data: dict) -> list[dict]:
    return [r for r in data["replicas"] if r["state"] == "RUNNING"]


def test_cli_lifecycle(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    launched = cli(daemon.state_dir, "launch", "--pool", "web", "--count", "20", "--wait", "--", "sleep", "1000")
    assert launched.returncode == 0, launched.stderr
    ids = launched.stdout.split()
    assert ids == [f"web-{n}" for n in range(1, 21)]

    data = daemon.status()
    assert set(data) >= {"state_dir", "daemon", "pools", "replicas"}
    assert data["daemon"]["running"] is True and data["daemon"]["pid"] == pid
    assert data["daemon"]["watchdog_pid"] and data["daemon"]["manager_pid"]
    assert sized(data["pools"]) == [{"name": "web", "desired": 20}]
    assert len(_running(data)) == 20
    rep = data["replicas"][0]
    assert set(rep) >= {"id", "pool", "state", "pid", "exit_code", "reason", "created_at", "ended_at"}
    for r in data["replicas"]:  # each in a process group of its own, with its title
        proc = psutil.Process(r["pid"])
        assert os.getpgid(r["pid"]) == r["pid"]
        assert proc.cmdline() == ["sleep", "1000"]
        assert proc.environ()["ORCHESTRATOR_REPLICA_ID"] == r["id"]
        assert proc.environ()["ORCHESTRATOR_POOL"] == "web"

    term = cli(daemon.state_dir, "terminate", *ids[:5], "--wait")
    assert term.returncode == 0, term.stderr
    data = daemon.status(all=True)
    assert {r["id"]: r["state"] for r in data["replicas"] if r["id"] in ids[:5]} == dict.fromkeys(ids[:5], "TERMINATED")
    assert sized(data["pools"]) == [{"name": "web", "desired": 15}]
    again = cli(daemon.state_dir, "terminate", ids[0])  # already terminal: a no-op
    assert again.returncode == 0, again.stderr

    scaled = cli_json(daemon.state_dir, "scale", "web", "10")
    assert scaled["desired"] == 10 and scaled["terminated"] == [f"web-{n}" for n in range(20, 15, -1)]
    wait_for(lambda: len(_running(daemon.status())) == 10, 10, "10 running")
    scaled = cli_json(daemon.state_dir, "scale", "web", "12")
    assert scaled["launched"] == ["web-21", "web-22"]  # ids are never reused
    daemon.snapshot()

    stopped = cli(daemon.state_dir, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not survivors(daemon.seen)
    left = sorted(p.name for p in daemon.state_dir.iterdir())
    assert "control.sock" not in left and "daemon.pid" not in left and "authkey" not in left
    down = cli(daemon.state_dir, "status", "--json")
    assert down.returncode == 3
    assert json.loads(down.stdout)["daemon"]["running"] is False
    assert cli(daemon.state_dir, "stop").returncode == 3


def test_second_start_is_refused(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    second = cli(daemon.state_dir, "start")
    assert second.returncode == 1
    assert "already running" in second.stderr and str(pid) in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    fg = cli(daemon.state_dir, "start", "--foreground")
    assert fg.returncode == 1 and "already running" in fg.stderr
    assert Client(daemon.state_dir).ping() == "pong"


def test_start_after_kill9_replaces_stale_files(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    cli(daemon.state_dir, "launch", "--pool", "web", "--count", "3", "--wait", "--", "sleep", "1000", check=True)
    daemon.status()
    daemon.snapshot()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not survivors(daemon.seen), 5, "the watchdog to clean up")
    assert (daemon.state_dir / "state.db").exists()
    new_pid = daemon.start()
    assert new_pid != pid
    data = daemon.status(all=True)
    lost = {r["id"] for r in data["replicas"] if r["state"] == "LOST"}
    assert lost == {"web-1", "web-2", "web-3"}
    # the pool is brought back to its desired size with new ids
    wait_for(lambda: len(_running(daemon.status())) == 3, 10, "the pool to come back")
    assert {r["id"] for r in _running(daemon.status())} == {"web-4", "web-5", "web-6"}


def test_bad_input_gets_one_line_and_changes_nothing(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    cli(daemon.state_dir, "launch", "--pool", "web", "--count", "2", "--wait", "--", "sleep", "1000", check=True)
    before = daemon.status()

    cases = [
        (("terminate", "nope-1"), "unknown replica"),
        (("terminate", "web-1", "web-99"), "unknown replica"),
        (("launch", "--pool", "web", "--", ""), "empty command"),
        (("launch", "--pool", "web", "--", "no-such-command-xyz"), "command not found"),
        (("launch", "--pool", "web", "--target", "nocolon"), "MODULE:FUNCTION"),
        (("launch", "--pool", "web", "--count", "-2", "--", "true"), "count"),
        (("launch", "--pool", "bad pool!", "--", "true"), "pool name"),
        (("scale", "nosuchpool", "3"), "unknown pool"),
        (("scale", "web", "-1"), "size must be an integer from 0"),
    ]
    usage = cli(daemon.state_dir, "launch", "--pool", "web", "--")  # a usage error: 2, as argparse's own
    assert usage.returncode == 2 and "nothing to run" in usage.stderr and len(usage.stderr.splitlines()) == 1
    for args, message in cases:
        proc = cli(daemon.state_dir, *args)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)

    with Client(daemon.state_dir) as client:
        with pytest.raises(UnknownReplica):
            client.terminate("web-77")
        with pytest.raises(InvalidSpec):
            client.call("frobnicate")
        with pytest.raises(InvalidSpec):
            client.call("launch", {"pool": "web", "count": 1, "spec": {"command": "not-a-list"}})
        # Not plain data, straight onto the queue: the manager answers, nothing crashes.
        client.ping()
        commands, replies = manager_proxies(daemon.state_dir)
        commands.put(["not", "a", "dict"])  # no id: nobody to answer, dropped
        commands.put({"id": "x1", "op": "status", "args": {"bad": {1, 2}}})
        assert replies.take("x1", 10)["code"] == "invalid"
        commands.put({"id": "x2", "op": "status", "args": "nope"})
        assert replies.take("x2", 10)["ok"] is False
        assert client.ping() == "pong"

    with pytest.raises(ChannelError, match="auth"):
        Client(daemon.state_dir, authkey=b"0" * 32).ping()

    after = daemon.status()
    assert after["replicas"] == before["replicas"] and after["pools"] == before["pools"]
    assert after["daemon"]["pid"] == before["daemon"]["pid"]
    assert after["daemon"]["manager_pid"] == before["daemon"]["manager_pid"]


def test_a_target_that_cannot_be_imported_fails_its_replica(daemon: DaemonUnderTest) -> None:
    """The daemon never imports a target: the worker does, and a bad one is that replica's
    "could not start", which `launch --wait` reports with exit 1."""
    daemon.start()
    for pool, target, message in (("t1", "no_such_module_xyz:f", "cannot import"),
                                  ("t2", "os:no_such_function", "no attribute")):
        proc = cli(daemon.state_dir, "launch", "--pool", pool, "--restart", "never", "--wait", "--target", target)
        assert proc.returncode == 1, (target, proc.stdout, proc.stderr)
        assert proc.stdout.split() == [f"{pool}-1"]
        assert message in proc.stderr and "could not start" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert daemon.status()["replicas"] == []


def test_commands_to_a_daemon_that_is_not_running(state_dir: Path) -> None:
    for args in (("launch", "--pool", "w", "--", "true"), ("terminate", "w-1"), ("scale", "w", "1"), ("stop",)):
        proc = cli(state_dir, *args)
        assert proc.returncode == 3, (args, proc.stderr)
        assert "no daemon is running" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    down = cli(state_dir, "status")
    assert down.returncode == 3 and "not running" in down.stdout
    with pytest.raises(DaemonNotRunning):
        Client(state_dir)


def test_long_state_dir_and_file_modes(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "state"
    assert len(str(deep / "control.sock")) > 150
    d = DaemonUnderTest(deep)
    try:
        d.start()
        cli(deep, "launch", "--pool", "p", "--count", "2", "--wait", "--", "sleep", "1000", check=True)
        assert len(_running(d.status())) == 2
        for name in ("control.sock", "authkey"):
            mode = stat.S_IMODE(os.stat(deep / name).st_mode)
            assert mode == 0o600, (name, oct(mode))
        assert stat.S_ISSOCK(os.stat(deep / "control.sock").st_mode)
        # the HTTP socket too, bound by a short name of the same file
        assert stat.S_IMODE(os.stat(deep / "http.sock").st_mode) == 0o600
        dirfd = os.open(deep, os.O_PATH | os.O_DIRECTORY)
        try:
            with socket.socket(socket.AF_UNIX) as c:
                c.settimeout(10)
                c.connect(f"/proc/self/fd/{dirfd}/http.sock")
                c.sendall(b"GET /v1/ping HTTP/1.0\r\n\r\n")
                assert c.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            os.close(dirfd)
        assert cli(deep, "stop").returncode == 0
        assert not (deep / "http.sock").exists()
    finally:
        assert not d.teardown()


def test_process_titles(daemon: DaemonUnderTest) -> None:
    daemon.start()
    cli(daemon.state_dir, "launch", "--pool", "py", "--target", "workers:sleeper", "--wait", check=True)
    data = daemon.status()
    titles = {
        psutil.Process(data["daemon"]["pid"]).cmdline()[0],
        psutil.Process(data["daemon"]["watchdog_pid"]).cmdline()[0],
        psutil.Process(data["daemon"]["manager_pid"]).cmdline()[0],
    }
    assert titles == {"orchestrator: daemon", "orchestrator: watchdog", "orchestrator: manager"}
    rep = data["replicas"][0]
    assert psutil.Process(rep["pid"]).cmdline()[0] == f"orchestrator: replica {rep['id']}"


def test_sigterm_during_launch_burst_leaves_nothing(state_dir: Path) -> None:
    """The daemon in --foreground as our child, so its exit code is ours to see."""
    log = open(state_dir.parent / "fg.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(state_dir), "start", "--foreground", "--grace", "2"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=cli_env(), start_new_session=True,
    )
    seen: set[Ident] = set()
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        wait_for(lambda: (state_dir / "control.sock").exists() and cli(state_dir, "status").returncode == 0,
                 30, "the daemon to accept commands")

        def burst() -> None:
            try:
                with Client(state_dir, timeout=10) as client:
                    while not stop.is_set():
                        client.launch("burst", ["sleep", "1000"], count=5)
            except (ShuttingDown, ChannelError, DaemonNotRunning):
                pass  # a clear, typed refusal once it shuts down: what a caller should get
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)

        threads = [threading.Thread(target=burst) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: len(tree(proc.pid)) > 30, 30, "a burst of launches")
        seen |= tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a client call did not return"
        wait_for(lambda: not survivors(seen), 5, "every process to be gone")
        assert not (state_dir / "control.sock").exists()
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        seen |= tree(proc.pid)
        kill_all(seen)
        log.close()


def test_ctrl_c_in_foreground(state_dir: Path) -> None:
    log = open(state_dir.parent / "fg.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(state_dir), "start", "--foreground"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=cli_env(), start_new_session=True,
    )
    seen: set[Ident] = set()
    try:
        wait_for(lambda: (state_dir / "control.sock").exists() and cli(state_dir, "status").returncode == 0,
                 30, "the daemon to accept commands")
        cli(state_dir, "launch", "--pool", "w", "--count", "5", "--wait", "--", "sleep", "1000", check=True)
        cli(state_dir, "launch", "--pool", "py", "--count", "2", "--wait", "--target", "workers:sleeper", check=True)
        seen |= tree(proc.pid)
        assert len(seen) >= 10
        # Ctrl-C: SIGINT to the foreground process group (which this test created).
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)  # a second one must not break the cleanup
        assert proc.wait(timeout=30) == 0
        wait_for(lambda: not survivors(seen), 5, "every process to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        kill_all(seen)
        log.close()
    text = (state_dir.parent / "fg.log").read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text


def test_orphaned_grandchildren_are_reaped(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    pid = daemon.start()
    marker = tmp_path / "orphan.pid"
    cli(daemon.state_dir, "launch", "--pool", "o", "--env", f"ORPHAN_FILE={marker}",
        "--target", "workers:orphan_maker", "--wait", check=True)
    wait_for(marker.exists, 20, "the grandchild to start")
    orphan = int(marker.read_text())
    ident = Ident.of(orphan)
    assert ident is not None
    daemon.seen.add(ident)
    assert psutil.Process(orphan).ppid() == pid  # re-parented to the daemon, a subreaper
    Path(str(marker) + ".go").touch()
    wait_for(lambda: not psutil.pid_exists(orphan), 10, "the orphan to be reaped, not left a zombie")


def test_manager_killed_is_replaced(daemon: DaemonUnderTest) -> None:
    daemon.start()
    cli(daemon.state_dir, "launch", "--pool", "w", "--count", "2", "--wait", "--", "sleep", "1000", check=True)
    before = daemon.status()
    old = before["daemon"]["manager_pid"]
    os.kill(old, signal.SIGKILL)

    def replaced() -> bool:
        proc = cli(daemon.state_dir, "status", "--json")
        return proc.returncode == 0 and json.loads(proc.stdout)["daemon"]["manager_pid"] not in (None, old)

    wait_for(replaced, 20, "a new manager")
    after = daemon.status()
    assert [(r["id"], r["pid"]) for r in after["replicas"]] == [(r["id"], r["pid"]) for r in before["replicas"]]


def test_foreground_under_systemd_notify_says_ready(state_dir: Path) -> None:
    """Type=notify: the daemon sends READY=1 (and a STATUS) to $NOTIFY_SOCKET once it takes
    commands, and keeps running; its replicas do not inherit the socket."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = str(state_dir.parent / "notify.sock")
    sock.bind(addr)
    sock.settimeout(60)
    log = open(state_dir.parent / "fg.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(state_dir), "start", "--foreground", "--grace", "1"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=cli_env({"NOTIFY_SOCKET": addr}),
        start_new_session=True,
    )
    seen: set[Ident] = set()
    try:
        lines = sock.recv(4096).decode().splitlines()
        assert lines[0] == "READY=1" and lines[1].startswith("STATUS="), lines
        assert cli(state_dir, "status").returncode == 0
        cli(state_dir, "launch", "--pool", "w", "--wait", "--", "sleep", "1000", check=True)
        rep = cli_json(state_dir, "status")["replicas"][0]
        assert "NOTIFY_SOCKET" not in psutil.Process(rep["pid"]).environ()
        seen |= tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_for(lambda: not survivors(seen), 5, "every process to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        seen |= tree(proc.pid)
        kill_all(seen)
        log.close()
        sock.close()
