"""Per-task logs: each task's stdout and stderr (its fds 1 and 2, so its children's output
too) in files of its own, ``logs/<pool>#<n>.out`` and ``.err``, rotated by its pool's log
limits and removed with the task's record. Loop thread only; the task table (tasktable.py)
calls it at four moments of a task, the log capture (logcapture.py) does the writing.

Whose bytes are whose is known without a word from the worker, by where they come from:

    slot 0:  the replica's own stdout/stderr pipes  ─┐  the loop pumps both pairs; each pair's
    slot 1:  a second pair the worker made (PIPES)  ─┘  bytes go to the file its slot is bound to

A worker holds at most two tasks, one per slot of its cancel words (taskwire.py), and puts
its slot's pair on fds 1 and 2 as it starts a task. So a slot's pipes carry, from the TASK
frame the loop sent into that slot until that task's answer, only that task's bytes: the
task it held before in that slot has answered (the loop read its answer before it sent the
next one), and the one in the other slot writes to the other pair. Then:

  * ``sent``: the slot's pipes are bound to the task's files (made by its first byte: a
    task that writes nothing costs no file), from the moment the loop sends it (it may start
    before the loop reads its predecessor's answer, so not from its start);
  * ``answered``: the worker flushed its Python streams and ended the task's leftover
    processes before it answered, so everything the task wrote is in the pipes: they are
    drained into its files (at most DRAIN_LIMIT, a pipe's worth; one poll of the pair
    first, so a silent task costs no read) before the slot is bound back to the worker's
    own files; a line in the worker's stdout log says the task ran (written with the other
    lines of the next NOTES_DELAY: logcapture.File.note);
  * ``given_back``: a held task the worker gave back never ran: its slot is the worker's;
  * ``worker_ended``: the replica was reaped (its pipes drained into what they were bound
    to by the capture's finish) and the second pair is drained and closed.

Considered, and why not: a single pipe pair and the answer as the boundary (drain at the
answer, then switch). The worker starts its held task as soon as it has sent the answer,
before the loop reads it, so the next task's first lines would land in the one before's
log; only a byte of the worker's in the pipes (a marker per task) or a round trip per task
fixes that, each costing every task. Two pairs cost two dup2 per task in the worker and a
poll per answer in the loop (a drain only if the pair holds something). What is not
attributed: output of a thread a task left running (it writes into whatever pair is on fds
1 and 2 when it writes).
"""

from __future__ import annotations

import logging
import os
import select
import time
from dataclasses import dataclass, field

from ..states import TaskState as T
from .logcapture import File, LogCapture, Stream
from .taskrecords import Task, Worker

log = logging.getLogger("orchestrator.logs")


@dataclass(eq=False)
class _Slots:
    """One worker's pipes: per slot its (stdout, stderr) streams, a poll of the pair, and
    the id of the task the slot is bound to."""

    own: File  # the replica's own stdout file (its log), where the lines per task go
    pipes: list[tuple[Stream, Stream]]
    polls: list[select.poll] = field(default_factory=list)
    bound: list[str | None] = field(default_factory=lambda: [None, None])


