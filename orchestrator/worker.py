"""What a worker sees of the orchestrator: ``Terminated``, ``ready()`` and ``listen_sockets()``.

Imported by the spawner (so it is in every forked worker already) and by user code in any
replica, command or Python target: it imports nothing but ``os``, ``sys`` and ``_signal`` at
the top (``socket`` only when ``ready()`` has a socket to send to, or ``listen_sockets()``
is called), and does nothing when imported.

SIGTERM in a Python target's worker
    The spawner installs ``install_sigterm_handler()`` in the forked child of a Python
    target (never in a command worker, which execs), before the user's callable runs. A
    SIGTERM then raises :class:`Terminated` in the worker's main thread (Python runs signal
    handlers there only), at the next bytecode boundary or out of the blocking call it
    interrupted (``time.sleep``, a read...), so ``finally:`` blocks and ``with`` exits run.
    If it is not caught, the worker exits as a SIGTERM would have killed it (the engine
    records exit code -15, reason ``killed by SIGTERM``); if the target catches it and
    returns or exits, that exit status is the worker's. Every SIGTERM raises again, as every
    SIGINT raises KeyboardInterrupt: cleanup that must not be interrupted by a second one
    can set ``signal.signal(signal.SIGTERM, signal.SIG_IGN)`` first. A target that installs
    its own SIGTERM handler replaces this one. Processes the target forks (multiprocessing's
    fork context included) die of SIGTERM as usual, even one SIGTERMed in the instant of its
    fork: SIGTERM is blocked across ``os.fork()`` and unblocked in the child only once its
    handler is the default again (CPython clears, after a fork, the flag of a signal whose
    Python handler was tripped in between, so such a SIGTERM would be lost). Python cannot
    raise into the target everywhere its handler may run: in a fork hook (logging's, or the
    mask's own above), a ``__del__``, a weakref callback, it only reports the exception
    ("Exception ignored in ...") and goes on. A Terminated raised there is not lost: the
    worker ends as SIGTERM's default would (no ``finally:`` of the target runs), through
    ``sys.unraisablehook`` (the one before ours is called for everything else). What it
    cannot do: interrupt a C call
    that never returns to the interpreter (a long computation in an extension that does not
    check for signals): the Terminated comes when the call returns, or the SIGKILL after the
    grace comes first. In any Python program, a signal that lands in the instant between
    the interpreter's last check for signals and a blocking call's entry into the kernel
    (``time.sleep(1000)`` called just then) does not interrupt that call: its handler waits
    for the call to return (seen about once in 400 workers SIGTERMed within a millisecond of
    their start on a loaded host). So that the Terminated is not left waiting there until
    the SIGKILL, the daemon follows its stop signal to a Python target's worker with a few
    SIGURGs (after 50 ms, 250 ms, 1 s and 4 s, while it lives): this module's handler for
    SIGURG does nothing, but the call it interrupts returns to the interpreter, which runs
    the handler the stop signal left pending. The kicks go to the worker's own process
    only, and SIGURG's default is to be ignored: a command never notices one.

Readiness
    ``ready()`` is systemd's ``sd_notify(0, "READY=1")``: one datagram on the AF_UNIX socket
    named by ``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace).

Socket activation
    ``listen_sockets()`` is systemd's ``sd_listen_fds(0)`` for a pool with ``sockets``: the
    listening sockets the daemon passed as fds 3, 4, ... (``LISTEN_FDS``, checked against
    ``LISTEN_PID``), as ``socket.socket`` objects, in the order of the pool's addresses.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stub; the module signal wraps, lighter to import
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import socket  # imported where a worker has sockets to take

__all__ = ["Terminated", "Cancelled", "TaskTimeout", "Retry", "install_sigterm_handler", "exit_as_killed", "ready",
           "listen_sockets"]

SD_LISTEN_FDS_START = 3
_listening: tuple[int, list[socket.socket]] | None = None  # (pid, sockets): one object per fd, made once


class Terminated(BaseException):
    """Raised in a Python target's main thread when the worker gets SIGTERM.

    A BaseException, like SystemExit and KeyboardInterrupt, so that ``except Exception``
    does not swallow it; not a KeyboardInterrupt (SIGINT still raises that).
    """

    def __init__(self, signum: int = _signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by signal {self.signum}"


class Cancelled(Terminated):
    """Raised inside a task of ``orchestrator.Executor`` whose future was cancelled while it
    ran; never in any other task. A Terminated, so one ``except Terminated:`` cleans up after
    a cancel, a timeout and a shutdown alike."""

    def __str__(self) -> str:
        return "the task was cancelled"


class TaskTimeout(Terminated):
    """Raised inside a task of ``orchestrator.Executor`` that ran past its ``timeout``."""

    def __str__(self) -> str:
        return "the task ran past its timeout"


REASON_MAX = 500  # characters of a Retry's reason kept (a line for `tasks`)


class Retry(Exception):
    """Raised by a task of ``orchestrator.Executor`` that cannot do its work now: that
    attempt ends without failing the task, which waits (state ``WAITING``, with ``reason``,
    holding no worker) and runs again ``after`` seconds from now, bounded by its
    ``deadline``. An attempt that ends so does not count against ``retries``.

        raise orchestrator.Retry(after=30, reason="the upstream API is rate limited")

    A bad ``after`` (not a number, negative, not finite) is a ValueError at the raise,
    and the task fails with it."""

    def __init__(self, after: float, reason: str = "") -> None:
        if isinstance(after, bool) or not isinstance(after, (int, float)) or not 0 <= after < float("inf"):
            raise ValueError(f"Retry: after must be a number of seconds of at least 0, got {after!r}")
        if not isinstance(reason, str):
            raise ValueError(f"Retry: reason must be a string, got {type(reason).__name__}")
        super().__init__(after, reason)
        self.after = float(after)
        self.reason = " ".join(reason.split())[:REASON_MAX]

    def __str__(self) -> str:
        return f"retry after {self.after:g} s" + (f": {self.reason}" if self.reason else "")


_owner = 0  # the pid install_sigterm_handler() was called in
_hooked = False
_TERM = (_signal.SIGTERM,)


def _raise_terminated(signum: int, frame: object) -> None:
    if os.getpid() != _owner:
        # A process the target forked (multiprocessing's fork context, os.fork): it gets
        # SIGTERM's default, as in any Python program; its parent's Terminated is not its
        # business (multiprocessing would report exit code 1 and a traceback, not -15).
        # Its stdio buffers are copies of its parent's: not flushed, as the default would not.
        _die_of(signum)
    raise Terminated(signum)


def _kicked(signum: int, frame: object) -> None:
    """SIGURG: nothing. It comes to interrupt a blocking call, so that a handler left pending
    by a signal that landed just before the call (the module's doc) runs now."""


def install_sigterm_handler() -> None:
    """SIGTERM raises :class:`Terminated` in this process from now on (main thread of the
    main interpreter only, as any ``signal.signal``); processes it forks later die of SIGTERM
    as usual unless they call this again. SIGURG does nothing (the daemon's kick after a stop
    signal: the module's doc). Cheap: it is on the spawn path."""
    global _owner, _hooked
    _owner = os.getpid()
    _signal.signal(_signal.SIGTERM, _raise_terminated)
    _signal.signal(_signal.SIGURG, _kicked)
    if not _hooked:
        _hooked = True
        os.register_at_fork(before=_block_term, after_in_parent=_unblock_term, after_in_child=_term_default)
        sys.unraisablehook = _UnraisableTerminated(sys.unraisablehook)


class _UnraisableTerminated:
    """``sys.unraisablehook``: a Terminated that Python swallowed (see the module's doc)
    ends this worker as SIGTERM would; anything else goes to the hook before it."""

    def __init__(self, before: Callable[[Any], object]) -> None:
        self.before = before

    def __call__(self, unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, Terminated) and os.getpid() == _owner:
            exit_as_killed(exc.signum)
        self.before(unraisable)


def _block_term() -> None:
    try:
        _signal.pthread_sigmask(_signal.SIG_BLOCK, _TERM)
    except Terminated as term:  # its handler ran here, in a hook: it cannot raise past it
        exit_as_killed(term.signum)


def _unblock_term() -> None:
    try:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _TERM)
    except Terminated as term:  # one that came during the fork, pending until now
        exit_as_killed(term.signum)


