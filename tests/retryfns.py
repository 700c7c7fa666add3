"""Tasks of the retry tests (test_task_retry.py) and of the parked-task benchmark,
importable by name in every worker. Each attempt leaves a line in a file the test names, so
the test counts attempts and reads when each began (the host's wall clock, as a task's
``wait_until`` is)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator import Retry


def _attempt(log: str) -> int:
    """This attempt's number (1 for the first), its start time appended to ``log``."""
    with open(log, "a") as f:
        f.write(f"{time.time()!r}\n")
    return len(Path(log).read_text().split())


def starts(log: str) -> list[float]:
    """When each attempt of the task that wrote ``log`` began."""
    return [float(x) for x in Path(log).read_text().split()] if os.path.exists(log) else []


def park_once(log: str, after: float, reason: str) -> float:
    """Its first attempt raises Retry(after=); the second returns when it began."""
    if _attempt(log) == 1:
        raise Retry(after=after, reason=reason)
    return starts(log)[-1]


def always_park(log: str, after: float) -> None:
    _attempt(log)
    raise Retry(after=after, reason="never ready")


def flaky(log: str, fails: int) -> int:
    """Raises ConnectionError on its first ``fails`` attempts; then returns the attempt's number."""
    n = _attempt(log)
    if n <= fails:
        raise ConnectionError(f"attempt {n}")
    return n


def wrong(log: str) -> None:
    _attempt(log)
    raise ValueError("not a connection problem")


def bad_retry(after: object) -> None:
    raise Retry(after=after)  # type: ignore[arg-type]  # what the test gives: not a number


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def now() -> float:
    return time.time()


def park_then_hold(log: str, go: str, after: float) -> int:
    """Its first attempt raises Retry(after=); the second reads the FIFO ``go`` (it blocks
    until the test opens it to write), then returns its attempt's number."""
    n = _attempt(log)
    if n == 1:
        raise Retry(after=after, reason="not yet")
    with open(go) as f:
        f.read()
    return n
