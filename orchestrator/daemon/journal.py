"""What the control loop writes to the store, in the store's shapes, in one place.

The engine says what happened (a replica changed state, a pool changed, a command was
applied) and this module says how that is recorded: the replica's row, the ``transition``
event, the pool's row, the ``command`` event. ``commit()`` makes one turn durable and turns
a failing disk into a message instead of an exception: the replicas still need supervising.

A commit that fails (a full disk, an I/O error) is a *journal fault*, not a failed command:
what the turn buffered stays buffered (the store keeps it) and goes in with the first commit
that succeeds, in one transaction, so the journal catches up whole and in order. ``fault``
says why while it lasts (``health`` and ``status`` show it), and two ``journal`` events
frame it in the journal itself: ``{"fault": why}`` where it began (buffered like the rest,
it lands with what it held back) and ``{"saved_again": true, "fault", "since", "for"}``
once it is over.
Recovery writes its LOST records through the same functions, so a recovered transition
has the same shape as any other. What the store's retention forgets (ended replicas' ids) is
passed on to ``forgotten``: the daemon removes their log files.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, TypedDict

from ..states import Replica, ReplicaState
from ..store import Store, StoreError


class JournalFault(TypedDict):
    """The journal's fault in force, as ``health`` and ``status`` report it."""

    fault: str  # why the last commit failed
    since: float | None  # since when (wall clock)
    unsaved: int  # rows buffered, waiting to be written

log = logging.getLogger("orchestrator")


class Journal:
    """The engine's writes to ``store`` (a Store, or anything with its write methods);
    with no store every call is a no-op."""

    def __init__(self, store: Store | None, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        # Set by the daemon: how to open a fresh store at the same path, and how to write
        # the whole table into it, for when state.db is deleted under a running daemon.
        self.reopen: Callable[[], Store] | None = None
        self.rebuild: Callable[[], None] | None = None
        # Set by the daemon: called (in the loop's turn) with the ids of ended replicas whose
        # records retention deleted; their log files go with them.
        self.forgotten: Callable[[list[str]], None] | None = None
        self._file_id = self._current_file_id()
        self._watch(store)
        # The journal fault in force: why the last commit failed, since when (wall clock);
        # None while commits succeed.
        self.fault: str | None = None
        self.fault_since: float | None = None

    def _watch(self, store: Store | None) -> None:
        if store is not None and hasattr(store, "on_pruned"):  # a Store; a test's stand-in may not prune
            store.on_pruned = self._pruned

    def _pruned(self, ids: list[str]) -> None:
        if self.forgotten is not None:
            self.forgotten(ids)

    def _current_file_id(self) -> tuple[int, int] | None:
        file_id = getattr(self.store, "file_id", None)
        return file_id() if file_id is not None else None

    def transition(self, rep: Replica, old: ReplicaState | None) -> None:
        """The replica's row and a ``transition`` event (``old`` None: it was just made)."""
        if self.store is None:
            return
        self.store.save_replica(rep.to_record())
        self.store.append_event(
            "transition", replica=rep.id, ts=self.clock(),
            data={"from": old.value if old else None, "to": rep.state.value, "reason": rep.reason},
        )

    def replica(self, rep: Replica) -> None:
        """The replica's row only (its state did not change: e.g. its pid is gone)."""
        if self.store is not None:
            self.store.save_replica(rep.to_record())

    def pool(self, name: str, spec: dict[str, Any], desired: int, next_n: int) -> None:
        if self.store is not None:
            self.store.save_pool(name, spec, desired, next_n)

    def command(self, op: Any, cmd_id: Any, error: str | None) -> None:
        """A ``command`` event: ``op`` and ``cmd_id`` as the caller sent them (unchecked JSON)."""
        if self.store is None:
            return
        data: dict[str, Any] = {"op": op, "cmd_id": cmd_id, "ok": error is None}
        if error is not None:
            data["error"] = error
        self.store.append_event("command", data=data, ts=self.clock())

    def event(self, kind: str, data: Mapping[str, Any]) -> None:
        if self.store is not None:
            self.store.append_event(kind, data=data, ts=self.clock())

    @property
    def pending(self) -> bool:
        return self.store is not None and bool(self.store.pending)

    @property
    def unsaved(self) -> int:
        """Rows buffered and not committed yet (what a fault holds back)."""
        return int(self.store.pending) if self.store is not None else 0

    def fault_info(self) -> JournalFault | None:
        """The fault in force, for ``health`` and ``status``; None if there is none."""
        if self.fault is None:
            return None
        return {"fault": self.fault, "since": self.fault_since, "unsaved": self.unsaved}

    def commit(self) -> str | None:
        """Commit what this turn buffered; None on success, else why it failed (the batch
        stays buffered and the next commit retries it: see the module docstring)."""
        if self.store is None:
            return None
        if self.reopen is not None and self.store.pending and self._current_file_id() != self._file_id:
            self._recreate(self.reopen)
        try:
            self.store.commit()
        except StoreError as err:
            if self.fault is None:
                self.fault_since = self.clock()
                self.event("journal", {"fault": str(err)})
            self.fault = str(err)
            return self.fault
        if self.fault is not None:
            since = self.fault_since if self.fault_since is not None else self.clock()
            log.warning("the state is saved again after %.1f s (%s)", self.clock() - since, self.fault)
            self.event("journal", {"saved_again": True, "fault": self.fault, "since": since,
                                   "for": round(self.clock() - since, 3)})
            self.fault = self.fault_since = None
            try:
                self.store.commit()
            except StoreError:
                pass  # that event waits for the next commit, with whatever comes next
        return None

    def _recreate(self, reopen: Callable[[], Store]) -> None:
        """state.db was deleted or replaced: writing on into the unlinked file would lose
        everything at the next start. Open a new one with ``reopen`` and write the table
        from memory."""
        try:
            fresh = reopen()
        except StoreError as err:
            log.error("state.db vanished and cannot be recreated (will retry): %s", err)
            return
        log.error("%s was deleted or replaced while the daemon ran: recreated from memory", fresh.path)
        old, self.store = self.store, fresh
        self._watch(fresh)
        self._file_id = self._current_file_id()
        try:
            if old is not None:  # it is not: commit() calls this only with a store
                old.hand_over(fresh)
        except StoreError:
            pass  # the old file is gone; what it buffered is in the new one already
        if self.rebuild is not None:
            self.rebuild()
        self.event("journal", {"recreated": True, "reason": "state.db vanished while running"})
