"""memory_max keeps its word without a memory controller: the worker's whole tree counted
(a child holding the memory, one that left the worker's group too), checked often enough
that a fast allocation is stopped near the limit, the task failed with the reason and not
retried; and the embedded executor in a cgroup of its own where the host allows one,
leaving none behind (after shutdown and after the host's SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import memfns
from conftest import TAG_VAR, ProcessTracker
from helpers import DaemonUnderTest, cgroup_unusable, wait_for, wait_gone
from orchestrator import Client, WorkerLost
from orchestrator.daemon.taskmemory import CHECK_INTERVAL, TreeMemory
from orchestrator.daemon.tasktable import TaskTable
from test_executor import MakeExecutor, make_executor  # noqa: F401  (the fixture)
from watchdog import cgroup
from watchdog.identity import start_time

LIMIT = 200 << 20
NO_CGROUPS = cgroup_unusable()


def _idents(*pids: int) -> list[tuple[int, int]]:
    """(pid, start time in clock ticks): what wait_gone verifies against."""
    out = []
    for pid in pids:
        start = start_time(pid)
        if start is not None:
            out.append((pid, start))
    return out


def _no_memory_controller(ex: Any) -> None:
    containment = ex.orchestrator.containment
    if containment is not None and "memory" in containment.controllers:
        pytest.skip("the memory controller is enabled here: memory_max is the cgroup's memory.max, not the poll")


# -- the poll, embedded (a cgroup per worker where it can be made, else process groups) ----


def test_a_fast_allocation_is_stopped_near_the_limit(make_executor: MakeExecutor, tmp_path: Path) -> None:  # noqa: F811
    """Three workers start 1.5 GiB each, a third of a second apart: wherever the checks
    fall, each is stopped within a few checks of passing the limit."""
    ex = make_executor(max_workers=3, memory_max=LIMIT)
    _no_memory_controller(ex)
    at = time.time() + 3.0  # the workers are up by then
    runs = [(memfns.new_progress(tmp_path / f"progress{i}"), at + i / 3) for i in range(3)]
    futs = [ex.submit(memfns.touch, 1536, progress, str(tmp_path / "runs"), start) for progress, start in runs]
    peaks = []
    for fut, (progress, _) in zip(futs, runs):
        with pytest.raises(WorkerLost) as info:
            fut.result(timeout=60)
        assert info.value.reason == "memory limit 200 MiB exceeded"
        touched, before = memfns.read_progress(Path(progress))
        peaks.append((before >> 20) + touched)
    # 20 ms at ~2 GiB/s is ~40 MiB past the limit; the bound leaves room for a loaded
    # machine's late timers. A once-a-second poll lets at least two of them pass 500 MiB.
    assert max(peaks) < (LIMIT >> 20) + 300, f"peaks before the kill: {peaks} MiB"
    assert ex.submit(memfns.resident).result(timeout=60) < LIMIT  # a fresh worker serves the next


def test_a_task_killed_for_memory_is_not_retried(make_executor: MakeExecutor, tmp_path: Path) -> None:  # noqa: F811
    ex = make_executor(max_workers=1, memory_max=LIMIT, retries=2)
    _no_memory_controller(ex)
    runs = tmp_path / "runs"
    fut = ex.submit(memfns.touch, 400, memfns.new_progress(tmp_path / "progress"), str(runs))
    with pytest.raises(WorkerLost) as info:
        fut.result(timeout=60)
    assert info.value.reason == "memory limit 200 MiB exceeded"
    assert len(runs.read_text().split()) == 1, "a task killed for memory_max ran again (retries)"


def test_memory_kills_do_not_put_the_pool_in_a_crash_loop(make_executor: MakeExecutor,  # noqa: F811
                                                          tmp_path: Path) -> None:
    """A greedy task is the task's fault, not its worker's: the worker is replaced at once,
    not counted as a crash (five within a minute would stop the pool replacing workers)."""
    ex = make_executor(max_workers=1, memory_max=LIMIT)
    _no_memory_controller(ex)
    for i in range(6):
        with pytest.raises(WorkerLost, match="memory limit 200 MiB exceeded"):
            ex.submit(memfns.touch, 400, memfns.new_progress(tmp_path / f"p{i}"), str(tmp_path / "runs")).result(60)
    assert ex.submit(memfns.resident).result(timeout=60) < LIMIT
    pool = [p for p in ex.orchestrator.status()["pools"] if p["name"] == ex.pool][0]
    assert pool["state"] != "crashloop" and pool.get("restarts", 0) == 0, pool


@pytest.mark.parametrize("setsid", [False, True], ids=["child", "setsid-child"])
def test_a_child_holding_the_memory_is_counted_and_killed(make_executor: MakeExecutor,  # noqa: F811
                                                          tmp_path: Path, setsid: bool) -> None:
    ex = make_executor(max_workers=1, memory_max=LIMIT)
    _no_memory_controller(ex)
    started = tmp_path / "started"
    fut = ex.submit(memfns.child_holds, 800, str(started), setsid)
    with pytest.raises(WorkerLost) as info:
        fut.result(timeout=60)
    assert info.value.reason == "memory limit 200 MiB exceeded"
    worker, child = (int(p) for p in started.read_text().split())
    assert not wait_gone(_idents(worker, child), 10), "the worker or its child outlived the memory kill"


def test_a_daemon_in_process_group_mode_counts_the_tree(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    """The same in a daemon without cgroups: the tree is found from the kernel's child lists
    or, on a kernel without them, from the scan of /proc."""
    daemon.start("--cgroup", "off")
    started = tmp_path / "started"
    with Client(daemon.state_dir) as client:
        ex = client.executor("mem", max_workers=1, memory_max=LIMIT)
        try:
            fut = ex.submit(memfns.child_holds, 800, str(started), True)
            with pytest.raises(WorkerLost) as info:
                fut.result(timeout=60)
            assert info.value.reason == "memory limit 200 MiB exceeded"
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
    worker, child = (int(p) for p in started.read_text().split())
    assert not wait_gone(_idents(worker, child), 10), "the worker or its setsid child outlived the memory kill"


# -- the tree's measure -------------------------------------------------------------------


@pytest.mark.parametrize("child_lists", [True, False], ids=["child-lists", "proc-scan"])
def test_the_measure_counts_descendants_and_names_those_outside_the_group(child_lists: bool) -> None:
    memory = TreeMemory(lambda: 0.0)
    if child_lists and not memory.child_lists:
        pytest.skip("this kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    memory.child_lists = child_lists
    # A process of its own group (as a worker is), with a child in a session of its own.
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {memfns.HOLD.format(n=100 << 20)!r}],"
              " stdout=subprocess.PIPE, start_new_session=True); c.stdout.readline(); print(c.pid, flush=True);"
              " time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, process_group=0)
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        used, outside = memory.measure(parent.pid, None)
        assert used >= 100 << 20
        assert outside == _idents(child)
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)  # in a session of its own: not in the group below
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()


def test_the_proc_scan_is_paced_by_its_cost() -> None:
    now = [0.0]
    memory = TreeMemory(lambda: now[0])
    memory.child_lists = False
    memory.measure(os.getpid(), None)
    due = memory._scan_due
    assert due <= CHECK_INTERVAL
    now[0] = due - 0.001
    memory._kids = {}  # a scan not redone: what it found stays
    memory.measure(os.getpid(), None)
    assert memory._kids == {}


def test_a_kernel_oom_kill_under_the_cgroups_memory_max_is_that_limit_and_final() -> None:
    """With the memory controller the kernel kills (OOM in the worker's cgroup): the task
    fails with the limit's reason, not retried, as after the poll's kill."""
    table = TaskTable.__new__(TaskTable)
    xp = SimpleNamespace(options={"memory_max": LIMIT}, rss_check=False)
    worker = SimpleNamespace(over_memory=False, lost_reason=None)
    assert table._memory_reason(xp, worker, SimpleNamespace(reason="OOM-killed")) == "memory limit 200 MiB exceeded"  # type: ignore[arg-type]
    assert table._memory_reason(xp, worker, SimpleNamespace(reason="killed by SIGKILL")) is None  # type: ignore[arg-type]
    xp.options = {}
    assert table._memory_reason(xp, worker, SimpleNamespace(reason="OOM-killed")) is None  # type: ignore[arg-type]


# -- the embedded executor's cgroup --------------------------------------------------------

needs_cgroups = pytest.mark.skipif(NO_CGROUPS is not None, reason=f"no writable cgroup2 here: {NO_CGROUPS}")


@needs_cgroups
def test_the_embedded_executor_runs_its_workers_in_cgroups_and_removes_them(make_executor: MakeExecutor  # noqa: F811
                                                                            ) -> None:
    ex = make_executor(max_workers=2)
    containment = ex.orchestrator.containment
    assert containment is not None and containment.mode == "cgroup"
    subtree = containment.path
    pid = ex.submit(os.getpid).result(timeout=60)
    with open(f"/proc/{pid}/cgroup") as f:
        assert f"{subtree}/replicas/".removeprefix(cgroup.find_mount() or "") in f.read()
    ex.shutdown(wait=True)
    assert not os.path.exists(subtree), f"{subtree} outlived the executor's shutdown"


def _kill_host(tmp_path: Path, code: str, procs: ProcessTracker, env: dict[str, str] | None = None) -> list[str]:
    """Run ``code`` as a host script until it prints a line (its watchdog's pid first, then
    other pids to see gone, then anything), SIGKILL it, and wait (bounded) until the pids
    are gone: the watchdog has finished its clean-up. The line's words."""
    host = tmp_path / "host.py"
    host.write_text(textwrap.dedent(code))
    proc = subprocess.Popen([sys.executable, str(host)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})})
    try:
        assert proc.stdout is not None
        words = proc.stdout.readline().split()
        procs.track(int(words[0]))
        everything = _idents(*(int(w) for w in words if w.isdigit()))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert not wait_gone(everything, 30), "the watchdog (or a worker) outlived the host's SIGKILL"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    return words


