"""Not a test module: the replica that tests/test_containment.py and
benchmarks/bench_containment.py launch, a process tree that does everything a worker can do
to get away from its supervisor.

``python tests/containment_tree.py PREFIX``
    The replica's main process (``root``). It starts, and each member appends
    ``<role> <pid>`` to the file ``PREFIX.<replica id>`` (``$ORCHESTRATOR_REPLICA_ID``; one
    ``O_APPEND`` write, so lines never mix), then
    the escaping members disguise themselves: ``execve`` of ``sleep`` under another name
    (``argv[0]`` "innocent": a new title) with an empty environment (no
    ``ORCHESTRATOR_DAEMON_TOKEN``, no ``ORCH_TEST_TAG``: nothing left to find them by):

    ========== =====================================================================
    setsid     a child in a session of its own
    setpgid    a child in a process group of its own
    orphan     double-forked (its parent exited at once) into a session of its own
    timeout    run under GNU ``timeout``, which moves itself and it to a group of
               their own; ``timeout-wrapper`` is the ``timeout`` process
    job        started by ``bash -c 'set -m; ... & wait'``: job control gives it a
               group of its own; ``job-shell`` is that bash
    root       this process, once all the others are started; it waits for signals
    ========== =====================================================================

    ``ROLES`` lists them: the test waits for that many lines.

``python tests/containment_tree.py --member OUT ROLE``
    Used by the tree itself: say ROLE, then disguise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

ROLES = ("setsid", "setpgid", "orphan", "timeout", "timeout-wrapper", "job", "job-shell", "root")
DISGUISED = ("setsid", "setpgid", "orphan", "timeout", "job")
SLEEP = shutil.which("sleep") or "/bin/sleep"


def say(out: str, role: str, pid: int | None = None) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{role} {pid or os.getpid()}\n".encode())
    finally:
        os.close(fd)


def disguise() -> None:
    """A new title and an empty environment, in one exec; the pid stays."""
    os.execve(SLEEP, ["innocent", "1000"], {})


def _child(body) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(127)
    return pid


def tree(out: str) -> None:
    def member(setup, role: str):
        def body() -> None:
            setup()
            say(out, role)
            disguise()

        return body

    _child(member(os.setsid, "setsid"))
    _child(member(lambda: os.setpgid(0, 0), "setpgid"))

    def middle() -> None:
        _child(member(os.setsid, "orphan"))
        os._exit(0)

    os.waitpid(_child(middle), 0)
    me = [sys.executable, os.path.abspath(__file__), "--member", out]
    wrapper = subprocess.Popen(["timeout", "300", *me, "timeout"])
    say(out, "timeout-wrapper", wrapper.pid)
    shell = subprocess.Popen(["bash", "-c", 'set -m; "$@" & wait', "job-shell", *me, "job"])
    say(out, "job-shell", shell.pid)
    say(out, "root")
    while True:
        signal.pause()


if __name__ == "__main__":
    if sys.argv[1] == "--member":
        say(sys.argv[2], sys.argv[3])
        disguise()
    else:
        tree(f"{sys.argv[1]}.{os.environ.get('ORCHESTRATOR_REPLICA_ID', 'replica')}")
