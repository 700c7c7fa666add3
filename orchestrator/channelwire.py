"""The command channel's wire, shared by its two ends: the client (``client/channel.py``,
in the CLI or a user's app) and the manager server (``manager/channelserver.py``,
``manager/server.py``, in the manager process). Both processes import it, so it imports
only the standard library and shared modules (``errors``, ``paths``).

What is here: the socket's address and the auth key of a state dir; the peer check
(SO_PEERCRED) and the socket time-outs; the plain-data unpicklers; and the client's end
of the multiprocess Manager protocol (``ClientConnection``, ``open_connection``), which
the manager server also names as its serializer's client half.

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
import struct
from pathlib import Path
from typing import Any

from .errors import ChannelError, DaemonNotRunning, UnsafeStateDir
from .paths import AUTHKEY_NAME, SOCKET_NAME, Paths, read_private, user_name

SERIALIZER = "orchestrator"  # the name multiprocess knows our plain-pickling listener and client by
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



def peer_uid(fd: int) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    sock = socket.socket(fileno=fd)
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        sock.detach()
    pid, uid, gid = struct.unpack("3i", creds)
    return int(uid)


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


class AuthenticationError(ChannelError):
    """The handshake failed: the other end does not hold this daemon's auth key."""


class ClientConnection:
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
            raise AuthenticationError("the manager server did not start the handshake")
        self.send_bytes(hmac.new(authkey, message[len(_CHALLENGE):], "md5").digest())
        if self.recv_bytes(_HANDSHAKE_MAX) != _WELCOME:
            raise AuthenticationError("digest sent was rejected")
        challenge = os.urandom(_CHALLENGE_BYTES)
        self.send_bytes(_CHALLENGE + challenge)
        if hmac.compare_digest(self.recv_bytes(_HANDSHAKE_MAX), hmac.new(authkey, challenge, "md5").digest()):
            self.send_bytes(_WELCOME)
        else:
            self.send_bytes(_FAILURE)
            raise AuthenticationError("digest received was wrong")

    def dispatch(self, ident: str | None, method: str, args: tuple[Any, ...] = ()) -> Any:
        """One request, one reply: its result, or the error it carries raised."""
        self.send((ident, method, args, {}))
        kind, result = self.recv()
        if kind == "#RETURN":
            return result
        if kind == "#ERROR" and isinstance(result, BaseException):
            raise result  # e.g. the OSError of a manager refusing a connection at its limits
        # "#TRACEBACK" / "#UNSERIALIZABLE": the server failed on our request
        text = result if isinstance(result, str) else repr(result)
        raise ServerError(text.strip().splitlines()[-1] if text.strip() else kind)


class ServerError(ChannelError):
    """The manager server answered a request with a traceback (its last line here)."""


def open_connection(address: str, authkey: bytes, timeout: float) -> ClientConnection:
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
    conn = ClientConnection(sock.detach())
    try:
        conn.handshake(authkey)
    except BaseException:
        conn.close()
        raise
    return conn



__all__ = [
    "AuthenticationError", "ClientConnection", "DEFAULT_TIMEOUT", "PlainUnpickler", "SERIALIZER", "ServerError",
    "open_connection", "peer_uid", "read_authkey", "set_timeouts", "socket_address",
]
