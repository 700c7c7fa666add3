"""The head-of-line part of ``python -m benchmarks --only tasks`` measures what it says: one
quick round (its case B scaled to a 6 s long task), the peers that are not installed left
out. The figures are bounded by the tasks themselves (no future can end before its own
sleep, nor the third before a worker is free at 3 s), and the reference, ProcessPoolExecutor,
shows no head-of-line blocking. How ours fares is the benchmark's to report, not this test's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import sec_tasks  # noqa: E402


@pytest.mark.timeout(90)
def test_head_of_line_part_measures_when_each_future_ends() -> None:
    res = sec_tasks.part_head_of_line(True, lambda _: None, install=False, rounds=1)
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
