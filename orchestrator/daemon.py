"""The host daemon: one per state dir.

    orchestrator start ──spawns──► daemon (own session, stdio -> logs/daemon.log)
                                          │ holds a POSIX write lock on daemon.pid
                                          │ recovers leftovers of an unclean end (LOST)
                                          ├─► watchdog process   (python -m watchdog)
                                          ├─► manager process    (python -m orchestrator.manager)
                                          └─► replicas           (forked by the control loop)
    ◄──── "READY <pid>" on a pipe once the channel accepts commands

Liveness is the lock, never a pid check: the kernel drops the lock the moment the daemon
exits (a zombie daemon already counts as gone), F_GETLK names the holder's pid without
taking the lock, and a stale pid file or socket left by a SIGKILL is simply replaced.

Signals only record themselves (and wake the loop through the wakeup fd); the loop then
raises ShutdownRequested for SIGTERM/SIGINT, reaps orphans for SIGCHLD. Shutdown: refuse
commands, terminate every replica (TERM to its group, grace, KILL), stop the manager, tell
the watchdog to exit quietly, remove the runtime files, exit 0. A second SIGTERM or SIGINT
during shutdown is logged and ignored: the cleanup always runs to its end.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from watchdog import WatchdogLink
from watchdog.identity import is_alive, scan, start_time
from watchdog.ledger import Entry
from watchdog.reaper import sweep

from .channel import AUTHKEY_NAME, SOCKET_NAME, FrameReader, PipeWriter
from .engine import Engine, EngineConfig, drain
from .errors import OrchestratorError, ShutdownRequested
from .spawner import OSApi, exit_reason, raise_fd_limit, set_child_subreaper

log = logging.getLogger("orchestrator")
TOKEN_ENV = "ORCHESTRATOR_DAEMON_TOKEN"
_FLOCK = "hhqqi4x"  # struct flock on Linux (x86_64, aarch64)


class Paths:
    """Where one daemon keeps its files."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(os.path.abspath(state_dir))
        self.pidfile = self.state_dir / "daemon.pid"
        self.authkey = self.state_dir / AUTHKEY_NAME
        self.socket = self.state_dir / SOCKET_NAME
        self.db = self.state_dir / "state.db"
        self.logs = self.state_dir / "logs"
        self.log = self.logs / "daemon.log"
        self.report = self.state_dir / "watchdog-report.json"


