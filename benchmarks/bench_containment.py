"""Benchmark of containment (orchestrator/containment.py): cgroups against process groups.

Run: ``.venv/bin/python benchmarks/bench_containment.py [--quick]`` from the repo root, as a
user who may create cgroups (root here; else only the process-group rows run). ~60-90 s
(``--quick`` ~30 s). Prints a markdown table and the command that reproduced it.

1. Churn, one run, two real daemons (``start_detached``, ``--cgroup off`` and ``--cgroup
   auto``) side by side, in interleaved rounds (who goes first alternates): a cycle is
   ``launch(20 x sleep 1000, wait=True)`` through the daemon's ``Client`` (returns once all
   are RUNNING), then ``terminate(*ids, wait=True)`` (returns once all have ended: in cgroup
   mode once their cgroups are empty and removed). replicas/s per round, median over rounds,
   and the ratio cgroup / process-group.
2. What a spawn costs: ``OSApi.spawn`` of ``/bin/true`` until reaped, with and without a
   cgroup (mkdir, the child's write to cgroup.procs, the wait for ``populated 0``, rmdir),
   interleaved, p50 per spawn.
3. Clean-up after a kill -9 of the daemon: N replica trees (each ``sh -c 'sleep 1000 &
   sleep 1000'``, so 2-3 processes) RUNNING; every process of them pinned with a pidfd;
   SIGKILL to the daemon; the time until the last of them has exited (the watchdog's
   work: cgroup.kill per replica cgroup, or its signal sweep). N = 50 and 200, a few
   rounds each, in each mode, interleaved; p50/p99/max.

Targets: churn with cgroups >= 0.8x process groups; clean-up p99 <= 25 ms for 50 trees.
Every daemon is stopped in a ``finally``; every process the benchmark saw is checked gone,
and no ``orchestrator*`` cgroup of its state dirs is left. Figures drift +-20% between runs
on shared 2-core machines: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

BATCH = 20
SLEEP = ["sleep", "1000"]
TREE = ["sh", "-c", "sleep 1000 & sleep 1000"]
TARGET_CHURN_RATIO = 0.8
TARGET_CLEANUP_P99_MS = 25.0
pc = time.perf_counter


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


class Daemon:
    """One daemon of the benchmark: started detached, its processes remembered."""

    def __init__(self, root: Path, name: str, cgroup: str) -> None:
        from orchestrator.paths import Paths

        self.paths = Paths(root / name)
        self.cgroup = cgroup
        self.pid: int | None = None
        self.client: Any = None
        self.seen: dict[int, float] = {}  # pid -> create time, every process we saw

    def start(self) -> None:
        from orchestrator.client.channel import Client
        from orchestrator.client.control import start_detached

        self.pid = start_detached(self.paths, ["--cgroup", self.cgroup, "--grace", "2"])
        self.client = Client(str(self.paths.state_dir))
        self.remember()

    def status(self) -> dict:
        return self.client.status()

    def remember(self) -> None:
        import psutil

        if self.pid is None:
            return
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass

    def reap(self) -> None:
        """start_detached's Popen never waits: the daemon is our child."""
        if self.pid is not None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass

    def close_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def stop(self) -> None:
        from orchestrator.client.control import stop
        from orchestrator.paths import running_pid

        self.close_client()
        if running_pid(self.paths) is not None:
            stop(self.paths, timeout=60)
        self.reap()
        self.pid = None


# -- 1. churn ------------------------------------------------------------------------------


def churn_cycle(client: Any, pool: str) -> None:
    ids = client.launch(pool, SLEEP, count=BATCH, wait=True, timeout=60)
    if len(ids) != BATCH:
        raise RuntimeError(f"{pool}: launched {len(ids)}, expected {BATCH}")
    done = client.terminate(*ids, wait=True, timeout=60)
    if len(done) != BATCH:
        raise RuntimeError(f"{pool}: terminated {len(done)}, expected {BATCH}")


def bench_churn(daemons: dict[str, Daemon], rounds: int, cycles: int) -> dict[str, list[float]]:
    names = list(daemons)
    for name in names:  # warm-up
        churn_cycle(daemons[name].client, "churn")
        daemons[name].remember()
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = pc()
            for _ in range(cycles):
                churn_cycle(daemons[name].client, "churn")
            rates[name].append(cycles * BATCH / (pc() - t0))
    for name in names:
        if daemons[name].status()["replicas"]:
            raise RuntimeError(f"{name}: replicas still live after the churn")
    return rates


