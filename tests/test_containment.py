"""Containment (orchestrator/containment.py): a cgroup per replica, or process groups.

Part 1 drives the engine over tests/fakes.py's FakeOS with a fake cgroup containment:
a replica whose main process is reaped ends only once its cgroup is empty (bounded), its
cgroup is removed and the watchdog told; the OOM reason; limits refused in one line; the
stop signal to the cgroup's members; a reaped pid reused while a cgroup drains.

Part 2 is the real cgroupfs: the reactor's EPOLLPRI readers and ``Cgroups.watch_empty``, a
child that cannot join its cgroup, the embedded API with ``cgroup="auto"``.

Part 3 is the daemon through the CLI, in both modes (``--cgroup auto`` where this process
may create cgroups, else skipped with the reason; ``--cgroup off``): a replica whose
descendants setsid, setpgid, double-fork, run under ``timeout`` and ``set -m`` and rewrite
their title and environment (tests/containment_tree.py); terminate, kill -9 of the daemon,
kill -9 of the daemon and its watchdog together then ``start``. Where process groups cannot
reach a descendant, the test is an ``xfail(strict=True, raises=Survived)``: the limit is
stated by the test, exactly (more survivors than documented is a real failure, none is an
XPASS that fails too).

Every test removes what it made: processes by identity (pid, create time), and its daemon's
cgroup subtree, which must be gone at the end (``*orchestrator*`` under the cgroup2 mount).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from containment_tree import DISGUISED, ROLES
from helpers import DaemonUnderTest, Ident, cgroup_unusable, cli, cli_json, kill_all, survivors, wait_for
from orchestrator import Orchestrator
from orchestrator.daemon.containment import Cgroups, detect, subtree_name
from orchestrator.daemon.engine import Engine, EngineConfig
from orchestrator.daemon.reactor import Reactor
from orchestrator.daemon.osapi import OSApi
from fakes import SPEC, FakeOS, Harness
from watchdog import cgroup

pytestmark = pytest.mark.timeout(120)
TREE = Path(__file__).resolve().parent / "containment_tree.py"


# -- where cgroups can be tested ----------------------------------------------------------


UNUSABLE = cgroup_unusable()
needs_cgroups = pytest.mark.skipif(UNUSABLE is not None, reason=f"no writable cgroup2 here: {UNUSABLE}")


def cgroup_mode():
    """The ``cgroup`` case of a mode parametrization: skipped, with the reason, where the
    daemon could not make cgroups."""
    return pytest.param("cgroup", id="cgroup", marks=needs_cgroups)


def _remove_subtree(path: str) -> None:
    """Kill and remove a subtree a test's daemon left (only ever that one)."""
    assert cgroup.MARK in os.path.basename(path)
    try:
        tree = cgroup.Subtree.open(path)
    except cgroup.CgroupUnavailable:
        tree = cgroup.Subtree(path)
    tree.kill_all(timeout=5)
    tree.destroy()


# -- part 1: the engine over a fake OS and a fake cgroup containment -----------------------


class FakeCgroups(Cgroups):
    """Cgroups' bookkeeping over no cgroupfs: members and emptiness are the test's to set."""

    def __init__(self, controllers: frozenset[str] = frozenset()) -> None:
        self.path = "/fake/orchestrator-test"
        self.reason = "fake"
        self.controllers = controllers
        self.reactor = None
        self.calls: list[tuple] = []
        self.members: dict[str, list[int]] = {}
        self.watches: dict[str, object] = {}
        self.oom: set[str] = set()
        self.fail_prepare: Exception | None = None

    def prepare(self, replica_id: str, limits=None) -> str:
        if self.fail_prepare is not None:
            raise self.fail_prepare
        path = f"{self.path}/replicas/{replica_id}"
        self.calls.append(("prepare", replica_id, dict(limits or {})))
        self.members[path] = []
        return path

    def signal(self, path: str, sig: int) -> list[int]:
        self.calls.append(("signal", path, sig))
        return list(self.members.get(path, []))

    def kill(self, path: str) -> str:
        self.calls.append(("kill", path))
        return "cgroup.kill"

    def watch_empty(self, path, callback, timeout=3.0) -> None:
        self.calls.append(("watch", path))
        self.watches[path] = callback

    def empty(self, path: str, empty: bool = True) -> None:
        self.watches.pop(path)(empty)

    def remove(self, path: str) -> str:
        self.calls.append(("remove", path))
        self.members.pop(path, None)
        return "removed"

    def oom_killed(self, path: str) -> bool:
        return path in self.oom

    def close(self) -> bool:
        return True


