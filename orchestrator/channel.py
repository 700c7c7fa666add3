"""The command channel: a multiprocess Manager queue on a Unix socket, and the Client.

    Client (CLI, API, any process)         Manager server process             daemon
    ──────────────────────────────         ────────────────────────           ──────────────
    commands.put({"id","op","args"}) ───►  commands: queue.Queue
                                           forwarder thread: get(),
                                           check plain data, frame ─── pipe ─►  control loop
                                                                               applies it,
    replies.take(id, timeout)  ◄────────   ReplyBoard ◄── router thread ◄ pipe ─ one reply/id

Why the Manager server is a process of its own, not threads in the daemon: the daemon must
stay single-threaded so that it can fork workers safely and fast (see spawner.py), and a
Manager queue cannot be selected on, so whoever consumes it needs a blocked thread. Those
threads live in the Manager server; the daemon sees two pipes in its epoll set. Cost: one
extra pipe hop each way, ~30 µs against a ~0.5 ms Manager round trip
(benchmarks/bench_channel.py).

Commands and replies are plain data (dict, list, str, int, float, bool, None): the Manager
server unpickles whatever a client sends, so nothing user-defined is ever in a command;
a callable travels as base64 text that only the worker unpickles (spec.py). Every proxy
call is bounded: the client's socket carries SO_RCVTIMEO/SO_SNDTIMEO, so a stopped or
hung server gives a ChannelError instead of blocking forever.

A state dir whose socket path exceeds the 108-byte sun_path limit is reached through
``/proc/self/fd/<dirfd>/control.sock``, a short path to the same file.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import uuid
from pathlib import Path
from typing import Any

from multiprocess import connection
from multiprocess import managers

from .errors import ChannelError, DaemonNotRunning
from .paths import AUTHKEY_NAME, SOCKET_NAME, Paths, running_pid
from .protocol import command, raise_reply
from .verbs import Verbs

SERIALIZER = "orchestrator"
_SUN_PATH_MAX = 107
DEFAULT_TIMEOUT = 30.0


# -- addresses and keys ------------------------------------------------------------


def socket_address(state_dir: Path) -> tuple[str, int | None]:
    """(address to bind/connect, dirfd to keep open while it is used, or None)."""
    path = str(state_dir / SOCKET_NAME)
    if len(path.encode()) <= _SUN_PATH_MAX:
        return path, None
    dirfd = os.open(state_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{dirfd}/{SOCKET_NAME}", dirfd


def read_authkey(state_dir: Path) -> bytes:
    try:
        return (state_dir / AUTHKEY_NAME).read_bytes()
    except FileNotFoundError:
        raise DaemonNotRunning(f"no daemon is running for {state_dir}") from None
    except PermissionError:
        raise ChannelError(f"cannot read the auth key {state_dir / AUTHKEY_NAME}: permission denied") from None


def _set_timeouts(fd: int, seconds: float) -> None:
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    finally:
        sock.close()


class _PlainConnection(connection.Connection):
    """A multiprocess Connection that pickles with the stdlib pickler. The channel carries
    only plain data and the Manager's own protocol tuples, so dill's pure-Python pickler
    (~46 µs a message against ~3 µs) buys nothing here; both ends use this class."""

    def send(self, obj: Any) -> None:
        self._check_closed()
        self._check_writable()
        self._send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        self._check_closed()
        self._check_readable()
        return pickle.loads(self._recv_bytes().getbuffer())


class _PlainListener(connection.Listener):
    def accept(self) -> _PlainConnection:
        conn = super().accept()
        conn.__class__ = _PlainConnection  # same object, stdlib pickling (no detach() to rewrap)
        return conn


_connect_bound = threading.local()  # per thread: Clients with other time-outs never race


def _bounded_client(address: str, family: str | None = None, authkey: bytes | None = None) -> Any:
    """multiprocess's Client, with every send and recv bounded by socket time-outs (the
    handshake by the connecting Client's time-out; each call re-bounds its connection)."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        _set_timeouts(sock.fileno(), getattr(_connect_bound, "seconds", DEFAULT_TIMEOUT))
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    conn = _PlainConnection(sock.detach())
    if authkey is not None:
        connection.answer_challenge(conn, authkey)
        connection.deliver_challenge(conn, authkey)
    return conn


