"""What goes wrong with ``state.db``, said in one line for the operator: SQLite's result
codes and the OS's errnos turned into the messages ``StoreError`` carries (store.py), and
the one question that tells a read-only or full state dir apart (a real file created in
it). Shared: the daemon's store and the CLI's read-only one both use it.
"""

from __future__ import annotations

import errno
import os
import sqlite3

# SQLite primary result codes (the low byte of an extended code).
_SQLITE_PERM, _SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY = 3, 5, 6, 8
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 10, 11, 13, 14, 26


def _code(e: sqlite3.Error) -> int:
    return (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF


def is_corruption(e: sqlite3.Error) -> bool:
    """A damaged file, as opposed to its surroundings."""
    # OperationalError ("unable to open", "readonly", "disk full") is a DatabaseError too:
    # only genuine corruption may send a file aside, never an environment problem.
    if _code(e) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    msg = str(e)
    return "malformed" in msg or "not a database" in msg


def dir_problem(state_dir: str, path: str) -> str | None:
    """Probe the state dir with a real file create: the only test that is right for root,
    read-only mounts, ACLs and full disks alike. Only called after something failed."""
    probe = os.path.join(state_dir, f".store-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"state dir {state_dir} is read-only"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"disk full writing {path}"
        if e.errno == errno.ENOENT:
            return f"state dir {state_dir} does not exist"
        return None
    try:
        os.write(fd, b"x" * 4096)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"disk full writing {path}"
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def os_message(e: OSError, doing: str, state_dir: str, path: str) -> str:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"state dir {state_dir} is read-only ({doing} {e.filename or path})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full {doing} {e.filename or path}"
    return f"{doing} {e.filename or path} failed: {e.strerror or e}"


def sql_message(e: sqlite3.Error, doing: str, state_dir: str, path: str, *, probe: bool) -> str:
    """``e`` in one line. ``probe``: a writer may look at the state dir (dir_problem) to
    tell a read-only or full one from a damaged file."""
    code = _code(e)
    if code == _SQLITE_FULL:
        return f"disk full writing {path}"
    if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return f"state db {path} is locked by another process ({e})"
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return f"state db {path} is corrupt ({e})"
    if code in (_SQLITE_READONLY, _SQLITE_CANTOPEN, _SQLITE_PERM, _SQLITE_IOERR):
        if probe:
            problem = dir_problem(state_dir, path)
            if problem:
                return problem
        if code == _SQLITE_READONLY:
            return f"state db {path} is read-only ({e})"
        if code == _SQLITE_IOERR:
            return f"I/O error {doing} {path} ({e})"
        return f"cannot open state db {path} ({e})"
    return f"{doing} state db {path} failed: {e}"
