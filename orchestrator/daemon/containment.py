"""What holds a replica's process tree together: a cgroup of its own, or its process group.

    start --cgroup auto|off|PATH ──► detect() ──► Cgroups        one cgroup per replica
                                           └────► ProcessGroups  the process-group design

The engine calls one interface in both modes, and every decision about a replica's own tree
that differs between them is taken here, never in the engine: the cgroup ``claim``ed for a replica goes into its
``LaunchPlan`` (the forked child joins it before anything else) and is registered with the
watchdog; ``signal_tree`` reaches every member, ``kill_after_grace`` and ``kill_tree`` are one
``cgroup.kill``; when its main process exits, ``end_remnants`` kills what is left, and
``watch_end`` says the replica has ended once its cgroup holds no process (then it is
``release``d), with the OOM evidence. ``ProcessGroups`` does the same to the replica's
process group and the descendants that left it (``escaped``, killed after the grace too).
Three other modules take the replica's cgroup (None in process-group mode) and decide for
what they own: probebox.py and probes.py, where an exec probe's attempt runs (a cgroup of
its own beside the replica's, or its own process group in the watchdog's ledger);
notify.py, whose ``READY=1`` counts (a process of the replica's cgroup, or of its group);
taskmemory.py, what a worker's tree is when it is measured for ``memory_max``.

Descendants that left a stopped replica's group (process groups only: nothing leaves a
cgroup) outlive its main process's reap until the SIGKILL after its grace. From that reap
on they are the containment's, not the replica's: each held through a pidfd (so its kill
cannot hit a reused pid, and its end is an event) with its kill deadline, as are those a
SIGKILL was sent to and which have not exited yet. The loop's shutdown waits for them
(``end_escapes``: the grace, then SIGKILL, bounded), so none outlives an embedded
``with`` block or a daemon's stop; an upgrade carries them (``carried``/``take_over``).

Layout (``watchdog.cgroup.Subtree``): under the daemon's own cgroup (``auto``) or a given
cgroup dir (``PATH``), ``orchestrator-<sha1(state dir)[:12]>/`` with ``daemon/`` (the daemon
moves itself in, so its watchdog and manager are born there, outside every replica's
cgroup), ``replicas/<replica id>/`` and ``replicas/<replica id>.probe/`` (its exec probes,
probebox.ProbeBox). The subtree's path is recorded in the state dir
(``cgroup``, 0600): a later ``start`` kills what a daemon and a watchdog that were killed
together left in it, wherever the new daemon's own cgroup is (``previous`` / recovery.py).
A clean stop removes the replica cgroups, moves the daemon back out and removes the subtree.

Why each step is where it is:
  * ``auto`` falls back to process groups with a one-line reason (no cgroup2 mount, a
    hierarchy this user may not write, ...); ``PATH`` that cannot be used is an error: the
    operator asked for it by name.
  * The wait for an empty cgroup is the ``cgroup.events`` fd polled for EPOLLPRI in the
    reactor (``Reactor.add_priority_reader``): no poll loop, and bounded by a timer, so a
    cgroup that never empties (a process in uninterruptible sleep) cannot wedge the loop.
  * Limits (``memory_max``, ``pids_max``, ``cpu_weight``) are refused with one line when the
    controller is not enabled for replica cgroups, and in process-group mode: a limit
    silently not applied is worse than a refusal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol

from watchdog import cgroup
from watchdog.cgroup import CgroupUnavailable, Subtree
from watchdog.identity import open_verified

from .. import signals
from ..errors import InvalidSpec, OrchestratorError
from .oom import was_oom_killed

if TYPE_CHECKING:
    from watchdog.link import WatchdogLink

    from ..paths import Paths
    from .reactor import Reactor, Timer

log = logging.getLogger("orchestrator")

__all__ = ["Cgroups", "ProcessGroups", "CgroupUnavailable", "Tree", "Signals", "detect", "subtree_name",
           "previous", "record", "forget", "drop_previous", "RECORD_NAME", "DRAIN_TIMEOUT"]

RECORD_NAME = "cgroup"  # in the state dir: the subtree of the daemon that runs (or last ran) there
PROBE_SUFFIX = ".probe"  # replicas/<id>.probe: the cgroup of a replica's exec probes
DRAIN_TIMEOUT = 3.0  # seconds a replica's cgroup may take to empty after its main process exited
KILLED_EXIT_TIMEOUT = 5.0  # seconds SIGKILLed processes may take to exit, at a shutdown


class Tree(Protocol):
    """A replica's process tree as the engine holds it (engine.Proc): what is read and set here."""

    pid: int  # its main process, our child: unreaped, its zombie pins the pid and the group
    cgroup: str | None  # its own cgroup (Cgroups), else None
    reaped: bool
    killed: bool  # SIGKILL sent by us (not the kernel's OOM killer)
    escaped: list[tuple[int, int]]  # (pid, start) of descendants that left its group
    kill_timer: Timer | None  # the SIGKILL after its grace, if it is being stopped


