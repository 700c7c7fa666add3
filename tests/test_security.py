"""Who the daemon and its clients trust: the state dir, the files in it, and the peer on
the control socket (orchestrator/paths.py, channel.py).

Black-box through the CLI where possible, each test in a state dir of its own. The tests
that need another user (``nobody``) need root to make one's files and processes; they skip,
saying why, where either is missing (CI runs as root, so they run there). Every process a
test starts is ended by the pid it got, and waited for, bounded.
"""

from __future__ import annotations

import os
import pwd
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import ROOT, DaemonUnderTest, cli, cli_env
from orchestrator import ChannelError, Client
from orchestrator.paths import UnsafeStateDir

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-api-token-0123456789"


def _nobody() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


NOBODY = _nobody()
needs_nobody = pytest.mark.skipif(
    os.geteuid() != 0 or NOBODY is None,
    reason="needs root and a 'nobody' user: another user's files and processes",
)


def one_line_error(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    """Assert the CLI failed the way it promises: exit ``code``, one line, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orchestrator: "), proc.stderr
    return lines[0]


def listing(d: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``d``: (mode, uid, size), without following links."""
    out = {}
    for path in sorted(d.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(d))] = (st.st_mode, st.st_uid, st.st_size)
    return out


def modes(d: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(d.lstat().st_mode)}
    for path in d.rglob("*"):
        out[str(path.relative_to(d))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def chown_tree(d: Path, uid: int, gid: int) -> None:
    os.chown(d, uid, gid, follow_symlinks=False)
    for path in d.rglob("*"):
        os.chown(path, uid, gid, follow_symlinks=False)


def _stop(d: Path) -> None:
    cli(d, "stop", "--timeout", "30")


# -- a state dir that is not a dir, or not ours -------------------------------------


def test_state_dir_that_is_a_regular_file_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "state"
    f.write_text("not a dir\n")
    for args in (("status",), ("status", "--json"), ("start",), ("stop",), ("events",),
                 ("launch", "--pool", "w", "--", "true"), ("terminate", "w-1"), ("scale", "w", "1")):
        line = one_line_error(cli(f, *args))
        assert "not a directory" in line, (args, line)
    assert f.read_text() == "not a dir\n"
    under = tmp_path / "state" / "sub"  # a file as a parent of the dir: start cannot make it
    one_line_error(cli(under, "start"))
    one_line_error(cli(under, "status"))


def test_never_used_dir_still_reads_as_not_running(tmp_path: Path) -> None:
    d = tmp_path / "never"
    down = cli(d, "status")
    assert down.returncode == 3 and "not running" in down.stdout, down.stderr
    assert cli(d, "events").returncode == 0
    assert not d.exists()  # a reader creates nothing


@needs_nobody
@pytest.mark.parametrize("mode", [0o700, 0o755])
def test_dir_owned_by_another_user_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=mode)
    os.chmod(d, mode)
    (d / "logs").mkdir()
    (d / "authkey").write_bytes(b"k" * 32)  # a key they planted
    chown_tree(d, NOBODY.pw_uid, NOBODY.pw_gid)
    before = listing(d)
    try:
        for args in (("status",), ("start",), ("start", "--foreground"), ("stop",), ("events",),
                     ("launch", "--pool", "w", "--", "true"), ("scale", "w", "1")):
            line = one_line_error(cli(d, *args))
            assert "owned by uid 65534" in line or f"owned by uid {NOBODY.pw_uid}" in line, (args, line)
        with pytest.raises(UnsafeStateDir, match="owned by"):
            Client(d)
        assert listing(d) == before  # nothing created, truncated or appended to
    finally:
        _stop(d)


@pytest.mark.parametrize("mode", [0o775, 0o777, 0o1777, 0o757])
def test_dir_writable_by_others_is_refused_not_tightened(tmp_path: Path, mode: int) -> None:
    """Our own dir, but someone else may already have put something in it: refused (a
    chmod would not undo that), everywhere, and left as it is."""
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, mode)
    try:
        for args in (("status",), ("start",), ("start", "--foreground"), ("events",),
                     ("launch", "--pool", "w", "--", "true")):
            line = one_line_error(cli(d, *args))
            assert "writable by group or others" in line, (args, line)
        assert listing(d) == {}
        assert stat.S_IMODE(d.stat().st_mode) == mode
    finally:
        _stop(d)


def test_file_in_the_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    db = d / "state.db"
    db.write_bytes(b"")
    os.chmod(db, 0o666)  # a journal someone else could have written pickled targets into
    try:
        for args in (("status",), ("start",), ("events",)):
            line = one_line_error(cli(d, *args))
            assert "state.db is writable by group or others" in line, (args, line)
    finally:
        _stop(d)


