"""client/topfeed.py, the data side of ``orchestrator top``, on a fake client and a real
journal written by the test: an idle daemon is asked nothing, a burst of events costs a few
coalesced ``status`` calls, not one each, and a daemon that goes away (and one that comes
back) is seen. No Textual needed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import wait_for
from orchestrator.client.topfeed import STATUS_GAP, Feed, View, event_line
from orchestrator.paths import Paths
from orchestrator.store import Store


class FakeClient:
    """``status`` and ``tasks`` as a daemon of one pool answers them, counted."""

    def __init__(self) -> None:
        self.statuses = 0
        self.renewed = 0
        self.replicas = [{"id": "web-1", "pool": "web", "state": "RUNNING", "pid": None, "restarts": 0}]

    def status(self) -> dict[str, Any]:
        self.statuses += 1
        return {"daemon": {"pid": 4242, "started_at": time.time()}, "pools": [{"name": "web", "desired": 1}],
                "replicas": list(self.replicas)}

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        assert op == "tasks"
        return []

    def renew(self) -> None:
        self.renewed += 1


class Running:
    """A Feed's loop in a thread (as top's Textual worker runs it), its views kept."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.views: list[View] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=feed.run, args=(self.views.append, self.stop), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[Paths, Store]]:
    paths = Paths(tmp_path / "state")
    paths.state_dir.mkdir()
    store = Store(paths.db)
    store.append_event("transition", replica="web-1", data={"from": None, "to": "PENDING", "reason": None})
    store.commit()
    yield paths, store
    store.close()


def test_an_idle_daemon_is_asked_once_and_a_burst_of_events_a_few_times(journal: tuple[Paths, Store]) -> None:
    paths, store = journal
    client = FakeClient()
    pid = {"now": 4242}
    running = Running(Feed(paths, client, tick=0.01, daemon_pid=lambda _: pid["now"]))  # type: ignore[arg-type]
    try:
        wait_for(lambda: any(v.pools for v in running.views), 5, "the first view")
        assert running.views[-1].events[-1].text == "new -> PENDING"
        time.sleep(1.0)  # idle: 100 ticks read the journal, none asks the daemon
        assert client.statuses == 1
        t0 = time.monotonic()
        for i in range(40):  # a burst: 40 commits over ~0.4 s
            store.append_event("transition", replica="web-1", data={"from": "RUNNING", "to": "FAILED",
                                                                     "reason": f"crash {i}"})
            store.commit()
            time.sleep(0.01)
        wait_for(lambda: running.views[-1].events[-1].text == "RUNNING -> FAILED (crash 39)", 5, "the last event")
        took = time.monotonic() - t0
        wait_for(lambda: client.statuses > 1, 5, "a refresh after the burst")
        time.sleep(2 * STATUS_GAP)
        asked = client.statuses - 1
        assert 1 <= asked <= took / STATUS_GAP + 2, (asked, took)  # coalesced, not 40
    finally:
        running.close()


def test_a_daemon_gone_keeps_the_last_view_and_one_back_is_followed(journal: tuple[Paths, Store]) -> None:
    paths, _ = journal
    client = FakeClient()
    pid: dict[str, int | None] = {"now": 4242}
    running = Running(Feed(paths, client, tick=0.01, daemon_pid=lambda _: pid["now"]))  # type: ignore[arg-type]
    try:
        wait_for(lambda: any(v.pools for v in running.views), 5, "the first view")
        pid["now"] = None  # its pid file no longer locked: stopped, or killed with its watchdog done
        wait_for(lambda: running.views[-1].gone is not None, 3, "the view to say it is gone")
        last = running.views[-1]
        assert "4242" in (last.gone or "") and [p.name for p in last.pools] == ["web"]  # the last view, kept
        pid["now"] = 5151  # a new daemon in the same state dir
        wait_for(lambda: running.views[-1].gone is None, 3, "the new daemon followed")
        assert client.renewed == 1
    finally:
        running.close()


def test_event_lines_say_what_happened_in_a_few_words() -> None:
    line = event_line({"seq": 3, "ts": 1.0, "kind": "transition", "replica": "web-2",
                       "data": {"from": "RUNNING", "to": "FAILED", "reason": "killed by SIGKILL"}})
    assert (line.who, line.text) == ("web-2", "RUNNING -> FAILED (killed by SIGKILL)")
    line = event_line({"seq": 4, "ts": 1.0, "kind": "task", "replica": None,
                       "data": {"task": "jobs/7", "pool": "jobs", "from": "RUNNING", "to": "DONE"}})
    assert (line.who, line.text) == ("jobs/7", "RUNNING -> DONE")
    line = event_line({"seq": 5, "ts": 1.0, "kind": "command", "replica": None,
                       "data": {"op": "scale", "ok": False, "error": "unknown pool 'x'"}})
    assert line.text == "scale failed: unknown pool 'x'"
