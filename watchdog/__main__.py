"""Entry point of the watchdog process: ``python -m watchdog ...``.

Started by the orchestrator through ``WatchdogLink.start()``::

    python -m watchdog --parent-pid P --parent-start S --state-dir D --feed-fd N
                       [--token T] [--grace G] [--remove PATH ...]

Flow:

1. Set the title ``orchestrator: watchdog``; ignore SIGINT and SIGHUP (a Ctrl-C or hang-up
   is for the parent to handle; SIGTERM keeps its default so the parent can stop us).
2. Watch the parent ``(P, S)`` through a pidfd (``ParentWatch``). If it is already gone,
   go straight to 4.
3. Block in ONE ``poll`` on [parent pidfd, feed fd] with no timeout: an idle watchdog
   never wakes up. Feed data updates the ledger. ``Q`` means a clean shutdown: exit 0 at
   once, quietly. Feed EOF without ``Q`` is only a hint (forked workers may hold the write
   end, or the parent closed it by mistake): if the parent is verifiably gone, go to 4,
   otherwise keep watching the pidfd alone.
4. Parent died: read what is left in the feed; kill the ledger's replica cgroups whole, and
   every other cgroup in ``--cgroup-subtree``'s replicas/ (``sweep_cgroups``: one
   ``cgroup.kill`` each, one bounded wait on their events fds, rmdir); ``sweep()`` the
   ledger's processes (plus the token), which finds whatever lives outside those cgroups;
   remove the ``--remove`` paths and, out of its daemon/ first, the emptied subtree (both
   only while holding the lock); write ``<state_dir>/watchdog-report.json`` atomically
   (unless the state dir itself was among the paths removed: an embedded host's own
   temporary dir); exit 0.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import cgroup
from .identity import proc_stat
from .ledger import Ledger
from .parent import ParentWatch
from .reaper import DEFAULT_GRACE, sweep, sweep_cgroups

TITLE = "orchestrator: watchdog"
REPORT_NAME = "watchdog-report.json"
WANTED_FDS = 65536


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m watchdog", description=__doc__.split("\n")[0])
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--parent-start", type=int, required=True, help="clock ticks since boot")
    parser.add_argument("--state-dir", required=True, help=f"where {REPORT_NAME} is written")
    parser.add_argument("--feed-fd", type=int, required=True, help="read end of the ledger pipe")
    parser.add_argument("--token", default=None, help="also kill processes with this ORCHESTRATOR_DAEMON_TOKEN")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE, help="SIGTERM to SIGKILL, seconds")
    parser.add_argument("--remove", action="append", default=[], metavar="PATH", help="stale file or dir")
    parser.add_argument("--lock", default=None, metavar="PATH",
                        help="the parent's lock file: files are removed only while we hold its lock")
    parser.add_argument("--cgroup-subtree", default=None, metavar="DIR",
                        help="the parent's cgroup subtree: every replicas/* cgroup in it is killed, then it is removed")
    return parser.parse_args(argv)


def _set_title() -> None:
    # SPT_NOENV: keep setproctitle from reusing the environ memory for a long title, so
    # /proc/PID/environ stays readable (the token rule reads environments).
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle
    except ImportError:  # cosmetic: the watchdog works without a title
        return
    setproctitle.setproctitle(TITLE)


def _raise_fd_limit() -> None:
    # The sweep holds one pidfd per target at once: hundreds of workers plus descendants
    # would not fit a soft limit of 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANTED_FDS if hard == resource.RLIM_INFINITY else min(hard, WANTED_FDS)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class _Feed:
    """The read end of the ledger pipe."""

    def __init__(self, fd: int, ledger: Ledger) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.ledger = ledger

    def drain(self) -> bool:
        """Read everything available now into the ledger; True once the feed is at EOF.

        At EOF the fd is closed: nothing more can come, and an fd at EOF would make every
        later poll return at once.
        """
        while self.fd >= 0:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return False
            if not data:
                os.close(self.fd)
                self.fd = -1
                break
            self.ledger.feed(data)
        return True


def _take_lock(path: str | None) -> int | None:
    """Take the dead parent's lock (a POSIX lock on its pid file), so that no new daemon can
    start on this state dir while we sweep, and so that the stale files we remove are
    proven stale: if a new daemon holds the lock already, the files are its own. Returns
    the locked fd (the lock goes when we exit), or None if someone else holds it."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # gone: nothing of the parent's is left to remove by that name
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove(paths: Sequence[str]) -> list[dict[str, str]]:
    """Remove stale runtime files/dirs left by the dead parent (missing ones are fine)."""
    results = []
    for path in paths:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            status = "removed"
        except FileNotFoundError:
            status = "missing"
        except OSError as exc:  # reported, not fatal: the processes matter more
            status = f"error: {exc.strerror or exc}"
        results.append({"path": path, "status": status})
    return results


def _replica_cgroups(subtree: str | None) -> list[str]:
    """The cgroups in ``subtree``/replicas (sweep_cgroups checks each one before a kill)."""
    if subtree is None:
        return []
    replicas = os.path.join(subtree, "replicas")
    try:
        return [os.path.join(replicas, name) for name in sorted(os.listdir(replicas))
                if os.path.isdir(os.path.join(replicas, name))]
    except OSError:  # gone already, or never made
        return []


