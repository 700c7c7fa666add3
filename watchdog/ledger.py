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
``Q``
    Quit quietly: a clean shutdown, not a crash. The watchdog exits without sweeping.

Lines may arrive split across reads (the pipe is non-blocking and a write may be partial),
so ``Ledger.feed`` buffers an incomplete last line. A malformed line is counted in
``Ledger.errors`` and skipped: a bad line must never take the watchdog down.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Entry", "Ledger", "encode_add", "encode_remove", "ENCODE_QUIT", "KINDS"]

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


class Ledger:
    """Incremental parser of the feed, and the set of entries it describes."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
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
