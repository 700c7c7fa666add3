"""Replicas' stdout and stderr, captured in the daemon: pipes the control loop pumps into
size-rotated files (their layout: logfiles.py; read back by logread.py, with the daemon up
or down).

    <logs dir>/<id>.out, <id>.out.1 .. <id>.out.K     stdout, newest first (.K the oldest)
    <logs dir>/<id>.err, <id>.err.1 .. <id>.err.K     stderr
    <logs dir>/<pool>#<n>.out, .err (and their .k)    a task's (tasklogs.py says whose bytes are whose)
    <logs dir>/<any of those>.idx                     the read times of its lines (logindex.py)

Decision: pipes pumped by the control loop (design a), not the log file's fd handed to
the child (design b). Measured side by side in one run of
``.venv/bin/python benchmarks/bench_logs.py --orchestrator`` (the figures: benchmarks/README.md,
its "log capture" row): both keep the loop's timers near idle with a writer at 20 MB/s;
direct fds cost the loop less CPU than pipes. But only pipes give what the contract asks for:
exact rotation with a bounded total (direct: the file grows until someone copy-truncates it,
a stall each time that loses what the child writes meanwhile); a full disk that drops and
counts (direct: the replica's own write fails with ENOSPC, and a Python worker may die of
the exception); a bound on the rate a replica may put on disk; and files made only for
replicas that write, which keeps the churn's cost of capture small where making two files
per replica costs it a large share on a real disk.

How the pump keeps its promises:
  * the child's write end is a plain blocking pipe: when the pipe is full, the CHILD blocks
    on its own write. The daemon's read end is non-blocking and sits in the reactor's epoll
    set (level-triggered), so the daemon never waits on it;
  * work per turn is bounded: at most ``READS_PER_TURN`` reads of ``CHUNK`` bytes per pipe,
    and ``TURN_BUDGET`` bytes for all pipes together (reset at the end of every turn); a pipe
    left with data is simply ready again next turn, so one chatty replica cannot starve the
    loop, nor can many;
  * rate caps: a stream is pumped at most ``RATE`` bytes/s, all of them ``TOTAL_RATE``
    (token buckets); over it the pipe is taken out of the epoll set for the time its bucket
    needs, so the replica blocks on its full pipe. Without them `yes` holds the loop's CPU
    (still bounded per turn) and fills the disk as fast as it takes the writes;
  * a pipe found full (a read that filled the whole chunk) is grown to ``PIPE_SIZE`` with
    F_SETPIPE_SZ, best effort; quiet replicas keep the kernel's 64 KiB, which matters for an
    unprivileged daemon: every pipe counts against the per-user pipe-user-pages-soft limit;
  * a replica's files are made by its first output, or ``CREATE_AFTER`` seconds after
    ``open`` (a timer), whichever comes first: a replica that lived less and wrote nothing
    has no log (``logs`` says so), and costs the churn no file creation;
  * files are opened relative to a descriptor of the logs dir, with O_NOFOLLOW, created
    0600, and refused unless they are regular files of ours with a single link: a planted
    symbolic link is never followed (its output is dropped and counted, with a warning;
    with ``create_after=0`` ``open`` raises OSError instead);
  * rotation is exact: a file never exceeds ``max_bytes``; the cut is put after the last
    newline that fits when there is one, so files end on whole lines; ``backups`` old files
    are kept (.1 the newest), so a stream never holds more than (backups + 1) * max_bytes.
    The oldest is unlinked first, so no rename replaces a file: ext4 flushes the source of
    a replacing rename (auto_da_alloc), a stall in the loop per rotation of a large log
    that unlink-then-rename does not have;
  * a write the disk refuses (ENOSPC, EDQUOT, EIO, EFBIG) drops that data and counts it
    (``dropped``, in bytes); the pipe keeps being read, so neither the daemon nor the replica
    stops, and writing resumes by itself once there is room. A file that cannot be
    (re)opened is retried every ``RETRY`` seconds, its data dropped and counted meanwhile;
  * a write to a regular file cannot be made non-blocking: when the disk is slower than the
    replicas the kernel throttles the writer (balance_dirty_pages). A write that took longer
    than ``SLOW_WRITE`` pauses reading that pipe for ``SLOW_PAUSE``, so the throttling is
    passed on to the replica (it blocks on its full pipe) instead of being paid again and
    again by the loop;
  * each stdout/stderr file keeps its bytes only; the time each chunk was read lives beside
    it, in ``<file>.idx`` (logindex.py: a 16-byte record before the chunk's write, at most
    one per millisecond per file, made by the file's first write), renamed right after its
    file at rotation and removed with it; what it costs the loop: bench_logs.py's (4);
  * ``finish()`` (the replica was reaped) drains what is left in the pipes, bounded by
    ``DRAIN_LIMIT`` per stream (a descendant that still holds the write end and keeps
    writing cannot hold the loop), then closes everything. It runs in the caller's turn: a
    full pipe is at most ``PIPE_SIZE`` bytes to write;
  * a replica's files live as long as its record: ``forget(ids)`` (the journal's retention
    deleted those records) queues their files for removal (a task's only if it wrote, so has
    files: most tasks have none), which the loop works through at
    most ``REMOVE_PER_TURN`` unlinks and ``REMOVE_TURN_TIME`` seconds a turn (an unlink that
    took longer than ``SLOW_WRITE`` pauses it for ``SLOW_PAUSE``), so a prune of thousands of
    records never holds the loop, and a daemon under churn keeps logs/ at the size of the
    journal's history instead of one file pair per replica ever made. A file that cannot be
    removed (EACCES, EROFS, ...) is logged, once until removing works again, and left for
    the start-up scan of a later daemon.
Pipes have one cost the direct fds would not: the read ends live in the daemon, so a
daemon killed -9 leaves its replicas writing into pipes nobody reads (EPIPE / SIGPIPE). The
watchdog ends those replicas anyway (no replica outlives its daemon), so nothing is lost
that was not going to be.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..logfiles import (BACKUP_LIMIT, DIR_FLAGS, INDEX_FLAGS, STREAMS, WRITE_FLAGS, base_name, check_stream,
                        open_log_file)
from ..logindex import IndexWriter, index_name
from ..protocol import parse_replica_id, parse_task_id

if TYPE_CHECKING:
    from .reactor import Reactor, Timer

log = logging.getLogger("orchestrator.logs")  # the name daemon.log has always shown for these lines

CHUNK = 64 << 10  # bytes per read
READS_PER_TURN = 4  # reads of one pipe in one turn (256 KiB)
TURN_BUDGET = 1 << 20  # bytes read from all pipes together in one turn
PIPE_SIZE = 1 << 20  # a chatty stream's pipe (the default pipe-max-size); best effort
DRAIN_LIMIT = 4 << 20  # bytes finish() reads from one stream at most
SLOW_WRITE = 0.05  # seconds: a file write this slow is the kernel throttling us
SLOW_PAUSE = 0.25  # seconds the pipe is then left unread (the replica blocks, not the loop)
RETRY = 1.0  # seconds between attempts to open a log file that could not be opened
RATE = 64 << 20  # bytes/s one stream is pumped at most (then its replica blocks on its pipe)
TOTAL_RATE = 256 << 20  # bytes/s all streams together are pumped at most
BURST = 0.25  # seconds of its rate a quiet stream may write at once
MIN_READ = 4096  # a stream allowed less than this (by its rate) is left unread a while
CREATE_AFTER = 1.0  # seconds: a replica's files are made by its first output or then
REMOVE_PER_TURN = 64  # unlinks of forgotten replicas' files in one turn, at most
REMOVE_TURN_TIME = 0.002  # seconds of unlinking in one turn, after which the rest waits a turn
NOTES_DELAY = 0.25  # seconds a line of the daemon's (a task's marker) may wait for others to write with
DEFAULT_MAX_BYTES = 10 << 20
DEFAULT_BACKUPS = 3


class _Bucket:
    """A token bucket: ``rate`` bytes/s, at most ``BURST`` seconds of it saved up."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: int, now: float) -> None:
        self.rate = rate
        self.burst = max(rate * BURST, CHUNK)
        self.tokens = self.burst
        self.stamp = now

    def available(self, now: float) -> int:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return int(self.tokens)

    def wait(self, want: int) -> float:
        """Seconds until ``want`` bytes are allowed (after ``available``)."""
        return max(0.0, (min(want, self.burst) - self.tokens) / self.rate)


