"""Conformance: the same twelve questions asked of ProcessPoolExecutor, loky, pebble, Dask's
``Client(LocalCluster(processes=True)).get_executor()`` and ``orchestrator.Executor``.

Every cell is what that executor did in this run: a task of ``benchmarks/conffns.py`` beats
on a named pipe every 20 ms (``S`` at its start, ``H`` beats, ``X Name`` when an exception
reached it, ``E`` at its end), so "did it stop" is read from the beats and the worker's pidfd,
never assumed. Where an executor has no API for a question, that is detected (a keyword
missing from the signature that would take it, a method missing, a ``TypeError``) and the
closest thing it has is measured instead; the cell then says "no API" and what that closest
thing did. A peer that is not installed is a column of "not installed".

Each executor's column runs in child processes of its own (``python -c`` of ``column_main``),
so that no peer's threads are inherited by another's forks and the processes a question made
are new descendants of one pid. With ``--quick`` every column runs at the same time, each
dealt out to two children (the tasks mostly sleep, and the windows below are wide enough for
a loaded host: a task counts as stopped only after 0.75 s without a beat); in full mode the
columns run one after another in one child each. After each question the tasks still beating
are killed, its pools closed (bounded), every process it made since it began waited for
(bounded) and what is left killed by pidfd, and said so in the JSON.

The questions (pools of 2 workers; a fresh one per question, but questions 7, 8, 10 where there
is no process-per-task API, 11 and 12, which leave a pool as they found it, share one per
column: SHARED):

1. ``cancel`` of a running task: does the task stop, how soon after ``cancel()``.
2. the same from asyncio: ``loop.run_in_executor`` (``asyncio.wrap_future`` where the pool
   has no ``submit``) in an asyncio task, and ``task.cancel()``.
3. SIGKILL of one busy worker, with a task in flight on the other and two queued: what the
   killed task's future raises and with what words, whether the others succeed, whether the
   same pool runs a task afterwards.
4. a per-task timeout that stops the task (without one: ``result(timeout=)``, which only
   stops the wait).
5. ``shutdown(wait=False, cancel_futures=True)`` with both workers busy and four tasks
   queued: does a thread blocked in the last one's ``result()`` wake, how soon.
6. SIGKILL of the host: the executor runs in a child process with a task on each worker;
   the child and everything under it are noted, the child is SIGKILLed: what is still
   there after a bounded wait (then killed).
7. two workers, one busy with a long task: does a task submitted then start at once.
8. retries: an API to run a failed task again (the task fails its first attempt).
9. a memory limit per task or worker that stops a task touching 512 MiB (limit 256 MiB).
10. a process per task: six tasks, how many distinct worker pids.
11. a result that cannot be pickled (a lock): does its future raise, is the pool usable.
12. a task's own exception class: does the caller get that type with its args.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import inspect
import itertools
import json
import multiprocessing
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks import conffns
from benchmarks.sec_tasks import Fifo

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2
MIB = 1 << 20
MEMORY_LIMIT_MIB = 256
HOG_MIB = 512

QUICK_PARTS = 2  # children per column in quick mode

YES, NO, NO_API, NOT_INSTALLED, ERROR = "yes", "no", "no API", "not installed", "error"


@dataclass(frozen=True)
class Limits:
    """Every wait of a question, in seconds."""

    start: float  # a task's first line (a pool's workers coming up under load)
    observe: float  # after a cancel or a timeout: how long the beats are watched
    quiet: float  # no beat for this long at the end of ``observe``: the task stopped
    long: float  # a task meant to outlast its question (it is killed at the question's end)
    idle_long: float  # question 7's busy task
    timeout: float  # question 4's per-task timeout
    settle: float  # futures of a question settling (a Dask worker restarting, its re-runs)
    wake: float  # question 5: the waiter's bound
    host_gone: float  # question 6: how long the host's processes get to go
    reap: float  # after a question: its processes going before they are killed
    answer: float  # questions 11 and 12: a future's answer (Dask never gives one to 11)


QUICK = Limits(start=60, observe=2, quiet=0.75, long=30, idle_long=2.5, timeout=0.5, settle=30, wake=3,
               host_gone=5, reap=5, answer=5)
FULL = Limits(start=90, observe=4, quiet=1, long=60, idle_long=5, timeout=0.5, settle=60, wake=10,
              host_gone=10, reap=10, answer=30)


class NoAPI(Exception):
    """The executor has no API for this; the message says where it was looked for."""


class Unavailable(Exception):
    """The peer's package is not installed."""


