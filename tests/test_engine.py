"""The control loop (orchestrator.daemon.engine), first through a fake OS seam, then for real.

Part 1 drives ``Engine.handle`` / ``Engine.run_once(0)`` in the test thread over
``FakeOS`` (tests/fakes.py), which has OSApi's methods; its clock only moves when the test
moves it, and it flags whatever the engine must never do to a process or an fd.

Part 2 runs real workers through the embedded ``Orchestrator`` (the real OSApi).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fakes import NO_RESTART, SPEC, S
from helpers import Ident, wait_for
from orchestrator import InvalidSpec, ShuttingDown
from orchestrator.daemon.engine import Engine, EngineConfig
from orchestrator.daemon.osapi import OSApi


CHECK_INVARIANTS = True  # the h fixture (conftest) checks them at teardown


# -- launch, start, exit ------------------------------------------------------------------


def test_launch_goes_starting_then_running(h, fake):
    assert h.launch() == ["web-1"]
    row = h.rep("web-1")
    assert row["state"] == "STARTING"
    pid = fake.pid(0)
    assert row["pid"] == pid
    p = fake.procs[pid]
    assert p.argv == ("sleep", "1000") and p.exe.endswith("/sleep")
    assert p.env["ORCHESTRATOR_REPLICA_ID"] == "web-1"
    assert p.env["ORCHESTRATOR_POOL"] == "web"
    h.turn()
    assert h.state("web-1") == "STARTING"  # nothing happened yet: no event, no change
    fake.ready(pid)
    h.turn()
    row = h.rep("web-1")
    assert (row["state"], row["pid"], row["exit_code"], row["ended_at"]) == ("RUNNING", pid, None, None)
    assert h.desired() == 1
    assert fake.signals == []
    assert h.journal.history("web-1") == ["PENDING", "STARTING", "RUNNING"]


@pytest.mark.parametrize(
    "code, state, reason",
    [
        (0, "EXITED", "exit code 0"),
        (3, "FAILED", "exit code 3"),
        (-9, "FAILED", "killed by SIGKILL"),
        (-11, "FAILED", "killed by SIGSEGV"),
    ],
)
def test_exit_on_its_own(h, fake, code, state, reason):
    (rid,) = h.running()
    pid = fake.pid()
    fake.exit(pid, code)
    h.turn()
    row = h.rep(rid)
    assert (row["state"], row["exit_code"], row["reason"], row["pid"]) == (state, code, reason, None)
    assert row["ended_at"] == fake.time()
    assert fake.procs[pid].reaped
    assert fake.open_fds_of(pid) == set(), "both read ends are closed once reaped"
    # Only the remnant kill of its group, sent while the zombie pinned it.
    assert fake.signals_to(pid) == [(signal.SIGKILL, "exited")]
    assert h.desired() == 0  # not replaced: the desired size follows it out


def test_exit_while_starting_settles_the_ready_pipe_first(h, fake):
    h.launch()
    fake.exit(fake.pid(), 0)  # ran and ended before the loop saw it run
    h.turn()
    assert h.journal.history("web-1") == ["PENDING", "STARTING", "RUNNING", "EXITED"]


@pytest.mark.parametrize("same_turn", [True, False], ids=["exit-same-turn", "exit-later"])
def test_could_not_start_is_failed_with_the_reason(h, fake, same_turn):
    h.launch()
    pid = fake.pid()
    fake.cannot_start(pid, b"FileNotFoundError: [Errno 2] No such file", exit_too=same_turn)
    h.turn()
    if not same_turn:
        assert h.rep("web-1")["pid"] == pid  # still our unreaped child
        fake.exit(pid, 127)
        h.turn()
    row = h.rep("web-1")
    assert row["state"] == "FAILED"
    assert row["reason"] == "could not start: FileNotFoundError: [Errno 2] No such file"
    assert row["exit_code"] is None and row["pid"] is None
    assert h.journal.history("web-1") == ["PENDING", "STARTING", "FAILED"]
    assert h.desired() == 0


def test_spawn_error_is_failed_and_the_loop_goes_on(h, fake):
    fake.spawn_error = OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    h.launch()
    row = h.rep("web-1")
    assert row["state"] == "FAILED" and row["pid"] is None
    assert row["reason"] == f"could not start: {os.strerror(errno.EAGAIN)}"
    fake.spawn_error = None
    assert h.running() == ["web-2"]
    assert h.desired() == 1


# -- terminate ----------------------------------------------------------------------------


def test_terminate_while_pending_is_interrupted_and_never_spawned(h, fake):
    box: list[dict] = []
    h.engine.handle({"op": "launch", "args": {"pool": "web", "spec": SPEC, "policy": NO_RESTART}}, box.append)
    assert h.state("web-1") == "PENDING"
    assert h.ok("terminate", ids=["web-1"]) == ["web-1"]
    for _ in range(3):
        h.turn()
    row = h.rep("web-1")
    assert (row["state"], row["reason"], row["pid"]) == ("INTERRUPTED", "terminated", None)
    assert fake.order == [] and fake.signals == []
    assert h.desired() == 0


def test_terminate_pending_in_a_spawn_backlog(make_h, fake):
    h = make_h(spawn_batch=1)
    h.launch(count=3)  # one fork per turn: web-1 STARTING, the rest wait
    assert [h.state(f"web-{n}") for n in (1, 2, 3)] == ["STARTING", "PENDING", "PENDING"]
    assert h.ok("terminate", ids=["web-3"]) == ["web-3"]
    h.turn()
    h.turn()
    assert [fake.procs[p].replica_id for p in fake.order] == ["web-1", "web-2"]
    assert h.state("web-3") == "INTERRUPTED"
    assert h.desired() == 2
    h.check_invariants()


@pytest.mark.parametrize(
    "late",
    ["ready", "could-not-start", "exit-0", "exit-1", "ready-then-exit", "sigterm-kills-it"],
)
def test_terminate_while_starting_is_interrupted_and_stays_so(h, fake, late):
    h.launch()
    pid = fake.pid()
    if late == "sigterm-kills-it":
        fake.procs[pid].on_term = "die"
    assert h.ok("terminate", ids=["web-1"]) == ["web-1"]
    assert h.state("web-1") == "INTERRUPTED"
    assert fake.signals_to(pid)[0] == (signal.SIGTERM, "alive")
    if late != "sigterm-kills-it":
        assert h.rep("web-1")["pid"] == pid  # not reaped yet: still tracked
    if late == "ready":
        fake.ready(pid)
    elif late == "could-not-start":
        fake.cannot_start(pid, b"OSError: nope", exit_too=False)
    elif late == "exit-0":
        fake.exit(pid, 0)
    elif late == "exit-1":
        fake.exit(pid, 1)
    elif late == "ready-then-exit":
        fake.ready(pid)
        h.turn()
        fake.exit(pid, 0)
    h.turn()
    if not fake.procs[pid].exited:
        fake.exit(pid, -15)
        h.turn()
    row = h.rep("web-1")
    assert (row["state"], row["reason"], row["exit_code"], row["pid"]) == ("INTERRUPTED", "terminated", None, None)
    assert h.journal.history("web-1") == ["PENDING", "STARTING", "INTERRUPTED"]
    assert fake.open_fds_of(pid) == set()
    fake.now += 60  # the grace timer of a reaped process must not fire a signal
    h.turn()
    assert fake.signals_to(pid) == [(signal.SIGTERM, "alive"), (signal.SIGKILL, "exited")]
    assert h.desired() == 0


def test_terminate_running_goes_stopping_then_terminated(h, fake):
    (rid,) = h.running()
    pid = fake.pid()
    assert h.ok("terminate", ids=[rid]) == [rid]
    assert h.state(rid) == "STOPPING"
    assert h.rep(rid)["reason"] == "terminated"
    assert fake.signals_to(pid) == [(signal.SIGTERM, "alive")]
    assert h.desired() == 0  # lowered at once: a terminated replica is not replaced
    fake.exit(pid, -signal.SIGTERM)
    h.turn()
    row = h.rep(rid)
    assert (row["state"], row["exit_code"], row["reason"], row["pid"]) == (
        "TERMINATED", -15, "killed by SIGTERM", None)
    assert h.journal.history(rid) == ["PENDING", "STARTING", "RUNNING", "STOPPING", "TERMINATED"]


def test_grace_timer_escalates_to_sigkill(h, fake):
    (rid,) = h.running()
    pid = fake.pid()
    fake.procs[pid].on_term = "ignore"
    h.ok("terminate", ids=[rid])
    fake.now += 4.99
    h.turn()
    assert h.state(rid) == "STOPPING"
    assert fake.signals_to(pid) == [(signal.SIGTERM, "alive")]
    fake.now += 0.02
    h.turn()  # the timer fires: SIGKILL to the group
    assert fake.signals_to(pid) == [(signal.SIGTERM, "alive"), (signal.SIGKILL, "alive")]
    h.turn()  # the exit is seen
    row = h.rep(rid)
    assert (row["state"], row["exit_code"]) == ("TERMINATED", -9)
    assert row["reason"] == "killed by SIGKILL after 5s grace"
    assert row["ended_at"] == fake.time()


def test_exit_within_the_grace_disarms_the_kill(h, fake):
    (rid,) = h.running()
    pid = fake.pid()
    h.ok("terminate", ids=[rid])
    fake.now += 1
    fake.exit(pid, 0)  # it shut down cleanly on SIGTERM
    h.turn()
    assert (h.state(rid), h.rep(rid)["exit_code"], h.rep(rid)["reason"]) == ("TERMINATED", 0, "exit code 0")
    fake.now += 10
    h.turn()
    assert fake.signals_to(pid) == [(signal.SIGTERM, "alive"), (signal.SIGKILL, "exited")]


@pytest.mark.parametrize("outcome", ["exit-0", "exit-3", "could-not-start", "terminated", "interrupted"])
def test_terminate_of_an_ended_replica_is_a_noop(h, fake, outcome):
    """The "terminate() on a process that exited a moment earlier" bug: once its end is
    recorded, a terminate signals nothing, changes nothing, and does not lower the
    pool's desired size a second time."""
    h.launch()
    pid = fake.pid()
    if outcome == "could-not-start":
        fake.cannot_start(pid, b"ImportError: x")
    elif outcome == "interrupted":
        h.ok("terminate", ids=["web-1"])
        fake.exit(pid, -15)
    else:
        fake.ready(pid)
        h.turn()
        if outcome == "terminated":
            h.ok("terminate", ids=["web-1"])
            fake.exit(pid, -15)
        else:
            fake.exit(pid, int(outcome[-1]))
    h.turn()
    before = h.rep("web-1")
    assert S(before["state"]).terminal and before["pid"] is None
    signals_before = list(fake.signals)
    assert h.ok("terminate", ids=["web-1"]) == []
    reply = h.send("terminate", ids=["web-1"], wait=True)
    assert reply == [{"id": h._next_id, "ok": True, "result": {"web-1": before["state"]}}]
    assert h.rep("web-1") == before
    assert fake.signals == signals_before
    assert h.desired() == 0


