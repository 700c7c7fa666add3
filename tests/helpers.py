"""Shared by the tests: drive the real CLI, account for every process, and the small
helpers more than one test file needs (bounded waits, fds, free ports, reading lines).

Every process a test causes to exist is recorded as an identity (pid, create time); the
teardown checks that none is left and kills (SIGCONT, SIGKILL) by identity what is. Nothing
is ever matched by name or command line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import psutil

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # tests/workers.py is importable by the daemon for --target tests.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("ORCH_TEST_TAG", f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}:{os.getpid()}")
    env.update(extra or {})
    return env


def cli(state_dir: Path, *args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``orchestrator --state-dir DIR ARGS`` like a user would."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--state-dir", str(state_dir), *args],
        capture_output=True, text=True, timeout=timeout, env=cli_env(), stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"orchestrator {' '.join(args)} -> {proc.returncode}: {proc.stderr}")
    return proc


def cli_json(state_dir: Path, *args: str) -> dict:
    proc = cli(state_dir, *args, "--json")
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


def status(state_dir: Path, all: bool = False) -> dict:  # noqa: A002
    """What ``orchestrator status --json [--all]`` prints. Asked in this process, through the
    call the CLI makes and its JSON, while a daemon answers: the suite's waits ask it often,
    and each CLI run costs an interpreter's start and the CLI's imports (~80 ms of CPU, the
    largest part of the suite's). With no daemon to answer (the stored status, an unsafe
    dir) the CLI is run. The CLI's own ``status`` is tested through ``cli``/``cli_json``."""
    from orchestrator.client.channel import Client
    from orchestrator.errors import OrchestratorError

    try:
        client = Client(state_dir)
        try:
            data = client.status(all=all)
        finally:
            client.close()
    except OrchestratorError:  # none, or gone in the meantime: as the CLI says it
        return cli_json(state_dir, "status", *(["--all"] if all else []))
    return json.loads(json.dumps({"state_dir": str(Path(state_dir)), **data}))


