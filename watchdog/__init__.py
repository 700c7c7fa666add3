"""The orchestrator's watchdog: a separate process that cleans up if the daemon dies.

The daemon (its parent) starts it through ``WatchdogLink.start()`` and feeds it, over a
pipe, the identity ``(pid, start_time)`` of every worker it launches (``add``) or reaps
(``remove``), and the replica cgroups it makes (``add_cgroup``) or removes
(``remove_cgroup``). The watchdog blocks on a pidfd of its parent and wakes up only when the
parent dies (SIGKILL, OOM, crash). It then kills every registered cgroup whole
(``cgroup.kill``) and removes it, kills every registered worker, their process groups and
descendants, and auxiliary processes such as a Manager server, removes stale runtime
files, writes ``<state_dir>/watchdog-report.json`` and exits. On a clean shutdown the
parent calls ``stop()`` and the watchdog exits quietly.

Modules: ``identity`` (who a pid is: /proc and pidfds), ``ledger`` (the feed protocol),
``parent`` (detecting the parent's death), ``reaper`` (the clean-up), ``link`` (the
parent's side), ``cgroup`` (cgroup v2 containment primitives, also the daemon's),
``__main__`` (the process). This package never imports ``orchestrator``.
"""

from .identity import is_alive, open_verified, start_time
from .link import WatchdogLink

__all__ = ["WatchdogLink", "start_time", "open_verified", "is_alive"]