def test_exit_and_terminate_in_one_turn_exit_first(h, fake):
    """Exit event and terminate command in the same turn: the loop dispatches events
    before commands, so the exit wins and the terminate finds nothing to do."""
    (rid,) = h.running()
    pid = fake.pid()
    box: list[dict] = []
    fake.exit(pid, 0)
    h.engine.submit({"id": 7, "op": "terminate", "args": {"ids": [rid]}}, box.append)
    h.turn()
    assert box == [{"id": 7, "ok": True, "result": []}]
    row = h.rep(rid)
    assert (row["state"], row["exit_code"], row["reason"]) == ("EXITED", 0, "exit code 0")
    assert fake.signals_to(pid) == [(signal.SIGKILL, "exited")]  # remnant kill only; no SIGTERM
    assert h.desired() == 0
    assert [t for t in h.journal.transitions if t[0] == rid][-1] == (rid, "RUNNING", "EXITED")


def test_exit_and_terminate_in_one_turn_while_starting(h, fake):
    h.launch()
    pid = fake.pid()
    box: list[dict] = []
    fake.cannot_start(pid, b"PermissionError: denied")  # ready message and exit, both readable
    h.engine.submit({"id": 8, "op": "terminate", "args": {"ids": ["web-1"]}}, box.append)
    h.turn()
    assert box == [{"id": 8, "ok": True, "result": []}]
    assert h.rep("web-1")["reason"] == "could not start: PermissionError: denied"
    assert fake.signals_to(pid) == [(signal.SIGKILL, "exited")]


