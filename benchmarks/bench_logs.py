"""Replica log capture: pipes pumped by the control loop (a) against the child writing to
the log file directly (b), side by side in one process run. Compare ratios, not figures.

(1) Setup cost per replica, in the loop's thread: batches of 20 replicas that exec `true`
    through the real spawner (spawner.OSApi.spawn, the engine's own path), ready pipe read to
    EOF, reaped. Variants, interleaved round by round:
      none     fds 1 and 2 on /dev/null (opened once): the engine as it is today
      pipes    LogCapture.open (2 pipes in the reactor) .. spawned() .. finish(); the files
               are made by the first output or after CREATE_AFTER (1 s): `true` makes none
      pipes, files at once   the same with create_after=0: the 2 files made in open()
      direct   2 log files opened (O_NOFOLLOW, dirfd-relative), given to the child, closed
    With --orchestrator, the embedded Orchestrator's own churn (launch + terminate of 20
    `sleep` replicas, no capture yet) is measured too, for the scale of a whole cycle.

(2) The loop's responsiveness while one child writes to its stdout, in a real Reactor:
      timer    lateness of a call_later(0.005) timer, re-armed each time it fires
      echo     round trip of one byte through the loop (add_reader on a socketpair), timed
               by a separate client process every 5 ms: what a command would see
    in scenarios: idle (nobody writes), pipes and direct with a writer paced at 20 MB/s
    (a Python child writing 100-byte lines in 64 KiB blocks), and with `yes` unthrottled.
    Also: bytes that reached the files per second, and the loop's CPU (RUSAGE_SELF; the
    writer and the client are other processes).

(3) What rotation costs design (b): a copy-truncate of one full 10 MiB file (copy_file_range
    + ftruncate), the stall the loop (or someone) pays per rotation, and during which what
    the child writes is lost or duplicated.

(4) What the per-line times cost the capture (logindex.py): the loop's CPU for the same
    writer with the index (LogCapture's default) against without (``index=False``), rounds
    interleaved, rate caps off, per writer:
      lines    a Python child writing 100-byte lines one write each, ~1 ms apart: a chunk
               per line and a record per chunk, the index's worst case
      20 MB/s  the paced writer of (2), 64 KiB blocks
      yes      `yes` unthrottled: as many chunks as the loop can read
    and ``logs --since`` over a large log (``--big-mib``, 1024 by default: 1 GiB) written
    through the capture on a simulated clock (the whole log spread over 10 days), against
    reading the whole file once (what a --since without an index would have to do).

Run: .venv/bin/python benchmarks/bench_logs.py [--rounds N] [--seconds S] [--orchestrator]
[--index-only] [--big-mib M] (from the repo root; the default run takes about a minute and
writes --big-mib MiB to the temporary dir).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orchestrator.daemon.logcapture import LogCapture  # noqa: E402
from orchestrator.daemon.reactor import Reactor  # noqa: E402
from orchestrator.daemon.osapi import OSApi  # noqa: E402
from orchestrator.spec import LaunchPlan  # noqa: E402

BATCH = 20
RATE = 20_000_000  # bytes/s of the paced writer
FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC

PACED_WRITER = r"""
import os, sys, time
rate = int(sys.argv[1])
line = b"%s 2025-01-01T00:00:00Z INFO worker: request handled in 1.234 ms path=/api/v1/items\n"
block = (line * (65536 // len(line) + 1))[:65536]
start = time.monotonic()
sent = 0
while True:
    ahead = sent / rate - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(ahead)
    sent += os.write(1, block)
"""

LINE_WRITER = r"""
import os, time
line = b"2025-01-01T00:00:00Z INFO worker: request handled in 1.234 ms path=/api/v1/items?page=1&size=20\n"
while True:
    os.write(1, line)
    time.sleep(0.001)
"""

ECHO_CLIENT = r"""
import os, socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
period, seconds = float(sys.argv[2]), float(sys.argv[3])
rtts = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    s.send(b"p")
    if not s.recv(1):
        break
    rtts.append(time.perf_counter() - t0)
    time.sleep(period)
s.send(b"q")
print(" ".join(f"{x:.7f}" for x in rtts))
"""


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- (1) setup cost ---------------------------------------------------------------------------


def spawn_batch(osapi: OSApi, true_exe: str, fds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spawn one `true` per (stdout, stderr) pair, wait for each exec (ready EOF), reap."""
    made = []
    for i, (out, err) in enumerate(fds):
        sp = osapi.spawn(LaunchPlan(f"bench-{i}", argv=("true",), exe=true_exe, env={}, stdout=out, stderr=err))
        made.append(sp)
    return made


def finish_batch(made) -> None:
    for sp in made:
        if os.read(sp.ready_fd, 4096):
            raise RuntimeError("exec of true failed")
        os.waitpid(sp.pid, 0)
        os.close(sp.ready_fd)
        os.close(sp.exit_fd)


def setup_none(osapi, true_exe, devnull, _cap, _dirfd, n) -> None:
    made = spawn_batch(osapi, true_exe, [(devnull, devnull)] * BATCH)
    finish_batch(made)


def setup_pipes(osapi, true_exe, _devnull, cap: LogCapture, _dirfd, n) -> None:
    logs = [cap.open(f"pipes-{n * BATCH + i}") for i in range(BATCH)]
    made = []
    for i, rl in enumerate(logs):
        made += spawn_batch(osapi, true_exe, [(rl.stdout, rl.stderr)])
        rl.spawned()
    finish_batch(made)
    for rl in logs:
        rl.finish()


def setup_pipes_eager(osapi, true_exe, _devnull, cap: LogCapture, _dirfd, n) -> None:
    setup_pipes(osapi, true_exe, _devnull, cap, _dirfd, n)


def setup_direct(osapi, true_exe, _devnull, _cap, dirfd: int, n) -> None:
    files = []
    for i in range(BATCH):
        rid = f"direct-{n * BATCH + i}"
        files.append((os.open(f"{rid}.out", FILE_FLAGS, 0o600, dir_fd=dirfd),
                      os.open(f"{rid}.err", FILE_FLAGS, 0o600, dir_fd=dirfd)))
    made = []
    for pair in files:
        made += spawn_batch(osapi, true_exe, [pair])
        os.close(pair[0])
        os.close(pair[1])
    finish_batch(made)


def measure_setup(rounds: int, tmp: str) -> dict[str, list[float]]:
    true_exe = shutil.which("true")
    assert true_exe, "true not found on PATH"
    osapi = OSApi(pdeathsig=signal.SIGKILL)
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    reactor = Reactor()
    cap = LogCapture(os.path.join(tmp, "setup-pipes"), reactor)
    eager = LogCapture(os.path.join(tmp, "setup-eager"), reactor, create_after=0)
    os.mkdir(os.path.join(tmp, "setup-direct"), 0o700)  # a dir of its own: file creation cost
    dirfd = os.open(os.path.join(tmp, "setup-direct"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    variants = {"none": setup_none, "pipes": setup_pipes, "pipes, files at once": setup_pipes_eager,
                "direct": setup_direct}
    names = list(variants)
    per_replica: dict[str, list[float]] = {n: [] for n in names}
    try:
        for rnd in range(rounds + 3):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for name in order:
                t0 = time.perf_counter()
                variants[name](osapi, true_exe, devnull, eager if "once" in name else cap, dirfd, rnd)
                dt = (time.perf_counter() - t0) / BATCH
                if rnd >= 3:  # warm-up rounds are not counted
                    per_replica[name].append(dt)
            reactor.run_once(0)
    finally:
        cap.close()
        eager.close()
        reactor.close()
        os.close(dirfd)
        os.close(devnull)
    return per_replica


def measure_orchestrator(rounds: int, tmp: str) -> float | None:
    """Replicas/s of the embedded Orchestrator's churn (no capture), or None if unavailable."""
    try:
        from orchestrator import Orchestrator

        with Orchestrator(grace=5.0, state_dir=os.path.join(tmp, "orch")) as orch:
            cycles = []
            for rnd in range(rounds + 2):
                t0 = time.perf_counter()
                ids = orch.launch("bench", ["sleep", "1000"], count=BATCH, wait=True, timeout=60)
                orch.terminate(*ids, wait=True, timeout=60)
                if rnd >= 2:
                    cycles.append(time.perf_counter() - t0)
        return BATCH * len(cycles) / sum(cycles)
    except Exception as err:  # the engine is other people's work in progress
        print(f"(orchestrator churn unavailable: {type(err).__name__}: {err})", file=sys.stderr)
        return None


# -- (2) responsiveness -------------------------------------------------------------------------


class Scenario:
    def __init__(self, name: str) -> None:
        self.name = name
        self.lateness: list[float] = []
        self.rtt: list[float] = []
        self.bytes = 0
        self.seconds = 0.0
        self.cpu = 0.0
        self.dropped = 0
        self.files_bytes = 0
        self.runq = 0.0


def writer_argv(kind: str) -> list[str] | None:
    if kind == "paced":
        return [sys.executable, "-c", PACED_WRITER, str(RATE)]
    if kind == "yes":
        return [shutil.which("yes") or "yes", "2025-01-01T00:00:00Z INFO worker: request handled in 1.234 ms"]
    return None


def _run_delay() -> float:
    """Seconds this thread has waited on a run queue (runnable, not running)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def run_scenario(name: str, design: str, writer: str, seconds: float, tmp: str, **cap_kwargs) -> Scenario:
    sc = Scenario(name)
    logs_dir = os.path.join(tmp, "".join(c if c.isalnum() else "_" for c in name))
    os.mkdir(logs_dir, 0o700)
    reactor = Reactor()
    cap = LogCapture(logs_dir, reactor, **cap_kwargs) if design == "pipes" else None
    direct_fd = -1
    ours, theirs = socket.socketpair()
    client = None
    child = None
    stop = [False]

    def echo() -> None:
        try:
            data = ours.recv(64)
        except BlockingIOError:
            return
        if not data or b"q" in data:
            stop[0] = True
            return
        ours.send(b"e" * len(data))

    ours.setblocking(False)
    reactor.add_reader(ours.fileno(), echo)

    def tick(deadline: list[float]) -> None:
        now = reactor.monotonic()
        sc.lateness.append(now - deadline[0])
        deadline[0] = now + 0.005
        reactor.call_at(deadline[0], lambda: tick(deadline))

    rlog = None
    try:
        argv = writer_argv(writer)
        if argv is not None:
            if cap is not None:
                rlog = cap.open("writer-1")
                out = rlog.stdout
            else:
                direct_fd = os.open(os.path.join(logs_dir, "writer-1.out"), FILE_FLAGS, 0o600)
                out = direct_fd
            child = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            if rlog is not None:
                rlog.spawned()
            else:
                os.close(direct_fd)
                direct_fd = -1
        # let the writer reach its pace before the probes start
        reactor.run_until(lambda: False, 0.3)
        client = subprocess.Popen([sys.executable, "-c", ECHO_CLIENT, str(theirs.fileno()), "0.005", str(seconds)],
                                  pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True)
        theirs.close()
        first = [reactor.monotonic() + 0.005]
        reactor.call_at(first[0], lambda: tick(first))
        start_bytes = cap.totals()["bytes"] if cap else _file_bytes(logs_dir)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = _run_delay()
        t0 = time.monotonic()
        reactor.run_until(lambda: stop[0], seconds + 10)
        sc.seconds = time.monotonic() - t0
        sc.runq = (_run_delay() - w0) / sc.seconds
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        sc.cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / sc.seconds
        sc.bytes = (cap.totals()["bytes"] if cap else _file_bytes(logs_dir)) - start_bytes
        out_text, _ = client.communicate(timeout=30)
        sc.rtt = [float(x) for x in out_text.split()]
    finally:
        if child is not None:
            child.kill()
            child.wait(timeout=30)
        if client is not None and client.poll() is None:
            client.kill()
            client.wait(timeout=30)
        if rlog is not None:
            rlog.finish()
        if cap is not None:
            sc.dropped = cap.totals()["dropped"]
            cap.close()
        if direct_fd >= 0:
            os.close(direct_fd)
        sc.files_bytes = _file_bytes(logs_dir)
        reactor.close()
        ours.close()
        theirs.close()
        shutil.rmtree(logs_dir, ignore_errors=True)
    return sc


# -- (4) the index ---------------------------------------------------------------------------------


def capture_cpu(writer: list[str], seconds: float, tmp: str, index: bool) -> tuple[float, int, int]:
    """(loop CPU seconds, bytes captured, records in the index) for ``seconds`` of ``writer``
    (the records: of the whole run, the 0.2 s warm-up included)."""
    logs_dir = tempfile.mkdtemp(dir=tmp)
    reactor = Reactor()
    # one file (no rotation) so that its index holds every record made
    cap = LogCapture(logs_dir, reactor, rate=None, total_rate=None, create_after=0, index=index,
                     max_bytes=4 << 30, backups=0)
    ru: list[resource.struct_rusage] = []
    got = [0]

    def run() -> None:
        reactor.run_until(lambda: False, 0.2)  # the writer at its pace first
        b0 = cap.totals()["bytes"]
        ru.append(resource.getrusage(resource.RUSAGE_SELF))
        reactor.run_until(lambda: False, seconds)
        ru.append(resource.getrusage(resource.RUSAGE_SELF))
        got[0] = cap.totals()["bytes"] - b0

    _with_writer(cap, reactor, "writer-1", writer, run)
    ru0, ru1 = ru
    idx = os.path.join(logs_dir, "writer-1.out.idx")
    records = os.path.getsize(idx) // 16 - 1 if os.path.exists(idx) else 0
    shutil.rmtree(logs_dir, ignore_errors=True)
    return ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime, got[0], records


def _with_writer(cap: LogCapture, reactor: Reactor, rid: str, argv: list[str], run: Callable[[], None]) -> None:
    """``run()`` while ``argv`` writes into replica ``rid``'s capture; then all closed."""
    rlog = cap.open(rid)
    child = subprocess.Popen(argv, stdout=rlog.stdout, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    rlog.spawned()
    try:
        run()
    finally:
        child.kill()
        child.wait(timeout=30)
        rlog.finish()
        cap.close()
        reactor.close()


def measure_index_cost(rounds: int, seconds: float, tmp: str) -> dict[str, dict[bool, list[tuple[float, int, int]]]]:
    """Per writer, per variant (index or not): a (CPU, bytes, records) per round."""
    writers = {"lines ~1 ms apart": [sys.executable, "-c", LINE_WRITER],
               "20 MB/s blocks": [sys.executable, "-c", PACED_WRITER, str(RATE)],
               "yes unthrottled": writer_argv("yes") or []}
    out: dict[str, dict[bool, list[tuple[float, int, int]]]] = {w: {True: [], False: []} for w in writers}
    for r in range(rounds):
        for name, argv in writers.items():
            for index in ((True, False) if r % 2 else (False, True)):
                out[name][index].append(capture_cpu(argv, seconds, tmp, index))
    return out


def measure_since(tmp: str, mib: int) -> dict[str, float]:
    """A ``mib`` MiB log written through the capture on a clock that spreads it over 10 days;
    then --since the last 10 minutes (in process and by the CLI) against one full read."""
    from orchestrator.logread import LineFilter, read_lines

    state = os.path.join(tmp, "since-state")
    logs_dir = os.path.join(state, "logs")
    os.makedirs(logs_dir)
    total = mib << 20
    span = 10 * 86400.0
    t0 = time.time() - span
    reactor = Reactor()
    cap = LogCapture(logs_dir, reactor, rate=None, total_rate=None, create_after=0, max_bytes=total + (1 << 20),
                     backups=0, clock=lambda: t0 + cap.totals()["bytes"] * span / total)
    began = time.monotonic()
    _with_writer(cap, reactor, "big-1", writer_argv("yes") or [],
                 lambda: reactor.run_until(lambda: cap.totals()["bytes"] >= total, 600))
    built = time.monotonic() - began
    path = os.path.join(logs_dir, "big-1.out")
    size = os.path.getsize(path)
    since = time.time() - 600
    res: dict[str, float] = {"size": size, "build": built, "index": os.path.getsize(path + ".idx")}
    t = time.perf_counter()
    lines = read_lines(logs_dir, "big-1", lines=None, filt=LineFilter(since=since))
    res["since"] = time.perf_counter() - t
    res["lines"] = len(lines)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", state, "logs", "big-1", "--since", "10m",
                    "-n", "3"], check=True, stdout=subprocess.DEVNULL)
    res["cli"] = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", state, "logs", "big-1", "-n", "3"],
                   check=True, stdout=subprocess.DEVNULL)
    res["cli_tail"] = time.perf_counter() - t
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    res["scan"] = time.perf_counter() - t
    os.unlink(path)
    os.unlink(path + ".idx")
    return res


def _file_bytes(d: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(d))


# -- (3) copy-truncate ---------------------------------------------------------------------------


def measure_copy_truncate(tmp: str, size: int = 10 << 20, runs: int = 5) -> list[float]:
    path = os.path.join(tmp, "ct.out")
    block = b"x" * 99 + b"\n"
    out = []
    for _ in range(runs):
        with open(path, "wb") as f:
            f.write(block * (size // len(block)))
        fd = os.open(path, os.O_RDWR)
        t0 = time.perf_counter()
        dst = os.open(path + ".1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        left = os.fstat(fd).st_size
        off = 0
        while left:
            n = os.copy_file_range(fd, dst, left, off, off)
            if n == 0:
                break
            off += n
            left -= n
        os.ftruncate(fd, 0)
        os.close(dst)
        out.append(time.perf_counter() - t0)
        os.close(fd)
    os.unlink(path)
    os.unlink(path + ".1")
    return out


# -- the run ---------------------------------------------------------------------------------------


def us(x: float) -> str:
    return f"{x * 1e6:.0f}"


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="counted setup rounds, one batch of 20 per variant (default 40)")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each responsiveness scenario (default 3)")
    ap.add_argument("--orchestrator", action="store_true", help="also measure the embedded Orchestrator's churn")
    ap.add_argument("--index-only", action="store_true", help="only (4): the per-line times' cost, and --since")
    ap.add_argument("--index-rounds", type=int, default=4, help="(4): interleaved rounds per writer (default 4)")
    ap.add_argument("--big-mib", type=int, default=1024, help="(4): size of the --since log in MiB (default 1024)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-logs-") as tmp:
        index_cost = measure_index_cost(args.index_rounds, min(args.seconds, 2.0), tmp)
        since = measure_since(tmp, args.big_mib)
    report_index(index_cost, since, min(args.seconds, 2.0))
    if args.index_only:
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-logs-") as tmp:
        started = time.monotonic()
        setup = measure_setup(args.rounds, tmp)
        orch_rate = measure_orchestrator(max(5, args.rounds // 4), tmp) if args.orchestrator else None
        scenarios = [
            run_scenario("idle", "pipes", "none", args.seconds, tmp),
            run_scenario("pipes, 20 MB/s", "pipes", "paced", args.seconds, tmp),
            run_scenario("direct, 20 MB/s", "direct", "paced", args.seconds, tmp),
            run_scenario("pipes, yes unthrottled", "pipes", "yes", args.seconds, tmp),
            run_scenario("pipes, yes, no rate caps", "pipes", "yes", args.seconds, tmp, rate=None, total_rate=None),
            run_scenario("direct, yes unthrottled", "direct", "yes", args.seconds, tmp),
        ]
        ct = measure_copy_truncate(tmp)
        elapsed = time.monotonic() - started

    print(f"# Log capture: pipes pumped by the loop (a) vs direct file fds (b); {elapsed:.1f} s; "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, kernel {os.uname().release}")
    print()
    print(f"(1) setup per replica, spawn of `true` + reap, batches of {BATCH}, {args.rounds} rounds interleaved")
    print()
    print("| variant | per replica p50 (µs) | p90 (µs) | extra vs none (µs) |")
    print("| --- | ---: | ---: | ---: |")
    base = statistics.median(setup["none"])
    for name, vals in setup.items():
        med = statistics.median(vals)
        print(f"| {name} | {us(med)} | {us(pct(vals, 0.9))} | {us(med - base):>4} |")
    print()
    print(f"pipes, files at once - direct (the pipes, epoll registration, drain; both create the 2 files): "
          f"{us(statistics.median(setup['pipes, files at once']) - statistics.median(setup['direct']))} µs "
          f"per replica")
    if orch_rate is not None:
        print()
        print(f"Orchestrator churn (launch+terminate, no capture): {orch_rate:.0f} replicas/s = "
              f"{1e6 / orch_rate:.0f} µs per replica; adding each variant's extra setup:")
        for name in list(setup)[1:]:
            extra = statistics.median(setup[name]) - base
            print(f"  {name}: {1 / (1 / orch_rate + extra):.0f} replicas/s ({extra * orch_rate * 100:.1f}% slower)")
    print()
    print(f"(2) loop responsiveness, {args.seconds:g} s per scenario; timer = lateness of a "
          f"call_later(0.005); echo = 1-byte round trip through the loop from another process every 5 ms")
    print()
    print("| scenario | timer p50 (ms) | timer p99 (ms) | timer max (ms) | echo p50 (ms) | echo p99 (ms) | "
          "echo max (ms) | to files (MB/s) | loop CPU | loop runnable, waiting | on disk after (MiB) | dropped |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for sc in scenarios:
        print(f"| {sc.name} | {ms(pct(sc.lateness, 0.5))} | {ms(pct(sc.lateness, 0.99))} | "
              f"{ms(max(sc.lateness))} | {ms(pct(sc.rtt, 0.5))} | {ms(pct(sc.rtt, 0.99))} | "
              f"{ms(max(sc.rtt) if sc.rtt else float('nan'))} | {sc.bytes / sc.seconds / 1e6:.1f} | "
              f"{sc.cpu * 100:.0f}% | {sc.runq * 100:.0f}% | {sc.files_bytes / (1 << 20):.0f} | {sc.dropped} |")
    print()
    print(f"(3) copy-truncate of a full 10 MiB log (design (b)'s rotation): p50 {ms(statistics.median(ct))} ms, "
          f"max {ms(max(ct))} ms per rotation, in whichever process does it")
    return 0


def report_index(cost: dict[str, dict[bool, list[tuple[float, int, int]]]], since: dict[str, float],
                 seconds: float) -> None:
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"(4) the per-line times (index beside each log) against none, rounds interleaved; load {' '.join(load)}")
    print()
    print("| writer | loop CPU per MiB, no index (ms) | with index (ms) | ratio (median of rounds) | "
          "MiB/s captured | index records/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, by in cost.items():
        def per_mib(runs: list[tuple[float, int, int]]) -> list[float]:
            return [cpu / (got / (1 << 20)) * 1e3 for cpu, got, _ in runs if got]
        a, b = per_mib(by[False]), per_mib(by[True])
        ratios = [y / x for x, y in zip(a, b)]
        rate = statistics.median(got for _, got, _ in by[True]) / (1 << 20) / seconds
        recs = statistics.median(r for _, _, r in by[True]) / (seconds + 0.2)
        print(f"| {name} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
              f"{statistics.median(ratios):.3f} | {rate:.1f} | {recs:.0f} |")
    print()
    print(f"--since over a {since['size'] / (1 << 30):.2f} GiB log (index {since['index'] / 1024:.0f} KiB, written "
          f"through the capture in {since['build']:.1f} s, spread over 10 days by its clock): the last 10 min, "
          f"{since['lines']:.0f} lines, read in process in {since['since'] * 1e3:.1f} ms; "
          f"`logs --since 10m -n 3` {since['cli'] * 1e3:.0f} ms (plain `logs -n 3`: {since['cli_tail'] * 1e3:.0f} ms, "
          f"the CLI's start included); one read of the whole file: {since['scan'] * 1e3:.0f} ms")
    print()


if __name__ == "__main__":
    sys.exit(main())
