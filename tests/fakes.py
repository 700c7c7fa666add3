"""The engine's fakes, for the state-machine tests (test_engine, test_supervision,
test_containment, test_stress, test_reload, test_bad_values): ``FakeOS`` has OSApi's methods
over pipes the test controls and a clock the test moves; ``Journal`` is a store that records
every transition; ``Harness`` drives an ``Engine`` over them one turn at a time; ``launch``,
``run``, ``pool``, ``live`` and ``later`` drive a supervised pool on one.

Each fake process is two real pipes whose write ends the test holds: closing the exit pipe
is the process exiting, closing the ready pipe is the worker running, a message then close
is "could not start". The fake also polices the engine: it records every signal, and flags
a signal to a reaped pid, a reap of a live process, a double reap, and any fd closed twice
or not its own.
"""

from __future__ import annotations

import os
import signal

from orchestrator.daemon.engine import Engine, EngineConfig
from orchestrator.daemon.osapi import Spawned
from orchestrator.spec import LaunchPlan
from orchestrator.states import TRANSITIONS, ReplicaState

S = ReplicaState
SPEC = {"command": ["sleep", "1000"]}
NO_RESTART = {"restart": "never"}
LIVE = ("PENDING", "STARTING", "RUNNING")


# -- the fake OS --------------------------------------------------------------------------


class FakeProc:
    def __init__(self, pid: int, replica_id: str, argv, exe, env, on_term: str) -> None:
        self.pid, self.replica_id, self.argv, self.exe, self.env = pid, replica_id, argv, exe, env
        self.exit_r, self.exit_w = os.pipe()
        self.ready_r, self.ready_w = os.pipe()
        os.set_blocking(self.ready_r, False)
        self.on_term = on_term  # "manual" | "die" (default action) | "exit0" | "ignore"
        self.code: int | None = None
        self.reaped = False

    @property
    def exited(self) -> bool:
        return self.code is not None


