"""Per-task logs (daemon mode): each task's stdout and stderr, from Python and from its
children, in its own log only, on one reused worker; a fast writer loses nothing; ``logs
POOL/N [--stderr] [--follow]``; the worker's log keeps one line per task; a task's log goes
with its record. And the attribution itself on real pipes without processes
(daemon/tasklogs.py): a held task's first bytes, written before the loop read its
predecessor's answer, are its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import DaemonUnderTest, cli, cli_env, module_of_tasks, wait_for
from orchestrator import Client
from orchestrator.logfiles import log_paths

TASKS = textwrap.dedent("""
    import os, subprocess, sys, time

    def speak(tag, lines=3):
        # Python's buffered prints, an unbuffered write, and children writing to the fds.
        for i in range(lines):
            print(f"{tag} out {i}")
            print(f"{tag} err {i}", file=sys.stderr)
        os.write(1, f"{tag} raw\\n".encode())
        subprocess.run(["sh", "-c", f"echo {tag} child"], check=True)
        subprocess.run(["sh", "-c", f"echo {tag} childerr >&2"], check=True)
        return tag

    def flood(tag, total, rate=20 << 20):
        # ``total`` lines of 100 bytes at about ``rate`` bytes/s, straight to fd 1.
        line = (tag + " " * 100)[:99] + "\\n"
        batch = (line * 1000).encode()
        began = time.monotonic()
        sent = 0
        while sent < total:
            os.write(1, batch)
            sent += 1000
            ahead = sent * 100 / rate - (time.monotonic() - began)
            if ahead > 0:
                time.sleep(ahead)
        return sent

    def held(tag, release, limit=60):
        print(f"{tag} first", flush=True)
        end = time.monotonic() + limit
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.01)
        print(f"{tag} last", flush=True)
        return tag
""")


@pytest.fixture
def logtasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with module_of_tasks(tmp_path / "code", "logtasks", TASKS, monkeypatch) as module:
        yield module


def _read(logs: Path, log_id: str, stream: str = "out") -> list[str]:
    """Every line of a log, its rotated files included, oldest first."""
    return [line for path in log_paths(logs, log_id, stream) for line in path.read_text().splitlines()]


def test_each_tasks_output_is_in_its_own_log_only(daemon: DaemonUnderTest, logtasks: Any) -> None:
    """Six tasks on one worker (it holds the next one while it runs one, so each starts
    right after the one before answered): prints, raw writes and children's output, stdout
    and stderr, each line in its task's log and nowhere else; the worker's log has a line
    per task and none of theirs."""
    daemon.start()
    logs = daemon.state_dir / "logs"
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        futs = [ex.submit(logtasks.speak, f"t{i}") for i in range(6)]
        assert [f.result(timeout=60) for f in futs] == [f"t{i}" for i in range(6)]
        ids = [f.task_id for f in futs]
        assert sorted(ex.task_log(ids[0])) == sorted(["t0 out 0", "t0 out 1", "t0 out 2", "t0 raw", "t0 child"])
        handle = Client(daemon.state_dir).task(ids[1])  # from any process
        assert sorted(handle.log(stderr=True)) == sorted(["t1 err 0", "t1 err 1", "t1 err 2", "t1 childerr"])
        assert len(handle.log(lines=2)) == 2
        worker = {row["worker"] for row in Client(daemon.state_dir).call("tasks", {"pool": "jobs", "all": True})}
    assert len(worker) == 1  # one reused worker ran them all
    for i, task_id in enumerate(ids):
        out = _read(logs, task_id, "out")
        err = _read(logs, task_id, "err")
        assert sorted(out) == sorted([f"t{i} out {k}" for k in range(3)] + [f"t{i} raw", f"t{i} child"])
        assert sorted(err) == sorted([f"t{i} err {k}" for k in range(3)] + [f"t{i} childerr"])
        shown = cli(daemon.state_dir, "logs", task_id, "--lines", "100", "--stderr", check=True).stdout.splitlines()
        assert sorted(shown) == sorted(err)
    own = _read(logs, worker.pop(), "out")
    assert [line.split(" ")[2] for line in own if line.startswith("--- task ")] == ids
    assert all("DONE" in line for line in own if line.startswith("--- task "))
    assert not [line for line in own if not line.startswith("--- task ")]  # no task's line there


def test_a_fast_writer_loses_nothing_and_the_next_task_has_none_of_it(daemon: DaemonUnderTest,
                                                                     logtasks: Any) -> None:
    """About 20 MB/s for a second: every line in its task's log (rotated files included),
    none in the next task's on the same worker."""
    daemon.start()
    logs = daemon.state_dir / "logs"
    total = 200_000  # 20 MB
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        fast = ex.submit(logtasks.flood, "fast", total)
        after = ex.submit(logtasks.speak, "after", 1)
        assert fast.result(timeout=120) == total
        assert after.result(timeout=60) == "after"
    lines = _read(logs, fast.task_id)
    assert len(lines) == total
    assert set(lines) == {("fast" + " " * 100)[:99]}
    assert not [line for line in _read(logs, after.task_id) if line.startswith("fast")]
    totals = Client(daemon.state_dir).call("status", {})["daemon"].get("logs") or {}
    assert totals.get("dropped", 0) == 0


