"""The reactor under the control loop (orchestrator/daemon/reactor.py), on its own: the order
of one turn, timers on a fake clock, the thread-safe entry and its wakeup, buffered writers,
the last-resort guard and its fault limit, and fds that an earlier callback of the same turn
removed.

A fake clock (``Reactor(clock=...)``) decides which timers are due; the epoll wait itself is
real, so a test that needs to know how long a turn would have waited spies on the selector's
``select`` (``spied``) instead of waiting. Nothing here sleeps to synchronise: threads meet
on Events with bounded waits.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import select
import selectors
import socket
import threading
import time
from typing import Iterator

import pytest

from orchestrator.daemon import reactor as reactor_module
from orchestrator.daemon.reactor import MAX_FD_FAULTS, BufferedWriter, Reactor


class FakeClock:
    """A monotonic clock that moves only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SpySelector(selectors.EpollSelector):
    """The reactor's epoll, recording every wait: the timeout it was asked for and how many
    events it returned. ``waiting`` is set as a wait begins (another thread may then know
    the loop is, or is about to be, blocked); ``cap`` bounds the real wait, for a timeout
    computed from a fake clock."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.ready: list[int] = []
        self.waiting = threading.Event()
        self.cap: float | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.timeouts.append(timeout)
        self.waiting.set()
        if self.cap is not None:
            timeout = self.cap if timeout is None else min(timeout, self.cap)
        events = super().select(timeout)
        self.ready.append(len(events))
        return events


class Records(logging.Handler):
    """The records of the "orchestrator" logger, whatever the logging set-up of the run."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def loop(clock: FakeClock) -> Iterator[Reactor]:
    """A reactor on the fake clock, closed at teardown."""
    r = Reactor(clock)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> Iterator[tuple[Reactor, SpySelector]]:
    """A reactor on the fake clock whose epoll is a SpySelector."""
    made: list[SpySelector] = []

    def make() -> SpySelector:
        made.append(SpySelector())
        return made[-1]

    monkeypatch.setattr(selectors, "EpollSelector", make)  # the module the reactor calls
    r = Reactor(clock)
    monkeypatch.undo()
    try:
        assert len(made) == 1
        yield r, made[0]
    finally:
        r.close()


@pytest.fixture
def logged() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("orchestrator")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def pipes() -> Iterator[list[tuple[int, int]]]:
    """Pipes a test makes (append them); every fd still open is closed at teardown."""
    made: list[tuple[int, int]] = []
    yield made
    for pair in made:
        for fd in pair:
            try:
                os.close(fd)
            except OSError:
                pass  # the test closed it itself


def new_pipe(pipes: list[tuple[int, int]]) -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    pipes.append((r, w))
    return r, w


# -- timers ---------------------------------------------------------------------------


def test_due_timers_fire_in_deadline_order_and_ties_in_the_order_they_were_set(
        loop: Reactor, clock: FakeClock) -> None:
    fired: list[str] = []
    for name, delay in [("c", 3.0), ("a1", 1.0), ("b1", 2.0), ("a2", 1.0), ("b2", 2.0), ("a3", 1.0)]:
        loop.call_later(delay, functools.partial(fired.append, name))
    loop.call_at(clock.now + 2.5, functools.partial(fired.append, "b3"))
    loop.run_once(0)
    assert fired == []  # nothing is due before its deadline
    clock.advance(1.0)  # a deadline equal to now is due
    loop.run_once(0)
    assert fired == ["a1", "a2", "a3"]
    clock.advance(0.5)
    loop.run_once(0)
    assert fired == ["a1", "a2", "a3"]
    clock.advance(10)
    loop.run_once(0)
    assert fired == ["a1", "a2", "a3", "b1", "b2", "b3", "c"]
    clock.advance(10)
    loop.run_once(0)
    assert len(fired) == 7  # each fires once