class FakeOS:
    """OSApi's methods over pipes the test controls, with a clock the test moves."""

    def __init__(self, on_term: str = "manual") -> None:
        self.now = 1000.0
        self.on_term = on_term
        self.procs: dict[int, FakeProc] = {}
        self.order: list[int] = []  # pids in spawn order
        self.signals: list[tuple[int, int, str]] = []  # (pid, sig, "alive" | "exited")
        self.violations: list[str] = []
        self.spawn_error: OSError | None = None
        self._given: set[int] = set()  # read ends handed to the engine, not yet closed
        self._next_pid = 4001

    # OSApi
    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def spawn(self, plan: LaunchPlan, via: object = None) -> Spawned:
        if self.spawn_error is not None:
            raise self.spawn_error
        pid, self._next_pid = self._next_pid, self._next_pid + 1
        p = FakeProc(pid, plan.replica_id, plan.argv, plan.exe, dict(plan.env), self.on_term)
        self.procs[pid] = p
        self.order.append(pid)
        self._given |= {p.exit_r, p.ready_r}
        return Spawned(pid, p.exit_r, p.ready_r, start_time=pid * 7)

    def _signalled(self, pid: int, sig: int) -> FakeProc | None:
        """Record ``sig`` to ``pid``; the process, or None (and a violation) if it is not an
        unreaped child."""
        p = self.procs.get(pid)
        if p is None or p.reaped:
            self.violations.append(f"signal {sig} to {pid}, which is not an unreaped child")
            return None
        self.signals.append((pid, sig, "exited" if p.exited else "alive"))
        return p

    def kill_child(self, pid: int, sig: int) -> bool:
        """A signal to the process alone (the engine's SIGURG kick): recorded, no effect."""
        return self._signalled(pid, sig) is not None

    def signal_group(self, pgid: int, sig: int) -> bool:
        p = self._signalled(pgid, sig)
        if p is None:
            return False
        if p.exited:
            return True  # the zombie pins the group; nobody left to receive it
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and p.on_term == "die"):
            self.exit(pgid, -sig)
        elif sig == signal.SIGTERM and p.on_term == "exit0":
            self.exit(pgid, 0)  # it was ending anyway and got there first
        return True

    def escaped_descendants(self, pid: int) -> list[tuple[int, int]]:
        return []  # fake processes fork nothing

    def signal_verified(self, ident: tuple[int, int], sig: int) -> bool:
        self.violations.append(f"signal {sig} to {ident}, which no fake process forked")
        return False

    def reap(self, pid: int) -> int | None:
        p = self.procs[pid]
        if p.reaped:
            self.violations.append(f"reaped {pid} twice")
        elif not p.exited:
            self.violations.append(f"reap of {pid}, which has not exited, would block")
        p.reaped = True
        return p.code

    def read_ready(self, fd: int) -> bytes:
        try:
            return os.read(fd, 4096)
        except BlockingIOError:
            self.violations.append(f"read_ready({fd}) on a pipe that is not readable")
            return b""

    def close(self, fd: int) -> None:
        if fd not in self._given:
            self.violations.append(f"close({fd}): not an open fd of a spawned process")
            return
        self._given.discard(fd)
        os.close(fd)

    # the test's side
    def pid(self, index: int = -1) -> int:
        return self.order[index]

    def ready(self, pid: int) -> None:
        """The worker runs (exec succeeded / the callable is about to run)."""
        p = self.procs[pid]
        if p.ready_w >= 0:
            os.close(p.ready_w)
            p.ready_w = -1

    def cannot_start(self, pid: int, message: bytes, *, exit_too: bool = True) -> None:
        p = self.procs[pid]
        os.write(p.ready_w, message)
        self.ready(pid)
        if exit_too:
            self.exit(pid, 127)

    def exit(self, pid: int, code: int) -> None:
        """The process ends: every fd it held closes, its exit becomes readable."""
        p = self.procs[pid]
        assert not p.exited, f"{pid} exited twice"
        p.code = code
        self.ready(pid)
        os.close(p.exit_w)
        p.exit_w = -1

    def open_fds_of(self, pid: int) -> set[int]:
        p = self.procs[pid]
        return {p.exit_r, p.ready_r} & self._given

    def signals_to(self, pid: int) -> list[tuple[int, str]]:
        return [(sig, when) for p, sig, when in self.signals if p == pid]

    def cleanup(self) -> None:
        for p in self.procs.values():
            for fd in (p.exit_w, p.ready_w):
                if fd >= 0:
                    os.close(fd)
        for fd in self._given:
            os.close(fd)
        self._given.clear()


class Journal:
    """A stand-in store that records every transition the engine makes."""

    def __init__(self) -> None:
        self.transitions: list[tuple[str, str | None, str]] = []
        self.commands: list[dict] = []
        self.pending = 0  # rows buffered since the last commit
        self.committed_ids: set[str] = set()  # replica ids made durable
        self._buffered_ids: set[str] = set()
        self.failing: str | None = None  # set: every commit fails with this (a full disk)
        self.events: list[tuple[str, dict]] = []  # committed events other than transitions
        self._buffered_events: list[tuple[str, dict]] = []

    def save_replica(self, record: dict) -> None:
        self.pending += 1
        self._buffered_ids.add(record["id"])

    def save_pool(self, name, spec, desired, next_n) -> None:
        pass

    def append_event(self, kind: str, replica: str | None = None, ts: float | None = None, data=None) -> None:
        if kind == "transition":
            self.transitions.append((replica, data["from"], data["to"]))
        else:
            self.commands.append(data)
            self.pending += 1
            self._buffered_events.append((kind, data))

    def replicas(self, include_terminal: bool = False) -> list[dict]:
        return []

    def commit(self) -> None:
        if self.failing is not None:
            from orchestrator.store import StoreError

            raise StoreError(self.failing)
        self.events += self._buffered_events
        self._buffered_events.clear()
        self.pending = 0
        self.committed_ids |= self._buffered_ids
        self._buffered_ids.clear()

    def history(self, rid: str) -> list[str]:
        return [to for r, _, to in self.transitions if r == rid]


