"""cgroup v2 containment: one cgroup per replica, killed and awaited as a whole.

A process group is a promise a worker can break (``setsid``, ``setpgid``, a shell's job
control, GNU ``timeout``); a cgroup is not: every descendant stays in its ancestor's cgroup
unless someone with write access to the hierarchy moves it. So a replica's whole tree can be
signalled (``send_signal``), killed in one write (``kill``: ``cgroup.kill``) and awaited
(``cgroup.events`` says ``populated 0``), whatever it did to its groups and environment.

Layout (``Subtree``), under the daemon's own cgroup or any writable cgroup dir::

    <parent>/<name>/              name contains "orchestrator" (leftover checks look for it)
        daemon/                   the daemon moves itself here (no-internal-processes rule:
                                  a cgroup with controllers enabled for its children may
                                  not hold processes itself)
        replicas/<replica_id>/    one leaf per replica

Module-level functions take an absolute cgroup directory and need no ``Subtree``: the
watchdog, which only knows paths from its ledger, uses them directly. They never look for
the mount at a fixed place: hybrid hosts mount cgroup2 at ``/sys/fs/cgroup/unified``, so
``find_mount`` reads ``/proc/self/mountinfo``.

Waiting on ``cgroup.events`` (``events_fd``): the fd of the file itself, polled for
POLLPRI/EPOLLPRI. Measured on this kernel (6.18) against inotify (IN_MODIFY on
cgroup.events), both work under epoll and wake equally fast after ``cgroup.kill`` (both are
fed by the same kernfs notification). The file's own poll wins
because inotify instances are capped per user (``fs.inotify.max_user_instances``: 128 here,
shared with everything else the uid runs; the 129th ``inotify_init1`` failed with EMFILE),
while a daemon holds one fd per replica, thousands of them; and it needs no ctypes. Its
rules, also measured: register POLLPRI, never POLLIN (kernfs always reports POLLIN, so an
EPOLLIN registration spins); a fresh fd reports POLLPRI until it is read once (``events_fd``
does that); each read re-arms it (``populated(fd)`` reads with pread); once the cgroup is
removed the fd reports POLLPRI|POLLERR for good and reads fail with ENODEV, so a waiter on a
removed cgroup wakes up rather than hangs. Notifications are rate-limited by the kernel (a
change within ~10 ms of the previous one is delivered by a timer, a little later, not lost).

Stdlib only: the daemon may import this in its forked children (``join``) and the watchdog
must start fast.
"""

from __future__ import annotations

import errno
import math
import os
import re
import select
import signal as _signal
import time
from collections.abc import Iterable, Mapping
from typing import TypedDict

__all__ = [
    "CgroupUnavailable", "Subtree", "find_mount", "read_mount", "own_path", "require_own_path", "join", "kill",
    "send_signal", "signal_members", "populated", "events_fd", "wait_unpopulated", "remove", "kill_and_remove",
    "KillRecord", "KillReport", "oom_killed", "refusal", "EVENTS_POLL_MASK", "LIMITS",
]  # fmt: skip

EVENTS_POLL_MASK = select.POLLPRI  # == select.EPOLLPRI: what to register an events_fd for
# Limit key (pool option) -> (interface file, controller it needs).
LIMITS = {"memory_max": ("memory.max", "memory"), "pids_max": ("pids.max", "pids"), "cpu_weight": ("cpu.weight", "cpu")}
WANTED_CONTROLLERS = ("memory", "pids", "cpu")
MARK = "orchestrator"  # every cgroup dir we create has it in its name
KILL_WAIT = 1.0  # seconds the signal fallback of kill() may take
_ROUND = 0.1  # seconds the fallback waits for a round of SIGKILLs to empty the cgroup


class CgroupUnavailable(Exception):
    """cgroup containment cannot be used here; ``str()`` is a one-line reason for the user."""


# -- where the hierarchy is -------------------------------------------------------------