# -- planted links ----------------------------------------------------------------------


@pytest.mark.parametrize("dangling", [False, True])
def test_planted_pidfile_symlink_is_not_followed(tmp_path: Path, dangling: bool) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    target = tmp_path / "precious"
    if not dangling:
        target.write_text("precious content\n")
        os.chmod(target, 0o644)
    (d / "daemon.pid").symlink_to(target)
    before = listing(d)
    try:
        for args in (("start",), ("start", "--foreground"), ("status",), ("stop",)):
            line = one_line_error(cli(d, *args))
            assert "daemon.pid is a symbolic link" in line, (args, line)
        if dangling:
            assert not target.exists()  # not created through the link either
        else:
            assert target.read_text() == "precious content\n"
        assert listing(d) == before
    finally:
        _stop(d)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_planted_log_link_is_not_followed(tmp_path: Path, link: str) -> None:
    d = tmp_path / "state"
    (d / "logs").mkdir(parents=True, mode=0o700)
    os.chmod(d, 0o700)
    target = tmp_path / "precious"
    target.write_text("precious content\n")
    os.chmod(target, 0o600)
    if link == "symlink":
        (d / "logs" / "daemon.log").symlink_to(target)
    else:
        os.link(target, d / "logs" / "daemon.log")
    try:
        for args in (("start",), ("start", "--foreground")):
            line = one_line_error(cli(d, *args))
            assert "daemon.log" in line and ("symbolic link" in line or "hard links" in line), line
        assert target.read_text() == "precious content\n"
        assert not (d / "daemon.pid").exists()  # no daemon was started
    finally:
        _stop(d)


# -- secrets stay ours ------------------------------------------------------------------


def _assert_private(d: Path) -> None:
    me = os.geteuid()
    loose = {name: oct(mode) for name, mode in modes(d).items() if mode & 0o077}
    assert not loose, f"readable by group or others: {loose}"
    for path in [d, *d.rglob("*")]:
        assert path.lstat().st_uid == me, path


def _secret_on_disk(d: Path) -> list[str]:
    return [str(p.relative_to(d)) for p in d.rglob("*")
            if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_readable_dir_is_tightened_and_secrets_stay_private(tmp_path: Path) -> None:
    """A state dir made with ``mkdir`` under umask 022 (0755): readers accept it (nobody
    else could write to it), ``start`` tightens it to 0700, and every file the daemon and
    its workers make in it is 0600 (dirs 0700), the WAL with the launch's token included."""
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, 0o755)
    assert cli(d, "status").returncode == 3
    daemon = DaemonUnderTest(d)
    try:
        daemon.start()
        proc = cli(d, "launch", "--pool", "web", "--env", f"API_TOKEN={SECRET}", "--wait", "--", "sleep", "100")
        assert proc.returncode == 0, proc.stderr
        assert daemon.status()["replicas"][0]["state"] == "RUNNING"
        assert _secret_on_disk(d), "the token is not on disk: this test would prove nothing"
        _assert_private(d)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    finally:
        assert not daemon.teardown()
    _assert_private(d)


def test_old_readable_files_are_tightened_at_start(tmp_path: Path) -> None:
    """Files an older version left readable by others (a 0644 state.db makes SQLite create
    its -wal and -shm 0644 too, whatever the umask) are tightened when a daemon starts."""
    d = tmp_path / "state"
    daemon = DaemonUnderTest(d)
    try:
        daemon.start()
        assert cli(d, "launch", "--pool", "warm", "--", "true").returncode == 0
        assert cli(d, "stop").returncode == 0
        os.chmod(d, 0o755)
        os.chmod(d / "logs", 0o755)
        for name in ("state.db", "logs/daemon.log"):
            os.chmod(d / name, 0o644)
        assert cli(d, "status").returncode == 3  # readable by others is no reason to refuse a reader
        daemon.start()
        proc = cli(d, "launch", "--pool", "web", "--env", f"API_TOKEN={SECRET}", "--wait", "--", "sleep", "100")
        assert proc.returncode == 0, proc.stderr
        _assert_private(d)
    finally:
        assert not daemon.teardown()


# -- the peer on the control socket -----------------------------------------------------

