"""A state dir's files, who may be trusted with them, and who holds its lock.

    <state dir>/            0700, ours
      daemon.pid        the daemon's pid, POSIX-locked (F_SETLK) for as long as it lives
      authkey           the channel's auth key (0600)
      control.sock      the manager server's Unix socket (0600)
      tasks.sock        the executor workers' task listener (0600)
      state.db          the journal (store.py), with -wal and -shm beside it
      watchdog-report.json   what the watchdog did after the daemon died
      logs/daemon.log   the detached daemon's stdout and stderr

Trust: a state dir is used only if it is ours (owned by our effective uid; root trusts
only root's) and nobody else can write to it; so is every file in it that we use, which
must also be what it claims to be (no symbolic link, no hard link to somewhere else, no
FIFO where a file should be). Anything else is refused with ``UnsafeStateDir`` and one
line that says why, before a byte of it is read. A dir writable by group or others is
refused even when it is ours: someone else may already have put something in it, and a
chmod would not undo that. A dir that is merely readable by others (``mkdir`` under umask
022) is tightened to 0700 by whoever starts a daemon in it (``create=True``), and so are
the files in it that others could read. Files are opened relative to a descriptor of the
checked dir, with O_NOFOLLOW, and checked again through the descriptor they were opened
as (``fstat``), so what is checked is what is used.

Files read on an operator's behalf (the config file of ``start --config`` and ``reload``,
the ``env_file`` its pools name, ``launch --env-file``) are outside the state dir, but a
daemon that reads them runs what they say, so the same rules hold (``read_operator_file``):
the file must be a regular file (checked before it is opened, so a FIFO never blocks and a
device is never opened, and again through the descriptor it was opened as), owned by the
reader's effective uid or by root, not writable by group or others, and at most a bound in
size. A symbolic link is followed (a Kubernetes ConfigMap is mounted as links), and what it
leads to is checked. The client's ``launch --env-file`` is read with its user's own rights:
the type and size rules hold there, the owner and mode rules do not.

Liveness is the lock, never a pid check: the kernel drops it the moment the daemon exits
(a zombie daemon already counts as gone), and F_GETLK names the holder's pid without
taking the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import signal
import stat
import struct
from pathlib import Path
from typing import Iterator

from .errors import InvalidSpec, UnsafeFile, UnsafeStateDir

SOCKET_NAME = "control.sock"
AUTHKEY_NAME = "authkey"
PIDFILE_NAME = "daemon.pid"
LOGS_NAME = "logs"
LOG_NAME = "daemon.log"
_FLOCK = "hhqqi4x"  # struct flock on Linux (x86_64, aarch64)

# What check_state_dir() looks at: every entry of the state dir that a command uses.
_ENTRIES = (
    (PIDFILE_NAME, stat.S_IFREG),
    (AUTHKEY_NAME, stat.S_IFREG),
    (SOCKET_NAME, stat.S_IFSOCK),
    ("state.db", stat.S_IFREG),
    ("state.db-wal", stat.S_IFREG),
    ("state.db-shm", stat.S_IFREG),
    ("watchdog-report.json", stat.S_IFREG),
    (LOGS_NAME, stat.S_IFDIR),
)
_KIND = {stat.S_IFREG: "regular file", stat.S_IFDIR: "directory", stat.S_IFSOCK: "socket"}
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_OPEN_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks the open


class Paths:
    """Where one daemon keeps its files."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(os.path.abspath(state_dir))
        self.pidfile = self.state_dir / PIDFILE_NAME
        self.authkey = self.state_dir / AUTHKEY_NAME
        self.socket = self.state_dir / SOCKET_NAME
        self.tasks_socket = self.state_dir / "tasks.sock"
        self.db = self.state_dir / "state.db"
        self.logs = self.state_dir / LOGS_NAME
        self.log = self.logs / LOG_NAME
        self.report = self.state_dir / "watchdog-report.json"


