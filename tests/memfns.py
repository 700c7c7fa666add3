"""Tasks of the memory_max tests (tests/test_executor_memory.py), importable by name in
every worker, embedded or in a daemon (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

PROGRESS = struct.Struct("qq")  # MiB touched so far, the worker's resident bytes before it began
HOLD = "import sys, time; b = bytearray({n}); [b.__setitem__(i, 1) for i in range(0, {n}, 4096)]; " \
       "print('held', flush=True); time.sleep(300)"


def resident() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def touch(mib: int, progress: str, runs: str, at: float = 0.0, hold: float = 30.0) -> int:
    """At the wall-clock time ``at`` (or now), makes ``mib`` MiB resident as fast as a
    Python loop can touch pages (about 2 GiB/s), saying after each MiB how far it got in
    ``progress`` (an mmap: the word outlives a SIGKILL); appends a line to ``runs`` when
    it starts."""
    with open(runs, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(max(0.0, at - time.time()))
    with open(progress, "r+b") as f:
        word = mmap.mmap(f.fileno(), PROGRESS.size)
    word[:] = PROGRESS.pack(0, resident())
    # Not bytearray(n): its memset would touch every page in one C call, before any progress.
    block = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(mib):
        for at in range(i << 20, (i + 1) << 20, 4096):
            block[at] = 1
        word[:8] = struct.pack("q", i + 1)
    time.sleep(hold)
    return len(block)


def new_progress(path: Path) -> str:
    path.write_bytes(bytes(PROGRESS.size))
    return str(path)


def read_progress(path: Path) -> tuple[int, int]:
    """(MiB the task had touched when it was killed, its worker's resident bytes before)."""
    touched, before = PROGRESS.unpack(path.read_bytes()[:PROGRESS.size])
    return touched, before


def child_holds(mib: int, started: str, setsid: bool) -> None:
    """A child (in a session of its own with ``setsid``) that makes ``mib`` MiB resident and
    holds them ("<worker pid> <child pid>" in ``started`` first); then a long sleep."""
    child = subprocess.Popen([sys.executable, "-c", HOLD.format(n=mib << 20)], stdout=subprocess.PIPE,
                             start_new_session=setsid)
    tmp = f"{started}.tmp"
    Path(tmp).write_text(f"{os.getpid()} {child.pid}")
    os.rename(tmp, started)
    assert child.stdout is not None
    child.stdout.readline()
    time.sleep(60)
