"""``Executor(memory_max=...)`` where no cgroup memory controller enforces it: the poll of a
worker's tree (orchestrator/daemon/taskmemory.py). Two figures:

(1) Overshoot: an embedded Executor with ``memory_max`` 200 MiB and 3 workers; each runs a
    task that makes 1.5 GiB resident as fast as a Python loop touches pages (~2 GiB/s), the
    three a third of a second apart, so the checks fall at different points of each. Each
    task writes how far it got into shared memory after every MiB (the word outlives the
    SIGKILL); reported: the peak each reached before its tree was killed, in MiB, against
    the limit. Skipped where the memory controller is enabled for the workers' cgroups
    (then ``memory.max`` holds exactly, and there is no poll to measure).
(2) Cost of one check (``TreeMemory.measure``) in the loop's thread, for a worker with one
    child in its process group: with the kernel's child lists; without them, between two
    scans of /proc (the loop paces the scan by its own cost) and with a scan; the scan's
    cost per process on this host.

Run: .venv/bin/python benchmarks/bench_memory.py [--rounds N] (from the repo root; about
half a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orchestrator import Executor, WorkerLost  # noqa: E402
from orchestrator.daemon.taskmemory import TreeMemory  # noqa: E402
from watchdog.identity import scan  # noqa: E402

LIMIT_MIB = 200
TOUCH_MIB = 1536
_WORD = struct.Struct("qq")  # MiB touched so far, the worker's resident bytes before it began


def touch(mib: int, progress: str, at: float) -> int:
    """Runs in a worker (pickled by value: this script is ``__main__``)."""
    import mmap as mm
    import os as o
    import struct as st
    import time as t

    with open("/proc/self/statm", "rb") as f:
        before = int(f.read().split()[1]) * o.sysconf("SC_PAGE_SIZE")
    t.sleep(max(0.0, at - t.time()))
    with open(progress, "r+b") as f:
        word = mm.mmap(f.fileno(), 16)
    word[:] = st.pack("qq", 0, before)
    block = mm.mmap(-1, mib << 20, flags=mm.MAP_PRIVATE | mm.MAP_ANONYMOUS)
    for i in range(mib):
        for off in range(i << 20, (i + 1) << 20, 4096):
            block[off] = 1
        word[:8] = st.pack("q", i + 1)
    t.sleep(30)
    return len(block)


def overshoot(tmp: Path) -> list[int] | None:
    with Executor(max_workers=3, memory_max=LIMIT_MIB << 20) as ex:
        containment = ex.orchestrator.containment
        if containment is not None and "memory" in containment.controllers:
            return None
        at = time.time() + 3.0  # the workers are up by then
        words = []
        for i in range(3):
            path = tmp / f"progress{i}"
            path.write_bytes(bytes(_WORD.size))
            words.append(path)
        futs = [ex.submit(touch, TOUCH_MIB, str(p), at + i / 3) for i, p in enumerate(words)]
        peaks = []
        for fut, path in zip(futs, words):
            try:
                fut.result(timeout=120)
            except WorkerLost:
                pass
            touched, before = _WORD.unpack(path.read_bytes()[:_WORD.size])
            peaks.append((before >> 20) + touched)
        return peaks


def check_cost(rounds: int) -> tuple[float, float, float, float, int]:
    """(µs per check with child lists; without them, between two scans and with a scan;
    µs of a scan per process, processes on the host)."""
    worker = subprocess.Popen(["sh", "-c", "sleep 100 & wait"], start_new_session=True)
    try:
        time.sleep(0.2)  # its child forked
        memory = TreeMemory(time.monotonic)

        def per_check(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                memory.measure(worker.pid, None)
            return 1e6 * (time.perf_counter() - t0) / n

        lists = statistics.median(per_check(rounds) for _ in range(5)) if memory.child_lists else float("nan")
        memory.child_lists = False
        memory.measure(worker.pid, None)  # a scan now; the next ones read its map until it is due
        memory._scan_due = float("inf")  # noqa: SLF001 - between two scans
        between = statistics.median(per_check(rounds) for _ in range(5))
        scans = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(rounds // 10 or 1):
                memory._scan_due = float("-inf")  # noqa: SLF001
                memory.measure(worker.pid, None)
            scans.append(1e6 * (time.perf_counter() - t0) / (rounds // 10 or 1))
        t0 = time.perf_counter()
        n = len(scan())
        per_process = 1e6 * (time.perf_counter() - t0) / max(n, 1)
        return lists, between, statistics.median(scans), per_process, n
    finally:
        os.killpg(worker.pid, 9)  # our child's group, led by it (unreaped until the wait)
        worker.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000, help="checks timed per sample (default 2000)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        peaks = overshoot(Path(tmp))
    if peaks is None:
        print("overshoot: skipped, the memory controller is enabled here (memory.max is exact)")
    else:
        print(f"overshoot: peaks {', '.join(map(str, peaks))} MiB before the kill, limit {LIMIT_MIB} MiB "
              f"(tasks touching ~2 GiB/s; checks every 20 ms while a task runs)")
    lists, between, scanned, per_process, n = check_cost(args.rounds)
    print(f"one check of a worker and one child in a process group: {lists:.1f} µs with child lists; without "
          f"them {between:.1f} µs between two scans, {scanned:.0f} µs with a scan; a scan: {per_process:.1f} µs "
          f"per process ({n} here)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
