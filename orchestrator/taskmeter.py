"""What a task took, measured in its worker (taskworker.py) around each task and sent to the
loop as a FIGURES frame (taskwire.py) in the same write as the task's answer.

    wall               ``time.perf_counter`` from the task's start in the worker to its
                       answer: the call, its pickling, the end of the processes it left
    cpu                user + system seconds (``getrusage``) of the worker, all its threads,
                       and of the children reaped meanwhile (``RUSAGE_CHILDREN``: the ones the
                       task waited for, their own reaped descendants, and what the worker,
                       the subreaper of a task's leftovers, ended and reaped before it answers),
                       from the reading its worker made for the task before it (or once it
                       was ready for tasks) to this one's answer: the worker's CPU between
                       two tasks (the write of the answer before, the read and unpickling of
                       this task's frame: a few µs; none while it waits, unless a thread of its
                       own runs) is this task's too.
                       One ``getrusage`` a task fewer than a reading at each start
    peak_rss           the worker's own peak resident set while the task ran, not its
                       lifetime's: before each task ``/proc/self/clear_refs`` ("5") brings
                       the kernel's high-water mark down to the resident set of the moment
    children_peak_rss  the largest ``ru_maxrss`` the kernel reports for a child reaped
                       during the task, when that rose during it; None otherwise. The kernel
                       keeps one maximum over all the children the worker ever reaped, and
                       it cannot be reset: a task whose children stayed below an earlier
                       task's has no figure of its own. A child started from the worker
                       (fork, or the vfork of ``subprocess``) counts at least the worker's
                       resident set at its start (its exec folds the old image's mark in)

Why the peak is read as it is: ``getrusage(RUSAGE_SELF).ru_maxrss`` is one system call
(~0.5 us) and follows the reset, but it is the larger of the high-water mark and a figure
the kernel fixed at this process's exec: the peak of the image before it, which for a
worker exec'd from a fork of a large process is that process's size. ``VmHWM`` of
``/proc/self/status`` follows the reset too, and no exec raises it, but reading it costs
~5 us. So, once, just after the first reset: where ``ru_maxrss`` is not above ``VmHWM``
(the exec's figure is below the worker's resident set), every task's peak is its
``ru_maxrss``; where it is above, that figure is a floor: a task whose ``ru_maxrss`` passes
it peaked there, one below it reads ``VmHWM``. (``ru_maxrss`` follows the kernel's per-CPU
resident-set counters, which may lag the exact figure by a few hundred KiB.)

Without ``clear_refs`` (a kernel or sandbox without it) ``peak_rss`` is None: the worker's
lifetime peak is not the task's. The reset is made before every task: measured here, the
write costs ~0.5 us, less than what would tell whether it can be skipped (the resident set
of the moment, ``/proc/self/statm``: ~1.3 us; ``VmHWM``: ~5-10 us), and skipping it when the
last task's peak did not rise gives a task the peak of one before it that freed memory.
What figures cost a tiny task (two ``getrusage``, one write, two clock reads, one ``struct``
pack, 45 bytes more in the answer's write): benchmarks/README.md.
"""

from __future__ import annotations

import os
import resource
import struct
import time

from . import taskwire as w

_SELF, _CHILDREN = resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN
_usage = resource.getrusage
_clock = time.perf_counter
_RESET = b"5"  # clear_refs: "reset the peak resident set size (VmHWM) to the resident set now"
# KiB: an exec's figure this little above the resident set at the start is taken as none
# (a task that peaks below it is counted as peaking at it): about what ru_maxrss's per-CPU
# counters may be off by, so that a worker is not sent to VmHWM by their noise alone
_SLACK = 1024
# The whole FIGURES frame, header and payload, packed in one call (its header's two
# constants bound here: module attributes looked up per task cost more than the pack)
_pack = struct.Struct(w.HEADER.format + w.FIGURES_PAYLOAD.format.lstrip("!")).pack
_SIZE, _KIND = w.FIGURES_PAYLOAD.size, w.FIGURES


class Meter:
    """The figures of the task that runs: made as the worker starts, ``settle`` once it is
    ready for tasks, ``start`` before each task, ``frame`` once its answer is ready (main
    thread only, like the worker)."""

    def __init__(self) -> None:
        self._reset_fd = _open("/proc/self/clear_refs", os.O_WRONLY)
        self._status_fd = _open("/proc/self/status", os.O_RDONLY)
        self._floor = 0  # ru_maxrss (KiB) up to which a task's peak is read from VmHWM (the exec's figure)
        if self._reset_fd >= 0:
            try:
                os.write(self._reset_fd, _RESET)
            except OSError:
                os.close(self._reset_fd)
                self._reset_fd = -1
            else:
                floor = _usage(_SELF).ru_maxrss
                if floor > self._high_water() + _SLACK:
                    self._floor = floor
        self._began = 0.0
        self._cpu = 0.0  # the worker's user + system seconds at the last reading (the last task's end)
        self._children_cpu = 0.0  # ...its reaped children's, and their largest ru_maxrss
        self._children_peak = 0
        self.settle()

    def settle(self) -> None:
        """The worker is ready for tasks: what its children took so far (its initializer's)
        is no task's."""
        own, children = _usage(_SELF), _usage(_CHILDREN)  # (a struct_rusage read by index: cheaper than by name)
        self._cpu = own[0] + own[1]
        self._children_cpu, self._children_peak = children[0] + children[1], children[2]

    def start(self) -> None:
        """A task starts now: its clock from here, the peak brought down. (The counters are
        where the last task's ``frame``, or ``settle``, read them: between two tasks the
        worker reaps no child, and its own CPU meanwhile is the next task's.)"""
        if self._reset_fd >= 0:
            try:
                os.write(self._reset_fd, _RESET)
            except OSError:  # it worked at the start: not expected, but no task's peak is made up
                os.close(self._reset_fd)
                self._reset_fd = -1
        self._began = _clock()

    def frame(self, number: int) -> bytes:
        """The FIGURES frame of task ``number``, measured now."""
        wall = _clock() - self._began
        own, children = _usage(_SELF), _usage(_CHILDREN)
        own_cpu, children_cpu, children_peak = own[0] + own[1], children[0] + children[1], children[2]
        cpu = own_cpu - self._cpu + children_cpu - self._children_cpu
        peak = 0
        if self._reset_fd >= 0:
            peak = own[2] if own[2] > self._floor else self._high_water()
        risen = children_peak if children_peak > self._children_peak else 0
        self._cpu, self._children_cpu, self._children_peak = own_cpu, children_cpu, children_peak
        return _pack(_SIZE, _KIND, number, wall, cpu, peak << 10, risen << 10)

    def _high_water(self) -> int:
        """VmHWM (KiB) of /proc/self/status; 0 if it cannot be read."""
        try:
            text = os.pread(self._status_fd, 1 << 13, 0)
            at = text.index(b"VmHWM:") + 6
            return int(text[at:text.index(b"kB", at)])
        except (OSError, ValueError):
            return 0


def _open(path: str, flags: int) -> int:
    """An fd kept for the worker's life (one system call a task, not three), or -1."""
    try:
        return os.open(path, flags | os.O_CLOEXEC)
    except OSError:
        return -1
