"""Readiness and liveness probes run by the daemon: is a replica ready, is it still alive?

Run by the daemon, in its loop. What a probe is (``parse``, ``ProbeSpec``): probespec.py.
``run_once`` starts one attempt of an active probe (tcp, http, exec) and reports
``on_result(ok, reason)`` from the loop; ``Checker`` repeats attempts for liveness,
``retry_until_ready`` for readiness. The passive ``notify`` probe is notify.py's
``NotifySocket``; where a replica's exec probes run and write, probebox.py's ``ProbeBox``.
The names of those three modules that the daemon uses are also importable from here. A
probe's failure (refused, timed out, bad status, exit code) is a result with a one-line
reason, never an exception.

Nothing here blocks the control loop: every wait is an fd in the reactor's epoll set or a
reactor timer; there are no threads, sleeps, blocking connects, reads or waits. Every
attempt is bounded by its timeout (``probe_timeout``).

tcp: a non-blocking socket and ``connect_ex``. The reactor only watches readability, and a
connect completes by turning writable, so each attempt's socket sits in a private epoll
whose own fd the reactor watches (an epoll fd is readable while one of its fds is ready);
``SO_ERROR`` says how the connect ended.

http: the tcp connect, then HTTP/1.1 by ``h11`` (sans-IO: it builds the request and parses
the answer, never touching the socket): ``GET PATH`` with ``Connection: close`` sent and the
answer read, both as the socket allows, until h11 has the response's head (one still
incomplete past 8 KiB is refused); 2xx and 3xx succeed, an informational 1xx is passed over, the body is never read. A server
that closes right after its status line, without the blank line that ends a head, is still
judged by that status (the head is ended for it), as before h11.

exec: ``os.posix_spawnp`` (no fork of the daemon's memory) in a session of its own, with
an empty signal mask and default dispositions, stdin on /dev/null. Its exit is seen
through a pidfd in the reactor; then, or on timeout, its whole process group is SIGKILLed
(and the leader reaped once its pidfd says it is gone). A replica's probes run in its
``ProbeBox``: in a cgroup killed whole after each attempt (cgroup containment) or recorded
in the watchdog's ledger (process groups), their output in ``logs/<id>.probe``.
``EXEC_PROBES`` maps the pids of probe processes to their handles, so a SIGCHLD orphan
reaper hands such a pid to ``Handle.exited()`` instead of reaping it blindly.
"""

from __future__ import annotations

import errno
import functools
import os
import select
import shutil
import signal
import socket
from typing import Any, Callable, Mapping, Protocol, TypedDict

import h11

from watchdog.cgroup import CgroupUnavailable

from ..errors import InvalidSpec
from ..probespec import ProbeSpec
from ..states import exit_reason
from .probebox import ProbeBox

__all__ = ["Handle", "EXEC_PROBES", "run_once", "Checker", "retry_until_ready"]

