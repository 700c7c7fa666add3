"""A pool: its desired size, its slots, and the bookkeeping of its restart policy.

Pure state, no I/O, in the daemon's loop thread: the supervisor and the engine decide with
it and act. A pool's states, as ``status`` shows them:

    ok          every replica that should run runs (or is starting)
    backoff     a replacement is scheduled; ``restarts`` counts them
    crashloop   a replacement would have been the (N+1)-th within S seconds: replacing
                stopped (``reason`` says why) until an operator acts (scale, restart
                --pool, launch --replace), and the pool's size follows what is left

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
from typing import Any

from ..errors import InvalidSpec
from ..policy import Policy
from ..probespec import ProbeSpec
from ..probespec import parse as parse_probe
from ..spec import MAX_PORT, Runtime
from ..states import Replica
from ..store import POOL_ROW_VERSION as _STORED

OK, BACKOFF, CRASHLOOP = "ok", "backoff", "crashloop"
PROBE_KEYS = ("ready", "live")


@dataclass(eq=False)
class Pool:
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
    pending: dict[int, Any] = field(default_factory=dict)  # slot -> Timer of a scheduled replacement
    # The stored (spec, policy) of a pool restored without a runtime (they no longer
    # resolve): written back as they were, so that a later start can try them again.
    unresolved: tuple[Any, Any] | None = None
    slot_restarts: dict[int, int] = field(default_factory=dict)
    # An executor pool's options (daemon/taskrecords.py checks them): stored with the pool, so that a restart
    # makes it an executor pool again with its unfinished tasks.
    executor: dict | None = None
    # slot -> how its last replica failed, when it was not replaced: a dependency that failed
    failed: dict[int, str] = field(default_factory=dict)
    _recent: collections.deque = field(default_factory=collections.deque)  # monotonic times
    _delay: dict[int, float] = field(default_factory=dict)  # slot -> current backoff

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

    # -- what an upgrade carries (handover.py): all the store does not hold --------------

    def carried(self) -> dict:
        """The in-memory bookkeeping, as JSON; scheduled replacements by their deadline."""
        return {"desired": self.desired, "state": self.state, "reason": self.reason, "restarts": self.restarts,
                "slot_restarts": {str(k): v for k, v in self.slot_restarts.items()},
                "recent": list(self._recent), "delay": {str(k): v for k, v in self._delay.items()},
                "pending": {str(k): t.deadline for k, t in self.pending.items()}}

    def take_over(self, carried: dict) -> dict[int, float]:
        """The bookkeeping of ``carried()``; returns the replacements to schedule (slot -> deadline)."""
        self.desired = int(carried["desired"])
        self.state, self.reason = str(carried["state"]), carried.get("reason")
        self.restarts = int(carried["restarts"])
        self.slot_restarts = {int(k): int(v) for k, v in carried.get("slot_restarts", {}).items()}
        self._recent = collections.deque(float(t) for t in carried.get("recent", ()))
        self._delay = {int(k): float(v) for k, v in carried.get("delay", {}).items()}
        return {int(k): float(v) for k, v in carried.get("pending", {}).items()}

    # -- what is stored and shown -------------------------------------------------------

    def stored(self) -> dict:
        """The pool row's JSON: the spec, the policy, and a crash loop to survive a restart."""
        spec, policy = self._declared()
        row: dict[str, Any] = {"v": _STORED, "spec": spec, "policy": policy}
        if self.state == CRASHLOOP:
            row["crashloop"] = self.reason
        if self.deleted:
            row["deleted"] = True
        if self.declared:
            row["declared"] = True
        if self.executor is not None:
            row["executor"] = self.executor
        if self.failed:
            row["failed"] = {str(slot): text for slot, text in self.failed.items()}
        return row

    def to_dict(self) -> dict:
        spec, policy = self._declared()
        out = {"name": self.name, "desired": self.desired, "state": self.state, "reason": self.reason,
               "restarts": self.restarts, "spec": spec, "policy": policy, "after": list(self.policy.after)}
        if self.executor is not None:
            out["kind"] = "executor"
        return out

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
