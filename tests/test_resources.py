"""The daemon at the limits of its resources, for real: a full disk under its state dir (a
small tmpfs), a low RLIMIT_NOFILE, a pids cgroup filled by its replicas. Work that ran is
never reported failed, the fault is shown by ``health`` and ``status`` and clears by itself
when the resource comes back, and the control plane (the command channel, a manager
restart) keeps a reserve that replicas cannot take.

After each: nothing left behind (``no_leftovers``), the journal consistent, ``health`` true.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import resourcefns
from fakes import Harness
from helpers import ROOT, TESTS, DaemonUnderTest, cli, no_leftovers, wait_for
from orchestrator import Executor
from orchestrator.store import Store

pytestmark = pytest.mark.timeout(240)


# -- a full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs, mounted for this test (as root) where the state dir goes."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount a small tmpfs")
    mnt = tmp_path / "state"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=True)


def test_a_failing_commit_fails_no_command_and_is_retried_once_a_second(fake) -> None:
    """The engine's side, on the fake OS: replies stay ok (marked ``unsaved``), the id of a
    replica is still made durable before its process exists, the failing disk is tried
    once a second and not every turn, and the journal catches up by itself."""
    h = Harness(fake)
    h.journal.failing = "disk full writing /s/state.db"
    reply = h.cmd("launch", pool="web", spec={"command": ["sleep", "1000"]}, policy={"restart": "never"})
    assert reply["ok"] is True and reply["unsaved"] == "disk full writing /s/state.db", reply
    (rid,) = reply["result"]
    assert h.state(rid) == "PENDING" and not fake.order  # not forked before its id is saved
    assert h.engine.journal.fault == "disk full writing /s/state.db"
    assert h.cmd("ping") == {"id": 2, "ok": True, "result": "pong"}  # read-only: no mark
    calls = []
    real = h.journal.commit
    h.journal.commit = lambda: (calls.append(fake.now), real())[1]  # type: ignore[method-assign]
    for _ in range(5):
        h.turn()
    assert calls == []  # the same second: not tried again
    h.journal.failing = None
    fake.now += 1.0
    h.turn()
    assert calls and h.engine.journal.fault is None
    h.turn()
    assert fake.order and h.state(rid) == "STARTING" and rid in h.journal.committed_ids
    frames = [data for kind, data in h.journal.events if kind == "journal"]
    assert frames[0] == {"fault": "disk full writing /s/state.db"} and frames[-1]["saved_again"] is True, frames
    reply = h.cmd("scale", pool="web", n=1)
    assert reply["ok"] is True and "unsaved" not in reply


def _fill(where: Path) -> Path:
    """Write a file until the disk under ``where`` is full."""
    ballast = where / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return ballast


def _health(state_dir: Path) -> tuple[int, dict]:
    done = cli(state_dir, "health", "--json")
    return done.returncode, json.loads(done.stdout)


def test_a_full_disk_fails_no_work_that_ran_and_the_journal_catches_up(
        small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(ROOT)]))  # the workers import resourcefns
    runs = tmp_path / "runs"  # off the full disk: every run of a task is counted here
    with no_leftovers(DaemonUnderTest(small_disk)) as daemon:
        daemon.start()
        ex = Executor(max_workers=2, state_dir=small_disk, pool="jobs")
        try:
            assert ex.submit(resourcefns.record, str(runs), -1, b"").result(timeout=60) == (-1, 0)
            wait_for(lambda: sum(r["state"] == "RUNNING" for r in daemon.status()["replicas"]) == 2, 60,
                     "both workers running")
            ballast = _fill(small_disk)
            # 40 tasks of 100 KiB each: the turn's rows cannot fit in what the WAL has.
            futures = [ex.submit(resourcefns.record, str(runs), i, b"x" * 100_000) for i in range(40)]
            assert [f.result(timeout=120) for f in futures] == [(i, 100_000) for i in range(40)]
            assert sorted(int(line) for line in runs.read_text().split()) == list(range(-1, 40))  # each ran once
            code, info = _health(small_disk)
            assert code == 1 and "journal" in info["failed"] and info["parts"]["journal"] is False, info
            assert info["journal"]["fault"].startswith("disk full"), info
            status = cli(small_disk, "status")
            assert status.returncode == 0, status.stderr
            line = [x for x in status.stdout.splitlines() if x.startswith("journal:")]
            assert line and "state not saved since" in line[0] and "disk full" in line[0], status.stdout
            journal = daemon.status()["daemon"]["journal"]
            assert journal["ok"] is False and journal["unsaved"] > 0, journal
        finally:
            ex.shutdown(wait=True)  # its close is applied: it does not raise for the disk
        ballast.unlink()
        # Nothing is asked of the daemon but health: it catches up by itself.
        wait_for(lambda: _health(small_disk)[0] == 0, 30, "the journal to save again")
        assert daemon.status()["daemon"]["journal"] == {"ok": True}
        store = Store(small_disk / "state.db", readonly=True)
        try:
            assert store.integrity_ok()
            tasks = {t["id"]: t for t in store.tasks(pool="jobs", include_terminal=True)}
            assert sorted(tasks) == sorted(f"jobs/{n}" for n in range(1, 42)), sorted(tasks)
            assert {t["state"] for t in tasks.values()} == {"DONE"}, tasks
            frames = [e["data"] for e in store.events() if e["kind"] == "journal"]
            assert frames[0]["fault"].startswith("disk full") and frames[-1]["saved_again"] is True, frames
        finally:
            store.close()
    assert sorted(int(line) for line in runs.read_text().split()) == list(range(-1, 40))  # and none ran again
