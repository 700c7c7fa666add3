"""Invariants the stress tests check on a daemon after the storm: the replica table, the
event journal, and the histories seen while it ran."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from helpers import cli
from orchestrator.states import TRANSITIONS, ReplicaState

S = ReplicaState
LIVE = {"PENDING", "STARTING", "RUNNING", "STOPPING"}


def reachable(old: S, new: S) -> bool:
    """``new`` can follow ``old`` through zero or more edges (a poller skips states)."""
    todo, seen = [old], {old}
    while todo:
        s = todo.pop()
        if s is new:
            return True
        for t in TRANSITIONS[s]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return False


class Histories:
    """Each replica's states in the order one poller saw them (polls from two threads
    may be recorded out of order)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    def observe(self, status: dict) -> None:
        for r in status["replicas"]:
            hist = self.seen.setdefault(r["id"], [])
            if not hist or hist[-1] != r["state"]:
                hist.append(r["state"])

    def violations(self) -> list[str]:
        """Orders no path of the table allows, and a terminal record that changed."""
        out = []
        for rid, hist in self.seen.items():
            for old, new in zip(hist, hist[1:]):
                if S(old).terminal or not reachable(S(old), S(new)):
                    out.append(f"{rid}: {old} -> {new} in {hist}")
        return out


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def table_violations(status: dict) -> list[str]:
    """``status --all`` of a running daemon: legal states, one row per id, a live pid for
    every RUNNING replica and none shared by two live ones, no pid on an ended one, one
    live replica per slot of a pool."""
    out = []
    rows = status["replicas"]
    ids = [r["id"] for r in rows]
    if len(ids) != len(set(ids)):
        out.append(f"an id twice in the table: {sorted(ids)}")
    live_pids: dict[int, str] = {}
    slots: dict[tuple[str, int], str] = {}
    for r in rows:
        if r["state"] not in S.__members__:
            out.append(f"{r['id']}: no such state {r['state']!r}")
            continue
        if S(r["state"]).terminal:
            if r["pid"] is not None or r["ended_at"] is None:
                out.append(f"{r['id']}: ended ({r['state']}) but pid {r['pid']}, ended_at {r['ended_at']}")
            continue
        if r["state"] == "RUNNING" and not (r["pid"] and _alive(r["pid"])):
            out.append(f"{r['id']}: RUNNING without a live process (pid {r['pid']})")
        if r["pid"]:
            if r["pid"] in live_pids:
                out.append(f"{r['id']} and {live_pids[r['pid']]} share pid {r['pid']}")
            live_pids[r["pid"]] = r["id"]
        if r.get("slot") is not None:
            key = (r["pool"], r["slot"])
            if key in slots and r["state"] != "STOPPING" and slots[key] != r["id"]:
                out.append(f"{r['id']} and {slots[key]} hold slot {key}")
            if r["state"] != "STOPPING":
                slots[key] = r["id"]
    return out


def journal_violations(state_dir: Path, status: dict) -> list[str]:
    """The journal's transitions, replica by replica: a chain from nothing to PENDING,
    each edge in the table, each starting where the last ended, ending in the state the
    table shows."""
    proc = cli(state_dir, "events", "--json")
    if proc.returncode != 0:
        return [f"events: exit {proc.returncode}: {proc.stderr.strip()}"]
    last: dict[str, str | None] = {}
    out = []
    for line in proc.stdout.splitlines():
        e = json.loads(line)
        if e["kind"] != "transition":
            continue
        rid, old, new = e["replica"], e["data"]["from"], e["data"]["to"]
        if last.get(rid) != old:
            out.append(f"{rid}: journal says {old} -> {new} after {last.get(rid)}")
        elif old is None and new != "PENDING" or old is not None and S(new) not in TRANSITIONS[S(old)]:
            out.append(f"{rid}: illegal edge {old} -> {new} in the journal")
        last[rid] = new
    for r in status["replicas"]:
        if last.get(r["id"]) != r["state"]:
            out.append(f"{r['id']}: table says {r['state']}, journal's last word {last.get(r['id'])}")
    return out


def quiet(status: dict) -> bool:
    """No replica between states and no pool waiting on a backoff."""
    return (all(r["state"] in ("RUNNING",) or S(r["state"]).terminal for r in status["replicas"])
            and all(p["state"] != "backoff" for p in status["pools"]))


def size_violations(status: dict) -> list[str]:
    """A settled pool that is not in a crash loop runs exactly its size."""
    out = []
    for p in status["pools"]:
        running = sum(1 for r in status["replicas"] if r["pool"] == p["name"] and r["state"] == "RUNNING")
        if p["state"] == "ok" and running != p["desired"]:
            ended = [(r["id"], r["state"], r.get("reason"), r.get("slot")) for r in status["replicas"]
                     if r["pool"] == p["name"] and r["state"] != "RUNNING"][-6:]
            out.append(f"pool {p['name']}: size {p['desired']}, {running} running; its last others: {ended}")
    return out
