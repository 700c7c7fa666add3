"""Site hook of the adapter's venv: a fresh interpreter that a CPython test starts
(``assert_python_ok``, in isolated mode ``-I``: no ``PYTHONPATH``) gets the stand-in too.

The venv's ``.pth`` line (written by ``venvcache.py``) puts this directory on ``sys.path`` and
imports this module only when ``ORCH_CPYTHON_STANDIN`` names it (the runner sets it); then
the checkout under test goes on ``sys.path`` as well and ``from concurrent.futures import
ProcessPoolExecutor`` gives ``cpython_standin.ProcessPoolExecutor``. The stand-in (and
orchestrator) is imported only when the name is asked for, so the other interpreters of the
venv (the pool's spawner, the daemon's helpers) pay one import of ``concurrent.futures``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "ORCH_CPYTHON_STANDIN"  # this directory
REPO_ENV = "ORCH_CPYTHON_REPO"  # the checkout whose orchestrator is tested


def _activate() -> None:
    repo = os.environ.get(REPO_ENV)
    if repo and repo not in sys.path:
        sys.path.insert(0, repo)
    import concurrent.futures as cf

    previous = cf.__getattr__  # the package's lazy import of its two executors

    def __getattr__(name: str) -> Any:
        if name == "ProcessPoolExecutor":
            from cpython_standin import ProcessPoolExecutor

            cf.ProcessPoolExecutor = ProcessPoolExecutor  # type: ignore[misc]
            return ProcessPoolExecutor
        return previous(name)

    cf.__getattr__ = __getattr__  # type: ignore[method-assign]


if os.environ.get(ENV):
    _activate()
