"""Benchmark of the HTTP control plane (orchestrator/daemon/httpapi.py) beside the Manager channel.

Run: ``.venv/bin/python benchmarks/bench_api.py [--replicas 2000] [--rounds 400] [--sse 20]``
from the repo root. Prints a markdown table and the command that reproduced it.

One real daemon (``control.start_detached`` in a temporary state dir, stopped in a
``finally``) holding ``--replicas`` live replicas (``sleep``); then, in interleaved blocks:

1. ``ping`` and ``GET /v1/pools`` over the unix socket (a new connection per request, as
   curl makes it), against ``ping`` and ``status`` over the channel (``Client.call``);
   ``status`` of every replica over both (excepted from the 2 ms target, measured).
2. An event's way to a Server-Sent Events client: a scale up by one, and the time from the
   transition's journal stamp (``ts``, the daemon's wall clock) to its arrival at a client
   attached to ``/v1/events?follow=1``, with ``--sse`` such clients attached; and the scale
   commands' own round trip over the channel.
3. The loop's lag (``/v1/health``'s ``lag``) with none and with ``--sse`` clients attached.

Targets (the contract): a command over the unix socket p99 <= 2 ms; an event at an SSE
client <= 5 ms after its transition. Figures drift +-20% between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.scale import pct, time_calls  # noqa: E402 - after the path is set


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(self.unix_path)
        self.sock = s


def http_get(path: str, route: str) -> Any:
    conn = _Unix(path)
    try:
        conn.request("GET", route)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, (route, resp.status, body[:200])
        return json.loads(body)
    finally:
        conn.close()


class Sse(threading.Thread):
    """``n`` SSE clients read by one thread: the wall-clock arrival time of every event at
    each (seq -> (ts, arrived, kind)). Every socket found readable is stamped as the wait
    returns, before any is read or parsed: one thread per client made the last of 20 wait for
    the GIL while the others parsed, which the daemon's figure then carried."""

    def __init__(self, path: str, n: int) -> None:
        super().__init__(daemon=True)
        self.socks = []
        for _ in range(n):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(b"GET /v1/events?follow=1&limit=0 HTTP/1.1\r\nHost: x\r\n\r\n")
            self.socks.append(sock)
        self.seen: list[dict[int, tuple[float, float, str]]] = [{} for _ in range(n)]
        self.stop = False

    def run(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        bufs = [b""] * len(self.socks)
        for i, sock in enumerate(self.socks):
            sel.register(sock, selectors.EVENT_READ, i)
        while not self.stop:
            ready = sel.select(0.5)
            now = time.time()
            for key, _ in ready:
                i = key.data
                try:
                    chunk = self.socks[i].recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                bufs[i] += chunk
                while b"\n\n" in bufs[i]:
                    block, bufs[i] = bufs[i].split(b"\n\n", 1)
                    for line in block.split(b"\n"):
                        if line.startswith(b"data: "):
                            ev = json.loads(line[6:])
                            self.seen[i][ev["seq"]] = (ev["ts"], now, ev["kind"])

    def close(self) -> None:
        self.stop = True
        for sock in self.socks:
            sock.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--sse", type=int, default=20)
    args = ap.parse_args()

    from orchestrator import Client
    from orchestrator.client.control import start_detached, stop
    from orchestrator.paths import Paths

    tmp = tempfile.mkdtemp(prefix="bench-api-")
    paths = Paths(Path(tmp) / "state")
    sock = str(paths.state_dir / "http.sock")
    rows: list[tuple[str, str]] = []
    try:
        start_detached(paths, ["--grace", "1"])
        with Client(paths.state_dir, timeout=600) as client:
            left = args.replicas
            while left > 0:
                client.launch("sleepers", ["sleep", "100000"], count=min(500, left), wait=True, timeout=600)
                left -= 500
            lat: dict[str, list[float]] = {k: [] for k in ("http ping", "channel ping", "http pools",
                                                           "channel status (pools)", "http status",
                                                           "channel status")}
            for fn in (lambda: http_get(sock, "/v1/ping"), lambda: client.call("ping")):
                time_calls(fn, 50)  # warm-up
            block = max(1, args.rounds // 10)
            for _ in range(10):  # interleaved blocks: the same machine state for both
                lat["http ping"] += time_calls(lambda: http_get(sock, "/v1/ping"), block)
                lat["channel ping"] += time_calls(lambda: client.call("ping"), block)
                lat["http pools"] += time_calls(lambda: http_get(sock, "/v1/pools"), block)
                lat["channel status (pools)"] += time_calls(lambda: client.call("status")["pools"], block)
                lat["http status"] += time_calls(lambda: http_get(sock, "/v1/status"), max(1, block // 10))
                lat["channel status"] += time_calls(lambda: client.call("status"), max(1, block // 10))
            for name, vals in lat.items():
                rows.append((f"{name} ({args.replicas} replicas), n={len(vals)}",
                             f"p50 {pct(vals, 50) * 1e3:.2f} ms, p99 {pct(vals, 99) * 1e3:.2f} ms"))

            lag0 = [http_get(sock, "/v1/health").get("lag") or 0.0 for _ in range(5)]
            clients = Sse(sock, max(1, args.sse))
            clients.start()
            time.sleep(0.5)
            marks, scales = [], []
            for i in range(20):  # one transition at a time: its events' way to every client
                t0 = time.perf_counter()
                client.scale("probe", i + 1, command=["sleep", "100000"])
                scales.append(time.perf_counter() - t0)
                time.sleep(0.1)
            time.sleep(1.0)
            for seen in clients.seen:
                marks += [arrived - ts for ts, arrived, kind in seen.values() if kind == "transition"]
            lag1 = [http_get(sock, "/v1/health").get("lag") or 0.0 for _ in range(5)]
            clients.close()
            rows.append((f"event -> SSE client, {len(clients.socks)} clients, n={len(marks)}",
                         f"p50 {pct(marks, 50) * 1e3:.2f} ms, p99 {pct(marks, 99) * 1e3:.2f} ms"))
            rows.append((f"channel scale by one ({args.replicas} replicas), n={len(scales)}",
                         f"p50 {pct(scales, 50) * 1e3:.2f} ms, p99 {pct(scales, 99) * 1e3:.2f} ms"))
            rows.append((f"loop lag (health), 0 / {len(clients.socks)} SSE clients",
                         f"{max(lag0) * 1e3:.2f} ms / {max(lag1) * 1e3:.2f} ms"))
    finally:
        stop(paths, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    print("| measure | figure |\n| --- | --- |")
    for name, fig in rows:
        print(f"| {name} | {fig} |")
    print(f"\n`.venv/bin/python benchmarks/bench_api.py --replicas {args.replicas} --rounds {args.rounds} "
          f"--sse {args.sse}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
