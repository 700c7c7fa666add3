"""Where a cgroup costs an elastic pool's new worker: the parts of a start that a cgroup
per replica adds, each timed alone on this host (benchmarks/bench_elastic.py times the
whole start).

SAMPLES times, in a subtree of its own (``containment.detect``, this process not moved):
the replica's cgroup made (``prepare``: the mkdir the loop does in ``claim``), a fork, the
child's one write of its pid to ``cgroup.procs`` (``watchdog.cgroup.join``, what
spawn/childsetup.py does before the exec: the kernel's migration, which takes the cgroup
threadgroup lock for writing and waits for an RCU grace period), the child's exit and the
cgroup's rmdir. The subtree is removed at the end.

Run: .venv/bin/python -m benchmarks.bench_cgroup_join [--samples N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import tempfile
import time

pc = time.perf_counter
STAMPS = struct.Struct("dd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    args = parser.parse_args()
    from orchestrator.daemon import containment
    from watchdog.cgroup import join

    with tempfile.TemporaryDirectory() as state:
        where = containment.detect("auto", state, move_self=False, name=f"orchestrator-bench-join-{os.getpid()}")
        if not isinstance(where, containment.Cgroups):
            raise SystemExit(f"no cgroups here: {where.reason}")
        made: list[float] = []
        forked: list[float] = []
        joined: list[float] = []
        removed: list[float] = []
        try:
            for i in range(args.samples):
                t0 = pc()
                path = where.prepare(f"bench-{i}")
                t1 = pc()
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: one write, its two stamps, out
                    a = pc()
                    join(path)
                    os.write(w, STAMPS.pack(a, pc()))
                    os._exit(0)
                a, b = STAMPS.unpack(os.read(r, STAMPS.size))
                os.waitpid(pid, 0)
                os.close(r)
                os.close(w)
                t2 = pc()
                where.remove(path)
                removed.append(pc() - t2)
                made.append(t1 - t0)
                forked.append(a - t1)
                joined.append(b - a)
        finally:
            where.subtree.destroy()

    def show(what: str, xs: list[float]) -> None:
        ordered = sorted(xs)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(f"  {what:<40} p50 {statistics.median(xs) * 1000:6.2f} ms   p99 {p99 * 1000:6.2f} ms")

    print(f"a cgroup per replica, {args.samples} samples, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores ({where.path}):")
    show("mkdir of its cgroup (the loop's claim)", made)
    show("fork -> the child runs", forked)
    show("the child's join (cgroup.procs write)", joined)
    show("rmdir after its exit", removed)


if __name__ == "__main__":
    main()
