"""Many clients at once on one daemon: threads on the Python ``Client`` and a thread on the
CLI send random launch / terminate / scale / status / restart / delete / signal commands
while a poller watches the table; afterwards the daemon must be the same, healthy, its
table and journal consistent, and its pools back at their sizes."""

from __future__ import annotations

import json

import random
import subprocess
import threading
import time
import traceback

import pytest

from helpers import DaemonUnderTest, cli, wait_for
from orchestrator import Client, OrchestratorError
from stress.conftest import Stress
from stress.invariants import Histories, journal_violations, quiet, size_violations, table_violations

pytestmark = [pytest.mark.stress, pytest.mark.timeout(90)]

STUBBORN = ["sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"]
# A pool runs one spec and one policy: each pool here always gets the same ones.
POOLS: dict[str, tuple[list[str], dict]] = {
    "sleepers": (["sleep", "1000"], {"restart": "always", "backoff": [0.0, 0.1]}),
    "blinkers": (["sh", "-c", "sleep 0.1; exit 3"], {"restart": "on-failure", "backoff": [0.02, 0.2],
                                                      "max_restarts": [1000, 1]}),
    "stubborn": (STUBBORN, {"grace": 0.3}),
    "oneshot": (["true"], {"restart": "never"}),
}
FLAGS = {"sleepers": ["--restart", "always", "--backoff", "0:0.1"],
         "blinkers": ["--restart", "on-failure", "--backoff", "0.02:0.2", "--max-restarts", "1000/1"],
         "stubborn": ["--grace", "0.3"], "oneshot": ["--restart", "never"]}
# Refusals a race makes legitimate (the pool was deleted, the replica ended, a rollout's
# new replica crashed); anything else, and any "internal error", fails the test.
REFUSALS = ("unknown replica", "unknown pool", "another spec", "failed", "timed out", "not ready",
            "no live replica", "nothing to", "already", "being deleted", "rollout", "ended", "not running",
            "one pool at a time")


def _refusal_ok(message: str) -> bool:
    return "internal error" not in message and any(r in message for r in REFUSALS)


class Storm:
    """The clients' shared account: every id any command made, commands done, refusals."""

    def __init__(self, stress: Stress) -> None:
        self.stress = stress
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.made: list[str] = []
        self.errors: list[str] = []
        self.ok = 0
        self.refused: list[str] = []

    def record(self, ids: list[str]) -> None:
        with self.lock:
            self.made.extend(ids)
            self.ok += 1

    def some_ids(self, rng: random.Random, k: int = 3) -> list[str]:
        with self.lock:
            recent = self.made[-40:]
        return rng.sample(recent, min(len(recent), rng.randint(1, k))) if recent else []

    def refuse(self, where: str, message: str) -> None:
        with self.lock:
            if _refusal_ok(message):
                self.refused.append(message)
            else:
                self.errors.append(f"{where}: unexpected refusal: {message}")
                self.stop.set()

    def crash(self, where: str) -> None:
        with self.lock:
            self.errors.append(f"{where}: {traceback.format_exc()}")
        self.stop.set()


def client_actor(state_dir, storm: Storm, k: int) -> None:
    rng = random.Random(storm.stress.seed * 101 + k)
    try:
        with Client(state_dir, timeout=30) as client:
            while not storm.stop.is_set():
                pool = rng.choice(list(POOLS))
                command, policy = POOLS[pool]
                op = rng.choices(("launch", "terminate", "scale", "status", "restart", "delete", "signal"),
                                 (30, 25, 15, 10, 8, 4, 8))[0]
                try:
                    if op == "launch":
                        storm.record(client.launch(pool, command, count=rng.randint(1, 3), policy=policy,
                                                   wait=rng.random() < 0.3, timeout=10))
                    elif op == "terminate" and (ids := storm.some_ids(rng)):
                        client.terminate(ids, wait=rng.random() < 0.3, timeout=10)
                        storm.record([])
                    elif op == "scale":  # of an existing pool
                        storm.record(client.scale(pool, rng.randint(0, 4))["launched"])
                    elif op == "status":
                        client.status(all=rng.random() < 0.5)
                        storm.record([])
                    elif op == "restart":
                        if rng.random() < 0.5 and (ids := storm.some_ids(rng, 2)):
                            done = client.restart(ids, timeout=10)
                        else:
                            done = client.restart(pool=pool, max_unavailable=rng.randint(1, 2), timeout=10)
                        storm.record(list(done["replaced"].values()))
                    elif op == "delete":
                        client.delete(pool)
                        storm.record([])
                    elif op == "signal":
                        sig = rng.choice(("HUP", "CONT", "USR1"))
                        if rng.random() < 0.5:
                            client.signal(sig, pool=pool)
                        elif ids := storm.some_ids(rng):
                            client.signal(sig, ids)
                        storm.record([])
                except OrchestratorError as err:
                    storm.refuse(f"client {k} {op} {pool}", str(err))
    except BaseException:
        storm.crash(f"client {k}")