# -- 2. one spawn --------------------------------------------------------------------------


def bench_spawn(n: int, with_cgroup: bool) -> dict[str, list[float]]:
    """OSApi.spawn of /bin/true until reaped (and its cgroup empty and removed), per spawn."""
    from orchestrator.daemon.osapi import OSApi
    from orchestrator.spec import LaunchPlan
    from watchdog import cgroup

    api = OSApi()
    tree = None
    if with_cgroup:
        tree = cgroup.Subtree.create(cgroup.require_own_path(), f"orchestrator-bench-spawn-{os.getpid()}",
                                     move_self=False)
    out: dict[str, list[float]] = {"cgroup": [], "plain": []}
    try:
        for i in range(n):
            for mode in ("plain", "cgroup") if tree is not None else ("plain",):
                t0 = pc()
                path = tree.make_replica(f"r{i}") if mode == "cgroup" else None
                plan = LaunchPlan(f"r{i}", ("/bin/true",), "/bin/true", env={}, cgroup=path)
                sp = api.spawn(plan)
                select.select([sp.exit_fd], [], [], 10)
                api.reap(sp.pid)
                os.close(sp.exit_fd)
                os.close(sp.ready_fd)
                if path is not None:
                    cgroup.wait_unpopulated([path], 5)
                    cgroup.remove(path)
                out[mode].append(pc() - t0)
    finally:
        if tree is not None:
            tree.kill_all()
            tree.destroy()
    return out


# -- 3. clean-up after kill -9 ----------------------------------------------------------------


def tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return []


