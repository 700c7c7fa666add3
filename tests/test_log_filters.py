"""journalctl's filters on the captured logs: the per-line read times kept beside each log
(logindex.py, written by logcapture.py), and ``logs --since/--until/--grep/--timestamps/
--json`` reading through them (logread.py, logcli.py).

The capture tests run a real Reactor on a fake wall clock (LogCapture's ``clock``): the
test writes into a replica's pipe, sets the clock, and runs turns until the bytes are in
the file, so every line's time is known exactly. The end-to-end tests run a daemon whose
replica prints its own time on each line.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from helpers import cli, cli_env, wait_for
from orchestrator import logindex
from orchestrator.daemon.logcapture import LogCapture, ReplicaLog
from orchestrator.daemon.reactor import Reactor
from orchestrator.errors import UsageError
from orchestrator.logindex import RECORD, open_index
from orchestrator.logread import LineFilter, compile_grep, follow_lines, parse_when, read_lines, stamp

T0 = 1_790_000_000.0  # the fake clock's start (2026-09-21)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def logs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    return d


@pytest.fixture
def opened(logs_dir: Path, reactor: Reactor, clock: Clock, request: pytest.FixtureRequest
           ) -> Iterator[tuple[LogCapture, ReplicaLog]]:
    limits = getattr(request, "param", {})
    cap = LogCapture(logs_dir, reactor, create_after=0, clock=clock, **limits)
    rlog = cap.open("web-1")
    try:
        yield cap, rlog
    finally:
        cap.close()  # (closes the write ends too: finish)


def put(reactor: Reactor, cap: LogCapture, rlog: ReplicaLog, data: bytes) -> None:
    """Write ``data`` into the replica's stdout pipe and run turns until the capture has it."""
    want = rlog.bytes + len(data)
    os.write(rlog.stdout, data)
    for _ in range(1000):
        if rlog.bytes >= want:
            return
        reactor.run_once(1.0)
    raise AssertionError(f"the capture never took {data!r}")


def texts(lines: list) -> list[str]:
    return [line.text for line in lines]


def test_each_line_has_the_time_its_chunk_was_read(opened, reactor: Reactor, clock: Clock, logs_dir: Path) -> None:
    cap, rlog = opened
    put(reactor, cap, rlog, b"a\nb\n")  # one chunk: one time for both
    clock.now += 0.0004  # within RESOLUTION of the last record: no record of its own
    put(reactor, cap, rlog, b"c\n")
    clock.now += 2.0
    put(reactor, cap, rlog, b"half")  # a line cut between two chunks: the time of its start
    clock.now += 1.0
    put(reactor, cap, rlog, b" and rest\nd\n")
    clock.now -= 10.0  # a clock stepped back: times never decrease in one index
    put(reactor, cap, rlog, b"e\n")
    got = [(line.text, round(line.time - T0, 4)) for line in read_lines(logs_dir, "web-1", lines=None)]
    assert got == [("a", 0.0), ("b", 0.0), ("c", 0.0), ("half and rest", 2.0004), ("d", 3.0004), ("e", 3.0004)]
    index = logs_dir / "web-1.out.idx"
    assert index.stat().st_size == RECORD.size * (1 + 3)  # the header and 3 records, not one per chunk
    assert (logs_dir / "web-1.out").read_bytes() == b"a\nb\nc\nhalf and rest\nd\ne\n"  # the bytes, only them
    # since/until by the read time; a line that began before ``since`` is not shown
    after = read_lines(logs_dir, "web-1", lines=None, filt=LineFilter(since=T0 + 2.5))
    assert texts(after) == ["d", "e"]
    assert texts(read_lines(logs_dir, "web-1", lines=None, filt=LineFilter(since=T0 + 1))) == [
        "half and rest", "d", "e"]
    assert texts(read_lines(logs_dir, "web-1", lines=None, filt=LineFilter(until=T0 + 1))) == ["a", "b", "c"]
    assert texts(read_lines(logs_dir, "web-1", lines=None, filt=LineFilter(until=T0 + 2.5))) == [
        "a", "b", "c", "half and rest"]
    both = LineFilter(since=T0 + 1, until=T0 + 3.5, grep=compile_grep("^[a-d]$"))
    assert texts(read_lines(logs_dir, "web-1", lines=None, filt=both)) == ["d"]
    assert texts(read_lines(logs_dir, "web-1", lines=2)) == ["d", "e"]
    assert texts(read_lines(logs_dir, "web-1", lines=2, filt=LineFilter(grep=compile_grep("^[abc]")))) == ["b", "c"]


