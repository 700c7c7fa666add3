"""The command channel under real resource limits and hostile traffic, through the CLI:

* a process limit (a pids cgroup's ``pids.max``, what systemd's ``TasksMax=`` sets): the
  manager server serves on the threads it started ahead, and refuses with the reason a
  connection for which none is free;
* an fd limit (RLIMIT_NOFILE, set on the running process as ``prlimit`` does) on the manager
  server, and on the daemon when the manager has to be restarted;
* a command over the frame limit;
* a closed stdout, or a pipe whose reader has gone.

Each limit is lifted again and the same daemon must take commands without a restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from helpers import DaemonUnderTest, cli, cli_env, manager_proxies, one_line_error, wait_for
from orchestrator import Client, FrameTooLarge
from orchestrator.protocol import command

pytestmark = pytest.mark.timeout(180)


def _launch(daemon: DaemonUnderTest, *extra: str) -> subprocess.CompletedProcess:
    return cli(daemon.state_dir, "launch", "--pool", "web", *extra, "--", "sleep", "1000")


def _daemon_log(daemon: DaemonUnderTest) -> str:
    return (daemon.state_dir / "logs" / "daemon.log").read_text(errors="replace")


# -- a pids cgroup of the test's own ------------------------------------------------------


def _pids_mount() -> tuple[Path, int] | None:
    """A cgroup mount with the pids controller: (mount point, 2) for cgroup v2 where pids is
    available, else (mount point, 1) for a v1 pids hierarchy; None if there is neither."""
    found: dict[int, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = (right.split() + ["", "", ""])[:3]
            mount = Path(left.split()[4])
            if fstype == "cgroup2":
                try:
                    if "pids" in (mount / "cgroup.controllers").read_text().split():
                        found.setdefault(2, mount)
                except OSError:
                    continue
            elif fstype == "cgroup" and "pids" in options.split(","):
                found.setdefault(1, mount)
    for version in (2, 1):
        if version in found:
            return found[version], version
    return None


class PidsCgroup:
    """A pids cgroup made for one test: processes moved in are moved back to where they
    were at the end, and the cgroup is removed."""

    def __init__(self, mount: Path, version: int) -> None:
        self.mount, self.version = mount, version
        self.path = mount / f"orchestrator-test-{uuid.uuid4().hex[:12]}"
        self.origins: dict[int, Path] = {}
        if version == 2:
            (mount / "cgroup.subtree_control").write_text("+pids")
        self.path.mkdir()

    def _origin(self, pid: int) -> Path:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, rel = line.rstrip("\n").split(":", 2)
                if (self.version == 2 and controllers == "") or (
                        self.version == 1 and "pids" in controllers.split(",")):
                    return self.mount / rel.lstrip("/")
        return self.mount

    def move(self, pid: int) -> None:
        self.origins[pid] = self._origin(pid)
        (self.path / "cgroup.procs").write_text(str(pid))

    def current(self) -> int:
        return int((self.path / "pids.current").read_text())

    def limit(self, value: int | str) -> None:
        (self.path / "pids.max").write_text(str(value))

    def read_limit(self) -> int:
        text = (self.path / "pids.max").read_text().strip()
        return 1 << 62 if text == "max" else int(text)

    def destroy(self) -> None:
        self.limit("max")
        for line in (self.path / "cgroup.procs").read_text().split():
            pid = int(line)
            try:
                (self.origins.get(pid, self.mount) / "cgroup.procs").write_text(str(pid))
            except OSError:  # gone meanwhile, or its old cgroup is: the mount's root takes it
                try:
                    (self.mount / "cgroup.procs").write_text(str(pid))
                except (ProcessLookupError, FileNotFoundError):
                    pass
        wait_for(lambda: not (self.path / "cgroup.procs").read_text().strip(), 10, "the test cgroup to empty")
        self.path.rmdir()


@pytest.fixture
def pids_cgroup() -> Iterator[PidsCgroup]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a pids cgroup")
    found = _pids_mount()
    if found is None:
        pytest.skip("no cgroup mount with the pids controller")
    mount, version = found
    if not os.access(mount, os.W_OK):
        pytest.skip(f"the pids cgroup mount {mount} is not writable")
    try:
        group = PidsCgroup(mount, version)
    except OSError as err:
        pytest.skip(f"cannot make a pids cgroup under {mount}: {err}")
    try:
        yield group
    finally:
        group.destroy()


# -- 6. resource exhaustion of the command channel -------------------------------------------


def test_a_manager_at_its_thread_limit_serves_on_the_threads_it_has_and_refuses_beyond_them(
        daemon: DaemonUnderTest, pids_cgroup: PidsCgroup) -> None:
    from orchestrator.channelwire import open_connection, read_authkey, socket_address
    from orchestrator.paths import Paths

    pid = daemon.start()
    manager = daemon.status()["daemon"]["manager_pid"]
    pids_cgroup.move(manager)
    pids_cgroup.limit(pids_cgroup.current())  # not one thread more: TasksMax reached
    for _ in range(3):  # its connection threads were started ahead, and are reused
        assert _launch(daemon).returncode == 0
    address, _ = socket_address(daemon.state_dir)
    key = read_authkey(Paths(daemon.state_dir))
    held, refusal = [], ""
    try:
        for _ in range(64):  # connections that keep their thread, until none is left
            conn = open_connection(address, key, 10.0)
            try:
                conn.dispatch(None, "accept_connection", ("held",))
            except OSError as err:
                conn.close()
                refusal = str(err)
                break
            held.append(conn)
        assert held and "thread" in refusal, (len(held), refusal)
        for _ in range(2):  # one refused connection does not cost the next one its answer
            line = one_line_error(_launch(daemon))
            assert "thread" in line, line
        assert "cannot start a thread" in _daemon_log(daemon)
    finally:
        for conn in held:
            conn.close()
    wait_for(lambda: _launch(daemon).returncode == 0, 30, "a thread to be free again")  # still at the limit
    pids_cgroup.limit("max")
    assert _launch(daemon).returncode == 0  # the same manager, serving again
    status = daemon.status()
    assert status["daemon"]["pid"] == pid and status["daemon"]["manager_pid"] == manager
    assert [r["id"] for r in status["replicas"]] == [f"web-{n}" for n in range(1, 6)]


def test_a_manager_at_its_fd_limit_refuses_with_a_reason_and_serves_again(daemon: DaemonUnderTest) -> None:
    daemon.start()
    manager = psutil.Process(daemon.status()["daemon"]["manager_pid"])
    fds = Path(f"/proc/{manager.pid}/fd")

    def sockets() -> int:
        return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))

    wait_for(lambda: sockets() == 1, 10, "the status command's connections to close")  # the listener only
    soft, hard = manager.rlimit(psutil.RLIMIT_NOFILE)
    try:
        taken = {int(fd.name) for fd in fds.iterdir()}
        lowest_free = min(set(range(len(taken) + 1)) - taken)
        manager.rlimit(psutil.RLIMIT_NOFILE, (lowest_free, hard))  # no fd for a connection
        for _ in range(3):
            line = one_line_error(_launch(daemon))
            assert "Too many open files" in line, line
    finally:
        manager.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    assert _launch(daemon).returncode == 0
    assert daemon.status()["daemon"]["manager_pid"] == manager.pid


def test_a_manager_that_cannot_be_restarted_at_the_fd_limit_comes_back_and_leaks_nothing(
        daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    proc = psutil.Process(pid)
    manager = daemon.status()["daemon"]["manager_pid"]
    before = proc.num_fds()
    soft, hard = proc.rlimit(psutil.RLIMIT_NOFILE)
    try:
        # Not one fd, not even those the daemon keeps for its control plane (the lowest
        # numbers after stdio: a limit at its count would leave them, tests/test_resources.py).
        proc.rlimit(psutil.RLIMIT_NOFILE, (3, hard))
        os.kill(manager, signal.SIGKILL)
        wait_for(lambda: _daemon_log(daemon).count("cannot start the manager server (Too many open files)") >= 2,
                 60, "two failed restarts")
        health = cli(daemon.state_dir, "health", "--json")
        assert health.returncode == 1, health.stderr
        info = json.loads(health.stdout)
        assert info["failed"] == ["manager"] and info["parts"]["manager"] is False, info
        assert "Too many open files" in info["reason"], info
        plain = one_line_error(cli(daemon.state_dir, "launch", "--pool", "web", "--", "true"))
        assert "manager server is down" in plain and "Too many open files" in plain, plain
    finally:
        proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    wait_for(lambda: cli(daemon.state_dir, "health").returncode == 0, 60, "the manager to come back")
    # Every failed attempt closed what it had opened: the same fds as before, one manager's worth.
    wait_for(lambda: proc.num_fds() == before, 10, f"the daemon back at {before} fds, not {proc.num_fds()}")
    assert _launch(daemon).returncode == 0
    status = daemon.status()
    assert status["daemon"]["pid"] == pid and status["daemon"]["manager_pid"] != manager
    journal = [json.loads(line) for line in cli(daemon.state_dir, "events", "--json").stdout.splitlines()]
    events = [e["data"] for e in journal if e["kind"] == "manager"]
    assert events[0]["up"] is True and events[-1]["up"] is True, events  # the journal says it was down and why
    assert any(not e["up"] and "Too many open files" in e["reason"] for e in events), events


# -- 7. oversized or malformed traffic ---------------------------------------------------------


BIG = 70 << 20  # over the 64 MiB frame limit


def test_a_command_over_the_frame_limit_is_answered_at_once(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    pid = daemon.start()
    with Client(daemon.state_dir, timeout=60) as client:
        with pytest.raises(FrameTooLarge, match="too large"):  # refused before it is sent (an InvalidSpec)
            client.launch("web", ["sleep", "1000"], env={"BIG": "x" * BIG})
        # A client that sends it anyway gets an error reply, not silence until its time-out.
        _, replies = manager_proxies(daemon.state_dir)
        reply = replies.call(command("launch", {"pool": "web", "spec": {
            "command": ["sleep", "1000"], "env": {"BIG": "x" * BIG}}}, "too-big"), 60)
        assert reply is not None and reply["ok"] is False and "too large" in reply["error"], reply
        assert reply["code"] == FrameTooLarge.code, reply  # a client raises it as a FrameTooLarge
        assert client.ping() == "pong"
    env_file = tmp_path / "big.env"
    env_file.write_text("BIG=" + "x" * BIG + "\n")
    one_line_error(_launch(daemon, "--env-file", str(env_file)))
    assert _launch(daemon).returncode == 0
    assert daemon.status()["daemon"]["pid"] == pid


def _shell(daemon: DaemonUnderTest, line: str, timeout: float = 60) -> subprocess.CompletedProcess:
    orch = f"{sys.executable} -m orchestrator --state-dir {daemon.state_dir}"
    return subprocess.run(line.replace("ORCH", orch), shell=True, executable="/bin/bash", capture_output=True,
                          text=True,
                          env=cli_env(), timeout=timeout, stdin=subprocess.DEVNULL)


def _quiet(proc: subprocess.CompletedProcess, codes: tuple[int, ...]) -> None:
    assert proc.returncode in codes, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 1, proc.stderr


@pytest.mark.parametrize("args", ["status --watch --interval 0.1", "metrics", "logs web-1", "status", "events",
                                  "health", "launch --pool other -- sleep 1000"])
def test_a_closed_stdout_ends_with_one_line_and_no_traceback(daemon: DaemonUnderTest, args: str) -> None:
    daemon.start()
    assert cli(daemon.state_dir, "launch", "--pool", "web", "--", "sh", "-c", "echo hello; exec sleep 1000"
               ).returncode == 0
    wait_for(lambda: (daemon.state_dir / "logs" / "web-1.out").exists(), 30, "web-1's log")
    proc = _shell(daemon, f"ORCH {args} >&-")
    _quiet(proc, (1,))
    assert "standard output" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", ["status --watch --interval 0.1", "metrics", "logs --follow web-1",
                                  "logs --follow --pool web", "events --follow", "status"])
def test_a_pipe_whose_reader_exits_ends_quietly(daemon: DaemonUnderTest, args: str) -> None:
    daemon.start()
    assert cli(daemon.state_dir, "launch", "--pool", "web", "--", "sh", "-c", "echo hello; exec sleep 1000"
               ).returncode == 0
    wait_for(lambda: (daemon.state_dir / "logs" / "web-1.out").exists(), 30, "web-1's log")
    # PIPESTATUS: the orchestrator's own exit, not head's; a follow that never ends fails the bound.
    proc = _shell(daemon, f'ORCH {args} | head -1; exit "${{PIPESTATUS[0]}}"', 60)
    _quiet(proc, (0,))
    assert proc.stderr == "", proc.stderr
