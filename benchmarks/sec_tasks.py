"""Tasks: ``orchestrator.Executor`` against ``ProcessPoolExecutor``, loky and pebble, side by side.

Seven parts, each with every pool open at once and the variants interleaved round by round
in a rotating order (after a warm-up round), all with 2 workers but the fifth's case B (the
seventh is ours alone):

1. **tiny tasks**: ``map`` of a no-op over N tasks on warm pools, tasks/s (N per variant is
   sized from its warm-up rate, so every round lasts about as long for each); also one
   ``submit(...).result()`` after another, the round trip of a single task.
2. **a process per task**: ``max_tasks_per_child=1`` (ours; ``ProcessPoolExecutor`` with
   the context 3.11 picks for it, spawn, and with an explicit fork context where the
   executor takes one (3.11 refuses: shown as not run); pebble's ``max_tasks=1``; loky has
   no such setting), ``map`` of a task that returns its pid
   (every pid is checked distinct), tasks/s. Ours also with a module that holds 200 MB
   (``bench_spawn``'s generator) in ``preload``.
3. **cancel of a running task**: the task says it started (a line on a FIFO), sleeps, and
   when ``Cancelled`` reaches it writes the monotonic time it arrived; the figure is that
   time minus the time just before ``cancel()`` in the parent. ``ProcessPoolExecutor`` and
   loky return False from ``cancel()`` of a running task (counted; the task runs to its
   end); pebble's ``cancel()`` terminates the worker: its figure is ``cancel()`` → the
   worker process gone (its pidfd readable), and the task sees no exception.
4. **kill -9 of one busy worker** with 50 tasks of 50 ms in flight: how many futures fail,
   and with what; whether the same executor takes a task afterwards.
5. **head-of-line**: warm pools, ``time.sleep`` tasks submitted back to back, when each
   future ends. A: 2 workers, 6 s, 3 s, 0.1 s: the third can end at ~3.1 s (on the worker
   the 3 s task frees), or after 6 s if a busy worker held it. B: 4 workers, one long task
   (20 s; 6 s in quick mode) then seven of 1 s: the last short one can end at ~3 s on the
   three free workers. Each pool also with a process per task (``max_tasks_per_child=1``,
   pebble's ``max_tasks=1``; loky has none). Here every pool runs its round at the same
   time: the tasks sleep, so they do not compete for the CPUs, and a round lasts as long
   as its longest task instead of that times the pools.
6. **scheduling**: tiny tasks submitted back to back, then all waited for, through 8
   tenants (weights 1 to 4, ``max_wait`` on) with 3 priorities mixed, against the same
   tasks through a plain FIFO pool of ours, both open at once, interleaved: tasks/s and the
   ratio (the queue's cost: priority lanes, weighted turns, aging).
7. **a parked task's resume** (ours alone: no peer has ``Retry``): two tasks at a time (one
   per worker) raise ``Retry(after=0.1)`` on their first attempt, after writing the
   monotonic time; the second attempt reports how long after that time plus 0.1 s it
   began (from the raise: an upper bound of the lateness; ``benchmarks.bench_retry
   --daemon`` also measures it from the loop's own time).

The tasks live in ``benchmarks/taskfns.py``, which imports nothing but ``os`` and ``time``:
every pool imports them by name, and a fresh worker pays no import of this module's. Every
pool is shut down in a ``finally`` (workers killed where the library can); no process is
killed by name.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks import peers
from benchmarks.report import summary
from benchmarks.taskfns import busy, noop, park_once, pid, until_cancelled

WORKERS = 2
pc = time.perf_counter

OURS = "orchestrator.Executor"
OURS_RETRY = "orchestrator.Executor, retries=1"
OURS_PROC = "orchestrator.Executor, max_tasks_per_child=1"
OURS_PRELOAD = "orchestrator.Executor, max_tasks_per_child=1, 200 MB preload"
PPE = "ProcessPoolExecutor (default context: fork)"
PPE_SPAWN = "ProcessPoolExecutor(max_tasks_per_child=1) (3.11's default: spawn)"
PPE_FORK = "ProcessPoolExecutor(max_tasks_per_child=1, fork context)"
LOKY = "loky"
PEBBLE = "pebble ProcessPool"
PEBBLE_PROC = "pebble ProcessPool(max_tasks=1)"

# Goals (README, "Benchmarks"); measured values come from run().
TINY_VS_PPE = 1.0
PROC_VS_PPE = 5.0
PRELOAD_RATE = 100.0
CANCEL_P99_MS = 10.0
PARKED_P99_MS = 10.0
PARK_AFTER = 0.1  # seconds a parked task waits

KILL_TASKS = 50
KILL_SLEEP = 0.05
PRELOAD_MIB = 200


# -- the parent's side ---------------------------------------------------------------------

class Fifo:
    """A named pipe the tasks write lines to; the parent waits on it with select (no polling).
    The parent holds a writer too, so that no writer being there is not an end of file."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = str(path)
        self._r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._w = os.open(path, os.O_WRONLY)
        self._buf = b""
        self.lines: list[list[str]] = []

    def pump(self, timeout: float, fds: tuple[int, ...] = ()) -> list[int]:
        """Read what the tasks wrote into ``lines``, waiting up to ``timeout`` for it or for
        one of ``fds``; the ``fds`` that are readable."""
        ready, _, _ = select.select([self._r, *fds], [], [], max(0.0, timeout))
        if self._r in ready:
            try:
                self._buf += os.read(self._r, 1 << 16)
            except BlockingIOError:
                pass
            else:
                *done, self._buf = self._buf.split(b"\n")
                self.lines += [line.decode().split() for line in done]
        return [fd for fd in ready if fd != self._r]

    def wait(self, kind: str, n: int | None = None, timeout: float = 30.0) -> list[str]:
        """The first line of ``kind`` (for task ``n``) not taken yet; RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            for i, line in enumerate(self.lines):
                if line[0] == kind and (n is None or int(line[1]) == n):
                    return self.lines.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {kind!r} line for task {n} within {timeout:g} s")
            self.pump(left)

    def drain(self) -> None:
        self.pump(0)
        self.lines.clear()

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def _gone(pid: int, timeout: float) -> bool:
    """Wait (select on its pidfd) until process ``pid`` has exited; False at ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


