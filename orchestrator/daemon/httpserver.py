"""The loopback HTTP endpoint for ``/metrics`` and ``/healthz``, served by the control loop.

HTTP/1.1 is parsed and framed by ``h11`` (sans-IO: it never touches a socket), and the
sockets are driven by the reactor: a non-blocking listener and non-blocking connections in
a private epoll whose fd is one reader of the reactor (the reactor's writer API cannot share
an fd with a reader, so readiness for both directions is watched here). Nothing here
sleeps, blocks or starts a thread, and no reactor callback of this module raises: a broken
client is closed and counted. Every response closes its connection (a scraper reconnects
once every few seconds; keep-alive would only add idle sockets to bound).
"""

from __future__ import annotations

import collections
import errno
import functools
import http
import json
import logging
import select
import socket
from typing import Any, Callable, Mapping

import h11

from .reactor import Reactor, Timer

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
MAX_REQUEST = 8192  # bytes of request line and headers; beyond: 431
_TEXT = "text/plain; charset=utf-8"
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: 5\r\nConnection: close\r\n\r\nbusy\n")


class _Conn:
    __slots__ = ("sock", "fd", "h11", "fed", "out", "sent", "timer", "outcome")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        # h11's bound holds only while the head is incomplete (a request in pieces); a whole
        # one in a single read is measured in _read, from what h11 was fed and kept.
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST)
        self.fed = 0  # bytes given to h11
        self.out: bytes | None = None  # the response, once there is one
        self.sent = 0
        self.timer: Timer | None = None
        self.outcome = ""


