"""Probes against real sockets and real processes, driven through a real Reactor.

Every wait is the reactor run until a condition (bounded); ports come from binding port 0;
every process a probe starts is tracked by identity and checked to be reaped.
"""

from __future__ import annotations

import http.server
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid

import psutil
import pytest

from helpers import Ident, cli, open_fds, wait_for
from orchestrator.daemon import probes
from orchestrator.errors import InvalidSpec
from orchestrator.daemon.notify import NotifySocket
from orchestrator.daemon.probebox import ProbeBox
from orchestrator.daemon.probes import Checker, retry_until_ready, run_once
from orchestrator.probespec import parse
from orchestrator.daemon.osapi import OSApi


# -- fixtures and helpers -----------------------------------------------------------------


@pytest.fixture
def os_api():
    return OSApi()


@pytest.fixture(autouse=True)
def no_probe_left():
    """After each test: no exec probe unreaped, and no child of this process left, zombie
    or not."""
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    yield
    extra = [p for p in me.children() if p.pid not in before]
    left = dict(probes.EXEC_PROBES)
    probes.EXEC_PROBES.clear()
    for pid in left:  # a failing test's leftovers: ended by pid, reaped
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    assert not left, f"exec probes not reaped: {sorted(left)}"
    assert not extra, f"children left behind: {extra}"


class Results:
    """An on_result that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, str | None]] = []

    def __call__(self, ok: bool, reason: str | None) -> None:
        self.calls.append((ok, reason))

    def __bool__(self) -> bool:
        return bool(self.calls)


def attempt(reactor, os_api, text: str, timeout: float = 2.0, env=None) -> tuple[bool, str | None]:
    got = Results()
    run_once(parse(text), reactor, os_api, timeout=timeout, on_result=got, env=env)
    assert reactor.run_until(lambda: bool(got), timeout + 5), f"no result for {text}"
    reactor.run_until(lambda: False, 0.05)  # nothing more comes
    assert len(got.calls) == 1, got.calls
    return got.calls[0]


@pytest.fixture
def listener():
    """A listening socket on a port-0 port of 127.0.0.1 that never accepts (the kernel
    completes connects into its backlog)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s
    s.close()


@pytest.fixture
def closed_port():
    """A port bound but not listening: connects are refused, and nobody else can take it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s
    s.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        code = int(self.path.rsplit("/", 1)[-1])
        self.send_response(code)
        if code in (301, 302):
            self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_port():
    """A real http.server in a thread of this process; GET /N answers status N."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(5)


