"""The pools' listening sockets (``--socket``): bound once by the daemon, passed to every replica.

Run by the daemon's loop thread (and the embedded ``Orchestrator``'s). ``Listeners`` owns
every listening socket of the daemon: one per address, opened when a pool declares it
(``open``, called by the declaration's checks, so that a bad address is that command's
one-line error), kept while any pool that is not deleted names it (a reload that keeps an
address keeps the socket, and its queue of pending connections), and closed in the loop
turn in which no pool names it any more. Replicas get dups of them as fds 3, 4, ...
(spawning.py puts them in the ``LaunchPlan``; childsetup.py places them), exactly as
systemd's socket activation passes them, so the listener outlives every replica: while one
is replaced, the kernel queues the connections that arrive and the others accept them.

A daemon started by systemd socket activation adopts the fds it was given (``inherited``,
from ``LISTEN_FDS``/``LISTEN_PID``/``LISTEN_FDNAMES``, read once at start-up): a pool names
one as ``fd:NAME``. They are systemd's, so they are never closed while the daemon runs.

Every fd here is close-on-exec: only a plan's own fds reach a replica, never a probe, a
spawner or another pool's replica.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, MutableMapping

from ..errors import InvalidSpec
from ..listenspec import MAX_SOCKETS, ListenAddress, fdname_ok, parse

if TYPE_CHECKING:
    from .reactor import Reactor

log = logging.getLogger("orchestrator")

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3)
LISTEN_ENV = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
UNIX_MODE = 0o666  # systemd's SocketMode= default: who may connect is the directory's to say


def adopt_inherited(environ: MutableMapping[str, str] = os.environ) -> list[tuple[str, int]]:
    """The fds systemd passed to this process, as (name, fd), as ``sd_listen_fds_with_names``
    reads them: only if ``LISTEN_PID`` is ours; names ``unknown`` when they are missing. The
    variables are removed from ``environ`` (replicas must never see the daemon's), and each
    fd made close-on-exec (systemd passes them inheritable)."""
    values = {k: environ.pop(k, None) for k in LISTEN_ENV}
    try:
        pid, count = int(values["LISTEN_PID"] or ""), int(values["LISTEN_FDS"] or "")
    except ValueError:
        return []
    if pid != os.getpid() or count <= 0:
        return []
    names = (values["LISTEN_FDNAMES"] or "").split(":")
    if len(names) != count:
        names = ["unknown"] * count
    out: list[tuple[str, int]] = []
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:  # closed under us: nothing to hand out
            continue
        out.append((names[i], fd))
    return out


class Listeners:
    """The daemon's listening sockets; see the module docstring."""

    def __init__(self, reactor: Reactor, in_use: Callable[[], set[str]],
                 inherited: Iterable[tuple[str, int]] = ()) -> None:
        """``in_use``: the addresses the table's pools name now (asked when one may have
        become unused); ``inherited``: systemd's fds, (name, fd)."""
        self._reactor = reactor
        self._in_use = in_use
        self._open: dict[str, socket.socket] = {}  # tcp and unix addresses we bound
        self._made: dict[str, tuple[int, int]] = {}  # unix path -> (dev, ino) of the file we made
        self._inherited: dict[str, list[int]] = {}
        for name, fd in inherited:
            self._inherited.setdefault(name, []).append(fd)
        self._sweep_asked = False

    def open(self, addresses: Iterable[str]) -> None:
        """Bind and listen on every one of ``addresses`` not open yet. InvalidSpec (one line)
        if one cannot be: the ones this call opened are closed again, nothing else changes.
        What no pool takes is closed at the end of the turn."""
        opened: list[str] = []
        try:
            for text in addresses:
                addr = parse(text)
                if addr.kind == "fd":
                    if addr.name not in self._inherited:
                        have = ", ".join(sorted(self._inherited)) or "none"
                        raise InvalidSpec(f"socket {text}: the daemon was not passed a socket named "
                                          f"{addr.name!r} (LISTEN_FDNAMES: {have})")
                    continue
                if addr.text not in self._open:
                    self._open[addr.text] = self._bind(addr)
                    opened.append(addr.text)
        except InvalidSpec:
            for text in opened:
                self._close(text)
            raise
        if opened:
            self.changed()

    def fds(self, addresses: Iterable[str], name: str) -> tuple[list[int], list[str]]:
        """The fds of ``addresses``, in order, and their ``LISTEN_FDNAMES`` names: ``name``
        (the pool's, as systemd names a socket unit's fds after the unit) for ours, systemd's
        own for ``fd:NAME`` (every fd it gave that name). InvalidSpec if one is not open."""
        fds: list[int] = []
        names: list[str] = []
        own = name if fdname_ok(name) else "unknown"
        for text in addresses:
            if text.startswith("fd:"):
                got = self._inherited.get(text[3:])
                if not got:
                    raise InvalidSpec(f"socket {text} was not passed to the daemon")
                fds += got
                names += [text[3:]] * len(got)
                continue
            sock = self._open.get(text)
            if sock is None:
                raise InvalidSpec(f"socket {text} is not open")
            fds.append(sock.fileno())
            names.append(own)
        if len(fds) > MAX_SOCKETS:  # systemd may give many fds one name: the spawner takes so many
            raise InvalidSpec(f"{len(fds)} listening sockets for one replica: at most {MAX_SOCKETS}")
        return fds, names

    def carried(self) -> dict[str, Any]:
        """What an upgrade carries: every socket's fd (made inheritable here, just before the exec)."""
        for sock in self._open.values():
            sock.set_inheritable(True)
        for fds in self._inherited.values():
            for fd in fds:
                os.set_inheritable(fd, True)
        return {"open": {text: sock.fileno() for text, sock in self._open.items()},
                "made": {path: list(ident) for path, ident in self._made.items()},
                "inherited": [[name, fd] for name, fds in self._inherited.items() for fd in fds]}

    def take_over(self, carried: Mapping[str, Any]) -> None:
        """The sockets an earlier image of the daemon carried (``carried()``)."""
        for text, fd in carried.get("open", {}).items():
            os.set_inheritable(fd, False)
            self._open[text] = socket.socket(fileno=fd)
        self._made = {path: (int(ident[0]), int(ident[1])) for path, ident in carried.get("made", {}).items()}
        self._inherited = {}
        for name, fd in carried.get("inherited", []):
            os.set_inheritable(fd, False)
            self._inherited.setdefault(name, []).append(fd)

    def addresses(self) -> list[str]:
        """What is bound now (``fd:`` names included)."""
        return sorted(self._open) + [f"fd:{n}" for n in sorted(self._inherited)]

    def changed(self) -> None:
        """A pool's sockets may have changed (declared, replaced, deleted): close what no
        pool names, once this turn's commands are applied."""
        if not self._sweep_asked:
            self._sweep_asked = True
            self._reactor.call_soon(self._sweep)

    def _sweep(self) -> None:
        self._sweep_asked = False
        used = self._in_use()
        for text in [t for t in self._open if t not in used]:
            log.info("socket %s: no pool uses it; closed", text)
            self._close(text)

    def close(self) -> None:
        """Every socket we bound closed (unix files we made removed); systemd's stay open."""
        for text in list(self._open):
            self._close(text)

    # -- one socket ---------------------------------------------------------------------

    def _bind(self, addr: ListenAddress) -> socket.socket:
        if addr.kind == "unix":
            return self._bind_unix(addr)
        family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)  # close-on-exec, as every socket Python makes
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as systemd does
            sock.bind((addr.host, addr.port))
            sock.listen(socket.SOMAXCONN)
        except OSError as err:
            sock.close()
            raise InvalidSpec(self._why(addr, err)) from None
        log.info("socket %s: listening", addr.text)
        return sock

    def _bind_unix(self, addr: ListenAddress) -> socket.socket:
        path = addr.path
        if not path.startswith("\0"):
            where = os.path.dirname(path)
            # No directory is made: a missing one is most likely a typo in the address.
            if not os.path.isdir(where):
                raise InvalidSpec(f"socket {addr.text}: directory {where} does not exist")
            if not os.access(where, os.W_OK | os.X_OK):
                raise InvalidSpec(f"socket {addr.text}: directory {where} is not writable")
            self._clear_stale(addr)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            if not path.startswith("\0"):
                self._made[addr.text] = _chmod_bound(path, UNIX_MODE)
            sock.listen(socket.SOMAXCONN)
        except OSError as err:
            sock.close()
            self._unlink_made(addr.text)
            raise InvalidSpec(self._why(addr, err)) from None
        log.info("socket %s: listening", addr.text)
        return sock

    def _clear_stale(self, addr: ListenAddress) -> None:
        """A socket file left by a process that is gone is removed (nobody accepts on it);
        one that something listens on is in use; anything else is not ours to remove."""
        try:
            st = os.lstat(addr.path)
        except FileNotFoundError:
            return
        except OSError as err:
            raise InvalidSpec(self._why(addr, err)) from None
        if not stat.S_ISSOCK(st.st_mode):
            raise InvalidSpec(f"socket {addr.text}: {addr.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(addr.path)
        except ConnectionRefusedError:
            os.unlink(addr.path)  # stale: nobody listens
            return
        except OSError:
            pass  # BlockingIOError: a full queue is someone listening
        finally:
            probe.close()
        raise InvalidSpec(f"socket {addr.text}: address in use")

    def _why(self, addr: ListenAddress, err: OSError) -> str:
        if err.errno == errno.EADDRINUSE:
            return f"socket {addr.text}: address in use"
        if err.errno == errno.EACCES and addr.kind == "tcp" and addr.port < _unprivileged_port_start():
            return (f"socket {addr.text}: permission denied: a port below {_unprivileged_port_start()} "
                    "needs root or CAP_NET_BIND_SERVICE")
        if err.errno == errno.EADDRNOTAVAIL:
            return f"socket {addr.text}: {addr.host} is not an address of this host"
        return f"socket {addr.text}: {err.strerror or err}"

    def _close(self, text: str) -> None:
        sock = self._open.pop(text, None)
        if sock is not None:
            sock.close()
        self._unlink_made(text)

    def _unlink_made(self, text: str) -> None:
        made = self._made.pop(text, None)
        if made is None:
            return
        path = parse(text).path
        try:  # only the file we made: another may have been put there since
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == made:
                os.unlink(path)
        except OSError:
            pass


def _chmod_bound(path: str, mode: int) -> tuple[int, int]:
    """chmod the socket file bind() just made at ``path``, never what a path swapped in since
    points to: chmod by path follows a symlink that whoever may write the directory put there
    (making another file 0666), and Linux has no lchmod, nor an fchmod that reaches the file
    of a socket. So the name is opened without following it (O_PATH|O_NOFOLLOW), the inode
    checked to be the one bind() made (a socket, ours, with no other name: a file of another
    user, a link or one linked in from elsewhere is not it), and that very inode changed
    through its descriptor. Returns its (dev, ino); OSError (EEXIST) if it is not ours."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise OSError(errno.EEXIST, f"{path} was replaced after it was bound: not changed")
        os.chmod(f"/proc/self/fd/{fd}", mode)  # the inode the fd holds: no name is looked up again
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def _unprivileged_port_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1024


def env_for(fds: list[int], names: list[str]) -> Mapping[str, str]:
    """What a replica with these fds gets in its environment, but for ``LISTEN_PID``, which
    only the child knows (childsetup.py sets it after the fork, before the exec)."""
    return {"LISTEN_FDS": str(len(fds)), "LISTEN_FDNAMES": ":".join(names)}
