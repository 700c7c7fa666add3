"""How the daemon makes, signals and reaps its children: ``OSApi``, the OS seam under the engine.

Run by the daemon (and the embedded ``Orchestrator``'s loop). Tests of the state machine
substitute a fake with the same methods. Its signals are sent by ``signals.py``: to the
loop's own children (replicas, the manager, the watchdog, the spawners, adopted orphans),
whose unreaped zombies pin their pids, and through the watchdog's identity-checked ladder
(``OSApi.sweep``) to processes that are not our children, such as a dead daemon's leftovers.

Start method: the child is made by a spawner process (spawner.py, launcher.py) with
``clone(CLONE_PARENT)``, so it is our child all the same, and ``OSApi.spawn`` watches it as
such; while no spawner is ready, by a plain ``os.fork()`` from the control loop's thread
(the daemon is single-threaded by construction: the Manager server and its threads live in
their own process). Either way the child then runs ``_child`` below: ``execve`` for a
command, the callable for a Python target. Fork is the only start method fast enough here
(``benchmarks/bench_churn.py --forkserver`` runs multiprocess's forkserver beside it, many
times slower; 3.11's forkserver re-runs ``__main__`` in every child, gh-98552).

What the child does between the fork and the exec or its target: childsetup.py.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # pthread_sigmask without the enum conversion: ~3 µs against ~60 µs a call
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol

from watchdog.identity import proc_stat, start_time
from watchdog.ledger import Entry

from .. import signals
from ..errors import SpawnerLost
from ..prctl import prctl
from ..spawn.childsetup import ALL_SIGNALS, run_child
from ..spec import LaunchPlan

if TYPE_CHECKING:
    from watchdog.reaper import Report

_PR_SET_CHILD_SUBREAPER = 36
# The write ends of ready pipes this process holds for a moment (between the pipe and the
# spawner's or our own fork). An embedding program that forks on another thread in that
# moment (a multiprocessing or pebble pool making a worker) would keep one in its child,
# and the replica's ready pipe would not reach EOF while that child lives: the replica would
# stay STARTING. A fork handler closes them in every child but our own forks' (_OURS).
_WRITE_ENDS: set[int] = set()
_OURS = False


def _close_write_ends() -> None:
    if _OURS:
        return  # the replica itself: run_child writes to its ready pipe
    for fd in list(_WRITE_ENDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _WRITE_ENDS.clear()


os.register_at_fork(after_in_child=_close_write_ends)
_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def set_child_subreaper() -> None:
    """Orphaned descendants are re-parented to us, and we reap them (PID 1 may not)."""
    prctl(_PR_SET_CHILD_SUBREAPER, 1)


class Via(Protocol):
    """A spawner process, as the launcher holds it (launcher.Spawner): what OSApi asks of it."""

    def begin(self, plan: LaunchPlan, ready_w: int, pdeathsig: int | None, nofile: tuple[int, int] | None) -> int: ...
    def end(self, seq: int) -> tuple[int, int | None]: ...
    def reap_lost(self, ready_r: int) -> None: ...


@dataclass(slots=True)
class Begun:
    """A worker asked of a spawner (OSApi.begin), not yet known (OSApi.end)."""

    plan: LaunchPlan
    via: Via
    ready_r: int
    seq: int | None  # None: the spawner was lost before the request went out


@dataclass(slots=True)
class Spawned:
    pid: int
    exit_fd: int  # readable when the process has exited (a pidfd)
    ready_fd: int  # EOF when the worker runs; one line of text if it could not start
    start_time: int | None


class OSApi:
    """The real OS. Tests of the state machine substitute a fake with the same methods."""

    def __init__(self, *, pdeathsig: int | None = signal.SIGKILL,
                 nofile: tuple[int, int] | None = None) -> None:
        self.pdeathsig = pdeathsig
        self.nofile = nofile  # the fd limit workers get, if ours was raised
        self.maxfd = os.sysconf("SC_OPEN_MAX")  # after any raise: every fd we may hold is below

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    def spawn(self, plan: LaunchPlan, via: Via | None = None) -> Spawned:
        """Make one worker from ``plan``: through the spawner ``via`` (launcher.Spawner) if
        given, else by forking here. Raises OSError when no child could be made."""
        return self.end(self.begin(plan, via)) if via is not None else self._fork(plan, *os.pipe())

    def begin(self, plan: LaunchPlan, via: Via) -> "Begun":
        """Ask the spawner ``via`` for a worker; ``end()`` gets it. Begin a batch, then end
        it, in the same order."""
        ready_r, ready_w = os.pipe()
        _WRITE_ENDS.add(ready_w)
        try:
            seq = via.begin(plan, ready_w, self.pdeathsig, self.nofile)
        except SpawnerLost:
            seq = None
        finally:
            _WRITE_ENDS.discard(ready_w)
            os.close(ready_w)
        return Begun(plan, via, ready_r, seq)

    def end(self, begun: "Begun") -> Spawned:
        """The worker ``begin()`` asked for: from its spawner, or, if that was lost, forked
        here (any child it had made is reaped first). Raises OSError (no child made)."""
        via, ready_r = begun.via, begun.ready_r
        try:
            if begun.seq is not None:
                pid, start = via.end(begun.seq)
                return self._watch(pid, ready_r, start)
        except SpawnerLost:
            pass
        except OSError:
            os.close(ready_r)
            raise
        via.reap_lost(ready_r)
        os.close(ready_r)
        return self._fork(begun.plan, *os.pipe())

    def _fork(self, plan: LaunchPlan, ready_r: int, ready_w: int) -> Spawned:
        global _OURS
        parent = os.getpid()
        _WRITE_ENDS.add(ready_w)
        old_mask = _signal.pthread_sigmask(signal.SIG_BLOCK, ALL_SIGNALS)
        before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        try:
            _OURS = True
            pid = os.fork()
        except OSError:  # EAGAIN, ENOMEM: no child; the caller records FAILED
            _OURS = False
            _signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            _WRITE_ENDS.discard(ready_w)
            os.close(ready_r)
            os.close(ready_w)
            raise
        if pid == 0:  # pragma: no cover - runs in the child, never returns
            run_child(plan, ready_w, parent, self.pdeathsig, self.maxfd, self.nofile)
        _OURS = False
        after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        _signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _WRITE_ENDS.discard(ready_w)
        os.close(ready_w)
        # The kernel's start time is the fork's CLOCK_BOOTTIME in clock ticks (10 ms). When
        # the fork fell inside one tick it is known exactly without reading /proc, whose
        # first lookup of a new pid costs ~100-200 µs here; otherwise (~2%) read it.
        tick = before // _TICK_NS
        return self._watch(pid, ready_r, tick if after // _TICK_NS == tick else None)

    def _watch(self, pid: int, ready_r: int, start: int | None) -> Spawned:
        # Non-blocking: the pipe is read at the replica's exit too, and may not be at EOF
        # then. A fork elsewhere in an embedding program (a multiprocessing or pebble pool
        # on another thread) between pipe() and the close of our write end keeps a copy
        # of it for that child's whole life; a blocking read there would hang the loop.
        os.set_blocking(ready_r, False)
        try:
            exit_fd = os.pidfd_open(pid)
        except OSError:  # EMFILE: we could not watch it, so it must not run untracked
            signals.to_child(pid, signal.SIGKILL)  # our unreaped child: the pid is pinned
            os.waitpid(pid, 0)
            os.close(ready_r)
            raise
        return Spawned(pid, exit_fd, ready_r, start if start is not None else start_time(pid))

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Signal the group led by one of OUR unreaped children: the child (a zombie at
        worst) pins the number, so it cannot have been reused. A child that has not run
        its setpgid yet has no group: it alone gets the signal, which stays blocked until
        it has dropped our handlers, so nothing is lost. False if nothing was there."""
        return signals.to_group(pgid, sig)

    def escaped_descendants(self, pid: int) -> list[tuple[int, int]]:
        """(pid, start time) of the descendants of our child ``pid`` that have left its
        process group (GNU timeout, a shell's job control, setsid), found by walking the
        kernel's child lists down from it: a group signal would miss them, and once ``pid``
        dies they are re-parented and their ancestry is gone. Costs one read per process
        of the tree, nothing for a worker without children."""
        found: list[tuple[int, int]] = []
        stack = [pid]
        seen = {pid}
        while stack:
            for child in _children(stack.pop()):
                st = proc_stat(child)
                if st is None or child in seen:
                    continue
                seen.add(child)
                if st.pgrp != pid:
                    found.append((child, st.start_time))
                stack.append(child)
        return found

    def signal_verified(self, ident: tuple[int, int], sig: int) -> bool:
        """Signal the process ``(pid, start time)`` if it is still that process."""
        return signals.to_verified(ident, sig)

    def kill_child(self, pid: int, sig: int) -> bool:
        """Signal one of OUR unreaped children (a system child: manager, watchdog)."""
        return signals.to_child(pid, sig)

    def pidfd(self, pid: int) -> int:
        """A pidfd of our child: readable once it has exited."""
        return os.pidfd_open(pid)

    def exited_child(self) -> int | None:
        """The pid of a child that has exited and is not reaped yet, without reaping it
        (so that its owner still reaps it, while its zombie pins the pid); None if none."""
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        return info.si_pid if info is not None and info.si_pid else None

    def sweep(self, entries: Iterable[Entry], *, grace: float, exclude: Iterable[int] = ()) -> Report:
        """TERM, ``grace``, KILL for processes that are not our children, and for their
        groups and descendants: every signal through a pidfd verified against the recorded
        start time (the watchdog's ladder), so a reused pid is never hit."""
        return signals.sweep(entries, grace=grace, exclude=exclude)

    def reap(self, pid: int) -> int | None:
        """Exit code (negative: signal) of an exited child; None if someone else reaped it."""
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if wpid == 0:  # cannot last: we are only called once its pidfd (or waitid) said it exited
            wpid, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    def read_ready(self, fd: int) -> bytes:
        try:
            return os.read(fd, 4096)
        except BlockingIOError:  # at its exit, a stranger still holds the write end: nothing said
            return b""

    def close(self, fd: int) -> None:
        os.close(fd)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc/PID/task/*/children (any of its threads may
    have forked them)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out
