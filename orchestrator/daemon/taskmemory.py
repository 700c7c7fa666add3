"""``memory_max`` where no cgroup memory controller enforces it: a worker's whole process
tree, measured on the loop's timers (tasktable.TaskTable._check_rss). Loop thread only.

With the memory controller (cgroup containment, ``memory`` enabled for replica cgroups) the
limit is the worker cgroup's ``memory.max``: the kernel counts every page of the tree once
and never lets it pass; nothing here runs. Without it this module is the fallback, and it
is a poll: what it can and cannot promise is this.

  * What counts: the resident memory (RSS) of the worker and of every descendant, however
    it left the worker's process group (``setsid``). A page two processes of the tree share
    (a fork's copy-on-write pages, shared memory) counts once per process: the sum errs on
    the high side, the cgroup's count does not.
  * When: every CHECK_INTERVAL (20 ms) while a worker of the pool runs a task, every
    IDLE_INTERVAL (1 s) while all are idle; a task's start brings the next check forward.
    An allocation faster than that overshoots the limit by up to its rate x the interval
    before the kill (measured by ``benchmarks/bench_memory.py``; the figures are in
    benchmarks/README.md) and may run the host out of memory first if it is faster than the
    host has room for. There is no event to
    wait on instead: without a memory controller the kernel says nothing about one
    cgroup's or one tree's usage (PSI files report stalls, which an unlimited cgroup does
    not have until the whole host runs short).
  * Which processes: a worker in a cgroup of its own (cgroup containment without the memory
    controller) is its ``cgroup.procs``, read at each check: exact, and the kill is
    ``cgroup.kill``. A worker in a process group is found by walking the kernel's child
    lists (``/proc/PID/task/TID/children``) at each check; on a kernel built without them
    (CONFIG_PROC_CHILDREN), by a scan of /proc shared by all pools and paced by its own
    cost (at most SCAN_SHARE of the loop's time): a descendant is counted from the first
    scan after its birth. In a process group, a descendant whose parent exited (a double
    fork) is re-parented away from the worker and no longer counted; a cgroup keeps it.
  * The kill: the worker's whole tree (its cgroup, or its group and the descendants that
    left it, identity-checked), its task failed with ``WorkerLost("memory limit N
    exceeded")`` and not run again by ``retries``: it would pass the limit again.

What a check reads: in a cgroup, cgroup.procs and a statm per member; in a process group
with child lists, a listdir of each process's threads, a children file per thread, a stat
and a statm per process; without them, the /proc scan's map between two scans (a scan reads
every process of the host, so it is paced to SCAN_SHARE of the loop). Its cost, and so the
share of a core a busy worker's checks take at CHECK_INTERVAL: ``benchmarks/bench_memory.py``,
figures in benchmarks/README.md.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from watchdog.identity import ProcStat, proc_stat, scan

from .osapi import _children

CHECK_INTERVAL = 0.02  # seconds between checks of a pool that runs a task
IDLE_INTERVAL = 1.0  # ... of a pool whose workers are all idle (only what a task left runs there)
SCAN_SHARE = 0.02  # the /proc scan (no child lists) takes at most this share of the loop
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _has_child_lists() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")


def resident(pid: int) -> int:
    """Bytes of ``pid`` resident in memory now (0 if it is gone or a zombie)."""
    try:
        fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return int(os.read(fd, 256).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        os.close(fd)


class TreeMemory:
    """What a worker's tree holds (see the module docstring); one for the task table."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.child_lists = _has_child_lists()
        self._kids: dict[int, list[ProcStat]] = {}  # ppid -> children, from the last /proc scan
        self._scan_due = float("-inf")

    def measure(self, pid: int, cgroup: str | None) -> tuple[int, list[tuple[int, int]]]:
        """(bytes resident in the tree of the worker ``pid``, the (pid, start time) of its
        descendants outside its process group: a group kill would miss them). ``cgroup``:
        the worker's own cgroup, if it has one (then nothing is outside it)."""
        if cgroup is not None:
            try:
                with open(os.path.join(cgroup, "cgroup.procs"), "rb") as f:
                    members = [int(p) for p in f.read().split()]
            except (OSError, ValueError):
                members = [pid]
            return sum(resident(p) for p in members), []
        total = resident(pid)
        outside: list[tuple[int, int]] = []
        for st in self._descendants(pid):
            total += resident(st.pid)
            if st.pgrp != pid:
                outside.append((st.pid, st.start_time))
        return total, outside

    def used(self, pid: int, cgroup: str | None) -> int:
        """Bytes the tree of the worker ``pid`` holds, for an elastic pool's memory_budget
        (elastic.py): its cgroup's ``memory.current`` where the memory controller counts it
        (every page of the tree once, the page cache it caused too), else its resident
        memory as ``measure`` sums it."""
        if cgroup is not None:
            try:
                with open(os.path.join(cgroup, "memory.current"), "rb") as f:
                    return int(f.read())
            except (OSError, ValueError):
                pass  # no memory controller in that cgroup: its members' RSS
        return self.measure(pid, cgroup)[0]

    def _descendants(self, pid: int) -> list[ProcStat]:
        found: list[ProcStat] = []
        seen = {pid}
        stack = [pid]
        if self.child_lists:
            while stack:
                for child in _children(stack.pop()):
                    st = proc_stat(child)
                    if st is not None and child not in seen:
                        seen.add(child)
                        found.append(st)
                        stack.append(child)
            return found
        self._rescan()
        while stack:
            for st in self._kids.get(stack.pop(), ()):
                now = proc_stat(st.pid)  # since the scan it may have ended, its number reused
                if now is not None and now.start_time == st.start_time and st.pid not in seen:
                    seen.add(st.pid)
                    found.append(now)
                    stack.append(st.pid)
        return found

    def _rescan(self) -> None:
        """The ppid map from a scan of /proc, at most as often as its cost allows."""
        now = self._clock()
        if now < self._scan_due:
            return
        kids: dict[int, list[ProcStat]] = {}
        for st in scan().values():
            kids.setdefault(st.ppid, []).append(st)
        self._kids = kids
        took = self._clock() - now
        self._scan_due = now + max(CHECK_INTERVAL, took / SCAN_SHARE) - CHECK_INTERVAL / 2
