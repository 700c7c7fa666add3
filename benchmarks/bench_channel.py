"""Benchmark of the daemon's command channel (orchestrator/channel.py, manager.py, daemon.py).

Run: ``.venv/bin/python benchmarks/bench_channel.py [--quick]`` from the repo root (~30-40 s;
``--quick`` ~15 s). Prints a markdown table and the command that reproduced it.

One run, one real daemon (``daemon.start_detached`` in a temporary state dir, always stopped
in a ``finally`` with ``daemon.stop``; its whole process tree, and every process carrying its
ORCHESTRATOR_DAEMON_TOKEN, is checked gone with psutil afterwards):

1. Round trip: ``Client.ping()`` and ``Client.status()`` p50/p99/max over a few thousand
   sequential calls after a warm-up, in interleaved blocks.
2. Throughput: 1, 4 and 16 client threads (each its own ``Client``) and 4 client processes
   (this file with ``--client-proc``), each pinging in a loop for a fixed time; cmds/s,
   per-call p50/p99, and the CPU time per command of the clients, the manager and the daemon
   (where a command's cost goes: pickling, the Manager's threads, the control loop).
3. Churn, in interleaved rounds: a cycle = ``launch(20 x sleep 1000, wait=True)`` (returns
   once all RUNNING) then ``terminate(*ids, wait=True)`` (returns once all reaped), through
   the channel and through the embedded ``Orchestrator`` (same grace). The daemon always
   journals into its SQLite store; the embedded API does not by default, so a third row,
   embedded with ``db=``, separates the channel hop from the journal's cost.
4. The hops: one bare Manager RPC and a bare Manager queue put+get round trip through an
   echo process (multiprocess, and stdlib multiprocessing for reference), one RPC on our
   own channel connection (``replies.take`` of an unknown id with a 0 s wait), the
   per-call ``_set_timeouts``, against ``Client.ping()``, all interleaved.

Targets: round trip p99 <= 5 ms; churn through the channel >= 0.7x
the embedded API. Figures drift +-20% between runs on shared 2-core machines: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

BATCH = 20
SLEEP = ["sleep", "1000"]
TARGET_P99_MS = 5.0
TARGET_CHURN_RATIO = 0.7
pc = time.perf_counter


# -- small helpers ----------------------------------------------------------------------


def pct(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_vals:
        return float("nan")
    k = max(0, min(len(sorted_vals) - 1, int(round(q / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[k]


def summary(lat: list[float]) -> dict:
    s = sorted(lat)
    return {"n": len(s), "p50": pct(s, 50), "p99": pct(s, 99), "max": s[-1] if s else float("nan")}


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def us(x: float) -> str:
    return f"{x * 1e6:.0f}"


def timed_loop(fn: Callable[[], Any], n: int, out: list[float]) -> None:
    for _ in range(n):
        t0 = pc()
        fn()
        out.append(pc() - t0)


def cpu_self() -> float:
    t = os.times()
    return t.user + t.system


def cpu_of(procs: list[Any]) -> list[float]:
    """user+system seconds of each psutil.Process (nan if it is gone)."""
    out = []
    for p in procs:
        try:
            t = p.cpu_times()
            out.append(t.user + t.system)
        except Exception:  # noqa: BLE001 - psutil.Error, or None
            out.append(float("nan"))
    return out


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


# -- client process (throughput with separate processes) ----------------------------------


def client_proc(state_dir: str, seconds: float) -> int:
    from orchestrator.client.channel import Client

    client = Client(state_dir)
    for _ in range(100):
        client.ping()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    lat: list[float] = []
    cpu0 = cpu_self()
    start = pc()
    end = start + seconds
    while True:
        t0 = pc()
        client.ping()
        t1 = pc()
        lat.append(t1 - t0)
        if t1 >= end:
            break
    cpu = cpu_self() - cpu0
    print(json.dumps({"n": len(lat), "elapsed": t1 - start, "cpu": cpu, "lat": lat}), flush=True)
    client.close()
    return 0


# -- process-tree bookkeeping -------------------------------------------------------------


def proc_tree(pid: int) -> dict[int, tuple[float, str]]:
    """pid -> (create_time, name) for pid and all its descendants."""
    import psutil

    out: dict[int, tuple[float, str]] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            out[p.pid] = (p.create_time(), " ".join(" ".join(p.cmdline()[:4]).split()) or p.name())
        except psutil.Error:
            pass
    return out


def still_alive(snapshot: dict[int, tuple[float, str]]) -> list[str]:
    """Processes of a snapshot that still exist (same pid and start time), zombies included."""
    import psutil

    left = []
    for pid, (ctime, name) in snapshot.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - ctime) < 0.01:
                left.append(f"{pid} {name} ({p.status()})")
        except psutil.NoSuchProcess:
            pass
    return left


def token_holders(token: str) -> list[str]:
    """Every live process whose environment carries the daemon's token."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.pid == os.getpid():
                continue
            if p.environ().get("ORCHESTRATOR_DAEMON_TOKEN") == token:
                found.append(f"{p.pid} {p.info['name']} ({p.status()})")
        except psutil.Error:
            pass
    return found


