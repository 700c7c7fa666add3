"""The command channel: a multiprocess Manager queue on a Unix socket, and the Client.

    Client (CLI, API, any process)         Manager server process             daemon
    ──────────────────────────────         ────────────────────────           ──────────────
    commands.put({"id","op","args"}) ───►  commands: queue.Queue
                                           forwarder thread: get(),
                                           check plain data, frame ─── pipe ─►  control loop
                                                                               applies it,
    replies.take(id, timeout)  ◄────────   ReplyBoard ◄── router thread ◄ pipe ─ one reply/id

Why the Manager server is a process of its own, not threads in the daemon: the daemon must
stay single-threaded so that it can fork workers safely and fast (see osapi.py), and a
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

Who is on the other end is checked before anything it sends is read, with SO_PEERCRED
(the credentials the kernel recorded when the peer connected, or listened):

* a client talks only to a server that runs as its own uid (root's only to root's): a
  state dir, socket or auth key planted by someone else gets nothing sent to it and
  nothing unpickled from it (``_bounded_client``, before the auth handshake);
* the manager server serves only clients of its own uid or root, and drops any other
  before the auth handshake (``_PlainListener.accept``; the socket is 0600 in a 0700 dir
  as well, so this is the second wall, not the first).

Both ends still speak the Manager's protocol, which pickles its tuples, but unpickle with
``_PlainUnpickler``: it refuses every global, so a message can only be plain data (the
client also accepts builtin exception classes, which the Manager uses for its ``#ERROR``
replies). A pickle that would import or call anything is a ChannelError, never run.
"""

from __future__ import annotations

import builtins
import os
import pickle
import socket
import stat
import struct
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from multiprocess import connection
from multiprocess import managers

from .errors import ChannelError, DaemonNotRunning, InvalidSpec, OrchestratorError
from .paths import (
    AUTHKEY_NAME, SOCKET_NAME, Paths, UnsafeStateDir, check_file, check_state_dir, read_private, running_pid,
    user_name,
)
from .protocol import FrameTooLarge, command, encode_frame, raise_reply
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


def read_authkey(paths: Paths) -> bytes:
    """The auth key, from a checked file of a checked state dir (UnsafeStateDir if not)."""
    try:
        return read_private(paths, AUTHKEY_NAME)
    except FileNotFoundError:
        raise DaemonNotRunning(f"no daemon is running for {paths.state_dir}") from None


# The two helpers below borrow the fd (detach, never close) instead of working on a dup: at
# the fd limit a dup fails, and an accepted connection must still be checked and answered.


def manager_down(paths: Paths) -> str | None:
    """Why the daemon's manager server is down, as the daemon journaled it (it exited, or
    cannot be started: EMFILE, EAGAIN); None if it is up or nothing says otherwise."""
    from .store import Store, StoreError

    try:
        store = Store(paths.db, readonly=True)
    except (StoreError, OSError):
        return None
    try:
        event = store.last_event("manager")
    except StoreError:
        return None
    finally:
        store.close()
    data = event["data"] if event is not None and isinstance(event["data"], dict) else {}
    return str(data.get("reason")) if data.get("up") is False else None


def peer_uid(fd: int) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    sock = socket.socket(fileno=fd)
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        sock.detach()
    return struct.unpack("3i", creds)[1]


def set_timeouts(fd: int, seconds: float) -> None:
    """Bound every send and recv on socket ``fd`` (SO_SNDTIMEO/SO_RCVTIMEO)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    finally:
        sock.detach()


class _PlainUnpickler(pickle.Unpickler):
    """Plain data only: every global (a class, a function: anything that could run) is
    refused, so loading a message can build dicts, lists, tuples, sets, str, bytes,
    numbers, bool and None, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: the channel carries plain data only")