@pytest.mark.parametrize("how", ["exits-0-meanwhile", "sigterm-kills-it", "exits-0-on-sigterm"])
def test_terminate_then_exit_in_one_turn(h, fake, how):
    """The other order: the terminate is applied while the process still runs, and its
    exit (on its own, or of our signal) arrives right behind it. One terminal transition,
    TERMINATED, with the real exit code; no signal once reaped."""
    (rid,) = h.running()
    pid = fake.pid()
    if how == "sigterm-kills-it":
        fake.procs[pid].on_term = "die"
    elif how == "exits-0-on-sigterm":
        fake.procs[pid].on_term = "exit0"
    box: list[dict] = []
    h.engine.handle({"id": 9, "op": "terminate", "args": {"ids": [rid]}}, box.append)
    if how == "exits-0-meanwhile":
        fake.exit(pid, 0)
    h.turn()
    assert box == [{"id": 9, "ok": True, "result": [rid]}]
    row = h.rep(rid)
    code = -15 if how == "sigterm-kills-it" else 0
    assert (row["state"], row["exit_code"], row["pid"]) == ("TERMINATED", code, None)
    assert h.journal.history(rid) == ["PENDING", "STARTING", "RUNNING", "STOPPING", "TERMINATED"]
    fake.now += 60
    h.turn()
    assert fake.signals_to(pid) == [(signal.SIGTERM, "alive"), (signal.SIGKILL, "exited")]
    assert h.desired() == 0


def test_unknown_id_is_an_error_and_changes_nothing(h, fake):
    (rid,) = h.running()
    for ids in (["nope-1"], ["web-2"], ["web-0"], ["web-x"], [rid, "web-9"]):
        reply = h.cmd("terminate", ids=ids)
        assert (reply["ok"], reply["code"]) == (False, "unknown_replica"), reply
        assert "unknown replica" in reply["error"]
    reply = h.cmd("wait", ids=["ghost-3"])
    assert (reply["ok"], reply["code"]) == (False, "unknown_replica")
    assert h.state(rid) == "RUNNING"  # all or nothing: the known id was not stopped
    assert fake.signals == []
    assert h.desired() == 1


# -- malformed commands -------------------------------------------------------------------