def responder(reactor, payload: bytes):
    """A listener in the reactor that answers each connection with ``payload`` and closes."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    s.setblocking(False)

    def accept() -> None:
        conn, _ = s.accept()
        with conn:
            if payload:
                conn.sendall(payload)

    reactor.add_reader(s.fileno(), accept)
    return s


# -- parse and expand ---------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, fields", [
    ("tcp:127.0.0.1:8100", "tcp", {"host": "127.0.0.1", "ip": "127.0.0.1", "port": 8100}),
    ("tcp:localhost:1", "tcp", {"ip": "127.0.0.1", "port": 1}),
    ("tcp:[::1]:65535", "tcp", {"host": "::1", "ip": "::1", "port": 65535}),
    ("tcp:10.1.2.3:22", "tcp", {"ip": "10.1.2.3", "port": 22}),
    ("http://127.0.0.1:8100/health", "http", {"port": 8100, "path": "/health"}),
    ("http://127.9.9.9:8100/a?b=c", "http", {"ip": "127.9.9.9", "path": "/a?b=c"}),
    ("http://localhost:81", "http", {"ip": "127.0.0.1", "port": 81, "path": "/"}),
    ("http://[::1]:8100/x", "http", {"ip": "::1", "path": "/x"}),
    ("http://127.0.0.1/", "http", {"port": 80}),
    ("exec:check.sh --fast 'a b'", "exec", {"argv": ("check.sh", "--fast", "a b")}),
    ("notify", "notify", {}),
])
def test_parse_accepts(text, kind, fields):
    spec = parse(text)
    assert spec.kind == kind and spec.text == text and str(spec) == text
    for key, value in fields.items():
        assert getattr(spec, key) == value
    assert parse(spec.text) == spec
    assert not spec.templated
    assert spec.expand(3, 8103) is spec


@pytest.mark.parametrize("text, says", [
    ("", "empty probe"),
    ("bogus", "unknown probe"),
    ("udp:127.0.0.1:53", "unknown probe"),
    ("tcp:127.0.0.1", "HOST:PORT"),
    ("tcp:127.0.0.1:0", "1..65535"),
    ("tcp:127.0.0.1:65536", "1..65535"),
    ("tcp:127.0.0.1:http", "not a number"),
    ("tcp:example.com:80", "no DNS"),
    ("http://10.0.0.1:80/", "loopback only"),
    ("http://192.168.1.1/", "loopback only"),
    ("http://example.com:8100/", "loopback only"),
    ("http://[2001:db8::1]:80/", "loopback only"),
    ("http://127.0.0.1@evil.example/", "loopback only"),
    ("http://::1:80/", "brackets"),
    ("http://127.0.0.1:99999/", "1..65535"),
    ("http://127.0.0.1:80/a b", "spaces"),
    ("https://127.0.0.1/", "plain http"),
    ("exec:", "no command"),
    ("exec:'unterminated", "No closing quotation"),
    ("tcp:127.0.0.1:80\nx", "control characters"),
    ("notify:x", "unknown probe"),
])
def test_parse_refuses_with_one_line(text, says):
    with pytest.raises(InvalidSpec) as err:
        parse(text)
    assert says in str(err.value)
    assert "\n" not in str(err.value)


def test_port_placeholder_needs_a_port_base():
    for text in ("tcp:127.0.0.1:{port}", "http://127.0.0.1:{port}/", "exec:check {port}"):
        with pytest.raises(InvalidSpec, match="port"):
            parse(text, has_port=False)
        assert parse(text, has_port=True).templated
    assert parse("exec:check {slot}", has_port=False).templated  # {slot} needs no port base
    with pytest.raises(InvalidSpec, match="port base"):
        parse("tcp:127.0.0.1:{port}").expand(0, None)


def test_expand_substitutes_then_validates():
    spec = parse("http://127.0.0.1:{port}/replica/{slot}")
    assert spec.port is None and spec.templated
    done = spec.expand(2, 8102)
    assert done == parse("http://127.0.0.1:8102/replica/2")
    assert done.port == 8102 and done.path == "/replica/2" and not done.templated
    assert parse("exec:check --slot={slot} {port}").expand(1, 9001).argv == ("check", "--slot=1", "9001")
    assert parse("tcp:127.0.0.1:81{slot}").expand(5, None).port == 815
    with pytest.raises(InvalidSpec, match="1..65535"):
        parse("tcp:127.0.0.1:{port}").expand(0, 70000)
    with pytest.raises(InvalidSpec, match="1..65535"):
        parse("tcp:127.0.0.1:6553{slot}").expand(6, None)
    # what is literal is checked at once, placeholders or not
    with pytest.raises(InvalidSpec, match="loopback only"):
        parse("http://example.com:{port}/")
    with pytest.raises(InvalidSpec, match="not a number"):
        parse("tcp:127.0.0.1:x{port}")


def test_templates_and_notify_are_not_run(reactor, os_api):
    for text in ("tcp:127.0.0.1:{port}", "notify"):
        with pytest.raises(InvalidSpec):
            run_once(parse(text), reactor, os_api, timeout=1, on_result=Results())


# -- tcp ----------------------------------------------------------------------------------


def test_tcp_success_against_a_listener(reactor, os_api, listener):
    port = listener.getsockname()[1]
    assert attempt(reactor, os_api, f"tcp:127.0.0.1:{port}") == (True, None)
    assert attempt(reactor, os_api, f"tcp:localhost:{port}") == (True, None)


def test_tcp_refused_on_a_closed_port(reactor, os_api, closed_port):
    port = closed_port.getsockname()[1]
    assert attempt(reactor, os_api, f"tcp:127.0.0.1:{port}") == (
        False, f"tcp 127.0.0.1:{port}: connection refused")


def test_tcp_ipv6_loopback(reactor, os_api):
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    with s:
        port = s.getsockname()[1]
        assert attempt(reactor, os_api, f"tcp:[::1]:{port}") == (False, f"tcp [::1]:{port}: connection refused")
        s.listen()
        assert attempt(reactor, os_api, f"tcp:[::1]:{port}") == (True, None)


def test_the_result_never_comes_from_inside_run_once(reactor, os_api, closed_port):
    got = Results()
    run_once(parse(f"tcp:127.0.0.1:{closed_port.getsockname()[1]}"), reactor, os_api, timeout=1, on_result=got)
    assert not got  # refused at once, yet reported from the loop
    assert reactor.run_until(lambda: bool(got), 5)


# -- http ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code, ok", [(200, True), (204, True), (302, True), (404, False), (503, False)])
def test_http_status(reactor, os_api, http_port, code, ok):
    url = f"http://127.0.0.1:{http_port}/status/{code}"
    assert attempt(reactor, os_api, url) == (ok, None if ok else f"{url}: status {code}")


def test_http_stalled_server_times_out_without_blocking_the_loop(reactor, os_api, listener):
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/health"
    got = Results()
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(reactor.monotonic())
        reactor.call_later(0.05, tick)

    reactor.call_later(0.05, tick)
    start = reactor.monotonic()
    run_once(parse(url), reactor, os_api, timeout=0.6, on_result=got)
    assert reactor.run_until(lambda: bool(got), 5)
    end = reactor.monotonic()
    assert got.calls == [(False, f"{url}: timed out after 0.6 s")]
    assert 0.55 <= end - start < 3
    during = [t for t in ticks if t < end]
    assert len(during) >= 3, f"the loop stalled during the probe: {len(during)} ticks"


@pytest.mark.parametrize("payload, says", [
    (b"", "connection closed before a status line"),
    (b"SSH-2.0-OpenSSH\r\n", "bad status line"),
    (b"HTTP/1.1 500 Oops\r\n\r\n", "status 500"),
    (b"HTTP/1.0 200 OK\r\n", None),
])
def test_http_odd_answers(reactor, os_api, payload, says):
    with responder(reactor, payload) as s:
        url = f"http://127.0.0.1:{s.getsockname()[1]}/"
        ok, reason = attempt(reactor, os_api, url)
        reactor.remove_reader(s.fileno())
    assert ok is (says is None)
    if says:
        assert reason.startswith(f"{url}: ") and says in reason


@pytest.mark.parametrize("payload, says", [
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", None),  # a 1xx is passed over
    (b"HTTP/1.1 103 Early Hints\r\n\r\n", "connection closed before"),  # and is no answer itself
    (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"x" * 20000 + b"\r\n\r\n", "no complete response head in the first"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad response"),
])
def test_http_answers_as_h11_reads_them(reactor, os_api, payload, says):
    with responder(reactor, payload) as s:
        url = f"http://127.0.0.1:{s.getsockname()[1]}/"
        ok, reason = attempt(reactor, os_api, url)
        reactor.remove_reader(s.fileno())
    assert ok is (says is None), reason
    if says:
        assert reason.startswith(f"{url}: ") and says in reason


def test_http_request_is_http_1_1_with_host_and_close(reactor, os_api):
    """What the server sees: one HTTP/1.1 GET of the path, Host, our User-Agent, and
    Connection: close (the answer's end is the connection's)."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            seen.append(data)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        port = server.getsockname()[1]
        assert attempt(reactor, os_api, f"http://127.0.0.1:{port}/health?x=1") == (True, None)
    finally:
        thread.join(5)
        server.close()
    head = seen[0].decode("ascii").split("\r\n")
    assert head[0] == "GET /health?x=1 HTTP/1.1"
    assert {"host: 127.0.0.1:%d" % port, "user-agent: orchestrator-probe", "connection: close"} <= {
        h.lower() for h in head[1:] if h}