def named(fn: Callable[..., Any], name: str) -> bool:
    """``fn`` takes ``name`` as a keyword of its own (not swallowed by ``**kwargs``, which
    would hand it to the task)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _where(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


# -- the peers -------------------------------------------------------------------------------

class Peer:
    """One executor as its own API spells each thing. ``open`` returns a handle the other
    methods take; ``executor(h)`` is the object with ``submit``/``shutdown`` where there is one."""

    key = ""
    title = ""
    package = ""

    def available(self) -> None:
        """Raise Unavailable when the library is not importable."""
        if self.package:
            try:
                __import__(self.package)
            except ImportError as err:
                raise Unavailable(f"{self.package} is not installed ({err})") from None

    def open(self, workers: int = WORKERS, *, per_task: bool = False, memory_max: int | None = None) -> Any:
        raise NotImplementedError

    def executor(self, h: Any) -> Any:
        return h

    def submit(self, h: Any, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        return self.executor(h).submit(fn, *args)  # type: ignore[no-any-return]

    def timeout_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], seconds: float) -> cf.Future[Any]:
        submit = self.executor(h).submit
        if not named(submit, "timeout"):
            raise NoAPI(f"{_where(submit)}() takes no timeout")
        return submit(fn, *args, timeout=seconds)  # type: ignore[no-any-return]

    def retry_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], retries: int) -> cf.Future[Any]:
        submit = self.executor(h).submit
        if not named(submit, "retries"):
            raise NoAPI(f"{_where(submit)}() takes no retries")
        return submit(fn, *args, retries=retries)  # type: ignore[no-any-return]

    def shutdown_cancel(self, h: Any) -> tuple[bool, str]:
        """Shut down cancelling what is queued: (the API is there, what was called)."""
        ex = self.executor(h)
        shutdown = getattr(ex, "shutdown", None)
        if shutdown is not None and named(shutdown, "cancel_futures"):
            shutdown(wait=False, cancel_futures=True)
            return True, "shutdown(wait=False, cancel_futures=True)"
        return False, self.closest_shutdown(h)

    def closest_shutdown(self, h: Any) -> str:
        self.executor(h).shutdown(wait=False)
        return "shutdown(wait=False)"

    def close(self, h: Any) -> None:
        raise NotImplementedError

    @staticmethod
    def _keywords(ctor: Callable[..., Any], per_task: bool, memory_max: int | None) -> dict[str, Any]:
        """The keywords that ask ``ctor`` for a process per task and a memory limit, as it
        spells them; NoAPI when it takes none of the spellings."""
        kw: dict[str, Any] = {}
        for wanted, names, value in ((per_task, PER_TASK_NAMES, 1), (memory_max is not None, MEMORY_NAMES, memory_max)):
            if wanted:
                name = next((n for n in names if named(ctor, n)), None)
                if name is None:
                    raise NoAPI(f"{_where(ctor)}() takes none of {', '.join(names)}")
                kw[name] = value
        return kw


PER_TASK_NAMES = ("max_tasks_per_child", "max_tasks")
MEMORY_NAMES = ("memory_max", "memory_limit", "max_memory")


class PPEPeer(Peer):
    key, title = "ppe", "ProcessPoolExecutor"

    def open(self, workers: int = WORKERS, *, per_task: bool = False, memory_max: int | None = None) -> Any:
        kw = self._keywords(cf.ProcessPoolExecutor, per_task, memory_max)
        try:
            return cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), **kw)
        except ValueError:  # 3.11 refuses fork with max_tasks_per_child: its default context then
            return cf.ProcessPoolExecutor(workers, **kw)

    def close(self, h: Any) -> None:
        h.shutdown(wait=True, cancel_futures=True)


class LokyPeer(Peer):
    key, title, package = "loky", "loky", "loky"

    def open(self, workers: int = WORKERS, *, per_task: bool = False, memory_max: int | None = None) -> Any:
        import loky

        # loky's own ``timeout`` keyword is how long an idle worker lives, not a task's bound.
        kw = self._keywords(loky.ProcessPoolExecutor, per_task, memory_max)
        return loky.ProcessPoolExecutor(max_workers=workers, **kw)

    def closest_shutdown(self, h: Any) -> str:
        h.shutdown(wait=False, kill_workers=True)
        return "shutdown(wait=False, kill_workers=True)"

    def close(self, h: Any) -> None:
        h.shutdown(wait=True, kill_workers=True)


class PebblePeer(Peer):
    key, title, package = "pebble", "pebble", "pebble"

    def open(self, workers: int = WORKERS, *, per_task: bool = False, memory_max: int | None = None) -> Any:
        import pebble

        kw = self._keywords(pebble.ProcessPool, per_task, memory_max)
        return pebble.ProcessPool(max_workers=workers, **kw)

    def submit(self, h: Any, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        return h.schedule(fn, args=args)  # type: ignore[no-any-return]

    def timeout_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], seconds: float) -> cf.Future[Any]:
        if not named(h.schedule, "timeout"):
            raise NoAPI("ProcessPool.schedule() takes no timeout")
        return h.schedule(fn, args=args, timeout=seconds)  # type: ignore[no-any-return]

    def retry_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], retries: int) -> cf.Future[Any]:
        if not named(h.schedule, "retries"):
            raise NoAPI("ProcessPool.schedule() takes no retries")
        return h.schedule(fn, args=args, retries=retries)  # type: ignore[no-any-return]

    def closest_shutdown(self, h: Any) -> str:
        h.stop()  # pebble's pool has no shutdown: stop() ends it without running what is pending
        return "no shutdown(); stop()"

    def close(self, h: Any) -> None:
        h.stop()
        h.join(timeout=10)


@dataclass
class DaskPool:
    cluster: Any
    client: Any
    executor: Any


class DaskPeer(Peer):
    key, title, package = "dask", "Dask", "distributed"

    def open(self, workers: int = WORKERS, *, per_task: bool = False, memory_max: int | None = None) -> Any:
        import importlib
        import logging

        distributed: Any = importlib.import_module("distributed")  # untyped: Any, not its partial hints
        kw = self._keywords(distributed.Worker, per_task, memory_max)
        cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                           dashboard_address=None, silence_logs=logging.CRITICAL, **kw)
        try:
            client = distributed.Client(cluster)
        except BaseException:
            cluster.close(timeout=10)
            raise
        return DaskPool(cluster, client, client.get_executor())

    def executor(self, h: Any) -> Any:
        return h.executor

    def retry_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], retries: int) -> cf.Future[Any]:
        try:
            ex = h.client.get_executor(retries=retries)
        except TypeError as err:
            raise NoAPI(f"get_executor(retries=) refused: {err}") from None
        return ex.submit(fn, *args)  # type: ignore[no-any-return]

    def close(self, h: Any) -> None:
        try:
            h.client.close(timeout=10)
        finally:
            h.cluster.close(timeout=10)


class OursPeer(Peer):
    key, title = "ours", "orchestrator"

    def open(self, workers: int = WORKERS, *, per_task: bool = False, memory_max: int | None = None) -> Any:
        from orchestrator import Executor

        kw = self._keywords(Executor, per_task, memory_max)
        return Executor(max_workers=workers, **kw)

    def timeout_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], seconds: float) -> cf.Future[Any]:
        if not named(h.options, "timeout"):
            raise NoAPI("Executor.options() takes no timeout")
        return h.options(timeout=seconds).submit(fn, *args)  # type: ignore[no-any-return]

    def retry_submit(self, h: Any, fn: Callable[..., Any], args: tuple[Any, ...], retries: int) -> cf.Future[Any]:
        if not (named(h.options, "retries") and named(h.options, "retry_on")):
            raise NoAPI("Executor.options() takes no retries/retry_on")
        return h.options(retries=retries, retry_on=(conffns.AppError,)).submit(fn, *args)  # type: ignore[no-any-return]

    def close(self, h: Any) -> None:
        h.shutdown(wait=True, cancel_futures=True)


PEERS: dict[str, Peer] = {p.key: p for p in (PPEPeer(), LokyPeer(), PebblePeer(), DaskPeer(), OursPeer())}


# -- the beats -------------------------------------------------------------------------------

@dataclass
class Line:
    kind: str
    tag: int
    pid: int
    t: float
    rest: list[str]


class Beats:
    """The named pipe the tasks write to (``sec_tasks.Fifo``: read with select, a writer of
    its own held), its lines parsed."""

    def __init__(self, path: Path) -> None:
        self._fifo = Fifo(path)
        self.path = self._fifo.path
        self._lines: list[Line] = []
        self.running: dict[int, int] = {}  # tag -> pid of each task that started and has not ended

    def pump(self, timeout: float, fds: tuple[int, ...] = ()) -> list[int]:
        """Read what is there, waiting up to ``timeout``; the ``fds`` that are readable."""
        ready = self._fifo.pump(timeout, fds)
        for parts in self._fifo.lines:
            line = Line(parts[0], int(parts[1]), int(parts[2]), float(parts[3]), parts[4:])
            if line.kind == "S":
                self.running[line.tag] = line.pid
            elif line.kind in ("X", "E"):
                self.running.pop(line.tag, None)
            self._lines.append(line)
        self._fifo.lines.clear()
        return ready

    def take(self, tag: int) -> list[Line]:
        mine = [ln for ln in self._lines if ln.tag == tag]
        self._lines = [ln for ln in self._lines if ln.tag != tag]
        return mine

    def first(self, kind: str, tag: int, timeout: float) -> Line:
        """Task ``tag``'s first ``kind`` line (the others of that task are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, ln in enumerate(self._lines):
                if ln.tag == tag and ln.kind == kind:
                    return self._lines.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"task {tag} wrote no {kind!r} line within {timeout:g} s")
            self.pump(left)

    def watch(self, tag: int, pid: int, t0: float, limit: float, quiet: float) -> "Stop":
        """After ``t0``: did task ``tag`` (in process ``pid``) stop within ``limit`` s? It did
        when an exception reached it (``X``), its process ended, or no beat came in the last
        ``quiet`` s of the window."""
        fd = _pidfd(pid)
        beats, last = 0, t0
        try:
            deadline = t0 + limit
            while True:
                for ln in self.take(tag):
                    if ln.kind == "H" and ln.t > t0:
                        beats, last = beats + 1, max(last, ln.t)
                    elif ln.kind == "X":
                        return Stop(True, f"{ln.rest[0] if ln.rest else '?'} raised in it", ln.t - t0, beats)
                    elif ln.kind == "E":
                        return Stop(False, "it ran to its end", None, beats)
                now = time.monotonic()
                if fd is None:
                    return Stop(True, "its process is gone", now - t0, beats)
                if now >= deadline:
                    if now - last >= quiet:
                        return Stop(True, "its beats stopped", last - t0, beats)
                    return Stop(False, f"it beat on ({beats} beats in {limit:g} s)", None, beats)
                if self.pump(deadline - now, (fd,)):
                    os.close(fd)
                    fd = None
        finally:
            if fd is not None:
                os.close(fd)

    def drain(self) -> None:
        self.pump(0)
        self._lines.clear()

    def close(self) -> None:
        self._fifo.close()


