"""Scale: 2,000 live replicas under one daemon: memory per replica, `status` p99, and the fds
and threads its processes hold.

Run: ``.venv/bin/python benchmarks/scale.py [--quick] [--replicas N]`` from the repo root
(~25 s; ``--quick`` ~15 s). ``run(quick, progress)`` is the same for the ``benchmarks``
harness and returns a JSON-serialisable dict (the numbers it checks are at its top level).

One real daemon, started and stopped through the CLI in a temporary state dir (``start``
detaches; ``stop`` is SIGTERM by its pid file, and the daemon cleans up itself):

1. Preflight: the host's headroom for N more processes (pid_max, threads-max, RLIMIT_NPROC,
   the pids cgroup) and the daemon's fd limit; N is lowered, and the result says so, when
   the host cannot hold it.
2. Baseline: the daemon's and its system children's (manager, watchdog, spawner when
   present) RSS, USS, fds and threads with no replica.
3. N ``sleep`` replicas in one pool, in batches of ``launch(wait=True)`` (returns once all are
   RUNNING); ``--quick`` stops early, and says at what size, if the launches would not fit
   its time budget.
4. With all N live: the same figures again (delta / N = memory per replica in the daemon),
   the replicas' own USS/PSS (a sample of 50), ``Client.status()`` and ``Client.ping()``
   round trips, ``orchestrator status --json`` and the human table through the CLI, the
   loop's lag (``health``).
5. Teardown: ``terminate(wait=True)`` of every replica (timed), ``orchestrator stop``, then
   every pid recorded over the run (the daemon, its children, every replica) is checked
   gone by pid and start time, no process carries the daemon's token, and the daemon's
   cgroup subtree is removed.

Target: ``status`` p99 <= 100 ms with 2,000 live replicas (what ``status --watch`` and a
supervisor's polling need to stay responsive at that size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import psutil  # noqa: E402

from orchestrator.client.channel import Client  # noqa: E402

REPLICAS = 2000
BATCH = 100
SLEEP = ["sleep", "100000"]
TARGET_STATUS_P99_MS = 100.0
QUICK_LAUNCH_BUDGET_S = 15.0  # quick mode keeps the whole run near 20-25 s
QUICK_JUDGE_AFTER = 500  # launches before the budget is judged: one batch is too noisy a guess
HEADROOM_MARGIN = 200  # processes left free for everyone else on the host
FDS_PER_REPLICA = 6  # generous: pidfd, stdout/stderr pipes, ready pipe, cgroup.events
TOKEN_ENV = "ORCHESTRATOR_DAEMON_TOKEN"
pc = time.perf_counter


# -- small helpers shared with soak.py ----------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: every reported figure is a measured one)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def lat_summary(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p99/max in milliseconds, and how many calls they summarise."""
    return {"n": len(seconds), "p50_ms": pct(seconds, 50) * 1e3, "p99_ms": pct(seconds, 99) * 1e3,
            "max_ms": max(seconds) * 1e3 if seconds else float("nan")}


def proc_figures(p: psutil.Process, full: bool = False) -> dict[str, float]:
    """RSS (and with ``full`` USS/PSS, which read smaps: slower) in MiB, fds and threads of one
    process, straight from /proc: what the kernel charges it, not what it believes."""
    with p.oneshot():
        out: dict[str, float] = {"rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds(),
                                 "threads": p.num_threads()}
        if full:
            mem = p.memory_full_info()
            out["uss_mib"] = mem.uss / 2**20
            out["pss_mib"] = mem.pss / 2**20
    return out


def host_zombies(parents: set[int] | None = None) -> tuple[int, int]:
    """(zombies on the host, zombies whose parent is in ``parents``), from /proc/*/stat."""
    total = ours = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] == b"Z":
            total += 1
            if parents and int(fields[1]) in parents:
                ours += 1
    return total, ours


def same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The live (non-zombie) process with this pid and start time, else None: a pid alone may
    have been reused by someone else's process by now."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.Error:
        return None


