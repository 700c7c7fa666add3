"""How a pool is supervised: its restart policy, probes, stop signal, ports.

A ``Policy`` travels as plain data beside the spec (what runs) in ``launch``, is stored
with the pool, and is compared with the pool's current one: a launch into an existing pool
with another spec or policy is refused unless it asks to ``replace`` (a rolling restart
onto the new one). The flags of ``launch`` and the keys of a config file's ``[pools.NAME]``
table are the same names (``--max-restarts`` is ``max_restarts``).

    restart        always | on-failure | never       replace a replica that ended on its own
    backoff        [MIN, MAX] seconds               exponential with jitter, per slot
    healthy_after  seconds RUNNING                  then the slot's backoff starts over
    max_restarts   [N, S]                           the (N+1)-th replacement within S s: crashloop
    ready          probe (see probespec.py)         RUNNING only once ready
    ready_timeout  seconds                          not ready by then: FAILED
    probe_timeout  seconds                          one ready or live attempt is cut after it (1)
    start_secs     seconds                          without a probe: ready once it ran this long
    live           probe, live_interval, live_failures   liveness; misses in a row: replaced
    stop_signal    TERM, INT, HUP, ...              how a replica is asked to stop
    grace          seconds                          before SIGKILL (None: the daemon's)
    port_base      N                                slot s gets port N + s ({port}, $PORT)
    sockets        ["tcp://127.0.0.1:8000", ...]    listening sockets the daemon binds; fds 3.. of each replica
    memory_max     bytes, or "512M"                 cgroup memory.max of each replica
    pids_max       N                                cgroup pids.max of each replica
    cpu_weight     1..10000                         cgroup cpu.weight of each replica
    log_max_bytes  bytes, or "10M"                  a replica's log file is rotated at this size
    log_backups    0..100                           rotated files kept per stream (None: the daemon's)
    after          ["db", "migrate:completed"]      start only once those pools meet the condition
                                                    (ready, started or completed; see after_order)

The three limits need cgroup containment with the controller enabled (containment.py):
elsewhere a launch that sets one is refused with one line.
"""

from __future__ import annotations

import graphlib
import math
import re
import signal
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping

from . import listenspec, probespec
from .errors import InvalidSpec

RESTART_MODES = ("always", "on-failure", "never")
LIMIT_KEYS = ("memory_max", "pids_max", "cpu_weight")  # the cgroup limits (watchdog.cgroup.LIMITS)
CPU_WEIGHT_MAX = 10_000
# Log rotation bounds. Each rotation renames every backup, and the pump rotates up to
# (bytes per turn / max_bytes) times in one turn: at 16 KiB and 100 backups a replica
# writing at full speed costs the loop ~64 rotations of ~100 renames in a turn, tens of ms;
# a smaller file or more backups would let one pool's setting hold the loop far longer.
LOG_MIN_BYTES = 16 << 10
LOG_MAX_BACKUPS = 100
LOG_MAX_BYTES_LIMIT = 1 << 40  # 1 TiB: beyond it "never rotate" in all but name
AFTER_CONDITIONS = ("ready", "started", "completed")  # the first is the default
_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # protocol.pool_name's


def _number(value: Any, key: str, *, low: float = 0.0, integer: bool = False, above: bool = False) -> Any:
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type) or not math.isfinite(value):
        raise InvalidSpec(f"{key} must be a finite {'whole ' if integer else ''}number, got {value!r}")
    if value < low or (above and value == low):
        raise InvalidSpec(f"{key} must be {'more than' if above else 'at least'} {low:g}, got {value!r}")
    return value


def signal_number(name: Any, key: str = "stop_signal") -> int:
    """``TERM``, ``SIGTERM`` or ``15`` → 15; anything else is InvalidSpec."""
    if isinstance(name, int) and not isinstance(name, bool):
        try:
            return int(signal.Signals(name))
        except ValueError:
            raise InvalidSpec(f"{key}: no signal number {name}") from None
    if isinstance(name, str):
        text = name.strip().upper()
        if text.isascii() and text.isdigit():
            return signal_number(int(text), key)
        try:
            return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])
        except KeyError:
            pass
    raise InvalidSpec(f"{key}: not a signal name: {name!r}")


