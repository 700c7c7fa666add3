"""The tasks of executor pools: queued, handed to workers, ended. Loop thread only.

An executor pool is a pool like any other (its replicas run ``orchestrator.taskworker``,
supervised, restarted and shown as every replica is) plus what this module keeps: its
queue of tasks, and for each worker the one task it runs. The loop alone hands a task to a
worker, so at every moment it knows which worker runs which task; a cancel or a timeout
is delivered for that task's number (the cancel words, taskwire.py) and can never land in
the task a worker runs next. A busy worker is sent one more task to hold (still QUEUED
until it starts), so that it never waits for a round trip through the loop between two;
but never while another worker of the pool is idle: then a held task is asked back
(taskwire.py, "Taking a held task back") and, once its worker says it had not started it,
handed to the idle one. Idle first: a queued task goes to an idle worker whenever one exists.
Which queued task goes next is the queue's (taskqueue.py): a higher priority first, tenants
by weight within one, FIFO within a tenant, ``max_wait`` aging.

    submit ─► QUEUED ─► (an idle worker) ─► RUNNING ─► RESULT: DONE   RAISED: FAILED
                 ▲                            │ cancel ─► CANCELLED ┐ Cancelled raised in it;
                 │                            │ timeout ─► TIMED_OUT┘ still busy after grace:
                 ├── its worker died, retries left                    its tree killed
                 │                            ├ its worker died ─► FAILED (WorkerLost, reason)
                 └── at its time ◄─ WAITING ◄─┘ RETRY: Retry(after=), or retry_on's exception
                                              (holds no worker; taskwait.py; a deadline ends
                                              it TIMED_OUT wherever it is)

Workers connect to one listener (``$ORCHESTRATOR_TASK_SOCKET``, an abstract socket unless
a path is given); a connection is accepted only from the main process of a live replica
of an executor pool (SO_PEERCRED), once. The loop never unpickles a task or a result: it
moves opaque bytes between the submitting session and the worker. What a session hears
(``sink``, called with a list of them once per turn; a client of the daemon polls them):
``(kind, ref, data, task id)`` with kind a ``taskwire.TaskEvent`` (started, waiting: only
to a session that asked, stopping, stopped) or its end: result, raised, error (data: a line), cancelled, timeout, lost,
unrun, interrupted (data: the reason; interrupted: the loop's stop cut the task short).

This table is the one owner of the tasks, the workers' connections and the sessions; its
collaborators, the commands (taskcommands.py) and what carries across a restart or an
upgrade (taskcarry.py), hold it and use its public API (the class docstring), never its
records' containers. It asks the engine for what it needs through ``Table``. How many
workers an elastic pool has (min_workers..max_workers, idle_timeout, memory_budget) is
elastic.py's to decide, asked at the dispatch's hooks: it grows the pool when a task finds no
free worker, retires a worker idle too long; the supervisor does both.
"""

from __future__ import annotations

import base64
import collections
import errno
import functools
import json
import logging
import mmap
import os
import secrets
import socket
import struct
from typing import Any, Callable, Collection, Iterable, Mapping, Protocol

from .. import protocol, signals
from .. import taskwire as w
from ..taskwire import TaskEvent
from ..errors import InvalidSpec, UnknownSession, UnknownTask
from ..states import Replica, task_transition
from ..states import ReplicaState
from ..states import TaskState as T
from . import taskfigures
from .containment import Tree
from .elastic import Elastic
from .pools import CRASHLOOP, Pool
from .reactor import BufferedWriter, Reactor, Timer
from .taskmemory import CHECK_INTERVAL, IDLE_INTERVAL, TreeMemory
from .tasklogs import TaskLogs
from .taskqueue import TaskQueue, lane_key
from .taskwait import End, TaskWait, deadline_line
from .taskrecords import (
    Doc, ExecPool, Reply, Session, Sink, Task, Unarrived, Worker, as_text, ended_data, ended_kind, how_it_ended, outcome,
    received_fds, size_text,
)

log = logging.getLogger("orchestrator")
STOPPING = ReplicaState.STOPPING  # a worker being stopped is sent no task
WORKER_TARGET = "orchestrator.taskworker:main"
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
SESSION_IDLE = 60.0  # a polling session not heard from for this long is dropped (its tasks go on)
SESSION_BACKLOG = 100_000  # events kept for a session that does not poll
KEEP_ENDED = 1000  # ended tasks kept in memory for `result` (the store keeps more)...
KEEP_ENDED_BYTES = 64 << 20  # ...and no more of their results than this
STARTED_HOLD = 0.002  # seconds a sink's lone "started" waits for more events (its task's end)
SESSION_BACKLOG_BYTES = 256 << 20  # results held for a session that does not poll
HELLO_TIMEOUT = 10.0  # a connection that has not said who it is by then is closed
HELLO_MAX = 16  # the payload a connection may send before it said who it is
PARKED_MAX = 64  # connections of our user from pids not known yet, waiting unread
LINE_MAX = 64 << 10  # a worker's lines (UNPICKLABLE, STOPPED, KEPT) are far shorter
# Seconds after a cancel signal at which it is sent again while the worker has not answered.
KICKS = (0.05, 0.25, 1.0)
RECV_SIZE = 1 << 20  # bytes of one read of a worker's socket: a large result in few reads
COPY_MAX = 1 << 20  # a TASK frame's payload below this is copied behind its header: one write


class Clock(Protocol):
    """The engine's clocks (osapi.OSApi): a task's times are wall clock, timers monotonic."""

    def time(self) -> float: ...
    def monotonic(self) -> float: ...


class Proc(Tree, Protocol):
    """A replica's process as the engine holds it (engine.Proc): its tree, and whose it is."""

    replica: Replica


class Containment(Protocol):
    """What the table asks of containment.py: may memory_max be the cgroup's, and the kill
    of a worker's whole tree."""

    def check_limits(self, limits: dict[str, Any]) -> None: ...
    def kill_after_grace(self, tree: Tree) -> None: ...


class Supervisor(Protocol):
    """What the table and its commands ask of supervision.Supervisor: an executor pool is a
    pool like any other."""

    def renew(self, rep: Replica, reason: str, *, now: bool = False) -> None: ...
    def open_pool(self, name: str, spec: Doc, policy: Doc, size: int) -> tuple[Pool, list[str]]: ...
    def declare(self, name: str, spec: Doc, policy: Doc, size: int) -> str: ...
    def delete_pool(self, name: str) -> list[str]: ...
    def grow(self, pool: Pool, count: int) -> list[str]: ...
    def retire(self, rep: Replica, reason: str) -> bool: ...


class TaskStore(Protocol):
    """The store's task rows (store.Store)."""

    def save_task(self, rec: Doc) -> None: ...
    def tasks(self, *, pool: str | None = None, include_terminal: bool = False,
              task_id: str | None = None, key: str | None = None) -> list[Doc]: ...
    def task_numbers(self) -> dict[str, int]: ...


class Journal(Protocol):
    """The engine's writes to the store (journal.Journal): a task's row, its events."""

    @property
    def store(self) -> TaskStore | None: ...
    def event(self, kind: str, data: Doc) -> None: ...


class Metrics(Protocol):
    """The task counters of metrics.Metrics."""

    def task_started(self, pool: str, waited: float, tenant: str | None) -> None: ...
    def task_ended(self, pool: str, state: str, ran: float | None) -> None: ...
    def task_figures(self, pool: str, figures: w.Figures) -> None: ...


class Table(Protocol):
    """What the task table and its collaborators ask of the replica table (engine.Engine)."""

    @property
    def reactor(self) -> Reactor: ...
    @property
    def os(self) -> Clock: ...
    @property
    def containment(self) -> Containment: ...
    @property
    def supervisor(self) -> Supervisor: ...
    @property
    def journal(self) -> Journal: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def closing(self) -> bool: ...

    def pool(self, name: str) -> Pool | None: ...
    def replica(self, rid: str) -> Replica | None: ...
    def save_pool(self, pool: Pool) -> None: ...
    def proc_by_pid(self, pid: int) -> Proc | None: ...
    def proc_of(self, rep: Replica) -> Proc | None: ...
    def changed(self) -> None: ...
    def reply(self, reply: Reply, msg: protocol.Reply, durable: bool) -> None: ...
    def wait_for(self, ids: Iterable[str], until: str, reply: Reply, cmd_id: object, timeout: float) -> object: ...


