"""Benchmark of orchestrator.store under simulated replica churn.

(1) Churn: per cycle one replica goes PENDING -> STARTING -> RUNNING -> STOPPING -> TERMINATED:
    a save_replica + append_event at creation and at each transition (5 + 5 rows). Replicas move
    in batches of 20, one commit() per batch step (the control loop commits once per turn), so a
    commit carries 20 saves + 20 events. Reported: cycles/s and microseconds of store cost per
    replica (all store calls, commits and the periodic pruning included). A second row commits
    after every single transition (the worst case: one command per turn).
(2) Size: state.db (+ -wal) after 100,000 churn cycles at default retention.
Also: time of the reads the daemon / CLI make at default retention (load, events, reopen).
(3) The store in the real control loop: the embedded Orchestrator with the store on
    (``Orchestrator(db=path)``) and off (``Orchestrator()``), in the same run, in interleaved
    rounds (the order alternates each round, so drift and warm-up hit both alike). A cycle
    launches 20 ``sleep 1000`` with wait=True, then terminates them all with wait=True.
    Reported: replicas/s each, the cost ratio on/off (target: on within 20% of off), and the
    time spent inside Store calls per replica. Then the same cycle against a real daemon
    (always with its store) through the Client, for the end-to-end number.

Run: .venv/bin/python benchmarks/bench_store.py [--section all|store|loop]
     (from the repo root; well under a minute on the 2-core reference machine: ~10 s for
     "store", ~10 s for "loop")
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orchestrator.store import KEEP_EVENTS, KEEP_REPLICAS, Store  # noqa: E402

STATES = ("PENDING", "STARTING", "RUNNING", "STOPPING", "TERMINATED")


def churn(store: Store, cycles: int, batch: int, *, pool: str = "web", start_n: int = 1,
          per_transition_commit: bool = False) -> float:
    """Run `cycles` replica lifecycles; return the elapsed seconds."""
    store.save_pool(pool, {"cmd": ["sleep", "infinity"], "restart": "never"}, batch, start_n)
    store.commit()
    n = start_n
    t0 = time.perf_counter()
    done = 0
    while done < cycles:
        k = min(batch, cycles - done)
        recs = []
        for _ in range(k):
            now = time.time()
            recs.append({"id": f"{pool}-{n}", "pool": pool, "n": n, "state": "PENDING", "pid": None,
                         "start_time": None, "exit_code": None, "reason": None,
                         "created_at": now, "ended_at": None})
            n += 1
        prev = None
        for state in STATES:
            for r in recs:
                r["state"] = state
                if state == "RUNNING":
                    r["pid"], r["start_time"] = 40000 + r["n"] % 20000, 123456 + r["n"]
                elif state == "TERMINATED":
                    r["pid"], r["exit_code"], r["reason"] = None, -15, "terminate requested"
                    r["ended_at"] = time.time()
                store.save_replica(r)
                if prev is None:
                    store.append_event("create", replica=r["id"], data={"pool": pool})
                else:
                    store.append_event("transition", replica=r["id"],
                                       data={"from": prev, "to": state, "reason": r["reason"]})
                if per_transition_commit:
                    store.commit()
            prev = state
            store.commit()      # one loop turn
        done += k
    store.save_pool(pool, {"cmd": ["sleep", "infinity"], "restart": "never"}, batch, n)
    store.commit()
    return time.perf_counter() - t0


def sizes(path: str) -> tuple[int, int]:
    def sz(p: str) -> int:
        try:
            return os.path.getsize(p)
        except FileNotFoundError:
            return 0
    return sz(path), sz(path + "-wal")


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        # warm-up (imports, page cache)
        with Store(os.path.join(d, "warm.db")) as s:
            churn(s, 2000, 20)

        path = os.path.join(d, "a.db")
        with Store(path) as s:
            cycles = 20_000
            dt = churn(s, cycles, 20)
            rows.append(("churn, commit per 20-replica step", cycles, cycles / dt, dt / cycles * 1e6))

        path = os.path.join(d, "b.db")
        with Store(path) as s:
            cycles = 5_000
            dt = churn(s, cycles, 20, per_transition_commit=True)
            rows.append(("churn, commit per transition", cycles, cycles / dt, dt / cycles * 1e6))

        path = os.path.join(d, "c.db")
        max_wal = 0
        with Store(path) as s:
            cycles, step, n = 100_000, 10_000, 1
            total = 0.0
            for _ in range(cycles // step):
                total += churn(s, step, 20, start_n=n)
                n += step
                max_wal = max(max_wal, sizes(path)[1])
            rows.append(("churn 100k cycles, default retention", cycles, cycles / total,
                         total / cycles * 1e6))
            db_open, wal_open = sizes(path)
            n_rep = s._conn.execute("SELECT count(*) FROM replicas").fetchone()[0]
            n_ev = s._conn.execute("SELECT count(*) FROM events").fetchone()[0]
            free = s._conn.execute("PRAGMA freelist_count").fetchone()[0]
            pages = s._conn.execute("PRAGMA page_count").fetchone()[0]
            reads = []
            t = time.perf_counter(); pools, live = s.load(); reads.append(("load()", time.perf_counter() - t))
            t = time.perf_counter(); ev = s.events(); reads.append((f"events() all ({len(ev)})", time.perf_counter() - t))
            t = time.perf_counter(); s.events(replica="web-99999"); reads.append(("events(replica=)", time.perf_counter() - t))
            t = time.perf_counter(); s.events(after_seq=s.last_seq() - 100); reads.append(("events(after_seq=last-100)", time.perf_counter() - t))
            t = time.perf_counter(); allr = s.replicas(include_terminal=True); reads.append((f"replicas(all) ({len(allr)})", time.perf_counter() - t))
            t = time.perf_counter(); s.prune(); reads.append(("prune() at full retention", time.perf_counter() - t))
        db_closed, wal_closed = sizes(path)
        t = time.perf_counter()
        with Store(path) as s:
            reads.append(("open writer (quick_check+prune)", time.perf_counter() - t))
            t = time.perf_counter(); ok = s.integrity_ok(); reads.append((f"integrity_ok()={ok}", time.perf_counter() - t))

    print(f"{'scenario':40} {'cycles':>8} {'cycles/s':>10} {'us/replica':>11}")
    for name, c, rate, us in rows:
        print(f"{name:40} {c:>8} {rate:>10,.0f} {us:>11.1f}")
    print()
    print(f"after 100,000 cycles (keep_replicas={KEEP_REPLICAS:,}, keep_events={KEEP_EVENTS:,}): "
          f"{n_rep} replicas, {n_ev} events, {pages} pages ({free} free)")
    print(f"{'file':40} {'bytes':>12}")
    print(f"{'state.db (open)':40} {db_open:>12,}")
    print(f"{'state.db-wal (open, at end)':40} {wal_open:>12,}")
    print(f"{'state.db-wal (max seen, sampled)':40} {max_wal:>12,}")
    print(f"{'state.db + -wal (open)':40} {db_open + wal_open:>12,}")
    print(f"{'state.db after close (-wal: %d)' % wal_closed:40} {db_closed:>12,}")
    print()
    print(f"{'read / maintenance':40} {'ms':>8}")
    for name, dt in reads:
        print(f"{name:40} {dt * 1e3:>8.1f}")


# --------------------------------------------------------------------------- (3) in the loop

LOOP_REPLICAS = 20          # per cycle: launch 20 (wait), terminate them all (wait)
LOOP_ROUNDS = 12            # interleaved rounds ...
LOOP_CYCLES = 4             # ... of this many cycles per configuration
DAEMON_CYCLES = 15


class _StoreTimer:
    """Wraps a Store's methods to add up the time the control loop spends in them."""

    def __init__(self, store: Store) -> None:
        self.seconds = 0.0
        self.commits = 0
        for name in ("save_pool", "save_replica", "append_event", "commit"):
            setattr(store, name, self._wrap(getattr(store, name), name == "commit"))

    def _wrap(self, fn, is_commit):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
                if is_commit:
                    self.commits += 1
        return timed