def _remove_subtree(subtree: str) -> dict[str, Any]:
    """Remove the dead parent's emptied subtree: move out of its daemon/ first (we were born
    there), then rmdir what is empty. Never raises: the report says what stayed."""
    why = cgroup.refusal(subtree, cgroup.find_mount(), None)
    if why is not None:
        return {"refused": why}
    tree = cgroup.Subtree(subtree)
    own = cgroup.own_path()
    if own is not None and own.startswith(tree.path + "/"):
        try:
            tree.leave()
        except cgroup.CgroupUnavailable as exc:
            return {"kept": str(exc)}
    return tree.destroy()


def _write_report(state_dir: str, report: dict[str, Any]) -> str:
    """Write the report atomically: readers see the old file, or the whole new one."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(state_dir, REPORT_NAME)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _watch(watch: ParentWatch, feed: _Feed) -> str | None:
    """Block until the parent dies or asks us to quit.

    Returns how the death was detected ("pidfd", "feed-eof", "polling"), or None for a
    clean shutdown ("Q").
    """
    poller = select.poll()
    if watch.fileno() >= 0:
        poller.register(watch.fileno(), select.POLLIN)
    poller.register(feed.fd, select.POLLIN)
    while True:
        events = dict(poller.poll(watch.poll_timeout_ms))
        feed_eof = False
        # The feed first: a Q written just before a clean exit must win over the pidfd.
        if feed.fd in events:
            fd = feed.fd
            feed_eof = feed.drain()
            if feed_eof:
                poller.unregister(fd)
            if feed.ledger.quit_requested:
                return None
        if watch.fileno() >= 0 and watch.fileno() in events:
            return "pidfd"
        # EOF with the parent alive: a dying process closes its files a moment before it
        # is marked exited, or the parent closed the pipe by mistake. The pidfd decides.
        if feed_eof and watch.is_dead():
            return "feed-eof"
        if watch.fileno() < 0 and watch.is_dead():
            return "polling"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _set_title()
    _raise_fd_limit()

    ledger = Ledger()
    feed = _Feed(args.feed_fd, ledger)
    watch = ParentWatch(args.parent_pid, args.parent_start)
    # Never kill the parent's own process group as a group (a worker entry naming it by
    # mistake would otherwise take the parent's shell or test runner down with it).
    protect = set()
    parent = proc_stat(args.parent_pid)
    if parent is not None and parent.start_time == args.parent_start:
        protect.add(parent.pgrp)

    if watch.dead_at_start:
        reason, detected_by = "parent-gone-at-start", "identity"
    else:
        how = _watch(watch, feed)
        if how is None:
            return 0  # clean shutdown: no sweep, no report
        reason, detected_by = "parent-exited", how
    detected_monotonic = time.monotonic()
    detected_at = time.time()
    # Lines the parent wrote just before dying may still sit in the pipe.
    feed.drain()
    if ledger.quit_requested:
        return 0

    # Cgroups first: one write per replica reaches every descendant, setsid'ed or not, and
    # leaves the process sweep only what lives outside them. With the subtree known, also
    # the replica cgroups the parent made but had not registered yet (the feed lags a turn).
    t_cgroups = time.monotonic()
    cgroups = sweep_cgroups(dict.fromkeys([*ledger.cgroups, *_replica_cgroups(args.cgroup_subtree)]))
    cgroups_ms = round((time.monotonic() - t_cgroups) * 1e3, 3)
    lock_fd = _take_lock(args.lock)
    report = sweep(
        ledger.entries.values(),
        args.token,
        exclude={os.getpid(), args.parent_pid},
        grace=args.grace,
        protect_pgids=protect,
    )
    # Another daemon already holds the lock: the files are its, not stale.
    removed = _remove(args.remove) if args.lock is None or lock_fd is not None else [
        {"path": p, "status": "kept: a new daemon holds the lock"} for p in args.remove]
    if args.cgroup_subtree is not None:
        # Like the files: only while no new daemon can be using it (we hold the lock).
        report["subtree"] = (_remove_subtree(args.cgroup_subtree) if args.lock is None or lock_fd is not None
                             else {"kept": "a new daemon holds the lock"})
    report["timings_ms"]["cgroups"] = cgroups_ms
    report.update(
        reason=reason,
        detected_by=detected_by,
        parent={"pid": args.parent_pid, "start": args.parent_start},
        watchdog_pid=os.getpid(),
        detected_at=detected_at,
        # The detection latency is not known from in here (nothing records when the
        # parent died), so there is no detect_latency_s. CLOCK_MONOTONIC is system-wide on
        # Linux: whoever killed the parent subtracts its own reading from this one.
        detected_monotonic=detected_monotonic,
        ledger_entries=len(ledger.entries),
        cgroups=cgroups,
        ledger_errors=ledger.errors,
        removed=removed,
    )
    if not any(r["path"] == args.state_dir and r["status"] == "removed" for r in removed):
        _write_report(args.state_dir, report)  # (a state dir removed as asked: an embedded host's own)
    return 0  # the lock, if we took it, goes with us


if __name__ == "__main__":
    sys.exit(main())
