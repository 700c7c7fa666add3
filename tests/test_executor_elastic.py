"""Elastic executor pools end to end (daemon/elastic.py): a real Executor with
``min_workers=1, max_workers=3`` grows to 3 for a burst (three tasks run at once on three
worker processes) and, once idle for its short ``idle_timeout``, shrinks back to 1, with
``status`` showing busy / idle / min / max; a ``memory_budget`` that a worker holding a
large allocation fills keeps a second worker from starting, the queued task waits and
``tasks --json`` says why, and it runs once the first task has let go. In daemon mode and
embedded. Synchronised on files the tasks write and on ``status``; every wait bounded.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import DaemonUnderTest, Ident, cli, module_of_tasks, wait_for
from orchestrator import Client, Executor, InvalidSpec

MiB = 1 << 20
JOBS = textwrap.dedent("""
    import mmap, os, time
    from pathlib import Path

    def mark(path, text):
        Path(path + ".tmp").write_text(text)
        os.rename(path + ".tmp", path)

    def held(started, release, limit=60):
        # Runs until the test releases it (a file appears), at most ``limit`` seconds.
        mark(started, str(os.getpid()))
        end = time.monotonic() + limit
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.02)
        return os.getpid()

    def holding(mib, started, release, limit=60):
        # ``mib`` MiB made resident, held until released.
        block = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for at in range(0, mib << 20, 4096):
            block[at] = 1
        return held(started, release, limit)

    def pid():
        return os.getpid()
""")


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A module of tasks, importable here (pickled by reference) and by the workers."""
    with module_of_tasks(tmp_path / "code", "elasticjobs", JOBS, monkeypatch) as module:
        yield module


def _pool(daemon: DaemonUnderTest, name: str) -> dict[str, Any]:
    row: dict[str, Any] = next(p for p in daemon.status()["pools"] if p["name"] == name)
    return row


def _workers(daemon: DaemonUnderTest, name: str) -> list[dict[str, Any]]:
    return [r for r in daemon.status()["replicas"] if r["pool"] == name and r["state"] == "RUNNING"]


def test_a_burst_grows_the_pool_to_max_workers_and_idle_shrinks_it_to_min(daemon: DaemonUnderTest, jobs: Any,
                                                                           tmp_path: Path) -> None:
    daemon.start()
    release = tmp_path / "release"
    with Client(daemon.state_dir).executor("el", max_workers=3, min_workers=1, idle_timeout=1.0) as ex:
        wait_for(lambda: _pool(daemon, "el")["workers"]["idle"] == 1, 30, "the first worker")
        assert _pool(daemon, "el")["desired"] == 1  # it starts with min_workers
        starts = [tmp_path / f"started-{i}" for i in range(3)]
        futures = [ex.submit(jobs.held, str(s), str(release)) for s in starts]
        wait_for(lambda: all(s.exists() for s in starts), 60, "the burst's three tasks to run at once")
        assert len({s.read_text() for s in starts}) == 3  # on three workers
        row = _pool(daemon, "el")
        assert row["desired"] == 3
        assert row["workers"] == {"busy": 3, "idle": 0, "starting": 0, "min": 1, "max": 3}
        line = next(x for x in cli(daemon.state_dir, "status").stdout.splitlines() if x.startswith("pool el:"))
        assert "workers 3 busy, 0 idle (min 1, max 3)" in line
        release.write_text("")
        assert sorted(f.result(timeout=30) for f in futures) == sorted(int(s.read_text()) for s in starts)
        wait_for(lambda: len(_workers(daemon, "el")) == 1 and _pool(daemon, "el")["desired"] == 1, 30,
                 "the pool to shrink back to min_workers after idle_timeout")
        assert _pool(daemon, "el")["workers"] == {"busy": 0, "idle": 1, "starting": 0, "min": 1, "max": 3}
        assert ex.submit(jobs.pid).result(timeout=30) in {int(s.read_text()) for s in starts}
        # A joiner that asks for another size range conflicts, like any option that changes how tasks run.
        with pytest.raises(InvalidSpec, match=r"runs with min_workers=1, not 2; idle_timeout=1\.0, not 60\.0"):
            Client(daemon.state_dir).executor("el", max_workers=3, min_workers=2)
        Client(daemon.state_dir).executor("el", max_workers=3, min_workers=1, idle_timeout=1.0).shutdown()


