"""mypy, with the project's settings (``[tool.mypy]`` in pyproject.toml), over the whole tree
it names there (``orchestrator/`` and ``watchdog/``): no error, for the Python the suite runs
on (``--python-version`` of this interpreter: the standard library's stubs, and any
``sys.version_info`` branch, as that version has them).

CI runs the test suite on each Python it supports (``.ci/run``), so this is how the type
check runs in CI too, on the newest of them included.
"""

from __future__ import annotations

import subprocess
import tomllib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error(tmp_path: Path) -> None:
    """The tree, and beside it a user's module that imports every public name (``__all__``)
    from ``orchestrator``: under --strict each must be an explicit export, not only a
    name ``__getattr__`` finds at run time."""
    import orchestrator

    user = tmp_path / "user_code.py"
    user.write_text("import orchestrator\n"
                    f"from orchestrator import {', '.join(orchestrator.__all__)}\n"
                    "client_type: type[orchestrator.Client] = orchestrator.Client\n")
    with open(ROOT / "pyproject.toml", "rb") as f:
        files = tomllib.load(f)["tool"]["mypy"]["files"]
    # A cache of its own: a run never depends on (or writes) one left in the tree.
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy-cache"), "--python-version", "%d.%d" % sys.version_info[:2],
         *files, str(user)],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )
    if proc.returncode != 0:
        pytest.fail(f"mypy (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}", pytrace=False)


def test_the_settings_are_strict() -> None:
    # The check above is only as good as its settings: `strict` is what the house promises.
    with open(ROOT / "pyproject.toml", "rb") as f:
        settings = tomllib.load(f)["tool"]["mypy"]
    assert settings.get("strict") is True, settings