def cli_actor(state_dir, storm: Storm) -> None:
    rng = random.Random(storm.stress.seed * 101 + 99)
    try:
        while not storm.stop.is_set():
            pool = rng.choice(list(POOLS))
            op = rng.choice(("launch", "terminate", "scale", "status", "restart", "signal", "py"))
            if op == "launch":
                args = ["launch", "--pool", pool, "--count", str(rng.randint(1, 2)), *FLAGS[pool],
                        "--", *POOLS[pool][0]]
            elif op == "py":  # a Python target: only the CLI launches into this pool
                args = ["launch", "--pool", "py", "--restart", "always", "--target", "workers:sleeper"]
            elif op == "terminate":
                args = ["terminate", *(storm.some_ids(rng) or ["sleepers-1"])]
            elif op == "scale":
                args = ["scale", rng.choice([pool, "py"]), str(rng.randint(0, 3))]
            elif op == "status":
                args = ["status", "--all", "--json"]
            elif op == "restart":
                args = ["restart", "--pool", rng.choice([pool, "py"]), "--timeout", "10"]
            else:
                args = ["signal", "HUP", "--pool", pool]
            proc = cli(state_dir, *args)
            if proc.returncode == 0:
                storm.record(proc.stdout.split() if op in ("launch", "py") else [])
            elif proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1:
                storm.refuse(f"cli {' '.join(args)}", proc.stderr.strip())
            else:
                with storm.lock:
                    storm.errors.append(f"cli {' '.join(args)} -> {proc.returncode}: {proc.stderr}")
                storm.stop.set()
    except subprocess.TimeoutExpired:
        storm.crash("cli (a command did not return)")
    except BaseException:
        storm.crash("cli")


def test_many_clients_at_once(stress_daemon: DaemonUnderTest, stress: Stress) -> None:
    d = stress_daemon
    pid = d.start("--grace", "0.5")
    storm = Storm(stress)
    hist = Histories()
    polls = [0]

    def poller() -> None:
        try:
            with Client(d.state_dir, timeout=30) as client:
                while not storm.stop.is_set():
                    hist.observe(client.status(all=True))
                    polls[0] += 1
                    storm.stop.wait(0.01)
        except BaseException:
            storm.crash("poller")

    threads = [threading.Thread(target=client_actor, args=(d.state_dir, storm, k)) for k in range(3)]
    threads += [threading.Thread(target=cli_actor, args=(d.state_dir, storm)),
                threading.Thread(target=poller)]
    for t in threads:
        t.start()
    storm.stop.wait(stress.seconds(4))
    storm.stop.set()
    for t in threads:
        t.join(60)
    ctx = f"{stress.replay}: {storm.ok} commands, {len(storm.refused)} refused, {polls[0]} polls"
    assert not [t for t in threads if t.is_alive()], f"{ctx}: a client did not finish"
    assert not storm.errors, f"{ctx}:\n" + "\n".join(storm.errors)
    assert storm.ok > 40 * stress.size and polls[0] > 20, ctx

    # The same daemon, healthy; every id made once.
    health = cli(d.state_dir, "health", "--json")
    assert health.returncode == 0, f"{ctx}: {health.stdout} {health.stderr}"
    assert d.status()["daemon"]["pid"] == pid, ctx
    assert len(storm.made) == len(set(storm.made)), f"{ctx}: an id made twice"

    # The churny pool goes; the others settle at their sizes.
    cli(d.state_dir, "delete", "blinkers")
    wait_for(lambda: quiet(d.status(all=True)), 30, f"the table to settle ({ctx})")
    final = d.status(all=True)
    hist.observe(final)
    assert not table_violations(final), f"{ctx}: {table_violations(final)}"
    if size_violations(final):  # what the journal says of the short pool, for the bug report
        short = size_violations(final)[0].split()[1].rstrip(":")
        events = cli(d.state_dir, "events", "--json", "--limit", "400").stdout.splitlines()
        tail = sorted((e for e in events if f'"{short}' in e), key=lambda e: json.loads(e)["seq"])[-40:]
        raise AssertionError(f"{ctx}: {size_violations(final)}\n" + "\n".join(tail))
    assert not hist.violations(), f"{ctx}: {hist.violations()[:5]}"
    assert not journal_violations(d.state_dir, final), f"{ctx}: {journal_violations(d.state_dir, final)[:5]}"
    made = {r["id"] for r in final["replicas"]}
    assert set(storm.made) <= made | set(hist.seen), ctx
    log = (d.state_dir / "logs" / "daemon.log").read_text()
    assert "Traceback" not in log, f"{ctx}: {log[-2000:]}"


def test_ids_are_never_reused_by_a_pool_recreated_with_scale(stress_daemon: DaemonUnderTest) -> None:
    """docs/design.md: ids are never reused, even across a deleted pool of the same name,
    whether ``launch`` or ``scale POOL N`` with a spec brings the name back."""
    stress_daemon.start()
    with Client(stress_daemon.state_dir, timeout=30) as client:
        first = client.launch("p", ["sleep", "1000"], count=2)
        client.delete("p")
        again = client.scale("p", 2, command=["sleep", "1000"])["launched"]
        client.delete("p")
    assert not set(first) & set(again), (first, again)
