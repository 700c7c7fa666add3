"""The replica table: commands in, transitions out. The one owner of every Replica and of
the process table; it holds the pools (by name) but does not decide for them.

    commands (any thread: submit)     worker processes            timers
        │                               │ pidfd readable: exited    │ grace over: SIGKILL
        │                               │ ready pipe: EOF = it runs │ a wait timed out
        ▼                               ▼                           ▼
    ┌──────────────────────── reactor turn (reactor.py) ─────────────────────────┐
    │ readers: exits (end tree remnants, reap, transition), ready pipes           │
    │ commands applied in order    forks of pending replicas (spawning.py)        │
    │ timers                       settle: waiters, ONE store commit, then replies│
    └─────────────────────────────────────────────────────────────────────────────┘

Run by the daemon's loop thread (and the embedded ``Orchestrator``'s), both built by
loop.py, which hands it the daemon's additions (``Hooks``) at construction. Nothing but that
thread reads or writes a Replica, a Pool or the process table, so there is no lock, and a
terminate can never race a reap: both are events, applied one after the other, and
whichever comes second finds a state that tells it what is left to do. Every state change
goes through ``states.transition()``; a process is signalled only while it is our unreaped
child (its zombie pins the pid and the process group), and forgotten only after it is
reaped. What differs between a cgroup and a process group is decided in containment.py;
what a pool should hold (readiness, restarts, rollouts, its size, the commands that shape
pools, ``terminate`` among them) in supervision.py, which acts on the table only through
its ``Table`` interface. A Pool writes its own fields (pools.py): the engine only numbers a
pool's replicas and keeps its ``live`` as they begin and end; process
syscalls go through ``OSApi`` (osapi.py), store writes through ``Journal`` (journal.py).
The system children (watchdog, manager) are not the engine's.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from .. import protocol
from ..errors import InvalidSpec, OrchestratorError, ShuttingDown, UnknownReplica
from ..states import Replica, exit_reason, transition
from ..states import ReplicaState as S
from .containment import Cgroups, ProcessGroups
from .journal import Journal
from .metrics import Metrics
from .osapi import OSApi, Spawned
from .pools import Pool
from .reactor import Reactor, Timer
from .sockets import Listeners
from .spawning import Spawning
from .supervision import Supervisor
from .tasks import Tasks
from .waiters import Waiter, Waiters

if TYPE_CHECKING:
    from .limits import Limits
    from .logcapture import LogCapture

log = logging.getLogger("orchestrator")

Reply = protocol.ReplyTo
Handler = Callable[[dict[str, Any], Reply, Any], Any]
MAX_COUNT = protocol.MAX_COUNT
COMMIT_RETRY = 1.0  # seconds between commits while the journal has a fault
# Seconds after a Python target's stop signal at which it is sent a SIGURG, while it lives (_kick).
KICKS = (0.05, 0.25, 1.0, 4.0)
SHUTDOWN_MARGIN = 1.0  # of a stop budget, kept for what comes after the replicas (SIGKILL, reap, manager, journal)


@dataclass
class EngineConfig:
    grace: float = 5.0  # SIGTERM -> SIGKILL, per replica
    spawn_batch: int = 64  # forks per loop turn, so commands and exits interleave with a burst
    keep_ended: int = 1000  # terminal replicas kept in memory for `status --all`
    env: dict[str, str] | None = None  # base environment of command workers (default: ours)
    token: str | None = None  # ORCHESTRATOR_DAEMON_TOKEN, marks every process of one daemon
    spawners: bool = False  # replicas made by spawner processes (spawner.py, launcher.py), not forked here
    stdio: tuple[int, int] | None = None  # fds for replicas' stdout and stderr without a log capture (None: /dev/null)
    task_socket: str | None = None  # where executor workers connect (None: an abstract socket)
    task_stop_reason: str = "interrupted: the executor shut down"  # a task cut short by a shutdown
    result_max_bytes: int | None = None  # a task result larger than this fails its task
    inherited_sockets: tuple[tuple[str, int], ...] = ()  # (name, fd) systemd passed the daemon (sockets.py)


@dataclass(frozen=True)
class Hooks:
    """What the process that runs a loop adds to its engine, given at construction (the
    daemon's, through loop.py; an embedded loop adds none)."""

    status: Callable[[], dict[str, Any]] | None = None  # merged into every `status` reply
    # op -> handler(args) -> result: commands of the daemon (health, metrics, reload)
    commands: Mapping[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)
    # op -> handler(args, reply, cmd_id): a command whose reply may wait (protocol.DEFERRED: upgrade)
    deferred: Mapping[str, Handler] = field(default_factory=dict)
    # launches that would take the fds and pids the daemon's control plane keeps are
    # refused (room_for). None: no such check.
    limits: "Limits | None" = None
    log_capture: "LogCapture | None" = None  # replicas' stdout/stderr to files; a replica's go with its record
    reopen_store: Callable[[], Any] | None = None  # the journal's store file vanished: a new one
    turn_end: tuple[Callable[[], None], ...] = ()  # run at the end of every turn, after the engine's settle


@dataclass(eq=False, slots=True)
class Proc:
    """A replica's process, from its spawn until it is reaped (and its cgroup drained)."""

    pid: int
    exit_fd: int
    ready_fd: int
    replica: Replica
    killed: bool = False  # SIGKILL sent by us
    reaped: bool = False
    kill_timer: Timer | None = None
    escaped: list[tuple[int, int]] = field(default_factory=list)  # (pid, start) outside its group
    cleanup: list[Callable[[], None]] = field(default_factory=list)  # its probes, timers, notify socket
    cgroup: str | None = None  # its own cgroup (cgroup containment), else None: its process group
    probes: Any = None  # probebox.ProbeBox of its exec probes, made by the first one


class Engine:
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
        hooks: Hooks | None = None,
    ) -> None:
        hooks = hooks or Hooks()
        self.config = config or EngineConfig()
        protocol.seconds(self.config.grace, "grace")  # a NaN grace would never SIGKILL
        self.os = os_api or OSApi()
        self.reactor = reactor or Reactor(self.os.monotonic)
        self.journal = Journal(store, self.os.time)
        self.journal.rebuild = self._save_everything
        self.journal.reopen = hooks.reopen_store
        if hooks.log_capture is not None:
            self.journal.forgotten = hooks.log_capture.forget  # a replica's logs go with its record
        self.watchdog = watchdog  # the watchdog's ledger feed (WatchdogLink), if any
        # A cgroup per replica, or process groups (containment.py); the default keeps the
        # engine off the cgroupfs (the fake-OS tests, the embedded API unless asked).
        self.containment = containment or ProcessGroups("not asked for (the default)")
        self.containment.attach(self.reactor, self.os, watchdog)
        base_env = dict(self.config.env if self.config.env is not None else os.environ)
        self.metrics = Metrics(clock=self.os.monotonic, wall=self.os.time)
        self.log_capture = hooks.log_capture
        self.listeners = Listeners(self.reactor, self._sockets_in_use, self.config.inherited_sockets)
        self.supervisor = Supervisor(self, base_env=base_env, token=self.config.token)
        self.spawning = Spawning(self, self.supervisor, base_env, batch=self.config.spawn_batch,
                                 token=self.config.token, spawners=self.config.spawners, stdio=self.config.stdio)
        self.spawners = self.spawning.spawners
        self.tasks = Tasks(self, address=self.config.task_socket, token=self.config.token,
                           stop_reason=self.config.task_stop_reason, result_max_bytes=self.config.result_max_bytes,
                           log_capture=self.log_capture)
        self._inbox: collections.deque[tuple[Mapping[str, Any], Reply]] = collections.deque()
        self._submit_lock = threading.Lock()
        self._drain_asked = False  # a _drain_inbox is scheduled and has not begun
        self._pools: dict[str, Pool] = {}
        self._replicas: dict[str, Replica] = {}
        self._ended: collections.deque[str] = collections.deque()
        self._procs: dict[int, Proc] = {}
        self._draining: dict[str, Proc] = {}  # replica id -> reaped, its cgroup not empty yet
        self._waiters = Waiters(self._replicas)
        # (reply, message, durable): a durable reply says "applied"; if this turn's commit
        # fails it says so still, with the journal's fault beside it ("unsaved"): the
        # command was applied all the same. Read-only commands never depend on the disk.
        self._outbox: list[tuple[Reply, protocol.Reply, bool]] = []
        self.extra_status = hooks.status
        self.limits = hooks.limits
        self.extra_commands: dict[str, Callable[[dict[str, Any]], Any]] = dict(hooks.commands)
        self._commands: dict[str, Handler] = {
            "status": self._cmd_status, "wait": self._cmd_wait,
            "ping": self._cmd_ping, **self.supervisor.commands(), **self.tasks.commands(), **hooks.deferred}
        self._stop_deadline: float | None = None  # shutdown against a budget: graces are cut to it
        self._dirty = False
        self._store_warned = -1e9
        self._retry_commit_at = 0.0  # while the journal has a fault: no commit before this (monotonic)
        self._retry_timer: Timer | None = None
        self.closing = False
        self.closed = False
        self.reactor.at_turn_end(self.settle)
        for callback in hooks.turn_end:
            self.reactor.at_turn_end(callback)

    # -- the public face ------------------------------------------------------------

    def submit(self, cmd: Mapping[str, Any], reply: Reply) -> None:
        """Queue a command from any thread; ``reply`` is called once, from the loop."""
        with self._submit_lock:  # against close(): a command is either run or refused
            if self.closed:
                raise ShuttingDown("the orchestrator is not running")
            self._inbox.append((cmd, reply))
            # One wake-up for a burst: a drain already asked for takes this command too.
            if self._drain_asked:
                return
            self._drain_asked = True
        self.reactor.call_soon_threadsafe(self._drain_inbox)

    def _drain_inbox(self) -> None:
        with self._submit_lock:
            self._drain_asked = False  # from here on, a new command asks for a new drain
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
            handler = self._commands.get(op)
            extra = self.extra_commands.get(op) if handler is None else None
            if handler is None and extra is None:
                raise InvalidSpec(f"unknown command {op!r}")
            if self.closing:
                raise ShuttingDown("the orchestrator is shutting down")
            args = cmd.get("args") or {}
            if not isinstance(args, dict):
                raise InvalidSpec("malformed command: 'args' must be an object")
            started = self.os.monotonic()
            if handler is not None:
                result = handler(args, reply, cmd_id)
            elif extra is not None:
                result = extra(args)
        except OrchestratorError as err:
            self._journal_command(op, cmd_id, str(err))
            self._outbox.append((reply, protocol.error(cmd_id, err), False))
            self.metrics.command(op if isinstance(op, str) else "", 0.0, False)  # "": labelled "other"
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
        """Stop every replica (stop signal, grace, KILL) and wait until all are reaped;
        from now on every command is refused. Pools stop in the order of their ``after``
        (Order.stop_layers): the pools nobody starts after all at once, and the pools
        they start after once those have ended, and so on. With a ``budget`` (seconds)
        every grace is cut so that all is over inside it (systemd's TimeoutStopSec,
        Kubernetes' terminationGracePeriodSeconds), each layer getting an equal share of
        what is left. Desired sizes are kept: the next start brings the pools back. It
        returns once every replica tree it signalled is gone: the descendants that left a
        replica's process group too, SIGKILLed when their grace is over (containment.py)."""
        if self.closed:
            return
        self.closing = True
        end = None if budget is None else self.os.monotonic() + max(0.0, budget - SHUTDOWN_MARGIN)
        layers = self.supervisor.order.stop_layers()
        for i, names in enumerate(layers):
            wait = self.config.grace + 1.0
            if end is not None:
                now = self.os.monotonic()
                self._stop_deadline = now + max(0.0, end - now) / (len(layers) - i)
                wait = self._stop_deadline - now
            members = set(names)
            for rep in [r for name in names for r in self._pools[name].live.values()]:
                self.stop(rep, reason="shutdown")
            self.reactor.run_until(lambda: not any(p.replica.pool in members for p in
                                                   (*self._procs.values(), *self._draining.values())), wait)
        def done() -> bool:
            return not self._procs and not self._draining

        if not done():
            for proc in list(self._procs.values()):
                self.containment.kill_tree(proc)
            self.reactor.run_until(done, 5.0)
        # What left a stopped replica's group outlives its reap until the SIGKILL after its
        # grace, a timer of this loop: waited for here, or it would outlive the loop.
        self.containment.end_escapes(end)
        self._outbox.extend(self._waiters.fail_all(ShuttingDown("the orchestrator is shutting down")))
        self.settle()
        self.spawning.stop()

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
        self.tasks.close()
        self.listeners.close()
        self.reactor.close()

    @property
    def store(self) -> Any:
        return self.journal.store

    def _save_everything(self) -> None:
        """Every pool and every replica in memory, into a journal that starts empty."""
        for pool in self._pools.values():
            self.save_pool(pool)
        for rep in self._replicas.values():
            self.journal.replica(rep)

    def child_exited(self, pid: int) -> bool:
        """A SIGCHLD scan found ``pid`` exited: handle it if it is a replica's (True)."""
        proc = self._procs.get(pid)
        if proc is None:
            return self.spawning.exited(pid)
        self._on_exit(proc)
        return True

    def _sockets_in_use(self) -> set[str]:
        return {a for pool in self._pools.values() if not pool.deleted for a in pool.policy.sockets}

    def start_spawners(self, wait: float = 0.0) -> None:
        """Start the default spawner; ``wait``: run the loop until it is ready (bounded)."""
        self.spawning.start(wait)

    def system_pids(self) -> set[int]:
        """Our children that are not replicas (the spawners)."""
        return self.spawning.pids()

    def status(self, include_terminal: bool = False) -> dict[str, Any]:
        status: dict[str, Any] = self._cmd_status({"all": include_terminal}, None, None)
        return status

    # -- the table, as the supervisor and the spawning see it (supervision.Table) ------

    def pool(self, name: Any) -> Pool | None:
        return self._pools.get(name) if isinstance(name, str) else None

    def pools(self) -> Iterable[Pool]:
        return list(self._pools.values())

    def add_pool(self, pool: Pool) -> None:
        self._pools[pool.name] = pool

    def replica(self, rid: str) -> Replica | None:
        return self._replicas.get(rid)

    def proc_by_pid(self, pid: int) -> Proc | None:
        """The live (unreaped) process ``pid`` of a replica, if it is one."""
        return self._procs.get(pid)

    def lookup(self, rid: str) -> Replica | None:
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

    def proc_of(self, rep: Replica) -> Proc | None:
        """The live process of ``rep``, if any. A replica whose cgroup is being drained keeps
        its (reaped) pid until it has ended, and that number may belong to a new replica
        already: hence the identity check."""
        proc = self._procs.get(rep.pid) if rep.pid is not None else None
        return proc if proc is not None and proc.replica is rep else None

    def reply(self, reply: Reply, msg: protocol.Reply, durable: bool) -> None:
        """Send ``msg`` after this turn's commit (``durable``: an ok reply carries the
        journal's fault, ``unsaved``, if that commit fails)."""
        self._outbox.append((reply, msg, durable))

    def changed(self) -> None:
        """Something changed this turn: waiters and rollouts are looked at when it ends."""
        self._dirty = True

    def room_for(self, more: int) -> None:
        """Refuse (one line, before anything changes) ``more`` new replicas that would take
        what the daemon keeps for its control plane at its fd or pids limit (limits.py).
        Those not started yet (PENDING, or a place a restart fills later) count too."""
        if self.limits is None or more <= 0:
            return
        desired = sum(p.desired for p in self._pools.values() if not p.deleted)
        why = self.limits.refusal(more, replicas=len(self._procs), waiting=max(0, desired - len(self._procs)))
        if why is not None:
            raise OrchestratorError(why)

    # -- commands -------------------------------------------------------------------

    def _cmd_status(self, args: dict[str, Any], reply: Reply | None, cmd_id: Any) -> Any:
        if args.get("all"):
            rows = {r.id: r.to_dict() for r in self._replicas.values()}
            if self.store is not None:  # older history, and replicas of earlier daemons
                stored = {row["id"]: row for row in self.store.replicas(include_terminal=True)}
                rows = {**stored, **rows}
            replicas = sorted(rows.values(), key=lambda r: (r["created_at"], r["id"]))
        else:
            replicas = [r.to_dict() for r in self._replicas.values() if not r.state.terminal]
        pools = []
        for name in self.supervisor.order.start_order():
            row = {**self._pools[name].to_dict(), "waiting": self.supervisor.order.pool_waiting(self._pools[name])}
            counts = self.tasks.pool_counts(name)
            if counts is not None:
                row["tasks"] = counts
                row["workers"] = self.tasks.pool_workers(name)  # busy, idle, min, max, budget
            pools.append(row)
        result = {"pools": pools, "replicas": replicas}
        if self.extra_status is not None:
            result.update(self.extra_status())
        return result

    def _cmd_wait(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        ids = protocol.replica_ids(args.get("ids"), "wait")
        until = args.get("until", "running")
        if until not in ("running", "ended"):
            raise InvalidSpec("until must be 'running' or 'ended'")
        timeout = protocol.wait_timeout(args)
        for i in ids:
            self.lookup(i)
        return self.wait_for(tuple(ids), until, reply, cmd_id, timeout, durable=False)

    def _cmd_ping(self, args: dict[str, Any], reply: Reply, cmd_id: Any) -> Any:
        return "pong"

    def launch(self, pool: Pool, count: int, *, slots: list[int] | None = None) -> list[str]:
        """``count`` new replicas in the lowest free slots (or in ``slots``: replacements),
        PENDING until spawning.py starts them. The pool's size is the supervisor's to
        change (a replacement takes a place the pool has; a launch adds to it)."""
        ids = []
        now = self.os.time()
        assert pool.runtime is not None, "launch from a pool with a usable spec"
        for slot in slots if slots is not None else pool.free_slots(count):
            n = pool.take_number()
            rep = Replica(f"{pool.name}-{n}", pool.name, n, created_at=now, slot=slot,
                          restarts=pool.slot_restarts.get(slot, 0), made_from=(pool.runtime, pool.policy))
            self._replicas[rep.id] = rep
            pool.add(rep)
            self.spawning.add(rep, pool.runtime)
            self.journal.transition(rep, None)
            ids.append(rep.id)
        if ids:
            self.metrics.launched(pool.name, len(ids))
        self.spawning.schedule()
        return ids

    # -- an upgrade (handover.py): what is carried, and taken over -----------------------

    def procs(self) -> list[Proc]:
        """The live processes of replicas, unreaped."""
        return list(self._procs.values())

    def replicas_in(self, *states: S) -> list[Replica]:
        return [r for r in self._replicas.values() if r.state in states]

    def draining(self) -> int:
        """Replicas reaped whose tree (cgroup) has not ended yet."""
        return len(self._draining)

    def waiters(self) -> list[Waiter]:
        return list(self._waiters)

    def adopt(self, rep: Replica, pidfd: int, *, cgroup: str | None, cleanup: list[Callable[[], None]],
              kill_deadline: float | None, killed: bool, escaped: list[tuple[int, int]],
              ready_fd: int | None = None) -> Proc:
        """A replica whose process an earlier image of this daemon started (STARTING,
        RUNNING, STOPPING, or ended but not reaped): watched again through ``pidfd``, and
        through its ready pipe ``ready_fd`` if its exec was not known to have succeeded;
        its SIGKILL deadline, if it is stopping, kept. The watchdog's ledger has it already."""
        pool = self._pools[rep.pool]
        rep.made_from = (pool.runtime, pool.policy)
        self._replicas[rep.id] = rep
        if not rep.state.terminal:  # a replica interrupted while starting is not the pool's any more
            pool.add(rep)
        proc = Proc(rep.pid or 0, pidfd, -1 if ready_fd is None else ready_fd, rep, killed=killed, escaped=escaped,
                    cleanup=cleanup, cgroup=cgroup)
        self._procs[proc.pid] = proc
        self.reactor.add_reader(pidfd, lambda: self._on_exit(proc))
        if ready_fd is not None:
            os.set_inheritable(ready_fd, False)  # it was, for the exec
            self.reactor.add_reader(ready_fd, lambda: self._on_ready(proc))
        if kill_deadline is not None:
            proc.kill_timer = self.reactor.call_at(kill_deadline, lambda: self.containment.kill_after_grace(proc))
        return proc

    def adopt_pending(self, rep: Replica) -> None:
        """A PENDING replica of an earlier image (its spawn was held for the upgrade)."""
        pool = self._pools[rep.pool]
        assert pool.runtime is not None, "a pending replica's pool has a usable spec"
        rep.made_from = (pool.runtime, pool.policy)
        self._replicas[rep.id] = rep
        pool.add(rep)
        self.spawning.add(rep, pool.runtime)
        self.spawning.schedule()

    def adopt_waiter(self, ids: Iterable[str], until: str, reply: Reply, cmd_id: Any, deadline: float,
                     durable: bool) -> None:
        """An open ``wait`` (or ``--wait``) of an earlier image, answered by this one."""
        self.wait_for(ids, until, reply, cmd_id, max(0.0, deadline - self.os.monotonic()), durable=durable)

    # -- a replica's process ------------------------------------------------------------

    def spawned(self, rep: Replica, sp: Spawned, cgroup: str | None, cleanup: list[Callable[[], None]]) -> None:
        """Its process exists (spawning.py): watched from now on, STARTING."""
        rep.pid, rep.start_time = sp.pid, sp.start_time
        proc = Proc(sp.pid, sp.exit_fd, sp.ready_fd, rep, cgroup=cgroup, cleanup=cleanup)
        self._procs[sp.pid] = proc
        self.reactor.add_reader(sp.exit_fd, lambda: self._on_exit(proc))
        self.reactor.add_reader(sp.ready_fd, lambda: self._on_ready(proc))
        if self.watchdog is not None and sp.start_time is not None:
            self.watchdog.add(sp.pid, sp.start_time, sp.pid, "worker", rep.id)
        self.transition(rep, S.STARTING)
        self.tasks.spawned(sp.pid)  # an executor worker that connected before we knew its pid

    def failed(self, rep: Replica, reason: str) -> None:
        """It ended before it ran (could not start, not ready): FAILED, then the restart policy."""
        self.transition(rep, S.FAILED, reason)
        self.supervisor.ended_on_its_own(rep, failed=True)

    def _on_ready(self, proc: Proc) -> None:
        if proc.ready_fd < 0:
            return
        data = self.os.read_ready(proc.ready_fd)
        self.reactor.remove_reader(proc.ready_fd)
        self.os.close(proc.ready_fd)
        proc.ready_fd = -1
        if proc.replica.state is not S.STARTING:
            return  # interrupted while starting: its end is already recorded
        if data:
            self.failed(proc.replica, "could not start: " + data.decode("utf-8", "replace"))
        else:
            self.supervisor.readiness.started(proc)

    def _on_exit(self, proc: Proc) -> None:
        if proc.reaped:
            return  # a stale event: a SIGCHLD scan got to it first in this turn
        if proc.ready_fd >= 0:
            self._on_ready(proc)  # the pipe is at EOF or holds the reason: settle it first
        self.containment.end_remnants(proc)  # before the reap, while the pid is still ours
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
        rid = proc.replica.id
        self._draining[rid] = proc  # until its tree is gone (at once without a cgroup)

        def ended(oom: bool) -> None:
            self._draining.pop(rid, None)
            self._record_end(proc, code, oom)

        self.containment.watch_end(proc, code, proc.replica.created_at, ended)

    def _record_end(self, proc: Proc, code: int | None, oom: bool) -> None:
        """The replica's processes are all gone: record how it ended."""
        rep = proc.replica
        rep.pid = None
        self._dirty = True
        if oom:
            reason = "OOM-killed"
        else:
            reason = exit_reason(code) if code is not None else "exit status unknown (reaped elsewhere)"
        if rep.state is S.RUNNING:
            new = S.EXITED if code == 0 else S.FAILED
            self.transition(rep, new, reason, exit_code=code)
            self.supervisor.ended_on_its_own(rep, failed=new is S.FAILED)
        elif rep.state is S.STARTING:  # ran, but ended before it was ready
            self.transition(rep, S.FAILED, f"exited during start ({reason})", exit_code=code)
            self.supervisor.ended_on_its_own(rep, failed=True)
        elif rep.state is S.STOPPING:
            if proc.killed:
                reason = f"{reason} after {self._grace(rep):g}s grace"
            self.transition(rep, S.TERMINATED, reason, exit_code=code)
            self.supervisor.stopped(rep)
        else:
            self.journal.replica(rep)  # terminal already: only the pid is gone
        self.tasks.worker_ended(rep)

    def stop(self, rep: Replica, *, reason: str) -> bool:
        """Terminate one replica; a no-op (False) when it is ending or ended already. Its
        pool keeps its size: lowering it is the caller's (the supervisor's) decision."""
        state = rep.state
        if state is S.PENDING:
            self.transition(rep, S.INTERRUPTED, reason)
        elif state is S.STARTING:
            self.transition(rep, S.INTERRUPTED, reason)
            self.signal_and_arm(rep)
        elif state is S.RUNNING:
            self.transition(rep, S.STOPPING, reason)
            self.signal_and_arm(rep)
        else:
            return False
        return True

    def _grace(self, rep: Replica) -> float:
        pool = self._pools.get(rep.pool)
        grace = pool.policy.grace if pool is not None else None
        grace = self.config.grace if grace is None else grace
        if self._stop_deadline is not None:  # a shutdown against a budget
            grace = max(0.0, min(grace, self._stop_deadline - self.os.monotonic()))
        return grace

    def signal_and_arm(self, rep: Replica) -> None:
        """Its pool's stop signal to its tree, and SIGKILL once the grace is over."""
        proc = self.proc_of(rep)
        if proc is None or proc.kill_timer is not None:
            return
        pool = self._pools.get(rep.pool)
        sig = pool.policy.signum if pool is not None else signal.SIGTERM
        proc.escaped = self.containment.signal_tree(proc, sig)
        proc.kill_timer = self.reactor.call_later(self._grace(rep), lambda: self.containment.kill_after_grace(proc))
        if pool is not None and pool.runtime is not None and pool.runtime.run is not None:
            self._kick(proc, 0)

    def _kick(self, proc: Proc, n: int) -> None:
        """SIGURG to a Python target's worker KICKS[n] s after its stop signal, while it lives:
        a stop signal that landed just before a blocking call (time.sleep) leaves its handler
        pending until that call returns, and a SIGURG (whose handler does nothing: worker.py)
        interrupts the call, so the Terminated is raised now, not the SIGKILL after the grace."""

        def fire() -> None:
            if proc.reaped or proc.killed:
                return
            self.os.kill_child(proc.pid, signal.SIGURG)  # our unreaped child: the pid is pinned
            if n + 1 < len(KICKS):
                self._kick(proc, n + 1)

        self.reactor.call_later(KICKS[n] - (KICKS[n - 1] if n else 0.0), fire)

    def signal(self, rep: Replica, sig: int) -> bool:
        """``sig`` to every process of ``rep``, if it has a live one (True)."""
        proc = self.proc_of(rep)
        if proc is None or proc.reaped:
            return False
        self.containment.signal_tree(proc, sig)
        return True

    def transition(self, rep: Replica, new: S, reason: str | None = None, *, exit_code: int | None = None) -> None:
        old = transition(rep, new, reason, exit_code=exit_code, clock=self.os.time)
        self._dirty = True
        if new.terminal:
            self.metrics.exited(rep.pool, _exit_kind(rep))
            pool = self._pools.get(rep.pool)
            if pool is not None:
                pool.remove(rep)
            self._ended.append(rep.id)
        self.journal.transition(rep, old)

    def _forget_ended(self) -> None:
        """Ended replicas beyond ``keep_ended`` leave memory (the journal keeps them), the
        oldest first, except those an open waiter or rollout still reads: a terminate of
        2,000 replicas must still name all 2,000 in its reply."""
        excess = len(self._ended) - self.config.keep_ended
        if excess <= 0:
            return
        held = {rid for w in self._waiters for rid in w.ids} | self.supervisor.held()
        kept: list[str] = []
        while excess > 0 and self._ended:
            rid = self._ended.popleft()
            if rid in held:
                kept.append(rid)
            else:
                self._replicas.pop(rid, None)
                excess -= 1
        self._ended.extendleft(reversed(kept))

    def save_pool(self, pool: Pool) -> None:
        if (pool.runtime is not None or pool.unresolved is not None) and self.journal.store is not None:
            self.journal.pool(pool.name, pool.stored(), pool.desired, pool.next_n)

    def _journal_command(self, op: Any, cmd_id: Any, error: str | None) -> None:
        if op not in protocol.UNJOURNALED:
            self.journal.command(op, cmd_id, error)

    # -- waiting ------------------------------------------------------------------

    def wait_for(self, ids: Iterable[str], until: str, reply: Reply, cmd_id: Any, timeout: float,
                 *, durable: bool = True) -> Any:
        """Reply once every one of ``ids`` is ``until`` ("running", "ended"), or at ``timeout``."""
        waiter = Waiter(tuple(ids), until, reply, cmd_id, durable=durable,
                        deadline=self.os.monotonic() + timeout)
        self._waiters.add(waiter)
        self.reactor.call_later(timeout, lambda: self._outbox.extend(self._waiters.timed_out(waiter)))
        self._dirty = True
        return protocol.DEFERRED

    # -- settling a turn ------------------------------------------------------------

    def settle(self) -> None:
        """The end of a turn: rollouts and waiters checked, one commit, then the replies."""
        self.spawning.release()  # replicas that waited for the pools theirs starts after, or a budget
        if self._dirty:
            self._dirty = False
            self.supervisor.settle()
            self.tasks.settle()
            if self._waiters:
                self._outbox.extend(self._waiters.check())
            self._forget_ended()
        if self.store is not None:
            self.commit()  # before any reply: an acknowledged command is durable (unless the disk fails)
        if self._outbox:
            out, self._outbox = self._outbox, []
            unsaved = self.journal.fault
            for reply, msg, durable in out:
                if unsaved is not None and durable and msg["ok"]:
                    msg = {**msg, "unsaved": unsaved}  # applied; its durability is the journal's fault
                reply(msg)

    def commit(self) -> bool:
        """Commit this turn's changes; False if the disk fails. A failing disk must not
        kill the loop (the replicas still need supervising), nor fail the commands of the
        turn: they were applied, the tasks they queued run, and a client told otherwise
        would run them again. Their rows stay buffered (journal.py) and go in with the
        first commit that succeeds; meanwhile the fault is the journal's, shown by
        ``health`` and ``status``, and retried once a second (an idle daemon catches up by
        itself when space returns), not on every turn."""
        now = self.os.monotonic()
        if self.journal.fault is not None and now < self._retry_commit_at:
            return False
        err = self.journal.commit()
        if err is None:
            if self._retry_timer is not None:
                self._retry_timer.cancel()
                self._retry_timer = None
            return True
        self.metrics.store_failure()
        if now - self._store_warned > 10.0:  # one line per 10 s, not one per turn
            self._store_warned = now
            log.error("state not saved (will retry; %d changes wait): %s", self.journal.unsaved, err)
        self._retry_commit_at = now + COMMIT_RETRY
        if self._retry_timer is None:
            # Nothing may happen in an idle daemon: this turn's settle is the retry.
            self._retry_timer = self.reactor.call_later(COMMIT_RETRY, self._commit_retry_due)
        return False

    def _commit_retry_due(self) -> None:
        """The retry's wake-up: the settle of this turn commits (``_retry_commit_at`` is past)."""
        self._retry_timer = None


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
