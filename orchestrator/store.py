"""Durable state of one orchestrator daemon: ``<state dir>/state.db``.

What it is for
--------------
The control loop owns the replica table in memory; this module makes that table survive the
daemon (a clean stop, a crash, a ``kill -9``) so that the next ``start`` can recover: reap the
leftovers recorded here, mark them LOST, and bring every pool back to its desired size with
fresh ids. It also keeps an append-only journal of events (transitions, commands, recoveries)
for ``orchestrator events`` and ``status`` when the daemon is down.

Who writes, who reads
---------------------
* Exactly one writer: the daemon's single-threaded control loop. During one loop turn it calls
  ``save_pool`` / ``save_replica`` / ``append_event``; these only buffer in memory (cheap, no
  I/O). At the end of the turn it calls ``commit()`` once: one SQLite transaction for the whole
  turn. Replies to commands are sent only after ``commit()`` returned, so an acknowledged
  command is durable while the disk works. A failed ``commit()`` raises ``StoreError`` and
  keeps the buffer, so the next ``commit()`` retries it: everything buffered goes in with the
  first one that succeeds, in one transaction. (The daemon's loop answers meanwhile, its
  replies marked ``unsaved``: a command that was applied is not reported failed, see
  daemon/journal.py. Of the events buffered through a failure only the newest
  ``keep_events`` are kept, with one ``journal`` event counting the others.)
* Any number of readers (the CLI with the daemon down, ``events --follow``) open
  ``Store(path, readonly=True)``: a separate ``mode=ro`` connection that never writes, never
  prunes, never moves a file aside. WAL lets them read while the daemon writes.
* Reads on the writer's own Store see committed state only, not the current buffer.
* Not thread-safe: one thread at a time per Store object (the connection is created with
  ``check_same_thread=False`` so the daemon may open it in one thread and use it in another).

Schema (``PRAGMA user_version`` = 3; a file of an earlier version is migrated when a daemon
opens it: storesql.MIGRATIONS, and read as it is until then)
------------------------------------------------------------------------------------------
``pools(name TEXT PRIMARY KEY, spec TEXT /*JSON*/, desired INTEGER, next_n INTEGER)``
    ``next_n`` is monotonic (every write takes the max) and is also raised by every replica
    saved, so an id ``<pool>-<n>`` is never handed out twice even after its row was pruned.
``replicas(id TEXT PRIMARY KEY, pool, n, state, pid, start_time, exit_code, reason,
created_at, ended_at, retire_key REAL, extra TEXT /*JSON or NULL*/) WITHOUT ROWID``
    ``retire_key`` is NULL while the replica is live and its ``ended_at`` (or the save time when
    that is missing) once its state is terminal; a partial index on it drives retention.
    ``extra`` keeps any keys of the saved record beyond the known ones, so the control loop can
    persist more without a schema change.
``tasks(id TEXT PRIMARY KEY, pool, n, state, attempts, retries, timeout, worker, queued_at,
started_at, ended_at, reason, payload BLOB, kind, result BLOB, retire_key REAL, priority
INTEGER, tenant TEXT, key TEXT, deadline REAL, backoff_min REAL, backoff_max REAL, waits INTEGER,
wait_until REAL, wait_reason TEXT, figures TEXT /*JSON or NULL*/) WITHOUT ROWID``
    The tasks of executor pools (daemon/tasktable.py): ``payload`` (the pickled call) is kept
    while the task is unfinished, so that a queued task runs after a restart (at its
    ``priority``, its ``tenant``'s: version 2), a WAITING one at its ``wait_until``, each
    bounded by its ``deadline`` (version 3: daemon/taskwait.py); ``result`` once it ended,
    with ``figures`` (what it took in its worker: version 3); ``key``, its submitter's name
    for it (version 3; a partial index on (pool, key) finds it by that). Retention as for
    replicas, by ``retire_key`` (its end).
``events(seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL, kind TEXT, replica TEXT, data TEXT)``
    AUTOINCREMENT so that a ``seq`` is never reused even if retention empties the table:
    ``events --follow`` tails with ``after_seq`` and must never miss or repeat an event.

Durability
----------
WAL journal with ``synchronous=NORMAL``: a transaction is complete once its frames are written
to ``state.db-wal`` (in the OS page cache). ``kill -9`` of the daemon (or any crash of the
process) therefore loses nothing that ``commit()`` returned for, and never leaves a half
transaction: after a restart every committed turn is there in full and the turn that was
being buffered (or was inside ``commit()``) is there entirely or not at all. What it can lose:
the in-memory buffer of the turn in progress (never acknowledged, by construction), and on a
power loss / kernel crash the last transactions since the previous WAL checkpoint (the
database stays consistent, it just rolls back to an earlier commit). Stronger guarantees would
need ``synchronous=FULL`` (an fsync per turn), which the requirement does not ask for.

On open the writer runs ``PRAGMA quick_check`` on an existing file, through a read-only
connection so that a bad file is left byte for byte as it was (a read-write connection would
checkpoint its WAL into it on close). A file that is not a database, is malformed or fails the
check (or whose corruption shows up during the open itself) is moved aside to ``<path>.corrupt-<UTC timestamp>`` (with its -wal/-shm),
never deleted; a fresh database is created and a line is added to ``Store.notes`` for the
daemon to log. A read-only state dir, a full disk or an I/O error raise ``StoreError`` with a
one-line message; so does a database written by a newer schema version (not moved aside).

Retention
---------
Live replicas are never pruned. Terminal replicas beyond ``keep_replicas`` (oldest ended first)
or ended more than ``keep_seconds`` ago are deleted; events beyond the newest ``keep_events`` or
older than ``keep_seconds`` are deleted (age pruning assumes ``ts`` grows with ``seq``, which
holds for events appended by one loop). Pruning runs at open and then from ``commit()`` every
``prune_every`` rows written, or once ``max(PRUNE_RETIRED_MIN, keep_replicas // 10)`` replicas
were saved terminal (so the table overshoots ``keep_replicas`` by at most about a tenth, however
small the retention), or every 10 minutes if anything was written; not per commit: it deletes by
``seq`` ranges and through the partial index, so its cost is proportional to what it deletes
(plus one index walk of the kept terminal replicas). The ids of the replicas and tasks a
prune deleted are handed to ``on_pruned`` (when set) after its transaction committed: the
daemon removes their log files. Space freed is reused by new rows;
``auto_vacuum=INCREMENTAL`` plus a bounded ``PRAGMA incremental_vacuum`` give it back to the
file system when a large part of the file is free. ``wal_autocheckpoint`` and
``journal_size_limit`` keep the -wal file at about 1 MB as long as no reader keeps a read
transaction open forever (readers here always fetch everything and end their statement).
At the default limits (20,000 events, 5,000 ended replicas, 7 days) the database settles at
a size that benchmarks/bench_store.py measures (figures in benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import urllib.parse
from typing import Any, Callable, Iterable, Mapping, TypedDict

from .errors import StoreError
from .retention import KEEP_EVENTS, KEEP_REPLICAS, KEEP_SECONDS
from .states import TERMINAL
from .storeerrors import is_corruption, os_message, sql_message
from .storesql import (
    INDEXES, MIGRATIONS, REPLICA_COLS, REPLICA_KEYS, SCHEMA, SCHEMA_VERSION, SQL_BUMP, SQL_EVENT, SQL_POOL,
    SQL_REPLICA, SQL_SELECT_REPLICAS, SQL_SELECT_TASKS, SQL_TASK, TASK_COLS, TASK_COLS_SINCE, TASK_JSON, dumps,
    loads, sql_select_tasks,
)

__all__ = ["Store", "StoreError", "TERMINAL_STATES", "SCHEMA_VERSION"]
_TASK_JSON_AT = tuple(TASK_COLS.index(name) for name in sorted(TASK_JSON))  # saved as JSON text

# The terminal states as the strings rows hold (states.py imports nothing of ours, so the
# CLI reading the store with the daemon down still loads none of the daemon).
TERMINAL_STATES: frozenset[str] = frozenset(s.value for s in TERMINAL)

_BUSY_TIMEOUT_S = 5.0
_WAL_AUTOCHECKPOINT_PAGES = 256           # ~1 MB of WAL between automatic checkpoints
_JOURNAL_SIZE_LIMIT = 1024 * 1024         # WAL truncated back to this after a checkpoint
# Default retention: ~2 MB of state.db at steady state under endless churn (~80 B an event).
POOL_ROW_VERSION = 2  # the version of a pool row's JSON, as pools.Pool.stored() writes it (1: the bare spec)
PRUNE_RETIRED_MIN = 16                   # terminal replica saves that trigger a prune, at least
_PRUNE_INTERVAL_S = 600.0                 # prune at least this often when anything is written
_VACUUM_MIN_FREE_PAGES = 256              # only give pages back when >= 1 MB is free ...
_VACUUM_MAX_PAGES = 4096                  # ... and at most 16 MB per prune, to bound the pause

class PoolRow(TypedDict):
    """A pool as ``pools()`` reads it: ``spec`` is the row's JSON (``unpack_pool_row``)."""

    name: str
    desired: int
    spec: Any
    next_n: int


