"""The wire between the control loop and an ``Executor``'s workers, and nothing else.

Read by both ends: the task worker (taskworker.py, inside a replica) and the loop's task
table (daemon/tasks.py). So it imports only the standard library, and no part of either.

One stream socket per worker, which the worker opens to the loop's listener (its address
is ``$ORCHESTRATOR_TASK_SOCKET``; the loop accepts only a live replica of an executor pool,
by SO_PEERCRED). Every frame is a 13-byte header, then ``size`` bytes:

    size (u32) | kind (u8) | number (u64)

    worker -> loop   HELLO       number: its pid; with it, over SCM_RIGHTS, its cancel word
    loop -> worker   WELCOME     payload: the pickled (initializer, initargs), or empty
    worker -> loop   READY       its initializer ran: it takes tasks from now on
    loop -> worker   TASK        number: the task's; payload: the pickled (fn, args, kwargs)
    worker -> loop   RESULT      payload: the pickled return value
                     RAISED      payload: the pickled (exception, remote traceback text)
                     UNPICKLABLE payload: one line, UTF-8 (the result or exception could not
                                 be pickled; the worker lives on)
                     STOPPED     payload: the cause (CANCEL or TIMEOUT): the task ended on
                                 the exception the loop asked for

The loop never unpickles a payload: tasks and results are opaque bytes to it, which only
the worker and the submitting client load.

The cancel word: eight bytes of memory the worker shares with the loop (a memfd it sends
with HELLO). To interrupt task N, the loop writes ``N << 2 | cause`` there, then sends
``CANCEL_SIGNAL`` to the worker; the worker's handler raises only if the word names the
task it runs now. A signal that comes late (the task has ended, the next one runs) finds
another number and does nothing: a cancel can never land in another task.
"""

from __future__ import annotations

import pickle
import signal
import struct
from typing import Any

HEADER = struct.Struct("!IBQ")
MAX_FRAME = 1 << 30  # a corrupt length must not make either side allocate without bound
SOCKET_ENV = "ORCHESTRATOR_TASK_SOCKET"
# A real-time signal: no library or server framework claims it (SIGUSR1 is faulthandler's
# and many servers' reload signal); glibc keeps SIGRTMIN..+2 below Python's SIGRTMIN.
CANCEL_SIGNAL = signal.SIGRTMIN + 3
WORD = struct.Struct("=Q")  # the cancel word, native order: both ends are on this host

HELLO, WELCOME, READY, TASK, RESULT, RAISED, UNPICKLABLE, STOPPED = range(1, 9)
CANCEL, TIMEOUT = 1, 2  # the cause in the cancel word's low bits, and in STOPPED


def frame(kind: int, number: int = 0, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, number) + payload


def cancel_word(number: int, cause: int) -> int:
    return number << 2 | cause


class Frames:
    """Frames out of a byte stream fed in any pieces (the loop's non-blocking reads)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """(kind, number, payload) of every frame completed by ``data``; ValueError on a
        frame over MAX_FRAME (the peer is broken: the caller drops it)."""
        buf = self._buf
        buf += data
        out = []
        at = 0
        while len(buf) - at >= HEADER.size:
            size, kind, number = HEADER.unpack_from(buf, at)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes")
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            out.append((kind, number, bytes(buf[at + HEADER.size:end])))
            at = end
        if at:
            del buf[:at]
        return out


def dumps(obj: Any, *, by_value: bool = False) -> bytes:
    """A task, a result or an exception as payload bytes: pickle, or dill where pickle
    cannot (closures, lambdas) or where the object must travel by value (functions of
    ``__main__``). One byte in front says which, for ``loads``."""
    if not by_value:
        try:
            return b"p" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            pass
    import dill  # only for what pickle cannot do: ~30 ms to import

    return b"d" + dill.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    if data[:1] == b"d":
        import dill

        return dill.loads(data[1:])
    return pickle.loads(data[1:])
