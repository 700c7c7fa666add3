"""How a process is made, signalled and reaped: the OS seam under the engine.

Every signal ``orchestrator`` sends to a process goes through this module: ``OSApi`` for
the loop's own children (replicas, the manager, the watchdog, adopted orphans), whose
unreaped zombies pin their pids; ``OSApi.sweep`` (the watchdog's identity-checked ladder)
for processes that are not our children, such as a dead daemon's leftovers; and
``signal_pidfd`` for a daemon that ``orchestrator stop`` found through its lock.

Start method: the child is made by a spawner process (``zygote.py``) with
``clone(CLONE_PARENT)``, so it is our child all the same, and ``OSApi.spawn`` watches it as
such; while no spawner is ready, by a plain ``os.fork()`` from the control loop's thread
(the daemon is single-threaded by construction: the Manager server and its threads live in
their own process). Either way the child then runs ``_child`` below: ``execve`` for a
command, the callable for a Python target. Fork is the only start method fast enough here
(``benchmarks/bench_churn.py --forkserver``: multiprocess's forkserver ~35/s against ~600/s;
3.11's forkserver re-runs ``__main__`` in every child, gh-98552).

What the child does before it runs anything of the user's, in this order and why:
  * its own process group (a terminate that comes before the child has set it reaches
    the child alone, see OSApi.signal_group, and the child has forked nothing yet);
  * in cgroup mode, its replica's cgroup (``LaunchPlan.cgroup``): one write of its pid to
    ``cgroup.procs``, so that everything it will ever fork is born inside (~110 µs here,
    the kernel's migration; see benchmarks/bench_containment.py);
  * PR_SET_PDEATHSIG, then a getppid() check against the pid recorded before fork: the
    third layer against orphans, and the check closes the race where the parent died before
    the signal was armed;
  * a raised oom_score_adj (the OOM killer takes a replica before the daemon or its
    watchdog), one open/write/close;
  * signal handlers back to their defaults and an empty signal mask. The parent blocks
    every signal across fork, so a SIGTERM sent right after fork stays pending until the
    child has dropped the parent's Python handler, and then kills it as it should;
  * from a spawner: a wait for its go-ahead (one byte, written once it has told us the pid;
    EOF instead means it died first: say ``lost PID`` and exit, running nothing);
  * its captured stdout/stderr (``LaunchPlan.stdout/stderr``) on 1 and 2, then every
    other inherited fd above 2 closed, so no worker holds the daemon's pipes, locks or
    sockets (a held write end would hide the daemon's death from whoever waits for EOF);
  * its working directory (``LaunchPlan.cwd``: the launching caller's by default);
  * for a command: execve, with the ready pipe close-on-exec, so EOF means "exec
    succeeded"; for a callable: title set, ready pipe closed, then the SIGTERM handler
    that raises ``orchestrator.Terminated`` (worker.py), the callable run, exit.
A failure before that point writes one line to the ready pipe and exits 127: the engine
turns it into FAILED("could not start: ...").
"""

from __future__ import annotations

import _signal  # pthread_sigmask without the enum conversion: ~3 µs against ~60 µs a call
import ctypes
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from setproctitle import setproctitle

from watchdog.cgroup import join as join_cgroup
from watchdog.identity import open_verified, proc_stat, start_time
from watchdog.ledger import Entry
from watchdog.reaper import sweep

from .errors import SpawnerLost
from .oom import worker_oom_score_adj
from .states import exit_reason  # noqa: F401  (moved to states; its importers still find it here)
from .targets import TargetRef, load_preload, load_target
from .worker import Terminated, exit_as_killed, install_sigterm_handler

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)
# Resolved once here: a forked child that looked the symbol up itself paid ~150 µs for it.
_prctl = _libc.prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int

# Signals whose disposition the orchestrator (or an embedding program) may have changed
# and a worker must not inherit.
_RESET_SIGNALS = tuple(
    int(s)
    for s in (
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD,
        signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPIPE, signal.SIGXFSZ,
    )
)
_ALL_SIGNALS = signal.valid_signals()
# Python ignores these at start-up; a Python worker keeps that, a command must not.
_PYTHON_IGNORED = (int(signal.SIGPIPE), int(signal.SIGXFSZ))
_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
_OOM_SCORE_ADJ_PATH = "/proc/self/oom_score_adj"
# Replicas first: the kernel's OOM killer takes one before the daemon or its watchdog.
# Raising needs no privilege (lowering would); a sandbox may still refuse it (EACCES).
_OOM_SCORE_ADJ = worker_oom_score_adj()  # 500, or the parent's if higher: only a raise


