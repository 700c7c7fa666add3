"""What a worker sees: Terminated on SIGTERM, ready(), a raised oom_score_adj; and the OOM
helpers (orchestrator.daemon.oom).

Real workers through the embedded ``Orchestrator`` (the ``make_orchestrator`` fixture), and,
for the spawner's own setup window, through ``OSApi.spawn`` directly. Every wait is bounded.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import orchestrator
from helpers import ROOT, wait_for
from orchestrator.spawn import childsetup
from orchestrator.daemon import oom
from orchestrator.daemon.osapi import OSApi
from orchestrator.spec import LaunchPlan
from orchestrator.worker import Terminated, ready

GRACE = 30.0  # long: a test that waited for it would fail its own bound below
PROMPT = 5.0  # a SIGTERMed worker ends well within this


def _row(orch, rid: str) -> dict:
    (row,) = [r for r in orch.status(all=True)["replicas"] if r["id"] == rid]
    return row


def _launch_py(orch, procs, target, **kw) -> str:
    (rid,) = orch.launch("py", target=target, wait=True, timeout=30, **kw)
    procs.track(_row(orch, rid)["pid"])
    return rid


def _terminate(orch, rid: str) -> float:
    t0 = time.monotonic()
    assert orch.terminate(rid, wait=True, timeout=GRACE + 10) == [rid]
    return time.monotonic() - t0


def _sigcgt(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigCgt line")


# -- Terminated ---------------------------------------------------------------------------


def test_terminated_is_its_own_base_exception():
    assert issubclass(Terminated, BaseException)
    assert not issubclass(Terminated, Exception)
    assert not issubclass(Terminated, KeyboardInterrupt)
    assert orchestrator.Terminated is Terminated and "Terminated" in orchestrator.__all__
    t = Terminated(signal.SIGTERM)
    assert t.signum == signal.SIGTERM and Terminated().signum == signal.SIGTERM
    with pytest.raises(Terminated):
        try:
            raise Terminated(15)
        except Exception:  # noqa: BLE001 - the point: it does not catch it
            pytest.fail("except Exception caught Terminated")
        except KeyboardInterrupt:
            pytest.fail("except KeyboardInterrupt caught Terminated")


def test_uncaught_terminated_runs_finally_and_dies_of_sigterm(make_orchestrator, procs, tmp_path):
    orch = make_orchestrator(grace=GRACE)
    started, marker = tmp_path / "started", tmp_path / "finally-ran"

    def target() -> None:
        try:
            started.touch()
            time.sleep(1000)
        finally:
            marker.write_text("cleaned up")

    rid = _launch_py(orch, procs, target)
    wait_for(started.exists, 10, "the target to start")
    assert _terminate(orch, rid) < PROMPT
    assert marker.read_text() == "cleaned up"
    row = _row(orch, rid)
    assert (row["state"], row["exit_code"], row["reason"]) == ("TERMINATED", -15, "killed by SIGTERM")
    orch.close()
    assert not procs.survivors()


def test_caught_terminated_is_the_targets_own_exit(make_orchestrator, procs, tmp_path):
    orch = make_orchestrator(grace=GRACE)
    started, out = tmp_path / "started", tmp_path / "signum"

    def target() -> None:
        try:
            started.touch()
            time.sleep(1000)
        except Terminated as term:
            out.write_text(str(term.signum))
            sys.exit(0)

    rid = _launch_py(orch, procs, target)
    wait_for(started.exists, 10, "the target to start")
    assert _terminate(orch, rid) < PROMPT
    assert out.read_text() == str(int(signal.SIGTERM))
    row = _row(orch, rid)
    assert (row["state"], row["exit_code"], row["reason"]) == ("TERMINATED", 0, "exit code 0")


def test_sigterm_in_a_sleep_ends_it_promptly_without_the_grace_kill(make_orchestrator, procs, tmp_path):
    orch = make_orchestrator(grace=GRACE)
    started = tmp_path / "started"
    caught = tmp_path / "caught"

    def target() -> None:
        started.touch()
        try:
            time.sleep(1000)
        except Exception:  # noqa: BLE001 - must not see Terminated
            caught.write_text("Exception")
        except KeyboardInterrupt:
            caught.write_text("KeyboardInterrupt")

    rid = _launch_py(orch, procs, target)
    pid = _row(orch, rid)["pid"]
    wait_for(started.exists, 10, "the target to start")  # RUNNING comes a moment before the handler
    assert _sigcgt(pid) & (1 << (signal.SIGTERM - 1)), "the Python target does not handle SIGTERM"
    elapsed = _terminate(orch, rid)
    row = _row(orch, rid)
    assert (row["state"], row["exit_code"]) == ("TERMINATED", -15)
    assert row["reason"] == "killed by SIGTERM" and "grace" not in row["reason"]
    assert elapsed < PROMPT, f"{elapsed:.2f}s"
    assert not caught.exists(), f"except {caught.read_text()} caught Terminated"


def test_command_worker_still_dies_of_sigterm(make_orchestrator, procs):
    orch = make_orchestrator(grace=GRACE)
    (rid,) = orch.launch("cmd", ["sleep", "1000"], wait=True, timeout=30)
    pid = _row(orch, rid)["pid"]
    procs.track(pid)
    wait_for(lambda: Path(f"/proc/{pid}/exe").resolve().name == "sleep", 10, "the exec")
    assert not _sigcgt(pid) & (1 << (signal.SIGTERM - 1)), "a command inherited a SIGTERM handler"
    assert _terminate(orch, rid) < PROMPT
    row = _row(orch, rid)
    assert (row["state"], row["exit_code"], row["reason"]) == ("TERMINATED", -15, "killed by SIGTERM")


def test_processes_the_target_forks_keep_sigterms_default(make_orchestrator, procs, tmp_path):
    """A multiprocessing child (fork) of the target gets the group's SIGTERM too: it must die
    of it (exit code -15), not raise Terminated into multiprocessing's bootstrap (exit 1 and a
    traceback)."""
    orch = make_orchestrator(grace=GRACE)
    started, out = tmp_path / "started", tmp_path / "child-exitcode"

    def target() -> None:
        import multiprocessing

        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(1000,))
        child.start()
        try:
            started.write_text(str(child.pid))
            time.sleep(1000)
        finally:
            child.join(10)
            out.write_text(str(child.exitcode))

    rid = _launch_py(orch, procs, target)
    wait_for(lambda: started.exists() and started.read_text(), 10, "the target and its child")
    procs.track(int(started.read_text()))
    took = _terminate(orch, rid)
    # What the target saw of its child, and how the replica ended: a slow end says which hung.
    assert took < PROMPT, (took, out.read_text() if out.exists() else "no child exit code written", _row(orch, rid))
    assert out.read_text() == str(-signal.SIGTERM)
    assert _row(orch, rid)["exit_code"] == -signal.SIGTERM


def test_a_sigterm_left_pending_by_a_blocking_call_is_raised_at_the_kick(make_orchestrator, procs, tmp_path):
    """A SIGTERM that lands just before ``time.sleep`` enters the kernel leaves its handler
    pending, and the sleep is not interrupted (CPython's own race). Made certain here: the
    main thread blocks SIGTERM, so a thread of the target takes it, and the handler waits
    for the main thread, asleep. The daemon's SIGURG after the stop signal interrupts the
    sleep: the Terminated is raised, the target's ``finally:`` runs, the worker ends as
    SIGTERM's, at once, not by the SIGKILL after the grace."""
    orch = make_orchestrator(grace=GRACE)
    started, out = tmp_path / "started", tmp_path / "finally"

    def target() -> None:
        import threading

        taker = threading.Event()

        def take() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})  # the kick is the main thread's
            taker.set()
            time.sleep(1000)

        threading.Thread(target=take, daemon=True).start()
        taker.wait()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the kernel gives it to `take`
        started.touch()
        try:
            time.sleep(1000)
        finally:
            out.write_text("ran")

    rid = _launch_py(orch, procs, target)
    wait_for(started.exists, 10, "the target to sleep")
    took = _terminate(orch, rid)
    assert took < PROMPT, (took, _row(orch, rid))
    assert out.read_text() == "ran"
    assert _row(orch, rid)["exit_code"] == -signal.SIGTERM


