"""Recovery through the store: kill -9 of the daemon at random moments during churn, the
store read with the daemon down (status, events), a corrupt state.db, and retention as the
daemon applies it when it opens the store.

Every process these tests cause carries ORCH_TEST_TAG=<unique per test> in its environment
(the daemon passes its environment on to the watchdog, the manager and command workers), so
"every process of the daemon's tree is gone" is checked by identity *and* by tag: a worker
forked an instant before the kill, that no snapshot saw, is still found.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import DaemonUnderTest, Ident, cli, cli_env, kill_all, no_leftovers, sized, survivors, tagged, wait_for
import orchestrator.client.channel as channel
from orchestrator import ChannelError, Client, DaemonNotRunning, OrchestratorError, ShuttingDown
from orchestrator.spec import make_spec
from orchestrator.store import TERMINAL_STATES, Store
from watchdog.identity import start_time

pytestmark = pytest.mark.timeout(120)

# 12 by default, the bounded run CI does on each Python; CRASH_TRIALS=100 for a longer hunt.
CRASH_TRIALS = int(os.environ.get("CRASH_TRIALS", "12"))
CRASH_SEED = os.environ.get("CRASH_SEED")  # replay a failing run: its seed is in the message
CLI_EVERY = 5  # trials between two checks through the CLI (in between: Client, Store)
SLEEP = ["sleep", "1000"]
LIFECYCLE = ["PENDING", "STARTING", "RUNNING", "STOPPING", "TERMINATED"]


# -- bookkeeping ----------------------------------------------------------------------


class TaggedDaemon(DaemonUnderTest):
    """DaemonUnderTest whose processes (and their descendants) carry a unique tag."""

    def __init__(self, state_dir: Path, tag: str) -> None:
        super().__init__(state_dir)
        self.tag = tag

    def gone(self) -> bool:
        """Every process seen, and every tagged process, has ended."""
        return not survivors(self.seen) and not tagged(self.tag)

    def kill9(self) -> None:
        """SIGKILL the daemon through a pidfd that is checked to be the daemon we started."""
        assert self.pid is not None
        fd = os.pidfd_open(self.pid)
        try:
            assert Ident.of(self.pid) in self.seen, "the daemon's pid is no longer the daemon"
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)

    def teardown(self) -> list[Ident]:
        left = super().teardown()
        extra = tagged(self.tag)
        kill_all(extra)
        return left + sorted(extra)


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    tag = f"recovery:{uuid.uuid4().hex}"
    monkeypatch.setenv("ORCH_TEST_TAG", tag)  # cli_env() passes it on to the daemon
    with no_leftovers(TaggedDaemon(tmp_path / "state", tag)) as d:
        yield d


class IdSource:
    """Stands in for ``orchestrator.client.channel.uuid``.

    ``Client.call`` makes each command's id with ``uuid.uuid4().hex`` and the public API
    never returns it (the reply's id is dropped by ``raise_reply``). To check "every
    acknowledged command is in the journal" by id, this records, per thread, the id of the
    last command sent; everything else about Client.call stays as it is."""

    def __init__(self) -> None:
        self._local = threading.local()

    def uuid4(self) -> uuid.UUID:
        u = uuid.uuid4()
        self._local.last = u.hex
        return u

    @property
    def last(self) -> str | None:
        return getattr(self._local, "last", None)


@pytest.fixture
def ids(monkeypatch: pytest.MonkeyPatch) -> IdSource:
    source = IdSource()
    monkeypatch.setattr(channel, "uuid", source)
    return source


def traced(trace: Path) -> list[str]:
    """A command replica that first appends its replica id to ``trace`` (so every id a
    process ever ran with is known, even one the store never recorded), then sleeps."""
    return ["sh", "-c", f'echo "$ORCHESTRATOR_REPLICA_ID" >> {shlex.quote(str(trace))}; exec sleep 1000']


def ran(trace: Path) -> set[str]:
    """The replica ids some process has run with, according to ``trace``."""
    try:
        return set(trace.read_text().split())
    except FileNotFoundError:
        return set()


def read_store(state_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(pools, every replica, every event) as committed, through a read-only Store."""
    with Store(state_dir / "state.db", readonly=True) as s:
        return s.pools(), s.replicas(include_terminal=True), s.events()


def n_of(rid: str) -> tuple[str, int]:
    pool, _, n = rid.rpartition("-")
    return pool, int(n)


# -- 1. kill -9 during churn ----------------------------------------------------------


class Churn(threading.Thread):
    """Random launch / terminate / scale commands through one Client; records each command
    the daemon acknowledged (an ok reply) with its id, until stopped or the daemon is gone."""

    POOLS = ("a", "b")

    def __init__(self, state_dir: Path, ids: IdSource, rng: random.Random, live: set[str],
                 pools: set[str], killed: threading.Event, command: list[str]) -> None:
        super().__init__(name="churn", daemon=True)
        self.state_dir, self.ids, self.rng, self.killed = state_dir, ids, rng, killed
        self.command = command
        self.live = set(live)
        self.pools = set(pools)
        self.acked: list[tuple[str, str, Any, bool]] = []  # (command id, op, result, wait)
        self._wait = False
        self.errors: list[str] = []
        self.sent = 0
        self.halt = threading.Event()

    def _one(self, client: Client) -> tuple[str, Any]:
        rng = self.rng
        roll = rng.random()
        if self.live and (roll < 0.35 or len(self.live) > 12):
            victims = rng.sample(sorted(self.live), min(len(self.live), rng.randint(1, 2)))
            self._wait = rng.random() < 0.3
            result = client.terminate(*victims, wait=self._wait, timeout=20)
            self.live.difference_update(victims)
            return "terminate", result
        if self.pools and roll < 0.55:
            pool = rng.choice(sorted(self.pools))
            self._wait = False
            result = client.scale(pool, rng.randint(0, 4))
            self.live.update(result["launched"])
            self.live.difference_update(result["terminated"])
            return "scale", result
        pool = rng.choice(self.POOLS)
        self._wait = rng.random() < 0.3
        result = client.launch(pool, self.command, count=rng.randint(1, 3), wait=self._wait, timeout=20)
        self.pools.add(pool)
        self.live.update(result)
        return "launch", result

    def run(self) -> None:
        try:
            with Client(self.state_dir, timeout=20) as client:
                while not self.halt.is_set():
                    self.sent += 1
                    try:
                        op, result = self._one(client)
                    except (ChannelError, DaemonNotRunning, ShuttingDown) as err:
                        if not self.killed.is_set():
                            self.errors.append(f"{type(err).__name__}: {err}")
                        return
                    except OrchestratorError as err:  # refused: not acknowledged, and not expected
                        self.errors.append(f"refused: {type(err).__name__}: {err}")
                        return
                    self.acked.append((self.ids.last, op, result, self._wait))
        except DaemonNotRunning:
            if not self.killed.is_set():
                raise
        except BaseException as err:  # reported by the test
            self.errors.append(f"{type(err).__name__}: {err}")


def _acked_ids(acked: list[tuple[str, str, Any, bool]]) -> set[str]:
    out: set[str] = set()
    for _, op, result, _ in acked:
        if op == "launch":
            out.update(result)
        elif op == "scale":
            out.update(result["launched"])
    return out


@pytest.mark.stress
def test_kill9_during_churn_then_restart(daemon: TaggedDaemon, ids: IdSource) -> None:
    """CRASH_TRIALS times: churn, kill -9 at a random moment, the watchdog's clean-up, a
    restart; then the store is intact, no acknowledged command is missing from the
    journal, the replicas live at the kill are LOST, every pool is back at its desired size
    with live processes, and no id was ever handed out twice."""
    seed = int(CRASH_SEED) if CRASH_SEED else random.randrange(1 << 30)
    rng = random.Random(seed)
    state = daemon.state_dir
    db = state / "state.db"
    trace = state.parent / "trace"
    problems: dict[str, list[str]] = {}   # kind of violation -> instances
    observed: set[str] = set()           # every replica id seen so far, in any way
    acked_everything: list[tuple[str, str, Any, bool]] = []

    def problem(trial: int | None, kind: str, what: str) -> None:
        problems.setdefault(kind, []).append(what if trial is None else f"trial {trial}: {what}")

    daemon.start()
    for trial in range(CRASH_TRIALS):
        # -- churn, then kill -9 at a random moment of it ---------------------------
        with Client(state) as c:
            before = c.status()
        live = {r["id"] for r in before["replicas"] if r["state"] not in TERMINAL_STATES}
        killed = threading.Event()
        churn = Churn(state, ids, random.Random(rng.random()), live,
                      {p["name"] for p in before["pools"]}, killed, traced(trace))
        acks_before_kill = rng.randint(0, 6)
        churn.start()
        try:
            wait_for(lambda: len(churn.acked) >= acks_before_kill or not churn.is_alive(), 30,
                     f"{acks_before_kill} acknowledged commands")
            assert not churn.errors, (seed, trial, churn.errors)
            # The fault's offset into the churn: a random moment, mid-command or between two.
            time.sleep(rng.uniform(0, 0.03))
            daemon.snapshot()
            killed.set()
            daemon.kill9()
        finally:
            churn.halt.set()
            churn.join(timeout=40)
        assert not churn.is_alive(), "a client call did not return after the daemon died"
        assert not churn.errors, (seed, trial, churn.errors)
        acked = list(churn.acked)
        acked_everything += acked
        wait_for(daemon.gone, 15, "the watchdog to end every process of the daemon's tree")

        # -- the store as the crash left it, read with the daemon down ------------------
        with Store(db, readonly=True) as s:
            if not s.integrity_ok():
                problem(trial, "integrity", "state.db fails PRAGMA integrity_check after kill -9")
        pools, stored, events = read_store(state)
        by_id = {r["id"]: r for r in stored}
        if trial % CLI_EVERY == 0:  # the CLI's view is the store's (a CLI call costs ~0.15 s)
            down = cli(state, "status", "--all", "--json")
            assert down.returncode == 3, (down.returncode, down.stderr)
            down_data = json.loads(down.stdout)
            assert down_data["daemon"]["running"] is False
            assert {r["id"]: r["state"] for r in down_data["replicas"]} == {
                rid: r["state"] for rid, r in by_id.items()}, "status (daemon down) is not the store"
        journal = {e["data"].get("cmd_id"): e["data"] for e in events if e["kind"] == "command"}
        for cmd_id, op, _, wait in acked:
            what = f"acknowledged {op}{' --wait' if wait else ''} {cmd_id}"
            got = journal.get(cmd_id)
            if got is None:
                problem(trial, "acknowledged command not journaled", f"{what} is not in the journal")
            elif got.get("op") != op or got.get("ok") is not True:
                problem(trial, "acknowledged command journaled wrong", f"{what} is journaled as {got}")
        for rid in sorted(_acked_ids(acked) - set(by_id)):
            problem(trial, "acknowledged id not in the store", f"{rid}, handed out in an acknowledged reply, is not in the store")
        live_at_kill = {rid for rid, r in by_id.items() if r["state"] not in TERMINAL_STATES}
        desired = {p["name"]: p["desired"] for p in pools}
        top = {}
        for rid in observed | set(by_id) | _acked_ids(acked):
            pool, n = n_of(rid)
            top[pool] = max(top.get(pool, 0), n)
        observed |= set(by_id) | _acked_ids(acked)
        for rid in sorted(ran(trace) - set(by_id)):
            pool, n = n_of(rid)
            top[pool] = max(top.get(pool, 0), n)
        ran_before = ran(trace)

        # -- restart: recovery, then every pool back at its desired size ---------------
        daemon.start()
        if list(state.glob("state.db.corrupt-*")):
            problem(trial, "corrupt after kill", "the restarted daemon found state.db corrupt and moved it aside")

        def settled() -> bool:
            with Client(state) as c:
                reps = c.status()["replicas"]
            return all(r["state"] == "RUNNING" for r in reps)

        wait_for(settled, 20, "the restored replicas to run")
        if trial % CLI_EVERY == 0:
            data = daemon.status(all=True)  # `status --all --json`
            assert data["daemon"]["running"] is True
        else:  # the same command, without a CLI process
            with Client(state) as c:
                data = c.status(all=True)
            daemon.seen |= {i for r in data["replicas"] if r["pid"] and (i := Ident.of(r["pid"]))}
        now = {r["id"]: r for r in data["replicas"]}
        for rid in sorted(live_at_kill):
            r = now.get(rid)
            if r is None or r["state"] != "LOST":
                problem(trial, "live at the kill, not LOST", f"{rid} was {by_id[rid]['state']} at the kill, after the restart: "
                               f"{r and r['state']}")
        for rid in sorted(set(by_id) - live_at_kill):
            if rid in now and now[rid]["state"] != by_id[rid]["state"]:
                problem(trial, "terminal state changed", f"terminal {rid} changed from {by_id[rid]['state']} to {now[rid]['state']}")
        new = {rid: r for rid, r in now.items() if rid not in observed}
        for rid in sorted(new):
            pool, n = n_of(rid)
            if rid in ran_before:
                problem(trial, "id reused", f"{rid} handed out after the restart, but a process ran as {rid} before "
                               f"the kill (the store never recorded it)")
            elif n <= top.get(pool, 0):
                problem(trial, "id reused", f"{rid} handed out after the restart, but {pool}-{top[pool]} existed before")
        for pool, want in desired.items():
            got = sorted(rid for rid, r in new.items() if r["pool"] == pool)
            if len(got) != want:
                problem(trial, "pool not at its desired size", f"pool {pool}: desired {want}, relaunched {got}")
        # Every non-terminal replica runs, as the very process the store names.
        with Store(db, readonly=True) as s:
            records = {r["id"]: r for r in s.replicas()}
        for rid, r in now.items():
            if r["state"] in TERMINAL_STATES:
                continue
            rec = records.get(rid, {})
            ok = (r["state"] == "RUNNING" and r["pid"] and rec.get("pid") == r["pid"]
                  and rec.get("start_time") is not None and start_time(r["pid"]) == rec["start_time"])
            if ok:
                try:
                    ok = psutil.Process(r["pid"]).environ().get("ORCHESTRATOR_REPLICA_ID") == rid
                except psutil.Error:
                    ok = False
            if not ok:
                problem(trial, "non-terminal without its process", f"{rid} is {r['state']} (pid {r['pid']}) without its live process")
        daemon.snapshot()

    # -- over all trials: no id created twice, creation order strictly increasing -----
    _, stored, events = read_store(state)
    created: dict[str, list[int]] = {}
    seen_ids: set[str] = set()
    for e in events:
        if e["kind"] == "transition" and e["data"].get("from") is None:
            rid = e["replica"]
            if rid in seen_ids:
                problem(None, "id reused", f"{rid} was created twice (journal seq {e['seq']})")
            seen_ids.add(rid)
            pool, n = n_of(rid)
            created.setdefault(pool, []).append(n)
    for pool, ns in created.items():
        if ns != sorted(set(ns)):
            problem(None, "id order", f"pool {pool}: ids not handed out in increasing order: {ns}")
    assert len(events) < 50_000, "the journal was pruned: the check above saw only part of it"
    runs = collections.Counter(trace.read_text().split() if trace.exists() else [])
    for rid, k in sorted(runs.items()):
        if k > 1:
            problem(None, "id reused", f"{k} processes ran as {rid}: its id was handed out again")
    for rid in sorted(set(runs) - seen_ids, key=n_of)[:10]:
        problem(None, "ran but never journaled", f"a process ran as {rid}, which the journal never recorded")
    n_acked = len(acked_everything)
    report = [f"{kind}: {len(items)}, e.g.\n    " + "\n    ".join(items[:4]) for kind, items in problems.items()]
    assert not problems, (f"seed {seed} (CRASH_SEED={seed} to replay), {CRASH_TRIALS} trials, {n_acked} "
                          f"acknowledged commands; violations by kind:\n  " + "\n  ".join(report))
    assert n_acked >= CRASH_TRIALS, "the churn hardly ran: the test checked little"


def test_kill9_mid_launch_burst_never_reuses_an_id(daemon: TaggedDaemon) -> None:
    """A replica's id must be durable before any process runs with it: the control loop
    forks a whole batch (up to spawn_batch=64) in one turn and commits at the end of the
    turn. A kill -9 in between leaves processes that ran as t-1.. (and were killed by their
    PDEATHSIG) while the store never heard of those ids, and the next daemon hands them out
    again. The kill is synchronised on the state it needs: the first worker of the burst has
    run (its id is in the trace) -- from there the daemon is, most likely, still forking."""
    state = daemon.state_dir
    trace = state.parent / "trace"
    daemon.start()
    landed = 0
    for attempt in range(3):
        pool = f"t{attempt}"
        outcome: list[Any] = []

        def burst() -> None:
            try:
                with Client(state) as c:
                    outcome.append(c.launch(pool, traced(trace), count=64))
            except (ChannelError, DaemonNotRunning) as err:
                outcome.append(err)  # the daemon died before it answered: not acknowledged

        thread = threading.Thread(target=burst, daemon=True)
        daemon.snapshot()
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not any(rid.startswith(pool + "-") for rid in ran(trace)):
                assert time.monotonic() < deadline, "no worker of the burst ran within 30 s"
                time.sleep(0.0005)
            daemon.snapshot()
            daemon.kill9()
        finally:
            thread.join(timeout=40)
        assert outcome, "the launch call did not return after the daemon died"
        wait_for(daemon.gone, 15, "the watchdog to clean up")
        ran_before = {rid for rid in ran(trace) if rid.startswith(pool + "-")}
        _, stored, _ = read_store(state)
        unrecorded = ran_before - {r["id"] for r in stored}
        landed += bool(unrecorded)

        daemon.start()
        with Client(state) as c:
            after = c.launch(pool, traced(trace), count=3, wait=True, timeout=30)  # a pool runs one spec
            data = c.status(all=True)
        daemon.seen |= {i for r in data["replicas"] if r["pid"] and (i := Ident.of(r["pid"]))}
        reused = sorted(set(after) & ran_before, key=lambda rid: n_of(rid)[1])
        assert not reused, (f"ids handed out again after a kill -9: {reused}; processes ran as "
                            f"{sorted(unrecorded, key=lambda rid: n_of(rid)[1])} but the store never "
                            f"recorded them (the launch was {outcome[0]!r:.60})")
        if landed:
            break
        with Client(state) as c:  # the burst was committed before the kill: empty it, try again
            c.scale(pool, 0)


def test_acknowledged_wait_commands_are_journaled(daemon: TaggedDaemon, ids: IdSource) -> None:
    """launch --wait and terminate --wait are commands the daemon acknowledged like any other:
    the journal must have them (op, cmd_id, ok), like launch, terminate and scale without."""
    daemon.start()
    sent = []
    with Client(daemon.state_dir) as c:
        c.launch("w", SLEEP, count=2)
        sent.append(("launch", ids.last))
        c.launch("w", SLEEP, count=2, wait=True)
        sent.append(("launch", ids.last))
        c.terminate("w-1")
        sent.append(("terminate", ids.last))
        c.terminate("w-3", wait=True)
        sent.append(("terminate", ids.last))
        c.scale("w", 1)
        sent.append(("scale", ids.last))
    _, _, events = read_store(daemon.state_dir)
    journal = {e["data"]["cmd_id"]: e["data"] for e in events if e["kind"] == "command"}
    missing = [(op, cid) for op, cid in sent if journal.get(cid, {}).get("ok") is not True]
    assert not missing, f"acknowledged but not journaled: {missing}"
    assert [journal[cid]["op"] for _, cid in sent] == [op for op, _ in sent]


# -- 2. status and events with the daemon down; events --follow -------------------------


def _events(state: Path, *args: str) -> list[dict]:
    proc = cli(state, "events", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


class LineReader:
    """Lines of a subprocess's stdout, read by a thread, taken with a bound."""

    def __init__(self, stream: Any) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self._t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._t.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line)

    def until(self, cond: Any, timeout: float, got: list[dict]) -> None:
        deadline = time.monotonic() + timeout
        while not cond(got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"events --follow: timed out; got {len(got)} events: {got[-5:]}")
            try:
                got.append(json.loads(self.lines.get(timeout=left)))
            except queue.Empty:
                continue

    def join(self, timeout: float) -> None:
        self._t.join(timeout)


def test_status_and_events_with_the_daemon_down(daemon: TaggedDaemon) -> None:
    state = daemon.state_dir
    daemon.start()
    cli(state, "launch", "--pool", "web", "--count", "3", "--wait", "--", *SLEEP, check=True)
    cli(state, "terminate", "web-1", "--wait", check=True)
    up = daemon.status(all=True)
    daemon.snapshot()
    daemon.kill9()
    wait_for(daemon.gone, 15, "the watchdog to clean up")

    # status: from the store, says so, exit 3; replicas in their last recorded states.
    down = cli(state, "status", "--json")
    assert down.returncode == 3, down.stderr
    data = json.loads(down.stdout)
    assert data["state_dir"] == str(state)
    assert data["daemon"]["running"] is False and data["daemon"]["pid"] is None
    assert sized(data["pools"]) == [{"name": "web", "desired": 2}]
    assert [(r["id"], r["state"]) for r in data["replicas"]] == [("web-2", "RUNNING"), ("web-3", "RUNNING")]
    for r in data["replicas"]:
        assert set(r) >= {"id", "pool", "state", "pid", "exit_code", "reason", "created_at", "ended_at"}
    down_all = json.loads(cli(state, "status", "--all", "--json").stdout)
    assert {r["id"]: r["state"] for r in down_all["replicas"]} == {
        "web-1": "TERMINATED", "web-2": "RUNNING", "web-3": "RUNNING"}
    was = {r["id"]: r for r in up["replicas"]}
    for r in down_all["replicas"]:
        assert r["created_at"] == was[r["id"]]["created_at"]
    text = cli(state, "status")
    assert text.returncode == 3 and "not running" in text.stdout and "web-2" in text.stdout

    # events: the journal, read with the daemon down.
    every = _events(state)
    assert every and [e["seq"] for e in every] == sorted({e["seq"] for e in every})
    assert "transition" in {e["kind"] for e in every}
    plain = cli(state, "events")
    assert plain.returncode == 0 and len(plain.stdout.splitlines()) == len(every)
    one = _events(state, "--replica", "web-1")
    assert {e["replica"] for e in one} == {"web-1"}
    assert [e["data"]["to"] for e in one] == LIFECYCLE
    assert [e["data"]["from"] for e in one] == [None, *LIFECYCLE[:-1]]
    assert [e["seq"] for e in one] == sorted(e["seq"] for e in one)
    t = one[3]["ts"]  # web-1's STOPPING
    since = _events(state, "--since", repr(t))
    assert since == [e for e in every if e["ts"] >= t]
    assert since and len(since) < len(every)
    assert [e["data"]["to"] for e in _events(state, "--replica", "web-1", "--since", repr(t))] == LIFECYCLE[3:]

    # events --follow, started with the daemon down: it prints the restart's recovery and
    # what follows, each event once, in order.
    follow = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(state), "events", "--follow", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
        env=cli_env(), start_new_session=True,
    )
    got: list[dict] = []
    reader = LineReader(follow.stdout)
    try:
        if ident := Ident.of(follow.pid):
            daemon.seen.add(ident)
        reader.until(lambda g: len(g) >= len(every), 20, got)
        assert got == every
        daemon.start()
        reader.until(lambda g: any(e["kind"] == "recovery" for e in g), 20, got)
        cli(state, "launch", "--pool", "f", "--wait", "--", *SLEEP, check=True)
        reader.until(lambda g: any(e["replica"] == "f-1" and e["data"].get("to") == "RUNNING" for e in g),
                     20, got)
        cli(state, "terminate", "f-1", "--wait", check=True)
        reader.until(lambda g: any(e["replica"] == "f-1" and e["data"].get("to") == "TERMINATED" for e in g),
                     20, got)
    finally:
        if follow.poll() is None:
            follow.terminate()
        follow.wait(timeout=10)
        reader.join(timeout=10)  # at EOF now: the pipe's only writer is gone
        follow.stdout.close()
    seqs = [e["seq"] for e in got]
    assert seqs == sorted(set(seqs)), "events --follow repeated or reordered events"
    assert got == _events(state)[: len(got)], "events --follow skipped an event"
    assert [e["data"]["to"] for e in got if e["replica"] == "f-1"] == LIFECYCLE
    lost = {e["replica"]: e["data"] for e in got if e["data"].get("to") == "LOST"}
    assert set(lost) == {"web-2", "web-3"}
    assert all(d["from"] == "RUNNING" for d in lost.values())