def test_http_refused(reactor, os_api, closed_port):
    url = f"http://127.0.0.1:{closed_port.getsockname()[1]}/"
    assert attempt(reactor, os_api, url) == (False, f"{url}: connection refused")


# -- exec ---------------------------------------------------------------------------------


def _gone(ident: Ident, pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not ident.alive()
    return False


def test_exec_true_false_and_missing(reactor, os_api):
    assert attempt(reactor, os_api, "exec:true") == (True, None)
    assert attempt(reactor, os_api, "exec:false") == (False, "exec 'false': exit code 1")
    assert attempt(reactor, os_api, "exec:sh -c 'exit 2'") == (False, "exec 'sh -c 'exit 2'': exit code 2")
    ok, reason = attempt(reactor, os_api, "exec:/nonexistent/check.sh")
    assert not ok and reason == "exec '/nonexistent/check.sh': could not start: no such file or directory"
    assert not probes.EXEC_PROBES


def test_exec_env_and_expansion(reactor, os_api):
    env = {**os.environ, "PROBE_X": "yes"}
    assert attempt(reactor, os_api, "exec:sh -c 'test \"$PROBE_X\" = yes'", env=env) == (True, None)
    assert attempt(reactor, os_api, "exec:sh -c 'test \"$PROBE_X\" = yes'")[0] is False
    got = Results()
    run_once(parse("exec:test {slot} = 3").expand(3, None), reactor, os_api, timeout=5, on_result=got)
    assert reactor.run_until(lambda: bool(got), 10) and got.calls == [(True, None)]


def test_exec_timeout_kills_the_group_and_reaps(reactor, os_api, procs, tmp_path):
    pidfile = tmp_path / "bg.pid"
    text = f"exec:sh -c 'sleep 30 & echo $! > {shlex.quote(str(pidfile))}; wait'"
    got = Results()
    h = run_once(parse(text), reactor, os_api, timeout=1.0, on_result=got)
    assert h.pid is not None and probes.EXEC_PROBES[h.pid] is h
    leader = procs.track(h.pid)
    assert reactor.run_until(lambda: pidfile.exists() and pidfile.read_text().strip() != "", 5)
    background = procs.track(int(pidfile.read_text()))
    assert background is not None and background.alive()
    assert reactor.run_until(lambda: bool(got), 5)
    assert got.calls == [(False, f"exec '{text[5:]}': timed out after 1 s")]
    assert reactor.run_until(lambda: not h.active, 5)
    assert h.pid not in probes.EXEC_PROBES
    assert _gone(leader, h.pid), "the probe process is still there (or a zombie)"
    assert reactor.run_until(lambda: not background.alive(), 5), "the probe's group was not killed"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGPIPE])
