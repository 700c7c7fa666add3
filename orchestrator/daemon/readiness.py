"""Readiness and liveness: from a replica's exec to RUNNING, and its liveness checks after.

    exec succeeded ─► ready probe? ──yes─► retry until ready ─► RUNNING ─► liveness checks
          │                │                     └ ready_timeout ─► FAILED (then stopped)
          │                └ start_secs ─► RUNNING once it ran that long
          └ notify: READY=1 on its own sd_notify socket, from the replica itself

The engine calls ``started`` once a replica's exec succeeded; spawning.py asks for a
replica's ``notify_socket``. What follows from a failure is the supervisor's
(supervision.py), through ``Outcomes``: a template that does not expand, a replica never
ready, a replica no longer live. Loop thread only.

An upgrade (handover.py) carries a STARTING replica's wait as it stands: ``hand_over`` in
the old image says its kind, its deadline (monotonic: one clock for the whole machine) and,
for a probe, when its next attempt is due and what the attempts said, and detaches its
notify socket; ``resume`` in the new image goes on with that same wait (a deadline that
passed meanwhile fails it there), and with a RUNNING replica's healthy_after timer and
liveness probe.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from ..errors import InvalidSpec
from ..probespec import ProbeSpec
from ..states import Replica
from ..states import ReplicaState as S
from . import probes
from .notify import NotifySocket, from_replica
from .pools import Pool, expand_probe
from .probebox import ProbeBox

if TYPE_CHECKING:
    from watchdog.link import WatchdogLink

    from .containment import Cgroups, ProcessGroups
    from .logcapture import LogCapture
    from .osapi import OSApi
    from .reactor import Reactor, Timer

log = logging.getLogger("orchestrator")


class Proc(Protocol):
    """A replica's process as the table holds it (engine.Proc): what readiness reads."""

    pid: int
    replica: Replica
    reaped: bool
    ready_fd: int  # its ready pipe until the exec is known to have succeeded, then -1
    cgroup: str | None
    cleanup: list[Callable[[], None]]  # called once it is reaped: its probes, timers, socket
    probes: ProbeBox | None  # of its exec probes, made by the first one


class Table(Protocol):
    """What readiness asks of the replica table (engine.Engine)."""

    reactor: Reactor
    os: OSApi
    containment: Cgroups | ProcessGroups
    watchdog: WatchdogLink | None
    log_capture: LogCapture | None

    def pool(self, name: str) -> Pool | None: ...
    def proc_of(self, rep: Replica) -> Proc | None: ...
    def transition(self, rep: Replica, new: S, reason: str | None = None) -> None: ...
    def signal_and_arm(self, rep: Replica) -> None: ...


class Outcomes(Protocol):
    """What the supervisor does with a replica readiness gives up on."""

    def bad_template(self, rep: Replica, err: InvalidSpec) -> None: ...
    def ended_on_its_own(self, rep: Replica, *, failed: bool) -> None: ...
    def not_live(self, rep: Replica, why: str) -> None: ...


@dataclass(eq=False, slots=True)
class _Wait:
    """A STARTING replica's wait for readiness: ``kind`` "start_secs", "probe" (``handle``:
    probes' retry_until_ready) or "notify" (``handle``: the timer of its deadline)."""

    kind: str
    deadline: float
    handle: Timer | probes.ReadyWait