# -- 3. a corrupt state.db at start ---------------------------------------------------------


def test_corrupt_state_db_is_moved_aside_and_the_daemon_works(daemon: TaggedDaemon) -> None:
    state = daemon.state_dir
    state.mkdir(parents=True)
    garbage = os.urandom(64 * 1024)
    (state / "state.db").write_bytes(garbage)

    # With the daemon down the readers say what is wrong and touch nothing.
    for args in (("status", "--json"), ("events",)):
        proc = cli(state, *args)
        assert proc.returncode == 1, (args, proc.returncode, proc.stdout, proc.stderr)
        assert "state db" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (state / "state.db").read_bytes() == garbage

    daemon.start()
    aside = sorted(state.glob("state.db.corrupt-*"))
    assert len(aside) == 1, aside
    assert aside[0].read_bytes() == garbage, "the bad file must be kept as it was"
    log = (state / "logs" / "daemon.log").read_text()
    line = next((ln for ln in log.splitlines() if str(aside[0]) in ln), None)
    assert line is not None, log
    assert "WARNING" in line and "unreadable" in line and "moved aside" in line, line

    cli(state, "launch", "--pool", "w", "--count", "2", "--wait", "--", *SLEEP, check=True)
    data = daemon.status()
    assert [(r["id"], r["state"]) for r in data["replicas"]] == [("w-1", "RUNNING"), ("w-2", "RUNNING")]
    with Store(state / "state.db", readonly=True) as s:
        assert s.integrity_ok()
        assert {e["replica"] for e in s.events() if e["kind"] == "transition"} == {"w-1", "w-2"}
    assert cli(state, "stop").returncode == 0
    assert sorted(state.glob("state.db.corrupt-*")) == aside
    after = json.loads(cli(state, "status", "--all", "--json").stdout)
    assert {r["id"]: r["state"] for r in after["replicas"]} == {"w-1": "TERMINATED", "w-2": "TERMINATED"}


