"""The replica table: commands in, transitions out. The one owner of every Replica and Pool.

    commands (any thread: submit)     worker processes            timers
        │                               │ pidfd readable: exited    │ grace over: SIGKILL
        │                               │ ready pipe: EOF = it runs │ a wait timed out
        ▼                               ▼                           ▼
    ┌──────────────────────── reactor turn (reactor.py) ─────────────────────────┐
    │ readers: exits (end group remnants, reap, transition), ready pipes          │
    │ commands applied in order    forks of pending replicas (bounded per turn)   │
    │ timers                       settle: waiters, ONE store commit, then replies│
    └─────────────────────────────────────────────────────────────────────────────┘

Nothing but the loop's thread reads or writes a Replica, a Pool or the process table, so
there is no lock, and a terminate can never race a reap: both are events, applied one after
the other, and whichever comes second finds a state that tells it what is left to do. Every
state change goes through ``states.transition()``; a process is signalled only while it is
our unreaped child (its zombie pins the pid and the process group), and forgotten only
after it is reaped. Process syscalls go through ``OSApi`` (osapi.py), store writes through
``Journal`` (journal.py); the system children (watchdog, manager) are not the engine's.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import protocol
from .containment import CgroupUnavailable, Cgroups, ProcessGroups
from .errors import InvalidSpec, OrchestratorError, ShuttingDown, UnknownReplica
from .journal import Journal
from .policy import Policy
from .pools import Pool, check_templates
from .reactor import Reactor, Timer
from .metrics import Metrics
from .oom import was_oom_killed
from .osapi import OSApi, Spawned, exit_reason
from .spec import Runtime, prepare
from .states import ReplicaState as S
from .states import Replica, transition
from .supervision import Supervision
from .launcher import HOLD, HOLD_REASON, Spawners, Unavailable
from .waiters import Waiter, Waiters

log = logging.getLogger("orchestrator")

Reply = Callable[[dict], None]
_LIVE = (S.PENDING, S.STARTING, S.RUNNING)  # counted against a pool's desired size
MAX_COUNT = protocol.MAX_COUNT
SHUTDOWN_MARGIN = 1.0  # of a stop budget, kept for what comes after the replicas (SIGKILL, reap, manager, journal)


@dataclass
class EngineConfig:
    grace: float = 5.0  # SIGTERM -> SIGKILL, per replica
    spawn_batch: int = 64  # forks per loop turn, so commands and exits interleave with a burst
    keep_ended: int = 1000  # terminal replicas kept in memory for `status --all`
    env: dict[str, str] | None = None  # base environment of command workers (default: ours)
    token: str | None = None  # ORCHESTRATOR_DAEMON_TOKEN, marks every process of one daemon
    spawners: bool = False  # replicas made by spawner processes (spawner.py, launcher.py), not forked here


@dataclass(eq=False, slots=True)
class _Starting:
    """A replica between its start's request and its answer (Engine._begin_spawn)."""

    rep: Replica
    started: Any = None  # spawner.Begun, or the Spawned of a fork done at once
    group: str | None = None
    captured: Any = None
    notify: Any = None


@dataclass(eq=False, slots=True)
class _Proc:
    pid: int
    exit_fd: int
    ready_fd: int
    replica: Replica
    killed: bool = False
    reaped: bool = False
    kill_timer: Timer | None = None
    escaped: list[tuple[int, int]] = field(default_factory=list)  # (pid, start) outside its group
    cleanup: list[Callable[[], None]] = field(default_factory=list)  # its probes, timers, notify socket
    replace: bool = False  # asked to stop in order to be replaced (liveness, restart)
    cgroup: str | None = None  # its own cgroup (cgroup containment), else None: its process group
    probes: Any = None  # probes.ProbeBox of its exec probes, made by the first one


