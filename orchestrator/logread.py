"""Reading the captured logs back: the last lines of a replica's stream across its rotated
files, and following them as they are written; journalctl's filters (``LineFilter``: a time
range by the read times kept beside each file, logindex.py, and a pattern) on both. Runs in the reader's process (the ``logs``
command, any tool, and the daemon's HTTP API for ``GET /v1/logs``): it only reads the
files, so it works with the daemon down and after the replicas ended.
"""

from __future__ import annotations

import collections
import datetime
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from .errors import UsageError
from .logfiles import READ_FLAGS, backup_names, base_name, check_id, check_stream, open_dir, open_log_file
from .logindex import Index, Times, open_index
from .protocol import pool_name

CHUNK = 64 << 10  # bytes per read of a file
T = TypeVar("T")
R = TypeVar("R")
AGO = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_AGO = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,6})?)([smhd])")


def parse_when(text: str, now: float | None = None) -> float:
    """A time given as journalctl takes it: ISO 8601 (``2026-12-02T06:00``, ``... 06:00:00.250``,
    with ``Z`` or an offset; without one, local time), ``now``, or a span ago (``30s``,
    ``10m``, ``2h``, ``1d``). Unix seconds; UsageError (one line) for anything else."""
    text = text.strip()
    now = time.time() if now is None else now
    m = _AGO.fullmatch(text)
    if m:
        return now - float(m.group(1)) * AGO[m.group(2)]
    if text == "now":
        return now
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"not a time: {text!r} (give an ISO 8601 time such as 2026-12-02T06:00:00, "
                         f"or a span ago: 30s, 10m, 2h, 1d)") from None
    return when.timestamp()  # a naive time is local time, as journalctl takes it


def stamp(t: float) -> str:
    """journalctl's short-iso-precise, to the millisecond: local time with its offset."""
    local = datetime.datetime.fromtimestamp(t).astimezone()
    return local.isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class LineFilter:
    """Which lines to show: read at or after ``since``, at or before ``until`` (unix
    seconds), whose decoded text ``grep`` finds a match in."""

    since: float | None = None
    until: float | None = None
    grep: re.Pattern[str] | None = None

    @property
    def timed(self) -> bool:
        return self.since is not None or self.until is not None

    def keep(self, t_us: int, text: str) -> bool:
        if self.since is not None and t_us < self.since * 1e6:
            return False
        if self.until is not None and t_us > self.until * 1e6:
            return False
        return self.grep is None or self.grep.search(text) is not None


def compile_grep(pattern: str) -> re.Pattern[str]:
    """A Python regular expression; UsageError (one line) if it is not one."""
    try:
        return re.compile(pattern)
    except re.error as err:
        raise UsageError(f"--grep: not a regular expression: {pattern!r}: {err}") from None


@dataclass(frozen=True)
class Line:
    """One line of a log, with the time the daemon read it (logindex.py)."""

    log_id: str
    stream: str
    time: float
    text: str

    def as_dict(self) -> dict[str, object]:
        who = "task" if "/" in self.log_id else "replica"
        return {"time": stamp(self.time), "ts": round(self.time, 6), who: self.log_id, "stream": self.stream,
                "line": self.text}

def _open_chain(dirfd: int, name: str, where: Path) -> list[tuple[int, int, str]]:
    """(fd, size, name) of the current file then .1, .2 ..., newest first; a file seen twice
    (a rotation while we opened them) once. The caller closes the fds."""
    out: list[tuple[int, int, str]] = []
    seen: set[tuple[int, int]] = set()
    try:
        for n in [name, *backup_names(dirfd, name)]:
            try:
                fd, st = open_log_file(dirfd, n, READ_FLAGS, where)
            except FileNotFoundError:
                continue
            except OSError:  # a link or a FIFO planted there: not a log of ours, skip it
                continue
            if (st.st_dev, st.st_ino) in seen:
                os.close(fd)
                continue
            seen.add((st.st_dev, st.st_ino))
            out.append((fd, st.st_size, n))
    except BaseException:
        for fd, *_ in out:
            os.close(fd)
        raise
    return out


