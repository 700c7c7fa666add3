"""The host daemon process: one per state dir. How the CLI starts and stops it (the
client side) is control.py.

    orchestrator start ──spawns──► daemon (own session, stdio -> logs/daemon.log)
                                          │ holds a POSIX write lock on daemon.pid
                                          │ recovers leftovers of an unclean end (LOST)
                                          ├─► watchdog process   (python -m watchdog)
                                          ├─► manager process    (python -m orchestrator.manager.server)
                                          ├─► spawner processes  (orchestrator.spawn.spawner, by posix_spawn)
                                          └─► replicas           (cloned by a spawner as the daemon's own
                                                                  children; forked here while none is ready)
    ◄──── "READY <pid>" on a pipe once the channel accepts commands

Liveness is the lock, never a pid check: the kernel drops the lock the moment the daemon
exits (a zombie daemon already counts as gone), F_GETLK names the holder's pid without
taking the lock, and a stale pid file or socket left by a SIGKILL is simply replaced.

Signals only record themselves (and wake the loop through the wakeup fd); a reader in the
loop then reaps orphans for SIGCHLD and sets a flag for SIGTERM/SIGINT, which the daemon
checks between turns and turns into ShutdownRequested, so no turn is left half done. Shutdown: refuse
commands, terminate every replica (TERM to its group, grace, KILL), stop the manager, tell
the watchdog to exit quietly, remove the runtime files, exit 0. A second SIGTERM or SIGINT
during shutdown is logged and ignored: the cleanup always runs to its end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from typing import Any

from watchdog import WatchdogLink
from watchdog.identity import scan
from watchdog.ledger import Entry

from ..errors import InvalidSpec, OrchestratorError, ShutdownRequested
from ..interpreter import program_env
from ..logfiles import remove as remove_logs
from ..paths import TOKEN_ENV, Paths, is_watchdog, running_pid, take_lock
from ..policy import LIMIT_KEYS, RESULT_MAX_BYTES
from ..store import Store, StoreError
from ..version import __version__
from ..worker import sd_notify
from . import config as config_file
from ..protocol import DEFERRED
from . import containment, handover, logsink, probes
from .children import ManagerBridge, WatchdogChild
from .engine import Engine, EngineConfig
from .httpapi import DEFAULT_SOCKET as HTTP_SOCKET
from .httpapi import HttpApi, parse_address, read_token
from .httpserver import MetricsServer
from .loop import DaemonParts, build_loop
from .metrics import Health, LagMonitor, health
from .limits import FdReserve, Limits, fd_limit, raise_fd_limit, reserve_size
from .osapi import OSApi, set_child_subreaper
from .reactor import drain
from .sockets import adopt_inherited
from .recovery import recover_leftovers

log = logging.getLogger("orchestrator")
REPORTS_KEPT = 5  # watchdog-report.json.1 .. .5
WATCHDOG_SWEEP_WAIT = 30.0  # a sweep takes its grace plus milliseconds; this is the bound


def _policy_of(decl: config_file.PoolDecl) -> dict[str, Any]:
    """A config pool's policy, its cgroup limits included (they are policy keys on launch)."""
    return {**decl.policy, **{k: v for k in LIMIT_KEYS if (v := getattr(decl, k)) is not None}}


