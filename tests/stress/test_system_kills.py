"""SIGKILL of the daemon's own processes at random moments while clients keep sending
commands: the daemon (its watchdog ends every replica; the next start records them LOST
and brings the pools back), the watchdog and the manager (replaced, replicas untouched),
and the spawner (replaced; the pools keep their sizes)."""

from __future__ import annotations

import random
import signal
import threading
import time
import traceback
from pathlib import Path

import psutil
import pytest

from conftest import ProcessTracker
from helpers import DaemonUnderTest, Ident, cli, wait_for
from orchestrator import ChannelError, Client, DaemonNotRunning, OrchestratorError, ShuttingDown
from stress.conftest import Stress, signal_system
from stress.invariants import LIVE, quiet, size_violations, table_violations

pytestmark = [pytest.mark.stress, pytest.mark.timeout(90)]

ALWAYS = ["--restart", "always", "--backoff", "0:0.05"]


def _pools(d: DaemonUnderTest) -> None:
    cli(d.state_dir, "launch", "--pool", "cmd", "--count", "3", *ALWAYS, "--", "sleep", "1000", check=True)
    cli(d.state_dir, "launch", "--pool", "py", "--count", "2", *ALWAYS, "--target", "workers:sleeper", check=True)
    cli(d.state_dir, "launch", "--pool", "stubborn", "--grace", "0.3", *ALWAYS, "--target", "workers:stubborn",
        check=True)