def _last_lines(files: list[tuple[int, int, str]], lines: int) -> tuple[list[bytes], bytes]:
    """The last ``lines`` whole lines of files read as one stream, newest file first, each
    up to its given size; and the unterminated tail (a line still being written)."""
    chunks: list[bytes] = []
    newlines = 0
    for fd, size, _ in files:
        pos = size
        while pos > 0 and newlines <= lines:
            k = min(CHUNK, pos)
            pos -= k
            data = os.pread(fd, k, pos)
            chunks.append(data)
            newlines += data.count(b"\n")
        if newlines > lines:
            break
    blob = b"".join(reversed(chunks))
    body, sep, partial = blob.rpartition(b"\n")
    if not sep:
        body, partial = b"", blob
    whole = body.split(b"\n") if sep else []
    return (whole[-lines:] if lines > 0 else []), partial


def _decode(line: bytes) -> str:
    return line.decode("utf-8", "replace")


def tail(logs_dir: str | os.PathLike[str], replica_id: str, *, stream: str = "out", lines: int = 10) -> list[str]:
    """The last ``lines`` lines of a replica's stream (or a task's: ``replica_id`` POOL/N),
    across its rotated files (a line still being written counts as the last one); [] if it
    has no log."""
    check_id(replica_id)
    name = f"{base_name(replica_id)}.{check_stream(stream)}"
    if lines <= 0:
        return []
    dirfd = open_dir(logs_dir)
    if dirfd is None:
        return []
    try:
        files = _open_chain(dirfd, name, Path(logs_dir))
    finally:
        os.close(dirfd)
    try:
        whole, partial = _last_lines(files, lines)
    finally:
        for fd, *_ in files:
            os.close(fd)
    if partial:
        whole = [*whole, partial][-lines:]
    return [_decode(x) for x in whole]


def _line_start(fd: int, offset: int, size: int) -> int:
    """``offset`` if a line starts there, else the start of the next line (a chunk read from
    the pipe may end mid-line; the line it cut belongs to the chunk before)."""
    if offset <= 0 or os.pread(fd, 1, offset - 1) == b"\n":
        return max(0, offset)
    pos = offset
    while pos < size:
        data = os.pread(fd, min(CHUNK, size - pos), pos)
        if not data:
            break
        nl = data.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(data)
    return size


def _starts(files: list[tuple[int, int, str, Index]], lines: int | None, filt: LineFilter) -> list[int]:
    """Where to start reading each file (oldest first) so that nothing wanted is skipped:
    by the index for ``since`` (a binary search: the cost does not grow with the log), from
    the end back far enough for the last ``lines`` when nothing else filters, else 0. A
    file to skip whole starts at its size."""
    if filt.since is not None:
        since_us = int(filt.since * 1e6)
        out = []
        for fd, size, _, index in files:
            if index.count == 0:  # no index: every line dated by the file's mtime
                out.append(size if index.mtime < since_us else 0)
            elif index.record(index.count - 1)[0] < since_us:
                # lines after the last record have its time: all of this file is older
                out.append(size)
            else:
                out.append(_line_start(fd, index.find_time(since_us), size))
        return out
    out = [0] * len(files)
    if lines is None or filt.grep is not None or filt.until is not None:
        return out
    newlines = 0
    for k in range(len(files) - 1, -1, -1):
        fd, size, _, _ = files[k]
        pos = size
        while pos > 0 and newlines <= lines:
            n = min(CHUNK, pos)
            pos -= n
            newlines += os.pread(fd, n, pos).count(b"\n")
        out[k] = _line_start(fd, pos, size)
        if newlines > lines:
            out[:k] = [files[i][1] for i in range(k)]
            break
    return out


def _timed(files: list[tuple[int, int, str, Index]], lines: int | None, filt: LineFilter,
           hold_partial: bool) -> tuple[list[tuple[int, bytes]], int]:
    """The (time µs, line) pairs of files read as one stream (oldest first) that ``filt``
    keeps, the last ``lines`` of them (None: all); and the offset in the newest file of its
    unterminated last line (its size if none), which ``hold_partial`` leaves out."""
    kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=lines)
    until_us = None if filt.until is None else int(filt.until * 1e6)
    resume = files[-1][1] if files else 0
    for k, ((fd, size, _, index), start) in enumerate(zip(files, _starts(files, lines, filt))):
        times = Times(index, start)
        pos, partial = start, b""
        while pos < size:
            data = os.pread(fd, min(CHUNK, size - pos), pos)
            if not data:
                break
            base = pos - len(partial)
            pos += len(data)
            body, sep, rest = (partial + data).rpartition(b"\n")
            if not sep:
                partial = rest
                continue
            partial = rest
            for line in body.split(b"\n"):
                t = times.at(base)
                base += len(line) + 1
                if until_us is not None and t > until_us:
                    return list(kept), resume  # times only grow: nothing later is wanted
                if filt.keep(t, _decode(line) if filt.grep is not None else ""):
                    kept.append((t, line))
        if partial:
            if k == len(files) - 1 and hold_partial:
                resume = size - len(partial)
            else:
                t = times.at(size - len(partial))
                if (until_us is None or t <= until_us) and filt.keep(t, _decode(partial)):
                    kept.append((t, partial))
    return list(kept), resume


