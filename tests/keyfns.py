"""Tasks of the task-key tests (test_task_keys.py), importable by name in every worker."""

from __future__ import annotations

import os
import time


def record(log: str, value: object) -> object:
    """One line per run in ``log``: a task that ran twice shows it."""
    with open(log, "a") as f:
        f.write(f"{value}\n")
    return value


def held(started: str, release: str, value: object, limit: float = 120.0) -> object:
    """Says it started (a file), then runs until ``release`` exists, at most ``limit`` s."""
    with open(started + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(started + ".tmp", started)
    end = time.monotonic() + limit
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.01)
    return value


def brief(value: object, seconds: float) -> object:
    """Runs about ``seconds`` (a cancel raced against its end), then returns ``value``."""
    time.sleep(seconds)
    return value
