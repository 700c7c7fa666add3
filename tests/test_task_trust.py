"""Who may reach the task wire, and whom a worker trusts: the daemon's task listener is a
socket in its 0700 state dir (another user cannot connect, nor bind its name first); the
loop checks a peer's credentials at accept, before it reads a byte; a worker checks the
listener's before it unpickles anything. As root, against the user ``nobody``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers import ROOT, DaemonUnderTest
from orchestrator import Executor
from test_security import NOBODY, needs_nobody
from test_tasks_cli import executors, make_pool  # noqa: F401  # the fixture

pytestmark = pytest.mark.timeout(120)



def test_the_daemons_task_listener_is_a_socket_of_its_private_state_dir(daemon: DaemonUnderTest,
                                                                        executors: list[Executor]) -> None:
    daemon.start()
    ex = make_pool(daemon, executors)
    assert ex.submit(abs, -3).result(timeout=60) == 3
    sock = daemon.state_dir / "tasks.sock"
    st = sock.lstat()
    assert st.st_mode & 0o777 == 0o600 and (daemon.state_dir.stat().st_mode & 0o077) == 0
    assert st.st_uid == os.geteuid()


@needs_nobody
def test_another_user_cannot_reach_the_daemons_task_listener(daemon: DaemonUnderTest,
                                                             executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    assert NOBODY is not None
    code = (f"import os, socket, sys\n"
            f"os.setgroups([]); os.setgid({NOBODY.pw_gid}); os.setuid({NOBODY.pw_uid})\n"
            f"s = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({str(daemon.state_dir / 'tasks.sock')!r})\n"
            f"except OSError as e:\n    print(e.errno); sys.exit(0)\n"
            f"print('connected')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd="/")
    assert proc.stdout.strip() == "13", proc  # EACCES: the state dir is the daemon user's alone


@needs_nobody
def test_a_worker_refuses_a_listener_of_another_user() -> None:
    """A listener bound by ``nobody`` where the worker was told to connect (a name bound
    first): the worker connects, sees the listener's uid, and exits before reading."""
    assert NOBODY is not None
    name = f"orchestrator-test-squat-{os.getpid()}"
    code = (f"import socket, os, sys, time\n"
            f"s = socket.socket(socket.AF_UNIX); s.bind('\\0{name}')\n"
            f"os.setgroups([]); os.setgid({NOBODY.pw_gid}); os.setuid({NOBODY.pw_uid})\n"
            f"s.listen(4)  # SO_PEERCRED reports who listened: nobody\n"
            f"print('ready', flush=True)\n"
            f"c, _ = s.accept(); c.sendall(b'x' * 64); time.sleep(30)\n")
    squatter = subprocess.Popen([sys.executable, "-c", code], cwd="/", stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "ready\n"
        env = {**os.environ, "ORCHESTRATOR_TASK_SOCKET": f"@{name}", "PYTHONPATH": str(ROOT)}
        worker = subprocess.run([sys.executable, "-P", "-c", "from orchestrator.taskworker import main; main()"],
                                capture_output=True, text=True, timeout=30, env=env, cwd="/")
        assert worker.returncode != 0
        assert f"belongs to uid {NOBODY.pw_uid}, not to this worker's user: refused" in worker.stderr
    finally:
        squatter.kill()
        squatter.communicate(timeout=30)


def test_a_peer_that_is_no_worker_is_closed_before_a_byte_is_read(daemon: DaemonUnderTest,
                                                                  executors: list[Executor]) -> None:
    daemon.start()
    make_pool(daemon, executors)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer.connect(str(daemon.state_dir / "tasks.sock"))
        peer.settimeout(30)
        assert peer.recv(1) == b""  # closed by the daemon without a word
    finally:
        peer.close()
