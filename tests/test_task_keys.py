"""Task keys and tasks reached from any process (the request server's contract): a key
names one task of its pool, so a second submit with it is that task and never a second run
(embedded, in a daemon, from another client, from a client that restarted, across the
daemon's restart); ``POOL/@KEY`` wherever a task id is taken; a cancel from another process
raced against the task's end lands in that task alone; bad keys are refused in one line."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import keyfns
from conftest import TAG_VAR
from helpers import TESTS, DaemonUnderTest, cli, cli_env, one_line_error, wait_for
from orchestrator import Client, InvalidSpec, UnknownTask
from orchestrator import taskwire as w
from orchestrator.daemon import tasktable
from orchestrator.daemon.pools import Pool
from orchestrator.daemon.taskcarry import TaskCarry
from orchestrator.daemon.taskrecords import Doc, Task
from orchestrator.daemon.tasktable import TaskTable
from orchestrator.states import TaskState as T
from test_executor import MakeExecutor, make_executor  # noqa: F401  # the fixture
from test_tasktable_fake import (  # noqa: F401  # the fake's fixture
    POOL, FakeEngine, FakeStore, Harness, hand_over, make, state,
)

pytestmark = pytest.mark.timeout(180)


def _lines(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.fixture(params=["embedded", "daemon"])
def mode_executor(request: pytest.FixtureRequest, make_executor: MakeExecutor,  # noqa: F811
                  tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """An executor of one worker, embedded or in a daemon started for the test."""
    daemon: DaemonUnderTest | None = None
    if request.param == "daemon":
        daemon = request.getfixturevalue("daemon")
        daemon.start()

    def make(**kwargs: Any) -> Any:
        if daemon is None:
            return make_executor(1, **kwargs)
        return make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS), **kwargs)

    yield make


# -- idempotent keys ----------------------------------------------------------------------


def test_a_key_names_one_task_and_a_second_submit_is_that_task(mode_executor: Callable[..., Any],
                                                                tmp_path: Path) -> None:
    ex = mode_executor()
    started, release, log = tmp_path / "started", tmp_path / "release", tmp_path / "log"
    first = ex.options(key="req-1").submit(keyfns.held, str(started), str(release), "one")
    assert first.task_id is not None
    wait_for(started.exists, 30, "the keyed task to run")
    again = ex.options(key="req-1", priority=5).submit(keyfns.held, str(started), str(release), "two")
    assert again is first  # this executor's own future of that task
    plain = ex.submit(keyfns.record, str(log), "plain")
    assert plain.task_id is not None and plain.task_id != first.task_id
    release.touch()
    assert first.result(timeout=60) == "one"
    assert plain.result(timeout=60) == "plain"
    # Ended and kept: the key still names it; its future ends as that task did, no run.
    after = ex.options(key="req-1").submit(keyfns.record, str(log), "never")
    assert after is not first and after.task_id == first.task_id
    assert after.result(timeout=30) == "one"
    other = ex.options(key="req-2").submit(keyfns.record, str(log), "other")
    assert other.result(timeout=30) == "other" and other.task_id not in (first.task_id, plain.task_id)
    twice = [ex.options(key="req-3").submit(keyfns.record, str(log), f"t{i}") for i in range(5)]
    assert {f.task_id for f in twice} == {twice[0].task_id}
    assert [f.result(timeout=30) for f in twice] == ["t0"] * 5
    assert sorted(_lines(log)) == ["other", "plain", "t0"]  # each keyed task ran once
    with pytest.raises(TypeError, match="a key names one task"):
        ex.options(key="req-4").map(keyfns.record, [str(log)], ["x"])


def test_two_clients_with_one_key_share_its_task(daemon: DaemonUnderTest, make_executor: MakeExecutor,  # noqa: F811
                                                 tmp_path: Path) -> None:
    """Another client's submit with the key gets a future that follows the task (the first
    client's stays its own); a cancel through either lands in that task."""
    daemon.start()
    kw: dict[str, Any] = {"state_dir": daemon.state_dir, "pool": "jobs", "cwd": str(TESTS)}
    ex1, ex2 = make_executor(1, **kw), make_executor(1, **kw)
    started, release = tmp_path / "started", tmp_path / "release"
    a = ex1.options(key="shared").submit(keyfns.held, str(started), str(release), "a")
    wait_for(started.exists, 30, "the task to run")
    b = ex2.options(key="shared").submit(keyfns.held, str(started), str(release), "b")
    assert b.task_id == a.task_id and b is not a
    release.touch()
    assert a.result(timeout=60) == "a" and b.result(timeout=60) == "a"
    started.unlink()
    release.unlink()
    c = ex1.options(key="cancel-me").submit(keyfns.held, str(started), str(release), "c")
    wait_for(started.exists, 30, "the second task to run")
    d = ex2.options(key="cancel-me").submit(keyfns.held, str(started), str(release), "d")
    assert d.cancel() is True
    with pytest.raises(CancelledError):
        c.result(timeout=30)
    with pytest.raises(CancelledError):
        d.result(timeout=30)


CLIENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import keyfns
    from orchestrator import Client

    ex = Client({state_dir!r}).executor("jobs", max_workers=1, cwd={tests!r}, env={{{tag_var!r}: {tag!r}}})
    then, key, what = sys.argv[1], sys.argv[2], sys.argv[3:]
    fut = ex.options(key=key).submit(getattr(keyfns, what[0]), *what[1:])
    print(fut.task_id, flush=True)
    if then == "hang":
        time.sleep(120)  # killed meanwhile (kill -9): its session is left behind in the daemon
    print(repr(fut.result(timeout=60)), flush=True)
""")


def _client(daemon: DaemonUnderTest, tmp_path: Path, *argv: str) -> subprocess.Popen[str]:
    script = tmp_path / "client.py"
    script.write_text(CLIENT.format(tests=str(TESTS), state_dir=str(daemon.state_dir), tag_var=TAG_VAR,
                                    tag=cli_env()[TAG_VAR]))
    return subprocess.Popen([sys.executable, str(script), *argv], stdout=subprocess.PIPE, text=True,
                            env=cli_env())


def test_a_restarted_client_and_a_restarted_daemon_get_the_same_task(daemon: DaemonUnderTest,
                                                                     tmp_path: Path) -> None:
    daemon.start()
    log, started, release = tmp_path / "log", tmp_path / "started", tmp_path / "release"
    # A client that ended: its key's task ended, the next process gets it, not a run.
    one = _client(daemon, tmp_path, "wait", "req-1", "record", str(log), "first")
    out, _ = one.communicate(timeout=60)
    task_id, value = out.split()
    two = _client(daemon, tmp_path, "wait", "req-1", "record", str(log), "second")
    out, _ = two.communicate(timeout=60)
    assert out.split() == [task_id, value] == [task_id, "'first'"]
    # A client killed while its task runs (its session still in the daemon): the next one
    # follows that task.
    crashed = _client(daemon, tmp_path, "hang", "crash-1", "held", str(started), str(release), "held")
    try:
        assert crashed.stdout is not None
        held_id = crashed.stdout.readline().strip()
        wait_for(started.exists, 30, "the held task to run")
    finally:
        crashed.kill()
        crashed.wait(timeout=30)
    follower = _client(daemon, tmp_path, "wait", "crash-1", "record", str(log), "never")
    assert follower.stdout is not None
    assert follower.stdout.readline().strip() == held_id
    release.touch()
    assert follower.communicate(timeout=60)[0].strip() == "'held'"
    assert _lines(log) == ["first"]
    # Across the daemon's restart: the store finds the ended task by its key.
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    daemon.start()
    three = _client(daemon, tmp_path, "wait", "req-1", "record", str(log), "third")
    out, _ = three.communicate(timeout=60)
    assert out.split() == [task_id, "'first'"]
    assert _lines(log) == ["first"]


# -- POOL/@KEY wherever a task id is taken ------------------------------------------------


def test_pool_at_key_in_every_command(daemon: DaemonUnderTest, make_executor: MakeExecutor,  # noqa: F811
                                      tmp_path: Path) -> None:
    daemon.start()
    ex = make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS))
    log, started, release = tmp_path / "log", tmp_path / "started", tmp_path / "release"
    submit = ("submit", "--pool", "jobs", "--target", "keyfns:record", "--arg", json.dumps(str(log)))
    got = cli(daemon.state_dir, *submit, "--arg", '"cli"', "--key", "from-cli", "--wait", "--json")
    assert got.returncode == 0, got.stderr
    first = json.loads(got.stdout)
    again = cli(daemon.state_dir, *submit, "--arg", '"again"', "--key", "from-cli")
    assert again.returncode == 0 and again.stdout.strip() == first["id"]
    assert _lines(log) == ["cli"]
    assert json.loads(cli(daemon.state_dir, "result", "jobs/@from-cli", "--json").stdout)["result"] == "cli"
    (row,) = json.loads(cli(daemon.state_dir, "tasks", "jobs/@from-cli", "--json").stdout)
    assert (row["id"], row["key"], row["state"]) == (first["id"], "from-cli", "DONE")
    assert Client(daemon.state_dir).task("jobs/@from-cli").result(timeout=30) == "cli"
    # cancel by key (the CLI), of a running task the executor waits on
    fut = ex.options(key="long").submit(keyfns.held, str(started), str(release), "x")
    wait_for(started.exists, 30, "the task to run")
    handle = Client(daemon.state_dir).task("jobs/@long")
    assert handle.id == fut.task_id and handle.info()["state"] == "RUNNING"
    got = cli(daemon.state_dir, "cancel", "jobs/@long")
    assert got.returncode == 0 and got.stdout.strip() == "cancelled jobs/@long", got.stderr
    with pytest.raises(CancelledError):
        fut.result(timeout=30)
    with pytest.raises(CancelledError):
        handle.result(timeout=30)
    # a key of no task: one line, the daemon runs on
    for argv in (("result", "jobs/@nobody"), ("cancel", "jobs/@nobody"), ("tasks", "jobs/@nobody")):
        got = cli(daemon.state_dir, *argv)
        assert "no task of pool 'jobs' has that key" in one_line_error(got), argv
    with pytest.raises(UnknownTask):
        Client(daemon.state_dir).task("jobs/@nobody")
    # with the daemon down: result and tasks read the journal by key
    assert cli(daemon.state_dir, "stop", "--timeout", "60").returncode == 0
    assert json.loads(cli(daemon.state_dir, "result", "jobs/@from-cli", "--json").stdout)["result"] == "cli"
    down = cli(daemon.state_dir, "tasks", "jobs/@long", "--json")
    assert down.returncode == 3 and json.loads(down.stdout)[0]["state"] == "CANCELLED"


# -- a cancel from another process, raced against the task's end -------------------------


CANCELLER = textwrap.dedent("""
    import sys, time
    from orchestrator import Client

    client = Client(sys.argv[1])
    for line in sys.stdin:
        task_id, delay = line.split()
        time.sleep(float(delay))
        print(int(client.task(task_id).cancel()), flush=True)
