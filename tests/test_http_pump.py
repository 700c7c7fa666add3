"""Event streams on a real reactor and store, without a daemon: followers at different
places and with different filters are served from one journal query per turn, a page at a
time, and each gets every event it asked for once, in seq order."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.daemon import httpapi
from orchestrator.store import Store


class _Engine:
    """What HttpApi asks of the engine for event streams: its journal's store."""

    def __init__(self, store: Store) -> None:
        self.journal = type("Journal", (), {"store": store})()


class _Counting(Store):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.queries = 0

    def events(self, **kw: Any) -> list[Any]:
        self.queries += 1
        return super().events(**kw)


def _follow(path: str, query: str, headers: str = "") -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    c.sendall(f"GET /v1/events?follow=1{query} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    c.setblocking(False)
    return c


def _seqs(raw: bytes) -> list[int]:
    return [int(line[4:]) for line in raw.split(b"\n") if line.startswith(b"id: ")]


def test_followers_of_every_kind_get_each_event_once_from_one_query_a_turn(reactor: Any, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpapi, "PAGE", 7)  # a page boundary every few events
    store = _Counting(tmp_path / "state.db")
    path = str(tmp_path / "http.sock")
    api = httpapi.HttpApi(_Engine(store), reactor, [httpapi.Address("unix", path=path)], state_dir=str(tmp_path),
                          logs_dir=tmp_path)
    try:
        def add(n: int) -> None:
            for i in range(n):
                store.append_event("transition", replica=f"p-{i % 3}", data={"i": i})
            store.commit()

        add(30)  # seqs 1-30: p-0 has 1, 4, 7...
        clients = {"all": _follow(path, ""), "p-1": _follow(path, "&replica=p-1"),
                   "resumed": _follow(path, "", "Last-Event-ID: 25\r\n"), "last 4": _follow(path, "&limit=4")}
        raw = {name: b"" for name in clients}

        def turns(until: float) -> None:
            while time.monotonic() < until:
                reactor.call_soon(lambda: None)
                reactor.run_once(0.01)
                for name, c in clients.items():
                    try:
                        while chunk := c.recv(1 << 16):
                            raw[name] += chunk
                    except BlockingIOError:
                        pass
                if max(_seqs(raw["all"]), default=0) >= store.last_seq() and not any(
                        max(_seqs(raw[n]), default=0) < expected_top[n] for n in clients):
                    return

        expected_top = {"all": 30, "p-1": 29, "resumed": 30, "last 4": 30}
        turns(time.monotonic() + 20)
        asked = store.queries
        add(9)  # seqs 31-39, in one turn
        expected_top = {"all": 39, "p-1": 38, "resumed": 39, "last 4": 39}
        turns(time.monotonic() + 20)
        # 9 events in one commit: a page of 7 and the rest, one query for all four followers each
        assert store.queries - asked == 2, store.queries - asked
        assert _seqs(raw["all"]) == list(range(1, 40))
        assert _seqs(raw["p-1"]) == list(range(2, 40, 3))
        assert _seqs(raw["resumed"]) == list(range(26, 40))
        assert _seqs(raw["last 4"]) == list(range(27, 40))
        for c in clients.values():
            c.close()
    finally:
        api.close()
        store.close()