def test_exec_gets_default_signals_and_an_empty_mask(reactor, os_api, sig):
    """Blocked here, or ignored (Python ignores SIGPIPE): the probe must not inherit that."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    try:
        got = Results()
        run_once(parse(f"exec:sh -c 'kill -{sig.name[3:]} $$; exit 0'"), reactor, os_api, timeout=5, on_result=got)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    assert reactor.run_until(lambda: bool(got), 10)
    assert got.calls[0][0] is False and got.calls[0][1].endswith(f"killed by {sig.name}")


def test_exec_stdin_stdout_are_devnull(reactor, os_api):
    assert attempt(reactor, os_api, "exec:sh -c 'test \"$(readlink /proc/self/fd/0)\" = /dev/null'") == (True, None)
    assert attempt(reactor, os_api, "exec:sh -c 'test \"$(readlink /proc/$$/fd/1)\" = /dev/null'") == (True, None)


def test_exited_hands_a_probe_back_to_its_owner(reactor, os_api, procs):
    """What the daemon's SIGCHLD orphan reaper does: a pid found by waitid(WNOWAIT) that is
    in EXEC_PROBES goes to its handle, which reaps and reports once."""
    got = Results()
    h = run_once(parse("exec:true"), reactor, os_api, timeout=5, on_result=got)
    procs.track(h.pid)
    wait_for(lambda: os.waitid(os.P_PID, h.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, 5, "exit")
    assert os_api.exited_child() == h.pid  # the reaper's view: exited, not reaped
    probes.EXEC_PROBES[h.pid].exited()
    assert got.calls == [(True, None)] and not h.active
    h.exited()  # idempotent
    reactor.run_until(lambda: False, 0.1)  # its pidfd is out of the loop: no second report
    assert got.calls == [(True, None)]
    with pytest.raises(ChildProcessError):
        os.waitpid(h.pid, os.WNOHANG)


# -- cancel -------------------------------------------------------------------------------


def test_cancel_tcp_releases_fds_and_reports_nothing(reactor, os_api, listener):
    before = open_fds()
    got = Results()
    h = run_once(parse(f"tcp:127.0.0.1:{listener.getsockname()[1]}"), reactor, os_api, timeout=1, on_result=got)
    assert open_fds() != before
    h.cancel()
    h.cancel()
    assert open_fds() == before and not h.active
    reactor.run_until(lambda: False, 0.2)
    assert not got


def test_cancel_stalled_http_releases_fds(reactor, os_api, listener):
    before = open_fds()
    got = Results()
    h = run_once(parse(f"http://127.0.0.1:{listener.getsockname()[1]}/"), reactor, os_api, timeout=5, on_result=got)
    reactor.run_until(lambda: False, 0.2)  # connected, request sent, no answer
    assert not got and h.active
    h.cancel()
    assert open_fds() == before
    reactor.run_until(lambda: False, 0.2)
    assert not got


def test_cancel_exec_kills_reaps_and_releases_fds(reactor, os_api, procs):
    before = open_fds()
    got = Results()
    h = run_once(parse("exec:sleep 30"), reactor, os_api, timeout=30, on_result=got)
    ident = procs.track(h.pid)
    assert ident is not None and ident.alive()
    h.cancel()
    assert reactor.run_until(lambda: not h.active, 5)
    assert open_fds() == before
    assert _gone(ident, h.pid)
    reactor.run_until(lambda: False, 0.1)
    assert not got


def test_cancel_after_the_result_is_harmless(reactor, os_api, listener):
    before = open_fds()
    got = Results()
    h = run_once(parse(f"tcp:127.0.0.1:{listener.getsockname()[1]}"), reactor, os_api, timeout=1, on_result=got)
    assert reactor.run_until(lambda: bool(got), 5)
    h.cancel()
    assert open_fds() == before and got.calls == [(True, None)]


# -- notify -------------------------------------------------------------------------------


_SD_NOTIFY = """
import os, socket
addr = os.environ["NOTIFY_SOCKET"]
addr = "\\0" + addr[1:] if addr.startswith("@") else addr
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"READY=1\\nSTATUS=warm", addr)
"""


def _name() -> str:
    return f"orch-test-{uuid.uuid4().hex}"


def _run(argv: list[str], env: dict[str, str], reactor, done) -> subprocess.Popen:
    """Start ``argv``, run the reactor until ``done()`` and the process has ended (reaped)."""
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    try:
        assert reactor.run_until(lambda: done() and proc.poll() is not None, 15)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    return proc


def test_notify_ready_from_a_child_process(reactor):
    got: list[tuple[str, dict[str, str]]] = []
    name = _name()
    before = open_fds()
    ns = NotifySocket(reactor, lambda n, f: got.append((n, f)), name)
    assert ns.env() == {"NOTIFY_SOCKET": "@" + name}
    proc = _run([sys.executable, "-c", _SD_NOTIFY], {**os.environ, **ns.env()}, reactor, lambda: bool(got))
    assert proc.returncode == 0
    assert got == [(name, {"READY": "1", "STATUS": "warm"})]
    ns.close()
    ns.close()
    assert open_fds() == before and ns.closed


@pytest.mark.skipif(shutil.which("systemd-notify") is None, reason="no systemd-notify here")
def test_notify_ready_from_systemd_notify(reactor):
    got: list[dict[str, str]] = []
    ns = NotifySocket(reactor, lambda n, f: got.append(f), _name())
    before = open_fds()
    try:
        proc = _run(["systemd-notify", "--ready"], {**os.environ, **ns.env()}, reactor,
                    lambda: any(f.get("READY") == "1" for f in got))
    finally:
        after = open_fds()
        ns.close()
    # systemd-notify waits on a barrier: an fd it passes, which the receiver must close
    assert proc.returncode == 0
    assert after == before, "an fd passed along with a notification was kept"


def test_notify_ignores_garbage(reactor):
    got: list[dict[str, str]] = []
    ns = NotifySocket(reactor, lambda n, f: got.append(f), _name())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for junk in (b"\xff\xfe\xfd", b"no equals sign", b"=novalue", b"READY=1" + b"x" * 5000):
            s.sendto(junk, "\0" + ns.name)
        s.sendto(b"READY=1\n\ngarbage line\nX_Y=a=b", "\0" + ns.name)
    assert reactor.run_until(lambda: bool(got), 5)
    reactor.run_until(lambda: False, 0.05)
    assert got == [{"READY": "1", "X_Y": "a=b"}]
    assert ns.dropped == 4
    ns.close()


def test_notify_name_in_use_and_bad_names(reactor):
    ns = NotifySocket(reactor, lambda n, f: None, _name())
    try:
        with pytest.raises(OSError):
            NotifySocket(reactor, lambda n, f: None, ns.name)
    finally:
        ns.close()
    for bad in ("", "a\0b", "x" * 200):
        with pytest.raises(InvalidSpec):
            NotifySocket(reactor, lambda n, f: None, bad)


def test_notify_callback_may_close_the_socket(reactor):
    got: list[dict[str, str]] = []

    def on_message(name: str, fields: dict[str, str]) -> None:
        got.append(fields)
        ns.close()

    ns = NotifySocket(reactor, on_message, _name())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"READY=1", "\0" + ns.name)
        s.sendto(b"STATUS=later", "\0" + ns.name)
    assert reactor.run_until(lambda: bool(got), 5)
    reactor.run_until(lambda: False, 0.05)
    assert got == [{"READY": "1"}] and ns.closed


# -- Checker ------------------------------------------------------------------------------


def test_checker_fails_after_n_misses_and_not_before(reactor, os_api, closed_port):
    fails: list[str] = []
    port = closed_port.getsockname()[1]
    c = Checker(parse(f"tcp:127.0.0.1:{port}"), reactor, os_api, interval=0.05, failures=3,
                timeout=1, on_fail=fails.append)
    assert reactor.run_until(lambda: c.misses == 2, 5)
    assert not fails
    assert reactor.run_until(lambda: bool(fails), 5)
    assert fails == [f"tcp 127.0.0.1:{port}: connection refused"] and c.misses == 3 and c.attempts == 3
    reactor.run_until(lambda: False, 0.3)  # stopped after the failure: no more attempts
    assert len(fails) == 1 and c.attempts == 3 and c.stopped


def test_checker_resets_on_success(reactor, os_api, tmp_path):
    """Attempts fail, fail, succeed, fail, fail, fail (the probe counts its runs in a file;
    attempts never overlap): with failures=3 on_fail comes at the 6th, not the 4th."""
    counter = shlex.quote(str(tmp_path / "runs"))
    script = f"n=$(cat {counter} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {counter}; test $n -eq 3"
    at_fail: list[int] = []
    fails: list[str] = []

    def on_fail(reason: str) -> None:
        at_fail.append(c.attempts)
        fails.append(reason)

    c = Checker(parse(f"exec:sh -c {shlex.quote(script)}"), reactor, os_api, interval=0.05,
                failures=3, timeout=5, on_fail=on_fail)
    assert reactor.run_until(lambda: bool(fails), 20)
    reactor.run_until(lambda: False, 0.2)
    assert at_fail == [6] and c.attempts == 6 and c.misses == 3
    assert len(fails) == 1 and fails[0].endswith("exit code 1")
    assert (tmp_path / "runs").read_text().strip() == "6"


def test_checker_stop_cancels_the_attempt_in_flight(reactor, os_api):
    fails: list[str] = []
    c = Checker(parse("exec:sleep 30"), reactor, os_api, interval=0.01, failures=1, timeout=30,
                on_fail=fails.append)
    assert reactor.run_until(lambda: bool(probes.EXEC_PROBES), 5)
    (pid,) = probes.EXEC_PROBES
    ident = Ident.of(pid)
    c.stop()
    c.stop()
    assert reactor.run_until(lambda: not probes.EXEC_PROBES, 5)
    assert ident is None or _gone(ident, pid)
    reactor.run_until(lambda: False, 0.1)
    assert not fails and c.attempts == 0


# -- retry_until_ready --------------------------------------------------------------------


def test_ready_once_the_server_listens_midway(reactor, os_api, closed_port):
    ready: list[bool] = []
    timeouts: list[str] = []
    h = retry_until_ready(parse(f"tcp:127.0.0.1:{closed_port.getsockname()[1]}"), reactor, os_api,
                          period=0.05, attempt_timeout=1, deadline_s=10,
                          on_ready=lambda: ready.append(True), on_timeout=timeouts.append)
    assert not ready  # never from inside the call
    assert reactor.run_until(lambda: h.attempts >= 3, 5)
    assert not ready
    closed_port.listen()
    assert reactor.run_until(lambda: bool(ready), 5)
    reactor.run_until(lambda: False, 0.2)
    assert ready == [True] and not timeouts and not h.active


def test_ready_times_out_with_the_last_reason(reactor, os_api, closed_port):
    ready: list[bool] = []
    timeouts: list[str] = []
    port = closed_port.getsockname()[1]
    start = reactor.monotonic()
    retry_until_ready(parse(f"tcp:127.0.0.1:{port}"), reactor, os_api, period=0.05, deadline_s=0.5,
                      on_ready=lambda: ready.append(True), on_timeout=timeouts.append)
    assert reactor.run_until(lambda: bool(timeouts), 5)
    assert reactor.monotonic() - start >= 0.5
    reactor.run_until(lambda: False, 0.2)
    assert timeouts == [f"not ready within 0.5 s (last: tcp 127.0.0.1:{port}: connection refused)"]
    assert not ready


def test_ready_deadline_cuts_a_stalled_attempt(reactor, os_api, listener):
    timeouts: list[str] = []
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    before = open_fds()
    retry_until_ready(parse(url), reactor, os_api, attempt_timeout=5, deadline_s=0.3,
                      on_ready=lambda: None, on_timeout=timeouts.append)
    assert reactor.run_until(lambda: bool(timeouts), 3)
    assert timeouts == [f"not ready within 0.3 s (last: {url}: no answer yet)"]
    assert open_fds() == before


def test_ready_cancel(reactor, os_api, closed_port):
    calls: list[object] = []
    before = open_fds()
    h = retry_until_ready(parse("exec:sleep 30"), reactor, os_api, deadline_s=0.5,
                          on_ready=lambda: calls.append("ready"), on_timeout=calls.append)
    pid = h.pid
    assert pid in probes.EXEC_PROBES
    ident = Ident.of(pid)
    h.cancel()
    assert reactor.run_until(lambda: not probes.EXEC_PROBES, 5)
    reactor.run_until(lambda: False, 0.7)  # past the deadline: still nothing
    assert not calls and open_fds() == before
    assert ident is None or _gone(ident, pid)



def test_ready_wait_carried_keeps_its_deadline_and_schedule(reactor, os_api, closed_port):
    """An upgrade's hand-over of a wait (``carried()``) and the next image's wait made from
    it: the same deadline, the next attempt when it was due, the attempts and the last
    reason kept; the message still names the pool's ready_timeout."""
    port = closed_port.getsockname()[1]
    spec = parse(f"tcp:127.0.0.1:{port}")
    first = retry_until_ready(spec, reactor, os_api, period=0.3, deadline_s=3,
                              on_ready=lambda: None, on_timeout=lambda why: None)
    # Three attempts: at least 0.6 s into the wait, which a restarted deadline would add.
    assert reactor.run_until(lambda: first.attempts >= 3 and first.carried()["next"] is not None, 5)
    carried = first.carried()
    first.cancel()
    assert carried["deadline"] > reactor.monotonic() and carried["attempts"] >= 3
    assert carried["last"] == f"tcp 127.0.0.1:{port}: connection refused"
    assert carried["next"] > reactor.monotonic() - 0.3
    timeouts: list[str] = []
    again = retry_until_ready(spec, reactor, os_api, period=0.3, deadline_s=3, on_ready=lambda: None,
                              on_timeout=timeouts.append, carried=carried)
    assert reactor.run_until(lambda: bool(timeouts), 6)
    late = reactor.monotonic() - carried["deadline"]
    assert 0 <= late < 0.5, f"expired {late:.2f} s after the carried deadline"
    assert again.attempts > carried["attempts"]  # it went on trying meanwhile
    assert timeouts == [f"not ready within 3 s (last: tcp 127.0.0.1:{port}: connection refused)"]


