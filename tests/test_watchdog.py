"""Tests of the watchdog package: identity, ledger, link, reaper, and the process end to end.

The end-to-end tests run ``tests/watchdog_parent.py`` as a stand-in orchestrator:
it starts a real watchdog through ``WatchdogLink``, forks workers (own process groups,
grandchildren, one escaping with setsid, stopped ones), registers them and prints their
identities. The test SIGKILLs it and checks that the watchdog cleaned up.

Rules these tests keep, because they run in parallel (``pytest -n auto``) next to other
suites: every test works in its own ``tmp_path``; every process a test starts or learns
about is recorded by identity ``(pid, start)`` and killed at teardown through a verified
pidfd; no process group is signalled; every wait is bounded and waits on state (pidfds,
/proc), never on a fixed sleep, except the one-second idle measurement.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import watchdog  # noqa: E402
from watchdog.identity import is_alive, open_verified, parse_stat, proc_stat, scan, start_time  # noqa: E402
from watchdog.ledger import ENCODE_QUIT, Entry, Ledger, encode_add, encode_remove  # noqa: E402
from watchdog.link import WatchdogLink  # noqa: E402
from helpers import OwnedProcesses, reap_child, wait_for, wait_gone  # noqa: E402
from watchdog.reaper import sweep  # noqa: E402

HELPER = Path(__file__).resolve().parent / "watchdog_parent.py"
REPORT = "watchdog-report.json"
TITLE = "orchestrator: watchdog"

# A process that installs handlers for the catchable signals the watchdog sends (and a
# few more), writes each one it receives to a file, and says "ready" once armed.
RECORDER = textwrap.dedent(
    """
    import os, signal, sys
    log = sys.argv[1]
    def note(signum, frame):
        with open(log, "a") as f:
            f.write(f"{signum}\\n")
    for sig in (signal.SIGTERM, signal.SIGCONT, signal.SIGINT, signal.SIGHUP,
                signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, note)
    print("ready", flush=True)
    while True:
        signal.pause()
    """
)
SLEEPER = textwrap.dedent(
    """
    import signal, sys
    if "ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        signal.pause()
    """
)


# -- process bookkeeping --------------------------------------------------------------


@pytest.fixture
def procs():
    registry = OwnedProcesses()
    try:
        yield registry
    finally:
        registry.teardown()


def read_line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    """One line of ``proc``'s stdout, waiting at most ``timeout`` (the fd is unbuffered)."""
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError(f"no line from pid {proc.pid} within {timeout}s (got {buf!r})")
        chunk = os.read(fd, 1)  # byte by byte: never consume past the line
        if not chunk:
            raise EOFError(f"pid {proc.pid} closed stdout (got {buf!r}, exit {proc.poll()})")
        buf += chunk
    return buf.decode()


