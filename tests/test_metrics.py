"""orchestrator.daemon.metrics: the text format (parsed back with prometheus_client), churn, loop lag,
health, and the loopback HTTP endpoint served from a real Reactor.

The reactor runs in the test thread; HTTP clients run in threads of the test process (the
test process may have threads, the daemon may not). Every wait is bounded: the reactor runs
until a client's future is done or a limit passes."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.daemon.httpserver import MetricsServer
from orchestrator.client.display import format_health
from orchestrator.daemon.metrics import EXIT_KINDS, LagMonitor, Metrics, health
from orchestrator.daemon.reactor import Reactor

from helpers import read_to_close


# -- helpers ----------------------------------------------------------------------------

class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fam: Any, name: str | None = None) -> dict[tuple, float]:
    """{sorted label items: value} of one family's samples (``name``: only that sample name)."""
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples if name is None or s.name == name}


def open_fds() -> set[tuple[str, str]]:
    """This process's fds and what each points to. A leak is an fd that was not there
    before: fds that other code (another test's garbage, in the same xdist worker) closes
    meanwhile are not ours to count."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own fd, closed already
            pass
    return fds


def leaked(before: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return open_fds() - before


STATUS = {
    "pools": [
        {"name": "web", "desired": 3, "state": "ok", "reason": None, "restarts": 0},
        {"name": "jobs", "desired": 2, "state": "crashloop",
         "reason": 'exited 3 times in 10 s: "boom"\nsee \\logs', "restarts": 4},
        {"name": "batch", "desired": 0, "state": "backoff", "reason": "waiting", "restarts": 1},
    ],
    "replicas": [
        {"id": "web-1", "pool": "web", "state": "RUNNING", "pid": 11, "slot": 0, "ready": True},
        {"id": "web-2", "pool": "web", "state": "RUNNING", "pid": 12, "slot": 1, "ready": False},
        {"id": "web-3", "pool": "web", "state": "STARTING", "pid": 13, "slot": 2, "ready": False},
        {"id": "jobs-7", "pool": "jobs", "state": "STOPPING", "pid": 14, "slot": 0, "ready": True},
    ],
}
DAEMON = {"started_at": 5000.0, "daemon_alive": True, "watchdog_alive": True, "manager_alive": False,
          "version": "0.1.0"}


# -- render -----------------------------------------------------------------------------

def test_render_gauges_from_status():
    wall = FakeClock(5042.5)
    m = Metrics(clock=FakeClock(), wall=wall)
    fams = families(m.render(STATUS, DAEMON))
    assert all(name.startswith("orchestrator_") for name in fams)

    reps = fams["orchestrator_replicas"]
    assert reps.type == "gauge"
    got = samples(reps)
    assert got[(("pool", "web"), ("state", "RUNNING"))] == 2
    assert got[(("pool", "web"), ("state", "STARTING"))] == 1
    assert got[(("pool", "web"), ("state", "PENDING"))] == 0  # live states are there, at 0
    assert got[(("pool", "jobs"), ("state", "STOPPING"))] == 1
    assert got[(("pool", "batch"), ("state", "RUNNING"))] == 0
    assert samples(fams["orchestrator_replicas_ready"]) == {
        (("pool", "web"),): 1, (("pool", "jobs"),): 1, (("pool", "batch"),): 0}

    assert samples(fams["orchestrator_pools"]) == {
        (("state", "ok"),): 1, (("state", "crashloop"),): 1, (("state", "backoff"),): 1,
        (("state", "stopped"),): 0}  # every state is there, at 0
    assert samples(fams["orchestrator_pool_desired_replicas"]) == {
        (("pool", "web"),): 3, (("pool", "jobs"),): 2, (("pool", "batch"),): 0}

    assert samples(fams["orchestrator_up"]) == {
        (("part", "daemon"),): 1, (("part", "watchdog"),): 1, (("part", "manager"),): 0, (("part", "journal"),): 1}
    assert samples(fams["orchestrator_daemon_start_time_seconds"]) == {(): 5000.0}
    assert samples(fams["orchestrator_daemon_uptime_seconds"]) == {(): 42.5}
    assert samples(fams["orchestrator_build_info"]) == {(("version", "0.1.0"),): 1}
    assert "orchestrator_loop_lag_seconds" not in fams  # no LagMonitor attached


def test_render_counters():
    m = Metrics(clock=FakeClock())
    m.launched("web", 3)
    m.launched("jobs")
    for kind in EXIT_KINDS:
        m.exited("web", kind)
    m.exited("web", "signal")
    m.exited("web", "made-up")
    m.restarted("web")
    m.restarted("web")
    m.crashloop("jobs")
    m.store_failure()
    m.set_log_totals(12345, 6)
    m.http_request("served")
    fams = families(m.render(STATUS, {}))

    for name in ("replicas_launched", "replica_exits", "restarts", "crashloops", "store_failures",
                 "commands", "http_requests"):
        fam = fams[f"orchestrator_{name}"]  # the parser drops "_total" from a counter's name
        assert fam.type == "counter", name
        assert all(s.name.endswith("_total") for s in fam.samples), name
    assert samples(fams["orchestrator_replicas_launched"], "orchestrator_replicas_launched_total") == {
        (("pool", "jobs"),): 1, (("pool", "web"),): 3}
    exits = samples(fams["orchestrator_replica_exits"], "orchestrator_replica_exits_total")
    assert exits[(("kind", "signal"), ("pool", "web"))] == 2
    assert exits[(("kind", "lost"), ("pool", "web"))] == 1
    assert exits[(("kind", "other"), ("pool", "web"))] == 1  # an unknown kind does not become a label
    assert samples(fams["orchestrator_restarts"], "orchestrator_restarts_total") == {(("pool", "web"),): 2}
    assert samples(fams["orchestrator_crashloops"], "orchestrator_crashloops_total") == {(("pool", "jobs"),): 1}
    assert samples(fams["orchestrator_store_failures"], "orchestrator_store_failures_total") == {(): 1}
    assert samples(fams["orchestrator_log_bytes"]) == {(): 12345}
    assert samples(fams["orchestrator_log_dropped"]) == {(): 6}
    assert fams["orchestrator_log_bytes"].type == "gauge"
    # daemon dict empty: the daemon answered (up), watchdog and manager unknown (down)
    assert samples(fams["orchestrator_up"]) == {
        (("part", "daemon"),): 1, (("part", "watchdog"),): 0, (("part", "manager"),): 0, (("part", "journal"),): 1}
    assert "orchestrator_daemon_uptime_seconds" not in fams

    m.forget_pool("web")
    fams = families(m.render(STATUS, {}))
    assert samples(fams["orchestrator_replicas_launched"], "orchestrator_replicas_launched_total") == {
        (("pool", "jobs"),): 1}


def test_command_histogram_is_cumulative_and_counts_match():
    m = Metrics(clock=FakeClock())
    values = [0.0001, 0.0004, 0.003, 0.003, 0.2, 1.7, 12.0, 999.0]
    for v in values:
        m.command("status", v, ok=True)
    m.command("launch", 0.02, ok=False)
    m.command("launch", float("nan"), ok=True)  # a clock oddity: observed as 0, not NaN in the sum
    fams = families(m.render({}, {}))

    hist = fams["orchestrator_command_duration_seconds"]
    assert hist.type == "histogram"
    for op, expect_count, expect_sum in (("status", len(values), sum(values)), ("launch", 2, 0.02)):
        buckets = [(float(s.labels["le"]), s.value) for s in hist.samples
                   if s.name.endswith("_bucket") and s.labels["op"] == op]
        assert buckets == sorted(buckets)  # le ascending...
        counts = [c for _, c in buckets]
        assert counts == sorted(counts)  # ...and cumulative
        assert buckets[-1][0] == math.inf
        count = [s.value for s in hist.samples if s.name.endswith("_count") and s.labels["op"] == op]
        total = [s.value for s in hist.samples if s.name.endswith("_sum") and s.labels["op"] == op]
        assert count == [expect_count] and buckets[-1][1] == expect_count
        assert total == [pytest.approx(expect_sum)]
    status_buckets = {float(s.labels["le"]): s.value for s in hist.samples
                      if s.name.endswith("_bucket") and s.labels["op"] == "status"}
    assert status_buckets[0.0005] == 2
    assert status_buckets[0.005] == 4
    assert status_buckets[2.5] == 6
    assert status_buckets[300.0] == 7
    assert status_buckets[math.inf] == 8

    cmds = samples(fams["orchestrator_commands"], "orchestrator_commands_total")
    assert cmds == {(("op", "status"), ("outcome", "ok")): 8, (("op", "launch"), ("outcome", "error")): 1,
                    (("op", "launch"), ("outcome", "ok")): 1}


def test_command_op_labels_are_bounded():
    m = Metrics(clock=FakeClock())
    m.command('x"}\n', 0.001, True)  # whatever a client sends as op
    m.command("A" * 100, 0.001, True)
    for i in range(200):
        m.command(f"op{i}", 0.001, True)
    fams = families(m.render({}, {}))
    ops = {s.labels["op"] for s in fams["orchestrator_commands"].samples}
    assert "other" in ops
    assert len(ops) <= 65


def test_api_route_labels_are_bounded():
    m = Metrics(clock=FakeClock())
    for i in range(200):  # more routes than a table has: the rest is "other"
        m.api_request("GET", f"/v1/r{i}", 200, 0.001)
    m.api_request("GET", "/v1/r0", 404, -1.0)  # a clock step back is no negative time
    fams = families(m.render({}, {}))
    routes = {s.labels["route"] for s in fams["orchestrator_api_requests"].samples}
    assert "other" in routes and len(routes) <= 65
    counts = {(s.labels["route"], s.labels["status"]): s.value for s in fams["orchestrator_api_requests"].samples}
    assert counts[("/v1/r0", "200")] == 1 and counts[("/v1/r0", "404")] == 1
    sums = {s.labels["route"]: s.value for s in fams["orchestrator_api_request_duration_seconds"].samples
            if s.name.endswith("_sum")}
    assert sums["/v1/r0"] == pytest.approx(0.001)


def test_label_values_are_escaped_and_free_text_is_never_a_label():
    weird = 'we"ird\\pool\nname'  # not a valid pool name, but the format must survive it
    m = Metrics(clock=FakeClock())
    m.launched(weird)
    text = m.render(STATUS, {"version": 'v"1\\'})
    fams = families(text)
    assert samples(fams["orchestrator_replicas_launched"], "orchestrator_replicas_launched_total") == {
        (("pool", weird),): 1}
    assert samples(fams["orchestrator_build_info"]) == {(("version", 'v"1\\'),): 1}
    # a pool's reason is free text: it is in no label, nor anywhere in the output
    assert "boom" not in text and "waiting" not in text
    for fam in fams.values():
        for s in fam.samples:
            assert "reason" not in s.labels


def test_render_survives_odd_status():
    m = Metrics(clock=FakeClock())
    odd = {"pools": [{"name": "p"}, "junk"], "replicas": [{"pool": "q", "state": "LOST"}, None]}
    fams = families(m.render(odd, {"started_at": "yesterday"}))
    got = samples(fams["orchestrator_replicas"])
    assert got[(("pool", "q"), ("state", "LOST"))] == 1
    assert math.isnan(samples(fams["orchestrator_pool_desired_replicas"])[(("pool", "p"),)])
    fams = families(m.render({}, {}))
    assert samples(fams["orchestrator_replicas"]) == {}


# -- churn ------------------------------------------------------------------------------

def test_churn_rate_over_the_last_minute():
    clock = FakeClock(1000.0)
    m = Metrics(clock=clock)
    assert m.churn_rate() == 0
    m.launched("web", 30)
    clock.t = 1020.4
    m.launched("web", 20)
    m.launched("jobs", 10)
    assert m.churn_rate() == pytest.approx(60 / 60)
    clock.t = 1059.9  # the first launches are still inside the window
    assert m.churn_rate() == pytest.approx(1.0)
    clock.t = 1061.0  # ...and now out of it
    assert m.churn_rate() == pytest.approx(30 / 60)
    clock.t = 1100.0
    assert m.churn_rate() == 0
    assert len(m._churn) == 0  # the ring is pruned, not grown
    for i in range(1000):  # many launches: one bucket per second at most
        clock.t = 2000 + i * 0.1
        m.launched("web")
    assert len(m._churn) <= 61
    assert m.churn_rate() == pytest.approx(600 / 60)
    fams = families(m.render({}, {}))
    assert samples(fams["orchestrator_replica_churn_per_second"]) == {(): pytest.approx(10.0)}
    m.launched("web", 0)  # nothing launched: nothing counted
    assert m.churn_rate() == pytest.approx(10.0)


# -- loop lag ---------------------------------------------------------------------------

def test_lag_is_near_zero_when_idle(reactor):
    mon = LagMonitor(reactor, interval=0.1)
    t0 = time.monotonic()

    def samples_taken() -> int:
        return len(mon._samples)

    assert reactor.run_until(lambda: samples_taken() >= 5, limit=5.0)
    assert time.monotonic() - t0 >= 0.45
    # An idle loop reads near zero. One reading may still be late by however long the
    # machine kept this process off a CPU (seen: 63 ms on 2 loaded cores), so the best
    # reading is held to that, and every reading to well below a blocked loop's (next test).
    lags = [lag for _, lag in mon._samples]
    assert min(lags) < 0.05, lags
    assert mon.max_recent() == max(lags) < 0.25, lags
    assert 0 <= mon.last <= mon.current() < 0.25
    mon.stop()
    n = samples_taken()
    reactor.run_until(lambda: False, limit=0.3)
    assert samples_taken() == n  # stopped: no more readings


def test_lag_shows_a_blocked_loop(reactor):
    """This test blocks the loop on purpose, for 0.3 s, across the monitor's deadline."""
    mon = LagMonitor(reactor)  # the default interval, 0.5 s
    assert mon.interval == 0.5
    deadline = mon._timer.deadline
    reactor.call_at(deadline - 0.02, lambda: time.sleep(0.3))
    assert reactor.run_until(lambda: len(mon._samples) >= 1, limit=5.0)
    assert mon.last >= 0.2
    assert mon.max_recent() >= 0.2
    assert reactor.run_until(lambda: len(mon._samples) >= 2, limit=5.0)
    assert mon.last < 0.2  # the loop caught up (a loaded host's lag is not 0)...
    assert mon.max_recent() >= 0.2  # ...and the minute remembers
    m = Metrics(lag=mon)
    fams = families(m.render({}, {}))
    assert samples(fams["orchestrator_loop_lag_seconds"])[()] < 0.1
    assert samples(fams["orchestrator_loop_lag_max_seconds"])[()] >= 0.2
    mon.stop()


