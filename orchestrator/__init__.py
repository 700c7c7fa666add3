"""orchestrator: keeps pools of worker processes alive, and leaves no orphan behind.

The public names; everything else is private. How the house is built, module by module:
docs/design.md.

Each name is imported on first use (PEP 562), so that ``import orchestrator`` costs
nothing: the spawner process and a worker that only wants ``Terminated`` or ``ready()``
load just what they use, not the daemon.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "__version__": "version",
    "Orchestrator": "daemon.embedded",
    "Client": "executor",  # the channel's Client with its door to a daemon's executor
    "WorkerSpec": "spec",
    "ReplicaState": "states",
    "Replica": "states",
    "TERMINAL": "states",
    "TRANSITIONS": "states",
    "IllegalTransition": "states",
    "OrchestratorError": "errors",
    "InvalidSpec": "errors",
    "NotFound": "errors",
    "UnknownReplica": "errors",
    "UnknownPool": "errors",
    "UnknownTask": "errors",
    "UnknownSession": "errors",
    "ShuttingDown": "errors",
    "DaemonNotRunning": "errors",
    "ChannelError": "errors",
    "UnsafeStateDir": "errors",
    "UnsafeFile": "errors",
    "ConfigError": "errors",
    "StoreError": "errors",
    "FrameTooLarge": "errors",
    "WaitTimeout": "errors",
    "InternalError": "errors",
    "SpawnerLost": "errors",
    "ShutdownRequested": "errors",
    "Terminated": "worker",
    "Executor": "executor",
    "Cancelled": "worker",
    "TaskTimeout": "worker",
    "Retry": "worker",
    "WorkerLost": "errors",
    "TaskInterrupted": "errors",
    "TaskTimeoutError": "errors",
    "RemoteTraceback": "taskfutures",
    "TaskState": "states",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    # Each as a re-export (``X as X``): __all__ is made from _HOMES, which a type checker
    # does not read, so this is how a user's mypy --strict sees these names as public.
    from .daemon.embedded import Orchestrator as Orchestrator
    from .errors import (
        ChannelError as ChannelError, ConfigError as ConfigError, DaemonNotRunning as DaemonNotRunning,
        FrameTooLarge as FrameTooLarge, InternalError as InternalError, InvalidSpec as InvalidSpec,
        NotFound as NotFound, OrchestratorError as OrchestratorError, ShutdownRequested as ShutdownRequested,
        ShuttingDown as ShuttingDown, SpawnerLost as SpawnerLost, StoreError as StoreError,
        TaskInterrupted as TaskInterrupted, TaskTimeoutError as TaskTimeoutError, UnknownPool as UnknownPool,
        UnknownReplica as UnknownReplica, UnknownSession as UnknownSession, UnknownTask as UnknownTask,
        UnsafeFile as UnsafeFile, UnsafeStateDir as UnsafeStateDir, WaitTimeout as WaitTimeout,
        WorkerLost as WorkerLost,
    )
    from .executor import Client as Client, Executor as Executor
    from .spec import WorkerSpec as WorkerSpec
    from .states import (
        TERMINAL as TERMINAL, TRANSITIONS as TRANSITIONS, IllegalTransition as IllegalTransition,
        Replica as Replica, ReplicaState as ReplicaState, TaskState as TaskState,
    )
    from .taskfutures import RemoteTraceback as RemoteTraceback
    from .version import __version__ as __version__
    from .worker import (
        Cancelled as Cancelled, Retry as Retry, TaskTimeout as TaskTimeout, Terminated as Terminated,
    )