@dataclass
class Stop:
    stopped: bool
    how: str
    after_s: float | None
    beats_after: int

    def words(self) -> str:
        return f"{self.how}{f' {self.after_s * 1e3:.0f} ms after' if self.after_s is not None else ''}"


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


# -- processes: what a question left ------------------------------------------------------------

def descendants(root: int) -> dict[int, str]:
    """Live (not zombie) processes under ``root``: pid -> its command line (short)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z":
            parent[int(entry)] = int(fields[1])
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = _cmdline(pid)
        todo += children.get(pid, [])
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "?"


def _shared_helper(cmdline: str) -> bool:
    """multiprocessing's resource tracker: one per interpreter, shared by every pool of it."""
    return "resource_tracker" in cmdline


def end_processes(pids: dict[int, str], bound: float) -> tuple[list[str], float]:
    """Wait up to ``bound`` s for ``pids`` to exit, SIGKILL the rest (by pidfd: a reused pid is
    never hit), reap what is ours. (What had to be killed, seconds until all were gone.)"""
    fds = {pid: fd for pid in pids if (fd := _pidfd(pid)) is not None}
    t0 = time.monotonic()
    killed: list[str] = []
    try:
        for phase in ("wait", "kill"):
            deadline = time.monotonic() + (bound if phase == "wait" else 5.0)
            while fds:
                ready, _, _ = select.select(list(fds.values()), [], [], max(0.0, deadline - time.monotonic()))
                for pid in [p for p, fd in fds.items() if fd in ready]:
                    os.close(fds.pop(pid))
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
                if not ready and time.monotonic() >= deadline:
                    break
            if phase == "wait" and fds:
                for pid, fd in fds.items():
                    killed.append(f"{pid} {pids[pid]}")
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return killed, time.monotonic() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


