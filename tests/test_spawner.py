"""The spawner (orchestrator/spawner.py; launcher.py is its daemon side): replicas are forked
by a small exec'd process, are children of the launcher all the same, and a spawner that
dies, stalls or preloads never costs a replica its tracking."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import Ident, cli, cli_env, wait_for

HOST_MARK = "fresh"  # the test process changes it; a worker forked from a fresh spawner does not see that


def _report_mark_and_sleep() -> None:
    path = os.environ["MARK_FILE"]
    mod = sys.modules.get(__name__)
    with open(path + ".tmp", "w") as f:
        json.dump({"mark": getattr(mod, "HOST_MARK", None), "ppid": os.getppid(), "pid": os.getpid()}, f)
    os.rename(path + ".tmp", path)
    time.sleep(1000)


def _exit_5() -> None:
    sys.exit(5)


def _spawners_ready(orch) -> bool:
    spawners = orch._engine.spawners
    return bool(spawners._by_key) and all(sp.ready for sp in list(spawners._by_key.values()))


def test_replicas_are_made_by_the_spawner_and_are_the_launchers_children(make_orchestrator, procs, tmp_path):
    global HOST_MARK
    orch = make_orchestrator(grace=2.0)
    wait_for(lambda: orch.spawner_pids, 10, "the spawner to start")
    (spawner,) = orch.spawner_pids
    wait_for(lambda: _spawners_ready(orch), 10, "the spawner to be ready")
    HOST_MARK = "changed in the host after the spawner started"
    try:
        mark = tmp_path / "mark.json"
        orch.launch("py", target=_report_mark_and_sleep, env={"MARK_FILE": str(mark)}, wait=True, timeout=30)
        wait_for(mark.exists, 10, "the worker to report")
        seen = json.loads(mark.read_text())
        # Forked from the spawner's fresh interpreter, not from this process's memory...
        assert seen["mark"] == "fresh", seen
        assert seen["pid"] not in (os.getpid(), spawner)
        # ...and yet our child: we reap it and get its exact status.
        assert seen["ppid"] == os.getpid()
        assert psutil.Process(seen["pid"]).ppid() == os.getpid()
    finally:
        HOST_MARK = "fresh"
    (c,) = orch.launch("cmd", ["sh", "-c", "exit 3"])
    (p,) = orch.launch("py5", target=_exit_5)
    wait_for(lambda: all(r["pid"] is None for r in orch.status(all=True)["replicas"] if r["id"] in (c, p)),
             10, "both to exit")
    codes = {r["id"]: r["exit_code"] for r in orch.status(all=True)["replicas"]}
    assert codes[c] == 3 and codes[p] == 5
    assert orch.spawner_pids == {spawner}, "the spawner kept running throughout"


def test_the_spawner_killed_during_churn_loses_no_replica_and_churn_resumes(make_orchestrator, procs):
    orch = make_orchestrator(grace=2.0)
    wait_for(lambda: orch.spawner_pids, 10, "the spawner to start")
    stop = threading.Event()
    errors: list[BaseException] = []
    made: list[str] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                ids = orch.launch("churn", ["sleep", "1000"], count=4, wait=True, timeout=60)
                made.extend(ids)
                procs.track_status(orch.status())
                orch.terminate(ids[:3], wait=True, timeout=60)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    worker = threading.Thread(target=churn)
    worker.start()
    killed = []
    try:
        for _ in range(5):
            wait_for(lambda: len(made) >= 4 * (len(killed) + 1), 30, "churn to go on")
            pids = orch.spawner_pids
            if pids:
                victim = next(iter(pids))
                os.kill(victim, signal.SIGKILL)  # ours to kill: the test's own orchestrator's child
                killed.append(victim)
                wait_for(lambda: orch.spawner_pids and victim not in orch.spawner_pids, 30, "a new spawner")
    finally:
        stop.set()
        worker.join(60)
    assert not errors, errors
    assert len(killed) == 5
    before = len(made)
    orch.launch("churn", ["sleep", "1000"], count=2, wait=True, timeout=30)  # churn resumes
    assert len(orch.status()["replicas"]) >= 2 and before > 0
    # Every child of ours is a replica the table knows, a spawner, or the watchdog.
    live = {r["pid"] for r in orch.status()["replicas"] if r["pid"]}
    children = {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE}
    assert children <= live | orch.spawner_pids | {orch.watchdog_pid}, children - live
    assert all(r["state"] == "RUNNING" for r in orch.status()["replicas"])


def test_a_stalled_spawner_is_replaced_and_the_launch_still_happens(make_orchestrator, procs):
    orch = make_orchestrator(grace=2.0, watchdog=False)
    wait_for(lambda: _spawners_ready(orch), 10, "the spawner to be ready")
    (stalled,) = orch.spawner_pids
    stalled_ident = Ident.of(stalled)
    os.kill(stalled, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        (rid,) = orch.launch("after", ["sleep", "1000"], wait=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        if stalled_ident.alive():
            os.kill(stalled, signal.SIGCONT)
    (row,) = [r for r in orch.status()["replicas"] if r["id"] == rid]
    assert row["state"] == "RUNNING" and psutil.Process(row["pid"]).ppid() == os.getpid()
    assert took < 30, took  # bounded by the spawner's reply timeout, not hung
    wait_for(lambda: not stalled_ident.alive(), 10, "the stalled spawner to be killed and reaped")
    wait_for(lambda: orch.spawner_pids and stalled not in orch.spawner_pids, 30, "a new spawner")


def test_a_child_of_a_lost_spawner_is_reaped(tmp_path):
    """A child the spawner made but never let go reports ``lost PID`` and exits; the
    launcher reaps it (reap_lost), whoever its parent is told to be."""
    from orchestrator.daemon.launcher import Spawner

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.write(w, f"lost {os.getpid()}: gone".encode())
        os._exit(127)
    os.close(w)
    Spawner.reap_lost(None, r)  # type: ignore[arg-type]
    os.close(r)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # already reaped


def _write_module(tmp_path: Path, name: str, body: str) -> Path:
    pkg = tmp_path / "code"
    pkg.mkdir(exist_ok=True)
    (pkg / f"{name}.py").write_text(body)
    return pkg


def test_preload_is_imported_once_in_its_spawner_never_in_the_daemon(daemon, tmp_path):
    imports = tmp_path / "imports"
    code = _write_module(tmp_path, "heavy_mod", f"""
