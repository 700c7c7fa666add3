"""Not a test module: the stand-in "orchestrator" that tests/test_watchdog.py runs.

(It is named ``test_watchdog_*`` only to stay inside the files the watchdog work owns;
pytest imports it, finds no tests, and moves on.)

Run as ``python tests/watchdog_parent.py --state-dir D [options]``. It:

1. starts a watchdog through ``WatchdogLink`` (so it is the watchdog's parent);
2. forks ``--workers`` workers, each in its own process group. With ``--tree``:
   worker 0 has a grandchild in its group and a grandchild that escapes with
   ``setsid()`` (then SIGSTOPped: in a session of its own, the kernel's orphaned-group
   SIGHUP+SIGCONT does not reach it, so the watchdog finds it stopped); worker 1 (when
   ``ORCHESTRATOR_DAEMON_TOKEN`` is in the environment the helper was *started* with)
   double-forks a daemon-like orphan in its own session, reachable only by the token; the
   last worker is SIGSTOPped too (when the helper dies its group becomes orphaned and the
   kernel sends it SIGHUP+SIGCONT, which it ignores and continues);
3. optionally starts a ``multiprocess`` Manager (``--manager``), registered as a
   ``process`` entry, its socket directory passed to ``--remove``;
4. optionally registers ``--decoy PID:START`` as a worker (the test passes a wrong start);
5. prints one JSON line describing everything, then serves commands on stdin:
   ``stop`` (clean shutdown through ``link.stop()``), ``restart`` (SIGKILL the watchdog,
   reap it, ``link.start()`` again); it never exits on its own (the test SIGKILLs it).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(body) -> int:
    """Fork; the child runs ``body()`` then sleeps until killed. Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # never hold the test's stdout pipe open
        body()
        while True:
            signal.pause()
    finally:
        os._exit(0)


def _announce(ready_w: int, role: str) -> None:
    os.write(ready_w, f"{role} {os.getpid()}\n".encode())


def _worker(index: int, tree: bool, token: bool, ready_w: int):
    def body() -> None:
        os.setpgid(0, 0)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the orphaned-group SIGHUP
        if tree and index == 0:
            _child(lambda: _announce(ready_w, "grandchild"))
            _child(lambda: (os.setsid(), _announce(ready_w, "escaped")))
        if tree and token and index == 1:
            # Double fork: the intermediate exits at once, so the orphan's ppid link to
            # the worker is broken and it sits in a session of its own.
            def intermediate() -> None:
                _child(lambda: (os.setsid(), _announce(ready_w, "orphan")))
                os._exit(0)

            mid = _child(intermediate)
            os.waitpid(mid, 0)
        _announce(ready_w, f"worker{index}")

    return body


def _read_lines(fd: int, count: int, timeout: float) -> list[str]:
    buf = b""
    deadline = time.monotonic() + timeout
    while buf.count(b"\n") < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"only got {buf!r}")
        if select.select([fd], [], [], remaining)[0]:
            buf += os.read(fd, 4096)
    return buf.decode().splitlines()


def _wait_exit(pid: int, timeout: float) -> int | None:
    """Reap our child ``pid`` within ``timeout``; its wait status code, or None."""
    fd = os.pidfd_open(pid)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            return None
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--tree", action="store_true")
    parser.add_argument("--manager", action="store_true")
    parser.add_argument("--decoy", help="PID:START registered as a worker")
    parser.add_argument("--remove", action="append", default=[])
    args = parser.parse_args()

    sys.path.insert(0, REPO_ROOT)
    from watchdog import WatchdogLink, open_verified, start_time
    from watchdog.identity import proc_stat

    # /proc/PID/environ shows the environment a process was exec'd with, not later
    # os.environ changes: the token must come from our own start-up environment.
    token = os.environ.get("ORCHESTRATOR_DAEMON_TOKEN")
    info: dict = {"helper": [os.getpid(), start_time(os.getpid())], "processes": {}}
    remove = list(args.remove)
    manager = None
    if args.manager:
        import multiprocess

        manager = multiprocess.Manager()
        remove.append(os.path.dirname(manager.address))
        info["manager_dir"] = os.path.dirname(manager.address)

    link = WatchdogLink(args.state_dir, token=token, remove_files=remove, grace=0.2)
    watchdog_pid = link.start()
    info["watchdog"] = [watchdog_pid, start_time(watchdog_pid)]

    ready_r, ready_w = os.pipe()
    expected = 0
    workers = []
    for i in range(args.workers):
        workers.append(_child(_worker(i, args.tree, bool(token), ready_w)))
        expected += 1
        if args.tree and i == 0:
            expected += 2
        if args.tree and token and i == 1:
            expected += 1
    for line in _read_lines(ready_r, expected, timeout=10):
        role, pid = line.split()
        info["processes"][role] = [int(pid), start_time(int(pid))]

    for i, pid in enumerate(workers):
        link.add(pid, start_time(pid), pid, "worker", f"worker{i}")
    if manager is not None:
        mpid = manager._process.pid
        link.add(mpid, start_time(mpid), None, "process", "manager")
        info["processes"]["manager"] = [mpid, start_time(mpid)]
    if args.decoy:
        dpid, dstart = map(int, args.decoy.split(":"))
        link.add(dpid, dstart, dpid, "worker", "decoy")
    if args.tree and len(workers) > 1:
        stopped = workers[-1]
        os.kill(stopped, signal.SIGSTOP)  # our own child: a bare pid is safe until we reap it
        escaped = open_verified(*info["processes"]["escaped"])  # not our child: use a pidfd
        signal.pidfd_send_signal(escaped, signal.SIGSTOP)
        os.close(escaped)
        for pid in (stopped, info["processes"]["escaped"][0]):
            deadline = time.monotonic() + 5
            while proc_stat(pid).state != "T" and time.monotonic() < deadline:
                time.sleep(0.001)
        info["stopped"] = [stopped, info["processes"]["escaped"][0]]
    # Everything registered has been written (or is buffered: flush before reporting).
    while link.pending():
        select.select([], [link.fileno()], [], 1.0)
        link.flush()

    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "stop":
            link.stop()
            print(json.dumps({"watchdog_exit": _wait_exit(watchdog_pid, 5.0)}), flush=True)
        elif command == "restart":
            os.kill(watchdog_pid, signal.SIGKILL)
            status = _wait_exit(watchdog_pid, 5.0)
            watchdog_pid = link.start()
            while link.pending():
                select.select([], [link.fileno()], [], 1.0)
                link.flush()
            new = [watchdog_pid, start_time(watchdog_pid)]
            print(json.dumps({"old_exit": status, "watchdog": new}), flush=True)
    while True:  # stdin closed: wait to be killed
        signal.pause()


if __name__ == "__main__":
    main()