class Signals(Protocol):
    """The process signals containment sends (osapi.OSApi)."""

    def signal_group(self, pgid: int, sig: int) -> bool: ...
    def escaped_descendants(self, pid: int) -> list[tuple[int, int]]: ...
    def signal_verified(self, ident: tuple[int, int], sig: int) -> bool: ...


def subtree_name(state_dir: str | os.PathLike[str]) -> str:
    """``orchestrator-<12 hex>``: one subtree per state dir, the same one on every start."""
    digest = hashlib.sha1(os.path.abspath(os.fspath(state_dir)).encode("utf-8", "surrogateescape")).hexdigest()
    return f"{cgroup.MARK}-{digest[:12]}"


class _Escape:
    """A descendant that left a replica's group, held after that replica's reap: its pidfd
    in the reactor (readable once it has exited) and the timer of its SIGKILL."""

    __slots__ = ("ident", "fd", "deadline", "timer")

    def __init__(self, ident: tuple[int, int], fd: int, deadline: float | None) -> None:
        self.ident, self.fd, self.deadline = ident, fd, deadline
        self.timer: Timer | None = None


class ProcessGroups:
    """No cgroups: a replica is its process group plus the descendants that left it."""

    mode = "process-group"
    path: str | None = None  # no subtree
    controllers: frozenset[str] = frozenset()

    def __init__(self, reason: str) -> None:
        self.reason = reason
        # Set by attach(), before any use (the engine attaches what detect() made).
        self.os: Signals = None  # type: ignore[assignment]
        self.reactor: Reactor = None  # type: ignore[assignment]
        self._escapes: dict[tuple[int, int], _Escape] = {}

    def attach(self, reactor: Reactor, os_api: Signals, watchdog: WatchdogLink | None = None) -> None:
        """The loop's reactor, the signals to send and the watchdog's feed (none needed here)."""
        self.reactor, self.os = reactor, os_api

    def claim(self, replica_id: str, limits: Mapping[str, int] | None = None) -> str | None:
        """No cgroup (CgroupUnavailable if ``limits`` need one): the child makes its group."""
        return self.prepare(replica_id, limits)

    def release(self, path: str | None) -> None:
        pass

    def signal_tree(self, tree: Tree, sig: int) -> list[tuple[int, int]]:
        """``sig`` to the replica's group and to the descendants that left it, which are
        returned: the kill after the grace reaches them too."""
        # Walk the tree first: once the group dies, what left it is re-parented out of reach.
        escaped = self.os.escaped_descendants(tree.pid)
        self.os.signal_group(tree.pid, sig)
        for ident in escaped:
            self.os.signal_verified(ident, sig)
        return escaped

    def kill_after_grace(self, tree: Tree) -> None:
        """SIGKILL to the group if its leader is not reaped, and to every escaped
        descendant, even after the main process is reaped."""
        if not tree.reaped:
            tree.killed = True
            tree.escaped += self.os.escaped_descendants(tree.pid)
            self.os.signal_group(tree.pid, signal.SIGKILL)
        self._kill_escaped(tree)

    def kill_tree(self, tree: Tree) -> None:
        """SIGKILL now (a shutdown out of time): the group of an unreaped main process, and
        the descendants that left it."""
        tree.killed = True
        tree.escaped += self.os.escaped_descendants(tree.pid)
        self.os.signal_group(tree.pid, signal.SIGKILL)
        self._kill_escaped(tree)

    def _kill_escaped(self, tree: Tree) -> None:
        """SIGKILL to the descendants that left the tree's group; held until they have
        exited, so that a shutdown can wait for them."""
        for ident in tree.escaped:
            if self.os.signal_verified(ident, signal.SIGKILL):
                self._hold(ident, None)
        tree.escaped = []

    def end_remnants(self, tree: Tree) -> None:
        """Its main process exited, not reaped yet: the zombie still pins the group, so what
        the worker left in it is killed before the reap. The descendants that left it and
        were asked to stop are held here from now on, with their kill after the grace (the
        replica's ``escaped`` is emptied, so its own timer can go)."""
        self.os.signal_group(tree.pid, signal.SIGKILL)
        if tree.escaped:
            timer = tree.kill_timer
            due = timer.deadline if timer is not None and not timer.cancelled else self.reactor.monotonic()
            for ident in tree.escaped:
                self._hold(ident, due)
            tree.escaped = []

    # -- escaped descendants, after their replica's reap -----------------------------

    def _hold(self, ident: tuple[int, int], deadline: float | None) -> None:
        """Hold ``ident`` until it has exited; SIGKILL at ``deadline`` (None: sent already)."""
        held = self._escapes.get(ident)
        if held is not None:
            if deadline is None and held.timer is not None:  # killed now: no later kill due
                held.timer.cancel()
                held.timer = held.deadline = None
            return
        try:
            fd = open_verified(*ident)
        except OSError as err:  # EMFILE: not held, so not waited for; its kill is sent now
            log.error("cannot watch the escaped process %d (%s): killed now", ident[0], err.strerror or err)
            self.os.signal_verified(ident, signal.SIGKILL)
            return
        if fd is None:
            return  # gone already
        held = self._escapes[ident] = _Escape(ident, fd, deadline)
        self.reactor.add_reader(fd, lambda: self._gone(held))
        if deadline is not None:
            held.timer = self.reactor.call_at(deadline, lambda: self._kill(held))

    def _kill(self, held: _Escape) -> None:
        held.timer = held.deadline = None
        signals.to_pidfd(held.fd, signal.SIGKILL)

    def _gone(self, held: _Escape) -> None:
        if self._escapes.pop(held.ident, None) is not held:
            return
        self._forget(held)

    def _forget(self, held: _Escape) -> None:
        if held.timer is not None:
            held.timer.cancel()
        try:
            self.reactor.remove_reader(held.fd)
        except (KeyError, ValueError, OSError):  # the reactor has closed already
            pass
        os.close(held.fd)

    def settled(self) -> bool:
        """No escaped descendant of a stopped replica is still alive."""
        return not self._escapes

    def end_escapes(self, until: float | None = None) -> None:
        """A shutdown, once every replica is reaped: run the loop until every escaped
        descendant held is gone, each killed when its grace is over; bounded by the latest
        of those kills (and by ``until``, a monotonic deadline: the stop budget). Then
        SIGKILL to what is left and a bounded wait for it to exit."""
        if not self._escapes:
            return
        now = self.reactor.monotonic()
        due = max((e.deadline for e in self._escapes.values() if e.deadline is not None), default=now)
        limit = due - now + 1.0  # the kills fire within, then the exits are events
        if until is not None:
            limit = min(limit, until - now)
        if limit > 0:
            self.reactor.run_until(self.settled, limit)
        if self._escapes:
            for held in list(self._escapes.values()):
                self._kill(held)
            if not self.reactor.run_until(self.settled, KILLED_EXIT_TIMEOUT):
                log.error("escaped process(es) %s still alive %g s after SIGKILL",
                          ", ".join(str(e.ident[0]) for e in self._escapes.values()), KILLED_EXIT_TIMEOUT)

    def carried(self) -> list[list[int | float | None]]:
        """For an upgrade: each escaped descendant held, ``[pid, start, kill deadline]``."""
        return [[e.ident[0], e.ident[1], e.deadline] for e in self._escapes.values()]

    def take_over(self, carried: Iterable[Any]) -> None:
        """The escaped descendants an earlier image held, held here with their kill
        deadlines (their pidfds did not survive the exec: reopened, identity-checked)."""
        for pid, start, deadline in carried:
            self._hold((int(pid), int(start)), None if deadline is None else float(deadline))

    def watch_end(self, tree: Tree, code: int | None, since: float, then: Callable[[bool], None]) -> None:
        """Reaped: it has ended now. ``then(oom)``: a SIGKILL we did not send, that the
        kernel log says the OOM killer sent (bounded: at most 0.5 s and 8 MiB of /dev/kmsg,
        and only for such an exit)."""
        then(code == -signal.SIGKILL and not tree.killed and bool(was_oom_killed(tree.pid, since)))

    def check_limits(self, limits: Mapping[str, int]) -> None:
        """InvalidSpec (one line) if any limit is set: there is no cgroup to hold it."""
        if limits:
            raise InvalidSpec(self._refusal(limits))

    def prepare(self, replica_id: str, limits: Mapping[str, int] | None = None) -> str | None:
        if limits:  # a pool restored from the store that a cgroup daemon made
            raise CgroupUnavailable(self._refusal(limits))
        return None

    def prepare_probe(self, replica_id: str) -> str | None:
        """No cgroup for exec probes either: each attempt is its own process group."""
        return None

    def _refusal(self, limits: Mapping[str, int]) -> str:
        return f"{next(iter(limits))} needs cgroup containment, and this daemon uses process groups ({self.reason})"

    def describe(self) -> dict[str, Any]:
        return {"containment": self.mode, "containment_reason": self.reason, "cgroup_subtree": None}

    def close(self) -> bool:
        """The fds of escaped descendants still held (after a shutdown's end_escapes: none
        normally). Idempotent."""
        while self._escapes:
            self._forget(self._escapes.popitem()[1])
        return True


