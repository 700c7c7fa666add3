"""Metrics, loop lag and health of the daemon.

Everything here runs in the control loop (one thread, no locks): ``Metrics`` is fed by the
engine's callbacks and rendered by ``prometheus_client`` (a registry of its own holding one
custom collector, ``generate_latest``), ``LagMonitor`` is a reactor timer. The loopback
endpoint that serves them is ``httpserver.MetricsServer``.

The ``daemon`` dict (what the daemon knows about itself; every key optional)::

    {"started_at": float,       # wall-clock (time.time()) start of the daemon
     "daemon_alive": bool,      # default True: whoever holds this dict got it from a daemon
     "watchdog_alive": bool,    # default False: unknown counts as down
     "manager_alive": bool,     # default False
     "journal": {"ok": bool, "fault": str, "since": float, "unsaved": int},
                                # default ok; a fault: commits fail (a full disk), why and since when
     "version": str}            # optional: orchestrator_build_info{version=...} 1

The health dict (``health()``, what ``orchestrator health --json`` prints)::

    {"healthy": bool,
     "parts": {"daemon": bool, "watchdog": bool, "manager": bool, "journal": bool, "loop": bool},
     "failed": [str, ...],      # the parts that are False, in the order above
     "journal": {...},          # only when the journal has a fault: as in the daemon dict
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
    tasks_ended_total{pool,state}           counter    DONE, FAILED, CANCELLED, TIMED_OUT, LOST
    tasks{pool,state}                       gauge      from status: QUEUED and RUNNING tasks of each executor pool
    task_queue_wait_seconds{pool}           histogram  queued -> handed to a worker
    task_run_seconds{pool}                  histogram  handed to a worker -> ended
    task_wall_seconds{pool}                 histogram  each task's wall time in its worker (its figures)
    task_cpu_seconds{pool}                  histogram  ...its CPU time, user + system, its children's included
    task_peak_rss_bytes{pool}               histogram  ...its own peak resident set (a task whose worker
                                                       could not tell it is not counted here)
    tenant_tasks{pool,tenant,state}         gauge      from status: tasks{pool,state} by tenant
    tenant_task_queue_wait_seconds{pool,tenant}
                                            histogram  task_queue_wait_seconds by tenant
    http_requests_total{outcome}            counter    what MetricsServer did with a client
    daemon_start_time_seconds               gauge      wall clock
    daemon_uptime_seconds                   gauge
    up{part}                                gauge      part: daemon | watchdog | manager | journal
    build_info{version}                     gauge      1, when the daemon dict has a version

Free text (a pool's ``reason``) is never a label; label values are escaped anyway.

Tenants (an executor's ``options(tenant=...)``): ``tenant=""`` is the tasks with no tenant
(a tenant's name is never empty). The label set is bounded per pool: the wait histograms
keep the first ``MAX_TENANTS`` tenants a pool started tasks of, the later ones' waits are
observed under ``tenant="other"``; the gauges show the ``MAX_TENANTS`` tenants with the most
unfinished tasks now, the rest summed under ``"other"`` (a tenant named "other" is counted
with them). The per-pool series count every task either way.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import re
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, NotRequired, TypedDict, cast

from ..states import ReplicaState
from ..taskwire import Figures
from .reactor import Reactor, Timer

# prometheus_client is imported at the first scrape, not with the daemon: the package pulls
# in http.server, email and ssl (~70 ms of every daemon's start-up CPU) for its exposition,
# and what the loop counts between scrapes is plain Python here.
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "orchestrator_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

EXIT_KINDS = ("exit_zero", "exit_nonzero", "signal", "could_not_start", "not_ready", "terminated", "lost")
POOL_STATES = ("ok", "backoff", "crashloop", "stopped")
LIVE_STATES = tuple(s.value for s in ReplicaState if not s.terminal)
# Seconds; the last finite bucket is long enough for a command that waits (--wait).
COMMAND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 300.0)
# Seconds a task waited in its queue, or ran: from a tiny task to a long job.
TASK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0, 1800.0, 3600.0)
# Bytes a task's worker held at its peak: from an idle Python worker (~15 MiB) to 64 GiB.
RSS_BUCKETS = tuple(float(1 << shift) for shift in range(24, 37))
FOLD_AT = 1024  # a pool's task figures kept before they are counted in its histograms anyway
CHURN_WINDOW = 60  # seconds
LAG_WINDOW = 60.0  # seconds
LAG_LIMIT = 1.0  # seconds: a loop later than this is unhealthy
MAX_OPS = 64  # distinct command ops kept as labels; the rest is "other"
MAX_TENANTS = 100  # tenants of one pool kept as labels; the rest is "other"
NO_TENANT = ""  # the tenant label of a task submitted without one
OTHER = "other"
_OP = re.compile(r"[a-z][a-z0-9_]{0,31}")


# -- histograms -------------------------------------------------------------------------

class _Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not 0.0 <= value < math.inf:
            value = 0.0  # NaN, infinite or negative: a clock oddity, counted as 0
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value (+Inf last)
        self.sum += value
        self.count += 1

    def observe_all(self, values: list[float]) -> None:
        """``observe`` of each value, in one loop."""
        bounds, counts, find, total = self.bounds, self.counts, bisect.bisect_left, 0.0
        for value in values:
            if not 0.0 <= value < math.inf:
                value = 0.0
            counts[find(bounds, value)] += 1
            total += value
        self.sum += total
        self.count += len(values)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, as ``HistogramMetricFamily`` takes them."""
        from prometheus_client.utils import floatToGoString

        # A bound as Prometheus writes it (``+Inf``, ``0.005``); the library leaves it untyped.
        go_float = cast(Callable[[float], str], floatToGoString)
        out: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            out.append((go_float(bound), cumulative))
        return out


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
        self._api: dict[tuple[str, str, str], int] = collections.Counter()  # (method, route, status)
        self._api_latency: dict[tuple[str, str], _Histogram] = {}
        self._log_bytes = 0
        self._log_dropped = 0
        self._tasks_ended: dict[tuple[str, str], int] = collections.Counter()
        self._task_wait: dict[str, _Histogram] = {}
        self._task_run: dict[str, _Histogram] = {}
        self._task_wall: dict[str, _Histogram] = {}  # the figures of tasks (task_figures)
        self._task_cpu: dict[str, _Histogram] = {}
        self._task_peak: dict[str, _Histogram] = {}
        # Figures not in those three yet, per pool: put there by _fold, at a scrape or once
        # FOLD_AT wait (three observations one by one cost a tiny task's loop ~1.4 us; a
        # list's append ~0.1 us, and the fold's loop is tighter than three calls)
        self._figures: dict[str, list[Figures]] = {}
        self._tenant_wait: dict[str, dict[str, _Histogram]] = {}  # pool -> tenant label -> waits
        self._churn: collections.deque[list[int]] = collections.deque()  # [second, launches]
        self._collector = _Collector(self)
        self._registry: CollectorRegistry | None = None  # made at the first scrape

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

    def task_started(self, pool: str, waited: float, tenant: str | None = None) -> None:
        """A task started after ``waited`` seconds queued: in its pool's histogram and its
        tenant's (``tenant`` None: no tenant; past MAX_TENANTS of the pool: "other")."""
        pool = str(pool)
        _observe(self._task_wait, pool, waited)
        by_tenant = self._tenant_wait.setdefault(pool, {})
        label = NO_TENANT if tenant is None else str(tenant)
        if label not in by_tenant and len(by_tenant) >= MAX_TENANTS:
            label = OTHER
        _observe(by_tenant, label, waited)

    def task_ended(self, pool: str, state: str, ran: float | None) -> None:
        self._tasks_ended[(str(pool), str(state))] += 1
        if ran is not None:
            _observe(self._task_run, str(pool), ran)

    def task_figures(self, pool: str, figures: Figures) -> None:
        """What a task took in its worker (its record's ``figures``): kept, and counted in
        the histograms by the next scrape (or once FOLD_AT of a pool wait)."""
        pending = self._figures.get(pool)
        if pending is None:
            pending = self._figures[pool] = []
        pending.append(figures)
        if len(pending) >= FOLD_AT:
            self._fold(pool)

    def _fold(self, pool: str) -> None:
        """A pool's figures kept by task_figures, into its three histograms."""
        pending = self._figures.pop(pool, None)
        if not pending:
            return
        _histogram(self._task_wall, pool).observe_all([f["wall"] for f in pending])
        _histogram(self._task_cpu, pool).observe_all([f["cpu"] for f in pending])
        peaks = [float(peak) for f in pending if (peak := f["peak_rss"]) is not None]
        if peaks:
            _histogram(self._task_peak, pool, RSS_BUCKETS).observe_all(peaks)

    def http_request(self, outcome: str) -> None:
        """What MetricsServer did with one client (its ``on_outcome``)."""
        self._http[str(outcome)] += 1

    def api_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """One answer of the HTTP control plane (httpapi.py's ``on_response``): ``route`` is
        a path of its table (bounded: a request that matched none is "other")."""
        key = (str(method), str(route))
        if key not in self._api_latency and len(self._api_latency) >= MAX_OPS:
            key = (OTHER, OTHER)
        self._api[(*key, str(int(status)))] += 1
        h = self._api_latency.get(key)
        if h is None:
            h = self._api_latency[key] = _Histogram(COMMAND_BUCKETS)
        h.observe(max(0.0, float(seconds)))

    def set_log_totals(self, bytes: int, dropped: int) -> None:  # noqa: A002 (the agreed name)
        self._log_bytes = bytes
        self._log_dropped = dropped

    def forget_pool(self, pool: str) -> None:
        """Drop a deleted pool's series (optional: counters may also just stay)."""
        for counter in (self._launched, self._restarts, self._crashloops):
            counter.pop(pool, None)
        for key in [k for k in self._exits if k[0] == pool]:
            del self._exits[key]
        for key in [k for k in self._tasks_ended if k[0] == pool]:
            del self._tasks_ended[key]
        self._task_wait.pop(pool, None)
        self._task_run.pop(pool, None)
        for figures in (self._task_wall, self._task_cpu, self._task_peak):
            figures.pop(pool, None)
        self._figures.pop(pool, None)
        self._tenant_wait.pop(pool, None)

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
        """The exposition text (format 0.0.4) of these counters with ``status`` and
        ``daemon`` snapshots, by ``prometheus_client``'s ``generate_latest``."""
        from prometheus_client import CollectorRegistry, generate_latest

        if self._registry is None:
            self._registry = CollectorRegistry(auto_describe=False)
            # Any object with collect() is a collector to the registry; ours does not derive
            # from the library's ABC so that defining it needs no import of the library.
            self._registry.register(cast("Collector", self._collector))
        self._collector.snapshot = (status, daemon)
        try:
            return generate_latest(self._registry).decode("utf-8")
        finally:
            self._collector.snapshot = None

    def families(self, status: Mapping[str, Any], daemon: Mapping[str, Any]) -> Iterator[Metric]:
        """Every metric family, built from the counters and the snapshots (the collector's
        ``collect``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        for pool in list(self._figures):
            self._fold(pool)
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
        yield _family(GaugeMetricFamily, "replicas", "Replicas by pool and state.", ("pool", "state"),
                      sorted(by_state.items()))
        yield _family(GaugeMetricFamily, "replicas_ready", "Replicas that are ready, by pool.", ("pool",),
                      ((n, ready.get(n, 0)) for n in sorted(names)))
        pool_states: dict[str, int] = collections.Counter({s: 0 for s in POOL_STATES})
        for p in pools:
            pool_states[str(p.get("state") or "ok")] += 1
        yield _family(GaugeMetricFamily, "pools", "Pools by state (ok, backoff, crashloop, stopped).", ("state",),
                      sorted(pool_states.items()))
        yield _family(GaugeMetricFamily, "pool_desired_replicas", "Desired size of each pool.", ("pool",),
                      ((str(p.get("name")), _number(p.get("desired")))
                       for p in sorted(pools, key=lambda p: str(p.get("name")))))
        yield _family(CounterMetricFamily, "replicas_launched", "Replicas launched, by pool.", ("pool",),
                      sorted(self._launched.items()))
        yield _family(CounterMetricFamily, "replica_exits", "Replica ends, by pool and kind.", ("pool", "kind"),
                      sorted(self._exits.items()))
        yield _family(CounterMetricFamily, "restarts", "Replicas replaced after they ended, by pool.", ("pool",),
                      sorted(self._restarts.items()))
        yield _family(CounterMetricFamily, "crashloops", "Times a pool entered a crash loop.", ("pool",),
                      sorted(self._crashloops.items()))
        yield GaugeMetricFamily(PREFIX + "replica_churn_per_second",
                                "Replicas launched per second over the last 60 s.", value=self.churn_rate())
        if self.lag is not None:
            yield GaugeMetricFamily(PREFIX + "loop_lag_seconds", "How late the control loop ran its last lag timer.",
                                    value=self.lag.last)
            yield GaugeMetricFamily(PREFIX + "loop_lag_max_seconds",
                                    "Largest lag of the control loop over the last 60 s.", value=self.lag.max_recent())
        yield _family(CounterMetricFamily, "commands", "Commands handled, by op and outcome.", ("op", "outcome"),
                      sorted(self._commands.items()))
        latency = HistogramMetricFamily(PREFIX + "command_duration_seconds",
                                        "Time from a command's arrival to its reply, by op.", labels=("op",))
        for op in sorted(self._latency):
            h = self._latency[op]
            latency.add_metric((op,), buckets=h.buckets(), sum_value=h.sum)
        yield latency
        yield GaugeMetricFamily(PREFIX + "log_bytes", "Bytes of replica output written to logs (as last reported).",
                                value=_number(self._log_bytes))
        yield GaugeMetricFamily(PREFIX + "log_dropped", "Log output dropped (as last reported).",
                                value=_number(self._log_dropped))
        yield CounterMetricFamily(PREFIX + "store_failures", "Failed writes to the state store.",
                                  value=self._store_failures)
        yield from self._task_families(pools)
        yield _family(CounterMetricFamily, "http_requests", "Metrics endpoint clients, by outcome.", ("outcome",),
                      sorted(self._http.items()))
        yield _family(CounterMetricFamily, "api_requests", "HTTP control plane answers, by method, route and status.",
                      ("method", "route", "status"), sorted(self._api.items()))
        api_latency = HistogramMetricFamily(PREFIX + "api_request_duration_seconds",
                                            "Time from an HTTP request read whole to its answer's start, by route.",
                                            labels=("method", "route"))
        for key in sorted(self._api_latency):
            h = self._api_latency[key]
            api_latency.add_metric(key, buckets=h.buckets(), sum_value=h.sum)
        yield api_latency
        started = daemon.get("started_at")
        if isinstance(started, (int, float)) and not isinstance(started, bool):
            yield GaugeMetricFamily(PREFIX + "daemon_start_time_seconds", "Wall-clock start of the daemon.",
                                    value=float(started))
            yield GaugeMetricFamily(PREFIX + "daemon_uptime_seconds", "Seconds since the daemon started.",
                                    value=max(0.0, self.wall() - float(started)))
        alive = _alive(daemon)
        yield _family(GaugeMetricFamily, "up", "1 when the part is alive (daemon, watchdog, manager) "
                      "or saves (journal).", ("part",),
                      ((part, 1 if alive[part] else 0) for part in ("daemon", "watchdog", "manager", "journal")))
        if daemon.get("version") is not None:
            yield _family(GaugeMetricFamily, "build_info", "The daemon's version.", ("version",),
                          [(daemon["version"], 1)])


    def _task_families(self, pools: list[Mapping[str, Any]]) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        queued_running = []
        by_tenant: list[tuple[tuple[str, str, str], float]] = []
        for p in sorted(pools, key=lambda p: str(p.get("name"))):
            counts = p.get("tasks")
            if isinstance(counts, Mapping):
                name = str(p.get("name"))
                queued_running += [((name, "QUEUED"), _number(counts.get("queued"))),
                                   ((name, "RUNNING"), _number(counts.get("running")))]
                if "waiting" in counts:  # a daemon's status from before Retry has none
                    queued_running.append(((name, "WAITING"), _number(counts["waiting"])))
                tenants = counts.get("tenants")
                if isinstance(tenants, Mapping):
                    for tenant, (queued, running) in _bounded_tenants(tenants):
                        by_tenant += [((name, tenant, "QUEUED"), queued), ((name, tenant, "RUNNING"), running)]
        yield _family(GaugeMetricFamily, "tasks", "Unfinished tasks of each executor pool, by state.",
                      ("pool", "state"), queued_running)
        yield _family(GaugeMetricFamily, "tenant_tasks", "Unfinished tasks of each executor pool, by tenant "
                      "(\"\": none) and state.", ("pool", "tenant", "state"), by_tenant)
        yield _family(CounterMetricFamily, "tasks_ended", "Tasks ended, by pool and state.", ("pool", "state"),
                      sorted(self._tasks_ended.items()))
        for name, by_pool, text in (("task_queue_wait_seconds", self._task_wait, "Time tasks waited in their queue."),
                                    ("task_run_seconds", self._task_run, "Time tasks ran, to their end."),
                                    ("task_wall_seconds", self._task_wall, "Wall time of each task in its worker."),
                                    ("task_cpu_seconds", self._task_cpu,
                                     "CPU time (user + system) of each task, its child processes' included."),
                                    ("task_peak_rss_bytes", self._task_peak,
                                     "Peak resident set of each task's worker while it ran (not its lifetime's).")):
            family = HistogramMetricFamily(PREFIX + name, text, labels=("pool",))
            for pool in sorted(by_pool):
                h = by_pool[pool]
                family.add_metric((pool,), buckets=h.buckets(), sum_value=h.sum)
            yield family
        waits = HistogramMetricFamily(PREFIX + "tenant_task_queue_wait_seconds",
                                      "Time tasks waited in their queue, by tenant (\"\": none).",
                                      labels=("pool", "tenant"))
        for pool in sorted(self._tenant_wait):
            for tenant, h in sorted(self._tenant_wait[pool].items()):
                waits.add_metric((pool, tenant), buckets=h.buckets(), sum_value=h.sum)
        yield waits


def _bounded_tenants(tenants: Mapping[Any, Any]) -> list[tuple[str, tuple[float, float]]]:
    """``(tenant, (queued, running))`` by tenant label, from a status row's ``tenants``: the
    MAX_TENANTS with the most unfinished tasks, the rest summed under "other"."""
    rows: list[tuple[str, float, float]] = []
    for tenant, counts in tenants.items():
        if isinstance(counts, Mapping):
            rows.append((str(tenant), _number(counts.get("queued")), _number(counts.get("running"))))
    rows.sort(key=lambda r: (-(r[1] + r[2]), r[0]))
    out: dict[str, tuple[float, float]] = {}
    for i, (tenant, queued, running) in enumerate(rows):
        label = tenant if i < MAX_TENANTS else OTHER
        had = out.get(label, (0.0, 0.0))
        out[label] = (had[0] + queued, had[1] + running)
    return sorted(out.items())


def _observe(by_pool: dict[str, _Histogram], pool: str, value: float,
             bounds: tuple[float, ...] = TASK_BUCKETS) -> None:
    _histogram(by_pool, pool, bounds).observe(value)


def _histogram(by_pool: dict[str, _Histogram], pool: str, bounds: tuple[float, ...] = TASK_BUCKETS) -> _Histogram:
    h = by_pool.get(pool)
    if h is None:
        h = by_pool[pool] = _Histogram(bounds)
    return h


class _Collector:
    """``prometheus_client``'s view of one ``Metrics``: a custom collector whose
    ``collect()`` builds the families from the snapshot ``render`` hands it."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.snapshot: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None

    def collect(self) -> Iterator[Metric]:
        status, daemon = self.snapshot or ({}, {})
        return self.metrics.families(status, daemon)