class Pools:
    """The pools of one part, closed in reverse order whatever happens."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.skipped: dict[str, str] = {}

    def ours(self, workers: int = WORKERS, **kw: Any) -> Any:
        from orchestrator import Executor

        ex = Executor(max_workers=workers, **kw)
        self.stack.callback(ex.shutdown, wait=True, cancel_futures=True)
        return ex

    def ppe(self, ctx: str | None = None, workers: int = WORKERS, **kw: Any) -> cf.ProcessPoolExecutor:
        ex = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(ctx) if ctx else None, **kw)
        self.stack.callback(ex.shutdown, wait=True, cancel_futures=True)
        return ex

    def loky(self, install: bool, say: Callable[[str], None], workers: int = WORKERS) -> Any:
        loky = peers.ensure_package("loky", "loky", install=install, say=say)
        ex = loky.ProcessPoolExecutor(max_workers=workers)
        self.stack.callback(ex.shutdown, wait=True, kill_workers=True)
        return ex

    def pebble(self, install: bool, say: Callable[[str], None], workers: int = WORKERS, **kw: Any) -> Any:
        pebble = peers.ensure_package("pebble", "pebble", install=install, say=say)
        pool = pebble.ProcessPool(max_workers=workers, **kw)

        def close() -> None:
            pool.stop()
            pool.join(timeout=30)
        self.stack.callback(close)
        return pool

    def close(self) -> None:
        self.stack.close()


def _map(pool: Any, fn: Callable, n: int) -> list:
    """``map`` with chunksize 1, as each library spells it."""
    if hasattr(pool, "schedule"):  # pebble
        return list(pool.map(fn, range(n), chunksize=1).result())
    return list(pool.map(fn, range(n)))


def _submit(pool: Any, fn: Callable, *args: Any) -> cf.Future:
    if hasattr(pool, "schedule"):
        return pool.schedule(fn, args=args)
    return pool.submit(fn, *args)


def _rounds(progress: Callable[[str], None], part: str, runs: dict[str, Callable[[int], float]],
            budget: float, rounds: int, fn_n: dict[str, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """Every variant once per round, rotating, after a warm-up that sizes each one's count of
    tasks (``budget`` seconds a round; within ``fn_n[name]``'s bounds; the second of two
    warm-up runs, once its workers are surely up). tasks/s per variant."""
    sizes: dict[str, int] = {}
    for name, go in runs.items():
        low, high = fn_n[name]
        progress(f"{part}: warm-up: {name}")
        go(low)  # unmeasured: a pool whose workers were still coming up would size itself to a tiny round
        took = go(low)
        sizes[name] = max(low, min(high, int(budget * low / took) if took > 0 else high))
    times: dict[str, list[float]] = {n: [] for n in runs}
    names = list(runs)
    for r in range(rounds):
        progress(f"{part}: round {r + 1}/{rounds}")
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(runs[name](sizes[name]))
    return {n: {"tasks_per_round": sizes[n], "rounds": len(t), "round_s": summary(t),
                "rate": sizes[n] * len(t) / sum(t)} for n, t in times.items()}


# -- 1. tiny tasks ---------------------------------------------------------------------------

def part_tiny(quick: bool, progress: Callable[[str], None], install: bool, rounds: int) -> dict[str, Any]:
    pools = Pools()
    try:
        variants: dict[str, Any] = {OURS: pools.ours(), PPE: pools.ppe()}
        for name, make in ((LOKY, pools.loky), (PEBBLE, pools.pebble)):
            try:
                variants[name] = make(install, progress)
            except peers.Unavailable as err:
                pools.skipped[name] = str(err)

        def mapped(pool: Any) -> Callable[[int], float]:
            def go(n: int) -> float:
                t0 = pc()
                got = _map(pool, noop, n)
                took = pc() - t0
                if got != list(range(n)):
                    raise RuntimeError("map returned other values than it was given")
                return took
            return go

        def one_by_one(pool: Any) -> Callable[[int], float]:
            def go(n: int) -> float:
                t0 = pc()
                for i in range(n):
                    _submit(pool, noop, i).result(timeout=30)
                return pc() - t0
            return go

        budget = 0.4 if quick else 1.5
        return {"map": _rounds(progress, "tiny tasks, map", {n: mapped(p) for n, p in variants.items()},
                               budget, rounds, {n: (200, 100_000) for n in variants}),
                "submit_result": _rounds(progress, "tiny tasks, submit+result",
                                         {n: one_by_one(p) for n, p in variants.items()},
                                         budget / 2, rounds, {n: (100, 50_000) for n in variants}),
                "skipped": pools.skipped}
    finally:
        pools.close()


# -- 2. a process per task ---------------------------------------------------------------------

@contextlib.contextmanager
def _heavy_module(tmp: Path) -> Iterator[str]:
    """A module that holds PRELOAD_MIB at import (bench_spawn's), importable by the pools
    made while this is open (on PYTHONPATH, which the Executor records with its spec)."""
    from benchmarks.bench_spawn import _HEAVY

    code = tmp / "code"
    code.mkdir()
    (code / "heavy_bench_mod.py").write_text(_HEAVY.format(mib=PRELOAD_MIB))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), old]))
    try:
        yield "heavy_bench_mod"
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def part_process_per_task(quick: bool, progress: Callable[[str], None], install: bool, rounds: int,
                          tmp: Path) -> dict[str, Any]:
    pools = Pools()
    distinct: dict[str, list[int]] = {}
    try:
        progress("a process per task: starting the pools (one with a 200 MB preload)")
        variants: dict[str, Any] = {OURS_PROC: pools.ours(max_tasks_per_child=1)}
        with _heavy_module(tmp) as heavy:
            variants[OURS_PRELOAD] = pools.ours(max_tasks_per_child=1, preload=[heavy])
        variants[PPE_SPAWN] = pools.ppe(max_tasks_per_child=1)
        try:
            variants[PPE_FORK] = pools.ppe("fork", max_tasks_per_child=1)
        except ValueError as err:  # a Python whose executor refuses fork with max_tasks_per_child
            pools.skipped[PPE_FORK] = str(err)
        try:
            variants[PEBBLE_PROC] = pools.pebble(install, progress, max_tasks=1)
        except peers.Unavailable as err:
            pools.skipped[PEBBLE_PROC] = str(err)
        pools.skipped[LOKY] = "loky cannot: its executor has no max_tasks_per_child (workers are reused)"

        def go_for(name: str, pool: Any) -> Callable[[int], float]:
            def go(n: int) -> float:
                t0 = pc()
                pids = _map(pool, pid, n)
                took = pc() - t0
                distinct.setdefault(name, [0, 0])
                distinct[name][0] += len(set(pids))
                distinct[name][1] += n
                return took
            return go

        budget = 0.5 if quick else 1.5
        out = _rounds(progress, "a process per task", {n: go_for(n, p) for n, p in variants.items()}, budget,
                      rounds, {n: (10, 5_000) for n in variants})
        for name, (uniq, total) in distinct.items():
            out[name]["distinct_pids"] = f"{uniq}/{total}"
        return {"variants": out, "skipped": pools.skipped, "preload_mib": PRELOAD_MIB}
    finally:
        pools.close()


# -- 3. cancel of a running task ---------------------------------------------------------------------

def part_cancel(quick: bool, progress: Callable[[str], None], install: bool, rounds: int,
                fifo: Fifo) -> dict[str, Any]:
    pools = Pools()
    n_ours, n_peer = 100 * rounds, rounds  # a cancel of ours takes ~1 ms: enough of them for a p99
    counter = iter(range(1, 1 << 30))
    lat: list[float] = []
    call: list[float] = []
    ours_pids: set[int] = set()
    seen_by_task: dict[str, int] = {}
    refused: dict[str, list[bool]] = {PPE: [], LOKY: []}
    pebble_gone: list[float] = []
    try:
        ex = pools.ours()
        variants: dict[str, Any] = {OURS: ex, PPE: pools.ppe()}
        for name, make in ((LOKY, pools.loky), (PEBBLE, pools.pebble)):
            try:
                variants[name] = make(install, progress)
            except peers.Unavailable as err:
                pools.skipped[name] = str(err)

        def ours_once() -> None:
            n = next(counter)
            fut = ex.submit(until_cancelled, fifo.path, n, 60.0)
            ours_pids.add(int(fifo.wait("S", n)[2]))
            t0 = time.monotonic()
            ok = fut.cancel()
            call.append(time.monotonic() - t0)
            if not ok:
                raise RuntimeError("Executor: cancel() of a running task returned False")
            got = fifo.wait("C", n)
            lat.append(float(got[2]) - t0)
            seen_by_task[got[3]] = seen_by_task.get(got[3], 0) + 1
            if not fut.cancelled():
                raise RuntimeError("Executor: a cancelled future does not say so")

        def refusing(name: str, pool: Any) -> None:
            """PPE, loky: cancel() of a running task; the task runs to its end."""
            n = next(counter)
            fut = pool.submit(until_cancelled, fifo.path, n, 0.2)
            fifo.wait("S", n)
            refused[name].append(not fut.cancel())
            fut.result(timeout=30)
            fifo.wait("E", n)

        def pebble_once(pool: Any) -> None:
            n = next(counter)
            fut = pool.schedule(until_cancelled, args=(fifo.path, n, 60.0))
            worker = int(fifo.wait("S", n)[2])
            t0 = time.monotonic()
            if not fut.cancel():
                raise RuntimeError("pebble: cancel() of a running task returned False")
            if not _gone(worker, 30):
                raise RuntimeError("pebble: the worker of a cancelled task was still there 30 s later")
            pebble_gone.append(time.monotonic() - t0)
            fifo.drain()

        runs: dict[str, Callable[[], None]] = {OURS: ours_once}
        for name in (PPE, LOKY):
            if name in variants:
                runs[name] = lambda name=name: refusing(name, variants[name])
        if PEBBLE in variants:
            runs[PEBBLE] = lambda: pebble_once(variants[PEBBLE])
        for _ in range(5):  # warm-up: every pool's workers are up, the task module imported
            ours_once()
        lat.clear()
        call.clear()
        seen_by_task.clear()
        names = list(runs)
        for r in range(rounds):
            progress(f"cancel: round {r + 1}/{rounds}")
            for name in names[r % len(names):] + names[:r % len(names)]:
                for _ in range(n_ours // rounds if name == OURS else max(1, n_peer // rounds)):
                    runs[name]()
        out: dict[str, Any] = {
            OURS: {"cancels": len(lat), "cancel_to_raised_s": summary(lat), "cancel_call_s": summary(call),
                   "raised_in_task": seen_by_task, "worker_pids_seen": len(ours_pids)},
        }
        for name, got in refused.items():
            if name in variants:
                out[name] = {"cancel_returned_false": f"{sum(got)}/{len(got)}",
                             "note": "cannot: cancel() of a running task returns False; the task runs to its end"}
        if PEBBLE in variants:
            out[PEBBLE] = {"cancels": len(pebble_gone), "cancel_to_worker_gone_s": summary(pebble_gone),
                           "note": "kills the worker (SIGTERM to it): no exception is raised in the task, "
                                   "its finally blocks do not run, a new worker is forked"}
        return {"variants": out, "skipped": pools.skipped}
    finally:
        pools.close()


# -- 4. kill -9 of one busy worker ---------------------------------------------------------------

def part_kill(quick: bool, progress: Callable[[str], None], install: bool, rounds: int,
              fifo: Fifo) -> dict[str, Any]:
    counter = iter(range(1, 1 << 30))
    makers: dict[str, Callable[[Pools], Any]] = {
        OURS: lambda p: p.ours(),
        OURS_RETRY: lambda p: p.ours(retries=1),
        PPE: lambda p: p.ppe(),
        LOKY: lambda p: p.loky(install, progress),
        PEBBLE: lambda p: p.pebble(install, progress),
    }
    results: dict[str, dict[str, Any]] = {n: {"lost": [], "errors": {}, "settle_s": [], "usable_after": []}
                                          for n in makers}
    skipped: dict[str, str] = {}
    names = list(makers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in skipped:
                continue
            progress(f"kill -9 of a busy worker: round {r + 1}/{rounds}: {name}")
            pools = Pools()
            try:
                try:
                    pool = makers[name](pools)
                except peers.Unavailable as err:
                    skipped[name] = str(err)
                    continue
                _map(pool, pid, WORKERS * 4)  # warm: every worker up
                fifo.drain()
                first = next(counter)
                futs = [_submit(pool, busy, fifo.path, first + i, KILL_SLEEP) for i in range(KILL_TASKS)]
                for _ in range(KILL_TASKS - 1):
                    next(counter)
                victim = int(fifo.wait("S", first + 2)[2])  # the third task, 50 ms in: both workers busy
                t0 = pc()
                os.kill(victim, signal.SIGKILL)
                done, pending = cf.wait(futs, timeout=60)
                settle = pc() - t0
                if pending:
                    raise RuntimeError(f"{name}: {len(pending)} futures still pending 60 s after the kill")
                res = results[name]
                errors = [type(f.exception()).__name__ for f in futs if f.exception() is not None]
                res["lost"].append(len(errors))
                for e in errors:
                    res["errors"][e] = res["errors"].get(e, 0) + 1
                res["settle_s"].append(settle)
                try:
                    res["usable_after"].append(_submit(pool, pid).result(timeout=30) > 0)
                except Exception as err:  # noqa: BLE001 - what a broken peer raises is the figure
                    res["usable_after"].append(False)
                    res.setdefault("after", f"{type(err).__name__}: {err}"[:120])
            finally:
                pools.close()
                fifo.drain()
    out: dict[str, Any] = {}
    for name, res in results.items():
        if name in skipped:
            continue
        out[name] = {"futures_lost": res["lost"], "lost_max": max(res["lost"]), "errors": res["errors"],
                     "settle_s": summary(res["settle_s"]),
                     "usable_after": all(res["usable_after"]), **({"after": res["after"]} if "after" in res else {})}
    return {"tasks_in_flight": KILL_TASKS, "task_s": KILL_SLEEP, "rounds": rounds, "variants": out,
            "skipped": skipped}


# -- 5. head-of-line -------------------------------------------------------------------------------

HOL_A = (6.0, 3.0, 0.1)  # 2 workers: the third task's worker is the first one free (at 3 s)
HOL_B_WORKERS, HOL_B_SHORT, HOL_B_N = 4, 1.0, 7  # one long task, then 7 short ones on the 3 others
HOL_B_LONG = {True: 6.0, False: 20.0}  # quick: scaled down from the 20 s
HOL_SETTLE = 0.5  # after the warm-up and each round: a process-per-task pool's new workers come up
LOKY_PROC = "loky, max_tasks_per_child=1"


def _stamp(into: list[float], i: int, t0: float) -> Callable[[cf.Future], None]:
    """A done-callback: the time its future ended, from ``t0``, into ``into[i]`` (it runs
    in the pool's own thread as the future ends)."""
    def done(_: cf.Future) -> None:
        into[i] = pc() - t0
    return done


def part_head_of_line(quick: bool, progress: Callable[[str], None], install: bool, rounds: int) -> dict[str, Any]:
    """Warm pools, tasks of ``time.sleep`` submitted back to back: when does each future
    resolve (its done-callback's time, from just before the first submit)? Case A: two
    workers, 6 s, 3 s, 0.1 s: the third can start when the 3 s one ends (~3.1 s); a pool that
    gave it to the busy worker of the 6 s one resolves it after 6 s. Case B: four workers,
    one long task then seven of 1 s: the three free workers take them (~3 s); one held behind
    the long task ends after it. Every pool of both cases runs its tasks at the same time in
    a round (they sleep: they do not compete for the CPUs), submitted in a rotating order."""
    long_s = HOL_B_LONG[quick]
    cases: dict[str, tuple[int, list[float]]] = {
        "a": (WORKERS, list(HOL_A)), "b": (HOL_B_WORKERS, [long_s] + [HOL_B_SHORT] * HOL_B_N)}
    pools = Pools()
    variants: dict[tuple[str, str], Any] = {}
    try:
        progress("head-of-line: starting the pools")
        for case, (n, _) in cases.items():
            makers: dict[str, Callable[[int], Any]] = {
                OURS: lambda n: pools.ours(n),
                OURS_PROC: lambda n: pools.ours(n, max_tasks_per_child=1),
                PPE: lambda n: pools.ppe(workers=n),
                PPE_SPAWN: lambda n: pools.ppe(workers=n, max_tasks_per_child=1),
                LOKY: lambda n: pools.loky(install, progress, n),
                PEBBLE: lambda n: pools.pebble(install, progress, n),
                PEBBLE_PROC: lambda n: pools.pebble(install, progress, n, max_tasks=1),
            }
            for name, make in makers.items():
                try:
                    variants[(case, name)] = make(n)
                except peers.Unavailable as err:
                    pools.skipped[name] = str(err)
        pools.skipped[LOKY_PROC] = "loky cannot: its executor has no max_tasks_per_child (workers are reused)"
        progress("head-of-line: warm-up")
        for (case, _), pool in variants.items():
            _map(pool, pid, 2 * cases[case][0])  # every worker up and through a task
        stamps: dict[tuple[str, str], list[list[float]]] = {key: [] for key in variants}
        keys = list(variants)
        for r in range(rounds):
            time.sleep(HOL_SETTLE)
            progress(f"head-of-line: round {r + 1}/{rounds} ({max(long_s, HOL_A[0]):g} s)")
            got: dict[tuple[str, str], list[float]] = {}
            futs: list[cf.Future] = []
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                sleeps = cases[key[0]][1]
                got[key] = [float("nan")] * len(sleeps)
                t0 = pc()
                for i, seconds in enumerate(sleeps):
                    fut = _submit(variants[key], time.sleep, seconds)
                    fut.add_done_callback(_stamp(got[key], i, t0))
                    futs.append(fut)
            _, pending = cf.wait(futs, timeout=max(long_s, HOL_A[0]) * 3 + 30)
            if pending:
                raise RuntimeError(f"head-of-line: {len(pending)} futures still pending")
            failed = [f.exception() for f in futs if f.exception() is not None]
            if failed:
                raise RuntimeError(f"head-of-line: {len(failed)} tasks failed, e.g. {failed[0]!r}")
            for key, times in got.items():
                stamps[key].append(times)
        time.sleep(HOL_SETTLE)
    finally:
        pools.close()
    out: dict[str, Any] = {"a": {}, "b": {}}
    for (case, name), runs in stamps.items():
        if case == "a":
            out["a"][name] = {"third_s": summary([t[2] for t in runs]), "first_s": summary([t[0] for t in runs]),
                              "second_s": summary([t[1] for t in runs]), "raw_s": runs}
        else:
            out["b"][name] = {"last_short_s": summary([max(t[1:]) for t in runs]),
                              "long_s": summary([t[0] for t in runs]), "raw_s": runs}
    return {"rounds": rounds, "case_a": {"workers": WORKERS, "sleeps_s": list(HOL_A), "variants": out["a"]},
            "case_b": {"workers": HOL_B_WORKERS, "long_s": long_s, "short_s": HOL_B_SHORT, "shorts": HOL_B_N,
                       "variants": out["b"]},
            "skipped": pools.skipped}


# -- 6. scheduling ------------------------------------------------------------------------------

SCHED_TENANTS = 8
SCHED_VS_FIFO = 0.9  # scheduling costs at most 10% of a plain FIFO pool's tasks/s
OURS_FIFO = "orchestrator.Executor, FIFO (no options)"
OURS_SCHED = f"orchestrator.Executor, {SCHED_TENANTS} tenants x 3 priorities"


def part_scheduling(quick: bool, progress: Callable[[str], None], rounds: int) -> dict[str, Any]:
    pools = Pools()
    try:
        weights = {f"t{i}": 1 + i % 4 for i in range(SCHED_TENANTS)}
        fifo = pools.ours()
        sched = pools.ours(tenant_weights=weights, max_wait=60.0)
        views = [sched.options(tenant=f"t{i}", priority=i % 3) for i in range(SCHED_TENANTS)]

        def through(submits: list[Callable[..., cf.Future]]) -> Callable[[int], float]:
            def go(n: int) -> float:
                k = len(submits)
                t0 = pc()
                futs = [submits[i % k](noop, i) for i in range(n)]
                got = [f.result(timeout=60) for f in futs]
                took = pc() - t0
                if got != list(range(n)):
                    raise RuntimeError("the tasks returned other values than they were given")
                return took
            return go

        n = 1000 if quick else 4000  # the same batch for both: the ratio compares like with like
        variants = _rounds(progress, "scheduling", {OURS_FIFO: through([fifo.submit]),
                                                    OURS_SCHED: through([v.submit for v in views])},
                           1.0, rounds, {OURS_FIFO: (n, n), OURS_SCHED: (n, n)})
        return {"variants": variants, "tenants": SCHED_TENANTS, "weights": weights, "priorities": 3}
    finally:
        pools.close()


def part_parked(quick: bool, progress: Callable[[str], None], rounds: int) -> dict[str, Any]:
    pools = Pools()
    tmp = Path(tempfile.mkdtemp(prefix="bench-parked-"))
    try:
        ex = pools.ours()
        ex.submit(park_once, str(tmp / "warm"), 0.0).result(timeout=60)  # both attempts' paths warm
        pairs = (30 if quick else 100) * rounds
        progress(f"parked tasks: {pairs * WORKERS} resumes after Retry(after={PARK_AFTER:g})")
        late: list[float] = []
        for i in range(pairs):
            futs = [ex.submit(park_once, str(tmp / f"{i}-{j}"), PARK_AFTER) for j in range(WORKERS)]
            late += [f.result(timeout=60)[0] for f in futs]
        return {"after_s": PARK_AFTER, "parked_at_once": WORKERS, "late_s": summary(late)}
    finally:
        pools.close()
        shutil.rmtree(tmp, ignore_errors=True)


# -- the section -------------------------------------------------------------------------------

def run(quick: bool, progress: Callable[[str], None], *, batches: int | None = None,
        install: bool = True) -> dict[str, Any]:
    """Every part in turn. ``batches``: rounds per part (default 2 quick, 4 full); the tiny
    tasks run one more (quick) or twice as many (full), the kill and head-of-line parts half
    as many (at least 1); ours is cancelled 100 times a round."""
    rounds = batches if batches is not None else (2 if quick else 4)
    tmp = Path(tempfile.mkdtemp(prefix="bench-suite-tasks-"))
    fifo = Fifo(tmp / "tasks.fifo")
    try:
        tiny = part_tiny(quick, progress, install, rounds + 1 if quick else 2 * rounds)
        proc = part_process_per_task(quick, progress, install, rounds, tmp)
        cancel = part_cancel(quick, progress, install, rounds, fifo)
        kill = part_kill(quick, progress, install, max(1, rounds // 2), fifo)
        hol = part_head_of_line(quick, progress, install, max(1, rounds // 2))
        sched = part_scheduling(quick, progress, rounds + 1 if quick else 2 * rounds)
        parked = part_parked(quick, progress, rounds)
    finally:
        fifo.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {"workers": WORKERS, "tiny": tiny, "process_per_task": proc, "cancel": cancel,
                              "kill": kill, "head_of_line": hol, "scheduling": sched, "parked": parked}
    result["targets"] = targets(result)
    return result


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """This section's targets, judged from its own figures (report.targets shows them)."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, higher: bool, unit: str) -> None:
        ok = None if value is None else (value >= goal if higher else value <= goal)
        out.append({"target": name, "goal": f"{'≥' if higher else '≤'} {goal:g}{unit}", "measured": value,
                    "unit": unit, "ok": ok, "why": "" if value is not None else "not measured in this run"})

    def rate(part: dict, name: str) -> float | None:
        return (part.get(name) or {}).get("rate")

    tiny = res["tiny"]["map"]
    ours, ppe = rate(tiny, OURS), rate(tiny, PPE)
    add("tiny tasks/s (map, 2 workers) vs ProcessPoolExecutor", ours / ppe if ours and ppe else None,
        TINY_VS_PPE, True, "x")
    proc = res["process_per_task"]["variants"]
    ours, ppe = rate(proc, OURS_PROC), rate(proc, PPE_SPAWN)
    add("a process per task vs ProcessPoolExecutor(max_tasks_per_child=1)", ours / ppe if ours and ppe else None,
        PROC_VS_PPE, True, "x")
    add(f"a process per task with a {PRELOAD_MIB} MB preload, tasks/s", rate(proc, OURS_PRELOAD), PRELOAD_RATE,
        True, "/s")
    p99 = res["cancel"]["variants"].get(OURS, {}).get("cancel_to_raised_s", {}).get("p99")
    add("cancel() of a running task → Cancelled raised in it, p99", p99 * 1e3 if p99 is not None else None,
        CANCEL_P99_MS, False, " ms")
    kill = res["kill"]["variants"]
    for name, goal in ((OURS, 1.0), (OURS_RETRY, 0.0)):
        lost = (kill.get(name) or {}).get("lost_max")
        out.append({"target": f"kill -9 of a busy worker, {KILL_TASKS} in flight: futures lost, {name}",
                    "goal": f"{goal:g}", "measured": lost, "shown": "-" if lost is None else str(lost), "unit": "",
                    "ok": None if lost is None else lost == goal,
                    "why": "" if lost is not None else "not measured in this run"})
    sched = (res.get("scheduling") or {}).get("variants") or {}
    ours, fifo = rate(sched, OURS_SCHED), rate(sched, OURS_FIFO)
    add(f"{SCHED_TENANTS} tenants with mixed priorities vs a plain FIFO pool, tasks/s",
        ours / fifo if ours and fifo else None, SCHED_VS_FIFO, True, "x")
    p99 = ((res.get("parked") or {}).get("late_s") or {}).get("p99")
    add(f"a parked task resumes after its time (Retry(after={PARK_AFTER:g})), p99", p99 * 1e3 if p99 is not None
        else None, PARKED_P99_MS, False, " ms")
    return out


# -- the table -----------------------------------------------------------------------------------

def render(res: dict[str, Any]) -> list[str]:
    from benchmarks.report import _ms, _table

    tiny = res["tiny"]
    base = tiny["map"].get(PPE, {}).get("rate") or float("nan")
    rows = [[name, f"{v['rate']:,.0f}", f"{v['rate'] / base:.2f}x",
             f"{tiny['submit_result'].get(name, {}).get('rate', float('nan')):,.0f}",
             f"{v['rounds']} x {v['tasks_per_round']}"] for name, v in tiny["map"].items()]
    out = [f"tasks: {res['workers']} workers per pool, every pool open at once, variants interleaved",
           "1. tiny tasks (a no-op), warm pools",
           *_table(["pool", "map tasks/s", "vs PPE", "submit+result tasks/s", "rounds x tasks"], rows)]
    proc = res["process_per_task"]
    base = proc["variants"].get(PPE_SPAWN, {}).get("rate") or float("nan")
    rows = [[name, f"{v['rate']:,.1f}", f"{v['rate'] / base:.1f}x", v.get("distinct_pids", "-"),
             f"{v['rounds']} x {v['tasks_per_round']}"] for name, v in proc["variants"].items()]
    out += ["2. a process per task (map of a task returning its pid)",
            *_table(["pool", "tasks/s", "vs PPE (spawn)", "distinct pids", "rounds x tasks"], rows)]
    cancel = res["cancel"]["variants"]
    rows = []
    for name, v in cancel.items():
        if "cancel_to_raised_s" in v:
            s = v["cancel_to_raised_s"]
            rows.append([name, "True", f"Cancelled raised in the task ({s['n']}); {v['worker_pids_seen']} worker pids",
                         _ms(s, "p50"), _ms(s, "p99"), _ms(s, "max")])
        elif "cancel_to_worker_gone_s" in v:
            s = v["cancel_to_worker_gone_s"]
            rows.append([name, "True", f"kills the worker ({s['n']}); no exception in the task",
                         _ms(s, "p50"), _ms(s, "p99"), _ms(s, "max")])
        else:
            rows.append([name, f"False {v['cancel_returned_false']}", "cannot: the task runs to its end",
                         "-", "-", "-"])
    out += ["3. cancel() of a running task (a task in time.sleep): cancel() → the exception in the task",
            *_table(["pool", "cancel() returns", "what happens", "p50 ms", "p99 ms", "max ms"], rows)]
    kill = res["kill"]
    rows = [[name, ", ".join(map(str, v["futures_lost"])),
             ", ".join(f"{k} {c}" for k, c in v["errors"].items()) or "-",
             _ms(v["settle_s"], "p50"), "yes" if v["usable_after"] else f"no ({v.get('after', '')[:60]})"]
            for name, v in kill["variants"].items()]
    out += [f"4. kill -9 of one busy worker, {kill['tasks_in_flight']} tasks of {kill['task_s'] * 1e3:.0f} ms "
            f"in flight ({kill['rounds']} round(s))",
            *_table(["pool", "futures lost per round", "errors", "kill → all settled p50 ms",
                     "same executor usable after"], rows)]
    hol = res["head_of_line"]
    a, b = hol["case_a"], hol["case_b"]
    names = list(dict.fromkeys([*a["variants"], *b["variants"]]))

    def secs(v: dict | None, key: str) -> str:
        return f"{v[key]['p50']:.2f} / {v[key]['max']:.2f}" if v else "-"
    rows = [[name, secs(a["variants"].get(name), "third_s"), secs(a["variants"].get(name), "second_s"),
             secs(b["variants"].get(name), "last_short_s"), secs(b["variants"].get(name), "long_s")]
            for name in names]
    sleeps = ", ".join(f"{x:g} s" for x in a["sleeps_s"])
    out += [f"5. head-of-line, warm pools, seconds from the first submit to each future's end (p50 / max of "
            f"{hol['rounds']} round(s)): A: {a['workers']} workers, sleeps of {sleeps} (the third can end at "
            f"~{a['sleeps_s'][1] + a['sleeps_s'][2]:g} s); B: {b['workers']} workers, one of {b['long_s']:g} s then "
            f"{b['shorts']} of {b['short_s']:g} s (the last short one can end at "
            f"~{-(-b['shorts'] // (b['workers'] - 1)) * b['short_s']:g} s)",
            *_table(["pool", "A: third ends", "A: second (3 s) ends", "B: last short ends", "B: long ends"], rows)]
    sched = res.get("scheduling")
    if sched:
        base = sched["variants"].get(OURS_FIFO, {}).get("rate") or float("nan")
        rows = [[name, f"{v['rate']:,.0f}", f"{v['rate'] / base:.2f}x", f"{v['rounds']} x {v['tasks_per_round']}"]
                for name, v in sched["variants"].items()]
        out += [f"6. scheduling: tiny tasks submitted back to back, then waited for; {sched['tenants']} tenants "
                f"(weights {sorted(set(sched['weights'].values()))}, max_wait on) x {sched['priorities']} "
                "priorities vs the same pool without options",
                *_table(["pool", "tasks/s", "vs FIFO", "rounds x tasks"], rows)]
    parked = res.get("parked")
    if parked:
        s = parked["late_s"]
        out += [f"7. a parked task's resume: Retry(after={parked['after_s']:g}), {parked['parked_at_once']} parked at "
                "a time; from the raise + after to the second attempt's start",
                *_table(["pool", "resumes", "p50 ms", "p99 ms", "max ms"],
                        [[OURS, s["n"], _ms(s, "p50"), _ms(s, "p99"), _ms(s, "max")]])]
    for part in ("tiny", "process_per_task", "cancel", "kill", "head_of_line", "scheduling", "parked"):
        for name, why in ((res.get(part) or {}).get("skipped") or {}).items():
            out.append(f"  not run ({part}): {name}: {why}")
    return out