def test_lag_current_sees_a_stall_before_the_timer_runs(reactor):
    mon = LagMonitor(reactor, interval=0.05)
    time.sleep(0.3)  # the loop is stalled right now: the timer is overdue, not yet run
    assert mon.last == 0
    assert mon.current() >= 0.2
    mon.stop()


def test_lag_max_recent_forgets_after_a_minute():
    clock = FakeClock(100.0)
    r = Reactor(clock=clock)
    try:
        mon = LagMonitor(r, interval=0.5)
        clock.t = 100.5 + 0.7
        r.run_once(0)
        assert mon.last == pytest.approx(0.7)
        assert mon.max_recent() == pytest.approx(0.7)
        clock.t += 30
        assert mon.max_recent() == pytest.approx(0.7)
        clock.t += 31
        assert mon.max_recent() == 0.0
        r.run_once(0)  # the next reading is late by the whole jump of the fake clock
        assert mon.last == pytest.approx(60.5)
        assert mon.max_recent() == pytest.approx(60.5)
        mon.stop()
    finally:
        r.close()


# -- health -----------------------------------------------------------------------------

ALIVE = {"daemon_alive": True, "watchdog_alive": True, "manager_alive": True}


def test_health_when_all_is_well():
    ok, info = health(ALIVE, 0.003)
    assert ok is True
    assert info == {"healthy": True, "parts": {"daemon": True, "watchdog": True, "manager": True, "journal": True,
                                               "loop": True},
                    "failed": [], "lag": 0.003, "lag_limit": 1.0}
    json.dumps(info)  # what `health --json` prints
    line = format_health(ok, info)
    assert line.startswith("healthy") and "\n" not in line and "3.0 ms" in line