class Engine(Supervision):
    """Single-threaded: only submit() may be called from other threads."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        os_api: OSApi | None = None,
        store: Any = None,
        watchdog: Any = None,
        reactor: Reactor | None = None,
        containment: Cgroups | ProcessGroups | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        protocol.seconds(self.config.grace, "grace")  # a NaN grace would never SIGKILL
        self.os = os_api or OSApi()
        self.reactor = reactor or Reactor(self.os.monotonic)
        self.journal = Journal(store, self.os.time)
        self.journal.rebuild = self._save_everything
        self.watchdog = watchdog  # the watchdog's ledger feed (WatchdogLink), if any
        # A cgroup per replica, or process groups (containment.py); the default keeps the
        # engine off the cgroupfs (the fake-OS tests, the embedded API unless asked).
        self.containment = containment or ProcessGroups("not asked for (the default)")
        self.containment.attach(self.reactor)
        self._base_env = dict(self.config.env if self.config.env is not None else os.environ)
        # Started by start_spawners(), from the loop's thread: the replicas' PDEATHSIG follows it.
        self.spawners = Spawners(self.reactor, self.os, watchdog, self._base_env, self._spawners_changed,
                                 output=self._spawner_output) if self.config.spawners else None
        self._held: list[tuple[Replica, Runtime]] = []  # waiting for their pool's preload spawner
        self._inbox: collections.deque[tuple[dict, Reply]] = collections.deque()
        self._submit_lock = threading.Lock()
        self._pools: dict[str, Pool] = {}
        self._replicas: dict[str, Replica] = {}
        self._ended: collections.deque[str] = collections.deque()
        self._procs: dict[int, _Proc] = {}
        self._draining: dict[str, _Proc] = {}  # replica id -> reaped, its cgroup not empty yet
        self._pending: collections.deque[tuple[Replica, Runtime]] = collections.deque()
        self._spawn_scheduled = False
        self._waiters = Waiters(self._replicas)
        self._rollouts: list[Any] = []  # supervision.Rollout
        # (reply, message, durable): a durable reply says "applied"; if this turn's commit
        # fails it says "not saved" instead. Read-only commands never depend on the disk.
        self._outbox: list[tuple[Reply, dict, bool]] = []
        self.extra_status: Callable[[], dict] | None = None
        # Commands the daemon adds (health, metrics, reload): op -> handler(args) -> result.
        self.extra_commands: dict[str, Callable[[dict], Any]] = {}
        self.metrics = Metrics(clock=self.os.monotonic, wall=self.os.time)
        self.log_capture: Any = None  # logs.LogCapture: replicas' stdout/stderr to files (the daemon's)
        self._stop_deadline: float | None = None  # shutdown against a budget: graces are cut to it
        self._dirty = False
        self._store_warned = -1e9
        self.closing = False
        self.closed = False
        self.reactor.at_turn_end(self.settle)

    # -- the public face ------------------------------------------------------------

    def submit(self, cmd: dict, reply: Reply) -> None:
        """Queue a command from any thread; ``reply`` is called once, from the loop."""
        with self._submit_lock:  # against close(): a command is either run or refused
            if self.closed:
                raise ShuttingDown("the orchestrator is not running")
            self._inbox.append((cmd, reply))
        self.reactor.call_soon_threadsafe(self._drain_inbox)

    def _drain_inbox(self) -> None:
        while self._inbox:
            cmd, reply = self._inbox.popleft()
            self.handle(cmd, reply)

    def handle(self, cmd: Any, reply: Reply) -> None:
        """Apply one command now (loop thread only). Replies go out after the store commit.
        Whatever a command raises becomes its error reply: no input ends the loop."""
        cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
        op = cmd.get("op") if isinstance(cmd, dict) else None
        try:
            if not isinstance(cmd, dict) or not isinstance(op, str):
                raise InvalidSpec("malformed command: expected an object with an 'op'")
            handler = self._COMMANDS.get(op)
            extra = self.extra_commands.get(op) if handler is None else None
            if handler is None and extra is None:
                raise InvalidSpec(f"unknown command {op!r}")
            if self.closing:
                raise ShuttingDown("the orchestrator is shutting down")
            args = cmd.get("args") or {}
            if not isinstance(args, dict):
                raise InvalidSpec("malformed command: 'args' must be an object")
            started = self.os.monotonic()
            result = handler(self, args, reply, cmd_id) if handler is not None else extra(args)
        except OrchestratorError as err:
            self._journal_command(op, cmd_id, str(err))
            self._outbox.append((reply, protocol.error(cmd_id, err), False))
            self.metrics.command(op, 0.0, False)
            return
        except Exception as err:  # the client boundary: a bug in a handler is that command's error
            log.exception("command %r failed", op)
            self._journal_command(op, cmd_id, f"internal error: {err}")
            self._outbox.append((reply, protocol.error(cmd_id, f"internal error: {type(err).__name__}: {err}", "internal"), False))
            return
        self.metrics.command(op, self.os.monotonic() - started, True)
        self._journal_command(op, cmd_id, None)  # applied now, even if its reply waits
        if result is not protocol.DEFERRED:
            self._outbox.append((reply, protocol.ok(cmd_id, result), op not in protocol.READ_ONLY))

    def run_once(self, timeout: float | None = None) -> None:
        """One turn of the loop; ``timeout`` bounds the wait (None: until an event)."""
        self.reactor.run_once(timeout)

    def shutdown(self, budget: float | None = None) -> None:
        """Stop every replica, all at once (stop signal, grace, KILL), and wait until all are
        reaped; from now on every command is refused. With a ``budget`` (seconds) every
        grace is cut so that all is over inside it (systemd's TimeoutStopSec, Kubernetes'
        terminationGracePeriodSeconds). Desired sizes are kept: the next start brings the
        pools back."""
        if self.closed:
            return
        self.closing = True
        wait = self.config.grace + 1.0
        if budget is not None:
            self._stop_deadline = self.os.monotonic() + max(0.0, budget - SHUTDOWN_MARGIN)
            wait = max(0.0, budget - SHUTDOWN_MARGIN)
        for rep in list(self._live_replicas()):
            self._stop(rep, reason="shutdown", lower_desired=False)
        done = lambda: not self._procs and not self._draining  # noqa: E731
        if not self.reactor.run_until(done, wait):
            for proc in list(self._procs.values()):
                proc.killed = True
                if proc.cgroup is not None:
                    self.containment.kill(proc.cgroup)
                self.os.signal_group(proc.pid, signal.SIGKILL)
            self.reactor.run_until(done, 5.0)
        self._outbox.extend(self._waiters.fail_all(ShuttingDown("the orchestrator is shutting down")))
        self.settle()
        if self.spawners is not None:
            self.spawners.stop()

    def close(self) -> None:
        """Release the loop's fds. Call after shutdown()."""
        with self._submit_lock:
            if self.closed:
                return
            self.closed = True
        while self._inbox:  # submitted after the last turn: answer, never leave a caller hanging
            cmd, reply = self._inbox.popleft()
            cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
            reply(protocol.error(cmd_id, ShuttingDown("the orchestrator is shutting down")))
        self.reactor.close()

    @property
    def store(self) -> Any:
        return self.journal.store

    def _save_everything(self) -> None:
        """Every pool and every replica in memory, into a journal that starts empty."""
        for pool in self._pools.values():
            self._save_pool(pool)
        for rep in self._replicas.values():
            self.journal.replica(rep)

    def child_exited(self, pid: int) -> bool:
        """A SIGCHLD scan found ``pid`` exited: handle it if it is a replica's (True)."""
        proc = self._procs.get(pid)
        if proc is None:
            return self.spawners is not None and self.spawners.exited(pid)
        self._on_exit(proc)
        return True

    def start_spawners(self, wait: float = 0.0) -> None:
        """Start the default spawner; ``wait``: run the loop until it is ready (bounded)."""
        if self.spawners is not None:
            self.spawners.start()
            if wait:
                self.reactor.run_until(self.spawners.settled, wait)

    def system_pids(self) -> set[int]:
        """Our children that are not replicas (the spawners)."""
        return self.spawners.pids() if self.spawners is not None else set()

    # -- facts for the daemon -------------------------------------------------------

    def status(self, include_terminal: bool = False) -> dict:
        return self._cmd_status({"all": include_terminal}, None, None)

    # -- commands -------------------------------------------------------------------

    def _cmd_launch(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        name = protocol.pool_name(args.get("pool"))
        replace = bool(args.get("replace"))
        count = protocol.count(args["count"], low=0 if replace else 1) if "count" in args else None
        timeout = protocol.wait_timeout(args) if args.get("wait") or replace else None
        runtime, policy = self.check_declaration(args.get("spec"), args.get("policy"))
        pool = self._pools.get(name)
        # The size the pool will have, for the templates' check, before anything changes.
        if pool is None or pool.deleted:
            size = 1 if count is None else count
        elif runtime.wire != (pool.runtime.wire if pool.runtime else None) or policy != pool.policy:
            if not replace:
                raise InvalidSpec(f"pool {name!r} runs another spec or policy: use --replace to roll it "
                                  "onto this one, or another pool name")
            size = len(pool.live) if count is None else count
        else:
            size = pool.desired + (1 if count is None else count)
        check_templates(runtime, policy, size)
        if pool is not None and pool.deleted:  # a deleted pool's name again: ids still continue
            pool.deleted, pool.runtime, pool.policy = False, runtime, policy
            pool.clear()
        if pool is None:
            pool = self._pools[name] = Pool(name, runtime, policy)
        elif runtime.wire != (pool.runtime.wire if pool.runtime else None) or policy != pool.policy:
            if not replace:
                raise InvalidSpec(f"pool {name!r} runs another spec or policy: use --replace to roll it "
                                  "onto this one, or another pool name")
            pool.runtime, pool.policy = runtime, policy
            pool.clear()
            olds = sorted(pool.live.values(), key=lambda r: r.slot if r.slot is not None else -1)
            target = len(olds) if count is None else count
            self._save_pool(pool)
            return self._start_rollout(pool, [r.id for r in olds[:target]], 1, reply, cmd_id, timeout,
                                       then_scale=target)
        if replace:
            pool.clear()
        ids = self._launch(pool, 1 if count is None else count)
        self._save_pool(pool)
        if timeout is not None:
            return self._add_waiter(ids, "running", reply, cmd_id, timeout)
        return ids

    def _cmd_terminate(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        ids = protocol.replica_ids(args.get("ids"), "terminate", one_is_enough=True)
        timeout = protocol.wait_timeout(args) if args.get("wait") else None
        reps = [self._lookup(i) for i in ids]  # all or nothing: an unknown id changes nothing
        stopped = [r.id for r in reps if r is not None and self._stop(r, reason="terminated")]
        if timeout is not None:
            return self._add_waiter(tuple(ids), "ended", reply, cmd_id, timeout)
        return stopped

    def _cmd_scale(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        name = args.get("pool")
        n = protocol.count(args.get("n"), low=0, what="size")
        pool = self._pool(name, missing_ok=True)
        if args.get("spec") is not None:
            runtime = self._prepare(args["spec"])
            check_templates(runtime, pool.policy if pool is not None else Policy(), n)
            if pool is None:
                gone = self._pools.get(protocol.pool_name(name))
                if gone is not None and gone.deleted:  # a deleted pool's name again: ids still continue
                    pool, gone.deleted, gone.policy = gone, False, Policy.from_wire(None)
                else:
                    pool = self._pools[protocol.pool_name(name)] = Pool(name, runtime)
            pool.runtime = runtime
        elif pool is not None:
            check_templates(pool.runtime, pool.policy, n)
        if pool is None:
            raise InvalidSpec(f"unknown pool {name!r}: launch a replica into it first")
        pool.clear()  # an operator acted: a crash loop is forgiven
        live = [r for r in pool.live.values() if r.state in _LIVE and not self._leaving(r)]
        if len(live) < n and pool.runtime is None:
            raise InvalidSpec(f"pool {name!r} has no usable spec to launch from")
        before = set(pool.live)
        stopping = {r.id for r in live}
        self._converge(pool, n)
        launched = [rid for rid in pool.live if rid not in before]
        stopped = sorted((rid for rid in stopping if self._replicas[rid].state not in _LIVE),
                         key=lambda rid: -self._replicas[rid].n)
        return {"pool": pool.name, "desired": n, "launched": launched, "terminated": stopped}

    def _cmd_status(self, args: dict, reply: Reply | None, cmd_id: Any) -> Any:
        if args.get("all"):
            rows = {r.id: r.to_dict() for r in self._replicas.values()}
            if self.store is not None:  # older history, and replicas of earlier daemons
                stored = {row["id"]: row for row in self.store.replicas(include_terminal=True)}
                rows = {**stored, **rows}
            replicas = sorted(rows.values(), key=lambda r: (r["created_at"], r["id"]))
        else:
            replicas = [r.to_dict() for r in self._replicas.values() if not r.state.terminal]
        result = {
            "pools": [p.to_dict() for p in self._pools.values() if not p.deleted],
            "replicas": replicas,
        }
        if self.extra_status is not None:
            result.update(self.extra_status())
        return result

    def _cmd_wait(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        ids = protocol.replica_ids(args.get("ids"), "wait")
        until = args.get("until", "running")
        if until not in ("running", "ended"):
            raise InvalidSpec("until must be 'running' or 'ended'")
        timeout = protocol.wait_timeout(args)
        for i in ids:
            self._lookup(i)
        return self._add_waiter(tuple(ids), until, reply, cmd_id, timeout, durable=False)

    def _cmd_ping(self, args: dict, reply: Reply, cmd_id: Any) -> Any:
        return "pong"

    _COMMANDS: dict[str, Callable[..., Any]] = {
        "launch": _cmd_launch,
        "terminate": _cmd_terminate,
        "scale": _cmd_scale,
        "status": _cmd_status,
        "wait": _cmd_wait,
        "ping": _cmd_ping,
        "restart": Supervision._cmd_restart,
        "delete": Supervision._cmd_delete,
        "signal": Supervision._cmd_signal,
    }

    # -- lifecycle verbs ------------------------------------------------------------

    def _prepare(self, wire: Any) -> Runtime:
        return prepare(wire, self._base_env)

    def check_declaration(self, spec: Any, policy: Any, size: int | None = None) -> tuple[Runtime, Policy]:
        """A pool's spec and policy from the wire, checked as a declaration is: the spec
        resolves, the limits are available, and (given its ``size``) every slot's templates
        expand. InvalidSpec (one line) otherwise; nothing is changed."""
        runtime = self._prepare(spec)
        pol = Policy.from_wire(policy)
        self.containment.check_limits(pol.limits)
        if size is not None:
            check_templates(runtime, pol, size)
        return runtime, pol

    def _launch(self, pool: Pool, count: int, *, slots: list[int] | None = None, grow: bool = True) -> list[str]:
        """``count`` new replicas in the lowest free slots (or in ``slots``: replacements);
        ``grow``: they add to the pool's desired size (a replacement takes a place it has)."""
        ids = []
        now = self.os.time()
        for slot in slots if slots is not None else pool.free_slots(count):
            n = pool.next_n
            pool.next_n += 1
            rep = Replica(f"{pool.name}-{n}", pool.name, n, created_at=now, slot=slot,
                          restarts=pool.slot_restarts.get(slot, 0), made_from=(pool.runtime, pool.policy))
            self._replicas[rep.id] = rep
            pool.live[rep.id] = rep
            self._pending.append((rep, pool.runtime))
            self.journal.transition(rep, None)
            ids.append(rep.id)
        if grow:
            pool.desired += len(ids)
        if ids:
            self.metrics.launched(pool.name, len(ids))
        self._schedule_spawn()
        return ids

    def _pool(self, name: Any, *, missing_ok: bool = False) -> Pool | None:
        pool = self._pools.get(name) if isinstance(name, str) else None
        if pool is None or pool.deleted:
            if missing_ok:
                return None
            raise UnknownReplica(f"unknown pool {name!r}")
        return pool

    def _schedule_spawn(self) -> None:
        if self._pending and not self._spawn_scheduled:
            self._spawn_scheduled = True
            self.reactor.call_soon(self._spawn_pending)

    def _spawn_pending(self) -> None:
        self._spawn_scheduled = False
        if not self._pending:
            return
        if self.journal.pending and not self._commit():
            # A replica's id must be durable before its process exists: after a kill -9
            # between fork and commit, the next daemon would hand the id out again. The
            # disk fails: retry in a second, not in a spin.
            self.reactor.call_later(1.0, self._schedule_spawn)
            return
        begun: list[_Starting] = []
        for _ in range(min(len(self._pending), self.config.spawn_batch)):
            rep, rt = self._pending.popleft()
            if rep.state is not S.PENDING:  # interrupted while it waited
                continue
            via = self.spawners.pick(rt.key, self._pools[rep.pool].policy.ready_timeout) \
                if self.spawners is not None else None
            if via is HOLD:
                rep.reason = HOLD_REASON  # status says why it is still PENDING
                self._held.append((rep, rt))
            elif isinstance(via, Unavailable):  # its preload hangs: it would hang here too
                self._transition(rep, S.FAILED, f"could not start: {via.reason}")
                self._ended_on_its_own(rep, failed=True)
            elif (st := self._begin_spawn(rep, rt, via)) is not None:
                begun.append(st)
        for st in begun:  # the spawners fork while the batch's plans are sent: then collect
            self._end_spawn(st)
        self._schedule_spawn()  # the rest of a burst, after the next round of events

    def _spawner_output(self) -> Any:
        """Where the spawners' stdout and stderr go: ``logs/spawner.log``, rotated like a
        replica's logs (None without a log capture: /dev/null)."""
        return self.log_capture.open_stream("spawner", "log") if self.log_capture is not None else None

    def _spawners_changed(self) -> None:
        """A spawner became ready or failed: what waited for it is spawned now."""
        for rep, _ in self._held:
            rep.reason = None
        self._pending.extendleft(reversed(self._held))
        self._held.clear()
        self._schedule_spawn()

    def _begin_spawn(self, rep: Replica, rt: Runtime, via: Any) -> _Starting | None:
        """Everything a replica's process needs, then its start: asked of the spawner
        ``via`` (ended by _end_spawn) or, without one, forked now. None: it FAILED."""
        pool = self._pools[rep.pool]
        try:
            plan = rt.plan(rep.id, rep.pool, rep.slot, pool.port(rep.slot) if rep.slot is not None else None,
                           self.config.token)
        except InvalidSpec as err:
            self._bad_template(rep, err)
            return None
        st = _Starting(rep)
        try:
            if self.log_capture is not None:
                st.captured = self.log_capture.open(rep.id, max_bytes=pool.policy.log_max_bytes,
                                                    backups=pool.policy.log_backups)  # None: the daemon's
                plan = dataclasses.replace(plan, stdout=st.captured.stdout, stderr=st.captured.stderr)
            st.group = self.containment.prepare(rep.id, pool.policy.limits)
            if st.group is not None:
                plan = dataclasses.replace(plan, cgroup=st.group)
                if self.watchdog is not None:
                    self.watchdog.add_cgroup(st.group)
            if pool.policy.ready == "notify":
                st.notify = self._notify_socket(rep)
                plan.env.update(st.notify.env())
            st.started = self.os.begin(plan, via) if via is not None else self.os.spawn(plan)
        except (OSError, CgroupUnavailable, ValueError) as err:  # fork/pipe/socket/mkdir failed, a limit refused
            self._not_started(st, err)
            return None
        return st

    def _end_spawn(self, st: _Starting) -> None:
        rep, group = st.rep, st.group
        try:
            sp = st.started if isinstance(st.started, Spawned) else self.os.end(st.started)
        except OSError as err:
            self._not_started(st, err)
            return
        rep.pid, rep.start_time = sp.pid, sp.start_time
        proc = _Proc(sp.pid, sp.exit_fd, sp.ready_fd, rep, cgroup=group)
        if st.notify is not None:
            proc.cleanup.append(st.notify.close)
        if st.captured is not None:
            st.captured.spawned()  # the child has its ends; what it writes until its exit is drained
            proc.cleanup.append(st.captured.finish)
        self._procs[sp.pid] = proc
        self.reactor.add_reader(sp.exit_fd, lambda: self._on_exit(proc))
        self.reactor.add_reader(sp.ready_fd, lambda: self._on_ready(proc))
        if self.watchdog is not None and sp.start_time is not None:
            self.watchdog.add(sp.pid, sp.start_time, sp.pid, "worker", rep.id)
        self._transition(rep, S.STARTING)

    def _not_started(self, st: _Starting, err: Exception) -> None:
        if st.notify is not None:
            st.notify.close()
        if st.captured is not None:
            st.captured.finish()
        if st.group is not None:
            self._remove_cgroup(st.group)
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        self._transition(st.rep, S.FAILED, f"could not start: {why}")
        self._ended_on_its_own(st.rep, failed=True)

    def _on_ready(self, proc: _Proc) -> None:
        if proc.ready_fd < 0:
            return
        data = self.os.read_ready(proc.ready_fd)
        self.reactor.remove_reader(proc.ready_fd)
        self.os.close(proc.ready_fd)
        proc.ready_fd = -1
        rep = proc.replica
        if rep.state is not S.STARTING:
            return  # interrupted while starting: its end is already recorded
        if data:
            self._transition(rep, S.FAILED, "could not start: " + data.decode("utf-8", "replace"))
            self._ended_on_its_own(rep, failed=True)
        else:
            self._started(proc)

    def _on_exit(self, proc: _Proc) -> None:
        if proc.reaped:
            return  # a stale event: a SIGCHLD scan got to it first in this turn
        if proc.ready_fd >= 0:
            self._on_ready(proc)  # the pipe is at EOF or holds the reason: settle it first
        if proc.cgroup is None:
            # The zombie still pins the group: end what the worker left in it before reaping.
            self.os.signal_group(proc.pid, signal.SIGKILL)
        else:
            self.containment.kill(proc.cgroup)  # what it left, whatever group or session it is in
        code = self.os.reap(proc.pid)
        proc.reaped = True
        if proc.kill_timer is not None and not proc.escaped:
            proc.kill_timer.cancel()
        self.reactor.remove_reader(proc.exit_fd)
        self.os.close(proc.exit_fd)
        del self._procs[proc.pid]
        if self.watchdog is not None:
            self.watchdog.remove(proc.pid)
        for release in proc.cleanup:
            release()
        if proc.cgroup is None:
            self._record_end(proc, code)
        else:  # ended once its cgroup is empty (an event, bounded: containment.DRAIN_TIMEOUT)
            self._draining[proc.replica.id] = proc
            self.containment.watch_empty(proc.cgroup, lambda empty: self._drained(proc, code, empty))

    def _drained(self, proc: _Proc, code: int | None, empty: bool) -> None:
        """The cgroup of a reaped replica is empty (or the wait gave up): remove it, end it."""
        self._draining.pop(proc.replica.id, None)
        path = proc.cgroup
        assert path is not None
        if not empty:
            log.error("%s: its cgroup %s still holds processes after the kill; ending it anyway", proc.replica.id, path)
        oom = self.containment.oom_killed(path)
        self._remove_cgroup(path)
        self._record_end(proc, code, oom=oom)

    def _remove_cgroup(self, path: str) -> None:
        status = self.containment.remove(path)
        if status in ("removed", "missing"):
            if self.watchdog is not None:
                self.watchdog.remove_cgroup(path)
        else:  # still registered: the watchdog kills it if we die; a clean stop retries
            log.error("cannot remove cgroup %s: %s", path, status)

    def _record_end(self, proc: _Proc, code: int | None, *, oom: bool = False) -> None:
        """The replica's processes are all gone: record how it ended."""
        rep = proc.replica
        if not oom and code == -signal.SIGKILL and not proc.killed and proc.cgroup is None:
            # A SIGKILL we did not send: the kernel log says whether the OOM killer sent it
            # (bounded: at most 0.5 s and 8 MiB of /dev/kmsg, and only for such an exit).
            oom = bool(was_oom_killed(proc.pid, rep.created_at))
        rep.pid = None
        self._dirty = True
        if oom:
            reason = "OOM-killed"
        else:
            reason = exit_reason(code) if code is not None else "exit status unknown (reaped elsewhere)"
        if rep.state is S.RUNNING:
            new = S.EXITED if code == 0 else S.FAILED
            self._transition(rep, new, reason, exit_code=code)
            self._ended_on_its_own(rep, failed=new is S.FAILED)
        elif rep.state is S.STARTING:  # ran, but ended before it was ready
            self._transition(rep, S.FAILED, f"exited during start ({reason})", exit_code=code)
            self._ended_on_its_own(rep, failed=True)
        elif rep.state is S.STOPPING:
            if proc.killed:
                reason = f"{reason} after {self._grace(rep):g}s grace"
            self._transition(rep, S.TERMINATED, reason, exit_code=code)
            if proc.replace:
                self._replace(rep, reason="liveness probe failed" if rep.reason == "liveness probe failed"
                              else "restarted", backoff=rep.reason == "liveness probe failed")
        else:
            self.journal.replica(rep)  # terminal already: only the pid is gone

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

    def _grace(self, rep: Replica) -> float:
        pool = self._pools.get(rep.pool)
        grace = pool.policy.grace if pool is not None else None
        grace = self.config.grace if grace is None else grace
        if self._stop_deadline is not None:  # a shutdown against a budget
            grace = max(0.0, min(grace, self._stop_deadline - self.os.monotonic()))
        return grace

    def _proc_of(self, rep: Replica) -> _Proc | None:
        """The live process of ``rep``, if any. A replica whose cgroup is being drained keeps
        its (reaped) pid until it has ended, and that number may belong to a new replica
        already: hence the identity check."""
        proc = self._procs.get(rep.pid) if rep.pid is not None else None
        return proc if proc is not None and proc.replica is rep else None

    def _signal_and_arm(self, rep: Replica) -> None:
        proc = self._proc_of(rep)
        if proc is None or proc.kill_timer is not None:
            return
        pool = self._pools.get(rep.pool)
        sig = pool.policy.signum if pool is not None else signal.SIGTERM
        proc.escaped = self._signal_tree(proc, sig)
        proc.kill_timer = self.reactor.call_later(self._grace(rep), lambda: self._kill_after_grace(proc))

    def _signal_tree(self, proc: _Proc, sig: int) -> list[tuple[int, int]]:
        """``sig`` to every process of a live replica: its cgroup's, or its group and the
        descendants that left it (returned: the kill after the grace reaches them too)."""
        if proc.cgroup is not None:
            if proc.pid not in self.containment.signal(proc.cgroup, sig):
                self.os.signal_group(proc.pid, sig)  # forked, not in its cgroup yet: it alone
            return []
        # Walk the tree first: once the group dies, what left it is re-parented out of reach.
        escaped = self.os.escaped_descendants(proc.pid)
        self.os.signal_group(proc.pid, sig)
        for ident in escaped:
            self.os.signal_verified(ident, sig)
        return escaped

    def _kill_after_grace(self, proc: _Proc) -> None:
        if proc.cgroup is not None:
            if not proc.reaped:  # once reaped, its exit killed the cgroup already
                proc.killed = True
                self.containment.kill(proc.cgroup)
                self.os.signal_group(proc.pid, signal.SIGKILL)  # in case it had not joined yet
            return
        if not proc.reaped:
            proc.killed = True
            proc.escaped += self.os.escaped_descendants(proc.pid)
            self.os.signal_group(proc.pid, signal.SIGKILL)
        for ident in proc.escaped:  # even after the main process is reaped
            self.os.signal_verified(ident, signal.SIGKILL)
        proc.escaped = []

    def _transition(self, rep: Replica, new: S, reason: str | None = None, *, exit_code: int | None = None) -> None:
        old = transition(rep, new, reason, exit_code=exit_code, clock=self.os.time)
        self._dirty = True
        if new.terminal:
            self.metrics.exited(rep.pool, _exit_kind(rep))
            pool = self._pools.get(rep.pool)
            if pool is not None:
                pool.live.pop(rep.id, None)
            self._ended.append(rep.id)
        self.journal.transition(rep, old)

    def _forget_ended(self) -> None:
        """Ended replicas beyond ``keep_ended`` leave memory (the journal keeps them), the
        oldest first, except those an open waiter or rollout still reads: a terminate of
        2,000 replicas must still name all 2,000 in its reply."""
        excess = len(self._ended) - self.config.keep_ended
        if excess <= 0:
            return
        held = {rid for w in self._waiters for rid in w.ids}
        held.update(rid for r in self._rollouts for rid in r.ids())
        kept: list[str] = []
        while excess > 0 and self._ended:
            rid = self._ended.popleft()
            if rid in held:
                kept.append(rid)
            else:
                self._replicas.pop(rid, None)
                excess -= 1
        self._ended.extendleft(reversed(kept))

    def _save_pool(self, pool: Pool) -> None:
        if (pool.runtime is not None or pool.unresolved is not None) and self.journal.store is not None:
            self.journal.pool(pool.name, pool.stored(), pool.desired, pool.next_n)

    def _journal_command(self, op: Any, cmd_id: Any, error: str | None) -> None:
        if op not in protocol.READ_ONLY:
            self.journal.command(op, cmd_id, error)

    def _lookup(self, rid: str) -> Replica | None:
        """The replica, None if it ended long ago (a no-op for terminate), else UnknownReplica."""
        rep = self._replicas.get(rid)
        if rep is not None:
            return rep
        parsed = protocol.parse_replica_id(rid)
        if parsed is not None:
            pool = self._pools.get(parsed[0])
            if pool is not None and 0 < parsed[1] < pool.next_n:
                return None
        raise UnknownReplica(f"unknown replica {rid!r}")

    def _live_replicas(self) -> Iterable[Replica]:
        for pool in self._pools.values():
            yield from pool.live.values()

    # -- waiting ------------------------------------------------------------------

    def _add_waiter(self, ids: Iterable[str], until: str, reply: Reply, cmd_id: Any, timeout: float,
                    *, durable: bool = True) -> Any:
        waiter = Waiter(tuple(ids), until, reply, cmd_id, durable=durable)
        self._waiters.add(waiter)
        self.reactor.call_later(timeout, lambda: self._outbox.extend(self._waiters.timed_out(waiter)))
        self._dirty = True
        return protocol.DEFERRED

    # -- settling a turn ------------------------------------------------------------

    def settle(self) -> None:
        """The end of a turn: waiters checked, one commit, then the replies."""
        if self._dirty:
            self._dirty = False
            for rollout in list(self._rollouts):
                rollout.advance()
            if self._waiters:
                self._outbox.extend(self._waiters.check())
            self._forget_ended()
        if self.store is not None:
            self._commit()  # before any reply: an acknowledged command is durable
        if self._outbox:
            out, self._outbox = self._outbox, []
            for reply, msg, _ in out:
                reply(msg)

    def _commit(self) -> bool:
        """Commit this turn's changes. A failing disk must not kill the loop (the replicas
        still need supervising): the batch stays buffered for the next commit, and every
        success this turn would have reported is reported as not saved instead."""
        err = self.journal.commit()
        if err is None:
            return True
        self.metrics.store_failure()
        now = self.os.monotonic()
        if now - self._store_warned > 10.0:  # one line per 10 s, not one per turn
            self._store_warned = now
            log.error("state not saved (will retry): %s", err)
        self._outbox = [
            (reply, protocol.error(msg.get("id"), f"applied, but the state could not be saved: {err}", "store"), False)
            if durable and msg.get("ok") else (reply, msg, durable)
            for reply, msg, durable in self._outbox
        ]
        return False


def _exit_kind(rep: Replica) -> str:
    """How a replica ended, for the metrics (a small closed set, never free text)."""
    reason = rep.reason or ""
    if rep.state is S.TERMINATED or rep.state is S.INTERRUPTED:
        return "terminated"
    if rep.state is S.LOST:
        return "lost"
    if reason.startswith("could not start"):
        return "could_not_start"
    if reason.startswith("not ready"):
        return "not_ready"
    if rep.exit_code is not None and rep.exit_code < 0:
        return "signal"
    return "exit_zero" if rep.exit_code == 0 else "exit_nonzero"
