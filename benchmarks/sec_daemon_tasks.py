"""Tasks in the daemon: tiny tasks per second through one client and through four, the
queue-to-start latency on an idle daemon, a cancel by id from another process, and the
embedded executor beside them.

A daemon is started in a temporary state dir with an executor pool of 2 workers; the tasks
are a no-op from a module the clients put on their PYTHONPATH (the pool's workers import it
from there). "Through one client": one ``Client(DIR).executor`` submits N tasks, then waits
for all; "through four": four client processes do the same with N/4 each, from one start
signal to the last result. The latency is the daemon's own stamps of each task (queued ->
handed to a worker), for tasks sent one at a time to the idle pool, beside the client's own
submit -> result round trip. The cancel: a task runs (it says so on a FIFO), another
process (one client, started once) cancels it by id, ``Client(DIR).task(ID).cancel()``:
the figure is from just before ``task(ID)`` there to this process's future ended cancelled
(its done-callback; the monotonic clock is the host's), beside the other process's call
alone. The embedded figure is ``Executor(2)`` in this process, the same N.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.report import summary

POOL = "bench"
MODULE = textwrap.dedent("""
    import os, time

    def noop(x=None):
        return x

    def until_cancelled(fifo, n):
        fd = os.open(fifo, os.O_WRONLY)
        try:
            os.write(fd, f"S {n}\\n".encode())
        finally:
            os.close(fd)
        time.sleep(60)
        return n
""")
CANCELLER = textwrap.dedent("""
    import sys, time
    from orchestrator import Client
    with Client(sys.argv[1]) as client:
        for line in sys.stdin:
            t0 = time.monotonic()
            ok = client.task(line.strip()).cancel()
            print(t0, time.monotonic(), int(ok), flush=True)
""")
CLIENT = textwrap.dedent("""
    import sys, time
    from orchestrator import Client
    import benchtasks
    state_dir, n, go = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    with Client(state_dir) as c:
        ex = c.executor("bench", max_workers=2)
        while time.time() < go:
            time.sleep(0.001)
        futs = [ex.submit(benchtasks.noop, i) for i in range(n)]
        assert [f.result(timeout=300) for f in futs] == list(range(n))
        print(time.time(), flush=True)
        ex.shutdown()
