"""Every size limit of the task wire is decided on a frame's header: a result over
``--result-max-bytes`` fails its task in one line without the daemon buffering it (its
memory does not grow by the result's size), the worker lives on, and the next task of the
pool runs; a connection that has not said who it is cannot make the loop buffer more than
a HELLO."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

import taskfns
from helpers import DaemonUnderTest, wait_for
from orchestrator import Executor
from test_tasks_cli import executors, make_pool  # noqa: F401  # the fixture



def _peak_rss(pid: int) -> int:
    """VmHWM: the largest resident set the process ever had, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_a_result_over_the_limit_is_refused_on_its_header(daemon: DaemonUnderTest,
                                                           executors: list[Executor]) -> None:
    pid = daemon.start("--result-max-bytes", "1M")
    ex = make_pool(daemon, executors)
    before = _peak_rss(pid)
    futures = [ex.submit(taskfns.allocate_bytes, 300 << 20) for _ in range(2)]
    for fut in futures:
        with pytest.raises(Exception, match=r"over the limit of 1 MiB \(--result-max-bytes\)") as err:
            fut.result(timeout=120)
        assert "\n" not in str(err.value)
    assert ex.submit(taskfns.square, 6).result(timeout=60) == 36  # the same worker carries on
    grew = _peak_rss(pid) - before
    assert grew < 64 << 20, f"the daemon grew by {grew >> 20} MiB"


def test_an_unidentified_connection_cannot_make_the_loop_buffer(daemon: DaemonUnderTest,
                                                                executors: list[Executor]) -> None:
    pid = daemon.start()
    make_pool(daemon, executors)
    address = _task_socket(pid)
    before = _peak_rss(pid)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer.connect(address)
        # A header claiming 512 MiB, then data behind it: the loop reads the header and closes.
        peer.sendall((512 << 20).to_bytes(4, "big") + bytes([1]) + (0).to_bytes(8, "big"))
        sent = 0
        deadline = time.monotonic() + 30
        peer.settimeout(1.0)
        while sent < 256 << 20 and time.monotonic() < deadline:
            try:
                sent += peer.send(bytes(1 << 20))
            except (BrokenPipeError, ConnectionResetError):
                break
            except socket.timeout:
                continue
    finally:
        peer.close()
    assert _peak_rss(pid) - before < 32 << 20
    assert daemon.status()["daemon"]["pid"] == pid


def _task_socket(pid: int) -> str:
    """The daemon's task listener (its workers get it in their environment)."""
    wait_for(lambda: _listener_of(pid) is not None, 30, "the task listener")
    found = _listener_of(pid)
    assert found is not None
    return found


def _listener_of(pid: int) -> str | None:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and parts[5] == "01" and "tasks" in parts[7]:  # listening
            name = parts[7]
            return "\0" + name[1:] if name.startswith("@") else name
    return None

