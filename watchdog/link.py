"""The orchestrator's side: start the watchdog and keep it fed, without ever blocking.

Used from the orchestrator's single-threaded control loop::

    link = WatchdogLink(state_dir, token=token, remove_files=[socket_dir])
    watchdog_pid = link.start()           # the loop reaps this pid; start() again if it dies
    link.add(pid, start, pgid, "worker", "web-1")   # after each spawn
    link.remove(pid)                      # after each reap
    link.add_cgroup(path)                 # a replica's cgroup, once made (killed whole)
    link.remove_cgroup(path)              # once removed
    if link.pending():                    # the pipe was full: register EVENT_WRITE on
        selector.register(link.fileno(), EVENT_WRITE)   # link.fileno(), call flush()
    link.stop()                           # clean shutdown: "Q", then reap watchdog_pid

The write end of the feed pipe is non-blocking and close-on-exec. A write that would
block is buffered and retried by ``flush()``. The link keeps the whole ledger, so a
restarted watchdog gets every current entry replayed into its new pipe.

Spawning uses ``os.posix_spawn``, not ``subprocess.Popen``: the orchestrator reaps its
children itself, and Popen's own waitpid bookkeeping would race with it. The child gets:

* the pipe's read end as fd 3, stdin and stdout on /dev/null (it must not hold the
  caller's terminal or a ``$(orchestrator start)`` pipe open), stderr inherited;
* an empty signal mask and default dispositions for the signals it cares about (a mask
  inherited from a thread that blocked SIGTERM would otherwise survive exec);
* its own process group, so a Ctrl-C/Ctrl-Z aimed at the parent's group does not stop it;
* ``PYTHONPATH`` led by the directory holding this package, and ``PYTHONSAFEPATH=1`` so
  the current directory is not searched first: ``-m watchdog`` finds this package, never
  the PyPI library of the same name or a stray ``watchdog/`` in the caller's cwd.

Caveat: a write to the pipe of a dead watchdog fails with EPIPE. Python ignores SIGPIPE by
default; a parent that restores SIGPIPE's default action would be killed by it.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import sys
import time
from typing import Any, Mapping
from collections.abc import Sequence

from .identity import start_time
from .ledger import ENCODE_QUIT, encode_add, encode_add_cgroup, encode_remove, encode_remove_cgroup

__all__ = ["WatchdogLink"]

FEED_FD = 3  # where the child finds the read end of the feed
PIPE_SIZE = 1 << 20  # ask for 1 MiB so a large replay fits at once (best effort)
STOP_TIMEOUT = 1.0  # seconds stop() may block writing "Q"

# The directory that contains the `watchdog` package (the repo root, or site-packages).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WatchdogLink:
    """Starts the watchdog process and feeds it the ledger of processes to protect."""

    def __init__(
        self,
        state_dir: str,
        *,
        token: str | None = None,
        grace: float = 0.2,
        remove_files: Sequence[str] = (),
        lock_file: str | None = None,
        python: str = sys.executable,
        batch: bool = False,
        cgroup_subtree: str | None = None,
    ) -> None:
        self.state_dir = os.fspath(state_dir)
        self.token = token
        self.grace = grace
        self.remove_files = [os.fspath(p) for p in remove_files]
        self.lock_file = os.fspath(lock_file) if lock_file is not None else None
        self.python = python
        # The daemon's cgroup subtree (watchdog.cgroup.Subtree), if it has one: on the
        # daemon's death every replica cgroup in it is killed, registered yet or not, and
        # the subtree is removed. Set it before start().
        self.cgroup_subtree = cgroup_subtree
        # batch: add()/remove() only buffer, and the caller flush()es once per loop turn.
        # Each write wakes the watchdog; one per turn instead of two per replica is what
        # keeps it off a churning daemon's back. The ledger then lags by at most a turn,
        # a window that PR_SET_PDEATHSIG, the token and identity checks already cover.
        self.batch = batch
        self.pid: int | None = None
        self._entries: dict[int, bytes] = {}  # pid -> its encoded "A" line, for replays
        self._cgroups: dict[str, bytes] = {}  # cgroup path -> its encoded "G" line, likewise
        self._fd = -1  # write end of the current feed pipe
        self._buffer = bytearray()  # bytes the pipe had no room for yet

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> int:
        """Spawn a watchdog with a fresh pipe and replay the ledger into it; return its pid.

        Does not reap: the caller owns the child. If a previous watchdog's pipe is still
        open, it is told to quit ("Q", best effort) and the pipe closed first.
        """
        if self._fd >= 0:
            self._buffer += ENCODE_QUIT
            self.flush()
            self._close()
        me = os.getpid()
        my_start = start_time(me)
        if my_start is None:  # cannot happen for a running process; fail loudly if it does
            raise RuntimeError("cannot read our own start time from /proc")
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        if read_fd == FEED_FD:
            # dup2(3, 3) would be a no-op that leaves close-on-exec set on some libcs:
            # move the read end off fd 3 first.
            read_fd, old = os.dup(read_fd), read_fd
            os.close(old)
        spawned = False
        try:
            os.set_blocking(write_fd, False)
            try:
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            except PermissionError:  # above /proc/sys/fs/pipe-max-size: keep the default
                pass
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
            # `-m` would put the current directory first on sys.path, where some other
            # `watchdog` package may live: PYTHONSAFEPATH (3.11+) leaves it out.
            env["PYTHONSAFEPATH"] = "1"
            actions = [
                # dup2 first: if stdin/stdout were closed, the pipe may sit on fd 0 or 1.
                (os.POSIX_SPAWN_DUP2, read_fd, FEED_FD),
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            ]
            spawn = os.posix_spawn if os.sep in self.python else os.posix_spawnp
            pid = spawn(
                self.python,
                self._argv(me, my_start),
                env,
                file_actions=actions,
                setpgroup=0,
                setsigmask=(),
                setsigdef=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE),
            )
            spawned = True
        finally:
            os.close(read_fd)  # the child has its copy
            if not spawned:
                os.close(write_fd)
        self._fd = write_fd
        self.pid = pid
        self._buffer = bytearray(b"".join([*self._entries.values(), *self._cgroups.values()]))
        self.flush()
        return pid

    def _argv(self, parent_pid: int, parent_start: int) -> list[str]:
        argv = [
            self.python, "-m", "watchdog",
            "--parent-pid", str(parent_pid),
            "--parent-start", str(parent_start),
            "--state-dir", self.state_dir,
            "--feed-fd", str(FEED_FD),
            "--grace", repr(float(self.grace)),
        ]  # fmt: skip
        if self.token:
            argv += ["--token", self.token]
        for path in self.remove_files:
            argv += ["--remove", path]
        if self.lock_file is not None:
            argv += ["--lock", self.lock_file]
        if self.cgroup_subtree is not None:
            argv += ["--cgroup-subtree", self.cgroup_subtree]
        return argv

    def stop(self) -> None:
        """Clean shutdown: send "Q" (blocking at most ~1 s), then close the pipe.

        The caller then waits for and reaps ``pid``. If "Q" could not be delivered the
        watchdog sees EOF without it, keeps watching, and would sweep when this process
        exits: so reap it, and terminate it if it has not exited.
        """
        if self._fd < 0:
            return
        self._buffer += ENCODE_QUIT
        deadline = time.monotonic() + STOP_TIMEOUT
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while self._fd >= 0 and self._buffer:
            self.flush()
            remaining = deadline - time.monotonic()
            if not self._buffer or remaining <= 0:
                break
            poller.poll(remaining * 1000)
        self._close()

    def carried(self) -> dict[str, Any]:
        """For the caller's exec of itself (it keeps its pid, so the watchdog watches on):
        the feed's fd, made inheritable, and the ledger and unsent bytes, as JSON."""
        if self._fd >= 0:
            os.set_inheritable(self._fd, True)
        return {"fd": self._fd, "entries": {str(pid): line.hex() for pid, line in self._entries.items()},
                "cgroups": {path: line.hex() for path, line in self._cgroups.items()},
                "unsent": bytes(self._buffer).hex()}

    def adopt(self, carried: Mapping[str, Any]) -> None:
        """After that exec: the link as ``carried()`` described it, to the same watchdog."""
        self._fd = int(carried["fd"])
        if self._fd >= 0:
            os.set_inheritable(self._fd, False)
            os.set_blocking(self._fd, False)
        self.pid = int(carried["pid"]) if carried.get("pid") is not None else None
        self._entries = {int(pid): bytes.fromhex(line) for pid, line in carried["entries"].items()}
        self._cgroups = {path: bytes.fromhex(line) for path, line in carried["cgroups"].items()}
        self._buffer = bytearray(bytes.fromhex(carried["unsent"]))

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._buffer.clear()

    # -- ledger ---------------------------------------------------------------------

    def add(self, pid: int, start: int, pgid: int | None, kind: str = "worker", label: str = "") -> None:
        """Register ``(pid, start)``; ``kind`` "worker" also kills its group ``pgid``."""
        line = encode_add(pid, start, pgid, kind, label)
        self._entries[pid] = line
        self._send(line)

    def remove(self, pid: int) -> None:
        """Forget ``pid`` (call it once the process is reaped, before its pid can be reused)."""
        if self._entries.pop(pid, None) is not None:
            self._send(encode_remove(pid))

    def add_cgroup(self, path: str) -> None:
        """Register a replica cgroup: on the parent's death it is killed whole and removed."""
        line = encode_add_cgroup(path)
        self._cgroups[path] = line
        self._send(line)

    def remove_cgroup(self, path: str) -> None:
        """Forget a cgroup (call it once it is removed, or it is no longer a replica's)."""
        if self._cgroups.pop(path, None) is not None:
            self._send(encode_remove_cgroup(path))

    def _send(self, data: bytes) -> None:
        if self._fd < 0:
            return  # no watchdog yet: start() replays the ledger
        self._buffer += data
        if not self.batch:
            self.flush()

    # -- non-blocking output ----------------------------------------------------------

    def pending(self) -> bool:
        """True if bytes are still buffered (wait for ``fileno()`` to be writable, flush())."""
        return bool(self._buffer)

    def fileno(self) -> int:
        """The write end of the feed pipe, for EVENT_WRITE while ``pending()``."""
        if self._fd < 0:
            raise ValueError("the watchdog link is not started")
        return self._fd

    def flush(self) -> None:
        """Write as much of the buffer as the pipe takes now; never blocks."""
        while self._buffer and self._fd >= 0:
            try:
                written = os.write(self._fd, self._buffer)
            except BlockingIOError:
                return
            except BrokenPipeError:
                # The watchdog is gone. The caller notices when it reaps the pid and
                # calls start(), which replays the ledger; the buffer is moot.
                self._buffer.clear()
                return
            del self._buffer[:written]