def start_helper(procs: OwnedProcesses, tmp_path: Path, *args: str, token: str | None = None, cwd: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_DAEMON_TOKEN"}
    env["TMPDIR"] = str(tmp_path)  # the Manager's pymp-* directory lands here
    if token:
        env["ORCHESTRATOR_DAEMON_TOKEN"] = token
    stderr = open(tmp_path / "helper.err", "wb")
    try:
        proc = procs.popen(
            [sys.executable, str(HELPER), "--state-dir", str(tmp_path), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=str(cwd or tmp_path),
            start_new_session=True,  # its own group: a Ctrl-C in the test's terminal skips it
        )
    finally:
        stderr.close()
    try:
        info = json.loads(read_line(proc))
    except (TimeoutError, EOFError) as exc:
        raise AssertionError(f"{exc}\nhelper stderr:\n{(tmp_path / 'helper.err').read_text()}") from None
    procs.track(*info["helper"])
    procs.track(*info["watchdog"])
    for pid, start in info["processes"].values():
        procs.track(pid, start)
    return proc, info


def send(proc: subprocess.Popen, command: str) -> dict:
    proc.stdin.write(command.encode() + b"\n")
    proc.stdin.flush()
    return json.loads(read_line(proc))


def kill_helper(proc: subprocess.Popen) -> None:
    proc.kill()  # SIGKILL: the crash the watchdog exists for
    proc.wait(timeout=10)


def wait_report(tmp_path: Path, watchdog_identity, timeout: float = 10.0) -> dict:
    """The watchdog exits after writing its report: wait for its exit, then read it."""
    survivors = wait_gone([tuple(watchdog_identity)], timeout)
    assert not survivors, f"watchdog still running\n{(tmp_path / 'helper.err').read_text()}"
    return json.loads((tmp_path / REPORT).read_text())


def by_pid(report: dict) -> dict[int, dict]:
    return {rec["pid"]: rec for rec in report["processes"]}


def status_field(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == name:
                return value.strip()
    raise KeyError(name)


def watchdog_idle(pid: int) -> bool:
    """Title set and asleep in its poll: start-up and the ledger replay are done."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    st = proc_stat(pid)
    # wchan reads "0" on kernels that hide it: then sleeping with the title set is all we know.
    asleep = st is not None and st.state == "S" and ("poll" in wchan or wchan == "0")
    return cmdline.startswith(TITLE.encode()) and asleep


def start_recorder(procs: OwnedProcesses, tmp_path: Path, name: str, env=None):
    log = tmp_path / f"{name}.signals"
    log.touch()
    proc = procs.popen(
        [sys.executable, "-c", RECORDER, str(log)],
        stdout=subprocess.PIPE,
        start_new_session=True,  # a group of our own making: pgid == pid
        env=env,
    )
    assert read_line(proc) == "ready\n"
    return proc, log


def start_sleeper(procs: OwnedProcesses, *args: str, env=None) -> subprocess.Popen:
    proc = procs.popen([sys.executable, "-c", SLEEPER, *args], stdout=subprocess.PIPE, start_new_session=True, env=env)
    assert read_line(proc) == "ready\n"
    return proc


def run_watchdog(procs: OwnedProcesses, tmp_path: Path, parent_pid: int, parent_start: int, feed_r: int, *extra: str):
    """Start ``python -m watchdog`` directly (the test plays the parent's feed)."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return procs.popen(
        [sys.executable, "-m", "watchdog", "--parent-pid", str(parent_pid), "--parent-start", str(parent_start),
         "--state-dir", str(tmp_path), "--feed-fd", str(feed_r), *extra],
        pass_fds=(feed_r,),
        env=env,
        cwd=str(tmp_path),
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


# -- the package ----------------------------------------------------------------------


def test_package_is_ours_not_the_pypi_library():
    path = Path(watchdog.__file__).resolve()
    assert path.is_relative_to(REPO_ROOT), path
    assert path.parent == REPO_ROOT / "watchdog"
    assert set(watchdog.__all__) >= {"WatchdogLink", "start_time"}


def test_package_does_not_import_orchestrator():
    for source in (REPO_ROOT / "watchdog").glob("*.py"):
        text = source.read_text()
        assert "import orchestrator" not in text and "from orchestrator" not in text, source


# -- identity -------------------------------------------------------------------------


def test_start_time_of_self_matches_proc_and_psutil():
    import psutil

    mine = start_time(os.getpid())
    assert isinstance(mine, int) and mine > 0
    raw = Path("/proc/self/stat").read_bytes()
    assert mine == int(raw.rsplit(b")", 1)[1].split()[19])
    # psutil derives create_time from the same field: boot time + ticks / CLK_TCK.
    expected = psutil.boot_time() + mine / os.sysconf("SC_CLK_TCK")
    assert abs(psutil.Process().create_time() - expected) < 0.05


def test_start_time_of_a_missing_pid_is_none():
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert start_time(pid_max + 1) is None
    assert proc_stat(pid_max + 1) is None
    assert not is_alive(pid_max + 1, 1)
    assert open_verified(pid_max + 1, 1) is None


def test_reaped_child_is_gone_and_zombie_is_not_alive(procs):
    proc = procs.popen([sys.executable, "-c", "pass"])
    start = start_time(proc.pid)
    assert start is not None
    # Exited but not reaped: a zombie still has its identity, but is not alive.
    wait_for(lambda: (st := proc_stat(proc.pid)) is not None and st.state == "Z", 10, "zombie")
    assert start_time(proc.pid) == start
    assert not is_alive(proc.pid, start)
    proc.wait(timeout=10)
    after = start_time(proc.pid)
    assert after is None or after != start  # reaped (or the number already reused)


def test_parse_stat_takes_fields_after_the_last_paren():
    # Fields 3..24 of proc_pid_stat(5): state ppid pgrp session tty tpgid flags minflt
    # cminflt majflt cmajflt utime stime cutime cstime priority nice threads itreal START
    after = b"T 5 6 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0"
    # comm (field 2) may contain ") " and look like other fields: only the LAST ')' counts.
    st = parse_stat(1234, b"1234 (evil) S 1 2 3 (x) " + after + b"\n")
    assert st == (1234, 5, 6, 7, "T", 777)
    assert parse_stat(1, b"") is None
    assert parse_stat(1, b"1 (x) S 1 2") is None  # truncated


def test_start_time_with_a_hostile_comm(procs):
    # A child renames itself (comm) to something with spaces and parentheses.
    code = "import sys; open('/proc/self/comm', 'w').write(') (x y) Z 1'); print('ready', flush=True); sys.stdin.read()"
    proc = procs.popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    (tracked_start,) = [start for pid, start in procs.identities if pid == proc.pid]
    assert read_line(proc) == "ready\n"
    assert Path(f"/proc/{proc.pid}/comm").read_text().startswith(") (x y)")
    st = proc_stat(proc.pid)
    assert st.ppid == os.getpid() and st.pgrp == os.getpgrp() and st.state in "RSD"
    assert st.start_time == tracked_start == start_time(proc.pid)
    assert scan()[proc.pid]._replace(state=st.state) == st  # the state may flicker S/R


def test_open_verified_checks_the_start_time():
    me = os.getpid()
    fd = open_verified(me, start_time(me))
    assert fd is not None
    os.close(fd)
    assert open_verified(me, start_time(me) + 1) is None


def test_scan_sees_this_process():
    table = scan()
    me = table[os.getpid()]
    assert me.ppid == os.getppid() and me.pgrp == os.getpgrp() and me.session == os.getsid(0)


# -- ledger ---------------------------------------------------------------------------


def test_ledger_parses_lines_split_across_feeds():
    stream = (
        encode_add(100, 5000, 100, "worker", "web-1")
        + encode_add(101, 5001, None, "process", "manager  with\nnewline")
        + encode_add(102, 5002, 102, "worker", "ünïcode label")
        + encode_remove(100)
        + b"\n"  # blank lines are tolerated
        + b"A 1 5 - worker init-is-never-a-target\n"
        + b"A 103 notanumber - worker x\n"
        + b"A 104 5 104 daemon unknown-kind\n"
        + b"Z what\n"
        + ENCODE_QUIT
    )
    for chunk_size in (1, 2, 3, 7, len(stream)):
        ledger = Ledger()
        for i in range(0, len(stream), chunk_size):
            ledger.feed(stream[i : i + chunk_size])
            if i + chunk_size < len(stream) - len(ENCODE_QUIT):
                assert not ledger.quit_requested
        assert ledger.entries == {
            101: Entry(101, 5001, None, "process", "manager with newline"),
            102: Entry(102, 5002, 102, "worker", "ünïcode label"),
        }
        assert ledger.errors == 4
        assert ledger.quit_requested


def test_ledger_keeps_an_incomplete_line_until_its_newline():
    ledger = Ledger()
    ledger.feed(b"A 200 9 200 wor")
    assert ledger.entries == {}
    ledger.feed(b"ker\nD 2")
    assert 200 in ledger.entries
    ledger.feed(b"00\n")
    assert ledger.entries == {} and ledger.errors == 0


def test_encode_add_rejects_unknown_kind():
    with pytest.raises(ValueError):
        encode_add(1000, 1, None, "thread")


# -- the link (with a fake interpreter: no real watchdog) -----------------------------


@pytest.mark.timeout(60)
def test_link_never_blocks_buffers_and_replays_the_ledger(tmp_path):
    # The "python" the link spawns is a shell script: first one that never reads its
    # feed (the pipe fills up), then one that copies the feed to a file.
    stuck = tmp_path / "stuck-python"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    copier = tmp_path / "copier-python"
    copier.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/args\n'
        f"readlink /proc/$$/fd/0 > {tmp_path}/stdin\n"
        f"exec cat <&3 > {tmp_path}/feed\n"
    )
    stuck.chmod(0o755)
    copier.chmod(0o755)
    link = WatchdogLink(str(tmp_path), token="tok", grace=0.5, remove_files=["/nonexistent/x"], python=str(stuck))
    children: dict[int, bool] = {}  # our posix_spawn children -> reaped yet?
    try:
        link.add(10, 1, 10, "worker", "before-start")  # no watchdog yet: kept for the replay
        stuck_pid = link.start()
        children[stuck_pid] = False
        n = 10
        while not link.pending():
            n += 1
            t = time.monotonic()
            link.add(n, n, n, "worker", "x" * 40)
            assert time.monotonic() - t < 0.5, "add() blocked"
            assert n < 200_000, "the pipe never filled"
        for pid in range(11, 111):
            link.remove(pid)
        assert link.pending()
        writable = select.poll()
        writable.register(link.fileno(), select.POLLOUT)
        assert writable.poll(0) == []  # full: the caller would wait for EVENT_WRITE

        # The watchdog dies: writes fail with EPIPE, the buffer is dropped, nothing raises.
        os.kill(stuck_pid, signal.SIGKILL)  # our own unreaped child: the pid is safe
        children[stuck_pid] = True
        assert reap_child(stuck_pid, 10) == -signal.SIGKILL
        link.flush()
        assert not link.pending()

        # A new watchdog gets the whole current ledger.
        link.python = str(copier)
        copier_pid = link.start()
        children[copier_pid] = False
        deadline = time.monotonic() + 20
        while link.pending():
            assert time.monotonic() < deadline, "replay never drained"
            poller = select.poll()
            poller.register(link.fileno(), select.POLLOUT)
            poller.poll(1000)
            link.flush()
        link.stop()
        children[copier_pid] = True
        assert reap_child(copier_pid, 20) == 0
    finally:
        for pid, reaped in children.items():
            if not reaped:  # our child, not reaped yet: the pid cannot have been reused
                os.kill(pid, signal.SIGKILL)
                reap_child(pid, 10)

    ledger = Ledger()
    ledger.feed((tmp_path / "feed").read_bytes())
    assert ledger.quit_requested and ledger.errors == 0
    assert set(ledger.entries) == {10} | set(range(111, n + 1))
    assert ledger.entries[10].label == "before-start"
    args = (tmp_path / "args").read_text().split()
    me = os.getpid()
    assert args[:2] == ["-m", "watchdog"]
    assert args[args.index("--parent-pid") + 1] == str(me)
    assert args[args.index("--parent-start") + 1] == str(start_time(me))
    assert args[args.index("--feed-fd") + 1] == "3"
    assert args[args.index("--token") + 1] == "tok"
    assert args[args.index("--remove") + 1] == "/nonexistent/x"
    assert (tmp_path / "stdin").read_text().strip() == "/dev/null"


# -- the reaper, run in-process on processes this test owns ---------------------------


@pytest.mark.timeout(60)
def test_sweep_terms_kills_and_reports(procs):
    polite = start_sleeper(procs)
    stubborn = start_sleeper(procs, "ignore-term")
    stopped = start_sleeper(procs)
    stopped.send_signal(signal.SIGSTOP)  # our own unreaped child
    wait_for(lambda: proc_stat(stopped.pid).state == "T", 10, "stopped")
    spared = start_sleeper(procs)
    gone = procs.popen([sys.executable, "-c", "pass"])
    gone_start = start_time(gone.pid)
    gone.wait(timeout=10)

    def entry(proc, label, start=None):
        return Entry(proc.pid, start or start_time(proc.pid), proc.pid, "worker", label)

    entries = [
        entry(polite, "polite"),
        entry(stubborn, "stubborn"),
        entry(stopped, "stopped"),
        entry(spared, "spared"),
        Entry(gone.pid, gone_start, gone.pid, "worker", "gone"),
    ]
    report = sweep(entries, None, exclude={spared.pid}, grace=0.2)
    recs = by_pid(report)
    assert (recs[polite.pid]["action"], recs[polite.pid]["outcome"]) == ("term", "exited")
    assert (recs[stubborn.pid]["action"], recs[stubborn.pid]["outcome"]) == ("kill", "killed")
    assert recs[stopped.pid]["state"] == "stopped" and recs[stopped.pid]["outcome"] == "exited"
    assert recs[spared.pid]["outcome"] == "excluded"
    assert recs[gone.pid]["outcome"] in ("gone", "pid-reused")
    assert polite.wait(10) == -signal.SIGTERM
    assert stubborn.wait(10) == -signal.SIGKILL
    assert stopped.wait(10) == -signal.SIGTERM
    assert spared.poll() is None and is_alive(spared.pid, start_time(spared.pid))
    assert report["duration_s"] < 5


# -- the watchdog process, end to end -------------------------------------------------


@pytest.mark.timeout(90)
def test_parent_sigkill_kills_every_worker_and_reports(procs, tmp_path):
    token = uuid.uuid4().hex
    proc, info = start_helper(procs, tmp_path, "--workers", "4", "--tree", "--manager", token=token)
    processes = info["processes"]
    assert {"worker0", "worker1", "worker2", "worker3", "grandchild", "escaped", "orphan", "manager"} <= set(processes)
    assert Path(info["manager_dir"]).is_dir()
    targets = {tuple(v) for v in processes.values()}
    wait_for(lambda: watchdog_idle(info["watchdog"][0]), 10, "watchdog idle")

    kill_helper(proc)
    survivors = wait_gone(targets, 1.0)
    assert not survivors, f"still running 1 s after the parent died: {survivors}"

    report = wait_report(tmp_path, info["watchdog"])
    assert report["reason"] == "parent-exited"
    assert report["detected_by"] == "pidfd"  # forked workers hold the feed's write end open
    assert report["parent"] == {"pid": info["helper"][0], "start": info["helper"][1]}
    recs = by_pid(report)
    for role, (pid, start) in processes.items():
        assert pid in recs, f"{role} missing from the report"
        assert recs[pid]["start"] == start
    assert recs[processes["worker0"][0]]["found"] == "ledger"
    assert recs[processes["manager"][0]]["kind"] == "process"
    assert recs[processes["grandchild"][0]]["found"] in ("pgid", "token")
    assert recs[processes["orphan"][0]]["found"] == "token"  # no ppid or pgid link left
    assert recs[processes["escaped"][0]]["state"] == "stopped"
    assert all(rec["outcome"] in ("exited", "killed", "gone") for rec in report["processes"])
    assert not Path(info["manager_dir"]).exists()  # the Manager's socket dir was removed
    assert report["removed"] == [{"path": info["manager_dir"], "status": "removed"}]
    assert report["ledger_errors"] == 0
    assert info["watchdog"][0] not in recs and info["helper"][0] not in recs


@pytest.mark.timeout(60)
def test_clean_stop_exits_quietly_and_leaves_workers(procs, tmp_path):
    proc, info = start_helper(procs, tmp_path, "--workers", "3", "--tree")
    answer = send(proc, "stop")
    assert answer == {"watchdog_exit": 0}
    assert not (tmp_path / REPORT).exists()
    for role, (pid, start) in info["processes"].items():
        assert is_alive(pid, start), f"{role} was touched by a clean stop"
    for pid in info["stopped"]:
        assert proc_stat(pid).state == "T"


@pytest.mark.timeout(60)
def test_entry_with_wrong_start_time_is_never_signalled(procs, tmp_path):
    decoy, log = start_recorder(procs, tmp_path, "decoy")
    decoy_start = start_time(decoy.pid)
    proc, info = start_helper(procs, tmp_path, "--workers", "2", "--decoy", f"{decoy.pid}:{decoy_start + 1}")
    kill_helper(proc)
    report = wait_report(tmp_path, info["watchdog"])
    assert not wait_gone({tuple(v) for v in info["processes"].values()}, 1.0)
    assert by_pid(report)[decoy.pid]["outcome"] == "pid-reused"
    assert decoy.poll() is None and is_alive(decoy.pid, decoy_start)
    assert proc_stat(decoy.pid).state != "T"
    assert log.read_text() == "", "the decoy received a signal"


@pytest.mark.timeout(60)
def test_parent_already_dead_at_start_sweeps_at_once(procs, tmp_path):
    parent = procs.popen([sys.executable, "-c", "pass"])
    parent_start = start_time(parent.pid)
    parent.wait(timeout=10)  # reaped: (pid, start) is now nobody
    victim = start_sleeper(procs)
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, encode_add(victim.pid, start_time(victim.pid), victim.pid, "worker", "victim"))
        wd = run_watchdog(procs, tmp_path, parent.pid, parent_start, read_fd)
    finally:
        os.close(read_fd)
    try:
        assert wd.wait(timeout=20) == 0
    finally:
        os.close(write_fd)
    assert victim.wait(timeout=10) == -signal.SIGTERM
    report = json.loads((tmp_path / REPORT).read_text())
    assert report["reason"] == "parent-gone-at-start"
    assert report["detected_by"] == "identity"
    assert by_pid(report)[victim.pid]["outcome"] == "exited"


@pytest.mark.timeout(60)
def test_feed_eof_is_only_a_hint_then_parent_death_sweeps(procs, tmp_path):
    token = uuid.uuid4().hex
    parent = start_sleeper(procs)
    worker = start_sleeper(procs)
    tagged = start_sleeper(procs, env=dict(os.environ, ORCHESTRATOR_DAEMON_TOKEN=token))
    other, other_log = start_recorder(procs, tmp_path, "other", env=dict(os.environ, ORCHESTRATOR_DAEMON_TOKEN="x"))
    stale_file = tmp_path / "stale.sock"
    stale_file.touch()
    stale_dir = tmp_path / "pymp-stale"
    (stale_dir / "sub").mkdir(parents=True)
    read_fd, write_fd = os.pipe()
    try:
        wd = run_watchdog(
            procs, tmp_path, parent.pid, start_time(parent.pid), read_fd,
            "--token", token, "--grace", "0.5",
            "--remove", str(stale_file), "--remove", str(stale_dir), "--remove", str(tmp_path / "missing"),
        )  # fmt: skip
    finally:
        os.close(read_fd)
    os.write(write_fd, encode_add(worker.pid, start_time(worker.pid), worker.pid, "worker", "w"))
    os.close(write_fd)  # EOF without Q while the parent lives: keep watching
    # At EOF the watchdog closes its end of the feed (pass_fds kept the same fd number).
    wait_for(lambda: not os.path.exists(f"/proc/{wd.pid}/fd/{read_fd}"), 10, "watchdog saw EOF")
    wait_for(lambda: watchdog_idle(wd.pid), 10, "watchdog idle after EOF")
    assert wd.poll() is None and worker.poll() is None and not (tmp_path / REPORT).exists()

    parent.kill()
    assert wd.wait(timeout=20) == 0
    assert worker.wait(timeout=10) == -signal.SIGTERM
    assert tagged.wait(timeout=10) == -signal.SIGTERM
    assert other.poll() is None and other_log.read_text() == ""
    report = json.loads((tmp_path / REPORT).read_text())
    assert report["detected_by"] == "pidfd"
    recs = by_pid(report)
    assert recs[worker.pid]["found"] == "ledger" and recs[tagged.pid]["found"] == "token"
    assert other.pid not in recs and parent.pid not in recs
    assert not stale_file.exists() and not stale_dir.exists()
    assert [r["status"] for r in report["removed"]] == ["removed", "removed", "missing"]


@pytest.mark.timeout(60)
def test_idle_watchdog_never_wakes_up(procs, tmp_path):
    # The parent runs in a directory holding another `watchdog` package: `-m watchdog`
    # must still run ours (PYTHONSAFEPATH keeps the cwd off sys.path).
    shadow = tmp_path / "shadow" / "watchdog"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "__main__.py").write_text(f"open({str(tmp_path / 'shadowed')!r}, 'w').close()\n")
    proc, info = start_helper(procs, tmp_path, "--workers", "2", cwd=shadow.parent)
    wd, wd_start = info["watchdog"]
    wait_for(lambda: watchdog_idle(wd), 10, "watchdog idle")
    assert not (tmp_path / "shadowed").exists()

    # How it was spawned: own group, stdin/stdout on /dev/null, SIGINT/SIGHUP ignored,
    # nothing blocked, feed on fd 3.
    st = proc_stat(wd)
    assert st.pgrp == wd and st.ppid == info["helper"][0]
    assert os.readlink(f"/proc/{wd}/fd/0") == "/dev/null" == os.readlink(f"/proc/{wd}/fd/1")
    assert os.readlink(f"/proc/{wd}/fd/3").startswith("pipe:")
    assert int(status_field(wd, "SigBlk"), 16) == 0
    ignored = int(status_field(wd, "SigIgn"), 16)
    assert ignored & (1 << (signal.SIGINT - 1)) and ignored & (1 << (signal.SIGHUP - 1))
    assert not ignored & (1 << (signal.SIGTERM - 1))
    assert "psutil" not in Path(f"/proc/{wd}/maps").read_text()  # start-up stays cheap

    before = int(status_field(wd, "voluntary_ctxt_switches"))
    fd = open_verified(wd, wd_start)
    try:
        assert select.select([fd], [], [], 1.0)[0] == []  # one second, and it must not exit
    finally:
        os.close(fd)
    after = int(status_field(wd, "voluntary_ctxt_switches"))
    assert after - before <= 1, f"{after - before} wake-ups in one idle second"


@pytest.mark.timeout(60)
def test_restarted_watchdog_knows_the_whole_ledger(procs, tmp_path):
    proc, info = start_helper(procs, tmp_path, "--workers", "3")
    answer = send(proc, "restart")
    assert answer["old_exit"] == -signal.SIGKILL
    new_watchdog = answer["watchdog"]
    procs.track(*new_watchdog)
    assert new_watchdog[0] != info["watchdog"][0]
    wait_for(lambda: watchdog_idle(new_watchdog[0]), 10, "new watchdog idle")

    kill_helper(proc)
    assert not wait_gone({tuple(v) for v in info["processes"].values()}, 1.0)
    report = wait_report(tmp_path, new_watchdog)
    assert report["watchdog_pid"] == new_watchdog[0]
    assert report["ledger_entries"] == 3
