"""`orchestrator upgrade`: the daemon re-executes itself in place, as `systemctl daemon-reexec`.

    upgrade (a command) ──► the new code tried in a separate process: ``python -P -m
        │                   orchestrator.daemon.main --check 4`` imports the daemon's
        │                   modules and every program it starts (manager server,
        │                   watchdog, spawner, task worker) and says whether it reads
        │                   hand-over version 4 (no: the command's one-line error,
        │                   nothing touched)
        ├─► quiesce: new spawns held, wait (bounded) until no ended replica's tree is
        │   still draining (no: refused, the spawns go on)
        ├─► between two turns: probes, timers and notify sockets released, the spawners
        │   stopped, one store commit, the store closed; the fds that carry over made
        │   inheritable; the hand-over document written to a memfd; TERM/INT/HUP/CHLD
        │   blocked (the mask survives exec, handlers do not)
        └─► execve(python -m orchestrator.daemon.main --handover FD): same pid, so every
            replica stays our child (no PR_SET_PDEATHSIG fires: the daemon is one thread,
            which does not exit), the watchdog's pidfd does not fire, the pid file's lock
            (a process's, on a carried fd) is kept; the new image rebuilds (``Daemon``
            with ``handover``), unblocks the signals, and answers the upgrade command.

What carries over, by fd (``HANDOVER`` version 4): the pid file's lock, the watchdog's feed
pipe (and its ledger, to replay to a restarted watchdog), the manager's two pipes (and the
bytes of a frame half read or half written), each replica's log pipes (read ends), its
ready pipe while its exec is not confirmed, its notify socket (a ``READY=1`` sent during the
exec waits in it), the pools' listening sockets and systemd's, the metrics listener, the
task listener and each executor worker's connection and cancel words (tasks.py), the HTTP
control plane's listeners and the connections of its commands whose answer is to come (the
upgrade's own, open waits: httpapi.py; its event and log streams end cleanly just before the
exec, and a client resumes with Last-Event-ID). By value:
what the store does not hold (each pool's restart bookkeeping and scheduled replacements, a
STOPPING replica's SIGKILL deadline, a STARTING replica's wait for readiness as it stands
(readiness.py: its start_secs, probe or notify deadline, and when its probe's next attempt
is due), the descendants that left a stopped replica's process group with their SIGKILL
deadlines (containment.py), open ``wait``s, the daemon's settings, start time and token;
the unfinished tasks with their payloads and timeouts, and the events a client has not
polled yet). Rebuilt: the store (reopened), the spawners, pidfds (``pidfd_open`` of our own
unreaped children: a zombie pins its pid), liveness probes and healthy_after timers (from
the replica's start), the signal pipe, the loop-lag monitor and the metrics counters. An
attempt of a probe in flight at the exec is cut short (killed whole) and made again at once
by the new image, within the same deadline. Monotonic deadlines survive exec (one clock for
the whole machine). Version 2 adds the STARTING replicas, ready pipes, notify sockets and
escaped descendants to version 1 (whose images waited until nothing was STARTING); version 3
adds tasks that wait for a time (WAITING, with their deadline, backoff and wait: an image
before it cannot take one, so its ``--check`` refuses the hand-over); version 4 adds the HTTP
listeners (an image before it would bind their addresses again while the carried fds hold
them); this code reads all four.

Not carried, so refused with one line: a rollout, a reload's ordered delete or a waiting
``stop``/``start`` of pools in flight (each is a sequence of steps the new image would
have to resume half way). A replica reaped whose cgroup has not emptied yet is waited for:
its end is recorded once the cgroup is empty, which containment.py bounds (DRAIN_TIMEOUT,
well inside QUIESCE_TIMEOUT). No spawn is ever in flight between two turns (a batch is asked and answered within one callback,
and spawns are held from the check on: the PENDING replicas carry as such). A client's
poll for task events and a `result --wait` are answered just before the exec (with nothing
new); both ask again, and the next image answers.

If the exec itself fails the old image resumes (store reopened, spawners and probes
restarted). If the new image fails while taking over, it exits: the watchdog sees its
daemon die and sweeps every replica, as after a ``kill -9``, and the next ``start``
records them LOST. The ``--check`` step runs the same imports and reads the same version
first, which is what makes that case rare.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import signal
import sys
import time
from typing import Any, Callable

from .. import protocol
from ..errors import OrchestratorError
from ..interpreter import python_argv
from ..states import ReplicaState as S
from ..store import StoreError
from ..version import __version__

log = logging.getLogger("orchestrator")

HANDOVER = 4  # the format this code writes
# the formats this code reads (1: no STARTING replica in it; 2: no WAITING task; 3: no HTTP listener)
SUPPORTED = frozenset({1, 2, 3, 4})
CHECK_TIMEOUT = 30.0  # the --check process: imports only, normally well under a second
QUIESCE_TIMEOUT = 10.0  # draining trees, before an upgrade is refused
BLOCKED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)  # kept pending across the exec
INTERRUPTED = "interrupted by an upgrade"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')  # a traceback's frame line


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def write_document(doc: dict[str, Any]) -> int:
    """The document in an inheritable memfd, rewound; its fd."""
    fd = os.memfd_create("orchestrator-handover", 0)  # no MFD_CLOEXEC: it is for the next image
    try:
        os.write(fd, json.dumps(doc).encode())
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_document(fd: int) -> dict[str, Any]:
    """The hand-over document of ``fd`` (closed here); ValueError if it cannot be read."""
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    doc = json.loads(b"".join(chunks))
    if not isinstance(doc, dict) or doc.get("handover") not in SUPPORTED:
        raise ValueError(f"unsupported hand-over version {doc.get('handover') if isinstance(doc, dict) else None!r}")
    return doc


def check_command(version: int) -> list[str]:
    """The --check process's argv: the interpreter on the code installed now, importing
    every daemon module as the new image would (``-P``: never from the daemon's cwd)."""
    return python_argv("-m", "orchestrator.daemon.main", "--check", str(version))


# Every program the daemon starts, by the module its process runs (or, for the task worker,
# imports once forked), and the third-party modules they load later than at import. The
# daemon's own modules come first: main.py imports them before --check is even read.
PROGRAMS = (("the manager server", "orchestrator.manager.server"), ("the watchdog", "watchdog.__main__"),
            ("the spawner", "orchestrator.spawn.spawner"), ("the task worker", "orchestrator.taskworker"),
            ("the spawner", "dill"))


def _unimportable() -> str | None:
    """One line naming the first program (or daemon module imported only when needed) that
    the installed code cannot import, and why; None if each of them imports."""
    import importlib
    import pkgutil

    from . import __path__ as daemon_path

    lazy = [("the daemon", f"orchestrator.daemon.{m.name}") for m in pkgutil.iter_modules(daemon_path)]
    for program, module in (*lazy, *PROGRAMS):
        try:
            importlib.import_module(module)
        except (Exception, SystemExit) as err:  # whatever a broken module raises: its one line
            why = f"{type(err).__name__}: {err}".replace("\n", " ")
            return f"{program} cannot start: {module} does not import: {why}"
    return None


def check(version: str) -> int:
    """The --check process's answer, once it has imported what the new image runs (main.py
    calls this from its ``--check``, so that a daemon module that does not import is found
    first; then every other program the daemon starts, ``PROGRAMS``: an install whose
    manager, watchdog, spawner or task worker cannot start is refused before the exec)."""
    broken = _unimportable()
    if broken is not None:
        print(broken, flush=True)
        return 1
    if not (version.isascii() and version.isdigit()) or int(version) not in SUPPORTED:
        print(f"the installed code {__version__} cannot read hand-over version {version} "
              f"(it reads {', '.join(map(str, sorted(SUPPORTED)))})", flush=True)
        return 1
    print(f"ok {__version__}", flush=True)
    return 0


class Checker:
    """Runs the --check process without blocking the loop: its output through a pipe in the
    reactor, its end at EOF (the daemon's SIGCHLD scan reaps it as an orphan), bounded."""

    def __init__(self, reactor: Any, done: Callable[[str | None, str], None]) -> None:
        """``done(error, version)``: error None when the new code can take over."""
        self.reactor = reactor
        self._done: Callable[[str | None, str], None] | None = done
        self._out = bytearray()
        r, w = os.pipe()
        try:
            os.set_inheritable(w, True)
            self.pid = os.posix_spawn(
                sys.executable, check_command(HANDOVER), os.environ,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_DUP2, w, 2)],
                setsigmask=(), setsigdef=BLOCKED)
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        os.set_blocking(r, False)
        self._fd = r
        try:  # what the timeout signals: never a pid that the SIGCHLD scan reaped and the kernel reused
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:
            os.close(r)
            raise
        reactor.add_reader(r, self._readable)
        self._timer = reactor.call_later(CHECK_TIMEOUT, self._timed_out)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self._out += data[: max(0, 65536 - len(self._out))]
            return
        lines = [ln.strip() for ln in self._out.decode("utf-8", "replace").splitlines() if ln.strip()]
        last = lines[-1] if lines else "the check exited without a word"
        if last.startswith("ok "):
            self._finish(None, last[3:])
            return
        # Its own reason, or the last line of a traceback: the exception that ended the
        # import, and where (the innermost frame: the module that does not import).
        frame = next((m for ln in reversed(lines) if (m := _FRAME.match(ln))), None)
        where = f" (at {frame.group(1)}:{frame.group(2)})" if frame is not None and frame.group(1) not in last else ""
        self._finish(f"the installed code cannot take over: {last}{where}", "")

    def _timed_out(self) -> None:
        from .. import signals

        signals.to_pidfd(self._pidfd, signal.SIGKILL)
        self._finish(f"the installed code's check did not answer within {CHECK_TIMEOUT:g} s", "")

    def _finish(self, error: str | None, version: str) -> None:
        done, self._done = self._done, None
        if done is None:
            return
        self._timer.cancel()
        self.reactor.remove_reader(self._fd)
        os.close(self._fd)
        os.close(self._pidfd)
        done(error, version)


