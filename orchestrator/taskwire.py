"""The wire between the control loop and an ``Executor``'s workers, and nothing else.

Read by both ends: the task worker (taskworker.py, inside a replica) and the loop's task
table (daemon/tasktable.py). So it imports only the standard library, and no part of either.

One stream socket per worker, which the worker opens to the loop's listener (its address
is ``$ORCHESTRATOR_TASK_SOCKET``; the loop accepts only a live replica of an executor pool,
by SO_PEERCRED). Every frame is a 13-byte header, then ``size`` bytes:

    size (u32) | kind (u8) | number (u64)

    worker -> loop   HELLO       number: its pid; with it, over SCM_RIGHTS, its cancel word;
                                 payload: its wire version (a byte; none: version 1)
    loop -> worker   CONFIG      payload: JSON {"grace": s, "task_logs": bool} (``ConfigPayload``;
                                 version 2, before WELCOME)
    worker -> loop   PIPES       (asked for by "task_logs") over SCM_RIGHTS, the read ends of
                                 two more pipes, stdout's and stderr's: the second slot's
                                 (see "Per-task logs" below)
    loop -> worker   WELCOME     number: max_tasks; payload: the pickled (initializer,
                                 initargs), or empty; from an embedded executor, ``k``, the
                                 caller's multiprocessing authkey (u16 length) and then that
                                 (``with_authkey``)
    worker -> loop   READY       its initializer ran: it takes tasks from now on
    loop -> worker   TASK        number: the task's; payload: the pickled (fn, args, kwargs)
    worker -> loop   RESULT      payload: the pickled return value
                     RAISED      payload: a line saying what was raised (u16 length, UTF-8),
                                 then the pickled (exception, remote traceback text)
                     UNPICKLABLE payload: one line, UTF-8 (the result or exception could not
                                 be pickled; the worker lives on)
                     STOPPED     payload: the cause (CANCEL, TIMEOUT or SHUTDOWN): the task
                                 ended on the exception the loop asked for; or REVOKE, with
                                 number: the ask's, the held task given back unstarted
                     KEPT        number: an ask's, whose task had started: it runs here
                     RETRY       the task's attempt ended without failing it: payload: JSON
                                 ``RetryHead`` (u16 length): {"after": s, "reason"} (it raised
                                 ``Retry``), or {"after": null, "reason": its line} and then a
                                 RAISED payload (it raised an exception of the call's retry_on;
                                 ``retry_payload``). An old worker never sends it.
                     FIGURES     number: the task's; payload: ``FIGURES_PAYLOAD`` (what the
                                 task took: wall s, CPU s, peak RSS bytes, its children's peak
                                 RSS bytes; a size of 0: not known), written in the same
                                 ``sendall`` as the task's answer and just before it (a
                                 frame only workers of this version send: no version bump;
                                 a longer payload may carry more after these fields)

A TASK's pickled call is (fn, args, kwargs) or (fn, args, kwargs, retry_on): the exception
types the submitter named, which only the worker can test an exception against (the loop
loads no payload); when the task may run again and after how long is the loop's.

The loop never unpickles a payload: tasks and results are opaque bytes to it, which only
the worker and the submitting client load.

The cancel words: two words of eight bytes the worker shares with the loop (a memfd it sends
with HELLO). A worker is sent at most two tasks at a time (the one it runs, and the next,
so that it never waits for the loop between tasks); they use the two words by turns, as both
ends count (a version 1 worker: the k-th TASK frame, word k % 2; version 2: each frame it
starts takes the word its predecessor did not, and a frame given back leaves its word to
the next). To interrupt task N, the loop writes ``N << 2 | cause`` in its word, then sends
``CANCEL_SIGNAL`` to the worker if N runs; the worker's handler raises only if the word of
the task it runs now names that task, and a worker that starts a task looks at its word
first. A signal that comes late (the task has ended, the next one runs) finds another number
and does nothing: a cancel can never land in another task.

Taking a held task back (version 2): when another worker of the pool is idle, the loop asks
for the task a busy worker holds but may not have started, by writing ``revoke_word(r)``
(cause 0; r counts the asks to this worker) in that task's word and sending the signal.
The worker alone decides, the signal held off while it starts a task: not started, it
answers STOPPED(REVOKE) with number r and skips that frame when it reads it; started, it
answers KEPT with number r. The loop hands the task to another worker only after
STOPPED(REVOKE), so a task never runs twice; once an ask is answered (or its task's own
answer came first) the loop clears the word before the slot carries another task.

Per-task logs (CONFIG's "task_logs"): the two slots of the cancel words have a stdout and
stderr pipe pair each: slot 0 the replica's own fds 1 and 2 (the daemon's log capture),
slot 1 the pair whose read ends PIPES sent. A worker puts its slot's pair on fds 1 and 2
as it starts a task (after flushing what it wrote before), so what the task and its children
write lands in that slot's pipes. A slot carries a new task only after the loop has read the
answer of the one before, so the loop, which reads those pipes, knows whose bytes it reads
without asking the worker anything: the slot's task's, from the TASK frame it sent until it
drained the pipes at that task's answer (daemon/tasklogs.py).
"""

