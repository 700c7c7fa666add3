"""Commands whose reply waits: ``launch --wait``, ``terminate --wait``, ``wait``.

A waiter names replica ids and what it waits for (``running``: none is PENDING or
STARTING any more; ``ended``: all are terminal and reaped). The engine checks the waiters
once per turn in which something changed, before its store commit, so a waiter's reply
goes out in the same batch as the transitions it reports; a timer ends it with ``timeout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .. import protocol
from ..errors import OrchestratorError
from ..states import Replica
from ..states import ReplicaState as S

Reply = protocol.ReplyTo
Out = list[tuple[Reply, protocol.Reply, bool]]  # (where, the reply, durable): Engine._outbox's


@dataclass(eq=False)
class Waiter:
    ids: tuple[str, ...]
    until: str  # "running" | "ended"
    reply: Reply
    cmd_id: protocol.CommandId
    durable: bool = True  # the reply of a command that changed state (see Engine._outbox)
    done: bool = False
    deadline: float | None = None  # monotonic; carried by an upgrade (handover.py)


class Waiters:
    """The open waiters, over the engine's replica table (read only)."""

    def __init__(self, replicas: dict[str, Replica]) -> None:
        self._replicas = replicas
        self._open: list[Waiter] = []

    def __bool__(self) -> bool:
        return bool(self._open)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(self._open)

    def add(self, waiter: Waiter) -> None:
        self._open.append(waiter)

    def _result(self, waiter: Waiter) -> dict[str, str] | None:
        states: dict[str, str] = {}
        for rid in waiter.ids:
            if not self._done(rid, waiter.until):
                return None
            rep = self._replicas.get(rid)
            if rep is not None:  # else it ended long ago
                states[rid] = rep.state.value
        return states

    def check(self) -> Out:
        """The replies of every waiter whose condition now holds."""
        out: Out = []
        keep = []
        for w in self._open:
            if w.done:
                continue
            states = self._result(w)
            if states is None:
                keep.append(w)
                continue
            w.done = True
            out.append((w.reply, protocol.ok(w.cmd_id, states), w.durable))
        self._open = keep
        return out

    def timed_out(self, waiter: Waiter) -> Out:
        if waiter.done:
            return []
        waiter.done = True
        late = [rid for rid in waiter.ids if not self._done(rid, waiter.until)]
        shown = ", ".join(late[:10]) + (f" and {len(late) - 10} more" if len(late) > 10 else "")
        error = f"timed out: not yet {'ready' if waiter.until == 'running' else 'ended'}: {shown}"
        data = {"ids": list(waiter.ids), "late": late}
        return [(waiter.reply, protocol.error(waiter.cmd_id, error, "timeout", data=data), False)]

    def _done(self, rid: str, until: str) -> bool:
        rep = self._replicas.get(rid)
        if rep is None:
            return True
        if until == "running":
            return rep.state not in (S.PENDING, S.STARTING)
        return rep.state.terminal and rep.pid is None

    def fail_all(self, err: OrchestratorError) -> Out:
        out: Out = [(w.reply, protocol.error(w.cmd_id, err), False) for w in self._open if not w.done]
        for w in self._open:
            w.done = True
        self._open = []
        return out
