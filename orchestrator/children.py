"""The daemon's system children: the watchdog and the manager server.

Each is a ``SystemChild``: started by a function that returns its pid, watched through a
pidfd in the reactor, reaped by us, restarted after a ``Backoff`` when it dies on its own
(one that crash-loops or cannot be started at all, EAGAIN under a process limit, is retried
ever more slowly and said so in the log, never in a tight loop and never by ending the
loop), and stopped with one ladder: ask it to exit, wait, SIGKILL, wait, every wait bounded.

The manager's bridge lives here too: the two pipes between the daemon and the manager
server (see channel.py for the picture), as a reader of command frames and a buffered
writer of replies in the reactor.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from watchdog.identity import start_time

from .protocol import FrameReader, encode_frame
from .reactor import BufferedWriter, Reactor
from .spawner import OSApi, exit_reason

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
    ) -> None:
        self.name = name
        self.reactor = reactor
        self.os = os_api
        self._spawn = spawn
        self._on_exit = on_exit
        self.backoff = backoff or Backoff()
        self.pid: int | None = None
        self._pidfd: int | None = None
        self._started = 0.0
        self.stopping = False

    def start(self) -> bool:
        """Start it now; on failure schedule a retry and return False."""
        if self.stopping or self.pid is not None:
            return self.pid is not None
        self._started = self.reactor.monotonic()
        try:
            pid = self._spawn()
        except OSError as err:
            delay = self.backoff.failed_to_start()
            log.error("cannot start the %s (%s); retrying in %.1f s", self.name, err.strerror or err, delay)
            self.reactor.call_later(delay, self.start)
            return False
        self.pid = pid
        try:
            self._pidfd = self.os.pidfd(pid)
        except OSError:  # EMFILE: it cannot be watched, so it must not run unwatched
            self.os.kill_child(pid, signal.SIGKILL)
            self._reaped()
            return False
        self.reactor.add_reader(self._pidfd, self.exited)
        return True

    def owns(self, pid: int) -> bool:
        return pid == self.pid

    def exited(self) -> None:
        """It has exited (its pidfd said so, or a SIGCHLD scan found it): reap, restart."""
        if self.pid is not None:
            self._reaped()

    def _reaped(self) -> None:
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
        log.warning("%s exited (%s); starting a new one in %.1f s", self.name,
                    exit_reason(code) if code is not None else "status unknown", delay)
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

    def __init__(self, link: Any, reactor: Reactor, os_api: OSApi) -> None:
        self.link = link
        super().__init__("watchdog", reactor, os_api, self._spawn_link)

    def _spawn_link(self) -> int:
        self.reactor.remove_writer(self.link)  # a new watchdog comes with a new pipe
        pid = self.link.start()
        self.reactor.add_writer(self.link)
        return pid

    def stop_quietly(self, timeout: float = 2.0) -> None:
        """A clean stop is no crash: tell it to exit without sweeping, and reap it."""

        def ask() -> None:
            self.reactor.remove_writer(self.link)
            self.link.stop()

        self.stop(ask, timeout)


class ManagerBridge:
    """The manager server (``python -m orchestrator.manager``) and the two pipes to it:
    command frames in, reply frames out, neither ever blocking the loop."""

    def __init__(self, state_dir: Path, reactor: Reactor, os_api: OSApi,
                 handle: Callable[[dict, Callable[[dict], None]], None], watchdog: Any = None) -> None:
        self.state_dir = state_dir
        self.reactor = reactor
        self._handle = handle
        self._watchdog = watchdog
        self.ready = False
        self._cmd_fd: int | None = None
        self._reply: BufferedWriter | None = None
        self._frames = FrameReader()
        self.child = SystemChild("manager server", reactor, os_api, self._spawn, self._exited)

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def start(self) -> None:
        self.child.start()

    def _spawn(self) -> int:
        (self.state_dir / "control.sock").unlink(missing_ok=True)  # a killed manager leaves it
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        os.set_inheritable(cmd_w, True)
        os.set_inheritable(reply_r, True)
        argv = [sys.executable, "-m", "orchestrator.manager", "--state-dir", str(self.state_dir),
                "--parent-pid", str(os.getpid()), "--cmd-fd", str(cmd_w), "--reply-fd", str(reply_r)]
        try:
            pid = os.posix_spawn(sys.executable, argv, os.environ)
        except OSError:
            for fd in (cmd_r, reply_w):
                os.close(fd)
            raise
        finally:
            os.close(cmd_w)
            os.close(reply_r)
        self.ready = False
        self._frames = FrameReader()
        os.set_blocking(cmd_r, False)
        self._cmd_fd = cmd_r
        self._reply = BufferedWriter(reply_w)
        self.reactor.add_reader(cmd_r, self._on_commands)
        self.reactor.add_writer(self._reply)
        if self._watchdog is not None:
            start = start_time(pid)
            if start is not None:
                self._watchdog.add(pid, start, None, "process", "manager")
        return pid

    def _reply_frame(self, msg: dict) -> None:
        if self._reply is not None:
            self._reply.write(encode_frame(msg))

    def _on_commands(self) -> None:
        try:
            data = os.read(self._cmd_fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:  # the manager is gone; its pidfd brings the restart
            self.close_pipes()
            return
        for cmd in self._frames.feed(data):
            if isinstance(cmd, dict) and cmd.get("op") == "_ready" and "id" not in cmd:  # the manager's own
                self.ready = True
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
