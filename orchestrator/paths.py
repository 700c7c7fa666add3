"""A state dir's files, and who holds its lock.

    <state dir>/
      daemon.pid        the daemon's pid, POSIX-locked (F_SETLK) for as long as it lives
      authkey           the channel's auth key (0600)
      control.sock      the manager server's Unix socket (0600)
      state.db          the journal (store.py), with -wal and -shm beside it
      watchdog-report.json   what the watchdog did after the daemon died
      logs/daemon.log   the detached daemon's stdout and stderr

Liveness is the lock, never a pid check: the kernel drops it the moment the daemon exits
(a zombie daemon already counts as gone), and F_GETLK names the holder's pid without
taking the lock.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

SOCKET_NAME = "control.sock"
AUTHKEY_NAME = "authkey"
_FLOCK = "hhqqi4x"  # struct flock on Linux (x86_64, aarch64)


class Paths:
    """Where one daemon keeps its files."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.state_dir = Path(os.path.abspath(state_dir))
        self.pidfile = self.state_dir / "daemon.pid"
        self.authkey = self.state_dir / AUTHKEY_NAME
        self.socket = self.state_dir / SOCKET_NAME
        self.db = self.state_dir / "state.db"
        self.logs = self.state_dir / "logs"
        self.log = self.logs / "daemon.log"
        self.report = self.state_dir / "watchdog-report.json"


def default_state_dir() -> Path:
    if os.environ.get("ORCHESTRATOR_STATE_DIR"):
        return Path(os.environ["ORCHESTRATOR_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "orchestrator"


def running_pid(paths: Paths) -> int | None:
    """The daemon's pid if one holds the lock, else None. Never takes the lock."""
    try:
        fd = os.open(paths.pidfile, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, l_pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    finally:
        os.close(fd)
    return None if l_type == fcntl.F_UNLCK else l_pid


def take_lock(paths: Paths) -> int | None:
    """Open and lock the pid file, write our pid; None if another daemon holds it."""
    fd = os.open(paths.pidfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