# -- the questions ---------------------------------------------------------------------------------

@dataclass
class Ctx:
    """What a question works with: its peer, the pipe, the limits, and the pools it opened
    (closed, and their processes ended, when it is done)."""

    peer: Peer
    beats: Beats
    limits: Limits
    tmp: Path
    tags: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    shared: Any = None  # the column's plain pool, for the questions of SHARED
    handles: list[Any] = field(default_factory=list)

    def open(self, **kw: Any) -> Any:
        """A fresh pool of this question's (closed after it)."""
        h = self.peer.open(**kw)
        self.handles.append(h)
        return h

    def pool(self) -> Any:
        """The column's plain pool where it has one (a question of SHARED), else a fresh one."""
        return self.shared if self.shared is not None else self.open()

    def tag(self) -> int:
        return next(self.tags)

    def started(self, tag: int) -> Line:
        return self.beats.first("S", tag, self.limits.start)


@dataclass
class Cell:
    verdict: str
    text: str
    figures: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "text": self.text, "figures": self.figures}


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _exc(err: BaseException | None, width: int = 200) -> str:
    """``Name('its words')``, the words cut at ``width`` (the JSON keeps 200, a cell less);
    in a cell, an exception that carries a ``reason`` (ours do) shows that instead."""
    if err is None:
        return "no exception"
    reason = getattr(err, "reason", None)
    if width < 200 and isinstance(reason, str) and reason:
        return f"{type(err).__name__}(reason={reason[:width]!r})"
    words = " ".join(str(err).split())
    if len(words) > width:
        words = words[:width - 3] + "..."
    return f"{type(err).__name__}({words!r})" if words else type(err).__name__


def _outcome(fut: cf.Future[Any]) -> BaseException | None:
    """The future's exception, CancelledError included (it is one too)."""
    try:
        return fut.exception(timeout=0)
    except cf.CancelledError as err:
        return err


def q_cancel(ctx: Ctx) -> Cell:
    h = ctx.open()
    tag = ctx.tag()
    fut = ctx.peer.submit(h, conffns.beat, ctx.beats.path, tag, ctx.limits.long)
    s = ctx.started(tag)
    t0 = time.monotonic()
    returned = fut.cancel()
    stop = ctx.beats.watch(tag, s.pid, t0, ctx.limits.observe, ctx.limits.quiet)
    figs = {"cancel_returned": returned, "stopped": stop.stopped, "how": stop.how, "stopped_after_s": stop.after_s,
            "beats_after_cancel": stop.beats_after}
    return Cell(YES if stop.stopped else NO, f"cancel() {returned}; {stop.words()}", figs)


def q_cancel_asyncio(ctx: Ctx) -> Cell:
    h = ctx.open()
    ex = ctx.peer.executor(h)
    tag = ctx.tag()
    args = (ctx.beats.path, tag, ctx.limits.long)

    async def main() -> tuple[str, Stop, bool]:
        loop = asyncio.get_running_loop()
        if isinstance(ex, cf.Executor):
            how = "run_in_executor"
            inner: asyncio.Future[Any] = loop.run_in_executor(ex, conffns.beat, *args)
        else:  # no Executor to hand to the loop (pebble): the closest is its future wrapped
            how = f"no run_in_executor ({type(ex).__name__} is no Executor); wrap_future"
            inner = asyncio.wrap_future(ctx.peer.submit(h, conffns.beat, *args))

        async def call() -> Any:
            return await inner
        task = asyncio.ensure_future(call())
        s = await loop.run_in_executor(None, ctx.started, tag)
        t0 = time.monotonic()
        task.cancel()
        stop = await loop.run_in_executor(None, ctx.beats.watch, tag, s.pid, t0, ctx.limits.observe,
                                          ctx.limits.quiet)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return how, stop, task.cancelled()

    how, stop, cancelled = asyncio.run(main())
    figs = {"via": how, "asyncio_task_cancelled": cancelled, "stopped": stop.stopped, "how": stop.how,
            "stopped_after_s": stop.after_s}
    verdict = YES if stop.stopped else NO
    return Cell(verdict, f"{'wrap_future: ' if how.startswith('no ') else ''}{stop.words()}", figs)


def q_worker_death(ctx: Ctx) -> Cell:
    h = ctx.open()
    lim = ctx.limits
    victim_tag, other_tag = ctx.tag(), ctx.tag()
    victim = ctx.peer.submit(h, conffns.beat, ctx.beats.path, victim_tag, 3.0)
    other = ctx.peer.submit(h, conffns.beat, ctx.beats.path, other_tag, 1.0)
    sv, so = ctx.started(victim_tag), ctx.started(other_tag)
    if sv.pid == so.pid:
        raise RuntimeError("both tasks started in one process: no second worker to isolate from")
    queued = [ctx.peer.submit(h, conffns.beat, ctx.beats.path, ctx.tag(), 0.1) for _ in range(2)]
    t0 = time.monotonic()
    os.kill(sv.pid, signal.SIGKILL)
    others = [other, *queued]
    _, pending = cf.wait([victim, *others], timeout=lim.settle)
    settle = time.monotonic() - t0
    err = None if victim in pending else _outcome(victim)
    ok = sum(1 for f in others if f not in pending and _outcome(f) is None)
    try:
        after = ctx.peer.submit(h, conffns.pid).result(timeout=lim.settle)
        usable, after_err = isinstance(after, int), ""
    except Exception as e:  # noqa: BLE001 - what a broken pool raises is the answer
        usable, after_err = False, _exc(e)
    if victim in pending:
        fate = f"its future still pending after {lim.settle:g} s"
    elif err is None:
        fate = "its task ran again and succeeded"
    else:
        fate = _exc(err, 60)
    figs = {"killed_task": _exc(err) if err is not None else fate, "others_ok": f"{ok}/{len(others)}", "pending": len(pending), "settle_s": settle,
            "usable_after": usable, "after_error": after_err}
    verdict = YES if ok == len(others) and usable else NO
    return Cell(verdict, f"{fate}; others ok {ok}/{len(others)}; {'usable after' if usable else 'unusable after'}",
                figs)


