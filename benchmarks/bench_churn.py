"""Churn benchmark: the embedded Orchestrator against a bare multiprocess loop and the raw
fork floor, side by side in one process run (compare ratios, not figures: these machines drift).

One batch cycle = start 20 workers, wait until all 20 run, stop all 20, wait until all are
reaped. Variants:

  (a) orchestrator, command  launch(count=20, ["sleep", "1000"], wait=True), terminate(wait=True)
  (a) orchestrator, python   the same with a Python callable that sleeps
  (b) multiprocess.Process   fork context; the target writes a ready byte to a pipe, sleeps;
                             wait for 20 bytes, terminate() all, join() all
  (c) raw os.fork            the floor: 20 children write a ready byte and sleep; read 20
                             bytes, SIGTERM all, waitpid all
  (c') raw os.fork + exec    the floor for commands (information only, no target): each
                             child execs `sleep 1000`; its close-on-exec ready pipe reaching
                             EOF means the exec succeeded, as in the orchestrator

Variants run interleaved, one batch each per round in a rotating order, so machine drift
hits them equally; a few warm-up rounds are not counted. For the orchestrator, per-replica
latencies come from the loop's own transitions (a thin wrapper on Engine.transition
stamps each with perf_counter): launch call -> RUNNING, and terminate call -> TERMINATED or
INTERRUPTED (recorded right after the reap).

Run: .venv/bin/python benchmarks/bench_churn.py [--batches N] [--profile] [--no-watchdog]
(from the repo root; the default run takes well under a minute).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import multiprocess  # noqa: E402

from orchestrator import Orchestrator  # noqa: E402

BATCH = 20
TARGET_FLOOR = 0.6
TARGET_MP = 1.0


def _py_sleeper() -> None:
    time.sleep(1000)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Result:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cycles: list[float] = []  # seconds per batch cycle
        self.up: list[float] = []  # seconds: start -> all running, per batch
        self.down: list[float] = []  # seconds: stop -> all reaped, per batch
        self.launch_lat: list[float] = []  # per replica (orchestrator only)
        self.term_lat: list[float] = []

    @property
    def rate(self) -> float:
        return BATCH * len(self.cycles) / sum(self.cycles)


# -- (a) the orchestrator -------------------------------------------------------------------


def trace_transitions(orch: Orchestrator) -> dict[tuple[str, str], float]:
    """Stamp every transition the loop makes with perf_counter (loop thread only writes)."""
    engine = orch._engine
    stamps: dict[tuple[str, str], float] = {}
    original = engine.transition

    def traced(rep, new, reason=None, *, exit_code=None):
        original(rep, new, reason, exit_code=exit_code)
        stamps[(rep.id, new.value)] = time.perf_counter()

    engine.transition = traced
    return stamps


def orchestrator_batch(orch: Orchestrator, stamps: dict, res: Result, pool: str, command, target) -> None:
    t0 = time.perf_counter()
    ids = orch.launch(pool, command, target=target, count=BATCH, wait=True, timeout=60)
    t1 = time.perf_counter()
    ended = orch.terminate(*ids, wait=True, timeout=60)
    t2 = time.perf_counter()
    assert len(ended) == BATCH, ended
    res.cycles.append(t2 - t0)
    res.up.append(t1 - t0)
    res.down.append(t2 - t1)
    for rid in ids:
        running = stamps.pop((rid, "RUNNING"), None)
        end = stamps.pop((rid, "TERMINATED"), None) or stamps.pop((rid, "INTERRUPTED"), None)
        if running is None or end is None:
            raise AssertionError(f"{rid}: not RUNNING then ended ({running}, {end})")
        res.launch_lat.append(running - t0)
        res.term_lat.append(end - t1)
    for key in [k for k in stamps if k[0] in ids]:
        del stamps[key]


# -- (b) bare multiprocess ------------------------------------------------------------------


def _mp_target(ready_w: int) -> None:
    os.write(ready_w, b"r")
    time.sleep(1000)


def _read_exactly(fd: int, n: int) -> None:
    got = 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise RuntimeError("ready pipe closed early")
        got += len(chunk)


def _mp_conn_target(conn) -> None:
    conn.send_bytes(b"r")
    time.sleep(1000)


def multiprocess_batch(ctx, res: Result, *, fd_passing: bool = False) -> None:
    """A batch of bare multiprocess.Process workers. ``fd_passing``: for a start method
    whose children inherit no fds (forkserver), the ready signal travels over a
    multiprocess Pipe that the context hands to each child."""
    if fd_passing:
        r, w = ctx.Pipe(duplex=False)
        target, wait_ready = _mp_conn_target, lambda: [r.recv_bytes() for _ in range(BATCH)]
        close = lambda: (r.close(), w.close())  # noqa: E731
    else:
        rfd, wfd = os.pipe()
        w, target, wait_ready = wfd, _mp_target, lambda: _read_exactly(rfd, BATCH)
        close = lambda: (os.close(rfd), os.close(wfd))  # noqa: E731
    procs = []
    try:
        t0 = time.perf_counter()
        for _ in range(BATCH):
            p = ctx.Process(target=target, args=(w,), daemon=True)
            p.start()
            procs.append(p)
        wait_ready()
        t1 = time.perf_counter()
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        t2 = time.perf_counter()
    finally:
        close()
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    res.cycles.append(t2 - t0)
    res.up.append(t1 - t0)
    res.down.append(t2 - t1)


# -- (c) raw fork: the floor ------------------------------------------------------------------


def _terminate_and_reap(pids: list[int]) -> None:
    """SIGTERM our children, then reap each; ``pids`` keeps only those not reaped yet."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    while pids:
        os.waitpid(pids[0], 0)
        pids.pop(0)