class Daemon:
    """A real daemon in a temporary state dir, started and stopped through the CLI as an
    operator would: what is measured is the shipped process layout, not a stand-in. Every
    process of it that the benchmark sees is remembered by (pid, start time), so that the
    end can prove each one gone, or kill exactly that one and say so."""

    def __init__(self, prefix: str, extra_args: Sequence[str] = ()) -> None:
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        self.state_dir = os.path.join(self.tmp, "state")
        self.extra_args = list(extra_args)
        self.proc: psutil.Process | None = None
        self.token: str | None = None
        self.cgroup_subtree: str | None = None
        self.seen: dict[int, float] = {}

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """``orchestrator --state-dir D ARGS`` with output captured (files, never a tty)."""
        return subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", self.state_dir, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)

    def start(self) -> None:
        cp = self.cli("start", *self.extra_args)
        if cp.returncode != 0:
            raise RuntimeError(f"orchestrator start exited {cp.returncode}: {cp.stderr.strip()}")
        self._adopt(int(cp.stdout.split()[-1]))
        with Client(self.state_dir) as client:
            self.cgroup_subtree = client.status()["daemon"].get("cgroup_subtree")

    def _adopt(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.token = self.proc.environ().get(TOKEN_ENV)
        self.remember([pid])
        self.system_children()

    def remember(self, pids: Iterable[int]) -> None:
        """Record these pids' start times now, while they are certainly this daemon's."""
        for pid in pids:
            if pid and pid not in self.seen:
                try:
                    self.seen[pid] = psutil.Process(pid).create_time()
                except psutil.Error:
                    pass  # already gone: nothing to check at the end

    def system_children(self) -> dict[str, psutil.Process]:
        """The daemon's own helper processes by title (``manager``, ``watchdog``, and
        ``spawner`` once it exists), found by what they call themselves, not by guessing."""
        assert self.proc is not None
        out: dict[str, psutil.Process] = {}
        for child in self.proc.children():
            try:
                title = (child.cmdline() or [""])[0]
            except psutil.Error:
                continue
            if title.startswith("orchestrator: ") and not title.startswith("orchestrator: replica"):
                out[title.removeprefix("orchestrator: ").split()[0]] = child
        self.remember(p.pid for p in out.values())
        return out

    def stop(self, timeout: float = 90.0) -> list[str]:
        """``orchestrator stop``, then prove every remembered process gone; what is not is
        killed by its own pid and start time and returned as a problem, as is a process that
        carries the daemon's token, a leftover cgroup subtree, a stop that failed."""
        problems: list[str] = []
        if self.proc is None:  # start failed: a daemon may be up all the same
            try:
                with open(os.path.join(self.state_dir, "daemon.pid")) as f:
                    self._adopt(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError, psutil.Error):
                pass
        if self.proc is not None:
            cp = self.cli("stop", timeout=timeout + 10)
            if cp.returncode not in (0, 3):
                problems.append(f"orchestrator stop exited {cp.returncode}: {cp.stderr.strip()}")
            deadline = time.monotonic() + timeout
            while same_process(self.proc.pid, self.seen[self.proc.pid]) and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(0.2)  # the watchdog and the manager see the daemon's end and exit
        for pid, ctime in self.seen.items():
            p = same_process(pid, ctime)
            if p is not None:
                problems.append(f"left after stop, killed: pid {pid} {p.name()}")
                p.send_signal(signal.SIGKILL)
        if self.token:
            for p in psutil.process_iter():
                try:
                    if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE \
                            and p.environ().get(TOKEN_ENV) == self.token:
                        problems.append(f"carries the daemon's token after stop, killed: pid {p.pid} {p.name()}")
                        p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
        if self.cgroup_subtree and os.path.exists(self.cgroup_subtree):
            problems.append(f"cgroup subtree left behind: {self.cgroup_subtree}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        return problems


# -- the measurement ----------------------------------------------------------------------


def headroom(n: int) -> tuple[int, list[str]]:
    """How many replicas this host can take (at most ``n``), and why fewer when it is so."""
    limits: dict[str, int] = {}
    nprocs = sum(1 for d in os.listdir("/proc") if d.isdigit())
    nthreads = sum(len(os.listdir(f"/proc/{d}/task")) for d in os.listdir("/proc")
                   if d.isdigit() and os.path.isdir(f"/proc/{d}/task"))
    with open("/proc/sys/kernel/pid_max") as f:
        limits["kernel.pid_max"] = int(f.read()) - nthreads
    with open("/proc/sys/kernel/threads-max") as f:
        limits["kernel.threads-max"] = int(f.read()) - nthreads
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid())
        limits["ulimit -u"] = soft - mine
    for line in open("/proc/self/cgroup"):
        _, ctrl, path = line.rstrip("\n").split(":", 2)
        if ctrl == "pids":
            try:
                with open(f"/sys/fs/cgroup/pids{path}/pids.max") as f:
                    value = f.read().strip()
                with open(f"/sys/fs/cgroup/pids{path}/pids.current") as f:
                    current = int(f.read())
                if value != "max":
                    limits["pids cgroup"] = int(value) - current
            except OSError:
                pass
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the daemon raises its soft limit to this
    if hard != resource.RLIM_INFINITY:
        limits["ulimit -Hn / fds per replica"] = hard // FDS_PER_REPLICA
    fits = min(limits.values()) - HEADROOM_MARGIN
    notes = [f"{k}: room for {v} ({nprocs} processes now)" for k, v in limits.items() if v - HEADROOM_MARGIN < n]
    return max(0, min(n, fits)), notes


def snapshot(daemon: Daemon) -> dict[str, dict[str, float]]:
    """Figures of the daemon and each of its system children, keyed by title."""
    assert daemon.proc is not None
    out = {"daemon": proc_figures(daemon.proc, full=True)}
    for title, p in sorted(daemon.system_children().items()):
        out[title] = proc_figures(p, full=True)
    return out


def time_calls(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = pc()
        fn()
        out.append(pc() - t0)
    return out


def time_cli(daemon: Daemon, args: Sequence[str], n: int, expect: int) -> dict[str, float]:
    """Wall time of whole CLI runs (interpreter start included: what a shell user waits)."""
    lat = []
    for _ in range(n):
        t0 = pc()
        cp = daemon.cli(*args)
        lat.append(pc() - t0)
        if cp.returncode != 0:
            raise RuntimeError(f"orchestrator {' '.join(args)} exited {cp.returncode}: {cp.stderr.strip()}")
        if args[0] == "status" and "--json" in args and len(json.loads(cp.stdout)["replicas"]) != expect:
            raise RuntimeError(f"orchestrator {' '.join(args)} listed the wrong number of replicas")
    return lat_summary(lat)


def run(quick: bool, progress: Callable[[str], None], replicas: int = REPLICAS) -> dict:
    """The whole scale run; see the module docstring. Raises if the daemon misbehaves; the
    daemon is stopped and checked in every case."""
    n_status, n_cli = (100, 5) if quick else (300, 10)
    n, notes = headroom(replicas)
    if n < replicas:
        progress(f"host fits {n} replicas, not {replicas}: " + "; ".join(notes))
    daemon = Daemon("bench-scale-")
    res: dict[str, Any] = {"replicas_requested": replicas, "size_notes": notes, "findings": []}
    ids: list[str] = []
    problems: list[str] = []
    try:
        daemon.start()
        client = Client(daemon.state_dir)
        time_calls(client.status, 20)  # warm: first connection, first pages
        before = snapshot(daemon)
        progress(f"daemon {daemon.proc.pid} up; launching {n} x {' '.join(SLEEP)} in batches of {BATCH}")

        t0 = pc()
        while len(ids) < n:
            ids += client.launch("scale", SLEEP, count=min(BATCH, n - len(ids)), wait=True, timeout=120)
            elapsed = pc() - t0
            if len(ids) % 500 == 0 or len(ids) == n:
                progress(f"{len(ids)}/{n} RUNNING after {elapsed:.1f} s")
            if quick and QUICK_JUDGE_AFTER <= len(ids) < n and elapsed * n / len(ids) > QUICK_LAUNCH_BUDGET_S:
                notes.append(f"--quick: stopped at {len(ids)} replicas, {n} would not fit "
                             f"{QUICK_LAUNCH_BUDGET_S:g} s of launches")
                progress(notes[-1])
                break
        launch_s = pc() - t0
        status = client.status()
        live = [r for r in status["replicas"] if r["pool"] == "scale"]
        not_running = [r["id"] for r in live if r["state"] != "RUNNING"]
        if len(live) != len(ids) or not_running:
            raise RuntimeError(f"{len(live)} live of {len(ids)} launched; not RUNNING: {not_running[:5]}")
        daemon.remember(r["pid"] for r in live)
        res["replicas"] = len(ids)
        res["launch_s"] = launch_s
        res["launch_per_s"] = len(ids) / launch_s

        progress("measuring memory, fds and threads with all live")
        after = snapshot(daemon)
        sample = [r["pid"] for r in live[:: max(1, len(live) // 50)]][:50]
        rep = [proc_figures(psutil.Process(pid), full=True) for pid in sample]
        res["daemon_before"], res["daemon_after"] = before["daemon"], after["daemon"]
        res["children_before"] = {k: v for k, v in before.items() if k != "daemon"}
        res["children_after"] = {k: v for k, v in after.items() if k != "daemon"}
        per = 1024.0 / len(ids)  # MiB over N -> KiB per replica
        res["daemon_rss_kib_per_replica"] = (after["daemon"]["rss_mib"] - before["daemon"]["rss_mib"]) * per
        res["daemon_uss_kib_per_replica"] = (after["daemon"]["uss_mib"] - before["daemon"]["uss_mib"]) * per
        res["daemon_fds_per_replica"] = (after["daemon"]["fds"] - before["daemon"]["fds"]) / len(ids)
        res["replica_uss_kib_avg"] = sum(r["uss_mib"] for r in rep) / len(rep) * 1024
        res["replica_pss_kib_avg"] = sum(r["pss_mib"] for r in rep) / len(rep) * 1024
        res["replica_rss_kib_avg"] = sum(r["rss_mib"] for r in rep) / len(rep) * 1024
        res["replicas_sampled"] = len(rep)
        for key in ("fds", "threads", "rss_mib", "uss_mib"):
            res[f"daemon_{key}"] = after["daemon"][key]
            if "manager" in after:
                res[f"manager_{key}"] = after["manager"][key]

        progress(f"timing {n_status} status and ping round trips through the Client")
        res["status_reply_bytes"] = len(json.dumps(status))
        st = lat_summary(time_calls(client.status, n_status))
        res["status_client"] = st
        res["ping_client"] = lat_summary(time_calls(client.ping, n_status))
        res["status_p50_ms"], res["status_p99_ms"] = st["p50_ms"], st["p99_ms"]
        res["target_status_p99_ms"] = TARGET_STATUS_P99_MS
        res["status_p99_ok"] = st["p99_ms"] <= TARGET_STATUS_P99_MS
        progress(f"timing {n_cli} x `status --json` and `status` through the CLI")
        res["status_cli_json"] = time_cli(daemon, ["status", "--json"], n_cli, len(ids))
        res["status_cli_table"] = time_cli(daemon, ["status"], n_cli, len(ids))
        res["health_cli_json"] = time_cli(daemon, ["health", "--json"], n_cli, len(ids))
        res["status_cli_json_p50_ms"] = res["status_cli_json"]["p50_ms"]
        res["status_cli_json_p99_ms"] = res["status_cli_json"]["p99_ms"]
        res["lag_ms"] = client.call("health")["lag"] * 1e3

        progress(f"terminating {len(ids)} replicas")
        t0 = pc()
        done = client.terminate(*ids, wait=True, timeout=300)
        res["terminate_s"] = pc() - t0
        res["terminate_reply_ids"] = len(done)
        if len(done) != len(ids):  # the reply's states, not the stops: checked just below
            res["findings"].append(
                f"terminate(wait=True) of {len(ids)} ids replied with {len(done)}: the replicas that "
                "ended first were no longer in memory when the waiter replied (the engine keeps the "
                "newest `keep_ended` ended replicas)")
        left = [r["id"] for r in client.status()["replicas"] if r["pool"] == "scale"]
        if left:
            problems.append(f"{len(left)} replicas still live after terminate(wait=True)")
        system = {daemon.proc.pid, *(p.pid for p in daemon.system_children().values())}
        alive = [pid for pid, ctime in daemon.seen.items() if pid not in system and same_process(pid, ctime)]
        if alive:
            problems.append(f"{len(alive)} replica processes alive after terminate(wait=True), e.g. {alive[:5]}")
        client.close()
    finally:
        progress("stopping the daemon")
        problems += daemon.stop()
        res["processes_checked"] = len(daemon.seen)
    res["problems"] = problems
    res["clean"] = not problems
    return res


def report(res: dict) -> None:
    """A small markdown table of what ``run`` measured."""
    b, a = res["daemon_before"], res["daemon_after"]
    n = res["replicas"]
    print(f"## scale: {n} live `{' '.join(SLEEP)}` replicas (requested {res['replicas_requested']})")
    for note in res["size_notes"]:
        print(f"- size: {note}")
    print()
    print(f"launch in batches of {BATCH} (wait=True): {res['launch_s']:.1f} s ({res['launch_per_s']:.0f}/s); "
          f"terminate(wait=True) of all: {res['terminate_s']:.2f} s; loop lag with all live: "
          f"{res['lag_ms']:.1f} ms")
    print()
    print("| process | RSS MiB 0 → N | USS MiB 0 → N | fds 0 → N | threads 0 → N |")
    print("| --- | --- | --- | --- | --- |")
    rows = [("daemon", b, a)] + [(k, res["children_before"][k], v) for k, v in res["children_after"].items()
                                 if k in res["children_before"]]
    for name, x, y in rows:
        print(f"| {name} | {x['rss_mib']:.1f} → {y['rss_mib']:.1f} | {x['uss_mib']:.1f} → {y['uss_mib']:.1f} "
              f"| {x['fds']:.0f} → {y['fds']:.0f} | {x['threads']:.0f} → {y['threads']:.0f} |")
    print()
    print(f"per replica, in the daemon: RSS {res['daemon_rss_kib_per_replica']:.1f} KiB, "
          f"USS {res['daemon_uss_kib_per_replica']:.1f} KiB, {res['daemon_fds_per_replica']:.2f} fds; "
          f"each replica itself ({res['replicas_sampled']} sampled): USS {res['replica_uss_kib_avg']:.0f} KiB, "
          f"PSS {res['replica_pss_kib_avg']:.0f} KiB, RSS {res['replica_rss_kib_avg']:.0f} KiB")
    print()
    ok = "ok" if res["status_p99_ok"] else "**MISS**"
    print(f"| round trip with {n} live | calls | p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- |")
    for label, key in ((f"`Client.status()` ({res['status_reply_bytes'] / 1024:.0f} KiB as JSON; "
                        f"target p99 ≤ {TARGET_STATUS_P99_MS:g} ms: {ok})", "status_client"),
                       ("`Client.ping()`", "ping_client"),
                       ("CLI `orchestrator status --json` (whole process)", "status_cli_json"),
                       ("CLI `orchestrator status` (table)", "status_cli_table"),
                       ("CLI `orchestrator health --json` (the CLI's own start-up, for reference)",
                        "health_cli_json")):
        s = res[key]
        print(f"| {label} | {s['n']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} |")
    print()
    for line in res["findings"]:
        print(f"Finding: {line}")
        print()
    if res["problems"]:
        print("Process check: **FAILED**")
        for line in res["problems"]:
            print(f"- {line}")
    else:
        print(f"Process check: ok: {res['processes_checked']} processes recorded over the run "
              "(daemon, its children, every replica) are gone, none carries the daemon's token, "
              "no cgroup is left.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timed calls, a launch time budget (~15 s)")
    ap.add_argument("--replicas", type=int, default=REPLICAS, help="live replicas to hold")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON instead of tables")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that run()'s finally still runs
    res = run(args.quick, lambda msg: print(f"# {msg}", file=sys.stderr, flush=True), args.replicas)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        report(res)
    return 0 if res["clean"] and res["status_p99_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
