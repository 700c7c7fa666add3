"""The Manager server process: ``python -m orchestrator.manager`` (started by the daemon).

It serves the command queue and the reply board on the daemon's Unix socket (0600, auth
key, and only to peers of its own uid or root: channel.py checks SO_PEERCRED on accept)
and bridges them to the daemon over two pipes (see channel.py for the picture):

* forwarder thread: ``commands.get()`` → plain-data check → frame → command pipe;
* main thread: reads reply frames from the reply pipe → ``ReplyBoard``; EOF on that pipe
  means the daemon is gone (or closed it on shutdown), and the server exits at once.

It never outlives the daemon: PR_SET_PDEATHSIG (armed, then the parent checked), the pipe
EOF above, and the watchdog, which has it in its ledger.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from multiprocess import process, util

from .channel import SERIALIZER, ChannelManager, read_authkey, socket_address, use_plain_pickling
from .errors import OrchestratorError
from .paths import Paths, check_state_dir
from .protocol import FrameReader, encode_frame, is_plain
from .spawner import set_pdeathsig

REPLY_TTL = 120.0  # a reply nobody took (its client timed out or died) is dropped after this


class ReplyBoard:
    """Replies by command id; ``take`` blocks (server side) until its reply is posted."""

    def __init__(self, commands: queue.Queue) -> None:
        self._commands = commands
        self._cond = threading.Condition()
        self._replies: dict[str, tuple[float, dict]] = {}

    def post(self, msg: dict) -> None:
        now = time.monotonic()
        with self._cond:
            self._replies[msg.get("id")] = (now, msg)
            if len(self._replies) > 1000:
                for key, (t, _) in list(self._replies.items()):
                    if now - t > REPLY_TTL:
                        del self._replies[key]
            self._cond.notify_all()

    def call(self, cmd: Any, timeout: float) -> dict | None:
        """Put ``cmd`` on the command queue and wait for its reply."""
        cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
        if not isinstance(cmd_id, str):
            return {"id": cmd_id, "ok": False, "code": "invalid", "error": "malformed command: no 'id'"}
        self._commands.put(cmd)
        return self.take(cmd_id, timeout)

    def take(self, cmd_id: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + max(0.0, float(timeout))
        with self._cond:
            while cmd_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._replies.pop(cmd_id)[1]


def _forward(commands: queue.Queue, board: ReplyBoard, cmd_fd: int) -> None:
    while True:
        cmd = commands.get()
        cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
        if not isinstance(cmd_id, str) or not is_plain(cmd):
            if isinstance(cmd_id, str):
                board.post({"id": cmd_id, "ok": False, "code": "invalid",
                            "error": "malformed command: only plain data (dict, list, str, number, bool, None)"})
            continue  # without an id there is nobody to answer
        try:
            frame = encode_frame(cmd)
        except ValueError as err:  # NaN and friends
            board.post({"id": cmd_id, "ok": False, "code": "invalid", "error": f"malformed command: {err}"})
            continue
        try:
            _write_all(cmd_fd, frame)
        except BrokenPipeError:
            os._exit(0)  # the daemon is gone


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="orchestrator.manager")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--cmd-fd", type=int, required=True)
    ap.add_argument("--reply-fd", type=int, required=True)
    args = ap.parse_args(argv)

    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != args.parent_pid:
        os._exit(1)  # the daemon died before the signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    from setproctitle import setproctitle

    setproctitle("orchestrator: manager")

    state_dir = Path(args.state_dir)
    paths = Paths(state_dir)
    try:  # the daemon checked it; the key is read the same checked way
        check_state_dir(paths)
        authkey = read_authkey(paths)
    except OrchestratorError as err:
        print(f"orchestrator.manager: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    use_plain_pickling()
    address, _dirfd = socket_address(state_dir)
    commands: queue.Queue = queue.Queue()
    board = ReplyBoard(commands)
    ChannelManager.register("commands", callable=lambda: commands)
    ChannelManager.register("replies", callable=lambda: board, exposed=("take", "call"))
    old_umask = os.umask(0o177)  # the socket is created 0600
    try:
        server = ChannelManager(address=address, authkey=authkey, serializer=SERIALIZER).get_server()
    finally:
        os.umask(old_umask)
    server.stop_event = threading.Event()  # serve_forever() would have made it
    process.current_process()._manager_server = server
    # Our own accepter thread instead of serve_forever(), whose main loop wakes every second.
    _write_all(args.cmd_fd, encode_frame({"op": "_ready", "pid": os.getpid()}))
    threading.Thread(target=server.accepter, name="accepter", daemon=True).start()
    threading.Thread(target=_forward, args=(commands, board, args.cmd_fd), name="forwarder", daemon=True).start()

    reader = FrameReader()
    while True:
        try:
            data = os.read(args.reply_fd, 65536)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not data:
            break
        for msg in reader.feed(data):
            board.post(msg)
    util._run_finalizers(0)  # unlinks the socket
    os._exit(0)


if __name__ == "__main__":
    serve(sys.argv[1:])
