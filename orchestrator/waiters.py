"""Commands whose reply waits: ``launch --wait``, ``terminate --wait``, ``wait``.

A waiter names replica ids and what it waits for (``running``: none is PENDING or
STARTING any more; ``ended``: all are terminal and reaped). The engine checks the waiters
once per turn in which something changed, before its store commit, so a waiter's reply
goes out in the same batch as the transitions it reports; a timer ends it with ``timeout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import protocol
from .errors import OrchestratorError
from .states import Replica
from .states import ReplicaState as S

Reply = Callable[[dict], None]
Out = list[tuple[Reply, dict]]


@dataclass(eq=False)
class Waiter:
    ids: tuple[str, ...]
    until: str  # "running" | "ended"
    reply: Reply
    cmd_id: Any
    done: bool = False


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

    def _result(self, waiter: Waiter) -> dict | None:
        states = {}
        for rid in waiter.ids:
            rep = self._replicas.get(rid)
            if rep is None:
                continue  # ended long ago
            if waiter.until == "running":
                if rep.state in (S.PENDING, S.STARTING):
                    return None
            elif not rep.state.terminal or rep.pid is not None:
                return None
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
            out.append((w.reply, protocol.ok(w.cmd_id, states)))
        self._open = keep
        return out

    def timed_out(self, waiter: Waiter) -> Out:
        if waiter.done:
            return []
        waiter.done = True
        error = f"timed out waiting for {len(waiter.ids)} replica(s) to be {waiter.until}"
        return [(waiter.reply, protocol.error(waiter.cmd_id, error, "timeout"))]

    def fail_all(self, err: OrchestratorError) -> Out:
        out = [(w.reply, protocol.error(w.cmd_id, err)) for w in self._open if not w.done]
        for w in self._open:
            w.done = True
        self._open = []
        return out
