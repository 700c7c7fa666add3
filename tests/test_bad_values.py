"""Bad values that used to be accepted when a pool was declared and ended the control loop
later (and again at every start, the pool being restored from the journal): every template
expansion ({slot}, {port} in argv, env values and probe addresses) is checked when the pool
is declared, for every slot of its size; a journal that already holds such a pool restores
it as a crash loop with the reason; and no callback of the loop can end it."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from helpers import DaemonUnderTest, cli, one_line_error, wait_for

pytestmark = pytest.mark.timeout(120)


def _pools(d: DaemonUnderTest) -> dict[str, dict]:
    return {p["name"]: p for p in d.status()["pools"]}


def _alive(d: DaemonUnderTest, pid: int) -> None:
    """The same daemon still runs and answers."""
    data = d.status()
    assert data["daemon"]["running"] and data["daemon"]["pid"] == pid, data["daemon"]
    assert cli(d.state_dir, "health").returncode == 0


# -- refused when declared ------------------------------------------------------------------


def test_a_probe_template_that_expands_to_port_0_is_refused_at_launch(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--ready", "tcp:127.0.0.1:{slot}",
                               "--", "sleep", "300"))
    assert "slot 0" in line and "port must be 1..65535" in line, line
    _alive(daemon, pid)
    assert "p" not in _pools(daemon)
    # A template that is valid for every slot is accepted, and the loop lives on.
    assert cli(daemon.state_dir, "launch", "--pool", "q", "--ready", "tcp:127.0.0.1:1{slot}", "--ready-timeout",
               "30", "--", "sleep", "300").returncode == 0
    _alive(daemon, pid)


def test_port_base_past_65535_is_refused_at_launch_and_at_scale(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--port-base", "65535", "--count", "3",
                               "--", "sleep", "300"))
    assert "65537" in line and "65535" in line, line
    assert "p" not in _pools(daemon)
    assert cli(daemon.state_dir, "launch", "--pool", "p", "--port-base", "65534", "--count", "2",
               "--", "sleep", "300").returncode == 0
    line = one_line_error(cli(daemon.state_dir, "scale", "p", "3"))
    assert "65536" in line, line
    # A later launch that would grow it past the range is refused the same way.
    one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--port-base", "65534", "--", "sleep", "300"))
    _alive(daemon, pid)
    assert _pools(daemon)["p"]["desired"] == 2
    assert cli(daemon.state_dir, "scale", "p", "1").returncode == 0
    _alive(daemon, pid)


def test_a_probe_address_that_goes_out_of_range_at_a_higher_slot_is_refused_at_scale(
        daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    # Slots 0..5 probe ports 65530..65535; slot 6 would probe 65536.
    assert cli(daemon.state_dir, "launch", "--pool", "p", "--live", "tcp:127.0.0.1:6553{slot}",
               "--", "sleep", "300").returncode == 0
    line = one_line_error(cli(daemon.state_dir, "scale", "p", "7"))
    assert "slot 6" in line and "live" in line and "65536" in line, line
    _alive(daemon, pid)
    assert _pools(daemon)["p"]["desired"] == 1
    # The same through {port}: 6553 + slot, then a literal 0.
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "h", "--port-base", "6553", "--count", "2",
                               "--ready", "http://127.0.0.1:{port}0/", "--", "sleep", "300"))
    assert "slot 1" in line and "65540" in line, line
    _alive(daemon, pid)


def test_an_env_or_argv_template_with_port_but_no_port_base_is_refused(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--env", "ADDR=127.0.0.1:{port}",
                               "--", "sleep", "300"))
    assert "{port}" in line and "port" in line, line
    one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--", "sleep", "{port}"))
    # With a port base, an env template past the range is refused like $PORT is.
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--port-base", "65535", "--count", "2",
                               "--env", "ADDR=127.0.0.1:{port}", "--", "sleep", "300"))
    assert "65536" in line, line
    _alive(daemon, pid)
    assert "p" not in _pools(daemon)


def test_launch_replace_onto_a_template_invalid_for_the_pools_size_is_refused(daemon: DaemonUnderTest) -> None:
    pid = daemon.start()
    assert cli(daemon.state_dir, "launch", "--pool", "p", "--count", "2", "--", "sleep", "300").returncode == 0
    # Without --count the pool keeps its size (2): slot 1 would get 65536.
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--replace", "--port-base", "65535",
                               "--", "sleep", "300"))
    assert "slot 1" in line and "65536" in line, line
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "p", "--replace", "--count", "7",
                               "--ready", "tcp:127.0.0.1:6553{slot}", "--", "sleep", "300"))
    assert "slot 6" in line, line
    _alive(daemon, pid)
    assert _pools(daemon)["p"]["policy"] == {}


def test_a_config_reload_with_a_bad_expansion_is_refused_and_the_running_config_stays(
        daemon: DaemonUnderTest, tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    good = '[pools.web]\ncommand = ["sleep", "300"]\nsize = 2\nport_base = 65534\n'
    conf.write_text(good)
    pid = daemon.start("--config", str(conf))
    wait_for(lambda: len(daemon.status()["replicas"]) == 2, 20, "the declared pool")
    conf.write_text(good.replace("size = 2", "size = 3"))
    line = one_line_error(cli(daemon.state_dir, "reload"))
    assert "65536" in line, line
    _alive(daemon, pid)
    assert _pools(daemon)["web"]["desired"] == 2
    # The same file at start: one line, no daemon.
    assert cli(daemon.state_dir, "stop", "--timeout", "30").returncode == 0
    line = one_line_error(cli(daemon.state_dir, "start", "--config", str(conf)))
    assert "65536" in line, line


# -- a journal written by an older version ----------------------------------------------------


def _poison(db: Path, pool: str, policy: dict) -> None:
    """Give a stored pool a policy that no longer passes the declaration's checks, as an
    older daemon (which did not check) would have written it."""
    with sqlite3.connect(db) as conn:
        (spec_json,) = conn.execute("SELECT spec FROM pools WHERE name = ?", (pool,)).fetchone()
        row = json.loads(spec_json)
        row["policy"] = policy
        conn.execute("UPDATE pools SET spec = ? WHERE name = ?", (json.dumps(row), pool))
    conn.close()


@pytest.mark.parametrize("policy", [
    {"ready": "tcp:127.0.0.1:{slot}"},
    {"port_base": 65535},
], ids=["probe-port-0", "port-past-65535"])
def test_a_poisoned_journal_does_not_kill_start_and_the_pool_can_be_deleted(
        daemon: DaemonUnderTest, policy: dict) -> None:
    daemon.start()
    assert cli(daemon.state_dir, "launch", "--pool", "bad", "--count", "3", "--", "sleep", "300").returncode == 0
    assert cli(daemon.state_dir, "launch", "--pool", "good", "--", "sleep", "300").returncode == 0
    assert cli(daemon.state_dir, "stop", "--timeout", "30").returncode == 0
    _poison(daemon.state_dir / "state.db", "bad", policy)

    pid = daemon.start()
    wait_for(lambda: [r["state"] for r in daemon.status()["replicas"]] == ["RUNNING"], 20, "the good pool")
    bad = _pools(daemon)["bad"]
    assert bad["state"] == "crashloop" and "slot" in bad["reason"], bad
    assert [r["pool"] for r in daemon.status()["replicas"]] == ["good"]
    _alive(daemon, pid)
    log = (daemon.state_dir / "logs" / "daemon.log").read_text()
    assert "pool bad" in log and "Traceback" not in log, log[-2000:]

    assert "no usable spec" in one_line_error(cli(daemon.state_dir, "restart", "--pool", "bad"))
    assert "bad" in one_line_error(cli(daemon.state_dir, "scale", "bad", "3"))
    _alive(daemon, pid)
    assert cli(daemon.state_dir, "delete", "bad").returncode == 0
    assert "bad" not in _pools(daemon)
    assert cli(daemon.state_dir, "stop", "--timeout", "30").returncode == 0
    daemon.start()
    assert set(_pools(daemon)) == {"good"}


# -- no callback ends the loop ------------------------------------------------------------------


def test_an_exception_in_any_kind_of_callback_is_logged_and_the_loop_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    from orchestrator.daemon.reactor import Reactor

    reactor = Reactor()
    ran: list[str] = []
    r, w = os.pipe()

    def boom(where: str):
        def callback() -> None:
            ran.append(where)
            raise RuntimeError(f"injected in {where}")
        return callback

    def reader() -> None:
        os.read(r, 1)
        boom("reader")()

    try:
        reactor.add_reader(r, reader)
        reactor.call_soon(boom("soon"))
        reactor.call_soon(lambda: ran.append("soon after"))
        reactor.call_later(0, boom("timer"))
        reactor.call_later(0, lambda: ran.append("timer after"))
        reactor.at_turn_end(boom("turn end"))
        threading.Thread(target=lambda: reactor.call_soon_threadsafe(boom("inbox"))).start()
        os.write(w, b"x")
        with caplog.at_level(logging.ERROR, logger="orchestrator"):
            assert reactor.run_until(lambda: {"reader", "inbox", "soon after", "timer after"} <= set(ran), 10)
            reactor.run_once(0)  # and a further turn runs as usual
        assert {"reader", "soon", "timer", "turn end", "inbox", "soon after", "timer after"} <= set(ran)
        texts = [rec.getMessage() for rec in caplog.records]
        for where in ("reader", "soon", "timer", "turn end", "inbox"):
            assert any(rec.exc_info and f"injected in {where}" in str(rec.exc_info[1]) for rec in caplog.records), \
                (where, texts)
    finally:
        reactor.close()
        os.close(r)
        os.close(w)


def test_a_reader_that_keeps_failing_is_dropped_instead_of_spinning(caplog: pytest.LogCaptureFixture) -> None:
    """A level-triggered fd whose callback raises before it consumes the event would make
    every turn fail the same way: after a few in a row, the fd is no longer watched."""
    from orchestrator.daemon.reactor import Reactor

    reactor = Reactor()
    r, w = os.pipe()
    calls: list[int] = []

    def never_reads() -> None:
        calls.append(1)
        raise OSError("injected")

    try:
        reactor.add_reader(r, never_reads)
        os.write(w, b"x")
        with caplog.at_level(logging.ERROR, logger="orchestrator"):
            for _ in range(100):
                reactor.run_once(0)
        assert 1 < len(calls) < 100
        assert any("no longer watched" in rec.getMessage() for rec in caplog.records)
        timers: list[int] = []
        reactor.call_later(0, lambda: timers.append(1))
        reactor.run_once(0)
        assert timers == [1]
    finally:
        reactor.close()
        os.close(r)
        os.close(w)


def test_a_probe_that_fails_to_expand_at_run_time_fails_its_replica_not_the_loop(fake) -> None:
    """Past the declaration's checks (a slot beyond the size while older replicas still
    stop, a journal of an older version): the replica is FAILED with the reason and the
    pool stops replacing (crashloop), and the loop goes on."""
    from orchestrator.policy import Policy
    from fakes import SPEC, Harness

    h = Harness(fake)
    try:
        (ok,) = h.ok("launch", pool="web", count=1, spec=SPEC, policy={"restart": "always"})
        pool = h.engine.pool("web")
        # Bypass the checks, as an older daemon's journal would.
        pool.policy = Policy(restart="always", ready="tcp:127.0.0.1:7{slot}000")
        (rid,) = h.engine.launch(pool, 1)
        h.turn()
        h.fake.ready(h.rep(rid)["pid"])
        h.turn()
        h.turn()
        rep = h.rep(rid)
        assert rep["state"] == "FAILED" and "slot 1" in rep["reason"] and "port must be" in rep["reason"], rep
        (row,) = h.status()["pools"]
        assert row["state"] == "crashloop" and "slot 1" in row["reason"], row
        assert h.ok("ping") == "pong"
        # A bad live probe is caught the same way, before the replica counts as RUNNING.
        pool.policy = Policy(restart="always", live="tcp:127.0.0.1:{slot}")
        h.fake.ready(h.rep(ok)["pid"])  # slot 0: its live probe would probe port 0
        h.turn()
        h.turn()
        assert h.state(ok) == "FAILED" and "slot 0" in h.rep(ok)["reason"], h.rep(ok)
        assert h.ok("ping") == "pong"
    finally:
        h.engine.close()