class FakeLink:
    def __init__(self) -> None:
        self.lines: list[tuple] = []

    def add(self, pid, start, pgid, kind="worker", label="") -> None:
        self.lines.append(("A", pid))

    def remove(self, pid) -> None:
        self.lines.append(("R", pid))

    def add_cgroup(self, path) -> None:
        self.lines.append(("G", path))

    def remove_cgroup(self, path) -> None:
        self.lines.append(("U", path))


@pytest.fixture
def cg_h(fake: FakeOS):
    """A Harness whose engine uses FakeCgroups and a FakeLink watchdog feed."""
    harness = Harness(fake)
    harness.cg = FakeCgroups()
    harness.link = harness.engine.watchdog = FakeLink()
    harness.engine.containment = harness.cg
    harness.cg.attach(harness.engine.reactor, fake, harness.link)
    plans = []
    spawn = fake.spawn
    fake.spawn = lambda plan, via=None: (plans.append(plan), spawn(plan, via))[1]
    harness.plans = plans
    try:
        yield harness
    finally:
        harness.engine.close()


def test_a_replica_ends_only_once_its_cgroup_is_empty(cg_h, fake):
    (rid,) = cg_h.running()
    pid = fake.pid()
    path = f"{cg_h.cg.path}/replicas/{rid}"
    assert cg_h.plans[-1].cgroup == path  # the child joins it before anything else
    assert ("G", path) in cg_h.link.lines
    box = cg_h.send("wait", ids=[rid], until="ended", timeout=30)
    fake.exit(pid, 0)
    cg_h.turn()
    # Reaped, its remnants killed through the cgroup (never its group: that is the
    # process-group design), but not ended: something of it may still run.
    assert fake.procs[pid].reaped and fake.signals_to(pid) == []
    assert ("kill", path) in cg_h.cg.calls and path in cg_h.cg.watches
    row = cg_h.rep(rid)
    assert row["state"] == "RUNNING" and row["pid"] == pid and box == []
    assert ("R", pid) in cg_h.link.lines and ("U", path) not in cg_h.link.lines
    cg_h.cg.empty(path)
    cg_h.turn()
    row = cg_h.rep(rid)
    assert (row["state"], row["pid"], row["reason"]) == ("EXITED", None, "exit code 0")
    assert ("remove", path) in cg_h.cg.calls and cg_h.link.lines[-1] == ("U", path)
    assert len(box) == 1 and box[0]["ok"]
    assert fake.violations == []


def test_a_cgroup_that_does_not_empty_ends_its_replica_anyway(cg_h, fake, caplog):
    (rid,) = cg_h.running()
    path = f"{cg_h.cg.path}/replicas/{rid}"
    fake.exit(fake.pid(), -9)
    cg_h.turn()
    cg_h.cg.empty(path, empty=False)  # what Cgroups.watch_empty does after DRAIN_TIMEOUT
    cg_h.turn()
    assert cg_h.state(rid) == "FAILED"
    assert "still holds processes" in caplog.text


def test_oom_kill_in_the_cgroup_is_the_reason(cg_h, fake):
    (rid,) = cg_h.running()
    path = f"{cg_h.cg.path}/replicas/{rid}"
    cg_h.cg.oom.add(path)
    fake.exit(fake.pid(), -signal.SIGKILL)
    cg_h.turn()
    cg_h.cg.empty(path)
    cg_h.turn()
    row = cg_h.rep(rid)
    assert (row["state"], row["reason"], row["exit_code"]) == ("FAILED", "OOM-killed", -signal.SIGKILL)


def test_terminate_signals_the_cgroup_and_a_child_not_in_it_yet(cg_h, fake):
    (a, b) = cg_h.running(count=2)
    pa, pb = fake.pid(0), fake.pid(1)
    path_a, path_b = (f"{cg_h.cg.path}/replicas/{r}" for r in (a, b))
    cg_h.cg.members[path_a] = [pa, 777]  # joined, and a descendant of its own
    cg_h.ok("terminate", ids=[a, b])
    assert ("signal", path_a, signal.SIGTERM) in cg_h.cg.calls
    assert ("signal", path_b, signal.SIGTERM) in cg_h.cg.calls
    # a's main process got it through its cgroup, so not twice; b's had not joined yet
    # (forked, before its write to cgroup.procs): it alone, through its group.
    assert fake.signals_to(pa) == [] and fake.signals_to(pb) == [(signal.SIGTERM, "alive")]
    fake.now += 5.0  # the grace: SIGKILL is cgroup.kill (and the main pid, in case)
    cg_h.turn()
    assert ("kill", path_a) in cg_h.cg.calls
    assert fake.signals_to(pa) == [(signal.SIGKILL, "alive")]


