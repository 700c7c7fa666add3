"""The kernel's OOM killer and the replicas: who it should pick, and whether it did.

Who it should pick: every replica raises its own ``oom_score_adj`` (the forked child writes
``spawn.childsetup.worker_oom_score_adj()``), so under memory pressure the kernel takes a
replica before the daemon or its watchdog, which stay at what they inherited.

Whether it did: a replica the OOM killer took dies of a SIGKILL that nobody here sent, and
its wait status cannot tell that from any other SIGKILL. Two places can:

``cgroup_oom_kills(dir)``
    The ``oom_kill`` counter of a memory cgroup: exact, cheap, and only as fine as the
    cgroup (it counts kills of any process in it and, cgroup v2 unless mounted with
    ``memory_localevents``, in its descendants), and only where the memory controller is
    enabled for it. A cgroup per replica makes it a per-replica answer.

``was_oom_killed(pid, since)``
    The kernel log: the OOM killer logs every victim ("Out of memory: Killed process PID
    (comm)", "Memory cgroup out of memory: Killed process PID ...", and, rate-limited,
    "oom-kill:...,task=comm,pid=PID,uid=N" before it kills), whatever the cgroup layout. It
    can say True, False, or None (cannot be known):
      * None where the log cannot be read (``kernel.dmesg_restrict=1`` without CAP_SYSLOG,
        most containers). /dev/kmsg first; where it cannot be opened or was not read to
        its end within the bounds (8 MiB, 0.5 s), syslog(2) READ_ALL, what ``dmesg``
        itself falls back to (called directly: no program to fork, none to be missing);
      * None in a pid namespace other than the initial one: the log's pids are the
        initial namespace's, ours are not, so a number match would prove nothing. (Known
        by /proc/2 not being the kernel's kthreadd: in any other namespace it is not.)
      * a victim whose record has been overwritten (the ring buffer wrapped, under a flood
        of messages) reads as False: the log no longer says so;
      * the times: the log's timestamps are the kernel's clock since boot, ``since`` is
        wall time (``time.time()``, like ``Replica.created_at``); it is mapped the way
        ``dmesg -T`` maps it, through CLOCK_MONOTONIC now. The printk clock is not slewed
        by NTP and CLOCK_MONOTONIC is, so the two drift apart by parts per million of the
        uptime, and a wall clock stepped since ``since`` shifts it whole: records up to
        ``SLACK`` seconds older than ``since`` still count, and beyond that a drift can
        hide a kill that came within it of ``since``. A record of the same pid number's
        previous owner, OOM-killed within the slack before ``since``, would be taken for
        this one: pid reuse that fast is what it would take;
      * the kill record is logged right after the SIGKILL is sent, by the task that ran
        out of memory: a caller that has already reaped the victim could in principle read
        the log a few microseconds too early (the victim has to wake, exit and be reaped
        first; not seen here).
    Only kernel records count (facility 0: a user writing "Killed process" to /dev/kmsg is
    not the kernel). Asked right after the reap, a later owner of the pid cannot have been
    logged yet: the zombie pinned the number until then.

Both are bounded in bytes and time and never block: /dev/kmsg is read non-blockingly, one
record per read, oldest first, until EAGAIN (the end); cgroup files are single small reads.
"""

from __future__ import annotations

import os
import time

__all__ = ["was_oom_killed", "cgroup_oom_kills", "SLACK"]

SLACK = 2.0  # seconds: how much older than ``since`` a record may look and still count
MAX_BYTES = 8 << 20  # of log read per call (the default ring buffer is 128 KiB - 1 MiB)
MAX_SECONDS = 0.5
_RECORD_MAX = 8192  # one /dev/kmsg record fits (the kernel formats each into 8 KiB at most)
_KMSG = "/dev/kmsg"
_SYSLOG_ACTION_READ_ALL = 3
_SYSLOG_ACTION_SIZE_BUFFER = 10


# -- the kernel log ------------------------------------------------------------------------


def was_oom_killed(pid: int, since: float) -> bool | None:
    """Did the kernel's OOM killer kill process ``pid`` at or after ``since`` (wall time)?
    True/False from the kernel log; None when it cannot be known (see the module's text).
    Never raises, never blocks; at most ``MAX_BYTES`` read and about ``MAX_SECONDS`` spent."""
    try:
        if not _in_initial_pid_namespace():
            return None
        # The printk clock is (about) CLOCK_MONOTONIC: map the wall time onto it.
        since_us = (since - time.time() + time.clock_gettime(time.CLOCK_MONOTONIC) - SLACK) * 1e6
        found = _scan_kmsg(_KMSG, pid, since_us)
        if found is None:  # no /dev/kmsg (or no right to it): what dmesg falls back to
            found = _scan_syslog(pid, since_us)
        return found
    except Exception:  # a format we did not foresee: unknown, not a crash of the caller
        return None


def _in_initial_pid_namespace() -> bool:
    try:
        with open("/proc/2/stat", "rb") as f:
            return f.read(64).startswith(b"2 (kthreadd) ")
    except OSError:
        return False