def new_children(before: set[int], wait: float = 5.0) -> list[str]:
    """Our descendants that did not exist before the run (given `wait` s to go away)."""
    import psutil

    deadline = time.monotonic() + wait
    while True:
        me = psutil.Process()
        extra = []
        for p in me.children(recursive=True):
            if p.pid in before:
                continue
            try:
                if p.status() == psutil.STATUS_ZOMBIE and p.ppid() == me.pid:
                    os.waitpid(p.pid, os.WNOHANG)  # ours to reap; counted if it stays
                    continue
                extra.append(f"{p.pid} {' '.join(p.cmdline()[:4]) or p.name()} ({p.status()})")
            except (psutil.Error, ChildProcessError):
                pass
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


# -- 1. round trip --------------------------------------------------------------------------


def bench_round_trip(client: Any, calls: int, blocks: int = 5) -> dict[str, dict]:
    for _ in range(300):
        client.ping()
        client.status()
    lat: dict[str, list[float]] = {"ping": [], "status": []}
    per = max(1, calls // blocks)
    for _ in range(blocks):
        timed_loop(client.ping, per, lat["ping"])
        timed_loop(client.status, per, lat["status"])
    return {k: summary(v) for k, v in lat.items()}


# -- 2. throughput ----------------------------------------------------------------------------


def bench_threads(state_dir: str, nthreads: int, seconds: float, servers: list[Any]) -> dict:
    from orchestrator.client.channel import Client

    barrier = threading.Barrier(nthreads + 1)
    results: list[tuple[int, float, list[float]]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            client = Client(state_dir)
            for _ in range(50):
                client.ping()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()
            return
        try:
            barrier.wait(30)
        except threading.BrokenBarrierError:
            return
        lat: list[float] = []
        start = pc()
        end = start + seconds
        try:
            while True:
                t0 = pc()
                client.ping()
                t1 = pc()
                lat.append(t1 - t0)
                if t1 >= end:
                    break
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            return
        finally:
            client.close()
        with lock:
            results.append((len(lat), t1 - start, lat))

    threads = [threading.Thread(target=worker, name=f"client-{i}") for i in range(nthreads)]
    for t in threads:
        t.start()
    try:
        barrier.wait(60)
    except threading.BrokenBarrierError:
        pass
    c0, s0 = cpu_self(), cpu_of(servers)
    for t in threads:
        t.join(seconds + 60)
    c1, s1 = cpu_self(), cpu_of(servers)
    if errors:
        raise RuntimeError(f"{nthreads} threads: {errors[0]!r}")
    return _throughput(results, c1 - c0, [b - a for a, b in zip(s0, s1)])


def bench_procs(state_dir: str, nprocs: int, seconds: float, servers: list[Any]) -> dict:
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client-proc", state_dir, str(seconds)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        for _ in range(nprocs)
    ]
    results = []
    client_cpu = 0.0
    try:
        for p in procs:
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"client process {p.pid} did not get ready (said {line!r})")
        s0 = cpu_of(servers)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 60)
            if p.returncode != 0:
                raise RuntimeError(f"client process {p.pid} exited {p.returncode}")
            data = json.loads(out.strip().splitlines()[-1])
            results.append((data["n"], data["elapsed"], data["lat"]))
            client_cpu += data["cpu"]
        s1 = cpu_of(servers)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return _throughput(results, client_cpu, [b - a for a, b in zip(s0, s1)])


