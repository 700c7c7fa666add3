"""The daemon's HTTP, both directions: the metrics endpoint it serves and the http probes it
sends, measured through a real daemon.

Per checkout, one daemon with ``--metrics-port`` and a pool of ``--replicas`` replicas
(``sleep``) whose liveness probe is ``http://127.0.0.1:PORT/`` every ``--interval`` s,
all against one small HTTP server in this process (it counts the probes it answers).
Meanwhile a scraper GETs ``/metrics`` at 10 Hz. Reported:

- ``scrape_p50_ms`` / ``scrape_p99_ms``: a scrape's wall time, connect to last byte;
- ``lag_max_ms``: the loop's worst lag over the run (``orchestrator_loop_lag_max_seconds``);
- ``probe_cpu_us``: the daemon's CPU time (user + system) over the run divided by the
  probes answered: what one http probe costs the daemon, scrapes included (they are 10 a
  second against hundreds of probes).

``--baseline DIR`` runs the same from another checkout (a ``git worktree`` of an older
commit); the checkouts alternate round by round, so both see the same machine.

Run: .venv/bin/python benchmarks/bench_http.py [--baseline DIR] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


class _Counting(http.server.BaseHTTPRequestHandler):
    count = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        with _Counting.lock:
            _Counting.count += 1
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *args: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(checkout: str, state: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": checkout}
    return subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(state), *args],
                          env=env, capture_output=True, text=True, timeout=120, check=True, cwd=checkout)


def one_run(checkout: str, replicas: int, interval: float, seconds: float, target_port: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        state = Path(tmp) / "state"
        port = _free_port()
        pid = int(_cli(checkout, state, "start", "--metrics-port", str(port)).stdout.split()[-1])
        daemon = psutil.Process(pid)
        try:
            _cli(checkout, state, "launch", "--pool", "probed", "--count", str(replicas), "--wait",
                 "--live", f"http://127.0.0.1:{target_port}/", "--live-interval", str(interval),
                 "--", "sleep", "1000")
            time.sleep(2 * interval)  # every probe timer armed
            url = f"http://127.0.0.1:{port}/metrics"
            cpu0, probes0 = sum(daemon.cpu_times()[:2]), _Counting.count
            started = time.monotonic()
            scrapes: list[float] = []
            body = ""
            while time.monotonic() - started < seconds:
                t0 = time.perf_counter()
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = resp.read().decode()
                scrapes.append(time.perf_counter() - t0)
                time.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))
            cpu = sum(daemon.cpu_times()[:2]) - cpu0
            probes = _Counting.count - probes0
            lag = re.search(r"^orchestrator_loop_lag_max_seconds (\S+)$", body, re.M)
        finally:
            subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(state), "stop"],
                           env={**os.environ, "PYTHONPATH": checkout}, capture_output=True, timeout=120)
        q = statistics.quantiles(scrapes, n=100)
        return {"scrape_p50_ms": q[49] * 1000, "scrape_p99_ms": q[98] * 1000,
                "lag_max_ms": float(lag.group(1)) * 1000 if lag else None,
                "probe_cpu_us": cpu / probes * 1e6 if probes else None, "probes": probes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="DIR", help="also run this checkout, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--interval", type=float, default=0.5, help="liveness interval, seconds")
    args = ap.parse_args(argv)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    checkouts = {"now": str(ROOT)}
    if args.baseline:
        checkouts["baseline"] = str(Path(args.baseline).resolve())
    runs: dict[str, list[dict]] = {k: [] for k in checkouts}
    try:
        for r in range(args.rounds):
            for name, path in (checkouts.items() if r % 2 == 0 else reversed(checkouts.items())):
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(one_run(path, args.replicas, args.interval, args.seconds,
                                          server.server_address[1]))
    finally:
        server.shutdown()
    keys = ("scrape_p50_ms", "scrape_p99_ms", "lag_max_ms", "probe_cpu_us")
    summary = {name: {k: statistics.median(x[k] for x in rs if x[k] is not None) for k in keys}
               for name, rs in runs.items()}
    print(f"{'':10}" + "".join(f"{k:>16}" for k in keys))
    for name, s in summary.items():
        print(f"{name:10}" + "".join(f"{s[k]:16.2f}" for k in keys))
    if "baseline" in summary:
        print(f"{'now/base':10}" + "".join(f"{summary['now'][k] / summary['baseline'][k]:16.2f}x"
                                          if summary['baseline'][k] else f"{'-':>16}" for k in keys))
    print(json.dumps({"runs": runs, "median": summary}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