def _family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, help_text: str, labels: tuple[str, ...],
            samples: Iterable[tuple[Any, float]]) -> Metric:
    """A labelled family from ``(key, value)`` pairs; a key is one label value or a tuple."""
    family = kind(PREFIX + name, help_text, labels=labels)
    for key, value in samples:
        values = key if isinstance(key, tuple) else (key,)
        family.add_metric([str(v) for v in values], value)
    return family


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return math.nan


def _alive(daemon: Mapping[str, Any]) -> dict[str, bool]:
    return {"daemon": bool(daemon.get("daemon_alive", True)),
            "watchdog": bool(daemon.get("watchdog_alive", False)),
            "manager": bool(daemon.get("manager_alive", False)),
            "journal": _journal_ok(daemon)}


def _journal_ok(daemon: Mapping[str, Any]) -> bool:
    """False only on a fault the daemon reported: no journal info is no known fault."""
    journal = daemon.get("journal")
    return not isinstance(journal, Mapping) or journal.get("ok", True) is not False


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

class Health(TypedDict):
    """The health dict: see the module docstring."""

    healthy: bool
    parts: dict[str, bool]
    failed: list[str]
    journal: NotRequired[dict[str, Any]]
    lag: float | None
    lag_limit: float


def health(daemon: Mapping[str, Any], lag: float) -> tuple[bool, Health]:
    """(healthy, info): healthy only when the daemon, its watchdog and its manager are alive,
    the journal saves (no fault) and the loop's lag is below 1 s. ``info``'s shape is in the module docstring."""
    parts: dict[str, bool] = dict(_alive(daemon))
    try:
        lag = float(lag)
    except (TypeError, ValueError):
        lag = math.nan
    parts["loop"] = math.isfinite(lag) and lag < LAG_LIMIT
    failed = [name for name, good in parts.items() if not good]
    info: Health = {"healthy": not failed, "parts": parts, "failed": failed,
                            "lag": round(lag, 4) if math.isfinite(lag) else None, "lag_limit": LAG_LIMIT}
    if not parts["journal"]:
        info["journal"] = dict(daemon["journal"])
    return not failed, info