class _Watch:
    """One replica cgroup awaited empty: its events fd in the reactor, and a deadline."""

    __slots__ = ("fd", "path", "callback", "deadline", "timer")

    def __init__(self, fd: int, path: str, callback: Callable[[bool], None], deadline: float) -> None:
        self.fd, self.path, self.callback, self.deadline = fd, path, callback, deadline
        self.timer: Timer | None = None


class Cgroups:
    """One cgroup per replica under the daemon's ``Subtree``; see the module docstring."""

    mode = "cgroup"

    def __init__(self, subtree: Subtree, reason: str, *, moved_self: bool = True) -> None:
        self.subtree = subtree
        self.path = subtree.path
        self.reason = reason
        self.moved_self = moved_self
        self.controllers = subtree.controllers  # read once: they do not change under us
        self._mount = cgroup.read_mount()  # for the identity checks of signal()
        # Set by attach(), before any use (the engine attaches what detect() made).
        self.reactor: Reactor = None  # type: ignore[assignment]
        self.os: Signals = None  # type: ignore[assignment]
        self.watchdog: WatchdogLink | None = None
        self._watches: dict[int, _Watch] = {}

    def attach(self, reactor: Reactor, os_api: Signals, watchdog: WatchdogLink | None = None) -> None:
        """The loop's reactor (``watch_empty`` registers its fds there), the signals to send
        to a main process not in its cgroup yet, and the watchdog's feed (WatchdogLink): it
        kills every registered cgroup if the daemon dies."""
        self.reactor, self.os, self.watchdog = reactor, os_api, watchdog

    # -- limits ---------------------------------------------------------------------

    def check_limits(self, limits: Mapping[str, int]) -> None:
        """InvalidSpec (one line) for a limit whose controller replica cgroups lack."""
        for key in limits:
            controller = cgroup.LIMITS[key][1]
            if controller not in self.controllers:
                have = ", ".join(sorted(self.controllers)) or "none"
                raise InvalidSpec(f"{key} needs the cgroup {controller} controller, which is not enabled "
                                  f"for replica cgroups here (enabled: {have})")

    # -- one replica ----------------------------------------------------------------

    def prepare(self, replica_id: str, limits: Mapping[str, int] | None = None) -> str:
        """Create the replica's cgroup with its limits; its path. CgroupUnavailable or
        ValueError (a limit the kernel refused) say why not, in one line."""
        return self.subtree.make_replica(replica_id, limits)

    def prepare_probe(self, replica_id: str) -> str:
        """The cgroup of the replica's exec probes, ``replicas/<id>.probe`` (a replica id
        ends in a digit, so no replica has that name): under ``replicas/``, so whatever
        kills leftover replica cgroups (the watchdog, the next start, a clean stop) kills it
        too. No limits: a probe is not charged to its replica."""
        return self.subtree.make_replica(replica_id + PROBE_SUFFIX)

    def claim(self, replica_id: str, limits: Mapping[str, int] | None = None) -> str:
        """``prepare`` the replica's cgroup and register it with the watchdog."""
        path = self.prepare(replica_id, limits)
        if self.watchdog is not None:
            self.watchdog.add_cgroup(path)
        return path

    def release(self, path: str | None) -> None:
        """Remove a claimed cgroup and unregister it; one that cannot go stays registered
        (the watchdog kills it if we die; a clean stop retries)."""
        if path is None:
            return
        status = self.remove(path)
        if status not in ("removed", "missing"):
            log.error("cannot remove cgroup %s: %s", path, status)
        elif self.watchdog is not None:
            self.watchdog.remove_cgroup(path)

    def signal_tree(self, tree: Tree, sig: int) -> list[tuple[int, int]]:
        """``sig`` to every member of the replica's cgroup; to its main process alone if it
        is not among them (forked, not in its cgroup yet). Nothing escapes a cgroup: []."""
        assert tree.cgroup is not None
        if tree.pid not in self.signal(tree.cgroup, sig):
            self.os.signal_group(tree.pid, sig)
        return []

    def kill_after_grace(self, tree: Tree) -> None:
        """``cgroup.kill``, unless the main process is reaped: its exit killed the cgroup already."""
        if not tree.reaped:
            self.kill_tree(tree)

    def kill_tree(self, tree: Tree) -> None:
        assert tree.cgroup is not None
        tree.killed = True
        self.kill(tree.cgroup)
        self.os.signal_group(tree.pid, signal.SIGKILL)  # in case it had not joined yet

    def end_remnants(self, tree: Tree) -> None:
        """Its main process exited: what it left, whatever group or session it is in."""
        assert tree.cgroup is not None
        self.kill(tree.cgroup)

    def settled(self) -> bool:
        """Nothing escapes a cgroup: what a replica left is its cgroup's drain (watch_end)."""
        return True

    def end_escapes(self, until: float | None = None) -> None:
        pass

    def carried(self) -> list[list[int | float | None]]:
        return []

    def take_over(self, carried: Iterable[Any]) -> None:
        pass

    def watch_end(self, tree: Tree, code: int | None, since: float, then: Callable[[bool], None]) -> None:
        """Reaped; ended once its cgroup is empty (an event, bounded: DRAIN_TIMEOUT). Then
        the cgroup is released and ``then(oom)`` told whether the kernel OOM-killed in it."""
        path = tree.cgroup
        assert path is not None

        def drained(empty: bool) -> None:
            if not empty:
                log.error("%s: its cgroup %s still holds processes after the kill; ending it anyway",
                          os.path.basename(path), path)
            oom = self.oom_killed(path)
            self.release(path)
            then(oom)

        self.watch_empty(path, drained)

    def signal(self, path: str, sig: int) -> list[int]:
        """Send ``sig`` to every process of the cgroup (identity-checked); their pids. An
        error (EMFILE) is logged and sends nothing more: the kill after the grace is
        ``cgroup.kill``, one write, which needs no fd per process."""
        try:
            return signals.to_cgroup(path, sig, self._mount)
        except OSError as err:
            log.error("cannot signal the processes of cgroup %s: %s", path, err.strerror or err)
            return []

    def kill(self, path: str) -> str:
        """SIGKILL the whole cgroup (``cgroup.kill``); see ``watchdog.cgroup.kill``."""
        try:
            return signals.kill_cgroup(path)
        except (OSError, ValueError) as err:
            log.error("cannot kill cgroup %s: %s", path, getattr(err, "strerror", None) or err)
            return f"error: {err}"

    def watch_empty(self, path: str, callback: Callable[[bool], None], timeout: float = DRAIN_TIMEOUT) -> None:
        """Call ``callback(True)`` once the cgroup holds no process (now, if it is empty or
        gone), or ``callback(False)`` after ``timeout`` seconds if it still does. Never
        raises: without an fd to wait on (EMFILE), it looks again every 50 ms until then."""
        assert self.reactor is not None, "attach() the reactor first"
        deadline = self.reactor.monotonic() + timeout
        try:
            fd = cgroup.events_fd(path)
        except FileNotFoundError:
            callback(True)
            return
        except OSError as err:
            log.warning("cannot wait on %s/cgroup.events (%s): looking every 50 ms", path, err.strerror or err)
            self._look_again(path, callback, deadline)
            return
        if not cgroup.populated(fd):  # ENOENT/ENODEV read as empty; events_fd has read it once already
            os.close(fd)
            callback(True)
            return
        watch = _Watch(fd, path, callback, deadline)
        self._watches[fd] = watch
        self.reactor.add_priority_reader(fd, lambda: self._changed(watch))
        watch.timer = self.reactor.call_at(deadline, lambda: self._done(watch, False))

    def _look_again(self, path: str, callback: Callable[[bool], None], deadline: float) -> None:
        def look() -> None:
            try:
                empty = not cgroup.populated(path)
            except OSError:
                empty = False
            if empty or self.reactor.monotonic() >= deadline:
                callback(empty)
            else:
                self.reactor.call_later(0.05, look)

        self.reactor.call_later(0.05, look)

    def _changed(self, watch: _Watch) -> None:
        try:
            empty = not cgroup.populated(watch.fd)  # the read re-arms the fd
        except OSError as err:  # not ENOENT/ENODEV (those read as empty): unread, it would spin
            log.error("reading %s/cgroup.events: %s; looking every 50 ms", watch.path, err.strerror or err)
            del self._watches[watch.fd]
            self._forget(watch)
            self._look_again(watch.path, watch.callback, watch.deadline)
            return
        if empty:
            self._done(watch, True)

    def _done(self, watch: _Watch, empty: bool) -> None:
        if self._watches.pop(watch.fd, None) is None:
            return  # the other of event and deadline came first
        self._forget(watch)
        watch.callback(empty)

    def _forget(self, watch: _Watch) -> None:
        self.reactor.remove_priority_reader(watch.fd)
        os.close(watch.fd)
        if watch.timer is not None:  # set as the watch is made
            watch.timer.cancel()

    def remove(self, path: str) -> str:
        """rmdir the replica's cgroup: "removed", "missing", "busy" or "error: ..."."""
        return cgroup.remove(path)

    def oom_killed(self, path: str) -> bool:
        """Did the kernel OOM-kill a process of this cgroup (memory.events oom_kill)?"""
        if "memory" not in self.controllers:
            return False  # no memory.events to read
        try:
            return cgroup.oom_killed(path)
        except (OSError, ValueError):
            return False

    # -- the daemon's status and its end ----------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"containment": self.mode, "containment_reason": self.reason, "cgroup_subtree": self.path}

    def close(self) -> bool:
        """A clean end: kill and remove what is left of replica cgroups (nothing, normally),
        move this process back out (if it moved in) and remove the subtree. Never raises;
        True if the subtree is gone."""
        while self._watches:  # the loop is over: nobody is told any more
            self._forget(self._watches.popitem()[1])
        report = signals.kill_subtree(self.subtree)
        for rec in report["cgroups"]:
            log.warning("cgroup %s was left at the end: %s", rec["path"], rec)
        if self.moved_self:
            try:
                self.subtree.leave()
            except CgroupUnavailable as err:
                log.warning("the subtree %s stays: %s", self.path, err)
                return False
        result = self.subtree.destroy()
        left = {path: status for path, status in result.items() if status not in ("removed", "missing")}
        if left:
            log.warning("could not remove every cgroup of %s: %s", self.path, left)
        return not left


