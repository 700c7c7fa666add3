"""Readiness and liveness probes: is a replica ready to serve, is it still alive?

A probe spec (``parse``) is one of ``tcp:HOST:PORT``, ``http://127.0.0.1:PORT/PATH``,
``exec:CMD`` or ``notify``. ``run_once`` starts one attempt and reports ``on_result(ok,
reason)`` from the loop; ``Checker`` repeats attempts for liveness, ``retry_until_ready``
for readiness, ``NotifySocket`` receives sd_notify messages. A probe's failure (refused,
timed out, bad status, exit code) is a result with a one-line reason, never an exception.

Nothing here blocks the control loop: every wait is an fd in the reactor's epoll set or a
reactor timer; there are no threads, sleeps, blocking connects, reads or waits.

tcp: a non-blocking socket and ``connect_ex``. The reactor only watches readability, and a
connect completes by turning writable, so each attempt's socket sits in a private epoll
whose own fd the reactor watches (an epoll fd is readable while one of its fds is ready);
``SO_ERROR`` says how the connect ended. Hosts are IP literals or ``localhost``: a name
would need a DNS lookup, which blocks.

http: the tcp connect, then ``GET PATH HTTP/1.0`` sent and the answer read, both as the
socket allows, until the status line is complete (at most 8 KiB); 2xx and 3xx succeed.
Loopback addresses only: a probe checks a replica on this host.

exec: ``os.posix_spawnp`` (no fork of the daemon's memory) in a session of its own, with
an empty signal mask and default dispositions, stdin on /dev/null. Its exit is seen
through a pidfd in the reactor; then, or on timeout, its whole process group is SIGKILLed
(and the leader reaped once its pidfd says it is gone). A replica's probes run in its
``ProbeBox``: in a cgroup killed whole after each attempt (cgroup containment) or recorded
in the watchdog's ledger (process groups), their output in ``logs/<id>.probe``. ``EXEC_PROBES`` maps
the pids of probe processes to their handles, so a SIGCHLD orphan reaper hands such a pid
to ``Handle.exited()`` instead of reaping it blindly.

notify: passive. The replica sends ``READY=1`` on the datagram socket named by
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
"""

from __future__ import annotations

import array
import errno
import ipaddress
import logging
import os
import select
import shlex
import shutil
import signal
import socket
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from watchdog.cgroup import CgroupUnavailable
from watchdog.cgroup import own_path as _cgroup_of
from watchdog.identity import proc_stat

from .errors import InvalidSpec
from .spawner import exit_reason

log = logging.getLogger("orchestrator")

KINDS = ("tcp", "http", "exec", "notify")
_PLACEHOLDERS = ("{slot}", "{port}")
_STATUS_CAP = 8192  # bytes read from an http answer before giving up on its status line
_DGRAM_CAP = 4096  # a bigger notify datagram is garbage
_DGRAMS_PER_TURN = 64  # a flood of notify datagrams cannot starve the loop
_LOOPBACK_NAMES = ("localhost",)
# Dispositions a daemon may have changed (ignored PIPE/XFSZ in any Python) that an exec
# probe must not inherit.
_SIGDEF = tuple(
    int(s)
    for s in (
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGQUIT,
        signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGXFSZ,
    )
)

OnResult = Callable[[bool, "str | None"], None]


class TimerLike(Protocol):
    def cancel(self) -> None: ...


class ReactorLike(Protocol):
    """What probes use of ``reactor.Reactor``."""

    def monotonic(self) -> float: ...
    def add_reader(self, fd: int, callback: Callable[[], None]) -> None: ...
    def remove_reader(self, fd: int) -> None: ...
    def call_soon(self, callback: Callable[[], None]) -> None: ...
    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerLike: ...
    def call_at(self, deadline: float, callback: Callable[[], None]) -> TimerLike: ...


