"""Every signal ``orchestrator`` sends, in one place: to a pid, a pidfd, a verified identity,
a process group or a cgroup.

Run by whichever process sends one: the daemon (and the embedded ``Orchestrator``'s loop)
above all, the spawner process (a stalled or lost request's child), the CLI's ``stop`` and ``demo``.
So it imports nothing of ``orchestrator``, and ``watchdog`` (stdlib only itself) only inside
the functions that need it: the CLI, which loads no ``watchdog`` module for its other
commands, pays for none of it.

Which function fits which target, and why it cannot hit a stranger:

* ``to_child`` / ``to_group``: one of OUR unreaped children, or the group it leads. Its
  zombie pins the pid (and the group id) until we reap it, so the number cannot have been
  reused. ``to_group`` falls back to the pid alone for a child that has not run its
  ``setpgid`` yet (it has forked nothing; the signal stays blocked until it has dropped our
  handlers, so nothing is lost).
* ``to_pidfd``: the process behind a pidfd, which pid reuse cannot redirect.
* ``to_verified``: a ``(pid, start time)`` that is not our child: a pidfd opened first, its
  start time checked second (``watchdog.identity.open_verified``), then ``to_pidfd``.
* ``to_cgroup`` / ``kill_cgroup`` / ``kill_subtree``: a replica's cgroup, whatever its
  processes did to their groups and sessions: every member (read from ``cgroup.procs``,
  each identity-checked), or SIGKILL to the whole tree in one write to ``cgroup.kill``.
* ``sweep``: processes that are not our children and their groups and descendants (a dead
  daemon's leftovers): the watchdog's TERM, grace, KILL ladder, every signal verified.

A target that is already gone is ``False`` (or nothing sent), never an exception: only
``ProcessLookupError`` means that; any other error (EPERM) is raised to the caller.

``watchdog/`` keeps its own ladder (``watchdog.reaper``): the watchdog imports nothing of
``orchestrator``, and it is what runs when the daemon cannot.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from watchdog.cgroup import KillReport, Subtree
    from watchdog.ledger import Entry
    from watchdog.reaper import Report

__all__ = ["to_child", "to_group", "to_pidfd", "to_verified", "to_cgroup", "kill_cgroup", "kill_subtree",
           "sweep"]


def to_child(pid: int, sig: int) -> bool:
    """Signal one of OUR unreaped children (its zombie pins the pid). False if it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def to_group(pgid: int, sig: int) -> bool:
    """Signal the group led by one of OUR unreaped children; the child alone if it has no
    group yet (see the module docstring). False if nothing was there."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return to_child(pgid, sig)
    return True


def to_pidfd(pidfd: int, sig: int) -> bool:
    """Signal the process behind ``pidfd`` (pid reuse cannot redirect it); False if gone."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False
    return True


def to_verified(ident: tuple[int, int], sig: int) -> bool:
    """Signal the process ``(pid, start time)`` if it is still that process."""
    from watchdog.identity import open_verified

    fd = open_verified(*ident)
    if fd is None:
        return False
    try:
        return to_pidfd(fd, sig)
    finally:
        os.close(fd)


def to_cgroup(path: str, sig: int, mount: tuple[str, str] | None = None) -> list[int]:
    """Send ``sig`` to every process of the cgroup ``path`` (each identity-checked); their
    pids. OSError (EMFILE: one fd per member) is the caller's to report."""
    from watchdog import cgroup

    return cgroup.signal_members(path, sig, mount)


def kill_cgroup(path: str) -> str:
    """SIGKILL the cgroup's whole tree, forks in flight included; how ("cgroup.kill",
    "signals", "missing": see ``watchdog.cgroup.kill``). OSError, or ValueError for the
    root cgroup."""
    from watchdog import cgroup

    return cgroup.kill(path)


def kill_subtree(subtree: Subtree) -> KillReport:
    """Kill every replica cgroup of ``subtree``, wait (bounded) until they are empty, remove
    them; the report of ``Subtree.kill_all``."""
    return subtree.kill_all()


def sweep(entries: Iterable[Entry], *, grace: float, exclude: Iterable[int] = ()) -> Report:
    """TERM, ``grace``, KILL for processes that are not our children, and for their groups
    and descendants, every signal through a pidfd verified against the recorded start time
    (the watchdog's ladder): a reused pid is never hit. We (``os.getpid()``) are excluded."""
    from watchdog.reaper import sweep as _ladder

    return _ladder(list(entries), None, exclude={os.getpid(), *exclude}, grace=grace)
