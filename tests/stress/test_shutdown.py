"""Shutdown under fire: signals sent to a daemon that is already stopping, replicas that
ignore SIGTERM, a stop budget shorter than their grace, SIGKILL in the middle of a
shutdown, and the restarts after each, which bring the pools back with new ids."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ProcessTracker
from helpers import DaemonUnderTest, Ident, cli, cli_env, kill_all, tree, wait_for
from stress.conftest import Stress, signal_system
from stress.invariants import LIVE, quiet, size_violations, table_violations

pytestmark = [pytest.mark.stress, pytest.mark.timeout(90)]

STUBBORN_SH = ["sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"]


def _launch_stubborn(state_dir: Path, grace: str) -> None:
    cli(state_dir, "launch", "--pool", "sh", "--count", "2", "--restart", "always", "--grace", grace,
        "--", *STUBBORN_SH, check=True)
    cli(state_dir, "launch", "--pool", "py", "--count", "2", "--restart", "always", "--grace", grace,
        "--target", "workers:stubborn", check=True)
    cli(state_dir, "launch", "--pool", "plain", "--count", "2", "--restart", "always", "--", "sleep", "1000",
        check=True)


def _settled(state_dir: Path) -> bool:
    proc = cli(state_dir, "status", "--all", "--json")
    if proc.returncode != 0:
        return False
    st = json.loads(proc.stdout)
    return quiet(st) and not size_violations(st)


def test_signals_during_shutdown(tmp_path: Path, stress: Stress, procs: ProcessTracker) -> None:
    """A foreground daemon (our child: its exit code is ours) with replicas that ignore
    SIGTERM and a grace of 30 s, under a stop budget of 1.5 s: SIGTERM, then TERM, INT and
    HUP at random moments while it stops. It exits 0 within its budget, leaves nothing, and
    the next start brings every pool back with new ids."""
    state = tmp_path / "state"
    seen_ids: set[str] = set()
    for round_ in range(stress.count(2)):
        ctx = f"{stress.replay} round {round_}"
        log = open(tmp_path / f"fg-{round_}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--state-dir", str(state), "start", "--foreground",
             "--stop-budget", "1.5"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=cli_env(), start_new_session=True)
        seen: set[Ident] = set()
        try:
            wait_for(lambda: cli(state, "status").returncode == 0, 30, f"the daemon ({ctx})")
            if round_ == 0:
                _launch_stubborn(state, "30")
            wait_for(lambda: _settled(state), 30, f"the pools ({ctx})")
            st = json.loads(cli(state, "status", "--json").stdout)
            ids = {r["id"] for r in st["replicas"]}
            assert len(ids) == 6 and not ids & seen_ids, (ctx, ids, seen_ids)
            seen_ids |= ids
            seen |= tree(proc.pid)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for sig in stress.rng.sample([signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTERM], 4):
                time.sleep(stress.rng.uniform(0, 0.3))  # a random moment of the shutdown
                if proc.poll() is None:
                    proc.send_signal(sig)
            assert proc.wait(30) == 0, ctx
            took = time.monotonic() - t0
            assert took < 1.5 + 3, f"{ctx}: the stop took {took:.1f} s, its budget is 1.5 s"
            wait_for(lambda: not [i for i in seen if i.alive()], 5, f"every process to end ({ctx})")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            seen |= tree(proc.pid)
            kill_all(seen)
            log.close()
        text = (tmp_path / f"fg-{round_}.log").read_text()
        assert "Traceback" not in text, f"{ctx}: {text[-2000:]}"
    assert not procs.survivors(), stress.replay


def test_sigkill_during_shutdown(stress_daemon: DaemonUnderTest, stress: Stress, procs: ProcessTracker) -> None:
    """SIGTERM, then SIGKILL at a random moment of the shutdown, with replicas that ignore
    SIGTERM for 30 s (the stop budget, 3 s, keeps the teardown's stop short): the
    watchdog ends them all; the next start finds none live."""
    d = stress_daemon
    d.start("--stop-budget", "3")
    _launch_stubborn(d.state_dir, "30")
    wait_for(lambda: _settled(d.state_dir), 30, "the pools")
    for round_ in range(stress.count(2)):
        ctx = f"{stress.replay} round {round_}"
        before = d.status(all=True)
        d.snapshot()
        assert signal_system(d.pid, "orchestrator: daemon", signal.SIGTERM), ctx
        time.sleep(stress.rng.uniform(0, 0.5))  # the odd moment of the shutdown
        signal_system(d.pid, "orchestrator: daemon", signal.SIGKILL)  # False: it already stopped
        wait_for(lambda: not procs.survivors(), 20, f"every process to end ({ctx})")
        wait_for(lambda: cli(d.state_dir, "start", "--stop-budget", "3").returncode == 0, 20,
                 f"a new start ({ctx})")
        d.pid = d.status()["daemon"]["pid"]
        d.snapshot()
        after = {r["id"]: r for r in d.status(all=True)["replicas"]}
        for r in before["replicas"]:
            if r["id"] in after:
                assert after[r["id"]]["state"] not in LIVE, (ctx, after[r["id"]])
        wait_for(lambda: _settled(d.state_dir), 30, f"the pools to come back ({ctx})")
        assert not table_violations(d.status(all=True)), ctx


def test_replicas_that_ignore_sigterm_end_after_their_grace(stress_daemon: DaemonUnderTest, stress: Stress) -> None:
    """terminate, restart (rolling) and delete of replicas that ignore SIGTERM: each ends
    by the SIGKILL after its grace, TERMINATED, never much later."""
    d = stress_daemon
    d.start()
    n = stress.count(3)
    for pool, what in (("sh", ["--", *STUBBORN_SH]), ("py", ["--target", "workers:stubborn"])):
        ids = cli(d.state_dir, "launch", "--pool", pool, "--count", str(n), "--grace", "0.5", "--wait",
                  *what, check=True).stdout.split()
        t0 = time.monotonic()
        cli(d.state_dir, "terminate", *ids[: n // 2 + 1], "--wait", check=True)
        assert time.monotonic() - t0 < 0.5 + 3, stress.replay
        rows = {r["id"]: r for r in d.status(all=True)["replicas"]}
        assert all(rows[i]["state"] == "TERMINATED" for i in ids[: n // 2 + 1]), (stress.replay, rows)
        cli(d.state_dir, "scale", pool, str(n), check=True)
        t0 = time.monotonic()
        cli(d.state_dir, "restart", "--pool", pool, "--max-unavailable", str(n), "--timeout", "30", check=True)
        assert time.monotonic() - t0 < 0.5 + 5, stress.replay
        cli(d.state_dir, "delete", pool, check=True)
    wait_for(lambda: not d.status()["replicas"], 10, f"every replica to end ({stress.replay})")
