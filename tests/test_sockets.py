"""Socket activation (``--socket``, key ``sockets``): the daemon binds once, every replica
gets the listener as fds 3, 4, ... with LISTEN_FDS / LISTEN_PID / LISTEN_FDNAMES exactly as
systemd passes them; a rolling restart and a kill -9 refuse no connection; bad addresses
are one line; no other process gets the socket. Real processes through the CLI, plus the
rollout order on the fake OS."""

from __future__ import annotations

import contextlib
import shutil
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from fakes import SPEC, Harness
from helpers import (ROOT, DaemonUnderTest, Ident, cli, cli_env, free_port_range, kill_all, one_line_error,
                     survivors, tree, wait_for)

O_CLOEXEC = 0o2000000


# -- what a process holds, from /proc --------------------------------------------------------


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def fd_inodes(pid: int) -> dict[int, str]:
    """fd -> what it is (``socket:[123]``, a path...), for every fd of ``pid``."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return out


def fd_flags(pid: int, fd: int) -> int:
    text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
    return int(re.search(r"^flags:\s*(\d+)", text, re.M).group(1), 8)


def listening_inode(port: int) -> str:
    """``socket:[INODE]`` of the TCP socket listening on 127.0.0.1:``port``."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, state, inode = cols[1], cols[3], cols[9]
        if state == "0A" and local == f"0100007F:{port:04X}":
            return f"socket:[{inode}]"
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def running(daemon: DaemonUnderTest, pool: str) -> list[dict]:
    return [r for r in daemon.status()["replicas"] if r["pool"] == pool and r["state"] == "RUNNING"]