class OSLike(Protocol):
    """What probes use of ``spawner.OSApi``."""

    def pidfd(self, pid: int) -> int: ...
    def reap(self, pid: int) -> int | None: ...
    def signal_group(self, pgid: int, sig: int) -> bool: ...


# -- specs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """One parsed probe. ``text`` is what it was parsed from (``parse(spec.text) == spec``).
    A spec whose text holds ``{slot}``/``{port}`` is a template: its address fields are
    filled (and validated) by ``expand``."""

    kind: str  # tcp, http, exec, notify
    text: str
    host: str = ""  # tcp/http: the host as written (brackets stripped)
    ip: str = ""  # tcp/http: the address connected to (localhost -> 127.0.0.1)
    port: int | None = None
    path: str = ""  # http: path (and query) sent in the request line
    argv: tuple[str, ...] = ()  # exec

    def __str__(self) -> str:
        return self.text

    @property
    def templated(self) -> bool:
        return any(p in self.text for p in _PLACEHOLDERS)

    @property
    def passive(self) -> bool:
        """True for ``notify``: the replica reports, nothing is polled."""
        return self.kind == "notify"

    @property
    def label(self) -> str:
        """How reasons name this probe: ``tcp 127.0.0.1:8100``, the url, ``exec 'cmd'``."""
        if self.kind == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp {host}:{self.port}"
        if self.kind == "exec":
            return f"exec '{self.text[len('exec:'):].strip()}'"
        return self.text

    def expand(self, slot: int, port: int | None) -> ProbeSpec:
        """The spec with ``{slot}`` and ``{port}`` substituted, validated as a whole."""
        if not self.templated:
            return self
        if "{port}" in self.text and port is None:
            raise InvalidSpec(f"probe {self.text!r} uses {{port}} but the pool has no port base")
        text = self.text.replace("{slot}", str(slot))
        if port is not None:
            text = text.replace("{port}", str(port))
        return parse(text)


def parse(text: str, has_port: bool = True) -> ProbeSpec:
    """A ``ProbeSpec`` from its text; ``InvalidSpec`` (one line) for anything else.
    ``has_port=False``: the pool has no port base, so ``{port}`` is refused."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidSpec("empty probe: expected tcp:HOST:PORT, http://127.0.0.1:PORT/PATH, exec:CMD or notify")
    if any(c in text for c in "\r\n\0"):
        raise InvalidSpec(f"probe {text!r}: control characters are not allowed")
    if "{port}" in text and not has_port:
        raise InvalidSpec(f"probe {text!r} uses {{port}} but the pool has no --port-base")
    templated = any(p in text for p in _PLACEHOLDERS)
    if text == "notify":
        return ProbeSpec("notify", text)
    if text.startswith("tcp:"):
        host, port = _split_host_port(text, text[len("tcp:"):], default_port=None)
        # Literal parts are checked now; parts with a placeholder once expanded.
        ip = _address(text, host) if _literal(host) else ""
        num = _port(text, port) if _literal(port) else None
        if templated:
            return ProbeSpec("tcp", text)
        return ProbeSpec("tcp", text, host=host, ip=ip, port=num)
    if text.startswith("http://"):
        rest = text[len("http://"):]
        netloc, slash, path = rest.partition("/")
        path = slash + path if slash else "/"
        if any(c <= " " or c == "\x7f" for c in path):
            raise InvalidSpec(f"probe {text!r}: the path must not contain spaces or control characters")
        if "@" in netloc:
            raise InvalidSpec(f"probe {text!r}: http probes are loopback only (no user info)")
        host, port = _split_host_port(text, netloc, default_port="80")
        ip = ""
        if _literal(host):
            ip = _address(text, host, loopback_only=True)
            if not _is_loopback(ip):
                raise InvalidSpec(
                    f"probe {text!r}: http probes are loopback only (127.0.0.0/8, localhost, [::1])"
                )
        num = _port(text, port) if _literal(port) else None
        if templated:
            return ProbeSpec("http", text)
        return ProbeSpec("http", text, host=host, ip=ip, port=num, path=path)
    if text.startswith("exec:"):
        try:
            argv = tuple(shlex.split(text[len("exec:"):]))
        except ValueError as err:
            raise InvalidSpec(f"probe {text!r}: {err}") from None
        if not argv:
            raise InvalidSpec(f"probe {text!r}: no command after exec:")
        return ProbeSpec("exec", text, argv=() if templated else argv)
    if text.startswith(("https://", "http:")):
        raise InvalidSpec(f"probe {text!r}: only plain http://127.0.0.1:PORT/PATH is supported")
    raise InvalidSpec(
        f"unknown probe {text!r}: expected tcp:HOST:PORT, http://127.0.0.1:PORT/PATH, exec:CMD or notify"
    )