class Churn:
    """A client thread launching and terminating in pool ``churn`` until stopped; a lost
    channel (the manager or the daemon killed) is a typed error it reconnects after."""

    TYPED = (ChannelError, DaemonNotRunning, ShuttingDown)

    def __init__(self, state_dir: Path, seed: int) -> None:
        self.state_dir, self.rng = state_dir, random.Random(seed)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.calls = 0
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with Client(self.state_dir, timeout=10) as client:
                    while not self.stop.is_set():
                        ids = client.launch("churn", ["sleep", "1000"], count=self.rng.randint(1, 3))
                        client.terminate(ids, wait=self.rng.random() < 0.5, timeout=10)
                        self.calls += 1
            except self.TYPED:
                self.stop.wait(0.02)
            except OrchestratorError as err:
                if "internal error" in str(err) or "unknown replica" not in str(err):
                    self.errors.append(traceback.format_exc())
                    return
            except BaseException:
                self.errors.append(traceback.format_exc())
                return

    def end(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive() and not self.errors, self.errors


def _settled(d: DaemonUnderTest) -> bool:
    st = d.status(all=True)
    return quiet(st) and not size_violations(st)


def _live(d: DaemonUnderTest) -> dict[str, int]:
    return {r["id"]: r["pid"] for r in d.status()["replicas"] if r["pool"] != "churn"}


def test_sigkill_of_the_daemon_at_odd_moments(stress_daemon: DaemonUnderTest, stress: Stress,
                                              procs: ProcessTracker) -> None:
    d = stress_daemon
    d.start("--grace", "0.3")
    _pools(d)
    for round_ in range(stress.count(2)):
        ctx = f"{stress.replay} round {round_}"
        wait_for(lambda: _settled(d), 30, f"the pools to settle ({ctx})")
        churn = Churn(d.state_dir, stress.seed + round_)
        time.sleep(stress.rng.uniform(0.05, 0.5))  # the odd moment: somewhere in the churn
        before = d.status(all=True)
        d.snapshot()
        assert signal_system(d.pid, "orchestrator: daemon", signal.SIGKILL), ctx
        churn.end()
        # The watchdog ends every replica, then itself; no process of the test is left.
        wait_for(lambda: not procs.survivors(), 15, f"the watchdog to end everything ({ctx})")
        wait_for(lambda: cli(d.state_dir, "start", "--grace", "0.3").returncode == 0, 20, f"a new start ({ctx})")
        d.pid = d.status()["daemon"]["pid"]
        d.snapshot()
        after = d.status(all=True)
        rows = {r["id"]: r for r in after["replicas"]}
        for r in before["replicas"]:
            if r["state"] in LIVE and r["id"] in rows:
                assert rows[r["id"]]["state"] == "LOST" or rows[r["id"]]["state"] not in LIVE, (ctx, r, rows[r["id"]])
        assert not table_violations(after), (ctx, table_violations(after))
    wait_for(lambda: _settled(d), 30, f"the pools to come back ({stress.replay})")
    sizes = {p["name"]: p["desired"] for p in d.status()["pools"]}
    assert {k: sizes[k] for k in ("cmd", "py", "stubborn")} == {"cmd": 3, "py": 2, "stubborn": 1}, sizes


def _wait_replaced(d: DaemonUnderTest, key: str, old: Ident, what: str) -> Ident:
    """Wait (bounded) for the daemon's new ``key`` process; return it."""
    found: list[Ident] = []

    def replaced() -> bool:
        ident = _replaced(d, key, old)
        if ident is not None:
            found.append(ident)
        return ident is not None

    wait_for(replaced, 30, what)
    return found[0]


def _replaced(d: DaemonUnderTest, key: str, old: Ident) -> Ident | None:
    """The daemon's new ``key`` process (watchdog_pid, manager_pid), once it answers again."""
    proc = cli(d.state_dir, "status", "--json")
    if proc.returncode != 0:
        return None
    pid = d.status()["daemon"].get(key)
    ident = Ident.of(pid) if pid else None
    return ident if ident is not None and ident != old else None


@pytest.mark.parametrize("key, title", [("watchdog_pid", "orchestrator: watchdog"),
                                        ("manager_pid", "orchestrator: manager")])
def test_sigkill_of_a_system_child_replaces_it(stress_daemon: DaemonUnderTest, stress: Stress,
                                               procs: ProcessTracker, key: str, title: str) -> None:
    d = stress_daemon
    d.start("--grace", "0.3")
    _pools(d)
    wait_for(lambda: _settled(d), 30, "the pools to settle")
    replicas = _live(d)
    churn = Churn(d.state_dir, stress.seed)
    try:
        for round_ in range(stress.count(2)):
            ctx = f"{stress.replay} round {round_}"
            time.sleep(stress.rng.uniform(0.02, 0.3))  # the odd moment
            old = Ident.of(d.status()["daemon"][key])
            assert old and signal_system(old.pid, title, signal.SIGKILL, parent=d.pid), ctx
            d.seen.add(_wait_replaced(d, key, old, f"a new {title} ({ctx})"))
            wait_for(lambda: cli(d.state_dir, "health").returncode == 0, 20, f"health ({ctx})")
            assert _live(d) == replicas, f"{ctx}: the replicas changed"
    finally:
        churn.end()
    assert churn.calls > 0, stress.replay
    if key == "watchdog_pid":
        # The new watchdog has the whole ledger: kill -9 of the daemon still ends everything.
        d.snapshot()
        assert signal_system(d.pid, "orchestrator: daemon", signal.SIGKILL), stress.replay
        wait_for(lambda: not procs.survivors(), 15, f"the new watchdog to end everything ({stress.replay})")


def _spawner(daemon_pid: int) -> psutil.Process | None:
    """The daemon's spawner: its direct child titled ``orchestrator: spawner``."""
    for child in psutil.Process(daemon_pid).children():
        try:
            title = child.cmdline()[:1]  # once: a child that exits in between has none
            if title and title[0].startswith("orchestrator: spawner"):
                return child
        except psutil.Error:
            continue
    return None


def test_sigkill_of_the_spawner(stress_daemon: DaemonUnderTest, stress: Stress) -> None:
    """Needs the spawner (a system child that forks the replicas); it fails, saying so,
    against a daemon that forks replicas itself."""
    d = stress_daemon
    d.start("--grace", "0.3")
    _pools(d)
    wait_for(lambda: _settled(d), 30, "the pools to settle")
    for round_ in range(stress.count(2)):
        ctx = f"{stress.replay} round {round_}"
        spawner = _spawner(d.pid)
        assert spawner is not None, f"the daemon {d.pid} has no 'orchestrator: spawner' child"
        old = Ident((spawner.pid, spawner.create_time()))
        d.seen.add(old)
        churn = Churn(d.state_dir, stress.seed + round_)
        time.sleep(stress.rng.uniform(0.02, 0.3))  # the odd moment
        assert signal_system(old.pid, "orchestrator: spawner", signal.SIGKILL, parent=d.pid), ctx
        wait_for(lambda: (s := _spawner(d.pid)) is not None and s.pid != old.pid, 20, f"a new spawner ({ctx})")
        churn.end()
        d.snapshot()
        wait_for(lambda: _settled(d), 30, f"the pools to come back ({ctx})")
        assert cli(d.state_dir, "health").returncode == 0, ctx
        assert not table_violations(d.status(all=True)), ctx
        launched = cli(d.state_dir, "launch", "--pool", "cmd", "--wait", *ALWAYS, "--", "sleep", "1000")
        assert launched.returncode == 0, (ctx, launched.stderr)
