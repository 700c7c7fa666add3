"""An ``Executor``'s worker: the Python target of every replica of an executor pool.

It connects to the control loop's task listener (taskwire.py has the frames), runs the
pool's initializer once, then runs the tasks the loop sends, one at a time, in its main
thread, and answers each with its result, its exception (with the remote traceback's
text) or a line saying why neither could be pickled. It exits 0 after ``max_tasks`` tasks
(``max_tasks_per_child``; the pool replaces it) or when the loop closes the socket.

Cancel, timeout and shutdown: ``CANCEL_SIGNAL``'s handler raises :class:`orchestrator.Cancelled`
(:class:`orchestrator.TaskTimeout`, :class:`orchestrator.Terminated` for the executor's
shutdown) only if the cancel word names the task running now, so a signal that arrives after
its task has ended does nothing. The same signal asks for the task this worker holds but may
not have started (another worker is idle): the handler gives it back, or says it started
(taskwire.py, "Taking a held task back"). SIGTERM stays what it is in every Python worker:
:class:`orchestrator.Terminated`, and the worker ends.

Per-task logs (the loop asks for them in CONFIG): the worker makes a second stdout and
stderr pipe pair and sends their read ends (PIPES); each task runs with its cancel word's
slot's pair on fds 1 and 2 (slot 0: the replica's own), so the loop knows whose bytes each
pipe carries (taskwire.py, "Per-task logs"). Two dup2 calls per task, nothing else.

A task's leftovers: the worker is its descendants' subreaper, so every process a task
started, however it daemonized, stays below it; when a task ends, those still alive get
SIGTERM, then SIGKILL after the pool's grace, before the answer goes out and the next task
starts.

What each task took (wall time, CPU time with its children's, its own peak RSS): measured
around it (taskmeter.py) and sent as a FIGURES frame in the same write as its answer.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the module signal wraps, lighter to import
import json
import mmap
import os
import select
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, TypeAlias

from . import signals
from . import taskwire as w
from .prctl import set_child_subreaper
from .taskmeter import Meter
from .worker import Cancelled, Retry, TaskTimeout, Terminated

_BLOCK = {w.CANCEL_SIGNAL}
_current = 0  # the number of the task running now; 0 between tasks
_slot = 0  # the cancel word of the task that runs (or ran last)
_next = 0  # the cancel word of the next task this worker starts
_skips = 0  # TASK frames given back by the handler, not read yet (they come next)
_answered = 0  # the latest ask (taskwire.revoke_word) answered
_word: Any = None  # memoryview of the cancel words, shared with the loop
_sock: socket.socket | None = None
_ours: BaseException | None = None  # the exception the handler raised in the task that runs
_grace = 5.0
_own: set[int] = set()  # processes the initializer started: the worker's, not a task's
_starting = False  # a task's start is being made: the handler only notes that it came...
_deferred = False  # ...here, and the start handles it once made
_pipes: list[tuple[int, int]] = []  # per slot, the (stdout, stderr) a task writes to; [] without task logs
_on_slot = 0  # the slot whose pair is on fds 1 and 2 now


def _interrupt(signum: int, frame: object) -> None:
    """CANCEL_SIGNAL: what the loop wrote in the cancel words. Only between the start and
    the end of a task (``_current``), where the main thread is in no write of the socket."""
    global _deferred
    if _starting:
        _deferred = True  # a task is being started: handled where its start ends (_run)
        return
    number = _current
    if not number:
        return  # between tasks: the next start looks at the words itself
    # Blocked while it reads and answers: a second signal would run this again in the
    # middle (Python handlers nest) and answer one ask twice.
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _BLOCK)
    try:
        _look(number)
    finally:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _BLOCK)


def _look(number: int) -> None:
    global _answered, _skips, _ours
    ask = w.asked(_word[_slot ^ 1])
    if ask > _answered:  # the task held behind this one: not started, so never here
        _answered = ask
        _skips += 1
        _send(w.frame(w.STOPPED, ask, bytes([w.REVOKE])))
    word = _word[_slot]
    ask = w.asked(word)
    if ask:
        if ask > _answered:  # the loop asks back the task that runs: it started
            _answered = ask
            _send(w.frame(w.KEPT, ask))
    elif word >> 2 == number and _ours is None:
        # One exception per task: a later signal (a timeout after the cancel, the next
        # task's ask) never lands in the cleanup the first one began.
        cause = word & 3
        _ours = TaskTimeout() if cause == w.TIMEOUT else Terminated() if cause == w.SHUTDOWN else Cancelled()
        raise _ours


def _send(data: bytes) -> None:
    assert _sock is not None
    _sock.sendall(data)


_JOIN = 1 << 16  # an answer up to this size goes in one write with its figures
_READ = 1 << 16  # the reader's buffer (a tiny task's frame is ~100 bytes)
Frame: TypeAlias = "tuple[int, int, bytes | memoryview]"


class _Reader:
    """The loop's frames off the task socket. Every read lands in one buffer kept for the
    worker's life: a ``recv`` of 1 MiB made a new object each time, a mmap, a page fault,
    a mremap and a munmap per read, more CPU than the rest of a tiny task. A frame larger
    than that buffer is read straight into a buffer of its own size and comes out as a
    view of it (a 1 GiB argument is not held twice)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = memoryview(bytearray(_READ))
        self._held = b""  # the start of a frame not complete yet
        self._ready: list[Frame] = []

    def next(self) -> Frame | None:
        while not self._ready:
            if not self._read():
                return None
        return self._ready.pop()

    def _read(self) -> bool:
        """One read of the socket into ``_ready``; False at its end."""
        held = self._held
        if len(held) >= w.HEADER.size:
            size, kind, number = w.HEADER.unpack_from(held)
            if w.HEADER.size + size > _READ:
                return self._large(kind, number, size)
        got = self._sock.recv_into(self._buf)
        if not got:
            return False
        data = memoryview(held + self._buf[:got]) if held else self._buf[:got]
        at, end = 0, got + len(held)
        ready: list[Frame] = []
        while end - at >= w.HEADER.size:
            size, kind, number = w.HEADER.unpack_from(data, at)
            if size > w.MAX_FRAME:
                raise ValueError(f"frame of {size} bytes")
            stop = at + w.HEADER.size + size
            if stop > end:
                break
            ready.append((kind, number, bytes(data[at + w.HEADER.size:stop])))
            at = stop
        self._held = bytes(data[at:end])
        ready.reverse()
        self._ready = ready
        return True

    def _large(self, kind: int, number: int, size: int) -> bool:
        """The rest of a frame over the read buffer, into a buffer of its own."""
        if size > w.MAX_FRAME:
            raise ValueError(f"frame of {size} bytes")
        payload = memoryview(bytearray(size))
        have = len(self._held) - w.HEADER.size
        payload[:have] = self._held[w.HEADER.size:]
        self._held = b""
        while have < size:
            got = self._sock.recv_into(payload[have:])
            if not got:
                return False
            have += got
        self._ready = [(kind, number, payload)]
        return True


