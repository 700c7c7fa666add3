"""The start-up layer against orphans: what an unclean end left behind.

Every replica the store still calls live belongs to a run that ended uncleanly (a
``kill -9``, an OOM kill, a power cut). Its process is killed, with its group and
descendants, if it is still alive with the recorded identity (pid *and* start time: never
a reused pid), and the replica is recorded LOST through ``states.transition()``, like any
other state change. Shared by the daemon's ``start`` and ``Orchestrator(db=...)``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from watchdog.identity import is_alive
from watchdog.ledger import Entry

from .journal import Journal
from .spawner import OSApi
from .states import Replica, ReplicaState, transition

log = logging.getLogger("orchestrator")


def recover_leftovers(store: Any, os_api: OSApi | None = None, *, grace: float = 1.0) -> tuple[int, int]:
    """Kill the leftovers of an unclean end and record their replicas LOST; returns
    (lost, killed). Runs before the control loop starts."""
    _, live = store.load()
    if not live:
        return 0, 0
    os_api = os_api or OSApi()
    # Every recorded worker, alive or not: a dead leader's process group may still hold its
    # grandchildren (the daemon and the watchdog were killed together), and the kernel does
    # not reuse a pid number while a group of that number exists; the sweep checks that.
    entries = [
        Entry(r["pid"], r["start_time"], r["pid"], "worker", r["id"])
        for r in live
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
    journal.event("recovery", {"lost": len(live), "killed": len(killed)})
    store.commit()
    log.warning("recovered from an unclean end: %d replica(s) LOST, %d leftover(s) killed", len(live), len(killed))
    return len(live), len(killed)