import os
with open({str(imports)!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
BIG = bytearray(8 << 20)

def main():
    import time
    time.sleep(1000)
""")
    daemon.start()
    env = cli_env({"PYTHONPATH": f"{code}{os.pathsep}{cli_env()['PYTHONPATH']}"})
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "launch", "--pool", "warm",
         "--count", "4", "--target", "heavy_mod:main", "--preload", "heavy_mod", "--wait"],
        capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    st = daemon.status()
    assert [r["state"] for r in st["replicas"]] == ["RUNNING"] * 4
    pids = imports.read_text().split()
    assert len(pids) == 1, f"imported {len(pids)} times: {pids}"  # once, for all four
    importer = int(pids[0])
    assert importer != daemon.pid
    assert importer in st["daemon"]["spawner_pids"]
    title = psutil.Process(importer).cmdline()[0]
    assert title == "orchestrator: spawner [preload heavy_mod]", title
    assert all(psutil.Process(r["pid"]).ppid() == daemon.pid for r in st["replicas"])
    assert len(os.listdir(f"/proc/{daemon.pid}/task")) == 1


def test_a_preload_that_cannot_be_imported_fails_the_replicas_with_the_reason(daemon, tmp_path):
    daemon.start()
    proc = cli(daemon.state_dir, "launch", "--pool", "bad", "--target", "workers:sleeper",
               "--preload", "no_such_module_here", "--restart", "never", "--wait", "--timeout", "30")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    (row,) = daemon.status(all=True)["replicas"]
    assert row["state"] == "FAILED"
    assert "no_such_module_here" in row["reason"] and row["reason"].startswith("could not start:"), row


def test_preload_with_a_command_is_refused(daemon):
    daemon.start()
    proc = cli(daemon.state_dir, "launch", "--pool", "c", "--preload", "json", "--", "sleep", "1")
    assert proc.returncode != 0
    assert "preload" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1



def test_a_preload_that_never_finishes_fails_its_replicas_with_the_reason(daemon, tmp_path):
    import subprocess

    code = _write_module(tmp_path, "hangs_mod", """
import sys, time
print("preload chatter on stdout")
print("preload chatter on stderr", file=sys.stderr, flush=True)
sys.stdout.flush()
time.sleep(1000)

def main():
    pass
""")
    daemon.start()
    env = cli_env({"PYTHONPATH": f"{code}{os.pathsep}{cli_env()['PYTHONPATH']}"})
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "launch", "--pool", "hang",
         "--count", "2", "--target", "hangs_mod:main", "--preload", "hangs_mod", "--ready-timeout", "3",
         "--restart", "never"],
        capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    rows = daemon.status(all=True)["replicas"]
    # While it imports: PENDING, and status says why.
    assert [(r["state"], r["reason"]) for r in rows] == [("PENDING", "waiting for preload spawner")] * 2, rows
    wait_for(lambda: all(r["state"] == "FAILED" for r in daemon.status(all=True)["replicas"]), 30,
             "the replicas to fail")
    for row in daemon.status(all=True)["replicas"]:
        assert row["reason"] == "could not start: preload of hangs_mod did not finish within 3 s", row
    logs = daemon.state_dir / "logs"
    wait_for(lambda: (logs / "spawner.log").exists()
             and "chatter on stderr" in (logs / "spawner.log").read_text(), 10, "the spawner's own log")
    assert "chatter on stdout" in (logs / "spawner.log").read_text()
    assert "chatter" not in (logs / "daemon.log").read_text()


def test_a_fork_elsewhere_in_the_host_holding_a_ready_pipe_does_not_hang_the_loop(make_orchestrator, monkeypatch):
    """An embedding program forks in another thread (a multiprocessing or pebble pool making
    a worker) in the moment the loop holds a fresh ready pipe: that child keeps the write
    end, so the pipe never reaches EOF while it lives. The replica's exit is still recorded
    and the loop still answers (it once blocked reading that pipe until the stranger died)."""
    from orchestrator.daemon import osapi

    holders: list[int] = []

    class ForkInTheWindow:
        """``os`` for osapi, whose pipe() is followed by a fork that holds both ends."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        @staticmethod
        def pipe() -> tuple[int, int]:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the stranger: holds the write end, then exits
                time.sleep(600)
                os._exit(0)
            holders.append(pid)
            return r, w

    orch = make_orchestrator(grace=2.0, call_timeout=10.0)  # a loop that hangs: ChannelError
    wait_for(lambda: _spawners_ready(orch), 10, "the spawner to be ready")
    monkeypatch.setattr(osapi, "os", ForkInTheWindow())
    try:
        (rid,) = orch.launch("once", ["sh", "-c", "exit 3"])
        monkeypatch.undo()
        assert holders, "the launch went through osapi's pipe()"

        def ended() -> bool:
            (rep,) = [r for r in orch.status(all=True)["replicas"] if r["id"] == rid]
            return rep["pid"] is None and rep["exit_code"] == 3

        wait_for(ended, 20, "the replica's exit to be recorded while the stranger holds its ready pipe")
        assert orch.launch("again", ["true"], wait=True, timeout=20)
    finally:
        monkeypatch.undo()
        for pid in holders:  # our own children: the loop unblocks (if it was) once they are gone
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_fork_elsewhere_in_the_host_does_not_keep_a_ready_pipe_open(make_orchestrator, monkeypatch):
    """The same stranger, forked while the loop holds a ready pipe's write end (here: as
    the plan goes to the spawner): a fork handler closes that end in the stranger, so the
    replica is RUNNING at once, not once the stranger has exited."""
    from orchestrator.daemon import launcher, osapi

    holders: list[int] = []
    send = launcher.Spawner.begin

    def fork_then_send(self, plan, ready_w, *args):  # type: ignore[no-untyped-def]
        if not holders:
            assert ready_w in osapi._WRITE_ENDS
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the stranger
                time.sleep(600)
                os._exit(0)
            holders.append(pid)
        return send(self, plan, ready_w, *args)

    orch = make_orchestrator(grace=2.0, call_timeout=10.0)
    wait_for(lambda: _spawners_ready(orch), 10, "the spawner to be ready")
    monkeypatch.setattr(launcher.Spawner, "begin", fork_then_send)
    try:
        ids = orch.launch("held", ["sleep", "300"], wait=True, timeout=20)
        assert holders, "the stranger forked while the write end was held"
        assert [r["state"] for r in orch.status()["replicas"] if r["id"] in ids] == ["RUNNING"]
    finally:
        monkeypatch.undo()
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