def _throughput(results: list[tuple[int, float, list[float]]], client_cpu: float, server_cpu: list[float]) -> dict:
    """Rate, latency, and CPU seconds per command: [client(s), manager, daemon]."""
    lat = [x for _, _, l in results for x in l]
    rate = sum(n / el for n, el, _ in results if el > 0)
    n = max(1, len(lat))
    return {"rate": rate, "clients": len(results), "cpu": [client_cpu / n, *(c / n for c in server_cpu)],
            **summary(lat)}


# -- 3. churn -------------------------------------------------------------------------------


def churn_cycle(api: Any, pool: str, on_running: Callable[[], None] | None = None) -> tuple[float, float]:
    """One cycle; (launch seconds, terminate seconds). ``on_running`` runs, untimed, in between."""
    t0 = pc()
    ids = api.launch(pool, SLEEP, count=BATCH, wait=True, timeout=60)
    launch = pc() - t0
    if len(ids) != BATCH:
        raise RuntimeError(f"{pool}: launch returned {len(ids)} ids, expected {BATCH}")
    if on_running is not None:
        on_running()
    t1 = pc()
    done = api.terminate(*ids, wait=True, timeout=60)
    term = pc() - t1
    if len(done) != BATCH:
        raise RuntimeError(f"{pool}: terminate returned {len(done)} ids, expected {BATCH}")
    return launch, term


def check_churn(api: Any, pool: str) -> Counter:
    """No live replica left in the pool, and the states of its ended ones."""
    live = [r for r in api.status()["replicas"] if r.get("pool") == pool]
    if live:
        raise RuntimeError(f"{pool}: {len(live)} replica(s) still live after the churn")
    return Counter(r["state"] for r in api.status(all=True)["replicas"] if r.get("pool") == pool)


