"""The control plane's reserve at the daemon's permanent limits: file descriptors
(RLIMIT_NOFILE) and processes (a pids cgroup's ``pids.max``, systemd's ``TasksMax=``).

Replicas are what fills a limit: each costs the daemon up to ``FDS_PER_REPLICA`` fds (its
pidfd, its stdout and stderr pipes and their two log files, its ready pipe while it starts
or an executor worker's task connection) and at least one pid. At the limit the daemon itself must still be able to restart its manager
server (two pipes and a pidfd; a process and its threads), its watchdog, and reopen its
journal, or nobody can reach it again. Two walls keep that room:

* ``FdReserve``: spare fds (``/dev/null``) opened at start, so with the lowest numbers,
  and held. The control plane's own openings run inside ``FdReserve.spent()``, which gives
  them back for that moment; the reserve takes fds again as they free up (at the end of
  each loop turn while it is short). Whatever else fills the table (replicas' fds, probes,
  connections), those fds are not its to take.
* ``Limits.refusal()``: a ``launch``, ``scale`` or ``executor`` that would need more fds or
  pids than are left beside the reserve is refused before anything changes, in one line
  that says what is left and what to raise. Replacements of replicas that ended are not
  refused (what they take, the ended ones gave back).

Loop thread only; it starts no thread and nothing here blocks.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
from typing import Any, Iterator

FDS_PER_REPLICA = 6
PIDS_RESERVE = 16  # a manager server and its threads (~8), a watchdog, a spawner, with room
_SHORT_CHECK = 1  # fds a turn's top-up tries to open while short (one failing open at the limit)


def raise_fd_limit() -> tuple[int, int] | None:
    """Lift the soft fd limit to the hard one, as servers do (a daemon holds fds per
    replica). Returns the limits before, which workers get back (spawn(..., nofile=...)), or
    None if nothing changed. A hard limit of "unlimited" means the kernel's ``nr_open``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if hard == resource.RLIM_INFINITY:
        want = _nr_open()
    if soft != resource.RLIM_INFINITY and soft >= want:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):  # a seccomp filter, a kernel that says no: run with what we have
        return None
    return soft, hard


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's default nr_open


def fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _nr_open() if soft == resource.RLIM_INFINITY else int(soft)


