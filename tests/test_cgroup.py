"""Tests of watchdog/cgroup.py (cgroup v2 containment) and the watchdog's use of it.

The parsing and protocol tests run anywhere. The rest work on the real cgroupfs and skip,
with the reason, where this process cannot create a cgroup under its own (probed by making
and removing ``orchestrator-test-<pid>-<random>``).

Rules these tests keep, because they run in parallel (pytest-xdist) beside other work:
each test makes its own uniquely named subtree under this process's cgroup, and the
``subtree`` fixture always kills and removes everything under it (never the test process
itself: it is never moved into a test cgroup); nothing is signalled but processes this
test started, found by identity ``(pid, start)`` or by membership of a cgroup this test
made; every wait is bounded and waits on an event (pidfds, cgroup.events, pipes).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from watchdog import cgroup  # noqa: E402
from watchdog.cgroup import CgroupUnavailable, Subtree  # noqa: E402
from watchdog.identity import proc_stat, start_time  # noqa: E402
from watchdog.ledger import Ledger, encode_add_cgroup, encode_remove_cgroup  # noqa: E402
from watchdog.link import WatchdogLink  # noqa: E402
from helpers import OwnedProcesses, cgroup_unusable, read_lines, reap_child, wait_gone  # noqa: E402

PROGRAMS = Path(__file__).resolve().parent / "test_cgroup_parent.py"
TREE_ROLES = {"root", "setsid", "orphan", "timeout", "job"}
REPORT = "watchdog-report.json"

HYBRID = textwrap.dedent(
    r"""
    22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
    31 22 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
    32 31 0:29 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
    33 31 0:30 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
    35 31 0:32 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,memory
    """
)
PURE_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
# No optional field at all, a mount point with a space, a root that is a subtree.
ESCAPED = "40 31 0:38 /lxc/c1 /mnt/my\\040cgroups rw,relatime - cgroup2 none rw\n"
V1_ONLY = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:15 - cgroup cgroup rw,memory\n"
# A v1 "mount point" that contains " - " (escaped as \040-\040 by the kernel) must not fool
# the separator search.
TRICKY = "50 31 0:40 / /tmp/a\\040-\\040cgroup2 rw,relatime - tmpfs tmpfs rw\n"


# -- fixtures ---------------------------------------------------------------------------


def _unique_name() -> str:
    return f"orchestrator-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_everything(path: str) -> None:
    """Kill and remove the cgroup ``path`` and all below it: only ever one a test made."""
    assert cgroup.MARK in os.path.basename(path)
    own = cgroup.own_path()
    assert own is not None and not (own == path or own.startswith(path + "/")), "the test process is inside"
    if not os.path.isdir(path):
        return
    cgroup.kill(path)
    still = cgroup.wait_unpopulated([path], 10)
    status = cgroup.remove(path)
    assert not still and status == "removed", f"could not clean up {path}: {status}"


@pytest.fixture
def subtree():
    """A fresh Subtree (the test process stays where it is); all of it removed after.

    It is made inside a plain cgroup of the test's own (``own/orchestrator-test-.../``), so
    the controllers Subtree.create enables "along the way" are enabled in that dir, never in
    this process's cgroup, which other work on the machine shares.
    """
    reason = cgroup_unusable()
    if reason:
        pytest.skip(f"no writable cgroup2 here: {reason}")
    outer = os.path.join(cgroup.own_path(), _unique_name())
    os.mkdir(outer)
    try:
        yield Subtree.create(outer, "orchestrator-subtree", move_self=False)
    finally:
        _remove_everything(outer)
        assert not os.path.exists(outer)


@pytest.fixture
def owned():
    registry = OwnedProcesses()
    try:
        yield registry
    finally:
        registry.teardown()


def start_in(owned: OwnedProcesses, path: str, args: list[str], **kwargs) -> subprocess.Popen:
    """Start ``args`` inside the cgroup ``path``: the child joins it between fork and exec,
    as the daemon's spawner does."""
    return owned.popen(args, preexec_fn=functools.partial(cgroup.join, path), **kwargs)