MALFORMED = [
    ("not a dict: str", "launch"),
    ("not a dict: None", None),
    ("not a dict: int", 42),
    ("not a dict: list", ["launch", {"pool": "web"}]),
    ("missing op", {"args": {"pool": "web", "spec": SPEC}}),
    ("op None", {"op": None}),
    ("op not a str", {"op": 5}),
    ("unknown op", {"op": "explode"}),
    ("private method as op", {"op": "_cmd_launch"}),
    ("args not a dict", {"op": "launch", "args": "pool=web"}),
    ("count 0", {"op": "launch", "args": {"pool": "web", "spec": SPEC, "count": 0}}),
    ("count -1", {"op": "launch", "args": {"pool": "web", "spec": SPEC, "count": -1}}),
    ("count str", {"op": "launch", "args": {"pool": "web", "spec": SPEC, "count": "2"}}),
    ("count bool", {"op": "launch", "args": {"pool": "web", "spec": SPEC, "count": True}}),
    ("count float", {"op": "launch", "args": {"pool": "web", "spec": SPEC, "count": 1.5}}),
    ("count None", {"op": "launch", "args": {"pool": "web", "spec": SPEC, "count": None}}),
    ("pool missing", {"op": "launch", "args": {"spec": SPEC}}),
    ("pool empty", {"op": "launch", "args": {"pool": "", "spec": SPEC}}),
    ("pool with space", {"op": "launch", "args": {"pool": "my pool", "spec": SPEC}}),
    ("pool leading dash", {"op": "launch", "args": {"pool": "-web", "spec": SPEC}}),
    ("pool with slash", {"op": "launch", "args": {"pool": "a/b", "spec": SPEC}}),
    ("pool too long", {"op": "launch", "args": {"pool": "p" * 65, "spec": SPEC}}),
    ("pool int", {"op": "launch", "args": {"pool": 5, "spec": SPEC}}),
    ("pool list", {"op": "launch", "args": {"pool": ["web"], "spec": SPEC}}),
    ("spec missing", {"op": "launch", "args": {"pool": "web"}}),
    ("spec str", {"op": "launch", "args": {"pool": "web", "spec": "sleep 1"}}),
    ("command str", {"op": "launch", "args": {"pool": "web", "spec": {"command": "sleep 1"}}}),
    ("command empty", {"op": "launch", "args": {"pool": "web", "spec": {"command": []}}}),
    ("command empty arg0", {"op": "launch", "args": {"pool": "web", "spec": {"command": [""]}}}),
    ("command not str", {"op": "launch", "args": {"pool": "web", "spec": {"command": ["sleep", 1]}}}),
    ("command not found", {"op": "launch", "args": {"pool": "web", "spec": {"command": ["no-such-cmd-xq7"]}}}),
    ("command not executable", {"op": "launch", "args": {"pool": "web", "spec": {"command": ["/dev/null"]}}}),
    ("target no colon", {"op": "launch", "args": {"pool": "web", "spec": {"target": "os"}}}),
    ("target no module", {"op": "launch", "args": {"pool": "web", "spec": {"target": "no_such_mod_xq7:f"}}}),
    ("target no attr", {"op": "launch", "args": {"pool": "web", "spec": {"target": "os:no_such_fn"}}}),
    ("target not callable", {"op": "launch", "args": {"pool": "web", "spec": {"target": "os:sep"}}}),
    ("pickled not base64", {"op": "launch", "args": {"pool": "web", "spec": {"pickled": "!!!"}}}),
    ("pickled int", {"op": "launch", "args": {"pool": "web", "spec": {"pickled": 5}}}),
    ("two kinds", {"op": "launch", "args": {"pool": "web", "spec": {**SPEC, "target": "os:getpid"}}}),
    ("unknown spec field", {"op": "launch", "args": {"pool": "web", "spec": {**SPEC, "shell": True}}}),
    ("env not str", {"op": "launch", "args": {"pool": "web", "spec": {**SPEC, "env": {"A": 1}}}}),
    ("env list", {"op": "launch", "args": {"pool": "web", "spec": {**SPEC, "env": ["A=1"]}}}),
    ("terminate no ids", {"op": "terminate", "args": {}}),
    ("terminate ids int", {"op": "terminate", "args": {"ids": 5}}),
    ("terminate ids not str", {"op": "terminate", "args": {"ids": [1]}}),
    ("scale negative", {"op": "scale", "args": {"pool": "web", "n": -1}}),
    ("scale n str", {"op": "scale", "args": {"pool": "web", "n": "2"}}),
    ("scale n bool", {"op": "scale", "args": {"pool": "web", "n": True}}),
    ("scale n float", {"op": "scale", "args": {"pool": "web", "n": 1.0}}),
    ("scale n missing", {"op": "scale", "args": {"pool": "web"}}),
    ("scale unknown pool", {"op": "scale", "args": {"pool": "nope", "n": 1}}),
    ("scale bad pool name", {"op": "scale", "args": {"pool": "a b", "n": 1, "spec": SPEC}}),
    ("scale pool None", {"op": "scale", "args": {"pool": None, "n": 1, "spec": SPEC}}),
    ("wait ids str", {"op": "wait", "args": {"ids": "web-1"}}),
    ("wait until bad", {"op": "wait", "args": {"ids": [], "until": "later"}}),
    ("wait timeout negative", {"op": "wait", "args": {"ids": [], "timeout": -1}}),
    ("wait timeout str", {"op": "wait", "args": {"ids": [], "timeout": "5"}}),
]


NOT_INVALID = {"scale unknown pool": "unknown_pool"}  # a lookup that missed, not a malformed argument


@pytest.mark.parametrize("name, cmd", MALFORMED, ids=[name for name, _ in MALFORMED])
def test_malformed_command_is_an_error_reply_and_the_loop_goes_on(h, fake, name, cmd):
    (rid,) = h.running()
    box: list[dict] = []
    h.engine.handle(cmd, box.append)
    h.turn()
    assert len(box) == 1 and box[0]["ok"] is False, box
    assert box[0]["code"] == NOT_INVALID.get(name, "invalid")
    assert box[0]["error"]
    assert box[0]["id"] == (cmd.get("id") if isinstance(cmd, dict) else None)
    # The same through the inbox, with an id to echo.
    if isinstance(cmd, dict):
        h.engine.submit({**cmd, "id": "c-1"}, box.append)
        h.turn()
        assert box[1]["ok"] is False and box[1]["id"] == "c-1"
    # Nothing changed, and the loop still works.
    assert [r["id"] for r in h.status()["replicas"]] == [rid]
    assert [p["name"] for p in h.status()["pools"]] == ["web"]
    assert h.state(rid) == "RUNNING" and fake.signals == []
    assert h.running() == ["web-2"]


