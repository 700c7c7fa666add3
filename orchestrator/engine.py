"""The control loop: the one owner of the replica table.

    commands (any thread, the channel)      worker processes          watchdog, manager
        │ submit(): deque + wakeup pipe       │ pidfd readable on exit   │ pidfd
        ▼                                     │ ready pipe: EOF = runs    │
    ┌──────────────────── one epoll wait per turn ─────────────────────────────┐
    │ 1. dispatch ready fds: exits (kill group remnants, reap, transition),    │
    │    ready pipes (STARTING -> RUNNING / FAILED), wakeups, extra readers     │
    │ 2. apply queued commands            3. fork pending replicas (bounded)   │
    │ 4. fire due timers (SIGKILL after grace, wait time-outs)                 │
    │ 5. settle: waiters, one store commit, then replies, then the watchdog feed│
    └──────────────────────────────────────────────────────────────────────────┘

Nothing but this loop reads or writes a Replica, a Pool or the process table, so there is
no lock, and a terminate can never race a reap: both are events, applied one after the
other, and whichever comes second finds a state that tells it what is left to do. Every
state change goes through states.transition(); a process is signalled only while it is
our unreaped child (its zombie pins the pid and the process group), and forgotten only
after it is reaped.

Exit detection is event-driven: one pidfd per worker in the epoll set. In daemon mode the
loop is also a child subreaper and reaps orphans it inherits (``reap_orphans``); in the
embedded API it waits only for its own pids, so it never steals the host program's children.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import os
import re
import selectors
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .errors import InvalidSpec, OrchestratorError, ShuttingDown, UnknownReplica
from .spawner import OSApi, exit_reason
from .spec import WorkerSpec, resolve_executable, resolve_target
from .states import ReplicaState as S
from .states import Replica, transition

log = logging.getLogger("orchestrator")

Reply = Callable[[dict], None]
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_LIVE = (S.PENDING, S.STARTING, S.RUNNING)  # counted against a pool's desired size
_DEFERRED = object()

# selector key kinds
_WAKEUP, _EXIT, _READY, _CHILD, _READER, _WRITER = range(6)


MAX_COUNT = 10_000  # replicas one launch may add, and the largest size a scale may set


def _wait_timeout(args: dict) -> float:
    """A wait's bound, checked before the command does anything (a NaN would stall the
    timer heap; a bool is no number of seconds)."""
    timeout = args.get("timeout")
    if timeout is None:
        return 3600.0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
        math.isfinite(timeout) and timeout >= 0
    ):
        raise InvalidSpec(f"timeout must be a finite non-negative number, got {timeout!r}")
    return float(timeout)


def drain(fd: int) -> None:
    """Empty a non-blocking wakeup pipe."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


@dataclass
class EngineConfig:
    grace: float = 5.0  # SIGTERM -> SIGKILL, per replica
    spawn_batch: int = 64  # forks per loop turn, so commands and exits interleave with a burst
    keep_ended: int = 1000  # terminal replicas kept in memory for `status --all`
    env: dict[str, str] | None = None  # base environment of command workers (default: ours)
    token: str | None = None  # ORCHESTRATOR_DAEMON_TOKEN, marks every process of one daemon


@dataclass(slots=True)
class _Runtime:
    """A spec made ready to fork: resolved once per launch, reused for every replica."""

    spec: WorkerSpec
    run: Any = None  # callable, or pickled bytes only the child loads
    argv: tuple[str, ...] | None = None
    exe: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class Pool:
    name: str
    runtime: _Runtime | None
    desired: int = 0
    next_n: int = 1
    live: dict[str, Replica] = field(default_factory=dict)  # non-terminal, in id order


@dataclass(eq=False, slots=True)
class _Proc:
    pid: int
    exit_fd: int
    ready_fd: int
    replica: Replica
    killed: bool = False
    reaped: bool = False


@dataclass(eq=False)
class _Waiter:
    ids: tuple[str, ...]
    until: str
    reply: Reply
    cmd_id: Any
    deadline: float
    done: bool = False


