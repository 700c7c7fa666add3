"""Run CPython's own ``test_concurrent_futures`` process-pool tests against
``orchestrator.Executor`` (``cpython_standin``), and write each test's outcome as JSON.

    python3.13 tests/cpython_futures/run.py --out results.json [--modules M,M] [-k PATTERN] [--per-test 15]

Run by ``tests/test_cpython_futures.py`` in a venv of ``venvcache.py`` (the Python whose test
package it is, with orchestrator's dependencies; the checkout on ``PYTHONPATH``). For each
module of ``MODULES``, every class CPython generates for its forkserver process pool
(``create_executor_tests``) is made again with ``OrchestratorMixin`` in place of
``ProcessPoolForkserverMixin`` and named as CPython would name it
(``OrchestratorProcessPoolExecutorTest``, ...); the classes' tests are CPython's, unchanged,
in their own module (its ``setUpModule`` runs). One class of test_init names CPython's own
classes in its tests (``FailingInitializerResourcesTest``): it is made again with one test
that runs ours instead.

Each test is bounded (``--per-test`` s): past it the main thread gets ``Hung`` raised where
it waits (a signal from a guard thread: a hang is one test's error, not the end of the run),
then as long again for its tearDown. The run ends with ``os._exit`` after a bounded
shutdown of any executor a hung test left behind: an executor that hangs would hang the
interpreter's exit too. The processes still there are listed in the JSON for the caller.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Every module of the package that has process-pool tests. Left out: test_future (Future
# alone: no executor is involved, so it would test the standard library) and
# test_thread_pool (threads).
MODULES = ("test_process_pool", "test_shutdown", "test_wait", "test_as_completed", "test_deadlock", "test_init")
PACKAGE = "test.test_concurrent_futures"
REPLACED = "ProcessPoolForkserverMixin"


class Hung(BaseException):
    """Raised in the main thread when a test outlives its bound (a BaseException: code
    under test that catches Exception does not swallow it)."""


class Guard:
    """One thread for the whole run (a thread per test would show in the tests' own
    thread accounting): while a test is armed and its deadline passes, SIGUSR2 to the main
    thread, whose handler raises Hung; again every ``bound`` s until the test ends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self.test: str | None = None
        self.fired: dict[str, int] = {}
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGUSR2, self._raise)
        threading.Thread(target=self._watch, name="cpython-adapter-guard", daemon=True).start()

    def arm(self, test: str, bound: float) -> None:
        with self._cond:
            self.test, self.bound = test, bound
            self._deadline = time.monotonic() + bound
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self.test, self._deadline = None, None
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                assert self.test is not None and self._main is not None
                self.fired[self.test] = self.fired.get(self.test, 0) + 1
                self._deadline = time.monotonic() + self.bound
                signal.pthread_kill(self._main, signal.SIGUSR2)

    def _raise(self, signum: int, frame: Any) -> None:
        if self.test is not None:  # a signal that comes after the test ended does nothing
            raise Hung(f"{self.test}: no end within {self.bound:g} s (the adapter's bound)")