def wait_running(d: Daemon, n: int, timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        reps = [r for r in d.status()["replicas"] if r["state"] == "RUNNING" and r["pid"]]
        if len(reps) >= n:
            return reps
        if time.monotonic() > deadline:
            raise RuntimeError(f"{d.paths.state_dir}: only {len(reps)} of {n} replicas RUNNING")
        time.sleep(0.05)


def kill_round(d: Daemon, n: int, first: bool) -> tuple[float, int]:
    """Start (the pool comes back at its size after a kill), kill -9, time the clean-up."""
    d.start()
    if first:
        d.client.launch("trees", TREE, count=n, wait=True, timeout=120)
    reps = wait_running(d, n)
    time.sleep(0.3)  # let each sh fork its sleeps
    fds: list[int] = []
    for r in reps:
        for pid in tree_pids(r["pid"]):
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                pass
    d.remember()
    watchdog = d.status()["daemon"]["watchdog_pid"]
    d.close_client()
    report = d.paths.state_dir / "watchdog-report.json"
    report.unlink(missing_ok=True)
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left = set(fds)
    t0 = pc()
    os.kill(d.pid, signal.SIGKILL)
    deadline = t0 + 30
    while left and pc() < deadline:
        for fd, _ in poller.poll(1000):
            poller.unregister(fd)
            left.discard(fd)
    elapsed = pc() - t0
    for fd in fds:
        os.close(fd)
    if left:
        raise RuntimeError(f"{len(left)} of {len(fds)} processes still alive 30 s after the kill")
    d.reap()
    # The watchdog writes its report, then exits: wait for both before the next start.
    wait_gone(watchdog, 30)
    return elapsed, len(fds)


def wait_gone(pid: int | None, timeout: float) -> None:
    if pid is None:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import psutil

    from orchestrator.daemon.containment import subtree_name
    from watchdog import cgroup

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds, cycles = (3, 3) if args.quick else (6, 4)
    kill_rounds = 3 if args.quick else 5
    sizes = (50, 200)
    probe = cgroup.own_path()
    modes = {"process-group": "off"}
    try:
        if probe is not None:
            t = os.path.join(probe, f"orchestrator-bench-probe-{os.getpid()}")
            os.mkdir(t)
            os.rmdir(t)
            modes["cgroup"] = "auto"
    except OSError as err:
        print(f"cgroup rows skipped: cannot create a cgroup under {probe}: {err.strerror}")
    root = Path(tempfile.mkdtemp(prefix="bench-containment-"))
    daemons: list[Daemon] = []
    results: dict[str, Any] = {}
    t_all = pc()
    try:
        churners = {mode: Daemon(root, f"churn-{mode}", flag) for mode, flag in modes.items()}
        daemons += churners.values()
        for d in churners.values():
            d.start()
            if d.status()["daemon"]["containment"] != ("cgroup" if d.cgroup == "auto" else "process-group"):
                raise RuntimeError(f"{d.cgroup}: {d.status()['daemon']['containment_reason']}")
        results["churn"] = bench_churn(churners, rounds, cycles)
        for d in churners.values():
            d.stop()
        spawn_n = 100 if args.quick else 300
        results["spawn"] = bench_spawn(spawn_n, "cgroup" in modes)
        killers = {(mode, n): Daemon(root, f"kill-{mode}-{n}", flag) for mode, flag in modes.items() for n in sizes}
        daemons += killers.values()
        cleanup: dict[tuple[str, int], list[float]] = {k: [] for k in killers}
        procs: dict[tuple[str, int], int] = {}
        for r in range(kill_rounds):
            keys = list(killers)
            for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                elapsed, count = kill_round(killers[key], key[1], first=r == 0)
                cleanup[key].append(elapsed)
                procs[key] = count
        results["cleanup"], results["procs"] = cleanup, procs
        for d in killers.values():  # a last start: records them LOST; its stop cleans up
            d.start()
            d.client.scale("trees", 0)
            d.stop()
    finally:
        for d in daemons:
            try:
                d.stop()
            except Exception as err:  # noqa: BLE001 - report and go on cleaning up
                print(f"stopping {d.paths.state_dir}: {err}")
        left = []
        for d in daemons:
            for pid, ctime in d.seen.items():
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - ctime) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                        left.append(f"{pid} {p.name()}")
                        p.kill()
                except psutil.Error:
                    pass
        dirs = [os.path.join(probe, subtree_name(d.paths.state_dir)) for d in daemons] if probe else []
        stale = [p for p in dirs if os.path.exists(p)]
        shutil.rmtree(root, ignore_errors=True)
    took = pc() - t_all

    churn, spawn, cleanup, procs = results["churn"], results["spawn"], results["cleanup"], results["procs"]
    print(f"# Containment benchmark ({os.cpu_count()} CPUs, Linux {os.uname().release}, {took:.0f} s)\n")
    print(f"Command: `.venv/bin/python benchmarks/bench_containment.py{' --quick' if args.quick else ''}`\n")
    print(f"## Churn: {rounds} interleaved rounds of {cycles} cycles (launch 20 `sleep` --wait, terminate --wait)\n")
    print("| mode | replicas/s (median) | min | max |")
    print("| --- | ---: | ---: | ---: |")
    for mode, rates in churn.items():
        print(f"| {mode} | {statistics.median(rates):.0f} | {min(rates):.0f} | {max(rates):.0f} |")
    if "cgroup" in churn:
        ratio = statistics.median(churn["cgroup"]) / statistics.median(churn["process-group"])
        per_round = [c / p for c, p in zip(churn["cgroup"], churn["process-group"])]
        verdict = "meets" if ratio >= TARGET_CHURN_RATIO else "MISSES"
        print(f"\nRatio cgroup / process-group: **{ratio:.2f}x** (per round {min(per_round):.2f}-{max(per_round):.2f}; "
              f"target >= {TARGET_CHURN_RATIO}x: {verdict})\n")
    print(f"## One spawn of /bin/true until reaped, {len(spawn['plain'])} interleaved\n")
    print("| mode | p50 µs | p99 µs |")
    print("| --- | ---: | ---: |")
    for mode, vals in spawn.items():
        if vals:
            print(f"| {mode} | {pct(vals, 50) * 1e6:.0f} | {pct(vals, 99) * 1e6:.0f} |")
    print(f"\n## kill -9 of the daemon -> last process of N trees gone ({kill_rounds} rounds)\n")
    print("| mode | trees | processes | p50 ms | p99 ms | max ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for (mode, n), vals in cleanup.items():
        print(f"| {mode} | {n} | {procs[(mode, n)]} | {pct(vals, 50) * 1e3:.1f} | {pct(vals, 99) * 1e3:.1f} | "
              f"{max(vals) * 1e3:.1f} |")
    if ("cgroup", 50) in cleanup:
        p99 = pct(cleanup[("cgroup", 50)], 99) * 1e3
        print(f"\nClean-up p99 for 50 trees, cgroup mode: {p99:.1f} ms (target <= {TARGET_CLEANUP_P99_MS:g} ms: "
              f"{'meets' if p99 <= TARGET_CLEANUP_P99_MS else 'MISSES'})")
    print()
    if left or stale:
        print(f"Leftovers: **FAILED**: processes {left}, cgroup dirs {stale}")
        return 1
    print(f"Leftovers: none ({sum(len(d.seen) for d in daemons)} processes seen, all gone; no cgroup subtree left).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
