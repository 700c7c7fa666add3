"""Metrics, loop lag and health of the daemon, and a loopback HTTP endpoint for them.

Everything here runs in the control loop (one thread, no locks): ``Metrics`` is fed by the
engine's callbacks, ``LagMonitor`` is a reactor timer, ``MetricsServer`` is a non-blocking
listening socket and non-blocking connections driven by the reactor. Nothing here sleeps,
blocks or starts a thread, and no reactor callback of this module raises: a broken client
is closed and counted.

The ``daemon`` dict (what the daemon knows about itself; every key optional)::

    {"started_at": float,       # wall-clock (time.time()) start of the daemon
     "daemon_alive": bool,      # default True: whoever holds this dict got it from a daemon
     "watchdog_alive": bool,    # default False: unknown counts as down
     "manager_alive": bool,     # default False
     "version": str}            # optional: orchestrator_build_info{version=...} 1

The health dict (``health()``, what ``orchestrator health --json`` prints)::

    {"healthy": bool,
     "parts": {"daemon": bool, "watchdog": bool, "manager": bool, "loop": bool},
     "failed": [str, ...],      # the parts that are False, in the order above
     "lag": float,              # seconds the loop was late (rounded to 0.1 ms)
     "lag_limit": 1.0}          # the loop is healthy while lag < lag_limit

Metric names (all prefixed ``orchestrator_``; counters end in ``_total``)::

    replicas{pool,state}                    gauge      from status: replicas by pool and state
    replicas_ready{pool}                    gauge      from status: replicas that are ready
    pools{state}                            gauge      from status: pools by state
    pool_desired_replicas{pool}             gauge      from status: desired size
    replicas_launched_total{pool}           counter
    replica_exits_total{pool,kind}          counter    kind: EXIT_KINDS, else "other"
    restarts_total{pool}                    counter
    crashloops_total{pool}                  counter
    replica_churn_per_second                gauge      launches per second over the last 60 s
    loop_lag_seconds                        gauge      last measured lag of the loop
    loop_lag_max_seconds                    gauge      max lag over the last 60 s
    commands_total{op,outcome}              counter    outcome: ok | error
    command_duration_seconds{op}            histogram  _bucket{le}, _sum, _count
    log_bytes                               gauge      as last set by set_log_totals
    log_dropped                             gauge      as last set by set_log_totals
    store_failures_total                    counter
    http_requests_total{outcome}            counter    what MetricsServer did with a client
    daemon_start_time_seconds               gauge      wall clock
    daemon_uptime_seconds                   gauge
    up{part}                                gauge      part: daemon | watchdog | manager
    build_info{version}                     gauge      1, when the daemon dict has a version

Free text (a pool's ``reason``) is never a label; label values are escaped anyway.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import math
import re
import select
import socket
import time
from typing import Any, Callable, Iterable, Mapping

from .reactor import Reactor, Timer
from .states import ReplicaState

log = logging.getLogger(__name__)

PREFIX = "orchestrator_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

EXIT_KINDS = ("exit_zero", "exit_nonzero", "signal", "could_not_start", "not_ready", "terminated", "lost")
POOL_STATES = ("ok", "backoff", "crashloop")
LIVE_STATES = tuple(s.value for s in ReplicaState if not s.terminal)
# Seconds; the last finite bucket is long enough for a command that waits (--wait).
COMMAND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 300.0)
CHURN_WINDOW = 60  # seconds
LAG_WINDOW = 60.0  # seconds
LAG_LIMIT = 1.0  # seconds: a loop later than this is unhealthy
MAX_OPS = 64  # distinct command ops kept as labels; the rest is "other"
_OP = re.compile(r"[a-z][a-z0-9_]{0,31}")


# -- text format ------------------------------------------------------------------------

def escape_label(value: Any) -> str:
    """A label value for the text format: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels(labels: Mapping[str, Any]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


class _Text:
    """Accumulates metric families in the exposition format 0.0.4."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[Mapping[str, Any], float]]) -> None:
        name = PREFIX + name
        self.lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {format_value(value)}")

    def histogram(self, name: str, help_text: str, series: Mapping[str, "_Histogram"], label: str) -> None:
        name = PREFIX + name
        self.lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} histogram")
        for key in sorted(series):
            h = series[key]
            cumulative = 0
            for bound, count in zip(h.bounds, h.counts):
                cumulative += count
                le = "+Inf" if bound == math.inf else repr(float(bound))
                self.lines.append(f'{name}_bucket{_labels({label: key, "le": le})} {cumulative}')
            self.lines.append(f"{name}_sum{_labels({label: key})} {format_value(h.sum)}")
            self.lines.append(f"{name}_count{_labels({label: key})} {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class _Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            value = 0.0  # NaN, infinite or negative: a clock oddity, counted as 0
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1


# -- the metrics ------------------------------------------------------------------------

class Metrics:
    """Counters and histograms fed by the loop, rendered with a status snapshot.

    ``clock`` (monotonic) times the churn window, ``wall`` the uptime; ``lag`` is the
    ``LagMonitor`` whose readings are rendered (settable later: ``metrics.lag = monitor``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 lag: "LagMonitor | None" = None) -> None:
        self.clock = clock
        self.wall = wall
        self.lag = lag
        self._commands: dict[tuple[str, str], int] = collections.Counter()
        self._latency: dict[str, _Histogram] = {}
        self._launched: dict[str, int] = collections.Counter()
        self._exits: dict[tuple[str, str], int] = collections.Counter()
        self._restarts: dict[str, int] = collections.Counter()
        self._crashloops: dict[str, int] = collections.Counter()
        self._store_failures = 0
        self._http: dict[str, int] = collections.Counter()
        self._log_bytes = 0
        self._log_dropped = 0
        self._churn: collections.deque[list[int]] = collections.deque()  # [second, launches]

    # -- fed by the engine --

    def command(self, op: str, seconds: float, ok: bool) -> None:
        op = self._op(op)
        self._commands[(op, "ok" if ok else "error")] += 1
        h = self._latency.get(op)
        if h is None:
            h = self._latency[op] = _Histogram(COMMAND_BUCKETS)
        try:
            h.observe(float(seconds))
        except (TypeError, ValueError):
            h.observe(0.0)

    def _op(self, op: Any) -> str:
        """A bounded label: a client can send any op string, the label set stays small."""
        if not isinstance(op, str) or not _OP.fullmatch(op):
            return "other"
        if op not in self._latency and len(self._latency) >= MAX_OPS:
            return "other"
        return op

    def launched(self, pool: str, n: int = 1) -> None:
        if n <= 0:
            return
        self._launched[str(pool)] += n
        second = int(math.floor(self.clock()))
        if self._churn and self._churn[-1][0] == second:
            self._churn[-1][1] += n
        else:
            self._churn.append([second, n])
        self._prune_churn(second)

    def exited(self, pool: str, kind: str) -> None:
        self._exits[(str(pool), kind if kind in EXIT_KINDS else "other")] += 1

    def restarted(self, pool: str) -> None:
        self._restarts[str(pool)] += 1

    def crashloop(self, pool: str) -> None:
        self._crashloops[str(pool)] += 1

    def store_failure(self) -> None:
        self._store_failures += 1

    def http_request(self, outcome: str) -> None:
        """What MetricsServer did with one client (its ``on_outcome``)."""
        self._http[str(outcome)] += 1

    def set_log_totals(self, bytes: int, dropped: int) -> None:  # noqa: A002 (the agreed name)
        self._log_bytes = bytes
        self._log_dropped = dropped

    def forget_pool(self, pool: str) -> None:
        """Drop a deleted pool's series (optional: counters may also just stay)."""
        for counter in (self._launched, self._restarts, self._crashloops):
            counter.pop(pool, None)
        for key in [k for k in self._exits if k[0] == pool]:
            del self._exits[key]

    # -- churn --

    def _prune_churn(self, now_second: int) -> None:
        while self._churn and self._churn[0][0] <= now_second - CHURN_WINDOW:
            self._churn.popleft()

    def churn_rate(self) -> float:
        """Replicas launched per second over the last 60 s (the current second included)."""
        now = int(math.floor(self.clock()))
        self._prune_churn(now)
        return sum(n for _, n in self._churn) / CHURN_WINDOW

    # -- rendering --

    def render(self, status: Mapping[str, Any], daemon: Mapping[str, Any]) -> str:
        out = _Text()
        pools = [p for p in status.get("pools") or () if isinstance(p, Mapping)]
        replicas = [r for r in status.get("replicas") or () if isinstance(r, Mapping)]
        names = [str(p.get("name")) for p in pools]
        by_state: dict[tuple[str, str], int] = collections.Counter()
        ready: dict[str, int] = collections.Counter()
        for r in replicas:
            pool, state = str(r.get("pool")), str(r.get("state"))
            by_state[(pool, state)] += 1
            if r.get("ready"):
                ready[pool] += 1
            if pool not in names:
                names.append(pool)
        for name in names:  # the live states of every pool are there, at 0 when empty
            for state in LIVE_STATES:
                by_state.setdefault((name, state), 0)
        out.family("replicas", "gauge", "Replicas by pool and state.",
                   (({"pool": p, "state": s}, n) for (p, s), n in sorted(by_state.items())))
        out.family("replicas_ready", "gauge", "Replicas that are ready, by pool.",
                   (({"pool": n}, ready.get(n, 0)) for n in sorted(names)))
        pool_states: dict[str, int] = collections.Counter({s: 0 for s in POOL_STATES})
        for p in pools:
            pool_states[str(p.get("state") or "ok")] += 1
        out.family("pools", "gauge", "Pools by state (ok, backoff, crashloop).",
                   (({"state": s}, n) for s, n in sorted(pool_states.items())))
        out.family("pool_desired_replicas", "gauge", "Desired size of each pool.",
                   (({"pool": str(p.get("name"))}, _number(p.get("desired"))) for p in
                    sorted(pools, key=lambda p: str(p.get("name")))))
        out.family("replicas_launched_total", "counter", "Replicas launched, by pool.",
                   (({"pool": p}, n) for p, n in sorted(self._launched.items())))
        out.family("replica_exits_total", "counter", "Replica ends, by pool and kind.",
                   (({"pool": p, "kind": k}, n) for (p, k), n in sorted(self._exits.items())))
        out.family("restarts_total", "counter", "Replicas replaced after they ended, by pool.",
                   (({"pool": p}, n) for p, n in sorted(self._restarts.items())))
        out.family("crashloops_total", "counter", "Times a pool entered a crash loop.",
                   (({"pool": p}, n) for p, n in sorted(self._crashloops.items())))
        out.family("replica_churn_per_second", "gauge", "Replicas launched per second over the last 60 s.",
                   [({}, self.churn_rate())])
        if self.lag is not None:
            out.family("loop_lag_seconds", "gauge", "How late the control loop ran its last lag timer.",
                       [({}, self.lag.last)])
            out.family("loop_lag_max_seconds", "gauge", "Largest lag of the control loop over the last 60 s.",
                       [({}, self.lag.max_recent())])
        out.family("commands_total", "counter", "Commands handled, by op and outcome.",
                   (({"op": o, "outcome": r}, n) for (o, r), n in sorted(self._commands.items())))
        out.histogram("command_duration_seconds", "Time from a command's arrival to its reply, by op.",
                      self._latency, "op")
        out.family("log_bytes", "gauge", "Bytes of replica output written to logs (as last reported).",
                   [({}, _number(self._log_bytes))])
        out.family("log_dropped", "gauge", "Log output dropped (as last reported).",
                   [({}, _number(self._log_dropped))])
        out.family("store_failures_total", "counter", "Failed writes to the state store.",
                   [({}, self._store_failures)])
        out.family("http_requests_total", "counter", "Metrics endpoint clients, by outcome.",
                   (({"outcome": o}, n) for o, n in sorted(self._http.items())))
        started = daemon.get("started_at")
        if isinstance(started, (int, float)) and not isinstance(started, bool):
            out.family("daemon_start_time_seconds", "gauge", "Wall-clock start of the daemon.",
                       [({}, float(started))])
            out.family("daemon_uptime_seconds", "gauge", "Seconds since the daemon started.",
                       [({}, max(0.0, self.wall() - float(started)))])
        alive = _alive(daemon)
        out.family("up", "gauge", "1 when the part is alive (daemon, watchdog, manager).",
                   (({"part": part}, 1 if alive[part] else 0) for part in ("daemon", "watchdog", "manager")))
        if daemon.get("version") is not None:
            out.family("build_info", "gauge", "The daemon's version.", [({"version": daemon["version"]}, 1)])
        return out.text()


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return math.nan


def _alive(daemon: Mapping[str, Any]) -> dict[str, bool]:
    return {"daemon": bool(daemon.get("daemon_alive", True)),
            "watchdog": bool(daemon.get("watchdog_alive", False)),
            "manager": bool(daemon.get("manager_alive", False))}


# -- loop lag ---------------------------------------------------------------------------

class LagMonitor:
    """A reactor timer every ``interval`` seconds that measures how late it ran: the loop's
    lag. ``last`` is the latest reading, ``max_recent()`` the largest over ``window`` s."""

    def __init__(self, reactor: Reactor, interval: float = 0.5, window: float = LAG_WINDOW) -> None:
        if not interval > 0:
            raise ValueError("interval must be > 0")
        self.reactor = reactor
        self.interval = interval
        self.window = window
        self.last = 0.0
        self._samples: collections.deque[tuple[float, float]] = collections.deque()  # (when, lag)
        self._timer: Timer | None = None
        self._schedule()

    def _schedule(self) -> None:
        self._timer = self.reactor.call_later(self.interval, self._fire)

    def _fire(self) -> None:
        try:
            timer = self._timer
            if timer is None:
                return
            now = self.reactor.monotonic()
            self.last = max(0.0, now - timer.deadline)
            self._samples.append((now, self.last))
            self._prune(now)
            self._schedule()  # from now, not from the deadline: a stalled loop gets no burst
        except Exception:  # never out of a reactor callback
            log.exception("lag monitor")

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window:
            self._samples.popleft()

    def current(self) -> float:
        """``last``, or how overdue the pending timer is if that is more (a loop that is late
        right now: e.g. a health command handled in the turn after a stall)."""
        overdue = 0.0
        if self._timer is not None:
            overdue = self.reactor.monotonic() - self._timer.deadline
        return max(self.last, overdue)

    def max_recent(self) -> float:
        now = self.reactor.monotonic()
        self._prune(now)
        return max((lag for _, lag in self._samples), default=0.0)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


# -- health -----------------------------------------------------------------------------

def health(daemon: Mapping[str, Any], lag: float) -> tuple[bool, dict]:
    """(healthy, info): healthy only when the daemon, its watchdog and its manager are alive
    and the loop's lag is below 1 s. ``info``'s shape is in the module docstring."""
    parts: dict[str, bool] = dict(_alive(daemon))
    try:
        lag = float(lag)
    except (TypeError, ValueError):
        lag = math.nan
    parts["loop"] = math.isfinite(lag) and lag < LAG_LIMIT
    failed = [name for name, good in parts.items() if not good]
    info = {"healthy": not failed, "parts": parts, "failed": failed,
            "lag": round(lag, 4) if math.isfinite(lag) else None, "lag_limit": LAG_LIMIT}
    return not failed, info


def format_health(ok: bool, info: Mapping[str, Any]) -> str:
    """One line for ``orchestrator health``."""
    lag = info.get("lag")
    lag_text = f"loop lag {lag * 1000:.1f} ms" if isinstance(lag, (int, float)) else "loop lag unknown"
    if ok:
        return f"healthy: daemon, watchdog and manager alive; {lag_text}"
    failed = list(info.get("failed") or ())
    words = []
    for part in failed:
        if part == "loop":
            limit = info.get("lag_limit", LAG_LIMIT)
            words.append(f"control loop slow ({lag_text}, limit {format_value(limit)} s)")
        else:
            words.append(f"{part} down")
    if "loop" not in failed:
        words.append(lag_text)
    return "unhealthy: " + "; ".join(words or ["unknown"])


# -- the HTTP endpoint ------------------------------------------------------------------

MAX_REQUEST = 8192
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}
_REFUSAL = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: 5\r\nConnection: close\r\n\r\nbusy\n")


