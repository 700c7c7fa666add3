"""The spawner process: a small process, started by exec, that forks the replicas (a zygote).

Started by the launcher (launcher.py, the daemon's side of it) as ``python -P -c "from
orchestrator.spawn.spawner import main; main()"`` (``-P``: never from the directory it starts
in; interpreter.py), with its socket on fd 3; titled ``orchestrator: spawner``. Of
``orchestrator`` it loads only the frames below, the forked child's set-up (childsetup.py,
with what that needs: spec, targets, worker; and watchdog.cgroup for its join) and what a
preload asks for; no part of the daemon's loop.

Why: ``fork()`` copies the page tables of whatever forks, so a launcher holding 1 GiB forks
far slower than a small one (benchmarks/README.md, launch cost against the launcher's
size), and forking a process that runs threads (an embedding
program) is the classic fork hazard. The daemon and the embedded API therefore fork
nothing themselves: they send each ``LaunchPlan`` to a spawner, a fresh, small interpreter
started with ``posix_spawn`` (which never copies the launcher's memory), and it
forks the worker. A pool with ``preload`` modules gets a spawner of its own that imported
them once, so its replicas start warm (gunicorn's ``preload_app``, CPython's
``set_forkserver_preload``); the daemon itself never imports them.

The replica is made with ``clone(CLONE_PARENT)``: its parent is the launcher, not the
spawner. So the launcher reaps it, gets its exact exit status and holds its pidfd exactly
as if it had forked it, its PR_SET_PDEATHSIG is tied to the launcher, and a spawner that
dies strands nothing: it has no children. Python's own fork bookkeeping runs around the
raw syscall (``PyOS_BeforeFork`` / ``PyOS_AfterFork_Child``), as ``os.fork()`` does.
In cgroup mode it is ``clone3(CLONE_PARENT | CLONE_INTO_CGROUP)`` where the kernel allows
it: born in its replica's cgroup, the child skips the migration that a write to
``cgroup.procs`` costs (~10 ms of an elastic pool's new worker: an RCU grace period); where
it does not (before 5.7, a filter), a plain clone and the child joins, as before.

The launcher sends each plan with its fds (ready pipe, captured stdout and stderr, the
pool's listening sockets) over a
socketpair, a turn's batch at once (pipelined: the spawner forks while the next plan is
sent), then reads the answers in order; the spawner clones, answers with the pid, and only
then lets the child go on, through a one-byte pipe. A spawner killed before it answered
never let its child run: the child says ``lost PID`` on its ready pipe and exits 127, and
the launcher reaps it. Nothing a user wrote ever runs untracked. While a spawner is down
(restarting with the shared backoff, or when clone is refused, e.g. by a seccomp filter)
the launcher forks the plan itself, as it did before spawners existed.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # pthread_sigmask without the enum conversion
import array
import ctypes
import dataclasses
import os
import pickle
import platform
import signal
import socket
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, TypedDict, final

from ..listenspec import MAX_SOCKETS
from ..prctl import set_pdeathsig
from .childsetup import ALL_SIGNALS, run_child

if TYPE_CHECKING:
    from ..spec import LaunchPlan

_HEADER = struct.Struct("!I")
_FD = array.array("i")
_MAX_FRAME = 256 << 20  # a pickled closure may be large; a corrupt length must not be
_CLONE_PARENT = 0x00008000
# The clone syscall's number where it is known; elsewhere (None) the launcher forks itself.
SYS_CLONE = {"x86_64": 56, "aarch64": 220, "ppc64le": 120, "s390x": 120, "riscv64": 220}.get(platform.machine())
# clone3 (Linux 5.3; CLONE_INTO_CGROUP 5.7): one number in every table above. A child born
# in its replica's cgroup skips the migration a write to cgroup.procs costs: the kernel
# takes the cgroup threadgroup lock for writing and waits out an RCU grace period, ~10 ms
# per start unless another migration came just before (benchmarks/bench_cgroup_join.py).
SYS_CLONE3 = 435 if SYS_CLONE is not None else None
_CLONE_INTO_CGROUP = 0x200000000
_CLONE3_UNSUPPORTED = (1, 7, 22, 38)  # EPERM (a filter), E2BIG, EINVAL, ENOSYS: never again


class _CloneArgs(ctypes.Structure):
    """struct clone_args, as far as CLONE_INTO_CGROUP (its version 2, 88 bytes)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls", "set_tid",
        "set_tid_size", "cgroup")]
_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


# -- what the launcher and a spawner say to each other ---------------------------------------


class Hello(TypedDict):
    """The launcher's first frame: where to import from, what to preload."""

    parent: int  # the launcher's pid: a spawner whose parent is another exits
    sys_path: list[str]
    preload: tuple[str, ...]
    pythonpath: tuple[str, ...]
    cwd: str | None