""")


def test_a_cancel_from_another_process_lands_in_its_task_alone(daemon: DaemonUnderTest,
                                                               make_executor: MakeExecutor,  # noqa: F811
                                                               tmp_path: Path) -> None:
    """200 rounds: task a runs (a few ms, or longer) with b held behind it on the one worker;
    another process cancels a by its id (or its key) as a ends. a is cancelled exactly when that cancel says
    so, else it has its result; b (the task a misdirected cancel would hit) always has its
    result, and no task but an a ever ends CANCELLED."""
    daemon.start()
    ex = make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS))
    script = tmp_path / "canceller.py"
    script.write_text(CANCELLER)
    other = subprocess.Popen([sys.executable, str(script), str(daemon.state_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=cli_env())
    rng = random.Random(31)
    outcomes = {"cancelled": 0, "done": 0}
    named: set[str] = set()
    try:
        assert other.stdin is not None and other.stdout is not None
        for i in range(200):
            # By id: a plain submit, whose id may reach the other process before its batch
            # reaches the daemon (the handle asks again); by key: a keyed one.
            runs = rng.choice([0.0, 0.001, 0.002, 0.004, 0.05])
            a = ex.submit(keyfns.brief, f"a{i}", runs) if i % 2 else \
                ex.options(key=f"a{i}").submit(keyfns.brief, f"a{i}", runs)
            b = ex.submit(keyfns.brief, f"b{i}", 0.0)
            named.add(a.task_id)
            name = a.task_id if i % 2 else f"jobs/@a{i}"
            other.stdin.write(f"{name} {rng.choice([0.0, 0.0005, 0.001, 0.003])}\n")
            other.stdin.flush()
            said = other.stdout.readline().strip()
            assert said in ("0", "1"), said
            if said == "1":
                with pytest.raises(CancelledError):
                    a.result(timeout=30)
                outcomes["cancelled"] += 1
            else:
                assert a.result(timeout=30) == f"a{i}"
                outcomes["done"] += 1
            assert b.result(timeout=30) == f"b{i}", i
    finally:
        if other.stdin is not None:
            other.stdin.close()
        other.wait(timeout=30)
    assert other.returncode == 0
    assert outcomes["cancelled"] and outcomes["done"], outcomes  # the race was run both ways
    rows = json.loads(cli(daemon.state_dir, "tasks", "--pool", "jobs", "--all", "--json").stdout)
    assert {r["id"] for r in rows if r["state"] == "CANCELLED"} <= named
    assert all(r["state"] == "DONE" for r in rows if r["id"] not in named)


# -- bad keys ------------------------------------------------------------------------------


BAD_KEYS = [("", "1 to 200 bytes in UTF-8, got 0"), ("a/b", "must not contain '/'"),
            ("x" * 201, "1 to 200 bytes in UTF-8, got 201"), ("é" * 101, "got 202"), (7, "must be a str, got int"),
            (b"k", "must be a str, got bytes")]


def test_bad_keys_are_refused_in_one_line(mode_executor: Callable[..., Any], tmp_path: Path) -> None:
    ex = mode_executor()
    for key, line in BAD_KEYS:
        with pytest.raises(InvalidSpec) as info:
            ex.options(key=key)
        assert str(info.value).startswith("options(): a task key ") and line in str(info.value), (key, info.value)
        assert "\n" not in str(info.value)
    longest = "é" * 100  # 200 bytes: the most a key may have
    assert ex.options(key=longest).submit(keyfns.record, str(tmp_path / "log"), 1).result(timeout=30) == 1


def test_bad_keys_are_refused_by_the_daemon_and_the_cli(daemon: DaemonUnderTest,
                                                        make_executor: MakeExecutor) -> None:  # noqa: F811
    daemon.start()
    make_executor(1, state_dir=daemon.state_dir, pool="jobs", cwd=str(TESTS))
    with Client(daemon.state_dir) as client:
        for key, line in BAD_KEYS[:-1]:  # (bytes do not cross the channel: the client refuses them)
            with pytest.raises(InvalidSpec, match="a task key ") as info:
                client.call("task_submit", {"pool": "jobs", "target": "keyfns:record", "args": ["/dev/null", 1],
                                            "key": key})
            assert line in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(InvalidSpec, match="a task key must not contain"):
            client.call("tasks", {"id": "jobs/@a/b"})
    got = cli(daemon.state_dir, "submit", "--pool", "jobs", "--target", "keyfns:record", "--key", "a/b")
    assert got.returncode == 2 and "a task key must not contain '/'" in one_line_error(got, 2)
    for argv in (("cancel", "jobs/@"), ("result", "jobs/@a/b"), ("tasks", "jobs/@" + "x" * 201)):
        got = cli(daemon.state_dir, *argv)
        assert "a task is POOL/N or POOL/@KEY" in one_line_error(got), argv
    assert daemon.status()["daemon"]["pid"] == daemon.pid  # it runs on


# -- the key index on the fake: memory, then the store --------------------------------------


class KeyedStore:
    """The store's task rows as the fake's table reads them, with the key lookup."""

    def __init__(self) -> None:
        self.rows: dict[str, Doc] = {}

    def save_task(self, rec: Doc) -> None:
        self.rows[rec["id"]] = dict(rec)

    def tasks(self, *, pool: str | None = None, include_terminal: bool = False, task_id: str | None = None,
              key: str | None = None) -> list[Doc]:
        return [r for r in self.rows.values() if (pool is None or r["pool"] == pool)
                and (task_id is None or r["id"] == task_id) and (key is None or r.get("key") == key)]

    def task_numbers(self) -> dict[str, int]:
        return {}


def test_the_key_index_is_the_tables_while_in_memory_then_the_stores(make: Callable[..., Harness],  # noqa: F811
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasktable, "KEEP_ENDED", 2)
    h = make()
    h.engine.store = KeyedStore()  # type: ignore[assignment]
    worker = h.worker()
    submit = h.commands.commands()["task_submit"]
    replies: list[Doc] = []

    def keyed(key: str, ref: int, session: str | None = "s1") -> Any:
        one = {"pool": POOL, "payload": b"call", "key": key, "ref": ref, **({"session": session} if session else {})}
        return submit(one, replies.append, ref)

    first = keyed("k1", 1)
    assert first == {"id": f"{POOL}/1", "shared": False}
    task = h.tasks.by_key(POOL, "k1")
    assert isinstance(task, Task) and task.id == first["id"] and task.key == "k1"
    assert keyed("k1", 2) == {"id": first["id"], "shared": True}  # another ref: another future's
    assert keyed("k1", 1) == {"id": first["id"], "shared": False}  # its own ref (a resend)
    batch = submit({"pool": POOL, "session": "s1", "tasks": [{"payload": b"x", "key": "k2", "ref": 3},
                                                             {"payload": b"y", "key": "k2", "ref": 4},
                                                             {"payload": b"z", "ref": 5}]}, replies.append, 9)
    k2 = f"{POOL}/2"
    assert batch == {"ids": [k2, k2, f"{POOL}/3"], "shared": [k2]}
    assert h.commands.task_id(f"{POOL}/@k2") == k2 and h.commands.task_id(f"{POOL}/3") == f"{POOL}/3"
    assert worker.tasks_sent(2) == [1, 2]
    h.turn()
    worker.send(w.RESULT, 1, b"r1")
    assert state(task) is T.DONE
    # Ended, and pushed out of memory by later ends: the store's key finds it.
    for n in (2, 3):
        worker.send(w.RESULT, n, b"r")
    assert h.tasks.by_key(POOL, "k1") is None and f"{POOL}/1" not in h.tasks.ended
    assert h.commands.task_id(f"{POOL}/@k1") == first["id"]
    h.heard.clear()
    assert keyed("k1", 7) == {"id": first["id"], "shared": False}  # ended: this ref hears its end
    h.turn()
    assert h.kinds(7) == ["result"]
    assert keyed("k1", 8, session=None) == first["id"]  # a CLI's submit: the id alone
    with pytest.raises(UnknownTask, match="no task of pool"):
        h.commands.task_id(f"{POOL}/@k9")
    assert len(h.tasks.live) == 0  # nothing ran twice, nothing new queued



def test_a_tasks_key_goes_across_an_upgrade_and_a_restart(make: Callable[..., Harness]) -> None:  # noqa: F811
    h = make()
    h.worker()
    got = h.commands.commands()["task_submit"]({"pool": POOL, "session": "s1", "payload": b"p", "key": "k",
                                                 "ref": 1}, lambda m: None, 1)
    engine, table = hand_over(h)
    try:
        carried = table.by_key(POOL, "k")
        assert carried is not None and carried.id == got["id"] and carried.key == "k"
    finally:
        table.close()
        engine.reactor.close()
    engine = FakeEngine()
    pool = Pool(POOL, None, stored_executor=h.pool.executor.stored() if h.pool.executor is not None else None)
    engine.pools[POOL] = pool
    row = {"id": f"{POOL}/1", "pool": POOL, "n": 1, "payload": b"p", "timeout": None, "retries": 0,
           "state": "QUEUED", "attempts": 0, "worker": None, "queued_at": 1.0, "started_at": None, "key": "k"}
    restored = TaskTable(engine)
    try:
        TaskCarry(restored, engine).restore([pool], FakeStore([row], {POOL: 1}))
        again = restored.by_key(POOL, "k")
        assert again is not None and again.id == f"{POOL}/1" and again.state is T.QUEUED
    finally:
        restored.close()
        engine.reactor.close()


def test_a_cancel_by_key_or_id_on_the_fake_writes_that_tasks_word_alone(
        make: Callable[..., Harness]) -> None:  # noqa: F811
    """Both orders of the race, decided here: a cancel that comes after a's result finds it
    ended (False, no word written); one that comes while a runs writes a's word, never the
    word of b, held behind it on the same worker."""
    h = make()
    worker = h.worker()
    submit, cancel = h.commands.commands()["task_submit"], h.commands.commands()["task_cancel"]
    for round_, late in enumerate((True, False)):
        a_id = submit({"pool": POOL, "payload": b"a", "key": f"a{round_}"}, lambda m: None, 1)
        b_id = submit({"pool": POOL, "payload": b"b"}, lambda m: None, 2)
        a, b = h.tasks.task(a_id), h.tasks.task(b_id)
        assert a is not None and b is not None
        assert worker.tasks_sent(2) == [a.n, b.n]
        if late:
            worker.send(w.RESULT, a.n, b"done")
        name = f"{POOL}/@a{round_}" if late else a_id
        assert cancel({"ids": [name]}, lambda m: None, 3) == [not late]
        assert worker.word(b.slot) == 0  # b's word: nothing, either way
        assert worker.word(a.slot) == (0 if late else w.cancel_word(a.n, w.CANCEL))
        if not late:
            assert state(a) is T.CANCELLED
            worker.send(w.STOPPED, a.n)
        assert state(b) is T.RUNNING
        worker.send(w.RESULT, b.n, b"b")
        assert (state(a), state(b)) == ((T.DONE if late else T.CANCELLED), T.DONE)


class ArrivingClient:
    """A daemon's client as a handle sees it: ``tasks`` says "not arrived" ``late`` times."""

    def __init__(self, late: int, unheard: bool = True) -> None:
        self.late, self.unheard, self.asked = late, unheard, 0

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        assert op == "tasks" and args is not None
        self.asked += 1
        if self.asked <= self.late:
            err = UnknownTask(f"task {args['id']!r} is not here")
            err.data = {"unheard": True} if self.unheard else None
            raise err
        return [{"id": args["id"], "state": "QUEUED"}]

    def close_thread(self) -> None:
        pass

    def through_restart(self, attempt: Callable[[], Any], err: Any, window: float, stop: Any = None) -> Any:
        raise err


def test_a_handle_on_an_id_the_daemon_does_not_have_fails_at_once() -> None:
    """The daemon answers an id on its way (granted, its submit not arrived) as QUEUED: a
    handle never asks again, so one the daemon does not have is an error at once."""
    from orchestrator.client.taskhandle import TaskHandle

    on_way = ArrivingClient(0)
    assert TaskHandle(on_way, "jobs/7").id == "jobs/7" and on_way.asked == 1
    for unheard in (True, False):  # pruned or never submitted; never handed out
        client = ArrivingClient(1, unheard=unheard)
        with pytest.raises(UnknownTask):
            TaskHandle(client, "jobs/8")
        assert client.asked == 1