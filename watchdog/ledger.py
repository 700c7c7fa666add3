"""The feed protocol: how the parent tells the watchdog which processes to clean up.

The parent writes newline-terminated ASCII/UTF-8 lines to a pipe; the watchdog keeps the
resulting set of entries (its *ledger*):

``A <pid> <start> <pgid|-> <kind> [label]``
    Add a process identified by ``(pid, start)`` (start = clock ticks since boot, see
    ``identity.start_time``). ``kind`` is ``worker`` (on clean-up, kill its process group
    ``pgid`` and all its descendants) or ``process`` (kill just that process and its
    descendants: e.g. a Manager server sharing the parent's group). ``-`` means no
    process group. The label is free text to the end of the line, for the report.
``D <pid>``
    Remove: the parent reaped it, the pid is no longer ours.
``G <path>``
    Add a replica cgroup (an absolute directory under the cgroup2 mount) to kill whole on
    clean-up. The path is one field: space, tab, newline and backslash are written as
    mountinfo-style octal escapes (``\040``, ``\011``, ``\012``, ``\134``).
``U <path>``
    Remove that cgroup: the parent removed it (or it is no longer ours to kill).
``Q``
    Quit quietly: a clean shutdown, not a crash. The watchdog exits without sweeping.

Lines may arrive split across reads (the pipe is non-blocking and a write may be partial),
so ``Ledger.feed`` buffers an incomplete last line. A malformed line is counted in
``Ledger.errors`` and skipped: a bad line must never take the watchdog down.
"""

from __future__ import annotations

from typing import NamedTuple

from .cgroup import _escape, _unescape

__all__ = [
    "Entry", "Ledger", "encode_add", "encode_remove", "encode_add_cgroup", "encode_remove_cgroup", "ENCODE_QUIT", "KINDS",
]  # fmt: skip

KINDS = ("worker", "process")
ENCODE_QUIT = b"Q\n"


class Entry(NamedTuple):
    """One registered process."""

    pid: int
    start: int
    pgid: int | None
    kind: str
    label: str = ""


def encode_add(pid: int, start: int, pgid: int | None, kind: str = "worker", label: str = "") -> bytes:
    """The ``A`` line registering ``(pid, start)``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    # A label is the rest of the line: newlines would start a new command.
    label = " ".join(label.split())
    group = "-" if pgid is None else str(int(pgid))
    line = f"A {int(pid)} {int(start)} {group} {kind}"
    if label:
        line += " " + label
    return line.encode("utf-8") + b"\n"


def encode_remove(pid: int) -> bytes:
    """The ``D`` line forgetting ``pid``."""
    return f"D {int(pid)}\n".encode("ascii")


def encode_add_cgroup(path: str) -> bytes:
    """The ``G`` line registering the cgroup directory ``path``."""
    return _encode_cgroup("G", path)


def encode_remove_cgroup(path: str) -> bytes:
    """The ``U`` line forgetting the cgroup directory ``path``."""
    return _encode_cgroup("U", path)


def _encode_cgroup(op: str, path: str) -> bytes:
    if not path.startswith("/"):
        raise ValueError(f"a cgroup must be an absolute path, not {path!r}")
    return f"{op} {_escape(path)}\n".encode("utf-8")


class Ledger:
    """Incremental parser of the feed, and the set of entries it describes."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.cgroups: dict[str, None] = {}  # an ordered set of cgroup directories
        self.quit_requested = False
        self.errors = 0  # malformed lines skipped
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Consume bytes read from the pipe; complete lines take effect immediately."""
        if not data:
            return
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._apply(line)

    def _apply(self, raw: bytes) -> None:
        parts = raw.decode("utf-8", "replace").split(None, 5)
        if not parts:
            return  # blank line: tolerated
        op = parts[0]
        if op == "Q" and len(parts) == 1:
            self.quit_requested = True
            return
        if op == "D" and len(parts) == 2 and _is_pid(parts[1]):
            self.entries.pop(int(parts[1]), None)
            return
        if op in ("G", "U") and len(parts) == 2 and (path := _unescape(parts[1])).startswith("/"):
            if op == "G":
                self.cgroups[path] = None
            else:
                self.cgroups.pop(path, None)
            return
        if op == "A" and len(parts) >= 5:
            entry = _parse_add(parts)
            if entry is not None:
                self.entries[entry.pid] = entry
                return
        self.errors += 1


def _is_pid(text: str) -> bool:
    # pid 0 and 1 (init) are never valid targets; refusing them here is one guard of several.
    return text.isdigit() and int(text) > 1


def _parse_add(parts: list[str]) -> Entry | None:
    _, pid, start, pgid, kind, *rest = parts
    if not (_is_pid(pid) and start.isdigit() and (pgid == "-" or _is_pid(pgid)) and kind in KINDS):
        return None
    return Entry(int(pid), int(start), None if pgid == "-" else int(pgid), kind, rest[0] if rest else "")
