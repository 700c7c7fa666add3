"""Tasks that the executor tests submit (importable by name in every worker, and by the
spawn context's children of ProcessPoolExecutor)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import Cancelled, TaskTimeout, Terminated

_initialized: list[str] = []


def _say(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once: a reader that sees the file sees all of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.rename(tmp, path)


def square(x: int) -> int:
    return x * x


def pid(_: object = None) -> int:
    return os.getpid()


def fail(message: str) -> None:
    raise ValueError(message)


def sleep_then(seconds: float, value: object) -> object:
    time.sleep(seconds)
    return value


def init(tag: str) -> None:
    _initialized.append(tag)


def initialized() -> list[str]:
    return list(_initialized)


def init_fails() -> None:
    raise RuntimeError("no database")


def wait_for_cancel(started: str, marker: str) -> str:
    """Says it started (a file), then sleeps until something interrupts it; its
    ``finally:`` writes the exception's type to ``marker``."""
    caught = "nothing"
    _say(started, str(os.getpid()))
    try:
        time.sleep(60)
    except BaseException as exc:
        caught = type(exc).__name__
        raise
    finally:
        _say(marker, caught)
    return "not interrupted"


def record_cancel(token: int, log: str, seconds: float) -> int:
    """Sleeps ``seconds``; if a Cancelled reaches it, appends its own token to ``log``."""
    try:
        time.sleep(seconds)
    except Cancelled:
        with open(log, "a") as f:
            f.write(f"{token}\n")
        raise
    return token


def ignores_cancel_with_grandchild(started: str) -> None:
    """A setsid'd grandchild (outside the worker's group and session), then it swallows
    every Terminated and goes on sleeping: only the kill after the grace ends it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    _say(started, f"{os.getpid()} {child.pid}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            time.sleep(deadline - time.monotonic())
        except Terminated:
            continue


def timed(marker: str) -> None:
    try:
        time.sleep(60)
    except TaskTimeout:
        _say(marker, "TaskTimeout")
        raise


def unpicklable_result() -> object:
    return (i for i in range(3))  # a generator: neither pickle nor dill can


def allocate(mib: int, hold: float) -> int:
    block = bytearray(mib << 20)
    for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
        block[i] = 1
    time.sleep(hold)
    return len(block)


def exit_with(code: int) -> None:
    os._exit(code)


def exits(code: int) -> None:
    raise SystemExit(code)


def allocate_bytes(n: int) -> bytes:
    return bytes(n)
