"""Tests of orchestrator.store (the daemon's durable state). Each test uses its own tmp_path."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.store import SCHEMA_VERSION, TERMINAL_STATES, Store, StoreError

REPO = Path(__file__).resolve().parents[1]
LIFECYCLE = ("PENDING", "STARTING", "RUNNING", "STOPPING", "TERMINATED")


# Recent enough that the default 7-day retention keeps what the tests save.
T0 = float(int(time.time()) - 86400)


def rec(pool: str, n: int, state: str = "RUNNING", **kw: object) -> dict:
    r = {"id": f"{pool}-{n}", "pool": pool, "n": n, "state": state, "pid": 1000 + n,
         "start_time": 50_000 + n, "exit_code": None, "reason": None,
         "created_at": T0 + n, "ended_at": None}
    r.update(kw)
    return r


def status_view(r: dict) -> dict:
    return {k: r[k] for k in ("id", "pool", "state", "pid", "exit_code", "reason",
                              "created_at", "ended_at")}


def churn(store: Store, first_n: int, cycles: int, *, pool: str = "web", batch: int = 20) -> int:
    """Simulate the control loop: replicas go through LIFECYCLE, one commit per step."""
    n = first_n
    done = 0
    while done < cycles:
        k = min(batch, cycles - done)
        recs = [rec(pool, n + i, "PENDING", pid=None, created_at=time.time()) for i in range(k)]
        n += k
        prev = None
        for state in LIFECYCLE:
            for r in recs:
                r["state"] = state
                if state == "TERMINATED":
                    r.update(pid=None, exit_code=-15, ended_at=time.time())
                store.save_replica(r)
                store.append_event("transition", replica=r["id"],
                                   data={"from": prev, "to": state, "reason": None})
            prev = state
            store.commit()
        done += k
    return n


def run_py(code: str, *args: str, prefix: list[str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(code), *args],
                          env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


def count(path: Path, sql: str) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchone()[0]
    finally:
        conn.close()


# --------------------------------------------------------------------------- basics

def test_terminal_states_match_design() -> None:
    assert TERMINAL_STATES == {"TERMINATED", "EXITED", "FAILED", "INTERRUPTED", "LOST"}


def test_round_trip_after_reopen(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    spec = {"cmd": ["sleep", "10"], "env": {"A": "1"}, "restart": None}
    with Store(db) as s:
        s.save_pool("web", spec, 2, 3)
        s.save_replica(rec("web", 1))
        s.save_replica(rec("web", 2, "FAILED", pid=None, exit_code=3, reason="exit 3",
                           ended_at=T0 + 100.5, pgid=77, cmd=["x", "y"]))
        s.append_event("transition", replica="web-1", data={"from": "STARTING", "to": "RUNNING",
                                                            "reason": None}, ts=T0 + 123.25)
        s.append_event("start", data={"pid": 10}, ts=T0 + 124.0)
        s.commit()
    with Store(db) as s:
        assert s.notes == []
        assert s.pools() == [{"name": "web", "desired": 2, "spec": spec, "next_n": 3}]
        live = s.replicas()
        assert [r["id"] for r in live] == ["web-1"]
        assert live[0] == rec("web", 1)
        everything = s.replicas(include_terminal=True)
        assert [r["id"] for r in everything] == ["web-1", "web-2"]
        failed = everything[1]
        # extra keys survive the round trip; the status keys of the JSON contract are all there
        assert failed["pgid"] == 77 and failed["cmd"] == ["x", "y"]
        assert status_view(failed) == {"id": "web-2", "pool": "web", "state": "FAILED",
                                       "pid": None, "exit_code": 3, "reason": "exit 3",
                                       "created_at": T0 + 2.0, "ended_at": T0 + 100.5}
        assert s.events() == [
            {"seq": 1, "ts": T0 + 123.25, "kind": "transition", "replica": "web-1",
             "data": {"from": "STARTING", "to": "RUNNING", "reason": None}},
            {"seq": 2, "ts": T0 + 124.0, "kind": "start", "replica": None, "data": {"pid": 10}},
        ]
        assert s.last_seq() == 2
        assert s.integrity_ok()


def test_last_write_wins_within_a_batch(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as s:
        s.save_pool("web", {"v": 1}, 1, 1)
        s.save_pool("web", {"v": 2}, 5, 1)
        for state in LIFECYCLE[:3]:
            s.save_replica(rec("web", 1, state))
        r = rec("web", 2, "STARTING")
        s.save_replica(r)
        r["state"] = "MUTATED-AFTER-SAVE"      # the store snapshots at save time
        s.commit()
        assert [(p["desired"], p["spec"]) for p in s.pools()] == [(5, {"v": 2})]
        assert [(x["id"], x["state"]) for x in s.replicas()] == [("web-1", "RUNNING"),
                                                                  ("web-2", "STARTING")]
        # and across batches too (plain upsert)
        s.save_replica(rec("web", 1, "STOPPING"))
        s.commit()
        assert s.replicas()[0]["state"] == "STOPPING"


def test_nothing_visible_before_commit(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db) as w, Store(db, readonly=True) as r:
        w.save_pool("web", {}, 1, 2)
        w.save_replica(rec("web", 1))
        w.append_event("command", data={"op": "launch", "ok": True, "error": None, "cmd_id": "c1"})
        assert w.pending == 3
        for store in (r, w):          # neither another connection nor the writer's own reads
            assert store.pools() == [] and store.replicas() == [] and store.events() == []
        w.commit()
        assert w.pending == 0
        assert [p["name"] for p in r.pools()] == ["web"]
        assert [x["id"] for x in r.replicas()] == ["web-1"]
        assert [e["data"]["cmd_id"] for e in r.events()] == ["c1"]


def test_commit_without_writes_is_a_noop(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as s:
        conn = s._conn
        assert conn is not None
        before = conn.total_changes
        for _ in range(100):
            s.commit()
        assert conn.total_changes == before
        assert not conn.in_transaction


def test_load_returns_pools_and_live_replicas(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db) as s:
        s.save_pool("web", {"cmd": ["a"]}, 3, 1)
        s.save_pool("batch", {"cmd": ["b"]}, 0, 1)
        for n, state in enumerate(["RUNNING", "STARTING", "STOPPING", "PENDING"], start=1):
            s.save_replica(rec("web", n, state))
        for n, state in enumerate(sorted(TERMINAL_STATES), start=5):
            s.save_replica(rec("web", n, state, ended_at=T0 + 500.0 + n))
        s.save_replica(rec("batch", 7, "EXITED", exit_code=0, ended_at=T0 + 600.0))
        s.commit()
    with Store(db) as s:
        pools, live = s.load()
    assert {p["name"]: (p["desired"], p["next_n"], p["spec"]) for p in pools} == {
        "web": (3, 10, {"cmd": ["a"]}), "batch": (0, 8, {"cmd": ["b"]})}
    assert [(r["id"], r["state"]) for r in live] == [
        ("web-1", "RUNNING"), ("web-2", "STARTING"), ("web-3", "STOPPING"), ("web-4", "PENDING")]
    assert live[0]["pid"] == 1001 and live[0]["start_time"] == 50_001


def test_next_n_is_monotonic_and_survives_pruning(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db, keep_replicas=5) as s:
        s.save_pool("web", {}, 0, 1)
        for n in range(1, 51):
            s.save_replica(rec("web", n, "TERMINATED", ended_at=T0 + n))
        s.commit()
        # a stale next_n from the caller never lowers it
        s.save_pool("web", {}, 0, 3)
        # a replica saved for a pool never saved still reserves its id
        s.save_replica(rec("orphan", 9, "FAILED", ended_at=T0))
        s.commit()
        s.prune()
        assert len(s.replicas(include_terminal=True)) == 5
    with Store(db, keep_replicas=0) as s:      # prunes every terminal replica at open
        assert s.replicas(include_terminal=True) == []
        pools, live = s.load()
    assert live == []
    assert {p["name"]: p["next_n"] for p in pools} == {"web": 51, "orphan": 10}


def test_pool_and_n_derived_from_id_when_missing(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as s:
        s.save_replica({"id": "my-pool-12", "state": "PENDING"})
        s.commit()
        (r,) = s.replicas()
        assert (r["pool"], r["n"], r["pid"], r["created_at"]) == ("my-pool", 12, None, None)
        assert s.load()[0][0]["next_n"] == 13


# --------------------------------------------------------------------------- events

def test_events_filters(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as s:
        for i in range(10):
            s.append_event("transition", replica=f"web-{i % 3}", data={"i": i}, ts=T0 + i)
        s.append_event("stop", ts=T0 + 1000.0)
        s.commit()
        assert [e["seq"] for e in s.events()] == list(range(1, 12))
        assert [e["data"]["i"] for e in s.events(replica="web-1")] == [1, 4, 7]
        assert [e["seq"] for e in s.events(since=T0 + 8.0)] == [9, 10, 11]
        assert [e["seq"] for e in s.events(after_seq=8)] == [9, 10, 11]
        assert [e["seq"] for e in s.events(after_seq=2, limit=3)] == [3, 4, 5]
        assert [e["seq"] for e in s.events(limit=3, newest=True)] == [9, 10, 11]  # `events --limit`
        assert [e["seq"] for e in s.events(replica="web-0", since=T0 + 3.0, after_seq=4)] == [7, 10]
        assert s.events(after_seq=11) == []
        stop = s.events()[-1]
        assert stop == {"seq": 11, "ts": T0 + 1000.0, "kind": "stop", "replica": None, "data": {}}


def test_follow_tails_with_after_seq(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db) as w, Store(db, readonly=True) as r:
        seen: list[int] = []
        last = r.last_seq()
        assert last == 0
        for turn in range(5):
            for i in range(3):
                w.append_event("command", data={"turn": turn, "i": i})
            w.commit()
            new = r.events(after_seq=last)
            seen += [e["seq"] for e in new]
            last = new[-1]["seq"]
        assert seen == list(range(1, 16))


def test_event_data_with_odd_values_does_not_raise(tmp_path: Path) -> None:
    with Store(tmp_path / "state.db") as s:
        s.append_event("command", data={"path": tmp_path, "err": ValueError("bad"), "t": (1, 2)})
        s.commit()
        (e,) = s.events()
        assert e["data"] == {"path": str(tmp_path), "err": "bad", "t": [1, 2]}
        # a pool spec must come back as itself at recovery: no silent str() there
        with pytest.raises(TypeError):
            s.save_pool("web", {"pickled": b"\x80\x04"}, 1, 1)
        assert s.pending == 0


def test_seq_never_reused_after_everything_is_pruned(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db, keep_seconds=60) as s:
        for i in range(5):
            s.append_event("old", ts=1000.0 + i)
        s.commit()
        s.prune()
        assert s.events() == []
        s.append_event("new")
        s.commit()
        assert [e["seq"] for e in s.events()] == [6]
    with Store(db, readonly=True) as r:
        assert r.last_seq() == 6


# --------------------------------------------------------------------------- retention

def test_retention_bounds_rows_and_file_size_under_churn(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    keep_r, keep_e, every = 200, 1000, 500
    with Store(db, keep_replicas=keep_r, keep_events=keep_e, prune_every=every) as s:
        s.save_pool("web", {}, 20, 1)
        # live replicas, created long ago: never pruned whatever the limits
        for n in range(1, 301):
            s.save_replica(rec("live", n, "RUNNING", created_at=1.0))
        s.commit()
        n = churn(s, 1, 10_000)
        size_10k = db.stat().st_size
        max_wal = 0
        for _ in range(4):
            n = churn(s, n, 5_000)
            max_wal = max(max_wal, os.path.getsize(f"{db}-wal"))
            # between prunes the tables exceed the limits by at most one prune interval
            assert count(db, "SELECT count(*) FROM events") <= keep_e + every
            assert count(db, "SELECT count(*) FROM replicas WHERE retire_key IS NOT NULL") \
                <= keep_r + every
        assert n == 30_001
        s.prune()
        assert count(db, "SELECT count(*) FROM events") == keep_e
        terminal = [r for r in s.replicas(include_terminal=True) if r["state"] == "TERMINATED"]
        assert len(terminal) == keep_r
        # the newest ended are kept
        assert {r["n"] for r in terminal} == set(range(30_001 - keep_r, 30_001))
        assert len(s.replicas()) == 300
        assert [e["seq"] for e in s.events()][-1] == s.last_seq() == 150_000
        size_30k = db.stat().st_size
    # the file stops growing: three times the churn, (about) the same size
    assert size_30k <= size_10k * 1.25 + 64 * 1024, (size_10k, size_30k)
    assert size_30k < 1024 * 1024
    assert max_wal <= 2 * 1024 * 1024, max_wal


def test_retention_by_age_keeps_live_replicas(tmp_path: Path) -> None:
    now = time.time()
    db = tmp_path / "state.db"
    with Store(db, keep_seconds=3600) as s:
        s.save_replica(rec("web", 1, "RUNNING", created_at=now - 90_000))          # live, old
        s.save_replica(rec("web", 2, "EXITED", ended_at=now - 7200))               # old
        s.save_replica(rec("web", 3, "LOST", ended_at=now - 60))                   # recent
        for i, age in enumerate([9000, 5000, 100, 10]):
            s.append_event("transition", replica=f"web-{i}", ts=now - age)
        s.commit()
        s.prune(now)
        assert [r["id"] for r in s.replicas(include_terminal=True)] == ["web-1", "web-3"]
        assert [e["seq"] for e in s.events()] == [3, 4]
        # everything terminal and every event is old one week later; the live one stays
        s.prune(now + 7 * 86400)
        assert [r["id"] for r in s.replicas(include_terminal=True)] == ["web-1"]
        assert s.events() == []


def test_incremental_vacuum_gives_space_back(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db, keep_events=1_000_000, keep_replicas=1_000_000) as s:
        churn(s, 1, 4000)
        big = db.stat().st_size
    with Store(db, keep_events=100, keep_replicas=10) as s:   # retention lowered: prune at open
        s.prune()
        s.prune()
        conn = s._conn
        assert conn is not None
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        assert db.stat().st_size < big / 2, (big, db.stat().st_size)
        assert s.integrity_ok()


# --------------------------------------------------------------------------- corruption

def test_garbage_file_is_moved_aside_and_a_fresh_db_works(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    garbage = os.urandom(3 * 4096)
    db.write_bytes(garbage)
    Path(f"{db}-wal").write_bytes(b"not a wal either")
    with Store(db) as s:
        assert len(s.notes) == 1
        asides = sorted(tmp_path.glob("state.db.corrupt-*"))
        aside = next(p for p in asides if not p.name.endswith(("-wal", "-shm")))
        assert aside.read_bytes() == garbage                  # kept, never deleted
        assert Path(f"{aside}-wal").read_bytes() == b"not a wal either"
        assert str(aside) in s.notes[0] and "not a database" in s.notes[0]
        assert s.integrity_ok()
        s.save_pool("web", {}, 1, 1)
        s.save_replica(rec("web", 1))
        s.commit()
    with Store(db) as s:
        assert s.notes == []
        assert [r["id"] for r in s.replicas()] == ["web-1"]


def test_malformed_pages_fail_quick_check_and_are_moved_aside(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db) as s:
        for n in range(1, 3001):
            s.save_replica(rec("web", n))
            s.append_event("transition", replica=f"web-{n}", data={"n": n})
        s.commit()
    with open(db, "r+b") as f:     # keep the header valid, smash pages in the middle
        f.seek(4 * 4096)
        f.write(bytes((i * 131 + 7) % 256 for i in range(8 * 4096)))
    damaged = db.read_bytes()
    with Store(db) as s:
        assert len(s.notes) == 1 and "moved aside" in s.notes[0]
        assert s.replicas() == [] and s.integrity_ok()
    (aside,) = [p for p in tmp_path.glob("state.db.corrupt-*") if p.suffix != ".db"
                and not p.name.endswith(("-wal", "-shm"))]
    assert aside.read_bytes() == damaged


def test_two_corruptions_in_the_same_second_get_distinct_names(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    for i in range(2):
        db.write_bytes(b"garbage %d" % i * 500)
        Store(db).close()
    asides = [p for p in tmp_path.glob("state.db.corrupt-*")
              if not p.name.endswith(("-wal", "-shm"))]
    assert sorted(p.read_bytes()[:9] for p in asides) == [b"garbage 0", b"garbage 1"]


def test_newer_schema_is_refused_not_moved_aside(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    Store(db).close()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(db)
    assert list(tmp_path.glob("*.corrupt-*")) == []


V1_TASKS = """CREATE TABLE tasks (
    id TEXT PRIMARY KEY, pool TEXT NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL,
    attempts INTEGER NOT NULL, retries INTEGER NOT NULL, timeout REAL, worker TEXT, queued_at REAL,
    started_at REAL, ended_at REAL, reason TEXT, payload BLOB, kind TEXT, result BLOB, retire_key REAL
) WITHOUT ROWID"""  # the tasks table of schema version 1, as a file of that version has it


def _old_file(db: Path, version: int, *statements: str) -> None:
    """A state db of schema ``version``: the version 1 tasks table, then ``statements``."""
    conn = sqlite3.connect(db)
    for statement in (V1_TASKS, *statements, f"PRAGMA user_version = {version}"):
        conn.execute(statement)
    conn.commit()
    conn.close()


def test_a_file_of_schema_1_is_read_as_it_is_and_migrated_by_the_writer(tmp_path: Path) -> None:
    """Version 2 adds a task's priority and tenant: a version 1 file is read with neither
    (a CLI with the daemon down) and gains both columns when a writer opens it."""
    db = tmp_path / "state.db"
    _old_file(db, 1, "INSERT INTO tasks(id, pool, n, state, attempts, retries, queued_at, payload) "
                     "VALUES ('jobs/1', 'jobs', 1, 'QUEUED', 0, 0, 1.0, x'00')")
    with Store(db, readonly=True) as r:
        (row,) = r.tasks()
        assert (row["id"], row["priority"], row["tenant"]) == ("jobs/1", None, None)
    with Store(db) as s:
        (row,) = s.tasks()
        assert (row["priority"], row["tenant"]) == (None, None)
        s.save_task({**row, "priority": 4, "tenant": "alice"})
        s.commit()
        assert [(r["priority"], r["tenant"]) for r in s.tasks()] == [(4, "alice")]
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()


def test_a_file_of_schema_2_is_read_without_keys_and_migrated_by_the_writer(tmp_path: Path) -> None:
    """Version 3 adds a task's key: a version 2 file is read with none (and no task found
    by one) and gains the column, with its index, when a writer opens it."""
    db = tmp_path / "state.db"
    _old_file(db, 2, "ALTER TABLE tasks ADD COLUMN priority INTEGER", "ALTER TABLE tasks ADD COLUMN tenant TEXT",
              "INSERT INTO tasks(id, pool, n, state, attempts, retries, queued_at, payload, tenant) "
              "VALUES ('jobs/1', 'jobs', 1, 'QUEUED', 0, 0, 1.0, x'00', 'alice')")
    with Store(db, readonly=True) as r:
        (row,) = r.tasks()
        assert (row["tenant"], row["key"]) == ("alice", None)
        assert r.tasks(pool="jobs", key="req-1") == []
    with Store(db) as s:
        (row,) = s.tasks()
        s.save_task({**row, "key": "req-1"})
        s.commit()
        assert [r["id"] for r in s.tasks(pool="jobs", key="req-1")] == ["jobs/1"]
        assert s.tasks(pool="jobs", key="req-2") == []
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'tasks_key'").fetchone() == ("tasks_key",)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


WAIT_COLUMNS = ("deadline", "backoff_min", "backoff_max", "waits", "wait_until", "wait_reason")


def test_a_file_of_schema_2_gains_the_wait_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    """Version 3 adds a task's deadline, backoff and wait (daemon/taskwait.py): a version 2
    file reads them as NULL until a writer opens it, which adds each column once (one it
    has already is left as it is)."""
    db = tmp_path / "state.db"
    _old_file(db, 2, *(f"ALTER TABLE tasks ADD COLUMN {c}" for c in ("priority INTEGER", "tenant TEXT", "waits INTEGER")),
              "INSERT INTO tasks(id, pool, n, state, attempts, retries, queued_at, payload) "
              "VALUES ('jobs/1', 'jobs', 1, 'QUEUED', 0, 0, 1.0, x'00')")  # waits: as if a part of it were there
    with Store(db, readonly=True) as r:
        (row,) = r.tasks()
        assert row["id"] == "jobs/1" and all(row[c] is None for c in WAIT_COLUMNS)
    with Store(db) as s:
        (row,) = s.tasks()
        s.save_task({**row, "state": "WAITING", "deadline": 30.0, "backoff_min": 0.5, "backoff_max": 4.0,
                     "waits": 2, "wait_until": 99.5, "wait_reason": "rate limited"})
        s.commit()
        (row,) = s.tasks()  # unfinished: WAITING is not retired
        assert [row[c] for c in WAIT_COLUMNS] == [30.0, 0.5, 4.0, 2, 99.5, "rate limited"]
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()


# --------------------------------------------------------------------------- readers

def test_reader_on_missing_db_is_empty_and_creates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db, readonly=True) as r:
        assert r.pools() == [] and r.replicas(include_terminal=True) == [] and r.events() == []
        assert r.load() == ([], []) and r.last_seq() == 0
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(StoreError, match="read-only"):
            r.save_replica(rec("web", 1))
        with pytest.raises(StoreError, match="read-only"):
            r.append_event("x")
        # the daemon starts later: the same reader picks the file up
        with Store(db) as w:
            w.append_event("start")
            w.commit()
            assert [e["kind"] for e in r.events()] == ["start"]


def test_reader_on_corrupt_db_raises_and_moves_nothing(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    db.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(StoreError, match="corrupt"):
        Store(db, readonly=True)
    assert [p.name for p in tmp_path.iterdir()] == ["state.db"]


def test_closed_store_refuses(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    s.save_replica(rec("web", 1))
    s.close()                       # commits what was buffered
    s.close()                       # idempotent
    with pytest.raises(StoreError, match="closed"):
        s.replicas()
    with Store(tmp_path / "state.db", readonly=True) as r:
        assert [x["id"] for x in r.replicas()] == ["web-1"]


# --------------------------------------------------------------------------- environment errors

_OPEN_SCRIPT = """
import sys
from orchestrator.store import Store, StoreError
try:
    Store(sys.argv[1]).close()