def test_a_reused_pid_during_a_drain_does_not_redirect_signals(cg_h, fake):
    (a,) = cg_h.running()
    pa = fake.pid()
    fake.exit(pa, 0)
    cg_h.turn()
    assert cg_h.rep(a)["pid"] == pa  # draining: reaped, its pid still shown
    fake._next_pid = pa  # the kernel hands the number out again
    (b,) = cg_h.running()
    assert cg_h.rep(b)["pid"] == pa
    cg_h.ok("terminate", ids=[a])  # a is RUNNING still: it becomes STOPPING, nothing to signal
    cg_h.ok("signal", signal="HUP", ids=[a])
    assert fake.signals_to(pa) == []
    assert all(c[1] != f"{cg_h.cg.path}/replicas/{b}" for c in cg_h.cg.calls if c[0] == "signal")
    cg_h.cg.empty(f"{cg_h.cg.path}/replicas/{a}")
    cg_h.turn()
    assert cg_h.state(a) == "TERMINATED" and cg_h.state(b) == "RUNNING"
    assert fake.violations == []


def test_shutdown_waits_for_draining_cgroups(cg_h, fake):
    (rid,) = cg_h.running()
    fake.procs[fake.pid()].on_term = "die"
    original = cg_h.cg.watch_empty

    def watch_and_empty(p, callback, timeout=3.0):  # empty a turn later, as the kernel says
        original(p, callback, timeout)
        cg_h.engine.reactor.call_soon(lambda: cg_h.cg.empty(p))

    cg_h.cg.watch_empty = watch_and_empty
    cg_h.engine.shutdown()
    assert cg_h.state(rid) == "TERMINATED" and not cg_h.engine._draining


def test_limits_are_refused_in_one_line_where_they_cannot_hold(cg_h, fake, make_h):
    reply = cg_h.cmd("launch", pool="web", spec=SPEC, policy={"memory_max": "64M"})
    assert not reply["ok"] and reply["error"].count("\n") == 0
    assert "memory_max needs the cgroup memory controller" in reply["error"]
    cg_h.cg.controllers = frozenset({"memory", "pids"})
    cg_h.ok("launch", pool="web", spec=SPEC, policy={"memory_max": "64M", "pids_max": 20})
    assert cg_h.cg.calls[-1] == ("prepare", "web-1", {"memory_max": 64 << 20, "pids_max": 20})
    reply = cg_h.cmd("launch", pool="cpu", spec=SPEC, policy={"cpu_weight": 100})
    assert "cpu_weight needs the cgroup cpu controller" in reply["error"]
    pg = make_h()
    reply = pg.cmd("launch", pool="web", spec=SPEC, policy={"pids_max": 5})
    assert not reply["ok"] and "pids_max needs cgroup containment" in reply["error"]
    assert "process groups" in reply["error"]


def test_a_cgroup_that_cannot_be_made_is_a_start_failure(cg_h, fake):
    cg_h.cg.fail_prepare = cgroup.CgroupUnavailable("cannot create the cgroup /x: no space left on device")
    (rid,) = cg_h.launch()
    cg_h.turn()
    row = cg_h.rep(rid)
    assert row["state"] == "FAILED"
    assert row["reason"] == "could not start: cannot create the cgroup /x: no space left on device"
    assert fake.order == []  # nothing forked


# -- part 2: the real cgroupfs ---------------------------------------------------------------