@pytest.mark.parametrize("part", ["daemon", "watchdog", "manager"])
def test_health_a_part_down(part):
    ok, info = health({**ALIVE, f"{part}_alive": False}, 0.01)
    assert ok is False and info["healthy"] is False
    assert info["failed"] == [part]
    assert info["parts"][part] is False
    line = format_health(ok, info)
    assert line.startswith("unhealthy") and f"{part} down" in line and "\n" not in line


def test_health_a_journal_fault_is_unhealthy_and_says_why():
    fault = {"ok": False, "fault": "disk full writing /s/state.db", "since": 1_700_000_000.0, "unsaved": 40}
    ok, info = health({**ALIVE, "journal": fault}, 0.01)
    assert ok is False and info["failed"] == ["journal"] and info["parts"]["journal"] is False
    assert info["journal"] == fault
    json.dumps(info)
    line = format_health(ok, info)
    assert line.startswith("unhealthy: state not saved since ") and "(disk full writing /s/state.db)" in line, line
    assert "40 changes wait" in line and "\n" not in line
    assert health({**ALIVE, "journal": {"ok": True}}, 0.01)[0] is True
    fams = families(Metrics(clock=FakeClock()).render(STATUS, {**ALIVE, "journal": fault}))
    assert samples(fams["orchestrator_up"])[(("part", "journal"),)] == 0


