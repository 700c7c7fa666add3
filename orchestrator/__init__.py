"""orchestrator: keeps pools of worker processes alive, and leaves no orphan behind.

The public names; everything else is private. How the house is built, module by module:
docs/design.md.
"""

from .version import __version__
from .api import Orchestrator
from .errors import (
    ChannelError,
    DaemonNotRunning,
    InvalidSpec,
    OrchestratorError,
    ShutdownRequested,
    ShuttingDown,
    UnknownReplica,
)
from .channel import Client
from .spec import WorkerSpec
from .states import TERMINAL, TRANSITIONS, IllegalTransition, Replica, ReplicaState
from .worker import Terminated

__all__ = [
    "__version__",
    "Orchestrator",
    "Client",
    "WorkerSpec",
    "ReplicaState",
    "Replica",
    "TERMINAL",
    "TRANSITIONS",
    "IllegalTransition",
    "OrchestratorError",
    "InvalidSpec",
    "UnknownReplica",
    "ShuttingDown",
    "DaemonNotRunning",
    "ChannelError",
    "ShutdownRequested",
    "Terminated",
]