def test_bad_wait_timeout_on_launch_launches_nothing(h, fake):
    """An error reply must mean "nothing happened". launch --wait with an invalid timeout
    is refused only after the replicas were created and queued to fork."""
    reply = h.cmd("launch", pool="web", spec=SPEC, count=2, wait=True, timeout=-1)
    assert reply["ok"] is False and reply["code"] == "invalid"
    assert h.status()["replicas"] == [], "an error reply, yet replicas were launched"
    assert fake.order == []


def test_bad_wait_timeout_on_terminate_stops_nothing(h, fake):
    (rid,) = h.running()
    reply = h.cmd("terminate", ids=[rid], wait=True, timeout="soon")
    assert reply["ok"] is False and reply["code"] == "invalid"
    assert h.state(rid) == "RUNNING", "an error reply, yet the replica was stopped"
    assert fake.signals == []


def test_nan_wait_timeout_is_refused_and_cannot_stall_the_timers(h, fake):
    """A NaN deadline never compares due, and at the top of the timer heap it hides every
    timer behind it: no SIGKILL after the grace, and run_once spins with timeout 0."""
    (rid,) = h.running()
    reply = h.send("wait", ids=[rid], until="ended", timeout=float("nan"))
    fake.procs[fake.pid()].on_term = "ignore"
    h.ok("terminate", ids=[rid])
    fake.now += 6
    h.turn()
    h.turn()
    assert (signal.SIGKILL, "alive") in fake.signals_to(fake.pid()), "the grace timer never fired"
    assert reply and reply[0]["ok"] is False and reply[0]["code"] == "invalid"


@pytest.mark.parametrize(
    "source",
    ["raise RuntimeError('boom at import')\n", "def main(:\n", "import sys\nsys.exit(3)\n"],
    ids=["raises", "syntax-error", "sys-exit"],
)
def test_target_module_is_never_imported_by_the_loop(h, tmp_path, monkeypatch, source):
    """The loop never imports a target (the worker does, and a failure there is that
    replica's "could not start"): a module that raises, does not parse or exits at import
    changes nothing in the loop, which is not even exposed to it."""
    name = f"orch_bad_target_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    box: list[dict] = []
    try:
        h.engine.handle({"op": "launch", "args": {"pool": "py", "spec": {"target": f"{name}:main"}}}, box.append)
    finally:
        imported = name in sys.modules
        sys.modules.pop(name, None)
    h.turn()
    assert not imported
    assert box and box[0]["ok"] is True, box
    assert h.running() == ["web-1"]


# -- scale, ids, shutdown -----------------------------------------------------------------


def test_scale_up_and_down_newest_first(h, fake):
    h.running()
    result = h.ok("scale", pool="web", n=4)
    assert result == {"pool": "web", "desired": 4, "launched": ["web-2", "web-3", "web-4"], "terminated": []}
    assert h.desired() == 4
    for pid in fake.order:
        fake.ready(pid)
    h.turn()
    h.check_invariants()
    result = h.ok("scale", pool="web", n=1)
    assert result["terminated"] == ["web-4", "web-3", "web-2"] and result["launched"] == []
    pids = {fake.procs[p].replica_id: p for p in fake.order}
    sigterms = [p for p, sig, _ in fake.signals if sig == signal.SIGTERM]
    assert sigterms == [pids["web-4"], pids["web-3"], pids["web-2"]]
    assert [h.state(f"web-{n}") for n in (1, 2, 3, 4)] == ["RUNNING", "STOPPING", "STOPPING", "STOPPING"]
    assert h.desired() == 1
    for n in (2, 3, 4):
        fake.exit(pids[f"web-{n}"], -15)
    h.turn()
    assert h.desired() == 1  # a replica ending after a scale-down does not lower it again
    assert h.ok("scale", pool="web", n=3)["launched"] == ["web-5", "web-6"]  # ids go on
    assert h.ok("scale", pool="web", n=3)["launched"] == []
    # Down again while the new ones are still starting or pending: they are interrupted.
    box: list[dict] = []
    h.engine.handle({"op": "scale", "args": {"pool": "web", "n": 4}}, box.append)  # web-7 PENDING
    result = h.ok("scale", pool="web", n=0)
    assert result["terminated"] == ["web-7", "web-6", "web-5", "web-1"]
    assert [h.state(f"web-{n}") for n in (1, 5, 6, 7)] == ["STOPPING", "INTERRUPTED", "INTERRUPTED", "INTERRUPTED"]
    assert "web-7" not in [fake.procs[p].replica_id for p in fake.order]
    assert h.desired() == 0


def test_scale_with_a_spec_creates_the_pool(h, fake):
    assert h.ok("scale", pool="api", n=2, spec=SPEC)["launched"] == ["api-1", "api-2"]
    assert h.desired("api") == 2
    assert h.ok("scale", pool="api", n=0)["terminated"] == ["api-2", "api-1"]
    assert h.desired("api") == 0