except StoreError as e:
    print("StoreError:", e)
else:
    print("opened")
"""

# Root ignores file modes through CAP_DAC_OVERRIDE. Dropping that capability from the child's
# bounding set gives a root process that honours them, so chmod 0500 is a real read-only dir.
_NO_DAC = ["setpriv", "--inh-caps=-all",
           "--bounding-set=-dac_override,-dac_read_search,-fowner,-linux_immutable"]


def _readonly_dir_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv is missing: cannot make a dir read-only")
    probe = subprocess.run([*_NO_DAC, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot drop capabilities here: {probe.stderr.decode().strip()}")
    return _NO_DAC


@pytest.mark.parametrize("existing_db", [False, True])
def test_read_only_state_dir_is_a_clear_error(tmp_path: Path, existing_db: bool) -> None:
    prefix = _readonly_dir_prefix()
    state = tmp_path / "state"
    state.mkdir()
    db = state / "state.db"
    if existing_db:
        with Store(db) as s:
            s.save_replica(rec("web", 1))
    os.chmod(state, 0o500)
    try:
        out = run_py(_OPEN_SCRIPT, str(db), prefix=prefix)
    finally:
        os.chmod(state, 0o700)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""                       # no traceback
    assert out.stdout.strip() == f"StoreError: state dir {state} is read-only", out.stdout
    if existing_db:                               # and the data is untouched
        with Store(db, readonly=True) as r:
            assert [x["id"] for x in r.replicas()] == ["web-1"]


def test_full_database_is_a_clear_error_and_the_batch_is_retried(tmp_path: Path) -> None:
    """Simulated: PRAGMA max_page_count makes SQLite return SQLITE_FULL exactly as ENOSPC does."""
    with Store(tmp_path / "state.db") as s:
        conn = s._conn
        assert conn is not None
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        s.append_event("before")
        for n in range(1, 2001):
            s.save_replica(rec("web", n, reason="x" * 200))
        with pytest.raises(StoreError, match=r"^disk full writing .*state\.db$"):
            s.commit()
        assert s.pending == 2001                   # nothing lost from the buffer
        assert s.replicas() == [] and s.events() == []   # and nothing half-written
        conn.execute("PRAGMA max_page_count = 1073741823")
        s.commit()
        assert len(s.replicas()) == 2000 and [e["kind"] for e in s.events()] == ["before"]


def test_events_buffered_through_a_long_failure_are_bounded_and_counted(tmp_path: Path) -> None:
    """Rows are one per id; events are not: while commits fail, only the newest keep_events
    are kept for the catch-up, and one ``journal`` event counts the others."""
    with Store(tmp_path / "state.db", keep_events=100) as s:
        conn = s._conn
        assert conn is not None
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        s.save_replica(rec("web", 1, reason="x" * 5000))
        for n in range(3000):
            s.append_event("tick", data={"n": n, "pad": "x" * 100})
            if n % 500 == 0:
                with pytest.raises(StoreError, match="disk full"):
                    s.commit()
        assert s.pending <= 1 + 2 * 100 + 1000 + 1       # bounded, not 3000 events
        conn.execute("PRAGMA max_page_count = 1073741823")
        s.commit()
        events = s.events()
        assert events[0]["kind"] == "journal" and events[0]["data"]["dropped_events"] > 0, events[0]
        ticks = [e["data"]["n"] for e in events if e["kind"] == "tick"]
        assert ticks == list(range(3000 - len(ticks), 3000))  # the newest, in order, none twice
        assert events[0]["data"]["dropped_events"] + len(ticks) == 3000
        assert [r["id"] for r in s.replicas()] == ["web-1"]    # rows are never let go


_FULL_SCRIPT = """
import os, sys
from orchestrator.store import Store, StoreError
db = sys.argv[1]
s = Store(db)
try:
    for n in range(100_000):
        s.append_event("filler", data={"pad": "x" * 500, "n": n})
        if n % 100 == 99:
            s.commit()
