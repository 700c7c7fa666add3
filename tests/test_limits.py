"""Limits.refusal's fd count: the fd table's size bounds the fds open from above and is read
in microseconds, so a launch that fits even at that bound is not made to list every open fd
(about 10 ms at 2,000 replicas, in the loop); one that does not is counted exactly."""

from __future__ import annotations

from typing import Iterator

import pytest

from orchestrator.daemon import limits
from orchestrator.daemon.limits import FDS_PER_REPLICA, FdReserve, Limits


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The fd counts open_fds gave (one entry a call)."""
    calls: list[int] = []
    real = limits.open_fds

    def counting() -> int | None:
        n = real()
        calls.append(-1 if n is None else n)
        return n

    monkeypatch.setattr(limits, "open_fds", counting)
    yield calls


def test_the_table_size_bounds_the_open_fds() -> None:
    size, opened = limits.fd_table_size(), limits.open_fds()
    assert size is not None and opened is not None and opened <= size


def test_a_launch_that_fits_at_the_bound_is_not_counted(counted: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    reserve = FdReserve(4)
    try:
        assert Limits(reserve).refusal(10, replicas=0) is None
        assert counted == []
        # a limit at which the bound leaves room for 2 but the fds really open leave more
        size = limits.fd_table_size()
        assert size is not None
        monkeypatch.setattr(limits, "fd_limit", lambda: size + FDS_PER_REPLICA * 2)
        assert Limits(reserve).refusal(2, replicas=0) is None
        assert counted == []
        assert Limits(reserve).refusal(3, replicas=0) is None  # counted: it fits all the same
        assert len(counted) == 1 and counted[0] < size
        monkeypatch.setattr(limits, "fd_limit", lambda: counted[0] + FDS_PER_REPLICA)
        why = Limits(reserve).refusal(3, replicas=0)
        assert why is not None and f"({counted[1]} of its limit" in why, why
    finally:
        reserve.close()