def test_desired_follows_every_kind_of_end(h, fake):
    a, b, c = h.running(count=3)
    assert h.desired() == 3
    fake.exit(h.rep(a)["pid"], 0)
    h.turn()
    assert h.desired() == 2
    h.ok("terminate", ids=[b])
    assert h.desired() == 1
    h.ok("terminate", ids=[b])  # again: no-op, not lowered twice
    assert h.desired() == 1
    h.launch()
    fake.cannot_start(fake.pid(), b"oops")
    h.turn()
    assert h.desired() == 1
    assert h.ok("scale", pool="web", n=5)["launched"] == ["web-5", "web-6", "web-7", "web-8"]
    assert h.desired() == 5
    h.check_invariants()


def test_ids_are_never_reused(make_h, fake):
    h = make_h(keep_ended=2)
    seen = []
    for _ in range(4):
        ids = h.running(count=2)
        seen += ids
        for rid in ids:
            fake.exit(h.rep(rid)["pid"], 0)
        h.turn()
    assert seen == [f"web-{n}" for n in range(1, 9)]
    # Only the last two ended ones are kept, but the old ids are known to be over.
    assert [r["id"] for r in h.status()["replicas"]] == ["web-7", "web-8"]
    assert h.ok("terminate", ids=["web-1"]) == []
    assert h.cmd("terminate", ids=["web-9"])["code"] == "unknown_replica"
    assert h.ok("scale", pool="web", n=1)["launched"] == ["web-9"]
    h.check_invariants()


def test_a_terminate_of_more_than_keep_ended_names_them_all(make_h, fake):
    """Found by benchmarks/scale.py: terminate --wait of 2,000 replicas replied with the
    1,000 the engine keeps of ended ones; the ones a waiter still reads stay until it has."""
    fake.on_term = "die"
    h = make_h(keep_ended=2)
    ids = h.running(count=5)
    box = h.send("terminate", ids=ids, wait=True, timeout=10)
    for _ in range(3):
        h.turn()
    assert box and box[0]["ok"], box
    assert sorted(box[0]["result"]) == sorted(ids)
    h.turn()
    assert len(h.status()["replicas"]) == 2  # forgotten once the reply is out
    h.check_invariants()


def test_shutdown_terminates_everything(make_h, fake):
    fake.on_term = "die"
    h = make_h()
    h.running()
    h.launch()  # web-2 STARTING
    waiting = h.send("wait", ids=["web-2"], until="running")  # answered once web-2 leaves STARTING
    box: list[dict] = []
    h.engine.handle({"op": "launch", "args": {"pool": "web", "spec": SPEC, "policy": NO_RESTART}}, box.append)  # web-3 PENDING
    assert [h.state(f"web-{n}") for n in (1, 2, 3)] == ["RUNNING", "STARTING", "PENDING"]
    h.engine.shutdown()
    rows = {r["id"]: r for r in h.status()["replicas"]}
    assert {k: (r["state"], r["pid"]) for k, r in rows.items()} == {
        "web-1": ("TERMINATED", None), "web-2": ("INTERRUPTED", None), "web-3": ("INTERRUPTED", None)}
    assert rows["web-1"]["reason"] == "killed by SIGTERM" and rows["web-2"]["reason"] == "shutdown"
    assert [fake.procs[p].replica_id for p in fake.order] == ["web-1", "web-2"]
    assert all(p.reaped for p in fake.procs.values())
    # The waiter is answered: web-2 is past STARTING now (it will never run).
    assert [m["result"] for m in waiting] == [{"web-2": "INTERRUPTED"}] and box[0]["ok"] is True
    assert h.desired() == 3  # kept: the next start brings the pool back
    reply = h.cmd("launch", pool="web", spec=SPEC)
    assert (reply["ok"], reply["code"]) == (False, "shutting_down")
    assert fake.violations == []


def test_shutdown_kills_what_ignores_sigterm(make_h, fake):
    fake.on_term = "ignore"
    h = make_h(grace=0.0)  # the fake clock does not move by itself: no grace to wait
    h.running(count=2)
    h.engine.shutdown()
    assert [(r["state"], r["exit_code"], r["reason"]) for r in h.status()["replicas"]] == [
        ("TERMINATED", -9, "killed by SIGKILL after 0s grace")] * 2
    assert all(p.reaped for p in fake.procs.values())
    assert fake.violations == []


def test_fork_failure_is_a_failed_replica_not_a_dead_loop(monkeypatch):
    """spawner.OSApi.spawn: when os.fork() raises, the ``finally`` reads ``pid`` before
    it was ever assigned, so an UnboundLocalError (not the OSError the engine handles)
    escapes run_once, every signal stays blocked in the loop thread, and the ready pipe
    leaks."""
    engine = Engine(EngineConfig(env={}), os_api=OSApi(pdeathsig=None))
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    fds_before = set(os.listdir("/proc/self/fd"))

    def fork_fails() -> int:
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    box: list[dict] = []
    try:
        monkeypatch.setattr(os, "fork", fork_fails)
        engine.handle({"op": "launch", "args": {"pool": "web", "spec": SPEC}}, box.append)
        try:
            engine.run_once(0)
        finally:
            mask_after = signal.pthread_sigmask(signal.SIG_SETMASK, mask_before)
            monkeypatch.undo()
        assert mask_after == mask_before, "spawn left signals blocked in the loop thread"
        (row,) = engine.status(True)["replicas"]
        assert row["state"] == "FAILED" and "could not start" in row["reason"]
        assert box[0]["ok"] is True
        assert set(os.listdir("/proc/self/fd")) == fds_before, "the ready pipe leaked"
    finally:
        engine.shutdown()
        engine.close()