class Recorder(unittest.TestResult):
    """Each test's outcome: pass, fail, error, skip (with the reason), hung (Hung raised in
    it: its error says where it waited)."""

    def __init__(self, guard: Guard, bound: float, verbose: bool) -> None:
        super().__init__()
        self.guard, self.bound, self.verbose = guard, bound, verbose
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._t0 = 0.0
        self._live: set[int] = set()

    @staticmethod
    def key(test: unittest.TestCase) -> str:
        """``module.Class.test`` without the package's prefix."""
        return test.id().removeprefix(PACKAGE + ".")

    def _set(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        rec = self.outcomes.setdefault(self.key(test), {"outcome": "pass", "detail": ""})
        if rec["outcome"] in ("pass", "skip") or outcome == "hung":  # the first failure is kept; a hang wins
            rec["outcome"] = outcome
        rec["detail"] = (rec["detail"] + "\n" + detail).strip()[-6000:]

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self.outcomes[self.key(test)] = {"outcome": "pass", "detail": ""}
        self._live = {id(e) for e in _live()}
        self._t0 = time.monotonic()
        self.guard.arm(self.key(test), self.bound)

    def stopTest(self, test: unittest.TestCase) -> None:
        self.guard.disarm()
        super().stopTest(test)
        rec = self.outcomes[self.key(test)]
        rec["seconds"] = round(time.monotonic() - self._t0, 2)
        # A test that failed before its own shutdown() leaves its executor running (as it
        # would leave a ProcessPoolExecutor): ended here, after the test and its tearDown,
        # so that its workers do not weigh on the tests that follow. One that hung would
        # hang here too: the end of the run deals with it.
        left = [e for e in _live() if id(e) not in self._live]
        if left:
            rec["left_executors"] = len(left)
            if rec["outcome"] != "hung":
                _shutdown(left, 10.0)
        if self.verbose:
            print(f"{rec['outcome']:5} {rec['seconds']:6.2f} s  {self.key(test)}", file=sys.stderr, flush=True)

    def _text(self, err: Any) -> str:
        return "".join(traceback.format_exception(*err))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._set(test, "hung" if err[0] is Hung else "error", self._text(err))

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._set(test, "fail", self._text(err))

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "hung" if err[0] is Hung else "fail" if issubclass(err[0], test.failureException) else "error"
            self._set(test, kind, f"{subtest.id()}:\n{self._text(err)}")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._set(test, "skip", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._set(test, "fail", "expected failure: " + self._text(err))

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._set(test, "fail", "unexpected success")


def classes(module: Any, mixin: type) -> list[type]:
    """Ours for each class of ``module`` that CPython made for its forkserver pool."""
    out = []
    replaced = getattr(importlib.import_module(PACKAGE + ".util"), REPLACED)
    for name, cls in sorted(vars(module).items()):
        if isinstance(cls, type) and replaced in cls.__bases__:
            bases = tuple(mixin if b is replaced else b for b in cls.__bases__)
            out.append(type(name.replace("ProcessPoolForkserver", "Orchestrator"), bases,
                            {"__module__": module.__name__}))
    return out


def init_resources_class(module: Any, ours: list[type]) -> type:
    """test_init's ``FailingInitializerResourcesTest`` runs CPython's spawn and forkserver
    classes by name; this one runs ours through the same check (the resource tracker exits
    cleanly after the failing initializer's test)."""
    failing = next(c for c in ours if c.__name__ == "OrchestratorFailingInitializerTest")
    base = module.FailingInitializerResourcesTest

    def test_orchestrator(self: Any) -> None:
        self._test(failing)

    # None hides CPython's two (the loader takes only callables): no test of its pools here.
    body: dict[str, Any] = {"__module__": module.__name__, "test_orchestrator": test_orchestrator,
                            "test_spawn": None, "test_forkserver": None}
    return type("OrchestratorFailingInitializerResourcesTest", (base,), body)


def build(modules: list[str], patterns: list[str]) -> unittest.TestSuite:
    import cpython_standin

    mixin = cpython_standin.mixin()
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for name in modules:
        module = importlib.import_module(f"{PACKAGE}.{name}")
        ours = classes(module, mixin)
        if name == "test_init":
            ours.append(init_resources_class(module, ours))
        for cls in ours:
            for test in loader.loadTestsFromTestCase(cls):
                key = Recorder.key(test)  # type: ignore[arg-type]
                if not patterns or any(fnmatch.fnmatch(key, p) or p in key for p in patterns):
                    suite.addTest(test)
    return suite


def _live() -> list[Any]:
    """The executors that have not shut down (orchestrator's own account of them)."""
    from orchestrator import executor as ex_mod

    return list(ex_mod._LIVE)


def _shutdown(executors: list[Any], bound: float) -> None:
    """``shutdown(cancel_futures=True)`` of each, waited for at most ``bound`` s in all (an
    executor that hangs is left to the watchdog, which ends its workers with this process)."""
    threads = [threading.Thread(target=e.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True)
               for e in executors]
    for t in threads:
        t.start()
    deadline = time.monotonic() + bound
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _leftovers(bound: float) -> list[list[float]]:
    """Shut down (bounded) the executors still live; the processes still there."""
    import psutil

    _shutdown(_live(), bound)
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append([p.pid, p.create_time()])
        except psutil.NoSuchProcess:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON of outcomes")
    ap.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of {', '.join(MODULES)} (all)")
    ap.add_argument("-k", action="append", default=[], help="only tests whose id contains it (or matches the glob)")
    ap.add_argument("--per-test", type=float, default=15.0, help="seconds a test may take (then as long for its tearDown)")
    ap.add_argument("-v", action="store_true", help="a line per test on stderr")
    args = ap.parse_args(argv)
    modules = [m for m in args.modules.split(",") if m]
    if not modules or set(modules) - set(MODULES):
        ap.error(f"--modules: choose from {', '.join(MODULES)}")

    os.environ["ORCH_CPYTHON_STANDIN"] = str(HERE)  # the fresh interpreters of the tests: the site hook
    os.environ["ORCH_CPYTHON_REPO"] = str(REPO)
    # The pool's spawner is a fresh interpreter: it finds this checkout's orchestrator here.
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO) not in path:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, path)])
    sys.path.insert(1, str(REPO))
    import cpython_standin
    from test import support

    support.verbose = 0  # as regrtest without -v: no per-test timings on stdout
    cpython_standin.install()
    t0 = time.monotonic()
    suite = build(modules, args.k)
    guard = Guard()
    result = Recorder(guard, args.per_test, args.v)
    suite.run(result)
    left = _leftovers(5.0)
    doc = {"python": sys.version, "executable": sys.executable, "modules": modules,
           "per_test_s": args.per_test, "wall_s": round(time.monotonic() - t0, 1), "tests": result.outcomes,
           "leftover_processes": left}
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    counts: dict[str, int] = {}
    for rec in result.outcomes.values():
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    print(f"{len(result.outcomes)} tests in {doc['wall_s']} s: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), flush=True)
    sys.stderr.flush()
    os._exit(0)  # an executor that hung in a test would hang the interpreter's exit (atexit)


if __name__ == "__main__":
    sys.exit(main())
