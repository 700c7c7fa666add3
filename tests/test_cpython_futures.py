"""CPython's own ``test_concurrent_futures`` against ``orchestrator.Executor``.

The machine's Python 3.13 runs its test package's process-pool tests with the executor
standing in for ``ProcessPoolExecutor`` (``tests/cpython_futures/``: ``run.py`` and
``cpython_standin.py``), in a venv cached in the temp dir (``venvcache.py``: made once per
``pyproject.toml``, with the project's dependencies; the checkout is put on the path, so the
code tested is this one), in two runs of about equal length (``GROUPS``: with ``-n`` they
run side by side). Every test must pass except those ``expected.toml`` lists, each
with its reason, and each listed one must still fail for its reason: a fix that makes one
pass fails this test until the entry goes. Skipped (with the reason) where no python3.13
with its test package is found.

The small tests first hold ``check.problems`` itself to both directions, without 3.13.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cpython_futures import check, run, venvcache

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tests" / "cpython_futures" / "run.py"
RUN_TIMEOUT = 240  # a group takes ~50 s on 2 busy cores; the runner's own bound per test is 15 s
# Two runs of about the same length (~45 s of tests each today), in parallel under -n.
GROUPS = (("test_deadlock", "test_init"), ("test_process_pool", "test_shutdown", "test_wait", "test_as_completed"))


def _doc(**tests: str) -> dict[str, Any]:
    return {"tests": {name: {"outcome": outcome, "detail": "" if outcome == "pass" else f"boom {outcome}"}
                      for name, outcome in tests.items()}}


LISTED = {"tests": {"m.C.test_bug": {"kind": "bug", "item": "2", "match": "boom"},
                    "m.C.test_doc": {"kind": "documented", "readme": "a line  of\nthe README", "match": "boom"},
                    "other.C.test_x": {"kind": "bug", "item": "new", "match": "boom"}},  # a module not run
          "skipped": {"m.C.test_win": {"match": "boom"}},
          "counts": {"m": 4}}
README = "Some text. a line of the README, and more."


def test_the_list_agrees_with_a_run_that_matches_it() -> None:
    doc = _doc(**{"m.C.test_bug": "hung", "m.C.test_doc": "error", "m.C.test_win": "skip", "m.C.test_ok": "pass"})
    assert check.problems(doc, LISTED, README) == []


def test_the_list_is_held_both_ways() -> None:
    doc = _doc(**{"m.C.test_bug": "pass", "m.C.test_win": "pass", "m.C.test_new": "fail", "m.C.test_skip": "skip",
                  "m.C.test_more": "pass"})
    got = "\n".join(check.problems(doc, LISTED, README))
    assert "m: 5 tests ran, expected.toml's counts say 4" in got
    assert "m.C.test_bug: listed (bug) but passes now" in got  # a fix landed: the entry must go
    assert "m.C.test_doc: listed (documented) but not run" in got
    assert "m.C.test_win: listed as skipped but pass" in got
    assert "m.C.test_new: fail, not listed" in got
    assert "m.C.test_skip: skipped, not listed" in got


def test_an_entry_must_fail_for_its_reason_and_quote_the_readme() -> None:
    doc = {"tests": {"m.C.test_bug": {"outcome": "error", "detail": "AttributeError: other"},
                     "m.C.test_doc": {"outcome": "fail", "detail": "boom"},
                     "m.C.test_win": {"outcome": "skip", "detail": "boom"}}}
    got = check.problems(doc, LISTED, "a README that changed", counts=False)
    assert any(p.startswith("m.C.test_bug: fails otherwise than listed") for p in got), got
    assert any(p.startswith("m.C.test_doc: README.md no longer says") for p in got), got
    bad = {"tests": {"m.C.test_x": {"kind": "private", "match": "x"}}}  # no attribute named
    got = check.problems(_doc(**{"m.C.test_x": "error"}), bad, README, counts=False)
    assert got and got[0].startswith("m.C.test_x: an entry needs"), got


def test_the_list_in_the_tree_is_well_formed() -> None:
    """Every entry has its kind's reason and a match; every README quote is in README.md."""
    expected = check.load()
    listed = {name: {"outcome": "error", "detail": entry["match"]} for name, entry in expected["tests"].items()}
    skipped = {name: {"outcome": "skip", "detail": entry["match"]} for name, entry in expected["skipped"].items()}
    assert check.problems({"tests": {**listed, **skipped}}, expected, check.README.read_text(), counts=False) == []
    assert set(expected["counts"]) == set(GROUPS[0] + GROUPS[1]) == set(run.MODULES)


@pytest.mark.long
@pytest.mark.timeout(RUN_TIMEOUT + 420)  # the run, plus making the venv the first time (pip)
@pytest.mark.parametrize("modules", GROUPS, ids=["-".join(m.removeprefix("test_") for m in g) for g in GROUPS])
def test_cpython_test_concurrent_futures(modules: tuple[str, ...], tmp_path: Path, procs: Any,
                                         orch_test_tag: str) -> None:
    python, why = venvcache.find_python()
    if python is None:
        pytest.skip(why)
    vpy = venvcache.ensure_venv(python, timeout=400)
    out = tmp_path / "outcomes.json"
    # A short TMPDIR of its own: the tests' Manager sockets live there, and a unix socket's
    # path must stay under 108 bytes (pytest's tmp_path under xdist can be longer).
    tmp = tempfile.mkdtemp(prefix="cf-")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": tmp, "ORCH_TEST_TAG": orch_test_tag}
    try:
        done = subprocess.run([str(vpy), str(RUN), "--out", str(out), "--modules", ",".join(modules)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0 and out.exists(), f"run.py exit {done.returncode}:\n{done.stdout}{done.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    for pid, _ in doc["leftover_processes"]:  # ended by the watchdog with the run; if not, by procs
        procs.track(pid)
    expected = check.load()
    found = check.problems(doc, expected, check.README.read_text())
    print(done.stdout.strip())
    print(check.table(doc, expected))
    assert not found, (f"{len(found)} difference(s) from tests/cpython_futures/expected.toml "
                       f"({doc['python'].split()[0]}, {doc['wall_s']} s):\n" + "\n".join(found))
    assert doc["modules"] == list(modules)
