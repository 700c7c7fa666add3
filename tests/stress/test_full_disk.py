"""A full disk for the logs: the daemon's ``logs/`` is a 2 MiB tmpfs (in a mount namespace
of the daemon's own, so nothing of the host is mounted), filled up while chatty replicas
write: output is dropped and counted, the daemon keeps answering and supervising, and
writing resumes once there is room again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DaemonUnderTest, cli, cli_env, wait_for
from stress.conftest import Stress

pytestmark = [pytest.mark.stress, pytest.mark.timeout(90)]

CHATTY = ["sh", "-c", "while :; do echo 'a line of output that fills the disk for the logs'; done"]


def _logs(d: DaemonUnderTest) -> dict:
    return d.status()["daemon"]["logs"]


def test_a_full_disk_for_the_logs(stress_daemon: DaemonUnderTest, stress: Stress) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    d = stress_daemon
    logs = d.state_dir / "logs"
    logs.mkdir(parents=True, mode=0o700)
    d.state_dir.chmod(0o700)
    shell = (f'mount -t tmpfs -o size=2m,mode=0700 tmpfs "{logs}" || exit 77; '
             f'exec "{sys.executable}" -m orchestrator --state-dir "{d.state_dir}" start --grace 0.5')
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell], env=cli_env(),
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    d.pid = int(out.stdout.strip())
    d.snapshot()
    # The daemon's view of its logs dir: the tmpfs, seen through its own mount namespace.
    mine = Path(f"/proc/{d.pid}/root") / str(logs).lstrip("/")
    ballast = mine / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass  # ENOSPC: the disk is full
    finally:
        os.close(fd)
    n = stress.count(4)
    ids = cli(d.state_dir, "launch", "--pool", "chatty", "--count", str(n), "--wait", "--", *CHATTY,
              check=True).stdout.split()
    d.status()
    wait_for(lambda: _logs(d)["dropped"] > 0, 30, f"output to be dropped ({stress.replay})")
    # Supervising and answering go on: health, launch and terminate, with the disk full.
    assert cli(d.state_dir, "health").returncode == 0, stress.replay
    more = cli(d.state_dir, "launch", "--pool", "quiet", "--wait", "--", "sleep", "1000", check=True).stdout.split()
    cli(d.state_dir, "terminate", *more, ids[0], "--wait", check=True)
    assert {r["id"] for r in d.status()["replicas"] if r["state"] == "RUNNING"} == set(ids[1:]), stress.replay
    # Room again: writing resumes.
    written = _logs(d)["bytes"]
    ballast.unlink()
    wait_for(lambda: _logs(d)["bytes"] > written, 30, f"writing to resume ({stress.replay})")
    log = (mine / "daemon.log").read_text()
    assert "Traceback" not in log, f"{stress.replay}: {log[-2000:]}"
    stop = cli(d.state_dir, "stop", "--timeout", "30")
    assert stop.returncode == 0, (stress.replay, stop.stderr)
