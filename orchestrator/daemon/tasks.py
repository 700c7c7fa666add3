"""The tasks of executor pools, as the engine holds them (``Engine.tasks``).

    tasktable.py     the table: queue, workers, cancel and timeout for a task's number,
                     results, sessions' delivery, the task rows in state.db
    taskcommands.py  its commands, a config file's executor pools, sessions' lifecycle
    here             what carries across a restart (``restore``: the store's unfinished
                     tasks) and across an upgrade (``carried``/``take_over``: the
                     connections, cancel words and tasks handed to the next image)
    taskrecords.py   the records and the pure checks and shapes around them

Loop thread only.
"""

from __future__ import annotations

import base64
import functools
import mmap
import os
import socket
from typing import Any

from .. import protocol
from .. import taskwire as w
from ..errors import InvalidSpec
from ..states import TaskState as T
from .reactor import BufferedWriter, Timer
from .taskcommands import TaskCommands
from .taskrecords import ExecPool, Task, Worker, as_bytes, as_text, outcome, parse_options
from .tasktable import HELLO_TIMEOUT, log


class Tasks(TaskCommands):
    """The task table with its commands, and what it takes back after a restart or an
    upgrade; see the module docstring."""

    # -- start-up, status ----------------------------------------------------------------

    def restore(self, pools: Any, store: Any) -> None:
        """At start: the executor pools of the store (pools restored already) take their
        unfinished tasks back. A task that was RUNNING when the daemon died is LOST, or
        queued again (its attempt counted) while ``retries`` remain; a QUEUED one stays
        queued. Ids continue where they stopped."""
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
            self._listen()
            xp = self._adopt(pool, options, init, next_n=next_n)
            self._keep_about(pool, ex)
            if store is None:
                continue
            for row in store.tasks(pool=pool.name):
                task = Task(row["id"], int(row["n"]), xp, row["payload"], None, None, row["timeout"],
                            int(row["retries"]), state=T(row["state"]), attempts=int(row["attempts"]),
                            worker_id=row["worker"], queued_at=row["queued_at"] or 0.0,
                            started_at=row["started_at"])
                self._live[task.id] = task
                if task.state is T.RUNNING:
                    if task.attempts <= task.retries and task.payload:
                        self.requeue(task, "the daemon died while it ran")
                    else:
                        self._end(task, T.LOST, "lost", "the daemon died while it ran")
                else:
                    xp.queue.append(task)

    def _keep_about(self, pool: Any, stored: dict) -> None:
        """What the pool's row said of its initializer (a joiner's conflict names it) stays."""
        if stored.get("about") and pool.executor is not None:
            self._pools[pool.name].about = str(stored["about"])
            self.table.save_pool(pool)

    # -- an upgrade (handover.py) ----------------------------------------------------------

    def before_handover(self) -> None:
        """Answer what waits on the loop (a session's poll, a `result --wait`): both ask
        again, and the next image answers."""
        self.take_parked()
        for session in self._sessions.values():
            if session.poll is not None:
                reply, cmd_id, timer = session.poll
                timer.cancel()
                session.poll = None
                self.table.reply(reply, protocol.ok(cmd_id, {"events": [], "next": session.seq}), False)
        for task in self._live.values():
            for reply, cmd_id in task.waiters:
                self.table.reply(reply, protocol.ok(cmd_id, outcome(task.record())), False)
            task.waiters.clear()

    def carried(self) -> dict:
        """What the next image needs to go on with every executor pool: its tasks, its
        workers' connections and cancel words (their fds made inheritable here), the
        sessions' unread events, the listener."""
        def keep(fd: int) -> int:
            os.set_inheritable(fd, True)
            return fd

        def deadline(timer: Timer | None) -> float | None:
            return timer.deadline if timer is not None and not timer.cancelled else None

        tasks = []
        for t in self._live.values():
            tasks.append({**t.record(), "payload": as_text(t.payload), "result": None, "ref": t.ref,
                          "session": t.session.name if t.session is not None else None, "slot": t.slot,
                          "asked_back": t.asked_back, "stopping": t.stopping,
                          "timer": deadline(t.timer)})
        workers = []
        for worker in [wk for xp in self._pools.values() for wk in xp.workers.values()] + list(self._accepted):
            if worker.closed:
                continue
            workers.append({"pool": worker.pool.name if worker.pool is not None else None,
                            "replica": worker.replica.id if worker.replica is not None else None,
                            "pid": worker.pid, "sock": keep(worker.sock.fileno()), "out": keep(worker.writer.fd),
                            "pending_out": as_text(bytes(worker.writer.pending_bytes())),
                            "pending_in": as_text(worker.frames.pending()), "skip_in": worker.frames.skipping, "word": keep(worker.word_fd)
                            if worker.word_fd >= 0 else None, "ready": worker.ready, "sent": worker.sent, "version": worker.version,
                            "next_slot": worker.next_slot, "asks": worker.asks,
                            "asked": worker.asked.id if worker.asked is not None else None,
                            "done": worker.done, "tasks": [t.id for t in worker.tasks],
                            "kill": deadline(worker.kill_timer), "lost_reason": worker.lost_reason,
                            "over_memory": worker.over_memory})
        pools = [{"name": xp.name, "next_n": xp.next_n, "reserved": xp.reserved, "said": xp.said, "ended": dict(xp.ended),
                  "queue": [t.id for t in xp.queue if t.state is T.QUEUED]}
                 for xp in self._pools.values() if not xp.closing]
        sessions = [{"name": ss.name, "seq": ss.seq, "events": [[seq, ev] for seq, ev in ss.events]}
                    for ss in self._sessions.values() if ss.sink is None]
        listener = keep(self._listener.fileno()) if self._listener is not None else None
        return {"address": self._address, "listener": listener, "pools": pools, "tasks": tasks,
                "workers": workers, "sessions": sessions}

    def take_over(self, doc: dict | None) -> None:
        """The next image: the executor pools of the store (restored already) go on as the
        earlier image left them, on the connections it handed over."""
        if not doc:
            return
        reactor = self.table.reactor
        if doc.get("listener") is not None:
            self._address = doc["address"]
            self._listener = socket.socket(fileno=int(doc["listener"]))
            os.set_inheritable(self._listener.fileno(), False)
            reactor.add_reader(self._listener.fileno(), self._accept)
        for carried in doc.get("pools", []):
            pool = self.table.pool(carried["name"])
            ex = pool.stored_executor if pool is not None else None
            if pool is None or not ex:
                continue
            xp: ExecPool | None = self._adopt(pool, parse_options(ex.get("options")), base64.b64decode(ex.get("init") or ""),
                             next_n=int(carried["next_n"]))
            assert xp is not None
            self._keep_about(pool, ex)
            xp.said = carried.get("said")  # the next number: recorded by _adopt
            xp.ended.update({str(k): int(v) for k, v in (carried.get("ended") or {}).items()})
        for ss in doc.get("sessions", []):
            session = self._open_session(ss["name"], None)
            session.seq = int(ss["seq"])
            for seq, event in ss["events"]:
                session.events.append((int(seq), event))
                session.held += len(event[2]) if isinstance(event[2], str) else 0
        now = self.table.os.monotonic()
        by_id: dict[str, Task] = {}
        for row in doc.get("tasks", []):
            xp = self._pools.get(row["pool"])
            if xp is None:
                continue
            owner = self._sessions.get(row["session"]) if row.get("session") else None
            task = Task(row["id"], int(row["n"]), xp, as_bytes(row["payload"], "payload") if row["payload"] else None,
                        row.get("ref"), owner, row["timeout"], int(row["retries"]), state=T(row["state"]),
                        attempts=int(row["attempts"]), worker_id=row["worker"], queued_at=row["queued_at"] or 0.0,
                        started_at=row["started_at"], slot=int(row.get("slot") or 0),
                        asked_back=bool(row.get("asked_back")), stopping=bool(row.get("stopping")))
            if row.get("timer") is not None:
                task.timer = reactor.call_later(max(0.0, float(row["timer"]) - now),
                                                functools.partial(self._timed_out, task))
            if owner is not None and task.ref is not None:
                owner.tasks[task.ref] = task
            self._live[task.id] = task
            by_id[task.id] = task
        for carried in doc.get("pools", []):
            xp = self._pools.get(carried["name"])
            if xp is not None:
                xp.queue.extend(by_id[i] for i in carried["queue"] if i in by_id)
        for item in doc.get("workers", []):
            self._take_worker(item, by_id, now)
        for xp in self._pools.values():
            self._dispatch(xp)

    def _take_worker(self, item: dict, by_id: dict[str, Task], now: float) -> None:
        conn = socket.socket(fileno=int(item["sock"]))
        conn.setblocking(False)
        for fd in (conn.fileno(), int(item["out"]), item.get("word")):
            if fd is not None:
                os.set_inheritable(int(fd), False)
        worker = Worker(conn, BufferedWriter(int(item["out"])))
        worker.frames.resume(as_bytes(item.get("pending_in") or "", "pending_in"), int(item.get("skip_in") or 0))
        if item.get("pending_out"):
            worker.writer.write(as_bytes(item["pending_out"], "pending_out"))
        self._watch(worker)
        xp = self._pools.get(item["pool"]) if item.get("pool") else None
        rep = self.table.replica(item["replica"]) if item.get("replica") else None
        if xp is None or rep is None:  # not identified yet: it says HELLO to this image
            self._accepted.add(worker)
            self.table.reactor.call_later(HELLO_TIMEOUT, functools.partial(self._hello_timeout, worker))
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
                task = self._ended.get(task_id) or Task(task_id, int(task_id.rpartition("/")[2]), xp, None, None,
                                                        None, None, 0, state=T.CANCELLED)
            worker.tasks.append(task)
            if not task.state.terminal:
                task.worker = worker
            if task_id == item.get("asked"):
                worker.asked = task
        if len(worker.tasks) > 1:
            xp.holders.add(worker)
        xp.workers[rep.id] = worker
        if item.get("kill") is not None and worker.tasks:
            what = "cancel" if worker.tasks[0].state is T.CANCELLED else "timeout"
            task = worker.tasks[0]
            grace = max(0.0, float(item["kill"]) - now)
            worker.kill_timer = self.table.reactor.call_later(
                grace, lambda: self._kill(worker, f"task {task.id} did not stop after its {what}", renew=True))
        if worker.ready and not xp.closing:
            if not worker.tasks:
                xp.idle.append(worker)
            elif len(worker.tasks) == 1 and self._room(xp, worker):
                xp.single.append(worker)
