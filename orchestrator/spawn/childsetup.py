"""What a forked child does before it runs a replica's command or Python target.

``run_child`` runs in the new replica, between the fork (``osapi.OSApi`` forking in the
daemon, or the spawner process's clone, spawner.py) and the exec or the target. The
processes that fork import this module beforehand, so that ``prctl`` (``orchestrator/prctl.py``,
which the manager and a task worker use without this module) is resolved once there, not
in every child.

What the child does before it runs anything of the user's, in this order and why:
  * its own process group (a terminate that comes before the child has set it reaches
    the child alone, see OSApi.signal_group, and the child has forked nothing yet);
  * in cgroup mode, its replica's cgroup (``LaunchPlan.cgroup``): one write of its pid to
    ``cgroup.procs``, so that everything it will ever fork is born inside (the kernel's
    migration, paid by the child; what cgroups cost the churn: benchmarks/bench_containment.py);
    a child a spawner made with clone3 straight into its cgroup gets no ``cgroup`` here;
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
  * its captured stdout/stderr (``LaunchPlan.stdout/stderr``) on 1 and 2; its pool's
    listening sockets (``LaunchPlan.listen_fds``) on 3, 4, ..., inheritable, with
    ``LISTEN_PID`` set to its own pid, as systemd's socket activation passes them; then
    every other inherited fd above those closed, so no worker holds the daemon's pipes,
    locks or sockets (a held write end would hide the daemon's death from whoever waits
    for EOF);
  * its working directory (``LaunchPlan.cwd``: the launching caller's by default);
  * for a command: execve, with the ready pipe close-on-exec, so EOF means "exec
    succeeded"; for a callable: title set, ready pipe closed, then the SIGTERM handler
    that raises ``orchestrator.Terminated`` (worker.py), the callable run, exit.
A failure before that point writes one line to the ready pipe and exits 127: the engine
turns it into FAILED("could not start: ...").
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # pthread_sigmask without the enum conversion: ~3 µs against ~60 µs a call
import fcntl
import os
import resource
import signal
import sys
import traceback
from typing import Any, Callable

from setproctitle import setproctitle

from watchdog.cgroup import join as join_cgroup

from ..prctl import set_pdeathsig
from ..spec import LaunchPlan
from ..targets import TargetRef, load_preload, load_target
from ..worker import Terminated, exit_as_killed, install_sigterm_handler

# Signals whose disposition the orchestrator (or an embedding program) may have changed
# and a worker must not inherit.
_RESET_SIGNALS = tuple(
    int(s)
    for s in (
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD,
        signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPIPE, signal.SIGXFSZ,
    )
)
ALL_SIGNALS = signal.valid_signals()  # what a forking parent blocks across the fork
# Python ignores these at start-up; a Python worker keeps that, a command must not.
_PYTHON_IGNORED = (int(signal.SIGPIPE), int(signal.SIGXFSZ))
_OOM_SCORE_ADJ_PATH = "/proc/self/oom_score_adj"
# Replicas first: the kernel's OOM killer takes one before the daemon or its watchdog.
# Raising needs no privilege (lowering would); a sandbox may still refuse it (EACCES).
WORKER_OOM_SCORE_ADJ = 500  # of -1000..1000: a replica is the likelier pick, not a certain one


def worker_oom_score_adj() -> bytes:
    """What a replica writes to its ``/proc/self/oom_score_adj``: 500, or the calling
    process's own value if that is higher already, so that a replica is never made a less
    likely pick than its parent (lowering would also need privilege). Read once, in the
    parent: the child then does a single open/write/close."""
    own = 0
    try:
        with open("/proc/self/oom_score_adj", "rb") as f:
            own = int(f.read())
    except (OSError, ValueError):
        pass
    return b"%d" % max(WORKER_OOM_SCORE_ADJ, own)



_OOM_SCORE_ADJ = worker_oom_score_adj()  # 500, or the parent's if higher: only a raise


def run_child(
    plan: LaunchPlan,
    ready_w: int,
    parent: int,
    pdeathsig: int | None,
    maxfd: int,
    nofile: tuple[int, int] | None = None,
    go_fd: int | None = None,
) -> None:  # pragma: no cover - exercised through real processes only
    """Set the child up for ``plan`` and run it: exec a command, or run a Python target and
    exit with its code. Never returns. ``ready_w``: the ready pipe (one line of text if it
    could not start); ``parent``: the pid that must be our parent (else the parent died
    before PR_SET_PDEATHSIG was armed); ``go_fd``: a spawner's go-ahead pipe."""
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
        first = 3
        if plan.listen_fds:
            ready_w = _place_listen_fds(plan.listen_fds, ready_w)
            first += len(plan.listen_fds)
            plan.env["LISTEN_PID"] = str(os.getpid())  # a command's whole env, or a target's additions
        os.closerange(first, ready_w)
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


def _place_listen_fds(fds: tuple[int, ...], ready_w: int) -> int:  # pragma: no cover - in the child
    """Put ``fds`` on 3, 4, ... without close-on-exec (sd_listen_fds(3)); returns where the
    ready pipe is now. Everything involved is first moved above that range: the ready pipe
    (it may be fd 3 itself) and the sockets (one may sit on another's target number), so no
    dup2 overwrites an fd still to be placed. The copies left behind are closed with the
    rest by the caller."""
    top = 3 + len(fds)
    ready_w = fcntl.fcntl(ready_w, fcntl.F_DUPFD_CLOEXEC, top)  # still close-on-exec: EOF means exec'd
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) for fd in fds]
    for i, fd in enumerate(moved):
        os.dup2(fd, 3 + i)  # inheritable: the replica keeps it across its exec
    return ready_w


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


def unpickle_target(data: bytes) -> Callable[[], Any]:
    """Runs in the worker: only the worker ever unpickles a user's callable."""
    import dill

    target: Callable[[], Any] = dill.loads(data)  # dill has no types: what was pickled was one
    return target