def q_timeout(ctx: Ctx) -> Cell:
    h = ctx.open()
    lim = ctx.limits
    tag = ctx.tag()
    args = (ctx.beats.path, tag, lim.long)
    try:
        fut = ctx.peer.timeout_submit(h, conffns.beat, args, lim.timeout)
    except NoAPI as why:
        fut = ctx.peer.submit(h, conffns.beat, *args)
        s = ctx.started(tag)
        try:
            fut.result(timeout=lim.timeout)
            waited = "result(timeout=) returned"
        except cf.TimeoutError:
            waited = f"result(timeout={lim.timeout:g}) gave up the wait"
        stop = ctx.beats.watch(tag, s.pid, time.monotonic(), lim.observe, lim.quiet)
        return Cell(NO_API, f"{why}; {waited}; {stop.how if not stop.stopped else stop.words()}",
                    {"api": False, "why": str(why), "stopped": stop.stopped, "how": stop.how})
    s = ctx.started(tag)
    stop = ctx.beats.watch(tag, s.pid, s.t, lim.timeout + lim.observe, lim.quiet)
    with contextlib.suppress(cf.TimeoutError):
        fut.exception(timeout=lim.settle)
    err = _outcome(fut) if fut.done() else None
    figs = {"api": True, "timeout_s": lim.timeout, "stopped": stop.stopped, "how": stop.how,
            "stopped_after_start_s": stop.after_s, "future": _exc(err) if fut.done() else "pending"}
    said = _exc(err, 50) if fut.done() else "pending"
    text = f"{stop.words()} its start; {said}" if stop.stopped else f"{stop.how}; {said}"
    return Cell(YES if stop.stopped else NO, text, figs)


def q_shutdown_cancel(ctx: Ctx) -> Cell:
    h = ctx.open()
    lim = ctx.limits
    busy = [ctx.tag(), ctx.tag()]
    for tag in busy:
        ctx.peer.submit(h, conffns.beat, ctx.beats.path, tag, lim.long)
    for tag in busy:
        ctx.started(tag)
    queued = [ctx.peer.submit(h, conffns.started, ctx.beats.path, ctx.tag()) for _ in range(4)]
    woke = threading.Event()
    got: dict[str, Any] = {}

    def waiter() -> None:
        try:
            queued[-1].result(timeout=lim.wake + 5)
            got["outcome"] = got["short"] = "a result (the task ran)"
        except BaseException as err:  # noqa: BLE001 - what reaches the waiter is the answer
            got["outcome"], got["short"] = _exc(err), _exc(err, 40)
        got["t"] = time.monotonic()
        woke.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    t0 = time.monotonic()
    api, call = ctx.peer.shutdown_cancel(h)
    woken = woke.wait(lim.wake)
    cancelled = sum(1 for f in queued if f.cancelled())
    figs = {"api": api, "called": call, "woke": woken, "woke_after_s": got["t"] - t0 if woken else None,
            "waiter_got": got.get("outcome", "still waiting"), "queued_cancelled": f"{cancelled}/{len(queued)}"}
    said = (f"woke in {_ms(got['t'] - t0)}: {got['short']}" if woken else f"still blocked after {lim.wake:g} s")
    said += f"; {cancelled}/{len(queued)} queued cancelled"
    if not api:
        return Cell(NO_API, f"no cancel_futures; {call}: {said}", figs)
    return Cell(YES if woken else NO, said, figs)


CHILD = "import sys; from benchmarks.sec_conformance import host_child; host_child(*sys.argv[1:])"


def host_child(key: str, fifo: str, first_tag: str, seconds: str) -> None:
    """The host of question 6: a pool with a task on each worker, then it waits for its end
    (EOF on stdin, if the parent goes; a SIGKILL, in the question)."""
    peer = PEERS[key]
    h = peer.open()
    for i in range(WORKERS):
        peer.submit(h, conffns.beat, fifo, int(first_tag) + i, float(seconds))
    sys.stdin.read()
    peer.close(h)


def q_host_killed(ctx: Ctx) -> Cell:
    lim = ctx.limits
    tags = [ctx.tag() for _ in range(WORKERS)]
    with open(ctx.tmp / "host-child.err", "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", CHILD, ctx.peer.key, ctx.beats.path, str(tags[0]),
                                  str(lim.long)], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=err)
    try:
        workers = {ctx.started(tag).pid for tag in tags}
        under = descendants(child.pid)
        missing = workers - under.keys()
        if missing:
            raise RuntimeError(f"the tasks' processes {sorted(missing)} are not under the host")
    finally:  # the question's SIGKILL of the host (or its end, when the question failed first)
        t0 = time.monotonic()
        child.kill()
        child.wait(timeout=30)
        assert child.stdin is not None
        child.stdin.close()
    left, took = end_processes(under, lim.host_gone)
    survivors = [w for w in left if int(w.split()[0]) in workers]
    figs = {"processes_under_host": len(under), "workers": sorted(workers), "left_after_s": lim.host_gone,
            "left": left, "all_gone_after_s": took if not left else None, "since_kill_s": time.monotonic() - t0}
    if not left:
        return Cell(YES, f"all {len(under)} gone in {_ms(took)}", figs)
    return Cell(NO, f"{len(left)}/{len(under)} left after {lim.host_gone:g} s ({len(survivors)} workers; killed)",
                figs)


