"""Reading the captured logs back: the last lines of a replica's stream across its rotated
files, and following them as they are written. Runs in the reader's process (the ``logs``
command, any tool, and the daemon's HTTP API for ``GET /v1/logs``): it only reads the
files, so it works with the daemon down and after the replicas ended.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from .logfiles import READ_FLAGS, backup_names, base_name, check_id, check_stream, open_dir, open_log_file
from .protocol import pool_name

CHUNK = 64 << 10  # bytes per read of a file

def _open_chain(dirfd: int, name: str, where: Path) -> list[tuple[int, int]]:
    """(fd, size) of the current file then .1, .2 ..., newest first; a file seen twice (a
    rotation while we opened them) once. The caller closes the fds."""
    out: list[tuple[int, int]] = []
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
            out.append((fd, st.st_size))
    except BaseException:
        for fd, _ in out:
            os.close(fd)
        raise
    return out


def _last_lines(files: list[tuple[int, int]], lines: int) -> tuple[list[bytes], bytes]:
    """The last ``lines`` whole lines of files read as one stream, newest file first, each
    up to its given size; and the unterminated tail (a line still being written)."""
    chunks: list[bytes] = []
    newlines = 0
    for fd, size in files:
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
        for fd, _ in files:
            os.close(fd)
    if partial:
        whole = [*whole, partial][-lines:]
    return [_decode(x) for x in whole]


class _Follower:
    """One replica's current file, read as it grows; a rotation (the file replaced) is
    followed: the old file is read to its end first, then the new one from its start."""

    IDLE_FLUSH = 0.5  # seconds an unterminated line waits for its end before it is shown

    def __init__(self, replica_id: str, name: str) -> None:
        self.replica_id = replica_id
        self.name = name
        self.fd = -1
        self.ino: tuple[int, int] | None = None
        self.pos = 0
        self.partial = b""
        self.partial_since = 0.0

    def start(self, dirfd: int, where: Path, lines: int) -> list[bytes]:
        """Open the chain as it is now: the last ``lines`` lines, and the offset to go on from."""
        files = _open_chain(dirfd, self.name, where)
        try:
            if not files:
                return []
            whole, partial = _last_lines(files, lines) if lines > 0 else ([], b"")
            fd, size = files[0]
            st = os.fstat(fd)
            if os.stat(self.name, dir_fd=dirfd, follow_symlinks=False).st_ino != st.st_ino:
                return whole  # rotated while we looked: the new file is picked up from 0
            self.fd, self.ino = fd, (st.st_dev, st.st_ino)
            files[0] = (-1, 0)
            # An unterminated last line is not shown yet: it is read again from its start.
            self.pos = size - len(partial) if lines > 0 and len(partial) <= size else size
            return whole
        except FileNotFoundError:
            return []
        finally:
            for fd, _ in files:
                if fd >= 0:
                    os.close(fd)

    def poll(self, dirfd: int, where: Path, now: float) -> list[bytes]:
        out: list[bytes] = []
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
                got += self._read(out)
        if got:
            self.partial_since = now
        elif self.partial and now - self.partial_since >= self.IDLE_FLUSH:
            out.append(self.partial)
            self.partial = b""
        return out

    def _read_backups(self, dirfd: int, old: tuple[int, int] | None, where: Path, out: list[bytes]) -> int:
        """Read whole, oldest first, the backups newer than the file ``old``; bytes read."""
        got = 0
        for name in self._newer_backups(dirfd, old):
            try:
                self.fd, _ = open_log_file(dirfd, name, READ_FLAGS, where)
            except OSError:
                continue
            self.pos = 0
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

    def _read(self, out: list[bytes]) -> int:
        """Append the whole lines that were added since the last read; returns the bytes read."""
        if os.fstat(self.fd).st_size < self.pos:  # truncated under us (copy-truncate by hand)
            self.pos = 0
        got = 0
        while True:
            data = os.pread(self.fd, CHUNK, self.pos)
            if not data:
                return got
            got += len(data)
            self.pos += len(data)
            data = self.partial + data
            body, sep, self.partial = data.rpartition(b"\n")
            if sep:
                out.extend(body.split(b"\n"))
            else:
                self.partial = data
            if len(self.partial) > CHUNK:  # a line without end: show it in pieces
                out.append(self.partial)
                self.partial = b""

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

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
    ``prefix``), until ``stop()`` is true. ``lines``: first the last N lines of each, as one
    consistent start (nothing is shown twice nor missed between the two). ``pool``: replicas
    of that pool whose logs appear later are followed too, from their first line. Files are
    polled every ``interval`` seconds (a reader in the CLI, not in the daemon); a rotation
    is followed, a log not there yet is picked up when it appears."""
    check_stream(stream)
    where = Path(logs_dir)
    followers: dict[str, _Follower] = {}
    dirfd = open_dir(where)

    def fmt(rid: str, line: bytes) -> str:
        text = _decode(line)
        return f"{rid} | {text}" if prefix else text

    try:
        for rid in replica_ids:
            check_id(rid)
            f = followers[rid] = _Follower(rid, f"{base_name(rid)}.{stream}")
            if dirfd is not None:
                for line in f.start(dirfd, where, lines):
                    yield fmt(rid, line)
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
                            followers[rid] = _Follower(rid, f"{rid}.{stream}")
            # Asked before the poll: what was written before stop() turned true (a task's
            # last lines, written before its end was recorded) is shown, then it returns.
            stopping = stop()
            if dirfd is not None:
                for rid, f in followers.items():
                    for line in f.poll(dirfd, where, now):
                        yield fmt(rid, line)
            if stopping:
                for f in followers.values():
                    if f.partial:
                        yield fmt(f.replica_id, f.partial)
                        f.partial = b""
                return
            time.sleep(interval)
    finally:
        for f in followers.values():
            f.close()
        if dirfd is not None:
            os.close(dirfd)
