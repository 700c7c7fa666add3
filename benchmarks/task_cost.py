"""CPU per tiny task of an embedded Executor, in the host (its loop, the submitter and the
collector) and in its workers: less noisy than a throughput on a shared machine, and what
an A/B of two checkouts compares.

    .venv/bin/python benchmarks/task_cost.py                         # this checkout
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/task_cost.py other
"""

from __future__ import annotations

import os
import sys
import time

import psutil

from orchestrator import Executor

N = 60_000


def _pid(_: object) -> int:
    return os.getpid()


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    with Executor(max_workers=2) as ex:
        workers = [psutil.Process(p) for p in set(ex.map(_pid, range(300)))]
        list(ex.map(abs, range(5000)))  # warm
        me = psutil.Process()

        def cpu(procs: list) -> float:
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        began, host, work = time.perf_counter(), cpu([me]), cpu(workers)
        list(ex.map(abs, range(N)))
        took = time.perf_counter() - began
        print(f"{label}: {N / took:,.0f} tasks/s; host {1e6 * (cpu([me]) - host) / N:.1f} us/task, "
              f"workers {1e6 * (cpu(workers) - work) / N:.1f} us/task")


if __name__ == "__main__":
    main()