def test_ready_wait_carried_past_its_deadline_only_expires(reactor, os_api, closed_port):
    spec = parse(f"tcp:127.0.0.1:{closed_port.getsockname()[1]}")
    closed_port.listen()  # an attempt would succeed now: none may be made
    ready: list[bool] = []
    timeouts: list[str] = []
    h = retry_until_ready(spec, reactor, os_api, deadline_s=5, on_ready=lambda: ready.append(True),
                          on_timeout=timeouts.append,
                          carried={"deadline": reactor.monotonic() - 0.1, "next": None, "attempts": 3, "last": None})
    assert reactor.run_until(lambda: bool(timeouts), 5)
    assert not ready and h.attempts == 3
    assert timeouts[0].startswith("not ready within 5 s")


def test_notify_socket_detached_and_taken_over(reactor):
    """An upgrade's notify socket: detached (its fd inheritable, still bound), a datagram
    sent meanwhile waits in it, and the socket made from that fd reads it."""
    got: list[dict[str, str]] = []
    closed: list[str] = []
    before = open_fds()
    ns = NotifySocket(reactor, lambda n, f: got.append(f), _name(), on_close=lambda: closed.append("first"))
    fd = ns.detach()
    assert ns.closed and closed == ["first"] and os.get_inheritable(fd)
    ns.close()  # closing the old one no longer closes the socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"READY=1", "\0" + ns.name)  # the name is still bound
    again = NotifySocket(reactor, lambda n, f: got.append(f), ns.name, fd=fd, on_close=lambda: closed.append("again"))
    assert not os.get_inheritable(fd)
    assert reactor.run_until(lambda: bool(got), 5)
    assert got == [{"READY": "1"}]
    again.close()
    assert closed == ["first", "again"] and open_fds() == before