def q_idle_worker(ctx: Ctx) -> Cell:
    h = ctx.pool()
    lim = ctx.limits
    for f in [ctx.peer.submit(h, conffns.pid) for _ in range(WORKERS * 4)]:
        f.result(timeout=lim.start)  # every worker up (loky starts them lazily)
    long_tag, short_tag = ctx.tag(), ctx.tag()
    busy = ctx.peer.submit(h, conffns.beat, ctx.beats.path, long_tag, lim.idle_long)
    ctx.started(long_tag)
    t0 = time.monotonic()
    short = ctx.peer.submit(h, conffns.started, ctx.beats.path, short_tag)
    s = ctx.beats.first("S", short_tag, lim.idle_long + lim.start)
    short.result(timeout=lim.settle)
    busy.result(timeout=lim.settle)  # the pool may be the column's: left idle, as it was found
    wait = s.t - t0
    figs = {"busy_task_s": lim.idle_long, "submit_to_start_s": wait}
    if wait < lim.idle_long / 2:
        return Cell(YES, f"started {_ms(wait)} after its submit", figs)
    return Cell(NO, f"started {wait:.2f} s after its submit (behind the busy one, {lim.idle_long:g} s)", figs)


def q_retries(ctx: Ctx) -> Cell:
    h = ctx.pool()
    mark = str(ctx.tmp / f"flaky-{ctx.tag()}")
    try:
        fut = ctx.peer.retry_submit(h, conffns.flaky, (mark,), 1)
    except NoAPI as why:
        fut = ctx.peer.submit(h, conffns.flaky, mark)
        err = fut.exception(timeout=ctx.limits.settle)
        return Cell(NO_API, f"{why}; the first failure reached the caller: {_exc(err, 40)}",
                    {"api": False, "why": str(why), "future": _exc(err)})
    try:
        attempts = fut.result(timeout=ctx.limits.settle)
    except Exception as err:  # noqa: BLE001 - a failure that was not re-run is the answer
        return Cell(NO, f"not re-run: {_exc(err, 50)}", {"api": True, "future": _exc(err)})
    return Cell(YES, f"re-run: it succeeded at attempt {attempts}", {"api": True, "attempts": attempts})


def q_memory(ctx: Ctx) -> Cell:
    lim = ctx.limits
    try:
        h = ctx.open(memory_max=MEMORY_LIMIT_MIB * MIB)
    except NoAPI as why:
        return Cell(NO_API, str(why), {"api": False, "why": str(why)})
    tag = ctx.tag()
    t0 = time.monotonic()
    fut = ctx.peer.submit(h, conffns.hog, ctx.beats.path, tag, HOG_MIB, lim.long)
    s = ctx.started(tag)
    done, _ = cf.wait([fut], timeout=lim.settle)
    took = time.monotonic() - t0
    err = _outcome(fut) if done else None
    reached = any(ln.kind == "M" for ln in ctx.beats.take(tag))
    figs = {"api": True, "limit_mib": MEMORY_LIMIT_MIB, "hog_mib": HOG_MIB, "future": _exc(err) if done else "pending",
            "ended_after_s": took if done else None, "hog_held_it_all": reached, "first_pid": s.pid}
    if done and err is not None:
        return Cell(YES, f"{_exc(err, 60)} after {took:.1f} s", figs)
    if done:
        return Cell(NO, f"the hog ran to its end holding {HOG_MIB} MiB", figs)
    return Cell(NO, f"not stopped within {lim.settle:g} s{' (it held all of it)' if reached else ''}", figs)


def q_process_per_task(ctx: Ctx) -> Cell:
    n = 6
    try:
        h = ctx.open(per_task=True)
        api: NoAPI | None = None
    except NoAPI as why:
        h, api = ctx.pool(), why
    pids = [f.result(timeout=ctx.limits.settle) for f in [ctx.peer.submit(h, conffns.pid) for _ in range(n)]]
    distinct = len(set(pids))
    figs = {"api": api is None, "tasks": n, "distinct_pids": distinct}
    if api is not None:
        return Cell(NO_API, f"{api}; {n} tasks ran in {_processes(distinct)}", figs)
    return Cell(YES if distinct == n else NO, f"{n} tasks, {_processes(distinct)}", figs)


def _processes(n: int) -> str:
    return f"{n} process{'' if n == 1 else 'es'}"


def q_unpicklable(ctx: Ctx) -> Cell:
    h = ctx.pool()
    fut = ctx.peer.submit(h, conffns.unpicklable)
    done, _ = cf.wait([fut], timeout=ctx.limits.answer)
    err = _outcome(fut) if done else None
    try:
        usable = ctx.peer.submit(h, conffns.pid).result(timeout=ctx.limits.answer) > 0
    except Exception:  # noqa: BLE001 - a pool that broke is the answer
        usable = False
    figs = {"future": (_exc(err) if err is not None else "a result?!") if done else "pending", "usable_after": usable}
    raised = done and err is not None
    head = (_exc(err, 60) if err is not None else "a result?!") if done else f"no answer within {ctx.limits.answer:g} s"
    return Cell(YES if raised and usable else NO, f"{head}; {'usable after' if usable else 'unusable after'}", figs)


