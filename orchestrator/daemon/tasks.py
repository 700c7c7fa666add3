"""The tasks of executor pools, as the engine holds them (``Engine.tasks``): one table and
its two collaborators, put together here. Loop thread only.

    tasktable.py     TaskTable, the one owner of tasks, workers and sessions: queue,
                     dispatch, cancel and timeout for a task's number, results, sessions'
                     delivery, the task rows in state.db; a small public API
    taskcommands.py  TaskCommands: the command channel's task commands, a config file's
                     executor pools, each pool's counts for ``status``
    taskcarry.py     TaskCarry: what carries across a restart (``restore``) and an upgrade
                     (``before_handover``, ``carried``, ``take_over``)
    taskrecords.py   the records and the pure checks and shapes around them
    tasklogs.py      TaskLogs, each task's output in its own log (the daemon's), which
                     the table tells when a task is sent, answered, given back, lost

The collaborators hold the table and call only its public methods; neither is a part of
it. ``Tasks`` is the engine's one door to the three.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..states import Replica
from .pools import Pool
from .taskcarry import TaskCarry
from .taskcommands import Command, TaskCommands
from .taskrecords import Doc
from .logcapture import LogCapture
from .tasklogs import TaskLogs
from .tasktable import Table, TaskTable


class Tasks:
    """What the engine asks of executor pools: ``tasktable`` (the TaskTable), ``commands()``
    and ``declare``/``pool_counts``/``pool_workers`` (TaskCommands), ``restore``, ``before_handover``,
    ``carried``, ``take_over`` (TaskCarry), and the table's own ``address``, ``spawned``,
    ``worker_ended``, ``start_held``, ``settle`` and ``close``."""

    def __init__(self, table: Table, *, address: str | None = None, token: str | None = None,
                 stop_reason: str = "interrupted: the executor shut down",
                 result_max_bytes: int | None = None, log_capture: LogCapture | None = None) -> None:
        """As TaskTable's (``table``: the engine; ``token`` is unused here); ``log_capture``:
        the daemon's, which then also keeps each task's output in a log of its own."""
        logs = TaskLogs(log_capture) if log_capture is not None else None
        self.tasktable = TaskTable(table, address=address, stop_reason=stop_reason, result_max_bytes=result_max_bytes,
                                   task_logs=logs)
        self._commands = TaskCommands(self.tasktable, table)
        self._carry = TaskCarry(self.tasktable, table)

    # -- the command channel, the config file, status ---------------------------------------

    def commands(self) -> dict[str, Command]:
        return self._commands.commands()

    def declare(self, name: str, spec: Mapping[str, Any], policy: Doc, size: int, options: Doc) -> str:
        return self._commands.declare(name, spec, policy, size, options)

    def pool_counts(self, name: str) -> Doc | None:
        return self._commands.pool_counts(name)

    def pool_workers(self, name: str) -> Doc | None:
        return self._commands.pool_workers(name)

    # -- a restart, an upgrade ------------------------------------------------------------

    def restore(self, pools: Iterable[Pool], store: Any) -> None:
        self._carry.restore(pools, store)

    def before_handover(self) -> None:
        self._carry.before_handover()

    def carried(self) -> Doc:
        return self._carry.carried()

    def take_over(self, doc: Doc | None) -> None:
        self._carry.take_over(doc)

    # -- the table's own --------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.tasktable.address

    def spawned(self, pid: int) -> None:
        self.tasktable.spawned(pid)

    def worker_ended(self, rep: Replica) -> None:
        self.tasktable.worker_ended(rep)

    def start_held(self, rep: Replica, begun: int) -> str | None:
        return self.tasktable.start_held(rep, begun)

    def settle(self) -> None:
        self.tasktable.settle()

    def close(self) -> None:
        self.tasktable.close()
