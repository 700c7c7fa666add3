"""An elastic pool's new worker: how long a task that finds no idle worker waits for the
worker started for it (daemon/elastic.py), embedded.

An ``Executor(max_workers=2, min_workers=1, idle_timeout=IDLE)`` whose one worker is busy
with a task that holds it; then, SAMPLES times: a tiny task is submitted (no idle worker:
the pool grows, a worker is forked warm from the pool's spawner), and the time from its
``submit`` to its start in the new worker (the monotonic clock is one for the whole host)
and to its result are recorded; the new worker then retires after ``idle_timeout`` and
the next sample waits until its process is gone, so each sample starts a worker anew.
The target is a start within 20 ms (p50 and p99 printed).

Run: .venv/bin/python -m benchmarks.bench_elastic [--samples N] [--no-cgroup]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

IDLE = 0.05  # seconds: the new worker retires soon after each sample


def started_at() -> tuple[float, int]:
    """When it began, on the host's monotonic clock, and in which process."""
    return time.monotonic(), os.getpid()


def hold(release: str, limit: float = 300.0) -> None:
    """Keeps the pool's first worker busy until ``release`` exists (at most ``limit`` s)."""
    end = time.monotonic() + limit
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.01)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--no-cgroup", action="store_true",
                        help="workers in process groups, not a cgroup each (what a cgroup move costs)")
    args = parser.parse_args()
    from orchestrator import Executor
    from orchestrator.daemon import embedded

    if args.no_cgroup:  # the embedded loop the Executor makes, with cgroup="off"
        made = embedded.Orchestrator
        embedded.Orchestrator = lambda **kw: made(**{**kw, "cgroup": "off"})  # type: ignore[misc]

    from benchmarks import bench_elastic as me  # by name: the workers import it from this directory

    starts: list[float] = []
    results: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        release = str(Path(tmp) / "release")
        with Executor(max_workers=2, min_workers=1, idle_timeout=IDLE, preload=["benchmarks.bench_elastic"]) as ex:
            first = ex.submit(me.started_at).result(timeout=60)[1]  # the pool's one worker, warm
            busy = ex.submit(me.hold, release)
            for _ in range(args.samples):
                t0 = time.monotonic()
                fut = ex.submit(me.started_at)
                began, pid = fut.result(timeout=60)
                results.append(time.monotonic() - t0)
                starts.append(began - t0)
                assert pid != first, "the task ran on the busy worker: no new one was started"
                deadline = time.monotonic() + 30
                while not _gone(pid):  # retired after IDLE: the next sample starts a worker anew
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the new worker {pid} did not retire")
                    time.sleep(0.01)
            Path(release).write_text("")
            busy.result(timeout=60)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000

    where = "process groups" if args.no_cgroup else "a cgroup each where it can"
    print(f"elastic pool, a task that finds no idle worker ({len(starts)} samples, a worker forked warm each, "
          f"{where}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    print(f"  submit -> start on the new worker: p50 {statistics.median(starts) * 1000:.1f} ms, "
          f"p99 {pct(starts, 0.99):.1f} ms (target <= 20 ms)")
    print(f"  submit -> result:                  p50 {statistics.median(results) * 1000:.1f} ms, "
          f"p99 {pct(results, 0.99):.1f} ms")


if __name__ == "__main__":
    main()
