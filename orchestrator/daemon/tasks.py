"""The tasks of executor pools: queued, handed to workers, ended. Loop thread only.

An executor pool is a pool like any other (its replicas run ``orchestrator.taskworker``,
supervised, restarted and shown as every replica is) plus what this module keeps: its
queue of tasks, and for each worker the one task it runs. The loop alone hands a task to a
worker, so at every moment it knows which worker runs which task; a cancel or a timeout
is delivered for that task's number (the cancel word, taskwire.py) and can never land in
the task a worker runs next.

    submit ─► QUEUED ─► (an idle worker) ─► RUNNING ─► RESULT: DONE   RAISED: FAILED
                 ▲                            │ cancel ─► CANCELLED ┐ Cancelled raised in it;
                 │                            │ timeout ─► TIMED_OUT┘ still busy after grace:
                 └── its worker died, retries left                    its tree killed
                                              └ its worker died ─► FAILED (WorkerLost, reason)

Workers connect to one listener (``$ORCHESTRATOR_TASK_SOCKET``, an abstract socket unless
a path is given); a connection is accepted only from the main process of a live replica
of an executor pool (SO_PEERCRED), once. The loop never unpickles a task or a result: it
moves opaque bytes between the submitting session and the worker. What a session hears
(``sink``): ``(kind, ref, data, task id)`` with kind one of started, result, raised,
error (data: a line), cancelled, timeout, lost (data: the reason).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import mmap
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .. import protocol, signals
from .. import taskwire as w
from ..errors import InvalidSpec, UnknownReplica
from ..states import Replica
from ..states import ReplicaState as S
from ..states import TaskState as T
from ..states import task_transition
from .pools import CRASHLOOP, Pool
from .reactor import BufferedWriter, Reactor, Timer

log = logging.getLogger("orchestrator")
Reply = Callable[[dict], None]
Sink = Callable[[tuple], Any]
WORKER_TARGET = "orchestrator.taskworker:main"
RSS_INTERVAL = 1.0  # memory_max without a memory controller: each worker's RSS this often
_PAGE = os.sysconf("SC_PAGE_SIZE")
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
OPTION_KEYS = ("max_tasks_per_child", "timeout", "grace", "retries", "memory_max")


class Table(Protocol):
    """What the task table asks of the replica table (engine.Engine)."""

    reactor: Reactor
    os: Any
    containment: Any
    supervisor: Any
    closing: bool

    def pool(self, name: Any) -> Pool | None: ...
    def proc_by_pid(self, pid: int) -> Any: ...
    def proc_of(self, rep: Replica) -> Any: ...
    def changed(self) -> None: ...
    def reply(self, reply: Reply, msg: dict, durable: bool) -> None: ...


@dataclass(eq=False, slots=True)
class Task:
    id: str
    n: int
    pool: "ExecPool"
    payload: bytes
    ref: Any  # the submitting session's name for it
    session: "Session | None"
    timeout: float | None
    retries: int
    state: T = T.QUEUED
    attempts: int = 0
    worker: "Worker | None" = None
    queued_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    timer: Timer | None = None


@dataclass(eq=False)
class Worker:
    """One connection from a worker process, from its accept until its replica ended."""

    sock: socket.socket
    writer: BufferedWriter
    frames: w.Frames = field(default_factory=w.Frames)
    pid: int = 0  # 0 until its HELLO identified it
    replica: Replica | None = None
    pool: "ExecPool | None" = None
    word: mmap.mmap | None = None
    ready: bool = False
    task: Task | None = None  # sent to it, not answered yet
    done: int = 0
    kill_timer: Timer | None = None
    lost_reason: str | None = None  # why the loop killed it, if it did
    closed: bool = False


@dataclass(eq=False)
class ExecPool:
    name: str
    options: dict
    init: bytes
    queue: collections.deque = field(default_factory=collections.deque)
    idle: collections.deque = field(default_factory=collections.deque)
    workers: dict[str, Worker] = field(default_factory=dict)  # replica id -> its connection
    next_n: int = 1
    rss_timer: Timer | None = None
    rss_check: bool = False  # memory_max by RSS: no memory controller here
    said: str | None = None  # the last worker's complaint (its initializer failed)
    closing: bool = False

    @property
    def max_tasks(self) -> int:
        return self.options.get("max_tasks_per_child") or 0

    @property
    def grace(self) -> float:
        return float(self.options["grace"])


@dataclass(eq=False)
class Session:
    """One submitter (an embedded ``Executor``): where its tasks' ends are told."""

    name: str
    sink: Sink
    tasks: dict[Any, Task] = field(default_factory=dict)  # ref -> task, until it ended


