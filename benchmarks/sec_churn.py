"""Churn, every variant side by side in one run: the orchestrator three ways (embedded API,
the daemon's channel, the CLI), the process-starting floors, and the peers.

A churn cycle is a batch of 20 ``sleep 1000`` replicas launched until all run, then
terminated until all are reaped; replicas/s = 20 × cycles / time. Variants:

* orchestrator, embedded: ``Orchestrator.launch(count=20, wait=True)`` + ``terminate(wait=True)``;
  per-replica latencies stamped by the loop (``bench_churn.trace_transitions``);
* orchestrator, channel: the same calls through ``Client`` to a detached daemon
  (``daemon.start_detached`` in a temp state dir, stopped with ``daemon.stop``);
* orchestrator, CLI: ``python -m orchestrator launch --count 20 --wait`` and
  ``terminate --wait`` subprocesses against that daemon (each call pays an interpreter start);
  per-replica latencies for these two from the daemon's journal (transition times);
* ``multiprocess.Process`` (fork) and raw ``os.fork`` (the floor), raw fork+exec (information);
* ProcessPoolExecutor (fork) and loky: dead worker replaced and usable again, per second
  (``peers.PoolReplacement``: not a batch, one replacement of one worker of a pool of 4);
* supervisord: stop + start of a group of 20 programs over XML-RPC (``startsecs=0``).

Variants run interleaved, one batch each per round in a rotating order, after a warm-up round.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks import peers
from benchmarks.report import summary

BATCH = 20
POOL_WORKERS = 4
SLEEP = ["sleep", "1000"]
pc = time.perf_counter

EMBEDDED = "orchestrator, embedded API"
CHANNEL = "orchestrator, daemon channel"
CLI = "orchestrator, CLI"
MP = "multiprocess.Process (fork)"
FORK = "raw os.fork (floor)"
FORK_EXEC = "raw os.fork + exec"
PPE = "ProcessPoolExecutor (fork): dead worker replaced"
LOKY = "loky: dead worker replaced"
SUPERVISORD = "supervisord: stop+start of 20 programs"


class Variant:
    """What one variant measured: per-unit seconds, and per-replica latencies if known."""

    def __init__(self, name: str, unit: int, kind: str) -> None:
        self.name, self.unit, self.kind = name, unit, kind
        self.cycles: list[float] = []
        self.up: list[float] = []
        self.down: list[float] = []
        self.launch_lat: list[float] = []
        self.term_lat: list[float] = []

    def add(self, up: float, down: float = 0.0) -> None:
        self.cycles.append(up + down)
        self.up.append(up)
        self.down.append(down)

    def result(self) -> dict[str, Any]:
        total = sum(self.cycles)
        out: dict[str, Any] = {
            "kind": self.kind,
            "per_cycle": self.unit,
            "cycles": len(self.cycles),
            "rate": self.unit * len(self.cycles) / total if total else 0.0,
            "up_s": summary(self.up),
        }
        if self.kind == "churn":
            out["down_s"] = summary(self.down)
        if self.launch_lat:
            out["launch_to_running_s"] = summary(self.launch_lat)
            out["terminate_to_reaped_s"] = summary(self.term_lat)
        return out


def _cli(state_dir: str, *args: str) -> dict:
    """One CLI call, its --json reply; raises with its stderr if it failed."""
    done = subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", state_dir, *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"orchestrator {' '.join(args[:2])}: exit {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


class DaemonUnderTest:
    """A detached daemon in a temp state dir; ``close`` stops it by its own pid, always."""

    def __init__(self, root: Path) -> None:
        from orchestrator.client.channel import Client
        from orchestrator.client.control import start_detached
        from orchestrator.paths import Paths

        self.paths = Paths(root / "daemon")
        self.pid: int | None = None
        self.client: Any = None
        self.pid = start_detached(self.paths, ["--grace", "5"])
        self.client = Client(str(self.paths.state_dir))

    @property
    def state_dir(self) -> str:
        return str(self.paths.state_dir)

    def journal_latencies(self, calls: list[tuple[list[str], float, float]]) -> tuple[list[float], list[float]]:
        """Per replica: launch call (wall clock) → RUNNING, terminate call → ended, from the
        journal's transition events."""
        from orchestrator.store import Store

        store = Store(self.paths.db, readonly=True)
        try:
            first = min((t for _, t, _ in calls), default=0.0)
            seen: dict[tuple[str, str], float] = {}
            for ev in store.events(since=first - 1):
                if ev["kind"] == "transition" and ev["replica"]:
                    seen.setdefault((ev["replica"], ev["data"].get("to")), ev["ts"])
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                close()
        up: list[float] = []
        down: list[float] = []
        for ids, t_launch, t_term in calls:
            for rid in ids:
                running = seen.get((rid, "RUNNING"))
                end = seen.get((rid, "TERMINATED")) or seen.get((rid, "INTERRUPTED"))
                if running is not None and end is not None:
                    up.append(running - t_launch)
                    down.append(end - t_term)
        return up, down

    def close(self) -> None:
        from orchestrator.client.control import stop
        from orchestrator.paths import running_pid

        if self.client is not None:
            self.client.close()
            self.client = None
        if self.pid is None:
            return
        try:
            if running_pid(self.paths) == self.pid and stop(self.paths, timeout=60) == 1:
                os.kill(self.pid, 9)  # stop timed out: its watchdog cleans up the replicas
        finally:
            try:
                os.waitpid(self.pid, 0)  # start_detached's child: never left a zombie
            except ChildProcessError:
                pass
            self.pid = None