def default_state_dir() -> Path:
    if os.environ.get("ORCHESTRATOR_STATE_DIR"):
        return Path(os.environ["ORCHESTRATOR_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "orchestrator"


# -- trust ---------------------------------------------------------------------------


def user_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _check_stat(st: os.stat_result, what: str, kind: int) -> None:
    """Refuse ``st`` unless it is a ``kind`` of ours that nobody else can write."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStateDir(f"{what} is a symbolic link: refusing to follow it")
    if stat.S_IFMT(st.st_mode) != kind:
        raise UnsafeStateDir(f"{what} is not a {_KIND[kind]}")
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeStateDir(f"{what} is owned by {user_name(st.st_uid)}, not by {user_name(me)}: refusing to use it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeStateDir(f"{what} is writable by group or others (mode {mode:04o}): refusing to use it "
                             f"(chmod go-w it if nobody else has touched it)")
    if kind == stat.S_IFREG and st.st_nlink != 1:
        raise UnsafeStateDir(f"{what} has {st.st_nlink} hard links: refusing to use it")


def _tighten(fd: int, st: os.stat_result) -> None:
    """Take group's and others' bits off a checked file or dir of ours."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        os.fchmod(fd, mode & ~0o077)


def _tighten_fd(fd: int, what: str) -> None:
    try:
        _tighten(fd, os.fstat(fd))
    except OSError as err:
        raise _os_error(what, err) from None


def _os_error(what: str, err: OSError) -> UnsafeStateDir:
    return UnsafeStateDir(f"cannot use {what}: {err.strerror or err}")


def _open_state_dir(paths: Paths, create: bool) -> int | None:
    """A descriptor of the checked state dir (the caller closes it); None if it does not
    exist and ``create`` is false. ``create``: make it (0700) if it is missing."""
    where = paths.state_dir
    what = f"state dir {where}"
    if create:
        try:
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
        except FileExistsError:
            raise UnsafeStateDir(f"{what} is not a directory") from None
        except OSError as err:
            raise _os_error(what, err) from None
    try:
        fd = os.open(where, _OPEN_DIR)
    except FileNotFoundError:
        if create:
            raise UnsafeStateDir(f"{what} vanished while it was being created") from None
        return None
    except NotADirectoryError:
        raise UnsafeStateDir(f"{what} is not a directory") from None
    except PermissionError as err:
        with contextlib.suppress(OSError):  # say whose it is, if we may know
            _check_stat(os.stat(where), what, stat.S_IFDIR)
        raise _os_error(what, err) from None
    except OSError as err:
        raise _os_error(what, err) from None
    try:
        _check_stat(os.fstat(fd), what, stat.S_IFDIR)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _state_dir_fd(paths: Paths, create: bool = False) -> Iterator[int]:
    """The checked state dir's descriptor; FileNotFoundError if it does not exist."""
    fd = _open_state_dir(paths, create)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such state dir", str(paths.state_dir))
    try:
        yield fd
    finally:
        os.close(fd)


def _check_entry(dirfd: int, name: str, kind: int, what: str, tighten: bool) -> bool:
    """Check one entry of a checked dir without following it; False if it is absent."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise _os_error(what, err) from None
    _check_stat(st, what, kind)
    if tighten and stat.S_IMODE(st.st_mode) & 0o077:  # the entry is neither a link nor others' to swap
        try:
            os.chmod(name, stat.S_IMODE(st.st_mode) & ~0o077, dir_fd=dirfd)
        except OSError as err:
            raise _os_error(what, err) from None
    return True


def check_state_dir(paths: Paths, create: bool = False) -> bool:
    """Refuse (UnsafeStateDir) a state dir, or a file in it that we use, that is not ours,
    is writable by someone else, or is not what it should be; see the module docstring.
    Returns whether the dir exists: a missing one is fine for a reader (``create=False``);
    ``create=True`` (a daemon starting) makes it 0700, tightens one that others could
    read, with the files in it, and makes logs/."""
    fd = _open_state_dir(paths, create)
    if fd is None:
        return False
    try:
        # Everything is checked before anything is changed: a refusal leaves the dir as it was.
        for tighten in (False, True) if create else (False,):
            if tighten:
                _tighten_fd(fd, str(paths.state_dir))
                with contextlib.suppress(FileExistsError):
                    os.mkdir(LOGS_NAME, 0o700, dir_fd=fd)
            for name, kind in _ENTRIES:
                _check_entry(fd, name, kind, str(paths.state_dir / name), tighten)
            try:
                logs = os.open(LOGS_NAME, _OPEN_DIR | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as err:  # _check_entry has seen it a directory of ours
                raise _os_error(str(paths.logs), err) from None
            try:
                _check_entry(logs, LOG_NAME, stat.S_IFREG, str(paths.log), tighten)
            finally:
                os.close(logs)
    except OSError as err:
        raise _os_error(str(paths.state_dir), err) from None
    finally:
        os.close(fd)
    return True


def open_checked(paths: Paths, name: str, flags: int, *, create: bool = False, tighten: bool = False) -> int:
    """Open ``name`` (``logs/daemon.log`` style for a file in logs/) inside the checked
    state dir: relative to its descriptor, never through a symbolic link, and refused
    unless the file opened is a regular file of ours that nobody else can write (new
    files are 0600). FileNotFoundError if the dir or the file does not exist."""
    parts = name.split("/")
    what = str(paths.state_dir / name)
    with contextlib.ExitStack() as stack:
        dirfd = stack.enter_context(_state_dir_fd(paths, create))
        for i, part in enumerate(parts[:-1]):  # logs/
            sub_what = str(paths.state_dir.joinpath(*parts[:i + 1]))
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=dirfd)
            try:
                sub = os.open(part, _OPEN_DIR | os.O_NOFOLLOW, dir_fd=dirfd)
            except FileNotFoundError:
                raise
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    _check_entry(dirfd, part, stat.S_IFDIR, sub_what, False)
                raise _os_error(sub_what, err) from None
            stack.callback(os.close, sub)
            st = os.fstat(sub)
            _check_stat(st, sub_what, stat.S_IFDIR)
            if tighten:
                _tighten(sub, st)
            dirfd = sub
        try:
            fd = os.open(parts[-1], flags | _OPEN_FILE | (os.O_CREAT if create else 0), 0o600, dir_fd=dirfd)
        except FileNotFoundError:
            raise
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UnsafeStateDir(f"{what} is a symbolic link: refusing to follow it") from None
            raise _os_error(what, err) from None
        try:
            st = os.fstat(fd)
            _check_stat(st, what, stat.S_IFREG)
            if tighten:
                _tighten(fd, st)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd


def read_private(paths: Paths, name: str, limit: int = 1 << 16) -> bytes:
    """The content of a checked file of the state dir (FileNotFoundError if absent)."""
    fd = open_checked(paths, name, os.O_RDONLY)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def write_private(paths: Paths, name: str, data: bytes) -> None:
    """Replace ``name`` in the checked state dir by a new 0600 file holding ``data``."""
    with _state_dir_fd(paths) as dirfd:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dirfd)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FILE, 0o600, dir_fd=dirfd)
        except OSError as err:
            raise _os_error(str(paths.state_dir / name), err) from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def check_file(paths: Paths, name: str, kind: int = stat.S_IFREG) -> bool:
    """Check one entry of the state dir as check_state_dir() does; False if absent."""
    try:
        with _state_dir_fd(paths) as dirfd:
            return _check_entry(dirfd, name, kind, str(paths.state_dir / name), False)
    except FileNotFoundError:
        return False


# -- files read on an operator's behalf -------------------------------------------------

CONFIG_MAX_BYTES = 256 << 10  # a config file: parsed and applied in well under a second at this size
ENV_FILE_MAX_BYTES = 1 << 20  # one env file (launch --env-file, a pool's env_file)
_KIND_NAMES = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def _size(limit: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if limit >= 1 << shift and limit % (1 << shift) == 0:
            return f"{limit >> shift} {unit}"
    return f"{limit} bytes"


def _check_operator_file(st: os.stat_result, where: str, limit: int, trusted: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KIND_NAMES.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise UnsafeFile(f"{where} is {kind}, not a regular file: refusing to read it")
    if trusted:
        me = os.geteuid()
        if st.st_uid not in (me, 0):
            whom = "root" if me == 0 else f"{user_name(me)} or root"
            raise UnsafeFile(f"{where} is owned by {user_name(st.st_uid)}, not by {whom}: refusing to read it")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise UnsafeFile(f"{where} is writable by group or others (mode {mode:04o}): refusing to read it "
                             f"(chmod go-w it)")
    if st.st_size > limit:
        raise UnsafeFile(f"{where} is {st.st_size} bytes, more than the {_size(limit)} allowed: refusing to read it")


def read_operator_file(path: str | os.PathLike[str], what: str, limit: int, *, trusted: bool = True) -> bytes:
    """The content of a file read on an operator's behalf (see the module docstring), or
    UnsafeFile with one line that names ``what`` it is. ``trusted``: the reader acts for
    someone else (the daemon), so the owner and mode rules hold too."""
    where = f"{os.fspath(path)}: the {what}"
    try:
        # The type is checked before the open: opening a FIFO may block, a device's open
        # may act (a tape rewinds, a watchdog arms). The fstat after it is what counts.
        _check_operator_file(os.stat(path), where, limit, trusted)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        raise UnsafeFile(f"{os.fspath(path)}: cannot read the {what}: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        _check_operator_file(st, where, limit, trusted)
        chunks: list[bytes] = []
        left = limit + 1  # one byte more than allowed: a file that grew since the fstat
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        raise UnsafeFile(f"{os.fspath(path)}: cannot read the {what}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if left <= 0:
        raise UnsafeFile(f"{where} is more than the {_size(limit)} allowed: refusing to read it")
    return b"".join(chunks)


def read_env_file(path: str, *, trusted: bool = True) -> dict[str, str]:
    """An env file, as ``launch --env-file`` and a pool's ``env_file`` read it (see
    ``parse_env``), under the trust rules (``paths.read_operator_file``; ``trusted=False``:
    read by a client with its user's own rights, only the type and size rules hold)."""
    return parse_env(read_operator_file(path, "env file", ENV_FILE_MAX_BYTES, trusted=trusted), path)


def parse_env(data: bytes, path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, blank lines, an optional ``export ``, a value
    in matching quotes unquoted)."""
    env: dict[str, str] = {}
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise InvalidSpec(f"{path}: not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidSpec(f"{path}:{number}: expected KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


# -- the lock --------------------------------------------------------------------------


TOKEN_ENV = "ORCHESTRATOR_DAEMON_TOKEN"  # marks every process of one daemon, for the watchdog's sweep


def is_watchdog(pid: int | None) -> bool:
    """Is ``pid`` a watchdog (``python -m watchdog``), not a daemon? (The watchdog holds a
    dead daemon's pid-file lock while it sweeps.)"""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"-m" in argv and b"watchdog" in argv


def running_pid(paths: Paths) -> int | None:
    """The daemon's pid if one holds the lock, else None. Never takes the lock. Raises
    UnsafeStateDir for a pid file (or state dir) that cannot be trusted or read."""
    try:
        fd = open_checked(paths, PIDFILE_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, l_pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    finally:
        os.close(fd)
    return None if l_type == fcntl.F_UNLCK else l_pid


def take_lock(paths: Paths, *, wait: float = 0.0) -> int | None:
    """Open (0600) and lock the pid file, write our pid; None if another process holds it
    (for ``wait`` seconds at most: a dead daemon's watchdog holds it while it sweeps).

    The lock must be on the file the path names *now*: whoever held it before may have
    unlinked it (a clean stop, or that watchdog removing stale files) between our open and
    our lock, and a lock on an unlinked file guards nothing. So: lock, then compare."""
    for _ in range(8):
        fd = open_checked(paths, PIDFILE_NAME, os.O_RDWR, create=True, tighten=True)
        try:
            _lock(fd, wait)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN, errno.EINTR):
                return None
            raise
        try:
            same = os.stat(paths.pidfile, follow_symlinks=False)
            if (same.st_dev, same.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # unlinked under us: try the new one
    return None


def _lock(fd: int, wait: float) -> None:
    """lockf(LOCK_EX), giving up after ``wait`` seconds (EINTR) instead of blocking forever:
    a one-shot interval timer interrupts the blocking call, no polling."""
    if wait <= 0:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return

    def give_up(signum: int, frame: object) -> None:
        raise InterruptedError(errno.EINTR, "timed out waiting for the lock")

    old = signal.signal(signal.SIGALRM, give_up)
    signal.setitimer(signal.ITIMER_REAL, wait)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def open_log(paths: Paths) -> int:
    """logs/daemon.log for appending: created 0600, never through a link, tightened."""
    return open_checked(paths, f"{LOGS_NAME}/{LOG_NAME}", os.O_WRONLY | os.O_APPEND, create=True, tighten=True)
