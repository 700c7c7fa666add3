"""``python -m benchmarks``: its help, and one tiny churn section end to end (no network: a
peer that would need installing is skipped, with the reason in the output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ is a package of the checkout, not installed


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_flags_and_sections() -> None:
    done = _run("--help", timeout=15)
    assert done.returncode == 0, done.stderr
    for word in ("--quick", "--only", "--out", "--no-plots", "--batches", "churn", "cleanup", "soak"):
        assert word in done.stdout


def test_unknown_section_is_a_usage_error() -> None:
    done = _run("--only", "nope", timeout=15)
    assert done.returncode == 2
    assert "unknown section" in done.stderr


def test_tiny_churn_writes_json_with_figures(tmp_path: Path) -> None:
    done = _run("--only", "churn", "--quick", "--batches", "1", "--no-install", "--no-plots",
                "--out", str(tmp_path), timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    assert {"cpus", "python", "kernel", "date", "git_commit"} <= doc["machine"].keys()
    assert doc["mode"] == "quick"
    churn = doc["sections"]["churn"]
    assert churn["status"] == "ok", churn
    variants = churn["result"]["variants"]
    for name in ("orchestrator, embedded API", "orchestrator, daemon channel", "orchestrator, CLI",
                 "multiprocess.Process (fork)", "raw os.fork (floor)"):
        assert variants[name]["rate"] > 0, name
        assert variants[name]["cycles"] == 1
    for name in ("orchestrator, embedded API", "orchestrator, daemon channel", "orchestrator, CLI"):
        assert variants[name]["launch_to_running_s"]["p50"] > 0
        assert variants[name]["terminate_to_reaped_s"]["p99"] > 0
    assert churn["result"]["leftover_cgroups"] == []
    for name, why in churn["result"]["skipped"].items():  # skipped peers say why, on stdout too
        assert why and name in done.stdout
    floor_target = next(t for t in doc["targets"] if "floor" in t["target"])
    assert floor_target["measured"] > 0 and floor_target["ok"] in (True, False)
    assert "targets" in done.stdout and "vs floor" in done.stdout


@pytest.mark.long
def test_tiny_tasks_section_compares_the_executor_with_its_peers(tmp_path: Path) -> None:
    """One round of each part: every figure of ours is there (the scheduling part's too), a
    worker's kill -9 loses one future (none with retries=1), the head-of-line part's
    figures are bounded as its tasks bound them, and the section's targets reach the
    targets block."""
    done = _run("--only", "tasks", "--quick", "--batches", "1", "--no-install", "--no-plots",
                "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    section = json.loads((tmp_path / "results.json").read_text())["sections"]["tasks"]
    assert section["status"] == "ok", section
    res = section["result"]
    assert {"tiny", "process_per_task", "cancel", "kill", "targets"} <= res.keys()
    assert res["tiny"]["map"]["orchestrator.Executor"]["rate"] > 0
    assert res["tiny"]["map"]["ProcessPoolExecutor (default context: fork)"]["rate"] > 0
    proc = res["process_per_task"]["variants"]
    for name in ("orchestrator.Executor, max_tasks_per_child=1",
                 "orchestrator.Executor, max_tasks_per_child=1, 200 MB preload"):
        uniq, total = map(int, proc[name]["distinct_pids"].split("/"))
        assert uniq == total > 0, name  # a process per task
    ours = res["cancel"]["variants"]["orchestrator.Executor"]
    assert ours["cancels"] > 0 and ours["raised_in_task"] == {"Cancelled": ours["cancels"]}
    assert ours["worker_pids_seen"] == 2  # the workers live on through every cancel
    kill = res["kill"]["variants"]
    assert kill["orchestrator.Executor"]["futures_lost"] == [1]
    assert kill["orchestrator.Executor"]["errors"] == {"WorkerLost": 1}
    assert kill["orchestrator.Executor, retries=1"]["futures_lost"] == [0]
    assert kill["orchestrator.Executor"]["usable_after"] is True
    assert kill["ProcessPoolExecutor (default context: fork)"]["usable_after"] is False
    sched = res["scheduling"]["variants"]
    assert sched["orchestrator.Executor, FIFO (no options)"]["rate"] > 0
    assert sched["orchestrator.Executor, 8 tenants x 3 priorities"]["rate"] > 0
    names = [t["target"] for t in json.loads((tmp_path / "results.json").read_text())["targets"]]
    assert res["parked"]["late_s"]["n"] > 0 and res["parked"]["late_s"]["p50"] >= 0
    assert sum(n.startswith("tasks: ") for n in names) == len(res["targets"]) == 8
    assert "1. tiny tasks" in done.stdout and "4. kill -9" in done.stdout
    _check_head_of_line(res["head_of_line"])


def _check_head_of_line(res: dict) -> None:
    """The head-of-line part measures what it says (one quick round, its case B scaled to a
    6 s long task; checked here, on the section's own run, so that CI runs the part once):
    the figures are bounded by the tasks themselves (no future can end before its own
    sleep, nor the third before a worker is free at 3 s), and the reference,
    ProcessPoolExecutor, shows no head-of-line blocking. How ours fares is the benchmark's
    to report, not this test's."""
    from benchmarks import sec_tasks

    a, b = res["case_a"]["variants"], res["case_b"]["variants"]
    for variants in (a, b):
        for name in (sec_tasks.OURS, sec_tasks.OURS_PROC, sec_tasks.PPE, sec_tasks.PPE_SPAWN):
            assert name in variants, name
    long_s = res["case_b"]["long_s"]
    assert long_s == sec_tasks.HOL_B_LONG[True]
    for name, v in a.items():
        (first, second, third), = v["raw_s"]
        assert first >= 6.0 and second >= 3.0 and third >= 3.0 + 0.1, (name, v["raw_s"])
        assert v["third_s"]["p50"] == third
    for name, v in b.items():
        (long_end, *shorts), = v["raw_s"]
        assert long_end >= long_s and len(shorts) == sec_tasks.HOL_B_N, (name, v["raw_s"])
        assert min(shorts) >= 1.0 and v["last_short_s"]["p50"] == max(shorts)
        assert max(shorts) >= 3.0  # seven 1 s tasks on three free workers take three turns
    assert a[sec_tasks.PPE]["third_s"]["p50"] < 4.5  # its third task runs where the 3 s one ran
    assert b[sec_tasks.PPE]["last_short_s"]["p50"] < 4.5
    for name, why in res["skipped"].items():
        assert why, name
