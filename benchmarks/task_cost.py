"""CPU per tiny task of an embedded Executor, in the host (its loop, the submitter and the
collector) and in its workers: less noisy than a throughput on a shared machine, and what
an A/B of two checkouts compares.

    .venv/bin/python benchmarks/task_cost.py                                 # this checkout, 3 rounds
    .venv/bin/python benchmarks/task_cost.py --baseline DIR [--rounds 6]     # and another, alternating

``--baseline DIR``: another checkout of the project (``git worktree add --detach DIR COMMIT``),
run as ``PYTHONPATH=DIR`` with this venv, round by round in turn with this one (the order
swapped every round), so that both see the same load. Each round is a fresh process: a
pool of 2 workers, warmed, then ``map`` of ``abs`` over ``--tasks`` items; the CPU time the
host process and its workers spent meanwhile, divided by the tasks. Printed: each round,
then the median of each checkout and, with a baseline, this one's over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pid(_: object) -> int:
    return os.getpid()


def measure(tasks: int) -> dict[str, float]:
    """One round in this process: per task, the host's and the workers' CPU (µs)."""
    import psutil

    from orchestrator import Executor

    with Executor(max_workers=2) as ex:
        workers = [psutil.Process(p) for p in set(ex.map(_pid, range(300)))]
        list(ex.map(abs, range(5000)))  # warm
        me = psutil.Process()

        def cpu(procs: list[psutil.Process]) -> float:
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        began, host, work = time.perf_counter(), cpu([me]), cpu(workers)
        list(ex.map(abs, range(tasks)))
        took = time.perf_counter() - began
        host_us, work_us = 1e6 * (cpu([me]) - host) / tasks, 1e6 * (cpu(workers) - work) / tasks
    return {"tasks_per_s": tasks / took, "host_us": host_us, "workers_us": work_us, "total_us": host_us + work_us}


def _round(checkout: Path, tasks: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--one", str(tasks)], env=env, cwd=checkout,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"a round in {checkout} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="DIR", help="another checkout, run alternating with this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=60_000)
    ap.add_argument("--one", type=int, metavar="TASKS", help=argparse.SUPPRESS)  # a round, in this process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    checkouts = {"now": ROOT}
    if args.baseline:
        checkouts["baseline"] = Path(args.baseline).resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    keys = ("tasks_per_s", "host_us", "workers_us", "total_us")
    print(f"{'':14}" + "".join(f"{k:>13}" for k in keys))
    for r in range(args.rounds):
        order = list(checkouts.items())
        for name, path in order if r % 2 == 0 else reversed(order):
            got = _round(path, args.tasks)
            runs[name].append(got)
            print(f"{r + 1:>3} {name:10}" + "".join(f"{got[k]:13.1f}" for k in keys), flush=True)
    median = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    for name, m in median.items():
        print(f"median {name:7}" + "".join(f"{m[k]:13.1f}" for k in keys))
    if "baseline" in median:
        print(f"{'now/baseline':14}" + "".join(f"{median['now'][k] / median['baseline'][k]:12.3f}x" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