from __future__ import annotations

import io
import json
import pickle
import signal
import struct
import sys
import types
from enum import StrEnum
from typing import Any, Callable, NotRequired, TypedDict

HEADER = struct.Struct("!IBQ")
MAX_FRAME = 1 << 30  # a corrupt length must not make either side allocate without bound
SOCKET_ENV = "ORCHESTRATOR_TASK_SOCKET"
# A real-time signal: no library or server framework claims it (SIGUSR1 is faulthandler's
# and many servers' reload signal); glibc keeps SIGRTMIN..+2 below Python's SIGRTMIN.
CANCEL_SIGNAL = signal.SIGRTMIN + 3
WORD = struct.Struct("=Q")  # a cancel word, native order: both ends are on this host
WORDS = 2  # a worker holds at most two tasks (one runs, one waits): a word each, by turns

HELLO, WELCOME, READY, TASK, RESULT, RAISED, UNPICKLABLE, STOPPED, KEPT, CONFIG = range(1, 11)
RETRY = 11  # worker -> loop only, never sent unasked: no VERSION of its own
FIGURES = 12
FIGURES_PAYLOAD = struct.Struct("!ddQQ")  # wall s, CPU s, peak RSS, children's peak RSS (bytes; 0: unknown)
PIPES = 13  # worker -> loop, only when CONFIG asked for task logs
# The cause in the cancel word's low bits, and in STOPPED. REVOKE words name a frame's index
# (revoke_word), the others a task's number.
REVOKE, CANCEL, TIMEOUT, SHUTDOWN = 0, 1, 2, 3
VERSION = 2  # what HELLO says: 2 knows REVOKE and KEPT
OVERSIZE = 0x80  # Frames.feed: a frame over its limit, not read (the kind's high bit)


class TaskEvent(StrEnum):
    """What the loop tells a task's submitter (``Executor``) of a task that has not ended, or
    not for it: the first word of an event ``[kind, ref, data, task id]`` (the other kinds
    are its end: result, raised, error, timeout, lost, unrun, interrupted, cancelled).
    A ``str``: over the daemon's JSON channel it is the word itself, unchanged."""

    STARTED = "started"  # a worker runs it now (data: its task id)
    WAITING = "waiting"  # its attempt ended (Retry, retry_on): it waits for its time, runs on no worker
    # (data: its task id; told only to a session opened with ``waiting_events``: an older
    # submitter would take a word it does not know for its end)
    STOPPING = "stopping"  # it ended while a worker ran it: its end comes next, the worker still stops it
    STOPPED = "stopped"  # that worker is done with it (TaskFuture.wait_stopped returns)


class Figures(TypedDict):
    """What a task took in its worker (a FIGURES frame, ``read_figures``): its record's
    ``figures``. The worker measures (taskmeter.py says how, and what each figure covers)."""

    wall: float  # seconds from its start in the worker to its answer (its leftovers ended)
    cpu: float  # seconds of CPU, user + system: the worker's and the children reaped meanwhile
    peak_rss: int | None  # bytes: the worker's own peak resident set while it ran (None: not known here)
    children_peak_rss: int | None  # bytes: its largest child's, where the kernel's figure tells it (else None)


