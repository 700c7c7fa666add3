"""Benchmark the watchdog: how fast it cleans up after its parent is SIGKILLed, and what it
costs while idle.

Run: ``.venv/bin/python benchmarks/bench_watchdog.py [--quick]`` (30-60 s; --quick ~6 s).

Each trial starts a stand-in orchestrator (this file, ``--parent N``) that starts a real
watchdog through ``WatchdogLink`` (with a token, as the daemon does), forks N sleeping
workers (each in its own process group, no PR_SET_PDEATHSIG: only the watchdog can kill
them), registers them and reports ready. The benchmark opens a pidfd per worker, takes
``time.monotonic()`` (CLOCK_MONOTONIC is system-wide on Linux), SIGKILLs the parent and
waits on the pidfds:

* kill -> last worker gone: until the last worker pidfd is readable (the process exited);
* detection: the report's ``detected_monotonic`` minus the kill time;
* sweep: the report's own ``duration_s`` (selection, signals, waits, straggler scan).

Idle: the watchdog of a parent with 10 workers, over 10 s: CPU time and context switches
from /proc (0 wakeups/s expected: it blocks in one poll with no timeout).

Worker exits are real work (tearing down a forked interpreter's memory: ~0.5 ms of CPU
each on the VM this was written on), so on a 2-CPU machine 200 exits need ~50 ms however
fast the watchdog is, and other load on the machine shows up directly in the tails: the
header prints the load average and the CPU pressure (PSI) at the start.

This process makes itself a child subreaper so the orphaned workers and watchdogs are
reparented to it and reaped here, instead of piling up as zombies under PID 1.
"""

from __future__ import annotations

# Only what the stand-in parent needs is imported at module level: its workers are forks
# of it, and a smaller parent means cheaper worker exits, so the watchdog dominates what is
# measured. The driver's own modules (subprocess, tempfile, ctypes) are imported locally.
import argparse
import fcntl
import json
import os
import select
import signal
import sys
import termios
import time
from typing import TYPE_CHECKING

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from watchdog import WatchdogLink, open_verified, start_time  # noqa: E402
from watchdog.reaper import TOKEN_VARIABLE  # noqa: E402

if TYPE_CHECKING:
    import subprocess

PR_SET_CHILD_SUBREAPER = 36
TARGETS = {50: 0.025, 200: 0.080}  # kill -> last gone, p99 (seconds)
DETECT_TARGET = 0.002


# -- the stand-in orchestrator ----------------------------------------------------------


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def run_parent(workers: int, state_dir: str) -> None:
    # Like the daemon: a token in the environment it was started with, so its workers
    # carry it too, and the watchdog's sweep runs its token rule (reading environments).
    link = WatchdogLink(state_dir, token=os.environ[TOKEN_VARIABLE], grace=0.2)
    wd = link.start()
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        link.add(pid, start_time(pid), pid, "worker", f"w{pid}")
    # Ready = every line is in the watchdog's ledger and it is back in its poll.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        link.flush()
        unread = fcntl.ioctl(link.fileno(), termios.FIONREAD, b"\0\0\0\0")
        if not link.pending() and unread == b"\0\0\0\0" and "poll" in _wchan(wd):
            break
        time.sleep(0.002)
    else:
        raise TimeoutError("watchdog not ready")
    out = {"watchdog": [wd, start_time(wd)], "workers": [[p, start_time(p)] for p in pids]}
    print(json.dumps(out), flush=True)
    sys.stdin.read()  # until killed


# -- the measurements -------------------------------------------------------------------


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_all(fds: list[int], timeout: float) -> float | None:
    """Monotonic time at which the last of ``fds`` became readable; None on timeout.

    Sleeps on the last fd of the list (the watchdog signals in registration order, so it
    tends to die last), then collects the others in one non-blocking poll, and repeats:
    correct in any order, but this instrument wakes up a few times, not once per exit,
    and so steals little CPU from the processes it measures.
    """
    left = list(fds)
    deadline = time.monotonic() + timeout
    while True:
        everyone = select.poll()
        for fd in left:
            everyone.register(fd, select.POLLIN)
        done = {fd for fd, _ in everyone.poll(0)}
        left = [fd for fd in left if fd not in done]
        if not left:
            return time.monotonic()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        latest = select.poll()
        latest.register(left[-1], select.POLLIN)
        if latest.poll(remaining * 1000):
            left.pop()
            if not left:
                return time.monotonic()


def _start_parent(workers: int, state_dir: str) -> tuple[subprocess.Popen, dict]:
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--parent", str(workers), state_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, **{TOKEN_VARIABLE: os.urandom(8).hex()}),
    )
    ready, _, _ = select.select([proc.stdout], [], [], 20)
    if not ready:
        proc.kill()
        raise TimeoutError("parent did not start")
    return proc, json.loads(proc.stdout.readline())