def read_lines(logs_dir: str | os.PathLike[str], log_id: str, *, stream: str = "out", lines: int | None = 10,
               filt: LineFilter = LineFilter()) -> list[Line]:
    """The lines of a replica's (or a task's) stream across its rotated files that ``filt``
    keeps, each with the time the daemon read it; the last ``lines`` of them (None: all)."""
    check_id(log_id)
    name = f"{base_name(log_id)}.{check_stream(stream)}"
    if lines is not None and lines <= 0:
        return []
    where = Path(logs_dir)
    dirfd = open_dir(where)
    if dirfd is None:
        return []
    try:
        files = _open_chain(dirfd, name, where)
        try:
            found, _ = _with_indexes(dirfd, where, files, lambda chain: _timed(chain, lines, filt, hold_partial=False))
        finally:
            for fd, *_ in files:
                os.close(fd)
    finally:
        os.close(dirfd)
    return [Line(log_id, stream, t / 1e6, _decode(b)) for t, b in found]


def _with_indexes(dirfd: int, where: Path, files: list[tuple[int, int, str]],
                  read: Callable[[list[tuple[int, int, str, Index]]], T]) -> T:
    """``read`` of the files (given newest first) oldest first, each with its index."""
    indexes: list[Index] = []
    try:
        chain = []
        for fd, size, n in files[::-1]:
            indexes.append(open_index(dirfd, n, fd, where))
            chain.append((fd, size, n, indexes[-1]))
        return read(chain)
    finally:
        for index in indexes:
            index.close()


