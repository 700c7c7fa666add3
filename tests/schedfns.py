"""Tasks of the scheduling tests (test_scheduling.py), importable by name in every worker."""

from __future__ import annotations

import os
import time


def gate(fifo: str) -> str:
    """Blocks until the test opens ``fifo`` for writing and closes it (no poll: the open
    waits for the writer, the read for its close)."""
    fd = os.open(fifo, os.O_RDONLY)
    try:
        while os.read(fd, 64):
            pass
    finally:
        os.close(fd)
    return "open"


def now(_: object = None) -> float:
    """When it ran: the host's monotonic clock, the same in every process."""
    return time.monotonic()


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
