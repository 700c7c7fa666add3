"""`upgrade` over HTTP (``POST /v1/upgrade``) and what its exec does to HTTP clients: the
listeners carry over (a client that connects during the exec is answered by the new image),
so do the connections whose command's answer is to come (the upgrade's own, an open
``wait``), and event streams end cleanly before the exec and resume with Last-Event-ID
without a gap or a duplicate."""

from __future__ import annotations

import concurrent.futures
import socket
import threading

import pytest

from helpers import DaemonUnderTest, cli
from test_http import Api, open_sse

pytestmark = [pytest.mark.timeout(120), pytest.mark.long]


def _stream_to_its_end(sock: socket.socket, timeout: float = 30.0) -> tuple[list[int], bool]:
    """The seqs of the events of an SSE stream read until the daemon closes it, and whether
    it ended cleanly (the chunked body's last, empty chunk before the close)."""
    sock.settimeout(timeout)
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    sock.close()
    seqs = [int(line[4:]) for line in raw.split(b"\n") if line.startswith(b"id: ")]
    return seqs, raw.endswith(b"0\r\n\r\n")


def _sse_until(sock: socket.socket, seq: int, timeout: float = 30.0) -> list[int]:
    """The seqs read from a stream until one is >= ``seq`` (then it is closed)."""
    sock.settimeout(timeout)
    raw, seqs = b"", []
    while not seqs or seqs[-1] < seq:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended at {seqs[-1:] or None} before {seq}"
        raw += chunk
        *blocks, rest = raw.split(b"\n\n")
        raw = rest
        seqs += [int(line[4:]) for block in blocks for line in block.split(b"\n") if line.startswith(b"id: ")]
    sock.close()
    return seqs


def test_upgrade_over_http_carries_listeners_and_waits_and_streams_resume(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    path = str(daemon.state_dir / "http.sock")
    api = Api(unix=path)
    api.ok("POST", "/v1/launch", {"pool": "u", "spec": {"command": ["sleep", "600"]}, "count": 2, "wait": True,
                                  "timeout": 30})
    stream = open_sse(path)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # an open wait, across the exec: answered by the new image once u-1 has ended
        waiting = pool.submit(api, "POST", "/v1/wait", {"ids": ["u-1"], "until": "ended", "timeout": 60}, timeout=60)
        # requests all along the exec: none refused, none lost
        stop = threading.Event()

        def pings() -> list[str]:
            failed = []
            while not stop.is_set():
                try:
                    status, _, value = api("GET", "/v1/ping", timeout=30)
                    if status != 200:
                        failed.append(f"{status} {value}")
                except OSError as err:
                    failed.append(f"{type(err).__name__}: {err}")
            return failed

        pinging = pool.submit(pings)
        try:
            done = api.ok("POST", "/v1/upgrade", {}, timeout=60)
        finally:
            stop.set()
        assert done["pid"] == pid and done["replicas"] == 2 and done["from"] and done["to"], done
        assert pinging.result(30) == []
        seqs, clean = _stream_to_its_end(stream)
        assert clean, "the event stream did not end with its last chunk before the exec"
        assert not waiting.done(), waiting.result()
        assert cli(daemon.state_dir, "terminate", "u-1").returncode == 0
        status, _, value = waiting.result(30)
        assert status == 200 and value == {"u-1": "TERMINATED"}, (status, value)
    events = api.ok("GET", "/v1/events")
    upgrade = [e["seq"] for e in events if e["kind"] == "upgrade"]
    assert upgrade, [e["kind"] for e in events[-10:]]
    # the stream resumed where it ended: every event once, the upgrade's among them
    resumed = _sse_until(open_sse(path, f"Last-Event-ID: {seqs[-1]}\r\n"), events[-1]["seq"])
    got = seqs + resumed
    assert got[: len(events)] == [e["seq"] for e in events], "a gap or a duplicate"
    assert daemon.status()["daemon"]["pid"] == pid


def test_an_upgrade_refused_is_a_409_with_its_reason(daemon: DaemonUnderTest) -> None:
    daemon.start()
    api = Api(unix=str(daemon.state_dir / "http.sock"))
    message = api.refused("POST", "/v1/upgrade", {"now": True}, status=400, code="invalid")
    assert "unknown field 'now'" in message
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(api, "POST", "/v1/upgrade", {}), pool.submit(api, "POST", "/v1/upgrade", {})
        replies = sorted([first.result(60), second.result(60)], key=lambda r: r[0])
    (ok, _, done), (busy, _, refused) = replies
    assert ok == 200 and done["to"], done
    assert busy == 409 and refused["error"]["message"] == "an upgrade is in progress already", refused


def test_a_request_half_read_at_the_exec_is_answered_by_the_new_image(daemon: DaemonUnderTest) -> None:
    """A client that connected a moment before the exec (its request accepted, read in part
    or not yet read) is carried with what was read of it: the new image reads on and answers.
    Closed with the exec instead, its unread request was lost and the client reset."""
    pid = daemon.start()
    path = str(daemon.state_dir / "http.sock")
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.settimeout(60)
    half.connect(path)
    half.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n")  # the head's last line still to come
    # the upgrade's request on the same listener, after it: the loop has accepted the first
    # (and read what it sent) by the time it reads this one
    done = Api(unix=path).ok("POST", "/v1/upgrade", {}, timeout=60)
    assert done["pid"] == pid and done["from"] and done["to"], done
    half.sendall(b"Connection: close\r\n\r\n")
    raw = b""
    while chunk := half.recv(65536):
        raw += chunk
    half.close()
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]
