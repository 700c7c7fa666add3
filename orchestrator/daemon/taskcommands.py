"""The commands of the task table (tasktable.py), a collaborator that calls its public API
(as circus's commands call the arbiter): ``executor`` (open or join an executor
pool, with a session), ``task_numbers`` (a block of task numbers a session hands out
itself), ``task_submit``, ``task_attach`` (a session registered again takes its tasks back),
``task_cancel``, ``executor_close``, ``task_events`` (a client's long poll), ``tasks``,
``task_result``; each that takes a task takes ``POOL/@KEY`` too (``task_id``, the one
resolver); a config file's executor pools (``declare``); each pool's counts for
``status``; and the sessions' lifecycle (opened by ``executor``, kept alive by a client's
polls, dropped when closed or idle; the table keeps them). Loop thread only.

Task numbers: a session is granted blocks of numbers (``executor``, then ``task_numbers``)
and names each task's number itself when it submits it, so that the submitter knows the
task's id at once, without a round trip per task; every grant is recorded in the pool's
row (``TaskTable.grant``) before its reply. The table keeps, per open session, the ranges
of its numbers whose submits have not arrived: a command naming such an id (another
process was handed ``fut.task_id`` before the submit reached the loop) is answered at once,
not as an unknown task: ``tasks`` shows it QUEUED, ``task_result`` waits for it, and
``task_cancel`` records its cancel (its submit, when it comes, is that task, CANCELLED).
A task sent again with a number the pool has already (a client that reconnected resends
what it is not sure arrived) is that task, attached to the sender's session, never a
second run.

Joining a pool (``executor`` naming a pool that runs): the joiner takes the pool as it is,
its size (an operator may have scaled it) and its preload (it only warms a worker's
start); what would change how the joiner's tasks run is a conflict, named in the error
with both values: the options (``max_tasks_per_child``, ``timeout``, ``grace``,
``retries``, ``memory_max``, ``tenant_weights``, ``max_wait``, and an elastic pool's ``min_workers``,
``max_workers``, ``idle_timeout``, ``memory_budget``), the initializer and its arguments, and the workers' ``env``,
``cwd`` and import path.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .. import protocol
from .. import taskwire as w
from ..errors import InvalidSpec, UnknownPool, UnknownTask
from ..states import TaskState as T
from .pools import Pool
from .taskrecords import (
    Doc, ExecPool, Reply, Session, Task, as_bytes, backoff, deadline, listing, outcome, parse_options, priority,
    queue_place, target_payload, tenant, wait_fields,
)
from .tasktable import WORKER_TARGET, Table, TaskTable

NUMBERS_MAX = 1 << 31  # task numbers granted to a session at a time (an embedded executor's: all it needs)
Command = Callable[[Doc, Reply, Any], Any]


def _with_size(raw: Any, size: int) -> Any:
    """An executor's options with ``max_workers`` (its pool's size) filled in where it asks
    for an elastic pool (``min_workers``)."""
    if isinstance(raw, dict) and raw.get("min_workers") is not None and raw.get("max_workers") is None:
        return {**raw, "max_workers": size}
    return raw


def _unheard(task_id: str) -> UnknownTask:
    """A task whose number its pool handed out, of which there is no record, and no open
    session has it on its way: it was never submitted (its session ended first, or gave it
    back), or it ended long ago and its record was pruned (``data``: ``{"unheard": true}``)."""
    err = UnknownTask(f"task {task_id!r} is not here: it was never submitted, or it ended long ago "
                      "and its record was pruned")
    err.data = {"unheard": True}
    return err


def _span(value: Any) -> tuple[int, int] | None:
    """``[first, end]`` of task numbers as a client sends it, or None if it is not one."""
    if (isinstance(value, list) and len(value) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in value)):
        return value[0], value[1]
    return None


def _count(value: Any, what: str) -> int:
    """How many task numbers a session asks for."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= NUMBERS_MAX:
        raise InvalidSpec(f"{what} must be a whole number from 1 to {NUMBERS_MAX}, got {value!r}")
    return value