# -- real processes through the embedded API ---------------------------------------------


def _report_env(out: str) -> None:
    """A Python worker: write what it sees, then sleep until terminated."""
    info = {
        "id": os.environ.get("ORCHESTRATOR_REPLICA_ID"),
        "pool": os.environ.get("ORCHESTRATOR_POOL"),
        "pid": os.getpid(),
    }
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(out + ".tmp", out)
    time.sleep(1000)


REPORT_SH = (
    'printf \'{"id": "%s", "pool": "%s", "pid": %s}\' '
    '"$ORCHESTRATOR_REPLICA_ID" "$ORCHESTRATOR_POOL" $$ > "$OUT.tmp" '
    '&& mv "$OUT.tmp" "$OUT" && exec sleep 1000'
)


def _read_json(path: Path, timeout: float = 10.0) -> dict:
    wait_for(path.exists, timeout, f"{path.name} to be written")
    return json.loads(path.read_text())


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode().strip()


@pytest.mark.parametrize("kind", ["command", "callable"])
def test_worker_env_process_group_and_title(make_orchestrator, procs, tmp_path, kind):
    orch = make_orchestrator(grace=2.0)
    out = tmp_path / "report.json"
    if kind == "command":
        ids = orch.launch("cmdpool", ["sh", "-c", REPORT_SH], env={"OUT": str(out)}, wait=True, timeout=30)
    else:
        ids = orch.launch("pypool", target=lambda: _report_env(str(out)), wait=True, timeout=30)
    (rid,) = ids
    row = orch.status()["replicas"][0]
    procs.track(row["pid"])
    info = _read_json(out)
    pool = "cmdpool" if kind == "command" else "pypool"
    assert info == {"id": rid, "pool": pool, "pid": row["pid"]}
    assert os.getpgid(row["pid"]) == row["pid"] != os.getpgid(0)  # a group of its own
    title = _cmdline(row["pid"])
    if kind == "callable":
        assert title == f"orchestrator: replica {rid}"
    else:  # a command replica carries its command's own title (sh execs sleep last)
        wait_for(lambda: _cmdline(row["pid"]) == "sleep", 10, "the command's own title")
    assert orch.terminate(rid, wait=True, timeout=30) == [rid]
    orch.close()
    assert not procs.survivors()


@pytest.mark.parametrize("kind", ["command", "callable"])
def test_worker_ignoring_sigterm_is_killed_after_the_grace(make_orchestrator, procs, tmp_path, kind):
    grace = 0.5
    orch = make_orchestrator(grace=grace, watchdog=False)
    flag = tmp_path / "ignoring"
    if kind == "command":
        script = f'trap "" TERM; touch {flag}; while :; do sleep 1; done'
        (rid,) = orch.launch("stubborn", ["sh", "-c", script], wait=True, timeout=30)
    else:

        def stubborn() -> None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            flag.touch()
            while True:
                time.sleep(1)

        (rid,) = orch.launch("stubborn", target=stubborn, wait=True, timeout=30)
    procs.track_status(orch.status())
    wait_for(flag.exists, 10, "the worker to ignore SIGTERM")
    t0 = time.monotonic()
    assert orch.terminate(rid, wait=True, timeout=30) == [rid]
    elapsed = time.monotonic() - t0
    (row,) = orch.status(all=True)["replicas"]
    assert (row["state"], row["exit_code"]) == ("TERMINATED", -9)
    assert row["reason"] == "killed by SIGKILL after 0.5s grace"
    assert grace <= elapsed < grace + 5.0  # the grace is the feature: it was waited, then ended
    # Its group was SIGKILLed with it: the shell's `sleep 1` is dying too, a moment later.
    wait_for(lambda: not procs.survivors(), 5, "the worker's group to be gone")


def _sleeper() -> None:
    time.sleep(1000)


ROUNDS = 200  # ~0.5 s; docs/design.md, Limits: the host-forked case that lost one SIGTERM in ~3,000


def test_terminate_right_after_launch_never_leaks_nor_waits_the_grace(make_orchestrator, procs):
    """200 times: launch, then terminate at once (the replica is a few microseconds past
    fork). The test process has a Python SIGTERM handler, as a daemon would: a worker
    that still ran it would swallow SIGTERM and need the SIGKILL after the grace."""
    grace = 10.0
    orch = make_orchestrator(grace=grace)
    old = signal.signal(signal.SIGTERM, lambda *_: None)
    worst, slowest = 0.0, None
    try:
        for i in range(ROUNDS):
            if i % 2:  # one pool per spec: a pool runs one spec
                (rid,) = orch.launch("quick-cmd", ["sleep", "1000"])
            else:
                (rid,) = orch.launch("quick-py", target=_sleeper)
            t0 = time.monotonic()
            assert orch.terminate(rid, wait=True, timeout=3 * grace) == [rid]
            took = time.monotonic() - t0
            if took > worst:
                worst, slowest = took, rid
    finally:
        signal.signal(signal.SIGTERM, old)
    rows = orch.status(all=True)["replicas"]
    assert len(rows) == ROUNDS
    for row in rows:
        assert row["state"] in ("INTERRUPTED", "TERMINATED"), row
        assert row["pid"] is None
        assert row["exit_code"] in (None, -signal.SIGTERM), row
    slow = [r for r in rows if r["id"] == slowest]
    assert worst < grace / 2, f"a terminate took {worst:.2f}s: it waited for the grace: {slow}"
    assert not procs.new_descendants() - {Ident.of(p) for p in (orch.watchdog_pid, *orch.spawner_pids)}
    orch.close()
    assert not procs.survivors()