class ChannelManager(managers.BaseManager):
    """Typeids: ``commands`` (the command queue) and ``replies`` (a board keyed by id,
    whose ``call(cmd, timeout)`` puts a command on the queue and waits for its reply: one
    round trip instead of a put and a take)."""


ChannelManager.register("commands")
ChannelManager.register("replies")


def use_plain_pickling() -> None:
    """Teach multiprocess our serializer name (idempotent; called by whoever connects or
    serves, not as a side effect of importing this module)."""
    managers.listener_client.setdefault(SERIALIZER, (_PlainListener, _bounded_client))


# -- the client ------------------------------------------------------------------


class Client(Verbs):
    """Talks to a running daemon over its Manager queue. Thread-safe; every call bounded."""

    def __init__(self, state_dir: str | os.PathLike, *, timeout: float = DEFAULT_TIMEOUT, authkey: bytes | None = None) -> None:
        self.paths = Paths(Path(state_dir))
        self.timeout = timeout
        if running_pid(self.paths) is None:
            raise DaemonNotRunning(f"no daemon is running for {self.paths.state_dir}")
        self._authkey = authkey if authkey is not None else read_authkey(self.paths.state_dir)
        self._address, self._dirfd = socket_address(self.paths.state_dir)
        self._mgr: ChannelManager | None = None
        self._commands: Any = None
        self._replies: Any = None

    def close(self) -> None:
        self._mgr = self._commands = self._replies = None
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> None:
        use_plain_pickling()
        _connect_bound.seconds = self.timeout + 5.0
        mgr = ChannelManager(address=self._address, authkey=self._authkey, serializer=SERIALIZER)
        try:
            mgr.connect()
            self._commands, self._replies = mgr.commands(), mgr.replies()
        except connection.AuthenticationError:
            raise ChannelError("authentication failed: wrong auth key for this daemon") from None
        except (FileNotFoundError, ConnectionRefusedError):
            pid = running_pid(self.paths)
            if pid is None:
                raise DaemonNotRunning(f"no daemon is running for {self.paths.state_dir}") from None
            raise ChannelError(f"the daemon (pid {pid}) is not accepting commands right now") from None
        except (OSError, EOFError) as err:
            raise ChannelError(f"cannot reach the daemon: {err}") from None
        self._mgr = mgr

    def _drop_connection(self) -> None:
        tls = self._replies._tls if self._replies is not None else None
        conn = getattr(tls, "connection", None)
        if conn is not None:
            del tls.connection
            conn.close()
        self._mgr = None

    def call(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """Send one command and wait, bounded, for its reply; raises its typed error."""
        limit = self.timeout if timeout is None else timeout
        if self._mgr is None:
            self._connect()
        cmd = command(op, args, uuid.uuid4().hex)
        replies = self._replies
        try:
            tls = replies._tls  # this thread's connection, shared by every proxy of ours
            if not hasattr(tls, "connection"):
                replies._connect()
            # The reply may take up to `limit` to come: bound this thread's socket just past it.
            _set_timeouts(tls.connection.fileno(), limit + 5.0)
            msg = replies.call(cmd, limit)
        except (OSError, EOFError) as err:
            self._drop_connection()  # it may be mid-message: never reuse it
            if isinstance(err, (BlockingIOError, TimeoutError)):
                raise ChannelError(f"{op}: the daemon did not answer within {limit:g} s") from None
            raise ChannelError(f"{op}: lost the connection to the daemon ({err})") from None
        except managers.RemoteError as err:
            raise ChannelError(f"{op}: the channel refused the command: {str(err).strip().splitlines()[-1]}") from None
        if msg is None:
            raise ChannelError(f"{op}: no reply from the daemon within {limit:g} s")
        return raise_reply(msg)


__all__ = ["Client", "ChannelManager", "socket_address", "use_plain_pickling"]
