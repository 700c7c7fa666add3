"""`orchestrator top` attached to a big idle host: what it costs the daemon, and how fast it starts.

A daemon (CLI ``start``, its own temporary state dir) runs N idle ``sleep 1000`` replicas.
In one run, windows of S seconds alternate: nobody attached, then a real ``orchestrator
top`` started at the window's start in a pseudo-terminal of 80x24 (its screen read and
thrown away, as a terminal would show it) and quit at its end, so its attach (the first
``status``) counts. Reported: the CPU the daemon and its manager server (the channel's
other process) used in each kind of window, as a percent of one core, the difference, and
top's own CPU. Then top's start-up, R times: from the exec of the command to its first
frame on the terminal, and to the first frame that shows the pool (the daemon's answer
drawn), beside the floor: an interpreter that only imports Textual. Run from the repo root:

    .venv/bin/python benchmarks/bench_top.py [--replicas 2000] [--seconds 30] [--rounds 1] [--starts 5]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_upgrade import cli, launch_idle  # noqa: E402

POOL = "idle"


class Top:
    """``orchestrator top`` on a pty of 80x24; ``drain`` reads what it draws."""

    def __init__(self, state_dir: str) -> None:
        self.started = time.monotonic()
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal is ours now
            os.execv(sys.executable, [sys.executable, "-m", "orchestrator", "--state-dir", state_dir, "top"])
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.seen = b""

    def drain(self, timeout: float) -> bytes:
        """What it drew within ``timeout`` (returns at the first chunk)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return b""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError:  # EIO: it has exited
            return b""
        self.seen = (self.seen + chunk)[-(1 << 16):]
        return chunk

    def wait_for(self, text: bytes, timeout: float) -> float:
        """Seconds from its exec until ``text`` was drawn."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"top did not draw {text!r} within {timeout:g} s")
            self.drain(0.05)
        return time.monotonic() - self.started

    def quit(self) -> None:
        os.write(self.fd, b"q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.drain(0.05)
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                break
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def exec_time(args: list[str]) -> float:
    """Seconds an interpreter takes to run ``args`` to its end (the floor beside top's start)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, *args], check=True, stdin=subprocess.DEVNULL, capture_output=True)
    return time.monotonic() - t0


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def window(procs: list[psutil.Process], seconds: float, state_dir: str | None) -> dict[str, float]:
    """CPU (% of a core) of ``procs`` over ``seconds``; with ``state_dir``, top is started on
    it at the window's start (its attach, the first ``status``, is counted) and quit at its
    end, and its own CPU is given too."""
    before = cpu_seconds(procs)
    t0 = time.monotonic()
    top = Top(state_dir) if state_dir is not None else None
    own = psutil.Process(top.pid) if top is not None else None
    while time.monotonic() - t0 < seconds:
        if top is not None:
            top.drain(0.2)  # a terminal reads what it is sent
        else:
            time.sleep(0.2)
    took = time.monotonic() - t0
    used = cpu_seconds(procs) - before
    top_used = cpu_seconds([own]) if own is not None else 0.0
    if top is not None:
        top.wait_for(POOL.encode(), 10)  # it did attach and draw the pool
        top.quit()
    return {"daemon_pct": 100 * used / took, "top_pct": 100 * top_used / took}


def run(n: int, seconds: float, rounds: int, starts: int) -> dict[str, Any]:
    state_dir = tempfile.mkdtemp(prefix="bench-top-")
    try:
        got = cli(state_dir, "start")
        assert got.returncode == 0, got.stderr
        launch_idle(state_dir, n, POOL)
        status = json.loads(cli(state_dir, "status", "--json").stdout)
        assert sum(r["state"] == "RUNNING" for r in status["replicas"]) == n
        d = status["daemon"]
        procs = [psutil.Process(d["pid"]), psutil.Process(d["manager_pid"])]
        time.sleep(2)  # the launches' last journal writes and probes settle
        idle, attached, own = [], [], []
        for _ in range(rounds):
            idle.append(window(procs, seconds, None)["daemon_pct"])
            w = window(procs, seconds, state_dir)
            attached.append(w["daemon_pct"])
            own.append(w["top_pct"])
        first, drawn, floor = [], [], []
        for _ in range(starts):
            floor.append(exec_time(["-c", "import textual.app; from textual.widgets import DataTable, Input, Static"]))
            top = Top(state_dir)
            first.append(top.wait_for(b"pools", 30))  # its first frame (the panes, before any data)
            drawn.append(top.wait_for(POOL.encode(), 30))  # the pool drawn from the daemon's answer
            top.quit()
        return {"replicas": n, "seconds": seconds, "rounds": rounds,
                "daemon_idle_pct": statistics.median(idle), "daemon_attached_pct": statistics.median(attached),
                "delta_pct": statistics.median(a - b for a, b in zip(attached, idle)),
                "top_pct": statistics.median(own),
                "start_first_frame_ms": [round(x * 1e3) for x in first],
                "start_pool_drawn_ms": [round(x * 1e3) for x in drawn],
                "textual_import_ms": [round(x * 1e3) for x in floor],
                "load_average": os.getloadavg()}
    finally:
        cli(state_dir, "stop", "--timeout", "120")
        shutil.rmtree(state_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=30.0, help="each window")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of windows (none attached, top attached)")
    parser.add_argument("--starts", type=int, default=5, help="start-ups of top timed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = run(args.replicas, args.seconds, args.rounds, args.starts)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['replicas']} idle replicas, {r['rounds']} x {r['seconds']:g} s windows each way "
          f"(load average {', '.join(f'{x:.1f}' for x in r['load_average'])})")
    print(f"daemon + manager CPU: none attached {r['daemon_idle_pct']:.2f}% of a core, top attached "
          f"{r['daemon_attached_pct']:.2f}%: {r['delta_pct']:+.2f}% (target <= +1%); top itself {r['top_pct']:.1f}%")
    print(f"top start-up, exec -> first frame: {r['start_first_frame_ms']} ms; -> the pool drawn: "
          f"{r['start_pool_drawn_ms']} ms (median {statistics.median(r['start_pool_drawn_ms'])} ms, target <= 500)")
    print(f"the floor, an interpreter that imports Textual's app and the widgets top uses, then exits: "
          f"{r['textual_import_ms']} ms (median {statistics.median(r['textual_import_ms'])} ms)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    sys.exit(main())
