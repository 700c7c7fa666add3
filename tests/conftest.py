"""Shared fixtures: an account of every process a test starts, daemons driven through the
CLI, embedded orchestrators, and a real Reactor.

Rules they exist to keep: a test tears down what it started by identity (pid + create
time; helpers.Ident), never by name; SIGCONT then SIGKILL for leftovers, then a bounded
wait; every process an Orchestrator from ``make_orchestrator`` starts carries
``ORCH_TEST_TAG`` (command workers and whatever they start), so a leftover is found even
when the test never saw its pid.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import psutil
import pytest

from helpers import DaemonUnderTest, Ident, kill_all, no_leftovers, tagged

if TYPE_CHECKING:
    from orchestrator import Orchestrator
    from orchestrator.daemon.reactor import Reactor

TAG_VAR = "ORCH_TEST_TAG"


class ProcessTracker:
    """The processes one test started: pids it recorded, new descendants of the test
    process, and processes carrying its tag."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.seen: set[Ident] = set()
        self._me = psutil.Process()
        self._before = self._descendants()
        self.exempt: list[Callable[[], set[int]]] = []  # pids of running system children (spawners)

    def _descendants(self) -> set[Ident]:
        out = set()
        for p in self._me.children(recursive=True):
            if ident := Ident.of(p.pid):
                out.add(ident)
        return out

    def track(self, pid: int | None) -> Ident | None:
        """Record ``pid``'s identity now; None if it is already gone."""
        ident = Ident.of(pid) if pid else None
        if ident is not None:
            self.seen.add(ident)
        return ident

    def track_status(self, status: dict[str, Any]) -> None:
        for rep in status.get("replicas", ()):
            self.track(rep.get("pid"))

    def new_descendants(self) -> set[Ident]:
        """Descendants of the test process made since the tracker was, zombies included."""
        return self._descendants() - self._before

    def tagged(self) -> set[Ident]:
        """Processes with this test's tag in their environment (a Python worker that set
        its title has overwritten its environment: it is found as a descendant instead)."""
        return tagged(self.tag)

    def survivors(self) -> list[Ident]:
        """Every process this test started that is still alive (zombies do not count)."""
        exempt = {pid for pids in self.exempt for pid in pids()}
        return sorted(i for i in self.seen | self.new_descendants() | self.tagged() if i.alive() and i.pid not in exempt)

    def zombies(self) -> list[Ident]:
        """Children of the test process that exited and nobody reaped."""
        out = []
        for ident in self.new_descendants():
            try:
                p = psutil.Process(ident.pid)
                if p.ppid() == self._me.pid and p.status() == psutil.STATUS_ZOMBIE:
                    out.append(ident)
            except psutil.NoSuchProcess:
                pass
        return out

    def cleanup(self, timeout: float = 5.0) -> None:
        """SIGCONT + SIGKILL survivors, then wait for them (bounded); psutil reaps children
        of ours, zombies included."""
        left = self.survivors()
        kill_all(left)
        _wait_for_end([*left, *self.zombies()], timeout)


def _wait_for_end(idents: list[Ident], timeout: float) -> None:
    """Wait (bounded) for these processes to end, each if it is still the one we saw;
    psutil reaps children of ours, zombies included."""
    procs = []
    for ident in idents:
        try:
            p = psutil.Process(ident.pid)
            if p.create_time() == ident[1]:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A daemon's state dir, not made yet: ``tmp_path/state``."""
    return tmp_path / "state"


@pytest.fixture
def daemon(state_dir: Path) -> Iterator[DaemonUnderTest]:
    """A daemon driven through the CLI (helpers.DaemonUnderTest) in ``state_dir``; the
    teardown stops it and fails the test if anything it was seen to own is left."""
    with no_leftovers(DaemonUnderTest(state_dir)) as d:
        yield d


@pytest.fixture
def reactor() -> Iterator[Reactor]:
    """A real control loop, closed at teardown."""
    from orchestrator.daemon.reactor import Reactor

    r = Reactor()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def fake() -> Iterator[Any]:
    """The fake OS of the engine's state-machine tests (fakes.FakeOS); its pipes are
    closed at teardown."""
    from fakes import FakeOS

    f = FakeOS()
    try:
        yield f
    finally:
        f.cleanup()


@pytest.fixture
def make_h(fake: Any) -> Iterator[Callable[..., Any]]:
    """Harnesses (fakes.Harness: an engine over ``fake``) with EngineConfig overrides; their
    loops closed at teardown."""
    from fakes import Harness

    made: list[Any] = []

    def make(**config: Any) -> Any:
        made.append(Harness(fake, **config))
        return made[-1]

    try:
        yield make
    finally:
        for harness in made:
            harness.engine.close()


