"""The start-up layer against orphans: what an unclean end left behind.

Every replica the store still calls live belongs to a run that ended uncleanly (a
``kill -9``, an OOM kill, a power cut). Its process is killed, with its group and
descendants, if it is still alive with the recorded identity (pid *and* start time: never
a reused pid), and the replica is recorded LOST through ``states.transition()``, like any
other state change. Shared by the daemon's ``start`` and ``Orchestrator(db=...)``.

In cgroup mode, the replica cgroups of the earlier daemon's subtree are killed whole first
(``cgroups``: the subtrees recorded in the state dir): one ``cgroup.kill`` each reaches every
process, whatever it did to its group, session, title or environment, so what survives the
daemon and its watchdog killed together is gone before a replica is recorded LOST.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterable

from watchdog.cgroup import CgroupUnavailable, Subtree
from watchdog.identity import is_alive
from watchdog.ledger import Entry

from .. import signals
from ..states import TERMINAL, Replica, ReplicaState, transition
from .journal import Journal

if TYPE_CHECKING:
    from ..store import Store
from .osapi import OSApi

log = logging.getLogger("orchestrator")


def recover_leftovers(store: Store, os_api: OSApi | None = None, *, grace: float = 1.0,
                      cgroups: Iterable[str | None] = ()) -> tuple[int, int]:
    """Kill the leftovers of an unclean end and record their replicas LOST; returns
    (lost, killed). ``cgroups``: daemon subtrees whose replica cgroups are killed and
    removed first (None entries are skipped). Runs before the control loop starts."""
    killed_cgroups = kill_cgroup_leftovers(cgroups)
    _, live = store.load()
    # Ended, but the daemon died before it reaped them (a terminate's INTERRUPTED is recorded
    # at once): their records still name a process, which must go, and the pid with it.
    unreaped = [r for r in store.replicas(include_terminal=True)
                if r.get("pid") and Replica.from_record(r).state in TERMINAL]
    if not live and not unreaped:
        return 0, 0
    os_api = os_api or OSApi()
    # Every recorded worker, alive or not: a dead leader's process group may still hold its
    # grandchildren (the daemon and the watchdog were killed together), and the kernel does
    # not reuse a pid number while a group of that number exists; the sweep checks that.
    entries = [
        Entry(r["pid"], r["start_time"], r["pid"], "worker", r["id"])
        for r in (*live, *unreaped)
        if r.get("pid") and r.get("start_time") is not None
    ]
    killed = {e.pid for e in entries if is_alive(e.pid, e.start)}
    if entries:
        os_api.sweep(entries, grace=grace)
    journal = Journal(store, time.time)
    for rec in live:
        rep = Replica.from_record(rec)
        found = "killed at recovery" if rep.pid in killed else "found dead"
        rep.pid = None
        old = transition(rep, ReplicaState.LOST, f"daemon ended uncleanly; {found}")
        journal.transition(rep, old)
    for rec in unreaped:
        rep = Replica.from_record(rec)
        rep.pid = None
        journal.replica(rep)
    journal.event("recovery", {"lost": len(live), "killed": len(killed), "cgroups": killed_cgroups})
    store.commit()
    log.warning("recovered from an unclean end: %d replica(s) LOST, %d leftover(s) killed, %d cgroup(s) killed",
                len(live), len(killed), killed_cgroups)
    return len(live), len(killed)


def kill_cgroup_leftovers(subtrees: Iterable[str | None]) -> int:
    """Kill and remove every replica cgroup left in these subtrees; how many there were.

    Only ``replicas/*`` is touched: ``daemon/`` may hold a new daemon (the same subtree is
    reused) or a dead one's watchdog finishing its sweep."""
    count = 0
    for path in dict.fromkeys(p for p in subtrees if p):  # in order, each once
        try:
            tree = Subtree.open(path)
        except CgroupUnavailable:
            continue  # gone already (a clean stop removed it) or never made
        report = signals.kill_subtree(tree)
        for rec in report["cgroups"]:
            count += 1
            if rec["populated"] is not False or rec["removed"] != "removed":
                log.error("leftover cgroup %s: %s", rec["path"], rec)
        if report["cgroups"]:
            log.warning("killed %d leftover replica cgroup(s) of %s in %.1f ms", len(report["cgroups"]), path,
                        report["duration_s"] * 1e3)
    return count