class Upgrade:
    """One ``upgrade`` in the old image: the check, the quiesce, the exec. The daemon calls
    ``execute()`` between two turns once ``quiesced``."""

    def __init__(self, daemon: Any, reply: Callable[[dict[str, Any]], None], cmd_id: Any) -> None:
        self.daemon = daemon
        self.engine = daemon.engine
        self.reply = reply
        self.cmd_id = cmd_id
        self.quiesced = False
        self._waiting = False
        self._deadline: Any = None
        self._readiness: dict[int, dict[str, Any] | None] = {}  # pid -> what readiness handed over (for a failed exec)
        why = self._refusal()
        if why is not None:
            self._refused(why, answered=False)
            raise OrchestratorError(f"upgrade refused: {why}")
        try:
            Checker(self.engine.reactor, self._checked)
        except OSError as err:
            why = f"cannot run the installed code's check: {err.strerror or err}"
            self._refused(why, answered=False)
            raise OrchestratorError(f"upgrade refused: {why}") from None
        log.info("upgrade: checking the installed code")

    def _refusal(self) -> str | None:
        """What this image cannot carry over now, in one line; None: nothing."""
        engine = self.engine
        if engine.closing:
            return "the daemon is shutting down"
        if engine.supervisor.rollouts():
            return "a rolling restart is in progress; try again once it has ended"
        manager = self.daemon.manager
        if manager is None or manager.pid is None:
            return "the manager server is not running"
        reply_to = manager.reply_to()
        http = self.daemon.http_api
        carried = [reply_to] + ([] if http is None else [w.reply for w in engine.waiters() if http.key_of(w.reply)])
        if any(w.reply not in carried or w.deadline is None for w in engine.waiters()):
            # (a reload's ordered delete, or a stop or start of pools with --wait: an HTTP
            # client's own wait is carried, as the channel's is)
            return "a reload or a pool's stop or start is still waiting for replicas; try again once it has ended"
        return None

    def _refused(self, why: str, *, answered: bool = True) -> None:
        """Refused: nothing was touched; the spawns held meanwhile go on."""
        log.warning("upgrade refused: %s", why)
        self.engine.journal.event("upgrade", {"from": __version__, "refused": why})
        self.engine.spawning.hold(False)
        if self._deadline is not None:
            self._deadline.cancel()
        self.daemon.upgrade = None
        if answered:
            self.engine.reply(self.reply, protocol.error(self.cmd_id, OrchestratorError(f"upgrade refused: {why}")),
                              False)
            self.engine.changed()

    def _checked(self, error: str | None, version: str) -> None:
        if error is not None:
            self._refused(error)
            return
        self.to_version = version
        log.info("upgrade: the installed code %s can take over; holding new spawns", version)
        self.engine.spawning.hold(True)
        self._waiting = True
        self._deadline = self.engine.reactor.call_later(QUIESCE_TIMEOUT, self._too_slow)
        self.look()

    def look(self) -> None:
        """At a turn's end: no tree draining, then the exec is due (a STARTING replica
        carries over: its readiness wait goes on in the next image)."""
        if not self._waiting:
            return
        if self.engine.draining():
            return
        why = self._refusal()
        if why is not None:
            self._waiting = False
            self._refused(why)
            return
        self._waiting = False
        self._deadline.cancel()
        self.quiesced = True

    def _too_slow(self) -> None:
        if not self._waiting:
            return
        self._waiting = False
        self._refused(f"{self.engine.draining()} ended replica(s) whose cgroup still holds processes after "
                      f"{QUIESCE_TIMEOUT:g} s; try again")

    # -- the exec -------------------------------------------------------------------------

    def execute(self) -> None:
        """Between two turns: release, hand over, exec. Returns only if the exec failed."""
        daemon, engine = self.daemon, self.engine
        self.quiesced = False
        started = time.monotonic()
        engine.spawning.stop()  # EOF for them: they exit; the new image starts its own
        engine.tasks.before_handover()  # polls and result waits answered: they ask the next image
        engine.settle()  # one commit, and the replies of what the spawners' stop let in
        # The stop ran turns: a command may have begun what cannot be carried meanwhile.
        why = self._refusal() or ("a replica's tree is still ending" if engine.draining() else None)
        if why is not None:
            self._resume(why)
            return
        err = engine.journal.commit()
        if err is not None:
            self._resume(f"the state could not be saved: {err}")
            return
        doc = self.document()
        for proc in engine.procs():  # probes, timers, notify sockets: the new image makes its own
            keep = daemon.log_capture.finish_of(proc.replica.id) if daemon.log_capture is not None else None
            for release in proc.cleanup:
                if release != keep:
                    release()
            proc.cleanup = [keep] if keep is not None else []
            if proc.probes is not None:
                proc.probes = None
        try:
            engine.journal.store.close()
        except StoreError as store_err:
            log.warning("upgrade: closing the store: %s", store_err)
        fd = -1
        signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
        try:
            fd = write_document(doc)
            argv = python_argv("-m", "orchestrator.daemon.main", "--state-dir", str(daemon.paths.state_dir),
                               "--handover", str(fd))
            log.info("upgrade: exec of %s after %.0f ms of hand-over", self.to_version,
                     (time.monotonic() - started) * 1e3)
            if daemon.log_sink is not None:
                daemon.log_sink.flush()  # best effort: what the pipe takes now
            os.execv(sys.executable, argv)
        except OSError as exec_err:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
            if fd >= 0:
                os.close(fd)
            self._resume(f"exec failed: {exec_err.strerror or exec_err}", reopen=True)

    def _resume(self, why: str, *, reopen: bool = False) -> None:
        """The exec did not happen: this image goes on as it was (the store reopened, the
        spawners and probes started again)."""
        engine = self.engine
        log.error("upgrade: %s; this image goes on", why)
        if self.daemon.http_api is not None:
            self.daemon.http_api.keep()
        if reopen:
            engine.journal.store = self.daemon._new_store()
            for proc in engine.procs():
                if proc.ready_fd >= 0:
                    os.set_inheritable(proc.ready_fd, False)
                engine.supervisor.readiness.resume(proc, self._readiness.get(proc.pid))
        engine.start_spawners()
        self._refused(why)

    def document(self) -> dict[str, Any]:
        """The hand-over: every fd that carries over (made inheritable here) and what the
        store does not hold."""
        daemon, engine = self.daemon, self.engine
        os.set_inheritable(daemon._lock_fd, True)
        replicas, pending = [], []
        for proc in engine.procs():
            rep = proc.replica
            ends = daemon.log_capture.read_ends(rep.id) if daemon.log_capture is not None else None
            for end in ends or ():
                os.set_inheritable(end, True)
            kill = proc.kill_timer.deadline if proc.kill_timer is not None and not proc.kill_timer.cancelled else None
            if proc.ready_fd >= 0:
                os.set_inheritable(proc.ready_fd, True)
            readiness = self._readiness[proc.pid] = engine.supervisor.readiness.hand_over(proc)
            replicas.append({"record": rep.to_record(), "cgroup": proc.cgroup, "logs": list(ends) if ends else None,
                             "kill_deadline": kill, "killed": proc.killed, "escaped": [list(e) for e in proc.escaped],
                             "log_max_bytes": engine.pool(rep.pool).policy.log_max_bytes,
                             "log_backups": engine.pool(rep.pool).policy.log_backups,
                             "ready_fd": proc.ready_fd if proc.ready_fd >= 0 else None, "readiness": readiness})
        for rep in engine.replicas_in(S.PENDING):
            pending.append(rep.to_record())
        metrics = None
        if daemon.metrics_server is not None:
            listener = daemon.metrics_server.listener()
            listener.set_inheritable(True)
            metrics = listener.fileno()
        http = daemon.http_api
        http_doc = http.hand_over([self.reply, *(w.reply for w in engine.waiters())]) if http is not None else None
        containment_doc = {"path": daemon.containment.path, "reason": daemon.containment.reason,
                           "moved_self": getattr(daemon.containment, "moved_self", True),
                           "escapes": daemon.containment.carried()}
        return {
            "handover": HANDOVER, "from": __version__, "pid": os.getpid(),
            "daemon": {"settings": daemon.settings, "started_at": daemon.started_at, "token": engine.config.token,
                       "lock_fd": daemon._lock_fd, "notify": daemon._systemd_notify,
                       "containment": containment_doc, "upgraded_at": daemon.upgraded_at,
                       "nofile": daemon.nofile_before},  # the fd limits replicas get (limits.py)
            "upgrade": {"cmd_id": self.cmd_id, "http": http.key_of(self.reply) if http is not None else None},
            "watchdog": daemon.watchdog.carried(),
            "manager": daemon.manager.carried(),
            "listeners": engine.listeners.carried(),
            "tasks": engine.tasks.carried(),
            "metrics_fd": metrics,
            "http": http_doc,
            "pools": {p.name: p.carried() for p in engine.pools()},
            "supervisor": engine.supervisor.carried(),
            "replicas": replicas,
            "pending": pending,
            "waiters": [{"ids": list(w.ids), "until": w.until, "cmd_id": w.cmd_id, "deadline": w.deadline,
                         "durable": w.durable, "http": http.key_of(w.reply) if http is not None else None}
                        for w in engine.waiters()],
        }