def read_figures(payload: bytes) -> Figures | None:
    """A FIGURES payload's figures (None: too short to be one)."""
    if len(payload) < FIGURES_PAYLOAD.size:
        return None
    wall, cpu, peak, children = FIGURES_PAYLOAD.unpack_from(payload)
    return {"wall": wall, "cpu": cpu, "peak_rss": peak or None, "children_peak_rss": children or None}


class ConfigPayload(TypedDict):
    """A CONFIG frame's JSON payload."""

    grace: float  # seconds a task the loop stops has before its worker's tree is killed
    task_logs: NotRequired[bool]  # the worker sends PIPES and puts each task's fds 1 and 2 on its slot's pair


class RetryHead(TypedDict):
    """The JSON in front of a RETRY frame's payload."""

    after: float | None  # Retry(after=): seconds; None: an exception of retry_on (the loop's backoff)
    reason: str  # Retry's reason, or the exception's line


class TargetCall(TypedDict):
    """A ``module:function`` task's payload (``target_payload``), JSON after a ``t``."""

    target: str  # "module:function"
    args: list[Any]  # JSON values, the function's positional arguments
    kwargs: dict[str, Any]  # JSON values, its keyword arguments
    pythonpath: list[str]  # the submitter's, looked in first
    cwd: str | None  # the submitter's working directory, where the target is imported


def frame(kind: int, number: int = 0, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, number) + payload


def header(kind: int, number: int, size: int) -> bytes:
    """A frame's header alone: its payload is written after it, uncopied."""
    return HEADER.pack(size, kind, number)


def cancel_word(number: int, cause: int) -> int:
    return number << 2 | cause


def revoke_word(ask: int) -> int:
    """The word of the loop's ``ask``-th request (from 1) for a held task back."""
    return ask << 2 | REVOKE


def asked(word: int) -> int:
    """The ask a word carries (0: none: it is empty or names a task to stop)."""
    return word >> 2 if word & 3 == REVOKE else 0


