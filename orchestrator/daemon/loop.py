"""One builder of a control loop, for both processes that run one: the daemon (main.py)
and the embedded ``Orchestrator`` (embedded.py, which ``orchestrator.Executor`` runs).

    build_loop(config, os_api, store, link, containment, daemon=None | DaemonParts, logs=None | DIR)
        ├─► Reactor (reactor.py): the loop's clock, fds, timers and turn ends
        ├─► the replica and task log files (logcapture.py) on it, if ``daemon`` (or ``logs``)
        ├─► Engine (engine.py) on that reactor, with its Hooks given at construction:
        │   the daemon's commands, status, limits, log files, store reopening, turn ends
        └─► the watchdog child (children.py) that guards its replicas, if ``link``

Called in the caller's thread before the loop runs; what it builds is the loop thread's
from then on. What differs between the two processes is ``daemon`` alone: every other part
is made the same way, so that an embedded loop is the daemon's loop without the daemon's
additions. Starting the parts (the watchdog, the spawners, a restore) stays with each
caller: the daemon starts fresh or takes over from an upgrade, the embedded loop neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .children import WatchdogChild
from .containment import Cgroups, ProcessGroups
from .engine import Engine, EngineConfig, Handler, Hooks
from .limits import FdReserve, Limits
from .logcapture import LogCapture
from .osapi import OSApi
from .reactor import Reactor


@dataclass(frozen=True)
class DaemonParts:
    """What the daemon adds to its loop (engine.Hooks, and the log files of its replicas)."""

    logs: str | os.PathLike[str]  # the replicas' log files' dir
    log_max_bytes: int
    log_backups: int
    status: Callable[[], dict[str, Any]]
    commands: Mapping[str, Callable[[dict[str, Any]], Any]]  # health, metrics, reload
    deferred: Mapping[str, Handler]  # upgrade
    limits: Limits
    reserve: FdReserve  # the fds kept for the control plane: the watchdog's restart uses them
    reopen_store: Callable[[], Any]
    turn_end: tuple[Callable[[], None], ...] = field(default=())


@dataclass(eq=False)
class Loop:
    """A built control loop: its reactor, its engine, and the watchdog child (None without
    a watchdog) and replica log files (None outside the daemon) made for it."""

    reactor: Reactor
    engine: Engine
    watchdog: WatchdogChild | None
    log_capture: LogCapture | None


def build_loop(config: EngineConfig, *, os_api: OSApi, store: Any, link: Any,
               containment: Cgroups | ProcessGroups | None, daemon: DaemonParts | None = None,
               logs: str | os.PathLike[str] | None = None) -> Loop:
    """The loop of the daemon (``daemon`` given) or of an embedded Orchestrator (None).
    ``link``: the watchdog's ledger feed (watchdog.WatchdogLink), None for no watchdog;
    ``logs``: an embedded loop's dir for its replicas' and tasks' logs, as the daemon's."""
    reactor = Reactor(os_api.monotonic)
    hooks = None
    capture = None
    if daemon is not None:
        capture = LogCapture(daemon.logs, reactor, max_bytes=daemon.log_max_bytes, backups=daemon.log_backups)
        hooks = Hooks(status=daemon.status, commands=daemon.commands, deferred=daemon.deferred,
                      limits=daemon.limits, log_capture=capture, reopen_store=daemon.reopen_store,
                      turn_end=daemon.turn_end)
    elif logs is not None:
        capture = LogCapture(logs, reactor)
        hooks = Hooks(log_capture=capture)
    engine = Engine(config, os_api=os_api, store=store, watchdog=link, reactor=reactor,
                    containment=containment, hooks=hooks)
    watchdog = None
    if link is not None:
        watchdog = WatchdogChild(link, reactor, os_api, reserve=daemon.reserve if daemon is not None else None)
    return Loop(reactor, engine, watchdog, capture)
