"""The layout of the captured log files, shared by the daemon that writes them
(logcapture.py) and the readers (logread.py, the ``logs`` command), which run in any
process: the names, the rotated chain, and how a file is opened without following a link.

    <logs dir>/<id>.out, <id>.out.1 .. <id>.out.K     stdout, newest first (.K the oldest)
    <logs dir>/<id>.err, <id>.err.1 .. <id>.err.K     stderr
    <logs dir>/<id>.probe (and its .k)                 the output of a replica's exec probes
    <logs dir>/<pool>#<n>.out, .err (and their .k)     task <pool>/<n>'s stdout and stderr (a task
                                                       id's ``/`` cannot be in a name; ``#`` is in
                                                       no pool's name, so no replica's file is one)
    <logs dir>/<any of the .out/.err files>.idx        its lines' times (logindex.py), renamed
                                                       and removed with it
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterable

from .errors import InvalidSpec
from .protocol import parse_replica_id, parse_task_id

STREAMS = ("out", "err")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
WRITE_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
               | os.O_NOCTTY | os.O_CLOEXEC)  # NONBLOCK: a FIFO planted there never blocks the open
INDEX_FLAGS = (WRITE_FLAGS & ~os.O_WRONLY) | os.O_RDWR  # the daemon reads its index's last record back
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
INDEX_SUFFIX = ".idx"  # <log file>.idx: its lines' times (logindex.py)
BACKUP_LIMIT = 10_000  # rotated files probed at most (K is a pool's setting, never this large)


def check_stream(stream: str) -> str:
    if stream not in STREAMS:
        raise ValueError(f"stream must be 'out' or 'err', got {stream!r}")
    return stream


def check_id(replica_id: str) -> str:
    """A replica's id (``web-3``) or a task's (``jobs/7``): whose logs these are."""
    if not isinstance(replica_id, str) or (parse_replica_id(replica_id) is None
                                            and parse_task_id(replica_id) is None):
        raise InvalidSpec(f"invalid replica or task id {replica_id!r}")
    return replica_id


def base_name(log_id: str) -> str:
    """The files' name before ``.out``/``.err`` of a replica id (itself) or a task id
    (``jobs/7`` -> ``jobs#7``)."""
    pool, slash, n = log_id.partition("/")
    return f"{pool}#{n}" if slash else log_id


def open_dir(logs_dir: str | os.PathLike[str]) -> int | None:
    try:
        return os.open(logs_dir, DIR_FLAGS)
    except FileNotFoundError:
        return None


def open_log_file(dirfd: int, name: str, flags: int, where: Path) -> tuple[int, os.stat_result]:
    """Open ``name`` in the dir ``dirfd`` without following a link; refuse anything but a
    regular file of ours with one link. Raises OSError (FileNotFoundError if absent)."""
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dirfd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link: refusing to follow it", str(where / name)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a regular file of ours with a single link", str(where / name))
        if flags & (os.O_WRONLY | os.O_RDWR) and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def backup_names(dirfd: int, name: str) -> list[str]:
    """``name.1`` .. ``name.K`` that exist (contiguous from 1, as rotation keeps them)."""
    found = []
    for i in range(1, BACKUP_LIMIT + 1):
        try:
            os.stat(f"{name}.{i}", dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            break
        found.append(f"{name}.{i}")
    return found


def log_paths(logs_dir: str | os.PathLike[str], replica_id: str, stream: str = "out") -> list[Path]:
    """The files of one stream that exist, oldest first: .K .. .1, then the current one."""
    check_id(replica_id)
    name = f"{base_name(replica_id)}.{check_stream(stream)}"
    logs = Path(logs_dir)
    dirfd = open_dir(logs)
    if dirfd is None:
        return []
    try:
        names = backup_names(dirfd, name)[::-1]
        with contextlib.suppress(FileNotFoundError):
            os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            names.append(name)
        return [logs / n for n in names]
    finally:
        os.close(dirfd)


def remove(logs_dir: str | os.PathLike[str], replica_ids: Iterable[str]) -> int:
    """Delete every log file (current and rotated, stdout and stderr) of these replicas
    or tasks, e.g. once their records were pruned; returns the number of files removed."""
    wanted = {base_name(rid) for rid in replica_ids
              if isinstance(rid, str) and (parse_replica_id(rid) or parse_task_id(rid))}
    if not wanted:
        return 0
    dirfd = open_dir(logs_dir)
    if dirfd is None:
        return 0
    removed = 0
    try:
        with os.scandir(dirfd) as it:
            names = [e.name for e in it]
        for name in names:
            base = name.removesuffix(INDEX_SUFFIX)  # a log's index goes with it
            head, dot, tail_ = base.rpartition(".")
            if dot and tail_.isascii() and tail_.isdigit():
                base = head
            rid, dot, stream = base.rpartition(".")
            if dot and stream in (*STREAMS, "probe") and rid in wanted:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dirfd)
                    removed += 1
    finally:
        os.close(dirfd)
    return removed
