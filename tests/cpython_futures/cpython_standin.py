"""``orchestrator.Executor`` standing in for ``concurrent.futures.ProcessPoolExecutor`` in
CPython's own ``test_concurrent_futures`` (run by ``run.py`` beside this file, under the
Python whose test package it is).

Three pieces, each as thin as the tests allow:

- ``ProcessPoolExecutor``: ``orchestrator.Executor`` with ``ProcessPoolExecutor``'s
  signature. It is named so because the tests that start a fresh interpreter write
  ``from concurrent.futures import {executor_type.__name__}`` into its code. Its only
  addition is that it takes ``mp_context`` and drops it: our workers are always forked from
  the pool's spawner (a process started for the pool, with ``preload`` imported), the way a
  ``forkserver`` context's are; no context is used by it. Nothing else is added: above all,
  none of ``ProcessPoolExecutor``'s private attributes (``_processes``, ``_broken``, ...):
  a test that reads one fails, and is listed as such in ``expected.toml``.
- ``OrchestratorMixin``: what ``test_concurrent_futures/util.py``'s process-pool mixins are,
  for this executor. It says ``ctx = "forkserver"`` (the tests' branches on the start
  method: fork pre-spawns, refuses ``max_tasks_per_child``, ... ; forkserver is how our
  workers come to be), and ``get_context()`` gives that real context for what the tests
  make with it (``Manager()``, ``Semaphore``, ``Queue``).
- ``install()``: ``concurrent.futures.ProcessPoolExecutor`` is the stand-in from then on in
  this process, so the tests that name the class directly (``futures.ProcessPoolExecutor(
  max_workers=5, ...)``, and the fresh interpreters' imports through the site hook
  ``cpython_standin_hook``) test ours, not the standard library's.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

import orchestrator

CONTEXT = "forkserver"


class ProcessPoolExecutor(orchestrator.Executor):
    """``orchestrator.Executor`` called as ``ProcessPoolExecutor`` is."""

    def __init__(self, max_workers: int | None = None, mp_context: Any = None,
                 initializer: Callable[..., Any] | None = None, initargs: tuple = (), *,
                 max_tasks_per_child: int | None = None) -> None:
        del mp_context  # no start method to choose: every worker is forked from the pool's spawner
        super().__init__(max_workers, initializer=initializer, initargs=initargs,
                         max_tasks_per_child=max_tasks_per_child)


def install() -> None:
    """``concurrent.futures.ProcessPoolExecutor`` is the stand-in from now on (the package
    gives the name through its module ``__getattr__`` until someone sets it: set here)."""
    import concurrent.futures

    concurrent.futures.ProcessPoolExecutor = ProcessPoolExecutor  # type: ignore[misc]


def mixin() -> type:
    """The executor mixin of util.py for the stand-in (made on call: util.py is the test
    package's, importable only where it is)."""
    from test.test_concurrent_futures.util import ExecutorMixin

    class OrchestratorMixin(ExecutorMixin):
        executor_type = ProcessPoolExecutor
        ctx = CONTEXT

        def get_context(self) -> Any:
            return multiprocessing.get_context(self.ctx)

    return OrchestratorMixin