class Request(TypedDict):
    """One replica to make; its fds ride with the frame: the ready pipe's write end, then
    stdout and stderr if these say so, then the pool's listening sockets."""

    plan: LaunchPlan  # with no fds of its own in it
    stdout: bool
    stderr: bool
    pdeathsig: int | None
    nofile: tuple[int, int] | None


@final  # so that `"pid" in answer` tells the two apart
class Made(TypedDict):
    """A request's answer: the child, made (with its start time in ticks, if exact)."""

    pid: int
    start: int | None


@final
class NotMade(TypedDict):
    """A request's answer: no child. ``refused``: clone is not allowed here (EPERM, EINVAL,
    ENOSYS: a filter), the launcher forks from now on."""

    errno: int | None
    error: str
    refused: bool


Answer = Made | NotMade


# -- frames: a 4-byte length, then a pickle; fds ride on the first byte ---------------------

def send_frame(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_frame(sock: socket.socket, maxfds: int = 0) -> tuple[Any, list[int]] | None:
    """One frame and the fds that came with it; None at EOF."""
    if maxfds:
        # Close-on-exec, as every fd of ours: a ready pipe left open would outlive the exec.
        # (socket.recv_fds drops its flags argument in 3.11, hence recvmsg.)
        head, anc, flags, _ = sock.recvmsg(_HEADER.size, socket.CMSG_SPACE(maxfds * _FD.itemsize),
                                           socket.MSG_CMSG_CLOEXEC)
        received = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received.frombytes(data[: len(data) - len(data) % received.itemsize])
        fds = list(received)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise OSError("fds lost in transit (MSG_CTRUNC)")
    else:
        head, fds = sock.recv(_HEADER.size), []
    if not head:
        return None
    head = _read_exactly(sock, head, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    if size > _MAX_FRAME:
        raise OSError(f"frame of {size} bytes")
    return pickle.loads(_read_exactly(sock, b"", size)), fds


def _read_exactly(sock: socket.socket, have: bytes, size: int) -> bytes:
    chunks, n = [have], len(have)
    while n < size:
        chunk = sock.recv(min(size - n, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed mid-frame")
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def _clone_parent() -> Callable[[int | None], tuple[int, bool]]:
    """clone(CLONE_PARENT | SIGCHLD) with Python's fork bookkeeping around it, holding the
    GIL throughout (PyDLL), as os.fork() does; given a cgroup's directory fd, clone3 into
    that cgroup where the kernel allows it (else the child joins it itself, as before).
    Returns (0 in the child, else its pid; whether it was born in the cgroup)."""
    libc = ctypes.PyDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = (ctypes.c_long,) + (ctypes.c_ulong,) * 5
    api = ctypes.pythonapi
    flags = _CLONE_PARENT | int(signal.SIGCHLD)
    # No exit_signal: with CLONE_PARENT the child's is this process's own (SIGCHLD, to the
    # launcher), and clone3 refuses one (EINVAL).
    args = _CloneArgs(flags=_CLONE_PARENT | _CLONE_INTO_CGROUP)
    where = ctypes.addressof(args)
    usable = [SYS_CLONE3 is not None]

    def clone(cgroup_fd: int | None) -> tuple[int, bool]:
        api.PyOS_BeforeFork()
        inside = cgroup_fd is not None and usable[0]
        pid: int = -1
        if inside:
            args.cgroup = cgroup_fd
            pid = syscall(SYS_CLONE3, where, ctypes.sizeof(args), 0, 0, 0)
            if pid < 0:  # not here (an old kernel, a filter) or not into that cgroup: a clone
                inside = False
                if ctypes.get_errno() in _CLONE3_UNSUPPORTED:
                    usable[0] = False
        if not inside:
            pid = syscall(SYS_CLONE, flags, 0, 0, 0, 0)
        if pid == 0:
            api.PyOS_AfterFork_Child()
            return 0, inside
        err = ctypes.get_errno()
        api.PyOS_AfterFork_Parent()
        if pid < 0:
            raise OSError(err, os.strerror(err))
        return pid, inside

    return clone


def _cgroup_fd(path: str | None) -> int | None:
    """The replica's cgroup directory, for clone3 (None: none, or it cannot be opened: the
    child's join then says why)."""
    if path is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def _serve(sock: socket.socket, parent: int) -> None:
    clone = _clone_parent()
    maxfd = os.sysconf("SC_OPEN_MAX")
    while True:
        # ready pipe, stdout, stderr, then the pool's listening sockets
        got = recv_frame(sock, maxfds=3 + MAX_SOCKETS)
        if got is None:
            return  # the launcher closed our socket: it is stopping, or gone
        req: Request = got[0]
        fds = got[1]
        ready_w, rest = fds[0], fds[1:]
        plan = req["plan"]
        if req["stdout"]:
            plan = dataclasses.replace(plan, stdout=rest.pop(0))
        if req["stderr"]:
            plan = dataclasses.replace(plan, stderr=rest.pop(0))
        if rest:
            plan = dataclasses.replace(plan, listen_fds=tuple(rest))
        go_r, go_w = os.pipe()
        group = _cgroup_fd(plan.cgroup)
        old_mask = _signal.pthread_sigmask(signal.SIG_BLOCK, ALL_SIGNALS)
        before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        try:
            pid, inside = clone(group)
        except OSError as err:
            _signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            refused = err.errno in (1, 22, 38)  # EPERM, EINVAL, ENOSYS: a filter, not a shortage
            reply: Answer = {"errno": err.errno, "error": err.strerror or str(err), "refused": refused}
        else:
            if pid == 0:  # pragma: no cover - the child: never returns
                os.close(go_w)
                if group is not None:
                    os.close(group)  # a Python target never execs: no fd of ours left in it
                if inside:  # born in its cgroup: nothing to join
                    plan = dataclasses.replace(plan, cgroup=None)
                run_child(plan, ready_w, parent, req["pdeathsig"], maxfd, req["nofile"], go_fd=go_r)
            after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
            _signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            tick = before // _TICK_NS
            reply = {"pid": pid, "start": tick if after // _TICK_NS == tick else None}
        os.close(go_r)
        if group is not None:
            os.close(group)
        for fd in fds:
            os.close(fd)
        try:
            send_frame(sock, reply)
        except OSError:
            os.close(go_w)  # the launcher is gone: the child never runs
            return
        if "pid" in reply:
            try:
                os.write(go_w, b"g")  # the launcher has its pid: now it may run
            except BrokenPipeError:
                # The launcher killed it already (its replica was ended as it started):
                # nobody is left to let go, and we serve on.
                pass
        os.close(go_w)


def main() -> None:
    os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # whatever else the launcher let us inherit
    sock = socket.socket(fileno=3)
    try:
        got = recv_frame(sock)
    except (OSError, EOFError):
        got = None
    if got is None:
        os._exit(0)
    hello: Hello = got[0]
    from setproctitle import getproctitle, setproctitle

    set_pdeathsig(signal.SIGKILL)  # never outlive the launcher...
    if os.getppid() != hello["parent"]:
        os._exit(0)  # ...which may have died before that was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    getproctitle()  # set up once here, not in every forked worker
    preload = tuple(hello["preload"])
    setproctitle("orchestrator: spawner" + (f" [preload {','.join(preload)}]" if preload else ""))
    sys.path[:] = hello["sys_path"]
    try:
        import dill  # noqa: F401  (every worker of a pickled callable needs it: loaded once here)

        if preload:
            import importlib

            from ..targets import load_preload

            # A program of ours (an executor pool's orchestrator.taskworker) is imported
            # before the pool's PYTHONPATH and cwd go first on the path: what it imports is
            # the standard library's and ours, not a same-named module in the pool's cwd.
            for name in preload:
                if name.partition(".")[0] == "orchestrator":
                    importlib.import_module(name)
            load_preload(preload, tuple(hello["pythonpath"]), hello["cwd"])
            collapse_to_huge_pages()
    except BaseException as err:  # a user's import: whatever it raises is its error
        _say(sock, {"error": f"cannot preload: {type(err).__name__}: {err}".replace("\n", " ")[:1000]})
        os._exit(1)
    if _say(sock, {"ready": True}):
        try:
            _serve(sock, hello["parent"])
        except (OSError, EOFError):
            pass  # the launcher went away mid-frame
    os._exit(0)


_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE = 2 << 20


def collapse_to_huge_pages() -> int:
    """After a preload: this process's anonymous memory in 2 MiB pages where the kernel
    can (MADV_COLLAPSE, Linux 6.1+), so that each fork copies a page table entry per 2 MiB
    instead of one per 4 KiB: a fork from a spawner holding 200 MB is many times faster
    once collapsed (benchmarks/README.md, its 200 MB preload row; the copy-on-write after
    the fork still goes by 4 KiB: the kernel splits a huge page a child writes to). Best effort: an older kernel, THP off, or no
    memory for huge pages leaves the 4 KiB pages as they were. Returns the bytes collapsed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return 0
    done = 0
    for line in lines:
        fields = line.split()
        # anonymous (no path, or the heap), private and writable: where the preload's objects are
        if len(fields) < 5 or fields[1][:2] != "rw" or fields[1][3] != "p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo, hi = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if hi - lo < _HUGE:
            continue
        if madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 and madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def _say(sock: socket.socket, msg: dict[str, Any]) -> bool:
    """After the hello: ``{"ready": True}``, or ``{"error": why}`` (a preload failed)."""
    try:
        send_frame(sock, msg)
        return True
    except OSError:  # the launcher is gone already: nothing to say it to
        return False


if __name__ == "__main__":
    main()
