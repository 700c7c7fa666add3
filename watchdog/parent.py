"""Event-driven detection of the parent's death.

The watchdog is told its parent's identity ``(pid, start)`` on the command line. At
start-up ``ParentWatch`` opens a pidfd for that pid and verifies the start time *after*
opening (see ``identity.open_verified``). If the pid is gone, or now belongs to another
process, the parent has already died: ``dead_at_start`` is True.

Otherwise the pidfd becomes readable (POLLIN) the moment the parent exits, whatever the
cause (SIGKILL, OOM kill, crash), even before it is reaped. ``fileno()`` goes into the
watchdog's single blocking ``poll``, so an idle watchdog never wakes up.

Fallbacks:

* The feed pipe reaching EOF (the parent's write end closed on exit) is handled by the
  caller; it is only a hint because forked workers may inherit the write end.
* Without ``os.pidfd_open`` (old kernel or platform), ``fileno()`` is -1 and
  ``poll_timeout_ms`` is 100: the caller polls ``is_dead()`` every 0.1 s, which checks the
  identity in /proc (the same ``(pid, start)`` rule; psutil would add nothing here).
"""

from __future__ import annotations

import errno
import os
import select

from .identity import is_alive, start_time

__all__ = ["ParentWatch"]

FALLBACK_POLL_MS = 100


class ParentWatch:
    """Watches one process, identified by ``(pid, start)``, for its exit."""

    def __init__(self, pid: int, start: int) -> None:
        self.pid = pid
        self.start = start
        self.dead_at_start = False
        self._fd = -1
        # None: block forever in poll (pidfd mode); an int: the fallback's poll period.
        self.poll_timeout_ms: int | None = None
        if not hasattr(os, "pidfd_open"):
            self._use_fallback()
            return
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.dead_at_start = True
            return
        except OSError as exc:
            # ENOSYS: kernel without pidfd_open; EPERM: a seccomp filter refuses it.
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            self._use_fallback()
            return
        if start_time(pid) != start:
            # The pid is gone or was reused by someone else: our parent died before we
            # could watch it.
            self.dead_at_start = True
            self.close()

    def _use_fallback(self) -> None:
        self.poll_timeout_ms = FALLBACK_POLL_MS
        self.dead_at_start = not is_alive(self.pid, self.start)

    def fileno(self) -> int:
        """The pidfd (readable once the parent exited), or -1 in the polling fallback."""
        return self._fd

    def is_dead(self) -> bool:
        """Non-blocking check: has the parent exited?"""
        if self.dead_at_start:
            return True
        if self._fd < 0:
            return not is_alive(self.pid, self.start)
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
