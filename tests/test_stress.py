"""Randomized stress: many threads drive one embedded Orchestrator while workers end on
their own, and a fake-OS race of exit against terminate, many times over.

``STRESS_SECONDS`` (default 8) is how long the real-process trial runs at least (longer, up
to 8 times that, until it has launched MIN_LAUNCHES replicas); ``STRESS_SEED`` replays one
(the seed is printed in every failure message).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import sys
import threading
import time
import traceback

import pytest

from orchestrator import OrchestratorError
from orchestrator.states import TRANSITIONS, ReplicaState
from stress.invariants import reachable
from fakes import FakeOS, Harness

pytestmark = pytest.mark.stress

S = ReplicaState
SECONDS = float(os.environ.get("STRESS_SECONDS", "8"))
MIN_LAUNCHES = 50  # the random-churn trial goes on past SECONDS until this many were launched
POOLS = ("alpha", "beta", "gamma")
LIVE = ("PENDING", "STARTING", "RUNNING")


def _seed() -> int:
    return int(os.environ.get("STRESS_SEED") or random.SystemRandom().randrange(2**32))


# -- workers (forked: closures and partials are fine) -------------------------------------


DELAYS = (0.0, 0.001, 0.005, 0.02, 0.05, 0.1)
CODES = (0, 0, 0, 1, 3, 255)


def _lot(seed: int) -> tuple[float, int]:
    """This replica's delay and exit code: random, but fixed by the seed and its id (a pool
    runs one spec, so the randomness lives in the worker, not in its launch)."""
    rng = random.Random(f"{seed}:{os.environ['ORCHESTRATOR_REPLICA_ID']}")
    return rng.choice(DELAYS), rng.choice(CODES)


def _work(seed: int) -> None:
    delay, code = _lot(seed)
    time.sleep(delay)
    sys.exit(code)


def _stubborn(seed: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    delay, code = _lot(seed)
    time.sleep(delay * 3)
    sys.exit(code)


def _kinds(seed: int) -> dict[str, tuple[dict, float]]:
    """Worker kinds: launch arguments, and about how long one lives at most."""
    return {
        "sh": ({"command": ["sh", "-c", "sleep 0.0$(($$ % 6)); exit $(($$ % 4))"]}, 0.06),
        "py": ({"target": functools.partial(_work, seed)}, 0.1),
        "stubborn": ({"target": functools.partial(_stubborn, seed)}, 0.3),
        "sleep": ({"command": ["sleep", "1000"]}, 1000.0),
        "kill": ({"command": ["sh", "-c", "kill -9 $$"]}, 0.0),  # dies of a signal on its own
    }


def _random_worker(rng: random.Random, kinds: dict) -> tuple[str, dict, float]:
    """A kind (the pool runs it), its launch arguments, and about how long it lives."""
    kind = rng.choices(list(kinds), weights=(35, 40, 10, 8, 7))[0]
    return (kind, *kinds[kind])


# -- real processes -----------------------------------------------------------------------


def test_random_churn_on_one_orchestrator(make_orchestrator, procs):
    seed = _seed()
    orch = make_orchestrator(grace=0.3)
    stop = threading.Event()
    errors: list[str] = []
    lock = threading.Lock()
    launched: list[str] = []  # every id any launch or scale returned
    per_thread: dict[int, list[str]] = {}
    histories: dict[str, list[tuple]] = {}
    violations: list[str] = []
    polls = [0]
    # The trial runs SECONDS and until MIN_LAUNCHES replicas were launched: on a loaded
    # machine the same seconds hold fewer commands, and the churn, not the clock, is the test.
    enough = threading.Event()
    kinds = _kinds(seed)
    never = {"restart": "never"}  # the table under churn, not the restart policy (below)

    def record_error(where: str) -> None:
        with lock:
            errors.append(f"{where}: {traceback.format_exc()}")
        stop.set()

    def actor(k: int) -> None:
        rng = random.Random(seed * 31 + k)
        mine = per_thread.setdefault(k, [])
        try:
            while not stop.is_set():
                base = rng.choice(POOLS)
                roll = rng.random()
                if roll < 0.45:
                    kind, spec, life = _random_worker(rng, kinds)
                    pool = f"{base}-{kind}"  # a pool runs one spec
                    wait = rng.random() < 0.4
                    ids = orch.launch(pool, spec.get("command"), target=spec.get("target"),
                                      count=rng.randint(1, 3), wait=wait, timeout=30, policy=never)
                    mine += ids
                    with lock:
                        launched.extend(ids)
                        if len(launched) > MIN_LAUNCHES:
                            enough.set()
                    if wait and rng.random() < 0.5 and life < 1:
                        # Terminate right around its own exit.
                        time.sleep(rng.uniform(0, 2 * life))
                        orch.terminate(*ids, wait=rng.random() < 0.5, timeout=30)
                elif roll < 0.85:
                    with lock:
                        pool_ids = launched[-30:]
                    if pool_ids:
                        ids = rng.sample(pool_ids, rng.randint(1, min(3, len(pool_ids))))
                        orch.terminate(*ids, wait=rng.random() < 0.3, timeout=30)
                else:
                    n = rng.randint(0, 4)
                    result = orch.scale(f"{base}-scaled", n, command=["sleep", "1000"])
                    assert result["desired"] == n
                    mine += result["launched"]
                    with lock:
                        launched.extend(result["launched"])
        except BaseException:
            record_error(f"actor {k}")

    def poller() -> None:
        try:
            while not stop.is_set():
                status = orch.status(all=True)
                polls[0] += 1
                observe(status)
                time.sleep(0.002)
        except BaseException:
            record_error("poller")

    pids_seen: set[int] = set()

    def observe(status: dict, running: bool = True) -> None:
        for r in status["replicas"]:
            if r["pid"] and r["pid"] not in pids_seen:
                pids_seen.add(r["pid"])
                procs.track(r["pid"])  # its identity, for the final no-survivor check
        for pool in status["pools"] if running else ():  # shutdown keeps desired sizes
            live = sum(1 for r in status["replicas"] if r["pool"] == pool["name"] and r["state"] in LIVE)
            if pool["desired"] != live:
                violations.append(f"pool {pool['name']}: desired {pool['desired']} != {live} live")
        for r in status["replicas"]:
            seen = (r["state"], r["exit_code"], r["reason"], r["ended_at"])
            hist = histories.setdefault(r["id"], [])
            if not hist or hist[-1] != seen:
                hist.append(seen)

    threads = [threading.Thread(target=actor, args=(k,), name=f"actor-{k}") for k in range(3)]
    threads.append(threading.Thread(target=poller, name="poller"))
    for t in threads:
        t.start()
    stop.wait(SECONDS)
    enough.wait(8 * SECONDS)
    stop.set()
    for t in threads:
        t.join(60)
    assert not [t.name for t in threads if t.is_alive()], f"seed {seed}: threads did not finish"
    assert not errors, f"seed {seed}:\n" + "\n".join(errors)

    observe(orch.status(all=True))
    engine = orch._engine  # the table itself, read once the loop has ended
    orch.close()
    final = engine.status(include_terminal=True)
    observe(final, running=False)

    ctx = f"seed {seed}, {len(launched)} launched, {polls[0]} polls"
    assert len(launched) > MIN_LAUNCHES, ctx
    assert not violations, f"{ctx}: {violations[:5]}"
    # Every replica still in the table is terminal and reaped.
    for r in final["replicas"]:
        assert S(r["state"]).terminal and r["pid"] is None, (ctx, r)
        assert r["ended_at"] is not None, (ctx, r)
    # Observed histories: legal order, and a terminal record never changes (an
    # INTERRUPTED is never overwritten by a late exit, nor an EXITED by a terminate).
    for rid, hist in histories.items():
        states = [S(h[0]) for h in hist]
        for old, new in zip(states, states[1:]):
            assert not old.terminal, f"{ctx}: {rid} changed after its end: {hist}"
            assert reachable(old, new), f"{ctx}: {rid}: {old} -> {new} in {hist}"
    # Ids are never reused; within a pool, n grows with the order of creation.
    assert len(launched) == len(set(launched)), ctx
    for k, mine in per_thread.items():
        for pool in {p["name"] for p in final["pools"]}:
            ns = [int(i.rpartition("-")[2]) for i in mine if i.rpartition("-")[0] == pool]
            assert ns == sorted(ns) and len(ns) == len(set(ns)), (ctx, k, pool)
    rows = sorted(final["replicas"], key=lambda r: (r["pool"], int(r["id"].rpartition("-")[2])))
    for a, b in zip(rows, rows[1:]):
        if a["pool"] == b["pool"]:
            assert a["created_at"] <= b["created_at"], (ctx, a, b)
    # No process the test started is left: none alive, none unreaped.
    assert not procs.survivors(), ctx
    assert not procs.new_descendants(), ctx


def test_random_crashes_under_restart_always(make_orchestrator, procs):
    """Replicas SIGKILLed, segfaulting and exiting 0 at odd moments under --restart always,
    while other threads scale, terminate and roll the pool: no exception anywhere, no id
    reused, and once the crashes stop, the pool's live count comes back to its size."""
    seed = _seed()
    rng = random.Random(seed)
    orch = make_orchestrator(grace=0.3)
    policy = {"restart": "always", "backoff": [0.0, 0.05], "max_restarts": [100_000, 1]}
    sizes = {"web": 6, "py": 4}
    orch.launch("web", ["sleep", "1000"], count=sizes["web"], policy=policy)
    orch.launch("py", target=functools.partial(time.sleep, 1000), count=sizes["py"], policy=policy)
    stop = threading.Event()
    errors: list[str] = []
    seen_ids: set[str] = set()

    def guarded(name, body) -> None:
        try:
            while not stop.is_set():
                body()
        except BaseException:
            errors.append(f"{name}: {traceback.format_exc()}")
            stop.set()

    def crash() -> None:
        st = orch.status()
        victims = [r for r in st["replicas"] if r["pid"] and r["state"] == "RUNNING"]
        for r in victims:
            seen_ids.add(r["id"])
        if victims:
            r = rng.choice(victims)
            procs.track(r["pid"])
            try:
                os.kill(r["pid"], rng.choice((signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM)))
            except ProcessLookupError:
                pass  # it ended meanwhile (and its pid is still pinned until we reaped it)
        time.sleep(rng.uniform(0, 0.03))

    def operate() -> None:
        op = rng.random()
        pool = rng.choice(list(sizes))
        if op < 0.4:
            sizes[pool] = rng.randint(2, 6)
            orch.scale(pool, sizes[pool])
        elif op < 0.6 and rng.random() < 0.3:
            try:
                orch.restart(pool=pool, max_unavailable=2, timeout=30)
            except OrchestratorError as err:  # a new replica crashed too: that rollout stops
                assert "failed" in str(err) or "timed out" in str(err), err
        else:
            live = [r["id"] for r in orch.status()["replicas"] if r["pool"] == pool and r["state"] == "RUNNING"]
            if live and len(live) > 2:
                orch.terminate(rng.choice(live))
                sizes[pool] = max(0, sizes[pool] - 1)
        time.sleep(rng.uniform(0, 0.05))

    threads = [threading.Thread(target=guarded, args=("crasher", crash)),
               threading.Thread(target=guarded, args=("operator", operate))]
    for t in threads:
        t.start()
    stop.wait(min(SECONDS, 6))
    stop.set()
    for t in threads:
        t.join(60)
    ctx = f"seed {seed}"
    assert not errors, f"{ctx}:\n" + "\n".join(errors)

    def settled() -> bool:
        st = orch.status()
        for p in st["pools"]:
            running = [r for r in st["replicas"] if r["pool"] == p["name"] and r["state"] == "RUNNING"]
            if p["state"] != "ok" or len(running) != p["desired"] or len(st["replicas"]) != sum(
                    q["desired"] for q in st["pools"]):
                return False
        return True

    deadline = time.monotonic() + 30
    while not settled():
        assert time.monotonic() < deadline, f"{ctx}: the pools did not come back: {orch.status()}"
        time.sleep(0.02)
    st = orch.status(all=True)
    ids = [r["id"] for r in st["replicas"]]
    assert len(ids) == len(set(ids)), ctx
    for p in st["pools"]:
        slots = sorted(r["slot"] for r in st["replicas"] if r["pool"] == p["name"] and r["state"] == "RUNNING")
        # One replica a slot (a terminate frees a slot anywhere, so not always 0..size-1).
        assert len(slots) == len(set(slots)) == p["desired"], (ctx, p, slots)
        assert p["restarts"] > 0, (ctx, p)