def one_line_error(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    """The one line a refused command wrote to stderr (no traceback), its exit ``code`` checked."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def sized(pools: list[dict]) -> list[dict]:
    """A pool's name and size (status shows more of it since the restart policy landed)."""
    return [{"name": p["name"], "desired": p["desired"]} for p in pools]


class Ident(tuple):
    """(pid, create_time): a process, not a number."""

    @classmethod
    def of(cls, pid: int) -> "Ident | None":
        try:
            return cls((pid, psutil.Process(pid).create_time()))
        except psutil.NoSuchProcess:
            return None

    @property
    def pid(self) -> int:
        return self[0]

    def alive(self) -> bool:
        try:
            p = psutil.Process(self[0])
            return p.create_time() == self[1] and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def tree(pid: int) -> set[Ident]:
    """The process and all its descendants, right now."""
    out = set()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            out.add(Ident((p.pid, p.create_time())))
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for(cond: Callable[[], bool], timeout: float, what: str = "condition") -> float:
    """Poll with backoff (5 ms .. 50 ms) until cond() is true; return the time it took."""
    start = time.monotonic()
    delay = 0.005
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return time.monotonic() - start


def survivors(idents: Iterable[Ident]) -> list[Ident]:
    return [i for i in idents if i.alive()]


def tagged(tag: str) -> set[Ident]:
    """Live (non-zombie) processes other than this one whose environment carries
    ORCH_TEST_TAG=tag: the sweep that finds what a snapshot could have missed (a Python
    worker that set its title has overwritten its environment and is not found here)."""
    me = os.getpid()
    found = set()
    for p in psutil.process_iter():
        try:
            if p.pid == me or p.environ().get("ORCH_TEST_TAG") != tag:
                continue
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            found.add(Ident((p.pid, p.create_time())))
        except (psutil.Error, OSError):
            continue
    return found


def wait_gone(identities: Iterable[tuple[int, Any]], timeout: float) -> list[tuple[int, Any]]:
    """Wait (bounded, on pidfds) until every ``(pid, start)`` has exited, zombie or reaped;
    return those that did not. ``start``: clock ticks (watchdog.identity), or an ``Ident``'s
    psutil create time (then checked against it, and the wait is on the same process)."""
    from watchdog.identity import open_verified, start_time

    fds = {}
    for pid, start in identities:
        ticks = start
        if isinstance(start, float):  # an Ident: compared as clock ticks it would never match
            ident = Ident.of(pid)
            ticks = start_time(pid) if ident is not None and ident[1] == start else None
        fd = open_verified(pid, ticks) if ticks is not None else None
        if fd is not None:
            fds[fd] = (pid, start)
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = set(fds)
        deadline = time.monotonic() + timeout
        while left and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(remaining * 1000):
                poller.unregister(fd)
                left.discard(fd)
        return [fds[fd] for fd in left]
    finally:
        for fd in fds:
            os.close(fd)


def reap_child(pid: int, timeout: float) -> int:
    """Wait (bounded, on a pidfd) for a child of this process to exit; reap it; its exit code."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], timeout)[0], f"child {pid} did not exit"
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def read_lines(fd: int, count: int, timeout: float = 20.0) -> list[str]:
    """``count`` lines from ``fd``, waiting at most ``timeout`` for them."""
    buf = b""
    deadline = time.monotonic() + timeout
    while buf.count(b"\n") < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError(f"only got {buf!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise EOFError(f"EOF after {buf!r}")
        buf += chunk
    return buf.decode().splitlines()


def open_fds() -> set[str]:
    """This process's open file descriptors, now."""
    return set(os.listdir("/proc/self/fd"))


def fd_count() -> int:
    return len(open_fds())


def _ephemeral_ports() -> range:
    """The kernel's range for the source ports of outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port_range(n: int) -> int:
    """A base port whose next ``n`` ports are free on 127.0.0.1 right now, below the
    kernel's ephemeral range: a client that connects to such a port before its server
    listens may be given that same port as its own source and connect to itself (TCP's
    simultaneous open), reading back its own request as the answer (seen in CI)."""
    rng = random.Random()
    top = min(_ephemeral_ports().start, 65536)
    low = 10000 if top > 10000 + 4 * n else 1024
    for _ in range(200):
        base = rng.randrange(low, top - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def serves(port: int) -> bool:
    """Does an HTTP server on 127.0.0.1:``port`` answer ``GET /`` with 200 (within 1 s)?"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


def kill_all(idents: Iterable[Ident]) -> None:
    """Last-resort teardown: SIGCONT + SIGKILL each process that is still the one we saw."""
    for ident in idents:
        try:
            p = psutil.Process(ident.pid)
            if p.create_time() != ident[1]:
                continue
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.NoSuchProcess:
            pass


class DaemonUnderTest:
    """A daemon started through the CLI, and every process it is seen to own."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.pid: int | None = None
        self.seen: set[Ident] = set()
        self.removed_subtree: str | None = None  # what teardown had to remove (see there)

    def start(self, *extra: str) -> int:
        proc = cli(self.state_dir, "start", *extra)
        assert proc.returncode == 0, proc.stderr
        self.pid = int(proc.stdout.strip())
        self.snapshot()
        return self.pid

    def snapshot(self) -> set[Ident]:
        """Record the daemon's whole tree now (for the final no-leftover check)."""
        if self.pid is not None:
            self.seen |= tree(self.pid)
        return self.seen

    def status(self, all: bool = False) -> dict:  # noqa: A002
        data = status(self.state_dir, all)
        for pid in (data["daemon"].get("watchdog_pid"), data["daemon"].get("manager_pid"),
                    *data["daemon"].get("spawner_pids", ())):
            if pid and (ident := Ident.of(pid)):
                self.seen.add(ident)
        for rep in data["replicas"]:
            if rep["pid"] and (ident := Ident.of(rep["pid"])):
                self.seen.add(ident)
        return data

    def teardown(self) -> list[Ident]:
        """Stop the daemon if it runs; kill whatever we saw that is left; return those."""
        self.snapshot()
        cli(self.state_dir, "stop", "--timeout", "30")
        try:
            wait_for(lambda: not survivors(self.seen), 5, "the daemon's processes to end")
        except AssertionError:
            pass
        left = survivors(self.seen)
        kill_all(left)
        self.removed_subtree = self._remove_cgroup_subtree()
        return left

    def _remove_cgroup_subtree(self) -> str | None:
        """A daemon killed together with its watchdog leaves its cgroup subtree behind (the
        next ``start`` would kill what is in it and a clean stop remove it): kill and remove
        it here, by the path the daemon recorded in its state dir. Returns the path if there
        was one to remove."""
        record = self.state_dir / "cgroup"
        if not record.exists() or cli(self.state_dir, "status").returncode != 3:
            return None  # stopped cleanly (the record goes with the subtree), or still running
        from watchdog import cgroup

        path = record.read_text().strip()
        record.unlink()
        if cgroup.refusal(path, cgroup.find_mount(), None) is not None or not os.path.isdir(path):
            return None  # not a subtree of ours, or its watchdog removed it
        tree = cgroup.Subtree(path)
        tree.kill_all(timeout=5)
        tree.destroy()
        return path


D = TypeVar("D", bound=DaemonUnderTest)


@contextlib.contextmanager
def no_leftovers(daemon: D) -> Iterator[D]:
    """Yield ``daemon``; at the end stop it, kill what it was seen to own, and fail the
    test if anything was left to kill."""
    try:
        yield daemon
    finally:
        left = daemon.teardown()
        assert not left, f"processes left behind: {left}"


class OwnedProcesses:
    """Processes a test started or learned about: killed by identity (pid + start time, a
    pidfd opened and checked first) at teardown, Popen objects reaped and their pipes closed."""

    def __init__(self) -> None:
        self.identities: set[tuple[int, int]] = set()
        self.popens: list[subprocess.Popen] = []

    def track(self, pid: int, start: int | None) -> tuple[int, int | None]:
        if start is not None:
            self.identities.add((pid, start))
        return pid, start

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        from watchdog.identity import start_time

        proc = subprocess.Popen(args, **kwargs)
        self.popens.append(proc)
        self.track(proc.pid, start_time(proc.pid))
        return proc

    def teardown(self) -> None:
        from watchdog.identity import open_verified, proc_stat

        for pid, start in self.identities:
            fd = open_verified(pid, start)
            if fd is None:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)
        for proc in self.popens:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        # Orphans of a killed tree may have been handed to us (if this process is a child
        # subreaper): reap exactly those, by identity.
        for pid, start in self.identities:
            st = proc_stat(pid)
            if st is not None and st.start_time == start and st.ppid == os.getpid() and st.state == "Z":
                os.waitpid(pid, 0)