def _victim(text: bytes) -> int | None:
    """The pid an OOM-killer message names as its victim, or None if it is not one."""
    import re  # here: only a SIGKILL we did not send pays for it

    if b"Killed process " in text:  # "[Memory cgroup ]Out of memory: Killed process P (c)"
        m = re.search(rb"Killed process (\d+) \(", text)
    elif text.startswith(b"oom-kill:"):  # "...,task=COMM,pid=P,uid=U": anchored at the end,
        m = re.search(rb",pid=(\d+),uid=\d+\s*$", text)  # a comm holding ",pid=" can't forge it
    elif text.startswith(b"oom_reaper: reaped process "):
        m = re.match(rb"oom_reaper: reaped process (\d+) \(", text)
    else:
        return None
    return int(m.group(1)) if m else None


def _kmsg_match(record: bytes, pid: int, since_us: float) -> bool:
    """One /dev/kmsg record: "PRIO,SEQ,TIMESTAMP_US,FLAGS[,...];TEXT\\n[ KEY=VALUE\\n...]"."""
    head, sep, rest = record.partition(b";")
    if not sep:
        return False
    text = rest.split(b"\n", 1)[0]
    victim = _victim(text)
    if victim != pid:
        return False
    fields = head.split(b",")
    if len(fields) < 3 or int(fields[0]) >> 3 != 0:  # facility 0: the kernel's own
        return False
    return int(fields[2]) >= since_us


def _scan_kmsg(path: str, pid: int, since_us: float) -> bool | None:
    """Read every record /dev/kmsg holds, oldest first, until EAGAIN. None if it cannot be
    opened or was not read to its end within the bounds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    deadline = time.monotonic() + MAX_SECONDS
    total = 0
    n = 0
    try:
        while total < MAX_BYTES:
            n += 1
            if not n & 255 and time.monotonic() > deadline:
                return None
            try:
                record = os.read(fd, _RECORD_MAX)
            except BlockingIOError:  # EAGAIN: no record left, we have read them all
                return False
            except BrokenPipeError:  # EPIPE: overwritten while we read; the next one follows
                continue
            if not record:
                return False
            total += len(record)
            if (b"process " in record or b"oom-kill:" in record) and _kmsg_match(record, pid, since_us):
                return True
        return None
    except OSError:  # EINVAL (a record too long for us), EIO...: unknown
        return None
    finally:
        os.close(fd)


def _scan_syslog(pid: int, since_us: float) -> bool | None:
    """The same through syslog(2) READ_ALL, the call ``dmesg`` makes when /dev/kmsg fails
    (made here directly: no fork of a program that may not be installed). Lines
    "<PRIO>[SECONDS.MICROS] TEXT"; the timestamps are there only with printk.time=1, and a
    line naming the pid without one cannot be dated: the answer is then None. At most the
    newest ``MAX_BYTES``: if that cuts the log, False only when what was read reaches back
    to ``since``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    klogctl = libc.klogctl
    klogctl.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    klogctl.restype = ctypes.c_int
    full = klogctl(_SYSLOG_ACTION_SIZE_BUFFER, None, 0)
    if full <= 0:
        return None
    size = min(full, MAX_BYTES)
    buf = ctypes.create_string_buffer(size)
    got = klogctl(_SYSLOG_ACTION_READ_ALL, buf, size)  # non-destructive, never blocks
    if got < 0:  # EPERM: dmesg_restrict without CAP_SYSLOG
        return None
    return _match_syslog(buf.raw[:got], pid, since_us, complete=full <= MAX_BYTES)


def _match_syslog(data: bytes, pid: int, since_us: float, *, complete: bool) -> bool | None:
    """``data``: syslog(2) text, oldest line first; ``complete``: the whole buffer."""
    import re

    line_re = re.compile(rb"<(\d+)>(?:\[\s*(\d+)\.(\d+)\] ?)?(.*)")
    undated = False
    reaches_back = complete
    for line in data.splitlines():
        m = line_re.match(line)
        if m is None:
            continue
        ts = None if m.group(2) is None else int(m.group(2)) * 1_000_000 + int(m.group(3).ljust(6, b"0")[:6])
        if not reaches_back and ts is not None:
            reaches_back = ts <= since_us  # the oldest dated line read: older than since?
        if int(m.group(1)) >> 3 != 0 or (b"process " not in line and b"oom-kill:" not in line):
            continue
        if _victim(m.group(4)) != pid:
            continue
        if ts is None:
            undated = True
        elif ts >= since_us:
            return True
    return None if undated or not reaches_back else False


# -- cgroups -------------------------------------------------------------------------------


def cgroup_oom_kills(cgroup_dir: str) -> int:
    """How many processes the OOM killer has killed in this memory cgroup: ``oom_kill`` of
    cgroup v2's ``memory.events`` (with its descendants, unless the hierarchy is mounted with
    ``memory_localevents``), else of cgroup v1's ``memory.oom_control`` (kernel >= 4.13).
    0 where neither file is there (no memory controller for it, no such cgroup); another
    error reading one (EACCES, EIO) is raised. One read of at most 4 KiB per file."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            fd = os.open(os.path.join(cgroup_dir, name), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        for line in data.splitlines():
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value)
        return 0  # the file is there, the counter is not (a kernel older than the counter)
    return 0
