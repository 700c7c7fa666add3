"""Hardening, fourth round (trust): no interpreter the project starts imports from a directory
it did not choose, and the daemon does not keep its caller's; an upgrade whose helpers
cannot start is refused; and three small ones: task ids with Unicode digits, the HTTP
endpoint's header bound, the chmod of a unix listening socket.

The tests about another user need root and ``nobody`` (they skip, saying why, without);
every process a test starts is ended by the pid it got, and waited for, bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from conftest import TAG_VAR
from helpers import (
    ROOT, TESTS, DaemonUnderTest, cli, cli_env, no_leftovers, one_line_error, start_with_shadow, wait_for,
)
from orchestrator import Client, Executor, OrchestratorError
from test_security import NOBODY

pytestmark = pytest.mark.timeout(180)


needs_nobody = pytest.mark.skipif(
    os.geteuid() != 0 or NOBODY is None,
    reason="needs root and a 'nobody' user: a directory another user controls",
)


# -- 1. code from the caller's directory never runs as the daemon ----------------------

# What a hostile directory would hold: our packages and the ones our programs import.
PLANTED = ("orchestrator", "watchdog", "multiprocess", "setproctitle", "dill", "psutil", "h11")


def _hostile_dir(tmp_path: Path) -> Path:
    """A directory of nobody's (0755, as theirs would be) whose every package writes a
    marker naming itself and the pid that imported it."""
    assert NOBODY is not None
    where = tmp_path / "theirs"
    where.mkdir()
    for name in PLANTED:
        (where / name).mkdir()
        (where / name / "__init__.py").write_text(
            f"import os\nopen(os.path.join({str(where)!r}, 'MARK-{name}-%d' % os.getpid()), 'w').close()\n")
    for path in (where, *where.rglob("*")):
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid, follow_symlinks=False)
    os.chmod(where, 0o755)
    return where


def _markers(where: Path) -> list[str]:
    return sorted(p.name for p in where.glob("MARK-*"))


def _cli_in(where: Path, state_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI as its console script runs it (``-P``: the script's own directory, not the
    cwd, leads its path), typed in ``where``."""
    return subprocess.run([sys.executable, "-P", "-m", "orchestrator", "--state-dir", str(state_dir), *args],
                          capture_output=True, text=True, timeout=timeout, env=cli_env(), cwd=where,
                          stdin=subprocess.DEVNULL)


def _host(tmp_path: Path, where: Path, code: str, tag: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """A Python program of root's (``tmp_path/host.py``: its own directory leads its path)
    run in ``where``."""
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          env=cli_env({TAG_VAR: tag}), cwd=where, stdin=subprocess.DEVNULL)