_SWALLOWED = {
    # A hook registered before the handler's own runs after them as a "before" hook, with
    # SIGTERM blocked: the signal is pending across the fork and handled in the parent's
    # after-fork hook, where Python can only report what it raises.
    "a fork hook": """
os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGTERM) if armed else None)
install_sigterm_handler()
armed = True
pid = os.fork()
if pid == 0:
    os._exit(0)
armed = False
""",
    # os.kill runs the handler at once, inside the finalizer.
    "a finalizer": """
install_sigterm_handler()
class Dies:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
Dies()
""",
}


@pytest.mark.parametrize("where", sorted(_SWALLOWED))
def test_a_terminated_python_would_swallow_ends_the_worker_as_sigterm(where):
    """Where Python cannot raise (a fork hook, a ``__del__``), Terminated would be reported
    and dropped, the SIGTERM lost and the worker left running to its SIGKILL: it must die of
    the SIGTERM instead."""
    script = "import os, signal\nfrom orchestrator.worker import install_sigterm_handler\n"
    script += _SWALLOWED[where] + "print('the SIGTERM was lost', flush=True)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "lost" not in proc.stdout


# -- the spawner's own setup window ---------------------------------------------------------


def _spawn(procs, plan: LaunchPlan):
    sp = OSApi(pdeathsig=signal.SIGKILL).spawn(plan)
    procs.track(sp.pid)
    return sp


