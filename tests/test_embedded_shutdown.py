"""The embedded loop's close ends every tree it stopped, grace included, before it returns.

A worker's descendant in a session of its own that ignores SIGTERM is outside the worker's
process group: only the SIGKILL after the grace ends it (process groups; a cgroup's kill
reaches it anyway). That kill is a timer of the loop: a close that returned once the main
processes were reaped dropped it, and the descendant outlived the ``with`` block. Each test
here looks right when the ``with`` (or ``close()``) returns, without waiting: nothing of
the tree may be alive then; and the close took the grace, not much more.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import escapefns
from conftest import TAG_VAR, ProcessTracker
from helpers import Ident, cgroup_unusable, wait_for
from orchestrator import Executor, Orchestrator

GRACE = 1.0
SLACK = 8.0  # what a close may take beyond the grace on a loaded machine (reaps, spawner stop, cgroup removal)


@pytest.fixture(params=["process-group", "cgroup"])
def containment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The containment of the loops made in the test: process groups (the escape case) or a
    cgroup per replica (skipped where this process cannot make cgroups)."""
    if request.param == "cgroup":
        why = cgroup_unusable()
        if why is not None:
            pytest.skip(why)
    else:  # an Executor asks for "auto": make that process groups for this test
        from orchestrator.daemon import containment as module

        monkeypatch.setattr(module, "detect", lambda *a, **k: module.ProcessGroups("process groups for the test"))
    yield request.param


def _tree(started: Path) -> list[Ident]:
    wait_for(lambda: started.exists(), 60, "the task and its setsid'd child")
    idents = [Ident.of(int(p)) for p in started.read_text().split()]
    assert all(i is not None for i in idents), idents
    return [i for i in idents if i is not None]


def _executor(procs: ProcessTracker, tag: str, **kwargs: Any) -> Executor:
    ex = Executor(max_workers=1, grace=GRACE, env={TAG_VAR: tag}, **kwargs)
    procs.track(ex.orchestrator.watchdog_pid)
    return ex


def _mode(ex: Executor) -> str:
    return ex.orchestrator.containment.mode


@pytest.mark.parametrize("swallow", [False, True], ids=["ends-on-terminated", "swallows-terminated"])
def test_shutdown_cancel_futures_leaves_no_escaped_descendant(containment: str, swallow: bool, tmp_path: Path,
                                                              procs: ProcessTracker, orch_test_tag: str) -> None:
    started = tmp_path / "started"
    with _executor(procs, orch_test_tag) as ex:
        assert _mode(ex) == containment
        fut = ex.submit(escapefns.escape_and_hang, str(started), swallow)
        tree = _tree(started)
        for ident in tree:
            procs.track(ident.pid)
        begun = time.monotonic()
        ex.shutdown(wait=True, cancel_futures=True)
    took = time.monotonic() - begun
    assert [i for i in tree if i.alive()] == [], f"{containment}: alive after shutdown: {tree}"
    assert took < GRACE + SLACK, took
    assert fut.done()


def test_plain_shutdown_after_a_timeout_leaves_no_escaped_descendant(containment: str, tmp_path: Path,
                                                                     procs: ProcessTracker,
                                                                     orch_test_tag: str) -> None:
    """The task times out (and swallows its TaskTimeout); the ``with`` block's plain
    shutdown waits for that future, then closes."""
    started = tmp_path / "started"
    with _executor(procs, orch_test_tag, timeout=1.0) as ex:
        assert _mode(ex) == containment
        fut = ex.submit(escapefns.escape_and_hang, str(started), True)
        tree = _tree(started)
        for ident in tree:
            procs.track(ident.pid)
    assert [i for i in tree if i.alive()] == [], f"{containment}: alive after the with block: {tree}"
    with pytest.raises(cf.TimeoutError):
        fut.result(timeout=0)


@pytest.mark.parametrize("first", [None, "terminate"], ids=["close", "terminate-then-close"])
def test_orchestrator_close_leaves_no_escaped_descendant(containment: str, first: str | None, tmp_path: Path,
                                                         procs: ProcessTracker, orch_test_tag: str) -> None:
    """A plain replica pool: each replica leaves a setsid'd child that ignores SIGTERM, and
    ends on SIGTERM itself. ``terminate``: one replica is terminated (and has ended) just
    before the close, its child's kill after the grace still to come."""
    main = ("import subprocess, sys, time, os; d = sys.argv[1]; "
            "c = subprocess.Popen([sys.executable, '-c', sys.argv[2], os.path.join(d, f'{os.getpid()}.armed')], "
            "start_new_session=True); "
            "[time.sleep(0.01) for _ in range(3000) if not os.path.exists(os.path.join(d, f'{os.getpid()}.armed'))]; "
            "open(os.path.join(d, f'{os.getpid()} {c.pid}'), 'w').close(); time.sleep(300)")
    marks = tmp_path / "marks"
    marks.mkdir()
    orch = Orchestrator(grace=GRACE, state_dir=str(tmp_path), env={TAG_VAR: orch_test_tag},
                        cgroup="auto" if containment == "cgroup" else "off")
    with orch:
        procs.track(orch.watchdog_pid)
        ids = orch.launch("esc", [sys.executable, "-c", main, str(marks), escapefns.STUBBORN], count=2, wait=True)
        wait_for(lambda: len([p for p in marks.iterdir() if " " in p.name]) == 2, 60, "both replicas' children")
        found = [Ident.of(int(p)) for m in marks.iterdir() if " " in m.name for p in m.name.split()]
        assert all(i is not None for i in found), found
        tree = [i for i in found if i is not None]
        for ident in tree:
            procs.track(ident.pid)
        if first == "terminate":
            orch.terminate(ids[0], wait=True, timeout=30)
        begun = time.monotonic()
    took = time.monotonic() - begun
    assert [i for i in tree if i.alive()] == [], f"{containment}: alive after close: {tree}"
    assert took < GRACE + SLACK, took