def start_tree(owned: OwnedProcesses, path: str) -> tuple[subprocess.Popen, dict[str, int], set[tuple[int, int]]]:
    """The escaping tree of test_cgroup_parent.py in ``path``: (root, role -> pid, members)."""
    ready_r, ready_w = os.pipe()
    try:
        root = start_in(
            owned, path, [sys.executable, str(PROGRAMS), "tree", str(ready_w)],
            pass_fds=(ready_w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        )  # fmt: skip
        os.close(ready_w)
        ready_w = -1
        lines = read_lines(ready_r, len(TREE_ROLES))
    finally:
        if ready_w >= 0:
            os.close(ready_w)
        os.close(ready_r)
    roles = {role: int(pid) for role, pid in (line.split() for line in lines)}
    assert set(roles) == TREE_ROLES
    members = {(pid, start_time(pid)) for _where, pid in cgroup._members(path)}
    owned.identities |= members
    return root, roles, members


def alive(identity: tuple[int, int]) -> bool:
    st = proc_stat(identity[0])
    return st is not None and st.start_time == identity[1] and st.state not in ("Z", "X")


def events_ready(fd: int, timeout: float) -> bool:
    poller = select.epoll()  # the daemon's loop is an epoll: measure what it will see
    try:
        poller.register(fd, select.EPOLLPRI)
        return bool(poller.poll(timeout))
    finally:
        poller.close()


# -- parsing, pure --------------------------------------------------------------------


def test_find_mount_reads_the_fstype_after_the_separator():
    assert cgroup.find_mount(HYBRID) == "/sys/fs/cgroup/unified"
    assert cgroup.find_mount(PURE_V2) == "/sys/fs/cgroup"
    assert cgroup.find_mount(ESCAPED) == "/mnt/my cgroups"
    assert cgroup._parse_mount(ESCAPED) == ("/lxc/c1", "/mnt/my cgroups")
    assert cgroup.find_mount(V1_ONLY) is None
    assert cgroup.find_mount(TRICKY) is None
    assert cgroup.find_mount(TRICKY + HYBRID) == "/sys/fs/cgroup/unified"
    assert cgroup.find_mount("") is None


def test_find_mount_on_this_host_is_a_cgroup2_mount():
    mount = cgroup.find_mount()
    if mount is None:
        pytest.skip("no cgroup2 mount here")
    assert os.path.isfile(os.path.join(mount, "cgroup.procs"))
    # Never assumed: on this kind of (hybrid) host it is not /sys/fs/cgroup.
    lines = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if " - cgroup2 " in line]
    assert lines and cgroup._unescape(lines[0].split()[4]) == mount


def test_own_path_joins_the_0_line_onto_the_mount():
    hybrid = "12:pids:/user.slice\n1:name=systemd:/user.slice/x.scope\n0::/user.slice/x.scope\n"
    assert cgroup._parse_proc_cgroup(hybrid) == "/user.slice/x.scope"
    assert cgroup._parse_proc_cgroup("4:memory:/a\n") is None
    assert cgroup._parse_proc_cgroup("0::/a/b (deleted)\n") == "/a/b"
    assert cgroup._on_mount(("/", "/sys/fs/cgroup/unified"), "/") == "/sys/fs/cgroup/unified"
    assert cgroup._on_mount(("/", "/sys/fs/cgroup"), "/a/b") == "/sys/fs/cgroup/a/b"
    # A mount showing only /lxc/c1 of the hierarchy.
    assert cgroup._on_mount(("/lxc/c1", "/mnt/cg"), "/lxc/c1/app") == "/mnt/cg/app"
    assert cgroup._on_mount(("/lxc/c1", "/mnt/cg"), "/lxc/c1") == "/mnt/cg"
    assert cgroup._on_mount(("/lxc/c1", "/mnt/cg"), "/lxc/c10") is None
    if cgroup.find_mount() is None:
        return
    mine = cgroup.own_path()
    assert mine == cgroup.own_path(os.getpid()) == cgroup.require_own_path()
    assert mine is not None and mine.startswith(cgroup.find_mount())
    assert os.path.isfile(os.path.join(mine, "cgroup.procs"))
    assert cgroup.own_path(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1) is None


