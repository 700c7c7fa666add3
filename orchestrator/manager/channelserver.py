"""The manager server's end of the command channel (client/channel.py has the picture): the
multiprocess Manager, its listener and its connections, with the peer check on accept and
plain-data unpickling. Runs in the manager process (server.py); a client never loads it,
nor multiprocess: ``Client`` speaks the same protocol with the standard library only.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, cast

from multiprocess import connection, managers

from ..channelwire import DEFAULT_TIMEOUT, SERIALIZER, PlainUnpickler, open_connection, peer_uid
from ..errors import ChannelError
from ..paths import user_name


class _ServerConnection(connection.Connection):  # type: ignore[misc, unused-ignore]  # multiprocess: untyped
    """A multiprocess Connection that pickles with the stdlib pickler and unpickles plain
    data only (``PlainUnpickler``). The channel carries only plain data and the Manager's
    own protocol tuples, so dill's pure-Python pickler (many times slower a message than
    the stdlib's C one) buys nothing here."""

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
            return PlainUnpickler(data).load()
        except pickle.UnpicklingError as err:
            raise ChannelError(str(err)) from None


class _PlainListener(connection.Listener):  # type: ignore[misc, unused-ignore]  # multiprocess: untyped
    """The manager server's listener: a peer that is neither our uid nor root is dropped
    on accept, before the auth handshake and before anything it sends is read."""

    refused = 0

    def fileno(self) -> int:
        """The listening socket's fd (to poll it for a queued connection)."""
        return int(self._listener._socket.fileno())

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
                print(f"orchestrator.manager.server: refused a connection from {user_name(uid)}", file=sys.stderr, flush=True)
            raise PermissionError(f"refused a connection from {user_name(uid)}")  # the accepter goes on
        if self._authkey:
            connection.deliver_challenge(conn, self._authkey)
            connection.answer_challenge(conn, self._authkey)
        conn.__class__ = _ServerConnection  # same object, stdlib pickling (no detach() to rewrap)
        return cast(_ServerConnection, conn)


def _client(address: str, family: str | None = None, authkey: bytes | None = None) -> Any:
    """The client half of our serializer, for multiprocess's registry: channelwire.py's
    bounded, peer-checked connection (the manager server itself never connects)."""
    return open_connection(address, authkey or b"", DEFAULT_TIMEOUT)


class ChannelManager(managers.BaseManager):  # type: ignore[misc, unused-ignore]  # multiprocess: untyped
    """Typeids: ``commands`` (the command queue) and ``replies`` (a board keyed by id,
    whose ``call(cmd, timeout)`` puts a command on the queue and waits for its reply: one
    round trip instead of a put and a take)."""


ChannelManager.register("commands")
ChannelManager.register("replies")


def use_plain_pickling() -> None:
    """Teach multiprocess our serializer name (idempotent; called by whoever connects or
    serves, not as a side effect of importing this module)."""
    managers.listener_client.setdefault(SERIALIZER, (_PlainListener, _client))


__all__ = ["ChannelManager", "use_plain_pickling"]
