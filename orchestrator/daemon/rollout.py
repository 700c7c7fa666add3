"""Rolling replacement: ``restart ID...``, ``restart --pool P``, ``launch --replace``.

Each old replica is replaced by a new one (new id, same slot), at most ``max_unavailable``
slots at a time. Two orders, by what the slot holds:

    surge (the default)     new replica launched → ready → old one asked to stop
    stop first (port_base)  old one asked to stop → ended → new one launched → ready

(with ``port_base``, the old replica still holds its slot's port, so the new one could not
bind it while the old runs; a pool with ``sockets`` surges even so: its replicas accept on
the daemon's listener, which stays open throughout, so no connection is refused). A new
replica that fails or is not ready stops the rollout:
what is in flight finishes, nothing more is started, and the reply says which failed.

Run by the daemon's loop thread. A rollout is advanced by the supervisor (supervision.py)
at the end of every turn in which a replica changed (``advance``): it only reads replica
states and asks the supervisor, through ``Ops``, to launch and stop; the engine stays the
one owner of the table.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..states import Replica
from ..states import ReplicaState as S


class Ops(Protocol):
    """What a rollout asks of its supervisor (supervision.Supervisor)."""

    def replica(self, rid: str) -> Replica | None: ...
    def launch_into(self, pool: Any, slot: int | None) -> str: ...
    def stop_for_rollout(self, rid: str) -> None: ...


@dataclass(eq=False)
class _Step:
    old: str
    slot: int | None
    new: str | None = None
    old_stopped: bool = False


class Rollout:
    def __init__(self, ops: Ops, pool: Any, olds: list[str], max_unavailable: int, *,
                 on_done: Callable[[dict[str, Any] | None, str | None], None], then_scale: int | None = None) -> None:
        self.ops = ops
        # The pool's size once every slot is replaced (None: it keeps its size); a later
        # resize while it runs changes it, so the size that is applied last is the latest.
        self.then_scale = then_scale
        self.pool = pool
        # A socket pool's replicas share the daemon's listener: nothing in the slot to free.
        self.stop_first = pool.policy.port_base is not None and not pool.policy.sockets
        self.width = max(1, max_unavailable)
        self._queue = collections.deque(olds)
        self._active: list[_Step] = []
        self.replaced: dict[str, str] = {}
        self.failed: list[str] = []
        self.finished = False
        self._on_done = on_done

    def ids(self) -> list[str]:
        """The replicas it still reads: the old and new ones of its steps in flight."""
        return [rid for step in self._active for rid in (step.old, step.new) if rid is not None]

    def stopped_unreplaced(self) -> list[str]:
        """Old replicas it asked to stop whose replacement it has not launched yet (stop
        first: the slot waits for the old one to end). A rollout that supersedes this one
        takes them over, so that their slots are filled again."""
        return [step.old for step in self._active if step.old_stopped and step.new is None]

    def advance(self) -> None:
        """Move every step as far as the replicas' states allow; start new steps while
        there is room and nothing has failed; finish once all is done."""
        if self.finished:
            return
        for step in list(self._active):
            if self._move(step):
                self._active.remove(step)
        while not self.failed and self._queue and len(self._active) < self.width:
            old = self.ops.replica(self._queue.popleft())
            if old is None or old.state.terminal:
                continue  # it ended meanwhile: nothing to replace
            step = _Step(old.id, old.slot)
            self._active.append(step)
            if self._move(step):
                self._active.remove(step)
        if not self._active and (self.failed or not self._queue):
            self.finish(None)

    def _move(self, step: _Step) -> bool:
        """Advance one step; True once it is over (done or failed)."""
        if self.stop_first and not step.old_stopped:
            self.ops.stop_for_rollout(step.old)
            step.old_stopped = True
        if self.stop_first and step.new is None:
            old = self.ops.replica(step.old)
            if old is not None and (not old.state.terminal or old.pid is not None):
                return False  # still holds its port
        if step.new is None:
            step.new = self.ops.launch_into(self.pool, step.slot)
        new = self.ops.replica(step.new)
        if new is None or new.state in (S.PENDING, S.STARTING):
            return False
        if new.state is not S.RUNNING:
            self.failed.append(f"{new.id} {new.state.value}: {new.reason or 'ended'}")
            return True
        if not step.old_stopped:
            self.ops.stop_for_rollout(step.old)
            step.old_stopped = True
        self.replaced[step.old] = step.new
        return True

    def finish(self, timed_out: str | None) -> None:
        if self.finished:
            return
        self.finished = True
        error = timed_out or ("; ".join(self.failed) if self.failed else None)
        self._on_done({"pool": self.pool.name, "replaced": self.replaced,
                       "pending": [s.old for s in self._active] + list(self._queue)}, error)
