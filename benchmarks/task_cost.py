"""CPU per tiny task of an embedded Executor, in the host (its loop, the submitter and the
collector) and in its workers: less noisy than a throughput on a shared machine, and what
an A/B of two checkouts compares.

    .venv/bin/python benchmarks/task_cost.py                                 # this checkout, 3 rounds
    .venv/bin/python benchmarks/task_cost.py --baseline DIR [--rounds 6]     # and another, alternating
    .venv/bin/python benchmarks/task_cost.py --daemon [--print] [--baseline DIR]   # a daemon's pool

``--baseline DIR``: another checkout of the project (``git worktree add --detach DIR COMMIT``),
run as ``PYTHONPATH=DIR`` with this venv, round by round in turn with this one (the order
swapped every round), so that both see the same load. Each round is a fresh process: a
pool of 2 workers, warmed, then ``map`` of ``abs`` over ``--tasks`` items; the CPU time the
host process and its workers spent meanwhile, divided by the tasks; then a worker alone
against a scripted loop (``worker_alone_us``, the steadiest figure: no host threads, no
batching that moves with the machine's load). Printed: each round, then the median of each
checkout and, with a baseline, this one's over the baseline's. ``--baseline`` may be given
more than once (``--baseline A --baseline B``): all of them run in the same rounds, named
``baseline``, ``baseline2``, ..., each compared with this one.

``--daemon``: the same ``map`` through a daemon's pool (``Client(DIR).executor``, 2 workers;
a daemon started for the round from that checkout, stopped after it): the daemon's CPU
(its loop, with the per-task logs), its workers', and the client's (``host_us``), per task.
``--print``: each task prints its item (``map(print, ...)``): a line of output per task, so
a log file per task.
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

    from orchestrator.executor import Executor

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


def measure_worker(tasks: int) -> float:
    """A worker alone (``taskworker.main`` in a child of this process) against a scripted
    loop that keeps two TASK frames in flight, as the loop does: its CPU per task (µs). No
    host threads, no batching that moves with the load: the steadiest of the figures."""
    import socket

    from orchestrator import taskwire as w

    address = f"@orchestrator-task-cost-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address[1:])
    listener.listen(1)
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.environ[w.SOCKET_ENV] = address
            from orchestrator import taskworker

            taskworker.main()
        finally:
            os._exit(0)
    conn, _ = listener.accept()
    hello, _, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(16))
    if len(hello) > w.HEADER.size and hasattr(w, "CONFIG"):  # a version 2 worker: its CONFIG first
        conn.sendall(w.frame(w.CONFIG, 0, json.dumps({"grace": 5.0}).encode()))
    conn.sendall(w.frame(w.WELCOME, 0, b""))
    frames = w.Frames()
    ready: list[tuple[int, int, bytes]] = []

    figures = getattr(w, "FIGURES", None)  # a worker that sends a task's figures before its answer

    def answer() -> int:
        while True:
            while not ready:
                data = conn.recv(1 << 16)
                if not data:
                    raise SystemExit("the worker closed its socket")
                ready.extend(frames.feed(data))
            kind = ready.pop(0)[0]
            if kind != figures:
                return kind

    assert answer() == w.READY
    payload = w.dumps((abs, (-3,), {}))

    def run(n: int) -> None:
        sent = 0
        for _ in range(min(2, n)):
            conn.sendall(w.frame(w.TASK, sent + 1, payload))
            sent += 1
        for _ in range(n):
            if answer() != w.RESULT:
                raise SystemExit("the worker did not answer a task with its result")
            if sent < n:
                conn.sendall(w.frame(w.TASK, sent + 1, payload))
                sent += 1

    def cpu() -> float:
        # schedstat's time on a CPU (ns) where the kernel has it: /proc/PID/stat's ticks
        # (10 ms) are a tenth of a µs per task over 60,000, as coarse as the effect
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    run(3000)  # warm
    began = cpu()
    run(tasks)
    used = cpu() - began
    conn.close()
    listener.close()
    os.waitpid(pid, 0)
    return 1e6 * used / tasks


def measure_daemon(tasks: int, printing: bool) -> dict[str, float]:
    """One round through a daemon started here (from the checkout on PYTHONPATH): per
    task, the client's CPU (``host_us``), the daemon's and its workers' (µs)."""
    import shutil
    import tempfile

    import psutil

    from orchestrator import Client

    state = Path(tempfile.mkdtemp(prefix="task-cost-"))
    cli = [sys.executable, "-m", "orchestrator", "--state-dir", str(state)]
    try:
        pid = int(subprocess.run([*cli, "start"], check=True, capture_output=True, text=True,
                                 timeout=60).stdout.strip())
        daemon = psutil.Process(pid)
        fn = print if printing else abs
        try:
            with Client(state) as client, client.executor("bench", max_workers=2) as ex:
                workers = [psutil.Process(p) for p in set(ex.map(_pid, range(300)))]
                list(ex.map(fn, range(3000)))  # warm
                me = psutil.Process()

                def cpu(procs: list[psutil.Process]) -> float:
                    return sum(sum(p.cpu_times()[:2]) for p in procs)

                began, host, loop, work = time.perf_counter(), cpu([me]), cpu([daemon]), cpu(workers)
                list(ex.map(fn, range(tasks)))
                took = time.perf_counter() - began
                host_us = 1e6 * (cpu([me]) - host) / tasks
                loop_us = 1e6 * (cpu([daemon]) - loop) / tasks
                work_us = 1e6 * (cpu(workers) - work) / tasks
        finally:
            subprocess.run([*cli, "stop", "--timeout", "30"], capture_output=True, timeout=90)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return {"tasks_per_s": tasks / took, "host_us": host_us, "daemon_us": loop_us, "workers_us": work_us,
            "total_us": host_us + loop_us + work_us}


