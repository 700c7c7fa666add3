"""An ``Executor``'s worker: the Python target of every replica of an executor pool.

It connects to the control loop's task listener (taskwire.py has the frames), runs the
pool's initializer once, then runs the tasks the loop sends, one at a time, in its main
thread, and answers each with its result, its exception (with the remote traceback's
text) or a line saying why neither could be pickled. It exits 0 after ``max_tasks`` tasks
(``max_tasks_per_child``; the pool replaces it) or when the loop closes the socket.

Cancel and timeout: ``CANCEL_SIGNAL``'s handler raises :class:`orchestrator.Cancelled` (or
:class:`orchestrator.TaskTimeout`) only if the cancel word names the task running now,
so a signal that arrives after its task has ended does nothing. SIGTERM stays what it is
in every Python worker: :class:`orchestrator.Terminated`, and the worker ends.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the module signal wraps, lighter to import
import mmap
import os
import socket
import sys
import traceback
from typing import Any

from . import taskwire as w
from .worker import Cancelled, TaskTimeout, Terminated

_current = 0  # the number of the task running now; 0 between tasks
_slot = 0  # the cancel word of the task running now
_word: Any = None  # memoryview of the cancel words, shared with the loop


def _interrupt(signum: int, frame: object) -> None:
    word = _word[_slot]
    if _current and word >> 2 == _current:
        raise TaskTimeout() if word & 3 == w.TIMEOUT else Cancelled()


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._frames = w.Frames()
        self._ready: list[tuple[int, int, bytes]] = []

    def next(self) -> tuple[int, int, bytes] | None:
        while not self._ready:
            data = self._sock.recv(1 << 20)
            if not data:
                return None
            self._ready = self._frames.feed(data)
        return self._ready.pop(0)


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + address[1:] if address.startswith("@") else address)
    return sock


def main() -> None:
    """The executor pool's target (``orchestrator.taskworker:main``)."""
    global _word
    address = os.environ.pop(w.SOCKET_ENV, "")
    if not address:
        raise SystemExit(f"{w.SOCKET_ENV} is not set: not started by an executor pool")
    sock = _connect(address)
    fd = os.memfd_create("orchestrator-cancel", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, w.WORD.size * w.WORDS)
        _word = memoryview(mmap.mmap(fd, w.WORD.size * w.WORDS)).cast("Q")
        socket.send_fds(sock, [w.frame(w.HELLO, os.getpid())], [fd])
    finally:
        os.close(fd)
    reader = _Reader(sock)
    got = reader.next()
    if got is None or got[0] != w.WELCOME:
        raise SystemExit("the control loop closed the task socket before it welcomed this worker")
    _, max_tasks, init = got
    _signal.signal(w.CANCEL_SIGNAL, _interrupt)
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
    sock.sendall(w.frame(w.READY))
    done = 0
    while max_tasks == 0 or done < max_tasks:
        got = reader.next()
        if got is None:
            break  # the loop closed our socket: the pool is shrinking or gone
        kind, number, payload = got
        if kind != w.TASK:
            continue
        reply = _run(number, done % w.WORDS, payload)
        for stream in (sys.stdout, sys.stderr):  # a task's prints reach its log now, not at exit
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sock.sendall(reply)
        done += 1


def _run(number: int, slot: int, payload: bytes) -> bytes:
    global _current, _slot
    try:
        try:
            _slot = slot
            _current = number
            _interrupt(0, None)  # a cancel that came before we knew the task's number
            if payload[:1] == b"t":
                fn, args, kwargs = _target(payload)
            else:
                fn, args, kwargs = w.loads(payload)
            value = fn(*args, **kwargs)
        finally:
            _current = 0
    except (Cancelled, TaskTimeout) as exc:
        word = _word[slot]
        if word >> 2 == number:  # the loop's: a task that raised one itself falls through
            return w.frame(w.STOPPED, number, bytes([word & 3]))
        return _raised(number, exc)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too, as the standard library's workers
        if isinstance(exc, Terminated):
            raise  # SIGTERM is not the task's error: the worker ends
        return _raised(number, exc)
    try:
        data = w.json_result(value) if payload[:1] == b"t" else None  # for the command line
        return w.frame(w.RESULT, number, data if data is not None else w.dumps(value, result=True))
    except BaseException as err:  # a __reduce__ raising SystemExit too: this task fails, not the worker
        _end_on_sigterm(err)
        return _unpicklable(number, f"its result ({type(value).__name__}) cannot be pickled: {_text(err)}")


def _target(payload: bytes) -> tuple[Any, list, dict]:
    """A ``module:function`` task: imported here, from the submitter's PYTHONPATH and cwd
    (a target that cannot be imported fails this task, with the reason; the worker lives)."""
    import json

    from .targets import TargetRef, load_target

    call = json.loads(payload[1:])
    fn = load_target(TargetRef(call["target"], tuple(call.get("pythonpath") or ())), call.get("cwd"))
    return fn, call.get("args") or [], call.get("kwargs") or {}


def _raised(number: int, exc: BaseException) -> bytes:
    text = traceback.format_exc()
    try:
        return w.frame(w.RAISED, number, w.raised(_text(exc), w.dumps((exc, text), result=True)))
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


def run_chunk(fn: Any, chunk: tuple) -> list:
    """One task of ``Executor.map(..., chunksize=N)``: its items' results, in order (here,
    not in the executor's module: a worker need not import that to run it)."""
    return [fn(*args) for args in chunk]
