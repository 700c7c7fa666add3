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
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest

import resourcefns
from fakes import Harness
from helpers import ROOT, TESTS, DaemonUnderTest, cli, cli_env, no_leftovers, one_line_error, wait_for
from orchestrator import Executor
from orchestrator.store import Store
from test_channel_limits import PidsCgroup, pids_cgroup  # noqa: F401  # the fixture

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
    with open(ballast, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close on a full disk
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    return ballast


def _journal_consistent(state_dir: Path) -> None:
    """state.db passes the full integrity check and holds every replica the daemon shows."""
    shown = {r["id"] for r in DaemonUnderTest(state_dir).status(all=True)["replicas"]}
    store = Store(state_dir / "state.db", readonly=True)
    try:
        assert store.integrity_ok()
        wait_for(lambda: shown <= {r["id"] for r in store.replicas(include_terminal=True)}, 10,
                 "every replica in the journal")
    finally:
        store.close()


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
        _journal_consistent(small_disk)
    assert sorted(int(line) for line in runs.read_text().split()) == list(range(-1, 40))  # and none ran again


# -- the fd limit -----------------------------------------------------------------------------


def _start(daemon: DaemonUnderTest, preexec: Callable[[], None]) -> int:
    """``orchestrator start`` as DaemonUnderTest.start does, with ``preexec`` run in the CLI's
    process first (its limits and cgroup are the daemon's)."""
    done = subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "start",
                           "--grace", "1"], capture_output=True, text=True, timeout=60, env=cli_env(),
                          stdin=subprocess.DEVNULL, preexec_fn=preexec)
    assert done.returncode == 0, done.stderr
    daemon.pid = int(done.stdout.strip())
    daemon.snapshot()
    return daemon.pid


def _launch(daemon: DaemonUnderTest, *args: str, command: tuple[str, ...] = ("sleep", "1000")
            ) -> subprocess.CompletedProcess:
    return cli(daemon.state_dir, "launch", "--pool", "web", *args, "--", *command)


def _fill_with_replicas(daemon: DaemonUnderTest, what: str, **kw: Any) -> int:
    """Launch one replica at a time until the launch is refused (one line, naming ``what``)."""
    for launched in range(64):
        done = _launch(daemon, **kw)
        if done.returncode != 0:
            line = one_line_error(done)
            assert what in line and "room for 0 more" in line, line
            return launched
    raise AssertionError("never refused")


def _manager_comes_back(daemon: DaemonUnderTest) -> int:
    old = daemon.status()["daemon"]["manager_pid"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: cli(daemon.state_dir, "health").returncode == 0
             and daemon.status()["daemon"]["manager_pid"] != old, 60, "a new manager")
    return int(daemon.status()["daemon"]["manager_pid"])


def test_at_a_low_fd_limit_launches_leave_the_reserve_and_a_killed_manager_comes_back(tmp_path: Path) -> None:
    with no_leftovers(DaemonUnderTest(tmp_path / "state")) as daemon:
        pid = _start(daemon, lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (48, 64)))
        proc = psutil.Process(pid)
        assert proc.rlimit(psutil.RLIMIT_NOFILE) == (64, 64)  # the soft limit raised to the hard one
        line = one_line_error(_launch(daemon, "--count", "1000"))
        assert line.startswith("orchestrator: refused: 1000 more replica(s) need") and "file descriptors" in line, line
        assert daemon.status()["pools"] == []  # refused before anything changed
        launched = _fill_with_replicas(daemon, "file descriptors")
        assert launched >= 1
        wait_for(lambda: [r["state"] for r in daemon.status()["replicas"]] == ["RUNNING"] * launched, 30,
                 "every replica running")
        _manager_comes_back(daemon)
        # Whatever fills the table (here: a limit lowered to the first free fd), the control
        # plane restarts its manager on the fds it keeps.
        taken = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        proc.rlimit(psutil.RLIMIT_NOFILE, (min(set(range(len(taken) + 1)) - taken), 64))
        try:
            manager = _manager_comes_back(daemon)
            assert cli(daemon.state_dir, "status").returncode == 0
        finally:
            proc.rlimit(psutil.RLIMIT_NOFILE, (64, 64))
        limits = daemon.status()["daemon"]["limits"]
        assert limits["nofile"] == 64 and limits["fd_reserve"] == 8, limits
        wait_for(lambda: daemon.status()["daemon"]["limits"]["fd_reserve_held"] == 8, 30, f"the reserve taken back: {daemon.status()['daemon']['limits']} {sorted(os.readlink(f'/proc/{pid}/fd/{x}') for x in os.listdir(f'/proc/{pid}/fd'))}")
        status = daemon.status()
        assert status["daemon"]["pid"] == pid and status["daemon"]["manager_pid"] == manager
        assert [r["state"] for r in status["replicas"]] == ["RUNNING"] * launched  # none lost for want of an fd
        assert status["pools"][0]["restarts"] == 0
        _journal_consistent(daemon.state_dir)


