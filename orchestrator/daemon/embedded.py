"""The embedded Python API: the control loop inside the calling process.

    with Orchestrator(grace=2.0) as orch:
        ids = orch.launch("web", ["python", "-m", "http.server"], count=3, wait=True)
        orch.terminate(ids[0])
        orch.scale("web", 5)
        print(orch.status())
    # here every replica has been terminated and reaped (with the descendants that left
    # its process group: SIGKILLed after the grace and gone), and the watchdog has exited

The loop is built as the daemon's is (loop.py), without the daemon's additions, and runs
in one background thread, the only owner of the replica table; the methods
below send it commands (the same plain-data commands the daemon's channel carries) and
wait, bounded, for the reply. Any thread may call them.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
from typing import Any, Mapping

from ..errors import ChannelError, ShuttingDown
from ..protocol import Reply, ReplyTo, command, raise_reply
from ..verbs import Verbs
from .children import WatchdogChild
from .engine import Engine, EngineConfig
from .logcapture import LogCapture
from .loop import build_loop
from .osapi import OSApi
from .recovery import recover_leftovers

log = logging.getLogger("orchestrator")


class Orchestrator(Verbs):
    """Runs the control loop in this process; a context manager.

    Leaving the context terminates every replica (SIGTERM to its group, ``grace``, SIGKILL)
    and returns only when all are reaped and every process of their trees has exited: a
    descendant in a session of its own that ignores SIGTERM included (its SIGKILL after the
    grace is a timer of the loop, which the close runs before it returns). ``watchdog=True`` starts a watchdog process that
    kills every worker if this process dies without leaving the context (SIGKILL, OOM),
    then removes their cgroups and the temporary dir this process made for the watchdog's
    report (``$TMPDIR/orchestrator-*``, made when neither ``state_dir`` nor ``db`` is given).
    ``db``: journal pools, replicas and events into that SQLite file (orchestrator.store);
    ids then continue across runs, and replicas of a run that was killed are recorded LOST.
    ``cgroup``: "auto" or a cgroup2 dir gives each replica a cgroup of its own, in a subtree
    made under this process's cgroup (or that dir) and removed by ``close()``; this process
    itself stays where it is. None or "off" (the default): process groups.
    ``inherit_output``: replicas write to this process's stdout and stderr (fds 1 and 2),
    as a ProcessPoolExecutor's workers do; by default their output is dropped. ``logs``: a
    dir where it is kept instead, as the daemon keeps it (``<id>.out``/``.err``, rotated,
    and each executor task's own, ``<pool>#<n>.out``/``.err``: logcapture.py).
    """

    def __init__(
        self,
        *,
        grace: float = 5.0,
        watchdog: bool = True,
        pdeathsig: int | None = signal.SIGKILL,
        env: dict[str, str] | None = None,
        spawn_batch: int = 64,
        call_timeout: float = 60.0,
        state_dir: str | None = None,
        db: str | os.PathLike[str] | None = None,
        cgroup: str | None = None,
        inherit_output: bool = False,
        logs: str | os.PathLike[str] | None = None,
    ) -> None:
        self._token = secrets.token_hex(8)
        self._config = EngineConfig(grace=grace, spawn_batch=spawn_batch, env=env, token=self._token, spawners=True,
                                    stdio=(1, 2) if inherit_output and logs is None else None)
        self._logs = logs
        self._pdeathsig = pdeathsig
        self._use_watchdog = watchdog
        # The watchdog writes its report into the state dir: beside the journal if there is
        # one, else a temporary dir that close() removes.
        self._state_dir = state_dir if state_dir is not None or db is None else os.path.dirname(os.path.abspath(db))
        self._db = db
        self._cgroup = cgroup
        self.containment: Any = None
        self._own_dir: str | None = None
        self._call_timeout = call_timeout
        self._engine: Engine | None = None
        self._watchdog: WatchdogChild | None = None
        self._capture: LogCapture | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._started = threading.Event()
        self._failure: BaseException | None = None

    # -- lifetime ---------------------------------------------------------------------

    def __enter__(self) -> "Orchestrator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        # Set setproctitle up here, once, instead of in every forked worker (~120 µs each
        # on their first title). Like any setproctitle user, this moves the environment
        # block: /proc/PID/environ of this process no longer shows it (os.environ is intact).
        from setproctitle import getproctitle

        getproctitle()
        link = None
        if self._use_watchdog:
            from watchdog import WatchdogLink

            report_dir = self._state_dir
            if report_dir is None:
                report_dir = self._own_dir = tempfile.mkdtemp(prefix="orchestrator-")
            # A dir of our own is removed by close(), or by the watchdog once it has cleaned
            # up after our death (no report then: nobody would look for it). Never a dir
            # the caller gave.
            link = WatchdogLink(report_dir, token=self._token, batch=True,
                                remove_files=[self._own_dir] if self._own_dir is not None else ())
        store = None
        if self._db is not None:
            from ..store import Store  # sqlite3 only for a caller that asked for a journal

            store = Store(self._db)
        os_api = OSApi(pdeathsig=self._pdeathsig)
        if self._cgroup not in (None, "off"):
            from .containment import detect

            self.containment = detect(self._cgroup, self._state_dir or os.getcwd(), move_self=False,
                                      name=f"orchestrator-embedded-{os.getpid()}-{self._token[:8]}")
            if link is not None:
                link.cgroup_subtree = self.containment.path  # killed and removed if this process dies
        loop = build_loop(self._config, os_api=os_api, store=store, link=link, containment=self.containment,
                          logs=self._logs)
        self._engine, self._watchdog, self._capture = loop.engine, loop.watchdog, loop.log_capture
        if store is not None:
            recover_leftovers(store, os_api, grace=min(self._config.grace, 1.0))  # a killed earlier run
            self._engine.supervisor.restore(store.load()[0], relaunch=False)  # ids continue, never reused
        self._thread = threading.Thread(target=self._loop, name="orchestrator-loop", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise ChannelError("the control loop did not start within 30 s")
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Terminate every replica, wait until all are reaped, stop the watchdog."""
        if self._thread is None:
            return
        self._stop = True
        if self._engine is not None:
            try:
                self._engine.submit({"op": "ping"}, lambda _msg: None)  # wake the loop
            except ShuttingDown:
                pass  # it has closed already
        self._thread.join()
        self._thread = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        if self._failure is not None:
            raise self._failure

    def _loop(self) -> None:
        engine = self._engine
        assert engine is not None
        try:
            if self._watchdog is not None:
                self._watchdog.start()
            # From this thread (the replicas' PDEATHSIG follows it), and ready before the
            # first launch: else that one would be forked from this (maybe big) process.
            engine.start_spawners(wait=10.0)
            self._started.set()
            while not self._stop:
                engine.run_once(None)
        except BaseException as err:  # the loop died: record why, then still clean up below
            self._failure = err
            log.exception("control loop failed")
        finally:
            self._started.set()
            try:
                engine.shutdown()
                if self._watchdog is not None:
                    self._watchdog.stop_quietly()
            finally:
                engine.close()
                if self._capture is not None:
                    self._capture.close()  # what the replicas wrote last is drained into the files
                if engine.store is not None:
                    engine.store.close()
                engine.containment.close()  # the default process groups too: what they still hold

    # -- commands ---------------------------------------------------------------------

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Send one command to the loop and wait (bounded) for its reply."""
        engine = self._engine
        if engine is None or self._thread is None or self._stop or engine.closing:
            raise ShuttingDown("the orchestrator is not running")
        done = threading.Event()
        box: list[Reply] = []

        def reply(msg: Reply) -> None:
            box.append(msg)
            done.set()

        engine.submit(command(op, args), reply)
        limit = self._call_timeout if timeout is None else timeout
        if not done.wait(limit):
            raise ChannelError(f"{op}: no reply from the control loop within {limit:g} s")
        return raise_reply(box[0])

    def send(self, op: str, args: Mapping[str, Any] | None, on_reply: ReplyTo) -> None:
        """Send one command without waiting: ``on_reply(msg)`` is called once, from the
        loop's thread, so it must be quick and must not call back into this object."""
        engine = self._engine
        if engine is None or self._thread is None or self._stop or engine.closing:
            raise ShuttingDown("the orchestrator is not running")
        engine.submit(command(op, args), on_reply)

    @property
    def watchdog_pid(self) -> int | None:
        return self._watchdog.pid if self._watchdog is not None else None

    @property
    def spawner_pids(self) -> set[int]:
        """The spawner processes that fork this orchestrator's replicas (spawner.py; launcher.py starts them)."""
        engine = self._engine
        return set(engine.system_pids()) if engine is not None and self._thread is not None else set()

    @property
    def pid(self) -> int:
        return os.getpid()