def test_refusal_keeps_the_watchdog_to_orchestrator_cgroups():
    mount, own = "/sys/fs/cgroup/unified", "/sys/fs/cgroup/unified/system.slice/orchestrator-d/daemon"
    ok = "/sys/fs/cgroup/unified/system.slice/orchestrator-d/replicas/web-1"
    assert cgroup.refusal(ok, mount, own) is None
    assert cgroup.refusal(ok, None, own) == "no cgroup2 mount"
    for bad in (
        "/sys/fs/cgroup/unified",  # the root
        "/sys/fs/cgroup/unified/system.slice",  # no orchestrator dir
        "/sys/fs/cgroup/unified/system.slice/orchestrator-d",  # holds the caller
        own,
        "/sys/fs/cgroup/memory/orchestrator-x",  # a v1 hierarchy
        "/sys/fs/cgroup/unified/orchestrator-d/../system.slice",
        "relative/orchestrator-x",
    ):
        assert cgroup.refusal(bad, mount, own), bad


def test_ledger_carries_cgroup_paths():
    odd = "/sys/fs/cgroup/orchestrator x/replicas/a\\b\nc\td"
    stream = (
        encode_add_cgroup("/sys/fs/cgroup/orchestrator-1/replicas/web-1")
        + encode_add_cgroup(odd)
        + encode_add_cgroup("/sys/fs/cgroup/orchestrator-1/replicas/web-2")
        + encode_remove_cgroup("/sys/fs/cgroup/orchestrator-1/replicas/web-1")
        + encode_remove_cgroup("/never/added")
        + b"G relative/path\n"
        + b"G /two fields\n"
    )
    assert stream.count(b"\n") == 7  # the odd path stayed on one line
    for chunk_size in (1, 5, len(stream)):
        ledger = Ledger()
        for i in range(0, len(stream), chunk_size):
            ledger.feed(stream[i : i + chunk_size])
        assert list(ledger.cgroups) == [odd, "/sys/fs/cgroup/orchestrator-1/replicas/web-2"]
        assert ledger.errors == 2 and ledger.entries == {}
    with pytest.raises(ValueError):
        encode_add_cgroup("relative")


def test_kill_refuses_what_is_not_a_non_root_cgroup(tmp_path):
    # Like the root cgroup, a plain dir has neither cgroup.kill nor cgroup.events: the
    # signal fallback would otherwise treat every process listed there as a target.
    (tmp_path / "cgroup.procs").write_text("")
    with pytest.raises(ValueError, match="not a non-root cgroup2"):
        cgroup.kill(str(tmp_path))
    assert cgroup.kill(str(tmp_path / "missing")) == "missing"


def test_unavailable_reasons_are_one_line():
    exc = cgroup._unavailable("create cgroups under", "/sys/fs/cgroup/x", PermissionError(errno.EACCES, "Permission denied"))
    assert isinstance(exc, CgroupUnavailable)
    assert str(exc) == "cannot create cgroups under /sys/fs/cgroup/x: permission denied"


def test_oom_killed_reads_memory_events(tmp_path):
    assert not cgroup.oom_killed(str(tmp_path))  # no memory controller: no file
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n")
    assert not cgroup.oom_killed(str(tmp_path))
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert cgroup.oom_killed(str(tmp_path))


