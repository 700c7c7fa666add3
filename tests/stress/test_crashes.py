"""Replicas that crash at odd moments (SIGKILL, a real segfault, abort, exit 0 on their
own) under ``--restart always``, while others scale the pools, restart replicas and roll
whole pools: once the crashing stops the pools come back to their sizes, one replica a
slot, and the journal tells the same story as the table."""

from __future__ import annotations

import json
import random
import signal
import threading
import traceback

import pytest

from helpers import DaemonUnderTest, cli, wait_for
from orchestrator import Client, OrchestratorError
from stress.conftest import Stress, signal_replica
from stress.invariants import Histories, journal_violations, quiet, size_violations, table_violations

pytestmark = [pytest.mark.stress, pytest.mark.timeout(90)]

ALWAYS = ["--restart", "always", "--backoff", "0:0.05", "--max-restarts", "100000/1"]
SIZES = {"cmd": 4, "py": 3, "odd": 3}
KILLS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM, signal.SIGABRT)


def test_crashes_at_odd_moments_under_restart_always(stress_daemon: DaemonUnderTest, stress: Stress) -> None:
    d = stress_daemon
    pid = d.start("--grace", "0.3")
    for pool, what in (("cmd", ["--", "sleep", "1000"]), ("py", ["--target", "workers:sleeper"]),
                       ("odd", ["--env", f"STRESS_SEED={stress.seed}", "--target", "stress.crashers:odd"])):
        cli(d.state_dir, "launch", "--pool", pool, "--count", str(SIZES[pool]), *ALWAYS, *what, check=True)
    stop = threading.Event()
    errors: list[str] = []
    hist = Histories()
    signalled = [0]

    def guarded(name: str, body) -> None:
        try:
            with Client(d.state_dir, timeout=30) as client:
                while not stop.is_set():
                    body(client)
        except BaseException:
            errors.append(f"{name}: {traceback.format_exc()}")
            stop.set()

    crash_rng = random.Random(stress.seed)
    op_rng = random.Random(stress.seed + 1)

    def crasher(client: Client) -> None:
        st = client.status()  # the one thread that records histories: its polls are in order
        hist.observe(st)
        victims = [r for r in st["replicas"] if r["state"] == "RUNNING" and r["pool"] != "odd"]
        if victims and signal_replica(crash_rng.choice(victims), crash_rng.choice(KILLS)):
            signalled[0] += 1
        stop.wait(crash_rng.uniform(0, 0.03))

    def operator(client: Client) -> None:
        pool = op_rng.choice(("cmd", "py"))
        roll = op_rng.random()
        try:
            if roll < 0.35:
                client.scale(pool, op_rng.randint(2, 5))
            elif roll < 0.5:
                client.restart(pool=pool, max_unavailable=op_rng.randint(1, 2), timeout=20)
            else:
                live = [r["id"] for r in client.status()["replicas"] if r["pool"] == pool and r["state"] == "RUNNING"]
                if live:
                    client.restart(op_rng.choice(live), timeout=20)
        except OrchestratorError as err:  # a replica it waited for, or replaced, crashed
            message = str(err)
            if "internal error" in message or not any(w in message for w in ("failed", "timed out", "unknown replica", "not live",
                                                                              "ended", "not ready")):
                raise
        stop.wait(op_rng.uniform(0, 0.05))

    threads = [threading.Thread(target=guarded, args=("crasher", crasher)),
               threading.Thread(target=guarded, args=("operator", operator))]
    for t in threads:
        t.start()
    stop.wait(stress.seconds(3))
    stop.set()
    for t in threads:
        t.join(60)
    ctx = f"{stress.replay}: {signalled[0]} signalled"
    assert not errors, f"{ctx}:\n" + "\n".join(errors)
    assert signalled[0] > 10 * stress.size, ctx

    # The pool that crashes on its own goes; the others come back to their sizes.
    cli(d.state_dir, "scale", "odd", "0", check=True)
    wait_for(lambda: quiet(st := d.status(all=True)) and not size_violations(st), 30, f"the pools to settle ({ctx})")
    final = d.status(all=True)
    hist.observe(final)
    assert final["daemon"]["pid"] == pid, ctx
    assert not table_violations(final), f"{ctx}: {table_violations(final)}"
    assert not hist.violations(), f"{ctx}: {hist.violations()[:5]}"
    assert not journal_violations(d.state_dir, final), f"{ctx}: {journal_violations(d.state_dir, final)[:5]}"
    pools = {p["name"]: p for p in final["pools"]}
    assert all(pools[name]["restarts"] > 0 for name in ("cmd", "py", "odd")), (ctx, pools)
    # Every way of crashing was seen as what it was.
    reasons = {r["reason"] for r in final["replicas"] if r["state"] == "FAILED"}
    exits = {r["exit_code"] for r in final["replicas"] if r["state"] in ("FAILED", "EXITED")}
    assert -signal.SIGSEGV in exits and -signal.SIGKILL in exits, (ctx, exits, reasons)
    events = [json.loads(line) for line in cli(d.state_dir, "events", "--json").stdout.splitlines()]
    assert any(e["kind"] == "restart" for e in events), ctx
