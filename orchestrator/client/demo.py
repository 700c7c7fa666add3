"""``orchestrator demo``: the main job on built-in defaults, end to end.

1. a daemon in the foreground of a child process, in a temporary state dir;
2. churn through the command channel: launch, terminate, scale, workers that exit on
   their own, with a live line of progress;
3. kill -9 of the daemon, and the watchdog's clean-up of every worker and grandchild;
4. a new daemon on the same dir: the lost replicas recorded, the pools brought back;
5. a clean SIGTERM stop, and a summary. Nothing is left running, whatever happens.

Its signals go through ``orchestrator.signals``, as every signal the package sends: the
daemon it started is its own unreaped child (``to_child``); what is left at the end is
found by identity, (pid, start time) recorded when it was seen (``to_verified``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typing import Any, Callable, TypeVar

import psutil
from watchdog.identity import is_alive, start_time

from .. import signals
from ..errors import OrchestratorError
from ..interpreter import python_argv
from ..paths import Paths
from .channel import Client
from .control import daemon_env, read_until_eof

Ident = tuple[int, int]  # (pid, start time in clock ticks): a process, whatever reuses its pid later
R = TypeVar("R")


def demo_worker() -> None:
    """A replica that works for a while, then exits (now and then with an error)."""
    rnd = random.Random(os.getpid())
    time.sleep(rnd.uniform(0.5, 4.0))
    raise SystemExit(0 if rnd.random() < 0.8 else 3)


class _Daemon:
    """A foreground daemon as our child, started like ``start`` starts one."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        r, w = os.pipe()
        env = daemon_env()
        paths.logs.mkdir(parents=True, exist_ok=True)
        with open(paths.log, "ab") as log:
            self.proc = subprocess.Popen(
                python_argv("-m", "orchestrator", "--state-dir", str(paths.state_dir), "start",
                            "--foreground", "--grace", "2", "--ready-fd", str(w)),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(w,), env=env,
                start_new_session=True,
            )
        os.close(w)
        try:
            msg = read_until_eof(r, 60)
        finally:
            os.close(r)
        if not msg.startswith("READY"):
            self.kill()
            raise OrchestratorError(f"the demo daemon did not start: {msg or 'see ' + str(paths.log)}")
        self.pid = self.proc.pid

    def tree(self) -> list[Ident]:
        """The daemon and its descendants now, each by its identity."""
        try:
            pids = [self.pid, *(p.pid for p in psutil.Process(self.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            return []
        return [(pid, start) for pid in pids if (start := start_time(pid)) is not None]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:  # unreaped: its pid is still ours
            signals.to_child(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _alive(procs: list[Ident]) -> list[Ident]:
    """Those still running (not a zombie, not another process that took the pid)."""
    return [ident for ident in procs if is_alive(*ident)]


_last_line = [0.0]


def _line(text: str) -> None:
    """A live progress line on a terminal; one line a second into a file or pipe."""
    if sys.stdout.isatty():
        sys.stdout.write("\r\033[K" + text)
    elif time.monotonic() - _last_line[0] >= 1.0:
        _last_line[0] = time.monotonic()
        sys.stdout.write(text + "\n")
    else:
        return
    sys.stdout.flush()


def run_demo(replicas: int = 20, seconds: float = 4.0) -> int:
    tmp = tempfile.mkdtemp(prefix="orchestrator-demo-")
    paths = Paths(Path(tmp) / "state")
    seen: list[Ident] = []
    daemons: list[_Daemon] = []
    try:
        return _run(paths, replicas, seconds, seen, daemons)
    finally:
        for d in daemons:
            seen.extend(d.tree())
            d.kill()
        for ident in _alive(seen):  # last resort, each by its identity
            signals.to_verified(ident, signal.SIGCONT)
            signals.to_verified(ident, signal.SIGKILL)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _run(paths: Paths, replicas: int, seconds: float, seen: list[Ident], daemons: list[_Daemon]) -> int:
    print(f"orchestrator demo: state dir {paths.state_dir}")
    t0 = time.monotonic()
    d = _Daemon(paths)
    daemons.append(d)
    print(f"1. daemon pid {d.pid} ready in {1000 * (time.monotonic() - t0):.0f} ms")

    rtts: list[float] = []
    launched = terminated = 0
    rnd = random.Random(1)
    with Client(paths.state_dir) as client:
        def timed(fn: Callable[..., R], *a: Any, **kw: Any) -> R:
            t = time.perf_counter()
            out = fn(*a, **kw)
            rtts.append(time.perf_counter() - t)
            return out

        launched += len(timed(client.launch, "web", ["sleep", "1000"], count=replicas // 2, wait=True))
        launched += len(timed(client.launch, "jobs", target="orchestrator.client.demo:demo_worker",
                              count=replicas - replicas // 2, wait=True))
        # two replicas that leave work behind: a grandchild in their group, and one that escapes it
        launched += len(timed(client.launch, "tree", ["sh", "-c", "sleep 1000 & setsid sleep 1000 & wait"],
                              count=2, wait=True))
        print(f"2. churn for {seconds:g} s: terminate, scale and launch while workers exit on their own")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            st = timed(client.status)
            live = [r for r in st["replicas"] if r["state"] == "RUNNING" and r["pool"] != "tree"]
            victims = rnd.sample(live, min(len(live), rnd.randint(1, 4)))
            if victims:
                terminated += len(timed(client.terminate, *[r["id"] for r in victims]))
            for pool, size in (("web", replicas // 2), ("jobs", replicas - replicas // 2)):
                launched += len(timed(client.scale, pool, size)["launched"])
            counts: dict[str, int] = {}
            for r in timed(client.status, all=True)["replicas"]:
                counts[r["state"]] = counts.get(r["state"], 0) + 1
            _line(f"   {time.monotonic() - end + seconds:4.1f}s  launched {launched:4d}  terminated {terminated:4d}  "
                  + "  ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items())))
        if sys.stdout.isatty():
            print()
        wait_ids = [r["id"] for r in timed(client.status)["replicas"]]
        client.wait(wait_ids, "running", timeout=30)
        before = client.status()

    tree = d.tree()
    seen.extend(tree)
    workers = len(tree) - 3  # less the daemon, its watchdog and its manager
    print(f"3. kill -9 of the daemon with {len(before['replicas'])} replicas ({workers} worker processes "
          f"including grandchildren and an escaped setsid one)")
    t_kill = time.monotonic()
    d.signal(signal.SIGKILL)
    d.proc.wait(timeout=10)
    deadline = t_kill + 10
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.001)
    gone_ms = 1000 * (time.monotonic() - t_kill)
    left = _alive(tree)
    report: dict[str, Any] = {}
    for _ in range(200):
        if paths.report.exists():
            report = json.loads(paths.report.read_text())
            break
        time.sleep(0.01)
    actions: dict[str, int] = {}
    for proc in report.get("processes", []):
        actions[proc.get("action", "?")] = actions.get(proc.get("action", "?"), 0) + 1
    # With cgroups, one cgroup.kill each ends a replica's whole tree before the process
    # sweep looks: those processes are reported as "none" (nothing left to signal).
    groups = len(report.get("cgroups") or [])
    found = ", ".join(f"{n} {'already gone' if a == 'none' else a}" for a, n in sorted(actions.items()))
    print(f"   every process gone in {gone_ms:.1f} ms; survivors: {len(left)}; watchdog report: "
          + (f"{groups} replica cgroups killed whole; processes: " if groups else "processes: ") + found)

    t0 = time.monotonic()
    d2 = _Daemon(paths)
    daemons.append(d2)
    with Client(paths.state_dir) as client:
        st = client.status(all=True)
        lost = sum(1 for r in st["replicas"] if r["state"] == "LOST")
        back = [r["id"] for r in st["replicas"] if not r["state"] in ("LOST", "TERMINATED", "EXITED", "FAILED", "INTERRUPTED")]
        client.wait(back, "running", timeout=30)
        running = sum(1 for r in client.status()["replicas"] if r["state"] == "RUNNING")
    print(f"4. new daemon pid {d2.pid} in {1000 * (time.monotonic() - t0):.0f} ms: {lost} replicas recorded LOST, "
          f"pools back to {running} running replicas")
    seen.extend(d2.tree())
    d2.signal(signal.SIGTERM)
    code = d2.proc.wait(timeout=60)
    left2 = _alive(seen)
    print(f"5. SIGTERM: daemon exited {code}; processes left: {len(left2)}")

    ms = sorted(1000 * x for x in rtts)
    print("\nsummary")
    print(f"  replicas launched        {launched}")
    print(f"  replicas terminated      {terminated}")
    print(f"  command round trip (mixed) p50 {statistics.median(ms):.2f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.2f} ms "
          f"({len(ms)} commands)")
    print(f"  kill -9 -> all gone      {gone_ms:.1f} ms")
    print(f"  LOST after restart       {lost}")
    print(f"  left behind              {len(left) + len(left2)}")
    return 0 if not left and not left2 and code == 0 else 1
