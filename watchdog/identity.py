"""Process identity: who a pid is, read straight from /proc.

A pid alone names nothing: once a process is reaped its number can be handed to any new
process (pid_max is often only 32768). The watchdog therefore identifies a process by
``(pid, start_time)``, where ``start_time`` is field 22 of ``/proc/PID/stat``: clock ticks
since boot at which the process started. The pair is unique for the life of the machine.

To signal a process safely:

1. ``open_verified(pid, start)`` opens a pidfd and *then* re-checks the start time. A
   pidfd is pinned to one process: if the start time still matches after opening, the fd
   refers to the process we meant, and ``signal.pidfd_send_signal(fd, ...)`` can never
   reach a later process that reuses the number.
2. Signal through the fd; close it when done.

Everything here reads /proc with plain ``os.open``/``os.read`` (no psutil): the reaper
runs these on hundreds of processes within a few milliseconds.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["ProcStat", "start_time", "proc_stat", "scan", "open_verified", "is_alive"]


class ProcStat(NamedTuple):
    """The fields of ``/proc/PID/stat`` the watchdog uses."""

    pid: int
    ppid: int
    pgrp: int
    session: int
    state: str  # one letter: R, S, D, T (stopped), t (traced), Z (zombie), X, I, ...
    start_time: int  # clock ticks since boot


# Field numbers from proc_pid_stat(5), counted from 1. Fields 1 and 2 (pid, comm) come
# before the last ')'; the rest are split from what follows it.
_FIRST_AFTER_COMM = 3
_STATE = 3 - _FIRST_AFTER_COMM
_PPID = 4 - _FIRST_AFTER_COMM
_PGRP = 5 - _FIRST_AFTER_COMM
_SESSION = 6 - _FIRST_AFTER_COMM
_STARTTIME = 22 - _FIRST_AFTER_COMM


def _read_stat(pid: int) -> bytes | None:
    """Raw ``/proc/PID/stat``, or None if there is no such process (any more)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        # The line is well under 1 KiB; one read gets all of it.
        return os.read(fd, 4096)
    except ProcessLookupError:  # the task was reaped between open and read
        return None
    finally:
        os.close(fd)


def parse_stat(pid: int, data: bytes) -> ProcStat | None:
    """Parse one ``/proc/PID/stat`` line; None if it is empty or truncated.

    ``comm`` (field 2) is free text in parentheses and may itself contain spaces and
    parentheses, so the remaining fields start after the LAST ``)``.
    """
    close = data.rfind(b")")
    if close < 0:
        return None
    fields = data[close + 2 :].split()
    if len(fields) <= _STARTTIME:
        return None
    return ProcStat(
        pid,
        int(fields[_PPID]),
        int(fields[_PGRP]),
        int(fields[_SESSION]),
        fields[_STATE].decode("ascii", "replace"),
        int(fields[_STARTTIME]),
    )


def proc_stat(pid: int) -> ProcStat | None:
    """The process's stat fields, or None if it does not exist."""
    data = _read_stat(pid)
    return None if data is None else parse_stat(pid, data)


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist.

    With the pid, this is THE identity of a process. A zombie still has its start time
    (it exists until reaped); use ``is_alive`` to tell a running process from a zombie.
    """
    st = proc_stat(pid)
    return None if st is None else st.start_time


def scan() -> dict[int, ProcStat]:
    """Every process visible in /proc, read once: pid -> ProcStat.

    Not an atomic snapshot (nothing is): processes may start or exit while it runs.
    Callers re-verify identity through a pidfd before acting on any entry.
    """
    result: dict[int, ProcStat] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        data = _read_stat(pid)
        if data is None:
            continue
        st = parse_stat(pid, data)
        if st is not None:
            result[pid] = st
    return result


def open_verified(pid: int, start: int) -> int | None:
    """A pidfd for the process ``(pid, start)``, or None if it is gone or the pid was reused.

    The order matters: open first, verify second. Once the fd is open it is pinned to one
    process, so a matching start time read afterwards proves the fd is the one we want.
    (Verifying first and opening second would leave a window for pid reuse.)
    The caller owns the returned fd and must close it.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if start_time(pid) != start:
        os.close(fd)
        return None
    return fd


def is_alive(pid: int, start: int) -> bool:
    """True if ``(pid, start)`` exists and is not a zombie (a zombie has already exited)."""
    st = proc_stat(pid)
    return st is not None and st.start_time == start and st.state not in ("Z", "X")