def detect(choice: str, state_dir: str | os.PathLike[str], *, move_self: bool = True, name: str | None = None) -> Cgroups | ProcessGroups:
    """The containment for ``--cgroup choice``: "off", "auto" (cgroups where this process
    may make them, else process groups with the reason) or an absolute cgroup dir, under
    which the subtree is made (an OrchestratorError if it cannot be used).

    ``move_self``: the calling process moves into the subtree's ``daemon/`` (the daemon;
    call it before starting children that must stay out of replica cgroups). The embedded
    API leaves its host process where it is.
    """
    if choice == "off":
        return ProcessGroups("--cgroup off")
    name = name or subtree_name(state_dir)
    try:
        if choice == "auto":
            parent = cgroup.require_own_path()
        else:
            mount = cgroup.find_mount()
            why = None
            if mount is None:
                why = "no cgroup2 mount in /proc/self/mountinfo"
            elif not (os.path.isabs(choice) and os.path.normpath(choice) == choice
                      and (choice == mount or choice.startswith(mount.rstrip("/") + "/"))):
                why = f"not a normalised absolute path under the cgroup2 mount {mount}"
            if why is not None:
                raise CgroupUnavailable(why)
            parent = choice
        try:
            subtree = Subtree.create(parent, name, move_self=move_self)
        except CgroupUnavailable:
            if os.path.isfile(os.path.join(parent, "cgroup.procs")):
                Subtree(os.path.join(parent, name)).destroy()  # the dirs it made: removed if empty
            raise
    except CgroupUnavailable as err:
        if choice != "auto":
            raise OrchestratorError(f"--cgroup {choice}: {err}") from None
        return ProcessGroups(f"no usable cgroup2: {err}")
    controllers = ", ".join(sorted(subtree.controllers)) or "none"
    reason = f"a cgroup per replica under {subtree.replicas_dir} (controllers: {controllers})"
    return Cgroups(subtree, reason, moved_self=move_self)