def set_pdeathsig(sig: int) -> None:
    if _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_child_subreaper() -> None:
    """Orphaned descendants are re-parented to us, and we reap them (PID 1 may not)."""
    if _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def raise_fd_limit() -> tuple[int, int] | None:
    """A daemon holds one pidfd per live replica: lift the soft fd limit to the hard one.
    Returns the original limits, which workers get back (spawn(..., nofile=...))."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft >= want:
        return None
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return soft, hard


@dataclass(frozen=True, slots=True, eq=False)
class LaunchPlan:
    """Everything one worker process is made from: a command (``argv`` + ``exe``, its whole
    environment in ``env``) or a Python ``run`` (a callable, or pickled bytes that only the
    child loads; ``env`` then holds additions to the forking process's environment)."""

    replica_id: str
    argv: tuple[str, ...] | None = None
    exe: str | None = None
    run: Callable[[], Any] | bytes | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdout: int | None = None  # fds put on 1 and 2 in the child; None: inherited
    stderr: int | None = None
    cgroup: str | None = None  # the replica's cgroup dir, joined first thing in the child
    preload: tuple[str, ...] = ()  # imported before the target (at once if the spawner has them)
    pythonpath: tuple[str, ...] = ()  # the launching caller's, for the preload modules


@dataclass(slots=True)
class Begun:
    """A worker asked of a spawner (OSApi.begin), not yet known (OSApi.end)."""

    plan: LaunchPlan
    via: Any
    ready_r: int
    seq: int | None  # None: the spawner was lost before the request went out


@dataclass(slots=True)
class Spawned:
    pid: int
    exit_fd: int  # readable when the process has exited (a pidfd)
    ready_fd: int  # EOF when the worker runs; one line of text if it could not start
    start_time: int | None


class OSApi:
    """The real OS. Tests of the state machine substitute a fake with the same methods."""

    def __init__(self, *, pdeathsig: int | None = signal.SIGKILL,
                 nofile: tuple[int, int] | None = None) -> None:
        self.pdeathsig = pdeathsig
        self.nofile = nofile  # the fd limit workers get, if ours was raised
        self.maxfd = os.sysconf("SC_OPEN_MAX")  # after any raise: every fd we may hold is below

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    def spawn(self, plan: LaunchPlan, via: Any = None) -> Spawned:
        """Make one worker from ``plan``: through the spawner ``via`` (zygote.Spawner) if
        given, else by forking here. Raises OSError when no child could be made."""
        return self.end(self.begin(plan, via)) if via is not None else self._fork(plan, *os.pipe())

    def begin(self, plan: LaunchPlan, via: Any) -> "Begun":
        """Ask the spawner ``via`` for a worker; ``end()`` gets it. Begin a batch, then end
        it, in the same order."""
        ready_r, ready_w = os.pipe()
        try:
            seq = via.begin(plan, ready_w, self.pdeathsig, self.nofile)
        except SpawnerLost:
            seq = None
        finally:
            os.close(ready_w)
        return Begun(plan, via, ready_r, seq)

    def end(self, begun: "Begun") -> Spawned:
        """The worker ``begin()`` asked for: from its spawner, or, if that was lost, forked
        here (any child it had made is reaped first). Raises OSError (no child made)."""
        via, ready_r = begun.via, begun.ready_r
        try:
            if begun.seq is not None:
                pid, start = via.end(begun.seq)
                return self._watch(pid, ready_r, start)
        except SpawnerLost:
            pass
        except OSError:
            os.close(ready_r)
            raise
        via.reap_lost(ready_r)
        os.close(ready_r)
        return self._fork(begun.plan, *os.pipe())

    def _fork(self, plan: LaunchPlan, ready_r: int, ready_w: int) -> Spawned:
        parent = os.getpid()
        old_mask = _signal.pthread_sigmask(signal.SIG_BLOCK, _ALL_SIGNALS)
        before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        try:
            pid = os.fork()
        except OSError:  # EAGAIN, ENOMEM: no child; the caller records FAILED
            _signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            os.close(ready_r)
            os.close(ready_w)
            raise
        if pid == 0:  # pragma: no cover - runs in the child, never returns
            _child(plan, ready_w, parent, self.pdeathsig, self.maxfd, self.nofile)
        after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        _signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(ready_w)
        # The kernel's start time is the fork's CLOCK_BOOTTIME in clock ticks (10 ms). When
        # the fork fell inside one tick it is known exactly without reading /proc, whose
        # first lookup of a new pid costs ~100-200 µs here; otherwise (~2%) read it.
        tick = before // _TICK_NS
        return self._watch(pid, ready_r, tick if after // _TICK_NS == tick else None)

    def _watch(self, pid: int, ready_r: int, start: int | None) -> Spawned:
        try:
            exit_fd = os.pidfd_open(pid)
        except OSError:  # EMFILE: we could not watch it, so it must not run untracked
            os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is pinned
            os.waitpid(pid, 0)
            os.close(ready_r)
            raise
        return Spawned(pid, exit_fd, ready_r, start if start is not None else start_time(pid))

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Signal the group led by one of OUR unreaped children: the child (a zombie at
        worst) pins the number, so it cannot have been reused. A child that has not run
        its setpgid yet has no group: it alone gets the signal, which stays blocked until
        it has dropped our handlers, so nothing is lost. False if nothing was there."""
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            try:
                os.kill(pgid, sig)
            except ProcessLookupError:
                return False
        return True

    def escaped_descendants(self, pid: int) -> list[tuple[int, int]]:
        """(pid, start time) of the descendants of our child ``pid`` that have left its
        process group (GNU timeout, a shell's job control, setsid), found by walking the
        kernel's child lists down from it: a group signal would miss them, and once ``pid``
        dies they are re-parented and their ancestry is gone. Costs one read per process
        of the tree, nothing for a worker without children."""
        found: list[tuple[int, int]] = []
        stack = [pid]
        seen = {pid}
        while stack:
            for child in _children(stack.pop()):
                st = proc_stat(child)
                if st is None or child in seen:
                    continue
                seen.add(child)
                if st.pgrp != pid:
                    found.append((child, st.start_time))
                stack.append(child)
        return found

    def signal_verified(self, ident: tuple[int, int], sig: int) -> bool:
        """Signal the process ``(pid, start time)`` if it is still that process."""
        fd = open_verified(*ident)
        if fd is None:
            return False
        try:
            return signal_pidfd(fd, sig)
        finally:
            os.close(fd)

    def kill_child(self, pid: int, sig: int) -> bool:
        """Signal one of OUR unreaped children (a system child: manager, watchdog)."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def pidfd(self, pid: int) -> int:
        """A pidfd of our child: readable once it has exited."""
        return os.pidfd_open(pid)

    def exited_child(self) -> int | None:
        """The pid of a child that has exited and is not reaped yet, without reaping it
        (so that its owner still reaps it, while its zombie pins the pid); None if none."""
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        return info.si_pid if info is not None and info.si_pid else None

    def sweep(self, entries: Iterable[Entry], *, grace: float, exclude: Iterable[int] = ()) -> dict:
        """TERM, ``grace``, KILL for processes that are not our children, and for their
        groups and descendants: every signal through a pidfd verified against the recorded
        start time (the watchdog's ladder), so a reused pid is never hit."""
        return sweep(list(entries), None, exclude={os.getpid(), *exclude}, grace=grace)

    def reap(self, pid: int) -> int | None:
        """Exit code (negative: signal) of an exited child; None if someone else reaped it."""
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if wpid == 0:  # cannot last: we are only called once its pidfd (or waitid) said it exited
            wpid, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    def read_ready(self, fd: int) -> bytes:
        try:
            return os.read(fd, 4096)
        except BlockingIOError:  # pragma: no cover - only readable fds are read
            return b""

    def close(self, fd: int) -> None:
        os.close(fd)


def _child(
    plan: LaunchPlan,
    ready_w: int,
    parent: int,
    pdeathsig: int | None,
    maxfd: int,
    nofile: tuple[int, int] | None = None,
    go_fd: int | None = None,
) -> None:  # pragma: no cover - exercised through real processes only
    code = 127
    try:
        os.setpgid(0, 0)
        if plan.cgroup is not None:
            # Before anything that could fork or run the user's code: every descendant is
            # born inside. One open/write/close; a refusal is this replica's start failure.
            try:
                join_cgroup(plan.cgroup)
            except OSError as err:
                os.write(ready_w, f"cannot join cgroup {plan.cgroup}: {err.strerror or err}".encode("utf-8", "replace"))
                os._exit(127)
        if pdeathsig:
            set_pdeathsig(pdeathsig)
            if os.getppid() != parent:
                os._exit(128 + int(pdeathsig))  # the parent died before the signal was armed
        try:  # one open/write/close (~3 µs): inherited by whatever the replica runs
            fd = os.open(_OOM_SCORE_ADJ_PATH, os.O_WRONLY)
            try:
                os.write(fd, _OOM_SCORE_ADJ)
            finally:
                os.close(fd)
        except OSError:
            pass
        _signal.set_wakeup_fd(-1)
        # _signal, not signal: the wrappers turn every old handler into an enum, ~20x slower
        for sig in _RESET_SIGNALS:
            _signal.signal(sig, _signal.SIG_DFL)
        if plan.run is not None:
            _signal.signal(_signal.SIGINT, _signal.default_int_handler)
            for sig in _PYTHON_IGNORED:
                _signal.signal(sig, _signal.SIG_IGN)
        if go_fd is not None and os.read(go_fd, 1) != b"g":
            # From a spawner that died before it told our parent our pid: run nothing.
            os.write(ready_w, f"lost {os.getpid()}: the spawner died before this worker could run".encode())
            os._exit(127)
        if plan.stdout is not None:
            os.dup2(plan.stdout, 1)
        if plan.stderr is not None:
            os.dup2(plan.stderr, 2)
        os.closerange(3, ready_w)
        os.closerange(ready_w + 1, maxfd)
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        if plan.cwd is not None:
            os.chdir(plan.cwd)
        # SIGTERM is at its default here: one that came after fork (pending until now) or
        # during the rest of our set-up (unpickling the target, the title) kills the worker
        # as it should, with nothing of ours in between to swallow an exception. The
        # Terminated handler is installed by _run_python right before the target runs.
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        if plan.argv is not None:
            os.execve(plan.exe, plan.argv, plan.env)  # type: ignore[arg-type]
        os.environ.update(plan.env)
        if plan.preload:  # imported already where a preload spawner made us
            load_preload(plan.preload, plan.pythonpath, plan.cwd)
        run = plan.run
        if isinstance(run, bytes):
            run = unpickle_target(run)
        elif isinstance(run, TargetRef):
            run = load_target(run, plan.cwd)  # a bad target: "could not start: ..." like an exec failure
        setproctitle(f"orchestrator: replica {plan.replica_id}")
        os.close(ready_w)
        ready_w = -1
        code = _run_python(run)  # type: ignore[arg-type]
    except Terminated as term:  # SIGTERM during our setup, or late (in _run_python's own handlers)
        exit_as_killed(term.signum)
    except BaseException as err:
        if ready_w >= 0:
            msg = f"{type(err).__name__}: {err}".replace("\n", " ")[:1000]
            try:
                os.write(ready_w, msg.encode("utf-8", "replace"))
            except OSError:
                pass
        else:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run_python(run: Callable[[], Any]) -> int:
    """Run a Python target; its exit code as a process would have it. An uncaught
    Terminated (SIGTERM) does not return: the worker dies of the signal."""
    try:
        install_sigterm_handler()  # from here on SIGTERM raises Terminated in the target
        run()
    except Terminated as term:
        exit_as_killed(term.signum)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code & 0xFF
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc/PID/task/*/children (any of its threads may
    have forked them)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def signal_pidfd(pidfd: int, sig: int) -> bool:
    """Signal the process behind ``pidfd`` (pid reuse cannot redirect it); False if gone."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False
    return True


def unpickle_target(data: bytes) -> Callable[[], Any]:
    """Runs in the worker: only the worker ever unpickles a user's callable."""
    import dill

    return dill.loads(data)
