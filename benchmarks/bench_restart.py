"""Crash → replacement RUNNING: the orchestrator's restart policy beside supervisord's respawn.

One replica (``sleep 1000``) is SIGKILLed; the time until a new one runs in its place:

* orchestrator: the embedded ``Orchestrator`` with ``restart=always``, the backoff at its
  minimum (MIN 0, and the default 0.1 s for reference); the RUNNING moment is stamped by the
  loop itself (a thin wrapper on ``Engine.transition``), the kill right before ``os.kill``;
* supervisord: ``autorestart=true``, ``startsecs=0``, driven over its own Unix socket
  (XML-RPC), polled every millisecond for the new pid; installed into this venv from the
  package index if missing, and stopped by its own pid afterwards.

The same number of crashes for each, interleaved, in one run. Run from the repo root:

    .venv/bin/python benchmarks/bench_restart.py [--crashes 40]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xmlrpc.client
from pathlib import Path

from orchestrator import Orchestrator


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def trace_running(orch: Orchestrator) -> dict[str, float]:
    engine = orch._engine
    stamps: dict[str, float] = {}
    original = engine.transition

    def traced(rep, new, reason=None, *, exit_code=None):
        original(rep, new, reason, exit_code=exit_code)
        if new.value == "RUNNING":
            stamps[rep.id] = time.perf_counter()

    engine.transition = traced
    return stamps


def orchestrator_round(orch: Orchestrator, stamps: dict[str, float], pool: str) -> float:
    (rep,) = [r for r in orch.status()["replicas"] if r["pool"] == pool and r["state"] == "RUNNING"]
    t0 = time.perf_counter()
    os.kill(rep["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        fresh = [rid for rid, t in stamps.items() if t > t0 and rid.startswith(pool + "-")]
        if fresh:
            return stamps[fresh[0]] - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"{pool}: no replacement within 10 s")
        time.sleep(0.0005)


class Supervisord:
    def __init__(self, tmp: Path, extra: str = "") -> None:
        """``extra``: more config sections (e.g. ``[program:...]`` with ``autostart=false``)
        appended to the file, for callers that drive programs of their own."""
        try:
            import supervisor  # noqa: F401
        except ImportError:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "supervisor"], check=True)
        self.sock = tmp / "supervisor.sock"
        conf = tmp / "supervisord.conf"
        conf.write_text(textwrap.dedent(f"""
            [unix_http_server]
            file={self.sock}
            [supervisord]
            nodaemon=true
            logfile={tmp}/supervisord.log
            pidfile={tmp}/supervisord.pid
            [rpcinterface:supervisor]
            supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
            [program:sleeper]
            command=sleep 1000
            autorestart=true
            startsecs=0
            startretries=1000
            stdout_logfile=NONE
            stderr_logfile=NONE
            [program:defaults]
            command=sleep 1000
            autorestart=true
            startretries=1000
            stdout_logfile=NONE
            stderr_logfile=NONE
        """) + textwrap.dedent(extra))
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.rpc = self._proxy()  # a fresh one: a refused connect leaves the old unusable
                rpc = self.rpc.supervisor
                if rpc.getProcessInfo("sleeper")["state"] == 20 and rpc.getProcessInfo("defaults")["state"] == 20:
                    break
            except (OSError, xmlrpc.client.Fault):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("supervisord did not start its program")
            time.sleep(0.01)

    def _proxy(self) -> xmlrpc.client.ServerProxy:
        from supervisor.xmlrpc import SupervisorTransport

        return xmlrpc.client.ServerProxy(
            "http://127.0.0.1", transport=SupervisorTransport(None, None, f"unix://{self.sock}"))

    def round(self, name: str = "sleeper") -> float:
        info = self.rpc.supervisor.getProcessInfo(name)
        old = info["pid"]
        t0 = time.perf_counter()
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            info = self.rpc.supervisor.getProcessInfo(name)
            if info["state"] == 20 and info["pid"] not in (0, old):
                return time.perf_counter() - t0
            if time.monotonic() > deadline:
                raise RuntimeError("supervisord did not respawn within 30 s")
            time.sleep(0.001)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # supervisord stops its programs itself
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--crashes", type=int, default=30)
    ap.add_argument("--no-supervisord", action="store_true")
    args = ap.parse_args()
    results: dict[str, list[float]] = {"orchestrator, backoff MIN 0": [], "orchestrator, backoff MIN 0.1 s (default)": [],
                                       "supervisord 4 (autorestart, startsecs=0)": [],
                                       "supervisord 4 (autorestart, default startsecs=1)": []}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp, Orchestrator(grace=1.0, state_dir=tmp) as orch:
        stamps = trace_running(orch)
        orch.launch("zero", ["sleep", "1000"], policy={"restart": "always", "backoff": [0, 0],
                                                         "max_restarts": [100000, 1]}, wait=True)
        orch.launch("dflt", ["sleep", "1000"], policy={"restart": "always", "backoff": [0.1, 0.1],
                                                         "max_restarts": [100000, 1]}, wait=True)
        sup = None if args.no_supervisord else Supervisord(Path(tmp))
        try:
            for i in range(args.crashes):
                print(f"\rcrash {i + 1}/{args.crashes}", end="", file=sys.stderr, flush=True)
                results["orchestrator, backoff MIN 0"].append(orchestrator_round(orch, stamps, "zero"))
                results["orchestrator, backoff MIN 0.1 s (default)"].append(orchestrator_round(orch, stamps, "dflt"))
                if sup is not None:
                    results["supervisord 4 (autorestart, startsecs=0)"].append(sup.round())
                    results["supervisord 4 (autorestart, default startsecs=1)"].append(sup.round("defaults"))
        finally:
            if sup is not None:
                sup.close()
    print(file=sys.stderr)
    print(f"crash (SIGKILL) → replacement RUNNING, {args.crashes} crashes each, interleaved\n")
    print("| variant | p50 | p99 | mean |")
    print("| --- | --- | --- | --- |")
    for name, values in results.items():
        if values:
            print(f"| {name} | {pct(values, .5) * 1e3:.1f} ms | {pct(values, .99) * 1e3:.1f} ms | "
                  f"{statistics.mean(values) * 1e3:.1f} ms |")
    ours = results["orchestrator, backoff MIN 0"]
    for name in ("supervisord 4 (autorestart, startsecs=0)", "supervisord 4 (autorestart, default startsecs=1)"):
        theirs = results[name]
        if ours and theirs:
            print(f"p99 {name} / p99 orchestrator (MIN 0): {pct(theirs, .99) / pct(ours, .99):.1f}x")
    print("(targets: orchestrator p99 ≤ 50 ms; ≥ 20x better than supervisord)")


if __name__ == "__main__":
    main()
