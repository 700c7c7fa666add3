"""What the stress tests share: their size and seed, a daemon whose every process carries the
test's tag, and signals that reach a process only while it is still the one a test means.

``STRESS_SIZE`` (a multiplier, default 1: the bounded run CI does under ``pytest -n auto``)
scales the durations, counts and rounds; ``STRESS_SEED`` replays a run: the seed and the
size are added to the report of every failing test, and to the message of its assertions.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator

import psutil
import pytest

from conftest import TAG_VAR, ProcessTracker
from helpers import DaemonUnderTest, wait_for

SIZE = float(os.environ.get("STRESS_SIZE") or "1")
STASH = pytest.StashKey["Stress"]()


@dataclass
class Stress:
    """One test's seed and size, and the random stream drawn from them."""

    seed: int
    size: float
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def replay(self) -> str:
        return f"STRESS_SEED={self.seed} STRESS_SIZE={self.size:g}"

    def seconds(self, base: float) -> float:
        return base * self.size

    def count(self, base: float, least: int = 1) -> int:
        return max(least, round(base * self.size))


@pytest.fixture
def stress(request: pytest.FixtureRequest) -> Stress:
    seed = int(os.environ.get("STRESS_SEED") or random.SystemRandom().randrange(2**32))
    s = Stress(seed, SIZE)
    request.node.stash[STASH] = s
    return s


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing stress test says how to replay it, whatever its assertion said."""
    report = yield
    s = item.stash.get(STASH, None)
    if s is not None and report.failed:
        report.sections.append(("stress replay", s.replay))
    return report


@pytest.fixture(autouse=True)
def _tag_everything(monkeypatch: pytest.MonkeyPatch, orch_test_tag: str) -> None:
    """The CLI and Client calls of the test start their processes with this test's own
    tag (``cli_env`` keeps a tag already set), so ``procs`` finds any of them left."""
    monkeypatch.setenv(TAG_VAR, orch_test_tag)


@pytest.fixture
def stress_daemon(tmp_path, procs: ProcessTracker, stress: Stress) -> Iterator[DaemonUnderTest]:
    """A daemon in ``tmp_path/state`` (not started). Teardown stops it, ends what it was
    seen to own and whatever carries the test's tag, and fails the test if there was any."""
    d = DaemonUnderTest(tmp_path / "state")
    try:
        yield d
    finally:
        left = d.teardown()
        try:
            wait_for(lambda: not procs.survivors(), 5, "the test's tagged processes to end")
        except AssertionError:
            pass
        tagged = procs.survivors()
        assert not left and not tagged, f"{stress.replay}: processes left behind: {left or tagged}"


# -- signals by identity -----------------------------------------------------------------


def _send(pid: int, sig: int, is_it: Callable[[psutil.Process], bool]) -> bool:
    """Send ``sig`` through a pidfd opened before the identity check, so the process
    checked is the process signalled (a pid reused meanwhile gets nothing); False if the
    process is gone or is not the one meant."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if not is_it(psutil.Process(pid)):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except (psutil.Error, OSError):
        return False
    finally:
        os.close(fd)


def _tagged(p: psutil.Process) -> bool:
    return p.environ().get(TAG_VAR) == os.environ[TAG_VAR]


def signal_replica(rep: dict, sig: int) -> bool:
    """Signal the process ``status`` names for replica ``rep``, if it is that replica of
    this test: a command worker by the id in its environment, a Python one by its title."""
    def is_it(p: psutil.Process) -> bool:
        if not _tagged(p):
            return False
        return (p.environ().get("ORCHESTRATOR_REPLICA_ID") == rep["id"]
                or p.cmdline()[:1] == [f"orchestrator: replica {rep['id']}"])

    return bool(rep.get("pid")) and _send(rep["pid"], sig, is_it)


def signal_system(pid: int, title: str, sig: int, parent: int | None = None) -> bool:
    """Signal one of the daemon's own processes (daemon, watchdog, manager, spawner), by
    its pid, its title, this test's tag and, for a child, its parent."""
    def is_it(p: psutil.Process) -> bool:
        return (_tagged(p) and p.cmdline()[:1] == [title]
                and (parent is None or p.ppid() == parent))

    return _send(pid, sig, is_it)