@pytest.fixture
def h(make_h: Callable[..., Any], fake: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """One harness; at teardown the fake OS saw nothing illegal, and where the test module
    sets ``CHECK_INVARIANTS`` (no restart policy in play) every pool holds its desired size
    and every history is a path of the transition table."""
    harness = make_h()
    yield harness
    if getattr(request.module, "CHECK_INVARIANTS", False):
        harness.check_invariants()
    assert fake.violations == []


@pytest.fixture
def orch_test_tag(request: pytest.FixtureRequest) -> str:
    """A value unique to this test, for ORCH_TEST_TAG."""
    return f"{uuid.uuid4().hex[:12]}:{request.node.nodeid}"


@pytest.fixture
def procs(orch_test_tag: str) -> Iterator[ProcessTracker]:
    """A ProcessTracker whose teardown ends whatever the test left alive."""
    tracker = ProcessTracker(orch_test_tag)
    try:
        yield tracker
    finally:
        tracker.cleanup()


@pytest.fixture
def make_orchestrator(tmp_path: Path, procs: ProcessTracker,
                      orch_test_tag: str) -> Iterator[Callable[..., Orchestrator]]:
    """Factory of started embedded ``Orchestrator``s: state dir under tmp_path, the test's
    tag in the workers' environment, the watchdog tracked. Teardown closes each (terminate,
    grace, reap; a second close is a no-op), then ``procs`` sweeps."""
    from orchestrator import Orchestrator

    made: list[Orchestrator] = []

    def make(**kwargs: Any) -> Orchestrator:
        state_dir = tmp_path / f"orchestrator-{len(made)}"
        state_dir.mkdir()
        kwargs.setdefault("state_dir", str(state_dir))
        kwargs.setdefault("env", {**os.environ, TAG_VAR: orch_test_tag})
        orch = Orchestrator(**kwargs)
        made.append(orch)
        orch.start()
        procs.track(orch.watchdog_pid)
        procs.exempt.append(lambda: orch.spawner_pids)  # its own until it closes
        return orch

    try:
        yield make
    finally:
        errors = []
        for orch in reversed(made):
            try:
                orch.close()
            except BaseException as err:  # close every one, then report the first failure
                errors.append(err)
        if errors:
            raise errors[0]


# -- the order: the long tests first ----------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``stress`` or ``long`` (tens of seconds each) first, the rest in
    pytest's order: under xdist a long test started last keeps one worker busy while the
    others have nothing left, and that tail is the suite's wall time."""
    items.sort(key=lambda item: item.get_closest_marker("stress") is None and item.get_closest_marker("long") is None)


# -- the session's sweep: nothing any test started outlives the session -------------------

SESSION_TAG_VAR = "ORCH_SESSION_TAG"


def _is_controller(config: pytest.Config) -> bool:
    """The process that runs the session (xdist's workers have ``workerinput``)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """The controller tags the session before xdist starts its workers, so that they, and
    everything any test starts (daemons, their children, detached ones too), inherit the
    tag in their environment. Always a new value: a pytest run by a test is a session of
    its own, and sessions running side by side never see each other's tag."""
    if _is_controller(config):
        os.environ[SESSION_TAG_VAR] = f"{uuid.uuid4().hex}:{os.getpid()}"


def session_leftovers(tag: str) -> list[Ident]:
    """One /proc scan: the live processes carrying ``tag`` in their environment, and every
    descendant of those or of this process (one that replaced or cleared its environment
    is still found by its parentage); never this process or one of its ancestors."""
    me = psutil.Process()
    exempt = {me.pid, *(p.pid for p in me.parents())}
    children: dict[int, list[psutil.Process]] = {}
    roots: list[psutil.Process] = []
    for p in psutil.process_iter(["ppid"]):
        if p.pid in exempt:
            continue
        children.setdefault(p.info["ppid"], []).append(p)
        try:
            if p.environ().get(SESSION_TAG_VAR) == tag:
                roots.append(p)
        except (psutil.Error, OSError):
            continue
    found: dict[int, psutil.Process] = {}
    todo = [*roots, *children.get(me.pid, [])]
    while todo:
        p = todo.pop()
        if p.pid not in found:
            found[p.pid] = p
            todo.extend(children.get(p.pid, []))
    out = []
    for p in found.values():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(Ident((p.pid, p.create_time())))
        except psutil.Error:
            continue
    return sorted(out)


def _describe(ident: Ident) -> str:
    try:
        return f"pid {ident.pid}: {' '.join(psutil.Process(ident.pid).cmdline())[:200]}"
    except psutil.Error:
        return f"pid {ident.pid}: (gone)"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """In the controller, after xdist has stopped its workers: kill, by identity, whatever
    of this session is still alive, say what it was, and fail the session. A test's own
    teardown should have ended it; this is the net for what no test saw."""
    tag = os.environ.get(SESSION_TAG_VAR)
    if not _is_controller(session.config) or not tag:
        return
    left = session_leftovers(tag)
    if not left:
        return
    lines = [f"{len(left)} process(es) of this session left behind (killed now):",
             *(f"  {_describe(i)}" for i in left)]
    kill_all(left)
    _wait_for_end(left, 5)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