""")


def run(quick: bool, progress: Callable[[str], None]) -> dict[str, Any]:
    n = 2000 if quick else 10000
    latency_rounds = 100 if quick else 500
    cancel_rounds = 50 if quick else 300
    tmp = Path(tempfile.mkdtemp(prefix="bench-daemon-tasks-"))
    code = tmp / "code"
    code.mkdir()
    (code / "benchtasks.py").write_text(MODULE)
    state = tmp / "state"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    sys.path.insert(0, str(code))
    cli = [sys.executable, "-m", "orchestrator", "--state-dir", str(state)]
    rates: dict[str, float] = {}
    try:
        import benchtasks  # type: ignore[import-not-found]  # written just above

        from orchestrator import Client, Executor

        progress("starting a daemon")
        subprocess.run([*cli, "start"], check=True, capture_output=True, env=env, timeout=60)
        try:
            with Client(state) as client:
                with client.executor(POOL, max_workers=2) as ex:
                    list(ex.map(benchtasks.noop, range(200)))  # warm
                    progress(f"daemon, one client: {n} tiny tasks")
                    t0 = time.perf_counter()
                    futs = [ex.submit(benchtasks.noop, i) for i in range(n)]
                    assert [f.result(timeout=300) for f in futs] == list(range(n))
                    rates["daemon, 1 client"] = n / (time.perf_counter() - t0)
                    progress("daemon: queue-to-start latency, idle")
                    ids, round_trips = [], []
                    for i in range(latency_rounds):
                        t1 = time.perf_counter()
                        fut = ex.submit(benchtasks.noop, i)
                        fut.result(timeout=60)
                        round_trips.append(time.perf_counter() - t1)
                        ids.append(fut.task_id)  # type: ignore[attr-defined]
                    progress(f"daemon: {cancel_rounds} cancels by id from another process")
                    cancels, calls = _cancels(ex, benchtasks, state, tmp, env, cancel_rounds)
                rows = {r["id"]: r for r in client.call("tasks", {"pool": POOL, "all": True})}
                waits = [rows[i]["started_at"] - rows[i]["queued_at"] for i in ids if i in rows]
            progress(f"daemon, four clients: {n} tiny tasks")
            go = time.time() + 2.0
            procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(state), str(n // 4), str(go)],
                                      stdout=subprocess.PIPE, text=True, env=env) for _ in range(4)]
            ends = []
            for proc in procs:
                out, _ = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"a client failed ({proc.returncode})")
                ends.append(float(out.strip().splitlines()[-1]))
            rates["daemon, 4 clients"] = (n // 4 * 4) / (max(ends) - go)
        finally:
            subprocess.run([*cli, "stop"], capture_output=True, env=env, timeout=120)
        progress(f"embedded Executor: {n} tiny tasks")
        with Executor(max_workers=2) as emb:
            list(emb.map(benchtasks.noop, range(200)))
            t0 = time.perf_counter()
            futs = [emb.submit(benchtasks.noop, i) for i in range(n)]
            assert [f.result(timeout=300) for f in futs] == list(range(n))
            rates["embedded Executor"] = n / (time.perf_counter() - t0)
    finally:
        sys.path.remove(str(code))
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
        shutil.rmtree(tmp, ignore_errors=True)
    lat = summary(waits)
    one = rates["daemon, 1 client"]
    cancel = summary(cancels)
    return {
        "tasks": n,
        "rates_per_s": {k: round(v, 1) for k, v in rates.items()},
        "queue_to_start_ms": {k: round(v * 1000, 2) for k, v in lat.items() if k in ("p50", "p99", "max")},
        "submit_to_result_ms": {k: round(v * 1000, 2) for k, v in summary(round_trips).items()
                                if k in ("p50", "p99", "max")},
        "cancel_from_another_process_ms": {k: round(v * 1000, 2) for k, v in cancel.items()
                                           if k in ("p50", "p99", "max")},
        "cancel_call_there_ms": {k: round(v * 1000, 2) for k, v in summary(calls).items()
                                 if k in ("p50", "p99", "max")},
        "targets": [{"target": "tiny tasks per second through one client", "goal": ">= 1000/s",
                     "measured": round(one, 1), "unit": "/s", "ok": one >= 1000},
                    {"target": "a cancel by id from another process, p99 (its call -> the submitter's future "
                               "cancelled)", "goal": "<= 10 ms", "measured": round(cancel["p99"] * 1000, 2),
                     "unit": "ms", "ok": cancel["p99"] <= 0.010}],
    }


def _cancels(ex: Any, tasks: Any, state: Path, tmp: Path, env: dict[str, str],
             rounds: int) -> tuple[list[float], list[float]]:
    """``rounds`` running tasks, each cancelled by id from one other client process: (its
    call -> the future here ended, its call alone), seconds."""
    import threading

    fifo = tmp / "started"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDWR)  # never EOF between two tasks' writes
    other = subprocess.Popen([sys.executable, "-c", CANCELLER, str(state)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    ends, calls = [], []
    try:
        assert other.stdin is not None and other.stdout is not None
        for n in range(-1, rounds):  # the first warms the other client up (its connection, its imports)
            fut = ex.submit(tasks.until_cancelled, str(fifo), n)
            ended = threading.Event()
            when: list[float] = []
            fut.add_done_callback(lambda f, when=when, ended=ended: (when.append(time.monotonic()), ended.set()))
            line = os.read(reader, 64).decode()
            if line != f"S {n}\n":
                raise RuntimeError(f"the task said {line!r}")
            other.stdin.write(fut.task_id + "\n")
            other.stdin.flush()
            t0, t1, ok = other.stdout.readline().split()
            if ok != "1" or not ended.wait(30) or not fut.cancelled():
                raise RuntimeError(f"task {fut.task_id} was not cancelled")
            if n >= 0:
                ends.append(when[0] - float(t0))
                calls.append(float(t1) - float(t0))
    finally:
        if other.stdin is not None:
            other.stdin.close()
        other.wait(timeout=30)
        os.close(reader)
    return ends, calls


if __name__ == "__main__":
    import json

    print(json.dumps(run("--quick" in sys.argv, lambda m: print(m, file=sys.stderr)), indent=2))
