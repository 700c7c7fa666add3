"""A pool: its desired size, its slots, and the bookkeeping of its restart policy.

Pure state, no I/O, in the daemon's loop thread. A ``Pool`` is the one writer of its own
fields: others read them, and change a pool only through its methods (supervision.py what
it runs, its size and its restart state; the engine its replicas' numbers and ``live``; the
task table its executor record), so that each change has one name and one place to check
it. A pool's states, as ``status`` shows them:

    ok          every replica that should run runs (or is starting)
    backoff     a replacement is scheduled; ``restarts`` counts them
    crashloop   a replacement would have been the (N+1)-th within S seconds: replacing
                stopped (``reason`` says why) until an operator acts (scale, restart
                --pool, launch --replace, reset-failed), and the pool's size follows what
                is left
    stopped     an operator stopped it (``stop POOL``): its replicas are stopped, none is
                started or replaced, and it keeps its size and spec (``start POOL`` brings
                it back to them); the flag is stored with the pool, so a restart, an
                upgrade and a reload of the config file keep it stopped. It is the flag
                ``stopped`` beside ``state``, which keeps what it was (a crash loop stays
                one).

A pool whose replica failed and was not replaced (``--restart never``, a crash loop)
remembers that slot's failure (``failed``) until a replica is launched into the slot or
an operator acts: a pool that starts after it (``after``) waits meanwhile.

Slots: each live replica holds a slot 0..size-1 (a replacement takes the slot of the one
it replaces; a surge replacement shares it for a moment), so N replicas of a server each
get their own port (``port_base + slot``). Backoff is per slot: exponential from MIN to MAX
with jitter, back to MIN once a replica of the slot has stayed healthy ``healthy_after``.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import InvalidSpec
from ..policy import Policy
from ..probespec import ProbeSpec
from ..probespec import parse as parse_probe
from ..spec import MAX_PORT, Runtime
from ..states import Replica
from .reactor import Timer
from ..store import POOL_ROW_VERSION as _STORED

OK, BACKOFF, CRASHLOOP = "ok", "backoff", "crashloop"
PROBE_KEYS = ("ready", "live")


class ExecutorRow(Protocol):
    """What an executor pool's row stores of its task table's record (taskrecords.ExecPool,
    the one home of its options): written with the pool, so that a restart makes it an
    executor pool again with its unfinished tasks."""

    def stored(self) -> dict[str, Any]: ...


class PoolError(ValueError):
    """A transition a pool does not make (a bug in its caller, never a client's input:
    commands check what they are given before they change a pool)."""


@dataclass(eq=False)
class Pool:
    """One pool's record. Its fields are read by everyone and written here only: every
    change is one of the methods below, named for what it means. Who calls which:
    supervision.py decides what the pool runs, its size and its restart state; the engine
    (the replica table) numbers its replicas and keeps ``live`` as they begin and end; the
    task table makes it an executor pool (``make_executor``)."""

    name: str
    runtime: Runtime | None
    policy: Policy = field(default_factory=Policy)
    desired: int = 0
    next_n: int = 1
    live: dict[str, Replica] = field(default_factory=dict)  # non-terminal, in id order
    state: str = OK
    reason: str | None = None
    restarts: int = 0  # replacements made since the pool was created
    deleted: bool = False
    declared: bool = False  # by the config file: a reload without it deletes it
    stopped: bool = False  # by an operator (stop POOL): nothing of it runs until start POOL
    pending: dict[int, Timer] = field(default_factory=dict)  # slot -> Timer of a scheduled replacement
    # The stored (spec, policy) of a pool restored without a runtime (they no longer
    # resolve): written back as they were, so that a later start can try them again.
    unresolved: tuple[Any, Any] | None = None
    slot_restarts: dict[int, int] = field(default_factory=dict)
    # An executor pool's record in the task table (its options, initializer, reserved task
    # numbers), stored with the pool's row.
    executor: ExecutorRow | None = None
    # The row's executor part as the store held it, until the task table takes it
    # (``make_executor``); written back as it was if its options no longer load.
    stored_executor: dict[str, Any] | None = None
    # slot -> how its last replica failed, when it was not replaced: a dependency that failed
    failed: dict[int, str] = field(default_factory=dict)
    _recent: collections.deque[float] = field(default_factory=collections.deque)  # monotonic times
    _delay: dict[int, float] = field(default_factory=dict)  # slot -> current backoff

    @classmethod
    def restored(cls, name: str, runtime: Runtime | None, policy: Policy, *, next_n: int, extra: dict[str, Any]
                 ) -> "Pool":
        """A pool of the store (``extra``: the row's flags, store.unpack_pool_row), size 0
        until it is launched (or ``unresolvable``)."""
        pool = cls(name, runtime, policy, next_n=next_n, deleted=bool(extra.get("deleted")),
                   declared=bool(extra.get("declared")), stopped=bool(extra.get("stopped")))
        ex = extra.get("executor")
        pool.stored_executor = ex if isinstance(ex, dict) else None
        failed = extra.get("failed")
        if isinstance(failed, dict):
            pool.failed = {int(k): str(v) for k, v in failed.items() if isinstance(k, str) and k.isdigit()}
        return pool

    @property
    def is_executor(self) -> bool:
        return self.executor is not None or self.stored_executor is not None

    # -- what it runs, and its size (supervision.py) -------------------------------------

    def respec(self, runtime: Runtime | None, policy: Policy) -> None:
        """Replicas launched from now on run ``runtime`` under ``policy``."""
        self.runtime, self.policy = runtime, policy
        self.unresolved = None

    def reopen(self, runtime: Runtime, policy: Policy) -> None:
        """A deleted pool's name declared again: a pool once more (its ids continue), with
        the crash loop and failures of its earlier life forgotten."""
        if not self.deleted:
            raise PoolError(f"pool {self.name!r} is not deleted: nothing to reopen")
        self.deleted = False
        self.stopped = False  # a new life: it runs what it is declared with
        self.respec(runtime, policy)
        self.clear()

    def unresolvable(self, wire: Any, policy_wire: Any, desired: int, problem: str | None) -> None:
        """Restored with a spec or policy that no longer resolves: kept as stored (its size
        too, so that a later start tries again) and, with a ``problem``, in a crash loop."""
        self.runtime, self.policy = None, Policy()
        self.unresolved = (wire, policy_wire if policy_wire is not None else {})
        self.desired = desired
        if problem is not None:
            self.crashloop(problem)

    def mark_declared(self) -> bool:
        """The config file declares it (a reload without it deletes it); whether it was."""
        was, self.declared = self.declared, True
        return was

    def scale_to(self, n: int) -> None:
        if n < 0:
            raise PoolError(f"pool {self.name!r}: a size of {n}")
        if n and self.deleted:
            raise PoolError(f"pool {self.name!r} is deleted: it holds no replica")
        self.desired = n

    def grow(self, by: int) -> None:
        """Launched ``by`` more (``launch``, a restore)."""
        self.scale_to(self.desired + by)

    def lower(self) -> None:
        """One replica left and is not replaced (terminated, ended under its restart
        policy, a crash loop). Never below 0: a surge's extra replica holds no place."""
        self.desired = max(0, self.desired - 1)

    def left_failed(self, slot: int, why: str) -> None:
        """``slot``'s replica failed and was not replaced: the pools that start after this
        one wait, with ``why``, until the slot is filled again or an operator acts."""
        self.failed[slot] = why

    def stop(self) -> None:
        """Stopped by an operator: no replacement scheduled, none made until ``start``;
        its size is kept (the caller stops its replicas)."""
        self.cancel_replacements()
        self.stopped = True

    def start(self) -> None:
        """Started again by an operator: its replicas may run (the caller launches them)."""
        self.stopped = False

    def reset_failed(self) -> int:
        """``reset-failed``: the crash loop, the failed slots, the backoff history and the
        restart counters forgotten, and no replacement left scheduled; returns how many
        replicas it should hold now (its size with the failed slots filled again)."""
        size = self.desired + len(self.failed)
        self.cancel_replacements()
        self.clear()
        self.restarts = 0
        self.slot_restarts.clear()
        return size

    def delete(self) -> None:
        """Deleted: size 0, no replacement scheduled; its name (and ids) kept."""
        if self.deleted:
            raise PoolError(f"pool {self.name!r} is deleted already")
        self.cancel_replacements()
        self.desired = 0
        self.deleted = True

    # -- its replicas (the engine) -------------------------------------------------------

    def take_number(self) -> int:
        """The number of its next replica (``NAME-N``); never given twice."""
        n = self.next_n
        self.next_n += 1
        return n

    def add(self, rep: Replica) -> None:
        """``rep`` holds a slot of the pool (launched, or adopted by an upgrade): its slot
        is no longer a failure for the pool's dependents."""
        if rep.slot is not None:
            self.failed.pop(rep.slot, None)
        self.live[rep.id] = rep

    def remove(self, rep: Replica) -> None:
        """``rep`` has ended (or was interrupted while starting)."""
        self.live.pop(rep.id, None)

    # -- an executor pool (the task table) ---------------------------------------------

    def make_executor(self, row: ExecutorRow) -> None:
        """An executor pool from now on, whose row stores ``row``."""
        self.executor = row
        self.stored_executor = None

    # -- slots ------------------------------------------------------------------------

    def free_slots(self, count: int) -> list[int]:
        """The ``count`` lowest slots that no live replica holds and no replacement awaits."""
        held = {r.slot for r in self.live.values()} | set(self.pending)
        out: list[int] = []
        slot = 0
        while len(out) < count:
            if slot not in held:
                out.append(slot)
            slot += 1
        return out

    def port(self, slot: int) -> int | None:
        base = self.policy.port_base
        return None if base is None else base + slot

    # -- the restart policy -------------------------------------------------------------

    def wants_replacement(self, failed: bool) -> bool:
        mode = self.policy.restart
        return not self.deleted and (mode == "always" or (mode == "on-failure" and failed))

    def admit_replacement(self, now: float) -> bool:
        """Count one replacement at monotonic ``now``; False (and crashloop) if it would be
        the (N+1)-th within the window."""
        limit, window = self.policy.max_restarts
        while self._recent and now - self._recent[0] > window:
            self._recent.popleft()
        if len(self._recent) >= limit:
            return False
        self._recent.append(now)
        self.restarts += 1
        return True

    def next_delay(self, slot: int) -> float:
        low, high = self.policy.backoff
        current = self._delay.get(slot)
        current = low if current is None else min(max(current * 2, low), high)
        self._delay[slot] = current
        return current * random.uniform(0.8, 1.0) if current > low else current

    def healthy(self, slot: int) -> None:
        self._delay.pop(slot, None)

    def crashloop(self, reason: str) -> None:
        self.state, self.reason = CRASHLOOP, reason

    def clear(self) -> None:
        """An operator acted: forget the crash loop, the failed slots and the backoff history."""
        self.state, self.reason = OK, None
        self.failed.clear()
        self._recent.clear()
        self._delay.clear()

    def settle_state(self) -> None:
        if self.state != CRASHLOOP:
            self.state = BACKOFF if self.pending else OK

    def count_restart(self, slot: int) -> None:
        """A replacement for ``slot`` is made (its replicas show how many it had)."""
        self.slot_restarts[slot] = self.slot_restarts.get(slot, 0) + 1

    def schedule(self, slot: int, timer: Timer) -> None:
        """``slot``'s replacement is due when ``timer`` fires (backoff, meanwhile)."""
        self.pending[slot] = timer
        self.settle_state()

    def take_scheduled(self, slot: int) -> Timer | None:
        """``slot``'s replacement is due now: no longer scheduled (None: it was cancelled)."""
        timer = self.pending.pop(slot, None)
        self.settle_state()
        return timer

    def cancel_replacement(self, slot: int) -> None:
        timer = self.pending.pop(slot, None)
        if timer is not None:
            timer.cancel()
        self.settle_state()

    def cancel_replacements(self) -> None:
        for timer in self.pending.values():
            timer.cancel()
        self.pending.clear()
        self.settle_state()

    # -- what an upgrade carries (handover.py): all the store does not hold --------------

    def carried(self) -> dict[str, Any]:
        """The in-memory bookkeeping, as JSON; scheduled replacements by their deadline."""
        return {"desired": self.desired, "state": self.state, "reason": self.reason, "restarts": self.restarts,
                "stopped": self.stopped,
                "slot_restarts": {str(k): v for k, v in self.slot_restarts.items()},
                "recent": list(self._recent), "delay": {str(k): v for k, v in self._delay.items()},
                "pending": {str(k): t.deadline for k, t in self.pending.items()}}

    def take_over(self, carried: dict[str, Any]) -> dict[int, float]:
        """The bookkeeping of ``carried()``; returns the replacements to schedule (slot -> deadline)."""
        self.desired = int(carried["desired"])
        self.state, self.reason = str(carried["state"]), carried.get("reason")
        self.stopped = bool(carried.get("stopped", self.stopped))  # an older image's: the store's flag
        self.restarts = int(carried["restarts"])
        self.slot_restarts = {int(k): int(v) for k, v in carried.get("slot_restarts", {}).items()}
        self._recent = collections.deque(float(t) for t in carried.get("recent", ()))
        self._delay = {int(k): float(v) for k, v in carried.get("delay", {}).items()}
        return {int(k): float(v) for k, v in carried.get("pending", {}).items()}

    # -- what is stored and shown -------------------------------------------------------

    def stored(self) -> dict[str, Any]:
        """The pool row's JSON: the spec, the policy, and a crash loop to survive a restart."""
        spec, policy = self._declared()
        row: dict[str, Any] = {"v": _STORED, "spec": spec, "policy": policy}
        if self.state == CRASHLOOP:
            row["crashloop"] = self.reason
        if self.deleted:
            row["deleted"] = True
        if self.declared:
            row["declared"] = True
        if self.stopped:
            row["stopped"] = True
        if self.executor is not None:
            row["executor"] = self.executor.stored()
        elif self.stored_executor is not None:
            row["executor"] = self.stored_executor
        if self.failed:
            row["failed"] = {str(slot): text for slot, text in self.failed.items()}
        return row

    def to_dict(self) -> dict[str, Any]:
        spec, policy = self._declared()
        out: dict[str, Any] = {"name": self.name, "desired": self.desired, "state": self.shown_state,
                               "stopped": self.stopped, "reason": self.reason, "restarts": self.restarts,
                               "spec": spec, "policy": policy, "after": list(self.policy.after)}
        if self.is_executor:
            out["kind"] = "executor"
        return out

    @property
    def shown_state(self) -> str:
        """What ``status`` calls it: ``stopped`` while stopped, else its state."""
        return "stopped" if self.stopped else self.state

    def _declared(self) -> tuple[Any, Any]:
        """(spec, policy) as declared: what runs, or what was stored and no longer resolves."""
        if self.runtime is None and self.unresolved is not None:
            return self.unresolved
        return (self.runtime.wire if self.runtime else None), self.policy.to_wire()


def check_templates(runtime: Runtime | None, policy: Policy, size: int) -> None:
    """Everything a template of the pool expands to, for every slot 0..size-1 of a pool of
    ``size``: ``$PORT`` and ``{port}`` (port_base + slot), ``{slot}`` and ``{port}`` in argv,
    env values and the ready and live probes' addresses. Called wherever a pool is declared
    or resized (launch, scale, the config file, launch --replace), so that a value that
    cannot work is that command's one-line error, never a replica's (or the loop's) later.
    InvalidSpec names the first slot that does not expand."""
    base = policy.port_base
    if base is not None and size > 0 and base + size - 1 > MAX_PORT:
        raise InvalidSpec(f"port_base {base} with {size} replicas: slot {size - 1} would get port "
                          f"{base + size - 1}, past {MAX_PORT}")
    if base is None and runtime is not None and runtime.uses_port:
        raise InvalidSpec("the command or env uses {port} but the pool has no port_base")
    for key in PROBE_KEYS:
        text = getattr(policy, key)
        if text is None or not parse_probe(text, has_port=base is not None).templated:
            continue
        for slot in range(size):
            expand_probe(key, text, slot, None if base is None else base + slot)


def expand_probe(key: str, text: str, slot: int, port: int | None) -> ProbeSpec:
    """The ``ready`` or ``live`` probe ``text`` of one slot; InvalidSpec that says which."""
    try:
        return parse_probe(text).expand(slot, port)
    except InvalidSpec as err:
        raise InvalidSpec(f"{key} {text!r} does not expand for slot {slot}: {err}") from None