@dataclass(frozen=True)
class Policy:
    restart: str = "on-failure"
    backoff: tuple[float, float] = (0.1, 30.0)
    healthy_after: float = 10.0
    max_restarts: tuple[int, float] = (5, 60.0)
    ready: str | None = None
    ready_timeout: float = 60.0
    probe_timeout: float = 1.0  # one attempt of ready or live, as Kubernetes' timeoutSeconds
    start_secs: float = 0.0
    live: str | None = None
    live_interval: float = 10.0
    live_failures: int = 3
    stop_signal: str = "TERM"
    grace: float | None = None
    port_base: int | None = None
    sockets: tuple[str, ...] = ()  # listenspec.py: tcp://HOST:PORT, unix:/PATH, fd:NAME
    memory_max: int | None = None
    pids_max: int | None = None
    cpu_weight: int | None = None
    log_max_bytes: int | None = None  # None: the daemon's ([daemon] log_max_bytes, 10 MiB)
    log_backups: int | None = None  # None: the daemon's ([daemon] log_backups, 3)
    after: tuple[str, ...] = ()  # "POOL:CONDITION", sorted: the pools this one starts after

    def __post_init__(self) -> None:
        if self.restart not in RESTART_MODES:
            raise InvalidSpec(f"restart must be one of {', '.join(RESTART_MODES)}, got {self.restart!r}")
        lo, hi = _pair(self.backoff, "backoff")
        _number(lo, "backoff MIN")
        _number(hi, "backoff MAX")
        if hi < lo:
            raise InvalidSpec(f"backoff MAX must be at least MIN, got {lo:g}:{hi:g}")
        object.__setattr__(self, "backoff", (float(lo), float(hi)))
        n, window = _pair(self.max_restarts, "max_restarts")
        _number(n, "max_restarts N", integer=True)
        _number(window, "max_restarts S", above=True)
        object.__setattr__(self, "max_restarts", (int(n), float(window)))
        _number(self.healthy_after, "healthy_after")
        _number(self.ready_timeout, "ready_timeout", above=True)
        _number(self.probe_timeout, "probe_timeout", above=True)
        _number(self.start_secs, "start_secs")
        _number(self.live_interval, "live_interval", above=True)
        _number(self.live_failures, "live_failures", low=1, integer=True)
        if self.grace is not None:
            _number(self.grace, "grace")
        if self.port_base is not None:
            _number(self.port_base, "port_base", low=1, integer=True)
            if self.port_base > 65535:
                raise InvalidSpec(f"port_base must be at most 65535, got {self.port_base}")
        object.__setattr__(self, "sockets", listenspec.parse_all(self.sockets))
        object.__setattr__(self, "stop_signal", signal.Signals(signal_number(self.stop_signal)).name[3:])
        if self.memory_max is not None:
            object.__setattr__(self, "memory_max", parse_size(self.memory_max, "memory_max"))
        if self.pids_max is not None:
            _number(self.pids_max, "pids_max", low=1, integer=True)
        if self.cpu_weight is not None:
            _number(self.cpu_weight, "cpu_weight", low=1, integer=True)
            if self.cpu_weight > CPU_WEIGHT_MAX:
                raise InvalidSpec(f"cpu_weight must be at most {CPU_WEIGHT_MAX}, got {self.cpu_weight}")
        if self.log_max_bytes is not None:
            object.__setattr__(self, "log_max_bytes", log_max_bytes(self.log_max_bytes))
        if self.log_backups is not None:
            log_backups(self.log_backups)
        object.__setattr__(self, "after", after_entries(self.after))
        for key in ("ready", "live"):
            text = getattr(self, key)
            if text is not None:
                if not isinstance(text, str):
                    raise InvalidSpec(f"{key} must be a probe string, got {text!r}")
                spec = probespec.parse(text, has_port=self.port_base is not None)
                if key == "live" and spec.passive:
                    raise InvalidSpec("live cannot be notify: a liveness probe asks, notify only listens")

    @property
    def signum(self) -> int:
        return signal_number(self.stop_signal)

    @property
    def limits(self) -> dict[str, int]:
        """The cgroup limits that are set (``memory_max``, ``pids_max``, ``cpu_weight``)."""
        return self._derived()[1]

    @property
    def after_pools(self) -> dict[str, str]:
        """The pools this one starts after: name -> condition."""
        return dict(split_after(e) for e in self.after)

    def to_wire(self) -> dict[str, Any]:
        """Only what differs from the defaults: short in the journal, stable to compare."""
        return dict(self._derived()[0])

    def every_value(self) -> dict[str, Any]:
        """Every key with its value, the defaults too, as plain JSON (``show``)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def _derived(self) -> tuple[dict[str, Any], dict[str, int]]:
        # Computed once: a policy is immutable, and these are asked on every save and spawn.
        cached = self.__dict__.get("_cache")
        if cached is None:
            wire = {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                    if getattr(self, f.name) != f.default}
            limits = {k: v for k in LIMIT_KEYS if (v := getattr(self, k)) is not None}
            cached = (wire, limits)
            object.__setattr__(self, "_cache", cached)
        return cached

    @classmethod
    def from_wire(cls, wire: Any) -> "Policy":
        if wire is None:
            return cls()
        if not isinstance(wire, dict):
            raise InvalidSpec("policy must be an object")
        known = {f.name for f in fields(cls)}
        unknown = set(wire) - known
        if unknown:
            raise InvalidSpec(f"unknown policy key(s): {', '.join(sorted(unknown))}")
        # Any: the values are as they came over the wire; __post_init__ checks each one.
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in wire.items()}
        return cls(**kwargs)


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from a positive integer or a string ``512M``, ``1.5G``, ``64KiB`` (powers of
    1024, as systemd's MemoryMax= and cgroup tools read them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise InvalidSpec(f"{key} must be a positive number of bytes, got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m:
            n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
            if n >= 1:
                return n
    raise InvalidSpec(f"{key} must be a positive number of bytes or a size like \"512M\", got {value!r}")


def log_max_bytes(value: Any, key: str = "log_max_bytes") -> int:
    """A log file's rotation size: bytes (or "10M"), ``LOG_MIN_BYTES`` to ``LOG_MAX_BYTES_LIMIT``."""
    try:
        n = parse_size(value, key)
    except OverflowError:  # "9999...9K": a float too large for an int
        n = LOG_MAX_BYTES_LIMIT + 1
    if not LOG_MIN_BYTES <= n <= LOG_MAX_BYTES_LIMIT:
        raise InvalidSpec(f"{key} must be from {LOG_MIN_BYTES} (16K) to {LOG_MAX_BYTES_LIMIT} (1T) bytes, "
                          f"got {value!r}")
    return n