def _connect(address: str) -> socket.socket:
    """The loop's listener, checked before anything it sends is read: it must be this
    user's (or root's, a daemon that runs its workers as another user)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + address[1:] if address.startswith("@") else address)
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid not in (os.geteuid(), 0):
        sock.close()
        raise SystemExit(f"the task listener {address} belongs to uid {uid}, not to this worker's user: refused")
    return sock


def main() -> None:
    """The executor pool's target (``orchestrator.taskworker:main``)."""
    global _word, _sock, _grace
    address = os.environ.pop(w.SOCKET_ENV, "")
    if not address:
        raise SystemExit(f"{w.SOCKET_ENV} is not set: not started by an executor pool")
    try:
        set_child_subreaper()  # a task's daemonized children stay ours to end
    except OSError:
        pass
    sock = _sock = _connect(address)
    fd = os.memfd_create("orchestrator-cancel", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, w.WORD.size * w.WORDS)
        _word = memoryview(mmap.mmap(fd, w.WORD.size * w.WORDS)).cast("Q")
        socket.send_fds(sock, [w.frame(w.HELLO, os.getpid(), bytes([w.VERSION]))], [fd])
    finally:
        os.close(fd)
    reader = _Reader(sock)
    got = reader.next()
    while got is not None and got[0] == w.CONFIG:
        config: w.ConfigPayload = json.loads(bytes(got[2]))  # from the loop (its uid checked at connect)
        _grace = float(config.get("grace", _grace))
        if config.get("task_logs") and not _pipes:
            _open_pipes(sock)
        got = reader.next()
    if got is None or got[0] != w.WELCOME:
        raise SystemExit("the control loop closed the task socket before it welcomed this worker")
    _, max_tasks, init = got[0], got[1], bytes(got[2])
    _signal.signal(w.CANCEL_SIGNAL, _interrupt)
    meter = Meter()  # before the initializer: its floor for ru_maxrss read at the smallest resident set
    authkey, init = w.split_authkey(init)
    if authkey is not None:  # before the initializer, whose initargs may hold a manager's proxy
        import multiprocessing.process

        multiprocessing.process.current_process().authkey = authkey
    if init:
        initializer, initargs = w.loads(init)
        try:
            initializer(*initargs)
        except Exception as err:
            traceback.print_exc()
            line = f"initializer failed: {type(err).__name__}: {err}".replace("\n", " ")[:1000]
            sock.sendall(w.frame(w.UNPICKLABLE, 0, line.encode("utf-8", "replace")))
            raise SystemExit(3) from None
    _own.update(_children(os.getpid()))
    meter.settle()
    sock.sendall(w.frame(w.READY))
    done = 0
    while max_tasks == 0 or done < max_tasks:
        got = reader.next()
        if got is None:
            break  # the loop closed our socket: the pool is shrinking or gone
        kind, number, payload = got
        if kind != w.TASK:
            continue
        meter.start()
        reply = _run(number, payload)
        if reply is None:
            continue  # given back: another worker runs it
        _end_leftovers()
        for stream in (sys.stdout, sys.stderr):  # a task's prints reach its log now, not at exit
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        figures = meter.frame(number)
        if len(reply) <= _JOIN:  # one write: the loop reads both in one turn
            sock.sendall(figures + reply)
        else:  # not a copy of a large result for 45 bytes
            sock.sendall(figures)
            sock.sendall(reply)
        done += 1


