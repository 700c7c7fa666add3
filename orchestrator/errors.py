"""Typed errors. Each says what happened in one line; the CLI prints ``str(err)``."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of every error this package raises on purpose. ``data``: what a failed
    command still has to say (e.g. the ids a launch made before its wait timed out)."""

    code = "error"
    data: object = None


class InvalidSpec(OrchestratorError, ValueError):
    """A worker spec or command argument that cannot be used (empty command, bad target)."""

    code = "invalid"


class UnknownReplica(OrchestratorError, KeyError):
    """A replica id this daemon has never had."""

    code = "unknown_replica"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown replica"


class ShuttingDown(OrchestratorError):
    """The orchestrator is shutting down and accepts no more commands."""

    code = "shutting_down"


class DaemonNotRunning(OrchestratorError):
    """No daemon runs for this state dir."""

    code = "not_running"


class ChannelError(OrchestratorError):
    """The command channel failed: timed out, refused, or the daemon went away."""

    code = "channel"


class ShutdownRequested(BaseException):
    """Raised in the control loop when SIGTERM (or SIGINT in the foreground) arrived.

    A BaseException like KeyboardInterrupt, so no ``except Exception`` swallows it, but a
    type of its own: a SIGTERM is an order to shut down cleanly, not a user's Ctrl-C.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"shutdown requested by signal {signum}")
        self.signum = signum


ERROR_TYPES: dict[str, type[OrchestratorError]] = {
    cls.code: cls
    for cls in (OrchestratorError, InvalidSpec, UnknownReplica, ShuttingDown, DaemonNotRunning, ChannelError)
}