def _reap(sp, timeout: float) -> tuple[int, bytes]:
    """Wait (bounded) for the child to exit; its exit code and what it wrote to the ready pipe."""
    try:
        ready, _, _ = select.select([sp.exit_fd], [], [], timeout)
        if not ready:
            os.kill(sp.pid, signal.SIGKILL)
            os.waitpid(sp.pid, 0)
            raise AssertionError(f"the worker did not exit within {timeout}s")
        _, status = os.waitpid(sp.pid, 0)
        return os.waitstatus_to_exitcode(status), os.read(sp.ready_fd, 4096)
    finally:
        os.close(sp.exit_fd)
        os.close(sp.ready_fd)


def test_sigterm_while_the_target_is_still_being_loaded_kills_it(procs, tmp_path, monkeypatch):
    """The target's module is imported in the child (a pickled reference), and that import
    is slow: a SIGTERM then is in our setup, not the user's code. The worker must die of it
    (not "could not start: Terminated", exit 127)."""
    name = f"orch_slow_import_{uuid.uuid4().hex[:8]}"
    flag = tmp_path / "importing"
    (tmp_path / f"{name}.py").write_text(
        f"import pathlib, time\npathlib.Path({str(flag)!r}).touch()\ntime.sleep(1000)\ndef main():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # inherited by the forked child
    pickled = f"c{name}\nmain\n.".encode()  # protocol 0 GLOBAL: only the child imports it
    sp = _spawn(procs, LaunchPlan("slow-1", run=pickled))
    wait_for(flag.exists, 10, "the child to import the target")
    t0 = time.monotonic()
    os.kill(sp.pid, signal.SIGTERM)
    code, msg = _reap(sp, PROMPT)
    assert (code, msg) == (-signal.SIGTERM, b""), (code, msg)
    assert time.monotonic() - t0 < PROMPT
    assert name not in sys.modules


def _spin() -> None:
    while True:
        pass


def test_sigterm_right_after_fork_kills_a_python_target(procs):
    """Sent at once after the fork, it lands while the child is still blocked in the
    parent's mask (pending, then its default at the mask's clearing), in our set-up, or in
    the target: the exit is SIGTERM's each time, 50 times. The target spins, where the
    interpreter checks for signals at every turn: one that sleeps would hang about once in
    400 when the SIGTERM lands just before the sleep enters the kernel (CPython's race,
    which the module's doc tells; seen in CI)."""
    for i in range(50):
        sp = _spawn(procs, LaunchPlan(f"early-{i}", run=_spin))
        os.kill(sp.pid, signal.SIGTERM)
        code, msg = _reap(sp, PROMPT)
        assert (code, msg) == (-signal.SIGTERM, b""), (i, code, msg)


def test_stdio_written_in_finally_is_flushed_before_the_signal(procs, tmp_path):
    out_path = tmp_path / "out"
    started = tmp_path / "started"

    def target() -> None:
        # Our own stream on fd 1 (under pytest, sys.stdout is its capture, not fd 1).
        sys.stdout = os.fdopen(1, "w", buffering=8192, closefd=False)
        try:
            print("hello from the target")  # block-buffered: not written yet
            started.touch()
            time.sleep(1000)
        finally:
            print("bye from finally")

    with open(out_path, "wb") as out:
        sp = _spawn(procs, LaunchPlan("flush-1", run=target, stdout=out.fileno()))
    wait_for(started.exists, 10, "the target to start")
    os.kill(sp.pid, signal.SIGTERM)
    code, _ = _reap(sp, PROMPT)
    assert code == -signal.SIGTERM
    assert out_path.read_text() == "hello from the target\nbye from finally\n"


def test_a_blocked_sigterm_is_unblocked_to_die_of_it(procs, tmp_path):
    """A target that catches Terminated, blocks SIGTERM and re-raises: still -15."""
    started = tmp_path / "started"

    def target() -> None:
        try:
            started.touch()
            time.sleep(1000)
        except Terminated:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            raise

    sp = _spawn(procs, LaunchPlan("blocked-1", run=target))
    wait_for(started.exists, 10, "the target to start")
    os.kill(sp.pid, signal.SIGTERM)
    assert _reap(sp, PROMPT)[0] == -signal.SIGTERM


# -- ready() ------------------------------------------------------------------------------


@pytest.fixture
def notify_socket():
    """A datagram socket in the abstract namespace, as a supervisor would bind it."""
    name = f"orch-test-notify-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(10)
    try:
        yield "@" + name, sock
    finally:
        sock.close()


def test_ready_without_notify_socket_is_false(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert ready(status="x") is False


def test_ready_sends_ready_to_an_abstract_socket(monkeypatch, notify_socket):
    addr, sock = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    assert ready() is True
    assert sock.recv(4096) == b"READY=1"
    assert ready(status="warmed up") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=warmed up"


def test_ready_to_a_path_socket_and_to_nobody(monkeypatch, tmp_path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert ready(status="ok") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=ok"
    path.unlink()
    assert ready() is False  # no socket there: False, not an exception
    monkeypatch.setenv("NOTIFY_SOCKET", f"@orch-test-nobody-{uuid.uuid4().hex}")
    assert ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert ready() is False
    with pytest.raises(ValueError):
        ready(status="two\nlines")


def test_ready_from_real_replicas(make_orchestrator, procs, notify_socket):
    addr, sock = notify_socket
    orch = make_orchestrator(grace=GRACE)

    def target() -> None:
        from orchestrator.worker import ready as ready_in_worker

        ready_in_worker(status="python target")
        time.sleep(1000)

    rid = _launch_py(orch, procs, target, env={"NOTIFY_SOCKET": addr})
    assert sock.recv(4096) == b"READY=1\nSTATUS=python target"
    _terminate(orch, rid)

    code = "import sys; from orchestrator.worker import ready; sys.exit(0 if ready(status='command') else 3)"
    env = {"NOTIFY_SOCKET": addr, "PYTHONPATH": str(ROOT)}
    (cid,) = orch.launch("cmd", [sys.executable, "-c", code], env=env, wait=True, timeout=30)
    assert sock.recv(4096) == b"READY=1\nSTATUS=command"
    assert orch.wait([cid], until="ended", timeout=30) == {cid: "EXITED"}


# -- OOM ----------------------------------------------------------------------------------


def _oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


@pytest.mark.parametrize("kind", ["command", "callable"])
def test_replicas_run_with_a_raised_oom_score_adj(make_orchestrator, procs, kind):
    orch = make_orchestrator(grace=GRACE)
    if kind == "command":
        (rid,) = orch.launch("cmd", ["sleep", "1000"], wait=True, timeout=30)
    else:
        (rid,) = orch.launch("py", target=lambda: time.sleep(1000), wait=True, timeout=30)
    pid = _row(orch, rid)["pid"]
    procs.track(pid)
    want = int(childsetup._OOM_SCORE_ADJ)
    assert want == max(childsetup.WORKER_OOM_SCORE_ADJ, _oom_score_adj(os.getpid()))
    # Written before exec or the target: from RUNNING on, it is there.
    assert _oom_score_adj(pid) == want
    assert _oom_score_adj(pid) > _oom_score_adj(os.getpid()) or want == 1000
    _terminate(orch, rid)


def test_was_oom_killed_on_a_replica_that_was_not(make_orchestrator, procs, tmp_path):
    orch = make_orchestrator(grace=GRACE)
    since = time.time()
    rid = _launch_py(orch, procs, lambda: time.sleep(1000))
    pid = _row(orch, rid)["pid"]
    _terminate(orch, rid)
    t0 = time.monotonic()
    assert oom.was_oom_killed(pid, since) in (False, None)
    assert time.monotonic() - t0 < oom.MAX_SECONDS + 2.0
    for weird in ((0, 0.0), (-1, float("nan")), (2**40, float("inf")), (os.getpid(), -1e300)):
        assert oom.was_oom_killed(*weird) in (False, None)


def _kmsg_record(pid: int, ts_us: int, prio: int = 3, text: str | None = None) -> bytes:
    text = text or f"Out of memory: Killed process {pid} (python3) total-vm:1000kB, anon-rss:900kB"
    return f"{prio},1234,{ts_us},-;{text}\n SUBSYSTEM=x\n".encode()


def test_the_kernel_log_parser(tmp_path):
    now_us = 1_000_000_000
    assert oom._kmsg_match(_kmsg_record(42, now_us), 42, now_us - 1)
    assert not oom._kmsg_match(_kmsg_record(42, now_us), 43, now_us - 1)  # another pid
    assert not oom._kmsg_match(_kmsg_record(42, now_us), 42, now_us + 1)  # older than since
    assert not oom._kmsg_match(_kmsg_record(42, now_us, prio=14), 42, 0)  # written by a user
    cg = "Memory cgroup out of memory: Killed process 42 (python3) total-vm:1kB"
    assert oom._kmsg_match(_kmsg_record(42, now_us, text=cg), 42, 0)
    summary = (
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        "oom_memcg=/a,task_memcg=/a,task=x,pid=99,uid=0,pid=42,uid=0"  # a comm that lies
    )
    assert oom._kmsg_match(_kmsg_record(42, now_us, text=summary), 42, 0)
    assert not oom._kmsg_match(_kmsg_record(99, now_us, text=summary), 99, 0)
    assert oom._victim(b"oom_reaper: reaped process 42 (python3), now anon-rss:0kB") == 42
    assert oom._victim(b"Killed process 42 (x) total-vm") == 42  # older kernels
    assert oom._victim(b"some other message about process 42") is None
    # The scan, over a file holding one record (a read of /dev/kmsg returns one).
    log = tmp_path / "kmsg"
    log.write_bytes(_kmsg_record(42, now_us))
    assert oom._scan_kmsg(str(log), 42, now_us - 1) is True
    assert oom._scan_kmsg(str(log), 42, now_us + 1) is False
    assert oom._scan_kmsg(str(tmp_path / "missing"), 42, 0) is None


def test_the_syslog_fallback_parser():
    """syslog(2) text, what dmesg reads when /dev/kmsg is not there."""
    log = (
        b"<6>[    1.000000] booting\n"
        b"<3>[  100.250000] Out of memory: Killed process 42 (python3) total-vm:1kB\n"
        b"<14>[  200.000000] Out of memory: Killed process 43 (forged) total-vm:1kB\n"
    )
    assert oom._match_syslog(log, 42, 100_000_000, complete=True) is True
    assert oom._match_syslog(log, 42, 100_300_000, complete=True) is False  # before since
    assert oom._match_syslog(log, 43, 0, complete=True) is False  # not the kernel's
    # Cut to the newest bytes: False only if what was read reaches back to since.
    assert oom._match_syslog(log[log.index(b"<3>"):], 7, 50_000_000, complete=False) is None
    assert oom._match_syslog(log, 7, 50_000_000, complete=False) is False
    undated = b"<3>Out of memory: Killed process 42 (python3) total-vm:1kB\n"
    assert oom._match_syslog(undated, 42, 0, complete=True) is None  # cannot be dated
    assert oom._scan_syslog(os.getpid(), 0) in (False, None)  # the real one, where allowed


def test_was_oom_killed_says_none_when_it_cannot_know(monkeypatch):
    monkeypatch.setattr(oom, "_in_initial_pid_namespace", lambda: False)
    assert oom.was_oom_killed(os.getpid(), time.time()) is None
    monkeypatch.undo()
    monkeypatch.setattr(oom, "_KMSG", "/nonexistent/kmsg")
    monkeypatch.setattr(oom, "_scan_syslog", lambda pid, since_us: None)
    assert oom.was_oom_killed(os.getpid(), time.time()) is None


def test_cgroup_oom_kills(tmp_path):
    assert oom.cgroup_oom_kills(str(tmp_path)) == 0  # no memory controller: no file
    assert oom.cgroup_oom_kills(str(tmp_path / "no-such-cgroup")) == 0
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n")
    assert oom.cgroup_oom_kills(str(tmp_path)) == 0
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert oom.cgroup_oom_kills(str(tmp_path)) == 2
    events.unlink()
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom.cgroup_oom_kills(str(tmp_path)) == 5  # cgroup v1
