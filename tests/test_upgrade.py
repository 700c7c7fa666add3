"""`orchestrator upgrade`: the daemon re-executes itself in place, and its replicas stay.

Real processes through the CLI: a daemon with live replicas of every kind, upgraded while a
client churns another pool and another samples `status`; what exec does to a process (the
facts the design rests on); a broken install refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import (
    ROOT, DaemonUnderTest, Ident, cli, cli_env, free_port_range, one_line_error, start_with_shadow, survivors,
    wait_for, wait_gone,
)


def _live(data: dict) -> dict[str, dict]:
    return {r["id"]: r for r in data["replicas"] if r["state"] not in ("TERMINATED", "EXITED", "FAILED")}


def _idents(data: dict, pools: set[str]) -> dict[str, Ident]:
    out = {}
    for r in data["replicas"]:
        if r["pool"] in pools and r["state"] == "RUNNING":
            ident = Ident.of(r["pid"])
            assert ident is not None, r
            out[r["id"]] = ident
    return out


def _get(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
        return resp.status


class _Loop(threading.Thread):
    """Runs ``step`` until stopped; each failure (non-zero exit, with its stderr) is kept."""

    def __init__(self, step) -> None:
        super().__init__(daemon=True)
        self.step = step
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.done = 0

    def run(self) -> None:
        while not self.stop.is_set():
            why = self.step()
            if why is not None:
                self.failures.append(why)
            self.done += 1


@pytest.mark.long
def test_upgrade_keeps_every_replica(daemon: DaemonUnderTest) -> None:
    sd = daemon.state_dir
    pid = daemon.start()
    run = lambda *a: cli(sd, *a, check=True)  # noqa: E731
    port = free_port_range(2)
    run("launch", "--pool", "cmd", "--count", "3", "--wait", "--", "sh", "-c", "while :; do echo tick; sleep 0.05; done")
    run("launch", "--pool", "py", "--count", "2", "--wait", "--target", "workers:ticker")
    run("launch", "--pool", "web", "--count", "2", "--port-base", str(port), "--ready", "http://127.0.0.1:{port}/",
        "--live", "http://127.0.0.1:{port}/", "--live-interval", "0.2", "--wait", "--",
        sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "{port}")
    before = daemon.status()
    kept = _idents(before, {"cmd", "py", "web"})
    assert len(kept) == 7
    logs = {rid: (sd / "logs" / f"{rid}.out") for rid in kept if not rid.startswith("web")}
    wait_for(lambda: all(p.exists() and p.stat().st_size > 0 for p in logs.values()), 10, "the first output")

    def churn() -> str | None:
        got = cli(sd, "launch", "--pool", "churn", "--json", "--", "sleep", "1000")
        if got.returncode != 0:
            return f"launch: {got.stderr.strip()}"
        ids = json.loads(got.stdout)["ids"]
        got = cli(sd, "terminate", "--wait", *ids)
        return None if got.returncode == 0 else f"terminate: {got.stderr.strip()}"

    def sample() -> str | None:
        got = cli(sd, "status", "--json")
        if got.returncode != 0:
            return f"status: {got.stderr.strip()}"
        if json.loads(got.stdout)["daemon"]["pid"] != pid:
            return "status: another daemon pid"
        return None

    churner, sampler = _Loop(churn), _Loop(sample)
    churner.start()
    sampler.start()
    try:
        wait_for(lambda: churner.done >= 2 and sampler.done >= 2, 60, "the clients to get going")
        sizes = {rid: p.stat().st_size for rid, p in logs.items()}
        got = cli(sd, "upgrade", "--json")
        assert got.returncode == 0, got.stderr
        result = json.loads(got.stdout)
        assert result["pid"] == pid and result["replicas"] >= 7
        upgraded = (churner.done, sampler.done)
        wait_for(lambda: churner.done >= upgraded[0] + 2 and sampler.done >= upgraded[1] + 2, 60,
                 "the clients to go on after the upgrade")
    finally:
        churner.stop.set()
        sampler.stop.set()
        churner.join(60)
        sampler.join(60)
    assert not churner.failures, churner.failures
    assert not sampler.failures, sampler.failures

    after = daemon.status()
    assert after["daemon"]["pid"] == pid
    assert after["daemon"]["version"]
    assert after["daemon"]["upgraded_at"] is not None
    assert after["daemon"]["watchdog_pid"] == before["daemon"]["watchdog_pid"]
    assert after["daemon"]["manager_pid"] == before["daemon"]["manager_pid"]
    assert _idents(after, {"cmd", "py", "web"}) == kept  # same pids, same start times: nothing restarted
    assert all(r["restarts"] == 0 for r in after["replicas"] if r["id"] in kept)
    assert not [r for r in daemon.status(all=True)["replicas"] if r["state"] == "LOST"]
    wait_for(lambda: all(p.stat().st_size > sizes[rid] for rid, p in logs.items()), 10, "the logs to grow")
    assert _get(port) == 200 and _get(port + 1) == 200
    events = [json.loads(line) for line in cli(sd, "events", "--json").stdout.splitlines()]
    upgrades = [e for e in events if e["kind"] == "upgrade"]
    assert len(upgrades) == 1 and upgrades[0]["data"]["to"] == after["daemon"]["version"], upgrades
    assert cli(sd, "health").returncode == 0

    # the new image supervises as the old one did: a replica that dies is replaced ...
    victim = next(rid for rid in kept if rid.startswith("cmd"))
    os.kill(kept[victim].pid, signal.SIGKILL)
    wait_for(lambda: len(_idents(daemon.status(), {"cmd"})) == 3 and victim not in _idents(daemon.status(), {"cmd"}),
             20, "the killed replica to be replaced")
    # ... and its watchdog still covers everything: kill -9 of the daemon leaves nothing
    victims = daemon.snapshot() - {Ident.of(pid)}
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not survivors(victims), 10, "every replica to be gone after kill -9")


def test_broken_install_is_refused_in_one_line(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    sd = daemon.state_dir
    shadow = tmp_path / "shadow"
    pid = start_with_shadow(daemon, shadow)
    cli(sd, "launch", "--pool", "a", "--count", "2", "--wait", "--", "sleep", "1000", check=True)
    kept = _idents(daemon.status(), {"a"})
    # The install the daemon would exec now: the package with a module that does not import.
    shutil.copytree(ROOT / "orchestrator", shadow / "orchestrator", ignore=shutil.ignore_patterns("__pycache__"))
    with open(shadow / "orchestrator" / "daemon" / "engine.py", "a") as f:
        f.write("\nraise ImportError('simulated broken install')\n")

    got = cli(sd, "upgrade")
    line = one_line_error(got)
    assert "simulated broken install" in line and "refused" in line, line
    data = daemon.status()
    assert data["daemon"]["pid"] == pid and data["daemon"]["upgraded_at"] is None
    assert _idents(data, {"a"}) == kept
    events = [json.loads(line) for line in cli(sd, "events", "--json").stdout.splitlines()]
    refused = [e["data"] for e in events if e["kind"] == "upgrade"]
    assert len(refused) == 1 and "simulated broken install" in refused[0]["refused"]
    # the spawns held while it was tried go on
    cli(sd, "launch", "--pool", "a", "--count", "1", "--wait", "--", "sleep", "1000", check=True)


def test_an_unknown_handover_version_is_refused() -> None:
    got = subprocess.run([sys.executable, "-m", "orchestrator.daemon.main", "--check", "99"],
                         capture_output=True, text=True, timeout=60, env=cli_env())
    assert got.returncode == 1
    assert got.stdout.strip().splitlines() == [got.stdout.strip()] and "hand-over version 99" in got.stdout
    got = subprocess.run([sys.executable, "-m", "orchestrator.daemon.main", "--check", "1"],
                         capture_output=True, text=True, timeout=60, env=cli_env())
    assert got.returncode == 0 and got.stdout.startswith("ok "), got.stdout + got.stderr


def test_upgrade_with_200_replicas(daemon: DaemonUnderTest) -> None:
    sd = daemon.state_dir
    pid = daemon.start()
    cli(sd, "launch", "--pool", "many", "--count", "200", "--wait", "--timeout", "120", "--", "sleep", "1000",
        check=True)
    kept = _idents(daemon.status(), {"many"})
    assert len(kept) == 200
    got = cli(sd, "upgrade", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["replicas"] == 200
    data = daemon.status()
    assert data["daemon"]["pid"] == pid
    assert _idents(data, {"many"}) == kept
    cli(sd, "scale", "many", "150", check=True)  # the new image stops what the old one started
    wait_for(lambda: len(_idents(daemon.status(), {"many"})) == 150, 60, "the scale down")


EXEC_FACTS = textwrap.dedent("""
    import ctypes, os, signal, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 1, 36, 37

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)

    def bit(sig):
        return 1 << (sig - 1)

    if sys.argv[1] == "before":
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        signal.signal(signal.SIGUSR1, lambda *a: None)  # a handler
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # ignored
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        child = os.fork()
        if child == 0:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            time.sleep(1000)
            os._exit(0)
        os.execv(sys.executable, [sys.executable, __file__, "after", str(child)])
    child = int(sys.argv[2])
    time.sleep(0.3)  # a PDEATHSIG would have been sent at the exec
    value = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    waited = os.waitpid(child, os.WNOHANG)
    print(" ".join([
        "child_alive=%d" % (waited == (0, 0)),
        "subreaper=%d" % value.value,
        "term_blocked=%d" % bool(status("SigBlk") & bit(signal.SIGTERM)),
        "usr2_ignored=%d" % bool(status("SigIgn") & bit(signal.SIGUSR2)),
        "usr1_default=%d" % (not status("SigCgt") & bit(signal.SIGUSR1) and not status("SigIgn") & bit(signal.SIGUSR1)),
    ]))
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
""")


def test_what_exec_keeps(tmp_path: Path) -> None:
    """The facts an upgrade rests on: a single-threaded process's exec keeps its children
    (their PR_SET_PDEATHSIG does not fire), the subreaper flag and the signal mask; handlers
    go back to the default, ignored signals stay ignored."""
    script = tmp_path / "facts.py"
    script.write_text(EXEC_FACTS)
    got = subprocess.run([sys.executable, str(script), "before"], capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["child_alive=1", "subreaper=1", "term_blocked=1", "usr2_ignored=1",
                                  "usr1_default=1"], got.stdout


@pytest.mark.parametrize("_", [None])
def test_a_sigterm_during_the_exec_stops_the_new_image_cleanly(daemon: DaemonUnderTest, _: None) -> None:
    """TERM is blocked across the exec, so a stop that lands in it is delivered to the new
    image's handler (a clean stop), never the default action (a death the watchdog sweeps)."""
    sd = daemon.state_dir
    pid = daemon.start()
    cli(sd, "launch", "--pool", "a", "--count", "2", "--wait", "--", "sleep", "1000", check=True)
    upgrade = subprocess.Popen([sys.executable, "-m", "orchestrator", "--state-dir", str(sd), "upgrade"],
                               env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = sd / "logs" / "daemon.log"
    wait_for(lambda: "upgrade: exec of" in log.read_text(), 30, "the exec")
    os.kill(pid, signal.SIGTERM)
    upgrade.communicate(timeout=60)
    wait_for(lambda: cli(sd, "status").returncode == 3, 30, "the daemon to stop")
    text = log.read_text()
    assert "SIGTERM: shutting down" in text and f"daemon {pid} stopped" in text, text[-2000:]
    assert not (sd / "watchdog-report.json").exists()


def test_upgrade_in_process_group_mode(daemon: DaemonUnderTest) -> None:
    """The same hand-over without cgroups: the replicas' groups are ours as before, and a
    kill -9 of the daemon after the upgrade still leaves nothing behind (the teardown checks)."""
    sd = daemon.state_dir
    daemon.start("--cgroup", "off")
    assert cli(sd, "launch", "--pool", "s", "--count", "3", "--wait", "--", "sleep", "300").returncode == 0
    before = daemon.status()
    assert before["daemon"]["containment"] == "process-group"
    pids = {r["id"]: Ident.of(r["pid"]) for r in before["replicas"]}
    got = cli(sd, "upgrade")
    assert got.returncode == 0, got.stderr
    after = daemon.status()
    assert {r["id"]: Ident.of(r["pid"]) for r in after["replicas"]} == pids
    assert after["daemon"]["upgraded_at"] is not None
    assert daemon.pid is not None
    os.kill(daemon.pid, signal.SIGKILL)
    assert not wait_gone([i for i in pids.values() if i is not None], 30)