def _round(checkout: Path, tasks: int, extra: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--one", str(tasks), *extra], env=env, cwd=checkout,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"a round in {checkout} failed:\n{out.stderr}")
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="DIR", action="append", default=[],
                    help="another checkout, run alternating with this one (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=60_000)
    ap.add_argument("--daemon", action="store_true", help="through a daemon's pool (Client(DIR).executor)")
    ap.add_argument("--print", action="store_true", help="--daemon: each task prints a line")
    ap.add_argument("--one", type=int, metavar="TASKS", help=argparse.SUPPRESS)  # a round, in this process
    args = ap.parse_args(argv)
    extra = ["--daemon"] * args.daemon + ["--print"] * args.print
    if args.one and args.daemon:
        print(json.dumps(measure_daemon(args.one, args.print)))
        return 0
    if args.one:
        # The worker alone first, forked before this process ran an executor: a worker is
        # forked from a spawner that never did (what malloc does for a read of 1 MiB, say,
        # depends on what its process freed before).
        alone = measure_worker(args.one)
        print(json.dumps({**measure(args.one), "worker_alone_us": alone}))
        return 0
    checkouts = {"now": ROOT}
    for i, other in enumerate(args.baseline):
        checkouts["baseline" + (str(i + 1) if i else "")] = Path(other).resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    keys = (("tasks_per_s", "host_us", "daemon_us", "workers_us", "total_us") if args.daemon else
            ("tasks_per_s", "host_us", "workers_us", "total_us", "worker_alone_us"))
    print(f"{'':14}" + "".join(f"{k:>16}" for k in keys))
    for r in range(args.rounds):
        order = list(checkouts.items())
        for name, path in order if r % 2 == 0 else reversed(order):
            got = _round(path, args.tasks, extra)
            runs[name].append(got)
            print(f"{r + 1:>3} {name:10}" + "".join(f"{got[k]:16.1f}" for k in keys), flush=True)
    median = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    for name, m in median.items():
        print(f"median {name:7}" + "".join(f"{m[k]:16.1f}" for k in keys))
    for name in median:
        if name != "now":
            print(f"{'now/' + name:14}" + "".join(f"{median['now'][k] / median[name][k]:15.3f}x" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
