"""The daemon's own log output, which must never block the control loop.

``start --foreground`` writes its log to stderr, and stderr may be a pipe whose reader
stalls (``docker logs``, ``| logger``): a plain StreamHandler would then block the loop on
the next line, and with it every command and every reap. ``LogSink`` keeps lines in a
bounded buffer and writes only what the fd takes right now: a pipe that polls writable has
room for at least one page, so a write of at most ``PIPE_BUF`` bytes cannot block. The
reactor wakes it when the fd turns writable again. What does not fit in the buffer is
dropped and counted, and so is what a failing fd refuses (ENOSPC, EPIPE, EIO): the daemon
keeps supervising either way. The fd's own flags are left alone (O_NONBLOCK would be shared
with every process that inherited it).

When the log is ``logs/daemon.log`` (a detached daemon's stdout and stderr), ``rotate_file``
bounds it as replicas' logs are bounded: once a write would take it past ``max_bytes``
(default 10 MiB) it becomes ``daemon.log.1`` (``.1`` the newest, ``backups`` of them, 3 by
default) and a new ``daemon.log`` is opened onto the same fds, so Python's own last-resort
output (a traceback on fd 2) follows it. Only the daemon's own lines go there: probes and
spawners write to logs of their own (``<id>.probe``, ``spawner.log``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import stat

PIPE_BUF = select.PIPE_BUF
LIMIT = 1 << 20  # bytes of log held while the reader is stalled
MAX_BYTES = 10 << 20  # daemon.log is rotated before it grows past this...
BACKUPS = 3  # ...keeping this many old ones
_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class _Rotation:
    """The file behind the sink's fd, rotated at ``max_bytes`` keeping ``backups`` old ones."""

    def __init__(self, dirfd: int, name: str, size: int, max_bytes: int, backups: int) -> None:
        self.dirfd, self.name, self.size = dirfd, name, size
        self.max_bytes, self.backups = max_bytes, backups

    def rotate(self, fds: tuple[int, ...]) -> None:
        """Shift the old files (the oldest unlinked first: no rename replaces a file), then
        open a new one onto ``fds``. OSError: the current file stays, and grows."""
        name, dirfd = self.name, self.dirfd
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{name}.{self.backups}" if self.backups else name, dir_fd=dirfd)
        for i in range(self.backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{name}.{i}", f"{name}.{i + 1}", src_dir_fd=dirfd, dst_dir_fd=dirfd)
        if self.backups:
            with contextlib.suppress(FileNotFoundError):
                os.rename(name, f"{name}.1", src_dir_fd=dirfd, dst_dir_fd=dirfd)
        fd = os.open(name, _OPEN_FLAGS, 0o600, dir_fd=dirfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
                raise OSError(errno.EPERM, f"{name} is not a regular file of ours with a single link")
            os.set_blocking(fd, True)
            for target in fds:
                os.dup2(fd, target, inheritable=target <= 2)
        finally:
            os.close(fd)
        self.size = st.st_size


class LogSink(logging.Handler):
    """A logging handler that is also a reactor Writer (pending/flush/fileno)."""

    def __init__(self, fd: int = 2, limit: int = LIMIT) -> None:
        super().__init__()
        self.fd = fd
        self.limit = limit
        self.dropped = 0  # lines that found the buffer full
        self.failed = 0  # bytes the fd refused (a full disk, a closed pipe)
        self._buf = bytearray()
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)
        self._rotation: _Rotation | None = None
        self._same: tuple[int, ...] = (fd,)  # the fds that point at the rotated file

    def rotate_file(self, path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES, backups: int = BACKUPS,
                    also: tuple[int, ...] = (1,)) -> bool:
        """Rotate the file at ``path`` if it is what our fd writes to (the detached daemon's
        daemon.log; not a pipe, a terminal or systemd's journal). ``also``: other fds that
        point at it too (stdout) follow each rotation. True if rotation is on."""
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode) or max_bytes < 1 or backups < 0:
                return False
            path = os.fspath(path)
            dirfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            named = os.stat(os.path.basename(path), dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            named = None
        if named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
            os.close(dirfd)
            return False
        same = [self.fd]
        for fd in also:
            with contextlib.suppress(OSError):
                other = os.fstat(fd)
                if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                    same.append(fd)
        if self._rotation is not None:
            os.close(self._rotation.dirfd)
        self._rotation = _Rotation(dirfd, os.path.basename(path), st.st_size, max_bytes, backups)
        self._same = tuple(same)
        return True

    def _room(self, n: int) -> int:
        """How much of the next ``n`` bytes to write now: rotated first if they would take
        the file past its bound, and cut at the bound (a file never exceeds it)."""
        rot = self._rotation
        if rot is None:
            return n
        if rot.size > 0 and rot.size + n > rot.max_bytes:
            try:
                rot.rotate(self._same)
            except OSError as err:  # it keeps growing rather than losing lines
                log_line = f"orchestrator: cannot rotate {rot.name}: {err.strerror or err}\n".encode()
                rot.size = 0  # tried again after another max_bytes
                self._buf[:0] = log_line
                return min(len(log_line), PIPE_BUF)
        return max(1, min(n, rot.max_bytes - rot.size))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
        except Exception:  # a bad format argument in a log call must not end the loop
            self.handleError(record)
            return
        if len(self._buf) + len(line) > self.limit:
            self.dropped += 1
            return
        if self.dropped and not self._buf:
            note = f"orchestrator: {self.dropped} log line(s) dropped while the log output was stalled\n"
            self._buf += note.encode()
            self.dropped = 0
        self._buf += line
        self.flush()

    def pending(self) -> bool:
        return bool(self._buf)

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        while self._buf:
            try:
                if not self._poll.poll(0):
                    return  # full: the reactor calls again once the fd is writable
                n = os.write(self.fd, self._buf[:self._room(min(len(self._buf), PIPE_BUF))])
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:
                self.failed += len(self._buf)
                self._buf.clear()
                return
            del self._buf[:n]
            if self._rotation is not None:
                self._rotation.size += n


def install(level: int = logging.INFO, fd: int = 2) -> LogSink:
    """Route the ``orchestrator`` logs (and the root logger's) through a LogSink on ``fd``."""
    sink = LogSink(fd)
    sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [sink]
    root.setLevel(level)
    return sink