@pytest.mark.timeout(60)
def test_link_replays_cgroups_to_a_new_watchdog(tmp_path):
    copier = tmp_path / "copier-python"  # stands in for the interpreter: copies the feed
    copier.write_text(f"#!/bin/sh\nexec cat <&3 > {tmp_path}/feed\n")
    copier.chmod(0o755)
    link = WatchdogLink(str(tmp_path), python=str(copier))
    link.add_cgroup("/cg/orchestrator-a/replicas/before-start")
    link.add_cgroup("/cg/orchestrator-a/replicas/gone")
    link.remove_cgroup("/cg/orchestrator-a/replicas/gone")
    link.remove_cgroup("/cg/orchestrator-a/replicas/never-added")  # no line for it
    pid = link.start()
    try:
        link.add_cgroup("/cg/orchestrator-a/replicas/after start")
        link.stop()
    finally:
        assert reap_child(pid, 20) == 0
    ledger = Ledger()
    ledger.feed((tmp_path / "feed").read_bytes())
    assert list(ledger.cgroups) == ["/cg/orchestrator-a/replicas/before-start", "/cg/orchestrator-a/replicas/after start"]
    assert ledger.errors == 0 and ledger.quit_requested
    assert b"never-added" not in (tmp_path / "feed").read_bytes()


# -- the real cgroupfs ----------------------------------------------------------------


def test_subtree_layout(subtree: Subtree, tmp_path):
    assert os.path.basename(subtree.parent).startswith("orchestrator-test-")
    for path in (subtree.daemon_dir, subtree.replicas_dir):
        assert os.path.isfile(os.path.join(path, "cgroup.procs"))
    available = set(Path(subtree.parent, "cgroup.controllers").read_text().split())
    assert subtree.controllers <= available & {"memory", "pids", "cpu"}
    assert subtree.leftovers() == []
    assert subtree.replica_path("web-1") == os.path.join(subtree.replicas_dir, "web-1")
    for bad in ("", "..", "a/b", "a\nb"):
        with pytest.raises(ValueError):
            subtree.replica_path(bad)
    assert Subtree.open(subtree.path).controllers == subtree.controllers
    with pytest.raises(CgroupUnavailable, match="not an orchestrator cgroup subtree"):
        Subtree.open(subtree.replicas_dir)
    with pytest.raises(CgroupUnavailable, match="is not a cgroup2 directory"):
        Subtree.create(str(tmp_path), "orchestrator-x")
    with pytest.raises(ValueError):
        Subtree.create(subtree.parent, "daemon-without-the-mark")
    with pytest.raises(ValueError, match="not inside the subtree"):
        subtree.kill(subtree.parent)


@pytest.mark.timeout(60)
def test_kill_ends_a_tree_that_left_its_groups(subtree: Subtree, owned: OwnedProcesses):
    path = subtree.make_replica("web-1")
    assert not cgroup.populated(path)
    root, roles, members = start_tree(owned, path)
    # Every member is in the cgroup, though they are spread over three sessions and five
    # process groups (root and bash share the test's group; the others left it).
    assert {pid for pid, _ in members} >= set(roles.values())
    assert all(cgroup.own_path(pid) == path for pid, _ in members)
    stats = [proc_stat(pid) for pid, _ in members]
    assert len({st.session for st in stats}) == 3 and len({st.pgrp for st in stats}) == 5
    assert proc_stat(roles["orphan"]).ppid != roles["root"]
    assert cgroup.populated(path) and subtree.populated(path)
    assert subtree.remove(path) == "busy"  # reported, not raised

    fd = subtree.events_fd(path)
    try:
        assert not events_ready(fd, 0), "a fresh events fd must be armed, not ready"
        t0 = time.monotonic()
        assert subtree.kill(path) == "cgroup.kill" or not os.path.exists(path + "/cgroup.kill")
        assert events_ready(fd, 5), "no cgroup.events change within 5 s of the kill"
        assert not cgroup.populated(fd)
        elapsed = time.monotonic() - t0
    finally:
        os.close(fd)
    assert elapsed < 2, elapsed
    assert not wait_gone(members, 5)
    assert root.wait(timeout=10) == -signal.SIGKILL
    assert subtree.leftovers() == [path]
    assert subtree.remove(path) == "removed"
    assert subtree.remove(path) == "missing"
    assert subtree.leftovers() == []


