"""The Pythons the project declares are the ones CI runs the suite on: pyproject.toml's
classifiers name exactly the versions ``.ci/run`` runs (oldest first), and the oldest is
``requires-python``'s lower bound."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_versions() -> list[str]:
    found = re.findall(r"^VERSIONS=\(([^)]*)\)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert len(found) == 1, ".ci/run has no single VERSIONS=(...) line"
    return str(found[0]).split()


def test_the_declared_pythons_are_the_ones_ci_runs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    ci = _ci_versions()
    assert declared == ci, f"classifiers {declared}, .ci/run {ci}"
    assert project["requires-python"] == f">={ci[0]}", project["requires-python"]
