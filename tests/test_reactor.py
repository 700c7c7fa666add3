"""The reactor's turn: events of one epoll wait are applied one after the other, and one
callback may undo what a later event of the same turn refers to."""

from __future__ import annotations

import os
import time

from orchestrator.daemon.reactor import Reactor


def test_an_fd_removed_by_an_earlier_callback_of_the_turn_is_not_called():
    """A child's exit (its pidfd) and its command pipe, readable in the same turn: the exit
    handler closes the pipe; its stale event must not run a handler on a closed fd (the
    daemon died of exactly that when its manager was SIGKILLed while a client was sending)."""
    reactor = Reactor(time.monotonic)
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    calls: list[str] = []
    fds = {"a": a_r, "b": b_r}

    def make(name: str, other: str):
        def callback() -> None:
            calls.append(name)
            os.read(fds[name], 10)
            if fds[other] is not None:  # the first to run removes the other, as close_pipes does
                reactor.remove_reader(fds[other])
                os.close(fds[other])
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


def test_a_buffered_writer_flushes_a_large_frame_as_its_reader_drains_it() -> None:
    """50 MB written at once to a socket whose reader takes it in pieces: the reactor
    writes the rest each time the fd turns writable, in order, small writes behind it
    included, and nothing of the large one is copied into a second buffer."""
    import socket

    from orchestrator.daemon.reactor import BufferedWriter

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
    import socket

    from orchestrator.daemon.reactor import BufferedWriter

    a, b = socket.socketpair()
    writer = BufferedWriter(os.dup(a.fileno()))
    writer.write(os.urandom(4 << 20))
    assert writer.pending()
    b.close()
    writer.flush()
    assert not writer.pending() and writer.pending_bytes() == b""
    writer.close()
    a.close()
