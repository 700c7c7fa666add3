"""The peers the orchestrator is compared with, each measured the way it actually works.

* ``ProcessPoolExecutor`` (fork context) and loky: "a dead worker replaced and usable
  again". A worker is SIGKILLed; the clock runs until the pool has run a task again. Neither
  replaces one dead worker in place: the stdlib executor turns into BrokenProcessPool, so
  its replacement is a new executor (all of its workers forked again); loky marks its
  executor broken too (TerminatedWorkerError) and ``get_reusable_executor`` builds a new one.
  That whole path is what a user of those pools pays, so it is what is timed.
* supervisord: a batch of programs (``numprocs``) stopped and started again over its own
  XML-RPC Unix socket, through ``benchmarks/bench_restart.py``'s driver (which runs it in a
  temp dir and stops it by its own pid).

Packages a peer needs are installed into the running interpreter's environment with pip,
unless the caller forbids it (then the peer is skipped, with the reason).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

pc = time.perf_counter


class Unavailable(Exception):
    """A peer that cannot run here; the message says why."""


def ensure_package(module: str, package: str, *, install: bool, say: Callable[[str], None]) -> Any:
    """Import ``module``; if missing and ``install``, pip-install ``package`` into this
    interpreter's environment first (the benchmark's own venv, never the system's)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if not install:
            raise Unavailable(f"{package} is not installed (installing was not allowed)") from None
    say(f"installing {package} into {sys.prefix} (pip)")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", package],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise Unavailable(f"pip install {package} failed: {done.stderr.strip().splitlines()[-1:]}")
    importlib.invalidate_caches()
    return importlib.import_module(module)


def _pid(_: object = None) -> int:
    return os.getpid()


def _warm(executor: Any, workers: int) -> None:
    """Run enough tasks that every worker exists (loky starts them lazily)."""
    list(executor.map(_pid, range(workers * 4)))


class PoolReplacement:
    """Kill one worker of a pool of ``workers``, time until a task runs again."""

    def __init__(self, kind: str, workers: int, *, install: bool, say: Callable[[str], None]) -> None:
        self.kind = kind
        self.workers = workers
        self.executor: Any = None
        if kind == "loky":
            loky = ensure_package("loky", "loky", install=install, say=say)
            self._loky = loky
            self._broken: tuple[type[BaseException], ...] = (loky.process_executor.TerminatedWorkerError,
                                                             BrokenProcessPool)
        else:
            import multiprocessing

            self._ctx = multiprocessing.get_context("fork")
            self._broken = (BrokenProcessPool,)
        self.executor = self._new()
        _warm(self.executor, workers)

    def _new(self) -> Any:
        if self.kind == "loky":
            return self._loky.get_reusable_executor(max_workers=self.workers, timeout=3600, reuse=True)
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=self._ctx)

    def _is_broken(self) -> bool:
        if self.kind == "loky":
            return bool(self.executor._flags.broken)
        return bool(self.executor._broken)

    def once(self) -> float:
        """Seconds from SIGKILL of one worker until the pool is back at its size and has run
        a task on every worker: the executor noticed the death (its manager thread marks it
        broken), was replaced by a new one, and that one's workers answered. Waiting for the
        broken mark first keeps a task that a surviving worker answers in the moment before
        the pool breaks from counting as "usable again"."""
        victim = next(iter(self.executor._processes))  # pid -> Process in both executors
        t0 = pc()
        os.kill(victim, signal.SIGKILL)
        deadline = t0 + 60
        while not self._is_broken():
            if pc() > deadline:
                raise RuntimeError(f"{self.kind}: the pool did not notice the dead worker within 60 s")
            time.sleep(0.0002)
        while True:
            try:
                if self.kind != "loky":
                    self.executor.shutdown(wait=True)
                self.executor = self._new()
                pids = set(self.executor.map(_pid, range(self.workers * 4), timeout=30))
                if victim not in pids:
                    return pc() - t0
            except self._broken:
                pass
            if pc() > deadline:
                raise RuntimeError(f"{self.kind}: no task ran within 60 s of the kill")

    def close(self) -> None:
        if self.executor is not None:
            if self.kind == "loky":
                self.executor.shutdown(wait=True, kill_workers=True)
            else:
                self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None


class SupervisordBatch:
    """supervisord with one program of ``n`` processes (``sleep 1000``, ``startsecs=0``: its
    fastest setting), stopped and started as a group over XML-RPC."""

    GROUP = "batch"

    def __init__(self, tmp: Path, n: int, *, install: bool, say: Callable[[str], None]) -> None:
        from benchmarks.bench_restart import Supervisord

        ensure_package("supervisor", "supervisor", install=install, say=say)
        self.n = n
        self.sup = Supervisord(tmp, extra=f"""
            [program:{self.GROUP}]
            command=sleep 1000
            process_name=%(program_name)s_%(process_num)02d
            numprocs={n}
            autostart=false
            autorestart=false
            startsecs=0
            stopsignal=TERM
            stdout_logfile=NONE
            stderr_logfile=NONE
        """)

    @property
    def pid(self) -> int:
        return self.sup.proc.pid

    def _running(self) -> list[int]:
        infos = self.sup.rpc.supervisor.getAllProcessInfo()
        return [i["pid"] for i in infos if i["group"] == self.GROUP and i["state"] == 20]

    @staticmethod
    def _execd(pid: int) -> bool:
        """The child has become ``sleep`` (supervisord says RUNNING right after its fork)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().split(b"\0")[0].endswith(b"sleep")
        except OSError:
            return False

    def cycle(self) -> tuple[float, float]:
        """(start → all RUNNING and exec'd, stop → all stopped) seconds for the batch.

        With ``startsecs=0`` supervisord reports RUNNING as soon as it has forked, before the
        child execs; a SIGTERM in that window reaches the child's inherited Python handler and
        is lost at exec, so the stop waits out ``stopwaitsecs`` (10 s) and SIGKILLs. Waiting
        for the exec is what "running" means for the orchestrator too (its ready pipe closes
        on exec), and keeps that race out of the figure."""
        rpc = self.sup.rpc.supervisor
        t0 = pc()
        rpc.startProcessGroup(self.GROUP, True)
        pids = self._running()
        if len(pids) != self.n:
            raise RuntimeError(f"supervisord: {len(pids)} of {self.n} RUNNING after startProcessGroup")
        deadline = t0 + 30
        while not all(self._execd(pid) for pid in pids):
            if pc() > deadline:
                raise RuntimeError("supervisord: its programs did not exec within 30 s")
            time.sleep(0.0005)
        t1 = pc()
        rpc.stopProcessGroup(self.GROUP, True)
        t2 = pc()
        return t1 - t0, t2 - t1

    def crash_round(self, name: str) -> float:
        return self.sup.round(name)

    def close(self) -> None:
        self.sup.close()