class TaskLogs:
    """The per-task logs of the executor pools' workers (the module docstring)."""

    def __init__(self, capture: LogCapture) -> None:
        self.capture = capture
        self._workers: dict[Worker, _Slots] = {}  # a worker's slots, once it sent PIPES
        self._second = (-1, "")  # the last second a line was stamped with, and its text

    def wanted(self, rid: str) -> bool:
        """Should the worker of replica ``rid`` make its second pair (CONFIG's task_logs)?
        Only if its own output is captured: then its slot 0 is the capture's pair."""
        return self.capture.replica(rid) is not None

    def pipes(self, worker: Worker, fds: list[int]) -> None:
        """The worker sent its second pair's read ends (PIPES): both slots are pumped."""
        rep = worker.replica
        rlog = self.capture.replica(rep.id) if rep is not None else None
        if rep is None or rlog is None or len(fds) != 2 or worker in self._workers:
            for fd in fds:
                os.close(fd)
            return
        first = (rlog.stream("out"), rlog.stream("err"))
        second: list[Stream] = []
        try:
            for fd, own in zip(fds, first):
                second.append(self.capture.take_pipe(fd, own.file))
        except OSError as err:
            log.warning("%s: its task logs cannot be pumped (%s); its tasks' output goes to its own log",
                        rep.id, err)
            for stream in second:
                stream.close()
            for fd in fds[len(second):]:
                os.close(fd)
            return
        slots = _Slots(first[0].file, [first, (second[0], second[1])])
        for pair in slots.pipes:
            poll = select.poll()
            for stream in pair:
                poll.register(stream.r, select.POLLIN)
            slots.polls.append(poll)
        self._workers[worker] = slots

    def read_ends(self, worker: Worker) -> list[int] | None:
        """The second pair's read ends (an upgrade carries them), None without."""
        slots = self._workers.get(worker)
        if slots is None or slots.pipes[1][0].r < 0:
            return None
        return [slots.pipes[1][0].r, slots.pipes[1][1].r]

    def sent(self, worker: Worker, task: Task) -> None:
        """``task`` went to ``worker`` in its slot: what that slot's pipes carry from now on
        is the task's (an upgrade: each task a worker held, again)."""
        slots = self._workers.get(worker)
        if slots is None:
            return
        slot = task.slot
        if slots.bound[slot] is not None:  # (a slot carries one task at a time: not seen)
            self._unbind(slots, slot)
        out, err = slots.pipes[slot]
        out.bind(task.id, "out")
        err.bind(task.id, "err")
        slots.bound[slot] = task.id

    def answered(self, worker: Worker, task: Task) -> None:
        """The worker answered for ``task``: all it wrote is in its slot's pipes, drained
        into its files now; the slot is the worker's own again; one line in the worker's log."""
        slots = self._workers.get(worker)
        if slots is None or slots.bound[task.slot] != task.id:
            return
        self._unbind(slots, task.slot)
        slots.own.note(self.marker(task))

    def given_back(self, worker: Worker, task: Task) -> None:
        """A held task came back unstarted: its slot is the worker's own again."""
        slots = self._workers.get(worker)
        if slots is not None and slots.bound[task.slot] == task.id:
            self._unbind(slots, task.slot)

    def worker_ended(self, worker: Worker, ran: Task | None) -> None:
        """``worker``'s replica is gone (its first pair drained already by the capture):
        the second pair is drained and closed, each bound slot closed; ``ran``: the task it
        ran then (its line in the worker's log says how it ended)."""
        slots = self._workers.pop(worker, None)
        if slots is None:
            return
        for slot in (0, 1):
            self._unbind(slots, slot)
        for stream in slots.pipes[1]:
            stream.finish()
        if ran is not None:
            slots.own.note(self.marker(ran))

    def forget(self, task_id: str) -> None:
        """The task's record is gone (a loop without a store keeps only its latest ended
        tasks): so are its files (the store's retention does this in the daemon)."""
        self.capture.forget([task_id])

    def close(self) -> None:
        """The loop is closing: every bound file is closed (the capture closes the pipes)."""
        for slots in self._workers.values():
            for slot in (0, 1):
                self._unbind(slots, slot)
            for stream in slots.pipes[1]:
                stream.close()
        self._workers.clear()

    def marker(self, task: Task) -> str:
        """The worker's log's line for a task: which, when it started, how it ended."""
        started, ended, state = task.started_at, task.ended_at, task.state
        what = state.value if state is not T.QUEUED else "its worker was lost: queued again"
        if started is None:
            return f"--- task {task.id} {what}"
        second = int(started)
        if second != self._second[0]:  # strftime costs more than the rest of the line
            self._second = (second, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(second)))
        ms = int((started - second) * 1000)
        if ended is None:
            return f"--- task {task.id} started {self._second[1]}.{ms:03d}Z, {what}"
        took = ended - started  # (an f-string of ints and one float: a third cheaper than %)
        return f"--- task {task.id} started {self._second[1]}.{ms:03d}Z, {what} after {took:.3f} s"

    @staticmethod
    def _unbind(slots: _Slots, slot: int) -> None:
        if slots.bound[slot] is None:
            return
        slots.bound[slot] = None
        pair = slots.pipes[slot]
        if slots.polls[slot].poll(0):  # something to read (or a pipe at its end): drained, not lost
            for stream in pair:
                stream.drain()
        for stream in pair:
            stream.unbind()
