"""What sending journaled events to SSE followers costs the control loop, per turn.

Run: ``.venv/bin/python benchmarks/bench_sse_pump.py [--clients 20] [--turns 400]`` from the
repo root (``PYTHONPATH=OTHER_CHECKOUT`` measures another checkout's httpapi.py the same way:
an A/B of two versions in one run of the shell loop in benchmarks/README.md).

In one process, without a daemon: a real ``HttpApi`` on a unix socket in a temporary dir, a
real ``Reactor`` and a real ``Store`` (its journal, as the engine gives it), ``--clients``
clients attached to ``/v1/events?follow=1``. Each turn appends three events (a transition's
share: PENDING, STARTING, RUNNING of one replica), commits them and runs one reactor turn,
whose end sends them to every client (httpapi's turn-end hook). Reported: that turn's time
(p50, p99) and per event and client; the clients' sockets are drained between turns, outside
the timing. This is the part of an event's way to a client that the loop pays for, and
what the last of ``--clients`` clients waits for beyond the first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("PYTHONPATH") is None:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.scale import pct  # noqa: E402 - after the path is set


class _Journal:
    def __init__(self, store: Any) -> None:
        self.store = store


class _Engine:
    """What HttpApi asks of the engine for event streams: its journal's store."""

    def __init__(self, store: Any) -> None:
        self.journal = _Journal(store)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--turns", type=int, default=400)
    args = ap.parse_args()

    from orchestrator.daemon import httpapi
    from orchestrator.daemon.reactor import Reactor
    from orchestrator.store import Store

    tmp = tempfile.mkdtemp(prefix="bench-sse-")
    reactor = Reactor()
    store = Store(Path(tmp) / "state.db")
    api = httpapi.HttpApi(_Engine(store), reactor, [httpapi.Address("unix", path=f"{tmp}/http.sock")],
                          state_dir=tmp, logs_dir=tmp)
    clients: list[socket.socket] = []
    try:
        for _ in range(args.clients):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(f"{tmp}/http.sock")
            c.sendall(b"GET /v1/events?follow=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            c.setblocking(False)
            clients.append(c)
        deadline = time.monotonic() + 10
        while api.servers[0].connections < args.clients and time.monotonic() < deadline:
            reactor.run_once(0.05)

        def drain() -> int:
            got = 0
            for c in clients:
                try:
                    while chunk := c.recv(1 << 20):
                        got += len(chunk)
                except BlockingIOError:
                    pass
            return got

        turns: list[float] = []
        for n in range(args.turns):
            for state in ("PENDING", "STARTING", "RUNNING"):
                store.append_event("transition", replica=f"p-{n}", data={"from": None, "to": state, "pid": 4242,
                                                                          "reason": "launched"})
            store.commit()
            reactor.call_soon(lambda: None)  # a turn that does not wait
            t0 = time.perf_counter()
            reactor.run_once(0)
            turns.append(time.perf_counter() - t0)
            drain()
        per = [t / (3 * args.clients) for t in turns]
        print("| measure | figure |\n| --- | --- |")
        print(f"| a turn sending 3 events to {args.clients} clients, n={len(turns)} | "
              f"p50 {pct(turns, 50) * 1e3:.3f} ms, p99 {pct(turns, 99) * 1e3:.3f} ms |")
        print(f"| per event and client | p50 {pct(per, 50) * 1e6:.1f} us |")
        print(f"\n`.venv/bin/python benchmarks/bench_sse_pump.py --clients {args.clients} --turns {args.turns}` "
              f"(httpapi: {httpapi.__file__})")
    finally:
        for c in clients:
            c.close()
        api.close()
        store.close()
        reactor.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