def trial(workers: int) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-watchdog-") as state_dir:
        proc, info = _start_parent(workers, state_dir)
        fds = [open_verified(pid, start) for pid, start in info["workers"]]
        wd_fd = open_verified(*info["watchdog"])
        if wd_fd is None or None in fds:
            raise RuntimeError("a process died before the trial")
        try:
            t_kill = time.monotonic()
            proc.kill()
            t_last = _wait_all(fds, 5.0)
            if _wait_all([wd_fd], 5.0) is None:
                raise TimeoutError("watchdog did not exit")
            proc.wait(5)
            with open(os.path.join(state_dir, "watchdog-report.json")) as f:
                report = json.load(f)
        finally:
            for fd in fds + [wd_fd]:
                if fd is not None:
                    _kill_if_alive(fd)
                    os.close(fd)
            proc.kill()
            proc.wait(5)
            _reap_all()
        if t_last is None:
            raise TimeoutError("workers survived the watchdog")
        return {
            "gone": t_last - t_kill,
            "detect": report["detected_monotonic"] - t_kill,
            "sweep": report["duration_s"],
        }


def _kill_if_alive(fd: int) -> None:
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def idle(seconds: float) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-watchdog-") as state_dir:
        proc, info = _start_parent(10, state_dir)
        wd = info["watchdog"][0]
        fds = [open_verified(pid, start) for pid, start in info["workers"] + [info["watchdog"]]]
        try:
            before = _usage(wd)
            time.sleep(seconds)  # the measurement window itself
            after = _usage(wd)
        finally:
            proc.stdin.close()  # the parent ignores it; SIGKILL makes the watchdog sweep
            proc.kill()
            proc.wait(5)
            _wait_all([fd for fd in fds if fd is not None], 5.0)
            for fd in fds:
                if fd is not None:
                    _kill_if_alive(fd)
                    os.close(fd)
            _reap_all()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "cpu_ms": (after[0] - before[0]) * 1000 / ticks,
        "switches": (after[1] - before[1]) + (after[2] - before[2]),
        "seconds": seconds,
    }


def _usage(pid: int) -> tuple[int, int, int]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    cpu = int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)
    vol = invol = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol = int(line.split()[1])
    return cpu, vol, invol


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _cpu_pressure() -> str:
    """PSI "some avg10": % of the last 10 s in which some task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().split()[1].split("=")[1] + "%"
    except (FileNotFoundError, OSError, IndexError):
        return "n/a"


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parent", nargs=2, metavar=("N", "STATE_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer trials, 2 s idle")
    args = parser.parse_args()
    if args.parent:
        run_parent(int(args.parent[0]), args.parent[1])
        return 0

    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

    plan = {10: 30, 50: 30, 200: 20} if not args.quick else {10: 5, 50: 5, 200: 3}
    # Other work on the machine shows up in every latency below: print the load with them.
    print(f"watchdog benchmark: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"load average {' '.join(_loadavg())}, CPU pressure (PSI some avg10) {_cpu_pressure()}")
    print(f"{'workers':>7} {'trials':>6} | {'kill->last gone ms':^23} | {'detect ms':^15} | {'sweep ms':^9}")
    print(f"{'':>7} {'':>6} | {'p50':>7} {'p99':>7} {'max':>7} | {'p50':>7} {'p99':>7} | {'p50':>9}")
    failed = False
    all_detect: list[float] = []
    for workers, trials in plan.items():
        results = [trial(workers) for _ in range(trials)]
        gone = [r["gone"] * 1e3 for r in results]
        detect = [r["detect"] * 1e3 for r in results]
        sweep = [r["sweep"] * 1e3 for r in results]
        verdict = ""
        if workers in TARGETS:
            ok = _pct(gone, 0.99) <= TARGETS[workers] * 1e3
            failed |= not ok
            verdict = f"  target p99 <= {TARGETS[workers] * 1e3:.0f} ms: {'ok' if ok else 'MISSED'}"
        print(
            f"{workers:>7} {trials:>6} | {_pct(gone, 0.5):7.2f} {_pct(gone, 0.99):7.2f} {max(gone):7.2f} "
            f"| {_pct(detect, 0.5):7.3f} {_pct(detect, 0.99):7.3f} | {_pct(sweep, 0.5):9.2f}{verdict}"
        )
        all_detect += detect
    ok = _pct(all_detect, 0.99) <= DETECT_TARGET * 1e3
    failed |= not ok
    print(f"detection p99 over all trials: {_pct(all_detect, 0.99):.3f} ms "
          f"(target <= {DETECT_TARGET * 1e3:.0f} ms: {'ok' if ok else 'MISSED'})")

    seconds = 2.0 if args.quick else 10.0
    usage = idle(seconds)
    rate = usage["switches"] / usage["seconds"]
    print(f"idle watchdog over {seconds:.0f} s: CPU {usage['cpu_ms']:.1f} ms, "
          f"{usage['switches']} context switches ({rate:.1f} wakeups/s; target 0: {'ok' if rate == 0 else 'MISSED'})")
    end_load = _loadavg()
    print(f"load average at the end: {' '.join(end_load)}")
    if float(end_load[0]) > (os.cpu_count() or 1):
        print("note: more runnable work than CPUs during the run; the tails include that contention")
    return 1 if failed or rate else 0


if __name__ == "__main__":
    sys.exit(main())
