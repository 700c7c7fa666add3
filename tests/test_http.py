"""The HTTP control plane (daemon/httpapi.py on daemon/httpserver.py): every route against a
real daemon over its unix socket and over TCP with tokens, compared with the CLI's --json;
auth; the event stream resumed with Last-Event-ID; hostile clients; the OpenAPI document.
Plain http.client and sockets: curl's requests, without a new test dependency."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import TAG_VAR
from helpers import TESTS, DaemonUnderTest, cli, cli_env, free_port_range, read_to_close, wait_for
from orchestrator import Client, Executor
from orchestrator.daemon import httpapi
from orchestrator.daemon.httpserver import HttpServer, Request, Exchange, unix_listener

pytestmark = pytest.mark.timeout(120)

TOKEN = "full-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


class Api:
    """Requests to one listener: ``unix`` a socket path, else ``(host, port)`` and a token."""

    def __init__(self, unix: str | None = None, tcp: tuple[str, int] | None = None, token: str | None = None) -> None:
        self.unix, self.tcp, self.token = unix, tcp, token

    def connection(self, timeout: float = 20.0) -> http.client.HTTPConnection:
        if self.unix is not None:
            return _Unix(self.unix, timeout)
        assert self.tcp is not None
        return http.client.HTTPConnection(*self.tcp, timeout=timeout)

    def __call__(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 20.0) -> tuple[int, dict[str, str], Any]:
        conn = self.connection(timeout)
        hdrs = dict(headers or {})
        if self.token is not None:
            hdrs.setdefault("Authorization", f"Bearer {self.token}")
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            payload = resp.read()
            ctype = resp.getheader("Content-Type", "")
            value: Any = json.loads(payload) if ctype.startswith("application/json") and payload else payload.decode()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, value
        finally:
            conn.close()

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, _, value = self(method, path, body, **kw)
        assert status == 200, (method, path, status, value)
        conforms(method, path, value)
        return value

    def refused(self, method: str, path: str, body: Any = None, *, status: int, code: str | None = None,
                **kw: Any) -> str:
        got, _, value = self(method, path, body, **kw)
        assert got == status, (method, path, got, value)
        assert set(value) == {"error"} and {"code", "message"} <= set(value["error"]), value
        assert "\n" not in value["error"]["message"]
        if code is not None:
            assert value["error"]["code"] == code, value
        return str(value["error"]["message"])


def _route(method: str, path: str) -> httpapi.Route:
    bare = path.split("?", 1)[0]
    for route in httpapi.ROUTES:
        if route.method == method and route.pattern.match(bare):
            return route
    raise AssertionError(f"no route {method} {bare}")


def conforms(method: str, path: str, value: Any) -> None:
    """A 200 reply conforms to its route's schema in the document."""
    route = _route(method, path)
    if route.ctype == httpapi.JSON:
        httpapi.check(value, route.result, "reply")


def sse_events(sock: socket.socket, until_seq: int, timeout: float = 20.0) -> list[int]:
    """The seqs of the events read from an SSE stream until one >= ``until_seq``."""
    sock.settimeout(timeout)
    buf = b""
    seqs: list[int] = []
    deadline = time.monotonic() + timeout
    while not seqs or seqs[-1] < until_seq:
        assert time.monotonic() < deadline, f"events up to {until_seq} did not come: {seqs[-5:]}"
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended at {seqs[-1:] or None}"
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"id: "):
                    seqs.append(int(line[4:]))
    return seqs


