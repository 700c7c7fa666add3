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