class Daemon:
    """Runs in the foreground of its process until SIGTERM/SIGINT; see the module doc."""

    def __init__(self, paths: Paths, *, grace: float | None = None, ready_fd: int | None = None,
                 retention: dict[str, Any] | None = None, config_path: str | None = None,
                 stop_budget: float | None = None, metrics_port: int | None = None,
                 cgroup: str | None = None, result_max_bytes: int | None = None,
                 http: list[str] | None = None, http_token_file: str | None = None,
                 http_read_token_file: str | None = None,
                 handover: dict[str, Any] | None = None) -> None:
        """``handover``: the document of an upgrade (handover.py): take over from the earlier
        image of this process instead of starting."""
        self.paths = paths
        # What an upgrade hands to the next image, to make this same Daemon again.
        self.settings = {"grace": grace, "retention": retention, "config_path": config_path,
                         "stop_budget": stop_budget, "metrics_port": metrics_port, "cgroup": cgroup,
                         "result_max_bytes": result_max_bytes, "http": http, "http_token_file": http_token_file,
                         "http_read_token_file": http_read_token_file}
        self.handover = handover
        self.upgraded_at: float | None = None
        self.upgrade: Any = None  # handover.Upgrade in progress
        self._systemd_notify: str | None = None
        self.cgroup = cgroup  # auto | off | PATH (containment.detect); None: the config's, else auto
        self.containment: Any = None
        # Settings given on the command line win over the config file's [daemon] table,
        # which wins over the built-in defaults.
        self.config_path = config_path
        self.config: config_file.Config | None = None
        self._given_grace, self._given_stop_budget, self._given_metrics_port = grace, stop_budget, metrics_port
        self.grace = 5.0 if grace is None else grace
        self.stop_budget = 30.0 if stop_budget is None else stop_budget
        self.metrics_port = metrics_port
        self._given_result_max_bytes = result_max_bytes
        self.result_max_bytes = RESULT_MAX_BYTES if result_max_bytes is None else result_max_bytes
        self.retention = retention or {}
        self.metrics_server: MetricsServer | None = None
        # The HTTP control plane (httpapi.py): what the command line gave wins over the config
        # file's [daemon] keys; neither: a unix socket in the state dir.
        self._given_http = (list(http) if http is not None else None, http_token_file, http_read_token_file)
        self.http: list[str] = list(http) if http is not None else [f"unix:{HTTP_SOCKET}"]
        self.http_token_file, self.http_read_token_file = http_token_file, http_read_token_file
        self.http_api: HttpApi | None = None
        self.log_capture: Any = None
        self.lag: LagMonitor | None = None
        self.ready_fd = ready_fd
        self.started_at = time.time()
        self._signals: list[int] = []
        self._stop_signal: int | None = None
        self._lock_fd: int | None = None
        self.os = OSApi()
        self.engine: Engine | None = None
        self.store: Any = None
        self.watchdog: WatchdogChild | None = None
        self.manager: ManagerBridge | None = None
        self.log_sink: logsink.LogSink | None = None
        self.inherited_sockets: list[tuple[str, int]] = []  # (name, fd) from systemd's LISTEN_FDS
        self.nofile_before: tuple[int, int] | None = None  # the fd limits we were started with, if raised
        self.fd_reserve: FdReserve | None = None
        self.limits: Limits | None = None

    @property
    def _engine(self) -> Engine:
        """The engine, for what runs from _serve on (signals, commands, shutdown)."""
        if self.engine is None:
            raise RuntimeError("the daemon's engine is not made yet")  # a bug in the caller
        return self.engine

    # -- start-up ---------------------------------------------------------------------

    def run(self) -> int:
        from ..paths import check_state_dir

        paths = self.paths
        if self.handover is not None:
            return self._run_taken_over(self.handover)
        # Before any fd is opened or any child started: systemd's sockets (socket
        # activation) are taken, made close-on-exec, and their variables removed.
        self.inherited_sockets = adopt_inherited()
        # Every file the daemon and its children create is 0600 (dirs 0700) unless they say
        # otherwise: the journal, its WAL (which holds launch environments), logs, the key.
        os.umask(0o077)
        try:
            check_state_dir(paths, create=True)  # refuses another user's or a writable dir
            self._lock_fd = take_lock(paths)
            if self._lock_fd is None and is_watchdog(running_pid(paths)):
                # A dead daemon's watchdog still sweeps (it holds the lock so that nobody
                # starts on half-killed leftovers, and so that the files it removes are
                # its dead daemon's, never ours): wait for it, bounded.
                log.info("waiting for the previous daemon's watchdog to finish its sweep")
                self._lock_fd = take_lock(paths, wait=WATCHDOG_SWEEP_WAIT)
        except OrchestratorError as err:
            return self._fail(str(err))
        except OSError as err:
            return self._fail(f"cannot use state dir {paths.state_dir}: {err.strerror or err}")
        if self._lock_fd is None:
            return self._fail(f"a daemon is already running for {paths.state_dir} (pid {running_pid(paths)})")
        return self._titled_serve()

    def _titled_serve(self, unblock: tuple[int, ...] = ()) -> int:
        """Titled, signals handled (``unblock``: those an upgrade kept pending across its
        exec, delivered once handled), then serve until stopped."""
        os.environ.setdefault("SPT_NOENV", "1")
        from setproctitle import setproctitle

        setproctitle("orchestrator: daemon")
        self._install_signals()
        if unblock:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, unblock)
        try:
            return self._serve()
        except OrchestratorError as err:
            return self._fail(str(err))
        finally:
            self._remove_runtime_files()

    def _run_taken_over(self, doc: dict[str, Any]) -> int:
        """run() after an upgrade's exec: the lock, the state dir and systemd's sockets are
        ours already; the signals blocked across the exec are delivered once handled."""
        from .handover import BLOCKED

        os.umask(0o077)
        self._lock_fd = int(doc["daemon"]["lock_fd"])
        os.set_inheritable(self._lock_fd, False)
        return self._titled_serve(unblock=BLOCKED)

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

    def _load_config(self, path: str) -> None:
        """The config file's [daemon] settings, under what the command line gave."""
        self.config = config_file.load(path)
        d = self.config.daemon
        self.grace = d.grace if self._given_grace is None else self._given_grace
        self.stop_budget = d.stop_budget if self._given_stop_budget is None else self._given_stop_budget
        self.metrics_port = d.metrics_port if self._given_metrics_port is None else self._given_metrics_port
        if self._given_result_max_bytes is None:
            self.result_max_bytes = d.result_max_bytes
        http, token_file, read_token_file = self._given_http
        if http is None and d.http is not None:
            self.http = list(d.http)
        self.http_token_file = token_file if token_file is not None else d.http_token_file
        self.http_read_token_file = read_token_file if read_token_file is not None else d.http_read_token_file
        if not self.retention:
            self.retention = {"keep_replicas": d.keep_replicas, "keep_events": d.keep_events,
                              "keep_seconds": d.keep_days * 86400}

    def _serve(self) -> int:
        """Serve until stopped: a fresh start, or an upgrade's take-over of the earlier image."""
        if self.handover is not None:
            return self._serve_taken_over(self.handover)
        return self._serve_fresh()

    def _serve_fresh(self) -> int:
        """Start: leftovers of an unclean end recovered, the watchdog, the spawners, the pools
        of the store and of the config file, then the manager and its channel."""
        paths = self.paths
        # systemd's notify socket is ours (Type=notify), not the replicas'.
        self._prepare(notify=os.environ.pop("NOTIFY_SOCKET", None), nofile=None)
        token = os.environ.get(TOKEN_ENV) or secrets.token_hex(8)
        paths.socket.unlink(missing_ok=True)  # we hold the lock: whatever is there is stale
        self._write_authkey()
        self.store = self._open_store()
        self._keep_watchdog_report()
        # Before the watchdog and the manager start: they are born in the subtree's daemon/.
        previous_cgroup = containment.previous(paths)
        self.containment = containment.detect(
            self.cgroup or (self.config.daemon.cgroup if self.config is not None else "auto"), paths.state_dir)
        engine = self._build_loop(token)
        assert self.watchdog is not None and self.manager is not None and self.store is not None
        try:
            recover_leftovers(self.store, self.os, grace=min(self.grace, 1.0),
                              cgroups=[previous_cgroup, self.containment.path])
            containment.drop_previous(previous_cgroup, self.containment)
            containment.record(paths, self.containment)
            self._prune_logs()
            self.watchdog.start()
            engine.start_spawners()  # until one is ready, replicas are forked here
            # Pools first, then the channel: no command may see a half-restored table.
            engine.supervisor.restore(self.store.load()[0])
            engine.tasks.restore(engine.pools(), self.store)  # their queued tasks, and those cut short
            if self.config is not None:
                self._apply(self.config)
            self._serve_metrics(listener=None)
            self.manager.start()
            self._ready("ready")
            self._run()
        except ShutdownRequested as req:
            log.info("%s: shutting down", signal.Signals(req.signum).name)
        finally:
            self._shutdown(engine)
        return 0

    def _serve_taken_over(self, doc: dict[str, Any]) -> int:
        """After an upgrade's exec: the earlier image's settings, subtree, system children and
        replicas taken over (``_take_over``), then its upgrade command answered. A failure
        before that answer abandons the take-over (``_abandon``)."""
        carried = doc["daemon"]
        self._prepare(notify=carried.get("notify"), nofile=carried.get("nofile"))
        token = carried["token"]  # and no new key: the manager serves the socket with the one it has
        self.started_at = float(carried["started_at"])
        self.inherited_sockets = [(name, fd) for name, fd in doc["listeners"].get("inherited", [])]
        self.store = self._open_store()
        # the subtree we run in: opened, not made (that would nest a new one in daemon/)
        self.containment = handover.containment_of(carried["containment"])
        engine = self._build_loop(token)
        assert self.manager is not None
        taking_over = True
        try:
            self._take_over(doc)
            self._serve_metrics(listener=handover.metrics_listener(doc), http=handover.http_carried(doc))
            self.manager.take_over(doc.get("manager"))
            handover.answer(self, doc)  # the upgrade command, and the waits it carried
            taking_over = False
            self._ready("upgraded")
            self._run()
        except ShutdownRequested as req:
            log.info("%s: shutting down", signal.Signals(req.signum).name)
        finally:
            if taking_over:
                self._abandon()
            self._shutdown(engine)
        return 0

    # -- the steps both share ---------------------------------------------------------

    def _prepare(self, *, notify: str | None, nofile: list[int] | None) -> None:
        """The config file, the process's settings and its fd budget. ``nofile``: the fd
        limits we were started with, as an upgrade carries them (None: those of now)."""
        if self.config_path is not None:
            self._load_config(self.config_path)  # an invalid file: one line, and nothing started
        self._systemd_notify = notify
        set_child_subreaper()  # kept across an exec already; said again, it costs nothing
        # As servers do: the soft fd limit up to the hard one (the daemon holds fds per
        # replica); replicas get the limits we were started with, which an upgrade carries
        # (the new image finds the soft limit raised already).
        raised = raise_fd_limit()
        self.nofile_before = (int(nofile[0]), int(nofile[1])) if nofile else raised
        self.os = OSApi(nofile=self.nofile_before)
        # Opened now, so with low numbers: what a lowered or filled fd table leaves the
        # control plane (limits.py).
        self.fd_reserve = FdReserve(reserve_size(fd_limit()))
        self.limits = Limits(self.fd_reserve)

    def _build_loop(self, token: str) -> Engine:
        """The loop (loop.py, as the embedded one is built, with the daemon's parts), its
        watchdog child and the manager's bridge; nothing started yet."""
        paths = self.paths
        assert self.fd_reserve is not None and self.limits is not None and self.containment is not None
        log.info("containment: %s (%s)", self.containment.mode, self.containment.reason)
        link = WatchdogLink(str(paths.state_dir), token=token, batch=True,
                            remove_files=[str(paths.socket), str(paths.tasks_socket), str(paths.pidfile)],
                            lock_file=str(paths.pidfile))
        link.cgroup_subtree = self.containment.path  # the watchdog kills all of replicas/, then removes it
        # Executor workers connect to a socket in the state dir (0700): only the daemon's user
        # reaches it, and nobody can bind its name first.
        config = EngineConfig(grace=self.grace, token=token, spawners=True, task_socket=str(paths.tasks_socket),
                              task_stop_reason="interrupted: the daemon stopped",
                              result_max_bytes=self.result_max_bytes,
                              inherited_sockets=tuple(self.inherited_sockets))
        settings = self.config.daemon if self.config is not None else config_file.DaemonSettings()
        parts = DaemonParts(
            logs=paths.logs, log_max_bytes=settings.log_max_bytes, log_backups=settings.log_backups,
            status=self._daemon_status,
            commands={"health": self._cmd_health, "metrics": self._cmd_metrics, "reload": self._cmd_reload},
            deferred={"upgrade": self._cmd_upgrade}, limits=self.limits, reserve=self.fd_reserve,
            reopen_store=self._reopen_store,
            turn_end=(self.fd_reserve.turn_end, lambda: self.upgrade.look() if self.upgrade is not None else None))
        loop = build_loop(config, os_api=self.os, store=self.store, link=link, containment=self.containment,
                          daemon=parts)
        engine = self.engine = loop.engine
        self.log_capture, self.watchdog = loop.log_capture, loop.watchdog
        reactor = loop.reactor
        reactor.add_reader(self._sig_r, self._on_signal_wakeup)
        if self.log_sink is not None:
            reactor.add_writer(self.log_sink)
            # daemon.log (when it is our stderr) is bounded like a replica's logs
            self.log_sink.rotate_file(paths.log, max_bytes=settings.log_max_bytes, backups=settings.log_backups)
        self.manager = ManagerBridge(paths.state_dir, reactor, self.os, engine.handle, watchdog=link,
                                     journal=engine.journal, reserve=self.fd_reserve)
        return engine

    def _serve_metrics(self, listener: Any, http: dict[str, Any] | None = None) -> None:
        """This start's changes committed; the loop-lag monitor and, with a metrics port, its
        HTTP server (on the ``listener`` an upgrade carried, else a new one); the HTTP
        control plane (with what an upgrade's ``http`` carried)."""
        engine = self._engine
        engine.settle()
        self.lag = LagMonitor(engine.reactor, interval=1.0)
        engine.metrics.lag = self.lag  # measured from here: a long start is no lag of the loop
        if self.metrics_port is not None:
            try:
                self.metrics_server = MetricsServer(
                    engine.reactor, self.metrics_port, self._render_metrics, self._healthz,
                    on_outcome=engine.metrics.http_request, sock=listener)
            except OSError as err:
                raise OrchestratorError(str(err)) from None
        self._serve_http(http)

    def _serve_http(self, carried: dict[str, Any] | None = None) -> None:
        """The HTTP control plane on its addresses (``off``: none). An upgrade's new image
        serves the listeners the earlier one ``carried`` (a client that connects during the
        exec waits in the backlog) and answers the commands it carried (the upgrade's own,
        open waits); event and log streams ended cleanly before the exec, and a client that
        reconnects (an event stream with Last-Event-ID) goes on where it was."""
        engine = self._engine
        if not self.http or self.http == ["off"]:
            return
        try:
            addresses = [parse_address(a, self.paths.state_dir) for a in self.http]
            token = read_token(self.http_token_file, "http token file") if self.http_token_file else None
            read_only = (read_token(self.http_read_token_file, "http read token file")
                         if self.http_read_token_file else None)
            self.http_api = HttpApi(engine, engine.reactor, addresses, state_dir=str(self.paths.state_dir),
                                    logs_dir=self.paths.logs, token=token, read_token=read_only, carried=carried,
                                    on_response=engine.metrics.api_request)
        except OSError as err:
            raise OrchestratorError(str(err.strerror or err)) from None
        log.info("http: serving on %s", ", ".join(self.http_api.addresses()))

    def _ready(self, how: str) -> None:
        """Once the manager serves the channel: READY to `start` (and systemd)."""
        engine = self._engine
        assert self.manager is not None and self.limits is not None
        deadline = time.monotonic() + 30
        while not self.manager.ready:
            if time.monotonic() > deadline:
                raise OrchestratorError("the manager server did not start within 30 s")
            self._turn(1.0)
        self.limits.measure_base(len(engine.procs()))
        log.info("daemon %d %s on %s", os.getpid(), how, self.paths.state_dir)
        self._notify(f"READY {os.getpid()}")
        if self._systemd_notify:
            sd_notify(self._systemd_notify, STATUS=f"{len(engine.status()['replicas'])} replicas")
        if self.ready_fd is None and sys.stdout.isatty():
            print(f"orchestrator: daemon running (pid {os.getpid()})", flush=True)

    def _run(self) -> None:
        """Turn until a stop signal (ShutdownRequested)."""
        while True:
            self._turn(None)

    def _turn(self, timeout: float | None) -> None:
        """One turn of the loop; a shutdown signal is acted on between turns, never inside,
        and so is an upgrade's exec (it returns only if the exec failed)."""
        self._engine.run_once(timeout)
        if self._stop_signal is not None:
            raise ShutdownRequested(self._stop_signal)
        if self.upgrade is not None and self.upgrade.quiesced:
            self.upgrade.execute()

    def _cmd_upgrade(self, args: dict[str, Any], reply: Any, cmd_id: Any) -> Any:
        """`upgrade`: re-execute on the code installed now (handover.py); answered by the
        new image, or with the one-line reason it was refused."""
        if self.upgrade is not None:
            raise OrchestratorError("an upgrade is in progress already")
        self.upgrade = handover.Upgrade(self, reply, cmd_id)
        return DEFERRED

    def _take_over(self, doc: dict[str, Any]) -> None:
        """After an upgrade's exec: the table, the system children and the replicas of the
        earlier image, as the hand-over and the store say (handover.take_over)."""
        engine = self._engine
        assert self.watchdog is not None
        self.watchdog.take_over(doc["watchdog"])
        engine.start_spawners()
        handover.take_over(self, doc)
        self.upgraded_at = time.time()

    def _abandon(self) -> None:
        """The take-over failed half way: a clean shutdown would end only the replicas
        adopted so far and tell the watchdog to leave. Exit at once instead: the watchdog
        sees its daemon die and sweeps every replica of its ledger, as after a kill -9."""
        log.critical("upgrade: the take-over failed; exiting so that the watchdog ends every replica",
                     exc_info=True)
        if self.log_sink is not None:
            self.log_sink.flush()
        os._exit(70)

    def _write_authkey(self) -> None:
        from ..paths import AUTHKEY_NAME, write_private

        write_private(self.paths, AUTHKEY_NAME, secrets.token_bytes(32))  # a new 0600 file, in the checked dir

    def _reopen_store(self) -> Any:
        """state.db vanished: a new one, on the fds the control plane keeps for itself."""
        with self.fd_reserve.spent() if self.fd_reserve is not None else contextlib.nullcontext():
            return self._new_store()

    def _new_store(self) -> Any:
        store = Store(self.paths.db, **self.retention)
        for note in store.notes:
            log.warning("%s", note)
        return store

    def _open_store(self) -> Any:
        try:
            return self._new_store()
        except StoreError as err:
            raise OrchestratorError(str(err)) from None

    def _keep_watchdog_report(self) -> None:
        """A watchdog report is what happened the last time this daemon died: keep it (the
        last few, rotated) and say in the journal what the watchdog did, for `events`."""
        report = self.paths.report
        try:
            data = json.loads(report.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            data = {"unreadable": str(err)}
        summary = {k: data.get(k) for k in ("reason", "detected_by", "detected_at", "ledger_entries") if k in data}
        if isinstance(data.get("processes"), list):
            summary["processes"] = len(data["processes"])
        if isinstance(data.get("cgroups"), list):
            summary["cgroups"] = len(data["cgroups"])
        summary["report"] = f"{report.name}.1"
        self.store.append_event("watchdog", ts=time.time(), data=summary)
        for n in range(REPORTS_KEPT - 1, 0, -1):
            older = report.with_name(f"{report.name}.{n}")
            if older.exists():
                older.replace(report.with_name(f"{report.name}.{n + 1}"))
        report.replace(report.with_name(f"{report.name}.1"))

    def _daemon_status(self) -> dict[str, Any]:
        return {"daemon": {
            "running": True, "pid": os.getpid(),
            "watchdog_pid": self.watchdog.pid if self.watchdog is not None else None,
            "manager_pid": self.manager.pid if self.manager is not None else None,
            "spawner_pids": sorted(self.engine.system_pids()) if self.engine is not None else [],
            "started_at": self.started_at,
            "version": __version__,  # the code this process runs, not what is installed now
            "upgraded_at": self.upgraded_at,
            **(self.containment.describe() if self.containment is not None else {}),
            "logs": self.log_capture.totals() if self.log_capture is not None else None,
            "config": self.config_path,
            "journal": self._journal_state(),
            "limits": self.limits.describe() if self.limits is not None else None,
        }}

    def _journal_state(self) -> dict[str, Any]:
        """{"ok": true}, or the journal's fault: why, since when, how many changes wait."""
        fault = self.engine.journal.fault_info() if self.engine is not None else None
        return {"ok": True} if fault is None else {"ok": False, **fault}

    # -- signals and orphans ----------------------------------------------------------

    def _on_signal_wakeup(self) -> None:
        drain(self._sig_r)
        signals, self._signals = self._signals, []
        if signal.SIGCHLD in signals:
            self.reap_orphans()
        for sig in signals:
            if sig in (signal.SIGTERM, signal.SIGINT):
                if self._engine.closing:
                    log.info("%s during shutdown: the cleanup goes on", signal.Signals(sig).name)
                elif self._stop_signal is None:
                    self._stop_signal = sig
            elif sig == signal.SIGHUP:
                if self.config_path is None:
                    log.info("SIGHUP: no config file to reload (start --config FILE)")
                    continue
                if self._engine.closing:
                    log.info("SIGHUP during shutdown: not reloading")
                    continue
                try:
                    log.info("SIGHUP: reloaded %s: %s", self.config_path, self._cmd_reload({}))
                except OrchestratorError as err:
                    log.error("SIGHUP: %s (the running config stays)", err)

    def reap_orphans(self) -> None:
        """Reap every exited child, including orphans re-parented to this subreaper. Each
        exit goes to its owner first (a replica's to the engine, which ends its group's
        remnants while the zombie still pins the group; a system child's to its supervisor)."""
        while (pid := self.os.exited_child()) is not None:
            if self._engine.child_exited(pid):
                continue
            probe = probes.EXEC_PROBES.get(pid)
            if probe is not None:
                probe.exited()  # reaps it and reports its exit code to the probe's owner
                continue
            for child in (self.manager.child if self.manager else None, self.watchdog):
                if child is not None and child.owns(pid):
                    child.exited()
                    break
            else:
                self.os.reap(pid)
                log.debug("reaped orphan %d", pid)

    # -- shutdown -------------------------------------------------------------------

    # -- operations: config, health, metrics --------------------------------------------

    def _apply(self, new: config_file.Config, prepared: dict[str, Any] | None = None) -> dict[str, Any]:
        """Make the table what the file declares: pools an earlier file declared and this
        one does not deleted, changed ones rolled, resized ones scaled, new pools started.

        Removed pools go first, and while the replicas of deleted pools are still ending,
        new pools wait for them to be reaped (a pool of servers on fixed ports, renamed,
        would otherwise start while the old one still holds the ports); that wait is bounded
        by the grace plus 10 s, after which they are started anyway. ``prepared``:
        engine.supervisor.check_declaration() of each pool, when the caller checked them all already."""
        prepared = prepared or {}
        done: dict[str, list[str]] = {"added": [], "changed": [], "resized": [], "unchanged": []}
        engine = self._engine
        removed = engine.supervisor.undeclare_missing(set(new.pools))
        ending = engine.supervisor.deleted_not_ended()  # these, and those of an earlier delete
        later: list[str] = []
        for decl in new.pools.values():
            if ending and not engine.supervisor.has_pool(decl.name):
                later.append(decl.name)
                done["added"].append(decl.name)
                continue
            if decl.executor is not None:
                what = engine.tasks.declare(decl.name, decl.spec, _policy_of(decl), decl.size, decl.executor)
            else:
                what = engine.supervisor.declare(decl.name, decl.spec, _policy_of(decl), decl.size,
                                                 prepared.get(decl.name))
            done[what].append(decl.name)
        done["removed"] = removed
        if later:
            engine.supervisor.when_ended(ending, lambda ended: self._add_later(later, ended), self.grace + 10.0)
        return done

    def _add_later(self, names: list[str], ended: bool) -> None:
        """Start the pools _apply held back, as the config file declares them now (a later
        reload may have changed or removed them meanwhile)."""
        if self._engine.closing:  # the wait ended because the daemon stops: nothing to start
            return
        if not ended:
            log.warning("config: the removed pools' replicas have not all ended; starting %s anyway",
                        ", ".join(names))
        for name in names:
            decl = self.config.pools.get(name) if self.config is not None else None
            if decl is None:
                continue
            try:
                if decl.executor is not None:
                    self._engine.tasks.declare(decl.name, decl.spec, _policy_of(decl), decl.size, decl.executor)
                else:
                    self._engine.supervisor.declare(decl.name, decl.spec, _policy_of(decl), decl.size)
            except OrchestratorError as err:  # its spec no longer resolves (e.g. a binary removed meanwhile)
                log.error("config: pool %s: %s", name, err)

    def _prune_logs(self) -> None:
        """Logs live as long as their replica's record: drop those the journal forgot."""
        known = {r["id"] for r in self.store.replicas(include_terminal=True)} | self.store.task_ids()
        ids = {name.split(".", 1)[0] for name in os.listdir(self.paths.logs)
               if name.endswith((".out", ".err")) or ".out." in name or ".err." in name}
        ids = {i.replace("#", "/", 1) for i in ids}  # a task's files: <pool>#<n> (logfiles.py)
        stale = ids - known - {"daemon"}
        if stale:
            remove_logs(self.paths.logs, stale)

    def _cmd_reload(self, args: dict[str, Any]) -> dict[str, Any]:
        if self.config_path is None:
            raise OrchestratorError("this daemon was started without a config file (start --config FILE)")
        new = config_file.load(self.config_path)  # ConfigError: one line, and the running config stays
        # the whole file is checked before anything changes
        prepared: dict[str, Any] = {}
        for decl in new.pools.values():
            try:
                prepared[decl.name] = self._engine.supervisor.check_declaration(decl.spec, _policy_of(decl), decl.size)
            except InvalidSpec as err:  # e.g. a command that is not there: name the pool and its line
                raise config_file.ConfigError.at(new.source, decl.line, f"pools.{decl.name}", str(err)) from None
        try:  # a launched pool may start after one this file no longer declares
            self._engine.supervisor.order.check_declared({n: pol.after_pools for n, (_, pol) in prepared.items()})
        except InvalidSpec as err:
            raise config_file.ConfigError.at(new.source, None, "after", str(err).removeprefix("after: ")) from None
        done = self._apply(new, prepared)
        later = config_file.diff(self.config, new).daemon_changed
        self.config = new
        self._engine.config.grace = self.grace = new.daemon.grace if self._given_grace is None else self.grace
        if self._given_stop_budget is None:
            self.stop_budget = new.daemon.stop_budget
        if later:
            done["restart_needed"] = [k for k in later if k not in ("grace", "stop_budget")]
        return done

    def _daemon_parts(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "daemon_alive": True,
                "watchdog_alive": self.watchdog is not None and self.watchdog.pid is not None,
                "manager_alive": self.manager is not None and self.manager.pid is not None,
                "journal": self._journal_state(),
                "version": __version__}

    def _healthz(self) -> tuple[bool, Health]:
        return health(self._daemon_parts(), self.lag.current() if self.lag else 0.0)

    def _cmd_health(self, args: dict[str, Any]) -> Health:
        return self._healthz()[1]

    def _render_metrics(self) -> str:
        engine = self._engine
        if self.log_capture is not None:
            totals = self.log_capture.totals()
            engine.metrics.set_log_totals(totals["bytes"], totals["dropped"])
        return engine.metrics.render(engine.status(), self._daemon_parts())

    def _cmd_metrics(self, args: dict[str, Any]) -> str:
        return self._render_metrics()

    # -- shutdown -------------------------------------------------------------------

    def _shutdown(self, engine: Engine) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.http_api is not None:
            self.http_api.close()
        if self.lag is not None:
            self.lag.stop()
        engine.shutdown(self.stop_budget)
        if self.log_capture is not None:
            self.log_capture.close()  # what the replicas wrote last is drained into the files
        self._end_adopted()
        if self.manager is not None:
            self.manager.stop(5.0)  # EOF on its reply pipe: the manager exits by itself
        if self.watchdog is not None:
            self.watchdog.stop_quietly()
        journal = engine.journal
        if journal.store is not None:
            journal.event("stop", {"pid": os.getpid()})
            err = journal.commit()
            if err is not None:
                log.error("the stop could not be journaled: %s", err)
            try:
                journal.store.close()
            except StoreError as err:
                log.error("closing the journal: %s", err)
        engine.close()
        if self.fd_reserve is not None:
            self.fd_reserve.close()
        if self.containment is not None and self.containment.close():
            containment.forget(self.paths)  # the subtree is gone: nothing for a next start to kill
        log.info("daemon %d stopped", os.getpid())

    def _end_adopted(self) -> None:
        """Orphans re-parented to us (a worker's descendants that left its group, e.g. with
        setsid) outlive their replica; a clean stop ends them too, and their descendants."""
        me = os.getpid()
        children = (self.manager.pid if self.manager else None, self.watchdog.pid if self.watchdog else None)
        system = {pid for pid in children if pid is not None} | set(self._engine.system_pids())
        adopted = [Entry(st.pid, st.start_time, None, "process", "adopted")
                   for st in scan().values() if st.ppid == me and st.pid not in system and st.state != "Z"]
        if adopted:
            report = self.os.sweep(adopted, grace=min(self.grace, 1.0), exclude=system)
            log.info("ended %d adopted orphan(s) and their descendants", len(report.get("processes", adopted)))
        self.reap_orphans()

    def _remove_runtime_files(self) -> None:
        for path in (self.paths.socket, self.paths.authkey):
            path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            self.paths.pidfile.unlink(missing_ok=True)  # unlinked while still locked
            os.close(self._lock_fd)
            self._lock_fd = None


def run_foreground(paths: Paths, *, ready_fd: int | None = None, **settings: Any) -> int:
    """Run a daemon in this process until it is stopped; ``settings`` are Daemon's."""
    # The daemon does not keep its caller's directory (another user's, perhaps, and one
    # nobody could unmount): what it was given relative to it is made absolute first, and
    # so are PYTHONPATH's entries, which its helpers (started with -P) get (interpreter.py).
    if settings.get("config_path") is not None:
        settings["config_path"] = os.path.abspath(settings["config_path"])
    pythonpath = program_env(os.environ).get("PYTHONPATH")
    if pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = pythonpath
    os.chdir("/")
    sys.stderr.flush()
    daemon = Daemon(paths, ready_fd=ready_fd, **settings)
    daemon.log_sink = logsink.install(fd=sys.stderr.fileno())
    try:
        return daemon.run()
    finally:
        # Done, and about to exit: Python's finalization puts SIG_DFL back under handlers
        # it set, so a stop signal in those last milliseconds would turn a clean exit into
        # "killed by SIGTERM" for systemd or a shell. Ignored ones stay ignored.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)


def _main(argv: list[str] | None = None) -> int:
    """An upgrade's two uses of the code installed now (handover.py; nobody else runs them):
    ``--check VERSION``, run in a separate process first: this module imported (and with it
    every daemon module), can it read that hand-over version; ``--state-dir DIR --handover
    FD``: the new image, exec'd in the daemon's process."""
    import argparse

    from .handover import check, read_document

    parser = argparse.ArgumentParser(prog="python -m orchestrator.daemon.main")
    parser.add_argument("--check", metavar="VERSION")
    parser.add_argument("--state-dir")
    parser.add_argument("--handover", type=int, metavar="FD")
    args = parser.parse_args(argv)
    if args.check is not None:
        return check(args.check)
    if args.state_dir is None or args.handover is None:
        parser.error("--state-dir and --handover, or --check")
    try:
        doc = read_document(args.handover)
    except (OSError, ValueError) as err:
        # Nothing was taken over: the watchdog ends the replicas when we exit.
        print(f"orchestrator: upgrade: cannot read the hand-over: {err}", file=sys.stderr, flush=True)
        return 70
    return run_foreground(Paths(args.state_dir), handover=doc, **doc["daemon"]["settings"])


__all__ = ["Daemon", "run_foreground"]

if __name__ == "__main__":
    sys.exit(_main())