@pytest.mark.timeout(60)
def test_signal_fallback_kills_the_same_tree(subtree: Subtree, owned: OwnedProcesses):
    # Where cgroup.kill is missing (Linux < 5.14), kill() sends rounds of SIGKILL instead.
    path = subtree.make_replica("fallback")
    _root, _roles, members = start_tree(owned, path)
    assert cgroup._kill_by_signal(path, timeout=5)
    assert not cgroup.populated(path)
    assert not wait_gone(members, 5)


@pytest.mark.timeout(60)
def test_signal_reaches_every_member_and_events_fd_sees_it_empty(subtree: Subtree, owned: OwnedProcesses):
    path = subtree.make_replica("jobs")
    sleeper = start_in(owned, path, ["sleep", "300"])
    ready_r, ready_w = os.pipe()
    job = f'set -m; bash -c "echo ready >&{ready_w}; exec sleep 300" & wait'
    shell = start_in(owned, path, ["bash", "-c", job], pass_fds=(ready_w,))
    os.close(ready_w)
    try:
        assert read_lines(ready_r, 1) == ["ready"]
    finally:
        os.close(ready_r)
    members = {(pid, start_time(pid)) for _where, pid in cgroup._members(path)}
    owned.identities |= members
    assert len(members) == 3
    fd = cgroup.events_fd(path)
    try:
        assert subtree.signal(path, signal.SIGTERM) == 3
        assert events_ready(fd, 5) and not cgroup.populated(fd)
    finally:
        os.close(fd)
    assert not wait_gone(members, 5)
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    shell.wait(timeout=10)
    assert subtree.signal(path, signal.SIGTERM) == 0  # nobody left: nothing sent
    assert cgroup.remove(path) == "removed"
    # A removed cgroup: populated False, no events fd, nothing to kill.
    assert not cgroup.populated(path) and cgroup.kill(path) == "missing"
    with pytest.raises(FileNotFoundError):
        cgroup.events_fd(path)


def test_limits_without_their_controller_are_refused_in_one_line(subtree: Subtree):
    if "memory" in subtree.controllers:
        path = subtree.make_replica("mem", {"memory_max": 64 << 20})
        assert Path(path, "memory.max").read_text().strip() == str(64 << 20)
        assert not subtree.oom_killed(path)
    else:
        with pytest.raises(CgroupUnavailable) as info:
            subtree.make_replica("mem", {"memory_max": 64 << 20})
        message = str(info.value)
        assert "memory" in message and "\n" not in message and len(message) < 160, message
        assert not os.path.exists(subtree.replica_path("mem"))  # refused before mkdir
    for key, file, value in (("pids_max", "pids.max", 50), ("cpu_weight", "cpu.weight", 200)):
        if cgroup.LIMITS[key][1] in subtree.controllers:
            path = subtree.make_replica(f"r-{key}", {key: value})
            assert Path(path, file).read_text().strip() == str(value)
        else:
            with pytest.raises(CgroupUnavailable, match=cgroup.LIMITS[key][1]):
                subtree.make_replica(f"r-{key}", {key: value})
    with pytest.raises(ValueError, match="unknown limit"):
        subtree.make_replica("x", {"memory_min": 1})
    path = subtree.make_replica("no-limits", {"memory_max": None})  # None: not set
    assert os.path.isdir(path)


@pytest.mark.timeout(60)
def test_kill_all_then_destroy_leaves_nothing(subtree: Subtree, owned: OwnedProcesses):
    members = set()
    for rid in ("a", "b", "c"):
        path = subtree.make_replica(rid)
        proc = start_in(owned, path, ["sleep", "300"])
        members.add((proc.pid, start_time(proc.pid)))
    subtree.make_replica("empty")
    report = subtree.kill_all(timeout=5)
    assert [r["path"] for r in report["cgroups"]] == [subtree.replica_path(r) for r in ("a", "b", "c", "empty")]
    assert all(r["populated"] is False and r["removed"] == "removed" for r in report["cgroups"])
    assert report["duration_s"] < 5
    assert not wait_gone(members, 5)
    assert subtree.leftovers() == []
    result = subtree.destroy()
    assert result == {subtree.replicas_dir: "removed", subtree.daemon_dir: "removed", subtree.path: "removed"}