def default_state_dir() -> Path:
    if os.environ.get("ORCHESTRATOR_STATE_DIR"):
        return Path(os.environ["ORCHESTRATOR_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "orchestrator"


# -- the pid-file lock ------------------------------------------------------------


def running_pid(paths: Paths) -> int | None:
    """The daemon's pid if one holds the lock, else None. Never takes the lock."""
    try:
        fd = os.open(paths.pidfile, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, l_pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    finally:
        os.close(fd)
    return None if l_type == fcntl.F_UNLCK else l_pid


def _take_lock(paths: Paths) -> int | None:
    """Open and lock the pid file; None if another daemon holds it."""
    fd = os.open(paths.pidfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


# -- start / stop, as the CLI uses them ---------------------------------------------


def daemon_env() -> dict[str, str]:
    """The environment a daemon is exec'd with: a fresh token, so every descendant carries
    it, and SPT_NOENV, so setproctitle does not clobber that environment in /proc."""
    env = dict(os.environ)
    env[TOKEN_ENV] = secrets.token_hex(8)
    env["SPT_NOENV"] = "1"
    return env


def reexec_with_token() -> None:
    """Make sure the daemon's exec-time environment carries its token: /proc/PID/environ
    shows only that environment, and it is what forked Python workers show too, so the
    watchdog's token sweep can find them. `start` sets it; a bare `start --foreground`
    (systemd, a container) re-executes itself once with it."""
    if os.environ.get(TOKEN_ENV):
        return
    env = daemon_env()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "orchestrator", *sys.argv[1:]], env)


def start_detached(paths: Paths, extra_args: list[str] | None = None, timeout: float = 60.0) -> int:
    """Start a daemon in its own session; return its pid once it accepts commands."""
    pid = running_pid(paths)
    if pid is not None:
        raise OrchestratorError(f"a daemon is already running for {paths.state_dir} (pid {pid})")
    paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.logs.mkdir(exist_ok=True)
    r, w = os.pipe()
    env = daemon_env()
    argv = [sys.executable, "-m", "orchestrator", "--state-dir", str(paths.state_dir),
            "start", "--foreground", "--ready-fd", str(w), *(extra_args or [])]
    with open(paths.log, "ab") as logf, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(argv, stdin=devnull, stdout=logf, stderr=logf, env=env,
                                pass_fds=(w,), start_new_session=True)
    os.close(w)
    try:
        msg = _read_until_eof(r, timeout)
    finally:
        os.close(r)
    if msg.startswith("READY "):
        proc.returncode = 0  # it lives on, detached; nothing of ours will wait for it
        return int(msg.split()[1])
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.returncode = 0
        raise OrchestratorError(f"the daemon did not become ready within {timeout:g} s; see {paths.log}") from None
    detail = msg.removeprefix("ERROR ").strip() or f"it exited with {exit_reason(code)}; see {paths.log}"
    raise OrchestratorError(detail)


def _read_until_eof(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    chunks = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            break
        data = os.read(fd, 4096)
        if not data:
            break
        chunks.append(data)
        if b"\n" in data:
            break
    return b"".join(chunks).decode(errors="replace").strip()


def stop(paths: Paths, timeout: float = 30.0) -> int:
    """SIGTERM to the daemon (identity-checked), then wait. 0 stopped, 3 not running, 1 timed out."""

    pid = running_pid(paths)
    if pid is None:
        return 3
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 0
    try:
        if running_pid(paths) != pid:  # it died and the pid may be someone else's now
            return 0
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        except ProcessLookupError:
            return 0
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return 1
        try:
            os.waitpid(pid, os.WNOHANG)  # if we started it (start_detached), do not leave a zombie
        except ChildProcessError:
            pass
        return 0
    finally:
        os.close(pidfd)


# -- recovery -----------------------------------------------------------------------


def recover_leftovers(store: Any, *, grace: float = 1.0) -> tuple[int, int]:
    """The start-up layer against orphans. Every replica the store still calls live belongs
    to a run that ended uncleanly: kill its process (and group, and descendants) if it is
    still alive with the recorded identity, never a reused pid, then record it LOST.
    Returns (lost, killed)."""
    _, live = store.load()
    if not live:
        return 0, 0
    entries = [
        Entry(r["pid"], r["start_time"], r["pid"], "worker", r["id"])
        for r in live
        if r.get("pid") and r.get("start_time") is not None and is_alive(r["pid"], r["start_time"])
    ]
    killed = {e.pid for e in entries}
    if entries:
        sweep(entries, None, exclude={os.getpid()}, grace=grace)
    now = time.time()
    for rec in live:
        found = "killed at recovery" if rec.get("pid") in killed else "found dead"
        old = rec["state"]
        rec.update(state="LOST", pid=None, ended_at=now, reason=f"daemon ended uncleanly; {found}")
        store.save_replica(rec)
        store.append_event("transition", replica=rec["id"], ts=now,
                           data={"from": old, "to": "LOST", "reason": rec["reason"]})
    store.append_event("recovery", ts=now, data={"lost": len(live), "killed": len(killed)})
    store.commit()
    log.warning("recovered from an unclean end: %d replica(s) LOST, %d leftover(s) killed", len(live), len(killed))
    return len(live), len(killed)


# -- the daemon itself --------------------------------------------------------------


class Daemon:
    """Runs in the foreground of its process until SIGTERM/SIGINT; see the module doc."""

    def __init__(self, paths: Paths, *, grace: float = 5.0, ready_fd: int | None = None,
                 retention: dict | None = None) -> None:
        self.paths = paths
        self.grace = grace
        self.retention = retention or {}
        self.ready_fd = ready_fd
        self.started_at = time.time()
        self._signals: list[int] = []
        self._lock_fd: int | None = None
        self.engine: Engine | None = None
        self.store: Any = None
        self._manager_pid: int | None = None
        self._manager_ready = False
        self._manager_started = 0.0
        self._manager_backoff = 0.0
        self._cmd_fd: int | None = None
        self._reply: Any = None
        self._frames = FrameReader()

    # -- start-up ---------------------------------------------------------------------

    def run(self) -> int:
        paths = self.paths
        try:
            paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            paths.logs.mkdir(exist_ok=True)
            self._lock_fd = _take_lock(paths)
        except OSError as err:
            return self._fail(f"cannot use state dir {paths.state_dir}: {err.strerror or err}")
        if self._lock_fd is None:
            return self._fail(f"a daemon is already running for {paths.state_dir} (pid {running_pid(paths)})")
        os.environ.setdefault("SPT_NOENV", "1")
        from setproctitle import setproctitle

        setproctitle("orchestrator: daemon")
        self._install_signals()
        try:
            return self._serve()
        except OrchestratorError as err:
            return self._fail(str(err))
        finally:
            self._remove_runtime_files()

    def _fail(self, message: str) -> int:
        print(f"orchestrator: {message}", file=sys.stderr, flush=True)
        self._notify(f"ERROR {message}")
        return 1

    def _notify(self, line: str) -> None:
        if self.ready_fd is None:
            return
        try:
            os.write(self.ready_fd, (line + "\n").encode())
        except OSError:
            pass  # `start` gave up waiting; the log has it
        os.close(self.ready_fd)
        self.ready_fd = None

    def _install_signals(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._sig_r = r
        self._sig_w = w
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, self._record_signal)

    def _record_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)  # only record: the loop acts on it

    def _serve(self) -> int:
        paths = self.paths
        set_child_subreaper()
        nofile = raise_fd_limit()
        token = os.environ.get(TOKEN_ENV) or secrets.token_hex(8)
        for stale in (paths.socket, paths.report):
            stale.unlink(missing_ok=True)  # we hold the lock: whatever is there is stale
        self._write_authkey()
        self.store = self._open_store()
        link = WatchdogLink(str(paths.state_dir), token=token, batch=True,
                            remove_files=[str(paths.socket), str(paths.pidfile)])
        config = EngineConfig(grace=self.grace, token=token)
        engine = self.engine = Engine(config, os_api=OSApi(nofile=nofile), store=self.store, watchdog=link)
        engine.extra_status = self._daemon_status
        engine.add_reader(self._sig_r, self._on_signal_wakeup)
        try:
            recover_leftovers(self.store, grace=min(self.grace, 1.0))
            engine.start()
            # Pools first, then the channel: no command may see a half-restored table.
            engine.restore(self.store.load()[0])
            engine.settle()
            self._start_manager()
            deadline = time.monotonic() + 30
            while not self._manager_ready:
                if time.monotonic() > deadline:
                    raise OrchestratorError("the manager server did not start within 30 s")
                engine.run_once(1.0)
            log.info("daemon %d ready on %s", os.getpid(), paths.state_dir)
            self._notify(f"READY {os.getpid()}")
            if self.ready_fd is None and sys.stdout.isatty():
                print(f"orchestrator: daemon running (pid {os.getpid()})", flush=True)
            while True:
                engine.run_once(None)
        except ShutdownRequested as req:
            log.info("%s: shutting down", signal.Signals(req.signum).name)
        finally:
            self._shutdown(engine)
        return 0

    def _write_authkey(self) -> None:
        path = self.paths.authkey
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
        finally:
            os.close(fd)

    def _open_store(self) -> Any:
        from .store import Store, StoreError

        try:
            store = Store(self.paths.db, **self.retention)
        except StoreError as err:
            raise OrchestratorError(str(err)) from None
        for note in store.notes:
            log.warning("%s", note)
        return store

    def _daemon_status(self) -> dict:
        wd = self.engine.watchdog if self.engine else None
        return {"daemon": {
            "running": True, "pid": os.getpid(),
            "watchdog_pid": wd.pid if wd is not None else None,
            "manager_pid": self._manager_pid, "started_at": self.started_at,
        }}

    # -- signals --------------------------------------------------------------------

    def _on_signal_wakeup(self) -> None:
        drain(self._sig_r)
        signals, self._signals = self._signals, []
        engine = self.engine
        if signal.SIGCHLD in signals:
            engine.reap_orphans()
        for sig in signals:
            if sig in (signal.SIGTERM, signal.SIGINT):
                if engine.closing:
                    log.info("%s during shutdown: the cleanup goes on", signal.Signals(sig).name)
                else:
                    raise ShutdownRequested(sig)
            elif sig == signal.SIGHUP:
                log.info("SIGHUP: nothing to reload")

    # -- the manager server ---------------------------------------------------------

    def _start_manager(self) -> None:

        if self.engine.closing:
            return
        self.paths.socket.unlink(missing_ok=True)  # a killed manager leaves its socket behind
        self._manager_started = time.monotonic()
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        os.set_inheritable(cmd_w, True)
        os.set_inheritable(reply_r, True)
        argv = [sys.executable, "-m", "orchestrator.manager", "--state-dir", str(self.paths.state_dir),
                "--parent-pid", str(os.getpid()), "--cmd-fd", str(cmd_w), "--reply-fd", str(reply_r)]
        try:
            pid = os.posix_spawn(sys.executable, argv, os.environ)
        finally:
            os.close(cmd_w)
            os.close(reply_r)
        self._manager_pid = pid
        self._manager_ready = False
        self._frames = FrameReader()
        os.set_blocking(cmd_r, False)
        self._cmd_fd = cmd_r
        self._reply = PipeWriter(reply_w)
        engine = self.engine
        engine.add_reader(cmd_r, self._on_commands)
        engine.add_writer(self._reply)
        engine.watch_child(pid, self._on_manager_exit)
        start = start_time(pid)
        if start is not None and engine.watchdog is not None:
            engine.watchdog.add(pid, start, None, "process", "manager")

    def _close_manager_pipes(self) -> None:
        if self._cmd_fd is not None:
            self.engine.remove_reader(self._cmd_fd)
            os.close(self._cmd_fd)
            self._cmd_fd = None
        if self._reply is not None:
            self.engine.remove_writer(self._reply)
            self._reply.close()
            self._reply = None

    def _on_commands(self) -> None:
        try:
            data = os.read(self._cmd_fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:  # the manager is gone; its pidfd brings the restart
            self._close_manager_pipes()
            return
        reply = self._reply.write_frame
        for cmd in self._frames.feed(data):
            if isinstance(cmd, dict) and cmd.get("op") == "_ready":
                self._manager_ready = True
                continue
            self.engine.handle(cmd, reply)

    def _on_manager_exit(self, code: int | None) -> None:
        pid = self._manager_pid
        self._manager_pid = None
        self._close_manager_pipes()
        engine = self.engine
        if engine.watchdog is not None and pid is not None:
            engine.watchdog.remove(pid)
        if engine.closing:
            return
        # A manager that dies young is restarted after a growing delay, not in a tight loop.
        if time.monotonic() - self._manager_started < 10.0:
            self._manager_backoff = min(max(2 * self._manager_backoff, 0.1), 30.0)
        else:
            self._manager_backoff = 0.0
        log.warning("manager server exited (%s); starting a new one in %.1f s",
                    exit_reason(code) if code is not None else "status unknown", self._manager_backoff)
        engine.call_later(self._manager_backoff, self._start_manager)

    # -- shutdown -------------------------------------------------------------------

    def _shutdown(self, engine: Engine) -> None:
        engine.shutdown()
        self._end_adopted(engine)
        pid = self._manager_pid
        if pid is not None:
            self._close_manager_pipes()  # EOF on its reply pipe: the manager exits by itself
            engine.end_child(pid, 5.0)
        engine.stop_watchdog()
        if self.store is not None:
            self.store.append_event("stop", ts=time.time(), data={"pid": os.getpid()})
            self.store.commit()
            self.store.close()
        engine.close()
        log.info("daemon %d stopped", os.getpid())

    def _end_adopted(self, engine: Engine) -> None:
        """Orphans re-parented to us (a worker's descendants that left its group, e.g. with
        setsid) outlive their replica; a clean stop ends them too, and their descendants."""
        me = os.getpid()
        system = {self._manager_pid, engine.watchdog.pid if engine.watchdog else None} - {None}
        adopted = [Entry(st.pid, st.start_time, None, "process", "adopted")
                   for st in scan().values() if st.ppid == me and st.pid not in system and st.state != "Z"]
        if adopted:
            report = sweep(adopted, None, exclude={me, *system}, grace=min(self.grace, 1.0))
            log.info("ended %d adopted orphan(s) and their descendants", len(report.get("processes", adopted)))
        engine.reap_orphans()

    def _remove_runtime_files(self) -> None:
        for path in (self.paths.socket, self.paths.authkey):
            path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            self.paths.pidfile.unlink(missing_ok=True)  # unlinked while still locked
            os.close(self._lock_fd)
            self._lock_fd = None


def run_foreground(paths: Paths, *, grace: float = 5.0, ready_fd: int | None = None,
                   retention: dict | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    return Daemon(paths, grace=grace, ready_fd=ready_fd, retention=retention).run()


__all__ = ["Paths", "Daemon", "default_state_dir", "running_pid", "start_detached", "stop",
           "run_foreground", "recover_leftovers", "daemon_env"]
