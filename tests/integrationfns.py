"""Tasks of the Dask and joblib tests (tests/test_integrations_*.py): importable by name in
a Dask worker and in the executor's workers (tests/ is on their import path). A task tells
the test what it does over a unix socket the test listens on, so that the test waits on the
word itself (an accept, a recv, each bounded), not on a file that may not be there yet."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from orchestrator import Cancelled


def pid(_: object = None) -> int:
    return os.getpid()


def environ(name: str) -> str | None:
    return os.environ.get(name)


def announce_then_sleep(path: str, seconds: float, token: object = None) -> str:
    """Says ``pid`` on the socket at ``path``, then sleeps; a Cancelled that reaches it
    says ``cancelled <time.monotonic()>`` there (one clock for every process of the host)
    before it goes on up."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(f"{os.getpid()}\n".encode())
        try:
            time.sleep(seconds)
        except Cancelled:
            sock.sendall(f"cancelled {time.monotonic()}\n".encode())
            raise
    return f"slept {seconds}"


def fail_after(seconds: float, message: str) -> None:
    time.sleep(seconds)
    raise ValueError(message)


def tree(dask_worker: Any) -> list[int]:
    """For ``client.run``: the Dask worker's pid and its descendants' (the executor's
    watchdog, spawner, workers)."""
    import psutil

    me = psutil.Process()
    return [me.pid, *(p.pid for p in me.children(recursive=True))]


def replica_pids(dask_worker: Any, plugin: str) -> list[int]:
    """For ``client.run``: the pids of the executor's workers on this Dask worker."""
    executor = dask_worker.plugins[plugin].executor
    return [r["pid"] for r in executor.orchestrator.status()["replicas"] if r.get("pid")]


def no_restart(dask_worker: Any) -> None:
    """For ``client.run(..., nanny=True)``: the nanny starts no new worker when its worker
    exits (its ``close_gracefully``, what a cluster's shutdown tells it)."""
    dask_worker.close_gracefully(reason="the test kills its worker")