class _Conn:
    __slots__ = ("sock", "fd", "inbuf", "out", "sent", "timer", "outcome")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.inbuf = bytearray()
        self.out: bytes | None = None  # the response, once there is one
        self.sent = 0
        self.timer: Timer | None = None
        self.outcome = ""


class MetricsServer:
    """``GET /metrics`` (and ``/healthz``) over HTTP/1.0 on 127.0.0.1:``port``, served by the
    loop: a non-blocking listener and connections in a private epoll whose fd is one reader of
    the reactor (the reactor's writer API cannot share an fd with a reader, so readiness for
    both directions is watched here). A request is read up to 8 KiB within
    ``request_timeout`` s, the response written as the socket takes it within
    ``write_timeout`` s; beyond ``max_connections`` a client gets a 503 and is closed.

    ``render()`` gives the /metrics body; ``healthz()`` -> (ok, info) gives /healthz (200 or
    503, info as JSON; 404 when None). ``port`` 0 binds an ephemeral port (``.port`` says
    which). ``counts`` holds what happened to clients (outcome -> n), and ``on_outcome``
    (e.g. ``Metrics.http_request``) hears each outcome. A port that cannot be bound raises
    OSError with a one-line message.
    """

    HOST = "127.0.0.1"

    def __init__(self, reactor: Reactor, port: int, render: Callable[[], str],
                 healthz: Callable[[], tuple[bool, dict]] | None = None, *,
                 max_connections: int = 16, request_timeout: float = 2.0, write_timeout: float = 10.0,
                 on_outcome: Callable[[str], None] | None = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise OSError(errno.EINVAL, f"invalid metrics port {port!r} (0-65535)")
        self.reactor = reactor
        self.render = render
        self.healthz = healthz
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.write_timeout = write_timeout
        self.on_outcome = on_outcome
        self.counts: collections.Counter[str] = collections.Counter()
        self.closed = False
        self._conns: dict[int, _Conn] = {}
        self._listening = False
        self._resume: Timer | None = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # close-on-exec, as every Python fd
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.HOST, port))
            sock.listen(64)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise OSError(err.errno, f"cannot serve metrics on {self.HOST}:{port}: "
                                     f"{err.strerror or err}") from None
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        try:
            self._ep = select.epoll()  # close-on-exec too
        except OSError:
            sock.close()
            raise
        try:
            self._ep.register(sock.fileno(), select.EPOLLIN)
            reactor.add_reader(self._ep.fileno(), self._on_ready)
        except BaseException:
            self._ep.close()
            sock.close()
            raise
        self._listening = True

    # -- bookkeeping --

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:
                log.exception("metrics server: on_outcome")

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- events --

    def _on_ready(self) -> None:
        if self.closed:
            return
        try:
            events = self._ep.poll(0, 64)
        except OSError:
            return
        for fd, mask in events:
            if self.closed:
                return
            if fd == self._sock.fileno():
                try:
                    self._accept()
                except Exception:
                    log.exception("metrics server: accept")
                continue
            conn = self._conns.get(fd)
            if conn is None:
                continue
            try:
                if conn.out is None:
                    self._read(conn, mask)
                else:
                    self._write(conn)
            except Exception:  # a broken client, or a bug here: never out of the loop
                log.debug("metrics server: client failed", exc_info=True)
                self._close(conn, conn.outcome or "error")

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE, ENOBUFS...: stop accepting for a moment
                self._count("accept_error")
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause()
                return
            try:
                sock.setblocking(False)
                if len(self._conns) >= self.max_connections:
                    try:
                        sock.send(_REFUSAL, socket.MSG_NOSIGNAL)
                    except OSError:
                        pass
                    sock.close()
                    self._count("refused")
                    continue
                conn = _Conn(sock)
                self._ep.register(conn.fd, select.EPOLLIN | select.EPOLLRDHUP)
            except OSError:
                sock.close()
                self._count("error")
                continue
            self._conns[conn.fd] = conn
            conn.timer = self.reactor.call_later(self.request_timeout, lambda c=conn: self._expire(c))

    def _pause(self) -> None:
        if not self._listening:
            return
        try:
            self._ep.unregister(self._sock.fileno())
        except OSError:
            pass
        self._listening = False
        self._resume = self.reactor.call_later(1.0, self._unpause)

    def _unpause(self) -> None:
        self._resume = None
        if self.closed or self._listening:
            return
        try:
            self._ep.register(self._sock.fileno(), select.EPOLLIN)
            self._listening = True
        except OSError:
            log.exception("metrics server: cannot listen again")

    def _expire(self, conn: _Conn) -> None:
        try:
            if self._conns.get(conn.fd) is conn:
                conn.timer = None
                self._close(conn, "timeout")
        except Exception:
            log.exception("metrics server: timeout")

    def _read(self, conn: _Conn, mask: int) -> None:
        while True:
            want = MAX_REQUEST + 1 - len(conn.inbuf)
            try:
                data = conn.sock.recv(max(want, 1))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn, "error")
                return
            if not data:  # the client closed (or half-closed) before a whole request
                if not self._complete(conn.inbuf):
                    self._close(conn, "closed_early")
                    return
                break
            conn.inbuf += data
            if self._complete(conn.inbuf) or len(conn.inbuf) > MAX_REQUEST:
                break
        if self._complete(conn.inbuf):
            self._respond(conn, *self._handle(bytes(conn.inbuf)))
        elif len(conn.inbuf) > MAX_REQUEST:
            conn.outcome = "too_large"
            self._respond(conn, 431, "text/plain; charset=utf-8", b"request too large\n")
        elif mask & (select.EPOLLHUP | select.EPOLLERR):
            self._close(conn, "closed_early")

    @staticmethod
    def _complete(buf: bytearray) -> bool:
        return b"\r\n\r\n" in buf or b"\n\n" in buf

    def _handle(self, request: bytes) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, head only) for one request."""
        text = "text/plain; charset=utf-8"
        line = request.split(b"\n", 1)[0].rstrip(b"\r").decode("latin-1")
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, text, b"bad request\n", False
        method, target = parts[0], parts[1]
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, text, b"only GET\n", False
        head = method == "HEAD"
        if path == "/metrics":
            try:
                body = self.render().encode("utf-8")
            except Exception:
                log.exception("metrics server: render failed")
                return 500, text, b"metrics failed\n", head
            return 200, CONTENT_TYPE, body, head
        if path == "/healthz" and self.healthz is not None:
            try:
                ok, info = self.healthz()
                body = (json.dumps(info, sort_keys=True) + "\n").encode("utf-8")
            except Exception:
                log.exception("metrics server: health failed")
                return 500, text, b"health failed\n", head
            return (200 if ok else 503), "application/json", body, head
        return 404, text, b"not found: try /metrics or /healthz\n", head

    def _respond(self, conn: _Conn, status: int, ctype: str, body: bytes, head: bool = False) -> None:
        if not conn.outcome:
            conn.outcome = ("served" if status < 400 or status == 503 else
                            "bad_request" if status < 500 else "error")
        header = (f"HTTP/1.0 {status} {_REASONS.get(status, 'Unknown')}\r\nContent-Type: {ctype}\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
        conn.out = header if head else header + body
        conn.inbuf.clear()
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = self.reactor.call_later(self.write_timeout, lambda c=conn: self._expire(c))
        self._ep.modify(conn.fd, select.EPOLLOUT)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            while conn.sent < len(conn.out):
                n = conn.sock.send(memoryview(conn.out)[conn.sent:conn.sent + 65536], socket.MSG_NOSIGNAL)
                if n <= 0:
                    break
                conn.sent += n
        except (BlockingIOError, InterruptedError):
            return  # the rest on EPOLLOUT
        except OSError:
            self._close(conn, "error")
            return
        if conn.sent >= len(conn.out):
            try:
                conn.sock.shutdown(socket.SHUT_WR)
                while conn.sock.recv(4096):  # what the client sent beyond the request: a close
                    pass                     # with unread data would reset the connection
            except OSError:
                pass
            self._close(conn, conn.outcome)

    def _close(self, conn: _Conn, outcome: str) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        try:
            self._ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        conn.sock.close()
        self._count(outcome)

    def close(self) -> None:
        """Close the listener and every connection; the reactor forgets our fd. Idempotent."""
        if self.closed:
            return
        for conn in list(self._conns.values()):
            self._close(conn, "closed_by_server")
        self.closed = True
        if self._resume is not None:
            self._resume.cancel()
        try:
            self.reactor.remove_reader(self._ep.fileno())
        except (KeyError, ValueError, OSError):
            pass
        self._ep.close()
        self._sock.close()
