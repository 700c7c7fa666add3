"""The tasks ``sec_tasks`` runs in every pool's workers: a module that imports only ``os``
and ``time``, so a fresh worker (a process per task) pays no import beyond the pool's own."""

from __future__ import annotations

import os
import time
from typing import Any


def noop(x: Any = None) -> Any:
    return x


def pid(_: Any = None) -> int:
    return os.getpid()


def say(fifo: str, line: str) -> None:
    """One line to the parent's FIFO (shorter than PIPE_BUF: written whole)."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def until_cancelled(fifo: str, n: int, seconds: float) -> int:
    """Says it started, sleeps; says when an exception of the executor's reached it (the
    monotonic clock is the same in every process of the host), or that it ran to its end."""
    from orchestrator import Terminated

    try:  # a cancel may come as soon as the parent has read this line: inside the try
        say(fifo, f"S {n} {os.getpid()}")
        time.sleep(seconds)
    except Terminated as exc:
        say(fifo, f"C {n} {time.monotonic()!r} {type(exc).__name__}")
        raise
    say(fifo, f"E {n}")
    return n


def busy(fifo: str, n: int, seconds: float) -> int:
    say(fifo, f"S {n} {os.getpid()}")
    time.sleep(seconds)
    return os.getpid()


def park_once(mark: str, after: float) -> tuple[float, float]:
    """First attempt: raises ``Retry(after=)``, its monotonic time in ``mark``; second:
    seconds from (that time + after) to its start, and the wall clock of that start."""
    if not os.path.exists(mark):
        from orchestrator import Retry

        with open(mark, "w") as f:
            f.write(repr(time.monotonic()))
        raise Retry(after=after, reason="benchmark")
    began, wall = time.monotonic(), time.time()
    with open(mark) as f:
        return began - (float(f.read()) + after), wall