class TaskTable:
    """The one owner of the executor pools' tasks, workers and sessions (see the module
    docstring). Its collaborators (taskcommands.TaskCommands, taskcarry.TaskCarry) read its
    records through the read-only views below and change them only through its methods:

    views       ``address``, ``pools``, ``live``, ``ended``, ``sessions``, ``unidentified``,
                ``listener_fd``; ``task(id)``, ``by_key(pool, key)``; ``waiting(task)`` (why it has not started),
                ``parked(pool)`` (its WAITING tasks),
                ``workers(pool)`` (busy, idle, min, max, budget)
    pools       ``listen``, ``prepare`` (a pool's spec and policy), ``adopt``,
                ``set_options``, ``grant``/``give_back`` (task numbers), ``stop_pool``,
                ``run_queues``
    on its way  ``expect``, ``granted_to`` (whose number, its submit not arrived), ``arrived``,
                ``on_its_way`` (its record), ``cancel_unarrived``, ``wait_arrival``
    tasks       ``submit``, ``add``/``enqueue`` (restored ones), ``cancel``, ``shut_down``,
                ``requeue``, ``end``, ``arm_timeout``, ``wait_result``
    sessions    ``open_session``, ``session``, ``attach``, ``poll``, ``resume_session``,
                ``drop_session``, ``answer_waiting``
    workers     ``spawned``, ``worker_ended``, ``take_parked``, ``take_listener``,
                ``take_unidentified``, ``resume_worker``
    the engine  ``settle``, ``close``
    """

    def __init__(self, table: Table, *, address: str | None = None,
                 stop_reason: str = "interrupted: the executor shut down",
                 result_max_bytes: int | None = None, task_logs: TaskLogs | None = None) -> None:
        """``address``: the workers' listener (None: an abstract socket of this process);
        ``stop_reason``: what a task cut short by a shutdown ends with; ``result_max_bytes``:
        a larger result fails its task (None: no bound); ``task_logs``: each task's output
        in its own log (the daemon's; None: the workers' output is their own)."""
        self.table = table
        self.task_logs = task_logs
        # No address given (an embedded loop): an abstract name nobody can guess, so none can
        # bind it first; who connects is checked at accept either way.
        self._address = address or f"@orchestrator-tasks-{secrets.token_hex(16)}"
        self._listener: socket.socket | None = None
        self._pools: dict[str, ExecPool] = {}
        self._sessions: dict[str, Session] = {}
        self._accepted: set[Worker] = set()  # connected, not identified yet
        self._parked: dict[int, tuple[socket.socket, Timer]] = {}  # pid -> its connection, unread
        self._live: dict[str, Task] = {}  # unfinished tasks by id
        self._ended: collections.OrderedDict[str, Task] = collections.OrderedDict()  # the latest KEEP_ENDED
        self._ended_bytes = 0
        self._keys: dict[tuple[str, str], Task] = {}  # (pool, key) -> its task, while in memory
        self.stop_reason = stop_reason
        self.result_max_bytes = result_max_bytes
        self._hello_limit = lambda kind: HELLO_MAX  # not identified yet: a HELLO or nothing
        # Every worker's frames are read into this one buffer (and copied out by the frame
        # reader): a recv(1 MiB) makes a new 1 MiB object per read, which the allocator maps
        # and unmaps each time (~0.15 ms a read here against ~0.03, paid for every result).
        self._rbuf = bytearray(RECV_SIZE)
        self._rview = memoryview(self._rbuf)
        self._memory = TreeMemory(table.reactor.monotonic)
        self._elastic = Elastic(table, self._memory, self._dispatch)  # an elastic pool's size
        self._waits = TaskWait(table.reactor, table.os.time, self._resume, self._past_deadline)  # Retry, deadlines

    # -- the listener -------------------------------------------------------------------

    @property
    def address(self) -> str:
        """Where this loop's executor workers connect (``$ORCHESTRATOR_TASK_SOCKET``)."""
        return self._address

    # -- what the collaborators read (changed only by the methods below) -----------------

    @property
    def pools(self) -> Mapping[str, ExecPool]:
        """The executor pools by name (a closing one stays until its workers are gone)."""
        return self._pools

    @property
    def live(self) -> Mapping[str, Task]:
        """The unfinished tasks by id, oldest first."""
        return self._live

    @property
    def ended(self) -> Mapping[str, Task]:
        """The latest ended tasks by id (KEEP_ENDED of them; the store keeps more)."""
        return self._ended

    @property
    def sessions(self) -> Mapping[str, Session]:
        """The open sessions by name."""
        return self._sessions

    @property
    def unidentified(self) -> Collection[Worker]:
        """Connections accepted that have not said who they are (HELLO) yet."""
        return self._accepted

    @property
    def listener_fd(self) -> int | None:
        """The workers' listener, once it listens."""
        return self._listener.fileno() if self._listener is not None else None

    def task(self, task_id: str) -> Task | None:
        """The task of ``task_id`` in memory (unfinished, or among the latest ended)."""
        return self._live.get(task_id) or self._ended.get(task_id)

    def by_key(self, pool: str, key: str) -> Task | None:
        """The task of ``pool`` that ``key`` names, if it is in memory (as ``task``)."""
        return self._keys.get((pool, key))

    def listen(self) -> None:
        """Bind the workers' listener at ``address``, once (the first executor pool)."""
        if self._listener is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        addr = self._address
        try:
            if addr.startswith("@"):
                sock.bind("\0" + addr[1:])
            else:
                try:
                    os.unlink(addr)  # a socket file an earlier daemon of this state dir left
                except FileNotFoundError:
                    pass
                sock.bind(addr)
                os.chmod(addr, 0o600)
            sock.listen(512)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self.table.reactor.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:  # EMFILE: the worker retries nothing; it fails and is replaced
                log.error("task listener: accept failed: %s", err)
                return
            try:
                pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            except OSError:
                conn.close()
                continue
            if self._is_worker(pid):
                self._take(conn)
            elif uid == os.geteuid() and len(self._parked) < PARKED_MAX and pid not in self._parked:
                # Ours, but not known as a replica yet: a worker forked warm can connect before
                # its spawner's answer is read. It waits, unread, until then or HELLO_TIMEOUT.
                self._parked[pid] = (conn, self.table.reactor.call_later(
                    HELLO_TIMEOUT, functools.partial(self._unpark, pid, False)))
            else:
                log.warning("task socket: a connection from pid %d, which is no worker of an executor pool; "
                            "closed", pid)
                conn.close()

    def spawned(self, pid: int) -> None:
        """A replica's process ``pid`` exists now (engine.spawned): if it connected already,
        its connection is taken."""
        if pid in self._parked:
            self._unpark(pid, True)

    def take_parked(self) -> None:
        """Every parked connection is taken as it is (an upgrade: the next image reads
        their HELLOs and checks them)."""
        for pid in list(self._parked):
            conn, timer = self._parked.pop(pid)
            timer.cancel()
            self._take(conn)

    def take_listener(self, address: str, fd: int) -> None:
        """The workers' listener the image before this one handed over (an upgrade)."""
        self._address = address
        self._listener = socket.socket(fileno=fd)
        os.set_inheritable(fd, False)
        self.table.reactor.add_reader(fd, self._accept)

    def take_unidentified(self, worker: Worker) -> None:
        """A connection handed over before it said who it is: it says HELLO to this image."""
        self._accepted.add(worker)
        self._watch(worker)
        self.table.reactor.call_later(HELLO_TIMEOUT, functools.partial(self._hello_timeout, worker))

    def resume_worker(self, worker: Worker, kill_in: float | None) -> None:
        """An identified worker handed over (an upgrade), its ``pool``, ``replica`` and the
        tasks it holds filled in: it goes on here as it did there; ``kill_in``: its tree's
        kill after a stop's grace was due in that many seconds."""
        xp, rep = worker.pool, worker.replica
        assert xp is not None and rep is not None
        self._watch(worker)
        if len(worker.tasks) > 1:
            xp.holders.add(worker)
        xp.workers[rep.id] = worker
        if kill_in is not None and worker.tasks:
            task = worker.tasks[0]
            what = "cancel" if task.state is T.CANCELLED else "timeout"
            worker.kill_timer = self.table.reactor.call_later(
                kill_in, lambda: self._kill(worker, f"task {task.id} did not stop after its {what}", renew=True))
        if worker.ready and not xp.closing:
            if not worker.tasks:
                self._now_idle(xp, worker)
            elif len(worker.tasks) == 1 and self._room(xp, worker):
                xp.single.append(worker)

    def _unpark(self, pid: int, known: bool) -> None:
        conn, timer = self._parked.pop(pid, (None, None))
        if conn is None or timer is None:
            return
        timer.cancel()
        if known and self._is_worker(pid):
            self._take(conn)
        else:
            log.warning("task socket: pid %d connected but is no worker of an executor pool; closed", pid)
            conn.close()

    def _is_worker(self, pid: int) -> bool:
        """Is ``pid`` the main process of a live replica of an executor pool? Checked by the
        peer's credentials at accept, before a byte of it is read."""
        proc = self.table.proc_by_pid(pid)
        rep = proc.replica if proc is not None else None
        return rep is not None and rep.pool in self._pools and not rep.state.terminal

    def _take(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            out = os.dup(conn.fileno())  # its own fd: the reactor watches one fd per direction
        except OSError as err:
            log.error("task listener: %s", err)
            conn.close()
            return
        worker = Worker(conn, BufferedWriter(out))
        self._accepted.add(worker)
        self._watch(worker)
        # Until its HELLO it may send only that, and hold an fd only this long.
        self.table.reactor.call_later(HELLO_TIMEOUT, functools.partial(self._hello_timeout, worker))

    def _watch(self, worker: Worker) -> None:
        """Read what ``worker`` sends; flush what it is sent, however large (the reactor
        writes the rest of a frame as the socket drains)."""
        self.table.reactor.add_reader(worker.sock.fileno(), functools.partial(self._readable, worker))
        self.table.reactor.add_writer(worker.writer)

    def _hello_timeout(self, worker: Worker) -> None:
        if worker in self._accepted:
            log.warning("task socket: a connection that never said who it is; closed")
            self._disconnected(worker)

    # -- executor pools ---------------------------------------------------------------------

    def _cgroup_memory(self, limit: int) -> bool:
        """Whether the cgroup's memory.max can bound a worker here (else: its tree's RSS,
        polled: taskmemory.py)."""
        try:
            self.table.containment.check_limits({"memory_max": limit})
        except InvalidSpec:
            return False
        return True

    def adopt(self, pool: Pool, options: Doc, init: bytes, *, next_n: int = 1, said: str | None = None,
              ended: Mapping[str, int] | None = None) -> ExecPool:
        """``pool`` is an executor pool from now on (made, restored from the store, or carried
        across an upgrade: ``said`` and ``ended`` as the image before had them)."""
        queue = TaskQueue[Task](self.table.os.time, weights=options.get("tenant_weights"),
                                max_wait=options.get("max_wait"))
        xp = self._pools[pool.name] = ExecPool(pool.name, options, init, queue, next_n=next_n, reserved=0, said=said)
        xp.ended.update(ended or {})
        pool.make_executor(xp)
        self._reserve(xp, pool)
        self._watch_memory(xp)
        return xp

    def _reserve(self, xp: ExecPool, pool: Pool | None = None) -> None:
        """Record in the pool's row the exact next task number (committed with the turn that
        handed the last one out, before its reply), so that an id is never given twice, even
        once its task's row is pruned, and a restart continues without a gap."""
        if xp.next_n == xp.reserved:
            return
        pool = pool or self.table.pool(xp.name)
        if pool is None or pool.executor is not xp:
            return
        xp.reserved = xp.next_n  # in the pool's row: ExecPool.stored()
        self.table.save_pool(pool)

    def prepare(self, spec: Mapping[str, Any], policy: Doc, options: Doc) -> tuple[Doc, Doc]:
        """An executor pool's spec and policy as the supervisor is to run them: its workers
        told where the listener is (it listens from now on), its ``memory_max`` given to the
        cgroup where a memory controller enforces it (else it is polled: taskmemory.py)."""
        self.listen()
        spec = {**spec, "env": {**(spec.get("env") or {}), w.SOCKET_ENV: self._address}}
        policy = dict(policy)
        if options.get("memory_max") is not None and self._cgroup_memory(options["memory_max"]):
            policy["memory_max"] = options["memory_max"]
        return spec, policy

    def set_options(self, xp: ExecPool, options: Doc) -> None:
        """``xp``'s options (checked: taskrecords.parse_options) in force for the tasks
        handed out from now on (a config reload)."""
        xp.options = options
        xp.queue.configure(options.get("tenant_weights"), options.get("max_wait"))
        self._watch_memory(xp)

    def grant(self, xp: ExecPool, count: int, session: Session | None = None) -> list[int]:
        """A block of ``count`` task numbers of ``xp``, [first, count], recorded in this
        turn's commit, before the reply that hands them out; ``session``: whose they are,
        on their way until each one's submit arrives (``arrived``)."""
        first = xp.next_n
        xp.next_n += count
        self._reserve(xp)
        if session is not None:
            session.granted.setdefault(xp.name, Unarrived()).add(first, first + count)
        return [first, count]

    def give_back(self, xp: ExecPool, first: int, end: int, session: Session | None = None) -> bool:
        """The unused end of the latest block, [first, end), taken back if no number was
        handed out after it and no task has one of them; ``session``'s own (it says it will
        not use them) no longer on their way either way."""
        if session is not None and xp.name in session.granted:
            session.granted[xp.name].remove(first, end)
        # (Checked against the tasks held, not number by number: a block may be very large.)
        if 0 < first < end == xp.next_n and not any(t.pool is xp and t.n >= first
                                                      for t in (*self._live.values(), *self._ended.values())):
            xp.next_n = first
            self._reserve(xp)
            return True
        return False

    def expect(self, xp: ExecPool, session: Session, first: int, end: int) -> None:
        """[first, end), numbers of ``xp`` granted to ``session`` before (a daemon since
        restarted, or a session dropped while its client was away), on their way again; only
        numbers handed out count."""
        end = min(end, xp.next_n)
        if 0 < first < end:
            session.granted.setdefault(xp.name, Unarrived()).add(first, end)

    def granted_to(self, task_id: str) -> Session | None:
        """The open session that was granted ``task_id``'s number and has not submitted it
        yet (its submit on its way, or not sent yet); None if none."""
        parsed = protocol.parse_task_id(task_id)
        if parsed is None:
            return None
        pool, n = parsed
        if pool not in self._pools:
            return None
        for session in self._sessions.values():  # a few sessions, each with a range or two
            unarrived = session.granted.get(pool)
            if unarrived is not None and n in unarrived:
                return session
        return None

    def arrived(self, xp: ExecPool, session: Session | None, n: int) -> Task | None:
        """A submit of ``session`` naming number ``n`` arrived: ``n`` is on its way no longer.
        The task a cancel by id made of it before (``cancel_unarrived``), if any: its submit
        is that task, ended."""
        if session is None:
            return None
        unarrived = session.granted.get(xp.name)
        if unarrived is not None:
            unarrived.take(n)
        return session.early.pop(f"{xp.name}/{n}", None) if session.early else None

    def on_its_way(self, task_id: str) -> Doc:
        """The record of a task whose submit has not arrived (``granted_to``): QUEUED, as
        its submitter's future is, with no time yet."""
        pool, n = protocol.parse_task_id(task_id) or ("", 0)
        xp = self._pools[pool]
        return Task(task_id, n, xp, None, None, None, None, 0).record()

    def cancel_unarrived(self, session: Session, task_id: str) -> Task:
        """Cancel by id the task of ``task_id``, granted to ``session`` and not arrived
        (``granted_to``): a task CANCELLED now (its row, its end, its ``result``), which its
        submit is when it arrives: never run, its submitter told it is cancelled. Forgotten
        by the session if it ends first (its record stays, as an ended task's does)."""
        pool, n = protocol.parse_task_id(task_id) or ("", 0)
        xp = self._pools[pool]
        task = Task(task_id, n, xp, None, None, None, None, 0, queued_at=self.table.os.time())
        self.add(task)
        self.cancel(task)
        session.early[task_id] = task
        for reply, cmd_id, _ in session.awaited.pop(task_id, ()):
            self.table.reply(reply, protocol.ok(cmd_id, outcome(task.record())), False)
        return task

    def wait_arrival(self, session: Session, task_id: str, reply: Reply, cmd_id: Any, timeout: float) -> None:
        """A ``result --wait`` of a task whose submit has not arrived (``granted_to``): as
        ``wait_result`` once it has, for what is left of ``timeout``; at ``timeout`` the
        record ``on_its_way`` gives."""
        entry = (reply, cmd_id, self.table.reactor.monotonic() + timeout)
        session.awaited.setdefault(task_id, []).append(entry)

        def expire() -> None:
            waiting = session.awaited.get(task_id)
            if waiting is not None and entry in waiting:
                waiting.remove(entry)
                if not waiting:
                    del session.awaited[task_id]
                self.table.reply(reply, protocol.ok(cmd_id, outcome(self.on_its_way(task_id))), False)

        self.table.reactor.call_later(timeout, expire)

    def run_queues(self) -> None:
        """Hand out what every pool has queued (tasks and workers taken over)."""
        for xp in self._pools.values():
            self._dispatch(xp)

    # -- tasks ----------------------------------------------------------------------------

    def cancel(self, task: Task) -> bool:
        """Cancel ``task``: True if it is cancelled now or was before, False if it had ended
        otherwise. A running one gets ``Cancelled`` raised in it, its worker's tree is killed
        if it is still busy after the grace."""
        if task.state is T.CANCELLED:
            return True
        if task.state.terminal:
            return False
        worker = task.worker
        self.end(task, T.CANCELLED, "cancelled", "cancelled")
        if worker is not None:
            self._interrupt(worker, task, w.CANCEL)
        return True

    def shut_down(self, task: Task) -> None:
        """As ``cancel``, but a task that runs gets ``Terminated`` (its executor shuts down)."""
        worker = task.worker
        if task.state is not T.RUNNING or worker is None or worker.task is not task:
            self.cancel(task)
            return
        self.end(task, T.CANCELLED, "cancelled", "cancelled")
        self._interrupt(worker, task, w.SHUTDOWN)

    def submit(self, xp: ExecPool, task: Task) -> Task:
        """Queue a task just made (``task.n`` 0: not numbered by its session, the next
        number), and hand it out if a worker is free; a pool that no longer replaces its
        workers fails it at once."""
        if not task.n:  # the next number, recorded with this turn
            task.n = xp.next_n
            xp.next_n += 1
            self._reserve(xp)
        task.id = f"{xp.name}/{task.n}"
        task.queued_at = self.table.os.time()
        self.add(task)
        xp.queue.push(task)
        self._save(task, None)
        if task.session is not None and task.session.awaited:
            now = self.table.reactor.monotonic()
            for reply, cmd_id, until in task.session.awaited.pop(task.id, ()):
                self.wait_result(task, reply, cmd_id, max(0.0, until - now))
        self._dispatch(xp)
        if task.state is T.QUEUED:
            self._hopeless(xp)
        return task

    def add(self, task: Task) -> None:
        """An unfinished task is the table's (submitted, restored from the store, carried
        across an upgrade): kept by id, and by its session under its ref."""
        if task.session is not None and task.ref is not None:
            task.session.tasks[task.ref] = task
        self._live[task.id] = task
        if task.key is not None:
            self._keys[(task.pool.name, task.key)] = task
        self._waits.watch(task)  # its deadline, and a WAITING one's time

    def enqueue(self, task: Task) -> None:
        """A QUEUED task already the table's (``add``) waits last in its pool's queue; it is
        handed out with the next dispatch (``run_queues``, or a worker's READY)."""
        task.pool.queue.push(task)

    def arm_timeout(self, task: Task, delay: float) -> None:
        """``task``, RUNNING, times out in ``delay`` seconds (its clock carried across an
        upgrade)."""
        task.timer = self.table.reactor.call_later(delay, functools.partial(self._timed_out, task))

    def wait_result(self, task: Task, reply: Reply, cmd_id: Any, timeout: float) -> None:
        """``reply`` gets ``task``'s outcome once it has ended, or at ``timeout`` its state
        then."""
        entry = (reply, cmd_id)
        task.waiters.append(entry)

        def expire() -> None:
            if entry in task.waiters:
                task.waiters.remove(entry)
                self.table.reply(reply, protocol.ok(cmd_id, outcome(task.record())), False)

        self.table.reactor.call_later(timeout, expire)

    def _dispatch(self, xp: ExecPool) -> None:
        """Hand queued tasks out: to idle workers first, then one more to each busy worker,
        so that none waits for a round trip through the loop between two tasks. A task
        that goes to a free worker while an older one is held behind a busy worker has that
        one asked back (it is the next free worker's); workers still idle at the end ask
        held tasks back too."""
        queue = xp.queue
        while queue:
            worker = self._free_worker(xp)
            if worker is None:
                self._elastic.want(xp)  # an elastic pool below max_workers grows
                return
            task = queue.pop()  # the next in the queue's order (taskqueue.py)
            if task is None or task.state is not T.QUEUED:  # neither can be: an ended task leaves the queue
                self._offer(xp, worker)
                if task is None:
                    return
                continue
            self._send(xp, worker, task)
            if xp.holders and len(worker.tasks) == 1:
                self._take_back(xp, 1, before=task)
        if xp.idle and xp.holders:
            idle = {wk for wk in xp.idle if not wk.closed and wk.ready and not wk.tasks and self._room(xp, wk)}
            self._take_back(xp, len(idle))

    def _offer(self, xp: ExecPool, worker: Worker) -> None:
        """``worker``, taken from the free ones for a task that was not sent, is free again."""
        if not worker.tasks:
            xp.idle.appendleft(worker)
        elif self._room(xp, worker):
            xp.single.appendleft(worker)

    def _take_back(self, xp: ExecPool, want: int, *, before: Task | None = None) -> None:
        """Ask up to ``want`` held, unstarted tasks back from busy workers, the first in
        order first (each is handed on once its worker gives it back); asks still
        unanswered count. ``before``: a task that just went to a free worker; only held
        tasks that would have started before it are asked back."""
        if xp.closing or want <= 0:
            return
        held: list[tuple[tuple[tuple[int, int], int], Worker]] = []
        for wk in xp.holders:
            task = wk.tasks[1] if len(wk.tasks) > 1 else None
            if task is None or task.state is not T.QUEUED or wk.closed:
                continue
            if wk.asked is not None:
                want -= before is None
            elif wk.version >= 2 and (before is None or _ahead(task, before)):
                held.append((_rank(task), wk))
        for _, wk in sorted(held, key=lambda h: h[0])[:max(0, want)]:
            self._ask_back(wk, wk.tasks[1])

    def _ask_back(self, worker: Worker, task: Task) -> None:
        if worker.word is None or worker.asked is not None:
            return
        worker.asks += 1
        worker.asked = task
        task.asked_back = True
        self._set_word(worker, task.slot, w.revoke_word(worker.asks))
        self._signal(worker)

    def _answered(self, worker: Worker) -> Task | None:
        """The worker has answered the ask for its held task (or that task answered for
        itself): the ask's word is cleared, unless a cancel has overwritten it since."""
        task, worker.asked = worker.asked, None
        if task is None:
            return None
        task.asked_back = False
        if worker.word is not None:
            at = task.slot * w.WORD.size
            if w.WORD.unpack_from(worker.word, at)[0] == w.revoke_word(worker.asks):
                self._set_word(worker, task.slot, 0)
        return task

    @staticmethod
    def _name(worker: Worker) -> str:
        return worker.replica.id if worker.replica is not None else "a worker"

    @staticmethod
    def _set_word(worker: Worker, slot: int, value: int) -> None:
        assert worker.word is not None
        at = slot * w.WORD.size
        worker.word[at:at + w.WORD.size] = w.WORD.pack(value)

    def _signal(self, worker: Worker) -> bool:
        proc = self._proc(worker)
        if proc is None:
            return False
        signals.to_child(proc.pid, w.CANCEL_SIGNAL)
        if worker.kick_timer is None:
            self._kick(worker, 0)
        return True

    def _kick(self, worker: Worker, n: int) -> None:
        """The cancel signal again KICKS[n] s after the first, while the worker has not
        answered (an ask back, or its task's stop): one that landed just before the task's
        blocking call (time.sleep) leaves its handler pending until that call returns
        (CPython's race, worker.py), and a second one interrupts the call. The worker's
        handler acts once per word (taskworker._look): a signal more is never a second
        exception."""

        def fire() -> None:
            worker.kick_timer = None
            proc = self._proc(worker)
            if proc is None or worker.closed or (worker.asked is None and worker.kill_timer is None):
                return
            signals.to_child(proc.pid, w.CANCEL_SIGNAL)
            if n + 1 < len(KICKS):
                self._kick(worker, n + 1)

        worker.kick_timer = self.table.reactor.call_later(KICKS[n] - (KICKS[n - 1] if n else 0.0), fire)

    def _free_worker(self, xp: ExecPool) -> Worker | None:
        for waiting, holds in ((xp.idle, 0), (xp.single, 1)):
            if holds and not self._elastic.may_hold(xp):
                return None  # a growing pool's new worker takes it, unheld
            while waiting:
                worker = waiting.popleft()  # an entry whose worker changed since is dropped
                if not worker.closed and len(worker.tasks) == holds and self._room(xp, worker):
                    return worker
        return None

    def _room(self, xp: ExecPool, worker: Worker) -> bool:
        """May ``worker`` be sent one more task (max_tasks_per_child counts those it holds)?
        Not while it has an ask to answer: which cancel word the next frame takes depends
        on that answer."""
        return (not xp.closing and worker.asked is None
                and (not xp.max_tasks or worker.done + len(worker.tasks) < xp.max_tasks)
                and (worker.replica is None or worker.replica.state is not STOPPING))  # retiring, scaled down

    def _send(self, xp: ExecPool, worker: Worker, task: Task) -> None:
        """``task`` to ``worker``: it runs now, or waits there (still QUEUED) behind the one
        the worker runs."""
        task.worker = worker
        if worker.version >= 2:
            task.slot, worker.next_slot = worker.next_slot, worker.next_slot ^ 1
        else:
            task.slot = worker.sent % w.WORDS
        task.asked_back = False
        worker.sent += 1
        if worker.idle_timer is not None:
            self._elastic.busy(worker)
        worker.tasks.append(task)
        if self.task_logs is not None:
            self.task_logs.sent(worker, task)
        payload = task.payload or b""
        if len(payload) < COPY_MAX:  # one write (one syscall, one read in the worker)
            worker.writer.write(w.frame(w.TASK, task.n, payload))
        else:  # its header, then its own bytes, uncopied
            worker.writer.write(w.header(w.TASK, task.n, len(payload)))
            worker.writer.write(payload)
        if len(worker.tasks) > 1:
            xp.holders.add(worker)
        else:
            self._head(worker)
            if self._room(xp, worker):
                xp.single.append(worker)

    def _head(self, worker: Worker) -> None:
        """The worker starts the first task it holds now: its clock starts (timeout, the
        metrics, ``started``). One cancelled or timed out while it waited there stops at
        once (its word says so); the kill after the grace stands behind that too."""
        task = worker.tasks[0]
        if task.asked_back:
            return  # asked back: it starts here only once the worker says it did (KEPT)
        if task.state is not T.QUEUED:
            # Stopped while it waited here: its word says so, and the worker may have begun
            # it before we knew, so it hears the signal too.
            self._signal(worker)
            self._arm_kill(worker, task, self._what(task))
            return
        task.state = task_transition(task.id, task.state, T.RUNNING)
        task.attempts += 1
        task.worker_id = worker.replica.id if worker.replica is not None else None
        task.started_at = self.table.os.time()
        self._memory_busy(worker.pool)
        self._save(task, T.QUEUED)
        self.table.metrics.task_started(task.pool.name, task.started_at - task.queued_at, task.tenant)
        if task.timeout is not None:
            self.arm_timeout(task, task.timeout)
        self._tell(task, TaskEvent.STARTED, task.id)

    @staticmethod
    def _what(task: Task) -> str:
        return "timeout" if task.state is T.TIMED_OUT else "cancel"

    def _timed_out(self, task: Task) -> None:
        worker = task.worker
        if task.state is not T.RUNNING or worker is None:
            return
        self.end(task, T.TIMED_OUT, "timeout", [f"task {task.id} ran past its timeout of {task.timeout:g} s",
                                                 task.timeout])
        self._interrupt(worker, task, w.TIMEOUT)

    # -- waiting for a time (taskwait.py) ---------------------------------------------------

    def _retry(self, task: Task, payload: bytes) -> None:
        """``task``'s worker answered RETRY (Retry raised, or an exception of its retry_on):
        it waits for its time holding no worker, or ends if no retries remain."""
        got = self._waits.answer(task, payload)
        if isinstance(got, End):
            if got.reason is not None:
                task.reason = got.reason
            self.end(task, T.FAILED, got.kind, got.data)
            return
        task.state = task_transition(task.id, task.state, T.WAITING)
        if task.timer is not None:  # its timeout counts one attempt's run
            task.timer.cancel()
            task.timer = None
        task.waits += not got.counted
        self._waits.park(task, got.delay, got.why)
        self._save(task, T.RUNNING)
        if task.session is not None and task.session.waiting_events:
            self._tell(task, TaskEvent.WAITING, task.id)  # its future is not running() while it waits
        log.info("%s: waits %.3g s: %s", task.id, got.delay, got.why)
        self.table.changed()

    def _resume(self, task: Task) -> None:
        """A waiting task's time has come: first in its pool's queue again."""
        if task.state is not T.WAITING:
            return
        task.state = task_transition(task.id, task.state, T.QUEUED)
        self._waits.forget(task)
        task.wait_reason = None  # QUEUED: why it waits now is the pool's (``waiting``)
        task.pool.queue.push_front(task)
        self._save(task, T.WAITING)
        self._dispatch(task.pool)
        if task.state is T.QUEUED:
            self._hopeless(task.pool)
        self.table.changed()

    def _past_deadline(self, task: Task) -> None:
        """``task`` passed its deadline: TIMED_OUT wherever it is; one that runs (or waits
        held by its worker) gets the timeout's exception, as at its timeout."""
        worker = task.worker
        self.end(task, T.TIMED_OUT, "timeout", [deadline_line(task, task.state is T.WAITING), task.deadline])
        if worker is not None:
            self._interrupt(worker, task, w.TIMEOUT)

    def _interrupt(self, worker: Worker, task: Task, cause: int) -> None:
        """The exception of ``cause`` raised in ``task``, in its worker; the worker's whole
        tree killed if it has not answered for the task ``grace`` seconds after it began to
        stop. A task that waits in the worker behind another is only marked: it stops as
        soon as it starts."""
        if worker.word is None or worker.closed or task not in worker.tasks:
            return
        at = task.slot * w.WORD.size
        worker.word[at:at + w.WORD.size] = w.WORD.pack(w.cancel_word(task.n, cause))
        if worker.tasks[0] is not task:
            return  # it stops as soon as it starts
        if self._signal(worker) and not task.asked_back:  # asked back: the answer to that says more
            self._arm_kill(worker, task, {w.CANCEL: "cancel", w.TIMEOUT: "timeout"}.get(cause, "shutdown"))

    def _arm_kill(self, worker: Worker, task: Task, what: str) -> None:
        if worker.kill_timer is not None:
            worker.kill_timer.cancel()
        grace = worker.pool.grace if worker.pool is not None else 5.0
        worker.kill_timer = self.table.reactor.call_later(
            grace, lambda: self._kill(worker, f"task {task.id} still ran {grace:g} s after its {what}", renew=True))

    def _kill(self, worker: Worker, why: str, *, renew: bool) -> None:
        """SIGKILL to the worker's whole tree (its cgroup, or its group and what left it).
        ``renew``: replaced at once, not counted as a crash (it did what it was told too
        slowly, it did not fail on its own)."""
        proc = self._proc(worker)
        if proc is None or worker.closed:
            return
        worker.lost_reason = why
        log.warning("%s: %s; killing its process tree", self._name(worker), why)
        if renew and worker.replica is not None and worker.pool is not None and not worker.pool.closing:
            self.table.supervisor.renew(worker.replica, why, now=True)
        self.table.containment.kill_after_grace(proc)

    def end(self, task: Task, state: T, kind: str, data: Any) -> None:
        """``task`` ended ``state``; ``data``: the result's or exception's bytes (kind result,
        raised), else the reason (a line; for a timeout, [line, limit])."""
        old = task.state
        task.state = task_transition(task.id, task.state, state)
        task.ended_at = self.table.os.time()
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None
        self._waits.forget(task)
        worker = task.worker
        if worker is not None and worker.task is task:  # it runs: the worker answers for it when it stops
            task.stopping = True
            self._tell(task, TaskEvent.STOPPING, None)
        if old is T.QUEUED and worker is None:
            task.pool.queue.discard(task)  # it waits no longer
        task.worker = None
        task.kind = kind
        task.payload = None
        if isinstance(data, bytes):
            task.result = data
        else:
            task.reason = data if isinstance(data, str) else data[0] if isinstance(data, list) else None
        self._tell(task, kind, data)
        if task.session is not None:
            task.session.tasks.pop(task.ref, None)
        self._live.pop(task.id, None)
        task.pool.ended[state.value] += 1
        self.table.metrics.task_ended(task.pool.name, task.state.value,
                                      task.ended_at - task.started_at if task.started_at is not None else None)
        self._ended[task.id] = task
        self._ended_bytes += len(task.result or b"")
        while self._ended and (len(self._ended) > KEEP_ENDED or self._ended_bytes > KEEP_ENDED_BYTES):
            _, old_task = self._ended.popitem(last=False)  # the store still has it
            self._ended_bytes -= len(old_task.result or b"")
            if old_task.key is not None and self._keys.get((old_task.pool.name, old_task.key)) is old_task:
                del self._keys[(old_task.pool.name, old_task.key)]  # the store finds it by its key from now on
            if self.task_logs is not None and self.table.journal.store is None:
                self.task_logs.forget(old_task.id)  # no store: this was its record, its log goes with it
        self._save(task, old)
        for reply, cmd_id in task.waiters:
            self.table.reply(reply, protocol.ok(cmd_id, outcome(task.record())), False)
        task.waiters.clear()
        self.table.changed()

    def _save(self, task: Task, old: T | None) -> None:
        """The task's row, and an event for ``events`` (``old`` None: it was just queued)."""
        journal = self.table.journal
        if journal.store is None:
            return
        journal.store.save_task(task.record())
        event: Doc = {"task": task.id, "pool": task.pool.name, "from": old.value if old else None,
                      "to": task.state.value}
        if task.reason is not None and task.state.terminal:
            event["reason"] = task.reason
        elif task.state is T.WAITING:
            event["reason"], event["until"] = task.wait_reason, task.wait_until
        if task.worker_id is not None:
            event["worker"] = task.worker_id
        journal.event("task", event)

    def _tell(self, task: Task, kind: str, data: Any) -> None:
        session = task.session
        if session is None:
            return
        event = (kind, task.ref, data, task.id)
        if session.sink is not None:
            # Handed over once per turn, all of the turn's at once: one wake-up of the
            # submitter's thread for a burst of ends. A start alone waits STARTED_HOLD for
            # more: a short task's end then comes with it (and says both), one wake-up of
            # the collector for the task instead of two.
            session.outbox.append(event)
            if session.flushing:
                pass
            elif kind != TaskEvent.STARTED:
                session.flushing = True
                self.table.reactor.call_soon(lambda: self._hand_over(session))
            elif session.started_timer is None:
                session.started_timer = self.table.reactor.call_later(STARTED_HOLD, lambda: self._hand_over(session))
            return
        session.seq += 1
        # Over the channel (JSON): bytes travel as base64 text.
        text = as_text(data)
        session.events.append((session.seq, [kind, task.ref, text, task.id]))
        session.held += len(text) if isinstance(text, str) else 0
        while len(session.events) > SESSION_BACKLOG or session.held > SESSION_BACKLOG_BYTES:
            _, dropped = session.events.popleft()  # a client that stopped polling: its oldest go
            session.held -= len(dropped[2]) if isinstance(dropped[2], str) else 0
        if session.poll is not None and not session.flushing:
            # Answered soon, with everything this turn adds: one reply for a burst of ends.
            session.flushing = True
            self.table.reactor.call_soon(lambda: self._flush(session))

    def _hand_over(self, session: Session) -> None:
        session.flushing = False
        if session.started_timer is not None:
            session.started_timer.cancel()
            session.started_timer = None
        events, session.outbox = session.outbox, []
        if len(events) > 1:  # a task that started and ended in the same turn: its end says both
            ended = {e[1] for e in events if e[0] != TaskEvent.STARTED}
            events = [e for e in events if e[0] != TaskEvent.STARTED or e[1] not in ended]
        if events and session.sink is not None:
            try:
                session.sink(events)
            except Exception:  # a sink is the submitter's: its failure is not the loop's
                log.exception("executor session %s: its sink failed", session.name)

    def _flush(self, session: Session) -> None:
        session.flushing = False
        self._answer_poll(session)

    # -- sessions -------------------------------------------------------------------------

    def open_session(self, name: str, sink: Sink | None, *, after: int = 0, waiting_events: bool = False) -> Session:
        """The session ``name``, made if it is new (its events counted from ``after``: a
        client that comes back reads on from where it was), alive again; a ``sink`` given
        replaces its own; ``waiting_events``: its submitter takes WAITING events."""
        session = self._sessions.get(name)
        if session is None:
            session = self._sessions[name] = Session(name, sink, seq=after)
        elif sink is not None:
            session.sink = sink
        session.waiting_events = session.waiting_events or waiting_events
        self._touch(session)
        return session

    def session(self, name: Any) -> Session:
        """A command's session, alive again (UnknownSession: its client registers it again)."""
        session = self._sessions.get(str(name))
        if session is None:
            raise UnknownSession(f"unknown session {name!r} (the daemon restarted, or it was idle too long, or closed)")
        self._touch(session)
        return session

    def _touch(self, session: Session) -> None:
        """A polling session is alive: its idle clock starts over."""
        if session.sink is not None:
            return
        if session.idle_timer is not None:
            session.idle_timer.cancel()
        session.idle_timer = self.table.reactor.call_later(SESSION_IDLE, lambda: self.drop_session(session))

    def resume_session(self, name: str, seq: int, events: Iterable[tuple[int, list[Any]]], *,
                       waiting_events: bool = False, granted: Mapping[str, list[list[int]]] | None = None,
                       early: Iterable[tuple[str, float]] = ()) -> Session:
        """A polling session carried across an upgrade, with the events it had not read,
        its numbers on their way (``granted``: pool -> [first, end) ranges) and the tasks
        cancelled by id before their submits arrived (``early``: (id, ended_at); their rows
        are the store's already)."""
        session = self.open_session(name, None, waiting_events=waiting_events)
        session.seq = seq
        for number, event in events:
            session.events.append((number, event))
            session.held += len(event[2]) if isinstance(event[2], str) else 0
        for pool, ranges in (granted or {}).items():
            if pool in self._pools:
                unarrived = session.granted.setdefault(pool, Unarrived())
                for first, end in ranges:
                    unarrived.add(int(first), int(end))
        for task_id, ended_at in early:
            parsed = protocol.parse_task_id(task_id)
            if parsed is not None and parsed[0] in self._pools:
                session.early[task_id] = Task(task_id, parsed[1], self._pools[parsed[0]], None, None, None, None, 0,
                                              state=T.CANCELLED, ended_at=ended_at, kind="cancelled",
                                              reason="cancelled")
        return session

    def drop_session(self, session: Session) -> None:
        """The session ends (closed, or idle too long): a poll waiting is answered, its tasks
        run on (any client can fetch their results)."""
        if self._sessions.get(session.name) is session:
            del self._sessions[session.name]
        if session.idle_timer is not None:
            session.idle_timer.cancel()
        self._answer_poll(session)
        for task in session.tasks.values():
            task.session = None
        session.tasks.clear()
        # One of its numbers that still comes is a task as any; a cancel recorded for it is forgotten.
        session.granted.clear()
        session.early.clear()
        for task_id, waiting in session.awaited.items():
            for reply, cmd_id, _ in waiting:
                self.table.reply(reply, protocol.error(cmd_id, UnknownTask(
                    f"task {task_id!r} is not here: its session ended before its submit arrived")), False)
        session.awaited.clear()

    def _answer_poll(self, session: Session) -> None:
        """A poll of ``session`` that waits is answered now, with the events it has not
        read. Never empty with a ``next`` past events it holds: a flush due in this turn
        (call_soon) comes after the poll's timer or an upgrade's answer, and the client,
        reading on from ``next``, would never see them."""
        if session.poll is not None:
            reply, cmd_id, timer = session.poll
            timer.cancel()
            session.poll = None
            self.table.reply(reply, protocol.ok(cmd_id, {"events": [e for _, e in session.events],
                                                         "next": session.seq}), False)

    def attach(self, session: Session | None, ref: Any, task: Task) -> None:
        """``task`` is ``session``'s, under ``ref``: what it does from now on is told there,
        and what it did already (started, or its end) is told at once."""
        if session is None or ref is None:
            return
        if task.state.terminal:
            task.session, task.ref = session, ref
            self._tell(task, ended_kind(task), ended_data(task))
            return
        if task.session is not None and task.session is not session:
            task.session.tasks.pop(task.ref, None)
        task.session, task.ref = session, ref
        session.tasks[ref] = task
        if task.state is T.RUNNING:
            self._tell(task, TaskEvent.STARTED, task.id)

    def poll(self, session: Session, after: int, timeout: float, reply: Reply, cmd_id: Any) -> Any:
        """What a polling session's tasks did since its event ``after`` (those before are
        forgotten): at once if there is something, else (DEFERRED) when there is, or after
        ``timeout`` (at most 30 s), empty. An older poll of the session is answered empty."""
        while session.events and session.events[0][0] <= after:
            _, done = session.events.popleft()
            session.held -= len(done[2]) if isinstance(done[2], str) else 0
        if session.events:
            return {"events": [e for _, e in session.events], "next": session.seq}
        self._answer_poll(session)

        def expire() -> None:
            if session.poll is not None and session.poll[0] is reply:
                self._answer_poll(session)

        session.poll = (reply, cmd_id, self.table.reactor.call_later(min(timeout, 30.0), expire))
        return protocol.DEFERRED

    def answer_waiting(self) -> None:
        """Answer what waits on the loop (a session's poll, a ``result --wait``) now, with
        what there is (an upgrade: both ask again, and the next image answers)."""
        for session in self._sessions.values():
            self._answer_poll(session)
            for task_id, waiting in session.awaited.items():
                for reply, cmd_id, _ in waiting:
                    self.table.reply(reply, protocol.ok(cmd_id, outcome(self.on_its_way(task_id))), False)
            session.awaited.clear()
        for task in self._live.values():
            for reply, cmd_id in task.waiters:
                self.table.reply(reply, protocol.ok(cmd_id, outcome(task.record())), False)
            task.waiters.clear()

    # -- workers --------------------------------------------------------------------------

    def _readable(self, worker: Worker) -> bool:
        """Read what the worker sent; False if there was nothing to read now."""
        data: bytes | memoryview
        try:
            if worker.pid == 0 or not worker.ready:  # HELLO and PIPES come with fds
                data, anc, _, _ = worker.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 4))
                fds = received_fds(anc)
            else:
                data, fds = self._rview[:worker.sock.recv_into(self._rbuf)], []
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno not in (errno.ECONNRESET,):
                log.warning("task socket: %s", err)
            data, fds = b"", []
        if not data:
            self._disconnected(worker)
            return True
        try:
            frames = worker.frames.feed(data, self._limit if worker.pid else self._hello_limit)
        except ValueError as err:
            for fd in fds:
                os.close(fd)
            log.error("task socket of %s: %s; closing it", self._name(worker), err)
            self._disconnected(worker)
            return True
        for kind, number, payload in frames:
            if worker.closed:
                break
            if kind & w.OVERSIZE:
                self._oversize(worker, kind & ~w.OVERSIZE, number, int.from_bytes(payload, "big"))
            elif kind == w.HELLO:
                self._hello(worker, number, fds, payload[0] if payload else 1)
                fds = []
            elif kind == w.PIPES and worker.pid and not worker.ready:
                if self.task_logs is not None:
                    self.task_logs.pipes(worker, fds)
                    fds = []
            else:
                self._frame(worker, kind, number, payload)
        for fd in fds:
            os.close(fd)
        return True

    def _limit(self, kind: int) -> int:
        """The largest payload an identified worker's frame of ``kind`` may have."""
        if kind in (w.RESULT, w.RAISED, w.RETRY):  # a RETRY may carry retry_on's exception
            return w.MAX_FRAME if self.result_max_bytes is None else self.result_max_bytes
        return LINE_MAX

    def _oversize(self, worker: Worker, kind: int, number: int, size: int) -> None:
        """A frame over its limit, seen on its header and read past unbuffered: a result
        or exception fails its task in one line (the worker lives on); anything else is
        a peer that is no worker of ours, or a broken one, and is closed."""
        task = worker.task
        if kind in (w.RESULT, w.RAISED, w.RETRY) and worker.pid and task is not None and task.n == number:
            limit = self.result_max_bytes
            assert limit is not None
            what = "result" if kind == w.RESULT else "exception"  # RETRY: retry_on's
            line = f"its {what} of {size} bytes is over the limit of {size_text(limit)} (--result-max-bytes)"
            self._frame(worker, w.UNPICKLABLE, number, line.encode("utf-8"))
            return
        log.warning("task socket of %s: a frame of kind %d and %d bytes, over its limit; closing it",
                    self._name(worker), kind, size)
        self._disconnected(worker)

    def _hello(self, worker: Worker, pid: int, fds: list[int], version: int) -> None:
        cred_pid = _CRED.unpack(worker.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
        proc = self.table.proc_by_pid(cred_pid) if cred_pid == pid and worker.pid == 0 else None
        rep = proc.replica if proc is not None else None
        xp = self._pools.get(rep.pool) if rep is not None else None
        if rep is None or xp is None or xp.closing or rep.state.terminal or rep.id in xp.workers or len(fds) != 1:
            if xp is not None and (xp.closing or rep is not None and rep.state.terminal):
                log.debug("task socket: %s connected as its pool closes; closed", rep.id if rep else cred_pid)
            else:
                log.warning("task socket: a connection from pid %d that is no worker of an executor pool; closed",
                            cred_pid)
            for fd in fds:
                os.close(fd)
            fds.clear()
            self._disconnected(worker)
            return
        memfd = fds.pop()
        try:
            worker.word = mmap.mmap(memfd, w.WORD.size * w.WORDS)
        except (OSError, ValueError) as err:
            log.warning("%s: its cancel word cannot be mapped (%s); closing its task socket", rep.id, err)
            os.close(memfd)
            self._disconnected(worker)
            return
        worker.word_fd = memfd  # kept: an upgrade hands it to the next image, which maps it again
        self._accepted.discard(worker)
        worker.pid, worker.replica, worker.pool, worker.version = pid, rep, xp, version
        xp.workers[rep.id] = worker
        if version >= 2:
            config: w.ConfigPayload = {"grace": xp.grace}
            if self.task_logs is not None and self.task_logs.wanted(rep.id):
                config["task_logs"] = True
            worker.writer.write(w.frame(w.CONFIG, 0, json.dumps(config).encode()))
        worker.writer.write(w.frame(w.WELCOME, xp.max_tasks, xp.init))

    def _frame(self, worker: Worker, kind: int, number: int, payload: bytes) -> None:
        xp = worker.pool
        if xp is None:
            return  # not identified: nothing but HELLO is read from it
        if kind == w.FIGURES:  # what the task it runs took; its answer comes next (first: one a task)
            task = worker.tasks[0] if worker.tasks else None
            if task is not None and task.n == number:
                taskfigures.attach(task, payload, self.table.metrics, self.table.journal.store)
            return
        if kind == w.READY:
            worker.ready = True
            if not xp.closing:
                self._now_idle(xp, worker)
            self._dispatch(xp)
            return
        if kind == w.UNPICKLABLE and number == 0:  # its initializer failed: it exits now
            xp.said = payload.decode("utf-8", "replace")
            return
        if kind in (w.STOPPED, w.KEPT) and (kind == w.KEPT or payload == bytes([w.REVOKE])):
            if worker.asked is None or number != worker.asks:
                log.warning("%s: an answer to an ask it was not asked; ignored", self._name(worker))
                return
            if kind == w.STOPPED:
                self._given_back(xp, worker)
                return
            kept = self._answered(worker)
            if kept is not None and worker.tasks and worker.tasks[0] is kept:
                self._head(worker)  # it started when its predecessor ended
            if len(worker.tasks) == 1 and self._room(xp, worker):
                xp.single.append(worker)
            self._dispatch(xp)  # the idle worker may ask another busy one
            return
        task = worker.task
        if task is not None and task is worker.asked and task.n == number:
            self._answered(worker)  # it ran and ended before the ask reached it
            self._head(worker)
        if task is None or task.n != number or kind not in (w.RESULT, w.RAISED, w.UNPICKLABLE, w.STOPPED, w.RETRY):
            log.warning("%s: an answer for a task it does not run; ignored", self._name(worker))
            return
        worker.tasks.popleft()
        xp.holders.discard(worker)
        task.worker = None
        self._released(task)
        if worker.kill_timer is not None:
            worker.kill_timer.cancel()
            worker.kill_timer = None
        if task.state is T.RUNNING:
            if kind == w.RESULT:
                self.end(task, T.DONE, "result", payload)
            elif kind == w.RAISED:
                try:
                    task.reason, payload = w.split_raised(payload)
                except struct.error:
                    task.reason = "raised an exception (its summary was unreadable)"
                self.end(task, T.FAILED, "raised", payload)
            elif kind == w.UNPICKLABLE:
                self.end(task, T.FAILED, "error", f"task {task.id}: " + payload.decode("utf-8", "replace"))
            elif kind == w.RETRY:
                self._retry(task, payload)
            else:  # STOPPED for a task we did not stop: cannot be; as a cancel
                self.end(task, T.CANCELLED, "cancelled", None)
        if self.task_logs is not None:
            self.task_logs.answered(worker, task)
        worker.done += 1
        if worker.tasks:
            self._head(worker)
        if xp.max_tasks and worker.done >= xp.max_tasks:
            if worker.replica is not None and not xp.closing:  # it exits now: replaced at once, not counted
                self.table.supervisor.renew(worker.replica, f"retired after {worker.done} tasks", now=True)
        elif not worker.tasks:
            if not xp.closing:
                self._now_idle(xp, worker)
        elif self._room(xp, worker):
            xp.single.append(worker)
        self._dispatch(xp)
        self._check_quiet(xp)

    def _given_back(self, xp: ExecPool, worker: Worker) -> None:
        """The worker gave the task asked back unstarted: first in the queue again, its
        cancel word the next task's."""
        task = self._answered(worker)
        if task is None or task not in worker.tasks:
            return
        worker.next_slot = task.slot
        if self.task_logs is not None:
            self.task_logs.given_back(worker, task)
        head = worker.tasks[0] is task
        worker.tasks.remove(task)
        xp.holders.discard(worker)
        self._released(task)
        if task.worker is worker:
            task.worker = None
        if task.state is T.QUEUED:
            xp.queue.push_front(task)  # at its place: next of its priority
        if head and worker.tasks:
            self._head(worker)
        if not xp.closing:
            if not worker.tasks:
                self._now_idle(xp, worker)
            elif len(worker.tasks) == 1 and self._room(xp, worker):
                xp.single.append(worker)
        self._dispatch(xp)
        self._check_quiet(xp)

    def _now_idle(self, xp: ExecPool, worker: Worker) -> None:
        """``worker`` has no task: first for the next one; an elastic pool's retires once
        it has stayed so for its idle_timeout."""
        xp.idle.append(worker)
        self._elastic.idle(xp, worker)

    # -- why a task waits, and a pool's workers (``tasks``, ``status``) -------------------

    def waiting(self, task: Task) -> str | None:
        """Why ``task`` has not started, in a few words ("all 4 workers busy", "worker
        starting", "memory budget 512 MiB reached (480 MiB used)"; WAITING: its reason);
        None once it has started."""
        if task.state is T.WAITING:
            return task.wait_reason
        if task.state is not T.QUEUED:
            return None
        worker = task.worker
        if worker is not None:
            return f"held by {self._name(worker)}, behind the task it runs"
        return self._elastic.waiting(task.pool)

    def parked(self, xp: ExecPool) -> int:
        """How many of ``xp``'s tasks are WAITING for their time (``status``, the metrics)."""
        return self._waits.count(xp.name)

    def start_held(self, rep: Replica, begun: int) -> str | None:
        """Why ``rep``, a PENDING worker of an executor pool, may not start now (its pool's
        memory budget: elastic.Elastic.start_held); None: it may. Spawning asks before each
        start, ``begun``: how many of that pool's it has started in this batch."""
        xp = self._pools.get(rep.pool)
        pool = self.table.pool(rep.pool)
        if xp is None or pool is None:
            return None
        return self._elastic.start_held(xp, pool, rep, begun)

    def workers(self, xp: ExecPool) -> Doc:
        """``xp``'s workers for ``status``: busy, idle, starting, min, max and, with a
        memory_budget, ``budget``: {used, limit} in bytes (elastic.Elastic.counts)."""
        return self._elastic.counts(xp)

    def _released(self, task: Task) -> None:
        """No worker holds ``task`` any more: one that ended while a worker had it (a
        cancel, a timeout, a shutdown) is told ``stopped`` (``TaskFuture.wait_stopped``)."""
        if task.stopping:
            task.stopping = False
            self._tell(task, TaskEvent.STOPPED, None)

    def _check_quiet(self, xp: ExecPool) -> None:
        """A closing pool whose workers have all answered for their tasks (or are gone):
        what waited for that goes on (the pool's deletion: SIGTERM only reaches workers
        whose tasks' cleanup is over)."""
        if xp.on_quiet is None:
            return
        if any(wk.tasks and not wk.closed for wk in xp.workers.values()):
            return
        then, xp.on_quiet = xp.on_quiet, None
        then()

    def stop_pool(self, xp: ExecPool, *, cancel: bool, then: Callable[[], None]) -> None:
        """The executor shuts its pool down: queued tasks are cancelled (``cancel``) or
        failed; each running task gets one exception, ``Terminated``, and its cleanup runs
        undisturbed until it answers or the pool's grace passes (then its tree is killed);
        ``then()`` once no worker is busy."""
        xp.closing = True
        self._elastic.stop(xp)
        if xp.rss_timer is not None:
            xp.rss_timer.cancel()
        running = {wk.tasks[0].id for wk in xp.workers.values()
                   if wk.tasks and wk.tasks[0].state is T.RUNNING and not wk.closed}
        for task in [t for t in self._live.values() if t.pool is xp]:
            worker = task.worker
            if cancel:
                self.shut_down(task)
            elif task.id in running and worker is not None:
                self.end(task, T.FAILED, "interrupted", self.stop_reason)
                self._interrupt(worker, task, w.SHUTDOWN)
            else:
                self.end(task, T.FAILED, "unrun", self.stop_reason)
        xp.on_quiet = then
        self._check_quiet(xp)

    def _disconnected(self, worker: Worker) -> None:
        """EOF or a broken peer: stop reading. Its task is settled when its replica has
        ended (worker_ended), by then with the exit's reason."""
        if worker.closed:
            return
        self.table.reactor.remove_reader(worker.sock.fileno())
        worker.closed = True
        self._accepted.discard(worker)
        if worker.pid == 0:
            self._close(worker)

    def _close(self, worker: Worker) -> None:
        self._elastic.busy(worker)  # gone: it does not retire either
        if not worker.closed:
            self.table.reactor.remove_reader(worker.sock.fileno())
            worker.closed = True
        if worker.kill_timer is not None:
            worker.kill_timer.cancel()
        if worker.kick_timer is not None:
            worker.kick_timer.cancel()
        worker.sock.close()
        self.table.reactor.remove_writer(worker.writer)
        try:
            worker.writer.close()
        except OSError:
            pass
        if worker.word is not None:
            worker.word.close()
            worker.word = None
        if worker.word_fd >= 0:
            os.close(worker.word_fd)
            worker.word_fd = -1

    def worker_ended(self, rep: Replica) -> None:
        """``rep`` has ended and its processes are gone (engine._record_end): the task it
        ran is queued again (retries left) or failed with the reason, and it is forgotten."""
        xp = self._pools.get(rep.pool)
        worker = xp.workers.pop(rep.id, None) if xp is not None else None
        if worker is None or xp is None:
            return
        # What it said before it died counts: a result still in the socket stands.
        while not worker.closed and worker.tasks and self._readable(worker):
            pass
        self._close(worker)
        task = worker.task
        if task is not None and task is worker.asked and task.state is T.QUEUED:
            self._answered(worker)  # asked back, no answer: it may have begun, so as if it had
            self._head(worker)
        waited = list(worker.tasks)[1:]
        for held in worker.tasks:
            self._released(held)
        worker.tasks.clear()
        xp.holders.discard(worker)
        worker.asked = None
        for never in reversed(waited):  # sent, never started (still QUEUED): first in the queue again
            never.worker = None
            never.asked_back = False
            if never.state is T.QUEUED:
                xp.queue.push_front(never)
        if task is not None and task.state is T.RUNNING:
            task.worker = None
            memory = self._memory_reason(xp, worker, rep)  # it passed memory_max: it would again
            reason = self.stop_reason if self.table.closing else memory or worker.lost_reason or how_it_ended(rep)
            if task.may_run_again() and not xp.closing and memory is None:
                # Cut short by something not its own doing: it runs again (after the next
                # start, if the daemon is stopping), the attempt counted.
                self.requeue(task, f"its worker {rep.id} was lost ({reason})")
            else:  # a stop of the loop is no loss of the worker: its own kind (TaskInterrupted)
                self.end(task, T.FAILED, "interrupted" if self.table.closing else "lost", reason)
        if self.task_logs is not None:
            self.task_logs.worker_ended(worker, task)
        self._dispatch(xp)
        self._check_quiet(xp)
        self.table.changed()

    def requeue(self, task: Task, why: str) -> None:
        """``task``, cut short by something not its own doing (its worker lost, the daemon
        died), is queued again, first in its pool's queue, the attempt counted."""
        old = task.state
        task.state = task_transition(task.id, task.state, T.QUEUED)
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None
        task.worker = None
        task.asked_back = False
        task.pool.queue.push_front(task)
        self._save(task, old)
        log.info("%s: %s; queued again (attempt %d of %d)", task.id, why, task.attempts + 1, task.retries + 1)

    def settle(self) -> None:
        """A turn changed something: a pool that no longer replaces its workers fails what
        it has queued (no future waits forever); a closed pool whose workers are all gone
        is forgotten."""
        for xp in list(self._pools.values()):
            if xp.queue:
                self._hopeless(xp)
            if xp.closing and not xp.workers:
                pool = self.table.pool(xp.name)
                if pool is None or not pool.live:
                    del self._pools[xp.name]

    def _hopeless(self, xp: ExecPool) -> None:
        if self.table.closing:
            return  # a stopping daemon keeps its queued tasks for the next start
        pool = self.table.pool(xp.name)
        if pool is None:
            return
        if pool.deleted and not xp.closing:
            why = f"executor pool {xp.name} was deleted"
        elif pool.state == CRASHLOOP and not any(not r.state.terminal for r in pool.live.values()) and not pool.pending:
            why = f"executor pool {xp.name} stopped replacing its workers: {pool.reason}"
            if xp.said:
                why += f" ({xp.said})"
        else:
            return
        while (task := xp.queue.pop()) is not None:
            if task.state is T.QUEUED:
                self.end(task, T.FAILED, "unrun", why)

    # -- memory_max without a memory controller (taskmemory.py) -----------------------------

    def _watch_memory(self, xp: ExecPool) -> None:
        """Start or stop the poll of ``xp``'s memory_max for its options now: polled where
        no memory controller enforces it (a config reload may add or drop the limit)."""
        limit = xp.options.get("memory_max")
        xp.rss_check = limit is not None and not self._cgroup_memory(limit)
        if xp.rss_check and xp.rss_timer is None:
            xp.rss_timer = self.table.reactor.call_later(CHECK_INTERVAL, lambda: self._check_rss(xp))

    def _memory_busy(self, xp: ExecPool | None) -> None:
        """A task starts in ``xp``: its next check within CHECK_INTERVAL (an idle pool's
        comes only every IDLE_INTERVAL)."""
        timer = xp.rss_timer if xp is not None else None
        if xp is None or timer is None or timer.deadline <= self.table.reactor.monotonic() + CHECK_INTERVAL:
            return
        timer.cancel()
        xp.rss_timer = self.table.reactor.call_later(CHECK_INTERVAL, lambda: self._check_rss(xp))

    def _check_rss(self, xp: ExecPool) -> None:
        """memory_max where no memory controller enforces it: the resident memory of each
        worker's whole tree (taskmemory.TreeMemory), every CHECK_INTERVAL while one runs a
        task, else every IDLE_INTERVAL. One past the limit is killed, its tree with it (its
        task fails with the reason, not retried), and replaced as a worker that died is."""
        xp.rss_timer = None
        limit = xp.options.get("memory_max")
        if xp.closing or self._pools.get(xp.name) is not xp or not xp.rss_check or limit is None:
            return
        busy = False
        for worker in list(xp.workers.values()):
            proc = self._proc(worker)
            if proc is None or worker.closed or worker.over_memory:
                continue
            busy = busy or bool(worker.tasks)
            used, outside = self._memory.measure(proc.pid, proc.cgroup)
            if used > limit:
                worker.over_memory = True
                log.warning("%s: its process tree holds %.0f MiB, over memory_max",
                            worker.replica.id if worker.replica else "?", used / (1 << 20))
                proc.escaped += outside  # what left its group: the kill after the grace reaches it too
                # renew: replaced at once and not counted as a crash (its task's doing, not
                # the worker's): a few greedy requests must not put the pool in a crash loop.
                self._kill(worker, f"memory limit {size_text(limit)} exceeded", renew=True)
        xp.rss_timer = self.table.reactor.call_later(CHECK_INTERVAL if busy else IDLE_INTERVAL,
                                                     lambda: self._check_rss(xp))

    def _memory_reason(self, xp: ExecPool, worker: Worker, rep: Replica) -> str | None:
        """Why ``worker`` was lost if memory_max killed it (our kill, or the kernel's in its
        cgroup with memory.max), else None."""
        if worker.over_memory:
            return worker.lost_reason
        limit = xp.options.get("memory_max")
        if limit is not None and not xp.rss_check and rep.reason == "OOM-killed":
            return f"memory limit {size_text(limit)} exceeded"
        return None

    def _proc(self, worker: Worker) -> Proc | None:
        rep = worker.replica
        proc = self.table.proc_of(rep) if rep is not None else None
        return proc if proc is not None and not proc.reaped else None

    def close(self) -> None:
        """End every session (a poll waiting is answered before the loop goes), release the
        listener and every connection (the loop is closing)."""
        for session in list(self._sessions.values()):
            self.drop_session(session)
        for xp in self._pools.values():
            for worker in xp.workers.values():
                self._close(worker)
        if self.task_logs is not None:
            self.task_logs.close()
        for worker in list(self._accepted):
            self._close(worker)
        self._accepted.clear()
        for conn, timer in self._parked.values():
            timer.cancel()
            conn.close()
        self._parked.clear()
        if self._listener is not None:
            self.table.reactor.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            if not self._address.startswith("@"):
                try:
                    os.unlink(self._address)
                except OSError:
                    pass


def _rank(task: Task) -> tuple[tuple[int, int], int]:
    """Which of two held tasks starts first: the higher lane (taskqueue.lane_key), then the
    older (its number), as a sort key."""
    key = lane_key(task)
    return (-key[0], -key[1]), task.n


def _ahead(held: Task, sent: Task) -> bool:
    """Would ``held`` (sent to a busy worker to wait there) have started before ``sent``
    (which a free worker took)? Then it is asked back for the next free worker."""
    return _rank(held) < _rank(sent)
