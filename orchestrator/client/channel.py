"""The command channel: a multiprocess Manager queue on a Unix socket, and the Client.
Client side (the CLI, a user's app): the Client speaks the Manager's protocol with the
standard library (``channelwire.ClientConnection``); the server's end is manager/channelserver.py.

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

The wire both ends share (the socket's address, the auth key, the peer check, the
plain-data unpicklers, the client's end of the Manager protocol) is ``channelwire.py``:
the manager process imports it too, and never this module.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Self, TypeVar

from ..channelwire import (
    DEFAULT_TIMEOUT, AuthenticationError, ClientConnection, ServerError, open_connection, read_authkey, set_timeouts,
    socket_address,
)
from ..errors import (
    AWAY, ChannelError, DaemonNotRunning, FrameTooLarge, OrchestratorError, ShuttingDown, UnknownSession, UnsafeStateDir,
)
from ..paths import SOCKET_NAME, Paths, check_file, check_state_dir, running_pid
from ..protocol import command, encode_frame, raise_reply
from ..verbs import Verbs

if TYPE_CHECKING:
    from .taskhandle import TaskHandle

R = TypeVar("R")


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


# -- the client ------------------------------------------------------------------


class Client(Verbs):
    """Talks to a running daemon over its Manager queue. Thread-safe; every call bounded."""

    def __init__(self, state_dir: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT, authkey: bytes | None = None) -> None:
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

    def task(self, task_id: str, *, reconnect_timeout: float = 30.0) -> TaskHandle:
        """A handle on task ``task_id`` (``<pool>/<n>``, as ``fut.task_id`` and ``submit``
        give it, or ``<pool>/@<key>``: the task that key names) of this daemon, from any process: ``result(timeout)``, ``cancel()``,
        ``future()``, ``info()``. UnknownTask if the daemon has no such task. Its calls
        wait through a restart of the daemon for up to ``reconnect_timeout`` seconds."""
        from .taskhandle import TaskHandle  # here, not above: a command that makes no handle need not load it

        return TaskHandle(self, task_id, reconnect_timeout=reconnect_timeout)

    def close_thread(self) -> None:
        """Close the calling thread's connection (a thread that ends calls it: ``close``
        closes only its caller's, as closing a socket another thread waits on is unsafe)."""
        self._drop_connection()

    def __enter__(self) -> Self:
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
        except AuthenticationError:
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

    def _thread_connection(self, limit: float) -> ClientConnection:
        """This thread's connection to the board (made on first use), bounded for one reply."""
        conn: ClientConnection | None = getattr(self._tls, "connection", None)
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

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
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
        except ServerError as err:
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


__all__ = ["Client", "manager_down"]
