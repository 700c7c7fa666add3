"""The ``notify`` probe: a replica says it is ready through sd_notify, and nothing is polled.

Run by the daemon, in its loop (``supervision.py`` makes one socket per replica that has a
notify probe; ``orchestrator.worker.ready()`` is the replica's side).

The replica sends ``READY=1`` on the datagram socket named by
``$NOTIFY_SOCKET``, as systemd's sd_notify does; ``NotifySocket`` is one abstract-namespace
socket per replica in the reactor, read without blocking. Abstract sockets have no file
permissions and their names can be guessed, so the sender of each datagram is checked from
its SCM_CREDENTIALS, as systemd does for ``NotifyAccess=``: its uid must be ours or root,
and its pid must pass the socket's ``sender_ok`` check. For a replica that is
``from_replica``: its main process, or a process of its own cgroup (cgroup containment) or
process group (process groups), like ``NotifyAccess=all`` within one unit, so that a
``sh -c '...; systemd-notify --ready'`` wrapper still works while another replica cannot
mark this one ready. A datagram that fails the check is dropped and counted (``refused``;
the first one of each socket is logged). Fds passed along (sd_notify's barrier) are closed
at once.

Across an upgrade a socket carries over as its fd (``detach`` in the old image, ``fd=`` in
the new): same name, same bound socket, so a ``READY=1`` sent meanwhile waits in its queue
for the new image to read.
"""

from __future__ import annotations

import array
import logging
import os
import socket
from typing import Callable, Protocol

from watchdog.cgroup import own_path as _cgroup_of
from watchdog.identity import proc_stat

from ..errors import InvalidSpec

log = logging.getLogger("orchestrator")

_DGRAM_CAP = 4096  # a bigger notify datagram is garbage
_DGRAMS_PER_TURN = 64  # a flood of notify datagrams cannot starve the loop


class Readers(Protocol):
    """What a NotifySocket uses of ``reactor.Reactor``."""

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None: ...
    def remove_reader(self, fd: int) -> None: ...


_UCRED = array.array("I").itemsize * 3  # struct ucred: pid, uid, gid


class NotifySocket:
    """One replica's sd_notify socket: ``AF_UNIX``/``SOCK_DGRAM`` at ``"\\0" + name`` in the
    abstract namespace, in the reactor. Each datagram of newline-separated ``KEY=VALUE``
    becomes ``on_message(name, fields)``; garbage (oversized, not UTF-8, no field),
    datagrams from other users and, with ``sender_ok``, from a pid it refuses are dropped.
    Pick a name nobody can squat (the abstract namespace is shared by the network
    namespace). ``OSError`` if it is taken. ``fd``: the socket already bound to that name,
    handed over by an earlier image of the daemon (``detach``), taken over instead of bound
    anew. ``on_close``: told once when it is closed or detached."""

    def __init__(self, reactor: Readers, on_message: Callable[[str, dict[str, str]], None],
                 name: str, sender_ok: Callable[[int], bool] | None = None, *, fd: int | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        if not name or "\0" in name or len(name.encode()) > 107:
            raise InvalidSpec(f"notify socket name {name!r}: 1..107 bytes, no NUL")
        self.name = name
        self.dropped = 0  # datagrams ignored (garbage, another user, a refused sender)
        self.refused = 0  # of those: from a process sender_ok refused
        self._sender_ok = sender_ok
        self._reactor = reactor
        self._on_message = on_message
        self._on_close = on_close
        if fd is not None:
            sock = socket.socket(fileno=fd)
            try:  # as bound: only what the exec needed is undone
                if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_DGRAM:
                    raise OSError(f"fd {fd} is not a unix datagram socket")
                sock.set_inheritable(False)
                sock.setblocking(False)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                sock.bind("\0" + name)
            except OSError:
                sock.close()
                raise
        self._sock: socket.socket | None = sock
        self._uids = {os.geteuid(), 0}
        self._cmsg = socket.CMSG_SPACE(_UCRED) + socket.CMSG_SPACE(16 * array.array("i").itemsize)
        reactor.add_reader(sock.fileno(), self._readable)

    def env(self) -> dict[str, str]:
        """The replica's environment addition."""
        return {"NOTIFY_SOCKET": "@" + self.name}

    @property
    def closed(self) -> bool:
        return self._sock is None

    def _readable(self) -> None:
        for _ in range(_DGRAMS_PER_TURN):
            if self._sock is None:  # on_message closed us
                return
            try:
                data, anc, flags, _ = self._sock.recvmsg(_DGRAM_CAP, self._cmsg)
            except (BlockingIOError, InterruptedError):
                return
            pid, uid = _take_ancillary(anc)
            fields = None
            if not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) and uid in self._uids:
                fields = _fields(data)
            if fields and self._sender_ok is not None and not (pid and self._sender_ok(pid)):
                self.refused += 1
                if self.refused == 1:
                    log.warning("notify socket %s: dropped %s from pid %s, which is not the replica's (counted, "
                                "not logged again)", self.name, ",".join(sorted(fields)), pid)
                fields = None
            if fields:
                self._on_message(self.name, fields)
            else:
                self.dropped += 1

    def close(self) -> None:
        """Unregister and close. Idempotent."""
        if self._sock is not None:
            self._reactor.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            self._closed()

    def detach(self) -> int:
        """For an upgrade: unregistered, no longer ours, the socket's fd (inheritable, still
        bound and open) for the next image's ``NotifySocket(..., fd=)``; closed from now on."""
        sock = self._sock
        assert sock is not None, "detach of a closed notify socket"
        self._reactor.remove_reader(sock.fileno())
        fd = sock.detach()
        os.set_inheritable(fd, True)
        self._sock = None
        self._closed()
        return fd

    def _closed(self) -> None:
        told, self._on_close = self._on_close, None
        if told is not None:
            told()


def from_replica(pid: int, main_pid: int | None, cgroup: str | None) -> bool:
    """Is ``pid`` the replica's main process ``main_pid``, or one of its processes: in its
    ``cgroup`` (cgroup containment), else in its process group (led by ``main_pid``)? A
    process that is already gone is not (its datagram cannot be told apart from a forgery)."""
    if main_pid is None:
        return False
    if pid == main_pid:
        return True
    if cgroup is not None:
        try:
            return _cgroup_of(pid) == cgroup
        except OSError:
            return False
    st = proc_stat(pid)
    return st is not None and st.pgrp == main_pid


def _take_ancillary(anc: list[tuple[int, int, bytes]]) -> tuple[int | None, int | None]:
    """The sender's (pid, uid); fds passed along (sd_notify's barrier) are closed here."""
    pid = uid = None
    for level, kind, data in anc:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            for fd in fds:
                os.close(fd)
        elif kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED:
            pid, uid, _ = array.array("I", data[:_UCRED])
    return pid, uid


def _fields(data: bytes) -> dict[str, str] | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n"):
        key, eq, value = line.partition("=")
        if eq and key and key.isascii() and key.replace("_", "").isalnum():
            fields[key] = value
    return fields or None
