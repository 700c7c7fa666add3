"""The event loop under the control loop: epoll, timers, buffered writers. It knows no replicas.

One turn (``run_once``):

    wait ── one epoll wait, bounded by the next timer; no wait at all when work is queued
    1. readers   ── callbacks of the fds that are ready (pidfds, pipes, sockets; and, through
                    one nested epoll, the EPOLLPRI fds of add_priority_reader: cgroup.events)
    2. inbox     ── callables handed in by other threads (call_soon_threadsafe)
    3. soon      ── callables queued before this step (call_soon), in order
    4. timers    ── every timer due as the step begins, in deadline order (ties: as set)
    5. turn end  ── the hooks of at_turn_end (the engine settles: commit, then replies)
    6. writers   ── buffered non-blocking writers flushed; EVENT_WRITE while they hold data

Only the owner's thread runs a turn; ``call_soon_threadsafe`` is the one entry for other
threads, and a wakeup pipe in the epoll set is how it interrupts a wait. Steps 2 to 4 run
what was queued when the step began; what a callback queues for its own step is the next
turn's (which does not wait), so no callback can hold a turn for ever. Callbacks run to
completion: whatever must end the loop (a shutdown signal) is recorded and checked by the
owner between turns, never raised from inside a callback, so no turn is ever half done.

No callback ends the loop: each runs under one last-resort guard (``_run``) that logs an
exception's traceback and goes on with the rest of the turn. The callbacks handle what they
expect themselves (a replica's failure is that replica's); the guard is for the bug nobody
expected, which must cost one callback, not every replica the daemon supervises. An fd
(a priority reader's too) whose callback fails ``MAX_FD_FAULTS`` turns in a row is no
longer watched, so a level-triggered fd that is never consumed cannot spin the loop.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import select
import selectors
import threading
import time
from typing import Callable, Protocol

# A callback's result is ignored (a retrying start() says whether it started, for its
# other callers); object, not None, lets such a method be scheduled as it is.
Callback = Callable[[], object]
log = logging.getLogger("orchestrator")
MAX_FD_FAULTS = 10  # failures in a row of one fd's callback before the fd is dropped


def drain(fd: int) -> None:
    """Empty a non-blocking wakeup pipe. A read that returns less than it asked for has
    emptied it: no second read to hear EAGAIN (a syscall, and a release of the GIL that an
    embedded loop's threads wait for, per wakeup); a byte written after it is the next
    turn's (the epoll set is level-triggered)."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass


class Writer(Protocol):
    """What ``add_writer`` takes: a buffer that writes what the fd accepts, never blocking."""

    def pending(self) -> bool: ...
    def flush(self) -> None: ...
    def fileno(self) -> int: ...


class BufferedWriter:
    """A non-blocking pipe or socket end for the loop: what the fd cannot take now (its
    reader is stalled) waits here, and the reactor flushes it when the fd turns writable
    (the owner registers it: ``Reactor.add_writer``). A reader that is gone (EPIPE) drops
    the buffer: there is nobody left to read it. What waits is kept as the chunks it was
    given, each written from an offset: a frame of 1 GiB is never copied to be sent."""

    SMALL = 1 << 16  # chunks below this are joined, so that many small frames cost few writes

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._chunks: collections.deque[bytes | memoryview] = collections.deque()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if isinstance(data, bytearray):
            data = bytes(data)  # the caller may change its own buffer afterwards
        chunks = self._chunks
        if not chunks:
            try:
                n = os.write(self.fd, data)
            except BlockingIOError:
                n = 0
            except (BrokenPipeError, ConnectionResetError):
                return
            if n == len(data):
                return
            chunks.append(memoryview(data)[n:])
            return
        last = chunks[-1]
        if len(chunks) > 1 and len(last) < self.SMALL and len(data) < self.SMALL:
            chunks[-1] = bytes(last) + data
        else:
            chunks.append(data)

    def pending(self) -> bool:
        return bool(self._chunks)

    def pending_bytes(self) -> bytes:
        """What the fd has not taken yet."""
        return b"".join(self._chunks)

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        chunks = self._chunks
        try:
            while chunks:
                head = chunks[0]
                n = os.write(self.fd, head)
                if n == len(head):
                    chunks.popleft()
                else:
                    chunks[0] = memoryview(head)[n:]
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            chunks.clear()

    def close(self) -> None:
        os.close(self.fd)


class Timer:
    """A callable due at a monotonic deadline; ``cancel()`` makes it a no-op."""

    __slots__ = ("deadline", "callback", "cancelled")

    def __init__(self, deadline: float, callback: Callback) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Reactor:
    """Single-threaded: every method but ``call_soon_threadsafe`` is for the owner's thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.monotonic = clock
        self._sel = selectors.EpollSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._drain_wakeup)
        self._inbox: collections.deque[Callback] = collections.deque()
        self._inbox_lock = threading.Lock()  # against close(): never write to a closed (or reused) fd
        self._soon: list[Callback] = []
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._turn_end: list[Callback] = []
        self._writers: dict[Writer, int | None] = {}  # writer -> the fd registered for EVENT_WRITE
        # Priority readers (EPOLLPRI: cgroup.events): selectors cannot ask for EPOLLPRI, so
        # they sit in an epoll of their own, whose fd is one plain reader of the main one
        # (an epoll fd is readable while its ready list is not empty). Made on first use.
        self._pri: select.epoll | None = None
        self._pri_callbacks: dict[int, Callback] = {}
        self._pri_faults: dict[int, int] = {}  # as _fd_faults, for the priority readers
        self._pri_dropped: set[int] = set()  # as _dropped: out of the nested epoll, still known
        self._fd_faults: dict[int, int] = {}  # fd -> its callback's failures in a row
        self._dropped: set[int] = set()  # readers the guard stopped watching, until their owner removes them
        self.faults = 0  # callbacks that raised since the start
        self.closed = False

    # -- scheduling -------------------------------------------------------------------

    def call_soon(self, callback: Callback) -> None:
        """Run ``callback`` in this turn (if queued before step 3) or the next, without waiting."""
        self._soon.append(callback)

    def call_soon_threadsafe(self, callback: Callback) -> bool:
        """From any thread: run ``callback`` in the loop. False once the reactor is closed."""
        with self._inbox_lock:
            if self.closed:
                return False
            self._inbox.append(callback)
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wakeups already: the loop will run
        return True

    def call_later(self, delay: float, callback: Callback) -> Timer:
        return self.call_at(self.monotonic() + delay, callback)

    def call_at(self, deadline: float, callback: Callback) -> Timer:
        timer = Timer(deadline, callback)
        heapq.heappush(self._timers, (deadline, next(self._seq), timer))
        return timer

    def at_turn_end(self, callback: Callback) -> None:
        """Run ``callback`` at the end of every turn, after the timers."""
        self._turn_end.append(callback)

    # -- fds --------------------------------------------------------------------------

    def add_reader(self, fd: int, callback: Callback) -> None:
        # A new registration counts its own faults: one that removed itself and then raised
        # left a count under this number.
        self._fd_faults.pop(fd, None)
        self._dropped.discard(fd)
        self._sel.register(fd, selectors.EVENT_READ, callback)

    def remove_reader(self, fd: int) -> None:
        """Forget ``fd`` (call before it is closed); also for one the guard dropped."""
        self._fd_faults.pop(fd, None)
        if fd in self._dropped:
            self._dropped.discard(fd)
            return
        self._sel.unregister(fd)

    def add_priority_reader(self, fd: int, callback: Callback) -> None:
        """Call ``callback`` while ``fd`` reports EPOLLPRI (or an error), level-triggered:
        for files whose news is POLLPRI and which always report POLLIN, like cgroupfs's
        ``cgroup.events`` (an EVENT_READ registration of those would spin). The callback
        must consume the event (a cgroup.events fd: read it) or remove the fd."""
        if self._pri is None:
            self._pri = select.epoll()
            self._sel.register(self._pri.fileno(), selectors.EVENT_READ, self._run_priority)
        self._pri.register(fd, select.EPOLLPRI)
        self._pri_callbacks[fd] = callback
        self._pri_faults.pop(fd, None)
        self._pri_dropped.discard(fd)

    def remove_priority_reader(self, fd: int) -> None:
        """Forget ``fd`` (call before it is closed); a no-op once the reactor is closed."""
        if self.closed:
            return
        del self._pri_callbacks[fd]
        self._pri_faults.pop(fd, None)
        if fd in self._pri_dropped:
            self._pri_dropped.discard(fd)
            return
        assert self._pri is not None
        self._pri.unregister(fd)

    def _run_priority(self) -> None:
        assert self._pri is not None
        for fd, _events in self._pri.poll(0):
            callback = self._pri_callbacks.get(fd)  # an earlier callback may have removed it
            if callback is None:
                continue
            if self._run(callback):
                self._pri_faults.pop(fd, None)
                continue
            if self._pri_callbacks.get(fd) is not callback:
                continue  # it removed (or replaced) itself before it raised
            faults = self._pri_faults[fd] = self._pri_faults.get(fd, 0) + 1
            if faults >= MAX_FD_FAULTS:  # level-triggered too: the same spin as _run_fd's
                log.error("fd %d: its priority callback failed %d times in a row; it is no longer watched",
                          fd, faults)
                self._pri.unregister(fd)
                self._pri_faults.pop(fd, None)
                self._pri_dropped.add(fd)

    def add_writer(self, writer: Writer) -> None:
        """Flushed at the end of every turn, and woken by EVENT_WRITE while it holds data."""
        self._writers[writer] = None

    def remove_writer(self, writer: Writer) -> None:
        """Forget ``writer`` (call before its fd is closed or replaced)."""
        fd = self._writers.pop(writer, None)
        if fd is not None:
            self._sel.unregister(fd)

    # -- turns ------------------------------------------------------------------------

    def run_once(self, timeout: float | None = None) -> None:
        """One turn; ``timeout`` bounds the wait (None: until an event or a timer)."""
        if self._soon or self._inbox:
            timeout = 0
        elif self._timers:
            due = max(0.0, self._timers[0][0] - self.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        registered = self._sel.get_map()
        for key, _ in self._sel.select(timeout):
            # An earlier callback of this turn may have removed this fd (a child's exit
            # closes its pipes), or closed it and registered the number anew: skip a stale
            # event; a new registration that is ready is reported again next turn.
            if registered.get(key.fd) is key:
                self._run_fd(key)
        # Each step runs what was queued when it began: what a callback queues for the same
        # step (a timer re-armed for "now" or a past deadline, a callback handing itself in
        # again) is the next turn's, which does not wait. Otherwise one such callback would
        # hold the turn for ever (on a clock that does not move between calls, or a deadline
        # already past), and no fd would be served again.
        handed_in = len(self._inbox)
        while handed_in and self._inbox:  # close() from a callback empties it
            handed_in -= 1
            self._run(self._inbox.popleft())
        soon, self._soon = self._soon, []
        for callback in soon:
            self._run(callback)
        now = self.monotonic()
        ready: list[Timer] = []
        while self._timers and self._timers[0][0] <= now:
            ready.append(heapq.heappop(self._timers)[2])
        for timer in ready:
            if not timer.cancelled:  # checked as it comes: an earlier one may cancel it
                self._run(timer.callback)
        for callback in self._turn_end:
            self._run(callback)
        self._run(self._flush_writers)

    def _run(self, callback: Callback) -> bool:
        """Run one callback; False if it raised (logged with its traceback)."""
        try:
            callback()
        except Exception:  # noqa: BLE001
            # The one deliberate last-resort guard of the daemon (supervisord's main loop
            # does the same for a dispatcher's handler, asyncio's for a callback's): an
            # exception here is a bug in one callback, and ending the loop for it would
            # leave every replica unsupervised and, restored at the next start, do it again.
            self.faults += 1
            log.exception("a callback of the control loop failed (%r); the loop goes on", callback)
            return False
        return True

    def _run_fd(self, key: selectors.SelectorKey) -> None:
        if self._run(key.data):
            if self._fd_faults:
                self._fd_faults.pop(key.fd, None)
            return
        faults = self._fd_faults[key.fd] = self._fd_faults.get(key.fd, 0) + 1
        if faults >= MAX_FD_FAULTS and self._sel.get_map().get(key.fd) is key:
            # Level-triggered: a callback that fails before it consumes its event would fail
            # again every turn, at full speed. Stop watching it, as supervisord closes the
            # channel whose handler raised.
            log.error("fd %d: its callback failed %d times in a row; it is no longer watched", key.fd, faults)
            self._sel.unregister(key.fd)
            self._fd_faults.pop(key.fd, None)
            for writer, fd in self._writers.items():
                if fd == key.fd:  # a writer's EVENT_WRITE: it is flushed at turn ends only
                    self._writers[writer] = None
                    break
            else:
                self._dropped.add(key.fd)

    def run_until(self, done: Callable[[], bool], limit: float) -> bool:
        """Run turns until ``done()`` or ``limit`` seconds passed; returns ``done()``."""
        deadline = self.monotonic() + limit
        while not done():
            left = deadline - self.monotonic()
            if left <= 0:
                return False
            self.run_once(min(left, 0.5))
        return True

    def _flush_writers(self) -> None:
        for writer, registered in self._writers.items():
            if writer.pending():
                writer.flush()
            want = writer.fileno() if writer.pending() else None
            if want != registered:
                if registered is not None:
                    self._sel.unregister(registered)
                if want is not None:
                    self._sel.register(want, selectors.EVENT_WRITE, writer.flush)
                self._writers[writer] = want

    def _drain_wakeup(self) -> None:
        drain(self._wake_r)

    def close(self) -> None:
        """Release the reactor's fds; later call_soon_threadsafe calls return False."""
        with self._inbox_lock:
            if self.closed:
                return
            self.closed = True
        self._inbox.clear()
        self._sel.close()
        if self._pri is not None:
            self._pri.close()
            self._pri_callbacks.clear()
            self._pri_dropped.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)