# -- the state dir's record of the subtree ----------------------------------------------


def previous(paths: Paths) -> str | None:
    """The subtree recorded in the state dir by an earlier daemon, if it is one we may
    kill leftovers in (``watchdog.cgroup.refusal``: under the cgroup2 mount, below an
    ``orchestrator`` dir); None if there is none or it does not qualify (logged)."""
    from ..paths import check_file

    try:
        if not check_file(paths, RECORD_NAME):
            return None
        text = (paths.state_dir / RECORD_NAME).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError, OrchestratorError) as err:
        log.warning("ignoring the state dir's %s file: %s", RECORD_NAME, err)
        return None
    why = cgroup.refusal(text, cgroup.find_mount(), None)
    if why is not None:
        log.warning("ignoring the recorded cgroup subtree %r: %s", text, why)
        return None
    return text


def record(paths: Paths, containment: Cgroups | ProcessGroups) -> None:
    """Write the subtree in use to the state dir (0600), or remove the record if none."""
    from ..paths import write_private

    if containment.path is None:
        forget(paths)
    else:
        write_private(paths, RECORD_NAME, (containment.path + "\n").encode("utf-8", "surrogateescape"))


def forget(paths: Paths) -> None:
    (paths.state_dir / RECORD_NAME).unlink(missing_ok=True)


def drop_previous(path: str | None, current: Cgroups | ProcessGroups) -> None:
    """Remove an earlier daemon's subtree once recovery has emptied it, unless it is the one
    in use (best effort: what cannot go is logged)."""
    if path is None or path == current.path:
        return
    try:
        result = Subtree.open(path).destroy()
    except CgroupUnavailable:
        return
    left = {p: s for p, s in result.items() if s not in ("removed", "missing")}
    if left:
        log.warning("an earlier daemon's cgroup subtree could not be removed: %s", left)
