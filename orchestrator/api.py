"""The embedded Python API: the control loop inside the calling process.

    with Orchestrator(grace=2.0) as orch:
        ids = orch.launch("web", ["python", "-m", "http.server"], count=3, wait=True)
        orch.terminate(ids[0])
        orch.scale("web", 5)
        print(orch.status())
    # here every replica has been terminated and reaped, and the watchdog has exited

The loop runs in one background thread, the only owner of the replica table; the methods
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
from typing import Any, Callable, Sequence

from .engine import Engine, EngineConfig
from .errors import ERROR_TYPES, ChannelError, OrchestratorError, ShuttingDown
from .spawner import OSApi
from .spec import WorkerSpec

log = logging.getLogger("orchestrator")


def make_spec(
    command: Sequence[str] | None = None,
    target: str | Callable[[], Any] | None = None,
    env: dict[str, str] | None = None,
) -> WorkerSpec:
    """A WorkerSpec from the arguments the API and the CLI take."""
    if callable(target):
        return WorkerSpec(func=target, env=dict(env or {}))
    return WorkerSpec(
        command=tuple(command) if command is not None else None, target=target, env=dict(env or {})
    )


def raise_reply(msg: dict) -> Any:
    """The result of a reply, or the typed error it carries."""
    if msg.get("ok"):
        return msg.get("result")
    cls = ERROR_TYPES.get(msg.get("code", ""), OrchestratorError)
    raise cls(msg.get("error", "unknown error"))


class Orchestrator:
    """Runs the control loop in this process; a context manager.

    Leaving the context terminates every replica (SIGTERM to its group, ``grace``, SIGKILL)
    and returns only when all are reaped. ``watchdog=True`` starts a watchdog process that
    kills every worker if this process dies without leaving the context (SIGKILL, OOM).
    ``db``: journal pools, replicas and events into that SQLite file (orchestrator.store);
    ids then continue across runs, and replicas of a run that was killed are recorded LOST.
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
        db: str | os.PathLike | None = None,
    ) -> None:
        self._token = secrets.token_hex(8)
        self._config = EngineConfig(grace=grace, spawn_batch=spawn_batch, env=env, token=self._token)
        self._pdeathsig = pdeathsig
        self._use_watchdog = watchdog
        # The watchdog writes its report into the state dir: beside the journal if there is
        # one, else a temporary dir that close() removes.
        self._state_dir = state_dir if state_dir is not None or db is None else os.path.dirname(os.path.abspath(db))
        self._db = db
        self._own_dir: str | None = None
        self._call_timeout = call_timeout
        self._engine: Engine | None = None
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

            if self._state_dir is None:
                self._own_dir = tempfile.mkdtemp(prefix="orchestrator-")
            link = WatchdogLink(self._state_dir or self._own_dir, token=self._token, batch=True)
        store = None
        if self._db is not None:
            from .store import Store

            store = Store(self._db)
        self._engine = Engine(self._config, os_api=OSApi(pdeathsig=self._pdeathsig), watchdog=link, store=store)
        if store is not None:
            from .daemon import recover_leftovers

            recover_leftovers(store, grace=min(self._config.grace, 1.0))  # a killed earlier run
            self._engine.restore(store.load()[0], relaunch=False)  # ids continue, never reused
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
            engine.start()
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
                engine.stop_watchdog()
            finally:
                engine.close()
                if engine.store is not None:
                    engine.store.close()

    # -- commands ---------------------------------------------------------------------

    def call(self, op: str, args: dict | None = None, bound: float | None = None) -> Any:
        """Send one command to the loop and wait (bounded) for its reply."""
        engine = self._engine
        if engine is None or self._thread is None or self._stop or engine.closing:
            raise ShuttingDown("the orchestrator is not running")
        done = threading.Event()
        box: list[dict] = []

        def reply(msg: dict) -> None:
            box.append(msg)
            done.set()

        engine.submit({"id": None, "op": op, "args": args or {}}, reply)
        limit = self._call_timeout if bound is None else bound
        if not done.wait(limit):
            raise ChannelError(f"{op}: no reply from the control loop within {limit:g} s")
        return raise_reply(box[0])

    def launch(
        self,
        pool: str,
        command: Sequence[str] | None = None,
        *,
        target: str | Callable[[], Any] | None = None,
        count: int = 1,
        env: dict[str, str] | None = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> list[str]:
        """Add ``count`` replicas to ``pool``; returns their ids. ``wait``: until each runs."""
        spec = make_spec(command, target, env)
        result = self.call(
            "launch", {"pool": pool, "count": count, "spec": spec, "wait": wait, "timeout": timeout}, _limit(timeout)
        )
        return list(result) if isinstance(result, dict) else result

    def terminate(self, *ids: str, wait: bool = False, timeout: float | None = None) -> list[str]:
        """Stop these replicas; already-ended ones are a no-op. ``wait``: until reaped."""
        result = self.call("terminate", {"ids": list(ids), "wait": wait, "timeout": timeout}, _limit(timeout))
        return list(result)

    def scale(
        self,
        pool: str,
        n: int,
        *,
        command: Sequence[str] | None = None,
        target: str | Callable[[], Any] | None = None,
    ) -> dict:
        spec = make_spec(command, target) if command is not None or target is not None else None
        return self.call("scale", {"pool": pool, "n": n, "spec": spec})

    def status(self, all: bool = False) -> dict:  # noqa: A002 - mirrors `status --all`
        return self.call("status", {"all": all})

    def wait(self, ids: Sequence[str], until: str = "running", timeout: float = 60.0) -> dict:
        """Block until every replica is RUNNING (or ended), or ``until="ended"``: reaped."""
        return self.call("wait", {"ids": list(ids), "until": until, "timeout": timeout}, _limit(timeout))

    @property
    def watchdog_pid(self) -> int | None:
        link = self._engine.watchdog if self._engine else None
        return link.pid if link is not None else None

    @property
    def pid(self) -> int:
        return os.getpid()


def _limit(timeout: float | None) -> float | None:
    """The client-side bound for a command that itself waits up to ``timeout``."""
    return None if timeout is None else timeout + 10.0
