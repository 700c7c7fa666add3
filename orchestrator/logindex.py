"""The per-line times of a captured log, kept beside it: ``<file>.idx`` next to each log file
(``web-3.out.idx``, ``web-3.out.1.idx``, ...), so the log itself stays the replica's bytes,
byte for byte. Written by the daemon's capture (logcapture.py), read by logread.py.

The index is sparse: fixed-size records of (the wall-clock time the daemon read a chunk of
the pipe, in microseconds; the byte offset in the log where that chunk starts), one for the
first chunk of the file and then one for each chunk read at least ``RESOLUTION`` after the
last record. A line's time is the time of the last record at or before the offset where the
line starts: the read time of the chunk it began in, or up to ``RESOLUTION`` earlier. Times
never decrease within one index (a clock stepped back repeats the last time), so a time is
found by binary search over the records with a handful of preads, whatever the log's size;
from there the log is scanned forward.

    header   8 bytes MAGIC, 8 bytes the log file's inode (little-endian)
    record   8 bytes time (µs since the epoch, signed), 8 bytes offset

The inode ties an index to its log: rotation renames both, one after the other, and a
reader that meets an index of another file (a rotation between the two renames, a file
written by a daemon that kept no index) ignores it and takes the log's lines as written at
the file's mtime. Each record is written before the chunk it describes, so a reader that
sees a line also sees its time.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .logfiles import INDEX_SUFFIX, READ_FLAGS, open_log_file

MAGIC = b"OIDX\x00\x00\x00\x01"
SUFFIX = INDEX_SUFFIX
RECORD = struct.Struct("<qQ")
HEADER = struct.Struct("<8sQ")
RESOLUTION = 1000  # µs between two records at most
READ_RECORDS = 4096  # records per pread when reading an index forward

assert RECORD.size == HEADER.size  # record n sits at (n + 1) * RECORD.size


def index_name(log_name: str) -> str:
    return log_name + SUFFIX


def is_index(name: str) -> bool:
    return name.endswith(SUFFIX)


class IndexWriter:
    """The index of one log file being appended to (the daemon's loop): ``chunk(now, offset)``
    before each write of a chunk at ``offset``. Its fd is opened by the caller (who knows how
    files are opened safely there) and handed over; ``close`` closes it."""

    __slots__ = ("fd", "last", "failed")

    def __init__(self, fd: int, log_stat: os.stat_result) -> None:
        """``fd``: the index file, opened for appending; ``log_stat``: its log, as opened.
        An index that is not this log's (or is torn) is started again; a log that already
        has bytes no record covers gets one record at offset 0 with the log's mtime."""
        self.fd = fd
        self.last = -1  # the last record's time (µs)
        self.failed = False
        st = os.fstat(fd)
        head = os.pread(fd, HEADER.size, 0) if st.st_size >= HEADER.size else b""
        ok = len(head) == HEADER.size and HEADER.unpack(head) == (MAGIC, log_stat.st_ino)
        n = (st.st_size // RECORD.size) - 1 if ok else 0
        if ok and n > 0:
            self.last, last_offset = RECORD.unpack(os.pread(fd, RECORD.size, n * RECORD.size))
            # Past the log's end: the index of a file removed alone whose inode the new one
            # got (its records would not be this file's); started again
            ok = last_offset <= log_stat.st_size
            if ok:
                if st.st_size % RECORD.size:  # a torn last record (a crash mid-write): cut it off
                    os.ftruncate(fd, (n + 1) * RECORD.size)
                return
            self.last = -1
        if not ok:
            os.ftruncate(fd, 0)
            os.write(fd, HEADER.pack(MAGIC, log_stat.st_ino))
        if log_stat.st_size > 0:
            self._write(int(log_stat.st_mtime * 1e6), 0)

    def chunk(self, now_us: int, offset: int) -> None:
        """A chunk read at ``now_us`` is about to be written at ``offset``."""
        if now_us - self.last >= RESOLUTION:
            self._write(now_us, offset)

    def _write(self, now_us: int, offset: int) -> None:
        self.last = max(now_us, self.last)
        try:
            if os.write(self.fd, RECORD.pack(self.last, offset)) != RECORD.size:
                # a record cut short (the disk filled up mid-write): cut off, so the next one
                # lands where readers look for it
                os.ftruncate(self.fd, os.fstat(self.fd).st_size // RECORD.size * RECORD.size)
                self.failed = True
        except OSError:  # a full disk: the lines get the times of the records before them
            self.failed = True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Index:
    """The records of one log file's index, read lazily by pread: ``count`` records after
    the header. ``fd`` is -1 for a log without a usable index: then every line is taken as
    written at ``mtime`` (µs)."""

    fd: int
    count: int
    mtime: int

    def record(self, i: int) -> tuple[int, int]:
        t, off = RECORD.unpack(os.pread(self.fd, RECORD.size, (i + 1) * RECORD.size))
        return int(t), int(off)

    def find_time(self, t_us: int) -> int:
        """The offset to scan from for lines at or after ``t_us``: that of the last record
        before ``t_us`` (a line starting in its chunk may be later), 0 if none."""
        lo, hi = 0, self.count
        while lo < hi:  # the first record at or after t_us
            mid = (lo + hi) // 2
            if self.record(mid)[0] < t_us:
                lo = mid + 1
            else:
                hi = mid
        return self.record(lo - 1)[1] if lo > 0 else 0

    def find_offset(self, offset: int) -> int:
        """The number of the last record at or before ``offset`` (-1: none)."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if self.record(mid)[1] <= offset:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    def refresh(self) -> None:
        """Records appended since it was opened (a followed file)."""
        if self.fd >= 0:
            self.count = max(0, os.fstat(self.fd).st_size // RECORD.size - 1)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Times:
    """The time of each line of a log read forward from some offset: ``at(offset)`` for
    offsets that never go back, reading the records ahead a page at a time. A followed
    log's index grows: ``refresh`` takes the records added since."""

    def __init__(self, index: Index, start: int) -> None:
        self.index = index
        self.page: list[tuple[int, int]] = []
        self.offsets: list[int] = []
        self.next = 0  # the number of the first record not in ``page``
        self.current = index.mtime
        self.limit = -1  # offsets below this have ``current`` (the next record's offset)
        if index.fd >= 0:
            i = index.find_offset(start)
            if i >= 0:
                self.next = i
                self._load()

    def _load(self) -> bool:
        index = self.index
        if index.fd < 0 or self.next >= index.count:
            return False
        n = min(READ_RECORDS, index.count - self.next)
        data = os.pread(index.fd, n * RECORD.size, (self.next + 1) * RECORD.size)
        n = len(data) // RECORD.size
        if n == 0:
            return False
        self.page = [RECORD.unpack_from(data, k * RECORD.size) for k in range(n)]
        self.offsets = [off for _, off in self.page]
        self.next += n
        return True

    def refresh(self) -> None:
        if self.index.fd >= 0:
            count = self.index.count
            self.index.refresh()
            if self.index.count > count:
                self.limit = -1

    def at(self, offset: int) -> int:
        """The time (µs) of a line starting at ``offset``."""
        if offset < self.limit:
            return self.current  # most lines: in the same chunk as the one before
        while True:
            k = bisect.bisect_right(self.offsets, offset)
            if k:
                self.current = self.page[k - 1][0]
            if k < len(self.page):
                self.limit = self.offsets[k]
                return self.current
            if not self._load():
                self.limit = 1 << 63  # past the last record: its time, until ``refresh`` finds more
                return self.current


def open_index(dirfd: int, log_name: str, log_fd: int, where: Path) -> Index:
    """The index of the log ``log_name`` (open as ``log_fd``), if it is that file's; else one
    that dates every line at the log's mtime. The index is opened as the logs are (no link
    followed, a regular file of ours)."""
    st = os.fstat(log_fd)
    mtime = int(st.st_mtime * 1e6)
    try:
        fd, ist = open_log_file(dirfd, index_name(log_name), READ_FLAGS, where)
    except OSError:
        return Index(-1, 0, mtime)
    with contextlib.suppress(OSError):
        head = os.pread(fd, HEADER.size, 0)
        if len(head) == HEADER.size and HEADER.unpack(head) == (MAGIC, st.st_ino):
            return Index(fd, max(0, ist.st_size // RECORD.size - 1), mtime)
    os.close(fd)
    return Index(-1, 0, mtime)

