"""The session's sweep (tests/conftest.py) can fail: a pytest session of its own, whose one
test passes but leaves a detached, tagged ``sleep`` behind, exits non-zero, names it, and
kills it; the same session with a test that cleans up exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TESTS, Ident, cli_env, kill_all

pytestmark = [pytest.mark.stress, pytest.mark.timeout(90)]

INNER = '''
import os, subprocess

def test_starts_a_detached_sleep():
    # sh exits at once: the sleep is nobody's child of this session, only its tag says whose.
    subprocess.run(["sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}"], check=True)
    pid = int(open({pidfile!r}).read())
    if {clean}:
        os.kill(pid, 9)
'''


@pytest.mark.parametrize("clean", [False, True])
def test_the_session_sweep(tmp_path: Path, clean: bool) -> None:
    pidfile = tmp_path / "sleep.pid"
    (tmp_path / "test_inner.py").write_text(INNER.format(pidfile=str(pidfile), clean=clean))
    ident = None
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q",
             "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
            env=cli_env({"PYTHONPATH": str(TESTS)}), cwd=tmp_path, capture_output=True, text=True, timeout=60)
        pid = int(pidfile.read_text())
        ident = Ident.of(pid)
        assert "1 passed" in out.stdout, out.stdout + out.stderr
        if clean:
            assert out.returncode == 0, out.stdout + out.stderr
        else:
            assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout + out.stderr
            # Its command line: "sleep 1000", or still sh's if the sweep caught it before its exec.
            assert "left behind" in out.stdout and f"pid {pid}: " in out.stdout and "sleep 1000" in out.stdout, out.stdout
            assert not (ident and ident.alive()), f"the sweep did not kill {pid}"
    finally:
        if ident is not None:
            kill_all([ident])