class MetricsServer:
    """``GET /metrics`` (and ``/healthz``) on 127.0.0.1:``port``. A request is read within
    ``request_timeout`` s, the response written as the socket takes it within
    ``write_timeout`` s; beyond ``max_connections`` a client gets a 503 and is closed.

    ``render()`` gives the /metrics body; ``healthz()`` -> (ok, info) gives /healthz (200 or
    503, info as JSON; 404 when None). ``port`` 0 binds an ephemeral port (``.port`` says
    which). ``counts`` holds what happened to clients (outcome -> n), and ``on_outcome``
    (e.g. ``Metrics.http_request``) hears each outcome. A port that cannot be bound raises
    OSError with a one-line message.
    """

    HOST = "127.0.0.1"

    def __init__(self, reactor: Reactor, port: int, render: Callable[[], str],
                 healthz: Callable[[], tuple[bool, Mapping[str, Any]]] | None = None, *,
                 max_connections: int = 16, request_timeout: float = 2.0, write_timeout: float = 10.0,
                 on_outcome: Callable[[str], None] | None = None, sock: socket.socket | None = None) -> None:
        """``sock``: a listener bound already (carried by an upgrade), else one is bound on ``port``."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise OSError(errno.EINVAL, f"invalid metrics port {port!r} (0-65535)")
        self.reactor = reactor
        self.render = render
        self.healthz = healthz
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.write_timeout = write_timeout
        self.on_outcome = on_outcome
        self.counts: collections.Counter[str] = collections.Counter()
        self.closed = False
        self._conns: dict[int, _Conn] = {}
        self._listening = False
        self._resume: Timer | None = None
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # close-on-exec, as every Python fd
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.HOST, port))
                sock.listen(64)
                sock.setblocking(False)
            except OSError as err:
                sock.close()
                raise OSError(err.errno, f"cannot serve metrics on {self.HOST}:{port}: "
                                         f"{err.strerror or err}") from None
        else:
            sock.set_inheritable(False)
            sock.setblocking(False)
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        try:
            self._ep = select.epoll()  # close-on-exec too
        except OSError:
            sock.close()
            raise
        try:
            self._ep.register(sock.fileno(), select.EPOLLIN)
            reactor.add_reader(self._ep.fileno(), self._on_ready)
        except BaseException:
            self._ep.close()
            sock.close()
            raise
        self._listening = True

    # -- bookkeeping --

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:  # a metrics callback must not take the server down with it
                log.exception("metrics server: on_outcome")

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- events --

    def _on_ready(self) -> None:
        if self.closed:
            return
        try:
            events = self._ep.poll(0, 64)
        except OSError:
            return
        for fd, mask in events:
            if self.closed:
                return
            if fd == self._sock.fileno():
                self._accept()
                continue
            conn = self._conns.get(fd)
            if conn is None:
                continue
            try:
                if conn.out is None:
                    self._read(conn, mask)
                else:
                    self._write(conn)
            except Exception:  # a bug here must cost one client, never the loop
                log.exception("metrics server: client failed")
                self._close(conn, conn.outcome or "error")

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE, ENOBUFS...: stop accepting for a moment
                self._count("accept_error")
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause()
                return
            try:
                sock.setblocking(False)
                if len(self._conns) >= self.max_connections:
                    try:
                        sock.send(_REFUSAL, socket.MSG_NOSIGNAL)
                    except OSError:
                        pass
                    sock.close()
                    self._count("refused")
                    continue
                conn = _Conn(sock)
                self._ep.register(conn.fd, select.EPOLLIN | select.EPOLLRDHUP)
            except OSError:
                sock.close()
                self._count("error")
                continue
            self._conns[conn.fd] = conn
            conn.timer = self.reactor.call_later(self.request_timeout, functools.partial(self._expire, conn))

    def _pause(self) -> None:
        if not self._listening:
            return
        try:
            self._ep.unregister(self._sock.fileno())
        except OSError:
            pass
        self._listening = False
        self._resume = self.reactor.call_later(1.0, self._unpause)

    def _unpause(self) -> None:
        self._resume = None
        if self.closed or self._listening:
            return
        try:
            self._ep.register(self._sock.fileno(), select.EPOLLIN)
            self._listening = True
        except OSError:
            log.exception("metrics server: cannot listen again")

    def _expire(self, conn: _Conn) -> None:
        if self._conns.get(conn.fd) is conn:
            conn.timer = None
            self._close(conn, "timeout")

    def _read(self, conn: _Conn, mask: int) -> None:
        """Feed what the socket has to h11 until it yields a whole request (answered), an
        error (answered with its status hint), or wants more than there is."""
        while True:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                if mask & (select.EPOLLHUP | select.EPOLLERR):
                    self._close(conn, "closed_early")
                return
            except OSError:
                self._close(conn, "error")
                return
            conn.h11.receive_data(data)  # b"" tells it the client closed
            conn.fed += len(data)
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as err:
                if not data:  # closed in the middle of a request: nobody to answer
                    self._close(conn, "closed_early")
                    return
                too_large = err.error_status_hint == 431
                conn.outcome = "too_large" if too_large else ""
                self._respond(conn, err.error_status_hint,
                              _TEXT, b"request too large\n" if too_large else b"bad request\n")
                return
            if isinstance(event, h11.Request):
                if conn.fed - len(conn.h11.trailing_data[0]) > MAX_REQUEST:  # its head, whole in one read
                    conn.outcome = "too_large"
                    self._respond(conn, 431, _TEXT, b"request too large\n")
                    return
                self._respond(conn, *self._handle(event), head=event.method == b"HEAD")
                return
            if not data or isinstance(event, h11.ConnectionClosed):
                self._close(conn, "closed_early")  # gone before a whole request
                return

    def _handle(self, request: h11.Request) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request."""
        method = request.method.decode("latin-1")
        path = request.target.decode("latin-1").split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"only GET\n"
        if path == "/metrics":
            try:
                body = self.render().encode("utf-8")
            except Exception:  # a render bug is this request's 500, not the loop's end
                log.exception("metrics server: render failed")
                return 500, _TEXT, b"metrics failed\n"
            return 200, CONTENT_TYPE, body
        if path == "/healthz" and self.healthz is not None:
            try:
                ok, info = self.healthz()
                body = (json.dumps(info, sort_keys=True) + "\n").encode("utf-8")
            except Exception:  # as for render
                log.exception("metrics server: health failed")
                return 500, _TEXT, b"health failed\n"
            return (200 if ok else 503), "application/json", body
        return 404, _TEXT, b"not found: try /metrics or /healthz\n"

    def _respond(self, conn: _Conn, status: int, ctype: str, body: bytes, head: bool = False) -> None:
        if not conn.outcome:
            conn.outcome = ("served" if status < 400 or status == 503 else
                            "bad_request" if status < 500 else "error")
        headers = [("Content-Type", ctype), ("Content-Length", str(len(body))), ("Connection", "close")]
        h = conn.h11
        out = h.send(h11.Response(status_code=status, headers=headers, reason=http.HTTPStatus(status).phrase))
        if not head:
            out += h.send(h11.Data(data=body))
        out += h.send(h11.EndOfMessage())
        conn.out = out
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = self.reactor.call_later(self.write_timeout, functools.partial(self._expire, conn))
        self._ep.modify(conn.fd, select.EPOLLOUT)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            while conn.sent < len(conn.out):
                n = conn.sock.send(memoryview(conn.out)[conn.sent:conn.sent + 65536], socket.MSG_NOSIGNAL)
                if n <= 0:
                    break
                conn.sent += n
        except (BlockingIOError, InterruptedError):
            return  # the rest on EPOLLOUT
        except OSError:
            self._close(conn, "error")
            return
        if conn.sent >= len(conn.out):
            try:
                conn.sock.shutdown(socket.SHUT_WR)
                while conn.sock.recv(4096):  # what the client sent beyond the request: a close
                    pass                     # with unread data would reset the connection
            except OSError:
                pass
            self._close(conn, conn.outcome)

    def _close(self, conn: _Conn, outcome: str) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        try:
            self._ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        conn.sock.close()
        self._count(outcome)

    def listener(self) -> socket.socket:
        """The listening socket (an upgrade carries it)."""
        return self._sock

    def close(self) -> None:
        """Close the listener and every connection; the reactor forgets our fd. Idempotent."""
        if self.closed:
            return
        for conn in list(self._conns.values()):
            self._close(conn, "closed_by_server")
        self.closed = True
        if self._resume is not None:
            self._resume.cancel()
        try:
            self.reactor.remove_reader(self._ep.fileno())
        except (KeyError, ValueError, OSError):
            pass
        self._ep.close()
        self._sock.close()
