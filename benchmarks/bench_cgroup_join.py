"""Where a cgroup costs an elastic pool's new worker: the parts of a start that a cgroup
per replica adds, each timed alone on this host (benchmarks/bench_elastic.py times the
whole start).

SAMPLES times, in a subtree of its own (``containment.detect``, this process not moved):
the replica's cgroup made (``prepare``: the mkdir the loop does in ``claim``), a fork, the
child's one write of its pid to ``cgroup.procs`` (``watchdog.cgroup.join``, what
spawn/childsetup.py does before the exec: the kernel's migration, which takes the cgroup
threadgroup lock for writing and waits for an RCU grace period), the child's exit and the
cgroup's rmdir; ``--spacing S`` seconds between samples (an elastic pool starts a worker
now and then, not back to back: the kernel keeps the lock's writer path fast for a grace
period after a migration, so back-to-back joins are cheaper than spaced ones). Then, for
comparison, as many children born inside their cgroup (clone3 with ``CLONE_INTO_CGROUP``,
through ctypes: no migration at all): the time from the call to the child running.
The subtree is removed at the end.

Run: .venv/bin/python -m benchmarks.bench_cgroup_join [--samples N] [--spacing S]
"""

from __future__ import annotations

import argparse
import ctypes
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
    parser.add_argument("--spacing", type=float, default=0.0, help="seconds between samples")
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
        born: list[float] = []
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
                time.sleep(args.spacing)
            for i in range(args.samples):
                path = where.prepare(f"born-{i}")
                took = _born_inside(path)
                where.remove(path)
                if took is None:
                    break
                born.append(took)
                time.sleep(args.spacing)
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
    if born:
        show("clone3 into its cgroup -> the child runs", born)
    else:
        print("  clone3 with CLONE_INTO_CGROUP: not available here")


class _CloneArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls", "set_tid",
        "set_tid_size", "cgroup")]


CLONE_INTO_CGROUP = 0x200000000
SYS_CLONE3 = 435  # x86_64 and aarch64


def _born_inside(path: str) -> float | None:
    """A child made by clone3 straight into the cgroup ``path`` (the GIL held across the
    call, as os.fork holds it; the interpreter told before and after, as os.fork does);
    seconds from the call to the child's first stamp. None: the kernel refused."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    r, w = os.pipe()
    api = ctypes.pythonapi
    libc = ctypes.PyDLL(None, use_errno=True)
    cl = _CloneArgs(flags=CLONE_INTO_CGROUP, exit_signal=17, cgroup=fd)  # SIGCHLD
    t0 = pc()
    api.PyOS_BeforeFork()
    pid = libc.syscall(ctypes.c_long(SYS_CLONE3), ctypes.byref(cl), ctypes.c_size_t(ctypes.sizeof(cl)))
    if pid == 0:
        api.PyOS_AfterFork_Child()
        at = pc()
        with open("/proc/self/cgroup") as f:  # born inside: its cgroup is the one asked for
            inside = any(line.startswith("0::") and path.endswith(line[3:].strip()) for line in f)
        os.write(w, STAMPS.pack(at, float(inside)))
        os._exit(0)
    api.PyOS_AfterFork_Parent()
    os.close(fd)
    if pid < 0:
        os.close(r)
        os.close(w)
        return None
    a, inside = STAMPS.unpack(os.read(r, STAMPS.size))
    os.waitpid(pid, 0)
    os.close(r)
    os.close(w)
    if not inside:
        raise SystemExit(f"clone3's child was not in {path}")
    return a - t0


if __name__ == "__main__":
    main()