except StoreError as e:
    print("StoreError:", e)
    print("events", len(s.events()))
    # once space is back the same buffer commits
    os.unlink(sys.argv[2])
    s.commit()
    print("retried", len(s.events()))
s.close()
"""


def test_real_disk_full_on_a_small_tmpfs(tmp_path: Path) -> None:
    """ENOSPC for real: a 512 KiB tmpfs mounted in a private mount namespace of the child."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(_FULL_SCRIPT))
    shell = (f'mount -t tmpfs -o size=512k tmpfs "{mnt}" || exit 77; '
             f'head -c 262144 /dev/zero > "{mnt}/ballast"; '
             f'exec "{sys.executable}" "{script}" "{mnt}/state.db" "{mnt}/ballast"')
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=60)
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"StoreError: disk full writing {mnt}/state.db", out.stdout
    committed = int(lines[1].split()[1])
    assert committed > 0 and committed % 100 == 0        # whole batches only
    assert int(lines[2].split()[1]) == committed + 100   # the failed batch, retried


# --------------------------------------------------------------------------- crashes

_CRASH_SCRIPT = """
import os, signal, sys
from orchestrator.store import Store
s = Store(sys.argv[1])
for b in range(1, 6):
    s.save_pool("web", {"batch": b}, b, 1)
    for i in range(20):
        n = b * 100 + i
        s.save_replica({"id": f"web-{n}", "pool": "web", "n": n, "state": "RUNNING", "pid": n})
        s.append_event("transition", replica=f"web-{n}", data={"batch": b})
    s.commit()
s.save_pool("web", {"batch": 6}, 6, 1)
for i in range(20):
    s.save_replica({"id": f"web-{600 + i}", "pool": "web", "n": 600 + i, "state": "RUNNING"})
    s.append_event("transition", replica=f"web-{600 + i}", data={"batch": 6})
s.save_replica({"id": "web-100", "pool": "web", "n": 100, "state": "FAILED"})
print("buffered", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_mid_batch_keeps_committed_batches_only(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    out = run_py(_CRASH_SCRIPT, str(db))
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert out.stdout == "buffered\n"
    assert os.path.getsize(f"{db}-wal") > 0        # it really died with an un-checkpointed WAL
    with Store(db) as s:
        assert s.notes == [] and s.integrity_ok()
        pools, live = s.load()
        assert [(p["spec"], p["desired"]) for p in pools] == [({"batch": 5}, 5)]
        assert pools[0]["next_n"] == 520
        assert sorted(r["n"] for r in live) == sorted(b * 100 + i for b in range(1, 6)
                                                      for i in range(20))
        assert all(r["state"] == "RUNNING" for r in live)           # web-100 not FAILED
        batches = [e["data"]["batch"] for e in s.events()]
        assert batches == [b for b in range(1, 6) for _ in range(20)]


_LOOP_SCRIPT = """
import sys
from orchestrator.store import Store
s = Store(sys.argv[1], keep_events=5000, keep_replicas=2000, prune_every=300)
b = 0
while True:
    b += 1
    s.save_pool("web", {}, b, 1)
    for i in range(20):
        n = b * 100 + i
        s.save_replica({"id": f"web-{n}", "pool": "web", "n": n,
                        "state": "EXITED" if i % 2 else "RUNNING", "ended_at": float(b)})
        s.append_event("transition", replica=f"web-{n}", data={"batch": b, "i": i})
    s.commit()
    print(b, flush=True)     # acknowledged only after commit() returned