class _Follower:
    """One replica's current file, read as it grows; a rotation (the file replaced) is
    followed: the old file is read to its end first, then the new one from its start.
    ``timed``: each line comes with the time the daemon read it (from the index beside
    each file, logindex.py); else with 0."""

    IDLE_FLUSH = 0.5  # seconds an unterminated line waits for its end before it is shown

    def __init__(self, replica_id: str, name: str, timed: bool = False) -> None:
        self.replica_id = replica_id
        self.name = name
        self.timed = timed
        self.fd = -1
        self.ino: tuple[int, int] | None = None
        self.pos = 0
        self.partial = b""
        self.partial_since = 0.0
        self.times: Times | None = None  # the open file's index, when timed...
        self.attached: tuple[int, str, Path] | None = None  # ...and where it was looked for

    def start(self, dirfd: int, where: Path, lines: int) -> list[bytes]:
        """Open the chain as it is now: the last ``lines`` lines, and the offset to go on from."""

        def last(files: list[tuple[int, int, str]]) -> tuple[list[bytes], int]:
            whole, partial = _last_lines(files, lines) if lines > 0 else ([], b"")
            # An unterminated last line is not shown yet: it is read again from its start.
            size = files[0][1]
            return whole, size - len(partial) if lines > 0 and len(partial) <= size else size

        return self._start(dirfd, where, last)

    def start_filtered(self, dirfd: int, where: Path, lines: int | None,
                       filt: LineFilter) -> list[tuple[int, bytes]]:
        """``start`` for lines that ``filt`` keeps (the last ``lines``, None: all), with times."""
        return self._start(dirfd, where, lambda files: _with_indexes(
            dirfd, where, files, lambda chain: _timed(chain, lines, filt, hold_partial=True)))

    def _start(self, dirfd: int, where: Path, read: Callable[[list[tuple[int, int, str]]], tuple[list[R], int]]
               ) -> list[R]:
        """The chain as it is now, newest first, given to ``read``, which says what to show
        and the offset in the newest file to go on from."""
        files = _open_chain(dirfd, self.name, where)
        try:
            if not files:
                return []
            found, pos = read(files)
            self._keep_newest(dirfd, where, files, pos)
            return found
        except FileNotFoundError:
            return []
        finally:
            for fd, *_ in files:
                if fd >= 0:
                    os.close(fd)

    def _keep_newest(self, dirfd: int, where: Path, files: list[tuple[int, int, str]], pos: int) -> None:
        """Go on from ``pos`` in the newest of ``files`` (taken out of the list), unless it
        was rotated while we looked: then the new file is picked up from 0."""
        fd = files[0][0]
        st = os.fstat(fd)
        if os.stat(self.name, dir_fd=dirfd, follow_symlinks=False).st_ino != st.st_ino:
            return
        self.fd, self.ino, self.pos = fd, (st.st_dev, st.st_ino), pos
        files[0] = (-1, 0, "")
        self._attach(dirfd, self.name, where)

    def _attach(self, dirfd: int, name: str, where: Path) -> None:
        """The index of the file just opened as ``self.fd`` (``name``), when timed."""
        if self.times is not None:
            self.times.index.close()
            self.times = None
        if self.timed and self.fd >= 0:
            self.attached = (dirfd, name, where)
            self.times = Times(open_index(dirfd, name, self.fd, where), self.pos)

    def poll(self, dirfd: int, where: Path, now: float) -> list[bytes]:
        return [line for _, line in self.poll_timed(dirfd, where, now)]

    def poll_timed(self, dirfd: int, where: Path, now: float) -> list[tuple[int, bytes]]:
        """The lines written since the last poll, each with its time (µs; 0 if not timed)."""
        out: list[tuple[int, bytes]] = []
        try:
            st = os.stat(self.name, dir_fd=dirfd, follow_symlinks=False)
            current = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            current = None
        got = 0
        if self.fd >= 0:
            got += self._read(out)  # to its end: a replaced file gets no more writes
            if current is not None and current != self.ino:
                old = self.ino
                self._close()
                # Rotated more than once since the last poll: the files made in between
                # are backups now, newer than ours; read them whole, oldest first.
                got += self._read_backups(dirfd, old, where, out)
        if self.fd < 0 and current is not None:
            if self.ino is None:  # its first file: rotated ones it may already have are older
                got += self._read_backups(dirfd, None, where, out)
            try:
                fd, st2 = open_log_file(dirfd, self.name, READ_FLAGS, where)
            except OSError:
                fd = -1
            if fd >= 0:
                self.fd, self.ino, self.pos = fd, (st2.st_dev, st2.st_ino), 0
                self._attach(dirfd, self.name, where)
                got += self._read(out)
        if got:
            self.partial_since = now
        elif self.partial and now - self.partial_since >= self.IDLE_FLUSH:
            out.append((self._time(self.pos - len(self.partial)), self.partial))
            self.partial = b""
        return out

    def _time(self, offset: int) -> int:
        return self.times.at(max(0, offset)) if self.times is not None else 0

    def _read_backups(self, dirfd: int, old: tuple[int, int] | None, where: Path,
                      out: list[tuple[int, bytes]]) -> int:
        """Read whole, oldest first, the backups newer than the file ``old``; bytes read."""
        got = 0
        for name in self._newer_backups(dirfd, old):
            try:
                self.fd, _ = open_log_file(dirfd, name, READ_FLAGS, where)
            except OSError:
                continue
            self.pos = 0
            self._attach(dirfd, name, where)
            got += self._read(out)
            self._close()
        return got

    def _newer_backups(self, dirfd: int, old: tuple[int, int] | None) -> list[str]:
        """``name.k-1`` .. ``name.1`` where ``name.k`` is the file we read before; all the
        backups if that one is gone (everything kept is newer than it)."""
        newer = []
        for name in backup_names(dirfd, self.name):
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                break
            if (st.st_dev, st.st_ino) == old:
                break
            newer.append(name)
        return newer[::-1]

    def _read(self, out: list[tuple[int, bytes]]) -> int:
        """Append the whole lines that were added since the last read; returns the bytes read."""
        if os.fstat(self.fd).st_size < self.pos:  # truncated under us (copy-truncate by hand)
            self.pos = 0
            if self.times is not None:
                self.times = Times(self.times.index, 0)
        if self.times is not None and self.times.index.fd < 0 and self.attached is not None:
            # A file found empty has no index yet (its first write makes it): look again
            self._attach(*self.attached)
        elif self.times is not None:
            self.times.refresh()
        got = 0
        while True:
            data = os.pread(self.fd, CHUNK, self.pos)
            if not data:
                return got
            base = self.pos - len(self.partial)  # where the first line of data starts
            got += len(data)
            self.pos += len(data)
            data = self.partial + data
            body, sep, self.partial = data.rpartition(b"\n")
            if sep:
                for line in body.split(b"\n"):
                    out.append((self._time(base), line))
                    base += len(line) + 1
            else:
                self.partial = data
            if len(self.partial) > CHUNK:  # a line without end: show it in pieces
                out.append((self._time(base), self.partial))
                self.partial = b""

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.times is not None:
            self.times.index.close()
            self.times = None

    def close(self) -> None:
        self._close()


