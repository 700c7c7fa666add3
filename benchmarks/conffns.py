"""The tasks ``sec_conformance`` runs in every executor's workers.

They report on a named pipe the parent holds open, one line each (shorter than PIPE_BUF, so
written whole): ``S tag pid time`` at the start, ``H tag pid time`` every ``BEAT`` seconds,
``X tag pid time Name`` when an exception of that name reached the task, ``E tag pid time``
at its end (``time`` is the monotonic clock, the same in every process of the host). The
pipe is opened non-blocking: a task whose parent has gone fails at once instead of hanging,
and a beat that finds the pipe full is dropped rather than blocking the task.
"""

from __future__ import annotations

import os
import time
from typing import Any

BEAT = 0.02  # seconds between heartbeats


class AppError(Exception):
    """A task's own exception type: does it reach the caller as itself?"""


def _line(fd: int, kind: str, tag: int, extra: str = "") -> None:
    try:
        os.write(fd, f"{kind} {tag} {os.getpid()} {time.monotonic()!r}{extra}\n".encode())
    except BlockingIOError:  # the parent is behind: a lost beat, never a blocked task
        pass


def _open(fifo: str) -> int:
    return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)


def beat(fifo: str, tag: int, seconds: float) -> int:
    """Beats for ``seconds``, then returns its pid; says which exception stopped it, if any."""
    fd = _open(fifo)
    try:
        try:  # a cancel may come as soon as the parent has read the start: inside the try
            _line(fd, "S", tag)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(BEAT)
                _line(fd, "H", tag)
        except BaseException as exc:
            _line(fd, "X", tag, f" {type(exc).__name__}")
            raise
        _line(fd, "E", tag)
        return os.getpid()
    finally:
        os.close(fd)


def hog(fifo: str, tag: int, mib: int, seconds: float) -> int:
    """Touches ``mib`` MiB in steps of 8 MiB, a step every 10 ms, then beats until ``seconds``."""
    fd = _open(fifo)
    try:
        _line(fd, "S", tag)
        held = []
        for _ in range(mib // 8):
            held.append(bytearray(8 << 20))  # zero-filled by the kernel: every page touched by calloc's memset
            held[-1][::4096] = b"\1" * len(held[-1][::4096])
            time.sleep(0.01)
        _line(fd, "M", tag)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(BEAT)
            _line(fd, "H", tag)
        _line(fd, "E", tag)
        return os.getpid()
    finally:
        os.close(fd)


def started(fifo: str, tag: int) -> int:
    """Says when it started; returns its pid."""
    fd = _open(fifo)
    try:
        _line(fd, "S", tag)
    finally:
        os.close(fd)
    return os.getpid()


def pid(_: Any = None) -> int:
    return os.getpid()


def nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def flaky(mark: str) -> int:
    """The first attempt fails with AppError (it leaves ``mark``); a later one returns how
    many attempts there were."""
    try:
        fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        with open(mark, "a") as f:
            f.write("x")
        return os.path.getsize(mark) + 1
    os.close(fd)
    raise AppError("the first attempt fails")


def raises(code: int) -> None:
    raise AppError(code)


class Unpicklable:
    """A value no pickler takes: pickle, dill and cloudpickle all ask ``__reduce_ex__``. (A
    lock would not do: dill pickles one, as a new lock.)"""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("this object refuses to be pickled")


def unpicklable() -> Unpicklable:
    return Unpicklable()