def _split_host_port(text: str, netloc: str, default_port: str | None) -> tuple[str, str]:
    """(host without brackets, port text) of ``HOST:PORT``, ``[V6]:PORT`` or, with a
    default port, a bare host."""
    if netloc.startswith("["):
        host, bracket, after = netloc[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise InvalidSpec(f"probe {text!r}: bad address {netloc!r}")
        port = after[1:] if after else default_port
    elif ":" in netloc:
        host, _, port = netloc.rpartition(":")
        if default_port is not None and ":" in host:
            raise InvalidSpec(f"probe {text!r}: an IPv6 address needs brackets, as in [::1]")
    else:
        host, port = netloc, default_port
    if not host or port is None or port == "":
        raise InvalidSpec(f"probe {text!r}: expected HOST:PORT")
    if _strip_placeholders(port) and not _strip_placeholders(port).isdigit():
        raise InvalidSpec(f"probe {text!r}: port {port!r} is not a number")
    return host, port


def _strip_placeholders(s: str) -> str:
    for p in _PLACEHOLDERS:
        s = s.replace(p, "")
    return s


def _literal(s: str) -> bool:
    return not any(p in s for p in _PLACEHOLDERS)


def _port(text: str, port: str) -> int:
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidSpec(f"probe {text!r}: port must be 1..65535, not {port}")
    return int(port)


def _address(text: str, host: str, loopback_only: bool = False) -> str:
    """The IP to connect to: an IP literal, or localhost. No DNS (it would block)."""
    if host in _LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        if loopback_only:
            raise InvalidSpec(
                f"probe {text!r}: http probes are loopback only (127.0.0.0/8, localhost, [::1])"
            ) from None
        raise InvalidSpec(
            f"probe {text!r}: host must be an IP address or localhost (the control loop does no DNS lookups)"
        ) from None


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if addr.version == 4:
        return addr in ipaddress.ip_network("127.0.0.0/8")
    return addr == ipaddress.ip_address("::1")


def _seconds(s: float) -> str:
    return f"{s:g}"


# -- one attempt --------------------------------------------------------------------------


class Handle:
    """One probe attempt. ``on_result`` is called exactly once from the loop, unless
    ``cancel()`` came first. ``active`` stays true while the attempt still holds an fd or
    an unreaped process (a killed exec probe is reaped when its pidfd says it is gone)."""

    pid: int | None = None

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, timeout: float, on_result: OnResult) -> None:
        self.spec = spec
        self.done = False  # a result was delivered or the attempt was cancelled
        self.reason: str | None = None
        self._reactor = reactor
        self._on_result = on_result
        self._timeout = timeout
        self._timer = reactor.call_later(timeout, self._timed_out)

    @property
    def active(self) -> bool:
        return False

    def cancel(self) -> None:
        """No result will be reported; sockets closed, a probe process killed (and reaped
        as soon as it is gone). Idempotent."""
        if not self.done:
            self.done = True
            self._timer.cancel()
            self._release()

    def exited(self) -> None:
        """For a SIGCHLD reaper: an exec probe's process exited; reap it and report. Other
        kinds: nothing. Idempotent."""

    def _release(self) -> None:
        """Give back fds (and kill a process); subclasses."""

    def _finish(self, ok: bool, reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        self.reason = reason
        self._timer.cancel()
        self._release()
        self._on_result(ok, reason)

    def _finish_soon(self, ok: bool, reason: str | None) -> None:
        """A result known at once still reaches ``on_result`` from the loop, not from
        inside ``run_once``; a cancel() before then drops it."""
        self._reactor.call_soon(lambda: self._finish(ok, reason))

    def _timed_out(self) -> None:
        self._finish(False, f"{self.spec.label}: timed out after {_seconds(self._timeout)} s")


class _SocketHandle(Handle):
    """tcp and http: a non-blocking socket in a private epoll watched by the reactor."""

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, timeout: float, on_result: OnResult) -> None:
        super().__init__(spec, reactor, timeout, on_result)
        self._sock: socket.socket | None = None
        self._ep: select.epoll | None = None
        self._out = b""
        self._in = bytearray()
        self._connected = False
        if spec.kind == "http":
            host = f"[{spec.host}]" if ":" in spec.host else spec.host
            self._out = (
                f"GET {spec.path} HTTP/1.0\r\nHost: {host}:{spec.port}\r\n"
                "User-Agent: orchestrator-probe\r\nConnection: close\r\n\r\n"
            ).encode("ascii", "replace")
        family = socket.AF_INET6 if ":" in spec.ip else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        except OSError as err:  # EMFILE and the like: a failed attempt
            self._finish_soon(False, f"{self.spec.label}: {_strerror(err.errno)}")
            return
        self._sock = sock
        err = sock.connect_ex((spec.ip, spec.port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self._release()
            self._finish_soon(False, f"{self.spec.label}: {_strerror(err)}")
            return
        try:
            self._ep = select.epoll(2)
        except OSError as e:
            self._release()
            self._finish_soon(False, f"{self.spec.label}: {_strerror(e.errno)}")
            return
        self._ep.register(sock.fileno(), select.EPOLLOUT)
        reactor.add_reader(self._ep.fileno(), self._ready)

    @property
    def active(self) -> bool:
        return self._sock is not None

    def _ready(self) -> None:
        if self.done or self._ep is None or self._sock is None:
            return
        events = self._ep.poll(0)
        if not events:
            return
        mask = events[0][1]
        sock = self._sock
        if not self._connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._finish(False, f"{self.spec.label}: {_strerror(err)}")
                return
            if not mask & (select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP):
                return
            self._connected = True
            if self.spec.kind == "tcp":
                self._finish(True, None)
                return
        if self._out:
            try:
                sent = sock.send(self._out)
            except BlockingIOError:
                return
            except OSError as err:
                self._finish(False, f"{self.spec.label}: {_strerror(err.errno)}")
                return
            self._out = self._out[sent:]
            if not self._out:
                self._ep.modify(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            return
        try:
            chunk = sock.recv(_STATUS_CAP - len(self._in))
        except BlockingIOError:
            return
        except OSError as err:
            self._finish(False, f"{self.spec.label}: {_strerror(err.errno)}")
            return
        self._in += chunk
        line, newline, _ = bytes(self._in).partition(b"\n")
        if newline:
            self._finish(*_http_status(self.spec.label, line))
        elif not chunk:
            self._finish(False, f"{self.spec.label}: connection closed before a status line")
        elif len(self._in) >= _STATUS_CAP:
            self._finish(False, f"{self.spec.label}: no status line in the first {_STATUS_CAP} bytes")

    def _release(self) -> None:
        if self._ep is not None:
            self._reactor.remove_reader(self._ep.fileno())
            self._ep.close()
            self._ep = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _http_status(where: str, line: bytes) -> tuple[bool, str | None]:
    parts = line.strip().split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit() or len(parts[1]) != 3:
        shown = line.strip()[:60].decode("ascii", "replace")
        return False, f"{where}: bad status line {shown!r}"
    code = int(parts[1])
    if 200 <= code < 400:
        return True, None
    return False, f"{where}: status {code}"


def _strerror(err: int | None) -> str:
    if err == errno.ECONNREFUSED:
        return "connection refused"
    text = os.strerror(err) if err else "unknown error"
    return text[:1].lower() + text[1:]


EXEC_PROBES: dict[int, Handle] = {}
"""pid -> handle of every exec probe process not reaped yet. The daemon's SIGCHLD orphan
reaper calls ``EXEC_PROBES[pid].exited()`` for such a pid instead of reaping it itself."""


class ProbeBox:
    """Where one replica's exec probes run and write, made by its first exec attempt.

    * containment: with cgroups, every attempt runs in the cgroup ``replicas/<id>.probe``
      (joined by a ``/bin/sh`` wrapper before the probe's own command runs: posix_spawn
      cannot place a child in a cgroup), killed whole when the attempt ends, times out or
      is cancelled, so a background child, even one that left the probe's session, goes
      with it. The cgroup is registered with the watchdog and lies under ``replicas/``,
      so a dead daemon's watchdog, and the next start's recovery, kill it whole like a
      replica's. With process groups, each attempt's group is killed as before, and the
      attempt is recorded in the watchdog's ledger (``worker`` with its group) while it
      runs;
    * output: the probe's stdout and stderr go to one more captured stream of the replica,
      ``logs/<id>.probe``, rotated like its ``.out`` and ``.err`` (``LogCapture``); without
      a capture, to /dev/null. Never to the daemon's own log.

    ``close()`` (the replica ended) kills and removes the cgroup and finishes the stream."""

    def __init__(self, replica_id: str, containment: Any, watchdog: Any = None, capture: Any = None) -> None:
        self.replica_id = replica_id
        self.cgroup: str | None = None
        self.closed = False
        self._containment, self._watchdog, self._capture = containment, watchdog, capture
        self._stream: Any = None
        self._recorded: set[int] = set()

    def prepare(self) -> tuple[str | None, int | None]:
        """(cgroup dir to join or None, fd for stdout and stderr or None) for an attempt
        about to start. OSError, CgroupUnavailable or ValueError: it cannot start."""
        if self.closed:
            raise OSError(errno.ESHUTDOWN, "the replica has ended")
        if self.cgroup is None and getattr(self._containment, "path", None) is not None:
            self.cgroup = self._containment.prepare_probe(self.replica_id)
            if self._watchdog is not None:
                self._watchdog.add_cgroup(self.cgroup)
        if self._stream is None and self._capture is not None:
            self._stream = self._capture.open_stream(self.replica_id, "probe")
        return self.cgroup, self._stream.w if self._stream is not None else None

    def spawned(self, pid: int) -> None:
        if self.cgroup is None and self._watchdog is not None:
            from watchdog.identity import start_time

            start = start_time(pid)  # our unreaped child: the number is pinned
            if start is not None:
                self._watchdog.add(pid, start, pid, "worker", f"probe of {self.replica_id}")
                self._recorded.add(pid)

    def ended(self) -> None:
        """An attempt ended (exited, timed out, cancelled): what it left goes."""
        if self.cgroup is not None and not self.closed:
            self._containment.kill(self.cgroup)

    def reaped(self, pid: int) -> None:
        if pid in self._recorded:
            self._recorded.discard(pid)
            self._watchdog.remove(pid)

    def close(self) -> None:
        """The replica ended: kill and (once empty) remove the cgroup; finish the output."""
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            self._stream.finish()
            self._stream = None
        path = self.cgroup
        if path is None:
            return
        self._containment.kill(path)

        def removed(empty: bool) -> None:
            status = self._containment.remove(path)
            if status in ("removed", "missing"):
                if self._watchdog is not None:
                    self._watchdog.remove_cgroup(path)
            else:  # still registered: the watchdog or a clean stop gets it
                log.error("cannot remove the probe cgroup %s: %s", path, status)

        self._containment.watch_empty(path, removed)


# Runs the probe in a cgroup: a shell joins it ("0" moves the writer) and execs the command.
# If it cannot, the shell's message is in the probe's output and the attempt fails.
_JOIN = 'echo 0 >"$0" || exit 125; exec "$@"'


class _ExecHandle(Handle):
    """exec: a posix_spawn'ed process in its own session, watched through a pidfd."""

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, timeout: float,
                 on_result: OnResult, env: dict[str, str] | None, box: ProbeBox | None = None) -> None:
        super().__init__(spec, reactor, timeout, on_result)
        self._os = os_api
        self._box = box
        self._pidfd: int | None = None
        self.pid = None
        env = dict(os.environ if env is None else env)
        argv = list(spec.argv)
        out: tuple = (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)
        err: tuple = (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)
        try:
            if box is not None:
                cgroup, fd = box.prepare()
                if fd is not None:
                    out, err = (os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, fd, 2)
                if cgroup is not None:
                    # Found here, as posix_spawnp would, so a missing command still fails
                    # to start rather than as the wrapper's exit 127.
                    found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
                    if found is None:
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
                    argv = ["/bin/sh", "-c", _JOIN, os.path.join(cgroup, "cgroup.procs"), found, *argv[1:]]
            pid = os.posix_spawnp(
                argv[0], argv, env,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), out, err],
                setsid=True, setsigmask=(), setsigdef=_SIGDEF,
            )
        except (OSError, ValueError, CgroupUnavailable) as err_:  # not found, EAGAIN, no cgroup: a failed attempt
            why = _strerror(err_.errno) if isinstance(err_, OSError) else str(err_)
            self._finish_soon(False, f"{spec.label}: could not start: {why}")
            return
        self.pid = pid
        EXEC_PROBES[pid] = self
        if box is not None:
            box.spawned(pid)
        try:
            self._pidfd = os_api.pidfd(pid)
        except OSError as err_:  # EMFILE: it must not run unwatched
            os_api.signal_group(pid, signal.SIGKILL)
            self._kill_leftovers()
            self._reap()  # our child, SIGKILLed: its wait is short
            self._finish_soon(False, f"{spec.label}: could not watch it: {_strerror(err_.errno)}")
            return
        reactor.add_reader(self._pidfd, self.exited)

    @property
    def active(self) -> bool:
        return self.pid in EXEC_PROBES

    def exited(self) -> None:
        """Only once the process has exited (its pidfd is readable, or waitid said so)."""
        if not self.active:
            return
        pid = self.pid
        assert pid is not None
        # The leader is a zombie: its pid (and group id) are pinned, so the group signal
        # cannot go astray. Whatever the probe left running in its group goes with it.
        self._os.signal_group(pid, signal.SIGKILL)
        self._kill_leftovers()
        code = self._reap()
        if code is None:
            self._finish(False, f"{self.spec.label}: exit status lost (reaped elsewhere)")
        elif code == 0:
            self._finish(True, None)
        else:
            self._finish(False, f"{self.spec.label}: {exit_reason(code)}")

    def _kill_leftovers(self) -> None:
        if self._box is not None:
            self._box.ended()

    def _reap(self) -> int | None:
        pid = self.pid
        assert pid is not None
        if self._pidfd is not None:
            self._reactor.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        EXEC_PROBES.pop(pid, None)
        code = self._os.reap(pid)
        if self._box is not None:
            self._box.reaped(pid)
        return code

    def _release(self) -> None:
        # Result delivered after a reap: nothing left. Timed out or cancelled: kill the
        # group (and the probe's cgroup) now; the pidfd stays in the reactor until the
        # leader is gone, then exited() reaps it (self.done keeps that from reporting).
        if self.active:
            self._os.signal_group(self.pid, signal.SIGKILL)  # type: ignore[arg-type]
            self._kill_leftovers()


