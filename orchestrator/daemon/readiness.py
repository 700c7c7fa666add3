"""Readiness and liveness: from a replica's exec to RUNNING, and its liveness checks after.

    exec succeeded ─► ready probe? ──yes─► retry until ready ─► RUNNING ─► liveness checks
          │                │                     └ ready_timeout ─► FAILED (then stopped)
          │                └ start_secs ─► RUNNING once it ran that long
          └ notify: READY=1 on its own sd_notify socket, from the replica itself

The engine calls ``started`` once a replica's exec succeeded; spawning.py asks for a
replica's ``notify_socket``; an upgrade's new image ``resume``s a RUNNING replica. What
follows from a failure is the supervisor's (supervision.py), through ``Outcomes``: a
template that does not expand, a replica never ready, a replica no longer live. Loop thread
only.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Protocol

from ..errors import InvalidSpec
from ..probespec import ProbeSpec
from ..states import Replica
from ..states import ReplicaState as S
from . import probes
from .notify import NotifySocket, from_replica
from .pools import Pool, expand_probe
from .probebox import ProbeBox

log = logging.getLogger("orchestrator")


class Proc(Protocol):
    """A replica's process as the table holds it (engine.Proc): what readiness reads."""

    pid: int
    replica: Replica
    reaped: bool
    cgroup: str | None
    cleanup: list[Callable[[], None]]  # called once it is reaped: its probes, timers, socket
    probes: Any  # probebox.ProbeBox of its exec probes, made by the first one


class Table(Protocol):
    """What readiness asks of the replica table (engine.Engine)."""

    reactor: Any
    os: Any
    containment: Any
    watchdog: Any
    log_capture: Any

    def pool(self, name: Any) -> Pool | None: ...
    def proc_of(self, rep: Replica) -> Any: ...
    def transition(self, rep: Replica, new: S, reason: str | None = None) -> None: ...
    def signal_and_arm(self, rep: Replica) -> None: ...


class Outcomes(Protocol):
    """What the supervisor does with a replica readiness gives up on."""

    def bad_template(self, rep: Replica, err: InvalidSpec) -> None: ...
    def ended_on_its_own(self, rep: Replica, *, failed: bool) -> None: ...
    def not_live(self, rep: Replica, why: str) -> None: ...


