"""The Python 3.13 the adapter runs under, and a venv of it with orchestrator's dependencies.

``find_python()`` looks for ``python3.13`` on PATH, then under ``pyenv root`` (``versions/
3.13*/bin``; ``$PYENV_ROOT`` or ``~/.pyenv`` where the ``pyenv`` command is not there), and
takes the first that runs and has its test package (``test.test_concurrent_futures``: some
distributions ship Python without it). ``ensure_venv()`` makes, once, a venv of it with the
project's dependencies (read from ``pyproject.toml``: the checkout itself is not installed,
the runner puts it on ``sys.path``, so a cached venv always tests the code as it is now) and
the site hook's ``.pth`` line; it is cached in the temp dir under a key of
``pyproject.toml``, the interpreter and the hook line, built under a lock (parallel test
processes wait for one build) and marked ready only when complete.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
VERSION = "3.13"
NAME = f"python{VERSION}"
# The venv's .pth line: the site hook, only where the runner asked for it (cpython_standin_hook).
HOOK_LINE = ('import os, sys; d = os.environ.get("ORCH_CPYTHON_STANDIN"); '
             'd and d not in sys.path and sys.path.append(d); d and __import__("cpython_standin_hook")\n')
PTH = "_orchestrator_cpython_standin.pth"
PROBE = ("import sys, test.test_concurrent_futures.util, venv, ensurepip; "
         f"assert sys.version_info[:2] == {tuple(map(int, VERSION.split('.')))}")


def _candidates() -> list[str]:
    out = []
    on_path = shutil.which(NAME)
    if on_path:
        out.append(on_path)
    root = None
    if shutil.which("pyenv"):
        try:
            done = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=10)
            root = done.stdout.strip() if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            root = None
    root = root or os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    out += sorted(glob.glob(os.path.join(root, "versions", f"{VERSION}*", "bin", NAME)), reverse=True)
    return out


def find_python() -> tuple[str | None, str]:
    """(a python3.13 with its test package, "") or (None, why there is none)."""
    tried = []
    for exe in _candidates():
        try:
            done = subprocess.run([exe, "-c", PROBE], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            tried.append(f"{exe}: {err}")
            continue
        if done.returncode == 0:
            return exe, ""
        tried.append(f"{exe}: {(done.stderr.strip().splitlines() or ['exit ' + str(done.returncode)])[-1]}")
    if not tried:
        return None, f"no {NAME} on PATH nor under pyenv's root"
    return None, f"no {NAME} with its test package (test.test_concurrent_futures): " + "; ".join(tried)


def _dependencies() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def _key(python: str) -> str:
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             timeout=60).stdout
    h = hashlib.sha256()
    for part in ((REPO / "pyproject.toml").read_bytes(), os.path.realpath(python).encode(), version.encode(),
                 HOOK_LINE.encode()):
        h.update(part + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(tempfile.gettempdir()) / "orchestrator-cpython-venvs"


def ensure_venv(python: str, timeout: float = 600.0) -> Path:
    """The venv's interpreter, made if it is not there yet (RuntimeError with pip's words
    if it cannot be)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = _key(python)
    home = root / key
    vpy = home / "bin" / "python"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process building it: wait for its build
        if (home / "ready").exists():
            return vpy
        shutil.rmtree(home, ignore_errors=True)  # a build that died half-way
        steps = [[python, "-m", "venv", str(home)],
                 [str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", *_dependencies()]]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
                raise RuntimeError(f"{' '.join(argv[:4])} ... failed (exit {done.returncode}):\n{tail}")
        purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        (Path(purelib) / PTH).write_text(HOOK_LINE)
        (home / "ready").write_text(key + "\n")
    return vpy


if __name__ == "__main__":
    found, why = find_python()
    if found is None:
        sys.exit(why)
    print(ensure_venv(found))
