"""Python targets for the stress tests (``--target stress.crashers:NAME``): replicas that end
at an odd moment in an odd way, drawn from ``STRESS_SEED`` and their own id, so a run
replays."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import sys
import time

WAYS = ("segfault", "sigkill", "abort", "exit0", "exit3")
DELAYS = (0.0, 0.005, 0.05, 0.2, 0.6)


def odd() -> None:
    """Sleep a drawn delay, then end a drawn way: a real segfault (a NULL read), SIGKILL
    of itself, abort(), or an exit of its own with 0 or 3."""
    rng = random.Random(f"{os.environ.get('STRESS_SEED')}:{os.environ['ORCHESTRATOR_REPLICA_ID']}")
    time.sleep(rng.choice(DELAYS))
    way = rng.choice(WAYS)
    if way == "segfault":
        ctypes.string_at(0)
    elif way == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif way == "abort":
        os.abort()
    sys.exit(0 if way == "exit0" else 3)