# -- 4. retention: the limits given to `start`, applied by the daemon -----------------------
#
# `start --keep-replicas N --keep-events N --keep-days D` hands the limits to the daemon's
# Store, which prunes at open and then every prune_every (1000, not configurable) rows
# written. The Store's own retention rules are tested in tests/test_store.py; here: that the
# daemon applies what it is given, while running and at the next start, and that ids go on.

KEEP = ("--keep-replicas", "5", "--keep-events", "40", "--keep-days", "7")


def test_retention_options_bound_the_daemons_history(daemon: TaggedDaemon) -> None:
    state = daemon.state_dir
    daemon.start(*KEEP)
    with Client(state) as c:
        for _ in range(8):  # 160 replicas: ~1,500 rows written, so the loop prunes at least once
            ids = c.launch("r", SLEEP, count=20, wait=True, timeout=60)
            c.terminate(*ids, wait=True, timeout=60)
    with Store(state / "state.db", readonly=True) as s:
        ended = s.replicas(include_terminal=True)
        events, last = s.events(), s.last_seq()
    assert len(ended) < 160, "no terminal replica pruned while the daemon ran"
    assert len(events) < last, "no event pruned while the daemon ran"
    assert len(events) <= 40 + 1000 and len(ended) <= 5 + 1000 // 4

    assert cli(state, "stop").returncode == 0
    restart = time.time()
    daemon.start(*KEEP)  # prunes at open, to the limits exactly
    with Store(state / "state.db", readonly=True) as s:
        ended = s.replicas(include_terminal=True)
        events, last = s.events(), s.last_seq()
        assert s.pools()[0]["next_n"] == 161
    assert len(ended) == 5 and all(r["state"] == "TERMINATED" for r in ended)
    assert {n_of(r["id"])[1] for r in ended} <= set(range(141, 161)), "not the most recently ended"
    assert [e["seq"] for e in events] == list(range(events[0]["seq"], last + 1))
    assert len([e for e in events if e["ts"] < restart]) == 40, "the old journal is not cut to 40"
    data = daemon.status(all=True)
    assert sorted(r["id"] for r in data["replicas"]) == sorted(r["id"] for r in ended)
    assert cli(state, "launch", "--pool", "r", "--wait", "--", *SLEEP, check=True).stdout.split() == ["r-161"]