# -- the exit/terminate race on the fake OS (a terminate racing the reaper) ---------------------


TRIALS = int(os.environ.get("STRESS_FAKE_TRIALS", "5000"))


def test_exit_against_terminate_race_on_the_fake_os():
    """Exit, ready, could-not-start, terminate (through the inbox or applied at once), a
    signal that kills or not, the grace running out: in random order, turn by turn.
    Every replica ends in exactly one terminal transition, the right one, with no signal to
    a reaped process and no fd left open."""
    seed = _seed()
    rng = random.Random(seed)
    for trial in range(TRIALS):
        fake = FakeOS(on_term=rng.choice(("manual", "die", "exit0", "ignore")))
        h = Harness(fake, grace=1.0)
        ctx = f"seed {seed} trial {trial}"
        try:
            h.launch()
            pid = fake.pid()
            proc = fake.procs[pid]
            steps = ["exit", "terminate", rng.choice(["ready", "none"]), rng.choice(["tick", "none"])]
            rng.shuffle(steps)
            for step in steps:
                if step == "ready" and not proc.exited:
                    fake.ready(pid)
                elif step == "exit" and not proc.exited:
                    kind = rng.random()
                    if kind < 0.2 and proc.ready_w >= 0:
                        fake.cannot_start(pid, b"OSError: nope")
                    else:
                        fake.exit(pid, rng.choice((0, 1, -9)))
                elif step == "terminate":
                    box: list[dict] = []
                    cmd = {"op": "terminate", "args": {"ids": ["web-1"]}}
                    if rng.random() < 0.5:
                        h.engine.submit(cmd, box.append)  # after this turn's events
                    else:
                        h.engine.handle(cmd, box.append)  # before them
                elif step == "tick":
                    fake.now += rng.choice((0.5, 1.5))
                if rng.random() < 0.6:
                    h.turn()
            # Let it finish: the process ends (our SIGKILL after the grace at the latest).
            for _ in range(5):
                h.turn()
                fake.now += 1.0
            if not proc.exited:
                fake.exit(pid, 0)
            h.turn()
            row = h.rep("web-1")
            hist = h.journal.history("web-1")
            terminal = [s for s in hist if S(s).terminal]
            assert len(terminal) == 1 and row["state"] == terminal[0], (ctx, hist)
            assert row["pid"] is None and proc.reaped, (ctx, row)
            assert fake.open_fds_of(pid) == set(), ctx
            assert fake.violations == [], (ctx, fake.violations)
            assert h.desired() == 0, (ctx, hist)
            for old, new in zip(hist, hist[1:]):
                assert S(new) in TRANSITIONS[S(old)], (ctx, hist)
            # SIGTERM went out exactly when the terminate found it live (the fake checks
            # that no signal ever reached a reaped pid).
            sent_term = any(sig == signal.SIGTERM for sig, _ in fake.signals_to(pid))
            assert sent_term == ("STOPPING" in hist or "INTERRUPTED" in hist), (ctx, hist, fake.signals)
        finally:
            h.engine.close()
            fake.cleanup()
