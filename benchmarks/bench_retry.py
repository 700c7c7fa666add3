"""A parked task's resume: how late after its time a task that raised ``Retry(after=)``
starts again (daemon/taskwait.py: a reactor timer, no polling), embedded or (``--daemon``) in a daemon
started for the run in a temporary state dir (its loop alone in its process: no GIL shared
with the client's threads).

An ``Executor(max_workers=2)``; SAMPLES times, two tasks at once (one per worker): each
task's first attempt writes the host's monotonic time to a file of its own and raises
``Retry(after=AFTER)``; its second attempt returns how long after that time plus AFTER it
began. That is the lateness of the resume, measured from the raise (an upper bound: the
loop sets the task's time when the RETRY frame reaches it, a little after the raise), so
it holds the RETRY frame to the loop, the timer, the dispatch, the TASK frame to the worker
and its unpickling. With ``--daemon`` also from the task's own time, the ``wait_until`` the
loop journaled for it (the ``task`` event to WAITING, its ``until``: wall clock), to the
wall clock of its second start: the timer, the dispatch and the TASK frame alone. The target is <= 10 ms (p50 and p99 printed). For scale, in the same
run: a plain task's ``submit`` -> its start in an idle worker, the same path through the
loop to a worker without a wait.

Run: .venv/bin/python -m benchmarks.bench_retry [--samples N] [--after S] [--daemon]
(the suite's ``--only tasks`` measures the first figure too, embedded: sec_tasks, part 7)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks.report import summary
from benchmarks.taskfns import park_once

ROOT = Path(__file__).resolve().parent.parent  # the workers import this module from here


def began() -> float:
    return time.monotonic()


def journaled_times(state: Path) -> dict[str, float]:
    """Each task's ``until`` as the daemon journaled it when the task went WAITING."""
    from orchestrator.store import Store

    with Store(str(state / "state.db"), readonly=True) as store:
        return {e["data"]["task"]: e["data"]["until"] for e in store.events()
                if e["kind"] == "task" and e["data"].get("to") == "WAITING"}


@contextlib.contextmanager
def executor(tmp: str, daemon: bool) -> Iterator[Any]:
    """A 2-worker executor, embedded or in a daemon of its own (stopped at the end)."""
    from orchestrator import Client, Executor

    if not daemon:
        with Executor(max_workers=2, preload=["benchmarks.bench_retry", "benchmarks.taskfns"]) as ex:
            yield ex
        return
    cli = [sys.executable, "-m", "orchestrator", "--state-dir", str(Path(tmp) / "state")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([*cli, "start"], check=True, capture_output=True, env=env, timeout=60)
    try:
        with Client(Path(tmp) / "state") as client, \
                client.executor("retry-bench", max_workers=2, cwd=str(ROOT),
                                preload=["benchmarks.bench_retry", "benchmarks.taskfns"]) as ex:
            yield ex
    finally:
        subprocess.run([*cli, "stop"], capture_output=True, env=env, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--after", type=float, default=0.1)
    parser.add_argument("--daemon", action="store_true", help="in a daemon started for the run, not embedded")
    args = parser.parse_args()
    from benchmarks import bench_retry as me  # by name: the workers import it from this directory

    late: list[float] = []
    plain: list[float] = []
    exact: list[float] = []
    started: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, executor(tmp, args.daemon) as ex:
        ex.submit(park_once, str(Path(tmp) / "warm"), 0.0).result(timeout=60)  # both paths warm
        for i in range(0, args.samples, 2):
            futs = [ex.submit(park_once, str(Path(tmp) / f"{i + j}"), args.after) for j in range(2)]
            for fut in futs:
                lateness, wall = fut.result(timeout=60)
                late.append(lateness)
                started[fut.task_id] = wall
            t0 = time.monotonic()
            plain.append(ex.submit(me.began).result(timeout=60) - t0)
        if args.daemon:
            until = me.journaled_times(Path(tmp) / "state")
            exact = [started[task_id] - until[task_id] for task_id in started if task_id in until]

    def ms(xs: list[float]) -> str:
        got = summary(xs)
        return f"p50 {got['p50'] * 1000:.1f} ms, p99 {got['p99'] * 1000:.1f} ms, max {got['max'] * 1000:.1f} ms"

    where = "a daemon" if args.daemon else "embedded"
    print(f"a parked task's resume after Retry(after={args.after:g}), {where} ({len(late)} samples, 2 workers, two "
          f"parked at a time; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    print(f"  from the raise + after -> its start again: {ms(late)} (target <= 10 ms)")
    if exact:
        print(f"  from the loop's wait_until (journaled, wall clock) -> its start again: {ms(exact)}")
    print(f"  for scale, a plain submit -> its start: {ms(plain)} ({len(plain)} samples)")
    if min(late) < 0:
        raise SystemExit(f"a task started {-min(late) * 1000:.1f} ms before its time")


if __name__ == "__main__":
    main()