def manager_proxies(state_dir: Path) -> tuple:
    """The manager's ``commands`` queue and ``replies`` board as multiprocess proxies: what
    a client that skips ``Client``'s checks can send (the server end is channelserver.py)."""
    from orchestrator.channelwire import SERIALIZER, read_authkey, socket_address
    from orchestrator.manager.channelserver import ChannelManager, use_plain_pickling
    from orchestrator.paths import Paths

    use_plain_pickling()
    address, _ = socket_address(Path(state_dir))
    mgr = ChannelManager(address=address, authkey=read_authkey(Paths(state_dir)), serializer=SERIALIZER)
    mgr.connect()
    return mgr.commands(), mgr.replies()


@functools.cache
def cgroup_unusable() -> str | None:
    """Why this process cannot make cgroups under its own (so neither can a daemon it
    starts), or None: tried by making and removing one. Cached: one probe a test process."""
    from watchdog import cgroup

    mount = cgroup.find_mount()
    if mount is None:
        return "no cgroup2 mount in /proc/self/mountinfo"
    own = cgroup.own_path()
    if own is None:
        return "this process's cgroup2 path is not under the cgroup2 mount"
    probe = os.path.join(own, f"orchestrator-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(probe)
    except OSError as err:
        return f"cannot create a cgroup under {own}: {err.strerror} (needs root, a delegated unit or a writable cgroupfs)"
    os.rmdir(probe)
    return None


@contextlib.contextmanager
def module_of_tasks(where: Path, name: str, source: str, monkeypatch: Any) -> Iterator[Any]:
    """Module ``name`` written in ``where`` from ``source``: importable here (its functions
    pickled by reference) and on the PYTHONPATH an executor pool made meanwhile records for
    its workers; forgotten again at the end."""
    where.mkdir()
    (where / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv("PYTHONPATH", str(where))
    sys.modules.pop(name, None)
    import importlib

    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)


def start_with_shadow(daemon: DaemonUnderTest, shadow: Path) -> int:
    """Start ``daemon`` with ``shadow`` first on its PYTHONPATH (an install that ``upgrade``
    would exec, which a test then breaks); its pid, recorded on ``daemon``."""
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    got = subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "start"],
                         env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert got.returncode == 0, got.stderr
    daemon.pid = int(got.stdout)
    return daemon.pid


def read_to_close(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until the peer closes it (a reset ends it too)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out