class Readiness:
    """See the module docstring. ``token``: names the replicas' notify sockets."""

    def __init__(self, table: Table, outcomes: Outcomes, token: str | None) -> None:
        self.table = table
        self.outcomes = outcomes
        self._token = token

    def _pool_of(self, rep: Replica) -> Pool:
        pool = self.table.pool(rep.pool)
        assert pool is not None  # a replica's pool is never forgotten, only marked deleted
        return pool

    def started(self, proc: Proc) -> None:
        """Its exec succeeded (or its callable is about to run): ready now, or once its
        probe says so, or once it has run start_secs."""
        rep = proc.replica
        policy = self._pool_of(rep).policy
        reactor = self.table.reactor
        if policy.ready is None:
            if policy.start_secs > 0:
                proc.cleanup.append(reactor.call_later(policy.start_secs, lambda: self._ready(proc)).cancel)
            else:
                self._ready(proc)
            return
        if policy.ready != "notify":
            try:
                spec = self._probe(rep, "ready", policy.ready)
            except InvalidSpec as err:
                self.outcomes.bad_template(rep, err)
                return
            proc.cleanup.append(probes.retry_until_ready(
                spec, reactor, self.table.os, deadline_s=policy.ready_timeout, attempt_timeout=policy.probe_timeout,
                on_ready=lambda: self._ready(proc), on_timeout=lambda why: self._not_ready(proc, why),
                box=self._probe_box(proc, spec)).cancel)
        else:
            proc.cleanup.append(reactor.call_later(
                policy.ready_timeout,
                lambda: self._not_ready(proc, f"not ready within {policy.ready_timeout:g} s (no READY=1)")).cancel)

    def _probe(self, rep: Replica, key: str, text: str) -> ProbeSpec:
        """The ``ready`` or ``live`` probe of ``rep``'s slot; InvalidSpec if it does not expand."""
        pool = self._pool_of(rep)
        slot = rep.slot if rep.slot is not None else 0
        return expand_probe(key, text, slot, pool.port(slot))

    def _probe_box(self, proc: Proc, spec: ProbeSpec) -> Any:
        """Where the replica's exec probes run and write (probebox.ProbeBox), made once and
        closed with the replica (it kills an attempt still in flight whole)."""
        if spec.kind != "exec":
            return None
        if proc.probes is None:
            proc.probes = ProbeBox(proc.replica.id, self.table.containment, self.table.watchdog,
                                   self.table.log_capture)
            proc.cleanup.append(proc.probes.close)
        return proc.probes

    def notify_socket(self, rep: Replica) -> NotifySocket:
        """The replica's own sd_notify socket (abstract: no file to clean up); OSError if not."""
        name = f"orchestrator-{self._token or os.getpid()}-{rep.id}"
        return NotifySocket(self.table.reactor, lambda _n, fields: self._notified(rep, fields), name,
                            sender_ok=lambda pid: self._notify_sender_ok(rep, pid))

    def _notify_sender_ok(self, rep: Replica, pid: int) -> bool:
        """Only the replica itself may notify for it (notify.from_replica), not another one."""
        proc = self.table.proc_of(rep)
        return proc is not None and from_replica(pid, proc.pid, proc.cgroup)

    def _notified(self, rep: Replica, fields: dict[str, str]) -> None:
        proc = self.table.proc_of(rep)
        if proc is not None and fields.get("READY") == "1":
            self._ready(proc)

    def _ready(self, proc: Proc) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.STARTING:
            return
        pool = self._pool_of(rep)
        policy = pool.policy
        live = None
        if policy.live is not None:
            try:  # before it counts as RUNNING: a replica that cannot be checked is not started
                live = self._probe(rep, "live", policy.live)
            except InvalidSpec as err:
                self.outcomes.bad_template(rep, err)
                return
        self.table.transition(rep, S.RUNNING)
        rep.ready, rep.started_at = True, self.table.os.time()
        self._watch(proc, pool, policy.healthy_after, live)

    def resume(self, proc: Proc) -> None:
        """A RUNNING replica taken over from an earlier image of the daemon (an upgrade):
        its healthy_after timer from when it became RUNNING, its liveness probe anew."""
        rep = proc.replica
        if rep.state is not S.RUNNING:
            return
        pool = self._pool_of(rep)
        policy = pool.policy
        started = rep.started_at if rep.started_at is not None else self.table.os.time()
        live = None
        if policy.live is not None:
            try:
                live = self._probe(rep, "live", policy.live)
            except InvalidSpec as err:  # it expanded when it started: the pool was checked since
                log.error("%s: liveness probe not resumed: %s", rep.id, err)
        healthy_in = max(0.0, policy.healthy_after - (self.table.os.time() - started))
        self._watch(proc, pool, healthy_in if rep.started_at is not None else None, live)

    def _watch(self, proc: Proc, pool: Pool, healthy_in: float | None, live: ProbeSpec | None) -> None:
        """A RUNNING replica: its slot's backoff starts over once it has been healthy
        ``healthy_in`` more seconds; its liveness probe ``live``, if any, checks it."""
        reactor = self.table.reactor
        policy = pool.policy
        slot = proc.replica.slot
        if slot is not None and healthy_in is not None:
            proc.cleanup.append(reactor.call_later(healthy_in, lambda: pool.healthy(slot)).cancel)
        if live is not None:
            proc.cleanup.append(probes.Checker(
                live, reactor, self.table.os, policy.live_interval, policy.live_failures, policy.probe_timeout,
                lambda why: self._liveness_failed(proc, why), box=self._probe_box(proc, live)).stop)

    def _not_ready(self, proc: Proc, why: str) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.STARTING:
            return
        self.table.transition(rep, S.FAILED, why)
        self.table.signal_and_arm(rep)
        self.outcomes.ended_on_its_own(rep, failed=True)

    def _liveness_failed(self, proc: Proc, why: str) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.RUNNING:
            return
        self.outcomes.not_live(rep, why)