class _ReplyUnpickler(_PlainUnpickler):
    """A client's: plain data, and the builtin exception classes of ``#ERROR`` replies."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins":
            obj = getattr(builtins, name, None)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                return obj
        return super().find_class(module, name)


class _PlainConnection(connection.Connection):
    """A multiprocess Connection that pickles with the stdlib pickler and unpickles plain
    data only. The channel carries only plain data and the Manager's own protocol tuples,
    so dill's pure-Python pickler (~46 µs a message against ~3 µs) buys nothing here. A
    client's connections are of this class, a server's of ``_ServerConnection``."""

    _unpickler: type[pickle.Unpickler] = _ReplyUnpickler

    def send(self, obj: Any) -> None:
        self._check_closed()
        self._check_writable()
        self._send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        self._check_closed()
        self._check_readable()
        data = self._recv_bytes()  # a BytesIO, positioned at its end
        data.seek(0)
        try:
            return self._unpickler(data).load()
        except pickle.UnpicklingError as err:
            raise ChannelError(str(err)) from None


class _ServerConnection(_PlainConnection):
    _unpickler = _PlainUnpickler


class _PlainListener(connection.Listener):
    """The manager server's listener: a peer that is neither our uid nor root is dropped
    on accept, before the auth handshake and before anything it sends is read."""

    refused = 0

    def fileno(self) -> int:
        """The listening socket's fd (to poll it for a queued connection)."""
        return self._listener._socket.fileno()

    def accept(self) -> _ServerConnection:
        if self._listener is None:
            raise OSError("listener is closed")
        conn = self._listener.accept()
        try:
            uid = peer_uid(conn.fileno())
        except OSError:
            conn.close()  # it hung up already
            raise
        if uid not in (os.geteuid(), 0):
            conn.close()
            _PlainListener.refused += 1
            if _PlainListener.refused <= 10:  # a hostile peer must not fill the log
                print(f"orchestrator.manager: refused a connection from {user_name(uid)}", file=sys.stderr, flush=True)
            raise PermissionError(f"refused a connection from {user_name(uid)}")  # the accepter goes on
        if self._authkey:
            connection.deliver_challenge(conn, self._authkey)
            connection.answer_challenge(conn, self._authkey)
        conn.__class__ = _ServerConnection  # same object, stdlib pickling (no detach() to rewrap)
        return conn


_connect_bound = threading.local()  # per thread: Clients with other time-outs never race


def _bounded_client(address: str, family: str | None = None, authkey: bytes | None = None) -> Any:
    """multiprocess's Client, with every send and recv bounded by socket time-outs (the
    handshake by the connecting Client's time-out; each call re-bounds its connection)."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        set_timeouts(sock.fileno(), getattr(_connect_bound, "seconds", DEFAULT_TIMEOUT))
        sock.connect(address)
        # Before the handshake, before any byte is read: is the server one of ours?
        uid, me = peer_uid(sock.fileno()), os.geteuid()
        if uid != me:
            raise UnsafeStateDir(f"the server on its control socket runs as {user_name(uid)}, "
                                 f"not as {user_name(me)}: refusing to talk to it")
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
        # A dir, pid file, key or socket someone else controls is refused here (UnsafeStateDir).
        if not check_state_dir(self.paths) or running_pid(self.paths) is None:
            raise DaemonNotRunning(f"no daemon is running for {self.paths.state_dir}")
        self._authkey = authkey if authkey is not None else read_authkey(self.paths)
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
        check_file(self.paths, SOCKET_NAME, stat.S_IFSOCK)  # ours, 0600; the peer is checked on connect
        mgr = ChannelManager(address=self._address, authkey=self._authkey, serializer=SERIALIZER)
        try:
            mgr.connect()
            self._commands, self._replies = mgr.commands(), mgr.replies()
        except UnsafeStateDir as err:
            raise UnsafeStateDir(f"{self.paths.state_dir}: {err}") from None
        except connection.AuthenticationError:
            raise ChannelError("authentication failed: wrong auth key for this daemon") from None
        except (FileNotFoundError, ConnectionRefusedError):
            pid = running_pid(self.paths)
            if pid is None:
                raise DaemonNotRunning(f"no daemon is running for {self.paths.state_dir}") from None
            reason = manager_down(self.paths)
            if reason is not None:
                raise ChannelError(f"the daemon (pid {pid}) takes no commands: its manager server is down "
                                   f"({reason}); the daemon keeps restarting it") from None
            raise ChannelError(f"the daemon (pid {pid}) is not accepting commands right now") from None
        except EOFError:
            raise ChannelError("cannot reach the daemon: its manager server closed the connection "
                               "(see the daemon's log)") from None
        except OSError as err:  # a refusal's reason (the manager's thread or fd limit), a time-out
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
        try:  # what the manager server could only refuse is refused here, before it is sent
            encode_frame(cmd, f"the {op} command")
        except FrameTooLarge as err:
            raise InvalidSpec(str(err)) from None
        except (TypeError, ValueError):
            pass  # not plain data, or NaN: the manager server answers that, with its words
        replies = self._replies
        try:
            tls = replies._tls  # this thread's connection, shared by every proxy of ours
            if not hasattr(tls, "connection"):
                replies._connect()
            # The reply may take up to `limit` to come: bound this thread's socket just past it.
            set_timeouts(tls.connection.fileno(), limit + 5.0)
            msg = replies.call(cmd, limit)
        except OrchestratorError:  # a peer of another uid, or a reply that is not plain data
            self._drop_connection()
            raise
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
