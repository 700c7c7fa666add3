"""Typed errors. Each says what happened in one line; the CLI prints ``str(err)``.

Shared by every process (the CLI and clients, the daemon, the spawner): this module
imports nothing. The public ones are exported by ``orchestrator`` (see its ``__all__``).
"""

from __future__ import annotations

from typing import Any


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


class UnsafeStateDir(OrchestratorError):
    """A state dir, or a file in it, that someone else could control (or that is not what
    it should be): refused before anything in it is read or written."""

    code = "unsafe_state_dir"


class UnsafeFile(InvalidSpec):
    """A file read on an operator's behalf that is not a regular file of the reader (or
    root) that nobody else can write, or that is too large: refused before it is read."""


class ConfigError(OrchestratorError):
    """An invalid config file, in one line: ``FILE:LINE: KEY: what is wrong``.

    ``code`` is ``invalid``: refused by the daemon (``reload``), it reaches the client as an
    InvalidSpec with the same line, and the CLI exits 1."""

    code = "invalid"

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None,
                 key: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.source, self.line, self.key, self.problem = source, line, key, problem

    @classmethod
    def at(cls, source: str, line: int | None, key: str, problem: str) -> "ConfigError":
        where = f"{source}:{line}" if line else source
        return cls(f"{where}: {key}: {' '.join(problem.split())}", source=source, line=line, key=key,
                   problem=problem)


class StoreError(OrchestratorError):
    """The store cannot do its job; the message is one line meant for the operator."""

    code = "store"


class _TaskEnd(OrchestratorError):
    """A task of an ``Executor`` that ended without a result of its own: ``reason`` says
    why, ``task`` is its id."""

    def __init__(self, message: str, *, reason: str = "", task: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.task = reason, task

    def __reduce__(self) -> Any:
        return (_task_end, (type(self), str(self), self.reason, self.task))


def _task_end(cls: type[_TaskEnd], message: str, reason: str, task: str | None) -> _TaskEnd:
    return cls(message, reason=reason, task=task)


class WorkerLost(_TaskEnd):
    """An ``Executor`` task's worker died while it ran the task (a signal, an exit, the OOM
    killer, ``memory_max``, the daemon killed with kill -9), or the pool stopped replacing
    its workers before the task ran. ``reason`` says how (``killed by SIGKILL``,
    ``OOM-killed``, ``exited with 3``, ``memory limit 200 MiB exceeded``); ``task`` is the
    task's id."""

    code = "worker_lost"


def _worker_lost(message: str, reason: str, task: str | None) -> WorkerLost:
    """What pickles of an earlier version name (``WorkerLost.__reduce__`` then)."""
    return WorkerLost(message, reason=reason, task=task)


class TaskInterrupted(_TaskEnd):
    """An ``Executor`` task cut short because what runs its pool was stopped (``orchestrator
    stop``, or the embedded executor's control loop closing), with no ``retries`` left: it
    was not lost (its worker did not die on its own) and it did not fail (``Terminated``
    was raised in it, then the stop's grace). ``reason``: ``interrupted: the daemon
    stopped``; ``task``: its id."""

    code = "task_interrupted"


class UnknownSession(UnknownReplica):
    """A command names an executor session the daemon does not have (it restarted, or the
    session was idle too long): the client registers it again (``Executor`` does that by
    itself) and its tasks are attached to it by their ids."""

    code = "unknown_session"


class TaskTimeoutError(TimeoutError):
    """What the future of an ``Executor`` task that ran past its ``timeout`` raises (inside
    the task, ``orchestrator.TaskTimeout`` was raised). ``task`` is its id, ``timeout`` the
    limit in seconds."""

    def __init__(self, message: str, *, task: str | None = None, timeout: float | None = None) -> None:
        super().__init__(message)
        self.task, self.timeout = task, timeout


class SpawnerLost(Exception):
    """A spawner (launcher.Spawner) died or stalled during a request: fork here instead.

    Not an OrchestratorError: it never reaches a client; the launcher catches it and
    forks the replica itself."""


class ShutdownRequested(BaseException):
    """Raised in the control loop when SIGTERM (or SIGINT in the foreground) arrived.

    A BaseException like KeyboardInterrupt, so no ``except Exception`` swallows it, but a
    type of its own: a SIGTERM is an order to shut down cleanly, not a user's Ctrl-C.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"shutdown requested by signal {signum}")
        self.signum = signum


# What a call to a daemon that went away (stopped, killed, restarting) fails with;
# UnknownSession: it is back, and does not know the caller's executor session.
AWAY: tuple[type[OrchestratorError], ...] = (ChannelError, DaemonNotRunning, ShuttingDown, UnknownSession)

ERROR_TYPES: dict[str, type[OrchestratorError]] = {
    cls.code: cls
    for cls in (OrchestratorError, InvalidSpec, UnknownReplica, ShuttingDown, DaemonNotRunning, ChannelError,
                UnknownSession)
}