class _File:
    """One rotated file (a replica's stream, or a task's): what a pipe's bytes are written
    into, a file never over ``max_bytes``, ``backups`` old ones kept."""

    def __init__(self, cap: LogCapture, name: str, max_bytes: int, backups: int, eager: bool) -> None:
        self.cap = cap
        self.name = name
        self.max_bytes = max_bytes
        self.backups = backups
        self.bytes = 0  # written to the files
        self.dropped = 0  # read from the pipe and lost (a full disk, a file we could not open)
        self.fd = -1  # the current file
        self.failing = False  # a write or an open failed: reported once, until one succeeds
        self.retry_at = 0.0
        self.created = False  # a file was opened (it exists, unless someone removed it)
        self.size = 0
        self.slow = False  # the last write took longer than SLOW_WRITE (the kernel throttles us)
        self.finished = False  # its writer is done: a late line opens it for itself only
        self.notes = bytearray()  # lines of the daemon's (a task's marker), written at the turn's end
        # stdout and stderr have their lines' times beside them (logindex.py); probes' and
        # spawners' logs do not (nobody filters them by time)
        self.indexed = cap.index and name.endswith((".out", ".err"))
        self.index: IndexWriter | None = None  # made by the first write to the file (none for a silent one)
        self.index_tried = False  # for the file open now
        if eager:
            self.fd, st = open_log_file(cap.dirfd, self.name, WRITE_FLAGS, cap.logs_dir)
            self.size, self.created = st.st_size, True

    def store(self, buf: bytes | bytearray, n: int) -> None:
        """Write buf[:n] to the current file, rotating at ``max_bytes``."""
        if self.notes and buf is not self.notes:
            self.write_notes()  # the daemon's lines stay where they were said, among the output
        if self.finished and self.fd < 0:
            if self._reopen(now=True):
                self._store(buf, n)
                self.close()
            else:
                self._drop(n)
            return
        self._store(buf, n)

    def _store(self, buf: bytes | bytearray, n: int) -> None:
        view = memoryview(buf)
        start = 0
        while start < n:
            if self.fd < 0 and not self._reopen():
                self._drop(n - start)
                return
            room = self.max_bytes - self.size
            if n - start <= room:
                end = n
            else:
                nl = buf.rfind(b"\n", start, start + room) if room > 0 else -1
                if nl >= 0:
                    end = nl + 1
                elif self.size > 0:
                    if not self._rotate():  # keep the bound: drop the rest, try again next time
                        self._drop(n - start)
                        return
                    continue
                else:
                    end = start + room  # a line longer than a whole file
            written = self._write(view, start, end)
            if written < end - start:
                self._drop(n - start - written)
                return
            start = end

    def note(self, line: str) -> None:
        """A line of the daemon's own (a task's marker), written within NOTES_DELAY with
        the others said meanwhile (one write for a burst of tiny tasks, not one each: a
        write to a file costs more than the rest of a tiny task's log), and before any
        output read after it."""
        if not self.notes:
            self.cap._noted.append(self)
            if self.cap._notes_timer is None:
                self.cap._notes_timer = self.cap.reactor.call_later(NOTES_DELAY, self.cap._write_notes)
        self.notes += line.encode("utf-8", "replace") + b"\n"

    def write_notes(self) -> None:
        notes, self.notes = self.notes, bytearray()
        if notes:
            self.store(notes, len(notes))

    def _write(self, view: memoryview, start: int, end: int) -> int:
        done = 0
        began = time.perf_counter()
        if self.indexed:
            if self.index is None and not self.index_tried:
                self._open_index()
            if self.index is not None:
                self.index.chunk(int(self.cap.clock() * 1e6), self.size)
        while start + done < end:
            try:
                k = os.write(self.fd, view[start + done:end])
            except InterruptedError:
                continue
            except OSError as err:
                self._failed(f"writing {self.name}", err)
                break
            if k <= 0:
                break
            done += k
        self.slow = time.perf_counter() - began > SLOW_WRITE
        self.size += done
        self.bytes += done
        self.cap._bytes += done
        if done == end - start and self.failing:
            self.failing = False
            log.warning("%s: writing again (%d bytes dropped so far)", self.name, self.dropped)
        return done

    def _drop(self, n: int) -> None:
        self.dropped += n
        self.cap._dropped += n

    def _failed(self, what: str, err: OSError) -> None:
        if not self.failing:
            self.failing = True
            log.warning("%s: %s; its output is dropped (and counted) until it can be written",
                        what, err.strerror or err)

    def _rotate(self) -> bool:
        """current -> .1 -> .2 .. -> .K (gone); True if there is an empty current file now."""
        dirfd = self.cap.dirfd
        self._close_file()
        try:
            # Oldest first, so that no rename replaces an existing file: ext4 flushes the
            # source of a replacing rename (auto_da_alloc), ~8 ms for a 10 MiB log, in the loop.
            # Each index goes with its log, renamed right after it (a reader that looks in
            # between finds an index of another file, and knows it by its inode).
            chain = [self.name] + [f"{self.name}.{i}" for i in range(1, self.backups + 1)]
            for name in self._with_index(chain[-1]):  # the oldest (the current one, if none is kept)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dirfd)
            for i in range(len(chain) - 2, -1, -1):
                for old, new in zip(self._with_index(chain[i]), self._with_index(chain[i + 1])):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(old, new, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except OSError as err:
            self._failed(f"rotating {self.name}", err)
        return self._reopen(now=True) and self.size == 0

    def _with_index(self, name: str) -> tuple[str, ...]:
        """A log file's name, and its index's: what a rotation moves together."""
        return (name, index_name(name)) if self.indexed else (name,)

    def _open_index(self) -> None:
        """The index of the file open now, at its first write; without one (it cannot be
        opened) its lines are dated by the file's mtime, and the output is kept all the same."""
        self.index_tried = True
        try:
            st = os.fstat(self.fd)
            fd, _ = open_log_file(self.cap.dirfd, index_name(self.name), INDEX_FLAGS, self.cap.logs_dir)
        except OSError as err:
            log.warning("opening %s: %s; the lines of %s are dated by its mtime", index_name(self.name),
                        err.strerror or err, self.name)
            return
        try:
            self.index = IndexWriter(fd, st)
        except OSError as err:
            os.close(fd)
            log.warning("starting %s: %s; the lines of %s are dated by its mtime", index_name(self.name),
                        err.strerror or err, self.name)

    def _reopen(self, now: bool = False) -> bool:
        if self.cap.dirfd < 0:
            return False
        if not now and self.cap.reactor.monotonic() < self.retry_at:
            return False
        try:
            self.fd, st = open_log_file(self.cap.dirfd, self.name, WRITE_FLAGS, self.cap.logs_dir)
        except OSError as err:
            self.retry_at = self.cap.reactor.monotonic() + RETRY
            self._failed(f"opening {self.name}", err)
            return False
        self.size, self.created = st.st_size, True
        return True

    def create(self) -> None:
        """Its file exists from now on, written or not."""
        if self.fd < 0 and not self.created and not self.finished:
            self._reopen()

    def close(self) -> None:
        """Done with it: the notes still held are written, the file closed."""
        if self.notes and self.cap.dirfd >= 0:
            self.finished = False
            self.write_notes()
        self.finished = True
        self._close_file()

    def _close_file(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.index is not None:
            self.index.close()
            self.index = None
        self.index_tried = False


File = _File  # a rotated file: a task's (LogCapture.task_file), or a stream's own (Stream.file)


class _Stream:
    """One pipe (the child's stdout or stderr) and the rotated file it is pumped into: its
    own (``file``), or for a while another (``bind``: a task's, tasklogs.py)."""

    def __init__(self, cap: LogCapture, replica_id: str, stream: str, max_bytes: int, backups: int,
                 eager: bool, read_end: int | None = None, file: _File | None = None) -> None:
        """``read_end``: the pipe an earlier image of the daemon read (an upgrade), or one a
        worker made, else a new one; ``file``: another stream's (both write into it), else
        its own, ``<replica_id>.<stream>``."""
        self.cap = cap
        self.owns_file = file is None
        self.file = file if file is not None else _File(cap, f"{replica_id}.{stream}", max_bytes, backups, eager)
        self.sink: _File | None = self.file  # where what it reads goes now (None: ``bound``'s, not made yet)
        self.bound: str | None = None  # the id whose file it is bound to (bind), if any...
        self.bound_stream = ""  # ...and which of its streams
        self.name = self.file.name
        self.r = -1  # the pipe's read end (ours)
        self.w = -1  # the pipe's write end (the child's; closed here once it is spawned)
        self.watching = False
        self.grown = False
        self.paused: Timer | None = None  # resumes reading (after a slow write, over its rate)
        self.bucket = _Bucket(cap.rate, cap.reactor.monotonic()) if cap.rate else None
        try:
            if read_end is None:
                self.r, self.w = os.pipe()  # both close-on-exec; the spawner dup2s w onto 1 or 2
            else:
                self.r = read_end
                os.set_inheritable(read_end, False)
            os.set_blocking(self.r, False)  # ours only: the child's end stays blocking
            cap.reactor.add_reader(self.r, self._on_readable)
            self.watching = True
        except BaseException:
            self.close()
            raise

    @property
    def bytes(self) -> int:
        return self.file.bytes

    @property
    def dropped(self) -> int:
        return self.file.dropped

    # -- pumping

    def _on_readable(self) -> None:
        cap = self.cap
        if cap._turn_left <= 0:
            return  # this turn's budget is spent: the pipe is still ready next turn
        allow = min(READS_PER_TURN * CHUNK, cap._turn_left)
        buckets = [b for b in (self.bucket, cap._bucket) if b is not None]
        if buckets:
            now = cap.reactor.monotonic()
            for b in buckets:
                allow = min(allow, b.available(now))
            if allow < MIN_READ:  # over its rate: the replica waits on its full pipe, not us
                self._pause(max(0.001, *(b.wait(CHUNK) for b in buckets)))
                return
        got = self._pump(allow)
        cap._turn_left -= got
        for b in buckets:
            b.tokens -= got

    def _pump(self, limit: int, *, paused_too: bool = False) -> int:
        """Read at most ``limit`` bytes from the pipe into the sink; returns the bytes read."""
        buf = self.cap._buf
        view = self.cap._view
        got = 0
        while got < limit and self.r >= 0 and (paused_too or self.paused is None):
            want = min(CHUNK, limit - got)
            try:
                n = os.readv(self.r, [view[:want]])
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError:  # EIO and the like: as good as EOF
                n = 0
            if n == 0:
                self._eof()
                break
            got += n
            sink = self.sink if self.sink is not None else self._open_bound()
            sink.store(buf, n)
            if sink.slow:  # passed on to the replica (it blocks on its full pipe), not paid again here
                sink.slow = False
                self._pause(SLOW_PAUSE)
            if n < want:
                break  # the pipe is empty now: no second read just to hear EAGAIN
            if n == CHUNK and not self.grown:
                self._grow()
        return got

    def bind(self, log_id: str, stream: str) -> None:
        """What it reads goes to ``log_id``'s ``stream`` file from now on (a task's,
        ``<pool>#<n>.out``: its first byte makes it, rotated by this stream's limits), until
        ``unbind``. Nothing but two names set: a task that writes nothing costs no more."""
        if self.sink is not self.file:
            self.unbind()
        self.bound, self.bound_stream, self.sink = log_id, stream, None

    def unbind(self) -> None:
        """What it reads goes to its own file again; the bound one is closed."""
        if self.sink is not self.file:
            if self.sink is not None:
                self.sink.close()
            self.bound, self.sink = None, self.file

    def _open_bound(self) -> _File:
        assert self.bound is not None
        base = base_name(self.bound)
        self.sink = _File(self.cap, f"{base}.{check_stream(self.bound_stream)}", self.file.max_bytes,
                          self.file.backups, False)
        self.cap.task_files.add(base)
        return self.sink

    def drain(self) -> int:
        """What the pipe holds now, into the sink, at once (a pause or the turn's budget
        notwithstanding), at most ``DRAIN_LIMIT`` bytes: the writer is done with this sink."""
        return self._pump(DRAIN_LIMIT, paused_too=True) if self.r >= 0 else 0

    def _grow(self) -> None:
        self.grown = True
        with contextlib.suppress(OSError):  # EPERM over pipe-max-size or the per-user limit
            fcntl.fcntl(self.r, fcntl.F_SETPIPE_SZ, PIPE_SIZE)

    def create(self) -> None:
        """The replica has run CREATE_AFTER seconds: its file exists from now on, output or not."""
        if self.r >= 0:
            self.file.create()

    def _pause(self, seconds: float) -> None:
        if self.watching and self.paused is None:
            self._unwatch()
            self.paused = self.cap.reactor.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self.paused = None
        if self.r >= 0 and not self.watching:
            self.cap.reactor.add_reader(self.r, self._on_readable)
            self.watching = True

    def _unwatch(self) -> None:
        if self.watching:
            self.watching = False
            with contextlib.suppress(KeyError, ValueError, OSError):  # a reactor closed first
                self.cap.reactor.remove_reader(self.r)

    def _eof(self) -> None:
        """Every write end is closed: nothing more can come."""
        self._unwatch()
        self._close_read_end()
        if self.owns_file:
            self.file.close()

    # -- ends

    def spawned(self) -> None:
        if self.w >= 0:
            os.close(self.w)
            self.w = -1

    def finish(self) -> None:
        self.spawned()
        if self.paused is not None:
            self.paused.cancel()
            self.paused = None
        self._unwatch()
        if self.r >= 0:
            self._pump(DRAIN_LIMIT)
        self.close()

    def close(self) -> None:
        self._unwatch()
        self.spawned()
        self._close_read_end()
        if self.owns_file:
            self.file.close()

    def _close_read_end(self) -> None:
        if self.r >= 0:
            os.close(self.r)
            self.r = -1


Stream = _Stream  # what open_stream gives: its ``w`` to hand out, ``finish()`` when done


class ReplicaLog:
    """One replica's capture: ``stdout`` and ``stderr`` are the fds its child puts on 1 and 2."""

    def __init__(self, cap: LogCapture, replica_id: str, max_bytes: int, backups: int,
                 read_ends: tuple[int, int] | None = None) -> None:
        self.replica_id = replica_id
        self._cap = cap
        eager = cap.create_after == 0
        out_r, err_r = read_ends if read_ends is not None else (None, None)
        self._out = _Stream(cap, replica_id, "out", max_bytes, backups, eager, out_r)
        try:
            self._err = _Stream(cap, replica_id, "err", max_bytes, backups, eager, err_r)
        except BaseException:
            self._out.close()
            raise
        self.stdout = self._out.w
        self.stderr = self._err.w
        self.finished = False
        self._create_timer = None if eager else cap.reactor.call_later(cap.create_after, self._create)

    def _create(self) -> None:
        self._create_timer = None
        self._out.create()
        self._err.create()

    def spawned(self) -> None:
        """Right after fork, in the daemon: the child has its copies of the write ends."""
        self._out.spawned()
        self._err.spawned()
        self.stdout = self.stderr = -1

    def finish(self) -> None:
        """The replica was reaped (or never started): drain what is left, close, forget it."""
        if self.finished:
            return
        self.finished = True
        if self._create_timer is not None:
            self._create_timer.cancel()
            self._create_timer = None
        try:
            self._out.finish()
        finally:
            self._err.finish()
            self.stdout = self.stderr = -1
            self._cap._open.pop(self.replica_id, None)
            self._cap._finished(self.replica_id)

    def stream(self, name: str) -> _Stream:
        """Its stdout's (``out``) or stderr's (``err``) pipe: a worker's first pair, whose
        sink a task's logs take while the task runs (tasklogs.py)."""
        return self._out if check_stream(name) == "out" else self._err

    @property
    def bytes(self) -> int:
        return self._out.bytes + self._err.bytes

    @property
    def dropped(self) -> int:
        return self._out.dropped + self._err.dropped

    def __repr__(self) -> str:
        return f"<ReplicaLog {self.replica_id} bytes={self.bytes} dropped={self.dropped}>"


class LogCapture:
    """Every replica's capture in one daemon; owned by the control loop's thread."""

    def __init__(self, logs_dir: str | os.PathLike[str], reactor: Reactor, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS, rate: int | None = RATE,
                 total_rate: int | None = TOTAL_RATE, create_after: float = CREATE_AFTER,
                 index: bool = True, clock: Callable[[], float] = time.time) -> None:
        """``rate``: bytes/s one stream is pumped at most, ``total_rate``: all of them (None:
        no bound); beyond it the replicas block on their full pipes. ``create_after``:
        seconds after ``open`` at which a replica's files are made if no output made them
        first (0: in ``open``, which then also raises OSError for a file it cannot open).
        ``index``: keep each stdout/stderr file's lines' times beside it (logindex.py; off
        only to measure what it costs), read from ``clock`` (wall-clock seconds)."""
        self.max_bytes, self.backups = self._limits(max_bytes, backups)
        if isinstance(create_after, bool) or not isinstance(create_after, (int, float)) or not 0 <= create_after < 1e6:
            raise ValueError(f"create_after must be a number of seconds >= 0, got {create_after!r}")
        self.create_after = float(create_after)
        for what, value in (("rate", rate), ("total_rate", total_rate)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < CHUNK):
                raise ValueError(f"{what} must be None or a whole number >= {CHUNK} (bytes/s), got {value!r}")
        self.rate = rate
        self.total_rate = total_rate
        self.index = index
        self.clock = clock
        self.logs_dir = Path(os.path.abspath(logs_dir))
        self.reactor = reactor
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.logs_dir, 0o700)
        self.dirfd = os.open(self.logs_dir, DIR_FLAGS | os.O_NOFOLLOW)
        self._buf = bytearray(CHUNK)  # one read buffer: the loop pumps one pipe at a time
        self._view = memoryview(self._buf)
        self._open: dict[str, ReplicaLog] = {}
        self._bytes = 0
        self._dropped = 0
        self._turn_left = TURN_BUDGET
        self._bucket = _Bucket(total_rate, reactor.monotonic()) if total_rate else None
        self._noted: list[_File] = []  # files with lines of ours to write (File.note)
        self._notes_timer: Timer | None = None
        # Files of forgotten replicas still to remove: (id, stream, index), index 0 the
        # current file, k its .k backup; and ids forgotten while their capture was open.
        self._doomed: collections.deque[tuple[str, str, int]] = collections.deque()
        self._doomed_later: set[str] = set()
        self._removal: Timer | None = None  # the next batch of unlinks
        # The tasks whose files exist (made here, or there at the start): only theirs are
        # removed when their records go. Most tasks write nothing and have none, and an
        # unlink that finds no file, four a task, cost a tiny task's loop more than its log.
        self.task_files: set[str] = self._task_files_there()
        self._removing_failed = 0  # files that could not be removed since the last that could
        at_turn_end = getattr(reactor, "at_turn_end", None)
        if at_turn_end is not None:
            at_turn_end(self._new_turn)
        else:  # a reactor without turn hooks: the per-pipe bound alone
            self._turn_left = 1 << 62

    @staticmethod
    def _limits(max_bytes: int, backups: int) -> tuple[int, int]:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a whole number >= 1, got {max_bytes!r}")
        if isinstance(backups, bool) or not isinstance(backups, int) or not 0 <= backups <= BACKUP_LIMIT:
            raise ValueError(f"backups must be a whole number from 0 to {BACKUP_LIMIT}, got {backups!r}")
        return max_bytes, backups

    def _new_turn(self) -> None:
        self._turn_left = TURN_BUDGET

    def _write_notes(self) -> None:
        self._notes_timer = None
        noted, self._noted = self._noted, []
        for f in noted:
            f.write_notes()

    def open(self, replica_id: str, *, max_bytes: int | None = None, backups: int | None = None) -> ReplicaLog:
        """The pipes and files of a replica about to be spawned. Raises OSError when they
        cannot be made (EMFILE, a planted link, an unusable dir)."""
        if self.dirfd < 0:
            raise OSError(errno.EBADF, "the log capture is closed")
        if not isinstance(replica_id, str) or parse_replica_id(replica_id) is None:
            raise OSError(errno.EINVAL, f"invalid replica id {replica_id!r}")
        if replica_id in self._open:
            raise OSError(errno.EEXIST, f"replica {replica_id} already has its logs open")
        mb, bk = self._limits(self.max_bytes if max_bytes is None else max_bytes,
                              self.backups if backups is None else backups)
        rlog = ReplicaLog(self, replica_id, mb, bk)
        self._open[replica_id] = rlog
        return rlog

    def finish_of(self, replica_id: str) -> Callable[[], None] | None:
        """The ``finish`` of a replica's open capture (an upgrade keeps it, and its pipes)."""
        rlog = self._open.get(replica_id)
        return rlog.finish if rlog is not None else None

    def read_ends(self, replica_id: str) -> tuple[int, int] | None:
        """The (stdout, stderr) pipes' read ends of a spawned replica: what an upgrade carries."""
        rlog = self._open.get(replica_id)
        if rlog is None or rlog.finished:
            return None
        return rlog._out.r, rlog._err.r

    def adopt(self, replica_id: str, read_ends: tuple[int, int], *, max_bytes: int | None = None,
              backups: int | None = None) -> ReplicaLog:
        """The capture of a replica an earlier image of the daemon spawned (an upgrade),
        over the read ends it carried; the files go on where they are."""
        mb, bk = self._limits(self.max_bytes if max_bytes is None else max_bytes,
                              self.backups if backups is None else backups)
        rlog = ReplicaLog(self, replica_id, mb, bk, read_ends)
        rlog.spawned()
        self._open[replica_id] = rlog
        return rlog

    def open_stream(self, name: str, stream: str) -> _Stream:
        """One more captured stream, pumped into ``<name>.<stream>`` with the same rotation:
        a replica's exec probes (``<id>.probe``), the spawners (``spawner.log``). Hand out
        its ``w`` (kept open until ``finish()``, which drains and closes it). OSError when
        it cannot be made."""
        if self.dirfd < 0:
            raise OSError(errno.EBADF, "the log capture is closed")
        if (not name or "/" in name or name.startswith(".") or stream in STREAMS or not stream.isalpha()
                or not stream.isascii()):
            raise OSError(errno.EINVAL, f"invalid stream {name!r}.{stream!r}")
        return _Stream(self, name, stream, self.max_bytes, self.backups, self.create_after == 0)

    def replica(self, replica_id: str) -> ReplicaLog | None:
        """The open capture of a replica, if it has one."""
        return self._open.get(replica_id)

    def take_pipe(self, read_end: int, file: _File) -> _Stream:
        """A pipe a process of a replica made (a worker's second stdout or stderr: tasklogs.py),
        pumped as the replica's own into ``file`` (one of that replica's) unless its sink is
        set to another; ``finish()`` when the replica is gone."""
        if self.dirfd < 0:
            raise OSError(errno.EBADF, "the log capture is closed")
        return _Stream(self, "", "", file.max_bytes, file.backups, False, read_end, file)

    def forget(self, replica_ids: Iterable[str]) -> None:
        """The journal forgot these ended replicas or tasks (``POOL/N``): remove their files
        (current and rotated, stdout and stderr), a bounded number per turn from the next
        turn on. A replica whose capture is still open is removed once it finishes; a task
        only if it has files (``task_files``: a task that wrote nothing has none)."""
        if self.dirfd < 0:
            return  # closed: the next start's scan removes them
        for rid in replica_ids:
            if isinstance(rid, str) and "/" in rid:  # a task's (no replica id has one)
                base = base_name(rid)
                if base in self.task_files and parse_task_id(rid) is not None:
                    self.task_files.discard(base)
                    self._doomed.extend((base, stream, 0) for stream in STREAMS)
                continue
            if not isinstance(rid, str) or parse_replica_id(rid) is None:
                continue
            if rid in self._open:
                self._doomed_later.add(rid)
            else:
                self._doomed.extend((rid, stream, 0) for stream in (*STREAMS, "probe"))
        self._schedule_removal(0.0)

    def _task_files_there(self) -> set[str]:
        """The base names (``pool#n``) of the task files in the logs directory now."""
        try:
            names = os.listdir(self.dirfd)
        except OSError:
            return set()
        found: set[str] = set()
        for name in names:
            stem, dot, tail = name.rpartition(".")
            if tail.isdigit():  # a rotated one: <base>.<stream>.<k>
                stem, dot, tail = stem.rpartition(".")
            if dot and tail in STREAMS and "#" in stem:
                found.add(stem)
        return found

    @property
    def removals_pending(self) -> int:
        """Replica streams whose files are still to be removed."""
        return len(self._doomed) + 3 * len(self._doomed_later)

    def _finished(self, replica_id: str) -> None:
        if replica_id in self._doomed_later:
            self._doomed_later.discard(replica_id)
            self.forget([replica_id])

    def _schedule_removal(self, delay: float) -> None:
        if self._doomed and self._removal is None and self.dirfd >= 0:
            self._removal = self.reactor.call_later(delay, self._remove_some)

    def _remove_some(self) -> None:
        """One turn's share of the queue: REMOVE_PER_TURN unlinks or REMOVE_TURN_TIME at most."""
        self._removal = None
        if self.dirfd < 0:
            return
        began = time.perf_counter()
        unlinks = 0
        while self._doomed:
            rid, stream, index = self._doomed[0]
            indexed = stream in STREAMS  # a log and its time index: two unlinks
            if unlinks + 1 + indexed > REMOVE_PER_TURN:
                break
            self._doomed.popleft()
            name = f"{rid}.{stream}" if index == 0 else f"{rid}.{stream}.{index}"
            t0 = time.perf_counter()
            if indexed:
                unlinks += 1
                with contextlib.suppress(OSError):  # its index: gone with it, or left as the log is
                    os.unlink(index_name(name), dir_fd=self.dirfd)
            unlinks += 1
            try:
                os.unlink(name, dir_fd=self.dirfd)
                there = True
                if self._removing_failed:
                    log.info("removing forgotten replicas' logs again (%d files could not be removed)",
                             self._removing_failed)
                    self._removing_failed = 0
            except FileNotFoundError:
                there = False
            except OSError as err:  # EACCES, EPERM, EROFS, EIO, EISDIR: leave it, go on with the rest
                there = True
                if not self._removing_failed:
                    log.warning("cannot remove %s of a forgotten replica: %s; such files are left "
                                "(a later start removes them)", name, err.strerror or err)
                self._removing_failed += 1
            # Backups are contiguous from .1 (rotation keeps them so): the first missing one
            # ends the chain; a missing current file does not (.1 may be there all the same).
            if (there or index == 0) and index < BACKUP_LIMIT:
                self._doomed.appendleft((rid, stream, index + 1))
            now = time.perf_counter()
            if now - t0 > SLOW_WRITE:  # the disk is struggling: give it (and the loop) a rest
                self._schedule_removal(SLOW_PAUSE)
                return
            if now - began > REMOVE_TURN_TIME:
                break
        self._schedule_removal(0.0)

    def totals(self) -> dict[str, int]:
        """Bytes written and dropped by every replica since start; ReplicaLogs open now."""
        return {"bytes": self._bytes, "dropped": self._dropped, "open": len(self._open)}

    def close(self) -> None:
        """Finish every open ReplicaLog (daemon shutdown); later opens raise OSError."""
        for rlog in list(self._open.values()):
            rlog.finish()
        if self._notes_timer is not None:
            self._notes_timer.cancel()
        self._write_notes()
        if self._removal is not None:  # what is left is removed by the next start's scan
            self._removal.cancel()
            self._removal = None
        self._doomed.clear()
        self._doomed_later.clear()
        if self.dirfd >= 0:
            os.close(self.dirfd)
            self.dirfd = -1

    def __enter__(self) -> LogCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
