"""The daemon's side of the spawner processes: ``Spawners`` starts, supervises and asks them.

Run by the daemon (and the embedded ``Orchestrator``'s loop), the launcher: the process
whose children the replicas are. What a spawner is and why: spawner.py, the spawner
process's own side. Here: one ``Spawner`` per process (a system child of the launcher,
restarted with the shared backoff), its requests (``begin``/``end``, pipelined: a turn's
batch is sent, then its answers read), a lost or stalled one killed and its unanswered
children reaped (``reap_lost``), and ``Spawners``, the default spawner and one per
distinct preload. While a spawner is down (restarting, or when clone is refused, e.g. by a
seccomp filter) the launcher forks the plan itself (``OSApi``), as it did before spawners
existed.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import os
import pickle
import select
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Callable, Protocol

from .. import signals
from ..errors import SpawnerLost
from ..interpreter import bootstrap_argv
from ..spawn.spawner import SYS_CLONE, Answer, Hello, Request, recv_frame, send_frame
from ..spec import LaunchPlan, SpawnerKey

if TYPE_CHECKING:
    from watchdog.link import WatchdogLink

    from .osapi import OSApi
    from .reactor import Reactor, Timer

log = logging.getLogger("orchestrator")

_REPLY_TIMEOUT = 5.0  # a spawner that takes longer to fork is treated as lost
_LOST_WAIT = 2.0  # bound on hearing from (and reaping) the child of a lost request
_MAX_PRELOAD_SPAWNERS = 8  # beyond: those pools' replicas import their preload themselves
PRELOAD_TIMEOUT = 60.0  # a preload spawner's imports, when the pool does not say (its ready_timeout)


class Output(Protocol):
    """Where spawners' stdout and stderr go (logcapture's stream of ``logs/spawner.log``)."""

    w: int  # the pipe's write end, put on a spawner's fds 1 and 2

    def finish(self) -> None: ...


class Spawner:
    """One spawner process, supervised as a system child of the launcher."""

    def __init__(self, key: SpawnerKey, reactor: Reactor, os_api: OSApi, watchdog: WatchdogLink | None,
                 env: dict[str, str], preload_timeout: float = PRELOAD_TIMEOUT,
                 output: Callable[[], Output | None] | None = None) -> None:
        from .children import Backoff, SystemChild

        self.key = key
        self.reactor = reactor
        self._watchdog = watchdog
        self._env = env
        self.preload_timeout = preload_timeout
        self._output = output  # the stream its stdout and stderr go to (Spawners': shared, finished there)
        self._stream: Output | None = None
        self.sock: socket.socket | None = None
        self.ready = False
        self.failed = False  # once it has failed, its pool no longer waits for it
        self.refused = False  # clone is not allowed here: fork in the launcher from now on
        # Why its pool's replicas cannot start: its preload did not finish in time (it would
        # hang in each replica too). Cleared once a start of it is ready.
        self.reason: str | None = None
        self._hello_timer: Timer | None = None
        self.on_change: Callable[[], None] | None = None  # told when it becomes ready or fails
        self._seq = 0
        self._inflight: collections.deque[int] = collections.deque()  # sent, not answered yet
        self._answers: dict[int, Answer] = {}  # read ahead of their end(), when it failed
        name = "spawner" + (f" [preload {','.join(key.preload)}]" if key.preload else "")
        self.child = SystemChild(name, reactor, os_api, self._start, self._exited, Backoff())

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def _start(self) -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # -P: not from the directory it starts in (an embedding program's, perhaps another
        # user's): this install's spawner, whatever that directory holds (interpreter.py).
        argv = bootstrap_argv("orchestrator.spawn.spawner")
        try:
            # posix_spawn: vfork-like, so the launcher's size costs nothing and no thread of
            # an embedding program runs in between; the socket lands on fd 3 (dup2 clears
            # its close-on-exec there, so no concurrent fork elsewhere inherits it).
            pid = os.posix_spawn(sys.executable, argv, self._env,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3), *self._stdio()])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.ready = False
        hello: Hello = {"parent": os.getpid(), "sys_path": list(sys.path), "preload": self.key.preload,
                 "pythonpath": self.key.pythonpath, "cwd": self.key.cwd}
        try:
            send_frame(ours, hello)
        except OSError:
            pass  # it died at once: its pidfd brings the restart
        ours.setblocking(False)
        self.reactor.add_reader(ours.fileno(), self._on_hello)
        if self.key.preload:
            self._hello_timer = self.reactor.call_later(self.preload_timeout, self._too_slow)
        if self._watchdog is not None:
            from watchdog.identity import start_time

            start = start_time(pid)
            if start is not None:
                self._watchdog.add(pid, start, None, "process", "spawner")
        return pid

    def _stdio(self) -> list[tuple[int, ...] | tuple[int, int, str, int, int]]:
        """Its stdout and stderr (what a preload prints, a traceback): a rotated stream of
        its own (``logs/spawner.log``), else /dev/null; never the daemon's log."""
        if self._stream is None and self._output is not None:
            try:
                self._stream = self._output()
            except OSError as err:
                log.warning("%s: no log of its own (%s): its output is dropped", self.child.name, err.strerror or err)
        if self._stream is None:
            return [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
        return [(os.POSIX_SPAWN_DUP2, self._stream.w, fd) for fd in (1, 2)]

    def _too_slow(self) -> None:
        """Its preload did not finish in time: kill it (its pidfd restarts it, with the
        backoff) and fail its pool's replicas with the reason until a start of it is ready."""
        self._hello_timer = None
        if self.ready or self.sock is None:
            return
        self.reason = f"preload of {', '.join(self.key.preload)} did not finish within {self.preload_timeout:g} s"
        log.error("%s: %s; killed", self.child.name, self.reason)
        pid = self.child.pid
        if pid is not None:
            self.child.os.kill_child(pid, signal.SIGKILL)
        self._close()
        self.failed = True
        if self.on_change is not None:
            self.on_change()

    def _on_hello(self) -> None:
        """Its first frame: ready (preload imported) or why not. Read once; from then on
        the socket is blocking (bounded by a timeout): begin() sends, end() reads."""
        sock = self.sock
        if sock is None:
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.reactor.remove_reader(sock.fileno())
        try:
            sock.setblocking(True)
            sock.settimeout(_REPLY_TIMEOUT)
            got = recv_frame(sock)
        except (OSError, EOFError, pickle.UnpicklingError):
            got = None
        msg = got[0] if got is not None else None
        if isinstance(msg, dict) and msg.get("ready"):
            self.ready = True
            self.reason = None
            log.debug("%s %d ready", self.child.name, self.pid)
        else:
            if isinstance(msg, dict) and "error" in msg:
                log.error("%s: %s; its pool's replicas import it themselves", self.child.name, msg["error"])
            self._close()  # it died (its pidfd restarts it), or exits after the error
            self.failed = True
        if self.on_change is not None:
            self.on_change()

    def begin(self, plan: LaunchPlan, ready_w: int, pdeathsig: int | None, nofile: tuple[int, int] | None) -> int:
        """Send one request; its answer is ``end(seq)``'s. Requests are pipelined: a batch is
        sent, then its answers read, so the spawner forks while the launcher prepares the
        next plan (one at a time, each launch waited for the fork). SpawnerLost if the
        spawner is gone; ``ready_w`` may be closed once this returns (the message holds it)."""
        if self.sock is None or not self.ready:
            raise SpawnerLost("not running")
        fds = [ready_w] + [fd for fd in (plan.stdout, plan.stderr) if fd is not None] + list(plan.listen_fds)
        request: Request = {"plan": dataclasses.replace(plan, stdout=None, stderr=None, listen_fds=()),
                   "stdout": plan.stdout is not None, "stderr": plan.stderr is not None,
                   "pdeathsig": pdeathsig, "nofile": nofile}
        try:
            send_frame(self.sock, request, fds)
        except OSError as err:  # TimeoutError included: it stopped reading
            self._fail(f"{type(err).__name__}: {err}")
            raise SpawnerLost(str(err)) from None
        self._seq += 1
        self._inflight.append(self._seq)
        return self._seq

    def end(self, seq: int) -> tuple[int, int | None]:
        """(pid, start time in ticks or None) of the child made for request ``seq``: our
        child. OSError: none could be made (EAGAIN...). SpawnerLost: fork it here instead,
        once ``reap_lost`` has dealt with any child that was made."""
        if seq not in self._answers and self._inflight and self._inflight[0] == seq and self.sock is not None:
            try:
                got = recv_frame(self.sock)
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                got, why = None, f"{type(err).__name__}: {err}"
            else:
                why = "it closed its socket"
            if got is not None:
                self._inflight.popleft()
                self._answers[seq] = got[0]
            else:
                self._fail(why)
        reply = self._answers.pop(seq, None)
        if reply is None:
            raise SpawnerLost("no answer")
        if "pid" in reply:
            return reply["pid"], reply["start"]
        if reply.get("refused"):
            self.refused = True
            self._close()
            log.warning("%s: clone(CLONE_PARENT) refused (%s); forking in the launcher from now on",
                        self.child.name, reply["error"])
            raise SpawnerLost(reply["error"])
        raise OSError(reply["errno"], reply["error"])

    def _fail(self, why: str) -> None:
        """It died, or stalled: kill it (our unreaped child: its pid is pinned), then read
        what it answered before it died; a pid there is a child it may have let run, ours
        now. The requests left unanswered are lost: their children never run."""
        log.warning("%s lost during a launch (%s); forking in the launcher until it is back", self.child.name, why)
        pid = self.child.pid
        if pid is not None:
            self.child.os.kill_child(pid, signal.SIGKILL)
        sock = self.sock
        try:
            if sock is not None:
                sock.settimeout(_LOST_WAIT)
                while self._inflight:
                    got = recv_frame(sock)
                    if got is None:
                        break
                    self._answers[self._inflight.popleft()] = got[0]
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
        self._inflight.clear()
        self._close()

    def reap_lost(self, ready_r: int) -> None:
        """After SpawnerLost, with every other write end of the ready pipe closed: a child the
        lost spawner made but never let go says ``lost PID`` and exits 127; reap it. EOF at
        once: no child was made. Bounded."""
        deadline = time.monotonic() + _LOST_WAIT
        data = b""
        while len(data) < 64 and (left := deadline - time.monotonic()) > 0:
            if not select.select([ready_r], [], [], left)[0]:
                break
            chunk = os.read(ready_r, 64)
            if not chunk:
                break
            data += chunk
        if data.startswith(b"lost "):
            try:
                pid = int(data.split()[1].rstrip(b":"))
                # Our unreaped child (CLONE_PARENT): its pid is pinned. It is exiting by
                # itself; SIGKILL makes the wait for it bounded whatever it was doing.
                signals.to_child(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ValueError, IndexError, ProcessLookupError, ChildProcessError):
                pass

    def _close(self) -> None:
        self.ready = False
        if self.sock is not None:
            try:
                self.reactor.remove_reader(self.sock.fileno())
            except (KeyError, ValueError, OSError):
                pass
            self.sock.close()
            self.sock = None

    def _exited(self, pid: int, code: int | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self._close()
        if self._watchdog is not None:
            self._watchdog.remove(pid)
        if not self.failed and not self.child.stopping:
            self.failed = True  # a pool waits for its first start only
            if self.on_change is not None:
                self.on_change()

    def stop(self, timeout: float = 2.0) -> None:
        """EOF on its socket: a spawner exits by itself when it reads it."""
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.child.stop(self._close, timeout)


class Hold(enum.Enum):
    """pick(): wait for this pool's preload spawner to be ready (one value: ``HOLD``)."""

    HOLD = "hold"


HOLD = Hold.HOLD
HOLD_REASON = "waiting for preload spawner"  # a held replica's reason while it is PENDING


@dataclasses.dataclass(frozen=True, slots=True)
class Unavailable:
    """pick(): this pool's replicas cannot start now (``reason``): they fail with it."""

    reason: str


class Spawners:
    """The launcher's spawners: the default one, and one per distinct preload."""

    def __init__(self, reactor: Reactor, os_api: OSApi, watchdog: WatchdogLink | None, env: dict[str, str],
                 on_change: Callable[[], None] | None = None,
                 output: Callable[[], Output | None] | None = None) -> None:
        self.reactor, self.os, self.watchdog, self.env = reactor, os_api, watchdog, env
        self.on_change = on_change
        self.output = output  # a stream for the spawners' stdout and stderr (made once, shared)
        self._stream: Output | None = None
        self._by_key: dict[SpawnerKey, Spawner] = {}
        self.enabled = SYS_CLONE is not None

    def start(self) -> None:
        """Start the default spawner now (in the loop's thread: PDEATHSIG follows it)."""
        if self.enabled:
            self._get(SpawnerKey())

    def _shared_output(self) -> Output | None:
        if self._stream is None and self.output is not None:
            self._stream = self.output()
        return self._stream

    def _get(self, key: SpawnerKey, preload_timeout: float = PRELOAD_TIMEOUT) -> Spawner | None:
        sp = self._by_key.get(key)
        if sp is None:
            if key.preload and sum(1 for k in self._by_key if k.preload) >= _MAX_PRELOAD_SPAWNERS:
                return None
            sp = self._by_key[key] = Spawner(key, self.reactor, self.os, self.watchdog, self.env, preload_timeout,
                                             self._shared_output if self.output is not None else None)
            sp.on_change = self.on_change
            sp.child.start()
        return sp

    def pick(self, key: SpawnerKey, preload_timeout: float = PRELOAD_TIMEOUT) -> Spawner | Hold | Unavailable | None:
        """The spawner that makes replicas for ``key`` now; None: fork in the launcher (it
        is starting or restarting, or clone is refused here); HOLD: a preload spawner's
        first start, which its pool waits for (else each replica would import it itself,
        all at once: the cost and the memory preload exists to spare), at most
        ``preload_timeout`` seconds (the pool's ready_timeout; given by the pool that
        makes the spawner); Unavailable: its preload did not finish in time (it would hang
        in each replica too). on_change says when to ask again."""
        if not self.enabled:
            return None
        sp = self._get(key, preload_timeout)
        if sp is None:
            return None
        if sp.ready:
            return sp
        if sp.reason is not None:
            return Unavailable(sp.reason)
        if sp.refused:  # this host's seccomp filter, say: no spawner can work here
            self.enabled = False
            self.stop()
        elif key.preload and not sp.failed and sp.pid is not None:
            return HOLD
        return None

    def settled(self) -> bool:
        """The default spawner is ready, or will not be soon (failed, refused, not started)."""
        sp = self._by_key.get(SpawnerKey())
        return not self.enabled or sp is None or sp.ready or sp.failed or sp.pid is None

    def pids(self) -> set[int]:
        """A snapshot (also read from other threads: Orchestrator.spawner_pids)."""
        return {pid for sp in list(self._by_key.values()) if (pid := sp.pid) is not None}

    def exited(self, pid: int) -> bool:
        """A SIGCHLD scan found ``pid`` exited: True if it was one of ours (now handled)."""
        for sp in self._by_key.values():
            if sp.child.owns(pid):
                sp.child.exited()
                return True
        return False

    def stop(self) -> None:
        for sp in self._by_key.values():
            sp.stop()
        if self._stream is not None:
            self._stream.finish()
            self._stream = None