def _cwd(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/cwd")


@needs_nobody
def test_start_in_another_users_directory_imports_nothing_from_it(tmp_path: Path, orch_test_tag: str) -> None:
    """Root types ``orchestrator start`` in nobody's directory holding an ``orchestrator/``,
    ``watchdog/``, ``multiprocess/``...: the daemon, its manager, watchdog and spawners, an
    executor pool's workers (their pool's cwd is that directory, recorded by the client)
    and an upgrade's check and exec import none of them, and none of those processes keeps
    that directory as its cwd."""
    theirs = _hostile_dir(tmp_path)
    d = tmp_path / "state"
    with no_leftovers(DaemonUnderTest(d)) as daemon:
        got = _cli_in(theirs, d, "start")
        assert got.returncode == 0, got.stderr + (d / "logs" / "daemon.log").read_text()
        daemon.pid = pid = int(got.stdout)
        assert _markers(theirs) == []
        # An executor pool whose cwd is that directory (Executor's default: the client's),
        # and a task in it.
        got = _host(tmp_path, theirs, f"""
            import os
            from orchestrator import Executor
            with Executor(1, state_dir={str(d)!r}, pool="jobs") as ex:
                print(ex.submit(os.getpid).result(timeout=60))
        """, orch_test_tag)
        assert got.returncode == 0, got.stderr
        got = _cli_in(theirs, d, "upgrade")
        assert got.returncode == 0 and "upgraded" in got.stdout, got.stderr
        data = daemon.status()
        assert data["daemon"]["pid"] == pid
        helpers = [c.pid for c in psutil.Process(pid).children()]
        assert data["daemon"]["manager_pid"] in helpers and data["daemon"]["watchdog_pid"] in helpers
        daemon.snapshot()
        # The daemon and every helper it started run in /, never in the caller's directory.
        assert _cwd(pid) == "/"
        seen: set[str] = set()
        for child in psutil.Process(pid).children():
            try:  # (an upgrade's check process may be a zombie not reaped yet)
                title, cwd = " ".join(child.cmdline()), _cwd(child.pid)
            except (psutil.Error, OSError):
                continue
            if "orchestrator: replica" not in title:  # a replica runs where its pool says
                assert cwd == "/", (child.pid, title)
                seen.add(title.split(" [")[0].strip())
        assert seen >= {"orchestrator: manager", "orchestrator: watchdog", "orchestrator: spawner"}, seen
        # A killed manager is started again the same way.
        old = data["daemon"]["manager_pid"]
        os.kill(old, signal.SIGKILL)

        def manager() -> int | None:
            got = cli(d, "status", "--json")  # refused while the manager is down
            return json.loads(got.stdout)["daemon"]["manager_pid"] if got.returncode == 0 else None

        wait_for(lambda: manager() not in (None, old), 30, "the manager to be restarted")
        assert _cwd(manager() or 0) == "/"
        assert _markers(theirs) == []
        log = (d / "logs" / "daemon.log").read_text()
        assert "Traceback" not in log, log
    assert _markers(theirs) == []


@needs_nobody
def test_an_embedded_executor_in_another_users_directory_imports_nothing_from_it(
        tmp_path: Path, orch_test_tag: str, procs: Any) -> None:
    """Root's program, run in nobody's directory, uses an embedded Executor: its watchdog
    and spawners start there (the program's cwd) but import nothing from it."""
    theirs = _hostile_dir(tmp_path)
    got = _host(tmp_path, theirs, """
        import os
        from orchestrator import Executor
        with Executor(2) as ex:
            print(sorted(ex.map(abs, [-1, -2, -3])), ex.submit(os.getpid).result(timeout=60) != os.getpid())
    """, orch_test_tag)
    assert (got.returncode, got.stdout) == (0, "[1, 2, 3] True\n"), got.stderr
    assert _markers(theirs) == []


def test_a_relative_pythonpath_is_made_absolute_and_an_empty_entry_dropped(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What the daemon's helpers get: PYTHONPATH as it meant where ``start`` was typed; an
    empty entry (the current directory, wherever that is) gone."""
    from orchestrator.interpreter import absolute_pythonpath, program_env

    assert absolute_pythonpath(f"src{os.pathsep}{os.pathsep}/abs/x{os.pathsep}../y{os.pathsep}", "/here/a") == \
        os.pathsep.join(["/here/a/src", "/abs/x", "/here/y"])
    monkeypatch.chdir(tmp_path)
    assert program_env({"PYTHONPATH": f"{os.pathsep}lib", "A": "b"}) == {"PYTHONPATH": str(tmp_path / "lib"), "A": "b"}
    assert program_env({"PYTHONPATH": os.pathsep, "A": "b"}) == {"A": "b"}
    assert program_env({"A": "b"}) == {"A": "b"}


def test_a_daemon_started_with_a_relative_state_dir_config_and_pythonpath(tmp_path: Path) -> None:
    """The daemon leaves its caller's directory, and what it was given relative to it still
    means what it meant there: the state dir, the config file, PYTHONPATH (through which a
    pool's --target is found), also for a bare ``start --foreground``."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "relmod.py").write_text("import time\n\ndef main():\n    time.sleep(1000)\n")
    (tmp_path / "pools.toml").write_text('[pools.rel]\ntarget = "relmod:main"\nsize = 1\n')
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(["lib", env["PYTHONPATH"]])
    out = tmp_path / "foreground.log"
    with no_leftovers(DaemonUnderTest(tmp_path / "state")) as daemon, open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--state-dir", "state", "start", "--foreground",
                                 "--config", "pools.toml"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)
        try:
            wait_for(lambda: cli(daemon.state_dir, "health").returncode == 0 or proc.poll() is not None, 30,
                     "the daemon to answer")
            assert proc.poll() is None, out.read_text()
            daemon.pid = proc.pid
            assert _cwd(proc.pid) == "/"
            wait_for(lambda: [r["state"] for r in daemon.status()["replicas"]] == ["RUNNING"], 30,
                     "the config's pool to run its target")
            daemon.snapshot()
            assert cli(daemon.state_dir, "reload").returncode == 0  # the config is found again from /
        finally:
            cli(daemon.state_dir, "stop")
            try:
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)


# -- 5. an upgrade checks every program the daemon starts ------------------------------


@pytest.mark.parametrize("broken", ["orchestrator/manager/server.py", "watchdog/__main__.py",
                                    "orchestrator/taskworker.py", "orchestrator/spawn/spawner.py"])
def test_an_install_whose_helper_does_not_import_is_refused(daemon: DaemonUnderTest, tmp_path: Path,
                                                            broken: str) -> None:
    """The install the daemon would exec now has a manager server, watchdog, task worker or
    spawner that does not import: ``upgrade`` says so in one line, exit 1, and the daemon
    goes on as it was (same pid, not upgraded, its replicas and helpers untouched)."""
    sd = daemon.state_dir
    shadow = tmp_path / "shadow"
    pid = start_with_shadow(daemon, shadow)
    cli(sd, "launch", "--pool", "a", "--count", "2", "--wait", "--", "sleep", "1000", check=True)
    before = daemon.status()
    kept = {r["id"]: r["pid"] for r in before["replicas"]}
    for package in ("orchestrator", "watchdog"):
        shutil.copytree(ROOT / package, shadow / package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(shadow / broken, "a") as f:
        f.write("\nraise ImportError('simulated broken helper')\n")

    line = one_line_error(cli(sd, "upgrade"))
    # which one: by module (the check's own word) or, for one the daemon imports itself, by file
    module = broken.removesuffix(".py").replace("/", ".")
    assert "refused" in line and (module in line or str(shadow / broken) in line), line
    assert "simulated broken helper" in line, line
    data = daemon.status()
    assert data["daemon"]["pid"] == pid and data["daemon"]["upgraded_at"] is None
    assert {r["id"]: r["pid"] for r in data["replicas"]} == kept
    for helper in ("manager_pid", "watchdog_pid"):
        assert data["daemon"][helper] == before["daemon"][helper]
    assert cli(sd, "health").returncode == 0
    shutil.rmtree(shadow)  # the install mended: now it goes through
    got = cli(sd, "upgrade")
    assert got.returncode == 0 and "upgraded" in got.stdout, got.stderr
    assert {r["id"]: r["pid"] for r in daemon.status()["replicas"]} == kept


# -- 9. small ones -----------------------------------------------------------------------


@pytest.fixture
def jobs(daemon: DaemonUnderTest, orch_test_tag: str) -> Iterator[Executor]:
    daemon.start()
    with Client(daemon.state_dir) as client:
        ex = client.executor("jobs", max_workers=1, cwd=str(TESTS), env={TAG_VAR: orch_test_tag})
    try:
        wait_for(lambda: any(r["pool"] == "jobs" and r["state"] == "RUNNING" for r in daemon.status()["replicas"]),
                 30, "the pool's worker to run")
        yield ex
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


UNICODE_IDS = ("jobs/\u00b2", "jobs/\uff11", "jobs/\u0661", "jobs/01", "jobs/+1", "jobs/ 1", "jobs/1\n")


def test_task_ids_with_unicode_digits_are_unknown_in_one_line(daemon: DaemonUnderTest, jobs: Executor) -> None:
    """``jobs/²`` passes str.isdigit() and broke int(); ``jobs/１`` was read as ``jobs/1``
    (a wrong "had ended already"). Each is an unknown task, in one line, for result,
    cancel and tasks, from the CLI and from a client, with no traceback in the log."""
    assert jobs.submit(abs, -1).result(timeout=30) == 1  # jobs/1 exists and has ended
    sd = daemon.state_dir
    for bad in UNICODE_IDS:
        for command in (["result", bad], ["result", bad, "--wait", "--timeout", "1"], ["cancel", bad],
                        ["cancel", "jobs/1", bad]):
            line = one_line_error(cli(sd, *command))
            assert "unknown task" in line, (command, line)
        assert "unknown" in one_line_error(cli(sd, "tasks", "--pool", bad))
    with Client(sd) as client:
        for bad in UNICODE_IDS:
            for op, args in (("task_result", {"id": bad}), ("task_result", {"id": bad, "wait": True, "timeout": 1}),
                             ("task_cancel", {"ids": [bad]}), ("task_cancel", {"ids": ["jobs/1", bad]})):
                with pytest.raises(OrchestratorError, match="unknown task") as err:
                    client.call(op, args)
                assert "\n" not in str(err.value).strip()
        assert client.call("task_cancel", {"ids": ["jobs/1"]}) == [False]  # the real one: ended
    assert cli(sd, "health").returncode == 0
    log = (sd / "logs" / "daemon.log").read_text()
    assert "Traceback" not in log and "internal error" not in log, log


def _metrics_server() -> tuple[Any, Any]:
    from orchestrator.daemon.httpserver import MetricsServer
    from orchestrator.daemon.reactor import Reactor

    reactor = Reactor()
    return reactor, MetricsServer(reactor, 0, lambda: "up 1\n", lambda: (True, {}))


def _exchange(reactor: Any, port: int, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` (each its own write, the loop turning in between) and read the reply."""
    import threading

    out: list[bytes] = []

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            try:
                for piece in pieces:
                    c.sendall(piece)
                    if len(pieces) > 1:
                        threading.Event().wait(0.05)  # a piece apart: separate reads on the server
                data = b""
                while chunk := c.recv(65536):
                    data += chunk
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            out.append(data)

    t = threading.Thread(target=client)
    t.start()
    assert reactor.run_until(lambda: not t.is_alive(), 20), "the client did not finish"
    t.join(5)
    return out[0]


@pytest.mark.parametrize("whole", [True, False], ids=["one-piece", "in-pieces"])
def test_the_http_header_bound_holds_however_the_request_arrives(whole: bool) -> None:
    """8 KiB of request line and headers at most: a 9 KiB head is refused (431, or closed)
    whether it comes in one write or in pieces; one of 8000 bytes is served either way."""
    reactor, server = _metrics_server()
    try:
        def request(pad: int) -> bytes:
            return b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * pad + b"\r\n\r\n"

        for size, served in ((9 * 1024, False), (8000, True)):
            data = request(size)
            pieces = [data] if whole else [data[i:i + 1000] for i in range(0, len(data), 1000)]
            reply = _exchange(reactor, server.port, pieces)
            if served:
                assert reply.startswith(b"HTTP/1.1 200"), (size, reply[:80])
            else:
                assert reply == b"" or reply.startswith(b"HTTP/1.1 431"), (size, reply[:80])
        assert server.counts["too_large"] == 1 and server.counts["served"] == 1, server.counts
    finally:
        server.close()
        reactor.close()


def test_a_unix_socket_swapped_for_a_link_after_bind_changes_no_other_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever may write a socket's directory could put a symlink in its place between
    bind() and the chmod that opens it to 0666: the chmod must not follow it. Simulated by
    doing that swap right after bind: the victim keeps its mode, and the address is
    refused in one line."""
    from orchestrator.daemon.reactor import Reactor
    from orchestrator.daemon.sockets import Listeners
    from orchestrator.errors import InvalidSpec

    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    path = tmp_path / "app.sock"
    real_bind = socket.socket.bind

    def bind_then_swap(self: socket.socket, address: Any) -> None:
        real_bind(self, address)
        if address == str(path):
            os.rename(path, tmp_path / "moved.sock")
            os.symlink(victim, path)

    reactor = Reactor()
    listeners = Listeners(reactor, lambda: set())
    try:
        monkeypatch.setattr(socket.socket, "bind", bind_then_swap)
        with pytest.raises(InvalidSpec) as err:
            listeners.open([f"unix:{path}"])
        monkeypatch.undo()
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600
        assert "\n" not in str(err.value) and "replaced" in str(err.value), err.value
        assert path.is_symlink()  # not ours: left alone
        # Unswapped, the socket is made 0666 as before, and removed when closed.
        path.unlink()
        listeners.open([f"unix:{path}"])
        assert stat.S_ISSOCK(path.lstat().st_mode) and stat.S_IMODE(path.lstat().st_mode) == 0o666
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
    finally:
        listeners.close()
        reactor.close()
    assert not path.exists()
