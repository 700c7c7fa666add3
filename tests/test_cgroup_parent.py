"""Not a test module: the programs tests/test_cgroup.py runs (pytest imports it, finds no
tests, and moves on; the name keeps it among the files the cgroup work owns).

``python tests/test_cgroup_parent.py tree FD``
    A replica's process tree, started already inside its cgroup. Every member announces
    ``<role> <pid>`` on fd FD, five lines in all, then sleeps until killed:
    ``root`` (this process), ``setsid`` (a child in a session of its own), ``orphan``
    (double-forked: its parent exited, it has a session of its own and no link to root),
    ``timeout`` (``timeout 300 sleep 300``: GNU timeout moves itself to a group of its own)
    and ``job`` (``bash -c 'set -m; sleep 300 & wait'``: job control gives the sleep a
    group of its own). Nothing but the cgroup ties these together.

``python tests/test_cgroup_parent.py parent --state-dir D --subtree S [--register PATH ...]``
    A stand-in daemon, like tests/watchdog_parent.py: starts a watchdog through
    ``WatchdogLink``, makes replica cgroups ``r0`` and ``r1`` in the existing subtree S,
    forks a ``tree`` into each, registers both with ``add_cgroup`` then unregisters r1
    (``remove_cgroup``: the watchdog must leave it alone), registers every ``--register``
    path as given (the watchdog must refuse those), prints one JSON line: its identity,
    the watchdog's, the cgroups and the ``(pid, start)`` of every process in them. Then it
    serves ``restart`` on stdin (SIGKILL the watchdog, reap it, ``link.start()`` again: the
    replay must carry the cgroups) and never exits on its own: the test SIGKILLs it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE_LINES = 5


def _fork(body) -> int:
    """Fork a child that runs ``body()`` then sleeps until killed."""
    pid = os.fork()
    if pid:
        return pid
    try:
        body()
        while True:
            signal.pause()
    finally:
        os._exit(0)


def tree(fd: int) -> None:
    def say(role: str) -> None:
        os.write(fd, f"{role} {os.getpid()}\n".encode())

    def mid() -> None:
        _fork(lambda: (os.setsid(), say("orphan")))
        os._exit(0)

    _fork(lambda: (os.setsid(), say("setsid")))
    os.waitpid(_fork(mid), 0)
    shell = f"echo timeout $$ >&{fd}; exec sleep 300"
    subprocess.Popen(["timeout", "300", "bash", "-c", shell], pass_fds=(fd,))
    job = f'set -m; bash -c "echo job \\$\\$ >&{fd}; exec sleep 300" & wait'
    subprocess.Popen(["bash", "-c", job], pass_fds=(fd,))
    say("root")
    while True:
        signal.pause()


def members(path: str) -> list[list[int]]:
    """``[pid, start]`` of every process in the cgroup ``path`` and below."""
    from watchdog.cgroup import _members
    from watchdog.identity import start_time

    return [[pid, start_time(pid)] for _where, pid in _members(path)]


def _flush(link) -> None:
    deadline = time.monotonic() + 5
    while link.pending() and time.monotonic() < deadline:
        select.select([], [link.fileno()], [], 1.0)
        link.flush()


def parent(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--subtree", required=True)
    parser.add_argument("--register", action="append", default=[])
    args = parser.parse_args(argv)

    from helpers import read_lines  # tests/, this script's directory, is on sys.path
    from watchdog import WatchdogLink, start_time
    from watchdog.cgroup import Subtree, join

    subtree = Subtree.open(args.subtree)
    link = WatchdogLink(args.state_dir, grace=0.2)
    watchdog_pid = link.start()
    info: dict = {
        "helper": [os.getpid(), start_time(os.getpid())],
        "watchdog": [watchdog_pid, start_time(watchdog_pid)],
        "cgroups": {},
        "members": {},
    }
    ready_r, ready_w = os.pipe()
    for rid in ("r0", "r1"):
        path = subtree.make_replica(rid)
        info["cgroups"][rid] = path
        pid = os.fork()
        if pid == 0:  # the spawn path the daemon will use: join in the child, then exec
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)  # never hold the test's stdout pipe open
                join(path)
                os.set_inheritable(ready_w, True)
                os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "tree", str(ready_w)])
            finally:
                os._exit(127)
        link.add_cgroup(path)
    read_lines(ready_r, 2 * TREE_LINES, timeout=20)
    for rid, path in info["cgroups"].items():
        info["members"][rid] = members(path)
    link.remove_cgroup(info["cgroups"]["r1"])
    for path in args.register:
        link.add_cgroup(path)
    _flush(link)

    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() == "restart":
            os.kill(watchdog_pid, signal.SIGKILL)  # our own unreaped child: the pid is safe
            status = os.waitstatus_to_exitcode(os.waitpid(watchdog_pid, 0)[1])
            watchdog_pid = link.start()
            _flush(link)
            print(json.dumps({"old_exit": status, "watchdog": [watchdog_pid, start_time(watchdog_pid)]}), flush=True)
    while True:  # stdin closed: wait to be killed
        signal.pause()


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    if sys.argv[1] == "tree":
        tree(int(sys.argv[2]))
    else:
        parent(sys.argv[2:])
