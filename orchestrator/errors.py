"""Typed errors. Each says what happened in one line; the CLI prints ``str(err)``.

Shared by every process (the CLI and clients, the daemon, the spawner): this module
imports nothing of the package. The public ones are exported by ``orchestrator`` (see its
``__all__``).

Each ``OrchestratorError`` class has a ``code`` of its own: an error reply carries it across
the command channel, and ``ERROR_TYPES`` (code -> class, one table) turns it back into the
same class on the other side, with the same message, ``data`` and ``wire_fields``
(``to_wire`` / ``from_wire``, used by ``protocol.error`` and ``protocol.raise_reply``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping


class OrchestratorError(Exception):
    """Base of every error this package raises on purpose. ``data``: what a failed
    command still has to say (e.g. the ids a launch made before its wait timed out)."""

    code = "error"
    data: object = None
    # keyword arguments of the class's __init__, kept as attributes, that cross the command
    # channel beside the message (plain values only: str, int, float, bool, None)
    wire_fields: ClassVar[tuple[str, ...]] = ()


class InvalidSpec(OrchestratorError, ValueError):
    """A worker spec or command argument that cannot be used (empty command, bad target)."""

    code = "invalid"


class NotFound(OrchestratorError, KeyError):
    """A lookup that missed: a replica, pool, task, executor session or log file that is not
    there. A ``KeyError`` too, whose ``str()`` is the plain message (KeyError's own would be
    its repr, quotes and all)."""

    code = "not_found"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class UnknownReplica(NotFound):
    """A replica id this daemon has never had."""

    code = "unknown_replica"


class UnknownPool(NotFound):
    """A pool this daemon does not have (never made, or deleted), an executor pool too."""

    code = "unknown_pool"


class UnknownTask(NotFound):
    """A task id this daemon never handed out, or whose record was pruned long ago."""

    code = "unknown_task"


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

    code = "unsafe_file"


class FrameTooLarge(InvalidSpec):
    """A command or reply whose frame on the command channel would exceed its limit (64
    MiB of JSON): its sender refuses it with this error instead of sending it (the reader
    could only drop it, and its caller would wait)."""

    code = "frame_too_large"


class ConfigError(OrchestratorError):
    """An invalid config file, in one line: ``FILE:LINE: KEY: what is wrong``.

    Refused by the daemon (``reload``), it reaches the client as a ConfigError with the same
    line, ``source``, ``line``, ``key`` and ``problem``; the CLI exits 1."""

    code = "config"
    wire_fields = ("source", "line", "key", "problem")

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


class WaitTimeout(OrchestratorError):
    """A command's wait (``launch --wait``, ``terminate --wait``, ``wait``) ran out before
    the replicas got there. ``data``: ``{"ids": [...], "late": [...]}``, what the command
    made or waited on and which of them were late."""

    code = "timeout"


class InternalError(OrchestratorError):
    """A bug in the daemon, met while it handled a command: that command's error (the loop
    goes on, and the daemon's log has the traceback)."""

    code = "internal"


class UsageError(OrchestratorError):
    """A command line that cannot be right whatever the daemon holds (two things where one
    is wanted, none where one is needed, a malformed ``--env``), found after argparse: the
    CLI prints it as argparse does its own, in one line, and exits 2."""

    code = "usage"


class _TaskEnd(OrchestratorError):
    """A task of an ``Executor`` that ended without a result of its own: ``reason`` says
    why, ``task`` is its id."""

    wire_fields = ("reason", "task")

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


class UnknownSession(NotFound):
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
    for cls in (OrchestratorError, InvalidSpec, NotFound, UnknownReplica, UnknownPool, UnknownTask, UnknownSession,
                ShuttingDown, DaemonNotRunning, ChannelError, UnsafeStateDir, UnsafeFile, FrameTooLarge, ConfigError,
                StoreError, WaitTimeout, InternalError, UsageError, WorkerLost, TaskInterrupted)
}
"""Every error code and its class, one table: what an error reply's ``code`` becomes again
on the other side of the command channel (``from_wire``). A code no class has (a newer
daemon's) is an OrchestratorError that keeps that ``code``."""

_PLAIN = (str, int, float, bool, type(None))


def to_wire(err: OrchestratorError) -> dict[str, Any]:
    """The error part of an error reply: ``code``, ``error`` (the one line), and, where the
    error has them, ``data`` and ``fields`` (its ``wire_fields`` that are set)."""
    out: dict[str, Any] = {"code": err.code, "error": str(err)}
    fields = {name: getattr(err, name, None) for name in err.wire_fields}
    fields = {name: value for name, value in fields.items() if value is not None and isinstance(value, _PLAIN)}
    if fields:
        out["fields"] = fields
    if err.data is not None:
        out["data"] = err.data
    return out


def from_wire(msg: Mapping[str, Any]) -> OrchestratorError:
    """The typed error an error reply carries (``to_wire``'s inverse). What a peer sends
    that this class does not take (an unknown field, a value that is not plain) is left out."""
    code = msg.get("code")
    message = msg.get("error")
    text = message if isinstance(message, str) else "unknown error"
    cls = ERROR_TYPES.get(code) if isinstance(code, str) else None
    if cls is None:
        err = OrchestratorError(text)
        if isinstance(code, str) and code:
            err.code = code  # kept on the instance: the caller still sees what the peer said
    else:
        given = msg.get("fields")
        given = given if isinstance(given, dict) else {}
        # a field that is None was left out by to_wire: the class's default stands
        fields = {name: given[name] for name in cls.wire_fields if name in given and isinstance(given[name], _PLAIN)}
        err = cls(text, **fields)
    err.data = msg.get("data")
    return err
