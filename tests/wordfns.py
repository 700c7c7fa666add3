"""Tasks for tests/test_executor_word.py (importable by name in every worker)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import Cancelled, Terminated


def say(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once: a reader that sees the file sees all of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.rename(tmp, path)


def block_until(started: str, release: str, limit: float = 60.0) -> int:
    """Says it started (its pid in ``started``), then waits until ``release`` exists."""
    say(started, str(os.getpid()))
    deadline = time.monotonic() + limit
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def pid_of_worker() -> int:
    return os.getpid()


def size_of(data: bytes) -> int:
    return len(data)


def echo(data: bytes) -> bytes:
    return data


def cleans_up(started: str, marker: str, cleanup: float) -> None:
    """Runs until interrupted; its cleanup (``cleanup`` s, in ``finally:``) then records
    which exception came, and whether a second one came while it cleaned up."""
    caught = "nothing"
    say(started, str(os.getpid()))
    try:
        time.sleep(60)
    except BaseException as exc:
        caught = type(exc).__name__
        raise
    finally:
        second = "none"
        try:
            time.sleep(cleanup)
        except BaseException as exc:  # a second exception here cuts the cleanup short
            second = type(exc).__name__
        say(marker, f"{caught} {second}")


def leaves_children(record: str, daemonize: bool) -> str:
    """Starts a process that outlives the task: a child in a session of its own, or (with
    ``daemonize``) a double-forked grandchild whose parent exits at once."""
    if daemonize:
        code = ("import os, subprocess, sys, time\n"
                "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
                f"open({record!r}, 'w').write(str(p.pid))\n")
        subprocess.run([sys.executable, "-c", code], check=True)
    else:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        say(record, str(child.pid))
    return "done"


def leaves_a_child_that_ignores_term(record: str) -> str:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open(%r, 'w').write('ready'); time.sleep(300)"
    ready = record + ".ready"
    child = subprocess.Popen([sys.executable, "-c", code % ready], start_new_session=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    say(record, str(child.pid))
    return "done"


def leaves_child_then_cancelled(record: str, started: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    say(record, str(child.pid))
    say(started, str(os.getpid()))
    try:
        time.sleep(60)
    except Terminated:
        raise


def mark_once(path: str, log: str, seconds: float) -> int:
    """Makes its marker exclusively (a second run would raise), sleeps; a Cancelled that
    reaches it is logged with its number."""
    number = int(os.path.basename(path))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.close(fd)
    try:
        time.sleep(seconds)
    except Cancelled:
        with open(log, "a") as f:
            f.write(f"{number}\n")
        raise
    return number
