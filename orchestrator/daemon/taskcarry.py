"""What of the task table (tasktable.py) carries across a restart and across an upgrade: a
collaborator that reads the table's public views and gives back through its public methods
(as systemd's ``*-serialize.c`` sit beside what they serialize). Loop thread only.

    restore          at a start: the store's unfinished tasks, queued again or LOST; a
                     WAITING one waits for its time again (its deadline too)
    before_handover  an upgrade, in the image that goes: what waits on it answered
    carried          ...its tasks, workers' connections and cancel words, sessions' unread
                     events, their numbers on their way and the cancels by id waiting for
                     them, and the listener, as one JSON document (fds made inheritable)
    take_over        the next image: all of it taken back, the work going on
"""

from __future__ import annotations

import base64
import mmap
import os
import socket
from typing import Any, Callable, Iterable

from .. import taskwire as w
from ..errors import InvalidSpec
from ..states import TaskState as T
from .pools import Pool
from .reactor import BufferedWriter, Timer
from .taskrecords import Doc, ExecPool, Task, Worker, as_bytes, as_text, parse_options, queue_place, wait_fields
from .tasktable import Table, TaskTable, log


class TaskCarry:
    """Restart and upgrade for ``tasks`` (the task table), with the engine ``table``'s
    pools and store; see the module docstring."""

    def __init__(self, tasks: TaskTable, table: Table) -> None:
        self.tasks = tasks
        self.table = table

    # -- a restart -------------------------------------------------------------------------

    def restore(self, pools: Iterable[Pool], store: Any) -> None:
        """At start: the executor pools of the store (pools restored already) take their
        unfinished tasks back. A task that was RUNNING when the daemon died is LOST, or
        queued again (its attempt counted) while ``retries`` remain; a QUEUED one stays
        queued. Ids continue where they stopped."""
        tasks = self.tasks
        numbers = store.task_numbers() if store is not None else {}
        for pool in pools:
            ex = pool.stored_executor
            if not ex or pool.deleted:
                continue
            try:
                options = parse_options(ex.get("options"))
                init = base64.b64decode(ex.get("init") or "")
            except (InvalidSpec, ValueError) as err:
                log.error("executor pool %s: its stored options do not load (%s); its tasks stay as they are",
                          pool.name, err)
                continue
            next_n = max(int(ex.get("next_task") or 1), numbers.get(pool.name, 0) + 1)
            tasks.listen()
            xp = tasks.adopt(pool, options, init, next_n=next_n)
            self._keep_about(pool, xp, ex)
            if store is None:
                continue
            for row in store.tasks(pool=pool.name):
                task = Task(row["id"], int(row["n"]), xp, row["payload"], None, None, row["timeout"],
                            int(row["retries"]), state=T(row["state"]), attempts=int(row["attempts"]),
                            worker_id=row["worker"], queued_at=row["queued_at"] or 0.0,
                            started_at=row["started_at"], **queue_place(row), **wait_fields(row))
                tasks.add(task)  # a WAITING one waits for its time again, a deadline is armed again
                if task.state is T.RUNNING:
                    if task.may_run_again() and task.payload:
                        tasks.requeue(task, "the daemon died while it ran")
                    else:
                        tasks.end(task, T.LOST, "lost", "the daemon died while it ran")
                elif task.state is T.QUEUED:
                    tasks.enqueue(task)

    def _keep_about(self, pool: Pool, xp: ExecPool, stored: Doc) -> None:
        """What the pool's row said of its initializer (a joiner's conflict names it) stays."""
        if stored.get("about"):
            xp.about = str(stored["about"])
            self.table.save_pool(pool)

    # -- an upgrade (handover.py) ----------------------------------------------------------

    def before_handover(self) -> None:
        """Answer what waits on the loop (a session's poll, a `result --wait`): both ask
        again, and the next image answers. A connection parked unread goes as it is."""
        self.tasks.take_parked()
        self.tasks.answer_waiting()

    def carried(self) -> Doc:
        """What the next image needs to go on with every executor pool: its tasks, its
        workers' connections and cancel words (their fds made inheritable here), the
        sessions' unread events, the listener."""
        def keep(fd: int) -> int:
            os.set_inheritable(fd, True)
            return fd

        def deadline(timer: Timer | None) -> float | None:
            return timer.deadline if timer is not None and not timer.cancelled else None

        tasks = []
        for t in self.tasks.live.values():
            tasks.append({**t.record(), "payload": as_text(t.payload), "result": None, "ref": t.ref,
                          "session": t.session.name if t.session is not None else None, "slot": t.slot,
                          "asked_back": t.asked_back, "stopping": t.stopping,
                          "timer": deadline(t.timer)})
        workers = []
        pools = self.tasks.pools.values()
        for worker in [wk for xp in pools for wk in xp.workers.values()] + list(self.tasks.unidentified):
            if worker.closed:
                continue
            workers.append({"pool": worker.pool.name if worker.pool is not None else None,
                            "replica": worker.replica.id if worker.replica is not None else None,
                            "pid": worker.pid, "sock": keep(worker.sock.fileno()), "out": keep(worker.writer.fd),
                            "pending_out": as_text(bytes(worker.writer.pending_bytes())),
                            "pending_in": as_text(worker.frames.pending()), "skip_in": worker.frames.skipping,
                            "word": keep(worker.word_fd) if worker.word_fd >= 0 else None, "ready": worker.ready,
                            "sent": worker.sent, "version": worker.version,
                            "next_slot": worker.next_slot, "asks": worker.asks,
                            "asked": worker.asked.id if worker.asked is not None else None,
                            "done": worker.done, "tasks": [t.id for t in worker.tasks],
                            "kill": deadline(worker.kill_timer), "lost_reason": worker.lost_reason,
                            "over_memory": worker.over_memory, "pipes": self._pipes_of(worker, keep)})
        carried_pools = [{"name": xp.name, "next_n": xp.next_n, "reserved": xp.reserved, "said": xp.said,
                          "ended": dict(xp.ended), "queue": [t.id for t in xp.queue if t.state is T.QUEUED]}
                         for xp in pools if not xp.closing]
        sessions = [{"name": ss.name, "seq": ss.seq, "events": [[seq, ev] for seq, ev in ss.events],
                     "waiting_events": ss.waiting_events,
                     "granted": {pool: u.ranges for pool, u in ss.granted.items() if u.ranges},
                     "early": [[task_id, t.ended_at] for task_id, t in ss.early.items()]}
                    for ss in self.tasks.sessions.values() if ss.sink is None]
        listener = self.tasks.listener_fd
        return {"address": self.tasks.address, "listener": keep(listener) if listener is not None else None,
                "pools": carried_pools, "tasks": tasks, "workers": workers, "sessions": sessions}

    def _pipes_of(self, worker: Worker, keep: Callable[[int], int]) -> list[int] | None:
        """The read ends of the worker's second stdout/stderr pair (tasklogs.py), if it has one."""
        logs = self.tasks.task_logs
        ends = logs.read_ends(worker) if logs is not None else None
        return [keep(fd) for fd in ends] if ends is not None else None

    def take_over(self, doc: Doc | None) -> None:
        """The next image: the executor pools of the store (restored already) go on as the
        earlier image left them, on the connections it handed over."""
        if not doc:
            return
        tasks = self.tasks
        if doc.get("listener") is not None:
            tasks.take_listener(doc["address"], int(doc["listener"]))
        for carried in doc.get("pools", []):
            pool = self.table.pool(carried["name"])
            ex = pool.stored_executor if pool is not None else None
            if pool is None or not ex:
                continue
            adopted = tasks.adopt(pool, parse_options(ex.get("options")), base64.b64decode(ex.get("init") or ""),
                                  next_n=int(carried["next_n"]), said=carried.get("said"),  # the next number: recorded
                                  ended={str(k): int(v) for k, v in (carried.get("ended") or {}).items()})
            self._keep_about(pool, adopted, ex)
        for ss in doc.get("sessions", []):
            tasks.resume_session(ss["name"], int(ss["seq"]), ((int(seq), event) for seq, event in ss["events"]),
                                 waiting_events=ss.get("waiting_events") is True, granted=ss.get("granted") or {},
                                 early=((str(i), float(at or 0.0)) for i, at in ss.get("early") or ()))
        now = self.table.os.monotonic()
        by_id: dict[str, Task] = {}
        for row in doc.get("tasks", []):
            xp = tasks.pools.get(row["pool"])
            if xp is None:
                continue
            owner = tasks.sessions.get(row["session"]) if row.get("session") else None
            task = Task(row["id"], int(row["n"]), xp, as_bytes(row["payload"], "payload") if row["payload"] else None,
                        row.get("ref"), owner, row["timeout"], int(row["retries"]), state=T(row["state"]),
                        attempts=int(row["attempts"]), worker_id=row["worker"], queued_at=row["queued_at"] or 0.0,
                        started_at=row["started_at"], slot=int(row.get("slot") or 0),
                        asked_back=bool(row.get("asked_back")), stopping=bool(row.get("stopping")),
                        **queue_place(row), **wait_fields(row))
            if row.get("timer") is not None:
                tasks.arm_timeout(task, max(0.0, float(row["timer"]) - now))
            tasks.add(task)
            by_id[task.id] = task
        for carried in doc.get("pools", []):
            xp = tasks.pools.get(carried["name"])
            if xp is not None:
                for task_id in carried["queue"]:
                    if task_id in by_id:
                        tasks.enqueue(by_id[task_id])
        for item in doc.get("workers", []):
            self._take_worker(item, by_id, now)
        tasks.run_queues()

    def _take_worker(self, item: Doc, by_id: dict[str, Task], now: float) -> None:
        """One worker's connection as the image before left it, handed to the table."""
        conn = socket.socket(fileno=int(item["sock"]))
        conn.setblocking(False)
        for fd in (conn.fileno(), int(item["out"]), item.get("word")):
            if fd is not None:
                os.set_inheritable(int(fd), False)
        worker = Worker(conn, BufferedWriter(int(item["out"])))
        worker.frames.resume(as_bytes(item.get("pending_in") or "", "pending_in"), int(item.get("skip_in") or 0))
        if item.get("pending_out"):
            worker.writer.write(as_bytes(item["pending_out"], "pending_out"))
        xp = self.tasks.pools.get(item["pool"]) if item.get("pool") else None
        rep = self.table.replica(item["replica"]) if item.get("replica") else None
        if xp is None or rep is None:  # not identified yet: it says HELLO to this image
            self.tasks.take_unidentified(worker)
            return
        worker.pid, worker.replica, worker.pool = int(item["pid"]), rep, xp
        worker.ready, worker.sent, worker.done = bool(item["ready"]), int(item["sent"]), int(item["done"])
        worker.version = int(item.get("version", 1))
        worker.next_slot, worker.asks = int(item.get("next_slot", 0)), int(item.get("asks", 0))
        worker.lost_reason = item.get("lost_reason")
        worker.over_memory = bool(item.get("over_memory"))  # its task is not retried on the other side either
        if item.get("word") is not None:
            worker.word_fd = int(item["word"])
            worker.word = mmap.mmap(worker.word_fd, w.WORD.size * w.WORDS)
        for task_id in item["tasks"]:
            task = by_id.get(task_id)
            if task is None:  # ended already (a cancel): the worker still answers for it
                task = self.tasks.ended.get(task_id) or Task(task_id, int(task_id.rpartition("/")[2]), xp, None, None,
                                                             None, None, 0, state=T.CANCELLED)
            worker.tasks.append(task)
            if not task.state.terminal:
                task.worker = worker
            if task_id == item.get("asked"):
                worker.asked = task
        pipes = [int(fd) for fd in item.get("pipes") or ()]
        logs = self.tasks.task_logs
        if logs is not None and pipes:  # its tasks' output goes on into their logs
            logs.pipes(worker, pipes)
            for task in worker.tasks:
                logs.sent(worker, task)
        else:
            for fd in pipes:
                os.close(fd)
        kill = item.get("kill")
        self.tasks.resume_worker(worker, max(0.0, float(kill) - now) if kill is not None else None)