def test_bad_elastic_values_are_one_line_errors() -> None:
    for kw, error in (({"max_workers": 2, "min_workers": 3}, "min_workers 3 is above max_workers 2"),
                      ({"max_workers": 2, "memory_budget": 1 << 30}, "memory_budget bounds the workers"),
                      ({"max_workers": 2, "min_workers": 1, "memory_budget": 1 << 20, "memory_max": 1 << 30},
                       "below one worker's memory_max")):
        with pytest.raises(InvalidSpec, match=error) as err:
            Executor(**kw)
        assert "\n" not in str(err.value)


def test_a_memory_budget_keeps_a_second_worker_from_starting(daemon: DaemonUnderTest, jobs: Any,
                                                             tmp_path: Path) -> None:
    daemon.start()
    started, release, second = tmp_path / "started", tmp_path / "release", tmp_path / "second"
    budget = 160 * MiB
    with Client(daemon.state_dir).executor("mem", max_workers=2, min_workers=1, memory_budget=budget) as ex:
        first = ex.submit(jobs.holding, 100, str(started), str(release))
        wait_for(started.exists, 60, "the first task to hold its memory")
        queued = ex.submit(jobs.held, str(second), str(release))

        def why() -> str | None:
            rows = json.loads(cli(daemon.state_dir, "tasks", "--json").stdout)
            return next((r.get("waiting") for r in rows if r["id"] == queued.task_id), None)

        wait_for(lambda: (why() or "").startswith("memory budget 160 MiB reached"), 30,
                 "tasks --json to say the budget holds the queued task back")
        line = next(x for x in cli(daemon.state_dir, "tasks").stdout.splitlines() if x.startswith(queued.task_id))
        assert "waiting: memory budget 160 MiB reached" in line
        row = _pool(daemon, "mem")
        assert row["desired"] == 1 and len(_workers(daemon, "mem")) == 1  # no second worker started
        assert row["workers"]["budget"]["limit"] == budget
        assert row["workers"]["budget"]["used"] >= 100 * MiB
        assert not second.exists()
        release.write_text("")
        # Once the first task's memory is freed the budget no longer holds the pool back: the
        # queued task may run on the first worker or on a second one started meanwhile.
        first.result(timeout=30)
        queued.result(timeout=30)
        assert second.exists()


def test_a_worker_that_dies_at_the_budget_is_replaced_only_when_there_is_room(daemon: DaemonUnderTest, jobs: Any,
                                                                              tmp_path: Path) -> None:
    """The supervisor's replacement is bounded like a grow: it waits PENDING, saying why."""
    daemon.start()
    budget = 160 * MiB
    first, big, release = tmp_path / "first", tmp_path / "big", tmp_path / "release"
    with Client(daemon.state_dir).executor("rep", max_workers=2, min_workers=1, memory_budget=budget,
                                           idle_timeout=600) as ex:
        try:
            doomed = ex.submit(jobs.held, str(first), str(release))
            wait_for(first.exists, 60, "the first task to run")
            holder = ex.submit(jobs.holding, 100, str(big), str(release))  # no worker idle: the pool grows
            wait_for(big.exists, 60, "the second worker's task to hold its memory")
            assert len(_workers(daemon, "rep")) == 2
            os.kill(int(first.read_text()), 9)  # the first worker dies; the supervisor replaces it
            with pytest.raises(Exception, match="lost"):
                doomed.result(timeout=30)
            # One is held behind the busy worker's task (for throughput), the other waits.
            queued = [ex.submit(jobs.held, str(tmp_path / f"later-{i}"), str(release)) for i in range(2)]

            def replacement() -> dict[str, Any] | None:
                return next((r for r in daemon.status()["replicas"] if r["pool"] == "rep" and r["state"] == "PENDING"),
                            None)

            wait_for(lambda: ((replacement() or {}).get("reason") or "").startswith("memory budget 160 MiB reached"),
                     30, "the replacement to wait for the budget")
            rows = json.loads(cli(daemon.state_dir, "tasks", "--json").stdout)
            why = sorted(r["waiting"] for r in rows if r["id"] in {f.task_id for f in queued})
            assert why[0].startswith("held by rep-2") and why[1].startswith("memory budget 160 MiB reached"), why
            row = _pool(daemon, "rep")
            assert row["desired"] == 2 and len(_workers(daemon, "rep")) == 1  # nothing started meanwhile
            assert row["workers"]["budget"]["held"] == 1 and row["workers"]["budget"]["used"] >= 100 * MiB
            assert not any((tmp_path / f"later-{i}").exists() for i in range(2))
        finally:
            release.write_text("")  # the holder lets its memory go: the replacement starts
        assert holder.result(timeout=30) > 0 and all(f.result(timeout=30) > 0 for f in queued)
        wait_for(lambda: len(_workers(daemon, "rep")) == 2, 30, "the replacement to start once there is room")
        assert replacement() is None