# -- the new image -------------------------------------------------------------------------


def containment_of(carried: dict[str, Any]) -> Any:
    """The containment the earlier image ran under: its subtree opened, or process groups."""
    from watchdog.cgroup import CgroupUnavailable, Subtree

    from . import containment

    if carried.get("path") is None:
        return containment.ProcessGroups(str(carried.get("reason")))
    try:
        subtree = Subtree.open(str(carried["path"]))
    except CgroupUnavailable as err:  # the replicas run in it: without it they cannot be supervised
        raise OrchestratorError(f"upgrade: the cgroup subtree {carried['path']} is gone: {err}") from None
    return containment.Cgroups(subtree, str(carried.get("reason")), moved_self=bool(carried.get("moved_self", True)))


def metrics_listener(doc: dict[str, Any]) -> Any:
    import socket

    fd = doc.get("metrics_fd")
    return socket.socket(fileno=int(fd)) if fd is not None else None


def take_over(daemon: Any, doc: dict[str, Any]) -> None:
    """The pools (from the store, with what the hand-over adds), then every replica:
    PENDING ones queued, live ones watched again with their logs, probes and deadlines."""
    from ..states import Replica

    engine = daemon.engine
    engine.containment.take_over(doc["daemon"].get("containment", {}).get("escapes", []))
    engine.listeners.take_over(doc["listeners"])
    engine.supervisor.restore(daemon.store.load()[0], relaunch=False)
    carried_pools = doc.get("pools", {})
    for pool in engine.pools():
        carried = carried_pools.get(pool.name)
        if carried is None:
            continue
        for slot, deadline in pool.take_over(carried).items():
            engine.supervisor.schedule_replacement(pool, slot, deadline)
        engine.save_pool(pool)  # restore() saved it with no replica yet
    engine.supervisor.take_over(doc.get("supervisor", {}))
    for item in doc["replicas"]:
        rep = Replica.from_record(item["record"])
        if rep.pid is None:
            raise OrchestratorError(f"upgrade: {rep.id} has no pid in the hand-over")
        try:
            pidfd = os.pidfd_open(rep.pid)  # our unreaped child: a zombie still pins the pid
        except OSError as err:
            raise OrchestratorError(f"upgrade: cannot watch {rep.id} (pid {rep.pid}): {err}") from None
        cleanup = []
        if item.get("logs") and daemon.log_capture is not None:
            rlog = daemon.log_capture.adopt(rep.id, tuple(item["logs"]), max_bytes=item.get("log_max_bytes"),
                                            backups=item.get("log_backups"))
            cleanup.append(rlog.finish)
        ready_fd = item.get("ready_fd")
        proc = engine.adopt(rep, pidfd, cgroup=item.get("cgroup"), cleanup=cleanup,
                            kill_deadline=item.get("kill_deadline"), killed=bool(item.get("killed")),
                            escaped=[(int(a), int(b)) for a, b in item.get("escaped", [])],
                            ready_fd=None if ready_fd is None else int(ready_fd))
        engine.supervisor.readiness.resume(proc, item.get("readiness"))  # a STARTING one's wait goes on
    for record in doc.get("pending", []):
        engine.adopt_pending(Replica.from_record(record))
    engine.tasks.take_over(doc.get("tasks"))  # executor pools: their tasks, on the carried connections
    engine.journal.event("upgrade", {"from": doc.get("from"), "to": __version__, "pid": os.getpid(),
                                     "replicas": len(doc["replicas"]), "pending": len(doc.get("pending", []))})
    engine.changed()


