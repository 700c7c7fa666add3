"""What ``state.db`` holds, row by row: the schema (``PRAGMA user_version`` = ``SCHEMA_VERSION``),
the SQL statements ``store.Store`` prepares, and the compact JSON its rows and events carry.
Shared (the CLI reads the store with the daemon down); the why of each table is in
``store.py``'s docstring.
"""

from __future__ import annotations

import json
import json.encoder as _json_encoder
from typing import Any, Callable, Iterable

SCHEMA_VERSION = 3

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS pools (
        name    TEXT PRIMARY KEY,
        spec    TEXT NOT NULL,
        desired INTEGER NOT NULL,
        next_n  INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS replicas (
        id         TEXT PRIMARY KEY,
        pool       TEXT NOT NULL,
        n          INTEGER NOT NULL,
        state      TEXT NOT NULL,
        pid        INTEGER,
        start_time INTEGER,
        exit_code  INTEGER,
        reason     TEXT,
        created_at REAL,
        ended_at   REAL,
        retire_key REAL,
        extra      TEXT
    ) WITHOUT ROWID""",
    # Partial: live replicas (retire_key NULL) are not in it, so retention never sees them.
    """CREATE INDEX IF NOT EXISTS replicas_retire ON replicas(retire_key)
        WHERE retire_key IS NOT NULL""",
    """CREATE TABLE IF NOT EXISTS events (
        seq     INTEGER PRIMARY KEY AUTOINCREMENT,
        ts      REAL NOT NULL,
        kind    TEXT NOT NULL,
        replica TEXT,
        data    TEXT
    )""",
    # No index on events.replica or events.ts: each would cost every insert (the hot path)
    # while `events --replica` / `--since` are rare CLI reads over <= keep_events rows.
    # Tasks of executor pools: the payload is kept until the task ends (a queued task runs
    # after a restart), the result once it has; both opaque bytes the daemon never loads.
    """CREATE TABLE IF NOT EXISTS tasks (
        id         TEXT PRIMARY KEY,
        pool       TEXT NOT NULL,
        n          INTEGER NOT NULL,
        state      TEXT NOT NULL,
        attempts   INTEGER NOT NULL,
        retries    INTEGER NOT NULL,
        timeout    REAL,
        worker     TEXT,
        queued_at  REAL,
        started_at REAL,
        ended_at   REAL,
        reason     TEXT,
        payload    BLOB,
        kind       TEXT,
        result     BLOB,
        retire_key REAL,
        priority   INTEGER,
        tenant     TEXT,
        key        TEXT,
        deadline    REAL,
        backoff_min REAL,
        backoff_max REAL,
        waits       INTEGER,
        wait_until  REAL,
        wait_reason TEXT,
        figures    TEXT
    ) WITHOUT ROWID""",
    """CREATE INDEX IF NOT EXISTS tasks_retire ON tasks(retire_key) WHERE retire_key IS NOT NULL""",
)

# What brings a file of version N (the key) to N + 1, in the writer's schema transaction.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE tasks ADD COLUMN priority INTEGER",  # a task's queue place (its executor's options())
        "ALTER TABLE tasks ADD COLUMN tenant TEXT"),
    2: (  # one ALTER a line: each concern adds its own
        "ALTER TABLE tasks ADD COLUMN key TEXT",  # its submitter's name for it (options(key=))
        # a task's deadline and retry_on backoff, and a WAITING task's time and reason (daemon/taskwait.py)
        "ALTER TABLE tasks ADD COLUMN deadline REAL",
        "ALTER TABLE tasks ADD COLUMN backoff_min REAL",
        "ALTER TABLE tasks ADD COLUMN backoff_max REAL",
        "ALTER TABLE tasks ADD COLUMN waits INTEGER",
        "ALTER TABLE tasks ADD COLUMN wait_until REAL",
        "ALTER TABLE tasks ADD COLUMN wait_reason TEXT",
        "ALTER TABLE tasks ADD COLUMN figures TEXT",  # what a task took in its worker (JSON: taskwire.Figures)
    ),
}
# Run after the migrations (they may need a column a migration adds), on every open.
INDEXES = (
    # A keyed submit whose task is no longer in memory finds it here (its pool's, by key).
    "CREATE INDEX IF NOT EXISTS tasks_key ON tasks(pool, key) WHERE key IS NOT NULL",
)

# Constant SQL strings: sqlite3 caches the prepared statement per string.
SQL_POOL = (
    "INSERT INTO pools(name, spec, desired, next_n) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(name) DO UPDATE SET spec = excluded.spec, desired = excluded.desired, "
    "next_n = max(pools.next_n, excluded.next_n)"
)
# A replica saved for a pool never saved still reserves its id: a placeholder pool row
# (spec {}, desired 0) holds next_n. The control loop normally saves the pool first.
SQL_BUMP = (
    "INSERT INTO pools(name, spec, desired, next_n) VALUES (?, '{}', 0, ?) "
    "ON CONFLICT(name) DO UPDATE SET next_n = max(pools.next_n, excluded.next_n)"
)
SQL_REPLICA = (
    "INSERT INTO replicas(id, pool, n, state, pid, start_time, exit_code, reason, created_at, "
    "ended_at, retire_key, extra) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET pool = excluded.pool, n = excluded.n, state = excluded.state, "
    "pid = excluded.pid, start_time = excluded.start_time, exit_code = excluded.exit_code, "
    "reason = excluded.reason, created_at = excluded.created_at, ended_at = excluded.ended_at, "
    "retire_key = excluded.retire_key, extra = excluded.extra"
)
SQL_EVENT = "INSERT INTO events(ts, kind, replica, data) VALUES (?, ?, ?, ?)"

TASK_COLS = ("id", "pool", "n", "state", "attempts", "retries", "timeout", "worker", "queued_at",
             "started_at", "ended_at", "reason", "payload", "kind", "result", "priority", "tenant", "key",
             "deadline", "backoff_min", "backoff_max", "waits", "wait_until", "wait_reason", "figures", "retire_key")
TASK_JSON = frozenset({"figures"})  # columns of TASK_COLS that hold a record's object as JSON text
# The schema version that added each column of TASK_COLS after the first: a file of an
# earlier version, read before a daemon of this version has opened (migrated) it, has NULL.
TASK_COLS_SINCE = {"priority": 2, "tenant": 2, "key": 3, "deadline": 3, "backoff_min": 3, "backoff_max": 3,
                   "waits": 3, "wait_until": 3, "wait_reason": 3, "figures": 3}
SQL_TASK = (
    "INSERT OR REPLACE INTO tasks(" + ", ".join(TASK_COLS) + ") VALUES (" + ", ".join("?" * len(TASK_COLS)) + ")"
)
SQL_SELECT_TASKS = "SELECT " + ", ".join(TASK_COLS) + " FROM tasks"


def sql_select_tasks(version: int) -> str:
    """SQL_SELECT_TASKS for a file of schema ``version`` (not migrated yet)."""
    return "SELECT " + ", ".join(c if TASK_COLS_SINCE.get(c, 1) <= version else "NULL" for c in TASK_COLS) + \
        " FROM tasks"


REPLICA_COLS = ("id", "pool", "n", "state", "pid", "start_time", "exit_code", "reason",
                 "created_at", "ended_at")
REPLICA_KEYS = frozenset(REPLICA_COLS)
SQL_SELECT_REPLICAS = "SELECT " + ", ".join(REPLICA_COLS) + ", extra FROM replicas"

# JSON encoding is on the hot path (one per event). json.dumps builds a new C encoder per
# call (~1.5 us); building it once and calling it directly costs ~0.6 us. Compact separators
# keep rows small. default=str: a journal entry carrying an odd value (a Path, an exception)
# must not crash the control loop; it is stored as text. No circular-reference check
# (markers=None): data is plain data by contract. The C encoder is an undocumented name of
# json.encoder (typeshed does not declare it), hence the getattr.
_c_make_encoder: Callable[..., Any] | None = getattr(_json_encoder, "c_make_encoder", None)
dumps: Callable[[Any], str]
if _c_make_encoder is not None:
    _c_encode = _c_make_encoder(
        None, str, _json_encoder.encode_basestring_ascii, None, ":", ",", False, False, True)

    def dumps(obj: Any, _join: Callable[[Iterable[str]], str] = "".join, _enc: Any = _c_encode) -> str:
        return _join(_enc(obj, 0))
else:  # pragma: no cover - interpreters without the C accelerator
    dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode
loads = json.loads
