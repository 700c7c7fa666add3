"""`upgrade` while replicas are starting: their waits for readiness carry across the exec.

A replica waiting for its readiness probe, for ``notify`` or for ``start_secs`` does not
hold an upgrade back (it used to: ten seconds, then a refusal, so a pool with a slow start
could never be upgraded). The wait goes on in the new image as it stood: same pid, the same
deadline (not restarted by the exec), the probe's attempts going on, the notify socket the
replica was given still the one read. And the descendants that left a stopped replica's
process group, still within their grace, are killed by the new image when it is over.

Real daemons through the CLI. Each "ready" here is a file the test creates once the upgrade
has answered, so the probe or the notify cannot pass before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import escapefns
from helpers import DaemonUnderTest, Ident, cli, cli_env, free_port_range, wait_for, wait_gone

QUIESCE = 10.0  # how long the old code waited for STARTING replicas before it refused


def _replica(daemon: DaemonUnderTest, pool: str) -> dict:
    reps = [r for r in daemon.status(all=True)["replicas"] if r["pool"] == pool]
    assert len(reps) == 1, reps
    return reps[0]


def _upgrade(daemon: DaemonUnderTest) -> tuple[dict, float]:
    """The upgrade's --json answer and how long it took."""
    begun = time.monotonic()
    got = cli(daemon.state_dir, "upgrade", "--json")
    took = time.monotonic() - begun
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout), took


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


NOTIFIER = """
import os, socket, sys, time
flag = sys.argv[1]
while not os.path.exists(flag):
    time.sleep(0.05)
addr = os.environ["NOTIFY_SOCKET"]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"READY=1", "\\0" + addr[1:] if addr.startswith("@") else addr)
time.sleep(1000)
"""

