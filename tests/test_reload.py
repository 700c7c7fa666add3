"""`reload` converges: whatever reloads came before, and however their rollouts overlapped,
the pools end as the last file declares them, and a further `reload` finds nothing to do.
A pool renamed on fixed ports is stopped before its successor takes the ports."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import DaemonUnderTest, cli, free_port_range, serves, wait_for
from fakes import Harness
from test_supervision import live as fake_live

pytestmark = pytest.mark.timeout(180)

_LIVE = ("PENDING", "STARTING", "RUNNING", "STOPPING")


def live(d: DaemonUnderTest, pool: str) -> list[dict]:
    return [r for r in d.status()["replicas"] if r["pool"] == pool and r["state"] in _LIVE]


def cmdline(pid: int | None) -> list[str] | None:
    try:
        return psutil.Process(pid).cmdline() if pid else None
    except psutil.NoSuchProcess:
        return None


def reload(d: DaemonUnderTest) -> dict:
    done = cli(d.state_dir, "reload", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- on the fake OS: every interleaving the test chooses, step by step --------------------


def sleep(n: int) -> dict:
    return {"command": ["sleep", str(n)]}


ALWAYS = {"restart": "always"}


def step(h: Harness, *, start: bool = True, stop: bool = True) -> None:
    """One round of the world: STARTING replicas become ready, STOPPING ones end."""
    for r in fake_live(h):
        proc = h.fake.procs.get(r["pid"])
        if proc is None or proc.exited:
            continue
        if start and r["state"] == "STARTING":
            h.fake.ready(r["pid"])
        elif stop and r["state"] == "STOPPING":
            h.fake.exit(r["pid"], -15)
    h.turn()
    h.turn()


def settle(h: Harness) -> None:
    for _ in range(60):
        step(h)
        if not h.engine.supervisor._rollouts and all(r["state"] == "RUNNING" for r in fake_live(h)):
            return
    raise AssertionError(f"not settled: {fake_live(h)}")


def argv_of(h: Harness) -> list[tuple[str, ...]]:
    return [h.fake.procs[r["pid"]].argv for r in fake_live(h)]


@pytest.mark.parametrize("ports", [False, True])
def test_overlapping_declarations_end_as_the_last_one(h: Harness, ports: bool) -> None:
    policy = {**ALWAYS, "port_base": 9000} if ports else ALWAYS
    assert h.engine.supervisor.declare("web", sleep(1), policy, 2) == "added"
    settle(h)
    for n, size in ((2, 4), (3, 5), (4, 3)):
        assert h.engine.supervisor.declare("web", sleep(n), policy, size) == "changed"
        h.turn()
        step(h, stop=False)  # one new replica ready; the old ones are still ending
    settle(h)
    reps = fake_live(h)
    assert argv_of(h) == [("sleep", "4")] * 3, reps
    assert sorted(r["slot"] for r in reps) == [0, 1, 2]
    (pool,) = h.status()["pools"]
    assert pool["desired"] == 3 and pool["spec"] == sleep(4)
    assert h.engine.supervisor.declare("web", sleep(4), policy, 3) == "unchanged"
    for _ in range(5):  # nothing of the superseded rollouts is left to act later
        step(h)
    assert argv_of(h) == [("sleep", "4")] * 3 and pool["desired"] == 3


def test_a_resize_during_a_rollout_is_the_size_it_ends_at(h: Harness) -> None:
    assert h.engine.supervisor.declare("web", sleep(1), ALWAYS, 2) == "added"
    settle(h)
    assert h.engine.supervisor.declare("web", sleep(2), ALWAYS, 4) == "changed"
    h.turn()
    step(h)  # part of the way
    assert h.engine.supervisor.declare("web", sleep(2), ALWAYS, 1) in ("changed", "resized")
    settle(h)
    assert argv_of(h) == [("sleep", "2")]
    assert h.engine.supervisor.declare("web", sleep(2), ALWAYS, 1) == "unchanged"


def test_a_rollout_that_gave_up_is_taken_up_by_the_next_declaration(h: Harness) -> None:
    assert h.engine.supervisor.declare("web", sleep(1), ALWAYS, 2) == "added"
    settle(h)
    assert h.engine.supervisor.declare("web", sleep(2), ALWAYS, 2) == "changed"
    h.turn()
    (new,) = [r for r in fake_live(h) if r["state"] == "STARTING"]
    h.fake.exit(new["pid"], 1)  # the new spec fails: the rollout stops, the olds run on
    h.turn()
    h.turn()
    assert set(argv_of(h)) == {("sleep", "1")}
    assert h.engine.supervisor.declare("web", sleep(2), ALWAYS, 2) == "changed"  # the same again: rolled again
    settle(h)
    assert argv_of(h) == [("sleep", "2")] * 2
    assert h.engine.supervisor.declare("web", sleep(2), ALWAYS, 2) == "unchanged"


# -- through the CLI, with real processes ---------------------------------------------------


def sleeper_config(path: Path, seconds: int, size: int) -> None:
    # start_secs keeps each rollout step in flight long enough for the next reload to land on it
    path.write_text(f"""
[daemon]
grace = 1.0
stop_budget = 10