# A server of someone else's on control.sock: it passes the auth handshake with the key it
# knows and answers every request with a pickle that, unpickled, creates the marker file.
FAKE_SERVER = r'''
import fcntl, hashlib, hmac, os, pickle, socket, sys  # all imported while the stdlib is still ours to read
from multiprocess import connection

state, marker, kind, uid, gid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

class Payload:
    def __reduce__(self):
        return (open, (marker, "w"))

reply = pickle.dumps(("#RETURN", Payload()))
with open(os.path.join(state, "authkey"), "rb") as f:
    key = f.read()
pidfd = os.open(os.path.join(state, "daemon.pid"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.lockf(pidfd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # so that the client sees a daemon running
os.write(pidfd, f"{os.getpid()}\n".encode())
path = os.path.join(state, "control.sock")
sock = socket.socket(socket.AF_UNIX)
sock.bind(path)
os.chmod(path, 0o600)
if kind != "peer":  # "peer": every file is the client's own; only the process is not
    for p in ([path] if kind == "socket" else [state, path] + [os.path.join(state, n) for n in os.listdir(state)]):
        os.chown(p, uid, gid, follow_symlinks=False)
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
sock.listen(16)  # SO_PEERCRED reports who listened: now, nobody
print("ready", flush=True)
while True:
    s, _ = sock.accept()
    conn = connection.Connection(s.detach())
    try:
        connection.deliver_challenge(conn, key)
        connection.answer_challenge(conn, key)
        while True:
            conn.recv_bytes()
            conn.send_bytes(reply)
    except Exception:
        pass
    finally:
        conn.close()
'''


def _wait_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the fake server did not start"
    return proc.stdout.readline().strip()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@needs_nobody
@pytest.mark.parametrize("kind", ["dir", "socket", "peer"])
def test_fake_server_of_another_user_gets_nothing_unpickled(tmp_path: Path, kind: str) -> None:
    """``dir``: the whole state dir is nobody's (their key, their pid file, their socket);
    ``socket``: our dir and files, but nobody's socket; ``peer``: every file ours, only the
    server process runs as nobody, which only SO_PEERCRED can tell. The client refuses in
    each case before it unpickles a byte: the payload never runs. Then an unchecked client
    shows that the payload was armed."""
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    (d / "authkey").write_bytes(os.urandom(32))
    os.chmod(d / "authkey", 0o600)
    marker = tmp_path / "pwned"
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(d), str(marker), kind,
                             str(NOBODY.pw_uid), str(NOBODY.pw_gid)],
                            stdout=subprocess.PIPE, text=True, env=cli_env(), stdin=subprocess.DEVNULL)
    try:
        assert _wait_line(proc, 30) == "ready"
        expect = {"dir": "state dir", "socket": "control.sock is owned by", "peer": "runs as uid"}[kind]
        for args in (("status",), ("status", "--json"), ("launch", "--pool", "w", "--", "true"),
                     ("terminate", "w-1")):
            line = one_line_error(cli(d, *args, timeout=30))
            assert expect in line, (args, line)
        one_line_error(cli(d, "start", timeout=30))  # refused, or "already running": never a second daemon
        with pytest.raises(UnsafeStateDir):
            Client(d, timeout=5).ping()
        assert not marker.exists(), "the fake server's pickle ran in the client"
        assert proc.poll() is None

        # The control: multiprocess's own client, with no peer check and dill's unpickler.
        from multiprocess import connection

        conn = connection.Client(str(d / "control.sock"), authkey=(d / "authkey").read_bytes())
        try:
            conn.send((None, "dummy", (), {}))
            _, opened = conn.recv()
            opened.close()
        finally:
            conn.close()
        assert marker.exists(), "the fake server was not armed: this test would prove nothing"
    finally:
        _end(proc)
        _stop(d)