def test_a_cancelled_timer_never_fires_even_when_cancelled_by_a_timer_of_the_same_turn(
        loop: Reactor, clock: FakeClock) -> None:
    fired: list[str] = []
    before = loop.call_later(1.0, functools.partial(fired.append, "cancelled before"))
    loop.call_later(2.0, lambda: victim.cancel())  # due in the same turn as victim, and first
    victim = loop.call_later(2.0, functools.partial(fired.append, "cancelled in the turn"))
    loop.call_later(2.0, functools.partial(fired.append, "kept"))
    before.cancel()
    clock.advance(5)
    loop.run_once(0)
    clock.advance(5)
    loop.run_once(0)
    assert fired == ["kept"]


@pytest.mark.parametrize("how", ["call_later(0)", "call_at(a past deadline)"])
def test_a_timer_set_for_now_by_a_timer_runs_on_a_later_turn(loop: Reactor, clock: FakeClock,
                                                              pipes: list[tuple[int, int]], how: str) -> None:
    """A timer that re-arms itself for "now" (a retry whose deadline has passed) runs once a
    turn: the turn ends, fds are served in between. Bounded at 50 so that a reactor which
    ran it again within the turn fails the test instead of spinning for ever."""
    runs: list[float] = []
    reads: list[bytes] = []
    r, w = new_pipe(pipes)
    loop.add_reader(r, lambda: reads.append(os.read(r, 100)))

    def rearm() -> None:
        runs.append(clock.now)
        if len(runs) < 50:
            if how == "call_later(0)":
                loop.call_later(0, rearm)
            else:
                loop.call_at(clock.now - 10, rearm)

    loop.call_later(0, rearm)
    for turn in range(1, 4):
        os.write(w, b"%d" % turn)
        loop.run_once(0)
        assert len(runs) == turn
        assert reads[-1] == b"%d" % turn
    loop.remove_reader(r)


def test_call_soon_from_a_callback_runs_next_turn_and_that_turn_does_not_wait(
        spied: tuple[Reactor, SpySelector]) -> None:
    loop, sel = spied
    sel.cap = 0.0
    runs: list[int] = []

    def again() -> None:
        runs.append(len(sel.timeouts))
        if len(runs) < 50:
            loop.call_soon(again)

    loop.call_soon(again)
    for turn in range(1, 4):
        loop.run_once(None)
        assert runs == list(range(1, turn + 1))  # once a turn, in the turn it was queued for
        assert sel.timeouts[-1] == 0


def test_call_soon_threadsafe_from_an_inbox_callback_runs_next_turn(loop: Reactor) -> None:
    """The loop thread may hand work in too (code shared with other threads): one that keeps
    handing itself in must not hold the turn for ever."""
    runs: list[int] = []

    def again() -> None:
        runs.append(1)
        if len(runs) < 50:
            assert loop.call_soon_threadsafe(again)

    assert loop.call_soon_threadsafe(again)
    for turn in range(1, 4):
        loop.run_once(0)
        assert len(runs) == turn


def test_a_turn_waits_no_longer_than_the_next_deadline(spied: tuple[Reactor, SpySelector],
                                                       clock: FakeClock) -> None:
    loop, sel = spied
    sel.cap = 0.0  # record the timeout asked for; the fake clock's deadlines are not real ones
    loop.run_once(None)
    assert sel.timeouts[-1] is None  # nothing to wait for but events
    loop.run_once(3.0)
    assert sel.timeouts[-1] == 3.0
    fired: list[int] = []
    loop.call_later(2.5, functools.partial(fired.append, 1))
    loop.call_later(7.0, functools.partial(fired.append, 2))
    loop.run_once(None)
    assert sel.timeouts[-1] == pytest.approx(2.5)
    loop.run_once(1.0)
    assert sel.timeouts[-1] == pytest.approx(1.0)  # the caller's bound, when it is sooner
    loop.run_once(10.0)
    assert sel.timeouts[-1] == pytest.approx(2.5)
    clock.advance(2.0)
    loop.run_once(None)
    assert sel.timeouts[-1] == pytest.approx(0.5)
    clock.advance(1.0)  # overdue: no wait, and it fires
    loop.run_once(None)
    assert sel.timeouts[-1] == 0 and fired == [1]
    loop.run_once(None)
    assert sel.timeouts[-1] == pytest.approx(4.0)  # the next one: 7 s after the start, 3 s ago
    loop.call_soon(lambda: None)  # queued work: no wait at all
    loop.run_once(10.0)
    assert sel.timeouts[-1] == 0
    loop.call_soon_threadsafe(lambda: None)
    loop.run_once(None)
    assert sel.timeouts[-1] == 0