def test_follow_a_task_until_it_ends(daemon: DaemonUnderTest, logtasks: Any, tmp_path: Path) -> None:
    """``logs POOL/N --follow`` shows what the task writes as it runs, and ends by itself
    once the task has ended, with its last line."""
    daemon.start()
    release = tmp_path / "release"
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        fut = ex.submit(logtasks.held, "slow", str(release))
        # Its id is known at submit, before its batch reaches the daemon; logs reads the
        # journal, which has the task once it runs.
        wait_for(fut.running, 30, "the task to start")
        follow = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "logs", fut.task_id,
             "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
            stdin=subprocess.DEVNULL)
        try:
            assert follow.stdout is not None
            assert follow.stdout.readline() == "slow first\n"  # while it runs
            release.touch()
            out, err = follow.communicate(timeout=30)  # it ends by itself
            assert follow.returncode == 0, err
            assert out == "slow last\n"
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait(timeout=10)
        assert fut.result(timeout=30) == "slow"


def test_an_upgrade_carries_the_tasks_logs(daemon: DaemonUnderTest, logtasks: Any, tmp_path: Path) -> None:
    """`upgrade` while a task runs and the next is held (both slots bound): each task's
    lines, from before and after the upgrade, in its own log; the worker's second pair
    goes on being read (the third task uses the first pair again, the fourth the second)."""
    daemon.start()
    logs = daemon.state_dir / "logs"
    release = tmp_path / "release"
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        running = ex.submit(logtasks.held, "up", str(release))
        held = ex.submit(logtasks.speak, "h", 1)
        wait_for(lambda: _read(logs, running.task_id) == ["up first"], 30, "the task to run and write")
        got = cli(daemon.state_dir, "upgrade")
        assert got.returncode == 0, got.stderr
        release.touch()
        later = [ex.submit(logtasks.speak, f"l{i}", 1) for i in range(2)]
        assert [f.result(timeout=60) for f in (running, held, *later)] == ["up", "h", "l0", "l1"]
    assert _read(logs, running.task_id) == ["up first", "up last"]
    for fut, tag in ((held, "h"), (later[0], "l0"), (later[1], "l1")):
        assert sorted(_read(logs, fut.task_id)) == sorted([f"{tag} out 0", f"{tag} raw", f"{tag} child"])
        assert sorted(_read(logs, fut.task_id, "err")) == sorted([f"{tag} err 0", f"{tag} childerr"])


