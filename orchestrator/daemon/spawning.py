"""From PENDING to STARTING: the queue of replicas to start and the start of each.

Run by the daemon's loop thread, for the engine (engine.py). A launch makes PENDING
replicas and asks for a spawn; once per turn (``schedule``), at most ``spawn_batch`` of
them are started, after their ids are committed (an id must be durable before its process
exists). Each start is made ready here (its log files, its cgroup, its notify socket, its
listening sockets, its ``LaunchPlan``) and asked of a spawner process (spawner.py) or forked at once; the whole
batch is asked before any answer is collected, so the spawners fork while we send. The
answer goes back to the table (``Engine.spawned``, or ``Engine.failed`` with the reason).

    launch ─► PENDING ─► (held: a pool it starts after is not ready, its executor pool is
                 │       at its memory budget, or its preload spawner is not ready: the
                 │       reason says which; looked at again at a turn's end)
                 └─► begin: logs, cgroup, notify socket, plan ─► spawner / fork
                                        └─► end: the answer ─► Engine.spawned: STARTING
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import InvalidSpec
from ..taskwire import SOCKET_ENV as TASK_SOCKET_ENV
from ..spec import Runtime
from ..states import Replica
from ..states import ReplicaState as S
from .containment import Cgroups, CgroupUnavailable, ProcessGroups
from .journal import Journal
from .launcher import HOLD, HOLD_REASON, Spawner, Spawners, Unavailable
from .osapi import OSApi, Spawned
from .pools import Pool
from .reactor import Reactor
from .sockets import Listeners, env_for
from .supervision import Supervisor

if TYPE_CHECKING:
    from watchdog.link import WatchdogLink

    from .logcapture import LogCapture, ReplicaLog, Stream
    from .notify import NotifySocket
    from .osapi import Begun


class TaskListener(Protocol):
    """The task table (tasktable.py), as far as the spawning needs it."""

    @property
    def address(self) -> str: ...  # its listener, for $ORCHESTRATOR_TASK_SOCKET

    def start_held(self, rep: Replica, begun: int) -> str | None: ...  # its pool's memory budget


class Table(Protocol):
    """What the spawning asks of the replica table (engine.Engine)."""

    reactor: Reactor
    os: OSApi
    journal: Journal
    closing: bool  # a shutdown: nothing more is started (the pools stop in order)
    containment: Cgroups | ProcessGroups
    watchdog: WatchdogLink | None
    log_capture: LogCapture | None  # replicas' stdout/stderr to files (the daemon's)
    listeners: Listeners  # the pools' listening sockets
    tasks: TaskListener  # where an executor pool's workers connect

    def pool(self, name: str) -> Pool | None: ...
    def commit(self) -> bool: ...
    def spawned(self, rep: Replica, sp: Spawned, cgroup: str | None, cleanup: list[Callable[[], None]]) -> None: ...
    def failed(self, rep: Replica, reason: str) -> None: ...


@dataclass(eq=False, slots=True)
class _SpawnRequest:
    """A PENDING replica whose start was asked for, until the answer (``_end``)."""

    rep: Replica
    asked: Begun | Spawned | None = None  # asked of a spawner, or a fork done at once
    cgroup: str | None = None
    captured: ReplicaLog | None = None  # its stdout and stderr files
    notify: NotifySocket | None = None


class Spawning:
    """The PENDING replicas and their starts; see the module docstring."""

    def __init__(self, table: Table, supervisor: Supervisor, base_env: dict[str, str], *,
                 batch: int, token: str | None, spawners: bool, stdio: tuple[int, int] | None = None) -> None:
        """``batch``: starts per turn, so commands and exits interleave with a burst;
        ``token``: marks every process of one daemon; ``spawners``: replicas made by
        spawner processes (spawner.py), not forked here; ``stdio``: the fds replicas write
        to where there is no log capture (the embedding program's own, for an Executor)."""
        self.table = table
        self.supervisor = supervisor
        self._batch = batch
        self._token = token
        self._stdio = stdio
        # Started by start(), from the loop's thread: the replicas' PDEATHSIG follows it.
        self.spawners = Spawners(table.reactor, table.os, table.watchdog, base_env, self._spawners_changed,
                                 output=self._spawner_output) if spawners else None
        self._pending: collections.deque[tuple[Replica, Runtime]] = collections.deque()
        self._held: list[tuple[Replica, Runtime]] = []  # waiting for their pool's preload spawner
        # pool -> its replicas waiting for the pools it starts after (Order.waiting)
        self._gated: dict[str, list[tuple[Replica, Runtime]]] = {}
        self._scheduled = False
        self._upgrade_hold = False

    # -- the spawner processes ------------------------------------------------------------

    def start(self, wait: float = 0.0) -> None:
        """Start the default spawner; ``wait``: run the loop until it is ready (bounded)."""
        if self.spawners is not None:
            self.spawners.start()
            if wait:
                self.table.reactor.run_until(self.spawners.settled, wait)

    def stop(self) -> None:
        if self.spawners is not None:
            self.spawners.stop()

    def exited(self, pid: int) -> bool:
        """A SIGCHLD scan found ``pid`` exited: handled if it is a spawner (True)."""
        return self.spawners is not None and self.spawners.exited(pid)

    def pids(self) -> set[int]:
        return self.spawners.pids() if self.spawners is not None else set()

    def _spawner_output(self) -> Stream | None:
        """Where the spawners' stdout and stderr go: ``logs/spawner.log``, rotated like a
        replica's logs (None without a log capture: /dev/null)."""
        capture = self.table.log_capture
        return capture.open_stream("spawner", "log") if capture is not None else None

    def _spawners_changed(self) -> None:
        """A spawner became ready or failed: what waited for it is spawned now."""
        for rep, _ in self._held:
            rep.reason = None
        self._pending.extendleft(reversed(self._held))
        self._held.clear()
        self.schedule()

    def release(self) -> None:
        """At a turn's end: the replicas held for the pools their pool starts after, or by
        their executor pool's memory budget, are queued once nothing holds them; the
        others' reason says what they wait for now (``waiting for db (1 of 2 ready)``,
        ``memory budget 512 MiB reached (480 MiB used)``)."""
        if not self._gated or self.table.closing:
            return
        for name, held in list(self._gated.items()):
            held = [(rep, rt) for rep, rt in held if rep.state is S.PENDING]  # not interrupted meanwhile
            pool = self.table.pool(name)
            why = self._why_held(pool, held[0][0], 0) if held and pool is not None else None
            for rep, _ in held:
                rep.reason = why
            if why is None:  # each is looked at again as it starts (_spawn_pending)
                del self._gated[name]
                self._pending.extend(held)
            else:
                self._gated[name] = held
        self.schedule()

    def _why_held(self, pool: Pool, rep: Replica, begun: int) -> str | None:
        """Why ``rep`` may not start now: a pool its pool starts after is not ready, or (an
        executor pool's worker) its pool is at its memory budget, ``begun`` of its workers
        started in this batch; None: it may start."""
        why = self.supervisor.order.waiting(pool) if pool.policy.after else None
        if why is None and pool.is_executor:
            why = self.table.tasks.start_held(rep, begun)
        return why

    # -- the queue ------------------------------------------------------------------------

    def add(self, rep: Replica, runtime: Runtime) -> None:
        """``rep`` (PENDING) is to be started from ``runtime``; call schedule() after."""
        self._pending.append((rep, runtime))

    def schedule(self) -> None:
        if self._pending and not self._scheduled:
            self._scheduled = True
            self.table.reactor.call_soon(self._spawn_pending)

    def hold(self, held: bool) -> None:
        """An upgrade holds new spawns while it waits for the STARTING ones (handover.py)."""
        self._upgrade_hold = held
        if not held:
            self.schedule()

    def _spawn_pending(self) -> None:
        self._scheduled = False
        if not self._pending or self.table.closing or self._upgrade_hold:
            return
        if self.table.journal.pending and not self.table.commit():
            # A replica's id must be durable before its process exists: after a kill -9
            # between fork and commit, the next daemon would hand the id out again. The
            # disk fails: retry in a second, not in a spin.
            self.table.reactor.call_later(1.0, self.schedule)
            return
        asked: list[_SpawnRequest] = []
        begun: collections.Counter[str] = collections.Counter()  # pool -> its starts in this batch
        for _ in range(min(len(self._pending), self._batch)):
            rep, rt = self._pending.popleft()
            if rep.state is not S.PENDING:  # interrupted while it waited
                continue
            pool = self._pool(rep)
            why = self._why_held(pool, rep, begun[rep.pool])
            if why is not None:
                rep.reason = why  # status says what it waits for
                self._gated.setdefault(rep.pool, []).append((rep, rt))
                continue
            via = self.spawners.pick(rt.key, self._pool(rep).policy.ready_timeout) \
                if self.spawners is not None else None
            if via is HOLD:
                rep.reason = HOLD_REASON  # status says why it is still PENDING
                self._held.append((rep, rt))
            elif isinstance(via, Unavailable):  # its preload hangs: it would hang here too
                self.table.failed(rep, f"could not start: {via.reason}")
            elif (req := self._begin(rep, rt, via)) is not None:
                asked.append(req)
                begun[rep.pool] += 1
        for req in asked:  # the spawners fork while the batch's plans are sent: then collect
            self._end(req)
        self.schedule()  # the rest of a burst, after the next round of events

    def _pool(self, rep: Replica) -> Pool:
        pool = self.table.pool(rep.pool)
        assert pool is not None  # a replica's pool is never forgotten, only marked deleted
        return pool

    # -- one start ------------------------------------------------------------------------

    def _begin(self, rep: Replica, rt: Runtime, via: Spawner | None) -> _SpawnRequest | None:
        """Everything a replica's process needs, then its start: asked of the spawner
        ``via`` (answered in _end) or, without one, forked now. None: it FAILED."""
        pool = self._pool(rep)
        try:
            plan = rt.plan(rep.id, rep.pool, rep.slot, pool.port(rep.slot) if rep.slot is not None else None,
                           self._token)
        except InvalidSpec as err:
            self.supervisor.bad_template(rep, err)
            return None
        req = _SpawnRequest(rep)
        table = self.table
        try:
            if table.log_capture is not None:
                req.captured = table.log_capture.open(rep.id, max_bytes=pool.policy.log_max_bytes,
                                                      backups=pool.policy.log_backups)  # None: the daemon's
                plan = dataclasses.replace(plan, stdout=req.captured.stdout, stderr=req.captured.stderr)
            elif self._stdio is not None:
                plan = dataclasses.replace(plan, stdout=self._stdio[0], stderr=self._stdio[1])
            req.cgroup = table.containment.claim(rep.id, pool.policy.limits)
            if req.cgroup is not None:
                plan = dataclasses.replace(plan, cgroup=req.cgroup)
            if pool.policy.sockets:  # socket activation: the pool's listeners on fds 3, 4, ...
                fds, names = table.listeners.fds(pool.policy.sockets, pool.name)
                plan = dataclasses.replace(plan, listen_fds=tuple(fds))
                plan.env.update(env_for(fds, names))
            if pool.is_executor:  # the listener of this run (a stored spec may name an older one)
                plan.env[TASK_SOCKET_ENV] = table.tasks.address
            if pool.policy.ready == "notify":
                req.notify = self.supervisor.readiness.notify_socket(rep)
                plan.env.update(req.notify.env())
            req.asked = table.os.begin(plan, via) if via is not None else table.os.spawn(plan)
        except (OSError, CgroupUnavailable, ValueError) as err:  # fork/pipe/socket/mkdir failed, a limit refused
            self._not_started(req, err)
            return None
        return req

    def _end(self, req: _SpawnRequest) -> None:
        assert req.asked is not None  # _begin returns only a request it asked
        try:
            sp = req.asked if isinstance(req.asked, Spawned) else self.table.os.end(req.asked)
        except OSError as err:
            self._not_started(req, err)
            return
        cleanup: list[Callable[[], None]] = []
        if req.notify is not None:
            cleanup.append(req.notify.close)
        if req.captured is not None:
            req.captured.spawned()  # the child has its ends; what it writes until its exit is drained
            cleanup.append(req.captured.finish)
        self.table.spawned(req.rep, sp, req.cgroup, cleanup)

    def _not_started(self, req: _SpawnRequest, err: Exception) -> None:
        if req.notify is not None:
            req.notify.close()
        if req.captured is not None:
            req.captured.finish()
        self.table.containment.release(req.cgroup)
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        self.table.failed(req.rep, f"could not start: {why}")
