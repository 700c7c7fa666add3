"""Replica log capture (orchestrator/logcapture.py) and reading it back (logread.py, logcli.py):
a real Reactor pumps real children's pipes.

Every child is started here with the ReplicaLog's fds on its 1 and 2, reaped here, and
killed by pid if a test fails before it ends. Waits are bounded (the reactor's run_until,
timeouts on queues and processes); no sleep is used to synchronise.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import queue
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from helpers import cli, cli_env, fd_count, wait_for
from orchestrator.daemon import logcapture
from orchestrator.client import logcli
from orchestrator.errors import NotFound, OrchestratorError, UsageError
from orchestrator.daemon.logcapture import LogCapture
from orchestrator.logfiles import log_paths, remove
from orchestrator.logread import follow, pool_replicas, tail
from orchestrator.paths import Paths
from orchestrator.daemon.reactor import Reactor

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_fd_leak() -> Iterator[None]:
    before = fd_count()
    yield
    assert fd_count() == before, "file descriptors leaked"


class Children:
    """The processes a test started; teardown kills (by pid) and reaps what is left."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, rlog: logcapture.ReplicaLog, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(argv, stdout=rlog.stdout, stderr=rlog.stderr, pass_fds=(), **kw)
        self.procs.append(p)
        rlog.spawned()
        return p

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()


@pytest.fixture
def children() -> Iterator[Children]:
    c = Children()
    try:
        yield c
    finally:
        c.cleanup()


@pytest.fixture
def logs_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


@pytest.fixture
def capture(logs_dir: Path, reactor: Reactor) -> Iterator[LogCapture]:
    cap = LogCapture(logs_dir, reactor)
    try:
        yield cap
    finally:
        cap.close()


def run_to_exit(reactor: Reactor, p: subprocess.Popen, limit: float = 30.0) -> int:
    """Pump until ``p`` has exited (its pidfd in the reactor), then reap it."""
    pidfd = os.pidfd_open(p.pid)
    exited: list[bool] = []
    reactor.add_reader(pidfd, lambda: exited.append(True))
    try:
        assert reactor.run_until(lambda: bool(exited), limit), "the child did not exit in time"
    finally:
        reactor.remove_reader(pidfd)
        os.close(pidfd)
    return p.wait(timeout=10)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# -- capture ---------------------------------------------------------------------------