class Readiness:
    """See the module docstring. ``token``: names the replicas' notify sockets."""

    def __init__(self, table: Table, outcomes: Outcomes, token: str | None) -> None:
        self.table = table
        self.outcomes = outcomes
        self._token = token
        self._waits: dict[str, _Wait] = {}  # replica id -> its wait, while STARTING
        self._sockets: dict[str, NotifySocket] = {}  # replica id -> its notify socket, while open

    def _pool_of(self, rep: Replica) -> Pool:
        pool = self.table.pool(rep.pool)
        assert pool is not None  # a replica's pool is never forgotten, only marked deleted
        return pool

    def started(self, proc: Proc) -> None:
        """Its exec succeeded (or its callable is about to run): ready now, or once its
        probe says so, or once it has run start_secs."""
        policy = self._pool_of(proc.replica).policy
        if policy.ready is None:
            if policy.start_secs > 0:
                self._arm(proc, "start_secs", self.table.reactor.monotonic() + policy.start_secs)
            else:
                self._ready(proc)
            return
        self._arm(proc, "notify" if policy.ready == "notify" else "probe",
                  self.table.reactor.monotonic() + policy.ready_timeout)

    def _arm(self, proc: Proc, kind: str, deadline: float, carried: Mapping[str, Any] | None = None) -> None:
        """The wait of ``kind`` until ``deadline``; ``carried``: a probe's, as an earlier
        image left it (its next attempt, what the attempts said)."""
        rep = proc.replica
        policy = self._pool_of(rep).policy
        reactor = self.table.reactor
        if kind == "start_secs":
            handle: Timer | probes.ReadyWait = reactor.call_at(deadline, lambda: self._ready(proc))
        elif kind == "notify":
            handle = reactor.call_at(deadline, lambda: self._not_ready(
                proc, f"not ready within {policy.ready_timeout:g} s (no READY=1)"))
        else:
            if policy.ready is None or policy.ready == "notify":  # carried, but its pool has no probe now
                log.error("%s: its pool has no readiness probe to go on with; its wait starts over", rep.id)
                self.started(proc)
                return
            try:
                spec = self._probe(rep, "ready", policy.ready)
            except InvalidSpec as err:
                self.outcomes.bad_template(rep, err)
                return
            handle = probes.retry_until_ready(
                spec, reactor, self.table.os, deadline_s=policy.ready_timeout, attempt_timeout=policy.probe_timeout,
                on_ready=lambda: self._ready(proc), on_timeout=lambda why: self._not_ready(proc, why),
                box=self._probe_box(proc, spec),
                carried=None if carried is None else {**carried, "deadline": deadline})
        self._waits[rep.id] = _Wait(kind, deadline, handle)
        proc.cleanup.append(lambda: self._end_wait(rep))

    def _end_wait(self, rep: Replica) -> None:
        wait = self._waits.pop(rep.id, None)
        if wait is not None:
            wait.handle.cancel()

    # -- an upgrade ------------------------------------------------------------------

    def hand_over(self, proc: Proc) -> dict[str, Any] | None:
        """For an upgrade's next image: the replica's wait for readiness while it is
        STARTING, and its notify socket, detached (its fd, inheritable, goes on in the next
        image; closing the replica here no longer closes it). None: nothing to carry."""
        rep = proc.replica
        out: dict[str, Any] = {}
        wait = self._waits.get(rep.id)
        if wait is not None and rep.state is S.STARTING:
            out["wait"] = {"kind": wait.kind, "deadline": wait.deadline,
                           **(wait.handle.carried() if isinstance(wait.handle, probes.ReadyWait) else {})}
        sock = self._sockets.get(rep.id)
        if sock is not None and not sock.closed:
            out["notify"] = {"name": sock.name, "fd": sock.detach()}
        return out or None

    def resume(self, proc: Proc, carried: Mapping[str, Any] | None = None) -> None:
        """A replica taken over from an earlier image of the daemon (an upgrade), with what
        ``hand_over`` said there: its notify socket taken back; a STARTING replica's wait
        goes on with its deadline (one whose exec is not confirmed yet waits for its ready
        pipe, then ``started``); a RUNNING one's healthy_after timer from when it became
        RUNNING, its liveness probe anew."""
        rep = proc.replica
        carried = carried or {}
        notify = carried.get("notify")
        if notify is not None:
            sock = self._notify_socket(rep, str(notify["name"]), int(notify["fd"]))
            proc.cleanup.append(sock.close)
        if rep.state is S.STARTING:
            wait = carried.get("wait")
            if wait is not None:
                self._arm(proc, str(wait["kind"]), float(wait["deadline"]), wait)
            elif proc.ready_fd < 0:  # neither a wait nor a ready pipe: one from the start
                self.started(proc)
            return
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

    def _probe(self, rep: Replica, key: str, text: str) -> ProbeSpec:
        """The ``ready`` or ``live`` probe of ``rep``'s slot; InvalidSpec if it does not expand."""
        pool = self._pool_of(rep)
        slot = rep.slot if rep.slot is not None else 0
        return expand_probe(key, text, slot, pool.port(slot))

    def _probe_box(self, proc: Proc, spec: ProbeSpec) -> ProbeBox | None:
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
        return self._notify_socket(rep, f"orchestrator-{self._token or os.getpid()}-{rep.id}")

    def _notify_socket(self, rep: Replica, name: str, fd: int | None = None) -> NotifySocket:
        """Bound to ``name``, or the socket ``fd`` an earlier image bound to it."""
        rid = rep.id

        def closed() -> None:
            self._sockets.pop(rid, None)

        sock = NotifySocket(self.table.reactor, lambda _n, fields: self._notified(rep, fields), name,
                            sender_ok=lambda pid: self._notify_sender_ok(rep, pid), fd=fd, on_close=closed)
        self._sockets[rid] = sock
        return sock

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
        self._end_wait(rep)  # a notify deadline still pending, say
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
        self._end_wait(rep)
        self.table.transition(rep, S.FAILED, why)
        self.table.signal_and_arm(rep)
        self.outcomes.ended_on_its_own(rep, failed=True)

    def _liveness_failed(self, proc: Proc, why: str) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.RUNNING:
            return
        self.outcomes.not_live(rep, why)