# -- a pids limit -----------------------------------------------------------------------------


_FORKER = """
import os, time
for _ in range(100):
    try:
        if os.fork() == 0:
            time.sleep(1000)
            os._exit(0)
    except OSError:
        break
time.sleep(1000)
"""


def test_under_a_pids_limit_filled_by_replicas_the_channel_answers_and_the_manager_comes_back(
        tmp_path: Path, pids_cgroup: PidsCgroup) -> None:
    with no_leftovers(DaemonUnderTest(tmp_path / "state")) as daemon:
        procs_file = str(pids_cgroup.path / "cgroup.procs")

        def into_the_cgroup() -> None:
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))

        pid = _start(daemon, into_the_cgroup)
        pids_cgroup.limit(pids_cgroup.current() + 40)  # the daemon's TasksMax=, 40 more than it needs
        line = one_line_error(_launch(daemon, "--count", "100"))
        assert "processes" in line and "pids.max" in line and str(pids_cgroup.path) in line, line
        assert daemon.status()["pools"] == []
        # Each replica forks until it cannot (at most 100): what a launch cannot know fills
        # the limit to the last pid.
        forks = (sys.executable, "-c", _FORKER)
        assert _launch(daemon, "--count", "3", command=forks).returncode == 0  # 3 fit; their forks do not
        wait_for(lambda: pids_cgroup.current() >= pids_cgroup.read_limit(), 30, "the pids limit filled")
        for _ in range(3):  # the command channel answers on the threads it started ahead
            assert cli(daemon.state_dir, "status").returncode == 0
            line = one_line_error(_launch(daemon, command=forks))
            assert "processes" in line and "room for 0 more" in line, line
        assert cli(daemon.state_dir, "health").returncode == 0
        _manager_comes_back(daemon)  # it had its pids: the next one gets them
        assert cli(daemon.state_dir, "status").returncode == 0
        status = daemon.status()
        assert status["daemon"]["pid"] == pid
        assert [r["state"] for r in status["replicas"]] == ["RUNNING"] * 3
        _journal_consistent(daemon.state_dir)


def test_replicas_keep_the_fd_limit_the_daemon_was_started_with_across_an_upgrade(tmp_path: Path) -> None:
    with no_leftovers(DaemonUnderTest(tmp_path / "state")) as daemon:
        pid = _start(daemon, lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 4096)))

        def limits_of_new_replica() -> tuple[int, int]:
            assert _launch(daemon, "--wait").returncode == 0
            newest = max(daemon.status()["replicas"], key=lambda r: r["created_at"])
            return psutil.Process(newest["pid"]).rlimit(psutil.RLIMIT_NOFILE)

        assert psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE) == (4096, 4096)
        assert limits_of_new_replica() == (512, 4096)
        upgraded = cli(daemon.state_dir, "upgrade")
        assert upgraded.returncode == 0, upgraded.stderr
        assert daemon.status()["daemon"]["pid"] == pid
        assert psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE) == (4096, 4096)
        assert limits_of_new_replica() == (512, 4096)  # not the daemon's raised one
        _journal_consistent(daemon.state_dir)