def test_embedded_a_burst_grows_and_idle_retires_the_extra_workers(jobs: Any, tmp_path: Path) -> None:
    release = tmp_path / "release"
    starts = [tmp_path / f"started-{i}" for i in range(3)]
    with Executor(max_workers=3, min_workers=1, idle_timeout=0.5) as ex:
        futures = [ex.submit(jobs.held, str(s), str(release)) for s in starts]
        wait_for(lambda: all(s.exists() for s in starts), 60, "the burst's three tasks to run at once")
        pids = {int(s.read_text()) for s in starts}
        assert len(pids) == 3
        idents = [Ident.of(p) for p in pids]
        release.write_text("")
        assert {f.result(timeout=30) for f in futures} == pids
        wait_for(lambda: sum(1 for i in idents if i is not None and i.alive()) == 1, 30,
                 "two of the three workers to retire after idle_timeout")
        assert ex.submit(jobs.pid).result(timeout=30) in pids  # the one kept runs it
    assert os.getpid() not in pids


def test_a_config_files_elastic_pool_keeps_its_size_at_a_reload_and_across_an_upgrade(
        daemon: DaemonUnderTest, jobs: Any, tmp_path: Path) -> None:
    conf, release = tmp_path / "orchestrator.toml", tmp_path / "release"
    conf.write_text(textwrap.dedent(f"""
        [pools.cfg]
        kind = "executor"
        size = 2
        min_workers = 1
        idle_timeout = 1
        target = "elasticjobs:held"
        cwd = {str(tmp_path / "code")!r}
    """))
    daemon.start("--config", str(conf))
    wait_for(lambda: _pool(daemon, "cfg")["workers"]["idle"] == 1, 30, "the pool's first worker")
    assert _pool(daemon, "cfg")["desired"] == 1
    starts = [tmp_path / f"started-{i}" for i in range(2)]
    with Client(daemon.state_dir) as client:
        ids = [client.call("task_submit", {"pool": "cfg", "args": [str(s), str(release)]}) for s in starts]
        wait_for(lambda: all(s.exists() for s in starts), 60, "both tasks to run at once")
        assert _pool(daemon, "cfg")["desired"] == 2
        assert cli(daemon.state_dir, "reload").returncode == 0
        assert _pool(daemon, "cfg")["desired"] == 2  # the size it grew to, not the file's size reset
        got = cli(daemon.state_dir, "upgrade")
        assert got.returncode == 0, got.stderr
        assert _pool(daemon, "cfg")["workers"] == {"busy": 2, "idle": 0, "starting": 0, "min": 1, "max": 2}
        release.write_text("")
        for task_id in ids:
            assert client.call("task_result", {"id": task_id, "wait": True, "timeout": 30})["state"] == "DONE"
    wait_for(lambda: len(_workers(daemon, "cfg")) == 1 and _pool(daemon, "cfg")["desired"] == 1, 30,
             "the upgraded daemon to retire the idle worker")
