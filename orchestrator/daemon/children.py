"""The daemon's system children: the watchdog and the manager server.

Each is a ``SystemChild``: started by a function that returns its pid, watched through a
pidfd in the reactor, reaped by us, restarted after a ``Backoff`` when it dies on its own
(one that crash-loops or cannot be started at all, EAGAIN under a process limit, is retried
ever more slowly and said so in the log, never in a tight loop and never by ending the
loop; a start runs on the fds the daemon keeps for its control plane, limits.py), and stopped with one ladder: ask it to exit, wait, SIGKILL, wait, every wait bounded.

The manager's bridge lives here too: the two pipes between the daemon and the manager
server (see channel.py for the picture), as a reader of command frames and a buffered
writer of replies in the reactor.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypedDict

from watchdog.identity import start_time

from ..errors import FrameTooLarge
from ..interpreter import python_argv
from ..protocol import FrameReader, Reply, ReplyTo, encode_frame, error
from ..states import exit_reason
from .osapi import OSApi
from .reactor import BufferedWriter, Reactor

if TYPE_CHECKING:
    from watchdog.link import WatchdogLink

    from .journal import Journal
    from .limits import FdReserve

log = logging.getLogger("orchestrator")


class Backoff:
    """Delays before a restart: exponential from ``first`` to ``cap`` with jitter, back to
    nothing once a child has stayed up ``stable_after`` seconds."""

    def __init__(self, first: float = 0.1, cap: float = 30.0, stable_after: float = 10.0) -> None:
        self.first, self.cap, self.stable_after = first, cap, stable_after
        self.current = 0.0

    def next(self, ran_for: float) -> float:
        """The delay before the next start, given how long the last one ran."""
        if ran_for >= self.stable_after:
            self.current = 0.0
            return 0.0
        self.current = min(max(2 * self.current, self.first), self.cap)
        return self.current * random.uniform(0.8, 1.2)  # restarts of many daemons do not align

    def failed_to_start(self) -> float:
        return self.next(0.0)


class SystemChild:
    """One supervised system process. ``spawn()`` starts it and returns its pid;
    ``on_exit(pid, code)`` is told of every exit (code None: reaped elsewhere)."""

    def __init__(
        self,
        name: str,
        reactor: Reactor,
        os_api: OSApi,
        spawn: Callable[[], int],
        on_exit: Callable[[int, int | None], None] | None = None,
        backoff: Backoff | None = None,
        on_down: Callable[[str], None] | None = None,
        reserve: FdReserve | None = None,
    ) -> None:
        self.name = name
        self.reactor = reactor
        self.os = os_api
        self._spawn = spawn
        self._on_exit = on_exit
        self._on_down = on_down  # told why it is not running, each time it stops or cannot start
        self.backoff = backoff or Backoff()
        # limits.FdReserve: a start runs on the fds kept for the control plane, so that it
        # works when replicas (or anything else) have filled the fd table.
        self._reserve = reserve
        self.pid: int | None = None
        self._pidfd: int | None = None
        self._started = 0.0
        self.stopping = False

    def start(self) -> bool:
        """Start it now; on failure schedule a retry and return False."""
        if self.stopping or self.pid is not None:
            return self.pid is not None
        self._started = self.reactor.monotonic()
        with self._reserve.spent() if self._reserve is not None else contextlib.nullcontext():
            try:
                pid = self._spawn()
            except OSError as err:  # EAGAIN at a process limit, EMFILE at the fd limit: retried
                delay = self.backoff.failed_to_start()
                log.error("cannot start the %s (%s); retrying in %.1f s", self.name, err.strerror or err, delay)
                self._down(f"cannot start the {self.name}: {err.strerror or err}")
                self.reactor.call_later(delay, self.start)
                return False
            self.pid = pid
            try:
                self._pidfd = self.os.pidfd(pid)
            except OSError as err:  # EMFILE: it cannot be watched, so it must not run unwatched
                log.error("cannot watch the %s (%s): ending it", self.name, err.strerror or err)
                self._down(f"cannot watch the {self.name}: {err.strerror or err}")
                self.os.kill_child(pid, signal.SIGKILL)
                self._reaped(quiet=True)
                return False
        self.reactor.add_reader(self._pidfd, self.exited)
        return True

    def adopt(self, pid: int) -> None:
        """Supervise ``pid``, a child an earlier image of this daemon started (an upgrade):
        our child still, unreaped, so its pid cannot have been reused."""
        self.pid = pid
        self._started = self.reactor.monotonic()
        self._pidfd = self.os.pidfd(pid)
        self.reactor.add_reader(self._pidfd, self.exited)

    def _down(self, reason: str) -> None:
        if self._on_down is not None:
            self._on_down(reason)

    def owns(self, pid: int) -> bool:
        return pid == self.pid

    def exited(self) -> None:
        """It has exited (its pidfd said so, or a SIGCHLD scan found it): reap, restart."""
        if self.pid is not None:
            self._reaped()

    def _reaped(self, quiet: bool = False) -> None:
        pid, fd = self.pid, self._pidfd
        self.pid = self._pidfd = None
        if fd is not None:
            self.reactor.remove_reader(fd)
            os.close(fd)
        code = self.os.reap(pid) if pid is not None else None
        if self._on_exit is not None and pid is not None:
            self._on_exit(pid, code)
        if self.stopping:
            return
        delay = self.backoff.next(self.reactor.monotonic() - self._started)
        if not quiet:  # else its caller said why already
            how = exit_reason(code) if code is not None else "status unknown"
            log.warning("%s exited (%s); starting a new one in %.1f s", self.name, how, delay)
            self._down(f"the {self.name} exited ({how})")
        self.reactor.call_later(delay, self.start)

    def stop(self, ask: Callable[[], None] | None, timeout: float) -> None:
        """Ask it to exit (``ask``), wait up to ``timeout``, then SIGKILL it (still our
        unreaped child, so the pid is pinned) and wait again, bounded. No restart after."""
        self.stopping = True
        if self.pid is None:
            return
        if ask is not None:
            ask()
        if not self.reactor.run_until(lambda: self.pid is None, timeout) and self.pid is not None:
            self.os.kill_child(self.pid, signal.SIGKILL)
            self.reactor.run_until(lambda: self.pid is None, 2.0)


class WatchdogChild(SystemChild):
    """The watchdog: a restarted one gets the whole ledger replayed (WatchdogLink keeps
    it) into its new pipe, which the reactor then flushes."""

    def __init__(self, link: WatchdogLink, reactor: Reactor, os_api: OSApi, reserve: FdReserve | None = None) -> None:
        self.link = link
        super().__init__("watchdog", reactor, os_api, self._spawn_link, reserve=reserve)

    def _spawn_link(self) -> int:
        self.reactor.remove_writer(self.link)  # a new watchdog comes with a new pipe
        pid = self.link.start()
        self.reactor.add_writer(self.link)
        return pid

    def carried(self) -> dict[str, Any]:
        """What an upgrade carries: the watchdog, its feed (made inheritable) and the ledger."""
        return {"pid": self.pid, **self.link.carried()}

    def take_over(self, carried: Mapping[str, Any]) -> None:
        self.link.adopt(carried)
        self.reactor.add_writer(self.link)
        self.adopt(int(carried["pid"]))

    def stop_quietly(self, timeout: float = 2.0) -> None:
        """A clean stop is no crash: tell it to exit without sweeping, and reap it."""

        def ask() -> None:
            self.reactor.remove_writer(self.link)
            self.link.stop()

        self.stop(ask, timeout)


class ManagerCarried(TypedDict):
    """The manager server as an upgrade carries it across the exec (JSON)."""

    pid: int
    cmd_fd: int  # the command pipe's read end, inheritable
    reply_fd: int  # the reply pipe's write end, inheritable
    ready: bool
    partial: str  # hex: the bytes of a command frame half read
    unsent: str  # hex: replies not written yet


class ManagerBridge:
    """The manager server (``python -m orchestrator.manager.server``) and the two pipes to it:
    command frames in, reply frames out, neither ever blocking the loop.

    While it is down, nobody can ask the daemon why: the reason (it exited, or cannot be
    started: EMFILE, EAGAIN) goes to the journal as a ``manager`` event, ``{"up": false,
    "reason": ...}``, and ``{"up": true}`` once a new one is ready; ``health`` and the
    client read it from there (``channel.manager_down``)."""

    # The command channel is how an operator reaches the daemon at all: a manager that
    # could not start is retried at least this often, so it is back soon after the fault.
    BACKOFF_CAP = 5.0
    NOT_STARTED = "not started yet"

    def __init__(self, state_dir: Path, reactor: Reactor, os_api: OSApi,
                 handle: Callable[[Any, ReplyTo], None], watchdog: WatchdogLink | None = None,
                 journal: Journal | None = None, reserve: FdReserve | None = None) -> None:
        self.state_dir = state_dir
        self.reactor = reactor
        self._handle = handle
        self._watchdog = watchdog
        self._journal = journal
        self.ready = False
        self.down_reason: str | None = self.NOT_STARTED  # journaled as up once it is ready
        self._cmd_fd: int | None = None
        self._reply: BufferedWriter | None = None
        self._frames = FrameReader()
        self.child = SystemChild("manager server", reactor, os_api, self._spawn, self._exited,
                                 backoff=Backoff(cap=self.BACKOFF_CAP), on_down=self._down, reserve=reserve)

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def start(self) -> None:
        self.child.start()

    def carried(self) -> ManagerCarried | None:
        """What an upgrade carries: the manager, its pipes (made inheritable), the bytes of a
        command frame half read and of replies not written yet. None if there is none."""
        if self.pid is None or self._cmd_fd is None or self._reply is None:
            return None
        os.set_inheritable(self._cmd_fd, True)
        os.set_inheritable(self._reply.fd, True)
        return {"pid": self.pid, "cmd_fd": self._cmd_fd, "reply_fd": self._reply.fd, "ready": self.ready,
                "partial": bytes(self._frames._buf).hex(), "unsent": self._reply.pending_bytes().hex()}

    def take_over(self, carried: Mapping[str, Any] | None) -> None:
        """The manager an earlier image of the daemon ran, with its pipes; commands sent
        during the exec wait in them and are read now. None: start one."""
        if carried is None:
            self.start()
            return
        cmd_r, reply_w = int(carried["cmd_fd"]), int(carried["reply_fd"])
        for fd in (cmd_r, reply_w):
            os.set_inheritable(fd, False)
        os.set_blocking(cmd_r, False)
        self._cmd_fd = cmd_r
        self._frames = FrameReader()
        self._frames._buf += bytes.fromhex(carried["partial"])
        self._reply = BufferedWriter(reply_w)
        self._reply.write(bytes.fromhex(carried["unsent"]))
        self.ready = bool(carried["ready"])
        if self.ready:
            self.down_reason = None
        self.reactor.add_reader(cmd_r, functools.partial(self._on_commands, cmd_r))
        self.reactor.add_writer(self._reply)
        self.child.adopt(int(carried["pid"]))

    def reply_to(self) -> ReplyTo:
        """How a command from the manager is answered (an upgrade carries open waits)."""
        return self._reply_frame

    def _down(self, reason: str) -> None:
        if reason != self.down_reason:  # a retry that fails the same way is no news
            self.down_reason = reason
            if self._journal is not None:
                self._journal.event("manager", {"up": False, "reason": reason})

    def _spawn(self) -> int:
        (self.state_dir / "control.sock").unlink(missing_ok=True)  # a killed manager leaves it
        opened: list[int] = []
        try:  # at the fd limit any of these fails: what the attempt opened is closed again
            cmd_r, cmd_w = os.pipe()
            opened += (cmd_r, cmd_w)
            reply_r, reply_w = os.pipe()
            opened += (reply_r, reply_w)
            os.set_inheritable(cmd_w, True)
            os.set_inheritable(reply_r, True)
            # -P: on the standard path only, never from a directory the daemon did not choose
            argv = python_argv("-m", "orchestrator.manager.server", "--state-dir", str(self.state_dir),
                               "--parent-pid", str(os.getpid()), "--cmd-fd", str(cmd_w), "--reply-fd", str(reply_r))
            pid = os.posix_spawn(sys.executable, argv, os.environ)
        except OSError:
            for fd in opened:
                os.close(fd)
            raise
        os.close(cmd_w)
        os.close(reply_r)
        self.ready = False
        self._frames = FrameReader()
        os.set_blocking(cmd_r, False)
        self._cmd_fd = cmd_r
        self._reply = BufferedWriter(reply_w)
        self.reactor.add_reader(cmd_r, functools.partial(self._on_commands, cmd_r))
        self.reactor.add_writer(self._reply)
        if self._watchdog is not None:
            start = start_time(pid)
            if start is not None:
                self._watchdog.add(pid, start, None, "process", "manager")
        return pid

    def _reply_frame(self, msg: Reply) -> None:
        if self._reply is None:
            return
        try:
            frame = encode_frame(msg, "the reply")
        except ValueError as err:  # too large to send (or NaN): its caller gets why, at once
            frame = encode_frame(error(msg.get("id"), err if isinstance(err, FrameTooLarge) else str(err)))
        self._reply.write(frame)

    def _on_commands(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:  # the manager is gone; its pidfd brings the restart
            self.close_pipes()
            return
        for cmd in self._frames.feed(data):
            if isinstance(cmd, dict) and cmd.get("op") == "_ready" and "id" not in cmd:  # the manager's own
                self.ready = True
                if self.down_reason is not None:  # also at start: a dead daemon's "down" is no longer true
                    if self.down_reason != self.NOT_STARTED:
                        log.info("the manager server is back (pid %s)", self.pid)
                    self.down_reason = None
                    if self._journal is not None:
                        self._journal.event("manager", {"up": True, "pid": self.pid})
                continue
            self._handle(cmd, self._reply_frame)

    def close_pipes(self) -> None:
        """EOF on its reply pipe: a manager exits by itself when it sees it."""
        if self._cmd_fd is not None:
            self.reactor.remove_reader(self._cmd_fd)
            os.close(self._cmd_fd)
            self._cmd_fd = None
        if self._reply is not None:
            self.reactor.remove_writer(self._reply)
            self._reply.close()
            self._reply = None

    def _exited(self, pid: int, code: int | None) -> None:
        self.close_pipes()
        self.ready = False
        if self._watchdog is not None:
            self._watchdog.remove(pid)

    def stop(self, timeout: float = 5.0) -> None:
        self.child.stop(self.close_pipes, timeout)
