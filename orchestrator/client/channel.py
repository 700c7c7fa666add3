"""The command channel: a multiprocess Manager queue on a Unix socket, and the Client.
Client side (the CLI, a user's app): the Client speaks the Manager's protocol with the
standard library (see "the client's end" below); the server's end is channelserver.py.

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
extra pipe hop each way, small beside the Manager's own round trip
(benchmarks/bench_channel.py; figures in benchmarks/README.md).

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
  nothing unpickled from it (``open_connection``, before the auth handshake);
* the manager server serves only clients of its own uid or root, and drops any other
  before the auth handshake (channelserver's ``_PlainListener.accept``; the socket is 0600 in a 0700 dir
  as well, so this is the second wall, not the first).

Both ends speak the Manager's protocol, which pickles its tuples, but unpickle with
``PlainUnpickler``: it refuses every global, so a message can only be plain data (the
client also accepts builtin exception classes, which the Manager uses for its ``#ERROR``
replies). A pickle that would import or call anything is a ChannelError, never run.
"""

from __future__ import annotations

import builtins
import hmac
import io
import os
import pickle
import socket
import stat
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..errors import (
    AWAY, ChannelError, DaemonNotRunning, FrameTooLarge, OrchestratorError, ShuttingDown, UnknownSession, UnsafeStateDir,
)
from ..paths import (
    AUTHKEY_NAME, SOCKET_NAME, Paths, check_file, check_state_dir, read_private, running_pid, user_name,
)
from ..protocol import command, encode_frame, raise_reply
from ..verbs import Verbs

SERIALIZER = "orchestrator"
_SUN_PATH_MAX = 107
DEFAULT_TIMEOUT = 30.0
R = TypeVar("R")


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
    from ..store import Store, StoreError

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


class PlainUnpickler(pickle.Unpickler):
    """Plain data only: every global (a class, a function: anything that could run) is
    refused, so loading a message can build dicts, lists, tuples, sets, str, bytes,
    numbers, bool and None, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: the channel carries plain data only")


class _ReplyUnpickler(PlainUnpickler):
    """A client's: plain data, and the builtin exception classes of ``#ERROR`` replies."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins":
            obj = getattr(builtins, name, None)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                return obj
        return super().find_class(module, name)


# -- the client's end of the Manager protocol --------------------------------------------
#
# What multiprocess's BaseManager and BaseProxy do for a client, written against the
# standard library, so that a client (the CLI, a user's app) never imports multiprocess
# and dill (~50 ms of every command's start): the same frames (a 4-byte big-endian length,
# or -1 and an 8-byte one), the same HMAC challenge both ways, the same request tuples
# (ident, method, args, kwds) and (kind, result) replies as multiprocess.managers.Server
# serves. The server end (channelserver.py) is unchanged.

_CHALLENGE, _WELCOME, _FAILURE = b"#CHALLENGE#", b"#WELCOME#", b"#FAILURE#"
_CHALLENGE_BYTES = 20
_HANDSHAKE_MAX = 256  # a handshake message longer than this is refused, as multiprocess does


class _AuthenticationError(ChannelError):
    """The handshake failed: the other end does not hold this daemon's auth key."""


class _ClientConnection:
    """One connection to the manager server: frames out, frames in; a reply is unpickled
    as plain data and builtin exceptions only (``_ReplyUnpickler``)."""

    _unpickler: type[pickle.Unpickler] = _ReplyUnpickler

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=fd)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def send_bytes(self, data: bytes) -> None:
        n = len(data)
        head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        self._sock.sendall(head + data)

    def recv_bytes(self, limit: int | None = None) -> bytes:
        (size,) = struct.unpack("!i", self._exactly(4))
        if size == -1:
            (size,) = struct.unpack("!Q", self._exactly(8))
        if limit is not None and size > limit:
            raise OSError(f"a message of {size} bytes, more than the {limit} expected")
        return self._exactly(size)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])  # a time-out: TimeoutError (SO_RCVTIMEO)
            if k == 0:
                raise EOFError("the manager server closed the connection")
            got += k
        return bytes(buf)

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        data = self.recv_bytes()
        try:
            return self._unpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as err:
            raise ChannelError(str(err)) from None

    def handshake(self, authkey: bytes) -> None:
        """Answer the server's challenge, then challenge it (multiprocess's order)."""
        message = self.recv_bytes(_HANDSHAKE_MAX)
        if not message.startswith(_CHALLENGE):
            raise _AuthenticationError("the manager server did not start the handshake")
        self.send_bytes(hmac.new(authkey, message[len(_CHALLENGE):], "md5").digest())
        if self.recv_bytes(_HANDSHAKE_MAX) != _WELCOME:
            raise _AuthenticationError("digest sent was rejected")
        challenge = os.urandom(_CHALLENGE_BYTES)
        self.send_bytes(_CHALLENGE + challenge)
        if hmac.compare_digest(self.recv_bytes(_HANDSHAKE_MAX), hmac.new(authkey, challenge, "md5").digest()):
            self.send_bytes(_WELCOME)
        else:
            self.send_bytes(_FAILURE)
            raise _AuthenticationError("digest received was wrong")

    def dispatch(self, ident: str | None, method: str, args: tuple = ()) -> Any:
        """One request, one reply: its result, or the error it carries raised."""
        self.send((ident, method, args, {}))
        kind, result = self.recv()
        if kind == "#RETURN":
            return result
        if kind == "#ERROR" and isinstance(result, BaseException):
            raise result  # e.g. the OSError of a manager refusing a connection at its limits
        # "#TRACEBACK" / "#UNSERIALIZABLE": the server failed on our request
        text = result if isinstance(result, str) else repr(result)
        raise _RemoteError(text.strip().splitlines()[-1] if text.strip() else kind)