def test_daemon_prunes_old_history_at_start_but_recovers_old_live_replicas(
        daemon: TaggedDaemon) -> None:
    state = daemon.state_dir
    state.mkdir(parents=True)
    old = time.time() - 8 * 86400
    recent = time.time() - 60
    decoy = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL)
    try:
        # old-2 "runs" as the decoy's pid with another start time: a reused pid, not ours.
        with Store(state / "state.db") as s:
            s.save_pool("old", make_spec(SLEEP).to_wire(), 1, 3)
            base = {"pool": "old", "exit_code": None, "reason": None, "created_at": old}
            s.save_replica({**base, "id": "old-1", "n": 1, "state": "TERMINATED", "pid": None,
                            "start_time": None, "exit_code": -15, "ended_at": old})
            s.save_replica({**base, "id": "old-2", "n": 2, "state": "RUNNING", "pid": decoy.pid,
                            "start_time": start_time(decoy.pid) - 1, "ended_at": None})
            s.append_event("transition", replica="old-1", ts=old,
                           data={"from": "STOPPING", "to": "TERMINATED", "reason": None})
            s.append_event("note", ts=recent, data={"kept": True})
        daemon.start()
        assert decoy.poll() is None, "recovery signalled a process that only shares a pid"

        data = daemon.status(all=True)
        states = {r["id"]: r for r in data["replicas"]}
        assert "old-1" not in states, "a terminal replica ended 8 days ago was kept"
        assert states["old-2"]["state"] == "LOST" and "found dead" in states["old-2"]["reason"]
        wait_for(lambda: [r["state"] for r in daemon.status()["replicas"]] == ["RUNNING"], 20, "old-3")
        assert [r["id"] for r in daemon.status()["replicas"]] == ["old-3"]
        kinds = [(e["kind"], e["replica"]) for e in _events(state)]
        assert ("transition", "old-1") not in kinds, "an event from 8 days ago was kept"
        assert kinds[0] == ("note", None), kinds
        assert ("recovery", None) in kinds and ("transition", "old-2") in kinds
    finally:
        decoy.kill()
        decoy.wait(timeout=10)