def test_logs_of_tasks_refuse_what_is_not_there(daemon: DaemonUnderTest, logtasks: Any) -> None:
    """A task that wrote nothing has an empty log; an unknown task is one line, exit 1."""
    daemon.start()
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        quiet = ex.submit(int, "7")
        assert quiet.result(timeout=60) == 7
    shown = cli(daemon.state_dir, "logs", quiet.task_id)
    assert (shown.returncode, shown.stdout, shown.stderr) == (0, "", "")
    missing = cli(daemon.state_dir, "logs", "jobs/99")
    assert missing.returncode == 1 and len(missing.stderr.splitlines()) == 1 and "jobs/99" in missing.stderr
    bad = cli(daemon.state_dir, "logs", "jobs/01")
    assert bad.returncode != 0 and len(bad.stderr.splitlines()) == 1


def test_logs_take_a_tasks_key(daemon: DaemonUnderTest, logtasks: Any) -> None:
    """``logs POOL/@KEY`` is the log of the task that key names; a key that names none is
    one line, exit 1."""
    daemon.start()
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        keyed = ex.options(key="req-7").submit(logtasks.speak, "k")
        other = ex.submit(logtasks.speak, "o")
        assert (keyed.result(timeout=60), other.result(timeout=60)) == ("k", "o")
    shown = cli(daemon.state_dir, "logs", "jobs/@req-7", "--lines", "100", check=True).stdout.splitlines()
    assert sorted(shown) == sorted(_read(daemon.state_dir / "logs", keyed.task_id)) and "k raw" in shown
    missing = cli(daemon.state_dir, "logs", "jobs/@req-8")
    assert missing.returncode == 1 and len(missing.stderr.splitlines()) == 1 and "req-8" in missing.stderr


def test_a_tasks_log_goes_with_its_record(daemon: DaemonUnderTest, logtasks: Any) -> None:
    """Retention that forgets a task's record removes its log files."""
    daemon.start("--keep-replicas", "1")
    logs = daemon.state_dir / "logs"
    with Client(daemon.state_dir).executor("jobs", max_workers=1) as ex:
        first = ex.submit(logtasks.speak, "first", 1)
        assert first.result(timeout=60) == "first"
        assert log_paths(logs, first.task_id) and log_paths(logs, first.task_id, "err")
        # A prune comes after 16 ended records (store.PRUNE_RETIRED_MIN) and keeps one.
        for _ in range(3):
            list(ex.map(int, ["1"] * 20))
            if not log_paths(logs, first.task_id):
                break
        wait_for(lambda: not log_paths(logs, first.task_id) and not log_paths(logs, first.task_id, "err"), 30,
                 "the first task's log to be removed with its record")
    assert cli(daemon.state_dir, "logs", first.task_id).returncode == 1


def test_an_embedded_executor_keeps_task_logs_when_asked(tmp_path: Path, logtasks: Any) -> None:
    """Embedded, a task's output goes to this process's stdout and stderr, as with
    ProcessPoolExecutor; with ``task_logs=DIR`` each task's is kept there instead, and
    ``task_log`` reads it (a daemon's pool keeps them always: ``task_logs=`` is refused there)."""
    from orchestrator import Executor

    with Executor(max_workers=1) as plain:
        assert plain.submit(int, "1").result(timeout=60) == 1
        with pytest.raises(ValueError, match="keeps no task logs"):
            plain.task_log("x/1")
    logs = tmp_path / "tasklogs"
    with Executor(max_workers=1, task_logs=logs) as ex:
        futs = [ex.submit(logtasks.speak, f"e{i}", 2) for i in range(4)]
        assert [f.result(timeout=60) for f in futs] == [f"e{i}" for i in range(4)]
        for i, fut in enumerate(futs):
            assert fut.task_id is not None
            assert sorted(ex.task_log(fut.task_id)) == sorted(
                [f"e{i} out 0", f"e{i} out 1", f"e{i} raw", f"e{i} child"])
            assert len(ex.task_log(fut.task_id, stderr=True, lines=1)) == 1
            assert sorted(ex.task_log(fut.task_id, stderr=True)) == sorted(
                [f"e{i} err 0", f"e{i} err 1", f"e{i} childerr"])
        pool = ex.pool
    own = [line for path in sorted(logs.glob(f"{pool}-*.out")) for line in path.read_text().splitlines()]
    assert [line.split()[2] for line in own] == [f.task_id for f in futs]  # its line per task, nothing else
    with pytest.raises(ValueError, match="embedded"):
        Executor(state_dir=tmp_path, task_logs=logs)


