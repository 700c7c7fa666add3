"""Targets that the daemon tests launch with --target workers:NAME."""

import os
import signal
import time


def sleeper() -> None:
    time.sleep(1000)


def stubborn() -> None:
    """Ignores SIGTERM: only the SIGKILL after the grace ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1000)


def spawns_grandchild() -> None:
    """Leaves a grandchild in its process group, then sleeps."""
    if os.fork() == 0:
        time.sleep(1000)
        os._exit(0)
    time.sleep(1000)


def escapes_with_setsid() -> None:
    """A grandchild that leaves the worker's group and session."""
    if os.fork() == 0:
        os.setsid()
        time.sleep(1000)
        os._exit(0)
    time.sleep(1000)


def orphan_maker() -> None:
    """Double-forks a grandchild that outlives its parent, so it is orphaned and
    re-parented to the daemon (a subreaper); it writes its pid to $ORPHAN_FILE, waits for
    $ORPHAN_FILE.go to appear, and exits."""
    path = os.environ["ORPHAN_FILE"]
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            deadline = time.monotonic() + 30
            while not os.path.exists(path + ".go") and time.monotonic() < deadline:
                time.sleep(0.01)
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(1000)