RESULT_MAX_BYTES = 16 << 20  # a daemon task's result larger than this fails the task
RESULT_MAX_BYTES_LIMIT = 1 << 30  # a frame of the task wire is at most 1 GiB


def result_max_bytes(value: Any, key: str = "result_max_bytes") -> int:
    """The bound on a daemon task's result: bytes (or "16M"), 1 to 1 GiB."""
    try:
        n = parse_size(value, key)
    except OverflowError:
        n = RESULT_MAX_BYTES_LIMIT + 1
    if not 1 <= n <= RESULT_MAX_BYTES_LIMIT:
        raise InvalidSpec(f"{key} must be from 1 byte to {RESULT_MAX_BYTES_LIMIT} (1G), got {value!r}")
    return n


def log_backups(value: Any, key: str = "log_backups") -> int:
    """Rotated files kept per stream: a whole number 0..``LOG_MAX_BACKUPS``."""
    _number(value, key, integer=True)
    if value > LOG_MAX_BACKUPS:
        raise InvalidSpec(f"{key} must be at most {LOG_MAX_BACKUPS}, got {value!r}")
    checked: int = value  # a whole number now
    return checked


def split_after(entry: str) -> tuple[str, str]:
    """``db`` -> (db, ready); ``migrate:completed`` -> (migrate, completed). InvalidSpec
    for anything else."""
    if not isinstance(entry, str):
        raise InvalidSpec(f"after takes POOL[:CONDITION] strings, got {entry!r}")
    name, _, condition = entry.partition(":")
    condition = condition or AFTER_CONDITIONS[0]
    if not _POOL_NAME.fullmatch(name):
        raise InvalidSpec(f"after: invalid pool name {name!r} in {entry!r}")
    if condition not in AFTER_CONDITIONS:
        raise InvalidSpec(f"after: {entry!r}: the condition must be one of {', '.join(AFTER_CONDITIONS)}")
    return name, condition


def after_entries(value: Any) -> tuple[str, ...]:
    """``after`` in its one form: ``POOL:CONDITION`` strings, sorted, each pool once (so
    that two launches that mean the same compare equal)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise InvalidSpec(f"after must be a list of POOL[:CONDITION], got {value!r}")
    pairs = [split_after(e) for e in value]
    names = [name for name, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidSpec(f"after names pool {twice[0]!r} more than once")
    return tuple(sorted(f"{name}:{condition}" for name, condition in pairs))


class AfterCycle(InvalidSpec):
    """Pools that start after each other in a circle: ``cycle`` names them, each pool
    before the one it starts after, the first one again at the end."""

    def __init__(self, cycle: list[str]) -> None:
        super().__init__(f"after: a cycle: {' -> '.join(cycle)} (each starts after the next)")
        self.cycle = cycle


def after_order(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The start order of pools, ``graph``: pool -> the pools it starts after (each one
    known). Layers: every pool of a layer starts after pools of earlier layers only (a stop
    goes through them backwards). AfterCycle (an InvalidSpec, one line) for a cycle."""
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for name, deps in graph.items():
        sorter.add(name, *deps)
    try:
        sorter.prepare()
    except graphlib.CycleError as err:
        # graphlib names each node before the one that waits for it: read it backwards
        raise AfterCycle(list(reversed(err.args[1]))) from None
    layers: list[list[str]] = []
    while sorter.is_active():
        layer = sorted(sorter.get_ready())
        layers.append(layer)
        sorter.done(*layer)
    return layers


def check_after(graph: Mapping[str, Iterable[str]], *, names: Iterable[str] | None = None) -> list[list[str]]:
    """after_order() of ``graph``, every pool it names known first: InvalidSpec names an
    unknown one (of the pools in ``names`` only, when given)."""
    for name in graph if names is None else names:
        for dep in graph.get(name, ()):
            if dep not in graph:
                raise InvalidSpec(f"after: unknown pool {dep!r} (pool {name} starts after it)")
    return after_order(graph)


def _pair(value: Any, key: str) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidSpec(f"{key} must be a pair, got {value!r}")
    return value[0], value[1]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def parse_pair(text: str, sep: str, key: str) -> tuple[float, float]:
    """``0.1:30`` or ``5/60`` from the command line."""
    a, found, b = text.partition(sep)
    try:
        if not found:
            raise ValueError
        return float(a), float(b)
    except ValueError:
        raise InvalidSpec(f"{key} takes A{sep}B, got {text!r}") from None
