"""Keeping pools alive: readiness and liveness, the restart policy, rolling restarts, and the
commands built on them (restart, delete, signal).

These are methods of the engine (``Engine`` inherits them): they read and change the
engine's replica table from its loop thread, like everything else there; this file only
keeps the policy apart from the table's mechanics (commands in, forks, exits, transitions).

    exec succeeded ─► ready probe? ──yes─► retry until ready ─► RUNNING ─► liveness checks
          │                │                     └ ready_timeout ─► FAILED (then stopped)
          │                └ start_secs ─► RUNNING once it ran that long
          ▼
    ended on its own ─► restart policy ─► slot backoff ─► replacement (new id, same slot)
                               └ (N+1)-th within S s ─► pool crashloop, size follows it out
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable, Iterable

from . import probes, protocol
from .errors import InvalidSpec
from .policy import Policy, signal_number
from .pools import CRASHLOOP, Pool, check_templates, expand_probe, unpack_row
from .rollout import Rollout
from .states import Replica
from .states import ReplicaState as S

log = logging.getLogger("orchestrator")
Reply = Callable[[dict], None]
_LIVE = (S.PENDING, S.STARTING, S.RUNNING)
_NOT_RESTORED = "not restored: "  # the reason's prefix of a stored pool that no longer resolves


class Supervision:
    """Mixed into Engine; see the module docstring."""

    _pools: dict[str, Pool]
    _replicas: dict[str, Replica]
    _procs: dict[int, Any]

    def restore(self, pools: Iterable[dict], *, relaunch: bool = True) -> None:
        """Recreate pools from the store at start-up (their ids continue where they
        stopped) and, with ``relaunch``, bring each back to its desired size."""
        for row in pools:
            wire, policy_wire, extra = unpack_row(row.get("spec"))
            runtime, policy, problem = None, Policy(), None
            desired = int(row["desired"])
            deleted = bool(extra.get("deleted"))
            try:
                # Checked as a declaration is: a journal written before a check existed (or
                # by hand) must not bring a pool back that ends the loop at every start.
                policy = Policy.from_wire(policy_wire)
                if wire:
                    runtime = self._prepare(wire)
                    check_templates(runtime, policy, 0 if deleted else desired)
            except InvalidSpec as err:
                problem = f"{_NOT_RESTORED}{err}"
            pool = Pool(row["name"], runtime, policy, desired=0, next_n=int(row["next_n"]))
            pool.deleted = deleted
            pool.declared = bool(extra.get("declared"))
            if extra.get("crashloop") and not str(extra["crashloop"]).startswith(_NOT_RESTORED):
                pool.crashloop(extra["crashloop"])  # (one of an earlier restore is judged anew)
            self._pools[pool.name] = pool
            if problem is not None:
                # Kept as stored (its size too: a later start tries again, say once a
                # missing executable is back) and shown as a crash loop with the reason;
                # an operator scales, replaces or deletes it.
                pool.runtime, pool.policy = None, Policy()
                pool.unresolved = (wire, policy_wire if policy_wire is not None else {})
                pool.desired = 0 if deleted else desired
                if not deleted:
                    pool.crashloop(problem)
                    log.error("pool %s: %s", pool.name, problem)
            elif relaunch and runtime is not None and not deleted:
                self._launch(pool, desired)
            self._save_pool(pool)

    def _cmd_restart(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        """Replace replicas with new ones (new ids, same slots): a rolling restart."""
        timeout = protocol.wait_timeout(args)
        if args.get("pool") is not None:
            pool = self._pool(args["pool"])
            if pool.runtime is None:
                raise InvalidSpec(f"pool {pool.name!r} has no usable spec to launch from ({pool.reason}): "
                                  "launch --replace, or delete it")
            unavailable = protocol.count(args.get("max_unavailable", 1), what="max_unavailable")
            pool.clear()
            self._cancel_replacements(pool)
            olds = sorted((r for r in pool.live.values() if not self._leaving(r)),
                          key=lambda r: r.slot if r.slot is not None else -1)
            return self._start_rollout(pool, [r.id for r in olds], unavailable, reply, cmd_id, timeout)
        ids = protocol.replica_ids(args.get("ids"), "restart", one_is_enough=True)
        reps = [self._lookup(i) for i in ids]
        live = [r for r in reps if r is not None and not r.state.terminal]
        if len(live) != len(ids):
            gone = sorted(set(ids) - {r.id for r in live})
            raise InvalidSpec(f"not live, nothing to restart: {', '.join(gone)}")
        by_pool: dict[str, list[str]] = {}
        for r in live:
            by_pool.setdefault(r.pool, []).append(r.id)
        if len(by_pool) != 1:
            raise InvalidSpec("restart replicas of one pool at a time")
        (pool_name, olds), = by_pool.items()
        return self._start_rollout(self._pools[pool_name], olds, len(olds), reply, cmd_id, timeout)

    # -- pools declared by a config file ---------------------------------------------------

    def prepare_declared(self, spec: dict, policy: dict, size: int) -> tuple[Any, Policy]:
        """A config pool's spec and policy made ready, checked as a declaration of ``size``
        replicas is (InvalidSpec if they cannot be): a reload checks every pool of the file
        before it changes anything."""
        return self.check_declaration(spec, policy, size)

    def declare(self, name: str, spec: dict, policy: dict, size: int,
                prepared: tuple[Any, Policy] | None = None) -> str:
        """Make pool ``name`` run ``spec`` under ``policy`` with ``size`` replicas, from the
        config file: created, rolled onto a new spec (a rolling restart, one slot at a time),
        or resized. Returns what it did: added, changed, resized or unchanged.

        The difference is taken against what runs, not against the file read before: every
        live replica made from another spec or policy than the one declared is rolled (an
        earlier rollout that gave up, or one still in flight, leaves such replicas), and a
        rollout of an earlier reload still in flight is superseded by this one, so that the
        last file read is what the pool ends as, at its size. ``prepared``: what
        prepare_declared() made of ``spec`` and ``policy`` already."""
        runtime, pol = prepared or self.prepare_declared(spec, policy, size)
        pool = self._pools.get(protocol.pool_name(name))
        if pool is None or pool.deleted:
            if pool is None:
                pool = self._pools[name] = Pool(name, runtime, pol)
            pool.deleted, pool.runtime, pool.policy = False, runtime, pol
            pool.declared = True
            pool.clear()
            self._converge(pool, size)
            return "added"
        was_declared, pool.declared = pool.declared, True
        changed = runtime.wire != (pool.runtime.wire if pool.runtime else None) or pol != pool.policy
        if changed:
            pool.runtime, pool.policy = runtime, pol
        stale = [r for r in pool.live.values()
                 if r.state in _LIVE and not self._leaving(r) and not self._runs_declared(pool, r)]
        rolling = [r for r in self._rollouts if r.pool is pool]
        if not (changed or stale):
            if rolling:  # a restart of what is declared already: it ends at this size
                resized = any(r.then_scale != size for r in rolling)
                for rollout in rolling:
                    rollout.then_scale = size
                return "resized" if resized else "unchanged"
            if size == pool.desired:
                if not was_declared:  # a launched pool the file now declares: stored as such
                    self._save_pool(pool)
                return "unchanged"
            pool.clear()
            self._converge(pool, size)
            return "resized"
        taken_over: list[str] = []
        for rollout in rolling:
            taken_over += rollout.stopped_unreplaced()
            rollout.finish("superseded by a reload of the config file")
        pool.clear()
        # the slots emptied already are filled first, then the stale replicas are rolled
        olds = taken_over + [r.id for r in self._one_per_slot(pool, stale) if r.id not in taken_over]

        def logged(msg: dict) -> None:
            if not msg.get("ok"):
                log.error("config: rolling pool %s onto its new spec: %s", name, msg.get("error"))

        self._save_pool(pool)
        self._start_rollout(pool, olds, 1, logged, None, protocol.DEFAULT_WAIT, then_scale=size)
        return "changed"

    def _runs_declared(self, pool: Pool, rep: Replica) -> bool:
        """Was ``rep`` made from the spec and policy ``pool`` declares now?"""
        made = rep.made_from
        return (made is not None and pool.runtime is not None and made[0] is not None
                and made[0].wire == pool.runtime.wire and made[1] == pool.policy)

    def _one_per_slot(self, pool: Pool, stale: list[Replica]) -> list[Replica]:
        """The stale replicas to roll, one per slot, in slot order. Overlapping rollouts
        leave a slot held twice: a stale replica beside a current one in its slot, or
        beside another stale one, is surplus and stopped now (the one kept is RUNNING if
        one is, else the newest)."""
        current = {r.slot for r in pool.live.values()
                   if r.state in _LIVE and not self._leaving(r) and self._runs_declared(pool, r)}
        by_slot: dict[int | None, list[Replica]] = {}
        for rep in stale:
            by_slot.setdefault(rep.slot, []).append(rep)
        olds: list[Replica] = []
        for slot, reps in by_slot.items():
            reps.sort(key=lambda r: (r.state is S.RUNNING, r.n), reverse=True)
            keep = reps if slot is None else [] if slot in current else reps[:1]
            olds.extend(keep)
            for rep in reps[len(keep):]:
                self._stop(rep, reason="superseded by a reload", lower_desired=False)
        return sorted(olds, key=lambda r: (r.slot if r.slot is not None else -1, r.n))

    def undeclare_missing(self, names: set[str]) -> list[str]:
        """Delete the pools an earlier config declared that the current one does not."""
        gone = [p.name for p in self._pools.values() if p.declared and not p.deleted and p.name not in names]
        for name in gone:
            self._cmd_delete({"pool": name}, lambda _msg: None, None)
        return gone

    def has_pool(self, name: str) -> bool:
        """Is ``name`` a pool of the table now (not deleted)? Else declaring it adds it."""
        return self._pool(name, missing_ok=True) is not None

    def deleted_not_ended(self) -> list[str]:
        """The replicas of deleted pools that still run or are not reaped yet."""
        return [rid for pool in self._pools.values() if pool.deleted
                for rid, rep in pool.live.items() if not (rep.state.terminal and rep.pid is None)]

    def when_ended(self, ids: list[str], then: Callable[[bool], None], timeout: float) -> None:
        """Call ``then(True)`` in the turn in which all of ``ids`` have ended and been
        reaped, or ``then(False)`` after ``timeout`` seconds if they have not."""
        self._add_waiter(ids, "ended", lambda msg: then(bool(msg.get("ok"))), None, timeout, durable=False)

    def _cmd_delete(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        """Terminate a pool's replicas and forget the pool (it does not come back on start)."""
        pool = self._pool(args.get("pool"))
        self._cancel_replacements(pool)
        stopped = [r.id for r in list(pool.live.values()) if self._stop(r, reason="pool deleted")]
        pool.desired = 0
        pool.deleted = True
        self._save_pool(pool)
        return {"pool": pool.name, "terminated": stopped}

    def _cmd_signal(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        """Send a signal to replicas' process trees (e.g. HUP to make a worker reload)."""
        sig = signal_number(args.get("signal"), "signal")
        if args.get("pool") is not None:
            reps = list(self._pool(args["pool"]).live.values())
        else:
            ids = protocol.replica_ids(args.get("ids"), "signal", one_is_enough=True)
            found = [self._lookup(i) for i in ids]
            reps = [r for r in found if r is not None]
        sent = []
        for rep in reps:
            proc = self._proc_of(rep)
            if proc is not None and not proc.reaped:
                self._signal_tree(proc, sig)
                sent.append(rep.id)
        return {"signal": signal.Signals(sig).name, "sent": sent}


    # -- rollouts -------------------------------------------------------------------

    def _start_rollout(self, pool: Pool, olds: list[str], width: int, reply: Reply, cmd_id: Any,
                       timeout: float, *, then_scale: int | None = None) -> Any:
        def done(result: dict | None, error: str | None) -> None:
            self._rollouts.remove(rollout)
            timer.cancel()
            alone = not pool.deleted and not any(r.pool is pool for r in self._rollouts)
            size = rollout.then_scale
            if size is not None and error is None:
                if alone:  # a slot held twice by overlapping operations goes first
                    pool.desired = size
                    self._trim_surplus(pool)
                self._converge(pool, size)
                result = {**(result or {}), "ids": [r.id for r in pool.live.values() if not self._leaving(r)]}
            elif size is None and alone:
                self._trim_surplus(pool)
            if error is None:
                self._outbox.append((reply, protocol.ok(cmd_id, result), True))
            else:
                self._outbox.append((reply, protocol.error(cmd_id, f"restart of pool {pool.name} failed: {error}",
                                                           data=result), False))

        rollout = Rollout(self, pool, olds, width, on_done=done, then_scale=then_scale)
        self._rollouts.append(rollout)
        timer = self.reactor.call_later(timeout, lambda: rollout.finish(f"timed out after {timeout:g} s"))
        rollout.advance()
        self._dirty = True
        return protocol.DEFERRED

    def replica(self, rid: str) -> Replica | None:
        return self._replicas.get(rid)

    def launch_into(self, pool: Pool, slot: int | None) -> str:
        (rid,) = self._launch(pool, 1, slots=[slot if slot is not None else pool.free_slots(1)[0]], grow=False)
        self._save_pool(pool)
        return rid

    def stop_for_rollout(self, rid: str) -> None:
        rep = self._replicas.get(rid)
        if rep is not None:
            self._stop(rep, reason="restarted", lower_desired=False)

    def _trim_surplus(self, pool: Pool) -> None:
        """Stop what holds more than the pool's size once its rollouts are over: operations
        that overlapped one (a replica terminated while its replacement was starting, a
        second restart of the same pool) leave extra replicas, a slot held twice first."""
        live = [r for r in pool.live.values() if r.state in _LIVE and not self._leaving(r)]
        extra = len(live) + len(pool.pending) - pool.desired
        if extra <= 0:
            return
        by_slot: dict[Any, list[Any]] = {}
        for r in live:
            by_slot.setdefault(r.slot, []).append(r)
        doubled = [r for reps in by_slot.values() if len(reps) > 1 for r in sorted(reps, key=lambda r: r.n)[:-1]]
        rest = sorted((r for r in live if r not in doubled),
                      key=lambda r: (r.slot if r.slot is not None else -1, r.n), reverse=True)
        for rep in (doubled + rest)[:extra]:
            self._stop(rep, reason="over the pool's size", lower_desired=False)
        pool.settle_state()
        self._save_pool(pool)

    def _converge(self, pool: Pool, n: int) -> None:
        """Bring the pool to ``n``: replicas and scheduled replacements of the highest slots
        go first (the newest first among equals), so that what stays holds 0..n-1."""
        live = [r for r in pool.live.values() if r.state in _LIVE and not self._leaving(r)]
        held: list[tuple[int, int, Any]] = [(r.slot if r.slot is not None else -1, r.n, r) for r in live]
        held += [(slot, -1, None) for slot in pool.pending]
        held.sort(key=lambda h: (h[0], h[1]), reverse=True)
        for slot, _, rep in held[: max(0, len(held) - n)]:
            if rep is None:
                pool.pending.pop(slot).cancel()
            else:
                self._stop(rep, reason="scaled down", lower_desired=False)
        if len(held) < n:
            self._launch(pool, n - len(held), grow=False)
        pool.settle_state()
        pool.desired = n
        self._save_pool(pool)


    # -- readiness and liveness -------------------------------------------------------

    def _started(self, proc: Any) -> None:
        """Its exec succeeded (or its callable is about to run): ready now, or once its
        probe says so, or once it has run start_secs."""
        rep = proc.replica
        policy = self._pools[rep.pool].policy
        if policy.ready is None:
            if policy.start_secs > 0:
                proc.cleanup.append(self.reactor.call_later(policy.start_secs, lambda: self._ready(proc)).cancel)
            else:
                self._ready(proc)
            return
        if policy.ready != "notify":
            try:
                spec = self._probe(rep, "ready", policy.ready)
            except InvalidSpec as err:
                self._bad_template(rep, err)
                return
            proc.cleanup.append(probes.retry_until_ready(
                spec, self.reactor, self.os, deadline_s=policy.ready_timeout, attempt_timeout=policy.probe_timeout,
                on_ready=lambda: self._ready(proc), on_timeout=lambda why: self._not_ready(proc, why),
                box=self._probe_box(proc, spec)).cancel)
        else:
            proc.cleanup.append(self.reactor.call_later(
                policy.ready_timeout,
                lambda: self._not_ready(proc, f"not ready within {policy.ready_timeout:g} s (no READY=1)")).cancel)

    def _probe(self, rep: Replica, key: str, text: str) -> Any:
        """The ``ready`` or ``live`` probe of ``rep``'s slot; InvalidSpec if it does not expand."""
        pool = self._pools[rep.pool]
        slot = rep.slot if rep.slot is not None else 0
        return expand_probe(key, text, slot, pool.port(slot))

    def _bad_template(self, rep: Replica, err: InvalidSpec) -> None:
        """A template that does not expand for ``rep``'s slot, found as it starts (a pool
        from a journal written before the declaration checked it, or a slot past the size
        while older replicas still stop). It would fail the same way every time: ``rep`` is
        FAILED with the reason, and its pool stops replacing (crashloop) until an operator
        acts (scale, restart --pool, launch --replace, delete)."""
        pool = self._pools[rep.pool]
        reason = f"could not start: {err}"
        self._transition(rep, S.FAILED, reason)
        self._signal_and_arm(rep)  # if it runs already (a probe is set up after the exec)
        if pool.state != CRASHLOOP:
            pool.crashloop(f"{rep.id}: {err}")
            log.error("pool %s: crash loop (%s); not replacing until an operator acts", pool.name, pool.reason)
            self.journal.event("crashloop", {"pool": pool.name, "replica": rep.id, "reason": pool.reason})
            self.metrics.crashloop(pool.name)
        self._ended_on_its_own(rep, failed=True)

    def _probe_box(self, proc: Any, spec: Any) -> Any:
        """Where the replica's exec probes run and write (probes.ProbeBox), made once and
        closed with the replica (it kills an attempt still in flight whole)."""
        if spec.kind != "exec":
            return None
        if proc.probes is None:
            proc.probes = probes.ProbeBox(proc.replica.id, self.containment, self.watchdog, self.log_capture)
            proc.cleanup.append(proc.probes.close)
        return proc.probes

    def _notify_socket(self, rep: Replica) -> Any:
        """The replica's own sd_notify socket (abstract: no file to clean up); OSError if not."""
        name = f"orchestrator-{self.config.token or os.getpid()}-{rep.id}"
        return probes.NotifySocket(self.reactor, lambda _n, fields: self._notified(rep, fields), name,
                                   sender_ok=lambda pid: self._notify_sender_ok(rep, pid))

    def _notify_sender_ok(self, rep: Replica, pid: int) -> bool:
        """Only the replica itself may notify for it (probes.from_replica), not another one."""
        proc = self._proc_of(rep)
        return proc is not None and probes.from_replica(pid, proc.pid, proc.cgroup)

    def _notified(self, rep: Replica, fields: dict[str, str]) -> None:
        proc = self._proc_of(rep)
        if proc is not None and fields.get("READY") == "1":
            self._ready(proc)

    def _ready(self, proc: Any) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.STARTING:
            return
        pool = self._pools[rep.pool]
        policy = pool.policy
        live = None
        if policy.live is not None:
            try:  # before it counts as RUNNING: a replica that cannot be checked is not started
                live = self._probe(rep, "live", policy.live)
            except InvalidSpec as err:
                self._bad_template(rep, err)
                return
        self._transition(rep, S.RUNNING)
        rep.ready, rep.started_at = True, self.os.time()
        if rep.slot is not None:
            slot = rep.slot
            proc.cleanup.append(self.reactor.call_later(policy.healthy_after, lambda: pool.healthy(slot)).cancel)
        if live is not None:
            proc.cleanup.append(probes.Checker(
                live, self.reactor, self.os, policy.live_interval, policy.live_failures, policy.probe_timeout,
                lambda why: self._liveness_failed(proc, why), box=self._probe_box(proc, live)).stop)

    def _not_ready(self, proc: Any, why: str) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.STARTING:
            return
        self._transition(rep, S.FAILED, why)
        self._signal_and_arm(rep)
        self._ended_on_its_own(rep, failed=True)

    def _liveness_failed(self, proc: Any, why: str) -> None:
        rep = proc.replica
        if proc.reaped or rep.state is not S.RUNNING:
            return
        log.warning("%s: liveness probe failed (%s); replacing it", rep.id, why)
        proc.replace = True
        self._stop(rep, reason="liveness probe failed", lower_desired=False)


    def _ended_on_its_own(self, rep: Replica, *, failed: bool) -> None:
        """The restart policy decides: replaced after a backoff (the pool keeps its size),
        or not (the pool's desired size follows the replica out)."""
        pool = self._pools[rep.pool]
        if self._slot_taken(pool, rep.slot):
            return  # a rolling restart's new replica holds the slot already: nothing to do
        if self.closing or rep.slot is None or not pool.wants_replacement(failed) or pool.state == CRASHLOOP:
            pool.desired -= 1
            self._save_pool(pool)
            return
        self._replace(rep, reason=rep.reason or "ended", backoff=True)

    def _slot_taken(self, pool: Pool, slot: int | None) -> bool:
        return slot is not None and any(r.slot == slot and not self._leaving(r) for r in pool.live.values())

    def _replace(self, rep: Replica, *, reason: str, backoff: bool) -> None:
        """A new replica in ``rep``'s slot: now, or after the slot's backoff. The (N+1)-th
        replacement within the window is not made: the pool is in a crash loop."""
        pool = self._pools[rep.pool]
        slot = rep.slot if rep.slot is not None else pool.free_slots(1)[0]
        if self.closing or pool.deleted:
            return
        if backoff and not pool.admit_replacement(self.os.monotonic()):
            limit, window = pool.policy.max_restarts
            pool.crashloop(f"{limit} restarts within {window:g} s; last: {rep.id} {reason}")
            pool.desired -= 1
            self._save_pool(pool)
            log.error("pool %s: crash loop (%s); not replacing %s until an operator acts", pool.name, pool.reason, rep.id)
            self.journal.event("crashloop", {"pool": pool.name, "replica": rep.id, "reason": pool.reason})
            self.metrics.crashloop(pool.name)
            return
        pool.slot_restarts[slot] = pool.slot_restarts.get(slot, 0) + 1
        self.metrics.restarted(pool.name)
        delay = pool.next_delay(slot) if backoff else 0.0
        self.journal.event("restart", {"pool": pool.name, "replica": rep.id, "slot": slot, "delay": round(delay, 3),
                                       "reason": reason})

        def launch() -> None:
            if pool.pending.pop(slot, None) is None or self.closing or pool.deleted:
                return
            pool.settle_state()
            if self._slot_taken(pool, slot):
                return
            self._launch(pool, 1, slots=[slot], grow=False)
            self._save_pool(pool)

        pool.pending[slot] = self.reactor.call_later(delay, launch)
        pool.settle_state()
        self._save_pool(pool)

    def _leaving(self, rep: Replica) -> bool:
        """Asked to stop for a replacement (it still runs, but no longer counts)."""
        proc = self._proc_of(rep)
        return proc is not None and proc.replace and rep.state is S.STOPPING

    def _cancel_replacements(self, pool: Pool) -> None:
        for timer in pool.pending.values():
            timer.cancel()
        pool.pending.clear()
        pool.settle_state()