# -- call_soon_threadsafe ---------------------------------------------------------------


def test_call_soon_threadsafe_from_another_thread_wakes_a_blocked_turn(
        spied: tuple[Reactor, SpySelector]) -> None:
    loop, sel = spied
    ran_in: list[int] = []
    accepted: list[bool] = []

    def other() -> None:
        if sel.waiting.wait(10):  # the owner is in (or entering) its wait
            accepted.append(loop.call_soon_threadsafe(lambda: ran_in.append(threading.get_ident())))

    thread = threading.Thread(target=other)
    thread.start()
    try:
        start = time.monotonic()
        loop.run_once(12.0)  # no timer, no fd: only the wakeup can end this wait early
        elapsed = time.monotonic() - start
    finally:
        thread.join(10)
    assert accepted == [True]
    assert ran_in == [threading.get_ident()]  # in this turn, in the owner's thread
    assert elapsed < 6, f"the wakeup took {elapsed:.1f} s"


def test_callbacks_handed_in_by_many_threads_run_once_each_in_each_threads_order(
        reactor: Reactor) -> None:
    """More calls than the wakeup pipe holds (64 KiB), first while the loop is not turning
    (the pipe fills: a full pipe is a loop that will run anyway), then while it is."""
    threads, per = 4, 20_000
    got: dict[int, list[int]] = {t: [] for t in range(threads)}
    accepted = [0] * threads
    go = threading.Event()

    def hand_in(t: int) -> None:
        go.wait(10)
        for i in range(per):
            accepted[t] += reactor.call_soon_threadsafe(functools.partial(got[t].append, i))

    def total() -> int:
        return sum(len(v) for v in got.values())

    for phase in range(2):
        workers = [threading.Thread(target=hand_in, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        go.set()
        if phase == 0:
            for w in workers:
                w.join(30)
        assert reactor.run_until(lambda: total() == threads * per * (phase + 1), 30)
        for w in workers:
            w.join(30)
        go.clear()
    assert accepted == [2 * per] * threads
    for t in range(threads):
        assert got[t] == list(range(per)) * 2


def test_call_soon_threadsafe_after_close_returns_false_and_never_runs(clock: FakeClock) -> None:
    loop = Reactor(clock)
    assert loop.call_soon_threadsafe(lambda: None)
    loop.close()
    assert loop.call_soon_threadsafe(lambda: None) is False  # not a write to a closed (or reused) fd
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(loop.call_soon_threadsafe(lambda: None)))
    thread.start()
    thread.join(10)
    assert results == [False]
    loop.close()  # twice is fine


# -- buffered writers -----------------------------------------------------------------


def small_socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    b.setblocking(False)
    return a, b


@pytest.fixture
def stalling() -> Iterator[tuple[BufferedWriter, socket.socket]]:
    """A BufferedWriter on one end of a socketpair with small buffers (so that it stalls
    often), and the other end, non-blocking, for the test to read; both closed at teardown."""
    a, b = small_socketpair()
    writer = BufferedWriter(os.dup(a.fileno()))
    a.close()  # the writer holds a dup of its own
    try:
        yield writer, b
    finally:
        writer.close()
        b.close()


def recv_some(sock: socket.socket, most: int) -> bytes:
    try:
        return sock.recv(most)
    except BlockingIOError:
        return b""


def test_a_buffered_writer_keeps_the_order_of_many_writes_across_partial_writes(
        loop: Reactor, stalling: tuple[BufferedWriter, socket.socket]) -> None:
    """Writes of every size, small ones behind a stalled large one among them, while the
    reader takes pieces of random size between turns: the reader gets every byte once, in
    the order written."""
    rng = random.Random(29)
    writer, b = stalling
    loop.add_writer(writer)
    expected = bytearray()
    got = bytearray()
    stalled = 0
    for i in range(400):
        size = rng.choice([1, 7, 100, 5000, 70_000, 300_000])
        data = (b"%06d:" % i) + rng.randbytes(size)
        if rng.random() < 0.1:
            mutable = bytearray(data)
            writer.write(mutable)  # type: ignore[arg-type]  # a bytearray is accepted too, and copied
            mutable[:] = b"x" * len(mutable)  # the caller reusing its buffer changes nothing sent
        else:
            writer.write(data)
        expected += data
        stalled += writer.pending()
        if rng.random() < 0.5:
            loop.run_once(0)
        got += recv_some(b, rng.choice([10, 4096, 1 << 16]))
    deadline = time.monotonic() + 60
    while len(got) < len(expected) and time.monotonic() < deadline:
        loop.run_once(0.1)
        got += recv_some(b, 1 << 16)
    assert stalled > 100  # the path under test: writes behind data the fd did not take
    assert len(got) == len(expected)
    assert got == expected
    assert not writer.pending() and writer.pending_bytes() == b""
    loop.remove_writer(writer)


def test_a_pending_writer_wakes_the_turn_when_its_fd_turns_writable_and_is_unwatched_once_empty(
        spied: tuple[Reactor, SpySelector], stalling: tuple[BufferedWriter, socket.socket]) -> None:
    loop, sel = spied
    writer, b = stalling
    loop.add_writer(writer)
    data = os.urandom(1 << 20)
    got = bytearray()
    writer.write(data)
    loop.run_once(0)  # the turn's end watches its fd
    assert writer.pending()
    while writer.pending():
        left = len(writer.pending_bytes())
        while True:  # the reader drains all it can: the fd turns writable
            chunk = recv_some(b, 1 << 16)
            if not chunk:
                break
            got += chunk
        start = time.monotonic()
        loop.run_once(10.0)  # no timer, nothing else: only EVENT_WRITE ends this wait early
        assert time.monotonic() - start < 5
        assert sel.ready[-1] >= 1
        assert len(writer.pending_bytes()) < left
    while len(got) < len(data):  # all of it is in the socket now: recv never blocks here
        got += b.recv(1 << 20)
    assert got == data
    loop.run_once(0)
    loop.run_once(0.05)
    assert sel.ready[-2:] == [0, 0]  # empty: its always-writable fd no longer wakes the loop
    loop.remove_writer(writer)


def test_a_writer_whose_reader_goes_away_drops_its_data_and_stops_waking_the_loop(
        spied: tuple[Reactor, SpySelector], stalling: tuple[BufferedWriter, socket.socket]) -> None:
    loop, sel = spied
    writer, b = stalling
    loop.add_writer(writer)
    writer.write(os.urandom(1 << 20))
    loop.run_once(0)
    assert writer.pending()
    b.close()
    start = time.monotonic()
    loop.run_once(10.0)  # the gone reader is an event (EPOLLERR/HUP) of its own
    assert time.monotonic() - start < 5
    assert not writer.pending() and writer.pending_bytes() == b""
    writer.write(b"more")  # to nobody: dropped, not raised
    assert not writer.pending()
    loop.run_once(0)
    loop.run_once(0.05)
    assert sel.ready[-2:] == [0, 0]
    loop.remove_writer(writer)


def test_a_buffered_writer_flushes_a_large_frame_as_its_reader_drains_it() -> None:
    """50 MB written at once to a socket whose reader takes it in pieces: the reactor
    writes the rest each time the fd turns writable, in order, small writes behind it
    included, and nothing of the large one is copied into a second buffer."""
    reactor = Reactor()
    a, b = socket.socketpair()
    try:
        writer = BufferedWriter(os.dup(a.fileno()))
        reactor.add_writer(writer)
        big = os.urandom(50 << 20)
        writer.write(b"head")
        writer.write(big)
        for i in range(100):
            writer.write(b"%03d" % i)
        assert writer.pending()
        expected = b"head" + big + b"".join(b"%03d" % i for i in range(100))
        got = bytearray()
        b.setblocking(False)
        deadline = time.monotonic() + 60
        while len(got) < len(expected) and time.monotonic() < deadline:
            reactor.run_once(0.1)
            try:
                while True:
                    chunk = b.recv(1 << 16)
                    if not chunk:
                        break
                    got += chunk
            except BlockingIOError:
                pass
        assert bytes(got) == expected
        reactor.run_once(0)
        assert not writer.pending()
        reactor.remove_writer(writer)
        writer.close()
    finally:
        a.close()
        b.close()
        reactor.close()


def test_a_buffered_writer_whose_reader_is_gone_drops_what_it_holds() -> None:
    a, b = socket.socketpair()
    writer = BufferedWriter(os.dup(a.fileno()))
    writer.write(os.urandom(4 << 20))
    assert writer.pending()
    b.close()
    writer.flush()
    assert not writer.pending() and writer.pending_bytes() == b""
    writer.close()
    a.close()


# -- one turn ---------------------------------------------------------------------------


class RecordingWriter:
    """A Writer (the reactor's protocol) that records its flushes; its fd is a pipe's
    write end, writable as long as the pipe is not full."""

    def __init__(self, fd: int, calls: list[str]) -> None:
        self.fd = fd
        self.calls = calls
        self.held = True

    def pending(self) -> bool:
        return self.held

    def flush(self) -> None:
        self.calls.append("flush")
        self.held = False

    def fileno(self) -> int:
        return self.fd


def test_one_turn_runs_readers_inbox_soon_timers_turn_end_then_writers(
        loop: Reactor, clock: FakeClock, pipes: list[tuple[int, int]]) -> None:
    calls: list[str] = []
    r, w = new_pipe(pipes)
    _, writer_fd = new_pipe(pipes)
    writer = RecordingWriter(writer_fd, calls)
    loop.add_writer(writer)

    ends: list[int] = []

    def at_end() -> None:
        calls.append("turn end")
        ends.append(1)
        if len(ends) == 1:
            loop.call_soon(functools.partial(calls.append, "soon from the turn end"))

    loop.at_turn_end(at_end)
    loop.call_later(1.0, functools.partial(calls.append, "timer"))
    loop.call_soon(functools.partial(calls.append, "soon"))
    loop.call_soon_threadsafe(functools.partial(calls.append, "inbox"))
    loop.add_reader(r, lambda: calls.append("reader %r" % os.read(r, 10)))
    os.write(w, b"x")
    clock.advance(1.0)
    loop.run_once(0)
    assert calls == ["reader b'x'", "inbox", "soon", "timer", "turn end", "flush"]
    del calls[:]
    loop.run_once(0)  # what the turn end queued is the next turn's, and the hook runs again
    assert calls == ["soon from the turn end", "turn end"]
    del calls[:]
    for _ in range(3):
        loop.run_once(0)
    assert calls == ["turn end"] * 3  # once a turn, also a turn where nothing else happened
    loop.remove_reader(r)
    loop.remove_writer(writer)


def test_run_until_runs_turns_until_done_or_the_limit_on_the_reactor_clock(
        loop: Reactor, clock: FakeClock) -> None:
    turns: list[float] = []

    def tick() -> None:  # every turn moves the fake clock one second
        turns.append(clock.now)
        clock.advance(1.0)
        loop.call_soon(tick)

    loop.call_soon(tick)
    assert loop.run_until(lambda: len(turns) >= 3, 100) is True
    assert len(turns) == 3
    assert loop.run_until(lambda: False, 5) is False
    assert 4 <= len(turns) - 3 <= 6  # about five turns of one second
    assert loop.run_until(lambda: True, 0) is True  # done already: no turn
    assert len(turns) <= 9


def test_a_priority_reader_runs_while_its_fd_reports_epollpri_and_not_for_plain_data(
        loop: Reactor, urgent: tuple[socket.socket, socket.socket]) -> None:
    client, conn = urgent
    seen: list[bytes] = []
    loop.add_priority_reader(conn.fileno(), lambda: seen.append(conn.recv(1, socket.MSG_OOB)))
    client.send(b"plain")
    loop.run_once(0.05)
    assert seen == []
    client.send(b"!", socket.MSG_OOB)
    loop.run_once(5.0)
    assert seen == [b"!"]
    loop.run_once(0)  # consumed: not called again
    assert seen == [b"!"]
    loop.remove_priority_reader(conn.fileno())
    client.send(b"?", socket.MSG_OOB)
    loop.run_once(0.05)
    assert seen == [b"!"]


# -- fds removed within a turn --------------------------------------------------------


def test_an_fd_removed_by_an_earlier_callback_of_the_turn_is_not_called() -> None:
    """A child's exit (its pidfd) and its command pipe, readable in the same turn: the exit
    handler closes the pipe; its stale event must not run a handler on a closed fd (the
    daemon died of exactly that when its manager was SIGKILLed while a client was sending)."""
    reactor = Reactor(time.monotonic)
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    calls: list[str] = []
    fds: dict[str, int | None] = {"a": a_r, "b": b_r}

    def make(name: str, other: str) -> reactor_module.Callback:
        def callback() -> None:
            calls.append(name)
            fd = fds[name]
            assert fd is not None
            os.read(fd, 10)
            other_fd = fds[other]
            if other_fd is not None:  # the first to run removes the other, as close_pipes does
                reactor.remove_reader(other_fd)
                os.close(other_fd)
                fds[other] = None
        return callback

    reactor.add_reader(a_r, make("a", "b"))
    reactor.add_reader(b_r, make("b", "a"))
    os.write(a_w, b"x")
    os.write(b_w, b"x")
    reactor.run_once(1.0)
    assert len(calls) == 1, calls
    for fd in (a_w, b_w, *(fd for fd in fds.values() if fd is not None)):
        os.close(fd)
    reactor.close()


def test_an_fd_number_registered_anew_within_the_turn_is_served_next_turn_by_its_new_callback(
        loop: Reactor, pipes: list[tuple[int, int]]) -> None:
    """The first callback to run removes the other fd, and a new pipe takes its number (a
    child's exit closes its pipes, the next child's pipe reuses the number): the old
    registration's event of this turn is stale and skipped, the new one is reported next turn."""
    calls: list[str] = []
    first_r, first_w = new_pipe(pipes)
    second_r, second_w = new_pipe(pipes)
    replaced: list[str] = []

    def old(name: str, fd: int, other: str, other_fd: int) -> reactor_module.Callback:
        def callback() -> None:
            calls.append(f"old {name} {os.read(fd, 10)!r}")
            if not replaced:
                replaced.append(other)
                loop.remove_reader(other_fd)
                new_r, new_w = new_pipe(pipes)
                os.dup2(new_r, other_fd)  # the other's number now names the new pipe
                os.write(new_w, b"new")
                loop.add_reader(other_fd, lambda: calls.append(f"new {other} {os.read(other_fd, 10)!r}"))
        return callback

    loop.add_reader(first_r, old("first", first_r, "second", second_r))
    loop.add_reader(second_r, old("second", second_r, "first", first_r))
    os.write(first_w, b"old")
    os.write(second_w, b"old")
    loop.run_once(5.0)
    [other] = replaced
    ran = "second" if other == "first" else "first"
    assert calls == [f"old {ran} b'old'"]
    loop.run_once(5.0)
    assert calls == [f"old {ran} b'old'", f"new {other} b'new'"]
    loop.remove_reader(first_r)
    loop.remove_reader(second_r)


# -- the last-resort guard and its fault limit ------------------------------------------


def test_a_callback_that_raises_is_logged_and_the_turn_and_the_loop_go_on(
        loop: Reactor, clock: FakeClock, pipes: list[tuple[int, int]], logged: Records) -> None:
    calls: list[str] = []

    def fail(where: str) -> None:
        calls.append(where)
        raise RuntimeError(f"a bug in a {where} callback")

    r, w = new_pipe(pipes)

    def reader() -> None:
        os.read(r, 10)
        fail("reader")

    loop.add_reader(r, reader)
    loop.call_soon_threadsafe(functools.partial(fail, "inbox"))
    loop.call_soon_threadsafe(functools.partial(calls.append, "inbox after"))
    loop.call_soon(functools.partial(fail, "soon"))
    loop.call_soon(functools.partial(calls.append, "soon after"))
    loop.call_later(1.0, functools.partial(fail, "timer"))
    loop.call_later(1.0, functools.partial(calls.append, "timer after"))
    loop.at_turn_end(functools.partial(fail, "turn end"))
    loop.at_turn_end(functools.partial(calls.append, "turn end after"))
    os.write(w, b"x")
    clock.advance(1.0)
    loop.run_once(0)
    assert calls == ["reader", "inbox", "inbox after", "soon", "soon after", "timer", "timer after",
                     "turn end", "turn end after"]
    assert loop.faults == 5
    errors = [rec for rec in logged.records if rec.levelno == logging.ERROR]
    assert len(errors) == 5
    assert all("the loop goes on" in rec.getMessage() for rec in errors)
    assert [str(rec.exc_info[1]) for rec in errors if rec.exc_info] == [
        f"a bug in a {where} callback" for where in ("reader", "inbox", "soon", "timer", "turn end")]
    del calls[:]
    os.write(w, b"y")
    loop.run_once(0)  # the next turn is a whole one, and the reader (one fault) is still watched
    assert calls == ["reader", "turn end", "turn end after"]
    assert loop.faults == 7
    loop.remove_reader(r)


def test_an_fd_whose_callback_fails_max_faults_turns_in_a_row_is_no_longer_watched(
        loop: Reactor, pipes: list[tuple[int, int]], logged: Records) -> None:
    """A level-triggered fd whose callback fails before it consumes the event would fail
    every turn at full speed: after MAX_FD_FAULTS in a row the guard stops watching it; its
    owner may still remove it, and add it again."""
    calls: list[int] = []
    r, w = new_pipe(pipes)

    def fail() -> None:  # never reads: the fd stays readable
        calls.append(1)
        raise OSError("a bug before the read")

    loop.add_reader(r, fail)
    os.write(w, b"x")
    for _ in range(MAX_FD_FAULTS * 3):
        loop.run_once(0)
    assert len(calls) == MAX_FD_FAULTS
    assert loop.faults == MAX_FD_FAULTS
    assert logged.messages(logging.ERROR)[-1] == (
        f"fd {r}: its callback failed {MAX_FD_FAULTS} times in a row; it is no longer watched")
    loop.remove_reader(r)  # the owner's clean-up of a dropped fd is no error
    read: list[bytes] = []
    loop.add_reader(r, lambda: read.append(os.read(r, 10)))
    loop.run_once(0)
    assert read == [b"x"]  # watched again, with a count of its own
    loop.remove_reader(r)


def test_the_fault_limit_counts_failures_in_a_row_only(loop: Reactor, pipes: list[tuple[int, int]]) -> None:
    calls: list[bool] = []
    r, w = new_pipe(pipes)
    # MAX-1 failures, a success (which does not read either), then failures until dropped.
    plan = [False] * (MAX_FD_FAULTS - 1) + [True] + [False] * (MAX_FD_FAULTS * 2)

    def callback() -> None:
        ok = plan[len(calls)]
        calls.append(ok)
        if not ok:
            raise RuntimeError("failed")

    loop.add_reader(r, callback)
    os.write(w, b"x")
    for _ in range(MAX_FD_FAULTS * 3):
        loop.run_once(0)
    assert len(calls) == (MAX_FD_FAULTS - 1) + 1 + MAX_FD_FAULTS
    loop.remove_reader(r)


def test_an_fd_number_added_anew_starts_with_no_faults(loop: Reactor, pipes: list[tuple[int, int]]) -> None:
    """A callback that removes its own fd and then raises leaves no count behind for the
    next registration of that number (a new child's pipe): it gets MAX_FD_FAULTS of its own."""
    r, w = new_pipe(pipes)
    calls: list[str] = []

    def first() -> None:
        calls.append("first")
        if calls.count("first") == MAX_FD_FAULTS - 1:
            loop.remove_reader(r)  # its owner is done with it, then a bug
        raise RuntimeError("failed")

    def second() -> None:
        calls.append("second")
        raise RuntimeError("failed too")

    loop.add_reader(r, first)
    os.write(w, b"x")
    for _ in range(MAX_FD_FAULTS):
        loop.run_once(0)
    assert calls == ["first"] * (MAX_FD_FAULTS - 1)
    loop.add_reader(r, second)
    for _ in range(MAX_FD_FAULTS * 2):
        loop.run_once(0)
    assert calls.count("second") == MAX_FD_FAULTS
    loop.remove_reader(r)


@pytest.fixture
def urgent() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP connection over loopback (client, server side): urgent data (MSG_OOB) makes the
    server side report EPOLLPRI until it is read, as cgroup.events does until it is read."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    server.close()
    try:
        yield client, conn
    finally:
        client.close()
        conn.close()


def test_a_priority_reader_whose_callback_fails_max_faults_turns_in_a_row_is_no_longer_watched(
        spied: tuple[Reactor, SpySelector], urgent: tuple[socket.socket, socket.socket],
        logged: Records) -> None:
    loop, sel = spied
    client, conn = urgent
    calls: list[int] = []

    def fail() -> None:  # never reads the urgent byte: EPOLLPRI stays
        calls.append(1)
        raise OSError("a bug before the read")

    loop.add_priority_reader(conn.fileno(), fail)
    client.send(b"!", socket.MSG_OOB)
    loop.run_once(5.0)
    for _ in range(MAX_FD_FAULTS * 3):
        loop.run_once(0)
    assert len(calls) == MAX_FD_FAULTS
    assert logged.messages(logging.ERROR)[-1] == (
        f"fd {conn.fileno()}: its priority callback failed {MAX_FD_FAULTS} times in a row; "
        "it is no longer watched")
    loop.run_once(0.05)
    assert sel.ready[-1] == 0  # the nested epoll is quiet: nothing spins
    loop.remove_priority_reader(conn.fileno())  # the owner's clean-up is no error
    seen: list[bytes] = []
    loop.add_priority_reader(conn.fileno(), lambda: seen.append(conn.recv(1, socket.MSG_OOB)))
    loop.run_once(5.0)
    assert seen == [b"!"]  # watched again
    loop.remove_priority_reader(conn.fileno())


def test_the_priority_fault_limit_counts_failures_in_a_row_only(
        loop: Reactor, urgent: tuple[socket.socket, socket.socket]) -> None:
    client, conn = urgent
    calls: list[bool] = []
    plan = [False] * (MAX_FD_FAULTS - 1) + [True] + [False] * (MAX_FD_FAULTS * 2)

    def callback() -> None:  # never reads the urgent byte, not even when it succeeds
        ok = plan[len(calls)]
        calls.append(ok)
        if not ok:
            raise RuntimeError("failed")

    loop.add_priority_reader(conn.fileno(), callback)
    client.send(b"!", socket.MSG_OOB)
    loop.run_once(5.0)
    for _ in range(MAX_FD_FAULTS * 3):
        loop.run_once(0)
    assert len(calls) == (MAX_FD_FAULTS - 1) + 1 + MAX_FD_FAULTS
    loop.remove_priority_reader(conn.fileno())


class FailingWriter:
    """A Writer whose flush fails every other call: as woken by EVENT_WRITE (first in the
    turn), and succeeds, leaving data, at the turn's end."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.flushes = 0

    def pending(self) -> bool:
        return True

    def flush(self) -> None:
        self.flushes += 1
        if self.flushes % 2 == 0:
            raise OSError("a bug in flush")

    def fileno(self) -> int:
        return self.fd


def test_a_writer_whose_event_write_flush_fails_max_faults_times_is_still_flushed_and_removable(
        loop: Reactor, pipes: list[tuple[int, int]]) -> None:
    """The fault limit drops a writer's EVENT_WRITE registration, not the writer: it is
    flushed at the next turn end (which watches its fd again), and remove_writer is clean."""
    _, fd = new_pipe(pipes)  # a pipe's write end: always writable
    writer = FailingWriter(fd)
    loop.add_writer(writer)
    turns = MAX_FD_FAULTS + 5
    for _ in range(turns):
        loop.run_once(0)
    # Turn one flushes at its end only (then watches the fd); every later turn, on the
    # event (fails) and at its end: the drop at the limit is undone by that turn's end.
    assert writer.flushes == 1 + 2 * (turns - 1)
    assert loop.faults == turns - 1
    loop.remove_writer(writer)
    loop.run_once(0)
    assert writer.flushes == 1 + 2 * (turns - 1)  # forgotten