def test_health_lag():
    assert health(ALIVE, 0.999)[0] is True
    ok, info = health(ALIVE, 1.0)  # "below 1 s": 1 s itself is unhealthy
    assert ok is False and info["failed"] == ["loop"] and info["lag"] == 1.0
    assert "slow" in format_health(ok, info)
    for bad in (float("nan"), float("inf"), None, "x"):
        ok, info = health(ALIVE, bad)
        assert ok is False and info["failed"] == ["loop"] and info["lag"] is None
        json.dumps(info)
        assert "unknown" in format_health(ok, info)


def test_health_unknown_parts_count_as_down():
    ok, info = health({}, 2.0)
    assert ok is False
    assert info["failed"] == ["watchdog", "manager", "loop"]  # the daemon answered: it is up
    line = format_health(ok, info)
    assert "watchdog down" in line and "manager down" in line and "slow" in line


# -- the HTTP endpoint ------------------------------------------------------------------

class Served:
    """A MetricsServer on an ephemeral port of a real Reactor run in the test thread."""

    def __init__(self, reactor: Reactor, **kwargs: Any) -> None:
        self.reactor = reactor
        self.metrics = Metrics()
        self.healthy = True
        self.body: str | None = None
        self.fail = False
        kwargs.setdefault("healthz", lambda: health({**ALIVE, "manager_alive": self.healthy}, 0.01))
        self.server = MetricsServer(reactor, 0, self.render, on_outcome=self.metrics.http_request, **kwargs)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)
        self.url = f"http://127.0.0.1:{self.server.port}"

    def render(self) -> str:
        if self.fail:
            raise RuntimeError("render broke")
        if self.body is not None:
            return self.body
        return self.metrics.render(STATUS, DAEMON)

    def run(self, fn: Callable[[], Any], limit: float = 10.0) -> Any:
        """``fn`` in a client thread while the loop runs here; its result (or its exception)."""
        fut = self.pool.submit(fn)
        assert self.reactor.run_until(fut.done, limit), "client did not finish in time"
        return fut.result()

    def run_all(self, fns: list[Callable[[], Any]], limit: float = 20.0) -> list[concurrent.futures.Future]:
        futs = [self.pool.submit(fn) for fn in fns]
        assert self.reactor.run_until(lambda: all(f.done() for f in futs), limit), "clients did not finish"
        return futs

    def get(self, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
        def fetch() -> tuple[int, dict, bytes]:
            req = urllib.request.Request(self.url + path, method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, dict(resp.headers), resp.read()
            except urllib.error.HTTPError as err:
                with err:
                    return err.code, dict(err.headers), err.read()
        return self.run(fetch)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.server.close()


@pytest.fixture
def served(reactor):
    before = open_fds()
    made: list[Served] = []

    def make(**kwargs: Any) -> Served:
        s = Served(reactor, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
        assert s.server.connections == 0
    assert not leaked(before), "fd leak"


def test_get_metrics(served):
    s = served()
    status, headers, body = s.get("/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["Content-Length"]) == len(body)
    fams = families(body.decode())
    assert samples(fams["orchestrator_replicas"])[(("pool", "web"), ("state", "RUNNING"))] == 2
    status, _, body = s.get("/metrics?name[]=x")  # a query string is ignored
    assert status == 200 and b"orchestrator_up" in body
    status, _, body = s.get("/metrics", method="HEAD")
    assert status == 200 and body == b""
    assert s.server.counts["served"] == 3
    fams = families(s.metrics.render({}, {}))  # the server's outcomes reach Metrics
    assert samples(fams["orchestrator_http_requests"], "orchestrator_http_requests_total")[
        (("outcome", "served"),)] == 3


def test_healthz_and_unknown_paths(served):
    s = served()
    status, headers, body = s.get("/healthz")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body)["healthy"] is True
    s.healthy = False
    status, _, body = s.get("/healthz")
    assert status == 503
    assert json.loads(body)["failed"] == ["manager"]
    assert s.get("/")[0] == 404
    assert s.get("/metricsx")[0] == 404
    assert s.get("/metrics", method="POST")[0] == 405
    s.fail = True
    assert s.get("/metrics")[0] == 500  # a render that raises: a 500, and the loop goes on
    s.fail = False
    assert s.get("/metrics")[0] == 200


def test_healthz_absent_is_404(served):
    s = served(healthz=None)
    assert s.get("/healthz")[0] == 404


def test_binds_loopback_only(served):
    s = served()
    host, port = s.server._sock.getsockname()
    assert host == "127.0.0.1" and port == s.server.port and port > 0
    assert s.server._sock.getblocking() is False


def test_bind_failure_is_a_clear_oserror(served, reactor):
    s = served()
    before = open_fds()
    with pytest.raises(OSError) as info:
        MetricsServer(reactor, s.server.port, lambda: "")
    assert f"127.0.0.1:{s.server.port}" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(OSError, match="invalid metrics port"):
        MetricsServer(reactor, 70000, lambda: "")
    assert not leaked(before)


def test_silent_client_is_closed_after_the_timeout_without_blocking_the_loop(served):
    s = served()
    ticks = []

    def tick() -> None:
        ticks.append(time.monotonic())
        reactor_timer[0] = s.reactor.call_later(0.05, tick)

    reactor_timer = [s.reactor.call_later(0.05, tick)]
    connected = threading.Event()

    def silent() -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", s.server.port), timeout=10) as c:
            t0 = time.monotonic()
            connected.set()
            data = c.recv(100)  # blocks until the server closes us
            return data, time.monotonic() - t0

    fut = s.pool.submit(silent)
    assert s.reactor.run_until(connected.is_set, 5.0)
    # while the silent client waits, the loop serves another client
    status, _, _ = s.get("/metrics")
    assert status == 200
    assert s.reactor.run_until(fut.done, 10.0)
    data, waited = fut.result()
    reactor_timer[0].cancel()
    assert data == b""
    assert 1.5 <= waited <= 4.0
    assert s.server.counts["timeout"] == 1
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    # the loop never waited on the client (that would be a gap of its ~2 s timeout; a
    # loaded host stretches a 50 ms tick to half a second)
    assert len(ticks) >= 20 and max(gaps) < 1.0


def test_request_too_large_and_garbage(served):
    s = served()

    def send(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", s.server.port), timeout=10) as c:
            try:
                c.sendall(data)
            except OSError:
                pass
            return read_to_close(c)

    reply = s.run(lambda: send(b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 9000))
    assert reply == b"" or reply.startswith(b"HTTP/1.1 431")
    assert s.server.counts["too_large"] == 1
    assert s.run(lambda: send(b"\x00\xff garbage\r\n\r\n")).startswith(b"HTTP/1.1 400")
    assert s.run(lambda: send(b"GET /metrics\n\n")).startswith(b"HTTP/1.1 400")
    assert s.run(lambda: send(b"GET /metrics HTTP/1.0\n\n")).startswith(b"HTTP/1.1 200")  # bare LFs
    assert s.get("/metrics")[0] == 200


def test_clients_that_vanish_are_closed_and_counted(served):
    s = served()

    def reset_after_request() -> None:
        c = socket.create_connection(("127.0.0.1", s.server.port), timeout=10)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        c.close()  # RST

    def half_request() -> None:
        with socket.create_connection(("127.0.0.1", s.server.port), timeout=10) as c:
            c.sendall(b"GET /met")

    s.run_all([reset_after_request] * 5 + [half_request] * 5)
    # the clients are gone; the loop accepts (the kernel's queue still has them) and closes each
    assert s.reactor.run_until(lambda: sum(s.server.counts.values()) == 10, 5.0), s.server.counts
    assert s.server.connections == 0
    assert set(s.server.counts) <= {"error", "closed_early", "served"}
    assert s.get("/metrics")[0] == 200


def test_a_slow_reader_does_not_block_the_loop(served):
    """A body much bigger than the socket buffers: the rest is written as the client reads."""
    s = served()
    s.body = "# big\n" + "orchestrator_x 1\n" * 300_000  # ~5 MB
    go = threading.Event()
    sent = threading.Event()

    def slow() -> bytes:
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.settimeout(10)
        with c:
            c.connect(("127.0.0.1", s.server.port))
            c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            sent.set()
            assert go.wait(10)
            out = bytearray()
            while chunk := c.recv(65536):
                out += chunk
            return bytes(out)

    fut = s.pool.submit(slow)
    assert s.reactor.run_until(sent.is_set, 5.0)
    assert s.reactor.run_until(lambda: s.server._conns and next(iter(s.server._conns.values())).sent > 0, 5.0)
    t0 = time.monotonic()
    s.reactor.run_until(lambda: False, 0.3)  # turns go on while the client reads nothing
    assert time.monotonic() - t0 < 1.0
    conn = next(iter(s.server._conns.values()))
    assert 0 < conn.sent < len(conn.out)  # kept, not blocked on
    go.set()
    assert s.reactor.run_until(fut.done, 20.0)
    reply = fut.result()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert body == s.body.encode()


def test_fifty_concurrent_clients_are_all_answered_or_refused(served):
    s = served()

    def client() -> str:
        try:
            with urllib.request.urlopen(s.url + "/metrics", timeout=15) as resp:
                families(resp.read().decode())
                return "ok"
        except urllib.error.HTTPError as err:
            with err:
                return f"http {err.code}"
        except (urllib.error.URLError, ConnectionError) as err:
            return f"refused {err}"

    futs = s.run_all([client] * 50, limit=30.0)
    results = [f.result() for f in futs]  # no exception: the clients all returned
    assert len(results) == 50
    assert all(r == "ok" or r == "http 503" or r.startswith("refused") for r in results), results
    assert results.count("ok") >= 16
    assert s.reactor.run_until(lambda: s.server.connections == 0, 5.0)
    assert s.server.counts["served"] == results.count("ok")


def test_beyond_max_connections_a_client_is_refused(served):
    s = served(max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", s.server.port), timeout=10) for _ in range(4)]
    try:
        assert s.reactor.run_until(lambda: s.server.connections == 4, 5.0)
        status = s.run(lambda: _status_or_refused(s.url + "/metrics"))
        assert status in ("503", "refused")
        assert s.server.counts["refused"] == 1
        assert s.server.connections == 4
    finally:
        for c in idle:
            c.close()
    assert s.reactor.run_until(lambda: s.server.connections == 0, 5.0)
    assert s.server.counts["closed_early"] == 4
    assert s.get("/metrics")[0] == 200


def _status_or_refused(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as err:
        with err:
            return str(err.code)
    except (urllib.error.URLError, ConnectionError):
        return "refused"


def test_close_with_open_connections(served, reactor):
    before = open_fds()
    server = MetricsServer(reactor, 0, lambda: "")
    c = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        assert reactor.run_until(lambda: server.connections == 1, 5.0)
        server.close()
        server.close()  # idempotent
        assert server.counts["closed_by_server"] == 1
        assert c.recv(10) == b""
    finally:
        c.close()
    reactor.run_once(0)  # the reactor no longer has our fd: a turn runs fine
    assert not leaked(before)