def reserve_size(limit: int) -> int:
    """Spare fds for a limit: 8 at 64, 32 from 1024 on."""
    return max(8, min(32, limit // 32))


def open_fds() -> int | None:
    """How many fds this process has open now; None if that cannot be seen (no fd left to
    list them with)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself had open
    except OSError:
        return None


def fd_table_size() -> int | None:
    """The size of this process's fd table (``FDSize`` of /proc/self/status): at least one
    more than its highest open fd, so never fewer than the fds it has open. Read in tens of
    microseconds whatever is open, where counting them (``open_fds``: a listing of
    /proc/self/fd) takes about 10 ms at 2,000 replicas, which a ``scale`` paid in the loop.
    None if it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class FdReserve:
    """``size`` spare fds, held: see the module docstring."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._fds: list[int] = []
        self.top_up(size)

    @property
    def held(self) -> int:
        return len(self._fds)

    def top_up(self, at_most: int | None = None) -> None:
        """Take fds back, up to ``size`` (``at_most`` of them this time)."""
        todo = self.size - len(self._fds) if at_most is None else min(at_most, self.size - len(self._fds))
        for _ in range(todo):
            try:
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:  # EMFILE: still at the limit; the next turn tries again
                return

    def turn_end(self) -> None:
        """At the end of a loop turn: while short, try to take fds back (one try while the
        table is full, so a daemon at its limit pays one failing open a turn)."""
        if len(self._fds) < self.size:
            before = len(self._fds)
            self.top_up(_SHORT_CHECK)
            if len(self._fds) > before:
                self.top_up()

    @contextlib.contextmanager
    def spent(self) -> Iterator[None]:
        """Give the spare fds back for what runs inside (the control plane's own need),
        and take them again after, as far as fds are free."""
        self.release()
        try:
            yield
        finally:
            self.top_up()

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    close = release


class Limits:
    """What a launch may still take: fds beside the reserve, pids beside ``PIDS_RESERVE``."""

    def __init__(self, reserve: FdReserve, *, mountinfo: str | None = None) -> None:
        self.reserve = reserve
        self._pids_mounts = pids_mounts(mountinfo)
        self.base: int | None = None  # fds the daemon holds beside its replicas (measure_base)

    def measure_base(self, replicas: int) -> None:
        """Once the daemon is up: what it holds beside its ``replicas`` (counted at the
        three fds each surely holds by then: a replica's log files come with its output)."""
        opened = open_fds()
        if opened is not None:
            self.base = opened - 3 * replicas

    def refusal(self, more: int, *, replicas: int = 0, waiting: int = 0) -> str | None:
        """Why ``more`` new replicas would take the control plane's reserve, beside the
        ``replicas`` that have a process and the ``waiting`` ones that will (PENDING, or a
        place a restart fills), in one line; None if they fit. Every replica counts
        ``FDS_PER_REPLICA``, whatever it holds yet."""
        if more <= 0:
            return None
        limit = fd_limit()
        short = self.reserve.size - self.reserve.held  # the reserve takes these back first

        def room_at(opened: int) -> int:
            own = max(opened - FDS_PER_REPLICA * replicas, self.base if self.base is not None else 0)
            return (limit - own - short) // FDS_PER_REPLICA - replicas - waiting

        bound = fd_table_size()  # never fewer than the fds open: the room at it is the least there is
        if bound is not None and more <= room_at(bound):
            room, shown = more, ""  # they fit: no need to count the fds
        else:
            opened = open_fds()
            room, shown = (0, "all") if opened is None else (room_at(opened), str(opened))  # None: no fd to look with
        if more > room:
            return (f"refused: {more} more replica(s) need {more * FDS_PER_REPLICA} file descriptors, and the "
                    f"daemon has room for {max(0, room)} more ({shown} of its limit {limit} open, "
                    f"{FDS_PER_REPLICA} counted a replica, {self.reserve.size} kept for itself); raise its fd limit "
                    "(ulimit -n, LimitNOFILE=) and restart it")
        pids = self.pids()
        if pids is not None:
            left, path = pids
            room = left - PIDS_RESERVE - waiting
            if more > room:
                return (f"refused: {more} more replica(s) need {more} processes, and the daemon's cgroup "
                        f"{path} has room for {max(0, room)} more ({left} left under its pids.max, {PIDS_RESERVE} "
                        "kept for the daemon itself); raise pids.max (TasksMax=)")
        return None

    def pids(self) -> tuple[int, str] | None:
        """(pids left, the cgroup whose pids.max leaves the fewest) over the daemon's cgroup
        and its ancestors; None where no pids limit applies."""
        best: tuple[int, str] | None = None
        for path in self._cgroup_dirs():
            try:
                with open(os.path.join(path, "pids.max")) as f:
                    top = f.read().strip()
                if top == "max":
                    continue
                with open(os.path.join(path, "pids.current")) as f:
                    left = int(top) - int(f.read())
            except (OSError, ValueError):
                continue
            if best is None or left < best[0]:
                best = (left, path)
        return best

    def describe(self) -> dict[str, Any]:
        """For ``status --json`` (``daemon.limits``)."""
        pids = self.pids()
        return {"nofile": fd_limit(), "fds_open": open_fds(), "fd_reserve": self.reserve.size,
                "fd_reserve_held": self.reserve.held, "fds_per_replica": FDS_PER_REPLICA,
                "pids_left": pids[0] if pids is not None else None,
                "pids_cgroup": pids[1] if pids is not None else None, "pids_reserve": PIDS_RESERVE}

    def _cgroup_dirs(self) -> Iterator[str]:
        """The directories of this process's pids cgroups, each with its ancestors, up to
        the mount point."""
        try:
            with open("/proc/self/cgroup", encoding="utf-8", errors="surrogateescape") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for line in lines:
            hierarchy, _, rest = line.partition(":")
            controllers, _, rel = rest.partition(":")
            version = 2 if hierarchy == "0" and controllers == "" else 1
            if version == 1 and "pids" not in controllers.split(","):
                continue
            for root, point in self._pids_mounts.get(version, ()):
                if root != "/":
                    if rel != root and not rel.startswith(root + "/"):
                        continue  # outside the part of the hierarchy this mount shows
                    rel = rel[len(root):] or "/"
                path = os.path.normpath(point + rel)
                while True:
                    yield path
                    if path == point or len(path) <= len(point):
                        break
                    path = os.path.dirname(path)
                break


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def pids_mounts(mountinfo: str | None = None) -> dict[int, list[tuple[str, str]]]:
    """{2: [(root, mount point)] of cgroup2 mounts, 1: those of v1 pids hierarchies}."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
        except OSError:
            return {}
    found: dict[int, list[tuple[str, str]]] = {}
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        if tail[0] == "cgroup2":
            found.setdefault(2, []).append((_unescape(fields[3]), _unescape(fields[4])))
        elif tail[0] == "cgroup" and len(tail) >= 3 and "pids" in tail[2].split(","):
            found.setdefault(1, []).append((_unescape(fields[3]), _unescape(fields[4])))
    return found
