"""Tasks and replicas for the shutdown tests of the embedded loop (test_embedded_shutdown.py):
each leaves a descendant in a session of its own that ignores SIGTERM, which only a SIGKILL
after the grace ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from orchestrator import Terminated

# A process that ignores SIGTERM, then says it is ready (so that the test never signals
# it before the SIG_IGN is in place) and sleeps.
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(sys.argv[1], 'w').close(); time.sleep(300)")


def _say(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def escape_and_hang(started: str, swallow: bool) -> None:
    """Start a setsid'd child that ignores SIGTERM, say "<worker pid> <child pid>" in
    ``started`` once it ignores it, then never return: ``swallow``: every Terminated is
    swallowed too (only the kill after the grace ends the worker)."""
    armed = started + ".armed"
    child = subprocess.Popen([sys.executable, "-c", STUBBORN, armed], start_new_session=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(armed) and time.monotonic() < deadline:
        time.sleep(0.01)
    _say(started, f"{os.getpid()} {child.pid}")
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            time.sleep(end - time.monotonic())
        except Terminated:
            if not swallow:
                raise