"""


@pytest.mark.parametrize("acked_before_kill", [1, 37, 400])
def test_kill_9_at_any_moment_leaves_whole_batches(tmp_path: Path, acked_before_kill: int) -> None:
    db = tmp_path / "state.db"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_LOOP_SCRIPT), str(db)],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        acked = 0
        for line in proc.stdout:
            acked = int(line)
            if acked >= acked_before_kill:
                break
        proc.send_signal(signal.SIGKILL)     # while it is busy with the next batches
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    assert acked >= acked_before_kill
    with Store(db, readonly=True) as r:
        assert r.integrity_ok()
        pools = r.pools()
        last = pools[0]["desired"]          # the last batch that made it
        assert last >= acked                # every acknowledged batch is there
        events = r.events()
        per_batch: dict[int, int] = {}
        for e in events:
            per_batch[e["data"]["batch"]] = per_batch.get(e["data"]["batch"], 0) + 1
        # nothing half-written: every batch that is there is there in full, none after `last`
        assert max(per_batch) == last
        assert all(c == 20 for c in per_batch.values()), per_batch
        live = r.replicas()
        assert {x["n"] for x in live} == {b * 100 + i for b in range(1, last + 1)
                                          for i in range(0, 20, 2)}
        assert pools[0]["next_n"] == last * 100 + 20
