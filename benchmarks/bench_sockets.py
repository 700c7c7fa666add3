"""Connections refused during a rolling restart: a socket pool beside a ``--port-base`` pool.

One daemon (started through the CLI in a temporary state dir) runs two pools of 3 HTTP
servers each, side by side in one run:

* ``sockets``: ``--socket tcp://127.0.0.1:P``, the daemon's one listener shared by every
  replica (``examples/webapp.py``, ready by notify); its rolling restart surges: each new
  replica is ready before the old one stops;
* ``ports``: ``--port-base B``, ``python3 -m http.server {port}`` on B..B+2 (ready when it
  answers http); its rolling restart stops a slot's replica before its port can be taken.

While ``orchestrator restart --pool NAME`` runs, a client connects every ~2 ms (to the
shared port, or round-robin to the 3 ports) and sends a request; each attempt is answered,
refused (ECONNREFUSED) or failed otherwise. Rounds alternate between the pools. Run from
the repo root:

    .venv/bin/python benchmarks/bench_sockets.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(state), *args],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def free_ports(n: int) -> int:
    """A base port whose next ``n`` are free now: held together while they are checked."""
    for base in range(31000, 60000, 97):
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
            return base
    raise RuntimeError("no free ports")


class Client(threading.Thread):
    def __init__(self, ports: list[int], interval: float) -> None:
        super().__init__(daemon=True)
        self.ports, self.interval = ports, interval
        self.stop = threading.Event()
        self.answered = self.refused = self.failed = 0

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            port = self.ports[i % len(self.ports)]
            i += 1
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    data = b""
                    while chunk := s.recv(4096):
                        data += chunk
                if data.startswith(b"HTTP/1.0 200"):
                    self.answered += 1
                else:
                    self.failed += 1
            except ConnectionRefusedError:
                self.refused += 1
            except OSError:
                self.failed += 1
            self.stop.wait(self.interval)


def one_restart(state: Path, pool: str, ports: list[int], interval: float) -> dict:
    client = Client(ports, interval)
    client.start()
    time.sleep(0.2)  # attempts before the restart: the pool answers them all
    t0 = time.perf_counter()
    proc = cli(state, "restart", "--pool", pool)
    took = time.perf_counter() - t0
    time.sleep(0.2)
    client.stop.set()
    client.join(10)
    if proc.returncode != 0:
        raise RuntimeError(f"restart --pool {pool}: {proc.stderr.strip()}")
    total = client.answered + client.refused + client.failed
    return {"pool": pool, "attempts": total, "answered": client.answered, "refused": client.refused,
            "failed": client.failed, "restart_s": round(took, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.002, help="between connection attempts, s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-sockets-"))
    state = tmp / "state"
    base = free_ports(4)  # base..base+2 for the port pool, base+3 shared by the socket pool
    shared = base + 3
    rows: list[dict] = []
    try:
        started = cli(state, "start", "--cgroup", "off")
        if started.returncode != 0:
            raise RuntimeError(started.stderr.strip())
        for launch in (
            ["--pool", "sockets", "--count", "3", "--socket", f"tcp://127.0.0.1:{shared}", "--ready", "notify",
             "--target", "webapp:serve", "--cwd", str(ROOT / "examples")],
            ["--pool", "ports", "--count", "3", "--port-base", str(base), "--ready", "http://127.0.0.1:{port}/",
             "--", sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
        ):
            proc = cli(state, "launch", "--wait", *launch)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr.strip())
        for _ in range(args.rounds):
            rows.append(one_restart(state, "sockets", [shared], args.interval))
            rows.append(one_restart(state, "ports", [base, base + 1, base + 2], args.interval))
    finally:
        cli(state, "stop", "--timeout", "30")
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    for pool in ("sockets", "ports"):
        mine = [r for r in rows if r["pool"] == pool]
        attempts = sum(r["attempts"] for r in mine)
        refused = sum(r["refused"] for r in mine)
        summary[pool] = {"rounds": len(mine), "attempts": attempts, "refused": refused,
                         "failed": sum(r["failed"] for r in mine),
                         "refused_pct": round(100 * refused / attempts, 2) if attempts else None,
                         "restart_s_mean": round(sum(r["restart_s"] for r in mine) / len(mine), 3)}
    if args.json:
        print(json.dumps({"rounds": rows, "summary": summary, "cpus": os.cpu_count()}, indent=2))
        return 0
    print(f"rolling restart of 3 HTTP replicas, a connection every {args.interval * 1000:g} ms "
          f"({args.rounds} rounds each, alternating)")
    print(f"{'pool':<10}{'attempts':>10}{'refused':>10}{'failed':>8}{'refused %':>11}{'restart s':>11}")
    for pool, s in summary.items():
        label = "--socket" if pool == "sockets" else "--port-base"
        print(f"{label:<12}{s['attempts']:>8}{s['refused']:>10}{s['failed']:>8}{s['refused_pct']:>11}"
              f"{s['restart_s_mean']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