def q_exception_type(ctx: Ctx) -> Cell:
    h = ctx.pool()
    fut = ctx.peer.submit(h, conffns.raises, 7)
    err = fut.exception(timeout=ctx.limits.answer)
    kept = type(err) is conffns.AppError and err.args == (7,)
    figs = {"raised": _exc(err), "type": f"{type(err).__module__}.{type(err).__qualname__}",
            "args": repr(getattr(err, "args", None))}
    return Cell(YES if kept else NO, f"{type(err).__name__}{figs['args'] if kept else ': ' + _exc(err, 60)}", figs)


QUESTIONS: dict[str, tuple[str, Callable[[Ctx], Cell]]] = {
    "cancel": ("1. cancel() of a running task stops it", q_cancel),
    "cancel_asyncio": ("2. the same from asyncio (task.cancel())", q_cancel_asyncio),
    "worker_death": ("3. SIGKILL of one worker: only its task fails", q_worker_death),
    "timeout": ("4. a per-task timeout stops the task", q_timeout),
    "shutdown_cancel": ("5. shutdown(cancel_futures=True) wakes a waiter", q_shutdown_cancel),
    "host_killed": ("6. nothing left after the host's SIGKILL", q_host_killed),
    "idle_worker": ("7. an idle worker takes the next task", q_idle_worker),
    "retries": ("8. retries: a failed task runs again", q_retries),
    "memory": (f"9. a memory limit stops a hog ({MEMORY_LIMIT_MIB} MiB)", q_memory),
    "process_per_task": ("10. a process per task", q_process_per_task),
    "unpicklable": ("11. an unpicklable result: raises, pool lives", q_unpicklable),
    "exception_type": ("12. a task's exception keeps its type", q_exception_type),
}


# Questions that leave a plain pool as they found it (every task ended, every worker alive)
# share one per column, in this order: a pool of Dask's takes seconds to start.
SHARED = ("retries", "process_per_task", "exception_type", "unpicklable", "idle_worker")


def _close_bounded(peer: Peer, h: Any, bound: float) -> str | None:
    """Close a pool in a thread of its own, waiting at most ``bound`` s (a close that hangs
    is reported; the processes are ended by pid after it either way)."""
    box: list[BaseException] = []

    def close() -> None:
        try:
            peer.close(h)
        except BaseException as err:  # noqa: BLE001 - reported, never raised into the section
            box.append(err)
    t = threading.Thread(target=close, name=f"close-{peer.key}", daemon=True)
    t.start()
    t.join(bound)
    if t.is_alive():
        return f"close() still running after {bound:g} s"
    return _exc(box[0]) if box else None


def ask(peer: Peer, name: str, beats: Beats, limits: Limits, tmp: Path, tags: Iterator[int],
        shared: Any = None) -> dict[str, Any]:
    """One question of one peer: its cell, with what cleaning up after it took."""
    before = set(descendants(os.getpid()))
    ctx = Ctx(peer, beats, limits, tmp, tags, shared)
    t0 = time.monotonic()
    try:
        cell = QUESTIONS[name][1](ctx)
    except NoAPI as why:
        cell = Cell(NO_API, str(why), {"api": False})
    except Exception as err:  # noqa: BLE001 - one question failing does not lose the others
        cell = Cell(ERROR, _exc(err), {})
    seconds = time.monotonic() - t0
    t1 = time.monotonic()
    # Tasks still beating are ended first, so that closing a pool never waits for one.
    beats.pump(0)
    for pid in sorted(set(beats.running.values()) & set(descendants(os.getpid()))):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    beats.running.clear()
    problems = [p for h in ctx.handles if (p := _close_bounded(peer, h, limits.reap + 20))]
    left = {pid: cmd for pid, cmd in descendants(os.getpid()).items()
            if pid not in before and not _shared_helper(cmd)}
    killed, _ = end_processes(left, limits.reap)
    out = cell.as_dict()
    out["seconds"] = seconds
    out["cleanup_s"] = time.monotonic() - t1
    if problems:
        out["close_problems"] = problems
    if killed:
        out["killed_after_close"] = killed
    beats.drain()  # the last beats of the ended tasks: not the next question's
    return out


def column(key: str, names: list[str], quick: bool, say: Callable[[str], None] = lambda _: None,
           peer: Peer | None = None) -> dict[str, Any]:
    """Every question ``names`` of one peer, in this process: question -> cell."""
    peer = peer or PEERS[key]
    try:
        peer.available()
    except Unavailable as why:
        return {n: Cell(NOT_INSTALLED, str(why)).as_dict() for n in names}
    limits = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-conformance-{key}-"))
    beats = Beats(tmp / "beats.fifo")
    tags = itertools.count(1)
    before = set(descendants(os.getpid()))
    shared = None
    try:
        cells = {}
        for n in [n for n in names if n not in SHARED] + [n for n in SHARED if n in names]:
            if n in SHARED and shared is None:
                say(f"{peer.title}: a pool for {', '.join(q for q in SHARED if q in names)}")
                try:
                    shared = peer.open()
                    # Every worker up now, before any question notes the processes there are
                    # (loky and ProcessPoolExecutor start theirs at the first submits).
                    naps = [peer.submit(shared, conffns.nap, 0.2) for _ in range(WORKERS * 2)]
                    for f in naps:
                        f.result(timeout=limits.start)
                except Exception as err:  # noqa: BLE001 - each question then opens its own, and says why
                    shared = None
                    say(f"{peer.title}: no shared pool: {_exc(err, 80)}")
            say(f"{peer.title}: {n}")
            cells[n] = ask(peer, n, beats, limits, tmp, tags, shared)
        return {n: cells[n] for n in names}
    finally:
        try:
            if shared is not None:
                _close_bounded(peer, shared, limits.reap + 20)
            end_processes({pid: cmd for pid, cmd in descendants(os.getpid()).items()
                           if pid not in before and not _shared_helper(cmd)}, limits.reap)
        finally:
            beats.close()
            shutil.rmtree(tmp, ignore_errors=True)


