"""The Manager server process: ``python -m orchestrator.manager.server`` (started by the daemon).

It serves the command queue and the reply board on the daemon's Unix socket (0600, auth
key, and only to peers of its own uid or root: channelserver.py checks SO_PEERCRED on accept)
and bridges them to the daemon over two pipes (see client/channel.py for the picture):

* accepter thread: each connection to a connection thread, started ahead and reused
  (``_Handlers``: at a process limit the channel still answers);
* forwarder thread: ``commands.get()`` → plain-data check → frame → command pipe;
* main thread: reads reply frames from the reply pipe → ``ReplyBoard``; EOF on that pipe
  means the daemon is gone (or closed it on shutdown), and the server exits at once.

It never outlives the daemon: PR_SET_PDEATHSIG (armed, then the parent checked), the pipe
EOF above, and the watchdog, which has it in its ledger.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import queue
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from multiprocess import connection, process, util

from ..channelwire import SERIALIZER, read_authkey, set_timeouts, socket_address
from ..errors import OrchestratorError
from ..paths import Paths, check_state_dir
from ..errors import FrameTooLarge
from ..prctl import set_pdeathsig
from ..protocol import FrameReader, encode_frame, error, is_plain
from .channelserver import ChannelManager, use_plain_pickling

REPLY_TTL = 120.0  # a reply nobody took (its client timed out or died) is dropped after this


class ReplyBoard:
    """Replies by command id; ``take`` blocks (server side) until its reply is posted."""

    def __init__(self, commands: queue.Queue[Any]) -> None:
        self._commands = commands
        self._cond = threading.Condition()
        self._replies: dict[str, tuple[float, dict[str, Any]]] = {}

    def post(self, msg: Mapping[str, Any]) -> None:
        cmd_id = msg.get("id")
        if not isinstance(cmd_id, str):
            return  # only a command with an id is waited for (``call``): nobody could take it
        now = time.monotonic()
        with self._cond:
            self._replies[cmd_id] = (now, dict(msg))
            if len(self._replies) > 1000:
                for key, (t, _) in list(self._replies.items()):
                    if now - t > REPLY_TTL:
                        del self._replies[key]
            self._cond.notify_all()

    def call(self, cmd: Any, timeout: float) -> dict[str, Any] | None:
        """Put ``cmd`` on the command queue and wait for its reply."""
        cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
        if not isinstance(cmd_id, str):
            return {"id": cmd_id, "ok": False, "code": "invalid", "error": "malformed command: no 'id'"}
        self._commands.put(cmd)
        return self.take(cmd_id, timeout)

    def take(self, cmd_id: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + max(0.0, float(timeout))
        with self._cond:
            while cmd_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._replies.pop(cmd_id)[1]


def _forward(commands: queue.Queue[Any], board: ReplyBoard, cmd_fd: int) -> None:
    while True:
        cmd = commands.get()
        cmd_id = cmd.get("id") if isinstance(cmd, dict) else None
        if not isinstance(cmd_id, str) or not is_plain(cmd):
            if isinstance(cmd_id, str):
                board.post({"id": cmd_id, "ok": False, "code": "invalid",
                            "error": "malformed command: only plain data (dict, list, str, number, bool, None)"})
            continue  # without an id there is nobody to answer
        try:
            frame = encode_frame(cmd, "the command")
        except FrameTooLarge as err:  # the daemon could only drop it: say so now
            board.post(error(cmd_id, err))  # its own code: the client raises a FrameTooLarge
            continue
        except ValueError as err:  # NaN and friends
            board.post({"id": cmd_id, "ok": False, "code": "invalid", "error": f"malformed command: {err}"})
            continue
        try:
            _write_all(cmd_fd, frame)
        except BrokenPipeError:
            os._exit(0)  # the daemon is gone


class _Handlers:
    """The threads that serve connections, started ahead and reused. A thread started per
    connection (multiprocess's way) leaves the channel refusing every command once a
    process limit is reached (``pids.max``, systemd's ``TasksMax=``: a pool of replicas
    can fill it): so ``SPARE`` threads wait for connections from the start, one more is
    started whenever fewer than that are idle, and a thread that has served a connection
    waits for the next one instead of ending (at most ``KEEP`` wait). At the limit the
    threads there are keep serving, one connection each at a time; a connection that finds
    none idle and none can be started is refused with the reason."""

    SPARE = 4
    KEEP = 16

    def __init__(self, serve: Callable[[Any], None]) -> None:
        self._serve = serve
        self._cond = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._waiting = 0  # threads that hold no connection (waiting, or about to)
        for _ in range(self.SPARE):
            self._start()

    def _start(self) -> bool:
        with self._cond:
            self._waiting += 1  # counted before it runs: hand() must not start a second one for it
        try:
            threading.Thread(target=self._run, name="connection", daemon=True).start()
        except RuntimeError:  # "can't start new thread": the process limit
            with self._cond:
                self._waiting -= 1
            return False
        return True

    def hand(self, conn: Any) -> bool:
        """Give ``conn`` to a thread; False if none is idle and none can be started."""
        with self._cond:
            idle = self._waiting - len(self._queue)
            if idle > 0:
                self._queue.append(conn)
                self._cond.notify()
        if idle <= 0:
            if not self._start():
                return False
            with self._cond:
                self._queue.append(conn)
                self._cond.notify()
        if idle - 1 < self.SPARE:
            self._start()  # ahead of the next connection; at the limit, there is none to start
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._waiting > self.KEEP:
                        self._waiting -= 1
                        return
                    self._cond.wait()
                conn = self._queue.popleft()
                self._waiting -= 1
            try:
                self._serve(conn)  # multiprocess's handle_request: answers, serves, closes
            except Exception as err:  # one connection's failure is not the thread's
                print(f"orchestrator.manager.server: a connection failed ({err!r})", file=sys.stderr, flush=True)
            with self._cond:
                self._waiting += 1


class _Accepter:
    """The Manager server's accepter (``Server.accepter``), without its two ways of failing
    for good. multiprocess starts a thread per connection and lets a failed start end the
    accepter, so that at a process limit (``pids.max``, systemd's ``TasksMax=``) one
    connection left a manager that was alive and answered nothing ever again; and it retries
    a failed ``accept()`` at once, so that at the fd limit it spun while every client waited
    for its time-out. Here connections go to threads started ahead and reused (``_Handlers``),
    the one connection that cannot be served is answered with the
    reason (the auth handshake and an error reply, bounded by socket time-outs), it is said
    in the log, and the accepter goes on; a spare fd, given up for a moment, lets it take
    that connection off the queue at the fd limit."""

    REFUSAL_TIMEOUT = 1.0  # a refusal is served in the accepter's own thread: bound it
    LOG_EVERY = 10.0  # at most one log line per this many seconds about refusals

    def __init__(self, server: Any) -> None:
        self.server = server
        self.refused = 0
        self._logged_at = -self.LOG_EVERY
        self._spare = self._open_spare()
        self._handlers = _Handlers(server.handle_request)

    @staticmethod
    def _open_spare() -> int | None:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def run(self) -> None:
        while True:
            try:
                conn = self.server.listener.accept()
            except OSError as err:
                if err.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    raise  # no listener any more: end the thread, so the manager exits and is restarted
                if err.errno not in (errno.EMFILE, errno.ENFILE):
                    continue  # a peer refused by uid, or one that hung up before we got to it
                conn = self._at_fd_limit(err)
                if conn is None:
                    continue
            if not self._handlers.hand(conn):  # every thread busy, and no new one at the process limit
                self._refuse(conn, "the daemon's manager server cannot start a thread for this connection "
                                   "(can't start new thread: is a process limit reached?); try again later")

    def _at_fd_limit(self, err: OSError) -> Any:
        """accept() failed for want of an fd: the next connection to serve (the limit was
        lifted meanwhile), or None after refusing the queued one, or after a second with
        none queued."""
        # accept() takes an fd before it waits, so at the limit it fails at once whether a
        # connection is queued or not: wait for one without an fd (poll), bounded.
        poll = select.poll()
        poll.register(self.server.listener.fileno(), select.POLLIN)
        if not poll.poll(1000):
            return None
        try:
            return self.server.listener.accept()
        except OSError as again:
            if again.errno not in (errno.EMFILE, errno.ENFILE):
                return None
        reason = (f"the daemon's manager server has no file descriptor for this connection "
                  f"({err.strerror}); try again later")
        if self._spare is None:
            self._spare = self._open_spare()
            if self._spare is None:  # not even the spare: it waits in the queue; do not spin
                self._log(reason)
                time.sleep(0.1)
                return None
        os.close(self._spare)
        self._spare = None
        try:
            conn = self.server.listener.accept()  # the queued one, into the fd just given up
        except OSError:
            conn = None
        if conn is not None:
            self._refuse(conn, reason)
        self._spare = self._open_spare()
        return None

    def _refuse(self, conn: Any, reason: str) -> None:
        self.refused += 1
        self._log(reason)
        try:
            set_timeouts(conn.fileno(), self.REFUSAL_TIMEOUT)
            connection.deliver_challenge(conn, self.server.authkey)
            connection.answer_challenge(conn, self.server.authkey)
            conn.recv()  # the request it came with
            conn.send(("#ERROR", OSError(reason)))  # the client raises it: one line, at once
        except (OSError, EOFError, AssertionError, connection.AuthenticationError, OrchestratorError):
            pass  # a peer that hung up, timed out or spoke nonsense: it is refused all the same
        finally:
            conn.close()

    def _log(self, reason: str) -> None:
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY:
            self._logged_at = now
            print(f"orchestrator.manager.server: refused a connection ({self.refused} so far): {reason}",
                  file=sys.stderr, flush=True)


def _last_resort(name: str, target: Callable[[], None]) -> Callable[[], None]:
    """``target`` as a thread's body that must never end: a manager without its accepter or
    its forwarder is alive and answers nothing, and nothing would restart it."""

    def run() -> None:
        try:
            target()
        # The deliberate last-resort guard: whatever ended the thread (a bug, MemoryError),
        # exiting is what brings the channel back, since the daemon restarts its manager.
        except BaseException as err:  # noqa: BLE001
            print(f"orchestrator.manager.server: the {name} thread failed ({err!r}): exiting, to be restarted",
                  file=sys.stderr, flush=True)
            os._exit(70)
        print(f"orchestrator.manager.server: the {name} thread ended: exiting, to be restarted", file=sys.stderr, flush=True)
        os._exit(70)

    return run


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="orchestrator.manager.server")
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
        print(f"orchestrator.manager.server: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    use_plain_pickling()
    address, _dirfd = socket_address(state_dir)
    commands: queue.Queue[Any] = queue.Queue()  # what clients put: checked by the forwarder
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
    threading.Thread(target=_last_resort("accepter", _Accepter(server).run), name="accepter", daemon=True).start()
    forward = _last_resort("forwarder", lambda: _forward(commands, board, args.cmd_fd))
    threading.Thread(target=forward, name="forwarder", daemon=True).start()

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