def _check_active(spec: ProbeSpec) -> None:
    if spec.templated:
        raise InvalidSpec(f"probe {spec.text!r} has {{slot}}/{{port}}: expand it first")
    if spec.passive:
        raise InvalidSpec("a notify probe is not polled: the replica reports through NotifySocket")


def run_once(spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, *, timeout: float,
             on_result: OnResult, env: dict[str, str] | None = None, box: ProbeBox | None = None) -> Handle:
    """Start one attempt of an active probe (tcp, http, exec); ``on_result(ok, reason)``
    is called once from the loop, never from inside this call. ``env``: the whole
    environment of an exec probe (default: ours); ``box``: where it runs and writes
    (``ProbeBox``; without one: process group only, output to /dev/null). ``InvalidSpec`` for a template that was
    not expanded or for ``notify`` (passive: see ``NotifySocket``)."""
    _check_active(spec)
    if timeout <= 0:
        raise ValueError(f"probe timeout must be positive, not {timeout}")
    if spec.kind == "exec":
        return _ExecHandle(spec, reactor, os_api, timeout, on_result, env, box)
    return _SocketHandle(spec, reactor, timeout, on_result)


# -- repeated attempts --------------------------------------------------------------------


class Checker:
    """Liveness: one attempt every ``interval`` seconds (the first ``interval`` after the
    start, the next only after the previous result), ``on_fail(reason)`` once after
    ``failures`` misses in a row, then no more attempts. A success resets the count."""

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, interval: float,
                 failures: int, timeout: float, on_fail: Callable[[str], None],
                 env: dict[str, str] | None = None, box: ProbeBox | None = None) -> None:
        _check_active(spec)
        if interval <= 0 or timeout <= 0 or failures < 1:
            raise ValueError("a liveness check needs interval > 0, timeout > 0 and failures >= 1")
        self.spec, self.interval, self.failures, self.timeout = spec, interval, failures, timeout
        self.misses = 0  # consecutive
        self.attempts = 0  # finished ones
        self.last_reason: str | None = None
        self.stopped = False
        self._reactor, self._os, self._env, self._on_fail, self._box = reactor, os_api, env, on_fail, box
        self._handle: Handle | None = None
        self._started = reactor.monotonic()
        self._timer: TimerLike | None = reactor.call_later(interval, self._attempt)

    def _attempt(self) -> None:
        self._timer = None
        self._started = self._reactor.monotonic()
        self._handle = run_once(self.spec, self._reactor, self._os, timeout=self.timeout,
                                on_result=self._result, env=self._env, box=self._box)

    def _result(self, ok: bool, reason: str | None) -> None:
        self._handle = None
        self.attempts += 1
        if ok:
            self.misses = 0
        else:
            self.misses += 1
            self.last_reason = reason
            if self.misses >= self.failures:
                self.stopped = True
                self._on_fail(reason or "probe failed")
                return
        self._timer = self._reactor.call_at(max(self._reactor.monotonic(), self._started + self.interval),
                                            self._attempt)

    def stop(self) -> None:
        """No more attempts; one in flight is cancelled. Idempotent."""
        self.stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _ReadyWait(Handle):
    """retry_until_ready's handle: attempts every ``period`` until one succeeds or the
    deadline passes. ``pid`` is that of the exec attempt in flight, if any."""

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, period: float,
                 attempt_timeout: float, deadline_s: float, on_ready: Callable[[], None],
                 on_timeout: Callable[[str], None], env: dict[str, str] | None,
                 box: ProbeBox | None = None) -> None:
        self.spec = spec
        self._box = box
        self.done = False
        self.reason = None
        self.attempts = 0  # finished ones
        self.last_reason: str | None = None
        self._reactor, self._os, self._env = reactor, os_api, env
        self._period, self._attempt_timeout, self._deadline_s = period, attempt_timeout, deadline_s
        self._on_ready, self._on_timeout = on_ready, on_timeout
        self._deadline = reactor.monotonic() + deadline_s
        self._timer = reactor.call_at(self._deadline, self._expired)  # Handle.cancel() cancels it
        self._retry: TimerLike | None = None
        self._attempt_handle: Handle | None = None
        self._attempt()

    @property
    def pid(self) -> int | None:  # type: ignore[override]
        return self._attempt_handle.pid if self._attempt_handle is not None else None

    @property
    def active(self) -> bool:
        return not self.done

    def _attempt(self) -> None:
        self._retry = None
        left = self._deadline - self._reactor.monotonic()
        self._attempt_handle = run_once(self.spec, self._reactor, self._os,
                                        timeout=max(0.001, min(self._attempt_timeout, left)),
                                        on_result=self._result, env=self._env, box=self._box)

    def _result(self, ok: bool, reason: str | None) -> None:
        self._attempt_handle = None
        self.attempts += 1
        if ok:
            self.done = True
            self._timer.cancel()
            self._on_ready()
            return
        self.last_reason = reason
        self._retry = self._reactor.call_later(self._period, self._attempt)

    def _expired(self) -> None:
        last = self.last_reason or f"{self.spec.label}: no answer yet"
        self._finish_timeout(f"not ready within {_seconds(self._deadline_s)} s (last: {last})")

    def _finish_timeout(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.reason = reason
        self._release()
        self._on_timeout(reason)

    def _release(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._attempt_handle is not None:
            self._attempt_handle.cancel()
            self._attempt_handle = None


def retry_until_ready(spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, *, period: float = 0.2,
                      attempt_timeout: float = 1.0, deadline_s: float, on_ready: Callable[[], None],
                      on_timeout: Callable[[str], None], env: dict[str, str] | None = None,
                      box: ProbeBox | None = None) -> Handle:
    """Readiness: attempt now, then ``period`` after each failure, until a success
    (``on_ready()``) or ``deadline_s`` from now (``on_timeout("not ready within S s (last:
    <reason>)")``). Exactly one of the two is called, from the loop, unless cancelled."""
    _check_active(spec)
    if period <= 0 or attempt_timeout <= 0 or deadline_s <= 0:
        raise ValueError("readiness needs period, attempt_timeout and deadline_s > 0")
    return _ReadyWait(spec, reactor, os_api, period, attempt_timeout, deadline_s, on_ready, on_timeout, env, box)


# -- notify -------------------------------------------------------------------------------


_UCRED = array.array("I").itemsize * 3  # struct ucred: pid, uid, gid


class NotifySocket:
    """One replica's sd_notify socket: ``AF_UNIX``/``SOCK_DGRAM`` at ``"\\0" + name`` in the
    abstract namespace, in the reactor. Each datagram of newline-separated ``KEY=VALUE``
    becomes ``on_message(name, fields)``; garbage (oversized, not UTF-8, no field),
    datagrams from other users and, with ``sender_ok``, from a pid it refuses are dropped.
    Pick a name nobody can squat (the abstract namespace is shared by the network
    namespace). ``OSError`` if it is taken."""

    def __init__(self, reactor: ReactorLike, on_message: Callable[[str, dict[str, str]], None],
                 name: str, sender_ok: Callable[[int], bool] | None = None) -> None:
        if not name or "\0" in name or len(name.encode()) > 107:
            raise InvalidSpec(f"notify socket name {name!r}: 1..107 bytes, no NUL")
        self.name = name
        self.dropped = 0  # datagrams ignored (garbage, another user, a refused sender)
        self.refused = 0  # of those: from a process sender_ok refused
        self._sender_ok = sender_ok
        self._reactor = reactor
        self._on_message = on_message
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
