"""Starting and stopping a daemon, as the CLI does it (the client side of ``start`` and
``stop``): spawn ``orchestrator start --foreground`` in its own session and wait for its
"READY <pid>" line, SIGTERM it and wait until it is gone, and read who holds the pid file.
The daemon process itself is daemon/main.py; this module imports none of it.

    orchestrator start ──spawns──► daemon (own session, stdio -> logs/daemon.log)
    ◄──── "READY <pid>" (or "ERROR <one line>") on a pipe once the channel accepts commands

Liveness is the daemon's lock on its pid file (paths.running_pid), never a pid check.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
import time

from .. import signals
from ..errors import OrchestratorError
from ..interpreter import program_env, python_argv
from ..paths import TOKEN_ENV, Paths, check_state_dir, is_watchdog, open_log, running_pid
from ..states import exit_reason


def daemon_env() -> dict[str, str]:
    """The environment a daemon is exec'd with: a fresh token, so every descendant carries
    it, and SPT_NOENV, so setproctitle does not clobber that environment in /proc; its
    PYTHONPATH absolute, as it meant here (the daemon leaves this directory: interpreter.py)."""
    env = program_env(os.environ)
    env[TOKEN_ENV] = secrets.token_hex(8)
    env["SPT_NOENV"] = "1"
    return env


def reexec_with_token() -> None:
    """Make sure the daemon's exec-time environment carries its token: /proc/PID/environ
    shows only that environment, and it is what forked Python workers show too, so the
    watchdog's token sweep can find them. `start` sets it; a bare `start --foreground`
    (systemd, a container) re-executes itself once with it."""
    if os.environ.get(TOKEN_ENV):
        return
    env = daemon_env()
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: not from this directory (interpreter.py); the daemon leaves it once it has made
    # the paths it was given absolute (main.run_foreground).
    os.execve(sys.executable, python_argv("-m", "orchestrator", *sys.argv[1:]), env)


def start_detached(paths: Paths, extra_args: list[str] | None = None, timeout: float = 60.0) -> int:
    """Start a daemon in its own session; return its pid once it accepts commands.
    A state dir (or a file in it) that someone else controls is refused (UnsafeStateDir)
    before anything in it is touched; the log is opened 0600, never through a link."""
    check_state_dir(paths, create=True)  # 0700, ours; one that others could read is tightened
    pid = running_pid(paths)
    if pid is not None and not is_watchdog(pid):  # a sweeping watchdog: the daemon waits for it
        raise OrchestratorError(f"a daemon is already running for {paths.state_dir} (pid {pid})")
    logfd = open_log(paths)
    try:
        r, w = os.pipe()
    except BaseException:
        os.close(logfd)
        raise
    env = daemon_env()
    # Started in /, on the standard path only (-P): nothing of the caller's directory, which
    # may be another user's, is imported or kept (interpreter.py); every path it is given is
    # absolute by now (Paths, cmd_start's --config).
    argv = python_argv("-m", "orchestrator", "--state-dir", str(paths.state_dir),
                       "start", "--foreground", "--ready-fd", str(w), *(extra_args or []))
    try:
        with open(os.devnull, "rb") as devnull:
            proc = subprocess.Popen(argv, stdin=devnull, stdout=logfd, stderr=logfd, env=env,
                                    pass_fds=(w,), start_new_session=True, cwd="/")
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(logfd)
        os.close(w)
    try:
        msg = read_until_eof(r, timeout)
    finally:
        os.close(r)
    if msg.startswith("READY "):
        proc.returncode = 0  # it lives on, detached; nothing of ours will wait for it
        return int(msg.split()[1])
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.returncode = 0
        raise OrchestratorError(f"the daemon did not become ready within {timeout:g} s; see {paths.log}") from None
    detail = msg.removeprefix("ERROR ").strip() or f"it exited with {exit_reason(code)}; see {paths.log}"
    raise OrchestratorError(detail)


def read_until_eof(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    chunks = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            break
        data = os.read(fd, 4096)
        if not data:
            break
        chunks.append(data)
        if b"\n" in data:
            break
    return b"".join(chunks).decode(errors="replace").strip()


def stop(paths: Paths, timeout: float = 30.0) -> int:
    """SIGTERM to the daemon (identity-checked), then wait. 0 stopped, 3 not running, 1 timed out."""

    pid = running_pid(paths)
    if pid is None:
        return 3
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 0
    try:
        if running_pid(paths) != pid:  # it died and the pid may be someone else's now
            return 0
        if not signals.to_pidfd(pidfd, signal.SIGTERM):  # a pid reused meanwhile cannot redirect it
            return 0
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return 1
        try:
            os.waitpid(pid, os.WNOHANG)  # if we started it (start_detached), do not leave a zombie
        except ChildProcessError:
            pass
        return 0
    finally:
        os.close(pidfd)


__all__ = ["daemon_env", "read_until_eof", "reexec_with_token",
           "start_detached", "stop"]