class Tasks:
    """See the module docstring."""

    def __init__(self, table: Table, *, address: str | None = None, token: str | None = None) -> None:
        self.table = table
        self._address = address or f"@orchestrator-tasks-{token or os.getpid()}-{os.getpid()}"
        self._listener: socket.socket | None = None
        self._pools: dict[str, ExecPool] = {}
        self._sessions: dict[str, Session] = {}
        self._accepted: set[Worker] = set()  # connected, not identified yet

    def commands(self) -> dict[str, Callable[[dict, Reply, Any], Any]]:
        return {"executor": self._cmd_executor, "task_submit": self._cmd_submit,
                "task_cancel": self._cmd_cancel, "executor_close": self._cmd_close}

    # -- the listener -------------------------------------------------------------------

    def _listen(self) -> None:
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
            conn.setblocking(False)
            try:
                out = os.dup(conn.fileno())  # its own fd: the reactor watches one fd per direction
            except OSError as err:
                log.error("task listener: %s", err)
                conn.close()
                continue
            worker = Worker(conn, BufferedWriter(out))
            self._accepted.add(worker)
            self.table.reactor.add_reader(conn.fileno(), functools.partial(self._readable, worker))

    # -- commands -----------------------------------------------------------------------

    def _cmd_executor(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        """Open (or join) an executor pool, and register the session that submits to it."""
        name = protocol.pool_name(args.get("pool"))
        size = protocol.count(args.get("size"), what="max_workers")
        options = _options(args.get("options"))
        init = args.get("init") or b""
        if not isinstance(init, bytes):
            raise InvalidSpec("init must be bytes")
        spec = args.get("spec")
        if not isinstance(spec, dict) or spec.get("target") != WORKER_TARGET:
            raise InvalidSpec("an executor pool's spec runs " + WORKER_TARGET)
        self._listen()
        spec = {**spec, "env": {**(spec.get("env") or {}), w.SOCKET_ENV: self._address}}
        policy: dict[str, Any] = {"restart": "always", "grace": options["grace"]}
        rss = False
        if options.get("memory_max") is not None:
            try:
                self.table.containment.check_limits({"memory_max": options["memory_max"]})
                policy["memory_max"] = options["memory_max"]
            except InvalidSpec:
                rss = True  # no memory controller here: the worker's RSS, checked every second
        xp = self._pools.get(name)
        if xp is not None and not xp.closing:
            if xp.options != options or xp.init != init:
                raise InvalidSpec(f"executor pool {name!r} runs with other options: use another pool name")
        pool, ids = self.table.supervisor.open_pool(name, spec, policy, size)
        if xp is None or xp.closing:
            xp = self._pools[name] = ExecPool(name, options, init, next_n=xp.next_n if xp else 1)
            xp.rss_check = rss
            if rss:
                xp.rss_timer = self.table.reactor.call_later(RSS_INTERVAL, lambda: self._check_rss(xp))
        session = args.get("session")
        sink = args.get("sink")
        if session is not None:
            if not callable(sink):
                raise InvalidSpec("a session needs a sink")
            self._sessions[str(session)] = Session(str(session), sink)
        return {"pool": pool.name, "ids": ids}

    def _cmd_submit(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        xp = self._exec_pool(args.get("pool"))
        session = self._sessions.get(str(args.get("session")))
        payload = args.get("payload")
        if not isinstance(payload, bytes):
            raise InvalidSpec("a task's payload must be bytes")
        opts = xp.options
        timeout = args.get("timeout", opts.get("timeout"))
        if timeout is not None:
            timeout = protocol.seconds(timeout, "timeout")
        retries = args.get("retries", opts.get("retries", 0))
        task = Task(f"{xp.name}/{xp.next_n}", xp.next_n, xp, payload, args.get("ref"), session,
                    timeout, int(retries), queued_at=self.table.os.monotonic())
        xp.next_n += 1
        if session is not None:
            session.tasks[task.ref] = task
        xp.queue.append(task)
        self._dispatch(xp)
        if task.state is T.QUEUED:
            self._hopeless(xp)
        return task.id

    def _cmd_cancel(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        """Cancel tasks, by the session's refs: for each, True if it is cancelled (now or
        before), False if it had ended otherwise (its result stands)."""
        session = self._sessions.get(str(args.get("session")))
        if session is None:
            raise UnknownReplica(f"unknown session {args.get('session')!r}")
        # A ref it no longer holds has ended: cancelled (the submitter knows it is) or with a
        # result on its way, which stands.
        return [self.cancel(task) if (task := session.tasks.get(ref)) is not None else False
                for ref in args.get("refs") or ()]

    def _cmd_close(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        """Shut an executor pool down: its unfinished tasks cancelled (``cancel``) or
        failed, its workers stopped; the reply once every one of them is reaped."""
        xp = self._exec_pool(args.get("pool"))
        cancel = bool(args.get("cancel"))
        for task in [t for t in xp.queue] + [wk.task for wk in xp.workers.values() if wk.task is not None]:
            if cancel:
                self.cancel(task)
            elif not task.state.terminal:
                self._end(task, T.FAILED, "lost", "interrupted: the executor shut down")
        xp.closing = True
        if xp.rss_timer is not None:
            xp.rss_timer.cancel()
        self._sessions.pop(str(args.get("session")), None)
        ids = self.table.supervisor.delete_pool(xp.name)
        timeout = protocol.wait_timeout(args)
        return self.table.supervisor.wait_ended(ids, reply, cmd_id, timeout)

    def _exec_pool(self, name: Any) -> ExecPool:
        xp = self._pools.get(name) if isinstance(name, str) else None
        if xp is None or xp.closing:
            raise UnknownReplica(f"unknown executor pool {name!r}")
        return xp

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
        self._end(task, T.CANCELLED, "cancelled", "cancelled")
        if worker is not None:
            self._interrupt(worker, task, w.CANCEL)
        return True

    def _dispatch(self, xp: ExecPool) -> None:
        while xp.queue and xp.idle:
            task = xp.queue[0]
            if task.state is not T.QUEUED:
                xp.queue.popleft()
                continue
            worker = xp.idle.popleft()
            if worker.closed or worker.task is not None:
                continue
            xp.queue.popleft()
            task.state = task_transition(task.id, task.state, T.RUNNING)
            task.attempts += 1
            task.worker, worker.task = worker, task
            task.started_at = self.table.os.monotonic()
            worker.writer.write(w.frame(w.TASK, task.n, task.payload))
            if task.timeout is not None:
                task.timer = self.table.reactor.call_later(task.timeout, functools.partial(self._timed_out, task))
            self._tell(task, "started", task.id)

    def _timed_out(self, task: Task) -> None:
        worker = task.worker
        if task.state is not T.RUNNING or worker is None:
            return
        self._end(task, T.TIMED_OUT, "timeout", [f"task {task.id} ran past its timeout of {task.timeout:g} s",
                                                 task.timeout])
        self._interrupt(worker, task, w.TIMEOUT)

    def _interrupt(self, worker: Worker, task: Task, cause: int) -> None:
        """The exception of ``cause`` raised in ``task``, in its worker; the worker's whole
        tree killed if it has not answered for the task ``grace`` seconds later."""
        if worker.word is None or worker.closed or worker.task is not task:
            return
        worker.word[:] = w.WORD.pack(w.cancel_word(task.n, cause))
        proc = self._proc(worker)
        if proc is None:
            return
        signals.to_child(proc.pid, w.CANCEL_SIGNAL)
        what = "cancel" if cause == w.CANCEL else "timeout"
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
        log.warning("%s: %s; killing its process tree", worker.replica.id if worker.replica else "?", why)
        if renew and worker.replica is not None and worker.pool is not None and not worker.pool.closing:
            self.table.supervisor.renew(worker.replica, why, now=True)
        self.table.containment.kill_after_grace(proc)

    def _end(self, task: Task, state: T, kind: str, data: Any) -> None:
        task.state = task_transition(task.id, task.state, state)
        task.ended_at = self.table.os.monotonic()
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None
        task.worker = None  # a worker still busy with it keeps it as its ``task`` until it answers
        task.reason = data if isinstance(data, str) else data[0] if isinstance(data, list) else None
        self._tell(task, kind, data)
        if task.session is not None:
            task.session.tasks.pop(task.ref, None)
        self.table.changed()

    def _tell(self, task: Task, kind: str, data: Any) -> None:
        session = task.session
        if session is None:
            return
        try:
            session.sink((kind, task.ref, data, task.id))
        except Exception:  # a sink is the submitter's: its failure is not the loop's
            log.exception("executor session %s: its sink failed", session.name)

    # -- workers --------------------------------------------------------------------------

    def _readable(self, worker: Worker) -> bool:
        """Read what the worker sent; False if there was nothing to read now."""
        try:
            if worker.pid == 0:
                data, anc, _, _ = worker.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 4))
                fds = _fds(anc)
            else:
                data, fds = worker.sock.recv(1 << 20), []
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
            frames = worker.frames.feed(data)
        except ValueError as err:
            for fd in fds:
                os.close(fd)
            log.error("task socket of %s: %s; closing it", worker.replica.id if worker.replica else "a worker", err)
            self._disconnected(worker)
            return True
        for kind, number, payload in frames:
            if worker.closed:
                break
            if kind == w.HELLO:
                self._hello(worker, number, fds)
                fds = []
            else:
                self._frame(worker, kind, number, payload)
        for fd in fds:
            os.close(fd)
        return True

    def _hello(self, worker: Worker, pid: int, fds: list[int]) -> None:
        cred_pid = _CRED.unpack(worker.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
        proc = self.table.proc_by_pid(cred_pid) if cred_pid == pid and worker.pid == 0 else None
        rep = proc.replica if proc is not None else None
        xp = self._pools.get(rep.pool) if rep is not None else None
        if rep is None or xp is None or xp.closing or rep.state.terminal or rep.id in xp.workers or len(fds) != 1:
            log.warning("task socket: a connection from pid %d that is no worker of an executor pool; closed", cred_pid)
            for fd in fds:
                os.close(fd)
            fds.clear()
            self._disconnected(worker)
            return
        try:
            worker.word = mmap.mmap(fds[0], w.WORD.size)
        except (OSError, ValueError) as err:
            log.warning("%s: its cancel word cannot be mapped (%s); closing its task socket", rep.id, err)
            self._disconnected(worker)
            return
        finally:
            os.close(fds[0])
            fds.clear()
        self._accepted.discard(worker)
        worker.pid, worker.replica, worker.pool = pid, rep, xp
        xp.workers[rep.id] = worker
        worker.writer.write(w.frame(w.WELCOME, xp.max_tasks, xp.init))

    def _frame(self, worker: Worker, kind: int, number: int, payload: bytes) -> None:
        xp = worker.pool
        if xp is None:
            return  # not identified: nothing but HELLO is read from it
        if kind == w.READY:
            worker.ready = True
            xp.idle.append(worker)
            self._dispatch(xp)
            return
        if kind == w.UNPICKLABLE and number == 0:  # its initializer failed: it exits now
            xp.said = payload.decode("utf-8", "replace")
            return
        task = worker.task
        if task is None or task.n != number or kind not in (w.RESULT, w.RAISED, w.UNPICKLABLE, w.STOPPED):
            log.warning("%s: an answer for a task it does not run; ignored", worker.replica.id if worker.replica else "?")
            return
        worker.task = None
        task.worker = None
        if worker.kill_timer is not None:
            worker.kill_timer.cancel()
            worker.kill_timer = None
        if task.state is T.RUNNING:
            if kind == w.RESULT:
                self._end(task, T.DONE, "result", payload)
            elif kind == w.RAISED:
                self._end(task, T.FAILED, "raised", payload)
            elif kind == w.UNPICKLABLE:
                self._end(task, T.FAILED, "error", f"task {task.id}: " + payload.decode("utf-8", "replace"))
            else:  # STOPPED for a task we did not stop: cannot be; as a cancel
                self._end(task, T.CANCELLED, "cancelled", None)
        worker.done += 1
        if xp.max_tasks and worker.done >= xp.max_tasks:
            if worker.replica is not None and not xp.closing:  # it exits now: replaced at once, not counted
                self.table.supervisor.renew(worker.replica, f"retired after {worker.done} tasks", now=True)
        elif not xp.closing:
            xp.idle.append(worker)
        self._dispatch(xp)

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
        if not worker.closed:
            self.table.reactor.remove_reader(worker.sock.fileno())
            worker.closed = True
        if worker.kill_timer is not None:
            worker.kill_timer.cancel()
        worker.sock.close()
        try:
            worker.writer.close()
        except OSError:
            pass
        if worker.word is not None:
            worker.word.close()
            worker.word = None

    def worker_ended(self, rep: Replica) -> None:
        """``rep`` has ended and its processes are gone (engine._record_end): the task it
        ran is queued again (retries left) or failed with the reason, and it is forgotten."""
        xp = self._pools.get(rep.pool)
        worker = xp.workers.pop(rep.id, None) if xp is not None else None
        if worker is None or xp is None:
            return
        # What it said before it died counts: a result still in the socket stands.
        while not worker.closed and worker.task is not None and self._readable(worker):
            pass
        self._close(worker)
        task = worker.task
        worker.task = None
        if task is not None and task.state is T.RUNNING:
            task.worker = None
            if self.table.closing:
                reason = "interrupted: the executor shut down"
            else:
                reason = worker.lost_reason or _how_it_ended(rep)
            if task.attempts <= task.retries and not self.table.closing and not xp.closing:
                task.state = task_transition(task.id, task.state, T.QUEUED)
                if task.timer is not None:
                    task.timer.cancel()
                    task.timer = None
                xp.queue.appendleft(task)
                log.info("%s: its worker %s was lost (%s); queued again (attempt %d of %d)",
                         task.id, rep.id, reason, task.attempts + 1, task.retries + 1)
            else:
                self._end(task, T.FAILED, "lost", reason)
        self._dispatch(xp)
        self.table.changed()

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
        while xp.queue:
            task = xp.queue.popleft()
            if task.state is T.QUEUED:
                self._end(task, T.FAILED, "unrun", why)

    def _check_rss(self, xp: ExecPool) -> None:
        """memory_max where no memory controller enforces it: each worker's RSS, every
        RSS_INTERVAL; one past the limit is killed (its task lost, with the reason), and
        replaced as a worker that died is."""
        if xp.closing or self._pools.get(xp.name) is not xp:
            return
        limit = xp.options["memory_max"]
        for worker in list(xp.workers.values()):
            proc = self._proc(worker)
            if proc is None or worker.closed:
                continue
            try:
                with open(f"/proc/{proc.pid}/statm", "rb") as f:
                    rss = int(f.read().split()[1]) * _PAGE
            except (OSError, ValueError, IndexError):
                continue
            if rss > limit:
                self._kill(worker, f"memory limit {_size(limit)} exceeded", renew=False)
        xp.rss_timer = self.table.reactor.call_later(RSS_INTERVAL, lambda: self._check_rss(xp))

    def _proc(self, worker: Worker) -> Any:
        rep = worker.replica
        proc = self.table.proc_of(rep) if rep is not None else None
        return proc if proc is not None and not proc.reaped else None

    def close(self) -> None:
        """Release the listener and every connection (the loop is closing)."""
        for xp in self._pools.values():
            for worker in xp.workers.values():
                self._close(worker)
        for worker in list(self._accepted):
            self._close(worker)
        self._accepted.clear()
        if self._listener is not None:
            self.table.reactor.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            if not self._address.startswith("@"):
                try:
                    os.unlink(self._address)
                except OSError:
                    pass


def _options(raw: Any) -> dict:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidSpec("options must be an object")
    unknown = set(raw) - set(OPTION_KEYS)
    if unknown:
        raise InvalidSpec(f"unknown executor option {sorted(unknown)[0]!r}")
    out: dict[str, Any] = {}
    mtpc = raw.get("max_tasks_per_child")
    if mtpc is not None:
        out["max_tasks_per_child"] = protocol.count(mtpc, what="max_tasks_per_child")
    if raw.get("timeout") is not None:
        out["timeout"] = protocol.seconds(raw["timeout"], "timeout")
    out["grace"] = protocol.seconds(raw.get("grace", 5.0), "grace")
    retries = raw.get("retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidSpec(f"retries must be a whole number of at least 0, got {retries!r}")
    out["retries"] = retries
    mem = raw.get("memory_max")
    if mem is not None:
        if isinstance(mem, bool) or not isinstance(mem, int) or mem < 1 << 20:
            raise InvalidSpec(f"memory_max must be a number of bytes of at least 1 MiB, got {mem!r}")
        out["memory_max"] = mem
    return out


def _how_it_ended(rep: Replica) -> str:
    """A worker's end as WorkerLost says it: ``exited with 3``, ``killed by SIGKILL``,
    ``OOM-killed``."""
    code = rep.exit_code
    if code is not None and code >= 0 and rep.reason == f"exit code {code}":
        return f"exited with {code}"
    return rep.reason or "ended"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _fds(anc: list) -> list[int]:
    out: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            out.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    return out