def _leftover_cgroups(state_dirs: list[Path]) -> list[str]:
    """Cgroup subtrees of these state dirs still there (a clean stop removes its own)."""
    from orchestrator.daemon.containment import subtree_name
    from watchdog import cgroup

    own = cgroup.own_path()
    if own is None:
        return []
    return [p for p in (os.path.join(own, subtree_name(Path(os.path.abspath(d)))) for d in state_dirs)
            if os.path.exists(p)]


def run(quick: bool, progress: Callable[[str], None], *, batches: int | None = None,
        install: bool = True) -> dict[str, Any]:
    """Churn of every variant, interleaved; ``batches``: counted rounds (default 6 quick, 30 full)."""
    import multiprocess

    from benchmarks import bench_churn
    from orchestrator import Orchestrator

    rounds = batches if batches is not None else (6 if quick else 30)
    warmup = 1
    bench_churn.BATCH = BATCH  # its batch functions read the module's batch size
    sleep_exe = shutil.which("sleep")
    if sleep_exe is None:
        raise RuntimeError("sleep not found on PATH")
    ctx = multiprocess.get_context("fork")
    skipped: dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-suite-churn-"))
    closers: list[Callable[[], None]] = []
    variants: dict[str, Variant] = {}
    cli_calls: list[tuple[list[str], float, float]] = []
    chan_calls: list[tuple[list[str], float, float]] = []
    try:
        progress("starting the embedded orchestrator and a daemon")
        orch = Orchestrator(grace=5.0, state_dir=str(tmp / "embedded"))
        orch.start()
        closers.append(orch.close)
        stamps = bench_churn.trace_transitions(orch)
        daemon = DaemonUnderTest(tmp)
        closers.append(daemon.close)

        runs: dict[str, Callable[[Variant], None]] = {}

        def embedded(v: Variant) -> None:
            r = bench_churn.Result(v.name)
            bench_churn.orchestrator_batch(orch, stamps, r, "emb", SLEEP, None)
            v.add(r.up[0], r.down[0])
            v.launch_lat += r.launch_lat
            v.term_lat += r.term_lat

        def channel(v: Variant) -> None:
            t_wall, t0 = time.time(), pc()
            ids = daemon.client.launch("chan", SLEEP, count=BATCH, wait=True, timeout=60)
            t1_wall, t1 = time.time(), pc()
            done = daemon.client.terminate(*ids, wait=True, timeout=60)
            t2 = pc()
            if len(ids) != BATCH or len(done) != BATCH:
                raise RuntimeError(f"channel: {len(ids)} launched, {len(done)} terminated")
            v.add(t1 - t0, t2 - t1)
            chan_calls.append((ids, t_wall, t1_wall))

        def cli(v: Variant) -> None:
            t_wall, t0 = time.time(), pc()
            ids = _cli(daemon.state_dir, "launch", "--pool", "cli", "--count", str(BATCH), "--wait",
                       "--json", "--", *SLEEP)["ids"]
            t1_wall, t1 = time.time(), pc()
            done = _cli(daemon.state_dir, "terminate", "--wait", "--json", *ids)["terminated"]
            t2 = pc()
            if len(ids) != BATCH or len(done) != BATCH:
                raise RuntimeError(f"CLI: {len(ids)} launched, {len(done)} terminated")
            v.add(t1 - t0, t2 - t1)
            cli_calls.append((ids, t_wall, t1_wall))

        def via_result(fn: Callable[[Any], None]) -> Callable[[Variant], None]:
            def go(v: Variant) -> None:
                r = bench_churn.Result(v.name)
                fn(r)
                v.add(r.up[0], r.down[0])
            return go

        for name, fn in ((EMBEDDED, embedded), (CHANNEL, channel), (CLI, cli)):
            variants[name], runs[name] = Variant(name, BATCH, "churn"), fn
        for name, fn in ((MP, lambda r: bench_churn.multiprocess_batch(ctx, r)),
                         (FORK, bench_churn.fork_batch),
                         (FORK_EXEC, lambda r: bench_churn.fork_exec_batch(r, sleep_exe))):
            variants[name], runs[name] = Variant(name, BATCH, "churn"), via_result(fn)

        for name, kind in ((PPE, "ppe"), (LOKY, "loky")):
            try:
                progress(f"setting up {name.split(':')[0]}")
                pool = peers.PoolReplacement(kind, POOL_WORKERS, install=install, say=progress)
            except peers.Unavailable as err:
                skipped[name] = str(err)
                continue
            closers.append(pool.close)
            variants[name] = Variant(name, 1, "replacement")
            runs[name] = lambda v, pool=pool: v.add(pool.once())
        (tmp / "supervisord-home").mkdir()
        try:
            progress("starting supervisord")
            sup = peers.SupervisordBatch(tmp / "supervisord-home", BATCH, install=install, say=progress)
        except peers.Unavailable as err:
            skipped[SUPERVISORD] = str(err)
        else:
            closers.append(sup.close)
            variants[SUPERVISORD] = Variant(SUPERVISORD, BATCH, "churn")
            runs[SUPERVISORD] = lambda v: v.add(*sup.cycle())

        names = list(runs)
        scratch = {n: Variant(n, variants[n].unit, variants[n].kind) for n in names}
        for rnd in range(warmup + rounds):
            counted = rnd >= warmup
            progress(f"round {rnd + 1 - warmup}/{rounds}" if counted else "warm-up round")
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for name in order:
                runs[name]((variants if counted else scratch)[name])
        chan_up, chan_down = daemon.journal_latencies(chan_calls[-rounds:])  # the counted rounds
        cli_up, cli_down = daemon.journal_latencies(cli_calls[-rounds:])
        variants[CHANNEL].launch_lat, variants[CHANNEL].term_lat = chan_up, chan_down
        variants[CLI].launch_lat, variants[CLI].term_lat = cli_up, cli_down
    finally:
        errors = []
        for close in reversed(closers):
            try:
                close()
            except Exception as err:  # noqa: BLE001 - every closer runs; the first error is raised
                errors.append(err)
        leftovers = _leftover_cgroups([tmp / "embedded", tmp / "daemon"])
        shutil.rmtree(tmp, ignore_errors=True)
        if errors and sys.exc_info()[0] is None:
            raise errors[0]
    return {
        "batch": BATCH,
        "rounds": rounds,
        "warmup_rounds": warmup,
        "pool_workers": POOL_WORKERS,
        "variants": {n: v.result() for n, v in variants.items()},
        "skipped": skipped,
        "leftover_cgroups": leftovers,
    }