def _interpreter_for(user: pwd.struct_passwd, code: str, env: dict[str, str]) -> str | None:
    """A Python that ``user`` may run ``code`` with (the test's own may live under a
    home dir others cannot enter); None if there is none."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    seen = []
    for exe in (sys.executable, getattr(sys, "_base_executable", None), f"/usr/bin/{version}",
                f"/usr/local/bin/{version}", shutil.which(version)):
        if not exe or exe in seen or not os.path.exists(exe):
            continue
        seen.append(exe)
        try:
            ok = subprocess.run([exe, "-c", code], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                                env=env, cwd="/", capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return exe
    return None


@needs_nobody
def test_manager_drops_a_peer_of_another_uid(tmp_path: Path) -> None:
    """The second wall: even with the socket opened up to everyone (0666), a client of
    another uid is dropped on accept, before the auth challenge is sent and before
    anything it sends is read; the daemon goes on serving its own user."""
    exe = _interpreter_for(NOBODY, "import socket", {"PATH": "/usr/bin:/bin"})
    if exe is None:
        pytest.skip("no Python interpreter that 'nobody' may run")
    d = tmp_path / "state"
    daemon = DaemonUnderTest(d)
    probe = ("import socket, sys\n"
             "s = socket.socket(socket.AF_UNIX)\n"
             "s.settimeout(10)\n"
             "s.connect(sys.argv[1])\n"
             "try:\n"
             "    data = s.recv(256)\n"
             "except ConnectionResetError:\n"
             "    data = b''\n"
             "print(repr(data))\n")
    try:
        daemon.start()
        sock = d / "control.sock"
        dirfd = os.open(d, os.O_PATH | os.O_DIRECTORY)
        try:
            os.chmod(d, 0o711)  # the first wall down: they may reach the socket...
            os.chmod(sock, 0o666)  # ...and connect to it
            # As root, for comparison: the server opens with its challenge.
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(str(sock))
            assert b"#CHALLENGE#" in s.recv(256)
            s.close()
            # As nobody, through a descriptor of the dir (its parents are not theirs to enter).
            out = subprocess.run([exe, "-I", "-S", "-c", probe, f"/proc/self/fd/{dirfd}/control.sock"],
                                 user=NOBODY.pw_uid, group=NOBODY.pw_gid, extra_groups=[], pass_fds=(dirfd,),
                                 env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == "b''", out.stdout  # closed at once: no challenge
        finally:
            os.close(dirfd)
            os.chmod(d, 0o700)
            if sock.exists():
                os.chmod(sock, 0o600)
        with Client(d, timeout=10) as client:
            assert client.ping() == "pong"
        assert "refused a connection from uid" in (d / "logs" / "daemon.log").read_text()
    finally:
        assert not daemon.teardown()


@needs_nobody
def test_user_without_access_gets_one_line(tmp_path: Path) -> None:
    """Another user's CLI on our daemon's dir: one line and exit 1, no PermissionError
    traceback (from the pid file, the store or the key)."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(ROOT), *site]), "HOME": "/"}
    exe = _interpreter_for(NOBODY, "import orchestrator.client.cli", env)
    if exe is None:
        pytest.skip("no Python interpreter with which 'nobody' may import orchestrator")
    top = Path(tempfile.mkdtemp(prefix="orch-sec-"))  # not under tmp_path: its parents are 0700
    os.chmod(top, 0o711)  # they may pass through, not list
    d = top / "state"
    daemon = DaemonUnderTest(d)
    try:
        daemon.start()
        for args in (("status",), ("status", "--json"), ("stop",), ("events",),
                     ("launch", "--pool", "w", "--", "true")):
            proc = subprocess.run([exe, "-m", "orchestrator", "--state-dir", str(d), *args],
                                  user=NOBODY.pw_uid, group=NOBODY.pw_gid, extra_groups=[], env=env, cwd="/",
                                  capture_output=True, text=True, timeout=60)
            line = one_line_error(proc)
            assert "owned by uid 0" in line, (args, line)
        with Client(d, timeout=10) as client:
            assert client.ping() == "pong"
    finally:
        assert not daemon.teardown()
        shutil.rmtree(top, ignore_errors=True)


# -- what the channel unpickles ---------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_channel_unpickles_plain_data_only(tmp_path: Path) -> None:
    """Even from a trusted peer, a message that would import or call anything is a
    ChannelError, never run: the client takes plain data and builtin exceptions (the
    Manager's #ERROR replies), the server plain data only."""
    from orchestrator.channelwire import ClientConnection
    from orchestrator.manager.channelserver import _ServerConnection

    marker = tmp_path / "pwned"
    a, b = socket.socketpair()
    sender = ClientConnection(a.detach())
    client_end = ClientConnection(os.dup(b.fileno()))
    server_end = _ServerConnection(b.detach())
    try:
        plain = ("#RETURN", {"id": "x", "ok": True, "result": [1, 2.5, "s", None, True, b"b", (1,), {3}]})
        sender.send(plain)
        assert client_end.recv() == plain
        sender.send(("#ERROR", KeyError("web-9")))
        kind, err = client_end.recv()
        assert kind == "#ERROR" and isinstance(err, KeyError)
        for end in (client_end, server_end):
            sender.send(("#RETURN", _Payload(marker)))
            # the name open pickles as: io.open on 3.11, _io.open from 3.12 on
            with pytest.raises(ChannelError, match=r"refusing to unpickle _?io\.open"):
                end.recv()
        sender.send(("#ERROR", KeyError("web-9")))
        with pytest.raises(ChannelError, match="refusing to unpickle builtins.KeyError"):
            server_end.recv()
        sender.send((None, "create", ("commands",), {}))
        assert server_end.recv() == (None, "create", ("commands",), {})
        assert not marker.exists()
    finally:
        for conn in (sender, client_end, server_end):
            conn.close()