Follower = _Follower  # for a reader that drives its own polls (the daemon's HTTP API, at each turn's end)


def pool_replicas(logs_dir: str | os.PathLike[str], pool: str, stream: str = "out") -> list[str]:
    """Ids of a pool's replicas that have a log of ``stream`` (``<pool>-<n>.<stream>``, or
    only rotated files of it), in the order of n."""
    pool_name(pool)
    pattern = re.compile(rf"{re.escape(pool)}-([0-9]{{1,18}})\.{check_stream(stream)}(?:\.[0-9]+)?")
    found: dict[int, str] = {}
    try:
        with os.scandir(logs_dir) as it:
            for entry in it:
                m = pattern.fullmatch(entry.name)
                if m:
                    n = int(m.group(1))
                    if m.group(1) == str(n):  # "web-01" is no id the engine makes
                        found[n] = f"{pool}-{n}"
    except FileNotFoundError:
        return []
    return [found[n] for n in sorted(found)]


def follow(logs_dir: str | os.PathLike[str], replica_ids: list[str], *, stream: str = "out", prefix: bool,
           stop: Callable[[], bool], lines: int = 0, pool: str | None = None,
           interval: float = 0.1) -> Iterator[str]:
    """Lines of the replicas' ``stream`` as they are written (``web-3 | line`` with
    ``prefix``), until ``stop()`` is true: ``follow_lines``' text."""
    for line in follow_lines(logs_dir, replica_ids, stream=stream, stop=stop, lines=lines, pool=pool,
                             interval=interval):
        yield f"{line.log_id} | {line.text}" if prefix else line.text


def follow_lines(logs_dir: str | os.PathLike[str], replica_ids: list[str], *, stream: str = "out",
                 stop: Callable[[], bool], lines: int | None = 0, pool: str | None = None,
                 interval: float = 0.1, filt: LineFilter | None = None, timed: bool = False) -> Iterator[Line]:
    """Lines of the replicas' ``stream`` as they are written, until ``stop()`` is true.
    ``lines``: first the last N lines of each (None: all that ``filt`` keeps), as one
    consistent start (nothing is shown twice nor missed between the two). ``pool``: replicas
    of that pool whose logs appear later are followed too, from their first line. ``filt``
    applies to every line, the followed ones too; ``timed`` (or a filter): each line with
    the time the daemon read it (else 0). Files are polled every ``interval`` seconds (a
    reader in the CLI, not in the daemon); a rotation is followed, a log not there yet is
    picked up when it appears."""
    check_stream(stream)
    where = Path(logs_dir)
    followers: dict[str, _Follower] = {}
    dirfd = open_dir(where)
    timed = timed or filt is not None
    keep = filt if filt is not None else LineFilter()

    def made(rid: str, found: list[tuple[int, bytes]]) -> Iterator[Line]:
        for t, raw in found:
            text = _decode(raw)
            if keep.keep(t, text) or not timed:
                yield Line(rid, stream, t / 1e6, text)

    try:
        for rid in replica_ids:
            check_id(rid)
            f = followers[rid] = _Follower(rid, f"{base_name(rid)}.{stream}", timed)
            if dirfd is not None:
                if timed:
                    yield from made(rid, f.start_filtered(dirfd, where, lines, keep))
                else:
                    yield from made(rid, [(0, b) for b in f.start(dirfd, where, lines or 0)])
        next_scan = 0.0
        while True:
            now = time.monotonic()
            if dirfd is None:
                dirfd = open_dir(where)
            if dirfd is not None:
                if pool is not None and now >= next_scan:
                    next_scan = now + 1.0
                    for rid in pool_replicas(where, pool, stream):
                        if rid not in followers:
                            followers[rid] = _Follower(rid, f"{rid}.{stream}", timed)
            # Asked before the poll: what was written before stop() turned true (a task's
            # last lines, written before its end was recorded) is shown, then it returns.
            stopping = stop()
            if dirfd is not None:
                for rid, f in followers.items():
                    yield from made(rid, f.poll_timed(dirfd, where, now))
            if stopping:
                for f in followers.values():
                    if f.partial:
                        yield from made(f.replica_id, [(f._time(f.pos - len(f.partial)), f.partial)])
                        f.partial = b""
                return
            time.sleep(interval)
    finally:
        for f in followers.values():
            f.close()
        if dirfd is not None:
            os.close(dirfd)