# -- through the daemon: who may notify, how long an attempt may take ---------------------

_SEND_READY_FOR = """
import os, socket, sys
own = os.environ["NOTIFY_SOCKET"]
me = os.environ["ORCHESTRATOR_REPLICA_ID"]
target = own[:-len(me)] + sys.argv[1]  # the other replica's socket: the same name but its id
addr = "\\0" + target[1:]
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"READY=1", addr)
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"READY=1", "\\0" + own[1:])
"""


def _replica(d, rid: str) -> dict:
    (row,) = [r for r in d.status(all=True)["replicas"] if r["id"] == rid]
    return row


def _daemon_log(d) -> str:
    return (d.state_dir / "logs" / "daemon.log").read_text(errors="replace")


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_another_replica_cannot_mark_a_replica_ready(daemon, cgroup):
    from helpers import cli

    daemon.start("--cgroup", cgroup)
    cli(daemon.state_dir, "launch", "--pool", "victim", "--ready", "notify", "--ready-timeout", "60",
        "--", "sleep", "1000", check=True)
    assert _replica(daemon, "victim-1")["state"] == "STARTING"
    cli(daemon.state_dir, "launch", "--pool", "other", "--ready", "notify", "--wait", "--timeout", "30",
        "--", sys.executable, "-c", _SEND_READY_FOR + "\nimport time; time.sleep(1000)", "victim-1", check=True)
    # The forged datagram was read (its drop is logged) and other-1 is RUNNING on its own:
    wait_for(lambda: "dropped READY from pid" in _daemon_log(daemon), 10, "the forged READY=1 to be dropped")
    assert _replica(daemon, "other-1")["state"] == "RUNNING"
    assert _replica(daemon, "victim-1")["state"] == "STARTING"


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_a_child_of_the_replica_may_notify_for_it(daemon, cgroup):
    from helpers import cli

    daemon.start("--cgroup", cgroup)
    # The child lives on after its READY=1, as a wrapped service does: a sender that is gone
    # by the time the daemon reads its datagram cannot be told from a forgery (notify.py).
    child = shlex.quote(_SD_NOTIFY + "import time\ntime.sleep(1000)\n")
    proc = cli(daemon.state_dir, "launch", "--pool", "wrapped", "--ready", "notify", "--wait", "--timeout", "30",
               "--", "sh", "-c", f"{shlex.quote(sys.executable)} -c {child} & exec sleep 1000")
    assert proc.returncode == 0, proc.stderr
    assert _replica(daemon, "wrapped-1")["state"] == "RUNNING"
    assert "dropped" not in _daemon_log(daemon)