def answer(daemon: Any, doc: dict[str, Any]) -> None:
    """The upgrade command's reply, from the new image, and the waits it carried."""
    engine = daemon.engine
    channel: protocol.ReplyTo = daemon.manager.reply_to()

    def reply_of(carried: dict[str, Any]) -> protocol.ReplyTo:
        """The channel's, or an HTTP client's that the earlier image carried (httpapi.py;
        none: its listener is not served any more, and nobody is left to answer)."""
        key = carried.get("http")
        if key is None:
            return channel
        http: protocol.ReplyTo | None = daemon.http_api.reply_for(key) if daemon.http_api is not None else None
        return http if http is not None else _nobody

    for w in doc.get("waiters", []):
        engine.adopt_waiter(w["ids"], w["until"], reply_of(w), w["cmd_id"], float(w["deadline"]), bool(w["durable"]))
    upgrade = doc.get("upgrade", {})
    result = {"from": doc.get("from"), "to": __version__, "pid": os.getpid(), "replicas": len(doc["replicas"])}
    engine.reply(reply_of(upgrade), protocol.ok(upgrade.get("cmd_id"), result), True)


def _nobody(msg: protocol.Reply) -> None:
    pass


def http_carried(doc: dict[str, Any]) -> dict[str, Any] | None:
    """What the earlier image's HTTP control plane carried (httpapi.HttpApi.hand_over)."""
    carried = doc.get("http")
    return carried if isinstance(carried, dict) else None
