"""HTTP/1.1 served by the control loop: the connection handling ``/metrics`` and the JSON
control plane (httpapi.py) share, and the loopback ``/metrics`` + ``/healthz`` endpoint.

HTTP/1.1 is parsed and framed by ``h11`` (sans-IO: it never touches a socket), and the
sockets are driven by the reactor: a non-blocking listener and non-blocking connections in
a private epoll whose fd is one reader of the reactor (the reactor's writer API cannot share
an fd with a reader, so readiness for both directions is watched here). Nothing here
sleeps, blocks or starts a thread, and no reactor callback of this module raises: a broken
client is closed and counted. Every response closes its connection (a client reconnects;
keep-alive would only add idle sockets to bound).

``HttpServer`` is the public face: a listener, a ``handle(request, exchange)`` callback
that sees each whole request (head bounded to ``MAX_REQUEST`` bytes whether it came in one
read or in pieces, body to ``max_body``), and an ``Exchange`` that answers it now or later
(a command that waits), whole (``respond``) or as a stream (``start``/``send``/``end``:
Server-Sent Events, a followed log). A unix listener may admit only some uids: the peer's
is read with SO_PEERCRED on accept, before a byte of its request is read.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import errno
import functools
import http
import json
import logging
import os
import select
import socket
import struct
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import h11

from .reactor import Reactor, Timer

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
MAX_REQUEST = 8192  # bytes of request line and headers; beyond: 431
MAX_BODY = 1 << 20  # bytes of a request body by default; beyond: 413
MAX_BUFFERED = 4 << 20  # bytes a stream may hold unsent for a client that does not read: beyond, it is closed
_TEXT = "text/plain; charset=utf-8"
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_SUN_PATH_MAX = 107  # sockaddr_un's sun_path holds 108 bytes, the last one a NUL


def _canned(status: int, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: {_TEXT}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


_REFUSAL = _canned(503, b"busy\n")
_FORBIDDEN = _canned(403, b"forbidden: another user's process\n")


@dataclass
class Request:
    """One whole request, as the handler sees it. ``headers``: names lower-cased (a repeated
    header's last value); ``peer_uid``: the client's uid on a unix listener, else None."""

    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""
    peer_uid: int | None = None


class _Conn:
    __slots__ = ("sock", "fd", "h11", "fed", "out", "sent", "timer", "outcome", "state", "body", "head",
                 "peer_uid", "exchange", "finishing")

    def __init__(self, sock: socket.socket, peer_uid: int | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        # h11's bound holds only while the head is incomplete (a request in pieces); a whole
        # one in a single read is measured in _read, from what h11 was fed and kept.
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST)
        self.fed = 0  # bytes given to h11
        self.out = bytearray()  # what is to be sent
        self.sent = 0
        self.timer: Timer | None = None
        self.outcome = ""
        self.state = "reading"  # reading -> handling (the handler has it) -> writing | streaming
        self.body = bytearray()
        self.head: h11.Request | None = None
        self.peer_uid = peer_uid
        self.exchange: Exchange | None = None
        self.finishing = False  # the whole response is in ``out``: close once it is sent


class Exchange:
    """The answer to one request: ``respond`` once, or ``start`` a stream, ``send`` to it and
    ``end`` it. Any of them after the client left is a no-op (``closed`` says so), so a
    command's late reply needs no check; ``on_close`` hears the connection's end. ``route``
    and ``method`` label it for the server's ``on_response`` (the handler may name its route
    there: a path with an id in it is one route), timed from ``arrived``."""

    def __init__(self, server: HttpServer, conn: _Conn) -> None:
        self._server = server
        self._conn = conn
        self.on_close: Callable[[], None] | None = None
        self.started = False
        self.arrived = time.monotonic()
        self.method = "other"
        self.route = "other"

    @property
    def closed(self) -> bool:
        return self._server.is_closed(self._conn)

    @property
    def server(self) -> HttpServer:
        return self._server

    def hand_over(self) -> dict[str, Any] | None:
        """For an upgrade's exec, while its answer is still to come: its socket made
        inheritable and what ``HttpServer.adopt`` needs to answer it in the next image
        (None if it is closed, or answered or streaming already)."""
        return None if self.closed or self.started else self._server.hand_over(self._conn)

    def keep(self) -> None:
        """The exec did not happen: the socket is this image's again."""
        if not self.closed:
            self._conn.sock.set_inheritable(False)

    def respond(self, status: int, ctype: str, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> None:
        if self.closed or self.started:
            return
        self.started = True
        self._server.responded(self, status)
        self._server.respond(self._conn, status, ctype, body, headers)

    def start(self, status: int, ctype: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        if self.closed or self.started:
            return
        self.started = True
        self._server.responded(self, status)
        self._server.start_stream(self._conn, status, ctype, headers)

    def send(self, data: bytes) -> None:
        if not self.closed and self.started:
            self._server.stream_data(self._conn, data)

    def end(self) -> None:
        if not self.closed and self.started:
            self._server.end_stream(self._conn)


Handler = Callable[[Request, Exchange], None]


def tcp_listener(host: str, port: int, what: str = "http") -> socket.socket:
    """A non-blocking TCP listener on (host, port); OSError with one line if it cannot be."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise OSError(errno.EINVAL, f"invalid {what} port {port!r} (0-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)  # close-on-exec, as every Python fd
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot serve {what} on {host}:{port}: {err.strerror or err}") from None
    return sock


def unix_listener(path: str, what: str = "http") -> socket.socket:
    """A non-blocking unix listener at ``path``, mode 0600 from its creation (bound under a
    umask of 077); a stale socket there is replaced, anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise OSError(err.errno, f"cannot serve {what} on {path}: {err.strerror or err}") from None
    else:
        import stat

        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"cannot serve {what} on {path}: something that is not a socket is there")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    dirfd = None
    try:
        name = path
        if len(os.fsencode(path)) > _SUN_PATH_MAX:  # a deep state dir: the same file by a short name
            dirfd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            name = f"/proc/self/fd/{dirfd}/{os.path.basename(path)}"
        sock.bind(name)
        os.chmod(path, 0o600)  # connecting takes write permission: the owner's only
        sock.listen(64)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot serve {what} on {path}: {err.strerror or err}") from None
    finally:
        os.umask(old)
        if dirfd is not None:
            os.close(dirfd)
    return sock


class HttpServer:
    """Serves ``handle`` on the listener ``sock`` (taken over: closed by ``close``). A request
    is read within ``request_timeout`` s and a whole response written within
    ``write_timeout`` s; a stream lives until either end closes it, but a client that lets
    more than ``max_buffered`` bytes of it pile up is dropped. Beyond ``max_connections``
    a client gets a 503 and is closed; on a unix listener, a peer whose uid is not in
    ``uids`` gets a 403 (None: any). ``counts`` holds what happened to clients (outcome -> n),
    and ``on_outcome`` hears each outcome; ``on_response(method, route, status, seconds)``
    hears each answer as it starts (its ``Exchange``'s labels, and the time since the
    request was read whole)."""

    def __init__(self, reactor: Reactor, sock: socket.socket, handle: Handler, *,
                 max_connections: int = 16, request_timeout: float = 2.0, write_timeout: float = 10.0,
                 max_body: int = MAX_BODY, max_buffered: int = MAX_BUFFERED,
                 uids: Collection[int] | None = None, on_outcome: Callable[[str], None] | None = None,
                 on_response: Callable[[str, str, int, float], None] | None = None,
                 path: str | None = None) -> None:
        """``path``: a unix listener's file name, where its bound name is not it (a long one
        bound through /proc/self/fd); the file is removed by ``close`` while it is still ours."""
        self.reactor = reactor
        self.handle = handle
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.write_timeout = write_timeout
        self.max_body = max_body
        self.max_buffered = max_buffered
        self.uids = None if uids is None else frozenset(uids)
        self.on_outcome = on_outcome
        self.on_response = on_response
        self.counts: collections.Counter[str] = collections.Counter()
        self.closed = False
        self._conns: dict[int, _Conn] = {}
        self._listening = False
        self._resume: Timer | None = None
        sock.set_inheritable(False)
        sock.setblocking(False)
        self._sock = sock
        self.unix = sock.family == socket.AF_UNIX
        self.address: Any = path if path is not None and self.unix else sock.getsockname()
        self._bound: tuple[int, int] | None = None  # the socket file we made: removed by close if still ours
        if self.unix and isinstance(self.address, str) and self.address:
            with contextlib.suppress(OSError):
                st = os.stat(self.address)
                self._bound = (st.st_dev, st.st_ino)
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
                log.exception("http server: on_outcome")

    def responded(self, exchange: Exchange, status: int) -> None:
        """``exchange`` answers now with ``status`` (Exchange calls it): ``on_response`` hears it."""
        if self.on_response is not None:
            try:
                self.on_response(exchange.method, exchange.route, status, time.monotonic() - exchange.arrived)
            except Exception:  # as for on_outcome
                log.exception("http server: on_response")

    @property
    def connections(self) -> int:
        return len(self._conns)

    def is_closed(self, conn: _Conn) -> bool:
        return self._conns.get(conn.fd) is not conn

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
                if conn.state == "reading":
                    self._read(conn, mask)
                elif mask & (select.EPOLLHUP | select.EPOLLERR):
                    self._close(conn, conn.outcome or "closed_early")
                elif conn.state in ("handling", "streaming") and mask & select.EPOLLRDHUP:
                    self._close(conn, conn.outcome or "served")  # gone while its answer waits or streams
                elif mask & select.EPOLLOUT:
                    self._write(conn)
            except Exception:  # a bug here must cost one client, never the loop
                log.exception("http server: client failed")
                self._close(conn, conn.outcome or "error")

    def _peer_uid(self, sock: socket.socket) -> int | None:
        if not self.unix:
            return None
        return int(_CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1])

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
                uid = self._peer_uid(sock)
                refusal = (_REFUSAL if len(self._conns) >= self.max_connections else
                           _FORBIDDEN if self.uids is not None and uid not in self.uids else None)
                if refusal is not None:
                    try:
                        sock.send(refusal, socket.MSG_NOSIGNAL)
                    except OSError:
                        pass
                    sock.close()
                    self._count("refused" if refusal is _REFUSAL else "forbidden")
                    continue
                conn = _Conn(sock, uid)
                self._ep.register(conn.fd, select.EPOLLIN | select.EPOLLRDHUP)
            except OSError:
                sock.close()
                self._count("error")
                continue
            # a client that wrote as it connected (most do) is read now, not a turn later
            self._begin(conn, b"")

    def _begin(self, conn: _Conn, carried: bytes) -> None:
        self._conns[conn.fd] = conn
        conn.timer = self.reactor.call_later(self.request_timeout, functools.partial(self._expire, conn))
        try:
            self._read(conn, 0, carried)
        except Exception:  # as in _on_ready: one client's failure
            log.exception("http server: client failed")
            self._close(conn, conn.outcome or "error")

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
            log.exception("http server: cannot listen again")

    def _expire(self, conn: _Conn) -> None:
        if self._conns.get(conn.fd) is conn:
            conn.timer = None
            self._close(conn, "timeout")

    def _read(self, conn: _Conn, mask: int, carried: bytes = b"") -> None:
        """Feed what the socket has (after ``carried``, what an earlier image had read of it)
        to h11 until it yields a whole request (handed to the handler), an error (answered
        with its status hint), or wants more than there is."""
        while True:
            if carried:
                data, carried = carried, b""
            else:
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
            while True:
                try:
                    event = conn.h11.next_event()
                except h11.RemoteProtocolError as err:
                    if not data:  # closed in the middle of a request: nobody to answer
                        self._close(conn, "closed_early")
                        return
                    too_large = err.error_status_hint == 431
                    conn.outcome = "too_large" if too_large else ""
                    self.respond(conn, err.error_status_hint, _TEXT,
                                 b"request too large\n" if too_large else b"bad request\n")
                    return
                if isinstance(event, h11.Request):
                    if conn.fed - len(conn.h11.trailing_data[0]) > MAX_REQUEST:  # its head, whole in one read
                        conn.outcome = "too_large"
                        self.respond(conn, 431, _TEXT, b"request too large\n")
                        return
                    conn.head = event
                    if conn.h11.they_are_waiting_for_100_continue:  # curl's, for a body over 1 KiB
                        with contextlib.suppress(OSError):  # a few bytes into an empty buffer: best effort
                            conn.sock.send(conn.h11.send(h11.InformationalResponse(status_code=100, headers=[])),
                                           socket.MSG_NOSIGNAL)
                    length = dict(event.headers).get(b"content-length")
                    if length is not None and int(length) > self.max_body:  # h11 checked it is a number
                        conn.outcome = "too_large"
                        self.respond(conn, 413, _TEXT, b"request body too large\n")
                        return
                    continue
                if isinstance(event, h11.Data):
                    conn.body += event.data
                    if len(conn.body) > self.max_body:
                        conn.outcome = "too_large"
                        self.respond(conn, 413, _TEXT, b"request body too large\n")
                        return
                    continue
                if isinstance(event, h11.EndOfMessage):
                    self._dispatch(conn)
                    return
                break  # NEED_DATA (or PAUSED): read on
            if not data:
                self._close(conn, "closed_early")  # gone before a whole request
                return

    def _dispatch(self, conn: _Conn) -> None:
        head = conn.head
        assert head is not None
        if conn.timer is not None:  # the request is read; its answer may take as long as its command
            conn.timer.cancel()
            conn.timer = None
        conn.state = "handling"
        self._ep.modify(conn.fd, select.EPOLLRDHUP)  # only its going away, until there is something to send
        target = head.target.decode("latin-1")
        path, _, query = target.partition("?")
        request = Request(
            method=head.method.decode("latin-1"), target=target, path=urllib.parse.unquote(path),
            query=urllib.parse.parse_qs(query, keep_blank_values=True),
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers},
            body=bytes(conn.body), peer_uid=conn.peer_uid)
        conn.body = bytearray()
        exchange = conn.exchange = Exchange(self, conn)
        try:
            self.handle(request, exchange)
        except Exception:  # a handler bug is this request's 500, not the loop's end
            log.exception("http server: handler failed")
            exchange.respond(500, _TEXT, b"internal error\n")

    # -- answers --

    def _head(self, conn: _Conn, status: int, headers: list[tuple[str, str]]) -> None:
        conn.out += conn.h11.send(h11.Response(status_code=status, headers=headers,
                                               reason=http.HTTPStatus(status).phrase))

    def _frame(self, conn: _Conn, data: bytes) -> None:
        if data:
            conn.out += conn.h11.send(h11.Data(data=data))

    def _outcome(self, conn: _Conn, status: int) -> None:
        if not conn.outcome:
            conn.outcome = ("served" if status < 400 or status == 503 else
                            "bad_request" if status < 500 else "error")

    def respond(self, conn: _Conn, status: int, ctype: str, body: bytes,
                headers: Sequence[tuple[str, str]] = (), head: bool | None = None) -> None:
        """The whole response to ``conn``, then the connection closed (use ``Exchange``)."""
        if self.is_closed(conn):
            return
        self._outcome(conn, status)
        if head is None:
            head = conn.head is not None and conn.head.method == b"HEAD"
        self._head(conn, status, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                                  ("Connection", "close"), *headers])
        if not head:
            self._frame(conn, body)
        conn.out += conn.h11.send(h11.EndOfMessage())
        self._sending(conn, finishing=True)

    def start_stream(self, conn: _Conn, status: int, ctype: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        if self.is_closed(conn):
            return
        self._outcome(conn, status)
        # No length: h11 chunks it for an HTTP/1.1 client, and ends it by closing for a 1.0 one.
        self._head(conn, status, [("Content-Type", ctype), ("Cache-Control", "no-cache"),
                                  ("Connection", "close"), *headers])
        conn.state = "streaming"
        self._sending(conn, finishing=False)

    def stream_data(self, conn: _Conn, data: bytes) -> None:
        if self.is_closed(conn) or conn.finishing:
            return
        try:
            self._frame(conn, data)
        except h11.LocalProtocolError:  # a body where there may be none (a HEAD's): the stream ends here
            self._close(conn, "error")
            return
        if len(conn.out) - conn.sent > self.max_buffered:
            self._close(conn, "slow_reader")
            return
        self._sending(conn, finishing=False)

    def end_stream(self, conn: _Conn) -> None:
        if self.is_closed(conn) or conn.finishing:
            return
        conn.out += conn.h11.send(h11.EndOfMessage())
        self._sending(conn, finishing=True)

    def _sending(self, conn: _Conn, *, finishing: bool) -> None:
        if finishing:
            conn.finishing = True
            conn.state = "writing"
            if conn.timer is not None:
                conn.timer.cancel()
            conn.timer = self.reactor.call_later(self.write_timeout, functools.partial(self._expire, conn))
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            while conn.sent < len(conn.out):
                n = conn.sock.send(memoryview(conn.out)[conn.sent:conn.sent + 65536], socket.MSG_NOSIGNAL)
                if n <= 0:
                    break
                conn.sent += n
        except (BlockingIOError, InterruptedError):
            pass  # the rest on EPOLLOUT
        except OSError:
            self._close(conn, "error")
            return
        if conn.sent >= len(conn.out):
            del conn.out[:]
            conn.sent = 0
            if conn.finishing:
                try:
                    conn.sock.shutdown(socket.SHUT_WR)
                    while conn.sock.recv(4096):  # what the client sent beyond the request: a close
                        pass                     # with unread data would reset the connection
                except OSError:
                    pass
                self._close(conn, conn.outcome)
                return
            self._ep.modify(conn.fd, select.EPOLLRDHUP)
            return
        if conn.state == "streaming" and conn.sent > (1 << 20):  # a stream's buffer keeps only what is unsent
            del conn.out[:conn.sent]
            conn.sent = 0
        self._ep.modify(conn.fd, select.EPOLLOUT | select.EPOLLRDHUP)

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
        exchange = conn.exchange
        if exchange is not None and exchange.on_close is not None:
            try:
                exchange.on_close()
            except Exception:  # as for on_outcome
                log.exception("http server: on_close")

    def listener(self) -> socket.socket:
        """The listening socket (an upgrade carries it)."""
        return self._sock

    def hand_over(self, conn: _Conn) -> dict[str, Any]:
        """A connection whose request is read and whose answer is to come, for an upgrade:
        its fd made inheritable, and its request's line (see ``adopt``)."""
        assert conn.head is not None
        conn.sock.set_inheritable(True)
        return {"fd": conn.fd, "version": conn.head.http_version.decode("ascii"),
                "method": conn.head.method.decode("latin-1"), "target": conn.head.target.decode("latin-1")}

    def hand_over_reading(self) -> list[dict[str, Any]]:
        """For an upgrade's exec: each connection whose request is not read whole yet (a
        client that connected a moment before), its fd made inheritable, with what h11 holds
        of it, for ``adopt_reading``. Closed with the exec instead, its unread request would
        be lost and the client reset."""
        carried = []
        for conn in self._conns.values():
            if conn.state == "reading" and conn.head is None:
                conn.sock.set_inheritable(True)
                carried.append({"fd": conn.fd, "data": base64.b64encode(conn.h11.trailing_data[0]).decode("ascii")})
        return carried

    def keep_reading(self) -> None:
        """The exec did not happen: what ``hand_over_reading`` made inheritable is ours again."""
        for conn in self._conns.values():
            if conn.state == "reading":
                conn.sock.set_inheritable(False)

    def adopt_reading(self, sock: socket.socket, data: str) -> None:
        """A connection an earlier image had begun to read (``hand_over_reading``): read on
        from where it was, in the reactor's next turn (its request may be whole already, and
        its handler wants the daemon built)."""
        sock.set_inheritable(False)
        sock.setblocking(False)
        self.reactor.call_soon(functools.partial(self._adopted, sock, base64.b64decode(data)))

    def _adopted(self, sock: socket.socket, carried: bytes) -> None:
        if self.closed:
            sock.close()
            return
        try:  # registered here, so that no event of it is seen before it is one of ours
            conn = _Conn(sock, self._peer_uid(sock))
            self._ep.register(conn.fd, select.EPOLLIN | select.EPOLLRDHUP)
        except OSError:
            sock.close()
            self._count("error")
            return
        self._begin(conn, carried)

    def adopt(self, sock: socket.socket, version: str, method: str, target: str) -> Exchange:
        """A connection an earlier image read the request of (``hand_over``), answered from
        here as if this server had read it: its HTTP version decides the framing. h11 is told
        of the request again (its line only: the body was read by the earlier image)."""
        sock.set_inheritable(False)
        sock.setblocking(False)
        conn = _Conn(sock, None)
        conn.h11.receive_data(f"{method} {target} HTTP/{version}\r\nHost: carried\r\n\r\n".encode("latin-1"))
        for _ in range(3):  # the request, its end (no body), then PAUSED
            event = conn.h11.next_event()
            if isinstance(event, h11.Request):
                conn.head = event
            else:
                break
        conn.state = "handling"
        self._ep.register(conn.fd, select.EPOLLRDHUP)
        self._conns[conn.fd] = conn
        exchange = conn.exchange = Exchange(self, conn)
        return exchange

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
        if self._bound is not None:
            with contextlib.suppress(OSError):
                st = os.stat(self.address)
                if (st.st_dev, st.st_ino) == self._bound:
                    os.unlink(self.address)  # ours still: another daemon's socket there is not removed
        self._sock.close()


class MetricsServer(HttpServer):
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
        if sock is None:
            sock = tcp_listener(self.HOST, port, "metrics")
        self.render = render
        self.healthz = healthz
        super().__init__(reactor, sock, self._serve, max_connections=max_connections,
                         request_timeout=request_timeout, write_timeout=write_timeout, max_body=0,
                         on_outcome=on_outcome)
        self.port: int = self.address[1]

    def _serve(self, request: Request, exchange: Exchange) -> None:
        exchange.respond(*self._handle(request))

    def _handle(self, request: Request) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request."""
        if request.method not in ("GET", "HEAD"):
            return 405, _TEXT, b"only GET\n"
        if request.path == "/metrics":
            try:
                body = self.render().encode("utf-8")
            except Exception:  # a render bug is this request's 500, not the loop's end
                log.exception("metrics server: render failed")
                return 500, _TEXT, b"metrics failed\n"
            return 200, CONTENT_TYPE, body
        if request.path == "/healthz" and self.healthz is not None:
            try:
                ok, info = self.healthz()
                body = (json.dumps(info, sort_keys=True) + "\n").encode("utf-8")
            except Exception:  # as for render
                log.exception("metrics server: health failed")
                return 500, _TEXT, b"health failed\n"
            return (200 if ok else 503), "application/json", body
        return 404, _TEXT, b"not found: try /metrics or /healthz\n"