def column_main() -> None:
    """A column in a child process: argv KEY QUICK NAMES OUT; progress lines on stdout."""
    key, quick, names, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3].split(","), sys.argv[4]

    def say(msg: str) -> None:
        print(msg, flush=True)
    cells = column(key, names, quick, say)
    Path(out).write_text(json.dumps(cells, default=repr))


COLUMN = "import sys; from benchmarks.sec_conformance import column_main; column_main()"


def _columns_in_children(keys: list[str], names: list[str], quick: bool, at_once: int, parts: int,
                         progress: Callable[[str], None], tmp: Path) -> dict[str, dict[str, Any]]:
    """Each peer's column in child processes (``parts`` 2: the questions of SHARED in one, the
    others in another), ``at_once`` children at a time; their progress lines relayed. A
    child that fails gives cells of errors with its stderr's last line."""
    out: dict[str, dict[str, Any]] = {k: {} for k in keys}
    deals = [names] if parts == 1 else [[n for n in names if n not in SHARED], [n for n in names if n in SHARED]]
    todo = [(k, i, deal) for i, deal in enumerate(deals) for k in keys if deal]
    running: dict[int, tuple[str, list[str], Path, subprocess.Popen[str]]] = {}
    bound = len(names) * 120 + 120
    t0 = time.monotonic()
    try:
        while todo or running:
            while todo and len(running) < at_once:
                key, part, mine = todo.pop(0)
                result = tmp / f"{key}-{part}.json"
                with open(result.with_suffix(".err"), "w") as err:
                    child = subprocess.Popen([sys.executable, "-c", COLUMN, key, "1" if quick else "0", ",".join(mine),
                                              str(result)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=err,
                                             stdin=subprocess.DEVNULL, text=True)
                assert child.stdout is not None
                running[child.stdout.fileno()] = (key, mine, result, child)
            ready, _, _ = select.select(list(running), [], [], 5.0)
            if time.monotonic() - t0 > bound:
                raise TimeoutError(f"the columns took over {bound} s")
            for fd in ready:
                key, mine, result, child = running[fd]
                assert child.stdout is not None
                line = child.stdout.readline()
                if line:
                    progress(line.strip())
                    continue
                child.wait(timeout=60)
                del running[fd]
                child.stdout.close()
                if child.returncode == 0 and result.exists():
                    out[key].update(json.loads(result.read_text()))
                else:
                    tail = result.with_suffix(".err").read_text().strip().splitlines()[-1:] or ["no stderr"]
                    out[key].update({n: Cell(ERROR, f"its child exited {child.returncode}: {tail[0][:100]}").as_dict()
                                     for n in mine})
    finally:
        for *_, child in running.values():
            child.kill()
            child.wait(timeout=30)
    return out


# -- the section ---------------------------------------------------------------------------------

def run(quick: bool, progress: Callable[[str], None], *, out: Path | None = None,
        peers: list[str] | None = None, questions: list[str] | None = None) -> dict[str, Any]:
    """The matrix. ``peers`` and ``questions``: a subset (keys of PEERS and QUESTIONS);
    ``out``: where conformance.json and conformance.md go (benchmarks/results). Peers are
    not installed here: ``pip install loky pebble distributed`` does it."""
    keys = peers or list(PEERS)
    names = questions or list(QUESTIONS)
    unknown = [k for k in keys if k not in PEERS] + [n for n in names if n not in QUESTIONS]
    if unknown:
        raise ValueError(f"unknown peer or question: {', '.join(unknown)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-conformance-"))
    t0 = time.monotonic()
    try:
        # Quick: every column at once, each dealt out to QUICK_PARTS children (Dask's pools
        # take seconds to start: its column alone would set the pace); full: one at a time.
        cells = _columns_in_children(keys, names, quick, len(keys) * QUICK_PARTS if quick else 1,
                                     QUICK_PARTS if quick else 1, progress, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {
        "mode": "quick" if quick else "full", "workers": WORKERS, "seconds": time.monotonic() - t0,
        "columns": {k: PEERS[k].title for k in keys}, "questions": {n: QUESTIONS[n][0] for n in names},
        "cells": {n: {k: cells[k][n] for k in keys} for n in names}, "loadavg": os.getloadavg(),
    }
    where = out or REPO_ROOT / "benchmarks" / "results"
    where.mkdir(parents=True, exist_ok=True)
    result["table"] = str(where / "conformance.md")
    (where / "conformance.json").write_text(json.dumps(result, indent=1, default=repr) + "\n")
    (where / "conformance.md").write_text("\n".join(markdown(result)) + "\n")
    return result


def _cell_text(cell: dict[str, Any]) -> str:
    text = str(cell["text"]).replace("|", "/")
    return f"{cell['verdict']}: {text}" if text else str(cell["verdict"])


def markdown(res: dict[str, Any]) -> list[str]:
    """The matrix as a markdown table: rows the questions, columns the executors."""
    cols = res["columns"]
    rows = [[q, *(_cell_text(res["cells"][n][k]) for k in cols)] for n, q in res["questions"].items()]
    head = ["question", *cols.values()]
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def render(res: dict[str, Any]) -> list[str]:
    """The stdout block: one line per question and executor (the cells are long for a grid)."""
    out = [f"conformance: {res['workers']} workers per pool, a fresh pool per question but {', '.join(SHARED)} "
           f"(one pool for those) ({', '.join(res['columns'].values())})"]
    for n, q in res["questions"].items():
        out.append(q)
        for k, title in res["columns"].items():
            out.append(f"  {title:<20} {_cell_text(res['cells'][n][k])}")
    out.append(f"  the table: {res.get('table', 'benchmarks/results/conformance.md')}")
    return out