def open_sse(socket_path: str, headers: str = "") -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(socket_path)
    s.sendall(f"GET /v1/events?follow=1 HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
    return s


def _stream_opens(api: Api) -> bool:
    """Whether a new event stream is admitted now (its head read, then closed)."""
    assert api.unix is not None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    with s:
        s.connect(api.unix)
        s.sendall(b"GET /v1/events?follow=1&limit=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        return s.recv(12) == b"HTTP/1.1 200"


@pytest.fixture
def api(daemon: DaemonUnderTest) -> Api:
    daemon.start()
    return Api(unix=str(daemon.state_dir / "http.sock"))


# -- the routes over the unix socket ------------------------------------------------------


def test_the_socket_is_the_owners_only_and_speaks_as_curl_does(daemon: DaemonUnderTest, api: Api) -> None:
    st = os.stat(daemon.state_dir / "http.sock")
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    assert api.ok("GET", "/v1/ping") == "pong"
    status, headers, value = api("HEAD", "/v1/status")
    assert status == 200 and value == "" and int(headers["content-length"]) > 0
    assert api("HEAD", "/v1/events?follow=1")[0] == 400  # a HEAD answer has no body to say why
    # curl sends a body over 1 KiB after "Expect: 100-continue", once told to go on
    body = json.dumps({"pool": "big", "n": 0, "spec": {"command": ["true"], "env": {"PAD": "x" * 2000}}}).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    with s:
        s.connect(str(daemon.state_dir / "http.sock"))
        s.sendall(b"POST /v1/scale HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(1024).startswith(b"HTTP/1.1 100 ")
        s.sendall(body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 "), reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1]) == {"pool": "big", "desired": 0, "launched": [], "terminated": []}


def test_the_pool_verb_routes(daemon: DaemonUnderTest, api: Api) -> None:
    api.ok("POST", "/v1/launch", {"pool": "web", "spec": {"command": ["sleep", "60"]}, "count": 2,
                                  "wait": True, "timeout": 30})
    assert api.ok("GET", "/v1/pools/web/active") == {"pool": "web", "active": True, "state": "active"}
    stopped = api.ok("POST", "/v1/stop", {"pools": ["web"], "wait": True, "timeout": 30})
    assert stopped == {"stopped": ["web"], "terminating": ["web-1", "web-2"]}
    shown = api.ok("GET", "/v1/pools/web")
    assert (shown["state"], shown["desired"], shown["active_state"]) == ("stopped", 2, "inactive")
    assert shown == json.loads(cli(daemon.state_dir, "show", "web", "--json", check=True).stdout)
    assert api.ok("GET", "/v1/pools/web/active")["active"] is False
    started = api.ok("POST", "/v1/start", {"pools": ["web"], "wait": True, "timeout": 30})
    assert started == {"started": ["web"], "launched": ["web-3", "web-4"]}
    assert api.ok("POST", "/v1/reset-failed", {"pools": ["web"]}) == {"reset": ["web"], "launched": []}
    api.refused("GET", "/v1/pools/ghost", status=404, code="unknown_pool")
    api.refused("GET", "/v1/pools/ghost/active", status=404, code="unknown_pool")
    api.refused("POST", "/v1/stop", {"pools": ["web", "ghost"]}, status=404, code="unknown_pool")
    api.refused("POST", "/v1/stop", {"pools": []}, status=400)
    api.refused("POST", "/v1/start", {"pools": "web"}, status=400)
    assert api.ok("GET", "/v1/pools/web")["state"] == "ok"  # the refused stop changed nothing


def test_every_replica_route_as_the_cli_says_it(daemon: DaemonUnderTest, api: Api, tmp_path: Path) -> None:
    launched = api.ok("POST", "/v1/launch", {"pool": "web", "spec": {"command": ["sleep", "60"]}, "count": 2,
                                             "wait": True, "timeout": 30})
    assert launched == {"ids": ["web-1", "web-2"], "failed": []}
    daemon.status()
    cli_status = json.loads(cli(daemon.state_dir, "status", "--json", check=True).stdout)
    status = api.ok("GET", "/v1/status")
    assert status["state_dir"] == cli_status["state_dir"] == str(daemon.state_dir)
    assert [r["id"] for r in status["replicas"]] == [r["id"] for r in cli_status["replicas"]]
    assert status["pools"][0]["name"] == "web" and set(status) == set(cli_status)
    assert api.ok("GET", "/v1/pools") == status["pools"]
    assert [r["id"] for r in api.ok("GET", "/v1/replicas?all=1")] == ["web-1", "web-2"]
    health = api.ok("GET", "/v1/health")
    assert health["healthy"] is True and set(health) == set(json.loads(cli(daemon.state_dir, "health", "--json").stdout))
    assert "orchestrator_replicas" in api.ok("GET", "/v1/metrics")

    scaled = api.ok("POST", "/v1/scale", {"pool": "web", "n": 3})
    assert scaled == {"pool": "web", "desired": 3, "launched": ["web-3"], "terminated": []}
    assert api.ok("POST", "/v1/wait", {"ids": ["web-3"], "timeout": 30})
    sent = api.ok("POST", "/v1/signal", {"signal": "CONT", "pool": "web"})
    assert sorted(sent["sent"]) == ["web-1", "web-2", "web-3"]
    restarted = api.ok("POST", "/v1/restart", {"ids": ["web-3"], "timeout": 60})
    assert list(restarted["replaced"]) == ["web-3"]
    assert api.ok("POST", "/v1/terminate", {"ids": ["web-1"], "wait": True, "timeout": 30}) == {"terminated": ["web-1"]}
    deleted = api.ok("POST", "/v1/delete", {"pool": "web"})
    assert deleted["pool"] == "web" and "web-2" in deleted["terminated"]
    # reload without a config file: refused, a conflict with how it was started, not bad input
    assert "config file" in api.refused("POST", "/v1/reload", {}, status=409, code="error")

    # one bad input each: a 4xx with one line, never a 500
    api.refused("POST", "/v1/launch", {"pool": "web"}, status=400, code="invalid")
    api.refused("POST", "/v1/launch", {"pool": "bad name!", "spec": {"command": ["true"]}}, status=400)
    api.refused("POST", "/v1/launch", {"pool": "p", "spec": {"pickled": "eA=="}}, status=400)
    api.refused("POST", "/v1/launch", raw=b"{not json", status=400, code="invalid")
    api.refused("POST", "/v1/launch", raw=b"[1, 2]", status=400)
    api.refused("POST", "/v1/launch", raw=b'{"pool": "p", "spec": {"command": ["x"]}, "count": NaN}', status=400)
    api.refused("POST", "/v1/terminate", {"ids": ["nope-1"]}, status=404, code="unknown_replica")
    api.refused("POST", "/v1/terminate", {"ids": "web-1"}, status=400)
    api.refused("POST", "/v1/scale", {"pool": "web", "n": -1}, status=400)
    api.refused("POST", "/v1/scale", {"pool": "web", "n": 1, "extra": 1}, status=400)
    api.refused("POST", "/v1/restart", {"ids": ["ghost-1"]}, status=404)
    api.refused("POST", "/v1/delete", {"pool": "ghost"}, status=404, code="unknown_pool")
    api.refused("POST", "/v1/signal", {"signal": "NOPE", "pool": "web"}, status=400)
    api.refused("POST", "/v1/wait", {"ids": ["ghost-1"]}, status=404)
    api.refused("GET", "/v1/status?all=maybe", status=400)
    api.refused("GET", "/v1/status?colour=1", status=400)
    api.refused("GET", "/v1/pools", raw=b"{}", status=400)
    api.refused("GET", "/v1/health?x=1", status=400)
    api.refused("GET", "/v1/metrics?x=1", status=400)
    api.refused("GET", "/v1/ping?x=1", status=400)
    api.refused("GET", "/v1/replicas?all=2", status=400)
    api.refused("GET", "/v1/nope", status=404, code="no_route")
    api.refused("DELETE", "/v1/status", status=405)
    api.refused("GET", "/v1/launch", status=405)


def test_events_and_logs(daemon: DaemonUnderTest, api: Api) -> None:
    api.ok("POST", "/v1/launch", {"pool": "echo", "spec": {"command": ["sh", "-c", "echo one; echo two; sleep 60"]},
                                  "wait": True, "timeout": 30})
    daemon.status()
    wait_for(lambda: api("GET", "/v1/logs/echo-1?lines=5")[0] == 200
             and api.ok("GET", "/v1/logs/echo-1?lines=5")["lines"] == ["one", "two"], 20, "the replica's output")
    assert api.ok("GET", "/v1/logs/echo-1?lines=1") == {"id": "echo-1", "stream": "out", "lines": ["two"]}
    assert api.ok("GET", "/v1/logs/echo-1?stream=err")["lines"] == []
    api.refused("GET", "/v1/logs/echo-1?stream=both", status=400)
    api.refused("GET", "/v1/logs/echo-1?lines=x", status=400)
    api.refused("GET", "/v1/logs/ghost-9", status=404)
    api.refused("GET", "/v1/logs/..%2Fstate.db", status=404)

    cli_events = [json.loads(line) for line in cli(daemon.state_dir, "events", "--json", check=True).stdout.splitlines()]
    events = api.ok("GET", "/v1/events")
    assert events[:len(cli_events)] == cli_events
    mine = api.ok("GET", "/v1/events?replica=echo-1")
    assert mine and all(e["replica"] == "echo-1" for e in mine)
    assert api.ok("GET", f"/v1/events?after={events[-2]['seq']}")[0] == events[-1]
    assert len(api.ok("GET", "/v1/events?limit=2")) == 2
    api.refused("GET", "/v1/events?after=x", status=400)
    api.refused("GET", "/v1/events?since=-1", status=400)
    api.refused("GET", "/v1/events?replica=no%20such", status=400)  # no replica id
    api.refused("GET", "/v1/events?replica=ghost-9", status=404, code="unknown_replica")  # as the CLI says it
    api.refused("GET", "/v1/events?follow=1", headers={"Last-Event-ID": "abc"}, status=400)

    # streams are bounded (the rest of the connections stay for commands)
    streams = [open_sse(str(daemon.state_dir / "http.sock")) for _ in range(httpapi.MAX_STREAMS)]
    try:
        api.refused("GET", "/v1/events?follow=1", status=429, code="too_many_streams")
        assert api.ok("GET", "/v1/ping") == "pong"
    finally:
        for s in streams:
            s.close()
    wait_for(lambda: _stream_opens(api), 10, "a stream to be admitted again")

    # a followed log gets the lines written after it attached
    conn = api.connection()
    conn.request("GET", "/v1/logs/echo-1?follow=1&lines=1")
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline() == b"two\n"
    with open(daemon.state_dir / "logs" / "echo-1.out", "ab") as f:  # as the capture appends
        f.write(b"three\n")
    api.ok("GET", "/v1/ping")  # a turn of the loop, which reads on
    assert resp.readline() == b"three\n"
    conn.close()


def test_tasks_routes(daemon: DaemonUnderTest, api: Api, tmp_path: Path, orch_test_tag: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "httptasks.py").write_text("import decimal\ndef add(a, b=0):\n    return a + b\n"
                                       "def money(text):\n    return decimal.Decimal(text)\n"
                                       "def nap(s):\n    import time; time.sleep(s)\n")
    with Client(daemon.state_dir) as client:
        ex: Executor = client.executor("jobs", max_workers=1, cwd=str(TESTS), env={TAG_VAR: cli_env()[TAG_VAR]})
    try:
        wait_for(lambda: any(r["pool"] == "jobs" and r["state"] == "RUNNING" for r in daemon.status()["replicas"]),
                 30, "the executor's worker")
        task = api.ok("POST", "/v1/submit", {"pool": "jobs", "target": "httptasks:add", "args": [2], "kwargs": {"b": 40},
                                             "cwd": str(work)})["id"]
        outcome = api.ok("GET", f"/v1/result?id={task}&wait=1&timeout=30")
        assert outcome == {"id": task, "state": "DONE", "kind": "result", "result": 42, "repr": None, "reason": None}
        assert json.loads(cli(daemon.state_dir, "result", task, "--json").stdout) == outcome
        money = api.ok("POST", "/v1/submit", {"pool": "jobs", "target": "httptasks:money", "args": ["1.5"],
                                              "cwd": str(work)})["id"]
        pickled = api.ok("GET", f"/v1/result?id={money}&wait=1&timeout=30")
        assert pickled["state"] == "DONE" and pickled["result"] is None and "pickled" in pickled["repr"]
        slow = api.ok("POST", "/v1/submit", {"pool": "jobs", "target": "httptasks:nap", "args": [30], "cwd": str(work)})["id"]
        listed = api.ok("GET", "/v1/tasks?pool=jobs")
        assert [t["id"] for t in listed] == [t["id"] for t in json.loads(cli(daemon.state_dir, "tasks", "--json",
                                                                               "--pool", "jobs").stdout)]
        assert slow in [t["id"] for t in listed]
        assert task in [t["id"] for t in api.ok("GET", "/v1/tasks?all=1")]
        assert api.ok("POST", "/v1/cancel", {"ids": [slow, task]}) == {"cancelled": [slow], "ended": [task]}

        api.refused("POST", "/v1/submit", {"pool": "ghost", "target": "m:f"}, status=404, code="unknown_pool")
        api.refused("POST", "/v1/submit", {"pool": "jobs", "args": "x"}, status=400)
        api.refused("POST", "/v1/cancel", {"ids": []}, status=400)
        api.refused("POST", "/v1/cancel", {"ids": ["jobs/99999"]}, status=404)
        api.refused("GET", "/v1/result", status=400)
        api.refused("GET", "/v1/result?id=jobs/99999", status=404)
        api.refused("GET", "/v1/result?id=" + task + "&timeout=inf", status=400)
        api.refused("GET", "/v1/tasks?pool=ghost", status=404)
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def test_a_waiting_command_does_not_hold_the_loop(daemon: DaemonUnderTest, api: Api) -> None:
    api.ok("POST", "/v1/launch", {"pool": "w", "spec": {"command": ["sleep", "60"]}, "wait": True, "timeout": 30})
    daemon.status()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(api, "POST", "/v1/wait", {"ids": ["w-1"], "until": "ended", "timeout": 60})
        time.sleep(0.2)  # let it be read (the answer is what is checked, not this pause)
        t0 = time.monotonic()
        assert api.ok("GET", "/v1/ping") == "pong"
        assert time.monotonic() - t0 < 2.0 and not waiting.done()
        api.ok("POST", "/v1/terminate", {"ids": ["w-1"]})
        status, _, value = waiting.result(timeout=30)
        assert status == 200, value


def _samples(text: str, name: str) -> dict[str, float]:
    """The samples of one metric in Prometheus text: labels -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name):].rpartition(" ")
            out[labels] = float(value)
    return out


def test_every_answer_is_counted_and_timed_by_route(api: Api) -> None:
    for _ in range(3):
        api.ok("GET", "/v1/ping")
    api.refused("GET", "/v1/logs/nobody-1", status=404)
    api.refused("GET", "/v1/nowhere", status=404, code="no_route")
    api.refused("POST", "/v1/scale", {"pool": "x"}, status=400)
    text = api.ok("GET", "/v1/metrics")
    counts = _samples(text, "orchestrator_api_requests_total")
    assert counts['{method="GET",route="/v1/ping",status="200"}'] == 3, counts
    assert counts['{method="GET",route="/v1/logs/{id}",status="404"}'] == 1  # the route, not the id
    assert counts['{method="other",route="other",status="404"}'] == 1
    assert counts['{method="POST",route="/v1/scale",status="400"}'] == 1
    # the metrics request itself is counted once its answer starts, after its render
    assert '{method="GET",route="/v1/metrics",status="200"}' not in counts
    timed = _samples(text, "orchestrator_api_request_duration_seconds_count")
    assert timed['{method="GET",route="/v1/ping"}'] == 3, timed
    buckets = _samples(text, "orchestrator_api_request_duration_seconds_bucket")
    assert buckets['{le="+Inf",method="GET",route="/v1/ping"}'] == 3, buckets


def test_the_document_lists_every_route(api: Api) -> None:
    doc = api.ok("GET", "/openapi.json")
    assert doc["openapi"].startswith("3.1")
    listed = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert listed == {(r.method, r.path) for r in httpapi.ROUTES}
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert "200" in op["responses"] and "400" in op["responses"]
            for p in op.get("parameters", []):
                assert p["in"] == "path" or p["name"] in {q.name for r in httpapi.ROUTES if r.path == path for q in r.query}
    json.dumps(doc, allow_nan=False)  # plain JSON


# -- the event stream ------------------------------------------------------------------


def test_event_stream_resumes_with_last_event_id_without_gap_or_duplicate(daemon: DaemonUnderTest, api: Api) -> None:
    path = str(daemon.state_dir / "http.sock")
    first = open_sse(path)
    api.ok("POST", "/v1/launch", {"pool": "b", "spec": {"command": ["sleep", "60"]}, "count": 3, "wait": True,
                                  "timeout": 30})
    top = api.ok("GET", "/v1/events")[-1]["seq"]
    got = sse_events(first, top)
    first.close()  # the client goes away; a burst happens meanwhile
    api.ok("POST", "/v1/scale", {"pool": "b", "n": 20})
    api.ok("POST", "/v1/wait", {"ids": [f"b-{n}" for n in range(1, 21)], "timeout": 60})
    daemon.status()
    top = api.ok("GET", "/v1/events")[-1]["seq"]
    again = open_sse(path, f"Last-Event-ID: {got[-1]}\r\n")
    rest = sse_events(again, top)
    # and what comes while attached
    api.ok("POST", "/v1/scale", {"pool": "b", "n": 5})
    top = api.ok("GET", "/v1/events")[-1]["seq"]
    rest += sse_events(again, top)
    again.close()
    seqs = got + rest  # (the scale down's replicas may still be ending: more than top is fine)
    assert seqs[-1] >= top and seqs == list(range(1, seqs[-1] + 1)), "a gap or a duplicate"


# -- TCP and tokens ---------------------------------------------------------------------


def _token_file(where: Path, token: str, mode: int = 0o600) -> Path:
    where.write_text(token + "\n")
    os.chmod(where, mode)
    return where


def test_tcp_needs_a_token_and_a_read_token_may_only_read(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    port = free_port_range(1)
    full = _token_file(tmp_path / "full.token", TOKEN)
    read = _token_file(tmp_path / "read.token", READ_TOKEN)
    daemon.start("--http", f"tcp://127.0.0.1:{port}", "--http", "unix:http.sock", "--http-token-file", str(full),
                 "--http-read-token-file", str(read))
    where = ("127.0.0.1", port)
    nobody, wrong = Api(tcp=where), Api(tcp=where, token="x" * 30)
    reader, writer = Api(tcp=where, token=READ_TOKEN), Api(tcp=where, token=TOKEN)
    status, headers, _ = nobody("GET", "/v1/status")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    nobody.refused("GET", "/v1/status", status=401, code="unauthorized")
    wrong.refused("GET", "/v1/status", status=401, code="unauthorized")
    nobody.refused("GET", "/v1/ping", headers={"Authorization": "Basic eDp5"}, status=401)
    assert reader.ok("GET", "/v1/status")["daemon"]["running"] is True
    assert reader.ok("GET", "/openapi.json")["openapi"].startswith("3.1")
    reader.refused("POST", "/v1/scale", {"pool": "x", "n": 1}, status=403, code="read_only")
    reader.refused("POST", "/v1/launch", {"pool": "x", "spec": {"command": ["true"]}}, status=403)
    assert writer.ok("POST", "/v1/launch", {"pool": "t", "spec": {"command": ["sleep", "60"]}, "wait": True,
                                            "timeout": 30}) == {"ids": ["t-1"], "failed": []}
    daemon.status()
    # the unix socket beside it needs no token: its peers' uid is checked instead
    assert Api(unix=str(daemon.state_dir / "http.sock")).ok("GET", "/v1/pools")[0]["name"] == "t"


@pytest.mark.parametrize("case", ["no token file", "group-writable", "readable by others", "not a file", "short"])
def test_start_refuses_a_tcp_listener_without_a_trusted_token(state_dir: Path, tmp_path: Path, case: str) -> None:
    port = free_port_range(1)
    args = ["start", "--http", f"tcp://127.0.0.1:{port}"]
    token = tmp_path / "t"
    if case == "group-writable":
        args += ["--http-token-file", str(_token_file(token, TOKEN, 0o620))]
    elif case == "readable by others":
        args += ["--http-token-file", str(_token_file(token, TOKEN, 0o604))]
    elif case == "not a file":
        args += ["--http-token-file", str(tmp_path)]
    elif case == "short":
        args += ["--http-token-file", str(_token_file(token, "abc"))]
    proc = cli(state_dir, *args)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert cli(state_dir, "status").returncode == 3  # nothing left running


def test_a_token_file_of_another_user_is_refused(state_dir: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    token = _token_file(tmp_path / "t", TOKEN)
    os.chown(token, 65534, 65534)
    proc = cli(state_dir, "start", "--http", f"tcp://127.0.0.1:{free_port_range(1)}", "--http-token-file", str(token))
    assert proc.returncode == 1 and "owned by" in proc.stderr, proc.stderr
    assert cli(state_dir, "status").returncode == 3


def test_config_file_http_keys(state_dir: Path, tmp_path: Path) -> None:
    from orchestrator.daemon import config

    cfg = config.parse('[daemon]\nhttp = ["unix:a.sock", "tcp://:8080"]\nhttp_token_file = "tok"\n',
                       str(tmp_path / "c.toml"))
    assert cfg.daemon.http == ("unix:a.sock", "tcp://:8080")
    assert cfg.daemon.http_token_file == str(tmp_path / "tok")
    with pytest.raises(config.ConfigError, match="daemon.http"):
        config.parse("[daemon]\nhttp = 3\n")
    assert httpapi.parse_address("tcp://:8080", "/s") == httpapi.Address("tcp", host="127.0.0.1", port=8080)
    assert httpapi.parse_address("tcp://[::1]:80", "/s").host == "::1"
    assert httpapi.parse_address("unix:x.sock", "/s").path == "/s/x.sock"
    for bad in ("tcp://h:99999", "http://x:1", "unix:", "tcp://a b:1"):
        with pytest.raises(httpapi.InvalidSpec):
            httpapi.parse_address(bad, "/s")


# -- hostile clients ------------------------------------------------------------------


def _raw(path: str, data: bytes, *, pieces: int = 1, pause: float = 0.0) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(15)
    with s:
        s.connect(path)
        step = max(1, len(data) // pieces)
        try:
            for i in range(0, len(data), step):
                s.sendall(data[i:i + step])
                if pause:
                    time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before the rest
        return read_to_close(s)


def test_hostile_clients_are_answered_or_dropped_and_never_delay_another(daemon: DaemonUnderTest, api: Api) -> None:
    path = str(daemon.state_dir / "http.sock")
    big = b"GET /v1/ping HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9216 + b"\r\n\r\n"
    assert _raw(path, big).startswith(b"HTTP/1.1 431")
    assert _raw(path, big, pieces=12, pause=0.02).startswith(b"HTTP/1.1 431")
    assert _raw(path, b"\x16\x03\x01garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
    longer = b'POST /v1/scale HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}{"pool": "x", "n": 1}'
    assert _raw(path, longer).startswith(b"HTTP/1.1 400")  # the body is the 2 bytes announced: {} lacks pool
    huge = b"POST /v1/launch HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{"
    assert _raw(path, huge).startswith(b"HTTP/1.1 413")

    # slowloris: clients that send a byte now and then hold a connection each, not the loop
    slow = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b"GET /v1/ping HTTP/1.1\r\n")
        slow.append(s)
    try:
        t0 = time.monotonic()
        assert api.ok("GET", "/v1/ping") == "pong"
        assert time.monotonic() - t0 < 1.0
    finally:
        for s in slow:
            s.close()
    assert api.ok("GET", "/v1/health")["healthy"] is True


# -- the server's own seams, on a loop in this thread -------------------------------


def test_a_unix_peer_of_another_uid_is_refused_before_it_is_read(reactor: Any, tmp_path: Path) -> None:
    seen: list[Request] = []

    def handle(request: Request, exchange: Exchange) -> None:
        seen.append(request)
        exchange.respond(200, "text/plain", b"hi\n")

    path = str(tmp_path / "s.sock")
    mine = HttpServer(reactor, unix_listener(path), handle, uids={os.geteuid()})
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(_raw(path, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")))
    t.start()
    assert reactor.run_until(lambda: bool(got), 10)
    t.join()
    assert got[0].startswith(b"HTTP/1.1 200") and seen[0].peer_uid == os.geteuid()
    mine.close()
    assert not os.path.exists(path)  # its socket file goes with it

    other = HttpServer(reactor, unix_listener(path), handle, uids={os.geteuid() + 1})
    got.clear()
    t = threading.Thread(target=lambda: got.append(_raw(path, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")))
    t.start()
    assert reactor.run_until(lambda: bool(got), 10)
    t.join()
    assert got[0].startswith(b"HTTP/1.1 403") and len(seen) == 1
    assert other.counts["forbidden"] == 1
    other.close()


def test_a_stream_whose_client_stops_reading_is_dropped(reactor: Any, tmp_path: Path) -> None:
    streams: list[Exchange] = []

    def handle(request: Request, exchange: Exchange) -> None:
        exchange.start(200, "text/plain")
        streams.append(exchange)

    path = str(tmp_path / "s.sock")
    server = HttpServer(reactor, unix_listener(path), handle, max_buffered=1 << 20)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(path)
    c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reactor.run_until(lambda: bool(streams), 10)
    closed: list[bool] = []
    streams[0].on_close = lambda: closed.append(True)
    t0 = time.monotonic()
    for _ in range(64):  # 4 MiB the client never reads: a send that blocked would never return
        streams[0].send(b"x" * 65536)
    assert time.monotonic() - t0 < 5  # copies, not waits (a loaded host stretches them)
    assert closed and streams[0].closed and server.counts["slow_reader"] == 1
    c.close()
    server.close()


def test_the_documents_copy_in_docs_is_current() -> None:
    """docs/openapi.json, linked from the README, is what /openapi.json serves (regenerate:
    .venv/bin/python -m orchestrator.daemon.httpapi > docs/openapi.json)."""
    assert json.loads((TESTS.parent / "docs" / "openapi.json").read_text()) == httpapi.openapi()