@pytest.fixture
def outer():
    """A plain cgroup of this test's own under this process's (removed whole after)."""
    if UNUSABLE:
        pytest.skip(f"no writable cgroup2 here: {UNUSABLE}")
    path = os.path.join(cgroup.own_path(), f"orchestrator-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    try:
        yield path
    finally:
        _remove_subtree_dir(path)
        assert not os.path.exists(path)


def _remove_subtree_dir(path: str) -> None:
    cgroup.kill(path)
    cgroup.wait_unpopulated([path], 10)
    assert cgroup.remove(path) == "removed"


@needs_cgroups
def test_watch_empty_is_an_event_not_a_spin(outer):
    import subprocess

    reactor = Reactor()
    tree = cgroup.Subtree.create(outer, "orchestrator-w", move_self=False)
    cg = Cgroups(tree, "test", moved_self=False)
    cg.attach(reactor, OSApi())
    path = cg.prepare("r-1")
    proc = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: cgroup.join(path))
    try:
        results: list[bool] = []
        cg.watch_empty(path, results.append, timeout=10)
        turns = 0
        for _ in range(5):  # nothing changes: the loop must not wake for the fd
            reactor.run_once(0.02)
            turns += 1
        assert results == []
        t0 = time.monotonic()
        cg.kill(path)
        while not results and time.monotonic() - t0 < 5:
            reactor.run_once(1.0)
            turns += 1
        assert results == [True], "cgroup.events did not report the cgroup empty"
        assert turns <= 5 + 4, f"{turns} turns: the events fd is spinning the loop"
        assert proc.wait(5) == -signal.SIGKILL
        assert cg.remove(path) == "removed"
        # An empty (or missing) cgroup: at once.
        cg.watch_empty(path, results.append)
        assert results == [True, True]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reactor.close()
        assert cg.close() is True
    assert not os.path.exists(tree.path)


def test_a_child_that_cannot_join_its_cgroup_could_not_start(tmp_path):
    class Bogus(Cgroups):
        """Real cgroup mechanics, handing out a cgroup that does not exist."""

        def __init__(self) -> None:
            super().__init__(cgroup.Subtree(str(tmp_path / "orchestrator-bogus")), "test", moved_self=False)

        def prepare(self, replica_id, limits=None):
            return str(tmp_path / "no-such-cgroup")

    engine = Engine(EngineConfig(grace=1.0), containment=Bogus())
    try:
        replies: list[dict] = []
        engine.handle({"id": 1, "op": "launch", "args": {"pool": "p", "spec": SPEC, "policy": {"restart": "never"}}},
                      replies.append)
        engine.reactor.run_until(lambda: engine._replicas["p-1"].state.terminal and not engine._procs
                                 and not engine._draining, 10)
        rep = engine._replicas["p-1"]
        assert rep.state.name == "FAILED"
        assert rep.reason == f"could not start: cannot join cgroup {tmp_path}/no-such-cgroup: No such file or directory"
    finally:
        engine.shutdown()
        engine.close()


@needs_cgroups
def test_embedded_api_with_cgroups(tmp_path):
    prefix = tmp_path / "tree"
    with Orchestrator(grace=1.0, cgroup="auto") as orch:
        assert orch.containment.mode == "cgroup"
        subtree = orch.containment.path
        assert os.path.dirname(subtree) == cgroup.own_path()  # this process stays where it is
        (rid,) = orch.launch("tree", [sys.executable, str(TREE), str(prefix)], wait=True)
        members = read_members(prefix, rid)
        assert all(cgroup.own_path(m.pid) == os.path.join(subtree, "replicas", rid) for m in members.values())
        orch.terminate(rid, wait=True)
        assert not survivors(members.values())
        assert not os.path.exists(os.path.join(subtree, "replicas", rid))
    assert not os.path.exists(subtree)


# -- part 3: the daemon, in both modes ---------------------------------------------------------


class Survived(Exception):
    """Members of a replica's tree outlived what should have ended them."""


LIMIT_TERMINATE = {"orphan"}
LIMIT_KILL = {"setsid", "setpgid", "orphan"}
LIMIT_BOTH_KILLED = {"setsid", "setpgid", "orphan", "timeout", "timeout-wrapper"}
WHY_TERMINATE = ("process groups: a double-forked descendant is re-parented to the daemon (a subreaper) before "
                 "the terminate, so no walk down from the replica finds it; only the daemon's clean stop ends it")
WHY_KILL = ("process groups: the replica's main process dies with the daemon (PDEATHSIG), so its descendants "
            "are orphans before the watchdog walks the tree; those in a group of their own without the token are "
            "out of its reach")
WHY_BOTH = ("process groups: with the watchdog killed too, start's recovery finds only the recorded replicas' "
            "groups; descendants in a group of their own that rewrote their environment are unreachable")