_HEAD_CAP = 8192  # bytes of an http answer's head still incomplete; beyond, it is refused
_USER_AGENT = "orchestrator-probe"
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
    """What probes use of ``osapi.OSApi``."""

    def pidfd(self, pid: int) -> int: ...
    def reap(self, pid: int) -> int | None: ...
    def signal_group(self, pgid: int, sig: int) -> bool: ...


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
    """tcp and http: a non-blocking socket in a private epoll watched by the reactor; for
    http, an ``h11`` client connection that frames what is sent and parses what comes."""

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, timeout: float, on_result: OnResult) -> None:
        super().__init__(spec, reactor, timeout, on_result)
        self._sock: socket.socket | None = None
        self._ep: select.epoll | None = None
        self._http: h11.Connection | None = None
        self._out = b""
        self._first = b""  # the answer's first bytes, to quote in a reason
        self._connected = False
        if spec.kind == "http":
            self._http = h11.Connection(h11.CLIENT, max_incomplete_event_size=_HEAD_CAP)
            self._out = (self._http.send(_request(spec)) or b"") + (self._http.send(h11.EndOfMessage()) or b"")
        family = socket.AF_INET6 if ":" in spec.ip else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        except OSError as e:  # EMFILE and the like: a failed attempt
            self._finish_soon(False, f"{self.spec.label}: {_strerror(e.errno)}")
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
            if self._http is None:  # tcp: connected is all it asks
                self._finish(True, None)
                return
        if self._out:
            try:
                sent = sock.send(self._out, socket.MSG_NOSIGNAL)
            except BlockingIOError:
                return
            except OSError as e:
                self._finish(False, f"{self.spec.label}: {_strerror(e.errno)}")
                return
            self._out = self._out[sent:]
            if not self._out:
                self._ep.modify(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            return
        try:
            chunk = sock.recv(_HEAD_CAP)
        except BlockingIOError:
            return
        except OSError as e:
            self._finish(False, f"{self.spec.label}: {_strerror(e.errno)}")
            return
        self._answer(chunk)

    def _answer(self, chunk: bytes) -> None:
        """Feed h11 what came (b"": the server closed); finish once it has a response head
        or an error."""
        conn = self._http
        assert conn is not None
        if len(self._first) < 64:
            self._first += chunk[:64]
        pending = bool(conn.trailing_data[0])  # the start of a head h11 is waiting to complete
        if not chunk and pending and conn.their_state is h11.SEND_RESPONSE:
            conn.receive_data(b"\r\n")  # closed after its status line: end the head for it
        conn.receive_data(chunk)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as err:
                why = self._bad_answer(err) if chunk or pending else "connection closed before a status line"
                self._finish(False, f"{self.spec.label}: {why}")
                return
            if isinstance(event, h11.Response):
                code = event.status_code
                self._finish(*((True, None) if 200 <= code < 400 else (False, f"{self.spec.label}: status {code}")))
                return
            if event is h11.NEED_DATA:
                return
            if isinstance(event, h11.ConnectionClosed):
                self._finish(False, f"{self.spec.label}: connection closed before a status line")
                return
            # an InformationalResponse (1xx): the final answer follows

    def _bad_answer(self, err: h11.RemoteProtocolError) -> str:
        if err.error_status_hint == 431:
            return f"no complete response head in the first {_HEAD_CAP} bytes"
        line = self._first.partition(b"\n")[0].strip()
        if not line.startswith(b"HTTP/") or str(err).startswith("illegal status line"):
            return f"bad status line {line[:60].decode('ascii', 'replace')!r}"
        return f"bad response: {err}"

    def _release(self) -> None:
        if self._ep is not None:
            self._reactor.remove_reader(self._ep.fileno())
            self._ep.close()
            self._ep = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


@functools.lru_cache(maxsize=1024)
def _request(spec: ProbeSpec) -> h11.Request:
    """The request of an http probe: the same every attempt, and building it (h11 checks
    and normalises the headers) is a quarter of h11's cost of one, so it is built once."""
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    return h11.Request(method="GET", target=spec.path.encode("ascii", "replace"),
                       headers=[("Host", f"{host}:{spec.port}"), ("User-Agent", _USER_AGENT), ("Connection", "close")])


def _strerror(err: int | None) -> str:
    if err == errno.ECONNREFUSED:
        return "connection refused"
    text = os.strerror(err) if err else "unknown error"
    return text[:1].lower() + text[1:]


EXEC_PROBES: dict[int, Handle] = {}
"""pid -> handle of every exec probe process not reaped yet. The daemon's SIGCHLD orphan
reaper calls ``EXEC_PROBES[pid].exited()`` for such a pid instead of reaping it itself."""


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
        out: tuple[int, ...] | tuple[int, int, str, int, int] = (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)
        err: tuple[int, ...] | tuple[int, int, str, int, int] = (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)
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


class ReadyCarried(TypedDict):
    """A readiness wait as an upgrade carries it (``ReadyWait.carried``, JSON)."""

    deadline: float  # monotonic: the same clock in the next image (same boot)
    next: float | None  # when its next attempt is due; None: now
    attempts: int  # finished ones
    last: str | None  # what the last one said


class ReadyWait(Handle):
    """retry_until_ready's handle: attempts every ``period`` until one succeeds or the
    deadline passes. ``pid`` is that of the exec attempt in flight, if any."""

    def __init__(self, spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, period: float,
                 attempt_timeout: float, deadline_s: float, on_ready: Callable[[], None],
                 on_timeout: Callable[[str], None], env: dict[str, str] | None,
                 box: ProbeBox | None = None, carried: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self._box = box
        self.done = False
        self.reason = None
        self.attempts = 0  # finished ones
        self.last_reason: str | None = None
        self._reactor, self._os, self._env = reactor, os_api, env
        self._period, self._attempt_timeout, self._deadline_s = period, attempt_timeout, deadline_s
        self._on_ready, self._on_timeout = on_ready, on_timeout
        now = reactor.monotonic()
        first: float | None = now
        self._deadline = now + deadline_s
        if carried is not None:  # an earlier image's wait, going on: its deadline, its next attempt
            self._deadline = float(carried["deadline"])
            self.attempts = int(carried.get("attempts") or 0)
            self.last_reason = carried.get("last")
            first = now if carried.get("next") is None else max(now, float(carried["next"]))
            if first >= self._deadline:
                first = None  # over before its next attempt: only the expiry is left
        self._timer = reactor.call_at(self._deadline, self._expired)  # Handle.cancel() cancels it
        self._retry: TimerLike | None = None
        self._next_at: float | None = None  # when the attempt that _retry starts is due
        self._attempt_handle: Handle | None = None
        if first == now:
            self._attempt()
        elif first is not None:
            self._retry_at(first)

    @property
    def pid(self) -> int | None:  # type: ignore[override]
        return self._attempt_handle.pid if self._attempt_handle is not None else None

    @property
    def active(self) -> bool:
        return not self.done

    def carried(self) -> ReadyCarried:
        """Where this wait stands, for an upgrade's next image (``retry_until_ready(...,
        carried=)``): its deadline, when its next attempt is due (None: now; an attempt in
        flight is cut short by the exec and made again at once) and what the attempts said."""
        return {"deadline": self._deadline, "next": self._next_at if self._retry is not None else None,
                "attempts": self.attempts, "last": self.last_reason}

    def _attempt(self) -> None:
        self._retry = self._next_at = None
        left = self._deadline - self._reactor.monotonic()
        self._attempt_handle = run_once(self.spec, self._reactor, self._os,
                                        timeout=max(0.001, min(self._attempt_timeout, left)),
                                        on_result=self._result, env=self._env, box=self._box)

    def _retry_at(self, when: float) -> None:
        self._next_at = when
        self._retry = self._reactor.call_at(when, self._attempt)

    def _result(self, ok: bool, reason: str | None) -> None:
        self._attempt_handle = None
        self.attempts += 1
        if ok:
            self.done = True
            self._timer.cancel()
            self._on_ready()
            return
        self.last_reason = reason
        self._retry_at(self._reactor.monotonic() + self._period)

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
            self._retry = self._next_at = None
        if self._attempt_handle is not None:
            self._attempt_handle.cancel()
            self._attempt_handle = None


def retry_until_ready(spec: ProbeSpec, reactor: ReactorLike, os_api: OSLike, *, period: float = 0.2,
                      attempt_timeout: float = 1.0, deadline_s: float, on_ready: Callable[[], None],
                      on_timeout: Callable[[str], None], env: dict[str, str] | None = None,
                      box: ProbeBox | None = None, carried: Mapping[str, Any] | None = None) -> ReadyWait:
    """Readiness: attempt now, then ``period`` after each failure, until a success
    (``on_ready()``) or ``deadline_s`` from now (``on_timeout("not ready within S s (last:
    <reason>)")``). Exactly one of the two is called, from the loop, unless cancelled.
    ``carried``: what ``carried()`` of the same wait in an earlier image of the daemon said
    (an upgrade): its deadline and the time of its next attempt are kept, not restarted."""
    _check_active(spec)
    if period <= 0 or attempt_timeout <= 0 or deadline_s <= 0:
        raise ValueError("readiness needs period, attempt_timeout and deadline_s > 0")
    return ReadyWait(spec, reactor, os_api, period, attempt_timeout, deadline_s, on_ready, on_timeout, env, box,
                      carried)
