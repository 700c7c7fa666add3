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


def stamped() -> None:
    """Writes the system-wide monotonic time of what it does to $STAMPS/<replica id>.<what>:
    ``start``; ``ready`` (after $GO exists, if set, and $READY_AFTER seconds), also made
    visible as $STAMPS/<pool>.slot<slot>.ready for an exec readiness probe; on SIGTERM ``term``,
    then $STOP_SECS later ``end`` and a clean exit. $EXIT: exit with that code once ready
    (a one-shot job)."""
    import sys

    from orchestrator import Terminated

    stamps, rid = os.environ["STAMPS"], os.environ["ORCHESTRATOR_REPLICA_ID"]
    marker = os.path.join(stamps, f"{os.environ['ORCHESTRATOR_POOL']}.slot{os.environ['ORCHESTRATOR_SLOT']}.ready")

    def stamp(what: str, path: str | None = None) -> None:
        path = path or os.path.join(stamps, f"{rid}.{what}")
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(path + ".tmp", path)

    try:
        if os.path.exists(marker):
            os.unlink(marker)  # an earlier replica's in this slot
        stamp("start")
        go = os.environ.get("GO")
        deadline = time.monotonic() + 60
        while go and not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(float(os.environ.get("READY_AFTER", "0")))
        stamp("ready")
        stamp("ready", marker)
        if "EXIT" in os.environ:
            sys.exit(int(os.environ["EXIT"]))
        time.sleep(1000)
    except Terminated:
        stamp("term")
        time.sleep(float(os.environ.get("STOP_SECS", "0")))
        stamp("end")