def _term_default() -> None:
    """In a process the target forked: a SIGTERM that came during the fork is pending, and
    kills it now, as the default would have."""
    if _signal.getsignal(_signal.SIGTERM) is _raise_terminated:
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
    _unblock_term()


def exit_as_killed(signum: int) -> None:
    """End this process as ``signum``'s default action would, so that its parent's wait
    status says "killed by" it (for SIGTERM: exit code -15, reason ``killed by SIGTERM``), as
    for a worker that never had the handler. What the spawner does with an uncaught
    Terminated, once the target's ``finally:`` blocks have run. Never returns.

    The handler goes back to SIG_DFL first (a second SIGTERM now kills at once instead of
    raising into what follows), stdio is flushed (``os._exit`` flushes nothing), the signal
    is unblocked (the target may have blocked it) and sent to ourselves, which delivers it
    before ``kill`` returns. Should it still not have killed us, exit ``128 + signum``, the
    shell's way of saying the same thing.
    """
    if not isinstance(signum, int) or isinstance(signum, bool):  # a hand-made Terminated("x")
        signum = _signal.SIGTERM
    try:
        _signal.signal(signum, _signal.SIG_DFL)
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except BaseException:  # closed, broken pipe: the signal must still end us
                pass
    finally:
        _die_of(signum)