_SLOW_PROBE = "exec:sh -c 'sleep 1.5'"


def test_the_probe_timeout_is_a_setting(daemon, tmp_path):
    from helpers import cli

    daemon.start()
    # By default an attempt is cut at 1 s: a probe that takes 1.5 s never passes.
    proc = cli(daemon.state_dir, "launch", "--pool", "short", "--ready", _SLOW_PROBE, "--ready-timeout", "4",
               "--restart", "never", "--wait", "--timeout", "30", "--", "sleep", "1000")
    assert proc.returncode == 1
    reason = _replica(daemon, "short-1")["reason"]
    assert "timed out after 1 s" in reason, reason
    passed = tmp_path / "passed"
    live = f"exec:sh -c 'sleep 1.5 && echo ok >> {passed}'"
    proc = cli(daemon.state_dir, "launch", "--pool", "long", "--ready", _SLOW_PROBE, "--probe-timeout", "3",
               "--live", live, "--live-interval", "0.5", "--live-failures", "1",
               "--wait", "--timeout", "30", "--", "sleep", "1000")
    assert proc.returncode == 0, proc.stderr
    # ...and the liveness attempts get the same bound: two of them pass in a row.
    wait_for(lambda: passed.exists() and len(passed.read_text().split()) >= 2, 30, "two liveness attempts")
    row = _replica(daemon, "long-1")
    assert row["state"] == "RUNNING" and row["restarts"] == 0, row
    pool = [p for p in daemon.status()["pools"] if p["name"] == "long"][0]
    assert pool["policy"]["probe_timeout"] == 3


def test_probe_timeout_is_refused_when_not_positive(daemon):
    from helpers import cli

    daemon.start()
    proc = cli(daemon.state_dir, "launch", "--pool", "x", "--ready", "tcp:127.0.0.1:1", "--probe-timeout", "0",
               "--", "sleep", "1")
    assert proc.returncode != 0 and "probe_timeout" in proc.stderr and "Traceback" not in proc.stderr


# -- exec probes run inside something killed whole; their output is the replica's ----------


def _containment(d) -> str:
    return d.status()["daemon"]["containment"]


def _start_in(d, cgroup: str) -> None:
    d.start("--cgroup", cgroup)
    if cgroup == "auto" and _containment(d) != "cgroup":
        pytest.skip("no writable cgroup v2 here: " + d.status()["daemon"]["containment_reason"])


def _children_of_probes(pids_file) -> list[Ident]:
    """The background children the probes reported (pid per line), still alive or not."""
    if not pids_file.exists():
        return []
    return [i for i in (Ident.of(int(p)) for p in pids_file.read_text().split()) if i is not None]


# In cgroup mode even a child that left the probe's session (setsid) goes; in process-group
# mode the group is what is killed whole.
_ESCAPE = {"auto": "setsid sleep 300", "off": "sleep 300"}


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_an_exec_probes_background_child_does_not_outlive_the_probe_or_the_pool(daemon, tmp_path, cgroup):
    _start_in(daemon, cgroup)
    pids = tmp_path / "pids"
    probe = f"exec:sh -c '{_ESCAPE[cgroup]} & echo $! >> {pids}; sleep 0.2; exit 0'"
    left: list[Ident] = []
    try:
        proc = cli(daemon.state_dir, "launch", "--pool", "p", "--ready", probe, "--live", probe, "--live-interval", "0.3",
                    "--wait", "--timeout", "30", "--", "sleep", "1000")
        assert proc.returncode == 0, proc.stderr
        wait_for(lambda: len(pids.read_text().split()) >= 3, 30, "a ready and two liveness attempts")
        first = _children_of_probes(pids)[:2]
        left += first
        wait_for(lambda: not any(i.alive() for i in first), 10, "the probes' children to end with their probe")
        assert cli(daemon.state_dir, "delete", "p").returncode == 0
        left = _children_of_probes(pids)
        wait_for(lambda: not any(i.alive() for i in left), 10, "every probe child to end with the pool")
        if cgroup == "auto":
            subtree = daemon.status()["daemon"]["cgroup_subtree"]
            wait_for(lambda: not os.path.exists(f"{subtree}/replicas/p-1.probe"), 10, "the probe cgroup to go")
    finally:
        from helpers import kill_all

        kill_all(left + _children_of_probes(pids))