class EventRow(TypedDict):
    """A journal entry as ``events()`` reads it; ``data`` is {} for one appended without."""

    seq: int
    ts: float
    kind: str
    replica: str | None
    data: dict[str, Any]


class _Corrupt(Exception):
    pass


def unpack_pool_row(spec_json: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
    """(spec wire, policy wire, extras) of a stored pool row, old rows (a bare spec) too."""
    if isinstance(spec_json, dict) and spec_json.get("v") == POOL_ROW_VERSION:
        return spec_json.get("spec"), spec_json.get("policy"), spec_json
    return spec_json, None, {}


class Store:
    """One daemon's state.db. See the module docstring for the contract."""

    notes: list[str]

    def __init__(self, path: str | os.PathLike[str], *, keep_replicas: int = KEEP_REPLICAS,
                 keep_events: int = KEEP_EVENTS, keep_seconds: float = KEEP_SECONDS,
                 readonly: bool = False, prune_every: int = 1000) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.dir = os.path.dirname(self.path)
        self.readonly = readonly
        self.keep_replicas = max(0, int(keep_replicas))
        self.keep_events = max(0, int(keep_events))
        self.keep_seconds = float(keep_seconds)
        self.prune_every = max(1, int(prune_every))
        self.retire_every = max(PRUNE_RETIRED_MIN, self.keep_replicas // 10)
        # Called with the ids of the replicas each prune from commit()/prune() deleted.
        self.on_pruned: Callable[[list[str]], None] | None = None
        self.notes = []
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        # Write buffers. Dicts give last-write-wins per key within a turn.
        self._pools: dict[str, tuple[str, str, int, int]] = {}
        self._replicas: dict[str, tuple[Any, ...]] = {}
        self._bump: dict[str, int] = {}          # pool -> next_n implied by replicas saved
        self._events: list[tuple[float, str, str | None, str | None]] = []
        # Events committed by this writer: a reader of the journal in the same process (the
        # HTTP event streams) asks the database only once this has moved.
        self.events_written = 0
        self._tasks: dict[str, tuple[Any, ...]] = {}
        # While commits fail (a full disk), the buffer is what the journal will catch up
        # with. Rows are one per id (bounded by what exists); events are not, so the oldest
        # of them beyond keep_events (which retention would delete at once anyway) are let
        # go, and counted here for the "journal" event that says so.
        self._failing = False
        self._dropped_events = 0
        self._since_prune = 0
        self._retired_since_prune = 0
        self._last_prune = time.monotonic()
        if readonly:
            self._open_reader()
        else:
            self._open_writer()

    # ------------------------------------------------------------------ opening
    def _open_writer(self) -> None:
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StoreError(self._os_message(e, "creating state dir")) from e
        for attempt in (1, 2):
            try:
                self._check_existing()
                self._conn = self._connect_writer()
                try:
                    self._prune()
                except sqlite3.Error as e:
                    self._conn.close()
                    self._conn = None
                    if is_corruption(e):
                        raise _Corrupt(str(e)) from None
                    raise self._sql_error(e, "pruning") from e
                return
            except _Corrupt as c:
                if attempt == 2:   # a brand-new file cannot be corrupt: the disk is suspect
                    raise StoreError(f"fresh state db {self.path} is unreadable too: {c}") from None
                aside = self._move_aside()
                self.notes.append(f"state db {self.path} was unreadable ({c}); moved aside to "
                                  f"{aside}; started with an empty store")

    def _check_existing(self) -> None:
        """quick_check an existing file through a read-only connection.

        Read-only on purpose: a read-write connection may write the header and, when it is
        closed, checkpoints the WAL into the main file and deletes it. A corrupt file and its
        -wal must be moved aside exactly as the crash left them."""
        if not os.path.exists(self.path):
            return
        conn = self._ro_connect()
        try:
            rows = conn.execute("PRAGMA quick_check").fetchall()
        except sqlite3.Error as e:
            if is_corruption(e):
                raise _Corrupt(str(e)) from None
            raise self._sql_error(e, "checking") from e
        finally:
            conn.close()
        if rows != [("ok",)]:
            raise _Corrupt("quick_check: " + "; ".join(str(r[0]) for r in rows[:3]))

    def _connect_writer(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as e:
            raise self._sql_error(e, "opening") from e
        try:
            self._setup_writer(conn)
        except sqlite3.Error as e:
            conn.close()
            if is_corruption(e):
                raise _Corrupt(str(e)) from None
            raise self._sql_error(e, "opening") from e
        except BaseException:
            conn.close()
            raise
        return conn

    def _setup_writer(self, conn: sqlite3.Connection) -> None:
        # auto_vacuum only takes effect before the first table exists, and it must come
        # before journal_mode; set it on a fresh (empty) file only, so that opening an
        # existing file writes nothing before the schema transaction below.
        if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"cannot put {self.path} in WAL mode (journal_mode={mode})")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA wal_autocheckpoint = {_WAL_AUTOCHECKPOINT_PAGES}")
        conn.execute(f"PRAGMA journal_size_limit = {_JOURNAL_SIZE_LIMIT}")
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA cache_size = -8000")   # 8 MB: the whole working set at defaults
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"state db {self.path} has schema version {version}, newer than "
                             f"this orchestrator supports ({SCHEMA_VERSION})")
        # Always one small write transaction at open: it creates the schema on a fresh file
        # and, on an existing one, proves now (not at the first acknowledged command) that
        # the file is writable.
        conn.execute("BEGIN IMMEDIATE")
        try:
            for stmt in SCHEMA:
                conn.execute(stmt)
            for old in range(version or SCHEMA_VERSION, SCHEMA_VERSION):  # a fresh file has the schema now
                for stmt in MIGRATIONS[old]:
                    _migrate(conn, stmt)
            for stmt in INDEXES:
                conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise

    def _open_reader(self) -> None:
        # A missing file is not an error for a reader (no daemon ever ran here): reads return
        # nothing and the connection is retried on the next read.
        if os.path.exists(self.path):
            self._conn = self._connect_reader()

    def _ro_connect(self) -> sqlite3.Connection:
        uri = "file:" + urllib.parse.quote(self.path) + "?mode=ro"
        try:
            return sqlite3.connect(uri, uri=True, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as e:
            raise self._sql_error(e, "opening") from e

    def _connect_reader(self) -> sqlite3.Connection | None:
        conn = self._ro_connect()
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as e:
            conn.close()
            raise self._sql_error(e, "reading") from e
        if version > SCHEMA_VERSION:
            conn.close()
            raise StoreError(f"state db {self.path} has schema version {version}, newer than "
                             f"this orchestrator supports ({SCHEMA_VERSION})")
        if version == 0:
            # An empty file (a daemon that died while creating it, a `touch`): nothing was
            # ever journaled here, so a reader sees nothing, and tries again next time.
            conn.close()
            return None
        return conn

    def _move_aside(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = f"{self.path}.corrupt-{stamp}"
        k = 1
        while os.path.lexists(aside):
            aside = f"{self.path}.corrupt-{stamp}-{k}"
            k += 1
        try:
            os.rename(self.path, aside)
            for suffix in ("-wal", "-shm", "-journal"):
                if os.path.lexists(self.path + suffix):
                    os.rename(self.path + suffix, aside + suffix)
        except OSError as e:
            raise StoreError(self._os_message(e, "moving aside corrupt")) from e
        return aside

    # ------------------------------------------------------------------ errors
    def _os_message(self, e: OSError, doing: str) -> str:
        return os_message(e, doing, self.dir, self.path)

    def _sql_error(self, e: sqlite3.Error, doing: str) -> StoreError:
        return StoreError(sql_message(e, doing, self.dir, self.path, probe=not self.readonly))

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass   # SQLite already rolled back (e.g. after SQLITE_FULL): nothing to undo

    def _writer(self) -> sqlite3.Connection:
        if self.readonly:
            raise StoreError(f"state db {self.path} is open read-only")
        if self._conn is None:
            raise StoreError(f"state db {self.path} is closed")
        return self._conn

    def _reader(self) -> sqlite3.Connection | None:
        if self._conn is None:
            if self._closed:
                raise StoreError(f"state db {self.path} is closed")
            if self.readonly and os.path.exists(self.path):
                self._conn = self._connect_reader()
        return self._conn

    # ------------------------------------------------------------------ write side
    def save_pool(self, name: str, spec: dict[str, Any], desired: int, next_n: int) -> None:
        """Upsert a pool (buffered). next_n never goes down in the database."""
        if self.readonly:
            self._writer()
        # Strict JSON here (no default=str): recovery rebuilds the pool from this spec, so a
        # value that would not come back as itself must fail now, in the caller, not at restart.
        self._pools[name] = (name, json.dumps(spec, separators=(",", ":")), int(desired),
                             int(next_n))

    def save_replica(self, rec: Mapping[str, Any]) -> None:
        """Upsert a replica record (buffered; the last save of an id in a turn wins)."""
        if self.readonly:
            self._writer()
        g = rec.get
        rid = rec["id"]
        state = rec["state"]
        pool = g("pool")
        n = g("n")
        if pool is None or n is None:
            p, _, s = rid.rpartition("-")
            pool = p if pool is None else pool
            n = int(s) if n is None else n
        ended_at = g("ended_at")
        # retire_key orders terminal replicas for retention; NULL keeps a live one out of it.
        retire_key = None
        if state in TERMINAL_STATES:
            retire_key = ended_at if ended_at is not None else time.time()
        extra = None
        if not rec.keys() <= REPLICA_KEYS:
            extra = dumps({k: v for k, v in rec.items() if k not in REPLICA_KEYS})
        # Snapshot into a tuple now: the caller keeps mutating its record.
        self._replicas[rid] = (rid, pool, n, state, g("pid"), g("start_time"), g("exit_code"),
                               g("reason"), g("created_at"), ended_at, retire_key, extra)
        b = self._bump.get(pool)
        if b is None or n >= b:
            self._bump[pool] = n + 1

    def append_event(self, kind: str, *, replica: str | None = None, data: Mapping[str, Any] | None = None,
                     ts: float | None = None) -> None:
        """Append to the journal (buffered). ts defaults to now (wall clock)."""
        if self.readonly:
            self._writer()
        self._events.append((time.time() if ts is None else ts, kind, replica,
                             None if data is None else dumps(data)))
        if self._failing and len(self._events) > 2 * self.keep_events + 1000:
            drop = len(self._events) - self.keep_events
            del self._events[:drop]  # in bulk: amortised O(1) an event
            self._dropped_events += drop

    def save_task(self, rec: Mapping[str, Any]) -> None:
        """Upsert a task record (buffered; the last save of an id in a turn wins): the keys
        of TASK_COLS but ``retire_key``, which is its ``ended_at`` once it has ended."""
        if self.readonly:
            self._writer()
        g = rec.get
        retire = (g("ended_at") or time.time()) if g("state") not in ("QUEUED", "RUNNING", "WAITING") else None
        row = [g(k) for k in TASK_COLS[:-1]]
        for at in _TASK_JSON_AT:
            if row[at] is not None:
                row[at] = dumps(row[at])
        row.append(retire)
        self._tasks[rec["id"]] = tuple(row)

    @property
    def pending(self) -> int:
        """Number of buffered rows not yet committed."""
        return len(self._pools) + len(self._replicas) + len(self._events) + len(self._tasks)

    def file_id(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the database file now; None if it is gone."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def hand_over(self, other: "Store") -> None:
        """Move what is buffered and not committed into ``other`` (a journal recreated
        after this one's file vanished), and close this one without writing."""
        other._pools.update(self._pools)
        other._replicas.update(self._replicas)
        for pool, n in self._bump.items():
            other._bump[pool] = max(n, other._bump.get(pool, 0))
        other._events.extend(self._events)
        other._tasks.update(self._tasks)
        self._tasks.clear()
        self._pools.clear()
        self._replicas.clear()
        self._bump.clear()
        self._events.clear()
        self.close()

    def commit(self) -> None:
        """Write everything buffered in one transaction. No-op when nothing is buffered.

        On failure raises StoreError and keeps the buffer (a later commit() retries it)."""
        if not (self._pools or self._replicas or self._events or self._tasks):
            return
        conn = self._writer()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if self._pools:
                    conn.executemany(SQL_POOL, self._pools.values())
                if self._bump:
                    conn.executemany(SQL_BUMP, self._bump.items())
                if self._replicas:
                    conn.executemany(SQL_REPLICA, self._replicas.values())
                if self._dropped_events:  # first: it stands for events older than those kept
                    conn.execute(SQL_EVENT, (self._events[0][0] if self._events else time.time(), "journal", None,
                                             dumps({"dropped_events": self._dropped_events, "reason":
                                                    "beyond keep_events while the state could not be saved"})))
                if self._events:
                    conn.executemany(SQL_EVENT, self._events)
                if self._tasks:
                    conn.executemany(SQL_TASK, self._tasks.values())
                conn.execute("COMMIT")
            except BaseException:
                self._rollback(conn)
                raise
        except sqlite3.Error as e:
            self._failing = True
            raise self._sql_error(e, "writing") from e
        self._failing = False
        self.events_written += len(self._events) + bool(self._dropped_events)
        self._dropped_events = 0
        written = len(self._pools) + len(self._replicas) + len(self._events) + len(self._tasks)
        self._retired_since_prune += sum(1 for row in self._replicas.values() if row[10] is not None)
        self._retired_since_prune += sum(1 for row in self._tasks.values() if row[-1] is not None)
        self._tasks.clear()
        self._pools.clear()
        self._replicas.clear()
        self._bump.clear()
        self._events.clear()
        self._since_prune += written
        if (self._since_prune >= self.prune_every or self._retired_since_prune >= self.retire_every
                or time.monotonic() - self._last_prune >= _PRUNE_INTERVAL_S):
            try:
                pruned = self._prune()
            except sqlite3.Error as e:
                # The batch is committed: do not report failure for it. Retention is retried
                # at the next cadence; the daemon can log the note.
                self._since_prune = self._retired_since_prune = 0
                self._last_prune = time.monotonic()
                self.notes.append(f"pruning {self.path} failed: {e}")
                return
            self._tell_pruned(pruned)

    def prune(self, now: float | None = None) -> None:
        """Apply retention now (the store also does this by itself from commit())."""
        self._writer()
        try:
            pruned = self._prune(now)
        except sqlite3.Error as e:
            raise self._sql_error(e, "pruning") from e
        self._tell_pruned(pruned)

    def _tell_pruned(self, ids: list[str]) -> None:
        if ids and self.on_pruned is not None:
            self.on_pruned(ids)

    def _prune(self, now: float | None = None) -> list[str]:
        """Apply retention; returns the ids of the replica and task rows deleted."""
        conn = self._conn
        assert conn is not None
        cut = (time.time() if now is None else now) - self.keep_seconds
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Events by count: seqs are dense, so "the newest keep_events" is a rowid range.
            top = conn.execute("SELECT max(seq) FROM events").fetchone()[0]
            if top is not None and top > self.keep_events:
                conn.execute("DELETE FROM events WHERE seq <= ?", (top - self.keep_events,))
            # Events by age: walk from the oldest seq to the first young one (cost ~ rows
            # deleted), then delete the range before it.
            first_young = conn.execute(
                "SELECT seq FROM events WHERE ts >= ? ORDER BY seq LIMIT 1", (cut,)).fetchone()
            if first_young is None:
                conn.execute("DELETE FROM events")
            else:
                conn.execute("DELETE FROM events WHERE seq < ?", (first_young[0],))
            # Terminal replicas: by age, then keep only the keep_replicas most recently ended.
            # RETURNING: who was forgotten (fetched whole: the statement must end before COMMIT).
            pruned = [row[0] for row in conn.execute(
                "DELETE FROM replicas WHERE retire_key IS NOT NULL AND retire_key < ? RETURNING id",
                (cut,)).fetchall()]
            pruned += [row[0] for row in conn.execute(
                "DELETE FROM replicas WHERE id IN (SELECT id FROM replicas "
                "WHERE retire_key IS NOT NULL ORDER BY retire_key DESC, id DESC "
                "LIMIT -1 OFFSET ?) RETURNING id", (self.keep_replicas,)).fetchall()]
            # Ended tasks, as ended replicas: by age, then the keep_replicas most recent
            # (their ids, POOL/N, told with the replicas': their logs go with them).
            pruned += [row[0] for row in conn.execute(
                "DELETE FROM tasks WHERE retire_key IS NOT NULL AND retire_key < ? RETURNING id", (cut,)).fetchall()]
            pruned += [row[0] for row in conn.execute(
                "DELETE FROM tasks WHERE id IN (SELECT id FROM tasks WHERE retire_key IS NOT NULL "
                "ORDER BY retire_key DESC, id DESC LIMIT -1 OFFSET ?) RETURNING id", (self.keep_replicas,)).fetchall()]
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise
        self._since_prune = self._retired_since_prune = 0
        self._last_prune = time.monotonic()
        # Freed pages are reused by new rows; hand them back to the file system only when a
        # large share of the file is free (e.g. after retention was lowered), a bounded amount.
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        if free >= _VACUUM_MIN_FREE_PAGES:
            total = conn.execute("PRAGMA page_count").fetchone()[0]
            if free * 4 >= total:
                # executescript steps the pragma to completion; execute() would step it once
                # and free a single page.
                conn.executescript(f"PRAGMA incremental_vacuum({min(free, _VACUUM_MAX_PAGES)})")
        return pruned

    # ------------------------------------------------------------------ read side
    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        conn = self._reader()
        if conn is None:
            return []
        try:
            # fetchall: never leave a statement (a read transaction) open, it would pin the WAL.
            return conn.execute(sql, tuple(args)).fetchall()
        except sqlite3.Error as e:
            raise self._sql_error(e, "reading") from e

    @staticmethod
    def _replica_dict(row: tuple[Any, ...]) -> dict[str, Any]:
        d = dict(zip(REPLICA_COLS, row))
        extra = row[10]
        if extra:
            for k, v in loads(extra).items():
                d.setdefault(k, v)
        return d

    def pools(self) -> list[PoolRow]:
        """[{"name", "desired", "spec", "next_n"}] ordered by name (committed state)."""
        return [{"name": name, "desired": desired, "spec": loads(spec), "next_n": next_n}
                for name, spec, desired, next_n in
                self._rows("SELECT name, spec, desired, next_n FROM pools ORDER BY name")]

    def replicas(self, include_terminal: bool = False) -> list[dict[str, Any]]:
        """Replica records ordered by (pool, n); live ones only unless include_terminal."""
        sql = SQL_SELECT_REPLICAS
        if not include_terminal:
            sql += " WHERE retire_key IS NULL"
        return [self._replica_dict(r) for r in self._rows(sql + " ORDER BY pool, n")]

    def load(self) -> tuple[list[PoolRow], list[dict[str, Any]]]:
        """(pools, live replicas) for recovery at daemon start.

        Each pool's next_n is at least one more than any replica n ever stored for it."""
        pools = self.pools()
        # Belt and braces for next_n (the pools row already holds the max): also count the
        # replicas still present.
        top = dict(self._rows("SELECT pool, max(n) FROM replicas GROUP BY pool"))
        for p in pools:
            m = top.get(p["name"])
            if m is not None and m + 1 > p["next_n"]:
                p["next_n"] = m + 1
        return pools, self.replicas(include_terminal=False)

    def tasks(self, *, pool: str | None = None, include_terminal: bool = False, task_id: str | None = None,
              key: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Task records (committed state) in (pool, n) order: unfinished ones, with ended
        ones too if ``include_terminal``; one with ``task_id``; those of ``key`` (with
        ``pool``: the one it names)."""
        version = self._rows("PRAGMA user_version")
        version_n = int(version[0][0]) if version else SCHEMA_VERSION
        where, args = [], []
        if key is not None:
            if version_n < TASK_COLS_SINCE["key"]:
                return []  # a file from before keys: none has one
            where.append("key = ?")
            args.append(key)
        if task_id is not None:
            where.append("id = ?")
            args.append(task_id)
        elif not include_terminal and key is None:
            where.append("retire_key IS NULL")
        if pool is not None:
            where.append("pool = ?")
            args.append(pool)
        # A file not migrated yet (read with no daemon of ours) lacks the newer columns.
        select = SQL_SELECT_TASKS if version_n >= SCHEMA_VERSION else sql_select_tasks(version_n)
        sql = select + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY pool, n"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        rows = [dict(zip(TASK_COLS, row)) for row in self._rows(sql, args)]
        for row in rows:
            for name in TASK_JSON:
                if isinstance(row[name], str):
                    row[name] = loads(row[name])
        return rows

    def task_ids(self) -> set[str]:
        """The ids of every task stored (unfinished and retained ended ones)."""
        return {row[0] for row in self._rows("SELECT id FROM tasks")}

    def task_numbers(self) -> dict[str, int]:
        """Each pool's highest task number ever stored (ids are never reused)."""
        return dict(self._rows("SELECT pool, max(n) FROM tasks GROUP BY pool"))

    def events(self, *, replica: str | None = None, since: float | None = None,
               after_seq: int = 0, limit: int | None = None, newest: bool = False) -> list[EventRow]:
        """Journal entries {"seq", "ts", "kind", "replica", "data"} ordered by seq.

        after_seq: only seq > after_seq (for tailing); since: only ts >= since; limit: the
        first that many (a page, for tailing), or with ``newest`` the last that many;
        data is {} for events appended without data."""
        sql = "SELECT seq, ts, kind, replica, data FROM events WHERE seq > ?"
        args: list[Any] = [after_seq]
        if replica is not None:
            sql += " AND replica = ?"
            args.append(replica)
        if since is not None:
            sql += " AND ts >= ?"
            args.append(since)
        sql += " ORDER BY seq DESC" if newest else " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        rows = [self._event_dict(row) for row in self._rows(sql, args)]
        return rows[::-1] if newest else rows

    @staticmethod
    def _event_dict(row: tuple[Any, ...]) -> EventRow:
        seq, ts, kind, rep, data = row
        return {"seq": seq, "ts": ts, "kind": kind, "replica": rep, "data": loads(data) if data is not None else {}}

    def last_event(self, kind: str) -> EventRow | None:
        """The newest committed event of ``kind`` (shaped as in ``events``), or None."""
        rows = self._rows("SELECT seq, ts, kind, replica, data FROM events WHERE kind = ? "
                          "ORDER BY seq DESC LIMIT 1", (kind,))
        return self._event_dict(rows[0]) if rows else None

    def last_seq(self) -> int:
        """Highest event seq ever committed (0 if none): where `events --follow` starts."""
        rows = self._rows("SELECT seq FROM sqlite_sequence WHERE name = 'events'")
        return int(rows[0][0]) if rows else 0

    def integrity_ok(self) -> bool:
        """True when PRAGMA integrity_check reports ok (a full, slow check)."""
        try:
            return self._rows("PRAGMA integrity_check") in ([("ok",)], [])
        except StoreError:
            return False

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Commit anything still buffered, then close. Idempotent.

        If that final commit fails, the connection is closed anyway and StoreError is raised
        (the buffered rows are lost and the caller should know)."""
        conn, self._conn = self._conn, None
        if conn is None:
            self._closed = True
            return
        try:
            if not self.readonly and self.pending:
                self._conn = conn
                self.commit()
        finally:
            self._conn = None
            self._closed = True
            conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.path!r}, readonly={self.readonly})"


def _migrate(conn: sqlite3.Connection, stmt: str) -> None:
    """One statement of a migration; an ``ALTER TABLE T ADD COLUMN C`` whose column is there
    already (a file a development build migrated part of the way) is skipped."""
    words = stmt.split()
    if words[:5] == ["ALTER", "TABLE", words[2], "ADD", "COLUMN"] and len(words) > 5:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({words[2]})")}
        if words[5] in have:
            return
    conn.execute(stmt)