class _RemoteError(ChannelError):
    """The manager server answered a request with a traceback (its last line here)."""


def open_connection(address: str, authkey: bytes, timeout: float) -> _ClientConnection:
    """A connection to the manager server, bounded by socket time-outs, its peer checked
    before anything it sends is read, then authenticated."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        set_timeouts(sock.fileno(), timeout)
        sock.connect(address)
        # Before the handshake, before any byte is read: is the server one of ours?
        uid, me = peer_uid(sock.fileno()), os.geteuid()
        if uid != me:
            raise UnsafeStateDir(f"the server on its control socket runs as {user_name(uid)}, "
                                 f"not as {user_name(me)}: refusing to talk to it")
    except BaseException:
        sock.close()
        raise
    conn = _ClientConnection(sock.detach())
    try:
        conn.handshake(authkey)
    except BaseException:
        conn.close()
        raise
    return conn


# -- the client ------------------------------------------------------------------


class Client(Verbs):
    """Talks to a running daemon over its Manager queue. Thread-safe; every call bounded."""

    def __init__(self, state_dir: str | os.PathLike, *, timeout: float = DEFAULT_TIMEOUT, authkey: bytes | None = None) -> None:
        self.paths = Paths(Path(state_dir))
        self.timeout = timeout
        # A dir, pid file, key or socket someone else controls is refused here (UnsafeStateDir).
        if not check_state_dir(self.paths) or running_pid(self.paths) is None:
            raise DaemonNotRunning(f"no daemon is running for {self.paths.state_dir}")
        self._own_key = authkey is None  # read from the state dir: read again by renew()
        self._authkey = authkey if authkey is not None else read_authkey(self.paths)
        self._address, self._dirfd = socket_address(self.paths.state_dir)
        self._board: str | None = None  # the ident of the manager's reply board, once created
        self._tls = threading.local()  # each thread's connection
        self._lock = threading.Lock()
        self._generation = 0  # renew() counts; a thread's connection of an earlier one is made again

    def close(self) -> None:
        with self._lock:
            board, self._board = self._board, None
        self._drop_connection()
        if board is not None:
            self._release(board)
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None

    def renew(self) -> None:
        """Start over with the daemon of this state dir as it is now: after a restart it has
        a new auth key and a new manager server, so the key is read again, a new reply board
        is asked for on the next call, and each thread's connection is made again on its next
        use. DaemonNotRunning while none runs; the caller decides how long to keep trying."""
        if not check_state_dir(self.paths) or running_pid(self.paths) is None:
            raise DaemonNotRunning(f"no daemon is running for {self.paths.state_dir}")
        key = read_authkey(self.paths) if self._own_key else self._authkey
        with self._lock:
            self._authkey, self._generation = key, self._generation + 1
            board, self._board = self._board, None
        self._drop_connection()
        if board is not None:
            self._release(board)  # gone with an old manager, or one reference less in this one

    def through_restart(self, attempt: Callable[[], R], err: OrchestratorError, window: float,
                        stop: threading.Event | None = None) -> R:
        """What ``attempt`` returns once the daemon is back: it failed with ``err`` (one of
        AWAY); the daemon's key and the connections are renewed (not for UnknownSession:
        the daemon is there) and it is tried again, with a backoff from 0.05 s doubling to
        0.5 s (nothing tells another process when a daemon has started), until it succeeds
        or ``window`` seconds have passed: then ChannelError, with the last error. Another
        error of ``attempt`` is raised as it is; ``stop`` set: ShuttingDown."""
        deadline = time.monotonic() + window
        delay = 0.05
        pause = stop if stop is not None else threading.Event()
        while not pause.is_set():
            try:
                if not isinstance(err, UnknownSession):
                    self.renew()
                return attempt()
            except AWAY as again:
                err = again
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelError(f"the daemon of {self.paths.state_dir} went away and did not come back within "
                                   f"{window:g} s (reconnect_timeout): {err}")
            pause.wait(min(delay, left))
            delay = min(delay * 2, 0.5)
        raise ShuttingDown("stopped while waiting for the daemon to come back")

    def task(self, task_id: str, *, reconnect_timeout: float = 30.0) -> Any:
        """A handle on task ``task_id`` (``<pool>/<n>``, as ``fut.task_id`` and ``submit``
        give it) of this daemon, from any process: ``result(timeout)``, ``cancel()``,
        ``future()``, ``info()``. UnknownTask if the daemon has no such task. Its calls
        wait through a restart of the daemon for up to ``reconnect_timeout`` seconds."""
        from .taskhandle import TaskHandle

        return TaskHandle(self, task_id, reconnect_timeout=reconnect_timeout)

    def close_thread(self) -> None:
        """Close the calling thread's connection (a thread that ends calls it: ``close``
        closes only its caller's, as closing a socket another thread waits on is unsafe)."""
        self._drop_connection()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self, board: str) -> None:
        """Give back the reference ``create`` took (as a proxy's finalizer does); best effort:
        the board is the manager's for its whole life, a missed decref costs it a count."""
        try:
            conn = open_connection(self._address, self._authkey, min(self.timeout, 5.0))
        except (OrchestratorError, OSError, EOFError):
            return
        try:
            conn.dispatch(None, "decref", (board,))
        except (OrchestratorError, OSError, EOFError, AssertionError, KeyError):
            pass
        finally:
            conn.close()

    def _connect(self) -> None:
        """Ask the manager for its reply board (one connection, closed after)."""
        check_file(self.paths, SOCKET_NAME, stat.S_IFSOCK)  # ours, 0600; the peer is checked on connect
        try:
            conn = open_connection(self._address, self._authkey, self.timeout + 5.0)
            try:
                board, _exposed = conn.dispatch(None, "create", ("replies",))
            finally:
                conn.close()
        except UnsafeStateDir as err:
            raise UnsafeStateDir(f"{self.paths.state_dir}: {err}") from None
        except _AuthenticationError:
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
        with self._lock:
            if self._board is None:
                self._board, board = str(board), None
        if board is not None:  # another thread made one first: ours goes back
            self._release(str(board))

    def _thread_connection(self, limit: float) -> _ClientConnection:
        """This thread's connection to the board (made on first use), bounded for one reply."""
        conn: _ClientConnection | None = getattr(self._tls, "connection", None)
        if conn is not None and self._tls.generation != self._generation:  # made before a renew()
            self._drop_connection()
            conn = None
        if conn is None:
            conn = open_connection(self._address, self._authkey, self.timeout + 5.0)
            try:  # the server gives this connection a thread of its own, named as a proxy names it
                conn.dispatch(None, "accept_connection", (f"{os.getpid()}|{threading.current_thread().name}",))
            except BaseException:
                conn.close()
                raise
            self._tls.connection, self._tls.generation = conn, self._generation
        # The reply may take up to `limit` to come: bound this thread's socket just past it.
        set_timeouts(conn.fileno(), limit + 5.0)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._tls, "connection", None)
        if conn is not None:
            del self._tls.connection
            conn.close()

    def executor(self, pool: str | None = None, **keywords: Any) -> Any:
        """An ``orchestrator.Executor`` whose pool ``pool`` lives in this daemon (made, or
        joined as it runs where the keywords do not conflict: see ``Executor``): it outlives
        this client until ``delete``."""
        from ..executor import Executor

        return Executor(state_dir=self.paths.state_dir, pool=pool, **keywords)

    def call(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """Send one command and wait, bounded, for its reply; raises its typed error."""
        limit = self.timeout if timeout is None else timeout
        if self._board is None:
            self._connect()
        cmd = command(op, args, uuid.uuid4().hex)
        try:  # what the manager server could only refuse is refused here, before it is sent
            encode_frame(cmd, f"the {op} command")
        except FrameTooLarge:  # an InvalidSpec, as the manager server's refusal would be
            raise
        except (TypeError, ValueError):
            pass  # not plain data, or NaN: the manager server answers that, with its words
        try:
            conn = self._thread_connection(limit)
            msg = conn.dispatch(self._board, "call", (cmd, limit))
        except _RemoteError as err:
            self._drop_connection()
            raise ChannelError(f"{op}: the channel refused the command: {err}") from None
        except OrchestratorError:  # a peer of another uid, a failed handshake, a reply that is not plain data
            self._drop_connection()
            raise
        except (OSError, EOFError) as err:
            self._drop_connection()  # it may be mid-message: never reuse it
            if isinstance(err, (BlockingIOError, TimeoutError)):
                raise ChannelError(f"{op}: the daemon did not answer within {limit:g} s") from None
            raise ChannelError(f"{op}: lost the connection to the daemon ({err})") from None
        if msg is None:
            raise ChannelError(f"{op}: no reply from the daemon within {limit:g} s")
        return raise_reply(msg)


__all__ = ["Client", "DEFAULT_TIMEOUT", "SERIALIZER", "socket_address", "read_authkey", "set_timeouts"]