def test_a_running_exec_probe_is_killed_after_kill_9_of_daemon_and_watchdog(daemon, tmp_path):
    _start_in(daemon, "auto")
    pids = tmp_path / "pids"
    probe = f"exec:sh -c 'setsid sleep 300 & echo $! >> {pids}; exec sleep 300'"
    found: list[Ident] = []
    try:
        cli(daemon.state_dir, "launch", "--pool", "p", "--ready", probe, "--probe-timeout", "600", "--ready-timeout", "600",
             "--", "sleep", "1000", check=True)
        wait_for(lambda: pids.exists() and pids.read_text().strip(), 30, "the probe to run")
        found = _children_of_probes(pids)
        assert found and all(i.alive() for i in found)
        watchdog = daemon.status()["daemon"]["watchdog_pid"]
        dead = [Ident.of(daemon.pid), Ident.of(watchdog)]
        for pid in (watchdog, daemon.pid):  # the watchdog first: it must not sweep for the dead daemon
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(i and i.alive() for i in dead), 10, "daemon and watchdog to die")
        assert any(i.alive() for i in found)  # nobody has killed it yet: the next start must
        daemon.start("--cgroup", "auto")
        assert not any(i.alive() for i in found), "a probe's child outlived kill -9 of daemon and watchdog + start"
    finally:
        from helpers import kill_all

        kill_all(found)


def test_a_chatty_probe_writes_to_the_replicas_probe_log_not_the_daemons(daemon, tmp_path):
    config = tmp_path / "orchestrator.toml"
    config.write_text("[daemon]\nlog_max_bytes = 20000\nlog_backups = 1\n")
    config.chmod(0o600)
    daemon.start("--config", str(config))
    chatty = "exec:sh -c 'i=0; while [ $i -lt 300 ]; do echo probe line $i of a chatty probe; i=$((i+1)); done'"
    proc = cli(daemon.state_dir, "launch", "--pool", "p", "--ready", chatty, "--live", chatty, "--live-interval", "0.1",
                "--wait", "--timeout", "30", "--", "sleep", "1000")
    assert proc.returncode == 0, proc.stderr
    logs = daemon.state_dir / "logs"

    def probe_bytes() -> int:
        return sum(f.stat().st_size for f in logs.glob("p-1.probe*"))

    wait_for(lambda: (logs / "p-1.probe.1").exists(), 30, "the probe log to rotate")
    assert "probe line" in (logs / "p-1.probe").read_text()
    assert probe_bytes() <= 2 * 20000
    assert "probe line" not in (logs / "daemon.log").read_text()
    assert (logs / "daemon.log").stat().st_size < 20000


@pytest.mark.long
def test_daemon_log_is_rotated_and_bounded(daemon, tmp_path):
    config = tmp_path / "orchestrator.toml"
    config.write_text("[daemon]\nlog_max_bytes = \"16K\"\nlog_backups = 2\n")
    config.chmod(0o600)
    daemon.start("--config", str(config))
    # Each failed liveness check is a warning in daemon.log, and so is each replacement.
    # The probe's command is in every warning: a long one fills the 16K files in fewer cycles.
    cli(daemon.state_dir, "launch", "--pool", "flaky", "--live", "exec:false " + "x" * 1500, "--live-interval", "0.05", "--live-failures", "1",
         "--restart", "always", "--backoff", "0.01:0.01", "--max-restarts", "100000/1", "--grace", "0.5",
         "--", "sleep", "1000", check=True)
    logs = daemon.state_dir / "logs"
    wait_for(lambda: (logs / "daemon.log.2").exists(), 60, "daemon.log to rotate twice")
    cli(daemon.state_dir, "delete", "flaky", check=True)
    sizes = {f.name: f.stat().st_size for f in logs.glob("daemon.log*")}
    assert set(sizes) == {"daemon.log", "daemon.log.1", "daemon.log.2"}, sizes
    assert all(size <= 16384 for size in sizes.values()), sizes
    assert "liveness probe failed" in (logs / "daemon.log.1").read_text()
    assert cli(daemon.state_dir, "health").returncode == 0


def test_process_group_mode_records_each_exec_attempt_in_the_watchdog_ledger(reactor, os_api):
    from orchestrator.daemon.containment import ProcessGroups

    class Ledger:
        def __init__(self) -> None:
            self.lines: list[tuple] = []

        def add(self, pid, start, pgid, kind, label):
            self.lines.append(("add", pid, pgid, kind, label))

        def remove(self, pid):
            self.lines.append(("remove", pid))

    ledger = Ledger()
    box = ProbeBox("p-1", ProcessGroups("test"), ledger)
    results = Results()
    h = run_once(parse("exec:true"), reactor, os_api, timeout=5, on_result=results, box=box)
    pid = h.pid
    assert ledger.lines == [("add", pid, pid, "worker", "probe of p-1")]  # while it runs: its group
    assert reactor.run_until(lambda: bool(results), 5)
    assert results.calls == [(True, None)]
    assert ledger.lines[-1] == ("remove", pid)
    box.close()