def _unescape(text: str) -> str:
    r"""Undo mountinfo's octal escapes (``\040`` space, ``\011`` tab, ``\012``, ``\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _escape(text: str) -> str:
    """The inverse of ``_unescape`` for the characters that would split a line or field."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in text)


def _parse_mount(mountinfo_text: str | None = None) -> tuple[str, str] | None:
    """``(root, mount point)`` of the first cgroup2 mount, from mountinfo text.

    A mountinfo line is ``id parent major:minor root mount-point options [optional...] - fstype
    source super-options``: the optional fields vary in number, so the fstype is found after
    the " - " separator, never by position. ``root`` is the part of the hierarchy the mount
    shows (not "/" for a bind mount of a subtree).
    """
    if mountinfo_text is None:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            mountinfo_text = f.read()
    for line in mountinfo_text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if sep and len(fields) >= 5 and tail and tail[0] == "cgroup2":
            return _unescape(fields[3]), _unescape(fields[4])
    return None


def read_mount() -> tuple[str, str] | None:
    """``(root, mount point)`` of the cgroup2 mount, from /proc/self/mountinfo (one read):
    what ``signal_members`` takes, read once by a caller that signals often."""
    return _parse_mount()


def find_mount(mountinfo_text: str | None = None) -> str | None:
    """The cgroup2 mount point (``/proc/self/mountinfo`` by default), or None if none."""
    mount = _parse_mount(mountinfo_text)
    return None if mount is None else mount[1]


def _parse_proc_cgroup(text: str) -> str | None:
    """The cgroup2 path in ``/proc/PID/cgroup`` text: the ``0::`` line (v1 lines have a
    hierarchy number and controller names before it)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].removesuffix(" (deleted)")
    return None


def _hierarchy_path(pid: int | str) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="surrogateescape") as f:
            return _parse_proc_cgroup(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


def _on_mount(mount: tuple[str, str], relative: str) -> str | None:
    root, point = mount
    if root != "/":
        if relative != root and not relative.startswith(root + "/"):
            return None  # outside the part of the hierarchy this mount shows
        relative = relative[len(root) :] or "/"
    return os.path.normpath(point + relative)


def _path_of(pid: int | str, mount: tuple[str, str] | None) -> str | None:
    relative = _hierarchy_path(pid)
    return None if mount is None or relative is None else _on_mount(mount, relative)


def own_path(pid: int | str = "self") -> str | None:
    """The absolute directory of the process's cgroup2 cgroup, or None if not found."""
    return _path_of(pid, _parse_mount())


def require_own_path() -> str:
    """``own_path()``, or CgroupUnavailable saying why there is none (for ``--cgroup auto``)."""
    if find_mount() is None:
        raise CgroupUnavailable("no cgroup2 mount in /proc/self/mountinfo")
    path = own_path()
    if path is None:
        raise CgroupUnavailable("this process's cgroup (line 0:: of /proc/self/cgroup) is not under the cgroup2 mount")
    return path


# -- one cgroup -------------------------------------------------------------------------