# -- the attribution, on real pipes and a real log capture, without processes ----------


def test_a_held_tasks_first_bytes_before_its_predecessors_answer_are_its_own(tmp_path: Path,
                                                                             reactor: Any) -> None:
    """The race the two slots exist for: task 2 (held, slot 1) starts and writes as soon as
    its worker has answered task 1, before the loop has read that answer; then task 1's late
    bytes (still in slot 0's pipe) and task 2's are each in their own log. A slot given back
    unstarted, and bytes between tasks, are the worker's own."""
    from orchestrator.daemon.logcapture import LogCapture
    from orchestrator.daemon.tasklogs import TaskLogs
    from orchestrator.daemon.taskrecords import ExecPool, Task, Worker
    from orchestrator.states import Replica
    from orchestrator.states import TaskState as T

    capture = LogCapture(tmp_path / "logs", reactor, create_after=0)
    try:
        rlog = capture.open("jobs-1")
        out0, err0 = rlog.stdout, rlog.stderr
        rlog.spawned = lambda: None  # type: ignore[method-assign]  # we write into its ends ourselves
        logs = TaskLogs(capture)
        assert logs.wanted("jobs-1") and not logs.wanted("jobs-2")
        a, b = socket.socketpair()  # the worker's task socket: not used here
        worker = Worker(a, None, replica=Replica("jobs-1", "jobs", 1))  # type: ignore[arg-type]
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        logs.pipes(worker, [r1, r2])
        xp = ExecPool("jobs", {}, b"")

        def task(n: int, slot: int) -> Task:
            t = Task(f"jobs/{n}", n, xp, None, None, None, None, 0, state=T.RUNNING, slot=slot)
            t.started_at, t.ended_at = time.time(), time.time()
            return t

        one, two, three = task(1, 0), task(2, 1), task(3, 0)
        logs.sent(worker, one)
        logs.sent(worker, two)  # held behind it
        os.write(out0, b"one a\n")
        reactor.run_once(0)  # pumped while it runs
        os.write(out0, b"one late\n")  # flushed just before its answer...
        os.write(err0, b"one err\n")
        os.write(w1, b"two early\n")  # ...and task 2 writes before the loop reads that answer
        os.write(w2, b"two err\n")
        reactor.run_once(0)
        one.state = T.DONE
        logs.answered(worker, one)
        logs.sent(worker, three)  # held behind task 2, in slot 0 again
        os.write(w1, b"two b\n")
        reactor.run_once(0)
        logs.given_back(worker, three)  # another worker was idle: it never ran here
        os.write(out0, b"after\n")  # the worker's own, between tasks
        two.state = T.DONE
        logs.answered(worker, two)
        os.write(w1, b"between\n")  # the worker's own too
        reactor.run_once(0)
        reactor.run_once(0)
        logs.worker_ended(worker, None)
        rlog.finish()
        capture.close()
        logs_dir = tmp_path / "logs"
        assert _read(logs_dir, "jobs/1") == ["one a", "one late"]
        assert _read(logs_dir, "jobs/1", "err") == ["one err"]
        assert _read(logs_dir, "jobs/2") == ["two early", "two b"]
        assert _read(logs_dir, "jobs/2", "err") == ["two err"]
        assert not log_paths(logs_dir, "jobs/3")  # it wrote nothing: no file
        own = _read(logs_dir, "jobs-1")
        assert sorted(line for line in own if not line.startswith("---")) == ["after", "between"]
        assert [line.split()[2] for line in own if line.startswith("---")] == ["jobs/1", "jobs/2"]
    finally:
        capture.close()
        for fd in (w1, w2):
            os.close(fd)
        a.close()
        b.close()