class Harness:
    """An Engine over a FakeOS, driven one turn at a time from the test thread."""

    def __init__(self, fake: FakeOS, **config) -> None:
        config.setdefault("grace", 5.0)
        config.setdefault("env", {})
        self.fake = fake
        self.journal = Journal()
        self.engine = Engine(EngineConfig(**config), os_api=fake, store=self.journal)
        self._next_id = 0

    def send(self, op, **args) -> list[dict]:
        """Apply one command now and run a turn; the replies so far (a waiter's come later)."""
        box: list[dict] = []
        self._next_id += 1
        self.engine.handle({"id": self._next_id, "op": op, "args": args}, box.append)
        self.turn()
        return box

    def cmd(self, op, **args) -> dict:
        box = self.send(op, **args)
        assert len(box) == 1, box
        return box[0]

    def ok(self, op, **args):
        reply = self.cmd(op, **args)
        assert reply["ok"], reply
        return reply["result"]

    def turn(self) -> None:
        self.engine.run_once(0)

    def status(self, all: bool = True) -> dict:  # noqa: A002
        return self.engine.status(include_terminal=all)

    def rep(self, rid: str) -> dict:
        (row,) = [r for r in self.status()["replicas"] if r["id"] == rid]
        return row

    def state(self, rid: str) -> str:
        return self.rep(rid)["state"]

    def desired(self, pool: str = "web") -> int:
        (row,) = [p for p in self.status()["pools"] if p["name"] == pool]
        return row["desired"]

    def launch(self, pool: str = "web", count: int = 1, **args) -> list[str]:
        # These tests are of the table, not of the restart policy: nothing is replaced.
        args.setdefault("policy", NO_RESTART)
        return self.ok("launch", pool=pool, count=count, spec=args.pop("spec", SPEC), **args)

    def running(self, pool: str = "web", count: int = 1) -> list[str]:
        ids = self.launch(pool, count)
        for rid in ids:
            self.fake.ready(self.rep(rid)["pid"])
        self.turn()
        assert [self.state(i) for i in ids] == ["RUNNING"] * count
        return ids

    def check_invariants(self) -> None:
        """Every pool's desired size equals its live replicas (no restart policy yet);
        every recorded history is a path in TRANSITIONS; the fake saw nothing illegal."""
        st = self.status()
        for pool in st["pools"]:
            live = [r for r in st["replicas"] if r["pool"] == pool["name"] and r["state"] in LIVE]
            assert pool["desired"] == len(live), (pool, live)
        for r in st["replicas"]:
            hist = self.journal.history(r["id"])
            assert hist[0] == "PENDING" and hist[-1] == r["state"], (r["id"], hist)
            for old, new in zip(hist, hist[1:]):
                assert S(new) in TRANSITIONS[S(old)], (r["id"], hist)
            if S(r["state"]).terminal:
                assert r["ended_at"] is not None
        assert self.fake.violations == []


# -- a supervised pool on the harness (test_supervision, test_pool_verbs) --------------------


def launch(h: Harness, count: int = 1, policy: dict | None = None, spec: dict = SPEC, pool: str = "web") -> list[str]:
    return h.ok("launch", pool=pool, count=count, spec=spec, policy=policy or {})


def run(h: Harness, rid: str) -> int:
    pid = h.rep(rid)["pid"]
    h.fake.ready(pid)
    h.turn()
    assert h.state(rid) == "RUNNING", h.rep(rid)
    return pid


def pool(h: Harness, name: str = "web") -> dict:
    (row,) = [p for p in h.status()["pools"] if p["name"] == name]
    return row


def live(h: Harness, name: str = "web") -> list[dict]:
    return [r for r in h.status(all=False)["replicas"] if r["pool"] == name]


def later(h: Harness, seconds: float) -> None:
    """Move the clock; the turns fire what is due, then fork what that launched."""
    h.fake.now += seconds
    h.turn()
    h.turn()