def pg_limit(why: str):
    """The ``process-group`` case of a test that states a documented limit of that mode."""
    return pytest.param("process-group", id="process-group",
                        marks=pytest.mark.xfail(strict=True, raises=Survived, reason=why))


def read_members(prefix: Path, rid: str, timeout: float = 20.0) -> dict[str, Ident]:
    """Wait until replica ``rid``'s tree has announced every member; role -> identity."""
    path = Path(f"{prefix}.{rid}")

    def complete() -> bool:
        return path.exists() and len(path.read_text().splitlines()) >= len(ROLES)

    wait_for(complete, timeout, f"the members of {rid}")
    members = {}
    for line in path.read_text().splitlines():
        role, pid = line.split()
        ident = Ident.of(int(pid))
        assert ident is not None, f"{role} {pid} is gone already"
        members[role] = ident
    assert set(members) == set(ROLES)
    return members


def check_survivors(members: dict[str, Ident], mode: str, limit: set[str]) -> None:
    left = {role for role, ident in members.items() if ident.alive()}
    if mode == "process-group":
        assert left <= limit, f"more survived than the documented limit: {sorted(left - limit)}"
    if left:
        raise Survived(sorted(left))


class Tree:
    """A daemon in one mode, the escaping trees it runs, and the clean-up of all of it."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.mode = mode
        self.daemon = DaemonUnderTest(tmp_path / "state")
        self.prefix = tmp_path / "tree"
        self.members: dict[str, dict[str, Ident]] = {}
        own = cgroup.own_path()
        self.subtree = os.path.join(own, subtree_name(self.daemon.state_dir)) if own else None

    def start(self) -> dict:
        self.daemon.start("--cgroup", "auto" if self.mode == "cgroup" else "off", "--grace", "2")
        return self.daemon.status()["daemon"]

    def launch(self, count: int = 1) -> list[str]:
        proc = cli(self.daemon.state_dir, "launch", "--pool", "tree", "--count", str(count), "--wait",
                   "--", sys.executable, str(TREE), str(self.prefix))
        assert proc.returncode == 0, proc.stderr
        ids = proc.stdout.split()
        for rid in ids:
            self.members[rid] = read_members(self.prefix, rid)
        return ids

    def everyone(self) -> list[Ident]:
        return [i for tree in self.members.values() for i in tree.values()]

    def teardown(self) -> None:
        left = self.daemon.teardown()  # every test here ends with a clean stop
        stragglers = survivors(self.everyone())
        kill_all(stragglers)
        leftover_dir = self.subtree is not None and os.path.exists(self.subtree)
        if leftover_dir:
            _remove_subtree(self.subtree)
        # (In process-group mode a documented limit leaves stragglers: the tests say so.)
        assert not left and (not stragglers or self.mode == "process-group"), \
            f"processes left behind: {left} {stragglers}"
        assert not leftover_dir and self.daemon.removed_subtree is None, \
            f"the daemon left its cgroup subtree {self.subtree or self.daemon.removed_subtree}"


@pytest.fixture
def make_tree(tmp_path: Path):
    made: list[Tree] = []

    def make(mode: str) -> Tree:
        made.append(Tree(tmp_path, mode))
        return made[-1]

    try:
        yield make
    finally:
        for t in made:
            t.teardown()


@pytest.mark.parametrize("mode", [cgroup_mode(), "process-group"])
def test_status_says_which_containment_and_why(make_tree, mode):
    t = make_tree(mode)
    daemon = t.start()
    assert daemon["containment"] == mode
    assert daemon["containment_reason"] and "\n" not in daemon["containment_reason"]
    record = t.daemon.state_dir / "cgroup"
    if mode == "cgroup":
        assert daemon["cgroup_subtree"] == t.subtree and os.path.isdir(t.subtree)
        assert cgroup.own_path(daemon["pid"]) == os.path.join(t.subtree, "daemon")  # a leaf of its own
        assert cgroup.own_path(daemon["watchdog_pid"]) == os.path.join(t.subtree, "daemon")
        assert record.read_text().strip() == t.subtree and (record.stat().st_mode & 0o777) == 0o600
        log = (t.daemon.state_dir / "logs" / "daemon.log").read_text()
        assert "containment: cgroup" in log
    else:
        assert daemon["containment_reason"] == "--cgroup off" and daemon["cgroup_subtree"] is None
        assert not record.exists()
    (rid,) = t.launch()
    if mode == "cgroup":
        where = os.path.join(t.subtree, "replicas", rid)
        assert {cgroup.own_path(i.pid) for i in t.members[rid].values()} == {where}
    assert cli(t.daemon.state_dir, "stop").returncode == 0
    assert not record.exists() and not (t.subtree and os.path.exists(t.subtree))


@pytest.mark.parametrize("mode", [cgroup_mode(), pg_limit(WHY_TERMINATE)])
def test_terminate_ends_the_whole_tree(make_tree, mode):
    t = make_tree(mode)
    t.start()
    (rid,) = t.launch()
    assert cli(t.daemon.state_dir, "terminate", "--wait", "--timeout", "30", rid).returncode == 0
    # --wait returns once the replica has ended: in cgroup mode, once its cgroup is empty.
    row = cli_json(t.daemon.state_dir, "status", "--all")["replicas"][0]
    assert (row["state"], row["pid"]) == ("TERMINATED", None)
    if mode == "cgroup":
        assert not os.path.exists(os.path.join(t.subtree, "replicas", rid))  # removed
    check_survivors(t.members[rid], mode, LIMIT_TERMINATE)


@pytest.mark.parametrize("mode", [cgroup_mode(), pg_limit(WHY_KILL)])
def test_kill_9_of_the_daemon_ends_the_whole_tree(make_tree, mode):
    t = make_tree(mode)
    daemon = t.start()
    ids = t.launch(count=2)
    report = t.daemon.state_dir / "watchdog-report.json"
    os.kill(daemon["pid"], signal.SIGKILL)
    wait_for(report.exists, 30, "the watchdog's report")
    if mode == "cgroup":
        records = json.loads(report.read_text())["cgroups"]
        assert sorted(r["path"] for r in records) == [os.path.join(t.subtree, "replicas", r) for r in ids]
        assert all(r["kill"] == "cgroup.kill" and r["populated"] is False and r["removed"] == "removed"
                   for r in records), records
    try:
        for rid in ids:
            check_survivors(t.members[rid], mode, LIMIT_KILL)
    finally:
        # The next start records them LOST; its clean stop removes the subtree.
        t.start()
        rows = {r["id"]: r for r in cli_json(t.daemon.state_dir, "status", "--all")["replicas"]}
        assert all(rows[rid]["state"] == "LOST" for rid in ids)


@pytest.mark.parametrize("mode", [cgroup_mode(), pg_limit(WHY_BOTH)])
def test_kill_9_of_daemon_and_watchdog_then_start_ends_the_whole_tree(make_tree, mode):
    t = make_tree(mode)
    daemon = t.start()
    ids = t.launch(count=2)
    pids = (daemon["pid"], daemon["watchdog_pid"])
    for pid in pids:  # both stopped first, so that neither sees the other die
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(Ident.of(p) and Ident.of(p).alive() for p in pids), 10, "the daemon and watchdog")
    assert not (t.daemon.state_dir / "watchdog-report.json").exists()
    t.start()  # returns once the daemon accepts commands: recovery is over by then
    left = {role for rid in ids for role, ident in t.members[rid].items() if ident.alive()}
    rows = {r["id"]: r for r in cli_json(t.daemon.state_dir, "status", "--all")["replicas"]}
    assert all(rows[rid]["state"] == "LOST" for rid in ids), rows
    # The pool is back at its size with new replicas; a clean stop ends their trees too.
    new = [rid for rid, r in rows.items() if r["state"] == "RUNNING"]
    assert len(new) == 2
    for rid in new:
        t.members[rid] = read_members(t.prefix, rid)
    if mode == "process-group":
        assert left <= LIMIT_BOTH_KILLED, f"more survived than the documented limit: {sorted(left - LIMIT_BOTH_KILLED)}"
    if left:
        raise Survived(sorted(left))


@pytest.mark.parametrize("mode", [cgroup_mode(), "process-group"])
def test_clean_stop_ends_every_tree(make_tree, mode):
    t = make_tree(mode)
    t.start()
    t.launch(count=2)
    assert cli(t.daemon.state_dir, "stop", "--timeout", "30").returncode == 0
    # Adopted orphans are ended at a clean stop in process-group mode too.
    wait_for(lambda: not survivors(t.everyone()), 5 if mode == "process-group" else 0.5, "every member to end")


@pytest.mark.parametrize("mode", [cgroup_mode(), "process-group"])
def test_limits_without_a_controller_are_refused_in_one_line(make_tree, mode):
    t = make_tree(mode)
    t.start()
    for flag, value, key in (("--memory-max", "64M", "memory_max"), ("--pids-max", "20", "pids_max"),
                             ("--cpu-weight", "50", "cpu_weight")):
        controller = cgroup.LIMITS[key][1]
        if mode == "cgroup" and controller in set(Path(t.subtree, "replicas", "cgroup.subtree_control").read_text().split()):
            proc = cli(t.daemon.state_dir, "launch", "--pool", f"lim-{controller}", flag, value, "--wait",
                       "--", "sleep", "300")
            assert proc.returncode == 0, proc.stderr
            (rid,) = proc.stdout.split()
            written = Path(t.subtree, "replicas", rid, cgroup.LIMITS[key][0]).read_text().strip()
            assert written == (str(64 << 20) if key == "memory_max" else value)
            continue
        proc = cli(t.daemon.state_dir, "launch", "--pool", f"lim-{controller}", flag, value, "--", "sleep", "300")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert key in lines[0]
        assert (controller in lines[0]) if mode == "cgroup" else ("process groups" in lines[0])


@needs_cgroups
def test_oom_kill_gives_the_reason(make_tree):
    t = make_tree("cgroup")
    t.start()
    controllers = Path(t.subtree, "replicas", "cgroup.subtree_control").read_text().split()
    if "memory" not in controllers:
        pytest.skip("the cgroup2 memory controller is not enabled here (cgroup.controllers of the daemon's "
                    "parent lacks it): OOM-killed is covered by the fake-cgroup engine test only")
    proc = cli(t.daemon.state_dir, "launch", "--pool", "hog", "--memory-max", "32M", "--restart", "never", "--",
               sys.executable, "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))")
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: cli_json(t.daemon.state_dir, "status", "--all")["replicas"][0]["state"] == "FAILED", 30,
             "the OOM kill")
    assert cli_json(t.daemon.state_dir, "status", "--all")["replicas"][0]["reason"] == "OOM-killed"


def test_an_unusable_cgroup_path_is_one_line(tmp_path):
    state = tmp_path / "state"
    for bad in ("relative/orchestrator", str(tmp_path), "/sys/fs/cgroup/../cgroup"):
        proc = cli(state, "start", "--cgroup", bad)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and f"--cgroup {bad}" in lines[0], proc.stderr
    assert cli(state, "status").returncode == 3


def test_detect_off_and_auto():
    assert detect("off", "/tmp/x").mode == "process-group"
    assert detect("off", "/tmp/x").reason == "--cgroup off"
    assert subtree_name("/a/b") == subtree_name("/a/b/") != subtree_name("/a/c")
    assert subtree_name("/a/b").startswith("orchestrator-") and len(subtree_name("/a/b")) == len("orchestrator-") + 12


def test_auto_falls_back_to_process_groups_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "require_own_path", lambda: str(tmp_path))  # a plain dir: no cgroupfs
    chosen = detect("auto", tmp_path / "state")
    assert chosen.mode == "process-group"
    assert chosen.reason == f"no usable cgroup2: {tmp_path} is not a cgroup2 directory"
    assert os.listdir(tmp_path) == []  # nothing made
    with pytest.raises(Exception, match="--cgroup .*not a normalised absolute path under the cgroup2 mount"):
        detect(str(tmp_path), tmp_path / "state")


@needs_cgroups
def test_start_under_a_given_cgroup_path(tmp_path):
    outer = os.path.join(cgroup.own_path(), f"orchestrator-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(outer)
    d = DaemonUnderTest(tmp_path / "state")
    try:
        d.start("--cgroup", outer)
        daemon = d.status()["daemon"]
        assert daemon["containment"] == "cgroup"
        assert daemon["cgroup_subtree"] == os.path.join(outer, subtree_name(d.state_dir))
        assert cgroup.own_path(daemon["pid"]) == os.path.join(daemon["cgroup_subtree"], "daemon")
        assert cli(d.state_dir, "stop").returncode == 0
        assert not [e.name for e in os.scandir(outer) if e.is_dir()]  # the subtree is gone
    finally:
        left = d.teardown()
        _remove_subtree_dir(outer)
    assert not left and d.removed_subtree is None
