"""The order of pools (policy ``after``): which pools start after which, and whether a
pool's replicas may start now.

A pool's replicas start only once each pool it starts after meets its condition
(``waiting``, asked by spawning.py, which holds them PENDING with the reason meanwhile); a
launch, a config file and ``delete`` that would make a cycle or name an unknown pool are
refused (``check``, ``check_declared``, ``dependents``); a shutdown stops the pools in
``stop_layers`` order, dependents first; ``status`` lists them in ``start_order``. Pure
reads of the pools, in the daemon's loop thread.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Protocol

from ..policy import AfterCycle, after_order, check_after
from ..states import Replica
from ..states import ReplicaState as S
from .pools import CRASHLOOP, Pool


class Pools(Protocol):
    """What the order reads of the replica table (engine.Engine)."""

    def pool(self, name: str) -> Pool | None: ...  # deleted ones too
    def pools(self) -> Iterable[Pool]: ...


class Order:
    """See the module docstring. ``leaving``: whether a replica is stopping to be replaced
    (it no longer counts toward its pool's condition)."""

    def __init__(self, table: Pools, leaving: Callable[[Replica], bool]) -> None:
        self.table = table
        self._leaving = leaving

    def _graph(self) -> dict[str, list[str]]:
        """Pool -> the pools it starts after, of the pools there are (not deleted)."""
        return {p.name: list(p.policy.after_pools) for p in self.table.pools() if not p.deleted}

    def dependents(self, name: str) -> list[str]:
        """The pools (not deleted) that start after pool ``name``."""
        return sorted(n for n, deps in self._graph().items() if name in deps and n != name)

    def check(self, name: str, after: Mapping[str, str]) -> None:
        """Pool ``name`` is to start after ``after``: InvalidSpec (one line) if one of them
        is not a pool, or if that makes a cycle."""
        if not after:
            return  # a pool that starts after nothing is in no cycle
        graph = self._graph()
        graph[name] = list(after)
        check_after(graph, names=[name])

    def check_declared(self, declared: Mapping[str, Mapping[str, str]]) -> None:
        """A config file's pools (name -> its after) are to replace those of the file
        before: InvalidSpec if a pool left (a launched one) starts after a pool the file
        no longer declares, or if they make a cycle."""
        graph = {p.name: list(p.policy.after_pools) for p in self.table.pools() if not p.deleted and not p.declared}
        graph.update({name: list(after) for name, after in declared.items()})
        check_after(graph)

    def start_order(self) -> list[str]:
        """The pools (not deleted) in the order they start: each after those it starts
        after; as they were made where that does not decide (or after a cycle or an
        unknown pool found in a journal)."""
        names = [p.name for p in self.table.pools() if not p.deleted]
        graph = self._graph()
        try:
            layers = after_order({n: [d for d in deps if d in graph] for n, deps in graph.items()})
        except AfterCycle:
            return names
        rank = {name: i for i, layer in enumerate(layers) for name in layer}
        return sorted(names, key=lambda n: rank[n])

    def stop_layers(self, only: set[str] | None = None) -> list[list[str]]:
        """Pools in the order they stop, in layers: a pool stops before every pool it
        starts after, so a layer is stopped once the layers before it have ended.
        ``only``: of those pools; default: every pool, deleted ones (still ending) in the
        first layer."""
        pools = [p for p in self.table.pools() if only is None or p.name in only]
        names = {p.name for p in pools if only is not None or not p.deleted}
        graph: dict[str, list[str]] = {n: [] for n in names}
        for pool in pools:
            if pool.name in names:
                for dep in pool.policy.after_pools:
                    if dep in names and dep != pool.name:
                        graph[dep].append(pool.name)  # dep stops after pool
        try:
            layers = after_order(graph)
        except AfterCycle:  # only from a journal written by hand: all at once
            layers = [sorted(names)]
        first = sorted(set(layers[0] if layers else ()) | {p.name for p in pools if p.name not in names})
        return [first, *layers[1:]]

    def waiting(self, pool: Pool) -> str | None:
        """Why ``pool``'s replicas may not start yet: the first pool of its ``after`` that
        does not meet its condition; None when they may start."""
        for name, condition in pool.policy.after_pools.items():
            why = self._unmet(name, condition)
            if why is not None:
                return why
        return None

    def pool_waiting(self, pool: Pool) -> str | None:
        """What ``pool``'s PENDING replicas wait for (status), None if none waits."""
        if not pool.policy.after or not any(r.state is S.PENDING for r in pool.live.values()):
            return None
        return self.waiting(pool)

    def _unmet(self, name: str, condition: str) -> str | None:
        """Pool ``name`` and ``condition`` (ready: every replica it should have RUNNING,
        hence ready; started: each spawned, none waiting to start; completed: none left,
        the last one of each slot EXITED with 0): None when met, else why not. A pool that
        failed (a crash loop, or a replica that failed and was not replaced), or that an
        operator stopped, meets none."""
        dep = self.table.pool(name)
        if dep is None or dep.deleted:
            return f"waiting for {name}: no such pool"
        if dep.stopped:
            return f"waiting for {name}: stopped (start {name})"
        if dep.state == CRASHLOOP:
            return f"waiting for {name}: crash loop ({dep.reason})"
        if dep.failed:
            return f"waiting for {name}: {dep.failed[min(dep.failed)]}"
        live = [r for r in dep.live.values() if not self._leaving(r)]
        if condition == "completed":
            left = len(live) + len(dep.pending)
            return f"waiting for {name} to complete ({left} still to run)" if left else None
        if condition == "started":
            done = sum(r.state is not S.PENDING for r in live)
        else:
            done = sum(r.state is S.RUNNING for r in live)
        if done >= dep.desired and not dep.pending:
            return None
        return f"waiting for {name} ({done} of {dep.desired} {condition})"