def _cycle(orch) -> None:
    ids = orch.launch("bench", ["sleep", "1000"], count=LOOP_REPLICAS, wait=True, timeout=60)
    orch.terminate(*ids, wait=True, timeout=60)


def loop_bench() -> None:
    from orchestrator import Orchestrator

    with tempfile.TemporaryDirectory() as d:
        db = os.path.join(d, "state.db")
        with Orchestrator(grace=2.0) as off, Orchestrator(grace=2.0, db=db) as on:
            timer = _StoreTimer(on._engine.store)
            for orch in (off, on):      # warm-up: imports, page cache, first pool
                for _ in range(2):
                    _cycle(orch)
            timer.seconds, timer.commits = 0.0, 0
            spent = {"off": 0.0, "on": 0.0}
            cpu = {"off": 0.0, "on": 0.0}   # this process's CPU time (all threads): less
            ratios = []                     # sensitive than wall time to other load on the host
            for r in range(LOOP_ROUNDS):
                order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
                this = {}
                for name, orch in order:
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(LOOP_CYCLES):
                        _cycle(orch)
                    this[name] = time.perf_counter() - t
                    spent[name] += this[name]
                    cpu[name] += time.process_time() - c
                ratios.append(this["on"] / this["off"])
            rows = LOOP_ROUNDS * LOOP_CYCLES * LOOP_REPLICAS
            with Store(db, readonly=True) as s:
                n_events = len(s.events())
        db_bytes = sizes(db)
    rate_off, rate_on = rows / spent["off"], rows / spent["on"]
    ratio = spent["on"] / spent["off"]
    ratios.sort()
    print()
    print(f"(3) embedded Orchestrator, cycle = launch {LOOP_REPLICAS} `sleep 1000` (wait) + terminate all "
          f"(wait); {LOOP_ROUNDS} interleaved rounds x {LOOP_CYCLES} cycles each")
    print(f"{'configuration':40} {'replicas':>8} {'replicas/s':>10} {'ms/cycle':>9}")
    for name, rate in (("store off: Orchestrator()", rate_off), ("store on: Orchestrator(db=path)", rate_on)):
        print(f"{name:40} {rows:>8} {rate:>10,.0f} {LOOP_REPLICAS / rate * 1e3:>9.1f}")
    median = ratios[len(ratios) // 2]
    verdict = "within" if median <= 1.20 else "NOT within"
    print(f"cost ratio on/off, wall time: total {ratio:.3f}; per round min {ratios[0]:.3f} "
          f"median {median:.3f} max {ratios[-1]:.3f} -> {verdict} the 20% target (judged on the median)")
    print(f"cost ratio on/off, CPU time of this process: {cpu['on'] / cpu['off']:.3f} "
          f"({cpu['off'] / rows * 1e6:.0f} vs {cpu['on'] / rows * 1e6:.0f} us CPU/replica)")
    per_rep = timer.seconds / rows * 1e6
    print(f"inside Store calls (store on): {per_rep:.1f} us/replica "
          f"({timer.seconds / spent['on'] * 100:.1f}% of its wall time), {timer.commits} commits "
          f"({timer.commits / rows:.2f}/replica); journal {n_events} events, "
          f"state.db {db_bytes[0]:,} B + -wal {db_bytes[1]:,} B")


def daemon_bench() -> None:
    """The same cycle against a real daemon (store always on), through the Client."""
    from pathlib import Path

    from orchestrator import Client
    from orchestrator.client.control import start_detached, stop
    from orchestrator.paths import Paths, running_pid

    with tempfile.TemporaryDirectory() as d:
        paths = Paths(Path(d) / "state")
        start_detached(paths)
        try:
            with Client(paths.state_dir, timeout=60) as client:
                for _ in range(2):
                    _cycle(client)
                t = time.perf_counter()
                for _ in range(DAEMON_CYCLES):
                    _cycle(client)
                dt = time.perf_counter() - t
        finally:
            if stop(paths, timeout=30) == 1:
                print(f"the daemon (pid {running_pid(paths)}) did not stop within 30 s")
    rows = DAEMON_CYCLES * LOOP_REPLICAS
    print()
    print(f"(3b) daemon (store on), same cycle through Client: {DAEMON_CYCLES} cycles")
    print(f"{'daemon via Client':40} {rows:>8} {rows / dt:>10,.0f} {dt / DAEMON_CYCLES * 1e3:>9.1f}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--section", choices=("all", "store", "loop"), default="all")
    section = ap.parse_args().section
    if section in ("all", "store"):
        main()
    if section in ("all", "loop"):
        loop_bench()
        daemon_bench()