def launch_ok(daemon: DaemonUnderTest, *args: str) -> list[str]:
    proc = cli(daemon.state_dir, "launch", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


# -- the fds and variables, exactly as systemd passes them -------------------------------------


def test_each_replica_gets_the_listeners_as_systemd_passes_them(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    port = free_port_range(1)
    path = tmp_path / "app.sock"
    launch_ok(daemon, "--pool", "web", "--count", "2", "--socket", f"tcp://127.0.0.1:{port}",
              "--socket", f"unix:{path}", "--wait", "--", "sleep", "300")
    tcp = listening_inode(port)
    reps = running(daemon, "web")
    assert len(reps) == 2
    for rep in reps:
        pid = rep["pid"]
        env = environ(pid)
        assert env["LISTEN_PID"] == str(pid)  # its own pid, set after the fork
        assert env["LISTEN_FDS"] == "2"
        assert env["LISTEN_FDNAMES"] == "web:web"  # named after the pool, as systemd names a unit's fds
        fds = fd_inodes(pid)
        assert fds[3] == tcp, fds
        assert fds[4].startswith("socket:["), fds
        for fd in (3, 4):
            assert not fd_flags(pid, fd) & O_CLOEXEC  # inherited across its exec
        assert set(fds) == {0, 1, 2, 3, 4}, fds  # nothing else: no ready pipe, no daemon fd
    # the unix socket is one the daemon listens on, mode 0666 as systemd's SocketMode= default
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
    assert path.stat().st_mode & 0o777 == 0o666
    assert cli(daemon.state_dir, "delete", "web").returncode == 0
    wait_for(lambda: not path.exists(), 10, "the unix socket to be removed once no pool uses it")


def test_listen_sockets_gives_a_python_worker_its_sockets_in_order(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    port = free_port_range(1)
    out = tmp_path / "seen"
    launch_ok(daemon, "--pool", "py", "--socket", f"unix:{tmp_path / 'a.sock'}", "--socket",
              f"tcp://127.0.0.1:{port}", "--env", f"OUT={out}", "--target", "workers:report_listen_sockets",
              "--ready", "notify", "--wait")
    lines = out.read_text().splitlines()
    assert lines == [f"AF_UNIX {tmp_path / 'a.sock'}", f"AF_INET 127.0.0.1:{port}", "cloexec True True",
                     "forked child: 0"]


def test_a_socket_never_reaches_another_pool_a_probe_or_a_spawner(daemon: DaemonUnderTest) -> None:
    daemon.start()
    port = free_port_range(1)
    launch_ok(daemon, "--pool", "web", "--socket", f"tcp://127.0.0.1:{port}", "--ready",
              "exec:ls -l /proc/self/fd/", "--wait", "--", "sleep", "300")
    launch_ok(daemon, "--pool", "other", "--wait", "--", "sleep", "300")
    sock = listening_inode(port)
    (web,) = running(daemon, "web")
    (other,) = running(daemon, "other")
    assert fd_inodes(web["pid"])[3] == sock
    assert sock not in fd_inodes(other["pid"]).values()
    assert "LISTEN_FDS" not in environ(other["pid"]) and "LISTEN_PID" not in environ(other["pid"])
    # the readiness probe ran in the socket pool's own name, and listed its fds: not the socket
    probe_log = (daemon.state_dir / "logs" / f"{web['id']}.probe").read_text()
    assert "socket:[" + sock.split("[")[1] not in probe_log, probe_log
    st = daemon.status()
    for pid in (*st["daemon"]["spawner_pids"], st["daemon"]["manager_pid"], st["daemon"]["watchdog_pid"]):
        assert sock not in fd_inodes(pid).values(), pid
    daemon_fd = [fd for fd, what in fd_inodes(st["daemon"]["pid"]).items() if what == sock]
    assert len(daemon_fd) == 1 and fd_flags(st["daemon"]["pid"], daemon_fd[0]) & O_CLOEXEC


# -- zero refused connections -------------------------------------------------------------------


class Client(threading.Thread):
    """Connects every few ms, sends a request and reads the answer; counts by outcome."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.answered: dict[str, int] = {}
        self.refused = 0
        self.other: list[str] = []
        self.total = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.total += 1
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    data = b""
                    while chunk := s.recv(4096):
                        data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.0 200"):
                    raise OSError(f"bad answer {data!r}")
                self.answered[body.decode()] = self.answered.get(body.decode(), 0) + 1
            except ConnectionRefusedError:
                self.refused += 1
            except OSError as err:
                self.other.append(f"{type(err).__name__}: {err}")
            self.stop.wait(0.003)

    def snapshot(self) -> tuple[int, int, list[str]]:
        return self.total, self.refused, list(self.other)


def test_rolling_restart_and_kill9_refuse_no_connection(daemon: DaemonUnderTest) -> None:
    daemon.start()
    port = free_port_range(1)
    ids = launch_ok(daemon, "--pool", "web", "--count", "3", "--socket", f"tcp://127.0.0.1:{port}",
                    "--restart", "always", "--backoff", "0.1:0.1", "--ready", "notify",
                    "--target", "workers:http_on_sockets", "--wait")
    assert len(ids) == 3
    client = Client(port)
    client.start()
    try:
        wait_for(lambda: client.total > 50, 30, "the client to get going")
        proc = cli(daemon.state_dir, "restart", "--pool", "web")
        assert proc.returncode == 0, proc.stderr
        total, refused, other = client.snapshot()
        assert refused == 0 and other == [], (refused, other[:5])  # a graceful roll loses nothing
        after_restart = total
        reps = running(daemon, "web")
        assert len(reps) == 3 and not {r["id"] for r in reps} & set(ids)
        victim = reps[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: len([r for r in running(daemon, "web") if r["id"] != victim["id"]]) == 3, 30,
                 "a replacement for the killed replica")
        wait_for(lambda: client.total > after_restart + 50, 30, "more requests after the kill")
    finally:
        client.stop.set()
        client.join(10)
    assert client.refused == 0, client.refused
    # A kill -9 can cut a request the victim had accepted (a reset), never refuse one.
    assert all("Refused" not in o for o in client.other), client.other
    assert len(client.other) <= 1, client.other
    assert len(client.answered) >= 2, client.answered  # the replicas share the one port
    assert sum(client.answered.values()) > 100


def test_a_socket_pool_with_ports_surges_in_a_rolling_restart(h: Harness) -> None:
    name = f"@orchestrator-test-{os.getpid()}-{time.monotonic_ns()}"
    ids = h.ok("launch", pool="web", count=2, spec=SPEC, policy={"port_base": 9000, "sockets": [f"unix:{name}"]})
    for rid in ids:
        h.fake.ready(h.rep(rid)["pid"])
        h.turn()
    env = h.fake.procs[h.rep(ids[0])["pid"]].env
    assert env["LISTEN_FDS"] == "1" and env["LISTEN_FDNAMES"] == "web" and "LISTEN_PID" not in env
    h.send("restart", pool="web", max_unavailable=1)
    h.turn()
    # new first, the old one still running beside it: no moment without a replica on the slot
    starting = [r for r in h.status()["replicas"] if r["state"] == "STARTING"]
    assert len(starting) == 1 and starting[0]["slot"] == h.rep(ids[0])["slot"]
    assert [h.state(i) for i in ids] == ["RUNNING", "RUNNING"]


# -- refused addresses: one line, exit 1, the daemon keeps running ------------------------------


def test_an_address_in_use_is_one_line_and_the_daemon_runs_on(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    with holder:
        line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "web", "--socket",
                                  f"tcp://127.0.0.1:{port}", "--", "sleep", "300"))
        assert line == f"orchestrator: socket tcp://127.0.0.1:{port}: address in use", line
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "web", "--socket",
                              f"unix:{tmp_path}/nodir/app.sock", "--", "sleep", "300"))
    assert line.endswith(f"directory {tmp_path}/nodir does not exist"), line
    assert not (tmp_path / "nodir").exists()  # no directory is made
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "web", "--socket",
                              "tcp://localhost:80", "--", "sleep", "300"))
    assert "not a host name" in line
    # a unix path held by a live listener is in use; one left by a dead one is taken over
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(live))
        other.listen()
        line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "web", "--socket",
                                  f"unix:{live}", "--", "sleep", "300"))
        assert line.endswith("address in use"), line
    assert cli(daemon.state_dir, "launch", "--pool", "web", "--socket", f"unix:{live}", "--wait",
               "--", "sleep", "300").returncode == 0
    assert cli(daemon.state_dir, "health").returncode == 0
    assert [p["name"] for p in daemon.status()["pools"]] == ["web"]


def test_a_refused_socket_in_a_config_reload_keeps_the_running_config(daemon: DaemonUnderTest,
                                                                       tmp_path: Path) -> None:
    port = free_port_range(1)
    conf = tmp_path / "o.toml"
    conf.write_text(f'[pools.web]\ncommand = ["sleep", "300"]\nsockets = ["tcp://127.0.0.1:{port}"]\n')
    daemon.start("--config", str(conf))
    wait_for(lambda: len(running(daemon, "web")) == 1, 30, "web")
    sock = listening_inode(port)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        conf.write_text(f'[pools.web]\ncommand = ["sleep", "300"]\nsockets = ["tcp://127.0.0.1:{port}"]\n'
                        f'[pools.api]\ncommand = ["sleep", "300"]\nsockets = ["tcp://127.0.0.1:{busy}"]\n')
        line = one_line_error(cli(daemon.state_dir, "reload"))
        assert f"pools.api: socket tcp://127.0.0.1:{busy}: address in use" in line, line
    # the same address across a reload that changes the pool: the same listener, never closed
    conf.write_text(f'[pools.web]\ncommand = ["sleep", "301"]\nsockets = ["tcp://127.0.0.1:{port}"]\n')
    assert cli(daemon.state_dir, "reload").returncode == 0
    wait_for(lambda: [r["pid"] and Path(f"/proc/{r['pid']}/cmdline").read_bytes() for r in running(daemon, "web")]
             == [b"sleep\x00301\x00"], 30, "web rolled onto sleep 301")
    assert listening_inode(port) == sock


# -- without the right -------------------------------------------------------------------------
# Not as nobody: here the interpreter lives under /root (0700), which nobody cannot reach to
# start the daemon's helpers. The daemon runs as root without the capabilities that give the
# right instead: CAP_NET_BIND_SERVICE (ports below 1024) and CAP_DAC_OVERRIDE (any directory).


def _unprivileged_port_start() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())


def _without_the_right() -> list[str]:
    """The command prefix that runs a process without the right to bind low ports or write
    others' directories."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return ["setpriv", "--bounding-set=-net_bind_service,-dac_override,-dac_read_search"]
    pytest.skip("needs root and setpriv, to run a daemon without CAP_NET_BIND_SERVICE and CAP_DAC_OVERRIDE")


@contextlib.contextmanager
def unprivileged_daemon() -> Iterator[tuple[Path, Callable[..., subprocess.CompletedProcess]]]:
    prefix = _without_the_right()
    base = Path(tempfile.mkdtemp(prefix="orch-sock-", dir="/tmp"))
    os.chmod(base, 0o755)
    state = base / "state"
    state.mkdir(mode=0o700)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, sys.executable, "-m", "orchestrator", "--state-dir", str(state), *args],
                              capture_output=True, text=True, timeout=60, env={**cli_env(), "HOME": str(base)},
                              cwd=base, stdin=subprocess.DEVNULL)

    proc = run("start", "--cgroup", "off")
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.strip())
    seen: set[Ident] = tree(pid)
    try:
        yield base, run
    finally:
        seen |= tree(pid)
        run("stop", "--timeout", "30")
        left = survivors(seen)
        kill_all(left)
        shutil.rmtree(base, ignore_errors=True)
        assert not left, left