class Frames:
    """Frames out of a byte stream fed in any pieces (the loop's non-blocking reads)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skip = 0

    def pending(self) -> bytes:
        """What was read of a frame not complete yet."""
        return bytes(self._buf)

    @property
    def skipping(self) -> int:
        """Bytes of a frame over its limit still to be read and dropped."""
        return self._skip

    def resume(self, pending: bytes, skipping: int = 0) -> None:
        """Go on from what another reader of this stream had (an upgrade's hand-over)."""
        self._buf += pending
        self._skip = skipping

    def feed(self, data: bytes | memoryview, limit: Callable[[int], int] | None = None
             ) -> list[tuple[int, int, bytes]]:
        """(kind, number, payload) of every frame completed by ``data``; ValueError on a
        frame over MAX_FRAME (the peer is broken: the caller drops it). ``data`` is copied
        (the caller may reuse its buffer).

        ``limit(kind)``: the largest payload a frame of that kind may have, decided on its
        header: one over it is not buffered but read past, and comes out as
        ``(kind | OVERSIZE, number, its size as 8 bytes)``; the stream stays in step."""
        chunk: bytes | memoryview = data
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            chunk = memoryview(data)[n:]  # read past, uncopied
        buf = self._buf
        buf += chunk
        out = []
        at = 0
        with memoryview(buf) as view:  # one copy of each payload, however large
            while len(buf) - at >= HEADER.size:
                size, kind, number = HEADER.unpack_from(buf, at)
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes")
                if limit is not None and size > limit(kind):
                    out.append((kind | OVERSIZE, number, size.to_bytes(8, "big")))
                    have = len(buf) - at - HEADER.size
                    if have >= size:
                        at += HEADER.size + size
                        continue
                    self._skip = size - have
                    at = len(buf)
                    break
                end = at + HEADER.size + size
                if len(buf) < end:
                    break
                out.append((kind, number, bytes(view[at + HEADER.size:end])))
                at = end
        if at:
            del buf[:at]
        return out


def too_large(what: str, size: int) -> str | None:
    """The line that refuses a payload over the wire's limit (MAX_FRAME), or None."""
    if size <= MAX_FRAME:
        return None
    return f"{what} of {size:,} bytes is over the task wire's limit of {MAX_FRAME >> 30} GiB"


def dumps(obj: Any, *, by_value: bool = False, result: bool = False) -> bytes:
    """A task, a result or an exception as payload bytes: pickle, or dill where pickle
    cannot (closures, lambdas) or where the object must travel by value (functions of
    ``__main__``, and whatever names ``__main__``: an instance of a class of the caller's
    script, which a worker's ``__main__`` does not have). One byte in front says which, for
    ``loads``.

    ``result``: a worker's result or exception, for the client that submitted the task:
    there a class or function of ``__main__`` (one that came by value) is the client's own,
    and goes by name (so that the client gets its own class back, as from a forked worker).

    A manager's proxy (``multiprocessing`` or ``multiprocess``) carries its manager's
    authkey, as it does to a spawned child: the worker that loads it is not the caller's
    child, and a daemon's pool serves clients with other keys."""
    if not by_value:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            pass
        else:
            # One scan of the bytes is what the common case costs: a global of __main__
            # names its module in them (a result's are the client's: no scan).
            if result or data.find(_MAIN) < 0:  # find(): less overhead than `in` for short bytes
                return b"p" + (_pickled(obj, pickle.Pickler, result) if _has_proxy(data) else data)
        if result:  # what failed may be a class of __main__ that came by value: by name, it goes
            try:
                return b"p" + _pickled(obj, pickle.Pickler, result)
            except (pickle.PicklingError, TypeError, AttributeError):
                pass
    import dill  # only for what pickle cannot do: ~30 ms to import

    # recurse: the globals a function of __main__ names (its modules, constants) travel
    # with it; without it they were looked up in the worker's own __main__, and missed.
    if result:
        return b"d" + _pickled(obj, dill.Pickler, result, recurse=True)
    data = dill.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, recurse=True)
    return b"d" + (_pickled(obj, dill.Pickler, result, recurse=True) if _has_proxy(data) else data)


_MAIN = b"__main__"
_MANAGERS = ("multiprocessing.managers", "multiprocess.managers")


def _has_proxy(data: bytes) -> bool:
    """Whether ``data`` may hold a manager's proxy (its rebuild names itself): scanned
    only in a process that imported a managers module, where a proxy can exist."""
    modules = sys.modules
    if "multiprocessing.managers" not in modules and "multiprocess.managers" not in modules:
        return False
    return data.find(b"RebuildProxy") >= 0


def _pickled(obj: Any, base: type[pickle.Pickler], result: bool, **options: Any) -> bytes:
    """``obj`` pickled by ``base`` (pickle's or dill's Pickler) with each manager proxy's
    authkey in its rebuild's keywords (``RebuildProxy`` hands them to the proxy, which
    connects with it), and, for a ``result``, what is of ``__main__`` by name."""
    proxies = tuple(sys.modules[name].BaseProxy for name in _MANAGERS if name in sys.modules)

    class Pickler(base):  # type: ignore[valid-type,misc]  # pickle's or dill's, as the caller chose
        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, proxies):
                rebuild, (func, token, serializer, kwds) = value.__reduce__()
                return rebuild, (func, token, serializer, {**kwds, "authkey": bytes(value._authkey)})
            if result and isinstance(value, (type, types.FunctionType)) and value.__module__ == "__main__":
                name = getattr(value, "__qualname__", "<")
                if "<" not in name:  # a lambda or a local one has no name to be found by
                    return _of_main, (name,)
            return NotImplemented

    out = io.BytesIO()
    Pickler(out, pickle.HIGHEST_PROTOCOL, **options).dump(obj)
    return out.getvalue()


def _of_main(qualname: str) -> Any:
    """A class or function of this process's ``__main__``, by name: what a worker's result
    names of its client's script."""
    found: Any = sys.modules["__main__"]
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


