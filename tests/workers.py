"""Targets that the daemon tests launch with --target workers:NAME."""

import os
import signal
import time


def sleeper() -> None:
    time.sleep(1000)


def stubborn() -> None:
    """Ignores SIGTERM: only the SIGKILL after the grace ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1000)


def spawns_grandchild() -> None:
    """Leaves a grandchild in its process group, then sleeps."""
    if os.fork() == 0:
        time.sleep(1000)
        os._exit(0)
    time.sleep(1000)


def escapes_with_setsid() -> None:
    """A grandchild that leaves the worker's group and session."""
    if os.fork() == 0:
        os.setsid()
        time.sleep(1000)
        os._exit(0)
    time.sleep(1000)


def orphan_maker() -> None:
    """Double-forks a grandchild that outlives its parent, so it is orphaned and
    re-parented to the daemon (a subreaper); it writes its pid to $ORPHAN_FILE, waits for
    $ORPHAN_FILE.go to appear, and exits."""
    path = os.environ["ORPHAN_FILE"]
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            deadline = time.monotonic() + 30
            while not os.path.exists(path + ".go") and time.monotonic() < deadline:
                time.sleep(0.01)
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(1000)


def http_on_sockets() -> None:
    """A tiny HTTP server on the pool's listening socket (``listen_sockets()``): answers
    every request with its replica id; ready (notify) once it has the socket. SIGTERM ends
    it between requests, never in one (the wakeup fd makes the signal an event)."""
    import select

    from orchestrator.worker import listen_sockets, ready

    (srv,) = listen_sockets()
    srv.setblocking(False)  # a shared listener: another replica may take a connection first
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: None)
    body = os.environ["ORCHESTRATOR_REPLICA_ID"].encode()
    ready()
    while True:
        readable, _, _ = select.select([srv, wake_r], [], [])
        if wake_r in readable:
            return
        try:
            conn, _ = srv.accept()
        except BlockingIOError:
            continue
        with conn:
            conn.setblocking(True)
            conn.settimeout(5)
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass


def report_listen_sockets() -> None:
    """Writes to $OUT what ``listen_sockets()`` gives it (family and address of each, in
    order; close-on-exec; what a forked child of it gets), then says ready and sleeps."""
    import socket

    from orchestrator.worker import listen_sockets, ready

    socks = listen_sockets()
    lines = []
    for s in socks:
        name = s.getsockname()
        lines.append(f"{s.family.name} {name if isinstance(name, str) else '%s:%d' % name[:2]}")
    lines.append(f"cloexec {' '.join(str(not os.get_inheritable(s.fileno())) for s in socks)}")
    assert socks[0] is listen_sockets()[0]  # the same objects each call
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(w, str(len(listen_sockets())).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    lines.append(f"forked child: {os.read(r, 10).decode()}")
    with open(os.environ["OUT"], "w") as f:
        f.write("\n".join(lines) + "\n")
    ready()
    del socket
    time.sleep(1000)
def stamped() -> None:
    """Writes the system-wide monotonic time of what it does to $STAMPS/<replica id>.<what>:
    ``start``; ``ready`` (after $GO exists, if set, and $READY_AFTER seconds), also made
    visible as $STAMPS/<pool>.slot<slot>.ready for an exec readiness probe; on SIGTERM ``term``,
    then $STOP_SECS later ``end`` and a clean exit. $EXIT: exit with that code once ready
    (a one-shot job)."""
    import sys

    from orchestrator import Terminated

    stamps, rid = os.environ["STAMPS"], os.environ["ORCHESTRATOR_REPLICA_ID"]
    marker = os.path.join(stamps, f"{os.environ['ORCHESTRATOR_POOL']}.slot{os.environ['ORCHESTRATOR_SLOT']}.ready")

    def stamp(what: str, path: str | None = None) -> None:
        path = path or os.path.join(stamps, f"{rid}.{what}")
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(path + ".tmp", path)

    try:
        if os.path.exists(marker):
            os.unlink(marker)  # an earlier replica's in this slot
        stamp("start")
        go = os.environ.get("GO")
        deadline = time.monotonic() + 60
        while go and not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(float(os.environ.get("READY_AFTER", "0")))
        stamp("ready")
        stamp("ready", marker)
        if "EXIT" in os.environ:
            sys.exit(int(os.environ["EXIT"]))
        time.sleep(1000)
    except Terminated:
        stamp("term")
        time.sleep(float(os.environ.get("STOP_SECS", "0")))
        stamp("end")


def ticker() -> None:
    """A line on stdout every 50 ms, flushed: its log grows while it runs."""
    n = 0
    while True:
        n += 1
        print(f"tick {n}", flush=True)
        time.sleep(0.05)