class TaskCommands:
    """The task commands on ``tasks`` (its public API only), for the engine ``table``
    (pools, replies, the store); see the module docstring."""

    def __init__(self, tasks: TaskTable, table: Table) -> None:
        self.tasks = tasks
        self.table = table

    def commands(self) -> dict[str, Command]:
        return {"executor": self._cmd_executor, "task_numbers": self._cmd_numbers, "task_submit": self._cmd_submit,
                "task_attach": self._cmd_attach, "task_cancel": self._cmd_cancel, "executor_close": self._cmd_close,
                "task_events": self._cmd_events, "tasks": self._cmd_tasks, "task_result": self._cmd_result}

    def _cmd_executor(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """Open (or join) an executor pool, and register the session that submits to it
        (``numbers``: the size of the first block of task numbers it is granted; ``after``:
        where a session made anew starts counting its events, so that a client that comes
        back reads on from where it was; ``rejoin``: the pool must exist, it is not made
        again; ``on_its_way``: [[first, end], ...] of the numbers granted to it before
        whose submits are still to come, on their way again). Returns the pool's name, its
        replicas, its size, the block (``numbers``: [first, count]) and whether the session
        is new here (``fresh``)."""
        name = protocol.pool_name(args.get("pool"))
        size = protocol.count(args.get("size"), what="max_workers")
        options = parse_options(_with_size(args.get("options"), size))
        init = as_bytes(args.get("init") or b"", "init")
        about = args.get("init_about")
        spec = args.get("spec")
        if not isinstance(spec, dict) or spec.get("target") != WORKER_TARGET:
            raise InvalidSpec("an executor pool's spec runs " + WORKER_TARGET)
        numbers = _count(args["numbers"], "numbers") if args.get("numbers") is not None else 0
        after = args.get("after") or 0
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidSpec(f"after must be a whole number of at least 0, got {after!r}")
        spec, policy = self.tasks.prepare(spec, {"restart": "always", "grace": options["grace"]}, options)
        xp = self.tasks.pools.get(name)
        pool = self.table.pool(name)
        if xp is not None and not xp.closing and pool is not None and not pool.deleted:
            conflicts = self._conflicts(xp, pool, options, init, about, spec)  # joined as it runs, if none
            if conflicts:
                raise InvalidSpec(f"executor pool {name!r} runs with {'; '.join(conflicts)}: "
                                  "join it with the same, or use another pool name")
            ids = [r.id for r in pool.live.values()]
        elif args.get("rejoin"):
            raise UnknownPool(f"unknown executor pool {name!r} (deleted while this client was away)")
        else:
            if xp is not None and not xp.closing and (xp.options != options or xp.init != init):
                raise InvalidSpec(f"executor pool {name!r} runs with other options: use another pool name")
            # An elastic pool starts with min_workers and grows on demand (elastic.py).
            start = options["min_workers"] if "min_workers" in options else size
            pool, ids = self.table.supervisor.open_pool(name, spec, policy, start)
            if xp is None or xp.closing:
                xp = self.tasks.adopt(pool, options, init, next_n=xp.next_n if xp is not None else 1)
                if about:
                    xp.about = str(about)[:200]  # named in a joiner's conflict
                    self.table.save_pool(pool)
        fresh = False
        session = args.get("session")
        if session is not None:
            sink = args.get("sink")
            if sink is not None and not callable(sink):
                raise InvalidSpec("a session's sink must be callable")
            fresh = str(session) not in self.tasks.sessions
            opened = self.tasks.open_session(str(session), sink, after=after,
                                             waiting_events=args.get("waiting_events") is True)
        block = self.tasks.grant(xp, numbers, opened if session is not None else None) if numbers else None
        coming = args.get("on_its_way")  # a client back after a restart: the numbers it has yet to send
        if session is not None and isinstance(coming, list):
            for pair in coming:
                if (span := _span(pair)) is not None:
                    self.tasks.expect(xp, opened, *span)
        return {"pool": pool.name, "ids": ids, "workers": pool.desired, "numbers": block, "fresh": fresh}

    def _conflicts(self, xp: ExecPool, pool: Pool, options: Doc, init: bytes, about: Any, spec: Doc) -> list[str]:
        """What a joiner asks for that the running pool does not do, each as ``KEY=RUNS,
        not ASKED`` (see the module docstring for which keywords conflict, and why)."""
        out = [f"{key}={xp.options.get(key)!r}, not {options.get(key)!r}"
               for key in ("max_tasks_per_child", "timeout", "grace", "retries", "memory_max", "min_workers",
                           "max_workers", "idle_timeout", "memory_budget", "tenant_weights", "max_wait")
               if xp.options.get(key) != options.get(key)]
        if xp.init != init:
            runs = xp.about or ("another initializer" if xp.init else "none")
            out.append(f"initializer={runs}, not {about or 'another one' if init else 'none'}")
        wire = pool.runtime.wire if pool.runtime is not None else {}
        have_env, want_env = dict(wire.get("env") or {}), dict(spec.get("env") or {})
        for key in sorted(set(have_env) | set(want_env)):
            if key != w.SOCKET_ENV and have_env.get(key) != want_env.get(key):
                out.append(f"env[{key!r}]={have_env.get(key)!r}, not {want_env.get(key)!r}")
        for key, shown in (("cwd", "cwd"), ("pythonpath", "PYTHONPATH")):
            have, want = wire.get(key) or None, spec.get(key) or None
            if have != want:
                out.append(f"{shown}={have!r}, not {want!r}")
        return out

    def _cmd_numbers(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """The next block of task numbers for a session (``count``; [first, count]), or the
        unused end of its latest one given back (``give_back``: [first, end]; taken back
        only if no number was handed out after it)."""
        xp = self._exec_pool(args.get("pool"))
        back = args.get("give_back")
        session = self.tasks.sessions.get(str(args.get("session")))  # whose numbers are on their way
        if back is None:
            return self.tasks.grant(xp, _count(args.get("count"), "count"), session)
        span = _span(back)
        if span is None:
            raise InvalidSpec("give_back must be [first, end]")
        self.tasks.give_back(xp, *span, session)
        return None

    def declare(self, name: str, spec: Mapping[str, Any], policy: Doc, size: int, options: Doc) -> str:
        """An executor pool of the config file (``kind = "executor"``): declared as any pool
        (supervision.declare: made, rolled or resized), then its options in force for the
        tasks handed out from now on. Returns what declare did."""
        options = parse_options(_with_size(options, size))
        spec, policy = self.tasks.prepare(spec, policy, options)
        if "min_workers" in options:  # elastic: the size it has now, within min..max (elastic.py)
            have = self.table.pool(name)
            now = have.desired if have is not None and not have.deleted and name in self.tasks.pools else 0
            size = max(options["min_workers"], min(now, options["max_workers"]))
        what = self.table.supervisor.declare(name, spec, policy, size)
        pool = self.table.pool(name)
        assert pool is not None  # declared just now
        xp = self.tasks.pools.get(name)
        if xp is None or xp.closing:
            self.tasks.adopt(pool, options, b"", next_n=xp.next_n if xp is not None else 1)
        elif xp.options != options:
            self.tasks.set_options(xp, options)
            self.table.save_pool(pool)  # the row stores xp's options
            what = "changed" if what == "unchanged" else what
        return what

    def _cmd_submit(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """Queue one task (``payload``, or a ``target`` with JSON ``args``/``kwargs``), or a
        batch of them (``tasks``: a list of such objects); its id, or their ids. A task may
        name its number (``n``, of its session's block); ``resend``: the batch may have
        arrived before. With ``numbers``, a batch's answer is ``{"ids", "numbers"}``: the
        session's next block of task numbers granted with it. Each task may name its own
        ``timeout``, ``retries`` (else the pool's), ``priority`` and ``tenant`` (its place
        in the queue: taskqueue.py), ``deadline`` (seconds from now: past it, TIMED_OUT
        wherever it is), ``backoff`` ([MIN, MAX] seconds before a re-run of its retry_on:
        taskwait.py) and ``key``: a key that names a task of the pool already (unfinished,
        or ended and kept) is that task, not a second run. A session's keyed task is answered
        ``{"id", "shared"}`` (a batch with one: ``{"ids", "shared"}``, the ids among them):
        shared, the task is another future's (another session's, or another ref's), and this
        ref hears nothing of it (its submitter follows it by id)."""
        xp = self._exec_pool(args.get("pool"))
        session = self.tasks.session(args.get("session")) if args.get("session") is not None else None
        batch = args.get("tasks")
        shared: set[str] = set()
        if batch is None:
            task = self._known(xp, session, args, False) or self._keyed(xp, session, args, shared) \
                or self.tasks.submit(xp, self._task(xp, session, args))
            if session is not None and args.get("key") is not None:
                return {"id": task.id, "shared": task.id in shared}
            return task.id
        if not isinstance(batch, list):
            raise InvalidSpec("tasks must be a list")
        # All checked before any is queued; one that names a number the pool has is the task
        # it has (a batch sent again: ``resend``), attached to the session, not run again.
        resend = bool(args.get("resend"))
        keyed: dict[str, Task] | None = None  # the new tasks of this batch by key: a key twice in it is one task
        made = []
        for one in batch:
            if not isinstance(one, dict) or one.get("key") is None:
                made.append(self._known(xp, session, one, resend) or self._task(xp, session, one))
                continue
            keyed = {} if keyed is None else keyed
            task = self._known(xp, session, one, resend) or self._keyed(xp, session, one, shared) \
                or keyed.get(one["key"]) or self._task(xp, session, one)
            if task.key is not None and not task.id:
                keyed.setdefault(task.key, task)
            made.append(task)
        new: set[int] = set()  # id() of the tasks this batch queues
        ids = []
        for task in made:
            if not task.id:
                self.tasks.submit(xp, task)
                new.add(id(task))
            elif id(task) in new:  # its key again, later in the batch: the first ref's
                shared.add(task.id)
            ids.append(task.id)
        answer: Doc = {"ids": ids}
        if keyed is not None:
            answer["shared"] = sorted(shared)
        if args.get("numbers") is not None:  # the session's next block, with no round trip of its own
            answer["numbers"] = self.tasks.grant(xp, _count(args["numbers"], "numbers"), session)
        return answer if len(answer) > 1 else ids

    def _keyed(self, xp: ExecPool, session: Session | None, one: Any, shared: set[str]) -> Task | None:
        """The task ``one``'s key names (in memory, or ended and in the store), or None (no
        key, or a key of no task yet). It is attached to ``session`` under ``one``'s ref if
        it is nobody's (ended, or its session gone) or already that; else its id goes into
        ``shared``: another future follows it."""
        raw = one.get("key") if isinstance(one, dict) else None
        if raw is None:
            return None
        key = protocol.task_key(raw)
        task = self.tasks.by_key(xp.name, key)
        if task is None:
            row = self._stored_key(xp.name, key)
            task = self._from_row(xp, row) if row is not None else None
        if task is None:
            return None
        ref = one.get("ref")
        if task.state.terminal or task.session is None or (task.session is session and task.ref == ref):
            self.tasks.attach(session, ref, task)
        else:
            shared.add(task.id)
        return task

    def _known(self, xp: ExecPool, session: Session | None, one: Any, resend: bool) -> Task | None:
        """The task of ``one``'s number if the pool has it already, attached to ``session``;
        None for a new one. The store (ended tasks no longer in memory) is asked only for a
        resend: a first send names a number of its session's own block."""
        n = one.get("n") if isinstance(one, dict) else None
        if n is None or isinstance(n, bool) or not isinstance(n, int):
            return None
        early = self.tasks.arrived(xp, session, n)  # cancelled by id before it came: that task
        task_id = f"{xp.name}/{n}"
        task = self.tasks.task(task_id) or early
        if task is None and resend:
            row = self._stored(task_id)
            task = self._from_row(xp, row) if row is not None else None
        if task is not None:
            self.tasks.attach(session, one.get("ref"), task)
        return task

    def _cmd_attach(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """A session registered again (its client reconnected, perhaps to a daemon that
        restarted) takes its tasks back: ``tasks``, [[ref, id], ...]. For each, whether the
        pool has it; a running one is told ``started`` again, an ended one its end."""
        xp = self._exec_pool(args.get("pool"))
        session = self.tasks.session(args.get("session"))
        pairs = args.get("tasks")
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)
                                                  for p in pairs):
            raise InvalidSpec("tasks must be a list of [ref, task id]")
        known = []
        for ref, task_id in pairs:
            task = self.tasks.task(task_id)
            if task is None and task_id.rpartition("/")[0] == xp.name:
                row = self._stored(task_id)
                task = self._from_row(xp, row) if row is not None else None
            if task is not None:
                self.tasks.attach(session, ref, task)
            known.append(task is not None)
        return known

    @staticmethod
    def _from_row(xp: ExecPool, row: Doc) -> Task:
        """An ended task the store keeps (no longer in memory), as a record to tell its end."""
        task = Task(row["id"], int(row["n"]), xp, None, None, None, row["timeout"], int(row["retries"] or 0),
                    state=T(row["state"]), attempts=int(row["attempts"] or 0), worker_id=row["worker"],
                    queued_at=row["queued_at"] or 0.0, started_at=row["started_at"], **queue_place(row),
                    **wait_fields(row))
        task.ended_at, task.reason, task.kind, task.result = row["ended_at"], row["reason"], row["kind"], row["result"]
        return task

    def _task(self, xp: ExecPool, session: Session | None, one: Any) -> Task:
        """A task of a submit, checked (InvalidSpec), not queued yet."""
        if not isinstance(one, dict):
            raise InvalidSpec("a task must be an object")
        payload = one.get("payload")
        if payload is None and one.get("target") is None and not xp.options.get("target"):
            raise InvalidSpec(f"executor pool {xp.name!r} has no target of its own: give the task one (--target)")
        if payload is None and one.get("target") is None and xp.options.get("target"):
            pool = self.table.pool(xp.name)  # the pool's own target, from its PYTHONPATH and cwd
            wire = pool.runtime.wire if pool is not None and pool.runtime is not None else {}
            one = {**one, "target": xp.options["target"], "pythonpath": wire.get("pythonpath") or [],
                   "cwd": wire.get("cwd")}
        if payload is None and one.get("target") is not None:
            payload = target_payload(one)
        payload = as_bytes(payload, "payload")
        if not payload:
            raise InvalidSpec("a task needs a payload or a target")
        too_large = w.too_large("the task's pickled call", len(payload))
        if too_large:
            raise InvalidSpec(too_large)
        opts = xp.options
        timeout = one.get("timeout", opts.get("timeout"))
        if timeout is not None:
            timeout = protocol.seconds(timeout, "timeout")
        retries = one.get("retries", opts.get("retries", 0))
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidSpec(f"retries must be a whole number of at least 0, got {retries!r}")
        n = one.get("n")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 < n < xp.next_n):
            raise InvalidSpec(f"task number {n!r} was not handed out by executor pool {xp.name!r}")
        key = protocol.task_key(one["key"]) if one.get("key") is not None else None
        return Task("", n or 0, xp, payload, one.get("ref"), session, timeout, retries,
                    priority=priority(one.get("priority", 0)), tenant=tenant(one.get("tenant")), key=key,
                    deadline=deadline(one.get("deadline")), backoff=backoff(one.get("backoff")))

    def _cmd_cancel(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """Cancel tasks by id (``ids``) or by a session's refs (``refs``): for each, True if
        it is cancelled (now or before: one whose submit has not arrived is recorded
        CANCELLED, and never runs), False if it had ended otherwise (its result stands). An
        id never handed out is UnknownTask, and nothing is cancelled."""
        if args.get("ids") is not None:
            ids = args["ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
                raise InvalidSpec("ids must be a non-empty list of task ids")
            ids = [self.task_id(i) for i in ids]
            found = [self._find(i) for i in ids]  # all or nothing
            return [self.tasks.cancel(t) if t is not None else self._cancel_absent(i) for i, t in zip(ids, found)]
        session = self.tasks.session(args.get("session"))
        # A ref it no longer holds has ended: cancelled (the submitter knows it is) or with a
        # result on its way, which stands.
        return [self.tasks.cancel(task) if (task := session.tasks.get(ref)) is not None else False
                for ref in args.get("refs") or ()]

    def _cancel_absent(self, task_id: str) -> bool:
        """Cancel by id a task not in memory: one on its way (``TaskTable.granted_to``) is
        recorded cancelled; one in the store only had ended (True if it was cancelled)."""
        session = self.tasks.granted_to(task_id)
        if session is not None:
            self.tasks.cancel_unarrived(session, task_id)
            return True
        return self._stored_state(task_id) == T.CANCELLED.value

    def task_id(self, text: Any) -> str:
        """The id of the task ``text`` names: an id (``POOL/N``) as it is, or ``POOL/@KEY``
        the id of the task that key names (in memory, or ended and in the store);
        UnknownTask if none. Every command that takes a task resolves it here."""
        if not isinstance(text, str):
            raise InvalidSpec(f"not a task id: {text!r}")
        pool, _, rest = text.partition("/")
        if not rest.startswith("@"):
            return text
        key = protocol.task_key(rest[1:])
        task = self.tasks.by_key(pool, key)
        if task is not None:
            return task.id
        row = self._stored_key(pool, key)
        if row is not None:
            return str(row["id"])
        raise UnknownTask(f"unknown task {text!r}: no task of pool {pool!r} has that key")

    def _find(self, task_id: Any) -> Task | None:
        """The task in memory; None if it ended long ago (in the store only); UnknownTask
        if no such id was ever handed out."""
        if not isinstance(task_id, str):
            raise InvalidSpec(f"not a task id: {task_id!r}")
        task = self.tasks.task(task_id)
        if task is not None:
            return task
        parsed = protocol.parse_task_id(task_id)  # never a Unicode digit read as a number
        if parsed is not None and (xp := self.tasks.pools.get(parsed[0])) is not None and parsed[1] < xp.next_n:
            return None
        if self._stored(task_id) is not None:
            return None
        raise UnknownTask(f"unknown task {task_id!r}")

    def _stored(self, task_id: str) -> Doc | None:
        store = self.table.journal.store
        rows = store.tasks(task_id=task_id) if store is not None else []
        return rows[0] if rows else None

    def _stored_key(self, pool: str, key: str) -> Doc | None:
        """The stored task of ``pool`` that ``key`` names (one no longer in memory)."""
        store = self.table.journal.store
        rows = store.tasks(pool=pool, key=key) if store is not None else []
        return rows[-1] if rows else None

    def _stored_state(self, task_id: str) -> str | None:
        row = self._stored(task_id)
        return row["state"] if row is not None else None

    def _cmd_close(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """A session ends: its unfinished tasks cancelled (``cancel``: the running ones get
        ``Terminated``, a shutdown, not a user's cancel), or left to run; with ``delete`` (an
        embedded executor's pool) the pool goes too: its queued tasks cancelled or failed,
        each running task stopped and given the pool's grace to clean up, and only then its
        workers stopped; the reply waits until every one of them is reaped."""
        session = self.tasks.sessions.get(str(args.get("session")))
        cancel, delete = bool(args.get("cancel")), bool(args.get("delete"))
        if session is not None:
            if cancel:
                for task in list(session.tasks.values()):
                    self.tasks.shut_down(task)
            self.tasks.drop_session(session)
        if not delete:
            return None
        xp = self._exec_pool(args.get("pool"))
        timeout = protocol.wait_timeout(args)

        def then() -> None:
            ids = self.table.supervisor.delete_pool(xp.name)
            self.table.wait_for(ids, "ended", reply, cmd_id, timeout)

        self.tasks.stop_pool(xp, cancel=cancel, then=then)
        return protocol.DEFERRED

    def _cmd_events(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """What a polling session's tasks did since ``after``: at once if there is something,
        else when there is, or after ``timeout`` (empty)."""
        session = self.tasks.session(args.get("session"))
        after = args.get("after", 0)
        timeout = protocol.seconds(args.get("timeout", 1.0), "timeout") or 0.0
        return self.tasks.poll(session, after, timeout, reply, cmd_id)

    def _cmd_tasks(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """Unfinished tasks (``all``: the ended ones the store keeps too), oldest first;
        with ``id``, that task's alone (UnknownTask if there is none)."""
        if args.get("id") is not None:
            task_id = self.task_id(args["id"])
            task = self._find(task_id)
            row = task.record() if task is not None else self._stored(task_id)
            if row is None and self.tasks.granted_to(task_id) is not None:
                return [{**listing(self.tasks.on_its_way(task_id)), "waiting": "its submit has not arrived yet"}]
            if row is None:
                raise _unheard(task_id)
            return [listing(row)]
        pool = args.get("pool")
        if pool is not None and pool not in self.tasks.pools:
            raise UnknownPool(f"unknown executor pool {pool!r}")
        rows = {t.id: {**listing(t.record()), "waiting": self.tasks.waiting(t)}
                for t in self.tasks.live.values() if pool is None or t.pool.name == pool}
        if args.get("all"):
            store = self.table.journal.store
            if store is not None:
                for row in store.tasks(pool=pool, include_terminal=True):
                    rows.setdefault(row["id"], listing(row))
            for t in self.tasks.ended.values():
                if pool is None or t.pool.name == pool:
                    rows[t.id] = listing(t.record())
        return sorted(rows.values(), key=lambda r: (r["pool"], r["n"]))

    def _cmd_result(self, args: Doc, reply: Reply, cmd_id: Any) -> Any:
        """A task's outcome: ``{"id", "state", "kind", "result", "reason"}`` (``result``: the
        pickled value or exception, bytes). Unfinished: that state at once, or with
        ``wait`` the outcome once it has ended (or, at ``timeout``, the state then)."""
        task_id = self.task_id(args.get("id"))
        task = self._find(task_id)
        if task is None:
            row = self._stored(task_id)
            session = self.tasks.granted_to(task_id) if row is None else None
            if session is not None and args.get("wait"):
                self.tasks.wait_arrival(session, task_id, reply, cmd_id, protocol.wait_timeout(args))
                return protocol.DEFERRED
            if session is not None:
                return outcome(self.tasks.on_its_way(task_id))
            if row is None:
                raise _unheard(task_id)
            return outcome(row)
        if task.state.terminal or not args.get("wait"):
            return outcome(task.record())
        self.tasks.wait_result(task, reply, cmd_id, protocol.wait_timeout(args))
        return protocol.DEFERRED

    def _exec_pool(self, name: Any) -> ExecPool:
        xp = self.tasks.pools.get(name) if isinstance(name, str) else None
        pool = self.table.pool(name) if xp is not None else None
        if xp is None or xp.closing or pool is None or pool.deleted:
            raise UnknownPool(f"unknown executor pool {name!r}")
        return xp

    def pool_workers(self, name: str) -> Doc | None:
        """An executor pool's workers for ``status``: busy, idle, starting, min, max and its
        memory budget (``budget``: used and limit, bytes), if it has one."""
        xp = self.tasks.pools.get(name)
        return self.tasks.workers(xp) if xp is not None else None

    def pool_counts(self, name: str) -> Doc | None:
        """An executor pool's tasks for ``status``: queued, running and waiting (for a time:
        Retry, a retry_on backoff) now; ended since the daemon started, by how: done (a
        result), failed (raised, or WorkerLost), cancelled, timed_out, lost (the daemon died
        while it ran); ``tenants``: the queued and running by tenant, for each tenant that
        has either (``""``: the tasks with no tenant)."""
        xp = self.tasks.pools.get(name)
        if xp is None:
            return None
        tenants: dict[str, dict[str, int]] = {}

        def count(tenant: str | None, state: str, n: int) -> None:
            by_state = tenants.setdefault(tenant or "", {"queued": 0, "running": 0})
            by_state[state] += n

        for who, n in xp.queue.tenants().items():
            count(who, "queued", n)
        for wk in xp.workers.values():
            for t in wk.tasks:  # the one it runs, and one held behind it (still QUEUED)
                if t.state is T.RUNNING or t.state is T.QUEUED:
                    count(t.tenant, t.state.value.lower(), 1)
        return {"queued": sum(c["queued"] for c in tenants.values()),
                "running": sum(c["running"] for c in tenants.values()), "waiting": self.tasks.parked(xp),
                **{state.value.lower(): xp.ended[state.value] for state in T if state.terminal},
                "tenants": tenants}