[pools.web]
command = ["sleep", "{seconds}"]
size = {size}
restart = "always"
start_secs = 1.0
""")


def test_three_quick_reloads_converge_on_the_last_file(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    conf = tmp_path / "orchestrator.toml"
    sleeper_config(conf, 1000, 2)
    daemon.start("--config", str(conf))
    wait_for(lambda: len(live(daemon, "web")) == 2 and all(r["state"] == "RUNNING" for r in live(daemon, "web")),
             20, "the declared pool")

    # a bigger size in the middle: a rollout of it that finishes last must not win
    for seconds, size in ((1001, 4), (1002, 5), (1003, 3)):
        sleeper_config(conf, seconds, size)
        assert reload(daemon)["changed"] == ["web"]
        time.sleep(0.2)  # the operator's pace between edits, not a synchronisation

    def converged() -> bool:
        reps = live(daemon, "web")
        return (len(reps) == 3 and all(r["state"] == "RUNNING" for r in reps)
                and all(cmdline(r["pid"]) == ["sleep", "1003"] for r in reps))

    wait_for(converged, 60, "3 replicas of the third file's command")
    pool = next(p for p in daemon.status()["pools"] if p["name"] == "web")
    assert pool["spec"]["command"] == ["sleep", "1003"] and pool["desired"] == 3
    assert sorted(r["slot"] for r in live(daemon, "web")) == [0, 1, 2]

    again = reload(daemon)
    assert again["unchanged"] == ["web"], again
    assert not (again["added"] or again["changed"] or again["resized"] or again["removed"]), again
    # and it stays there: no rollout of an earlier reload is left to change it later
    time.sleep(1.0)
    assert converged() and len(live(daemon, "web")) == 3


def test_a_reload_rolls_replicas_that_do_not_run_the_declared_spec(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    """What runs decides, not the last file read: replicas left on an older spec (their
    rollout gave up) are rolled by the next reload of the very same file."""
    conf = tmp_path / "orchestrator.toml"
    sleeper_config(conf, 1000, 2)
    daemon.start("--config", str(conf))
    wait_for(lambda: len(live(daemon, "web")) == 2 and all(r["state"] == "RUNNING" for r in live(daemon, "web")),
             20, "the declared pool")
    # the new command fails until the flag file exists: its rollout stops at the first
    # failure and the old replicas keep running
    flag = tmp_path / "flag"
    new_cmd = ["sh", "-c", f"test -e {flag} && exec sleep 1001"]
    conf.write_text(conf.read_text().replace('["sleep", "1000"]', json.dumps(new_cmd)))
    assert reload(daemon)["changed"] == ["web"]
    wait_for(lambda: any(r["state"] == "FAILED" for r in daemon.status(all=True)["replicas"]), 20,
             "the new spec's replica failing")
    assert all(cmdline(r["pid"]) == ["sleep", "1000"] for r in live(daemon, "web"))

    flag.touch()  # the same file again: the replicas do not run it, so it is rolled again
    assert reload(daemon)["changed"] == ["web"]

    def rolled() -> bool:
        reps = live(daemon, "web")
        return (len(reps) == 2 and all(r["state"] == "RUNNING" for r in reps)
                and all(cmdline(r["pid"]) == ["sleep", "1001"] for r in reps))

    wait_for(rolled, 60, "the pool on the file's command")
    again = reload(daemon)
    assert again["unchanged"] == ["web"], again


# A server that takes a second to close once asked to stop, as one draining its
# connections does: it holds its port that long after the stop signal.
SLOW_SERVER = """
import http.server, signal, sys, time
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)
def drain(signum, frame):
    time.sleep(1.0)
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
server.serve_forever()
"""


def _server_config(path: Path, name: str, base: int, size: int = 2) -> None:
    script = path.parent / "server.py"
    script.write_text(SLOW_SERVER)
    path.write_text(f"""
[daemon]
grace = 5.0
stop_budget = 20

[pools.{name}]
command = [{json.dumps(sys.executable)}, {json.dumps(str(script))}, "{{port}}"]
size = {size}
port_base = {base}
ready = "http://127.0.0.1:{{port}}/"
ready_timeout = 20
restart = "always"
""")


def test_renaming_a_pool_on_fixed_ports_frees_them_first(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    base = free_port_range(2)
    conf = tmp_path / "orchestrator.toml"
    _server_config(conf, "web", base)
    daemon.start("--config", str(conf))
    wait_for(lambda: len(live(daemon, "web")) == 2 and all(r["state"] == "RUNNING" for r in live(daemon, "web")),
             30, "the servers")
    assert serves(base) and serves(base + 1)

    _server_config(conf, "www", base)
    done = reload(daemon)
    assert done["added"] == ["www"] and done["removed"] == ["web"], done

    def moved() -> bool:
        st = daemon.status()
        www = [r for r in st["replicas"] if r["pool"] == "www" and r["state"] in _LIVE]
        return (not any(r["pool"] == "web" and r["state"] in _LIVE for r in st["replicas"])
                and len(www) == 2 and all(r["state"] == "RUNNING" for r in www))

    wait_for(moved, 60, "the renamed pool's servers running")
    assert serves(base) and serves(base + 1)
    st = daemon.status(all=True)
    www = next(p for p in st["pools"] if p["name"] == "www")
    assert www["state"] != "crashloop", www
    # none of the new pool's replicas failed on a port still held by the old one
    assert [r for r in st["replicas"] if r["pool"] == "www" and r["state"] in ("FAILED", "EXITED")] == []
    assert all(r["restarts"] == 0 for r in live(daemon, "www"))
    # the old pool's ports are held by the new pool's processes, not by a leftover
    pids = {r["pid"] for r in live(daemon, "www")}
    holders = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
               and c.laddr and c.laddr.port in (base, base + 1)}
    assert holders <= pids, (holders, pids)
    with socket.create_connection(("127.0.0.1", base), timeout=2):
        pass