def test_leaving_the_context_reaps_everything(make_orchestrator, procs, tmp_path):
    orch = make_orchestrator(grace=0.5)
    flag = tmp_path / "stubborn"

    def stubborn() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        flag.touch()
        time.sleep(1000)

    orch.launch("cmd", ["sleep", "1000"], count=3, wait=True, timeout=30)
    orch.launch("py", target=_sleeper, count=3, wait=True, timeout=30)
    orch.launch("stubborn", target=stubborn, wait=True, timeout=30)
    wait_for(flag.exists, 10, "the stubborn worker to ignore SIGTERM")
    orch.launch("late", ["sleep", "1000"], count=5)  # some may still be starting
    status = orch.status()
    procs.track_status(status)
    idents = {Ident.of(r["pid"]) for r in status["replicas"] if r["pid"]} - {None}
    watchdog = Ident.of(orch.watchdog_pid)
    assert len(idents) >= 7 and watchdog
    orch.close()
    # Reaped, not merely dead: none of them is left, not even as a zombie.
    for ident in [*idents, watchdog]:
        assert Ident.of(ident.pid) != ident, f"{ident.pid} is still there after close()"
    assert not procs.new_descendants()
    with pytest.raises(ShuttingDown):
        orch.launch("cmd", ["sleep", "1"])


def test_grandchild_left_in_the_group_is_killed_when_the_worker_exits(make_orchestrator, procs, tmp_path):
    orch = make_orchestrator(grace=2.0, watchdog=False)
    gc_file, go = tmp_path / "grandchild", tmp_path / "go"
    script = (
        f'sleep 1000 & echo $! > {gc_file}.tmp && mv {gc_file}.tmp {gc_file}; '
        f'while [ ! -e {go} ]; do sleep 0.01; done; exit 0'
    )
    (rid,) = orch.launch("parent", ["sh", "-c", script], wait=True, timeout=30)
    worker_pid = orch.status()["replicas"][0]["pid"]
    procs.track(worker_pid)
    wait_for(gc_file.exists, 10, "the grandchild's pid")
    grandchild = procs.track(int(gc_file.read_text()))
    assert grandchild is not None and grandchild.alive()
    assert os.getpgid(grandchild.pid) == worker_pid
    go.touch()
    assert orch.wait([rid], until="ended", timeout=30) == {rid: "EXITED"}
    (row,) = orch.status(all=True)["replicas"]
    assert (row["state"], row["exit_code"]) == ("EXITED", 0)
    # Killed by the loop while the worker's zombie pinned the group (its new parent may
    # take a while to reap it: a zombie counts as gone).
    wait_for(lambda: not grandchild.alive(), 5, "the grandchild to be killed")
    assert not procs.survivors()


def test_invalid_spec_through_the_api(make_orchestrator):
    orch = make_orchestrator(watchdog=False)
    with pytest.raises(InvalidSpec):
        orch.launch("web", ["no-such-command-xq7"])
    with pytest.raises(InvalidSpec):
        orch.launch("bad name", ["sleep", "1"])
    assert orch.launch("web", ["sleep", "1000"], wait=True, timeout=30) == ["web-1"]


def test_an_id_is_durable_before_its_process_exists(h, fake):
    """A kill -9 between fork and commit must not leave a process whose id the store never
    saw (the next daemon would hand the id out again)."""
    durable_at_fork: list[bool] = []
    spawn = fake.spawn

    def checking_spawn(plan, via=None):
        durable_at_fork.append(plan.replica_id in h.journal.committed_ids)
        return spawn(plan, via)

    fake.spawn = checking_spawn
    h.launch(count=5)
    assert durable_at_fork == [True] * 5


def test_spawned_start_time_is_the_kernels(tmp_path):
    """The spawner derives a worker's start time from the clock around fork; it must be
    exactly what /proc says, or identity checks would spare or hit the wrong process."""
    from orchestrator.daemon.osapi import OSApi
    from orchestrator.spec import LaunchPlan
    from watchdog.identity import start_time

    api = OSApi(pdeathsig=None)
    for _ in range(50):
        sp = api.spawn(LaunchPlan("t-1", ("sleep", "1000"), "/bin/sleep"))
        try:
            assert sp.start_time == start_time(sp.pid)
        finally:
            api.signal_group(sp.pid, 9)
            os.close(sp.ready_fd)
            os.close(sp.exit_fd)
            os.waitpid(sp.pid, 0)


def test_a_pool_made_by_scale_takes_a_launch_of_the_same_command(make_orchestrator, procs):
    """scale POOL N with a spec records the caller's directory, as launch does, so that a
    launch of the same command from there adds to the pool instead of being refused."""
    orch = make_orchestrator(grace=2.0)
    orch.scale("q", 1, command=["sleep", "1000"])
    (rid,) = orch.launch("q", ["sleep", "1000"], wait=True, timeout=30)
    procs.track_status(orch.status())
    assert {r["id"] for r in orch.status()["replicas"]} == {"q-1", rid}