def test_a_low_port_or_an_unwritable_directory_is_refused_without_the_right() -> None:
    if _unprivileged_port_start() <= 80:
        pytest.skip("this host lets any user bind port 80 (net.ipv4.ip_unprivileged_port_start)")
    with unprivileged_daemon() as (base, run):
        line = one_line_error(run("launch", "--pool", "web", "--socket", "tcp://127.0.0.1:80",
                                  "--", "sleep", "300"))
        assert line == ("orchestrator: socket tcp://127.0.0.1:80: permission denied: a port below "
                        f"{_unprivileged_port_start()} needs root or CAP_NET_BIND_SERVICE"), line
        locked = base / "locked"
        locked.mkdir(mode=0o555)  # no one may create a file in it without the override
        line = one_line_error(run("launch", "--pool", "web", "--socket", f"unix:{locked}/app.sock",
                                  "--", "sleep", "300"))
        assert line == f"orchestrator: socket unix:{locked}/app.sock: directory {locked} is not writable", line
        assert not (locked / "app.sock").exists()
        assert run("health").returncode == 0


# -- systemd socket activation of the daemon itself -----------------------------------------


def test_a_socket_activated_daemon_hands_its_socket_to_the_pool_that_names_it(tmp_path: Path) -> None:
    """As systemd starts it from orchestrator.socket: the listener on fd 3, LISTEN_* set for
    the daemon's own pid (exec'd in place, as systemd's service process is)."""
    port = free_port_range(1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    conf = tmp_path / "o.toml"
    conf.write_text('[pools.web]\ncommand = ["sleep", "300"]\nsockets = ["fd:http"]\n'
                    '[pools.other]\ncommand = ["sleep", "300"]\n')
    state = tmp_path / "state"
    launcher = ("import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); os.close(fd);"
                "os.environ.update(LISTEN_FDS='1', LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES='http');"
                "os.execv(sys.executable, [sys.executable, '-m', 'orchestrator', *sys.argv[2:]])")
    daemon = subprocess.Popen([sys.executable, "-c", launcher, str(listener.fileno()), "--state-dir", str(state),
                               "start", "--foreground", "--config", str(conf)],
                              pass_fds=(listener.fileno(),), env=cli_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listener.close()  # only the daemon holds it now
    seen: set[Ident] = set()
    try:
        d = DaemonUnderTest(state)
        d.pid = daemon.pid

        def both_running() -> bool:
            st = cli(state, "status", "--json")
            return st.returncode == 0 and sum(r["state"] == "RUNNING" for r in d.status()["replicas"]) == 2

        wait_for(both_running, 60, "the config's pools")
        sock = listening_inode(port)
        (web,) = running(d, "web")
        (other,) = running(d, "other")
        assert fd_inodes(web["pid"])[3] == sock
        assert environ(web["pid"])["LISTEN_FDNAMES"] == "http"
        assert environ(web["pid"])["LISTEN_PID"] == str(web["pid"])
        assert sock not in fd_inodes(other["pid"]).values()
        assert "LISTEN_FDS" not in environ(other["pid"])  # the daemon's own variables are not passed on
        assert fd_flags(daemon.pid, 3) & O_CLOEXEC  # made close-on-exec by the daemon
        seen = d.snapshot()
    finally:
        seen |= tree(daemon.pid)
        cli(state, "stop", "--timeout", "30")
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            pass
        left = survivors(seen)
        kill_all(left)
        assert not left, left


def test_a_pool_naming_a_socket_the_daemon_was_not_given_is_refused(daemon: DaemonUnderTest) -> None:
    daemon.start()
    line = one_line_error(cli(daemon.state_dir, "launch", "--pool", "web", "--socket", "fd:http",
                              "--", "sleep", "300"))
    assert line == "orchestrator: socket fd:http: the daemon was not passed a socket named 'http' (LISTEN_FDNAMES: none)"


def test_the_socket_unit_matches_the_service(tmp_path: Path) -> None:
    from test_deploy import UNIT, read_unit

    sock_unit = read_unit((ROOT / "deploy" / "orchestrator.socket").read_text())
    service = read_unit(UNIT.read_text())
    assert sock_unit["Socket"]["ListenStream"], sock_unit
    assert sock_unit["Socket"].get("Service", ["orchestrator.service"]) == ["orchestrator.service"]
    assert sock_unit["Socket"]["Accept"] == ["no"]  # one daemon gets the listener, not one per connection
    names = sock_unit["Socket"]["FileDescriptorName"]
    example = (ROOT / "examples" / "sockets.toml").read_text()
    assert all(f'"fd:{n}"' in example for n in names), names
    assert "start --foreground" in service["Service"]["ExecStart"][0]  # the daemon is the process systemd starts


def test_the_example_web_app_serves_from_every_replica_on_one_port(daemon: DaemonUnderTest) -> None:
    daemon.start()
    port = free_port_range(1)
    launch_ok(daemon, "--pool", "web", "--count", "2", "--socket", f"tcp://127.0.0.1:{port}", "--ready", "notify",
              "--target", "webapp:serve", "--cwd", str(ROOT / "examples"), "--wait")
    seen = set()

    def both_answer() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200"), data
        seen.add(data.rsplit(b"hello from ", 1)[1].strip())
        return len(seen) == 2

    wait_for(both_answer, 30, "both replicas to answer on the one port")


def test_the_example_config_declares_the_socket_pool() -> None:
    from orchestrator.daemon import config

    if "after" not in config.POOL_KEYS:
        pytest.skip("this build has no `after` key yet (the ordering part adds it)")
    conf = config.load(str(ROOT / "examples" / "sockets.toml"))
    assert conf.pools["web"].policy["sockets"] == ["tcp://127.0.0.1:8000"]
    assert conf.pools["web"].size == 3


def test_a_bad_address_in_a_config_file_names_its_line(tmp_path: Path) -> None:
    from orchestrator.daemon import config

    conf = tmp_path / "o.toml"
    conf.write_text('[pools.web]\ncommand = ["sleep", "1"]\nsockets = ["tcp://localhost:80"]\n')
    with pytest.raises(config.ConfigError, match=r"o\.toml:3: pools\.web\.sockets: socket 'tcp://localhost:80': "
                                                 r".*not a host name"):
        config.load(str(conf))