def test_stdout_and_stderr_land_in_their_files(capture: LogCapture, reactor: Reactor, children: Children,
                                               logs_dir: Path) -> None:
    rlog = capture.open("web-1")
    assert os.get_blocking(rlog.stdout) and os.get_blocking(rlog.stderr)  # the child blocks, not us
    assert capture.totals() == {"bytes": 0, "dropped": 0, "open": 1}
    p = children.spawn(rlog, ["sh", "-c", "echo to-out; echo to-err >&2; echo more-out"])
    assert rlog.stdout == -1 and rlog.stderr == -1
    assert run_to_exit(reactor, p) == 0
    rlog.finish()
    assert (logs_dir / "web-1.out").read_text() == "to-out\nmore-out\n"
    assert (logs_dir / "web-1.err").read_text() == "to-err\n"
    for name in ("web-1.out", "web-1.err"):
        assert stat.S_IMODE((logs_dir / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(logs_dir.stat().st_mode) == 0o700
    assert rlog.bytes == len("to-out\nmore-out\nto-err\n") and rlog.dropped == 0
    assert capture.totals() == {"bytes": rlog.bytes, "dropped": 0, "open": 0}
    rlog.finish()  # a second finish is a no-op


def test_a_second_replica_appends_to_nothing_of_the_first(capture: LogCapture, reactor: Reactor,
                                                          children: Children, logs_dir: Path) -> None:
    a, b = capture.open("web-1"), capture.open("web-2")
    pa = children.spawn(a, ["sh", "-c", "echo a"])
    pb = children.spawn(b, ["sh", "-c", "echo b >&2"])
    run_to_exit(reactor, pa)
    run_to_exit(reactor, pb)
    a.finish()
    b.finish()
    assert (logs_dir / "web-1.out").read_text() == "a\n" and (logs_dir / "web-2.err").read_text() == "b\n"
    # A stream without output in the replica's first CREATE_AFTER seconds gets no file.
    assert not (logs_dir / "web-1.err").exists() and not (logs_dir / "web-2.out").exists()
    with pytest.raises(OSError):
        capture.open("../etc/passwd")
    with pytest.raises(OSError):
        capture.open("web-1x")


def test_a_silent_replica_gets_its_files_after_create_after(logs_dir: Path, reactor: Reactor,
                                                            children: Children) -> None:
    cap = LogCapture(logs_dir, reactor, create_after=0.05)
    try:
        quick = cap.open("web-1")
        quick.finish()  # ended before create_after: no file is made for it, ever
        rlog = cap.open("web-2")
        p = children.spawn(rlog, py("import sys; sys.stdin.read()"), stdin=subprocess.PIPE)
        assert reactor.run_until(lambda: (logs_dir / "web-2.err").exists(), 10)
        assert (logs_dir / "web-2.out").read_bytes() == b""
        p.stdin.close()
        run_to_exit(reactor, p)
        rlog.finish()
        assert reactor.run_until(lambda: False, 0.1) is False  # the cancelled timer is harmless
    finally:
        cap.close()
    assert sorted(x.name for x in logs_dir.iterdir()) == ["web-2.err", "web-2.out"]


def _lines(n: int, width: int = 49) -> list[str]:
    return [f"line {i:06d} ".ljust(width, "x") for i in range(n)]  # width + "\n" bytes each


WRITE_LINES = """
    import sys
    n, width = int(sys.argv[1]), int(sys.argv[2])
    for i in range(n):
        sys.stdout.write(f"line {i:06d} ".ljust(width, "x") + "\\n")
"""


def test_rotation_keeps_backups_files_and_bounds_the_total(logs_dir: Path, reactor: Reactor,
                                                           children: Children) -> None:
    cap = LogCapture(logs_dir, reactor, max_bytes=1000, backups=2)
    try:
        rlog = cap.open("web-1")
        p = children.spawn(rlog, [*py(WRITE_LINES), "100", "49"])  # 100 lines of 50 bytes
        assert run_to_exit(reactor, p) == 0
        rlog.finish()
    finally:
        cap.close()
    files = [p.name for p in log_paths(logs_dir, "web-1")]
    assert files == ["web-1.out.2", "web-1.out.1", "web-1.out"]
    assert not (logs_dir / "web-1.out.3").exists()
    sizes = [(logs_dir / f).stat().st_size for f in files]
    assert all(s <= 1000 for s in sizes) and sum(sizes) <= 3000
    kept = "".join((logs_dir / f).read_text() for f in files)
    assert all((logs_dir / f).read_text().endswith("\n") for f in files)  # cut on whole lines
    written = "".join(line + "\n" for line in _lines(100))
    assert written.endswith(kept) and len(kept) >= 2000  # the newest data, contiguous
    assert rlog.bytes == 5000 and rlog.dropped == 0
    for f in files:
        assert stat.S_IMODE((logs_dir / f).stat().st_mode) == 0o600


def test_rotation_without_backups_and_a_line_longer_than_a_file(logs_dir: Path, reactor: Reactor,
                                                               children: Children) -> None:
    cap = LogCapture(logs_dir, reactor, max_bytes=300, backups=0)
    try:
        rlog = cap.open("web-1")
        p = children.spawn(rlog, [*py(WRITE_LINES), "3", "999"])  # lines of 1000 bytes
        run_to_exit(reactor, p)
        rlog.finish()
    finally:
        cap.close()
    assert [p.name for p in log_paths(logs_dir, "web-1")] == ["web-1.out"]
    content = (logs_dir / "web-1.out").read_bytes()
    assert 0 < len(content) <= 300 and content.endswith(b"x\n")
    assert rlog.bytes == 3000


def test_tail_reads_across_a_rotation_boundary(logs_dir: Path, reactor: Reactor, children: Children) -> None:
    cap = LogCapture(logs_dir, reactor, max_bytes=1000, backups=3)
    try:
        rlog = cap.open("web-1")
        p = children.spawn(rlog, [*py(WRITE_LINES), "50", "49"])  # 2500 bytes: current holds 10 lines
        run_to_exit(reactor, p)
        rlog.finish()
    finally:
        cap.close()
    assert (logs_dir / "web-1.out.1").exists()
    current = (logs_dir / "web-1.out").read_text().splitlines()
    want = _lines(50)
    assert 0 < len(current) < 25
    assert tail(logs_dir, "web-1", lines=25) == want[-25:]  # spans .out.1 and .out (and .out.2)
    assert tail(logs_dir, "web-1", lines=1000) == want
    assert tail(logs_dir, "web-1", lines=len(current)) == current
    assert tail(logs_dir, "web-1", lines=0) == []
    assert tail(logs_dir, "web-1", stream="err") == []
    assert tail(logs_dir, "web-7") == []


def test_tail_of_an_unterminated_line_and_empty_lines(logs_dir: Path) -> None:
    logs_dir.mkdir()
    (logs_dir / "web-1.out.1").write_bytes(b"a\n\nb-st")
    (logs_dir / "web-1.out").write_bytes(b"art\nc")  # the rotation cut a line in two
    assert tail(logs_dir, "web-1", lines=3) == ["", "b-start", "c"]
    assert tail(logs_dir, "web-1", lines=10) == ["a", "", "b-start", "c"]
    (logs_dir / "web-2.out").write_bytes(b"\xff\xfebad utf-8\n")
    assert tail(logs_dir, "web-2") == ["\ufffd\ufffdbad utf-8"]


def test_log_paths_newest_last(logs_dir: Path) -> None:
    logs_dir.mkdir()
    for name in ("web-1.out", "web-1.out.1", "web-1.out.2", "web-1.err", "web-11.out"):
        (logs_dir / name).write_text("x\n")
    assert log_paths(logs_dir, "web-1") == [logs_dir / "web-1.out.2", logs_dir / "web-1.out.1",
                                            logs_dir / "web-1.out"]
    assert log_paths(logs_dir, "web-1", "err") == [logs_dir / "web-1.err"]
    assert log_paths(logs_dir, "web-2") == []
    assert log_paths(logs_dir / "missing", "web-1") == []
    with pytest.raises(ValueError):
        log_paths(logs_dir, "web-1", "in")
    with pytest.raises(ValueError):
        log_paths(logs_dir, "../web-1")


@pytest.mark.parametrize("caps", ["default", "uncapped"])
def test_a_writer_at_full_speed_does_not_delay_the_loop(logs_dir: Path, reactor: Reactor, children: Children,
                                                        caps: str) -> None:
    """`yes` writes as fast as it can while a call_later(0.01) timer is re-armed: its p90
    lateness stays under 50 ms (the target is a few ms), with or without the rate caps."""
    kw = {} if caps == "default" else {"rate": None, "total_rate": None}
    cap = LogCapture(logs_dir, reactor, max_bytes=1 << 20, backups=1, **kw)
    try:
        rlog = cap.open("fast-1")
        p = children.spawn(rlog, ["yes", "a line of log output " * 4])
        lateness: list[float] = []

        def arm() -> None:
            deadline = reactor.monotonic() + 0.01

            def fired() -> None:
                lateness.append(reactor.monotonic() - deadline)
                arm()

            reactor.call_at(deadline, fired)

        arm()
        assert reactor.run_until(lambda: len(lateness) >= 100, 30)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        rlog.finish()
        assert rlog.bytes > 2 << 20 and rlog.dropped == 0  # it really pumped, and rotated
        on_disk = sum(f.stat().st_size for f in log_paths(logs_dir, "fast-1"))
        assert on_disk <= 2 << 20
    finally:
        cap.close()
    # A loop the writer delayed would be late on most turns; a few late readings are the
    # machine's (`yes` takes one of 2 cores, the suite's other worker the second).
    lateness.sort()
    p90 = lateness[int(0.90 * len(lateness)) - 1]
    assert p90 < 0.05, f"timer p90 lateness {p90 * 1e3:.1f} ms"


def test_work_per_turn_is_bounded(logs_dir: Path, reactor: Reactor, children: Children) -> None:
    """Five replicas keep their pipes full: one turn reads at most READS_PER_TURN chunks
    of a pipe and TURN_BUDGET bytes of all, and every byte still arrives."""
    cap = LogCapture(logs_dir, reactor, rate=None, total_rate=None)
    per_turn: list[list[int]] = []
    try:
        rlogs = [cap.open(f"web-{i}") for i in range(5)]
        last = [0] * 5

        def turn_end() -> None:
            now = [r.bytes for r in rlogs]
            per_turn.append([a - b for a, b in zip(now, last)])
            last[:] = now

        reactor.at_turn_end(turn_end)
        procs = [children.spawn(r, ["head", "-c", str(4 << 20), "/dev/zero"]) for r in rlogs]
        for p in procs:
            run_to_exit(reactor, p)
        for r in rlogs:
            r.finish()
    finally:
        cap.close()
    assert [r.bytes for r in rlogs] == [4 << 20] * 5
    assert max(max(t) for t in per_turn) <= logcapture.READS_PER_TURN * logcapture.CHUNK
    assert max(sum(t) for t in per_turn) <= logcapture.TURN_BUDGET
    assert sum(sum(t) for t in per_turn) > 10 << 20  # most of it was pumped by turns, not drains


@pytest.mark.parametrize("which", ["rate", "total_rate"])
def test_the_rate_caps_make_the_writer_wait(logs_dir: Path, reactor: Reactor, children: Children,
                                            which: str) -> None:
    """Over its rate a pipe is left unread: the writer blocks on it (it is still running
    after a second of 8 MiB to write) and the pump stays within rate * t + burst."""
    rate = 256 << 10
    cap = LogCapture(logs_dir, reactor, **{"rate": None, "total_rate": None, which: rate})
    try:
        rlog = cap.open("web-1")
        p = children.spawn(rlog, ["head", "-c", str(8 << 20), "/dev/zero"])
        t0 = reactor.monotonic()
        reactor.run_until(lambda: False, 1.0)
        took = reactor.monotonic() - t0
        pumped = rlog.bytes
        assert p.poll() is None  # blocked on its full pipe
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        rlog.finish()
    finally:
        cap.close()
    assert rate // 4 <= pumped <= rate * took + max(rate // 4, logcapture.CHUNK) + logcapture.CHUNK


def test_slow_writes_pause_the_pipe_and_lose_nothing(logs_dir: Path, reactor: Reactor, children: Children,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file write counts as throttled: the pipe is left unread a while each time
    (the child blocks), and every byte still arrives."""
    monkeypatch.setattr(logcapture, "SLOW_WRITE", -1.0)
    monkeypatch.setattr(logcapture, "SLOW_PAUSE", 0.005)
    cap = LogCapture(logs_dir, reactor)
    try:
        rlog = cap.open("web-1")
        p = children.spawn(rlog, ["head", "-c", str(1 << 20), "/dev/zero"])
        assert run_to_exit(reactor, p) == 0
        rlog.finish()
    finally:
        cap.close()
    assert rlog.bytes == 1 << 20 and (logs_dir / "web-1.out").stat().st_size == 1 << 20


def test_finish_drains_what_the_child_wrote_just_before_exiting(capture: LogCapture, children: Children,
                                                                logs_dir: Path) -> None:
    rlog = capture.open("web-1")
    # Less than a pipe holds (64 KiB), so the child exits without anyone reading.
    p = children.spawn(rlog, py("""
        import os
        os.write(1, b"o" * 60000)
        os.write(2, b"last words\\n")
    """))
    assert p.wait(timeout=30) == 0  # the reactor never ran
    rlog.finish()
    assert (logs_dir / "web-1.out").read_bytes() == b"o" * 60000
    assert (logs_dir / "web-1.err").read_bytes() == b"last words\n"


def test_finish_after_pumping_keeps_every_byte(capture: LogCapture, reactor: Reactor, children: Children,
                                               logs_dir: Path) -> None:
    rlog = capture.open("web-1")
    p = children.spawn(rlog, ["head", "-c", str(3 << 20), "/dev/zero"])
    run_to_exit(reactor, p)
    rlog.finish()
    assert rlog.bytes == 3 << 20 and (logs_dir / "web-1.out").stat().st_size == 3 << 20


def test_a_log_never_spawned_is_finished_cleanly(capture: LogCapture) -> None:
    rlog = capture.open("web-1")
    rlog.finish()  # the spawn failed: the engine finishes it, both ends are closed
    assert capture.totals()["open"] == 0
    rlog2 = capture.open("web-2")
    capture.close()  # daemon shutdown: every open log finished
    assert capture.totals()["open"] == 0 and rlog2.finished
    with pytest.raises(OSError):
        capture.open("web-3")


def test_a_planted_symlink_is_not_followed_by_an_eager_open(logs_dir: Path, reactor: Reactor,
                                                           tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("do not touch\n")
    cap = LogCapture(logs_dir, reactor, create_after=0)  # files made in open(): it raises
    try:
        os.symlink(target, logs_dir / "web-1.out")
        before = fd_count()
        with pytest.raises(OSError) as info:
            cap.open("web-1")
        assert info.value.errno == errno.ELOOP and "symbolic link" in str(info.value)
        assert fd_count() == before
        assert target.read_text() == "do not touch\n"
        assert cap.totals()["open"] == 0
        os.mkfifo(logs_dir / "web-2.err")  # a FIFO neither blocks the open nor is used
        with pytest.raises(OSError):
            cap.open("web-2")
        assert fd_count() == before
    finally:
        cap.close()


def test_a_planted_symlink_is_not_followed_and_the_output_is_dropped(capture: LogCapture, reactor: Reactor,
                                                                     children: Children, logs_dir: Path,
                                                                     tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("do not touch\n")
    os.symlink(target, logs_dir / "web-1.out")
    rlog = capture.open("web-1")  # the file is made by the first output: there it fails
    p = children.spawn(rlog, ["sh", "-c", "echo secret; echo fine >&2"])
    run_to_exit(reactor, p)
    rlog.finish()
    assert target.read_text() == "do not touch\n"
    assert (logs_dir / "web-1.out").is_symlink()
    assert rlog.dropped == len("secret\n") and rlog.bytes == len("fine\n")
    assert (logs_dir / "web-1.err").read_text() == "fine\n"
    assert capture.totals() == {"bytes": 5, "dropped": 7, "open": 0}


def test_a_symlink_planted_in_place_of_a_backup_is_replaced_not_followed(
        logs_dir: Path, reactor: Reactor, children: Children, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("do not touch\n")
    logs_dir.mkdir(mode=0o700)
    os.symlink(target, logs_dir / "web-1.out.1")
    cap = LogCapture(logs_dir, reactor, max_bytes=100, backups=1)
    try:
        rlog = cap.open("web-1")
        p = children.spawn(rlog, [*py(WRITE_LINES), "10", "49"])
        run_to_exit(reactor, p)
        rlog.finish()
    finally:
        cap.close()
    assert target.read_text() == "do not touch\n"
    assert not (logs_dir / "web-1.out.1").is_symlink()


FULL_DISK_SCRIPT = """
import json, os, subprocess, sys
from orchestrator.daemon.logcapture import LogCapture
from orchestrator.daemon.reactor import Reactor

mnt = sys.argv[1]
ballast = os.path.join(mnt, "ballast")
with open(ballast, "wb") as f:
    f.write(b"\\0" * (256 << 10))
reactor = Reactor()
cap = LogCapture(os.path.join(mnt, "logs"), reactor)
rlog = cap.open("full-1")
writer = '''
import os, sys
block = (b"x" * 99 + b"\\\\n") * 655
for _ in range(32):
    os.write(1, block)          # ~2 MiB: more than the 1 MiB disk holds
sys.stdin.readline()            # until the test has made room
os.write(1, b"y" * 65536)
'''
child = subprocess.Popen([sys.executable, "-c", writer], stdout=rlog.stdout, stderr=rlog.stderr,
                         stdin=subprocess.PIPE)
rlog.spawned()
first = 32 * 655 * 100
ok1 = reactor.run_until(lambda: rlog.bytes + rlog.dropped >= first, 30)
phase1 = {"bytes": rlog.bytes, "dropped": rlog.dropped, "ok": ok1}
os.unlink(ballast)
child.stdin.write(b"go\\n")
child.stdin.close()
ok2 = reactor.run_until(lambda: rlog.bytes + rlog.dropped >= first + 65536, 30)
code = child.wait(timeout=30)
rlog.finish()
phase2 = {"bytes": rlog.bytes, "dropped": rlog.dropped, "ok": ok2, "code": code,
          "totals": cap.totals()}
cap.close()
reactor.close()
print(json.dumps([phase1, phase2]))
"""


def test_a_full_disk_drops_and_counts_and_never_raises(tmp_path: Path) -> None:
    """ENOSPC for real: a 1 MiB tmpfs mounted in a private mount namespace of a child."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK_SCRIPT)
    shell = (f'mount -t tmpfs -o size=1m,mode=0700 tmpfs "{mnt}" || exit 77; '
             f'exec "{sys.executable}" "{script}" "{mnt}"')
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=120)
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    phase1, phase2 = json.loads(out.stdout)
    first = 32 * 655 * 100
    assert phase1["ok"] and phase1["dropped"] > 0 and phase1["bytes"] > 0
    assert phase1["bytes"] + phase1["dropped"] == first           # every byte accounted for
    assert phase1["bytes"] < 1 << 20
    assert phase2["ok"] and phase2["code"] == 0
    assert phase2["bytes"] == phase1["bytes"] + 65536             # room again: writing resumed
    assert phase2["dropped"] == phase1["dropped"]
    assert phase2["totals"] == {"bytes": phase2["bytes"], "dropped": phase2["dropped"], "open": 0}
    assert "dropped" in out.stderr                                  # and it was said, once
    assert out.stderr.count("No space left on device") == 1


def test_a_logs_dir_that_cannot_be_written_fails_an_eager_open(tmp_path: Path, reactor: Reactor) -> None:
    d = tmp_path / "logs"
    cap = LogCapture(d, reactor, create_after=0)
    try:
        os.chmod(d, 0o500)
        if os.geteuid() == 0:  # root writes anyway: a file in the way instead
            os.chmod(d, 0o700)
            (d / "web-1.out").mkdir()
        with pytest.raises(OSError):
            cap.open("web-1")
        assert cap.totals()["open"] == 0
    finally:
        os.chmod(d, 0o700)
        cap.close()


def test_remove_deletes_only_those_replicas_logs(logs_dir: Path) -> None:
    logs_dir.mkdir()
    names = ["web-1.out", "web-1.out.1", "web-1.err", "web-1.err.3", "web-10.out", "web-2.out", "daemon.log"]
    for name in names:
        (logs_dir / name).write_text("x\n")
    assert remove(logs_dir, ["web-1", "web-3", "../x"]) == 4
    assert sorted(p.name for p in logs_dir.iterdir()) == ["daemon.log", "web-10.out", "web-2.out"]
    assert remove(logs_dir / "missing", ["web-1"]) == 0


def test_pool_replicas_from_file_names(logs_dir: Path) -> None:
    logs_dir.mkdir()
    for name in ("web-10.out", "web-2.out", "web-2.err", "web-3.out.1", "webx-1.out", "web-01.out", "web.out"):
        (logs_dir / name).write_text("x\n")
    assert pool_replicas(logs_dir, "web") == ["web-2", "web-3", "web-10"]
    assert pool_replicas(logs_dir, "web", "err") == ["web-2"]
    assert pool_replicas(logs_dir, "db") == []


# -- follow ----------------------------------------------------------------------------


class Follower:
    """follow() in a thread, its lines in a queue; stopped through ``stop``, bounded."""

    def __init__(self, *args, **kwargs) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.stop = threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            for line in follow(*args, stop=self.stop.is_set, interval=0.01, **kwargs):
                self.lines.put(line)
        except BaseException as err:  # reported by close()
            self.error.append(err)

    def take(self, n: int) -> list[str]:
        return [self.lines.get(timeout=10) for _ in range(n)]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        assert not self.error, self.error


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_follow_sees_lines_appended_after_it_started_and_a_rotation(logs_dir: Path) -> None:
    logs_dir.mkdir()
    cur = logs_dir / "web-1.out"
    cur.write_text("old 1\nold 2\n")
    f = Follower(logs_dir, ["web-1"], prefix=False, lines=1)
    try:
        assert f.take(1) == ["old 2"]
        _append(cur, "new 1\nnew 2\n")
        assert f.take(2) == ["new 1", "new 2"]
        _append(cur, "last of the old file\n")
        os.rename(cur, logs_dir / "web-1.out.1")  # what the pump's rotation does
        cur.write_text("first of the new file\n")
        assert f.take(2) == ["last of the old file", "first of the new file"]
        _append(cur, "after the rotation\n")
        assert f.take(1) == ["after the rotation"]
    finally:
        f.close()
    assert f.lines.empty()  # nothing twice


def test_follow_a_pool_with_prefixes_and_a_replica_that_appears_later(logs_dir: Path) -> None:
    logs_dir.mkdir()
    (logs_dir / "web-1.out").write_text("one\n")
    f = Follower(logs_dir, ["web-1"], prefix=True, pool="web", lines=5)
    try:
        assert f.take(1) == ["web-1 | one"]
        (logs_dir / "web-2.out").write_text("two, from its first line\n")
        assert f.take(1) == ["web-2 | two, from its first line"]
        _append(logs_dir / "web-1.out", "one again\n")
        assert f.take(1) == ["web-1 | one again"]
    finally:
        f.close()


def test_follow_of_the_real_pump(logs_dir: Path, reactor: Reactor, children: Children) -> None:
    """The pump rotates 4 times within a few ms, between two polls of the follower: the
    files rotated in meanwhile are read from the backups, so no line is missed."""
    cap = LogCapture(logs_dir, reactor, max_bytes=500, backups=5)
    try:
        rlog = cap.open("web-1")
        f = Follower(logs_dir, ["web-1"], prefix=False)
        try:
            p = children.spawn(rlog, [*py(WRITE_LINES), "40", "49"])  # 2000 bytes: 4 rotations
            run_to_exit(reactor, p)
            rlog.finish()
            got = f.take(40)
        finally:
            f.close()
    finally:
        cap.close()
    assert got == _lines(40)
    assert f.lines.empty()


# -- the command -----------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", default=argparse.SUPPRESS)
    ap = argparse.ArgumentParser(prog="orchestrator")
    sub = ap.add_subparsers(dest="command", required=True)
    logcli.add_parser(sub, common)
    return ap.parse_args(argv)


@pytest.fixture
def state(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "state")
    paths.logs.mkdir(parents=True)
    (paths.logs / "web-2.out").write_text("".join(f"two {i}\n" for i in range(20)))
    (paths.logs / "web-2.err").write_text("oops\n")
    (paths.logs / "web-10.out.1").write_text("ten old\n")
    (paths.logs / "web-10.out").write_text("ten 1\nten 2\n")
    (paths.logs / "web-10.err").write_text("")
    (paths.logs / "daemon.log").write_text("the daemon's own\n")
    return paths


def test_cmd_logs_lines_and_stderr(state: Paths, capsys: pytest.CaptureFixture) -> None:
    assert logcli.cmd_logs(_parse(["logs", "web-2"]), state) == 0
    assert capsys.readouterr().out == "".join(f"two {i}\n" for i in range(10, 20))
    assert logcli.cmd_logs(_parse(["logs", "web-2", "--lines", "2"]), state) == 0
    assert capsys.readouterr().out == "two 18\ntwo 19\n"
    assert logcli.cmd_logs(_parse(["logs", "web-2", "-n", "0"]), state) == 0
    assert capsys.readouterr().out == ""
    assert logcli.cmd_logs(_parse(["logs", "web-2", "--stderr"]), state) == 0
    assert capsys.readouterr().out == "oops\n"
    assert logcli.cmd_logs(_parse(["logs", "web-10", "--lines", "3"]), state) == 0
    assert capsys.readouterr().out == "ten old\nten 1\nten 2\n"  # across the rotation


def test_cmd_logs_pool_prefixes_each_line(state: Paths, capsys: pytest.CaptureFixture) -> None:
    assert logcli.cmd_logs(_parse(["logs", "--pool", "web", "--lines", "1"]), state) == 0
    assert capsys.readouterr().out == "web-2 | two 19\nweb-10 | ten 2\n"  # in the order of n
    assert logcli.cmd_logs(_parse(["logs", "--pool", "web", "--stderr"]), state) == 0
    assert capsys.readouterr().out == "web-2 | oops\n"
    assert logcli.cmd_logs(_parse(["logs", "web-10", "web-2", "-n", "1"]), state) == 0
    assert capsys.readouterr().out == "web-10 | ten 2\nweb-2 | two 19\n"


@pytest.mark.parametrize("argv, message", [
    (["logs", "web-9"], "no logs of replica 'web-9'"),
    (["logs", "web-2", "web-9"], "no logs of replica 'web-9'"),
    (["logs", "../state/x"], "no logs of replica '../state/x'"),
    (["logs", "daemon"], "no logs of replica 'daemon'"),
    (["logs", "--pool", "db"], "no logs of pool 'db'"),
    (["logs"], "logs needs a replica ID or --pool P"),
    (["logs", "web-2", "--pool", "web"], "not both"),
])
def test_cmd_logs_errors_are_one_line(state: Paths, argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(OrchestratorError) as info:
        logcli.cmd_logs(_parse(argv), state)
    assert message in str(info.value) and "\n" not in str(info.value)
    if argv[1:2] == ["web-9"]:
        assert isinstance(info.value, NotFound)  # a log file that is not there; the replica may run
    if argv in (["logs"], ["logs", "web-2", "--pool", "web"]):
        assert isinstance(info.value, UsageError)  # the CLI exits 2
    assert capsys.readouterr().out == ""


def test_cmd_logs_with_no_logs_dir(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        logcli.cmd_logs(_parse(["logs", "web-1"]), Paths(tmp_path / "nothing"))


def test_every_option_states_its_default() -> None:
    common = argparse.ArgumentParser(add_help=False)
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    logcli.add_parser(sub, common)
    parser = sub.choices["logs"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and "default" in action.help, action.dest


# A terminal's Ctrl-C: the test may itself run as a background job, whose children inherit
# SIGINT ignored (POSIX), and Python then leaves it ignored.
CLI_SCRIPT = """
import argparse, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from orchestrator.client import logcli
from orchestrator.paths import Paths
common = argparse.ArgumentParser(add_help=False)
common.add_argument("--state-dir")
ap = argparse.ArgumentParser(prog="orchestrator")
sub = ap.add_subparsers(dest="command", required=True)
logcli.add_parser(sub, common)
args = ap.parse_args(sys.argv[1:])
sys.exit(logcli.cmd_logs(args, Paths(args.state_dir)))
"""


def _cli(state: Paths, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLI_SCRIPT, "logs", "--state-dir", str(state.state_dir), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))


def _readline(proc: subprocess.Popen, limit: float = 20.0) -> bytes:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(limit), "no line in time"
    return proc.stdout.readline()


def test_a_closed_stdout_ends_quietly(state: Paths) -> None:
    (state.logs / "big-1.out").write_text("".join(f"line {i} of many\n" for i in range(20000)))
    proc = _cli(state, "big-1", "--lines", "20000")
    try:
        assert _readline(proc) == b"line 0 of many\n"
        proc.stdout.close()  # `| head -1`
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stderr.close()
    assert proc.returncode == 0 and err == b""


def test_follow_ends_on_ctrl_c_with_exit_0(state: Paths) -> None:
    proc = _cli(state, "web-10", "--follow", "--lines", "1")
    try:
        assert _readline(proc) == b"ten 2\n"
        _append(state.logs / "web-10.out", "appended while following\n")
        assert _readline(proc) == b"appended while following\n"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0 and err == b"" and out == b""


# -- a pool's own rotation, through the CLI ---------------------------------------------------

# ~300 KB on stdout in 100-byte lines, then "done", then it stays up (the files are looked
# at while it runs; the daemon's stop ends it).
WRITER = [sys.executable, "-c", "import sys, time\n"
          "for i in range(3000): sys.stdout.write(f'{i:06d} ' + 'x' * 92 + '\\n')\n"
          "print('done', flush=True)\n"
          "time.sleep(1000)\n"]
WRITTEN = 3000 * 100 + len("done\n")


def _stream_files(logs_dir: Path, rid: str) -> dict[str, int]:
    """name -> size of a replica's stdout files."""
    return {p.name: p.stat().st_size for p in logs_dir.iterdir()
            if (p.name == f"{rid}.out" or p.name.startswith(f"{rid}.out.")) and not p.name.endswith(".idx")}


def _written_all(daemon, rid: str) -> None:
    wait_for(lambda: cli(daemon.state_dir, "logs", rid, "--lines", "1").stdout == "done\n", 30,
             f"{rid} to write everything")


def _assert_rotated(logs_dir: Path, rid: str, max_bytes: int, backups: int) -> None:
    files = _stream_files(logs_dir, rid)
    assert set(files) == {f"{rid}.out", *(f"{rid}.out.{i}" for i in range(1, backups + 1))}, files
    assert all(size <= max_bytes for size in files.values()), files
    assert all((logs_dir / f"{name}.idx").exists() for name in files), os.listdir(logs_dir)  # rotated with it


def test_launch_log_rotation_flags_are_that_pools_rotation(daemon) -> None:
    daemon.start()
    made = cli(daemon.state_dir, "launch", "--pool", "small", "--log-max-bytes", "20000", "--log-backups", "2",
               "--", *WRITER)
    assert made.returncode == 0, made.stderr
    assert cli(daemon.state_dir, "launch", "--pool", "big", "--", *WRITER).returncode == 0  # the daemon's 10 MiB
    _written_all(daemon, "small-1")
    _written_all(daemon, "big-1")
    logs_dir = daemon.state_dir / "logs"
    _assert_rotated(logs_dir, "small-1", 20000, 2)
    assert _stream_files(logs_dir, "big-1") == {"big-1.out": WRITTEN}
    policy = {p["name"]: p["policy"] for p in daemon.status()["pools"]}
    assert policy["small"]["log_max_bytes"] == 20000 and policy["small"]["log_backups"] == 2
    assert "log_max_bytes" not in policy["big"]  # unset: the daemon's default
    # the daemon checks what a client sends as the CLI does (a client of its own process:
    # its connections' fds are not this test's)
    script = ("import sys\nfrom orchestrator import Client\nfrom orchestrator.errors import InvalidSpec\n"
              "with Client(sys.argv[1]) as client:\n"
              "    for policy in ({'log_max_bytes': 1}, {'log_backups': -1}, {'log_backups': 101}):\n"
              "        try:\n"
              "            client.launch('tiny', ['true'], policy=policy)\n"
              "        except InvalidSpec as err:\n"
              "            print(err)\n")
    refused = subprocess.run([sys.executable, "-c", script, str(daemon.state_dir)], capture_output=True,
                             text=True, timeout=60, env=cli_env())
    lines = refused.stdout.splitlines()
    assert len(lines) == 3 and "log_max_bytes" in lines[0] and all("log_backups" in x for x in lines[1:]), refused
    # another rotation is another policy: refused without --replace
    again = cli(daemon.state_dir, "launch", "--pool", "small", "--log-backups", "5", "--", *WRITER)
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1, again.stderr


def test_config_log_rotation_keys_are_that_pools_rotation(daemon, tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    conf.write_text(f"[pools.small]\ncommand = {json.dumps(WRITER)}\nlog_max_bytes = 20000\nlog_backups = 2\n\n"
                    f"[pools.sized]\ncommand = {json.dumps(WRITER)}\nlog_max_bytes = \"64K\"\nlog_backups = 0\n\n"
                    f"[pools.big]\ncommand = {json.dumps(WRITER)}\n")
    daemon.start("--config", str(conf))
    for rid in ("small-1", "sized-1", "big-1"):
        _written_all(daemon, rid)
    logs_dir = daemon.state_dir / "logs"
    _assert_rotated(logs_dir, "small-1", 20000, 2)
    _assert_rotated(logs_dir, "sized-1", 64 << 10, 0)
    assert _stream_files(logs_dir, "big-1") == {"big-1.out": WRITTEN}
    policy = {p["name"]: p["policy"] for p in daemon.status()["pools"]}
    assert (policy["small"]["log_max_bytes"], policy["small"]["log_backups"]) == (20000, 2)
    assert (policy["sized"]["log_max_bytes"], policy["sized"]["log_backups"]) == (64 << 10, 0)


@pytest.mark.parametrize("flags, word", [
    (["--log-max-bytes", "0"], "log_max_bytes"),
    (["--log-max-bytes", "-5"], "log_max_bytes"),
    (["--log-max-bytes", "lots"], "log_max_bytes"),
    (["--log-max-bytes", "100"], "log_max_bytes"),       # under the minimum
    (["--log-max-bytes", "1e400"], "log_max_bytes"),
    (["--log-backups", "-1"], "log_backups"),
    (["--log-backups", "two"], "log_backups"),
    (["--log-backups", "100000"], "log_backups"),         # over the maximum
])
def test_a_bad_log_rotation_flag_is_one_line_exit_1(tmp_path: Path, flags: list[str], word: str) -> None:
    proc = cli(tmp_path / "state", "launch", "--pool", "p", *flags, "--", "true")
    assert proc.returncode == 1, proc
    assert len(proc.stderr.strip().splitlines()) == 1 and word in proc.stderr, proc.stderr


@pytest.mark.parametrize("line", ["log_max_bytes = 0", "log_max_bytes = 100", "log_max_bytes = \"x\"",
                                  "log_backups = -1", "log_backups = 1.5", "log_backups = 100000"])
def test_a_bad_log_rotation_key_is_one_line_exit_1(daemon, tmp_path: Path, line: str) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text(f"[pools.p]\ncommand = [\"true\"]\n{line}\n")
    proc = cli(daemon.state_dir, "start", "--config", str(conf))  # the fixture stops one started wrongly
    assert proc.returncode == 1, proc
    assert len(proc.stderr.strip().splitlines()) == 1 and "bad.toml:3" in proc.stderr, proc.stderr
    assert not (daemon.state_dir / "daemon.pid").exists()


# -- the files of replicas the journal forgot ---------------------------------------------------


def _replica_files(logs_dir: Path) -> list[str]:
    return [n for n in os.listdir(logs_dir) if n != "daemon.log" and not n.startswith("daemon.log.")]


def test_logs_of_replicas_the_journal_forgets_go_while_the_daemon_runs(daemon) -> None:
    """Churn far more replicas than retention keeps: logs/ holds the files of the kept and
    the live ones (and of those retired since the last prune), not of every one ever made."""
    from orchestrator.store import PRUNE_RETIRED_MIN

    keep, size, churned = 10, 2, 400
    daemon.start("--keep-replicas", str(keep))
    flap = ["sh", "-c", 'echo "out $ORCHESTRATOR_REPLICA_ID"; echo "err $ORCHESTRATOR_REPLICA_ID" >&2']
    made = cli(daemon.state_dir, "launch", "--pool", "flap", "--count", str(size), "--restart", "always",
               "--backoff", "0.001:0.001", "--max-restarts", "1000000/60", "--", *flap)
    assert made.returncode == 0, made.stderr
    logs_dir = daemon.state_dir / "logs"
    # Each replica writes both streams: 2 files, each with its index. The journal holds
    # `keep` ended replicas, plus up to PRUNE_RETIRED_MIN retired since its last prune, plus
    # the live ones; the removal of a prune's files is a few turns behind it. Twice that is
    # the bound.
    bound = 2 * 2 * 2 * (keep + PRUNE_RETIRED_MIN + size)
    most = 0

    def churned_enough() -> bool:
        nonlocal most
        most = max(most, len(_replica_files(logs_dir)))
        live = [int(r["id"].rsplit("-", 1)[1]) for r in daemon.status()["replicas"]]
        return max(live, default=0) >= churned

    wait_for(churned_enough, 120, f"{churned} replicas to have come and gone")
    assert most <= bound, f"{most} files in logs/ (bound {bound})"
    # After the churn: the files left are those of replicas the journal still knows.
    assert cli(daemon.state_dir, "scale", "flap", "0").returncode == 0

    def only_known() -> bool:
        files = {n.split(".", 1)[0] for n in _replica_files(logs_dir)}
        known = {r["id"] for r in daemon.status(all=True)["replicas"]}
        return files <= known

    wait_for(only_known, 20, "logs/ to hold only the files of replicas the journal knows")
    assert len(_replica_files(logs_dir)) <= bound
    # the files of the replicas it keeps stay (the last few were stopped by the scale, maybe
    # before they wrote: the newest that ran to its end)
    ran = [r for r in daemon.status(all=True)["replicas"] if r["exit_code"] == 0]
    newest = max(ran, key=lambda r: int(r["id"].rsplit("-", 1)[1]))
    assert cli(daemon.state_dir, "logs", newest["id"]).stdout == f"out {newest['id']}\n"


def _plant(logs_dir: Path, rid: str, backups: int = 0) -> list[str]:
    names = [f"{rid}.out", f"{rid}.err", *(f"{rid}.out.{i}" for i in range(1, backups + 1))]
    for name in names:
        (logs_dir / name).write_text("x\n")
    return names


def _turns_until(reactor: Reactor, cap: LogCapture, limit: int = 1000) -> int:
    """Run turns until nothing is left to remove; how many it took."""
    for turn in range(1, limit + 1):
        reactor.run_once(1.0)
        if not cap.removals_pending:
            return turn
    raise AssertionError("the removal queue never emptied")


def test_forget_removes_every_file_of_those_replicas_a_bounded_number_per_turn(
        logs_dir: Path, reactor: Reactor, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = LogCapture(logs_dir, reactor)
    try:
        doomed = [f"web-{n}" for n in range(1, 201)]
        for rid in doomed:
            _plant(logs_dir, rid, backups=2)
        # A probe's log has no time index (one unlink, a stream's two): web-1's rotated one
        # makes the queue's cost odd, so a turn's 64th unlink falls inside a stream's pair,
        # which must wait for the next turn. Without the time bound, that turn is reached
        # whatever the host's speed (a loaded host's time bound found it first).
        for name in ("web-1.probe", "web-1.probe.1"):
            (logs_dir / name).write_text("x\n")
        monkeypatch.setattr(logcapture, "REMOVE_TURN_TIME", 60.0)
        kept = _plant(logs_dir, "web-500", backups=1) + ["daemon.log", "web-7.out.x"]
        for name in kept[-2:]:
            (logs_dir / name).write_text("not a forgotten replica's\n")
        unlinks: list[int] = []
        real_unlink = os.unlink

        def counting_unlink(name: str, *, dir_fd: int | None = None) -> None:
            unlinks[-1] += 1
            real_unlink(name, dir_fd=dir_fd)

        monkeypatch.setattr(os, "unlink", counting_unlink)
        cap.forget([*doomed, "../etc/passwd", "not an id"])
        assert sorted(os.listdir(logs_dir)) != sorted(kept)  # nothing removed in the caller's turn
        turns = 0
        while cap.removals_pending:
            unlinks.append(0)
            reactor.run_once(1.0)
            turns += 1
            assert turns < 1000
        assert max(unlinks) <= logcapture.REMOVE_PER_TURN
        assert turns >= 200 * 4 // logcapture.REMOVE_PER_TURN  # 800 files (+ the probes past the chains' ends)
        assert sorted(os.listdir(logs_dir)) == sorted(kept)
    finally:
        cap.close()


def test_forget_tolerates_missing_and_unremovable_files(logs_dir: Path, reactor: Reactor,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    cap = LogCapture(logs_dir, reactor)
    try:
        _plant(logs_dir, "web-1", backups=1)
        (logs_dir / "web-1.err").unlink()  # someone removed it already: ENOENT is no matter
        _plant(logs_dir, "web-2")
        (logs_dir / "web-3.out").mkdir()  # EISDIR: not a file of ours to insist on
        real_unlink = os.unlink

        def refusing_unlink(name: str, *, dir_fd: int | None = None) -> None:
            if name.startswith("web-2."):
                raise PermissionError(errno.EACCES, "Permission denied", name)
            real_unlink(name, dir_fd=dir_fd)

        monkeypatch.setattr(os, "unlink", refusing_unlink)
        with caplog.at_level("WARNING", logger="orchestrator.logs"):
            cap.forget(["web-1", "web-2", "web-3"])
            _turns_until(reactor, cap)
        assert sorted(os.listdir(logs_dir)) == ["web-2.err", "web-2.out", "web-3.out"]
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "Permission denied" in warnings[0].getMessage()  # said once
        monkeypatch.setattr(os, "unlink", real_unlink)
        cap.forget(["web-2"])  # writable again: removed, and it says so
        _turns_until(reactor, cap)
        assert sorted(os.listdir(logs_dir)) == ["web-3.out"]
    finally:
        cap.close()


def test_a_replica_forgotten_while_its_capture_is_open_goes_when_it_finishes(
        capture: LogCapture, reactor: Reactor, children: Children) -> None:
    rlog = capture.open("web-1")
    p = children.spawn(rlog, py("print('hello')"))
    run_to_exit(reactor, p)
    capture.forget(["web-1"])
    for _ in range(3):
        reactor.run_once(0.01)
    assert (capture.logs_dir / "web-1.out").exists() and capture.removals_pending  # still open: kept for now
    rlog.finish()
    _turns_until(reactor, capture)
    assert not list(capture.logs_dir.iterdir())


def test_the_store_names_the_replicas_its_retention_deleted(tmp_path: Path) -> None:
    from orchestrator.store import PRUNE_RETIRED_MIN, Store

    got: list[list[str]] = []
    ended = time.time() - 3600.0  # an hour ago: within the age limit, so only the count prunes
    with Store(tmp_path / "state.db", keep_replicas=3) as store:
        store.on_pruned = got.append
        for n in range(1, 6):
            store.save_replica({"id": f"web-{n}", "state": "RUNNING", "pid": 100 + n})
        store.commit()
        for n in range(1, 6):
            store.save_replica({"id": f"web-{n}", "state": "EXITED", "exit_code": 0, "ended_at": ended + n})
        store.commit()
        assert got == []  # 5 retired: under the cadence, nothing pruned yet
        for n in range(6, 6 + PRUNE_RETIRED_MIN):  # enough retired replicas to prune
            store.save_replica({"id": f"web-{n}", "state": "EXITED", "exit_code": 0, "ended_at": ended + n})
        store.commit()
        forgotten = [rid for batch in got for rid in batch]
        last = 5 + PRUNE_RETIRED_MIN
        assert sorted(forgotten, key=lambda r: int(r[4:])) == [f"web-{n}" for n in range(1, last - 2)]
        assert {r["id"] for r in store.replicas(include_terminal=True)} == {f"web-{n}" for n in range(last - 2, last + 1)}


def test_forget_removes_the_task_files_there_are_and_tries_none_for_a_task_without(
        logs_dir: Path, reactor: Reactor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's files are made by its first byte: most tasks have none, and a forgotten
    task without files costs no unlink. Files there before the capture started (an earlier
    daemon's) and files it made are both removed with their records."""
    logs_dir.mkdir(exist_ok=True)
    earlier = _plant(logs_dir, "jobs#1", backups=1)
    kept = ["jobs#3.out.x", "daemon.log"]
    for name in kept:
        (logs_dir / name).write_text("not a task's log\n")
    cap = LogCapture(logs_dir, reactor)
    rlog = cap.open("jobs-1")
    try:
        out = rlog.stream("out")
        out.bind("jobs/2", "out")  # a task that writes a line: its file is made
        os.write(out.w, b"task 2 says\n")
        out.drain()
        out.unbind()
        assert (logs_dir / "jobs#2.out").read_text() == "task 2 says\n"
        unlinked: list[str] = []
        real_unlink = os.unlink

        def counting_unlink(name: str, *, dir_fd: int | None = None) -> None:
            unlinked.append(name)
            real_unlink(name, dir_fd=dir_fd)

        monkeypatch.setattr(os, "unlink", counting_unlink)
        cap.forget([f"jobs/{n}" for n in range(1, 1001)])  # 998 tasks that wrote nothing
        _turns_until(reactor, cap)
        assert {name.split(".")[0] for name in unlinked} == {"jobs#1", "jobs#2"}
        # each chain probed one past its end, nothing else; each file with its time index
        assert len(unlinked) <= 2 * (4 * 2 + len(earlier))
        assert not any(name.startswith(("jobs#1.", "jobs#2.")) for name in os.listdir(logs_dir))
        assert all((logs_dir / name).exists() for name in kept)
    finally:
        rlog.finish()
        cap.close()