SERVER = """
import http.server, os, sys, time
flag, port = sys.argv[1], int(sys.argv[2])
while not os.path.exists(flag):
    time.sleep(0.05)
http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


@pytest.mark.parametrize("ready", ["exec", "http", "notify"])
def test_upgrade_while_a_replica_waits_for_readiness(daemon: DaemonUnderTest, tmp_path: Path, ready: str) -> None:
    sd = daemon.state_dir
    pid = daemon.start()
    flag, attempts = tmp_path / "ready", tmp_path / "attempts"
    policy = ["--ready-timeout", "60", "--restart", "never"]
    if ready == "exec":  # each attempt leaves a line: the probe's schedule, seen from outside
        args = ["--ready", f"exec:sh -c 'echo a >> {attempts}; test -e {flag}'", *policy, "--", "sleep", "1000"]
    elif ready == "http":
        port = free_port_range(1)
        args = ["--port-base", str(port), "--ready", "http://127.0.0.1:{port}/", *policy, "--",
                sys.executable, "-c", SERVER, str(flag), "{port}"]
    else:
        args = ["--ready", "notify", *policy, "--", sys.executable, "-c", NOTIFIER, str(flag)]
    # A client waits for it throughout: its wait carries too, and the new image answers it.
    launch = subprocess.Popen([sys.executable, "-m", "orchestrator", "--state-dir", str(sd), "launch", "--pool", "slow",
                               "--wait", "--timeout", "90", "--json", *args], env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(r["pool"] == "slow" and r["pid"] for r in daemon.status()["replicas"]), 30,
                 "the replica's process")
    except AssertionError:
        launch.kill()
        raise AssertionError(f"launch: {launch.communicate(timeout=30)}") from None
    if ready == "exec":
        wait_for(lambda: _lines(attempts) >= 2, 30, "two failed attempts")
    before = _replica(daemon, "slow")
    assert before["state"] == "STARTING", before
    ident = Ident.of(before["pid"])

    result, took = _upgrade(daemon)
    assert result["pid"] == pid and result["replicas"] == 1
    assert took < QUIESCE - 2, f"the upgrade waited {took:.1f} s for the STARTING replica"
    during = daemon.status()
    assert during["daemon"]["upgraded_at"] is not None
    rep = _replica(daemon, "slow")
    assert rep["state"] == "STARTING" and Ident.of(rep["pid"]) == ident, rep
    if ready == "exec":  # the new image goes on trying
        seen = _lines(attempts)
        wait_for(lambda: _lines(attempts) >= seen + 2, 30, "the probe's attempts in the new image")

    flag.touch()
    out, err = launch.communicate(timeout=60)
    assert launch.returncode == 0, err
    assert json.loads(out)["ids"] == [before["id"]]
    rep = _replica(daemon, "slow")
    assert rep["state"] == "RUNNING" and rep["ready"], rep
    assert Ident.of(rep["pid"]) == ident, "not the same process"
    assert rep["restarts"] == 0
    assert daemon.status()["daemon"]["pid"] == pid
    assert cli(sd, "health").returncode == 0
    events = [json.loads(line) for line in cli(sd, "events", "--json").stdout.splitlines()]
    assert [e["data"].get("refused") for e in events if e["kind"] == "upgrade"] == [None]


@pytest.mark.parametrize("kind", ["exec", "notify", "start_secs"])
def test_a_readiness_deadline_carries_and_the_new_image_enforces_it(daemon: DaemonUnderTest, tmp_path: Path,
                                                                    kind: str) -> None:
    """The deadline is the one the replica got at its start, not one restarted by the exec:
    the upgrade comes ``LEAD`` seconds into a ``LIMIT`` s wait, and the wait ends
    ``LIMIT`` s after the start (a restarted one would end ``LEAD`` s later). A probe or a
    notify that never comes: FAILED "not ready"; start_secs: RUNNING."""
    # The upgrade has limit - lead seconds to finish before the old image would decide (it
    # took over 6 s on 2 loaded cores).
    limit, lead = 16.0, 4.0
    sd = daemon.state_dir
    daemon.start()
    never = tmp_path / "never"
    policy = ["--restart", "never"]
    if kind == "exec":
        args = ["--ready", f"exec:test -e {never}", "--ready-timeout", f"{limit:g}", *policy, "--", "sleep", "1000"]
    elif kind == "notify":
        args = ["--ready", "notify", "--ready-timeout", f"{limit:g}", *policy, "--",
                sys.executable, "-c", NOTIFIER, str(never)]
    else:
        args = ["--start-secs", f"{limit:g}", *policy, "--", "sleep", "1000"]
    got = cli(sd, "launch", "--pool", "late", *args)
    assert got.returncode == 0, got.stderr
    wait_for(lambda: _replica(daemon, "late")["pid"] is not None, 30, "the replica's process")
    created = _replica(daemon, "late")["created_at"]
    wait_for(lambda: time.time() - created >= lead, 30, f"{lead:g} s of its wait")
    assert _replica(daemon, "late")["state"] == "STARTING"
    ident = Ident.of(_replica(daemon, "late")["pid"])

    _upgrade(daemon)
    upgraded_at = daemon.status()["daemon"]["upgraded_at"]
    wait_for(lambda: _replica(daemon, "late")["state"] != "STARTING", limit + 20, "the wait's end")
    rep = _replica(daemon, "late")
    if kind == "start_secs":
        assert rep["state"] == "RUNNING" and Ident.of(rep["pid"]) == ident, rep
        ended = rep["started_at"]
    else:
        assert rep["state"] == "FAILED" and rep["reason"].startswith(f"not ready within {limit:g} s"), rep
        ended = rep["ended_at"]
    assert ended > upgraded_at, "decided by the old image"
    # The start (created_at) is a little before the wait's: its spawn and exec.
    assert ended - created < limit + lead - 1.0, f"the wait ended {ended - created:.1f} s after the start"
    assert ended - created >= limit - 0.5, rep
    assert cli(sd, "health").returncode == 0


def test_an_escaped_descendant_within_its_grace_is_killed_by_the_new_image(daemon: DaemonUnderTest,
                                                                           tmp_path: Path) -> None:
    """Process groups: a replica ended by a terminate left a setsid'd child that ignores
    SIGTERM; its SIGKILL is due when the grace is over, which comes after the exec."""
    sd = daemon.state_dir
    daemon.start("--cgroup", "off")
    armed = tmp_path / "armed"
    main = ("import subprocess, sys, time, os; "
            "c = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True); "
            "print(c.pid, flush=True); time.sleep(1000)")
    got = cli(sd, "launch", "--pool", "esc", "--grace", "6", "--wait", "--", sys.executable, "-c", main,
              escapefns.STUBBORN, str(armed))
    assert got.returncode == 0, got.stderr
    wait_for(armed.exists, 30, "the child to ignore SIGTERM")
    rid = _replica(daemon, "esc")["id"]
    out = sd / "logs" / f"{rid}.out"
    wait_for(lambda: out.exists() and out.read_text().strip(), 30, "the child's pid")
    child = Ident.of(int(out.read_text().split()[0]))
    assert child is not None
    got = cli(sd, "terminate", "--wait", rid)
    assert got.returncode == 0, got.stderr
    assert child.alive(), "the child is to be killed after the grace, not before"
    _upgrade(daemon)
    assert not wait_gone([child], 20), "the escaped child outlived its grace across the upgrade"


@pytest.mark.parametrize("kind", ["start_secs", "notify"])
def test_hand_over_then_resume_keeps_a_starting_wait(h, kind: str) -> None:
    """On the fake OS and clock, what an upgrade does to a STARTING replica's wait in the
    old image (hand_over, then its releases run) and what the next image, or the old one
    after a failed exec, does with it (resume): the wait ends at the deadline it had (4 s
    from its start), not at one restarted by the hand-over (5.5 s)."""
    policy = {"restart": "never", **({"start_secs": 4} if kind == "start_secs" else
                                     {"ready": "notify", "ready_timeout": 4})}
    (rid,) = h.ok("launch", pool="web", count=1, spec={"command": ["sleep", "100"]}, policy=policy)
    pid = h.rep(rid)["pid"]
    h.fake.ready(pid)
    h.turn()
    assert h.state(rid) == "STARTING"
    h.fake.now += 1.0
    h.turn()
    readiness = h.engine.supervisor.readiness
    proc = h.engine.proc_by_pid(pid)
    carried = readiness.hand_over(proc)
    assert carried is not None and carried["wait"]["kind"] == kind
    if kind == "notify":
        os.close(carried["notify"]["fd"])  # the fake replica never sends on it
        carried = {"wait": carried["wait"]}
    for release in proc.cleanup:  # as the exec does: probes, timers, the socket (detached)
        release()
    proc.cleanup = []
    h.fake.now += 0.5  # the exec: resumed 1.5 s into the wait
    h.turn()
    readiness.resume(proc, carried)
    h.fake.now += 2.4  # 3.9 s into the wait
    h.turn()
    assert h.state(rid) == "STARTING"
    h.fake.now += 0.2
    h.turn()
    h.turn()
    if kind == "start_secs":
        assert h.state(rid) == "RUNNING"
    else:
        assert h.state(rid) == "FAILED" and h.rep(rid)["reason"] == "not ready within 4 s (no READY=1)"
