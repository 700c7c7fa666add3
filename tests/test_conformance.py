"""``python -m benchmarks --only conformance``: its cells come from what each executor did.

The section runs for ours and ProcessPoolExecutor on two questions (each column in a child
process, as the benchmark does); then stubs that behave differently from the peer they
derive from (one worker instead of two; a task's exception turned into a RuntimeError) are
asked in this process and must get other cells: a cell that were written down, not
measured, would not change. A peer whose package is missing is a column of "not installed".
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path
from typing import Any, Callable

from benchmarks import sec_conformance as C


def test_quick_section_cells_for_ours_and_process_pool(tmp_path: Path) -> None:
    said: list[str] = []
    res = C.run(True, said.append, out=tmp_path, peers=["ppe", "ours"], questions=["cancel", "idle_worker"])
    cancel = res["cells"]["cancel"]
    ours, ppe = cancel["ours"], cancel["ppe"]
    assert ours["verdict"] == C.YES, ours
    assert ours["figures"]["cancel_returned"] is True and ours["figures"]["stopped_after_s"] < 1.0
    assert ours["figures"]["how"] == "Cancelled raised in it"
    # The standard library refuses to cancel a running task: it is seen beating on.
    assert ppe["verdict"] == C.NO, ppe
    assert ppe["figures"]["cancel_returned"] is False and ppe["figures"]["beats_after_cancel"] > 10
    for key in ("ours", "ppe"):
        idle = res["cells"]["idle_worker"][key]
        assert idle["verdict"] == C.YES, idle
        assert 0 <= idle["figures"]["submit_to_start_s"] < C.QUICK.idle_long / 2
        assert "killed_after_close" not in idle and "close_problems" not in idle
    assert any("orchestrator: cancel" in line for line in said)  # the children's progress is relayed
    doc = json.loads((tmp_path / "conformance.json").read_text())
    assert doc["cells"] == res["cells"]
    table = (tmp_path / "conformance.md").read_text().splitlines()
    assert table[0] == "| question | ProcessPoolExecutor | orchestrator |"
    assert len(table) == 2 + 2 and table[2].startswith("| 1. cancel() of a running task stops it | no: cancel() False")


def typeless(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn``; whatever it raises comes back as a plain RuntimeError."""
    try:
        return fn(*args)
    except Exception as err:
        raise RuntimeError(str(err)) from None


class OneWorker(C.PPEPeer):
    """ProcessPoolExecutor with one worker, whatever it is asked for."""

    key, title = "one-worker", "one worker"

    def open(self, workers: int = C.WORKERS, **kw: Any) -> Any:
        return super().open(1, **kw)


class LosesTypes(C.PPEPeer):
    key, title = "loses-types", "loses exception types"

    def submit(self, h: Any, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        return super().submit(h, typeless, fn, *args)


def test_stubs_that_behave_differently_get_other_cells() -> None:
    base = C.column("ppe", ["exception_type"], True)
    assert base["exception_type"]["verdict"] == C.YES
    busy = C.column("one-worker", ["idle_worker"], True, peer=OneWorker())["idle_worker"]
    assert busy["verdict"] == C.NO, busy  # the short task waited for the one busy worker
    assert busy["figures"]["submit_to_start_s"] >= C.QUICK.idle_long / 2
    lost = C.column("loses-types", ["exception_type"], True, peer=LosesTypes())["exception_type"]
    assert lost["verdict"] == C.NO and lost["figures"]["type"] == "builtins.RuntimeError", lost


class Missing(C.Peer):
    key, title, package = "missing", "missing", "no_such_package_for_conformance"


def test_a_peer_not_installed_is_a_column_saying_so() -> None:
    cells = C.column("missing", ["cancel", "memory"], True, peer=Missing())
    assert {c["verdict"] for c in cells.values()} == {C.NOT_INSTALLED}
    assert "no_such_package_for_conformance" in cells["cancel"]["text"]


def test_no_api_is_detected_from_the_signature_that_would_take_it() -> None:
    assert not C.named(cf.ProcessPoolExecutor.submit, "timeout")  # its **kwargs go to the task
    assert C.named(cf.ProcessPoolExecutor, "max_tasks_per_child")
    assert not C.named(cf.ProcessPoolExecutor, "memory_max")