# -- the embedded API's journal after its process was killed ----------------------------------


def test_embedded_orchestrator_db_marks_a_killed_runs_replicas_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Orchestrator(db=path) keeps the same journal as the daemon: when the process that ran
    it was killed, the next Orchestrator on that db must not report the dead run's replicas
    as RUNNING (with pids that are gone) forever; they are LOST, as after a daemon crash."""
    from orchestrator import Orchestrator

    tag = f"recovery:{uuid.uuid4().hex}"
    monkeypatch.setenv("ORCH_TEST_TAG", tag)
    db = tmp_path / "embedded.db"
    code = (
        "import json, sys, time\n"
        "from orchestrator import Orchestrator\n"
        "o = Orchestrator(db=sys.argv[1], grace=1.0)\n"
        "o.start()\n"
        "ids = o.launch('e', ['sleep', '1000'], count=2, wait=True)\n"
        "print(json.dumps([r['pid'] for r in o.status()['replicas']]), flush=True)\n"
        "time.sleep(1000)\n"
    )
    host = subprocess.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=cli_env())
    seen = {i for i in [Ident.of(host.pid)] if i}
    try:
        line = host.stdout.readline()
        assert line, "the embedded orchestrator did not start"
        seen |= {i for pid in json.loads(line) if (i := Ident.of(pid))}
        host.kill()  # our own unreaped child: the pid cannot have been reused
        host.wait(timeout=10)
        wait_for(lambda: not survivors(seen) and not tagged(tag), 15, "the killed run's workers to end")

        with Orchestrator(db=db, grace=1.0) as orch:
            replicas = {r["id"]: r for r in orch.status(all=True)["replicas"]}
            assert set(replicas) == {"e-1", "e-2"}
            assert orch.launch("e", SLEEP, wait=True) == ["e-3"]  # ids continue
            stale = {rid: (r["state"], r["pid"]) for rid, r in replicas.items()
                     if r["state"] not in TERMINAL_STATES}
            assert not stale, f"replicas of a killed run still reported live: {stale}"
            assert {r["state"] for r in replicas.values()} == {"LOST"}
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(timeout=10)
        host.stdout.close()
        left = set(survivors(seen)) | tagged(tag)
        kill_all(left)
        assert not left, f"processes left behind: {left}"