def join(path: str, pid: int = 0) -> None:
    """Move ``pid`` (0: the calling process, all its threads) into the cgroup ``path``.

    Called in a freshly forked child before exec, so it is one open, one write, one close
    and nothing else: no allocation-heavy code, no locks, no imports.
    """
    fd = os.open(path + "/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"%d" % pid)
    finally:
        os.close(fd)


def _read(path: str) -> str:
    # os-level: a third of what open() and a text wrapper cost, on the loop's hot path
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("ascii")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def _cgroup_dirs(path: str) -> list[str]:
    """Every cgroup below ``path``, deepest first (the order rmdir needs), then ``path``."""
    below = [top for top, _dirs, _files in os.walk(path, topdown=False) if top != path]
    return [*below, path]


def _members(path: str) -> list[tuple[str, int]]:
    """``(cgroup dir, pid)`` of every process in ``path`` and its descendants."""
    out = []
    for top in _cgroup_dirs(path):
        try:
            out += [(top, int(pid)) for pid in _read(top + "/cgroup.procs").split()]
        except FileNotFoundError:
            pass  # removed meanwhile
    return out


def send_signal(path: str, sig: int) -> int:
    """Send ``sig`` to every process in ``path`` and its descendant cgroups; how many got it.

    A pid read from cgroup.procs may exit and be reused outside the cgroup before the
    signal: each one is pinned with a pidfd and re-checked to be in that cgroup after
    opening, then signalled through the pidfd (the watchdog's identity rule).
    """
    return len(signal_members(path, sig))


def signal_members(path: str, sig: int, mount: tuple[str, str] | None = None) -> list[int]:
    """``send_signal``, returning the pids that got the signal. ``mount``: what
    ``read_mount()`` returned, for a caller that signals many cgroups (None: read now)."""
    if mount is None:
        mount = _parse_mount()
    sent = []
    for where, pid in _members(path):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if _path_of(pid, mount) == where:
                _signal.pidfd_send_signal(fd, sig)
                sent.append(pid)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return sent


def kill(path: str) -> str:
    """SIGKILL everything in ``path`` and below; returns how: "cgroup.kill", "signals", "missing".

    ``cgroup.kill`` (Linux 5.14+) kills the whole subtree in one write, forks in flight
    included. Without it, SIGKILL every member, again and again until the cgroup is empty
    (a fork may race a round), bounded by ``KILL_WAIT``. A "cgroup.kill" returns before
    the processes are gone: ``wait_unpopulated`` for that. The caller makes sure ``path``
    is ours (``refusal``, ``Subtree``); the root cgroup is refused here (ValueError).
    """
    try:
        _write(path + "/cgroup.kill", "1")
        return "cgroup.kill"
    except FileNotFoundError:
        if not os.path.isdir(path):
            return "missing"
    if not os.path.isfile(path + "/cgroup.events"):
        # The root cgroup has neither file: the fallback would SIGKILL the whole host.
        raise ValueError(f"{path} is not a non-root cgroup2 directory")
    _kill_by_signal(path)
    return "signals"


def _kill_by_signal(path: str, timeout: float = KILL_WAIT) -> bool:
    """The fallback of ``kill``: rounds of SIGKILL to every member; True once empty."""
    deadline = time.monotonic() + timeout
    while populated(path):
        send_signal(path, _signal.SIGKILL)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        wait_unpopulated([path], min(_ROUND, remaining))
    return True


def populated(cgroup: str | int) -> bool:
    """Does the cgroup (a path, or an ``events_fd``) hold any process, in it or below?

    A removed cgroup is not populated. Reading an ``events_fd`` re-arms it.
    """
    try:
        if isinstance(cgroup, int):
            text = os.pread(cgroup, 4096, 0).decode("ascii")
        else:
            text = _read(cgroup + "/cgroup.events")
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            return False  # ENODEV: the fd's cgroup was removed
        raise
    return "populated 1" in text.splitlines()


def events_fd(path: str) -> int:
    """An fd on ``path/cgroup.events`` that reports POLLPRI (``EVENTS_POLL_MASK``) on change.

    Register it for POLLPRI/EPOLLPRI, never POLLIN (always "ready" on cgroupfs). It is read
    once here to arm it; after each wake-up call ``populated(fd)``, which re-arms it. The
    caller closes it. FileNotFoundError if the cgroup does not exist.
    """
    fd = os.open(path + "/cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
    try:
        populated(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def wait_unpopulated(paths: Iterable[str], timeout: float) -> list[str]:
    """Wait until none of the cgroups is populated, at most ``timeout`` s; those still populated.

    One poll over every cgroup's events fd: it wakes only when one of them changes.
    """
    deadline = time.monotonic() + timeout
    waiting: dict[int, str] = {}
    try:
        for path in paths:
            try:
                fd = events_fd(path)
            except FileNotFoundError:
                continue
            waiting[fd] = path  # first: closed in `finally` whatever happens next
            if not populated(fd):
                del waiting[fd]
                os.close(fd)
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, EVENTS_POLL_MASK)
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for fd, _events in poller.poll(math.ceil(remaining * 1000)):
                if not populated(fd):
                    poller.unregister(fd)
                    os.close(fd)
                    del waiting[fd]
        return sorted(waiting.values())
    finally:
        for fd in waiting:
            os.close(fd)


def remove(path: str) -> str:
    """rmdir the cgroup and any cgroup below it; "removed", "missing", "busy" or "error: ...".

    Never raises: EBUSY (still populated, or a child that could not go) is a result to
    report, and the caller decides whether to kill and wait first. ENOENT is fine.
    """
    try:
        os.rmdir(path)  # a leaf, the usual case: one syscall
        return "removed"
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            return f"error: {exc.strerror}"
    for top in _cgroup_dirs(path):  # busy: cgroups below it go first (deepest first)
        try:
            os.rmdir(top)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if top == path:
                return "busy" if exc.errno == errno.EBUSY else f"error: {exc.strerror}"
    return "removed"


class KillRecord(TypedDict):
    """What ``kill_and_remove`` did to one cgroup (see there)."""

    path: str
    kill: str
    populated: bool | None
    removed: str


class KillReport(TypedDict):
    """``Subtree.kill_all``'s result: a record per replica cgroup, and how long it took."""

    cgroups: list[KillRecord]
    duration_s: float


def kill_and_remove(paths: Iterable[str], timeout: float = KILL_WAIT) -> list[KillRecord]:
    """Kill every cgroup, wait (bounded) until none is populated, remove them: one record each.

    All kills go out before the one wait, so the cgroups empty in parallel. Never raises
    (the watchdog's clean-up must go on): a failure is the record's "error: ..." value.
    Record: ``path``, ``kill`` (see ``kill``, or "error: ..."), ``populated`` (still, after
    the wait; None if the wait failed), ``removed`` (see ``remove``).
    """
    how = {}
    for path in paths:
        try:
            how[path] = kill(path)
        except (OSError, ValueError) as exc:
            how[path] = f"error: {getattr(exc, 'strerror', None) or exc}"
    try:
        still: set[str] | None = set(wait_unpopulated(how, timeout))
    except OSError:  # e.g. out of fds: what is still populated is then unknown
        still = None
    return [
        {"path": p, "kill": k, "populated": None if still is None else p in still, "removed": remove(p)}
        for p, k in how.items()
    ]


def oom_killed(path: str) -> bool:
    """Did the kernel OOM-kill a process in this cgroup (``memory.events`` ``oom_kill`` > 0)?

    False where there is no memory controller (no file).
    """
    try:
        text = _read(path + "/memory.events")
    except FileNotFoundError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value) > 0
    return False


def refusal(path: str, mount: str | None, own: str | None) -> str | None:
    """Why ``path`` is not a cgroup we may kill whole, or None if it is.

    The watchdog kills whatever paths its ledger names: a bug upstream must not be able to
    take down the host's slices or the watchdog itself. A target must be a normalised path
    under the cgroup2 ``mount`` (``find_mount()``), below a directory whose name contains
    "orchestrator", and neither the caller's own cgroup (``own``: ``own_path()``) nor one of
    its ancestors. Pure: the caller reads mount and own once for many paths.
    """
    if mount is None:
        return "no cgroup2 mount"
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        return "not a normalised absolute path"
    if not path.startswith(mount.rstrip("/") + "/"):
        return f"not under the cgroup2 mount {mount}"
    if not any(MARK in part for part in path[len(mount) :].split("/")):
        return f"no {MARK!r} directory in the path"
    if own is not None and (own == path or own.startswith(path + "/")):
        return "holds the caller itself"
    return None


# -- the daemon's subtree ---------------------------------------------------------------


def _unavailable(action: str, path: str, exc: OSError) -> CgroupUnavailable:
    reason = (exc.strerror or str(exc)).lower()
    return CgroupUnavailable(f"cannot {action} {path}: {reason}")


def _enable(path: str, wanted: Iterable[str]) -> None:
    """Best effort: enable for ``path``'s children each wanted controller it has."""
    try:
        available = set(_read(path + "/cgroup.controllers").split())
    except OSError:
        return
    for name in wanted:
        if name in available:
            try:
                _write(path + "/cgroup.subtree_control", f"+{name}")
            except OSError:
                pass  # e.g. EBUSY: the dir holds processes; the controller stays off below


class Subtree:
    """The daemon's cgroup subtree: ``daemon/`` (itself) and ``replicas/<id>/`` (workers)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.normpath(path)
        self.parent = os.path.dirname(self.path)
        self.daemon_dir = os.path.join(self.path, "daemon")
        self.replicas_dir = os.path.join(self.path, "replicas")

    @classmethod
    def create(cls, parent_dir: str, name: str, *, move_self: bool = True) -> Subtree:
        """Make (or reuse) ``parent_dir/name/{daemon,replicas}``; with ``move_self``, move in.

        Order matters: the daemon moves into ``daemon/`` before controllers are enabled,
        because a non-root cgroup with processes of its own may not enable controllers for
        its children. Enabling is best effort; ``controllers`` says what replicas got. So
        call this before starting the watchdog (or anything else that would stay behind
        in ``parent_dir``): children started afterwards are born in ``daemon/``, and the
        watchdog, living there, is never inside a replica cgroup it kills.
        """
        if MARK not in name or "/" in name or name in (".", ".."):
            raise ValueError(f"a subtree name must be one path component containing {MARK!r}: {name!r}")
        if not os.path.isfile(os.path.join(parent_dir, "cgroup.procs")):
            raise CgroupUnavailable(f"{parent_dir} is not a cgroup2 directory")
        tree = cls(os.path.join(parent_dir, name))
        for path in (tree.path, tree.daemon_dir, tree.replicas_dir):
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise _unavailable("create cgroups under", parent_dir, exc) from None
        if move_self:
            try:
                join(tree.daemon_dir)
            except OSError as exc:
                raise _unavailable("move this process into", tree.daemon_dir, exc) from None
        for path in (parent_dir, tree.path, tree.replicas_dir):
            _enable(path, WANTED_CONTROLLERS)
        return tree

    @classmethod
    def open(cls, path: str) -> Subtree:
        """An existing subtree (recovery after a crash: ``kill_all`` its leftovers)."""
        tree = cls(path)
        if not os.path.isfile(os.path.join(tree.replicas_dir, "cgroup.procs")):
            raise CgroupUnavailable(f"{path} is not an orchestrator cgroup subtree (no replicas/ cgroup)")
        return tree

    @property
    def controllers(self) -> frozenset[str]:
        """The controllers (of memory, pids, cpu) enabled for replica cgroups."""
        try:
            enabled = _read(os.path.join(self.replicas_dir, "cgroup.subtree_control")).split()
        except FileNotFoundError:
            return frozenset()
        return frozenset(enabled) & set(WANTED_CONTROLLERS)

    def _mine(self, path: str) -> str:
        if not os.path.normpath(path).startswith(self.path + "/"):
            raise ValueError(f"{path} is not inside the subtree {self.path}")
        return path

    def replica_path(self, replica_id: str) -> str:
        """The cgroup dir of a replica (not created): ``replicas/<replica_id>``."""
        if not replica_id or replica_id in (".", "..") or any(c in replica_id for c in "/\n\0"):
            raise ValueError(f"not a usable cgroup name: {replica_id!r}")
        return os.path.join(self.replicas_dir, replica_id)

    def make_replica(self, replica_id: str, limits: Mapping[str, int | str | None] | None = None) -> str:
        """Create the replica's cgroup and write its limits; return its path.

        ``limits``: keys of ``LIMITS`` (``memory_max``, ``pids_max``, ``cpu_weight``); None
        values are skipped. A limit whose controller is not enabled raises CgroupUnavailable
        naming it, before anything is created: a limit silently not applied is worse than a
        refusal. A bad value raises ValueError (and the new cgroup is removed).
        """
        wanted = {k: v for k, v in (limits or {}).items() if v is not None}
        for key in wanted:
            if key not in LIMITS:
                raise ValueError(f"unknown limit {key!r} (known: {', '.join(LIMITS)})")
            controller = LIMITS[key][1]
            if controller not in self.controllers:
                have = ", ".join(sorted(self.controllers)) or "none"
                raise CgroupUnavailable(
                    f"{key} needs the cgroup {controller} controller, which is not available here (enabled: {have})"
                )
        path = self.replica_path(replica_id)
        try:
            os.mkdir(path)
        except FileExistsError:
            if populated(path):
                raise CgroupUnavailable(f"replica cgroup {path} already exists and holds processes") from None
        except OSError as exc:
            raise _unavailable("create the cgroup", path, exc) from None
        for key, value in wanted.items():
            try:
                _write(os.path.join(path, LIMITS[key][0]), str(value))
            except OSError as exc:
                remove(path)
                raise ValueError(f"{key}={value!r} refused by the kernel: {exc.strerror}") from None
        return path

    def join(self, path: str, pid: int) -> None:
        """Move ``pid`` into the replica cgroup ``path`` (a forked child uses ``join`` itself)."""
        join(self._mine(path), pid)

    def kill(self, path: str) -> str:
        """SIGKILL the replica's whole tree (see the module's ``kill``)."""
        return kill(self._mine(path))

    def signal(self, path: str, sig: int) -> int:
        """Send ``sig`` to every process of the replica's tree; how many got it."""
        return send_signal(self._mine(path), sig)

    def populated(self, path: str) -> bool:
        return populated(self._mine(path))

    def events_fd(self, path: str) -> int:
        """See the module's ``events_fd``: POLLPRI on change of the replica's populated state."""
        return events_fd(self._mine(path))

    def remove(self, path: str) -> str:
        return remove(self._mine(path))

    def oom_killed(self, path: str) -> bool:
        return oom_killed(self._mine(path))

    def leftovers(self) -> list[str]:
        """Replica cgroups still present (after a crash: what ``kill_all`` will end)."""
        try:
            names = sorted(os.listdir(self.replicas_dir))
        except FileNotFoundError:
            return []
        return [p for p in (os.path.join(self.replicas_dir, n) for n in names) if os.path.isdir(p)]

    def kill_all(self, timeout: float = KILL_WAIT) -> KillReport:
        """Kill every replica cgroup, wait (bounded) until all are empty, remove them."""
        t0 = time.monotonic()
        records = kill_and_remove(self.leftovers(), timeout)
        return {"cgroups": records, "duration_s": round(time.monotonic() - t0, 6)}

    def leave(self) -> None:
        """Move the calling process to the subtree's parent, so ``destroy`` can remove daemon/.

        Fails (CgroupUnavailable) where the parent may not hold processes: a non-root
        cgroup with controllers enabled for its children.
        """
        try:
            join(self.parent)
        except OSError as exc:
            raise _unavailable("move this process back into", self.parent, exc) from None

    def destroy(self) -> dict[str, str]:
        """Remove what is empty: replica cgroups, replicas/, daemon/, the subtree; path -> status.

        Kills nothing (``kill_all`` first). daemon/ stays "busy" while anything is in it:
        the daemon (``leave`` first) or its watchdog (stop it first); then so does the
        subtree dir.
        """
        result = {path: remove(path) for path in self.leftovers()}
        for path in (self.replicas_dir, self.daemon_dir, self.path):
            result[path] = remove(path)
        return result