def _die_of(signum: int) -> None:
    try:
        _signal.signal(signum, _signal.SIG_DFL)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, (signum,))
        _signal.raise_signal(signum)  # to this thread, where it is unblocked: delivered before this returns
    finally:
        os._exit(128 + signum)


def ready(**fields: object) -> bool:
    """Tell the supervisor this replica is ready: send ``READY=1`` and one ``KEY=value``
    line per keyword (``ready(status="warmed up")`` adds ``STATUS=warmed up``) to the
    datagram socket ``$NOTIFY_SOCKET``, as ``sd_notify(3)`` does.

    True if the datagram was sent. False, never an exception, when there is nothing to
    tell or no one to tell it to: ``NOTIFY_SOCKET`` unset or empty, an address that is
    neither a path nor ``@abstract``, no socket there, nobody reading, or a receiver whose
    queue stays full for 5 s. A value holding a newline (it would forge another field) or a
    key that is not a word is a programming error: ValueError.
    """
    return sd_notify(os.environ.get("NOTIFY_SOCKET"), **fields)


def listen_sockets() -> list[socket.socket]:
    """The listening sockets of this replica's pool (``--socket``, key ``sockets``), in their
    order there: ``socket.socket`` objects on fds 3, 4, ..., as ``sd_listen_fds(0)`` finds
    them: only when ``$LISTEN_PID`` is this process (a child this worker forks inherits the
    variables, not the right to them) and ``$LISTEN_FDS`` says how many. Made close-on-exec,
    as sd_listen_fds does. An empty list when the pool has none. Each call returns the same
    objects: closing one closes the fd for good.
    """
    global _listening
    pid = os.getpid()
    if _listening is not None and _listening[0] == pid:
        return list(_listening[1])
    try:
        if int(os.environ.get("LISTEN_PID", "")) != pid:
            return []
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    import socket  # only for a worker that has sockets to take

    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + max(0, count)):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))  # family and type read from the fd
    _listening = (pid, socks)
    return list(socks)


def sd_notify(addr: str | None, **fields: object) -> bool:
    """``ready()`` to the notify socket ``addr`` (the daemon's own, which it took out of
    the environment its replicas inherit); the same answers and errors."""
    if not addr:
        return False
    lines = ["READY=1"]
    for key, value in fields.items():
        text = str(value)
        if not key.isidentifier() or "\n" in text:
            raise ValueError(f"ready(): bad field {key}={text!r}")
        if key.upper() != "READY":
            lines.append(f"{key.upper()}={text}")
    if addr[0] == "@":
        target: str | bytes = b"\0" + os.fsencode(addr[1:])  # the abstract namespace
    elif addr[0] == "/":
        target = addr
    else:  # sd_notify refuses relative paths too; vsock: is not supported here
        return False
    import socket  # only when there is someone to notify: a plain import stays light

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(5.0)  # a full receive queue blocks a datagram send: bounded
            sock.sendto("\n".join(lines).encode("utf-8", "surrogateescape"), target)
    except OSError:  # ENOENT, ECONNREFUSED, EACCES, timeout (an OSError)
        return False
    return True