def loads(data: bytes | memoryview) -> Any:
    """What ``dumps`` (or a target task's JSON result, ``j``) made."""
    head = data[:1]
    if head == b"d":
        import dill

        return dill.loads(data[1:])
    if head == b"j":
        return json.loads(bytes(data[1:]))
    return pickle.loads(data[1:])


_LINE = struct.Struct("!H")


def raised(line: str, pickled: bytes) -> bytes:
    """A RAISED payload: ``Type: message`` (one line, for ``tasks`` and the command line,
    which do not unpickle) in front of the pickled exception."""
    text = " ".join(line.split())[:1000].encode("utf-8", "replace")
    return _LINE.pack(len(text)) + text + pickled


def split_raised(payload: bytes) -> tuple[str, bytes]:
    """(line, pickled) of a RAISED payload."""
    (size,) = _LINE.unpack_from(payload)
    end = _LINE.size + size
    return payload[_LINE.size:end].decode("utf-8", "replace"), payload[end:]


def exception_types(raw: Any) -> tuple[type[BaseException], ...] | None:
    """A call's ``retry_on`` (an exception type or a tuple of them, as ``except`` takes)
    as a tuple; None if it is anything else."""
    found = raw if isinstance(raw, tuple) else (raw,)
    return found if all(isinstance(t, type) and issubclass(t, BaseException) for t in found) else None


def retry_payload(head: RetryHead, raised_payload: bytes = b"") -> bytes:
    """A RETRY payload: ``head`` as JSON, then (an exception of retry_on) its RAISED payload."""
    text = json.dumps(head).encode("utf-8")
    return _LINE.pack(len(text)) + text + raised_payload


def split_retry(payload: bytes) -> tuple[RetryHead, bytes]:
    """(head, the RAISED payload or empty) of a RETRY payload; ValueError if it is not one
    (the worker is no worker of ours, or broken: the loop fails that task)."""
    try:
        (size,) = _LINE.unpack_from(payload)
        head = json.loads(payload[_LINE.size:_LINE.size + size])
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"an unreadable RETRY frame: {err}") from None
    if not isinstance(head, dict) or not isinstance(head.get("reason"), str) or not _wait(head.get("after")):
        raise ValueError(f"a RETRY frame with a bad head: {head!r}"[:200])
    after = head["after"]
    return {"after": None if after is None else float(after), "reason": head["reason"]}, payload[_LINE.size + size:]


def _wait(after: Any) -> bool:
    """Is ``after`` what a RETRY head may say: None, or seconds (finite, at least 0)?"""
    if after is None:
        return True
    return isinstance(after, (int, float)) and not isinstance(after, bool) and 0 <= after < float("inf")


def with_authkey(init: bytes, authkey: bytes) -> bytes:
    """A WELCOME payload that also gives the worker its caller's multiprocessing authkey
    (``current_process().authkey``, as a forked child of the caller would have it)."""
    return b"k" + _LINE.pack(len(authkey)) + authkey + init


def split_authkey(payload: bytes) -> tuple[bytes | None, bytes]:
    """(authkey or None, the pickled initializer or empty) of a WELCOME payload; one
    without a key (a daemon's pool, one restored from state.db) is read as it is."""
    if payload[:1] != b"k":
        return None, payload
    (size,) = _LINE.unpack_from(payload, 1)
    end = 1 + _LINE.size + size
    return payload[1 + _LINE.size:end], payload[end:]


def target_payload(call: TargetCall) -> bytes:
    """A ``module:function`` task (``submit --target``): JSON the daemon can build and the
    worker reads, {"target", "args", "kwargs", "pythonpath", "cwd"}. TypeError or ValueError
    if the arguments are not JSON."""
    return b"t" + json.dumps(call, allow_nan=False).encode("utf-8")


def json_result(value: Any) -> bytes | None:
    """A target task's result as JSON (``j``), for the command line to print; None if it
    is not JSON."""
    try:
        return b"j" + json.dumps(value, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError):
        return None