def _open_pipes(sock: socket.socket) -> None:
    """Slot 1's stdout and stderr pipes, their read ends to the loop (PIPES); slot 0 keeps
    the fds 1 and 2 the worker was started with (copies kept here, not inherited)."""
    global _pipes
    out_r, out_w = os.pipe()
    try:
        err_r, err_w = os.pipe()
    except OSError:
        os.close(out_r)
        os.close(out_w)
        raise
    try:
        socket.send_fds(sock, [w.frame(w.PIPES)], [out_r, err_r])
    finally:
        os.close(out_r)
        os.close(err_r)
    _pipes = [(os.dup(1), os.dup(2)), (out_w, err_w)]


def _put_pipes(slot: int) -> None:
    """Slot ``slot``'s pair on fds 1 and 2 (what the last task wrote was flushed before its
    answer), where this task and the children it starts write."""
    global _on_slot
    out, err = _pipes[slot]
    os.dup2(out, 1)
    os.dup2(err, 2)
    _on_slot = slot


def _run(number: int, payload: bytes | memoryview) -> bytes | None:
    """Run a TASK frame; its answer, or None if it was given back unstarted."""
    global _current, _slot, _next, _skips, _answered, _ours, _starting, _deferred
    # While this task starts, the handler only notes a signal: it sees either no task, or
    # this one with _current set, never a start half made (the word is read once, here).
    # A flag, not pthread_sigmask: a Python handler runs in this thread, between two
    # bytecodes, so the flag is exact, and it costs no system call per task. (In this order:
    # a signal between the two finds no task, as between tasks.)
    _deferred = False
    _starting = True
    if _skips:
        _skips -= 1
        _starting = False  # a signal noted meanwhile found no task: the next start reads the words
        return None  # answered already, by the handler
    ask = w.asked(_word[_next])
    if ask > _answered:  # asked back before it started: given back, its word left to the next
        _answered = ask
        _starting = False
        _send(w.frame(w.STOPPED, ask, bytes([w.REVOKE])))
        return None
    _slot, _next = _next, _next ^ 1
    if _pipes and _slot != _on_slot:
        _put_pipes(_slot)
    _ours = None
    _current = number
    retry_on: tuple[type[BaseException], ...] = ()
    try:
        try:
            try:
                if _word[0] or _word[1]:  # both empty (the common case): nothing asked, nothing to stop
                    _look(number)  # a cancel that came before the task started
            finally:
                _starting = False
                if _deferred:  # a signal that came while it started is handled now, inside the task
                    _deferred = False
                    _interrupt(w.CANCEL_SIGNAL, None)
            if payload[:1] == b"t":
                fn, args, kwargs = _target(payload)
            else:
                fn, args, kwargs, *more = w.loads(payload)
                retry_on = (w.exception_types(more[0]) or ()) if more else ()  # the submitter checked it
            value = fn(*args, **kwargs)
        finally:
            _current = 0
    except Terminated as exc:
        if exc is _ours:  # the loop's: a task that raised one itself falls through
            cause = w.TIMEOUT if isinstance(exc, TaskTimeout) else w.CANCEL if isinstance(exc, Cancelled) else w.SHUTDOWN
            return w.frame(w.STOPPED, number, bytes([cause]))
        if type(exc) is Terminated:
            raise  # SIGTERM is not the task's error: the worker ends
        return _raised(number, exc, retry_on)
    except Retry as exc:
        return _retry(number, exc)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too, as the standard library's workers
        return _raised(number, exc, retry_on)
    try:
        data = w.json_result(value) if payload[:1] == b"t" else None  # for the command line
        data = data if data is not None else w.dumps(value, result=True)
        if len(data) > w.MAX_FRAME:  # its line made only then: a tiny task's every µs counts
            too_large = w.too_large(f"its result ({type(value).__name__})", len(data))
            assert too_large is not None
            return _unpicklable(number, too_large)
        return w.frame(w.RESULT, number, data)
    except BaseException as err:  # a __reduce__ raising SystemExit too: this task fails, not the worker
        _end_on_sigterm(err)
        return _unpicklable(number, f"its result ({type(value).__name__}) cannot be pickled: {_text(err)}")


