"""Keeping pools alive: what each pool should hold and keeping it so. The restart policy,
crash loops, rolling restarts, pools declared by the config file, and the commands that
shape pools (launch, scale, terminate, restart, delete, signal, and systemctl's verbs on a
pool: stop, start, reset-failed, show, is-active); readiness and liveness are
readiness.py's, the order of pools ordering.py's (both held here: ``readiness``, ``order``).

The daemon's loop thread runs it, beside the engine (engine.py) and apart from it: the
engine owns the replica table and the processes (forks, exits, signals, transitions, one
commit per turn); the ``Supervisor`` decides, and acts on the table only through ``Table``
below. It alone decides what a pool runs, its size and its restart state, each through a
method of the Pool (pools.py), which is the one writer of its fields. The engine tells it what happened through its hooks: ``ended_on_its_own``,
``stopped`` (ended after a stop was asked), ``settle``; spawning.py reports a
``bad_template``.

    ended on its own ─► restart policy ─► slot backoff ─► replacement (new id, same slot)
                               └ (N+1)-th within S s ─► pool crashloop, size follows it out

A pool an operator stopped (``stop POOL``) keeps its size and spec but runs nothing: no
replacement is scheduled or made, no launch, scale, reload or restore starts one, until
``start POOL`` brings it back to its size.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Callable, Iterable, Mapping, Protocol

from .. import protocol
from ..errors import InvalidSpec, UnknownPool
from ..policy import Policy, signal_number
from ..spec import Runtime, prepare
from ..states import Replica
from ..states import ReplicaState as S
from ..store import unpack_pool_row as unpack_row
from .containment import Cgroups, ProcessGroups
from .journal import Journal
from .metrics import Metrics
from .osapi import OSApi
from .pools import CRASHLOOP, Pool, check_templates
from .ordering import Order
from .reactor import Reactor
from .readiness import Proc, Readiness
from .rollout import Rollout
from .sockets import Listeners

log = logging.getLogger("orchestrator")
Reply = protocol.ReplyTo
_LIVE = (S.PENDING, S.STARTING, S.RUNNING)
_NOT_RESTORED = "not restored: "  # the reason's prefix of a stored pool that no longer resolves


class Table(Protocol):
    """What the supervisor asks of the replica table (engine.Engine), and all it asks."""

    reactor: Reactor
    os: OSApi
    journal: Journal
    metrics: Metrics
    containment: Cgroups | ProcessGroups
    watchdog: Any  # the watchdog's ledger feed, for exec probes' cgroups
    log_capture: Any  # logcapture.LogCapture, for exec probes' output
    listeners: Listeners  # the pools' listening sockets, opened when a pool declares them
    closing: bool
    config: Any  # engine.EngineConfig: the daemon's grace

    def pool(self, name: Any) -> Pool | None: ...  # deleted ones too
    def pools(self) -> Iterable[Pool]: ...
    def add_pool(self, pool: Pool) -> None: ...
    def save_pool(self, pool: Pool) -> None: ...
    def replica(self, rid: str) -> Replica | None: ...
    def lookup(self, rid: str) -> Replica | None: ...  # UnknownReplica; None: ended long ago
    def proc_of(self, rep: Replica) -> Proc | None: ...
    def launch(self, pool: Pool, count: int, *, slots: list[int] | None = None) -> list[str]: ...
    def stop(self, rep: Replica, *, reason: str) -> bool: ...
    def signal(self, rep: Replica, sig: int) -> bool: ...
    def signal_and_arm(self, rep: Replica) -> None: ...
    def transition(self, rep: Replica, new: S, reason: str | None = None) -> None: ...
    def reply(self, reply: Reply, msg: protocol.Reply, durable: bool) -> None: ...
    def changed(self) -> None: ...
    def room_for(self, more: int) -> None: ...  # OrchestratorError: that would take the control plane's reserve
    def wait_for(self, ids: Iterable[str], until: str, reply: Reply, cmd_id: Any, timeout: float,
                 *, durable: bool = True) -> Any: ...


class Supervisor:
    """See the module docstring. Loop thread only, like the table it acts on."""

    def __init__(self, table: Table, *, base_env: dict[str, str], token: str | None) -> None:
        self.table = table
        self._base_env = base_env
        self._token = token
        self._rollouts: list[Rollout] = []
        self._replacing: set[str] = set()  # ids asked to stop in order to be replaced (liveness)
        # ids that end by the pool's own design (an executor's worker retired after its
        # tasks, or killed for a task that outran its cancel): replaced at once, not counted
        self._renewing: dict[str, str] = {}
        self.readiness = Readiness(table, self, token)  # exec -> RUNNING, and liveness after
        self.order = Order(table, self._leaving)  # which pools start after which

    def commands(self) -> dict[str, Callable[[dict[str, Any], Reply, Any], Any]]:
        """The commands it answers: op -> handler(args, reply, cmd_id)."""
        return {"launch": self._cmd_launch, "scale": self._cmd_scale, "restart": self._cmd_restart,
                "delete": self._cmd_delete, "signal": self._cmd_signal, "terminate": self._cmd_terminate,
                "stop_pools": self._cmd_stop_pools, "start_pools": self._cmd_start_pools,
                "reset_failed": self._cmd_reset_failed, "show": self._cmd_show, "is_active": self._cmd_is_active}

    # -- hooks the engine calls ---------------------------------------------------------

    def settle(self) -> None:
        """Something changed this turn: every rollout moves as far as it can."""
        for rollout in list(self._rollouts):
            rollout.advance()

    def held(self) -> set[str]:
        """The replica ids a rollout still reads: kept in memory while it runs."""
        return {rid for r in self._rollouts for rid in r.ids()}

    def stopped(self, rep: Replica) -> None:
        """``rep`` ended after it was asked to stop: replaced if that was the point."""
        if self._pool_of(rep).stopped:  # stopped with its pool: nothing replaces it
            self._renewing.pop(rep.id, None)
            self._replacing.discard(rep.id)
            return
        if rep.id in self._renewing:
            self._replace(rep, reason=self._renewing.pop(rep.id), backoff=False)
            return
        if rep.id in self._replacing:  # only a failed liveness probe asks for that
            self._replacing.discard(rep.id)
            # A failure like any other: after the slot's backoff, and counted against
            # max_restarts, so a replica that is never live ends in a crash loop.
            self._replace(rep, reason="liveness probe failed", backoff=True)

    def ended_on_its_own(self, rep: Replica, *, failed: bool) -> None:
        """The restart policy decides: replaced after a backoff (the pool keeps its size),
        or not (the pool's desired size follows the replica out)."""
        pool = self._pool_of(rep)
        renewed = self._renewing.pop(rep.id, None)
        if self._slot_taken(pool, rep.slot):
            return  # a rolling restart's new replica holds the slot already: nothing to do
        if pool.deleted:
            return  # its size is 0 already (a reload's delete stops dependencies last)
        if pool.stopped:
            return  # it keeps its size for its start; nothing replaces it meanwhile
        if renewed is not None and not self.table.closing:
            self._replace(rep, reason=renewed, backoff=False)
            return
        if self.table.closing or rep.slot is None or not pool.wants_replacement(failed) or pool.state == CRASHLOOP:
            pool.lower()
            if failed and not self.table.closing and rep.slot is not None:
                pool.left_failed(rep.slot, f"{rep.id} {rep.state.value} ({rep.reason})")
            self.table.save_pool(pool)
            return
        self._replace(rep, reason=rep.reason or "ended", backoff=True)

    def renew(self, rep: Replica, reason: str, *, now: bool = False) -> None:
        """``rep`` is about to end by its pool's own design, not as a failure (an executor's
        worker that retires after ``max_tasks_per_child`` tasks, or is killed because a task
        outran its cancel): replaced without a backoff and not counted toward a crash loop.
        ``now``: its replacement starts at once, sharing its slot while it ends (a surge),
        so a process per task does not wait for each exit."""
        pool = self._pool_of(rep)
        if now and rep.slot is not None and not self.table.closing and not pool.deleted and not pool.stopped:
            self.table.launch(pool, 1, slots=[rep.slot])
            pool.count_restart(rep.slot)
            self.table.metrics.restarted(pool.name)
            return  # when it ends, the new one holds its slot: nothing more to do
        self._renewing[rep.id] = reason

    # -- an elastic executor pool's size (the task table asks: daemon/elastic.py) --------

    def grow(self, pool: Pool, count: int) -> list[str]:
        """``count`` more workers for an elastic executor pool whose queued tasks find none
        free: launched now into the lowest free slots (forked warm by its spawner), the
        pool's size raised by as many. OrchestratorError (one line) if they would take what
        the daemon keeps for its control plane; nothing is launched then."""
        if (count <= 0 or self.table.closing or pool.deleted or pool.stopped or pool.runtime is None
                or pool.state == CRASHLOOP):
            return []
        self.table.room_for(count)
        ids = self.table.launch(pool, count)
        pool.grow(len(ids))
        self.table.save_pool(pool)
        return ids

    def retire(self, rep: Replica, reason: str) -> bool:
        """An elastic executor pool's idle worker retires (idle_timeout above min_workers):
        stopped as a scale-down stops a replica (the pool's stop signal, then SIGKILL after
        its grace), not replaced, the pool's size one less. False if it is no longer
        running (ending already)."""
        pool = self._pool_of(rep)
        if self.table.closing or pool.deleted or rep.state is not S.RUNNING:
            return False
        if not self.table.stop(rep, reason=reason):
            return False
        pool.lower()
        pool.settle_state()
        self.table.save_pool(pool)
        return True

    # -- declaring pools ----------------------------------------------------------------

    def open_pool(self, name: str, spec: Any, policy: Any, size: int) -> tuple[Pool, list[str]]:
        """Pool ``name`` running ``spec`` under ``policy`` with ``size`` replicas (an
        executor's): made (or made again, if deleted) and launched; joined as it is if it
        runs that spec and policy already; InvalidSpec if it runs others."""
        runtime, pol = self.check_declaration(spec, policy, size)
        pool = self.table.pool(protocol.pool_name(name))
        if pool is not None and not pool.deleted:
            if runtime.wire != (pool.runtime.wire if pool.runtime else None) or pol != pool.policy:
                raise InvalidSpec(f"pool {name!r} runs another spec or policy: use another pool name")
            if pool.desired != size:
                raise InvalidSpec(f"pool {name!r} has {pool.desired} workers, not {size}: use another pool name")
            return pool, [r.id for r in pool.live.values()]
        self.table.room_for(size)
        if pool is None:
            pool = Pool(name, runtime, pol)
            self.table.add_pool(pool)
        else:
            pool.reopen(runtime, pol)
        self._converge(pool, size)
        return pool, [r.id for r in pool.live.values()]

    def delete_pool(self, name: str) -> list[str]:
        """``delete`` of pool ``name``: every replica it still has, ending or not."""
        pool = self._pool(name)
        ids = list(pool.live)
        self._delete(pool)
        return ids

    def prepare(self, wire: Any) -> Runtime:
        return prepare(wire, self._base_env)

    def check_declaration(self, spec: Any, policy: Any, size: int | None = None) -> tuple[Runtime, Policy]:
        """A pool's spec and policy from the wire, checked as a declaration is: the spec
        resolves, the limits are available, and (given its ``size``) every slot's templates
        expand. InvalidSpec (one line) otherwise; nothing is changed."""
        runtime = self.prepare(spec)
        pol = Policy.from_wire(policy)
        self.table.containment.check_limits(pol.limits)
        self.table.listeners.open(pol.sockets)  # bound now: a bad address is this command's error
        if size is not None:
            check_templates(runtime, pol, size)
        return runtime, pol

    def restore(self, pools: Iterable[Mapping[str, Any]], *, relaunch: bool = True) -> None:
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
                    runtime = self.prepare(wire)
                    check_templates(runtime, policy, 0 if deleted else desired)
                if not deleted:
                    self.table.listeners.open(policy.sockets)
            except InvalidSpec as err:
                problem = f"{_NOT_RESTORED}{err}"
            pool = Pool.restored(row["name"], runtime, policy, next_n=int(row["next_n"]), extra=extra)
            if extra.get("crashloop") and not str(extra["crashloop"]).startswith(_NOT_RESTORED):
                pool.crashloop(extra["crashloop"])  # (one of an earlier restore is judged anew)
            self.table.add_pool(pool)
            if problem is not None:
                # Kept as stored (its size too: a later start tries again, say once a
                # missing executable is back) and shown as a crash loop with the reason;
                # an operator scales, replaces or deletes it.
                pool.unresolvable(wire, policy_wire, 0 if deleted else desired, None if deleted else problem)
                if not deleted:
                    log.error("pool %s: %s", pool.name, problem)
            elif relaunch and runtime is not None and not deleted and pool.stopped:
                pool.scale_to(desired)  # stopped by an operator: its size waits for its start
            elif relaunch and runtime is not None and not deleted:
                pool.grow(len(self.table.launch(pool, desired)))
            self.table.save_pool(pool)

    # -- commands -------------------------------------------------------------------

    def _cmd_launch(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        name = protocol.pool_name(args.get("pool"))
        replace = bool(args.get("replace"))
        count = protocol.count(args["count"], low=0 if replace else 1) if "count" in args else None
        timeout = protocol.wait_timeout(args) if args.get("wait") or replace else None
        runtime, policy = self.check_declaration(args.get("spec"), args.get("policy"))
        pool = self.table.pool(name)
        # The size the pool will have, for the templates' check, before anything changes.
        if pool is None or pool.deleted:
            size = 1 if count is None else count
        elif runtime.wire != (pool.runtime.wire if pool.runtime else None) or policy != pool.policy:
            if not replace:
                raise InvalidSpec(f"pool {name!r} runs another spec or policy: use --replace to roll it "
                                  "onto this one, or another pool name")
            size = len(pool.live) if count is None else count
        else:
            size = pool.desired + (1 if count is None else count)
        check_templates(runtime, policy, size)
        if pool is not None and not pool.deleted and pool.stopped:
            raise InvalidSpec(f"pool {name!r} is stopped: start it first (start {name}), or scale it "
                              "(its size changes, nothing starts)")
        self.order.check(name, policy.after_pools)
        rolls = pool is not None and not pool.deleted and (
            runtime.wire != (pool.runtime.wire if pool.runtime else None) or policy != pool.policy)
        self.table.room_for(1 if rolls or count is None else count)  # a rollout adds one at a time
        if pool is not None and pool.deleted:  # a deleted pool's name again: ids still continue
            pool.reopen(runtime, policy)
        if pool is None:
            pool = Pool(name, runtime, policy)
            self.table.add_pool(pool)
        elif runtime.wire != (pool.runtime.wire if pool.runtime else None) or policy != pool.policy:
            pool.respec(runtime, policy)
            pool.clear()
            olds = sorted(pool.live.values(), key=lambda r: r.slot if r.slot is not None else -1)
            target = len(olds) if count is None else count
            self.table.save_pool(pool)
            assert timeout is not None  # replace: always waits
            return self._start_rollout(pool, [r.id for r in olds[:target]], 1, reply, cmd_id, timeout,
                                       then_scale=target)
        if replace:
            pool.clear()
        ids = self.table.launch(pool, 1 if count is None else count)
        pool.grow(len(ids))
        self.table.save_pool(pool)
        if timeout is not None:
            return self.table.wait_for(ids, "running", reply, cmd_id, timeout)
        return ids

    def _cmd_terminate(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """Stop replicas; each pool's size follows them out (they are not replaced)."""
        ids = protocol.replica_ids(args.get("ids"), "terminate", one_is_enough=True)
        timeout = protocol.wait_timeout(args) if args.get("wait") else None
        reps = [self.table.lookup(i) for i in ids]  # all or nothing: an unknown id changes nothing
        stopped: list[str] = []
        for rep in reps:
            if rep is not None and self.table.stop(rep, reason="terminated"):
                pool = self._pool_of(rep)
                pool.lower()
                self.table.save_pool(pool)
                stopped.append(rep.id)
        if timeout is not None:
            return self.table.wait_for(tuple(ids), "ended", reply, cmd_id, timeout)
        return stopped

    def _cmd_scale(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        name = args.get("pool")
        n = protocol.count(args.get("n"), low=0, what="size")
        pool = self._known_pool(name)
        if pool is None or not pool.stopped:
            self.table.room_for(n - (len(self._live(pool)) if pool is not None else 0))
        if args.get("spec") is not None:
            runtime = self.prepare(args["spec"])
            check_templates(runtime, pool.policy if pool is not None else Policy(), n)
            if pool is None:
                gone = self.table.pool(protocol.pool_name(name))
                if gone is not None and gone.deleted:  # a deleted pool's name again: ids still continue
                    pool = gone
                    pool.reopen(runtime, Policy.from_wire(None))
                else:
                    pool = Pool(protocol.pool_name(name), runtime)
                    self.table.add_pool(pool)
            else:
                pool.respec(runtime, pool.policy)
        elif pool is not None:
            check_templates(pool.runtime, pool.policy, n)
        if pool is None:
            raise UnknownPool(f"unknown pool {name!r}: launch a replica into it first")
        pool.clear()  # an operator acted: a crash loop is forgiven
        if pool.stopped:  # its size for its start; nothing starts (or is left to stop) now
            pool.scale_to(n)
            self.table.save_pool(pool)
            return {"pool": pool.name, "desired": n, "launched": [], "terminated": [], "stopped": True}
        live = self._live(pool)
        if len(live) < n and pool.runtime is None:
            raise InvalidSpec(f"pool {name!r} has no usable spec to launch from")
        before = set(pool.live)
        self._converge(pool, n)
        launched = [rid for rid in pool.live if rid not in before]
        stopped = sorted((r for r in live if r.state not in _LIVE), key=lambda r: -r.n)
        return {"pool": pool.name, "desired": n, "launched": launched, "terminated": [r.id for r in stopped]}

    def _live(self, pool: Pool) -> list[Replica]:
        return [r for r in pool.live.values() if r.state in _LIVE and not self._leaving(r)]

    def _cmd_restart(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """Replace replicas with new ones (new ids, same slots): a rolling restart."""
        timeout = protocol.wait_timeout(args)
        if args.get("pool") is not None:
            pool = self._pool(args["pool"])
            if pool.stopped:
                raise InvalidSpec(f"pool {pool.name!r} is stopped: nothing runs to restart (start {pool.name})")
            if pool.runtime is None:
                raise InvalidSpec(f"pool {pool.name!r} has no usable spec to launch from ({pool.reason}): "
                                  "launch --replace, or delete it")
            unavailable = protocol.count(args.get("max_unavailable", 1), what="max_unavailable")
            pool.clear()
            in_order = sorted((r for r in pool.live.values() if not self._leaving(r)),
                              key=lambda r: r.slot if r.slot is not None else -1)
            # A replacement waiting out its backoff starts now, on the spec the rollout rolls
            # to: the operator acted. (Cancelled alone, its slot stayed empty for good.)
            due = sorted(pool.pending)
            pool.cancel_replacements()
            if due:
                self.table.launch(pool, len(due), slots=due)
                self.table.save_pool(pool)
            return self._start_rollout(pool, [r.id for r in in_order], unavailable, reply, cmd_id, timeout)
        ids = protocol.replica_ids(args.get("ids"), "restart", one_is_enough=True)
        reps = [self.table.lookup(i) for i in ids]
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
        if self._pool(pool_name).stopped:
            raise InvalidSpec(f"pool {pool_name!r} is stopped: its replicas are stopping, not restarted")
        return self._start_rollout(self._pool(pool_name), olds, len(olds), reply, cmd_id, timeout)

    def _cmd_delete(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """Terminate a pool's replicas and forget the pool (it does not come back on start).
        Refused while another pool starts after it: its dependents go first."""
        pool = self._pool(args.get("pool"))
        needed_by = self.order.dependents(pool.name)
        if needed_by:
            raise InvalidSpec(f"pool {pool.name!r} is in the after of {', '.join(needed_by)}: delete "
                              f"{'that' if len(needed_by) == 1 else 'those'} first, or launch --replace without it")
        return self._delete(pool)

    def _delete(self, pool: Pool, *, stop: bool = True) -> dict[str, Any]:
        """Forget ``pool``; ``stop``: its replicas are terminated now (else the caller does)."""
        pool.delete()
        stopped = [r.id for r in list(pool.live.values()) if self.table.stop(r, reason="pool deleted")] if stop else []
        self.table.save_pool(pool)
        self.table.listeners.changed()  # closed if no other pool uses them
        return {"pool": pool.name, "terminated": stopped}

    def _cmd_signal(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """Send a signal to replicas' process trees (e.g. HUP to make a worker reload)."""
        sig = signal_number(args.get("signal"), "signal")
        if args.get("pool") is not None:
            reps = list(self._pool(args["pool"]).live.values())
        else:
            ids = protocol.replica_ids(args.get("ids"), "signal", one_is_enough=True)
            found = [self.table.lookup(i) for i in ids]
            reps = [r for r in found if r is not None]
        sent = [rep.id for rep in reps if self.table.signal(rep, sig)]
        return {"signal": signal.Signals(sig).name, "sent": sent}

    # -- systemctl's verbs on a pool -----------------------------------------------------

    def _named_pools(self, args: Mapping[str, Any]) -> list[Pool]:
        """The pools a verb names (``pools``: one or more), all or none: an unknown one is
        the command's error before any pool changes."""
        names = args.get("pools")
        if not isinstance(names, list) or not names:
            raise InvalidSpec("pools: give one or more pool names")
        pools: list[Pool] = []
        for name in names:
            pool = self._pool(protocol.pool_name(name))
            if pool not in pools:
                pools.append(pool)
        return pools

    def _cmd_stop_pools(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """``stop POOL...``: every replica stopped as ``scale 0`` stops it (the pool's stop
        signal, SIGKILL after its grace), none replaced; each pool keeps its size and spec
        and stays stopped (across restarts too: the flag is stored) until ``start``.
        ``wait``: the reply comes once they have all ended."""
        pools = self._named_pools(args)
        timeout = protocol.wait_timeout(args) if args.get("wait") else None
        stopping: list[str] = []
        for pool in pools:
            for rollout in [r for r in self._rollouts if r.pool is pool]:
                rollout.finish("the pool was stopped")
            pool.stop()
            for rep in list(pool.live.values()):
                self._replacing.discard(rep.id)
                self._renewing.pop(rep.id, None)
                if self.table.stop(rep, reason="pool stopped") or rep.state is S.STOPPING:
                    stopping.append(rep.id)
            self.table.save_pool(pool)
            self.table.journal.event("pool_stopped", {"pool": pool.name, "desired": pool.desired})
        result = {"stopped": [p.name for p in pools], "terminating": stopping}
        if timeout is not None:
            self.when_ended(stopping, lambda ended: self._answer(
                reply, cmd_id, result, None if ended else f"not all stopped within {timeout:g} s"), timeout)
            return protocol.DEFERRED
        return result

    def _answer(self, reply: Reply, cmd_id: Any, result: dict[str, Any], error: str | None) -> None:
        """A verb's reply once what it waited for is over: its result, or ``error`` with it."""
        self.table.reply(reply, protocol.ok(cmd_id, result) if error is None
                         else protocol.error(cmd_id, error, data=result), error is None)

    def _cmd_start_pools(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """``start POOL...``: stopped pools back to their size (one not stopped is left as it
        is). Replicas of theirs still stopping are waited for first (bounded by their grace),
        so that the new ones take their slots, and ports, not the next ones. ``wait``: the
        reply comes once the replicas it launched run (or have ended)."""
        pools = self._named_pools(args)
        timeout = protocol.wait_timeout(args) if args.get("wait") else None
        to_start = [p for p in pools if p.stopped]
        for pool in to_start:  # checked before any pool changes
            if pool.runtime is None and pool.desired > 0:
                raise InvalidSpec(f"pool {pool.name!r} has no usable spec to launch from ({pool.reason}): "
                                  "launch --replace, or delete it")
        self.table.room_for(sum(max(0, p.desired - len(self._live(p))) for p in to_start))
        ending = [r.id for p in to_start for r in p.live.values() if r.state is S.STOPPING]
        result: dict[str, Any] = {"started": [p.name for p in to_start], "launched": []}
        for pool in to_start:
            pool.start()
            self.table.save_pool(pool)
            self.table.journal.event("pool_started", {"pool": pool.name, "desired": pool.desired})

        def launch() -> bool:
            """Launch what the pools lack; whether the reply waits for those to run."""
            for pool in to_start:
                if pool.stopped or pool.deleted or self.table.closing:  # stopped again meanwhile
                    continue
                before = set(pool.live)
                self._converge(pool, pool.desired)
                result["launched"] += [rid for rid in pool.live if rid not in before]
            if timeout is None or not result["launched"]:
                return False
            self.table.wait_for(result["launched"], "running", lambda msg: self._answer(
                reply, cmd_id, result, None if msg.get("ok") else f"not all running within {timeout:g} s"),
                cmd_id, timeout, durable=False)
            return True

        if not ending:
            return protocol.DEFERRED if launch() else result

        def resume(_ended: bool) -> None:
            if not launch():
                self._answer(reply, cmd_id, result, None)

        self.when_ended(ending, resume, 10.0 + max(self._grace_of(p) for p in to_start))
        return protocol.DEFERRED

    def _grace_of(self, pool: Pool) -> float:
        return pool.policy.grace if pool.policy.grace is not None else float(self.table.config.grace)

    def _cmd_reset_failed(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """``reset-failed POOL...``: a crash loop, the failed slots and the backoff are
        forgotten, the restart counters start from 0, and (unless the pool is stopped) the
        pool is brought back to its size with its failed slots filled again, now."""
        pools = self._named_pools(args)
        for pool in pools:
            if pool.runtime is None:
                raise InvalidSpec(f"pool {pool.name!r} has no usable spec to launch from ({pool.reason}): "
                                  "launch --replace, or delete it")
        launched: list[str] = []
        reset: list[str] = []
        for pool in pools:
            size = pool.reset_failed()
            reset.append(pool.name)
            if pool.stopped:
                pool.scale_to(size)
                self.table.save_pool(pool)
                continue
            self.table.room_for(size - len(self._live(pool)))
            before = set(pool.live)
            self._converge(pool, size)
            launched += [rid for rid in pool.live if rid not in before]
        return {"reset": reset, "launched": launched}

    def active_state(self, pool: Pool) -> str:
        """systemd's ActiveState of a pool: ``active`` (every replica of its size RUNNING,
        hence ready; nothing failed, nothing waits for a backoff), ``activating`` (some
        still start, or a replacement waits for its backoff), ``deactivating`` (stopped,
        replicas still ending), ``inactive`` (stopped, nothing left), ``failed`` (a crash
        loop, or a failed replica that was not replaced)."""
        live = [r for r in pool.live.values() if not self._leaving(r)]
        if pool.stopped:
            return "deactivating" if live else "inactive"
        if pool.state == CRASHLOOP or pool.failed:
            return "failed"
        running = sum(r.state is S.RUNNING for r in live)
        if running >= pool.desired and not pool.pending:
            return "active"
        return "activating"

    def _cmd_is_active(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        pool = self._pool(protocol.pool_name(args.get("pool")))
        state = self.active_state(pool)
        return {"pool": pool.name, "active": state == "active", "state": state}

    def _cmd_show(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        """Every property of a pool: as ``status`` shows it, and the policy with each
        default resolved (the daemon's grace, its log rotation), its order, sockets and
        counts."""
        pool = self._pool(protocol.pool_name(args.get("pool")))
        row = pool.to_dict()
        live = [r for r in pool.live.values() if not self._leaving(r)]
        counts = {state.value: 0 for state in (S.PENDING, S.STARTING, S.RUNNING, S.STOPPING)}
        for rep in pool.live.values():
            counts[rep.state.value] = counts.get(rep.state.value, 0) + 1
        effective = pool.policy.every_value()
        config = self.table.config
        if effective.get("grace") is None:
            effective["grace"] = config.grace
        capture = self.table.log_capture
        if capture is not None:
            for key, value in (("log_max_bytes", capture.max_bytes), ("log_backups", capture.backups)):
                if effective.get(key) is None:
                    effective[key] = value
        return {**row, "active_state": self.active_state(pool),
                "effective": effective, "replicas": sorted(pool.live), "counts": counts,
                "running": sum(r.state is S.RUNNING for r in live),
                "pending_replacements": sorted(pool.pending),
                "failed_slots": {str(k): v for k, v in sorted(pool.failed.items())},
                "slot_restarts": {str(k): v for k, v in sorted(pool.slot_restarts.items())},
                "after_pools": pool.policy.after_pools, "required_by": self.order.dependents(pool.name),
                "start_position": self.order.start_order().index(pool.name) + 1,
                "waiting": self.order.waiting(pool) if pool.policy.after else None,
                "sockets": list(pool.policy.sockets), "declared": pool.declared, "next_n": pool.next_n}

    def _pool(self, name: Any) -> Pool:
        pool = self._known_pool(name)
        if pool is None:
            raise UnknownPool(f"unknown pool {name!r}")
        return pool

    def _known_pool(self, name: Any) -> Pool | None:
        """Pool ``name``, None if there is none or it was deleted."""
        pool = self.table.pool(name)
        return None if pool is None or pool.deleted else pool

    def _pool_of(self, rep: Replica) -> Pool:
        return self._pool_of_name(rep.pool)

    # -- pools declared by a config file ---------------------------------------------------

    def declare(self, name: str, spec: Mapping[str, Any], policy: dict[str, Any], size: int,
                prepared: tuple[Runtime, Policy] | None = None) -> str:
        """Make pool ``name`` run ``spec`` under ``policy`` with ``size`` replicas, from the
        config file: created, rolled onto a new spec (a rolling restart, one slot at a time),
        or resized. Returns what it did: added, changed, resized or unchanged.

        The difference is taken against what runs, not against the file read before: every
        live replica made from another spec or policy than the one declared is rolled (an
        earlier rollout that gave up, or one still in flight, leaves such replicas), and a
        rollout of an earlier reload still in flight is superseded by this one, so that the
        last file read is what the pool ends as, at its size. ``prepared``: what
        check_declaration() made of ``spec`` and ``policy`` already (a reload checks every
        pool of the file before it changes anything)."""
        runtime, pol = prepared or self.check_declaration(spec, policy, size)
        pool = self.table.pool(protocol.pool_name(name))
        if pool is None or pool.deleted:
            if pool is None:
                pool = Pool(name, runtime, pol)
                self.table.add_pool(pool)
            else:
                pool.reopen(runtime, pol)
            pool.mark_declared()
            self._converge(pool, size)
            return "added"
        was_declared = pool.mark_declared()
        changed = runtime.wire != (pool.runtime.wire if pool.runtime else None) or pol != pool.policy
        if changed:
            pool.respec(runtime, pol)
        if pool.stopped:  # as systemd keeps a stopped unit stopped on daemon-reload
            resized = size != pool.desired
            pool.scale_to(size)
            self.table.save_pool(pool)
            return "changed" if changed else "resized" if resized else "unchanged"
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
                    self.table.save_pool(pool)
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

        def logged(msg: protocol.Reply) -> None:
            if not msg.get("ok"):
                log.error("config: rolling pool %s onto its new spec: %s", name, msg.get("error"))

        self.table.save_pool(pool)
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
                self.table.stop(rep, reason="superseded by a reload")
        return sorted(olds, key=lambda r: (r.slot if r.slot is not None else -1, r.n))

    def undeclare_missing(self, names: set[str]) -> list[str]:
        """Delete the pools an earlier config declared that the current one does not. All
        are deleted now, but their replicas stop in order: the pools that start after
        others first, and the pools they start after once those have ended."""
        gone = [p for p in self.table.pools() if p.declared and not p.deleted and p.name not in names]
        layers = self.order.stop_layers({p.name for p in gone})
        for pool in gone:
            self._delete(pool, stop=pool.name in layers[0])
        self._stop_in_order(layers)
        return [p.name for p in gone]

    def _stop_in_order(self, layers: list[list[str]]) -> None:
        """Once the replicas of ``layers[0]``'s (deleted) pools have ended, those of
        ``layers[1]`` are stopped, and so on (a stuck one is SIGKILLed after its grace: the
        wait is bounded by it)."""
        if len(layers) < 2:
            return
        first = [self._pool_of_name(n) for n in layers[0]]
        ids = [rid for pool in first for rid in pool.live]
        bound = 10.0 + max(self._grace_of(p) for p in first)

        def next_layer(_ended: bool) -> None:
            for pool in map(self._pool_of_name, layers[1]):
                if not pool.deleted:
                    continue  # launched again meanwhile: it is a new pool of that name
                for rep in list(pool.live.values()):
                    self.table.stop(rep, reason="pool deleted")
            self._stop_in_order(layers[1:])

        self.when_ended(ids, next_layer, bound)

    def _pool_of_name(self, name: str) -> Pool:
        pool = self.table.pool(name)
        assert pool is not None  # a pool is never forgotten, only marked deleted
        return pool

    def has_pool(self, name: str) -> bool:
        """Is ``name`` a pool of the table now (not deleted)? Else declaring it adds it."""
        return self._known_pool(name) is not None

    def deleted_not_ended(self) -> list[str]:
        """The replicas of deleted pools that still run or are not reaped yet."""
        return [rid for pool in self.table.pools() if pool.deleted
                for rid, rep in pool.live.items() if not (rep.state.terminal and rep.pid is None)]

    def when_ended(self, ids: list[str], then: Callable[[bool], None], timeout: float) -> None:
        """Call ``then(True)`` in the turn in which all of ``ids`` have ended and been
        reaped, or ``then(False)`` after ``timeout`` seconds if they have not."""
        self.table.wait_for(ids, "ended", lambda msg: then(bool(msg.get("ok"))), None, timeout, durable=False)

    # -- rollouts -------------------------------------------------------------------

    def _start_rollout(self, pool: Pool, olds: list[str], width: int, reply: Reply, cmd_id: Any,
                       timeout: float, *, then_scale: int | None = None) -> Any:
        def done(result: dict[str, Any] | None, error: str | None) -> None:
            self._rollouts.remove(rollout)
            timer.cancel()
            alone = not pool.deleted and not any(r.pool is pool for r in self._rollouts)
            size = rollout.then_scale
            if size is not None and error is None:
                if alone:  # a slot held twice by overlapping operations goes first
                    pool.scale_to(size)
                    self._trim_surplus(pool)
                self._converge(pool, size)
                result = {**(result or {}), "ids": [r.id for r in pool.live.values() if not self._leaving(r)]}
            elif size is None and alone:
                self._trim_surplus(pool)
            if error is None:
                self.table.reply(reply, protocol.ok(cmd_id, result), True)
            else:
                self.table.reply(reply, protocol.error(cmd_id, f"restart of pool {pool.name} failed: {error}",
                                                       data=result), False)

        rollout = Rollout(self, pool, olds, width, on_done=done, then_scale=then_scale)
        self._rollouts.append(rollout)
        timer = self.table.reactor.call_later(timeout, lambda: rollout.finish(f"timed out after {timeout:g} s"))
        rollout.advance()
        self.table.changed()
        return protocol.DEFERRED

    # rollout.Ops: what a rollout asks of its supervisor
    def replica(self, rid: str) -> Replica | None:
        return self.table.replica(rid)

    def launch_into(self, pool: Pool, slot: int | None) -> str:
        (rid,) = self.table.launch(pool, 1, slots=[slot if slot is not None else pool.free_slots(1)[0]])
        self.table.save_pool(pool)
        return rid

    def stop_for_rollout(self, rid: str) -> None:
        rep = self.table.replica(rid)
        if rep is not None:
            self.table.stop(rep, reason="restarted")

    def _trim_surplus(self, pool: Pool) -> None:
        """Stop what holds more than the pool's size once its rollouts are over: operations
        that overlapped one (a replica terminated while its replacement was starting, a
        second restart of the same pool) leave extra replicas, a slot held twice first."""
        live = [r for r in pool.live.values() if r.state in _LIVE and not self._leaving(r)]
        by_slot: dict[int | None, list[Replica]] = {}
        for r in live:
            by_slot.setdefault(r.slot, []).append(r)
        # A replacement scheduled for a slot a live replica holds will find it taken and
        # launch nothing: counted, it made a live replica "extra", and the pool one short.
        extra = len(live) + sum(1 for slot in pool.pending if slot not in by_slot) - pool.desired
        if extra <= 0:
            return
        doubled = [r for reps in by_slot.values() if len(reps) > 1 for r in sorted(reps, key=lambda r: r.n)[:-1]]
        rest = sorted((r for r in live if r not in doubled),
                      key=lambda r: (r.slot if r.slot is not None else -1, r.n), reverse=True)
        for rep in (doubled + rest)[:extra]:
            self.table.stop(rep, reason="over the pool's size")
        pool.settle_state()
        self.table.save_pool(pool)

    def _converge(self, pool: Pool, n: int) -> None:
        """Bring the pool to ``n`` slots held: the highest slots go first (what stays holds
        0..n-1), each with all that holds it. A slot counts once however many hold it: a
        rolling restart's new replica starts beside the old one, and a replacement may be
        scheduled for it too; counted twice, a scale down stopped one slot too many."""
        holders: dict[int | tuple[str], list[Replica | None]] = {}
        for r in pool.live.values():
            if r.state in _LIVE and not self._leaving(r):
                # A replica without a slot (none since slots exist) is a place of its own.
                holders.setdefault(r.slot if r.slot is not None else (r.id,), []).append(r)
        for slot in pool.pending:
            holders.setdefault(slot, []).append(None)

        def order(key: int | tuple[str]) -> tuple[int, int]:
            newest = max((r.n for r in holders[key] if r is not None), default=-1)
            return (key if isinstance(key, int) else -1, newest)

        for key in sorted(holders, key=order, reverse=True)[: max(0, len(holders) - n)]:
            for rep in holders[key]:
                if rep is not None:
                    self.table.stop(rep, reason="scaled down")
                elif isinstance(key, int):  # always: a scheduled replacement has its slot
                    pool.cancel_replacement(key)
        if len(holders) < n:
            self.table.launch(pool, n - len(holders))
        pool.settle_state()
        pool.scale_to(n)
        self.table.save_pool(pool)

    # -- a template that does not expand, and an upgrade ------------------------------

    def bad_template(self, rep: Replica, err: InvalidSpec) -> None:
        """A template that does not expand for ``rep``'s slot, found as it starts (a pool
        from a journal written before the declaration checked it, or a slot past the size
        while older replicas still stop). It would fail the same way every time: ``rep`` is
        FAILED with the reason, and its pool stops replacing (crashloop) until an operator
        acts (scale, restart --pool, launch --replace, delete)."""
        pool = self._pool_of(rep)
        self.table.transition(rep, S.FAILED, f"could not start: {err}")
        self.table.signal_and_arm(rep)  # if it runs already (a probe is set up after the exec)
        if pool.state != CRASHLOOP:
            pool.crashloop(f"{rep.id}: {err}")
            log.error("pool %s: crash loop (%s); not replacing until an operator acts", pool.name, pool.reason)
            self.table.journal.event("crashloop", {"pool": pool.name, "replica": rep.id, "reason": pool.reason})
            self.table.metrics.crashloop(pool.name)
        self.ended_on_its_own(rep, failed=True)

    def not_live(self, rep: Replica, why: str) -> None:
        """Its liveness probe failed (readiness.py): stopped, and replaced once it has ended."""
        log.warning("%s: liveness probe failed (%s); replacing it", rep.id, why)
        self._replacing.add(rep.id)
        self.table.stop(rep, reason="liveness probe failed")

    def carried(self) -> dict[str, Any]:
        """What an upgrade carries of the supervisor: the replicas stopping to be replaced."""
        return {"replacing": sorted(self._replacing), "renewing": dict(self._renewing)}

    def take_over(self, carried: dict[str, Any]) -> None:
        self._replacing = set(carried.get("replacing", ()))
        self._renewing = dict(carried.get("renewing", {}))

    def rollouts(self) -> int:
        return len(self._rollouts)

    # -- the restart policy -----------------------------------------------------------

    def _slot_taken(self, pool: Pool, slot: int | None) -> bool:
        """Does a replica that stays hold ``slot`` (a rolling restart's new one, already
        launched)? One on its way out does not: a rollout's old replica, asked to stop once
        its new one was ready, leaves the slot empty if that new one dies first."""
        return slot is not None and any(r.slot == slot and r.state in _LIVE and not self._leaving(r)
                                        for r in pool.live.values())

    def _replace(self, rep: Replica, *, reason: str, backoff: bool) -> None:
        """A new replica in ``rep``'s slot: now, or after the slot's backoff. The (N+1)-th
        replacement within the window is not made: the pool is in a crash loop."""
        pool = self._pool_of(rep)
        slot = rep.slot if rep.slot is not None else pool.free_slots(1)[0]
        if self.table.closing or pool.deleted or pool.stopped:
            return
        journal, metrics = self.table.journal, self.table.metrics
        if backoff and not pool.admit_replacement(self.table.os.monotonic()):
            limit, window = pool.policy.max_restarts
            pool.crashloop(f"{limit} restarts within {window:g} s; last: {rep.id} {reason}")
            pool.lower()
            pool.left_failed(slot, f"{rep.id} {rep.state.value} ({reason})")  # reset-failed fills it again
            self.table.save_pool(pool)
            log.error("pool %s: crash loop (%s); not replacing %s until an operator acts", pool.name, pool.reason, rep.id)
            journal.event("crashloop", {"pool": pool.name, "replica": rep.id, "reason": pool.reason})
            metrics.crashloop(pool.name)
            return
        pool.count_restart(slot)
        metrics.restarted(pool.name)
        delay = pool.next_delay(slot) if backoff else 0.0
        journal.event("restart", {"pool": pool.name, "replica": rep.id, "slot": slot, "delay": round(delay, 3),
                                  "reason": reason})
        self.schedule_replacement(pool, slot, self.table.reactor.monotonic() + delay)

    def schedule_replacement(self, pool: Pool, slot: int, deadline: float) -> None:
        """A replacement in ``slot`` at monotonic ``deadline`` (_replace's, or one an
        upgrade carried)."""

        def launch() -> None:
            if pool.take_scheduled(slot) is None or self.table.closing or pool.deleted or pool.stopped:
                return
            if self._slot_taken(pool, slot):
                return
            self.table.launch(pool, 1, slots=[slot])
            self.table.save_pool(pool)

        pool.schedule(slot, self.table.reactor.call_at(deadline, launch))
        self.table.save_pool(pool)

    def _leaving(self, rep: Replica) -> bool:
        """Asked to stop for a replacement (it still runs, but no longer counts)."""
        return rep.id in self._replacing and rep.state is S.STOPPING and self.table.proc_of(rep) is not None