def test_the_host_s_sigkill_leaves_no_cgroup_and_no_state_dir(tmp_path: Path, procs: ProcessTracker,
                                                              orch_test_tag: str) -> None:
    """The watchdog kills the workers, removes their cgroups (if they had some) and then
    the state dir the host made for itself in $TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _, _, subtree = _kill_host(tmp_path, f"""
        import os, pathlib, sys, time
        from orchestrator import Executor
        ex = Executor(max_workers=1, env={{{TAG_VAR!r}: {orch_test_tag!r}}})
        pid = ex.submit(os.getpid).result(timeout=60)
        assert [p for p in pathlib.Path({str(tmp)!r}).iterdir() if p.name.startswith("orchestrator-")]
        print(ex.orchestrator.watchdog_pid, pid, getattr(ex.orchestrator.containment, "path", None) or "-", flush=True)
        time.sleep(300)
    """, procs, {"TMPDIR": str(tmp)})
    assert subtree == "-" or not os.path.exists(subtree), f"the watchdog left {subtree}"
    assert list(tmp.iterdir()) == [], "the embedded host's own state dir outlived it"


def test_the_host_s_sigkill_keeps_a_state_dir_it_was_given(tmp_path: Path, procs: ProcessTracker) -> None:
    """Only a dir the host made for itself goes: one it was given keeps the watchdog's report."""
    given = tmp_path / "mine"
    given.mkdir()
    (given / "keep.txt").write_text("the user's")
    _kill_host(tmp_path, f"""
        import time
        from orchestrator import Orchestrator
        orch = Orchestrator(state_dir={str(given)!r})
        orch.start()
        print(orch.watchdog_pid, flush=True)
        time.sleep(300)
    """, procs)
    assert sorted(p.name for p in given.iterdir()) == ["keep.txt", "watchdog-report.json"]


def test_with_the_memory_controller_memory_max_is_the_worker_cgroups(make_executor: MakeExecutor,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    ex = make_executor(max_workers=1, memory_max=LIMIT)
    containment = ex.orchestrator.containment
    if containment is None or "memory" not in containment.controllers:
        have = sorted(containment.controllers) if containment is not None and containment.mode == "cgroup" else None
        pytest.skip("the memory controller is not enabled for the embedded executor's worker cgroups here "
                    f"({'controllers: ' + (', '.join(have) or 'none') if have is not None else 'no cgroups'})")
    pid = ex.submit(os.getpid).result(timeout=60)
    with open(f"/proc/{pid}/cgroup") as f:
        own = (cgroup.find_mount() or "") + f.read().strip().split("::", 1)[1]
    assert Path(own, "memory.max").read_text().strip() == str(LIMIT)
    with pytest.raises(WorkerLost, match="memory limit 200 MiB exceeded"):
        ex.submit(memfns.touch, 1536, memfns.new_progress(tmp_path / "progress"), str(tmp_path / "runs")).result(60)