# -- a task's leftover processes --------------------------------------------------------


def _children(pid: int, tids: list[str] | None = None) -> list[int]:
    out: list[int] = []
    for tid in tids if tids is not None else _tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def _tids(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


_mine_fd = -1  # /proc/self/task/<main thread>/children, kept open: one pread per task


def _my_children() -> list[int]:
    """This worker's children (of every thread, if the task left threads running)."""
    global _mine_fd
    if threading.active_count() > 1:
        return _children(os.getpid())
    try:
        if _mine_fd < 0:
            _mine_fd = os.open(f"/proc/self/task/{threading.get_native_id()}/children", os.O_RDONLY | os.O_CLOEXEC)
        return [int(p) for p in os.pread(_mine_fd, 1 << 16, 0).split()]
    except (OSError, ValueError):
        return _children(os.getpid())


def _end_leftovers() -> None:
    """The processes the task left below this worker: SIGTERM, then SIGKILL after the
    grace, before the next task starts. The common case (none) costs one read."""
    mine = _my_children()
    if not mine or _own.issuperset(mine):
        return
    me = os.getpid()
    _reap()
    fds = _pidfds(me)
    if not fds:
        return
    for fd in fds:
        signals.to_pidfd(fd, _signal.SIGTERM)
    deadline = time.monotonic() + _grace
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    alive = set(fds)
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            alive.discard(fd)
            poller.unregister(fd)
        _reap()
    # What is still there (and what was born since) is killed; down the tree again, since
    # a child that died may have left children of its own, re-parented to us.
    for _ in range(3):
        for fd in _pidfds(me):
            signals.to_pidfd(fd, _signal.SIGKILL)
            alive.add(fd)
        _reap()
        if _own.issuperset(_children(me)):
            break
    for fd in set(fds) | alive:
        os.close(fd)
    _reap()


def _pidfds(me: int) -> list[int]:
    """A pidfd of every live descendant (a pidfd pins the identity: no pid reuse between
    reading the tree and signalling it)."""
    fds: list[int] = []
    todo = [pid for pid in _children(me) if pid not in _own]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:
            continue
        todo += _children(pid)
    return fds




def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _target(payload: bytes | memoryview) -> tuple[Any, list[Any], dict[str, Any]]:
    """A ``module:function`` task: imported here, from the submitter's PYTHONPATH and cwd
    (a target that cannot be imported fails this task, with the reason; the worker lives)."""
    import json

    from .targets import TargetRef, load_target

    call = json.loads(bytes(payload[1:]))
    fn = load_target(TargetRef(call["target"], tuple(call.get("pythonpath") or ())), call.get("cwd"))
    return fn, call.get("args") or [], call.get("kwargs") or {}


def _retry(number: int, exc: Retry) -> bytes:
    """The task raised Retry: its attempt ends, the loop runs it again ``after`` seconds on."""
    after, reason = getattr(exc, "after", None), getattr(exc, "reason", "")
    if not isinstance(after, float) or not isinstance(reason, str):  # a subclass that skipped Retry's __init__
        return _raised(number, exc, ())
    return w.frame(w.RETRY, number, w.retry_payload({"after": after, "reason": reason}))


def _raised(number: int, exc: BaseException, retry_on: tuple[type[BaseException], ...]) -> bytes:
    """The task raised ``exc``: RAISED, or RETRY if it is of the call's ``retry_on`` (the
    loop decides whether retries remain)."""
    text = traceback.format_exc()
    try:
        line = _text(exc)
        body = w.raised(line, w.dumps((exc, text), result=True))
        if retry_on and isinstance(exc, retry_on):
            return w.frame(w.RETRY, number, w.retry_payload({"after": None, "reason": line}, body))
        return w.frame(w.RAISED, number, body)
    except BaseException as err:
        _end_on_sigterm(err)
        return _unpicklable(number, f"it raised {_text(exc)}, which cannot be pickled ({_text(err)})")


def _text(exc: BaseException) -> str:
    """``Type: message``, also for an exception whose ``__str__`` raises."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except BaseException as err:
        _end_on_sigterm(err)
        return f"{type(exc).__name__} (its message cannot be shown)"


def _end_on_sigterm(exc: BaseException) -> None:
    """Re-raise the worker's own SIGTERM (``Terminated``, not a Cancelled or TaskTimeout a
    __reduce__ raised: no cancel lands between tasks), which ends the worker wherever it comes."""
    if isinstance(exc, Terminated) and not isinstance(exc, (Cancelled, TaskTimeout)):
        raise exc


def _unpicklable(number: int, line: str) -> bytes:
    return w.frame(w.UNPICKLABLE, number, " ".join(line.split())[:2000].encode("utf-8", "replace"))


def run_chunk(fn: Any, chunk: tuple[Any, ...]) -> list[Any]:
    """One task of ``Executor.map(..., chunksize=N)``: its items' results, in order (here,
    not in the executor's module: a worker need not import that to run it)."""
    return [fn(*args) for args in chunk]
