"""Tasks of the per-task figures tests (tests/test_task_figures.py), importable by name in
every worker, embedded or in a daemon (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

# A child that burns CPU until its own user + system time reaches argv[1] seconds, then
# prints that time: what the task's figure must include.
BURN = ("import os, sys\n"
        "want = float(sys.argv[1])\n"
        "while sum(os.times()[:2]) < want:\n"
        "    sum(range(10000))\n"
        "print(sum(os.times()[:2]), flush=True)\n")


def touch(mib: int) -> int:
    """Makes ``mib`` MiB resident (every page written), then gives them back; the worker's pid."""
    block = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        block[::mmap.PAGESIZE] = b"\1" * ((mib << 20) // mmap.PAGESIZE)
    finally:
        block.close()
    return os.getpid()


def small() -> int:
    return os.getpid()


def child_burns(seconds: float) -> float:
    """Runs a child that burns ``seconds`` of CPU; the CPU time the child counted itself."""
    out = subprocess.run([sys.executable, "-c", BURN, str(seconds)], check=True, capture_output=True, text=True,
                         timeout=120)
    return float(out.stdout)


def orphan_burns(seconds: float, marker: str) -> float:
    """Starts a grandchild that leaves its parent (a double fork, a session of its own)
    and burns ``seconds`` of CPU; returns once it said it is done (the worker, its
    subreaper, reaps it before it answers). The CPU time the grandchild counted."""
    code = ("import os, sys\n"
            "if os.fork():\n"
            "    os._exit(0)\n"
            "os.setsid()\n"
            "want = float(sys.argv[1])\n"
            "while sum(os.times()[:2]) < want:\n"
            "    sum(range(10000))\n"
            f"with open({marker + '.tmp'!r}, 'w') as f:\n"
            "    f.write(str(sum(os.times()[:2])))\n"
            f"os.rename({marker + '.tmp'!r}, {marker!r})\n")
    subprocess.run([sys.executable, "-c", code, str(seconds)], check=True, timeout=60)
    path = Path(marker)
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the grandchild never said it was done")
        time.sleep(0.01)
    return float(path.read_text())


def sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def held(started: str, seconds: float) -> None:
    """Says it started (a file), then sleeps: a task to cancel while it runs."""
    Path(started).write_text(str(os.getpid()))
    time.sleep(seconds)