def _kill_and_reap(pids: list[int]) -> None:
    """After an error only: our unreaped children, so their pids are pinned."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    pids.clear()


def fork_batch(res: Result) -> None:
    r, w = os.pipe()
    pids: list[int] = []
    try:
        t0 = time.perf_counter()
        for _ in range(BATCH):
            pid = os.fork()
            if pid == 0:  # the child: report, then sleep until killed
                try:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.write(w, b"r")
                    time.sleep(1000)
                finally:
                    os._exit(0)
            pids.append(pid)
        _read_exactly(r, BATCH)
        t1 = time.perf_counter()
        _terminate_and_reap(pids)
        t2 = time.perf_counter()
    finally:
        os.close(r)
        os.close(w)
        _kill_and_reap(pids)
    res.cycles.append(t2 - t0)
    res.up.append(t1 - t0)
    res.down.append(t2 - t1)


def fork_exec_batch(res: Result, exe: str) -> None:
    pids: list[int] = []
    readers: list[int] = []
    try:
        t0 = time.perf_counter()
        for _ in range(BATCH):
            r, w = os.pipe()  # close-on-exec: EOF once the child has exec'd
            pid = os.fork()
            if pid == 0:
                try:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.execv(exe, [exe, "1000"])
                finally:
                    os._exit(127)
            pids.append(pid)
            readers.append(r)
            os.close(w)
        for r in readers:
            if os.read(r, 1):
                raise RuntimeError("exec failed")
        t1 = time.perf_counter()
        _terminate_and_reap(pids)
        t2 = time.perf_counter()
    finally:
        for r in readers:
            os.close(r)
        _kill_and_reap(pids)
    res.cycles.append(t2 - t0)
    res.up.append(t1 - t0)
    res.down.append(t2 - t1)


# -- the run --------------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=80, help="counted rounds (one batch of each variant per round)")
    ap.add_argument("--warmup", type=int, default=3, help="rounds run first and not counted")
    ap.add_argument("--no-watchdog", action="store_true", help="run the Orchestrator without its watchdog")
    ap.add_argument("--profile", action="store_true", help="cProfile the control loop thread; print the top entries")
    ap.add_argument("--forkserver", action="store_true",
                    help="add multiprocess.Process under forkserver (the start method not chosen; slow)")
    args = ap.parse_args(argv)

    ctx = multiprocess.get_context("fork")
    names = ["orchestrator, command", "orchestrator, python", "multiprocess.Process (fork)", "raw os.fork (floor)",
             "raw os.fork + exec sleep"]
    sleep_exe = shutil.which("sleep")
    assert sleep_exe, "sleep not found on PATH"
    results = {n: Result(n) for n in names}
    scratch = {n: Result(n) for n in names}  # warm-up rounds land here
    profiler = cProfile.Profile() if args.profile else None

    with tempfile.TemporaryDirectory(prefix="bench-churn-") as state_dir, Orchestrator(
        grace=5.0, watchdog=not args.no_watchdog, state_dir=state_dir
    ) as orch:
        stamps = trace_transitions(orch)
        if profiler is not None:
            engine = orch._engine
            run_once = engine.run_once

            def profiled(timeout=None):
                profiler.enable()
                try:
                    return run_once(timeout)
                finally:
                    profiler.disable()

            engine.run_once = profiled

        runs: dict[str, Callable[[Result], None]] = {
            names[0]: lambda res: orchestrator_batch(orch, stamps, res, "cmd", ["sleep", "1000"], None),
            names[1]: lambda res: orchestrator_batch(orch, stamps, res, "py", None, _py_sleeper),
            names[2]: lambda res: multiprocess_batch(ctx, res),
            names[3]: lambda res: fork_batch(res),
            names[4]: lambda res: fork_exec_batch(res, sleep_exe),
        }
        if args.forkserver:
            fs_ctx = multiprocess.get_context("forkserver")
            fs_ctx.set_forkserver_preload(["time"])
            name = "multiprocess.Process (forkserver)"
            names.append(name)
            results[name], scratch[name] = Result(name), Result(name)
            runs[name] = lambda res: multiprocess_batch(fs_ctx, res, fd_passing=True)
        started = time.monotonic()
        total = args.warmup + args.batches
        for rnd in range(total):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for name in order:
                runs[name]((scratch if rnd < args.warmup else results)[name])
        elapsed = time.monotonic() - started

    floor = results[names[3]].rate
    mp_rate = results[names[2]].rate
    print(f"# Churn: batches of {BATCH}, {args.batches} counted rounds (+{args.warmup} warm-up), "
          f"interleaved; {elapsed:.1f} s; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"watchdog {'off' if args.no_watchdog else 'on'}")
    print()
    print("| variant | replicas/s | vs floor | vs multiprocess | start→all running p50 (ms) | stop→all reaped p50 (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        r = results[name]
        print(f"| {name} | {r.rate:.0f} | {r.rate / floor:.2f}x | {r.rate / mp_rate:.2f}x | "
              f"{ms(statistics.median(r.up))} | {ms(statistics.median(r.down))} |")
    print()
    print("Orchestrator, per replica (from the loop's transitions; a batch of 20 is launched, then terminated, at once):")
    print()
    print("| variant | launch→RUNNING p50 | p99 | terminate→reaped p50 | p99 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in names[:2]:
        r = results[name]
        print(f"| {name} | {ms(_pct(r.launch_lat, 0.5))} ms | {ms(_pct(r.launch_lat, 0.99))} ms | "
              f"{ms(_pct(r.term_lat, 0.5))} ms | {ms(_pct(r.term_lat, 0.99))} ms |")
    print()
    print("Targets: orchestrator ≥ 0.6x the raw fork floor and ≥ 1.0x bare multiprocess.")
    exec_floor = results[names[4]].rate
    print()
    print("| variant | vs floor | target 0.6x | vs multiprocess | target 1.0x | vs fork+exec (info) |")
    print("| --- | ---: | --- | ---: | --- | ---: |")
    for name in names[:2]:
        r = results[name]
        f, m = r.rate / floor, r.rate / mp_rate
        print(f"| {name} | {f:.2f}x | {'met' if f >= TARGET_FLOOR else 'MISSED'} | "
              f"{m:.2f}x | {'met' if m >= TARGET_MP else 'MISSED'} | {r.rate / exec_floor:.2f}x |")

    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(25)
        print()
        print("Control loop profile (cProfile, loop thread, sorted by own time):")
        print("```")
        print(out.getvalue().strip())
        print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
