"""The executor inside Dask and joblib (orchestrator.integrations), side by side with what
each engine does without it, in one run on this host.

Dask, on a ``distributed.LocalCluster`` (one worker process of one thread, loopback), the
plugin registered: SAMPLES tasks that sleep, each cancelled once it runs, twice: in the
orchestrator executor (``dask.annotate(executor="orchestrator")``), from ``Future.cancel()``
to the ``Cancelled`` the task catches (it sends ``time.monotonic()`` over a unix socket: one
clock for the host's processes); and in Dask's default thread pool, from the cancel to the
task's end (Dask lets it run: the figure is the task's length, ``--dask-sleep``). Then the
cost of the hop: TASKS tiny tasks through ``client.map`` into each, tasks/s.

joblib, the backend "orchestrator" against loky (joblib's default), ``n_jobs=2``: one call
of 10 tiny calls, which for ours includes its pool's start (a pool per ``Parallel`` call;
loky's reusable executor is warmed first, as a program's second call finds it); then, in one
``with Parallel() as parallel:`` block (one pool for its calls), TINY calls of ``abs``
(auto-batched), 100 calls sleeping 10 ms, and an error's abort (one call raises after 0.2 s
while the others sleep 30 s: how long the call takes to raise).

Run: .venv/bin/python -m benchmarks.bench_integrations [--samples N] [--tasks N] [--tiny N]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def announce_then_sleep(path: str, seconds: float, token: int) -> int:
    """Says it started on the socket at ``path``, sleeps; a Cancelled that reaches it is
    said there with the host's monotonic time."""
    from orchestrator import Cancelled

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(b"started\n")
        try:
            time.sleep(seconds)
        except Cancelled:
            sock.sendall(f"cancelled {time.monotonic()}\n".encode())
            raise
        sock.sendall(f"ended {time.monotonic()}\n".encode())
    return token


def fail_soon_or_sleep(i: int) -> int:
    time.sleep(0.2 if i == 0 else 30)
    if i == 0:
        raise ValueError("boom")
    return i


def sleep_10ms(i: int) -> int:
    time.sleep(0.01)
    return i


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (f"p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
            f"max {ordered[-1] * 1000:.1f} ms (n={len(ordered)})")


def dask_figures(samples: int, tasks: int, dask_sleep: float) -> None:
    import dask
    from distributed import Client, LocalCluster

    from orchestrator.integrations.dask import DEFAULT_NAME, ExecutorPlugin

    with tempfile.TemporaryDirectory(prefix="bench-integrations-") as tmp, \
            dask.config.set({"temporary-directory": tmp}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        started = time.monotonic()
        client.register_plugin(ExecutorPlugin())
        print(f"dask: the plugin's setup (an executor of 1 worker in the Dask worker): "
              f"{(time.monotonic() - started) * 1000:.0f} ms")
        path = os.path.join(tmp, "tasks.sock")
        with socket.socket(socket.AF_UNIX) as srv:
            srv.bind(path)
            srv.listen()
            srv.settimeout(60)
            for executor, sleep, word in ((DEFAULT_NAME, 60.0, "cancelled"), ("default", dask_sleep, "ended")):
                took = []
                for i in range(samples):
                    with dask.annotate(executor=executor):
                        fut = client.submit(announce_then_sleep, path, sleep, i, pure=False)
                    conn, _ = srv.accept()
                    conn.settimeout(60)
                    with conn, conn.makefile("r") as lines:
                        assert lines.readline().strip() == "started"
                        asked = time.monotonic()
                        fut.cancel()
                        got, at = lines.readline().split()
                    assert got == word, got
                    took.append(float(at) - asked)
                what = ("Cancelled raised in the task" if executor == DEFAULT_NAME
                        else f"the task's own end (Dask lets a {dask_sleep:g} s task run)")
                print(f"dask, executor {executor!r}: Future.cancel() -> {what}: {_ms(took)}")
        for executor in ("default", DEFAULT_NAME):
            with dask.annotate(executor=executor):
                client.gather(client.map(abs, range(-20, 0), pure=False))  # warm
                started = time.monotonic()
                client.gather(client.map(abs, range(-tasks, 0), pure=False))
            print(f"dask, executor {executor!r}: {tasks} tiny tasks through client.map: "
                  f"{tasks / (time.monotonic() - started):,.0f} tasks/s")


def _timed(run: Callable[[], Any]) -> float:
    started = time.monotonic()
    run()
    return time.monotonic() - started


def joblib_figures(tiny: int) -> None:
    from joblib import Parallel, delayed, parallel_backend

    import orchestrator.integrations.joblib  # noqa: F401  (registers "orchestrator")

    def abort(parallel: Any) -> None:
        try:
            parallel(delayed(fail_soon_or_sleep)(i) for i in range(4))
        except ValueError:
            return
        raise AssertionError("the call did not raise")

    Parallel(n_jobs=2, backend="loky")(delayed(abs)(i) for i in range(10))  # loky's executor, warm
    for backend in ("loky", "orchestrator"):
        with parallel_backend(backend, n_jobs=2):
            cold = _timed(lambda: Parallel()(delayed(abs)(-i) for i in range(10)))
            with Parallel() as parallel:  # one pool for the block's calls (loky's is reused anyway)
                parallel(delayed(abs)(-i) for i in range(10))
                small = _timed(lambda: parallel(delayed(abs)(-i) for i in range(tiny)))
                sleeps = _timed(lambda: parallel(delayed(sleep_10ms)(i) for i in range(100)))
                aborted = _timed(lambda: abort(parallel))
        print(f"joblib {backend:>12}: a call of 10 tiny calls {cold:.2f} s (ours: with its pool's start); "
              f"in one 'with Parallel()': {tiny:,} tiny calls {small:.2f} s ({tiny / small:,.0f}/s), "
              f"100 x 10 ms {sleeps:.2f} s, an error after 0.2 s while 3 calls sleep 30 s raised after "
              f"{aborted:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_integrations", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20, help="cancels measured in each executor (20)")
    parser.add_argument("--tasks", type=int, default=500, help="tiny Dask tasks per executor (500)")
    parser.add_argument("--tiny", type=int, default=20000, help="tiny joblib calls per backend (20,000)")
    parser.add_argument("--dask-sleep", type=float, default=1.0, help="the default executor's task, s (1)")
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    with open("/proc/loadavg") as f:
        print(f"load: {f.read().split()[:3]}; {os.cpu_count()} CPUs; Python {sys.version.split()[0]}")
    dask_figures(args.samples, args.tasks, args.dask_sleep)
    joblib_figures(args.tiny)
    return 0


if __name__ == "__main__":
    sys.exit(main())
