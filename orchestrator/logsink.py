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
"""

from __future__ import annotations

import logging
import os
import select

PIPE_BUF = select.PIPE_BUF
LIMIT = 1 << 20  # bytes of log held while the reader is stalled


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
                n = os.write(self.fd, self._buf[:PIPE_BUF])
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:
                self.failed += len(self._buf)
                self._buf.clear()
                return
            del self._buf[:n]


def install(level: int = logging.INFO, fd: int = 2) -> LogSink:
    """Route the ``orchestrator`` logs (and the root logger's) through a LogSink on ``fd``."""
    sink = LogSink(fd)
    sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [sink]
    root.setLevel(level)
    return sink