def bench_churn(apis: dict[str, tuple[Any, str]], rounds: int, cycles: int,
                on_running: Callable[[], None] | None = None) -> dict[str, dict]:
    """``on_running``: called once, untimed, while the first (warm-up) batch of the first
    path is RUNNING (the process check snapshots the daemon's tree with its replicas)."""
    names = list(apis)
    for i, name in enumerate(names):  # warm-up: first launch of a pool, page faults, the store's first pages
        churn_cycle(*apis[name], on_running=on_running if i == 0 else None)
    per: dict[str, dict[str, list[float]]] = {n: {"launch": [], "term": [], "round": []} for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            api, pool = apis[name]
            t0 = pc()
            for _ in range(cycles):
                lt, tt = churn_cycle(api, pool)
                per[name]["launch"].append(lt)
                per[name]["term"].append(tt)
            per[name]["round"].append(cycles * BATCH / (pc() - t0))
    out = {}
    for name in names:
        d = per[name]
        total = sum(d["launch"]) + sum(d["term"])
        out[name] = {
            "rate": len(d["launch"]) * BATCH / total,
            "launch": summary(d["launch"]),
            "term": summary(d["term"]),
            "rounds": d["round"],
            "states": check_churn(*apis[name]),
        }
    return out


# -- 4. hops ----------------------------------------------------------------------------------


def _echo(qin: Any, qout: Any) -> None:
    while True:
        msg = qin.get()
        if msg is None:
            return
        qout.put(msg)


def bench_hops(client: Any, calls: int, blocks: int = 4) -> dict[str, dict]:
    import multiprocessing
    import multiprocessing.managers

    import multiprocess
    import multiprocess.managers

    from orchestrator.client import channel

    msg = {"id": uuid.uuid4().hex, "op": "ping", "args": {}}
    setups = []
    try:
        for label, mod, mgrmod in (("multiprocess", multiprocess, multiprocess.managers),
                                   ("stdlib", multiprocessing, multiprocessing.managers)):
            mgr = mgrmod.SyncManager()
            mgr.start()
            qin, qout = mgr.Queue(), mgr.Queue()
            echo = mod.Process(target=_echo, args=(qin, qout), daemon=True)
            echo.start()
            setups.append((label, mgr, qin, qout, echo))

        client.ping()  # connects this thread to the channel; the two lines below reach into
        # the Client (private attributes) to time one bare RPC on its own connection
        conn = client._thread_connection(30.0)
        fd = conn.fileno()

        def rt(qin: Any, qout: Any) -> Callable[[], Any]:
            def f() -> None:
                qin.put(msg)
                qout.get()
            return f

        fns: dict[str, Callable[[], Any]] = {}
        for label, _, qin, qout, _ in setups:
            fns[f"bare Manager RPC, {label} (`q.qsize()`)"] = qin.qsize
            fns[f"bare Manager queue put+get via an echo process, {label}"] = rt(qin, qout)
        fns["our channel: one RPC (`replies.take(unknown id, 0)`)"] = lambda: conn.dispatch(client._board, "take", ("0" * 32, 0))
        fns["our channel: `_set_timeouts` per call"] = lambda: channel.set_timeouts(fd, 35.0)
        fns["our channel: `Client.ping()`"] = client.ping

        for fn in fns.values():
            for _ in range(200):
                fn()
        lat: dict[str, list[float]] = {k: [] for k in fns}
        per = max(1, calls // blocks)
        for _ in range(blocks):
            for k, fn in fns.items():
                timed_loop(fn, per, lat[k])
        return {k: summary(v) for k, v in lat.items()}
    finally:
        for _, mgr, qin, _, echo in setups:
            try:
                qin.put(None)
                echo.join(5)
            finally:
                if echo.is_alive():
                    echo.kill()
                    echo.join()
                mgr.shutdown()


# -- the run --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls, shorter loops (~20 s)")
    ap.add_argument("--calls", type=int, default=3000, help="sequential round trips per command")
    ap.add_argument("--seconds", type=float, default=3.0, help="ping loop per concurrency level")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved churn rounds")
    ap.add_argument("--cycles", type=int, default=3, help="churn cycles per path per round")
    ap.add_argument("--grace", type=float, default=5.0, help="the same for the daemon and the embedded API")
    ap.add_argument("--client-proc", nargs=2, metavar=("STATE_DIR", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_proc:
        return client_proc(args.client_proc[0], float(args.client_proc[1]))
    if args.quick:
        args.calls, args.seconds, args.rounds, args.cycles = 1000, 1.5, 3, 2

    import psutil

    from orchestrator import Orchestrator
    from orchestrator.client.channel import Client
    from orchestrator.client.control import start_detached, stop
    from orchestrator.paths import Paths, running_pid

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below still runs
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    tmp = tempfile.mkdtemp(prefix="bench-channel-")
    paths = Paths(Path(tmp) / "state")
    load0 = loadavg()
    t_all = pc()
    res: dict[str, Any] = {}
    procs_check: list[str] = []
    daemon_pid = None
    token = None
    seen: dict[int, tuple[float, str]] = {}
    embedded: list[Any] = []
    client = None
    finished = False
    try:
        assert running_pid(paths) is None
        t0 = pc()
        daemon_pid = start_detached(paths, ["--grace", str(args.grace)])
        res["start_s"] = pc() - t0
        token = psutil.Process(daemon_pid).environ().get("ORCHESTRATOR_DAEMON_TOKEN")
        seen.update(proc_tree(daemon_pid))
        state_dir = str(paths.state_dir)
        client = Client(state_dir)
        manager = [pid for pid, (_, name) in seen.items() if "manager" in name]
        servers = [psutil.Process(manager[0]) if manager else None, psutil.Process(daemon_pid)]

        print(f"# 1/4 round trip ({args.calls} ping + {args.calls} status)", file=sys.stderr, flush=True)
        res["rt"] = bench_round_trip(client, args.calls)

        print("# 2/4 throughput", file=sys.stderr, flush=True)
        res["tp"] = []
        for n in (1, 4, 16):
            res["tp"].append((f"{n} thread{'s' if n > 1 else ''}", bench_threads(state_dir, n, args.seconds, servers)))
        res["tp"].append(("4 processes", bench_procs(state_dir, 4, args.seconds, servers)))

        print("# 3/4 churn", file=sys.stderr, flush=True)
        emb = Orchestrator(grace=args.grace)
        emb.start()
        embedded.append(emb)
        emb_db = Orchestrator(grace=args.grace, db=os.path.join(tmp, "embedded.db"))
        emb_db.start()
        embedded.append(emb_db)
        apis = {"channel": (client, "chan"), "embedded": (emb, "emb"), "embedded+db": (emb_db, "embdb")}
        res["churn"] = bench_churn(apis, args.rounds, args.cycles,
                                   on_running=lambda: seen.update(proc_tree(daemon_pid)))
        for emb in embedded:  # before the hops fork Manager servers from this process
            emb.close()

        print("# 4/4 hops", file=sys.stderr, flush=True)
        res["hops"] = bench_hops(client, max(400, args.calls // 2))
        seen.update(proc_tree(daemon_pid))
        finished = True
    finally:
        for emb in embedded:
            try:
                emb.close()
            except Exception as err:  # noqa: BLE001
                procs_check.append(f"embedded close failed: {err!r}")
        if client is not None:
            client.close()
        if daemon_pid is None:  # start_detached failed: a daemon may still be coming up
            daemon_pid = running_pid(paths)
        if daemon_pid is not None:
            seen.update(proc_tree(daemon_pid))
            code = stop(paths, timeout=60)
            if code == 1:  # timed out: kill -9, the watchdog then cleans up the rest
                procs_check.append("daemon.stop timed out: SIGKILL sent")
                try:
                    p = psutil.Process(daemon_pid)
                    if daemon_pid not in seen or abs(p.create_time() - seen[daemon_pid][0]) < 0.01:
                        p.kill()
                except psutil.Error:
                    pass
            try:  # start_detached's Popen never waits for the daemon: it is our child
                if psutil.Process(daemon_pid).status() == psutil.STATUS_ZOMBIE:
                    res["daemon_zombie"] = True
            except psutil.Error:
                pass
            try:
                os.waitpid(daemon_pid, 0)
            except ChildProcessError:
                pass
            time.sleep(0.2)
            procs_check += [f"left from the daemon's tree: {x}" for x in still_alive(seen)]
            if token:
                procs_check += [f"carries the daemon's token: {x}" for x in token_holders(token)]
        procs_check += [f"new child of the benchmark: {x}" for x in new_children(before)]
        shutil.rmtree(tmp, ignore_errors=True)
        if not finished:
            print("process check after the failure:", procs_check or "ok, nothing left", file=sys.stderr)

    report(args, res, seen, procs_check, pc() - t_all, load0)
    return 2 if procs_check else 0


def report(args: argparse.Namespace, res: dict, seen: dict, procs_check: list[str], total: float, load0: str) -> None:
    cmd = " ".join([os.path.relpath(sys.executable, REPO_ROOT) if sys.executable.startswith(REPO_ROOT)
                    else sys.executable, "benchmarks/bench_channel.py", *sys.argv[1:]])
    ok = lambda good: "ok" if good else "**MISS**"  # noqa: E731
    print(f"## bench_channel: {cmd}")
    print()
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load0} at start and "
          f"{loadavg()} at end; daemon ready in {res['start_s'] * 1e3:.0f} ms; whole run {total:.1f} s.")
    print()

    print("| round trip (1 client, sequential) | calls | p50 ms | p99 ms | max ms | target p99 ≤ 5 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in ("ping", "status"):
        s = res["rt"][k]
        print(f"| `Client.{k}()` | {s['n']} | {ms(s['p50'])} | {ms(s['p99'])} | {ms(s['max'])} "
              f"| {ok(s['p99'] * 1e3 <= TARGET_P99_MS)} |")
    print()

    print(f"| throughput: `ping` loop, {args.seconds:g} s per level | cmds/s | p50 ms | p99 ms | max ms "
          "| CPU µs/cmd: clients | manager | daemon |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, s in res["tp"]:
        cpu = " | ".join(us(x) for x in s["cpu"])
        print(f"| {label} | {s['rate']:.0f} | {ms(s['p50'])} | {ms(s['p99'])} | {ms(s['max'])} | {cpu} |")
    print()

    ch = res["churn"]
    base = ch["embedded"]["rate"]
    print(f"| churn: cycles of {BATCH} × `sleep 1000`, launch(wait) + terminate(wait), grace {args.grace:g} s, "
          f"{args.rounds} rounds × {args.cycles} cycles, interleaved | replicas/s | launch {BATCH} p50 ms "
          f"| terminate {BATCH} p50 ms | vs embedded | per-round ratio min–max | end states |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, label in (("channel", "through the daemon's channel (journal in state.db)"),
                        ("embedded", "embedded `Orchestrator` (no journal: the default)"),
                        ("embedded+db", "embedded `Orchestrator(db=...)` (journal, like the daemon)")):
        s = ch[name]
        ratios = [a / b for a, b in zip(s["rounds"], ch["embedded"]["rounds"])]
        tgt = f" (target ≥ {TARGET_CHURN_RATIO}: {ok(s['rate'] / base >= TARGET_CHURN_RATIO)})" if name == "channel" else ""
        states = ", ".join(f"{n} {k}" for k, n in sorted(s["states"].items()))
        print(f"| {label} | {s['rate']:.0f} | {ms(s['launch']['p50'])} | {ms(s['term']['p50'])} "
              f"| {s['rate'] / base:.2f}x{tgt} | {min(ratios):.2f}–{max(ratios):.2f} | {states} |")
    c, e = ch["channel"]["rate"], ch["embedded+db"]["rate"]
    print(f"| channel vs embedded+db (the hop alone, same journal) | | | | {c / e:.2f}x | | |")
    print()

    hops = res["hops"]
    print("| hop (interleaved blocks) | calls | p50 µs | p99 µs | max µs |")
    print("| --- | --- | --- | --- | --- |")
    for k, s in hops.items():
        print(f"| {k} | {s['n']} | {us(s['p50'])} | {us(s['p99'])} | {us(s['max'])} |")
    ping = hops["our channel: `Client.ping()`"]["p50"]
    rpc = hops["our channel: one RPC (`replies.take(unknown id, 0)`)"]["p50"]
    sto = hops["our channel: `_set_timeouts` per call"]["p50"]
    floor = hops["bare Manager queue put+get via an echo process, multiprocess"]["p50"]
    rest = ping - 2 * rpc - sto
    print(f"| ping = 2 channel RPCs ({us(2 * rpc)}) + `_set_timeouts` ({us(sto)}) + the rest: "
          f"pipes, manager threads, daemon turn, uuid (≈ {us(rest)}) | | | | |")
    print(f"| ping / bare multiprocess put+get floor (p50) | | {ping / floor:.2f}x | | |")
    print()

    names = Counter(v[1] for v in seen.values())
    names_s = ", ".join(f"{n} × {k}" if n > 1 else k for k, n in names.most_common())
    if res.get("daemon_zombie"):
        print("Note: after `daemon.stop` the daemon was a zombie child of this process until reaped here "
              "(`start_detached` never waits for its Popen).")
        print()
    if procs_check:
        print(f"Process check: **FAILED** ({len(seen)} processes seen in the daemon's tree):")
        for line in procs_check:
            print(f"- {line}")
    else:
        print(f"Process check: ok. {len(seen)} processes seen in the daemon's tree over the run "
              f"({names_s}); after `daemon.stop` none is left, no process carries "
              "the daemon's token, and the benchmark has no new child.")


if __name__ == "__main__":
    sys.exit(main())
