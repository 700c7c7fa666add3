"""examples/apiserver.py, driven as its user drives it: a daemon, two uvicorn processes
serving the app on loopback, and plain HTTP. A request runs once per id whichever server
gets it, its log streams while it runs, a DELETE on the other server cancels it (the task
sees Cancelled and cleans up), and a request whose worker is killed -9 still completes."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import ROOT, DaemonUnderTest, cli_env, free_port_range, wait_for
from orchestrator import Client

pytest.importorskip("fastapi", reason="the example needs the examples extra: pip install -e '.[examples]'")
pytest.importorskip("uvicorn", reason="the example needs the examples extra: pip install -e '.[examples]'")

HTTP_TIMEOUT = 60.0  # each socket operation; a wait the server itself bounds (?wait=S) is shorter


class Server:
    """One uvicorn process serving examples.apiserver:app on 127.0.0.1:port."""

    def __init__(self, state_dir: Path) -> None:
        env = cli_env({"ORCHESTRATOR_STATE_DIR": str(state_dir), "REQUEST_WORKERS": "3"})
        self.port = free_port_range(1)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "examples.apiserver:app", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def up(self) -> bool:
        """Does it answer (its lifespan has joined the pool)? Raises if it exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"uvicorn exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
        try:
            return self.call("GET", "/openapi.json")[0] == 200
        except OSError:
            return False

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        conn = self.connect()
        try:
            data = json.dumps(body) if body is not None else None
            conn.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def ok(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        status, got = self.call(method, path, body)
        assert status in (200, 202), (status, got)
        return got

    def stop(self) -> None:
        """SIGTERM (uvicorn runs the app's shutdown), SIGKILL if it does not end; by its pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.fixture
def servers(daemon: DaemonUnderTest) -> Iterator[tuple[Server, Server]]:
    """A daemon and two server processes of the app in front of it (both join its pool)."""
    daemon.start()
    pair: list[Server] = []
    try:
        pair += [Server(daemon.state_dir), Server(daemon.state_dir)]
        for s in pair:
            wait_for(s.up, 60, f"uvicorn on port {s.port} to answer")
        yield pair[0], pair[1]
    finally:
        for s in pair:
            s.stop()
        daemon.snapshot()


class LogStream:
    """``GET /requests/{id}/log``, read line by line as the server sends it."""

    def __init__(self, server: Server, request_id: str) -> None:
        self.conn = server.connect()
        self.conn.request("GET", f"/requests/{request_id}/log")
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200

    def line(self) -> str:
        got = self.resp.readline()
        assert got, "the log stream ended"
        return got.decode().rstrip("\n")

    def rest(self) -> list[str]:
        """Every line to the stream's end (the task's end ends it)."""
        try:
            return self.resp.read().decode().splitlines()
        finally:
            self.conn.close()


def test_one_run_per_request_id_its_log_streams_and_another_server_cancels_it(
        servers: tuple[Server, Server]) -> None:
    one, two = servers
    short = one.ok("POST", "/requests", {"id": "short", "steps": 2, "interval": 0})
    long_ = one.ok("POST", "/requests", {"id": "long", "steps": 1000, "interval": 0.05})  # 50 s
    assert short["task"] != long_["task"]
    # The same id again, on the other server process, with another body: that task, no second run.
    again = two.ok("POST", "/requests", {"id": "short", "steps": 99, "interval": 0})
    assert again["task"] == short["task"]
    done = two.ok("GET", "/requests/short?wait=30")
    assert done["state"] == "DONE" and done["attempts"] == 1, done
    assert done["result"]["steps"] == 2  # the first body's
    log = LogStream(one, "short").rest()
    assert [x for x in log if "started" in x] == [f"short: started in pid {done['result']['pid']}"], log

    # Its lines arrive while it runs (it would run for 50 s).
    stream = LogStream(one, "long")
    assert stream.line().startswith("long: started in pid ")
    assert stream.line() == "long: step 1 of 1000"
    assert one.ok("GET", "/requests/long")["state"] == "RUNNING"

    # Cancelled by its id through the other server process: the task sees Cancelled.
    assert two.ok("DELETE", "/requests/long") == {"id": "long", "cancelled": True}
    got = one.ok("GET", "/requests/long?wait=30")
    assert got["state"] == "CANCELLED" and got["error"] == "cancelled", got
    rest = stream.rest()  # the stream ends, as the task has
    assert len(rest) < 1000, "the stream went on after the cancel"

    def cleaned_up() -> bool:
        return any("cleaning up" in x for x in LogStream(two, "long").rest())

    wait_for(cleaned_up, 30, "the cancelled task's cleanup line in its log")
    assert two.ok("DELETE", "/requests/long")["cancelled"] is True  # already cancelled: still so
    assert one.call("GET", "/requests/nosuch")[0] == 404
    assert one.call("DELETE", "/requests/nosuch")[0] == 404
    assert one.call("POST", "/requests", {"id": "a/b"})[0] == 422  # no task key has a "/"


def test_a_request_whose_worker_is_killed_runs_again_and_the_server_answers_on(
        servers: tuple[Server, Server], daemon: DaemonUnderTest) -> None:
    one, two = servers
    one.ok("POST", "/requests", {"id": "c", "steps": 30, "interval": 0.1})  # 3 s a run
    stream = LogStream(one, "c")
    first = stream.line()
    assert first.startswith("c: started in pid ")
    info = one.ok("GET", "/requests/c")
    assert info["state"] == "RUNNING" and info["worker"], info
    replicas = Client(daemon.state_dir).call("status", {})["replicas"]
    (pid,) = [r["pid"] for r in replicas if r["id"] == info["worker"]]
    assert first == f"c: started in pid {pid}"  # the worker the daemon names runs it
    os.kill(pid, signal.SIGKILL)

    got = two.ok("GET", "/requests/c?wait=60")
    assert got["state"] == "DONE", got
    assert got["attempts"] == 2, f"the kill did not land in its first run: {got}"
    assert got["result"]["pid"] != pid
    # One stream across both runs: it went on through the retry to the end.
    rest = stream.rest()
    assert f"c: started in pid {got['result']['pid']}" in rest, rest
    assert rest[-1] == "c: step 30 of 30", rest
    # Both servers answer on, and the pool runs new requests.
    one.ok("POST", "/requests", {"id": "d", "steps": 1, "interval": 0})
    assert two.ok("GET", "/requests/d?wait=30")["state"] == "DONE"
