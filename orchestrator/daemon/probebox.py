"""Where a replica's exec probes run and write: its ``ProbeBox`` (exec probe containment).

Run by the daemon, in its loop: probes.py's exec attempts ask the box of their replica
where to run (``prepare``), and tell it when a process started, ended and was reaped; the
box asks the replica's containment (containment.py) for a cgroup, the watchdog to record
what runs, and the log capture for the ``.probe`` stream.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from watchdog.link import WatchdogLink

    from .containment import Cgroups, ProcessGroups
    from .logcapture import LogCapture, Stream

log = logging.getLogger("orchestrator")


class ProbeBox:
    """Where one replica's exec probes run and write, made by its first exec attempt.

    * containment: with cgroups, every attempt runs in the cgroup ``replicas/<id>.probe``
      (joined by a ``/bin/sh`` wrapper before the probe's own command runs: posix_spawn
      cannot place a child in a cgroup), killed whole when the attempt ends, times out or
      is cancelled, so a background child, even one that left the probe's session, goes
      with it. The cgroup is registered with the watchdog and lies under ``replicas/``,
      so a dead daemon's watchdog, and the next start's recovery, kill it whole like a
      replica's. With process groups, each attempt's group is killed as before, and the
      attempt is recorded in the watchdog's ledger (``worker`` with its group) while it
      runs;
    * output: the probe's stdout and stderr go to one more captured stream of the replica,
      ``logs/<id>.probe``, rotated like its ``.out`` and ``.err`` (``LogCapture``); without
      a capture, to /dev/null. Never to the daemon's own log.

    ``close()`` (the replica ended) kills and removes the cgroup and finishes the stream."""

    def __init__(self, replica_id: str, containment: Cgroups | ProcessGroups, watchdog: WatchdogLink | None = None,
                 capture: LogCapture | None = None) -> None:
        self.replica_id = replica_id
        self.cgroup: str | None = None
        self.closed = False
        self._containment, self._watchdog, self._capture = containment, watchdog, capture
        self._stream: Stream | None = None
        self._recorded: set[int] = set()

    @property
    def _cgroups(self) -> Cgroups:
        """The containment where a probe cgroup is made or was: only ``Cgroups`` has a path."""
        return cast("Cgroups", self._containment)

    def prepare(self) -> tuple[str | None, int | None]:
        """(cgroup dir to join or None, fd for stdout and stderr or None) for an attempt
        about to start. OSError, CgroupUnavailable or ValueError: it cannot start."""
        if self.closed:
            raise OSError(errno.ESHUTDOWN, "the replica has ended")
        if self.cgroup is None and getattr(self._containment, "path", None) is not None:
            self.cgroup = self._cgroups.prepare_probe(self.replica_id)
            if self._watchdog is not None:
                self._watchdog.add_cgroup(self.cgroup)
        if self._stream is None and self._capture is not None:
            self._stream = self._capture.open_stream(self.replica_id, "probe")
        return self.cgroup, self._stream.w if self._stream is not None else None

    def spawned(self, pid: int) -> None:
        if self.cgroup is None and self._watchdog is not None:
            from watchdog.identity import start_time

            start = start_time(pid)  # our unreaped child: the number is pinned
            if start is not None:
                self._watchdog.add(pid, start, pid, "worker", f"probe of {self.replica_id}")
                self._recorded.add(pid)

    def ended(self) -> None:
        """An attempt ended (exited, timed out, cancelled): what it left goes."""
        if self.cgroup is not None and not self.closed:
            self._cgroups.kill(self.cgroup)

    def reaped(self, pid: int) -> None:
        if pid in self._recorded:
            self._recorded.discard(pid)
            if self._watchdog is not None:  # it is: only a watchdog's box records one
                self._watchdog.remove(pid)

    def close(self) -> None:
        """The replica ended: kill and (once empty) remove the cgroup; finish the output."""
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            self._stream.finish()
            self._stream = None
        path = self.cgroup
        if path is None:
            return
        self._cgroups.kill(path)

        def removed(empty: bool) -> None:
            status = self._cgroups.remove(path)
            if status in ("removed", "missing"):
                if self._watchdog is not None:
                    self._watchdog.remove_cgroup(path)
            else:  # still registered: the watchdog or a clean stop gets it
                log.error("cannot remove the probe cgroup %s: %s", path, status)

        self._cgroups.watch_empty(path, removed)