class Engine:
    """The control loop. Single-threaded: only submit() may be called from other threads."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        os_api: OSApi | None = None,
        store: Any = None,
        watchdog: Any = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.os = os_api or OSApi()
        self.store = store
        self.watchdog = watchdog
        self._base_env = dict(self.config.env if self.config.env is not None else os.environ)
        self._sel = selectors.EpollSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, (_WAKEUP, None))
        self._inbox: collections.deque[tuple[dict, Reply]] = collections.deque()
        self._submit_lock = threading.Lock()
        self._pools: dict[str, Pool] = {}
        self._replicas: dict[str, Replica] = {}
        self._ended: collections.deque[str] = collections.deque()
        self._procs: dict[int, _Proc] = {}
        self._pending: collections.deque[tuple[Replica, _Runtime]] = collections.deque()
        self._timers: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._waiters: list[_Waiter] = []
        self._outbox: list[tuple[Reply, dict]] = []
        self._children: dict[int, tuple[int, Callable[[int | None], None]]] = {}
        # Non-blocking pipe writers (the watchdog feed, the reply pipe): obj -> fd in EVENT_WRITE
        self._writers: dict[Any, int | None] = {}
        if watchdog is not None:
            self._writers[watchdog] = None
        self.extra_status: Callable[[], dict] | None = None
        self._dirty = False
        self._store_warned = -1e9
        self._spawn_hold = -1e9
        self.closing = False
        self.closed = False

    # -- the public face ------------------------------------------------------------

    def submit(self, cmd: dict, reply: Reply) -> None:
        """Queue a command from any thread; ``reply`` is called once, from the loop."""
        with self._submit_lock:  # against close(): never write to a closed (or reused) fd
            if self.closed:
                raise ShuttingDown("the orchestrator is not running")
            self._inbox.append((cmd, reply))
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wakeups already: the loop will run

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self._sel.register(fd, selectors.EVENT_READ, (_READER, callback))

    def remove_reader(self, fd: int) -> None:
        self._sel.unregister(fd)

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` from the loop once ``delay`` seconds have passed."""
        self._arm(self.os.monotonic() + delay, callback)

    def add_writer(self, writer: Any) -> None:
        """A buffered non-blocking writer (pending/flush/fileno): flushed at the end of every
        turn, and woken by EVENT_WRITE while it holds data the pipe could not take."""
        self._writers[writer] = None

    def remove_writer(self, writer: Any) -> None:
        fd = self._writers.pop(writer, None)
        if fd is not None:
            self._sel.unregister(fd)

    def watch_child(self, pid: int, on_exit: Callable[[int | None], None]) -> None:
        """Reap ``pid`` (a child that is not a replica) when it exits, then call on_exit."""
        fd = os.pidfd_open(pid)
        self._children[pid] = (fd, on_exit)
        self._sel.register(fd, selectors.EVENT_READ, (_CHILD, pid))

    def start(self) -> None:
        if self.watchdog is not None:
            self._start_watchdog()

    def handle(self, cmd: dict, reply: Reply) -> None:
        """Apply one command now (loop thread only). Replies go out after the store commit."""
        cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
        op = cmd.get("op") if isinstance(cmd, dict) else None
        try:
            if not isinstance(cmd, dict) or not isinstance(op, str):
                raise InvalidSpec("malformed command: expected an object with an 'op'")
            handler = self._COMMANDS.get(op)
            if handler is None:
                raise InvalidSpec(f"unknown command {op!r}")
            if self.closing:
                raise ShuttingDown("the orchestrator is shutting down")
            args = cmd.get("args") or {}
            if not isinstance(args, dict):
                raise InvalidSpec("malformed command: 'args' must be an object")
            result = handler(self, args, reply, cmd_id)
        except OrchestratorError as err:
            self._journal_command(op, cmd_id, err)
            self._outbox.append((reply, {"id": cmd_id, "ok": False, "error": str(err), "code": err.code}))
            return
        self._journal_command(op, cmd_id, None)  # applied now, even if its reply waits
        if result is not _DEFERRED:
            self._outbox.append((reply, {"id": cmd_id, "ok": True, "result": result}))

    def run_once(self, timeout: float | None = None) -> None:
        """One turn of the loop; ``timeout`` bounds the wait (None: until an event)."""
        if self._inbox or (self._pending and self.os.monotonic() >= self._spawn_hold):
            timeout = 0
        elif self._timers:
            due = max(0.0, self._timers[0][0] - self.os.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        for key, _ in self._sel.select(timeout):
            kind, obj = key.data
            if kind == _EXIT:
                self._on_exit(obj)
            elif kind == _READY:
                self._on_ready(obj)
            elif kind == _WAKEUP:
                self._drain_wakeup()
            elif kind == _CHILD:
                self._on_child_exit(obj)
            elif kind == _READER:
                obj()
            elif kind == _WRITER:
                obj.flush()
        while self._inbox:
            cmd, reply = self._inbox.popleft()
            self.handle(cmd, reply)
        self._spawn_pending()
        self._fire_timers()
        self.settle()

    def shutdown(self) -> None:
        """Stop every replica (TERM, grace, KILL) and wait until all are reaped; from now on
        every command is refused. Desired sizes are kept: the next start brings the pools
        back. The watchdog still runs: stop_watchdog() is the caller's last step."""
        if self.closed:
            return
        self.closing = True
        for rep in list(self._live_replicas()):
            self._stop(rep, reason="shutdown", lower_desired=False)
        self._run_until(lambda: not self._procs, self.config.grace + 1.0)
        if self._procs:
            for proc in list(self._procs.values()):
                proc.killed = True
                self.os.signal_group(proc.pid, signal.SIGKILL)
            self._run_until(lambda: not self._procs, 5.0)
        self._fail_waiters("the orchestrator is shutting down")
        self.settle()

    def close(self) -> None:
        """Release the loop's own fds. Call after shutdown()."""
        with self._submit_lock:
            if self.closed:
                return
            self.closed = True
        while self._inbox:  # submitted after the last turn: answer, never leave a caller hanging
            cmd, reply = self._inbox.popleft()
            cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
            reply({"id": cmd_id, "ok": False, "code": ShuttingDown.code, "error": "the orchestrator is shutting down"})
        for fd, _ in list(self._children.values()):
            self._sel.unregister(fd)
            os.close(fd)
        self._children.clear()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def reap_orphans(self) -> None:
        """Reap every exited child, including orphans re-parented to this subreaper.

        Peeks with WNOWAIT first, so that our own workers still go through _on_exit
        (group remnants are killed while the zombie pins the group)."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            pid = info.si_pid
            if pid in self._procs:
                self._on_exit(self._procs[pid])
            elif pid in self._children:
                self._on_child_exit(pid)
            else:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
                log.debug("reaped orphan %d", pid)

    # -- facts for the daemon -------------------------------------------------------

    def status(self, include_terminal: bool = False) -> dict:
        return self._cmd_status({"all": include_terminal}, None, None)

    def restore(self, pools: Iterable[dict], *, relaunch: bool = True) -> None:
        """Recreate pools from the store at start-up (their ids continue where they
        stopped) and, with ``relaunch``, bring each back to its desired size."""
        for row in pools:
            spec = WorkerSpec.from_wire(row["spec"]) if row.get("spec") else None
            runtime = None
            if spec is not None:
                try:
                    runtime = self._prepare(spec)
                except InvalidSpec as err:
                    log.error("pool %s: its spec no longer resolves: %s", row["name"], err)
            pool = Pool(row["name"], runtime, desired=0, next_n=int(row["next_n"]))
            self._pools[pool.name] = pool
            if relaunch and runtime is not None:
                self._launch(pool, runtime, int(row["desired"]))
            self._save_pool(pool)

    # -- commands -------------------------------------------------------------------

    def _cmd_launch(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        name = args.get("pool")
        if not isinstance(name, str) or not _POOL_NAME.match(name):
            raise InvalidSpec(f"invalid pool name {name!r} (letters, digits, '_', '.', '-')")
        count = args.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
            raise InvalidSpec(f"count must be an integer from 1 to {MAX_COUNT}, got {count!r}")
        timeout = _wait_timeout(args) if args.get("wait") else None
        spec = args.get("spec")
        if not isinstance(spec, WorkerSpec):
            spec = WorkerSpec.from_wire(spec)
        runtime = self._prepare(spec)
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = Pool(name, runtime)
        pool.runtime = runtime
        ids = self._launch(pool, runtime, count)
        self._save_pool(pool)
        if args.get("wait"):
            return self._add_waiter(ids, "running", reply, cmd_id, timeout)
        return ids

    def _cmd_terminate(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        ids = args.get("ids")
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise InvalidSpec("terminate needs a list of replica ids")
        timeout = _wait_timeout(args) if args.get("wait") else None
        reps = [self._lookup(i) for i in ids]  # all or nothing: an unknown id changes nothing
        stopped = [r.id for r in reps if r is not None and self._stop(r, reason="terminated")]
        if args.get("wait"):
            return self._add_waiter(tuple(ids), "ended", reply, cmd_id, timeout)
        return stopped

    def _cmd_scale(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        name, n = args.get("pool"), args.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_COUNT:
            raise InvalidSpec(f"size must be an integer from 0 to {MAX_COUNT}, got {n!r}")
        pool = self._pools.get(name) if isinstance(name, str) else None
        spec = args.get("spec")
        if spec is not None:
            runtime = self._prepare(spec if isinstance(spec, WorkerSpec) else WorkerSpec.from_wire(spec))
            if pool is None:
                if not isinstance(name, str) or not _POOL_NAME.match(name):
                    raise InvalidSpec(f"invalid pool name {name!r}")
                pool = self._pools[name] = Pool(name, runtime)
            pool.runtime = runtime
        if pool is None:
            raise InvalidSpec(f"unknown pool {name!r}: launch a replica into it first")
        live = [r for r in pool.live.values() if r.state in _LIVE]
        launched: list[str] = []
        stopped: list[str] = []
        if len(live) > n:
            for rep in sorted(live, key=lambda r: r.n, reverse=True)[: len(live) - n]:
                self._stop(rep, reason="scaled down", lower_desired=False)
                stopped.append(rep.id)
        elif len(live) < n:
            if pool.runtime is None:
                raise InvalidSpec(f"pool {name!r} has no usable spec to launch from")
            launched = self._launch(pool, pool.runtime, n - len(live))
        pool.desired = n
        self._save_pool(pool)
        return {"pool": pool.name, "desired": n, "launched": launched, "terminated": stopped}

    def _cmd_status(self, args: dict, reply: Reply | None, cmd_id: Any) -> Any:
        include_terminal = bool(args.get("all"))
        if include_terminal:
            rows = {r.id: r.to_dict() for r in self._replicas.values()}
            if self.store is not None:  # older history, and replicas of earlier daemons
                stored = {row["id"]: row for row in self.store.replicas(include_terminal=True)}
                rows = {**stored, **rows}
            replicas = sorted(rows.values(), key=lambda r: (r["created_at"], r["id"]))
        else:
            replicas = [r.to_dict() for r in self._replicas.values() if not r.state.terminal]
        result = {
            "pools": [{"name": p.name, "desired": p.desired} for p in self._pools.values()],
            "replicas": replicas,
        }
        if self.extra_status is not None:
            result.update(self.extra_status())
        return result

    def _cmd_wait(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        ids = args.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise InvalidSpec("wait needs a list of replica ids")
        until = args.get("until", "running")
        if until not in ("running", "ended"):
            raise InvalidSpec("until must be 'running' or 'ended'")
        timeout = _wait_timeout(args)
        for i in ids:
            self._lookup(i)
        return self._add_waiter(tuple(ids), until, reply, cmd_id, timeout)

    def _cmd_ping(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        return "pong"

    _COMMANDS: dict[str, Callable[..., Any]] = {
        "launch": _cmd_launch,
        "terminate": _cmd_terminate,
        "scale": _cmd_scale,
        "status": _cmd_status,
        "wait": _cmd_wait,
        "ping": _cmd_ping,
    }
    _READ_ONLY = frozenset({"status", "wait", "ping"})

    # -- lifecycle verbs ------------------------------------------------------------

    def _prepare(self, spec: WorkerSpec) -> _Runtime:
        rt = _Runtime(spec)
        if spec.command is not None:
            env = {**self._base_env, **spec.env}
            rt.argv, rt.exe, rt.env = spec.command, resolve_executable(spec.command, env), env
        else:
            rt.env = dict(spec.env)
            if spec.func is not None:
                rt.run = spec.func
            elif spec.target is not None:
                rt.run = resolve_target(spec.target)
            else:
                import dill  # noqa: F401  (loaded once here, not in every forked worker)

                rt.run = spec.pickled
        return rt

    def _launch(self, pool: Pool, runtime: _Runtime, count: int) -> list[str]:
        ids = []
        now = self.os.time()
        for _ in range(count):
            n = pool.next_n
            pool.next_n += 1
            rep = Replica(f"{pool.name}-{n}", pool.name, n, created_at=now)
            self._replicas[rep.id] = rep
            pool.live[rep.id] = rep
            self._pending.append((rep, runtime))
            self._record(rep, None)
            ids.append(rep.id)
        pool.desired += count
        return ids

    def _spawn_pending(self) -> None:
        if not self._pending or self.os.monotonic() < self._spawn_hold:
            return
        if self.store is not None and self.store.pending:
            # A replica's id must be durable before its process exists: after a kill -9
            # between fork and commit, the next daemon would hand the id out again.
            if not self._commit():
                self._spawn_hold = self.os.monotonic() + 1.0  # the disk fails: retry, not spin
                self.call_later(1.0, lambda: None)
                return
        for _ in range(min(len(self._pending), self.config.spawn_batch)):
            rep, rt = self._pending.popleft()
            if rep.state is not S.PENDING:
                continue  # interrupted while it waited
            self._spawn(rep, rt)

    def _spawn(self, rep: Replica, rt: _Runtime) -> None:
        env = {"ORCHESTRATOR_REPLICA_ID": rep.id, "ORCHESTRATOR_POOL": rep.pool}
        if self.config.token:
            env["ORCHESTRATOR_DAEMON_TOKEN"] = self.config.token
        if rt.env:  # a command's whole environment, or a Python target's additions
            env = {**rt.env, **env}
        try:
            sp = self.os.spawn(rep.id, rt.run, rt.argv, rt.exe, env)
        except OSError as err:  # fork/pipe failed: EAGAIN, EMFILE, ENOMEM
            self._transition(rep, S.FAILED, f"could not start: {err.strerror or err}")
            self._ended_on_its_own(rep)
            return
        rep.pid, rep.start_time = sp.pid, sp.start_time
        proc = _Proc(sp.pid, sp.exit_fd, sp.ready_fd, rep)
        self._procs[sp.pid] = proc
        self._sel.register(sp.exit_fd, selectors.EVENT_READ, (_EXIT, proc))
        self._sel.register(sp.ready_fd, selectors.EVENT_READ, (_READY, proc))
        if self.watchdog is not None and sp.start_time is not None:
            self.watchdog.add(sp.pid, sp.start_time, sp.pid, "worker", rep.id)
        self._transition(rep, S.STARTING)

    def _on_ready(self, proc: _Proc) -> None:
        if proc.ready_fd < 0:
            return
        data = self.os.read_ready(proc.ready_fd)
        self._sel.unregister(proc.ready_fd)
        self.os.close(proc.ready_fd)
        proc.ready_fd = -1
        rep = proc.replica
        if rep.state is not S.STARTING:
            return  # interrupted while starting: its end is already recorded
        if data:
            self._transition(rep, S.FAILED, "could not start: " + data.decode("utf-8", "replace"))
            self._ended_on_its_own(rep)
        else:
            self._transition(rep, S.RUNNING)

    def _on_exit(self, proc: _Proc) -> None:
        if proc.reaped:
            return  # a stale event: reap_orphans() got to it first in this turn
        if proc.ready_fd >= 0:
            self._on_ready(proc)  # the pipe is at EOF or holds the reason: settle it first
        # The zombie still pins the group: end what the worker left in it before reaping.
        self.os.signal_group(proc.pid, signal.SIGKILL)
        code = self.os.reap(proc.pid)
        proc.reaped = True
        self._sel.unregister(proc.exit_fd)
        self.os.close(proc.exit_fd)
        del self._procs[proc.pid]
        if self.watchdog is not None:
            self.watchdog.remove(proc.pid)
        rep = proc.replica
        rep.pid = None
        self._dirty = True
        reason = exit_reason(code) if code is not None else "exit status unknown (reaped elsewhere)"
        if rep.state is S.RUNNING:
            new = S.EXITED if code == 0 else S.FAILED
            self._transition(rep, new, reason, exit_code=code)
            self._ended_on_its_own(rep)
        elif rep.state is S.STOPPING:
            if proc.killed:
                reason = f"{reason} after {self.config.grace:g}s grace"
            self._transition(rep, S.TERMINATED, reason, exit_code=code)
        elif self.store is not None:
            self.store.save_replica(rep.to_record())  # terminal already: only the pid is gone

    def _stop(self, rep: Replica, *, reason: str, lower_desired: bool = True) -> bool:
        """Terminate one replica; a no-op (False) when it is ending or ended already."""
        state = rep.state
        if state is S.PENDING:
            self._transition(rep, S.INTERRUPTED, reason)
        elif state is S.STARTING:
            self._transition(rep, S.INTERRUPTED, reason)
            self._signal_and_arm(rep)
        elif state is S.RUNNING:
            self._transition(rep, S.STOPPING, reason)
            self._signal_and_arm(rep)
        else:
            return False
        if lower_desired:
            pool = self._pools[rep.pool]
            pool.desired -= 1
            self._save_pool(pool)
        return True

    def _ended_on_its_own(self, rep: Replica) -> None:
        """No restart policy yet: the pool's desired size follows the replica out."""
        pool = self._pools[rep.pool]
        pool.desired -= 1
        self._save_pool(pool)

    def _signal_and_arm(self, rep: Replica) -> None:
        proc = self._procs.get(rep.pid) if rep.pid is not None else None
        if proc is None:
            return
        self.os.signal_group(proc.pid, signal.SIGTERM)
        self._arm(self.os.monotonic() + self.config.grace, proc)

    def _arm(self, deadline: float, what: Any) -> None:
        heapq.heappush(self._timers, (deadline, next(self._seq), what))

    def _fire_timers(self) -> None:
        now = self.os.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, what = heapq.heappop(self._timers)
            if isinstance(what, _Proc):
                if not what.reaped and self._procs.get(what.pid) is what:
                    what.killed = True
                    self.os.signal_group(what.pid, signal.SIGKILL)
            elif callable(what):
                what()
            elif isinstance(what, _Waiter) and not what.done:
                what.done = True
                self._outbox.append((what.reply, {
                    "id": what.cmd_id, "ok": False, "code": "timeout",
                    "error": f"timed out waiting for {len(what.ids)} replica(s) to be {what.until}",
                }))

    def _transition(self, rep: Replica, new: S, reason: str | None = None, *, exit_code: int | None = None) -> None:
        old = transition(rep, new, reason, exit_code=exit_code, clock=self.os.time)
        self._dirty = True
        if new.terminal:
            pool = self._pools.get(rep.pool)
            if pool is not None:
                pool.live.pop(rep.id, None)
            self._ended.append(rep.id)
            while len(self._ended) > self.config.keep_ended:
                self._replicas.pop(self._ended.popleft(), None)
        self._record(rep, old)

    def _record(self, rep: Replica, old: S | None) -> None:
        if self.store is None:
            return
        self.store.save_replica(rep.to_record())
        self.store.append_event(
            "transition", replica=rep.id, ts=self.os.time(),
            data={"from": old.value if old else None, "to": rep.state.value, "reason": rep.reason},
        )

    def _save_pool(self, pool: Pool) -> None:
        if self.store is None or pool.runtime is None:
            return
        self.store.save_pool(pool.name, pool.runtime.spec.to_wire(), pool.desired, pool.next_n)

    def _journal_command(self, op: Any, cmd_id: Any, err: OrchestratorError | None) -> None:
        if self.store is None or op in self._READ_ONLY:
            return
        data = {"op": op, "cmd_id": cmd_id, "ok": err is None}
        if err is not None:
            data["error"] = str(err)
        self.store.append_event("command", data=data, ts=self.os.time())

    def _lookup(self, rid: str) -> Replica | None:
        """The replica, None if it ended long ago (a no-op for terminate), else UnknownReplica."""
        rep = self._replicas.get(rid)
        if rep is not None:
            return rep
        name, _, n = rid.rpartition("-")
        pool = self._pools.get(name)
        if pool is not None and n.isdigit() and 0 < int(n) < pool.next_n:
            return None
        raise UnknownReplica(f"unknown replica {rid!r}")

    def _live_replicas(self) -> Iterable[Replica]:
        for pool in self._pools.values():
            yield from pool.live.values()

    # -- waiting ------------------------------------------------------------------

    def _add_waiter(self, ids: Iterable[str], until: str, reply: Reply, cmd_id: Any, timeout: float) -> Any:
        waiter = _Waiter(tuple(ids), until, reply, cmd_id, self.os.monotonic() + timeout)
        self._waiters.append(waiter)
        self._arm(waiter.deadline, waiter)
        self._dirty = True
        return _DEFERRED

    def _waiter_result(self, waiter: _Waiter) -> dict | None:
        states = {}
        for rid in waiter.ids:
            rep = self._replicas.get(rid)
            if rep is None:
                continue  # ended long ago
            if waiter.until == "running":
                if rep.state in (S.PENDING, S.STARTING):
                    return None
            elif not rep.state.terminal or rep.pid is not None:
                return None
            states[rid] = rep.state.value
        return states

    def _check_waiters(self) -> None:
        keep = []
        for w in self._waiters:
            if w.done:
                continue
            states = self._waiter_result(w)
            if states is None:
                keep.append(w)
                continue
            w.done = True
            self._outbox.append((w.reply, {"id": w.cmd_id, "ok": True, "result": states}))
        self._waiters = keep

    def _fail_waiters(self, message: str) -> None:
        for w in self._waiters:
            if not w.done:
                w.done = True
                self._outbox.append((w.reply, {"id": w.cmd_id, "ok": False, "error": message, "code": ShuttingDown.code}))
        self._waiters = []

    # -- settling a turn ------------------------------------------------------------

    def settle(self) -> None:
        if self._dirty:
            self._dirty = False
            if self._waiters:
                self._check_waiters()
        if self.store is not None:
            self._commit()  # before any reply: an acknowledged command is durable
        if self._outbox:
            out, self._outbox = self._outbox, []
            for reply, msg in out:
                reply(msg)
        for writer, registered in self._writers.items():
            if writer.pending():
                writer.flush()
            want = writer.fileno() if writer.pending() else None
            if want != registered:
                if registered is not None:
                    self._sel.unregister(registered)
                if want is not None:
                    self._sel.register(want, selectors.EVENT_WRITE, (_WRITER, writer))
                self._writers[writer] = want

    def _commit(self) -> bool:
        """Commit this turn's changes. A failing disk must not kill the loop (the replicas
        still need supervising): the batch stays buffered for the next commit, and every
        success this turn would have reported is reported as not saved instead."""
        from .store import StoreError

        try:
            self.store.commit()
            return True
        except StoreError as err:
            now = self.os.monotonic()
            if now - self._store_warned > 10.0:  # one line per 10 s, not one per turn
                self._store_warned = now
                log.error("state not saved (will retry): %s", err)
            self._outbox = [
                (reply, {"id": msg.get("id"), "ok": False, "code": "store",
                         "error": f"applied, but the state could not be saved: {err}"} if msg.get("ok") else msg)
                for reply, msg in self._outbox
            ]
            return False

    def _drain_wakeup(self) -> None:
        drain(self._wake_r)

    def _run_until(self, done: Callable[[], bool], limit: float) -> None:
        deadline = self.os.monotonic() + limit
        while not done():
            left = deadline - self.os.monotonic()
            if left <= 0:
                return
            self.run_once(min(left, 0.5))

    # -- system children: the watchdog and friends ---------------------------------

    def _on_child_exit(self, pid: int) -> None:
        entry = self._children.pop(pid, None)
        if entry is None:
            return
        fd, on_exit = entry
        self._sel.unregister(fd)
        os.close(fd)
        on_exit(self.os.reap(pid))

    def _forget_writer_fd(self, writer: Any) -> None:
        fd = self._writers.get(writer)
        if fd is not None:
            self._sel.unregister(fd)
            self._writers[writer] = None

    def _start_watchdog(self) -> None:
        self._forget_writer_fd(self.watchdog)  # a new watchdog comes with a new pipe
        pid = self.watchdog.start()
        self.watch_child(pid, self._on_watchdog_exit)

    def _on_watchdog_exit(self, code: int | None) -> None:
        if self.closing:
            return
        log.warning("watchdog exited (%s); starting a new one", exit_reason(code) if code is not None else "?")
        self._start_watchdog()

    def stop_watchdog(self) -> None:
        """Tell the watchdog to exit quietly (a clean stop is no crash) and reap it."""
        wd = self.watchdog
        if wd is None or wd.pid is None or wd.pid not in self._children:
            return
        pid = wd.pid
        self._forget_writer_fd(wd)
        self.closing = True  # so its exit is not taken for a death to recover from
        wd.stop()
        self.end_child(pid, 2.0)

    def end_child(self, pid: int, timeout: float) -> None:
        """Wait up to ``timeout`` for a watched child that was told to exit, then SIGKILL
        it (still our unreaped child, so the pid is pinned) and wait again, bounded."""
        self._run_until(lambda: pid not in self._children, timeout)
        if pid in self._children:
            os.kill(pid, signal.SIGKILL)
            self._run_until(lambda: pid not in self._children, 2.0)