MOVER = textwrap.dedent(
    """
    import json, os, sys
    from watchdog import cgroup
    tree = cgroup.Subtree.create(sys.argv[1], sys.argv[2])
    inside = cgroup.own_path()
    busy = tree.destroy()
    tree.leave()
    print(json.dumps({"inside": inside, "busy": busy, "after": cgroup.own_path(), "destroy": tree.destroy()}))
    """
)


@pytest.mark.timeout(60)
def test_move_self_leave_and_destroy(subtree: Subtree, owned: OwnedProcesses):
    # Done by a child: the test process itself never moves. It creates a subtree of its own
    # inside ours (so the fixture removes it whatever happens).
    name = _unique_name()
    proc = owned.popen(
        [sys.executable, "-c", MOVER, subtree.replicas_dir, name],
        stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    result = json.loads(out)
    inner = os.path.join(subtree.replicas_dir, name)
    assert result["inside"] == os.path.join(inner, "daemon")
    assert result["busy"][os.path.join(inner, "daemon")] == "busy"  # it was still in there
    assert result["after"] == subtree.replicas_dir
    assert set(result["destroy"].values()) <= {"removed", "missing"}  # replicas/ went in the first try
    assert not os.path.exists(inner)


@pytest.mark.timeout(90)
def test_watchdog_kills_registered_cgroups_when_its_parent_dies(subtree: Subtree, owned: OwnedProcesses, tmp_path):
    not_ours = os.path.join(cgroup.find_mount(), f"not-ours-{uuid.uuid4().hex[:8]}")
    own = cgroup.own_path()
    stderr = open(tmp_path / "helper.err", "wb")
    try:
        helper = owned.popen(
            [sys.executable, str(PROGRAMS), "parent", "--state-dir", str(tmp_path), "--subtree", subtree.path,
             "--register", not_ours, "--register", own],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=str(tmp_path),
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), start_new_session=True,
        )  # fmt: skip
    finally:
        stderr.close()

    def line() -> dict:
        try:
            return json.loads(read_lines(helper.stdout.fileno(), 1, 30)[0])
        except (TimeoutError, EOFError) as exc:
            raise AssertionError(f"{exc}\n{(tmp_path / 'helper.err').read_text()}") from None

    info = line()
    owned.identities.add(tuple(info["helper"]))
    owned.identities.add(tuple(info["watchdog"]))
    killed = {tuple(m) for m in info["members"]["r0"]}
    spared = {tuple(m) for m in info["members"]["r1"]}
    owned.identities |= killed | spared
    assert len(killed) >= len(TREE_ROLES) and len(spared) >= len(TREE_ROLES)

    # A restarted watchdog must know the cgroups too (the link replays them).
    helper.stdin.write(b"restart\n")
    helper.stdin.flush()
    answer = line()
    assert answer["old_exit"] == -signal.SIGKILL
    watchdog_identity = tuple(answer["watchdog"])
    owned.identities.add(watchdog_identity)

    helper.kill()  # SIGKILL: the crash the watchdog exists for
    helper.wait(timeout=10)
    assert not wait_gone([watchdog_identity], 20), (tmp_path / "helper.err").read_text()
    report = json.loads((tmp_path / REPORT).read_text())
    assert not wait_gone(killed, 1.0), "r0's tree outlived the watchdog's clean-up"
    records = {r["path"]: r for r in report["cgroups"]}
    r0, r1 = info["cgroups"]["r0"], info["cgroups"]["r1"]
    assert records[r0] == {"path": r0, "kill": "cgroup.kill", "populated": False, "removed": "removed"}
    assert not os.path.exists(r0)
    assert records[not_ours]["kill"].startswith("refused:")
    assert records[own]["kill"].startswith("refused:")
    assert set(records) == {r0, not_ours, own}  # r1 was unregistered
    assert all(alive(m) for m in spared), "an unregistered cgroup was touched"
    assert cgroup.populated(r1)
    assert report["watchdog_pid"] == watchdog_identity[0]
    assert report["timings_ms"]["cgroups"] < 5000