def test_an_index_survives_a_restart_of_its_writer(logs_dir: Path, reactor: Reactor, clock: Clock) -> None:
    """A later daemon appends to the same file: its index goes on (not started again)."""
    for t, line in ((0.0, b"first\n"), (5.0, b"second\n")):
        clock.now = T0 + t
        cap = LogCapture(logs_dir, reactor, create_after=0, clock=clock)
        rlog = cap.open("web-1")
        try:
            put(reactor, cap, rlog, line)
        finally:
            cap.close()
    got = [(line.text, line.time - T0) for line in read_lines(logs_dir, "web-1", lines=None)]
    assert got == [("first", 0.0), ("second", 5.0)]


@pytest.mark.parametrize("opened", [{"max_bytes": 40, "backups": 2}], indirect=True)
def test_rotation_moves_each_index_with_its_log(opened, reactor: Reactor, clock: Clock, logs_dir: Path) -> None:
    cap, rlog = opened
    written = b""
    for i in range(12):  # 12 lines of 10 bytes, one a second: 4 to a file, 3 files kept
        clock.now = T0 + i
        line = b"line %04d\n" % i
        written += line
        put(reactor, cap, rlog, line)
    names = sorted(n for n in os.listdir(logs_dir) if n.startswith("web-1.out"))
    assert names == ["web-1.out", "web-1.out.1", "web-1.out.1.idx", "web-1.out.2", "web-1.out.2.idx",
                     "web-1.out.idx"]
    chain = [logs_dir / n for n in ("web-1.out.2", "web-1.out.1", "web-1.out")]
    assert b"".join(p.read_bytes() for p in chain) == written[-len(b"".join(p.read_bytes() for p in chain)):]
    for path in chain:  # each index is its log's (its header names the log's inode)
        fd = os.open(path, os.O_RDONLY)
        dirfd = os.open(logs_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            index = open_index(dirfd, path.name, fd, logs_dir)
            assert index.fd >= 0 and index.count >= 1, path
            index.close()
        finally:
            os.close(fd)
            os.close(dirfd)
    everything = read_lines(logs_dir, "web-1", lines=None)
    assert [(line.text, line.time - T0) for line in everything] == [
        (f"line {i:04d}", float(i)) for i in range(12 - len(everything), 12)]
    since = read_lines(logs_dir, "web-1", lines=None, filt=LineFilter(since=T0 + 5, until=T0 + 9))
    assert texts(since) == [f"line {i:04d}" for i in range(5, 10)]  # across the three files
    # retention removes the index with its log
    cap.forget(["web-9"])  # (nothing of web-9's: a no-op)
    rlog.finish()
    cap.forget(["web-1"])
    wait_for(lambda: (reactor.run_once(0.05), not cap.removals_pending)[1], 10, "the removals")
    assert [n for n in os.listdir(logs_dir) if n.startswith("web-1.")] == []


def test_a_log_without_its_own_index_is_dated_by_its_mtime(logs_dir: Path) -> None:
    (logs_dir / "web-2.out").write_bytes(b"old 1\nold 2\n")
    os.utime(logs_dir / "web-2.out", (T0, T0))
    assert [(line.text, line.time) for line in read_lines(logs_dir, "web-2", lines=None)] == [
        ("old 1", T0), ("old 2", T0)]
    assert texts(read_lines(logs_dir, "web-2", lines=None, filt=LineFilter(since=T0 + 1))) == []
    assert texts(read_lines(logs_dir, "web-2", lines=None, filt=LineFilter(since=T0 - 1))) == ["old 1", "old 2"]
    # another file's index (a rotation seen between its two renames) is not taken for its own
    (logs_dir / "web-3.out").write_bytes(b"x\n")
    head = logindex.HEADER.pack(logindex.MAGIC, os.stat(logs_dir / "web-3.out").st_ino)
    (logs_dir / "web-2.out.idx").write_bytes(head + RECORD.pack(int((T0 + 99) * 1e6), 0))
    assert [line.time for line in read_lines(logs_dir, "web-2", lines=None)] == [T0, T0]


def test_since_is_a_binary_search_over_the_index(logs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge index is not read through: --since costs a few preads whatever the log's size."""
    n = 200_000
    log = logs_dir / "web-4.out"
    with open(log, "wb") as f:
        f.truncate(n * 100)  # sparse: 100 bytes a record, one line each at the end
        f.seek(n * 100 - 4)
        f.write(b"end\n")
    st = os.stat(log)
    records = b"".join(RECORD.pack(int((T0 + i) * 1e6), i * 100) for i in range(n))
    (logs_dir / "web-4.out.idx").write_bytes(logindex.HEADER.pack(logindex.MAGIC, st.st_ino) + records)
    fd = os.open(log, os.O_RDONLY)
    dirfd = os.open(logs_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        index = open_index(dirfd, log.name, fd, logs_dir)
        calls = []
        real = os.pread
        monkeypatch.setattr(os, "pread", lambda fd_, k, off: (calls.append(k), real(fd_, k, off))[1])
        assert index.find_time(int((T0 + 123_456.5) * 1e6)) == 123_456 * 100
        assert index.find_time(int((T0 - 5) * 1e6)) == 0
        assert index.find_time(int((T0 + n + 5) * 1e6)) == (n - 1) * 100
        assert len(calls) <= 3 * 20  # log2(200_000) < 18 each
        index.close()
    finally:
        os.close(fd)
        os.close(dirfd)


def test_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    log = tmp_path / "x.out"
    log.write_bytes(b"a\n")
    st = os.stat(log)
    idx = tmp_path / "x.out.idx"
    idx.write_bytes(logindex.HEADER.pack(logindex.MAGIC, st.st_ino) + RECORD.pack(5_000_000, 0) + b"\x01\x02")
    fd = os.open(idx, os.O_RDWR | os.O_APPEND)
    writer = logindex.IndexWriter(fd, st)
    writer.chunk(6_000_000, 2)
    writer.close()
    assert idx.read_bytes()[RECORD.size:] == RECORD.pack(5_000_000, 0) + RECORD.pack(6_000_000, 2)


def test_follow_applies_the_filters_to_followed_lines(opened, reactor: Reactor, clock: Clock,
                                                      logs_dir: Path) -> None:
    cap, rlog = opened
    put(reactor, cap, rlog, b"keep 1\ndrop 1\n")
    stopping = [False]
    lines = follow_lines(logs_dir, ["web-1"], stop=lambda: stopping[0], lines=None, interval=0.01,
                         filt=LineFilter(grep=compile_grep("keep")))
    first = next(lines)
    assert (first.text, first.time) == ("keep 1", T0)
    clock.now += 7.0
    put(reactor, cap, rlog, b"drop 2\nkeep 2\n")
    second = next(lines)
    assert (second.text, second.time) == ("keep 2", T0 + 7.0)
    stopping[0] = True
    assert list(lines) == []


def test_parse_when() -> None:
    now = 1_000_000.0
    assert parse_when("30s", now) == now - 30
    assert parse_when("10m", now) == now - 600
    assert parse_when("2h", now) == now - 7200
    assert parse_when("1d", now) == now - 86400
    assert parse_when("1.5s", now) == now - 1.5
    assert parse_when("now", now) == now
    assert parse_when("2026-12-02T06:00:00Z") == datetime.datetime(2026, 12, 2, 6, tzinfo=datetime.timezone.utc
                                                                   ).timestamp()
    assert parse_when("2026-12-02T07:00:00.250+01:00") == parse_when("2026-12-02T06:00:00.250Z")
    local = datetime.datetime(2026, 12, 2, 6, 0, 0).timestamp()  # a naive time is local time
    assert parse_when("2026-12-02 06:00:00") == local
    for bad in ("banana", "10x", "-5m", "", "12:00:00:00"):
        with pytest.raises(UsageError):
            parse_when(bad, now)
    with pytest.raises(UsageError):
        compile_grep("(")
    assert stamp(T0 + 0.25).endswith(datetime.datetime.fromtimestamp(T0).astimezone().strftime("%z")[:3]
                                      + ":" + datetime.datetime.fromtimestamp(T0).astimezone().strftime("%z")[3:])
    assert parse_when(stamp(T0 + 0.25)) == T0 + 0.25  # what --timestamps prints, --since takes


@pytest.mark.parametrize("argv, word", [
    (["--since", "banana"], "not a time"),
    (["--until", "yesterday-ish"], "not a time"),
    (["--grep", "(unclosed"], "not a regular expression"),
])
def test_bad_filters_are_one_line_exit_2(tmp_path: Path, argv: list[str], word: str) -> None:
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "web-1.out").write_text("x\n")
    done = cli(state, "logs", "web-1", *argv)
    assert done.returncode == 2 and done.stdout == "", done
    assert len(done.stderr.strip().splitlines()) == 1 and word in done.stderr, done.stderr


# -- end to end: a daemon, a replica that prints its own time --------------------------

TIMED = [sys.executable, "-c",
         "import sys, time\n"
         "record = open(sys.argv[1], 'ab')\n"
         "for i in range(6):\n"
         "    line = ('%.6f tick %d %s\\n' % (time.time(), i, 'odd' if i % 2 else 'even')).encode()\n"
         "    sys.stdout.buffer.write(line); sys.stdout.flush(); record.write(line); record.flush()\n"
         "    time.sleep(0.6)\n"
         "sys.stdout.write('done\\n'); sys.stdout.flush(); record.write(b'done\\n'); record.flush()\n"
         "time.sleep(1000)\n"]


def test_filters_select_the_lines_of_a_replica_that_says_when(daemon, tmp_path: Path) -> None:
    daemon.start()
    record = tmp_path / "written"
    assert cli(daemon.state_dir, "launch", "--pool", "clock", "--", *TIMED, str(record)).returncode == 0
    wait_for(lambda: cli(daemon.state_dir, "logs", "clock-1", "-n", "1").stdout == "done\n", 30, "the replica's lines")
    logs = daemon.state_dir / "logs"
    assert (logs / "clock-1.out").read_bytes() == record.read_bytes()  # the log is the replica's bytes, only them
    said = [float(line.split()[0]) for line in record.read_text().splitlines()[:-1]]

    def run(*argv: str) -> list[str]:
        done = cli(daemon.state_dir, "logs", "clock-1", *argv)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    stamped = run("--timestamps", "-n", "100")
    assert len(stamped) == 7
    for line, t in zip(stamped, said):
        read_at = parse_when(line.split(" ", 1)[0])
        assert t - 0.002 <= read_at <= t + 0.3, (line, t)  # read just after it was written (to the ms)
    assert stamped[-1].endswith(" done")
    iso = datetime.datetime.fromtimestamp(said[3] - 0.2).astimezone().isoformat()
    since = run("--since", iso)
    assert [x.split(" ")[2] for x in since[:-1]] == ["3", "4", "5"] and since[-1] == "done", since
    until = run("--until", datetime.datetime.fromtimestamp(said[1] + 0.2).astimezone().isoformat())
    assert [x.split(" ")[2] for x in until] == ["0", "1"], until
    assert [x.split(" ")[2] for x in run("--grep", r"tick \d odd$")] == ["1", "3", "5"]
    assert run("--since", "1d", "--grep", "done") == ["done"]
    assert run("--since", "2026-01-01T00:00:00Z", "--until", "2026-01-02T00:00:00Z") == []
    rows = [json.loads(x) for x in run("--json", "-n", "2")]
    assert [r["line"] for r in rows] == [record.read_text().splitlines()[-2], "done"]
    assert all(r["replica"] == "clock-1" and r["stream"] == "out" and parse_when(r["time"]) == pytest.approx(r["ts"],
               abs=0.001) for r in rows), rows
    # --until in the past with --follow: prints and returns
    past = run("--follow", "--until", datetime.datetime.fromtimestamp(said[0] + 0.2).astimezone().isoformat())
    assert [x.split(" ")[2] for x in past] == ["0"]


FOLLOWED = [sys.executable, "-c",
            "import sys, time\n"
            "for i in range(100000):\n"
            "    print('tick', i, flush=True); print('tock', i, flush=True); time.sleep(0.05)\n"]


def test_follow_with_grep_and_timestamps(daemon, tmp_path: Path) -> None:
    daemon.start()
    assert cli(daemon.state_dir, "launch", "--pool", "talk", "--", *FOLLOWED).returncode == 0
    wait_for(lambda: (daemon.state_dir / "logs" / "talk-1.out").exists(), 30, "the replica's log")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "logs",
                             "talk-1", "-f", "-n", "0", "--grep", "^tock", "--timestamps"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=cli_env())
    try:
        got: list[bytes] = []
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while len(got) < 5 and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                got.append(proc.stdout.readline())
        assert len(got) == 5 and all(b" tock " in line for line in got), got
        for line in got:
            assert abs(parse_when(line.split(b" ", 1)[0].decode()) - time.time()) < 30
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()


def test_a_log_copied_without_its_index_is_dated_by_its_mtime(tmp_path: Path) -> None:
    """A log copied without its index (cp of the .out alone): dated by its mtime, not an error."""
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    src = tmp_path / "elsewhere.out"
    src.write_text("copied\n")
    shutil.copy(src, state / "logs" / "web-5.out")
    done = cli(state, "logs", "web-5", "--since", "1h", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["line"] == "copied", done


def test_a_tasks_log_and_several_replicas_take_the_filters(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``logs jobs/7`` reads a task's files; several ids' lines are merged in time order."""
    from orchestrator.client import logcli
    from orchestrator.paths import Paths
    from test_logs import _parse

    paths = Paths(tmp_path / "state")
    paths.logs.mkdir(parents=True)
    for name, body, t in (("jobs#7.out", "task ok\ntask noise\n", T0 + 1), ("web-1.out", "early ok\n", T0),
                          ("web-2.out", "late ok\n", T0 + 2)):
        (paths.logs / name).write_text(body)
        os.utime(paths.logs / name, (t, t))  # no index: dated by the mtime
    assert logcli.cmd_logs(_parse(["logs", "jobs/7", "--grep", "ok", "--json"]), paths) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rows == [{"time": stamp(T0 + 1), "ts": T0 + 1, "task": "jobs/7", "stream": "out", "line": "task ok"}]
    assert logcli.cmd_logs(_parse(["logs", "web-2", "jobs/7", "web-1", "--grep", "ok", "-t"]), paths) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{stamp(T0)} web-1 | early ok", f"{stamp(T0 + 1)} jobs/7 | task ok", f"{stamp(T0 + 2)} web-2 | late ok"]
    assert logcli.cmd_logs(_parse(["logs", "--pool", "web", "--since", stamp(T0 + 1)]), paths) == 0
    assert capsys.readouterr().out == "web-2 | late ok\n"


def test_remove_takes_the_indexes_with_their_logs(logs_dir: Path) -> None:
    """logfiles.remove (a later daemon's start-up scan): a forgotten replica's indexes go too."""
    from orchestrator.logfiles import remove

    names = ["web-1.out", "web-1.out.idx", "web-1.out.1", "web-1.out.1.idx", "web-1.err.idx", "jobs#3.out.idx",
             "web-2.out", "web-2.out.idx"]
    for name in names:
        (logs_dir / name).write_text("x\n")
    assert remove(logs_dir, ["web-1", "jobs/3"]) == 6
    assert sorted(os.listdir(logs_dir)) == ["web-2.out", "web-2.out.idx"]


@pytest.mark.parametrize("opened", [{"max_bytes": 40, "backups": 1}], indirect=True)
def test_followed_lines_keep_their_times_across_rotations(opened, reactor: Reactor, clock: Clock,
                                                         logs_dir: Path) -> None:
    cap, rlog = opened
    first = [b"line 0000\n"]

    def stop() -> bool:  # asked before each poll: the first line is written once the follow has begun
        if first:
            put(reactor, cap, rlog, first.pop())
        return False

    # The file is there, empty (create_after=0), and has no index yet: its first write makes it
    lines = follow_lines(logs_dir, ["web-1"], stop=stop, lines=None, interval=0.01, timed=True)
    got = next(lines)
    assert (got.text, got.time) == ("line 0000", T0)
    for i in range(1, 10):  # 4 lines to a file: rotated twice on the way, each new file found empty
        clock.now = T0 + i
        put(reactor, cap, rlog, b"line %04d\n" % i)
        got = next(lines)
        assert (got.text, got.time) == (f"line {i:04d}", T0 + i)
    lines.close()


def test_follow_until_a_time_to_come_ends_then(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "web-1.out").write_text("there\n")
    began = time.monotonic()
    done = cli(state, "logs", "web-1", "-f", "--until", stamp(time.time() + 1.5), timeout=30)
    assert done.returncode == 0 and done.stdout == "there\n", done
    assert time.monotonic() - began >= 1.0  # it followed until then (not the past's "just print")


def test_an_index_whose_records_go_past_its_log_is_started_again(tmp_path: Path) -> None:
    """A log removed alone, its inode reused by the new one: the old records are not its own."""
    log = tmp_path / "x.out"
    log.write_bytes(b"a\n")
    st = os.stat(log)
    idx = tmp_path / "x.out.idx"
    idx.write_bytes(logindex.HEADER.pack(logindex.MAGIC, st.st_ino) + RECORD.pack(5_000_000, 0)
                    + RECORD.pack(6_000_000, 5_000))
    fd = os.open(idx, os.O_RDWR | os.O_APPEND)
    writer = logindex.IndexWriter(fd, st)
    mtime = int(st.st_mtime * 1e6)
    writer.chunk(mtime + 2_000_000, 2)
    writer.close()
    assert idx.read_bytes() == (logindex.HEADER.pack(logindex.MAGIC, st.st_ino) + RECORD.pack(mtime, 0)
                                + RECORD.pack(mtime + 2_000_000, 2))
