"""Soak: 10 minutes of churn (``--quick``: 30 s) with restarts and log output, sampling the
daemon's RSS, fds, threads, the loop's lag and the host's zombies: they must stay flat, and
"flat" is a least-squares slope against a stated tolerance, not a look at a plot.

Run: ``.venv/bin/python benchmarks/soak.py [--quick] [--seconds N]`` from the repo root.
``run(quick, progress, seconds=None)`` is the same for the ``benchmarks`` harness.

One real daemon (started and stopped through the CLI in a temporary state dir, as in
scale.py) and three pools:

* ``flap``: ``--restart always``, 6 ``sh`` workers that print to stdout and stderr and exit
  after 0.4-1.8 s, with 0 or 1: the supervisor replaces each one (short backoff, a restart
  budget no run reaches, so the pool never becomes a crash loop);
* ``batch``: the benchmark's own loop launches 8 replicas (``launch --wait``; each says
  hello on both streams, then sleeps), keeps 3 batches alive and terminates the oldest
  (``terminate --wait``), one cycle at least every 0.25 s;
* ``steady``: 3 workers ticking on stdout, rolled with the CLI's ``restart --pool`` every
  15 s (``--quick``: 8 s).

Samples are taken by the same loop, right after a terminate returned, so each one sees the
same load (3 batches, the flap pool at about its size) and the slope of a figure is its
drift, not the phase of the churn it happened to catch. Each sample: the daemon's RSS, fds
and threads and the manager's fds and threads (/proc), the loop's lag (the ``health``
command: its LagMonitor, including how overdue its timer is right now), a ``status`` round
trip, the live replicas in that status, and the zombies on the host (/proc/*/stat state Z)
and among the daemon's own children, and the files in the state dir's ``logs/``.

The daemon keeps ``keep_replicas`` ended replicas in its journal (``start --keep-replicas``:
5000, or ``seconds * 5`` for a shorter run, so that the journal is full before the second
half begins) and the log files of those it forgets are removed while it runs: ``log_files``
must be flat once the journal is full, not grow by a file pair per churned replica.

Slopes are computed over the second half of the run (the first is warm-up: SQLite's page
cache, the engine's memory of the last ``keep_ended`` ended replicas, allocator arenas).
Each is the coefficient of time in a least-squares fit ``y = a + c*t + b*live``: the live
count is in the fit because a sample that catches two more flap workers also holds their
fds and memory, which is load, not a leak; ``live`` is itself checked flat, so that a growing
number of replicas cannot hide behind that term. The raw slope (time alone) is reported as
well. Tolerances, per minute (the reasons are in TOLERANCES below).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
from collections import deque
from typing import Any, Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.scale import Daemon, host_zombies, proc_figures  # noqa: E402
from orchestrator.client.channel import Client  # noqa: E402
from orchestrator.daemon.engine import EngineConfig  # noqa: E402
from orchestrator.store import KEEP_REPLICAS  # noqa: E402

SECONDS, QUICK_SECONDS = 600.0, 30.0
FLAP_SIZE, BATCH, BATCHES_KEPT, STEADY_SIZE = 6, 8, 3, 3
CYCLE_MIN_S = 0.25
FLAP = ["sh", "-c", 'n=$(( $$ % 8 + 2 )); while [ $n -gt 0 ]; do echo "out $$ $n"; echo "err $$ $n" >&2; '
        'sleep 0.2; n=$((n - 1)); done; exit $(( $$ % 2 ))']
FLAP_POLICY = {"restart": "always", "backoff": [0.05, 0.2], "max_restarts": [1_000_000, 60]}
BATCH_CMD = ["sh", "-c", 'echo "hello from $$"; echo "warming up $$" >&2; exec sleep 1000']
STEADY = ["sh", "-c", 'while :; do echo "tick $$"; sleep 0.5; done']

# metric -> (tolerance per minute, why that much)
TOLERANCES: dict[str, tuple[float, str]] = {
    "rss_mib": (1.0, "1 MiB/min is under 2 KiB per churned replica at this churn (>500/min), less "
                     "than half of the ~5 KiB the daemon holds per live replica (scale.py): any leak "
                     "of a replica's record or buffers per churn exceeds it"),
    "fds": (0.5, "one fd leaked per ~1000 churned replicas would exceed it; the fit takes out "
                 "the fds of replicas that are live at the moment of the sample"),
    "threads": (0.5, "the daemon is single-threaded by design: any thread that appears is a defect"),
    "manager_fds": (0.5, "a connection leaked per CLI call (a restart every 8-15 s) would exceed it"),
    "manager_threads": (0.5, "the manager runs a thread per connection: a leaked one would exceed it"),
    "lag_ms": (2.0, "+20 ms over 10 minutes, 2% of the 1 s health limit: a loop whose turns "
                    "grow with history (a scan of every replica ever made) would exceed it"),
    "round_trip_ms": (2.0, "the same for a status with ~35 live replicas (~1 ms at the start)"),
    "zombies": (0.5, "the host's count; an unreaped child per ~1000 churned would exceed it, and "
                     "the floor (the minimum over the last quarter) must not rise above the first half's"),
    "zombies_ours": (0.5, "the same, among the children of the daemon and its helpers only (the host "
                          "count also holds other users' processes)"),
    "log_files": (200.0, "files in logs/: once the journal holds keep_replicas ended replicas, their files "
                          "and the live ones' are all that stays; a leak of the files of one churned "
                          "replica in ten (2 files each, >1000/min) exceeds it, while the sawtooth of "
                          "pruning (a prune every <=1000 journal rows or keep_replicas/10 retired "
                          "replicas, ~300 files) tilts a fit by less"),
    "live": (2.0, "replicas must not accumulate: the churn keeps ~35 live, 2/min is a rate no "
                  "leak of replicas would stay under for long"),
}
SAMPLE_KEYS = ("rss_mib", "fds", "threads", "manager_fds", "manager_threads", "lag_ms", "round_trip_ms",
               "zombies", "zombies_ours", "log_files", "live")
pc = time.perf_counter


# -- the slope ------------------------------------------------------------------------------


def slope(ts: Sequence[float], ys: Sequence[float], ls: Sequence[float]) -> dict[str, float]:
    """Least-squares slope of ``ys`` over ``ts`` (minutes), holding ``ls`` (live replicas)
    as a second regressor when it varies; with its standard error and the slope of time
    alone. Centred sums, 2x2 normal equations: no numpy needed."""
    n = len(ts)
    mt, my, ml = sum(ts) / n, sum(ys) / n, sum(ls) / n
    t = [x - mt for x in ts]
    y = [x - my for x in ys]
    li = [x - ml for x in ls]
    stt = sum(a * a for a in t)
    sll = sum(a * a for a in li)
    stl = sum(a * b for a, b in zip(t, li))
    sty = sum(a * b for a, b in zip(t, y))
    sly = sum(a * b for a, b in zip(li, y))
    raw = sty / stt
    det = stt * sll - stl * stl
    if sll > 0 and det > 1e-9 * stt * sll:
        c = (sty * sll - sly * stl) / det
        b = (sly * stt - sty * stl) / det
        dof, var_factor = n - 3, sll / det
    else:  # live constant over the window: time alone
        c, b, dof, var_factor = raw, 0.0, n - 2, 1.0 / stt
    ssr = sum((yy - c * tt - b * ll) ** 2 for yy, tt, ll in zip(y, t, li))
    se = math.sqrt(ssr / dof * var_factor) if dof > 0 else float("nan")
    return {"per_min": c, "stderr_per_min": se, "raw_per_min": raw, "per_live_replica": b}


def verdicts(samples: list[dict], seconds: float) -> dict[str, dict]:
    """Slope, tolerance and verdict per metric over the second half of the run."""
    half = [s for s in samples if s["t"] >= seconds / 2]
    if len(half) < 5:
        raise RuntimeError(f"only {len(half)} samples in the second half: too few for a slope")
    first = [s for s in samples if s["t"] < seconds / 2]
    ts = [s["t"] / 60.0 for s in half]
    ls = [float(s["live"]) for s in half]
    out = {}
    for key in SAMPLE_KEYS:
        tol, why = TOLERANCES[key]
        fit = slope(ts, [float(s[key]) for s in half], ls if key != "live" else [0.0] * len(ls))
        flat = abs(fit["per_min"]) <= tol
        entry = {**fit, "tolerance_per_min": tol, "why": why, "flat": flat,
                 "conclusive": 2 * fit["stderr_per_min"] <= tol,
                 "first": half[0][key], "last": half[-1][key], "max": max(s[key] for s in samples)}
        if key.startswith("zombies"):
            floor_late = min(s[key] for s in half[-max(1, len(half) // 2):])
            floor_early = min(s[key] for s in first) if first else floor_late
            entry["floor_first_half"], entry["floor_last_quarter"] = floor_early, floor_late
            entry["flat"] = flat and floor_late <= floor_early
        out[key] = entry
    return out


# -- the churn --------------------------------------------------------------------------------


def metric_totals(text: str) -> dict[str, float]:
    """Sums over labels of the counters the result reports, from the Prometheus text."""
    want = {"replicas_launched_total": "replicas_started", "restarts_total": "restarts",
            "log_bytes": "bytes_logged", "log_dropped": "log_bytes_dropped",
            "crashloops_total": "crashloops"}
    out = {v: 0.0 for v in want.values()}
    for line in text.splitlines():
        m = re.match(r"orchestrator_([a-z_]+)(?:\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in want:
            out[want[m.group(1)]] += float(m.group(2))
    return out


def take_sample(daemon: Daemon, client: Client, t: float) -> dict[str, Any]:
    assert daemon.proc is not None
    d = proc_figures(daemon.proc)
    children = daemon.system_children()
    m = proc_figures(children["manager"]) if "manager" in children else {"fds": -1, "threads": -1}
    lag = client.call("health")["lag"]
    t0 = pc()
    status = client.status()
    rt = pc() - t0
    daemon.remember(r["pid"] for r in status["replicas"] if r.get("pid"))
    zombies, ours = host_zombies({daemon.proc.pid, *(p.pid for p in children.values())})
    log_files = len(os.listdir(os.path.join(daemon.state_dir, "logs")))
    return {"t": round(t, 3), "rss_mib": round(d["rss_mib"], 3), "fds": d["fds"], "threads": d["threads"],
            "manager_fds": m["fds"], "manager_threads": m["threads"],
            "lag_ms": round((lag or 0.0) * 1e3, 3), "round_trip_ms": round(rt * 1e3, 3),
            "zombies": zombies, "zombies_ours": ours, "log_files": log_files, "live": len(status["replicas"])}


def run(quick: bool, progress: Callable[[str], None], seconds: float | None = None) -> dict:
    """The whole soak; see the module docstring. The daemon is stopped and checked in every
    case; a failing command ends the churn and is raised after that check."""
    seconds = seconds or (QUICK_SECONDS if quick else SECONDS)
    sample_every = 0.5 if quick else 1.0
    restart_every = 8.0 if quick else 15.0
    keep_replicas = min(KEEP_REPLICAS, max(100, int(seconds * 5)))
    daemon = Daemon("bench-soak-", ["--keep-replicas", str(keep_replicas)])
    res: dict[str, Any] = {"seconds": seconds, "sample_every_s": sample_every, "keep_replicas": keep_replicas}
    samples: list[dict] = []
    counts = {"batches_launched": 0, "batches_terminated": 0, "pool_restarts": 0}
    problems: list[str] = []
    try:
        daemon.start()
        client = Client(daemon.state_dir)
        client.launch("flap", FLAP, count=FLAP_SIZE, policy=FLAP_POLICY)
        client.launch("steady", STEADY, count=STEADY_SIZE, wait=True, policy={"restart": "always"})
        progress(f"daemon {daemon.proc.pid} up; churning for {seconds:g} s")
        batches: deque[list[str]] = deque()
        start = pc()
        next_sample = next_progress = 0.0
        next_restart = restart_every
        while (now := pc() - start) < seconds:
            cycle_start = pc()
            batches.append(client.launch("batch", BATCH_CMD, count=BATCH, wait=True, timeout=60))
            counts["batches_launched"] += 1
            if len(batches) > BATCHES_KEPT:
                client.terminate(*batches.popleft(), wait=True, timeout=60)
                counts["batches_terminated"] += 1
            if now >= next_restart:
                next_restart = now + restart_every
                cp = daemon.cli("restart", "--pool", "steady")
                if cp.returncode != 0:
                    raise RuntimeError(f"restart --pool steady exited {cp.returncode}: {cp.stderr.strip()}")
                counts["pool_restarts"] += 1
            if len(batches) == BATCHES_KEPT and now >= next_sample:
                samples.append(take_sample(daemon, client, pc() - start))
                next_sample = now + sample_every
                if now >= next_progress:
                    s = samples[-1]
                    progress(f"t={s['t']:.0f}s rss {s['rss_mib']:.1f} MiB, fds {s['fds']}, "
                             f"threads {s['threads']}, lag {s['lag_ms']:.1f} ms, status {s['round_trip_ms']:.1f} ms, "
                             f"live {s['live']}, zombies {s['zombies']}, log files {s['log_files']}")
                    next_progress = now + 5.0
            time.sleep(max(0.0, CYCLE_MIN_S - (pc() - cycle_start)))
        res["elapsed_s"] = pc() - start
        totals = {**metric_totals(client.call("metrics")), **counts}
        logs = daemon.cli("logs", "--pool", "flap", "--lines", "3")
        totals["logs_lines_shown"] = len(logs.stdout.splitlines()) if logs.returncode == 0 else 0
        logs_dir = os.path.join(daemon.state_dir, "logs")
        totals["log_files"] = len(os.listdir(logs_dir))
        totals["log_dir_mib"] = sum(os.path.getsize(os.path.join(logs_dir, f)) for f in os.listdir(logs_dir)) / 2**20
        res["totals"] = totals
        if logs.returncode != 0 or not totals["logs_lines_shown"]:
            problems.append(f"orchestrator logs --pool flap showed nothing (exit {logs.returncode}): "
                            f"{logs.stderr.strip()}")
        client.close()
    finally:
        progress("stopping the daemon")
        problems += daemon.stop()
        res["processes_checked"] = len(daemon.seen)
    res["samples"] = samples
    res["slopes"] = verdicts(samples, seconds)
    second_half_start = seconds / 2
    churn_per_min = res["totals"]["replicas_started"] / (res["elapsed_s"] / 60.0)
    res["churn_per_min"] = churn_per_min
    res["keep_ended"] = EngineConfig().keep_ended
    res["warm_at_half"] = churn_per_min * second_half_start / 60.0 >= res["keep_ended"]
    res["journal_full_at_half"] = churn_per_min * second_half_start / 60.0 >= keep_replicas
    res["rss_kib_per_churned_replica"] = res["slopes"]["rss_mib"]["per_min"] * 1024 / churn_per_min
    res["flat"] = {k: v["flat"] for k, v in res["slopes"].items()}
    res["all_flat"] = all(res["flat"].values())
    res["problems"] = problems
    res["clean"] = not problems
    for key in ("rss_mib", "fds", "threads", "lag_ms", "zombies", "log_files"):  # the plainly named top-level figures
        res[f"{key}_slope_per_min"] = res["slopes"][key]["per_min"]
    return res


def report(res: dict) -> None:
    """The slopes table, a thinned samples table and the totals, as markdown."""
    tot = res["totals"]
    print(f"## soak: {res['elapsed_s']:.0f} s of churn, {len(res['samples'])} samples "
          f"(every ≥ {res['sample_every_s']:g} s, at the same point of the churn cycle)")
    print()
    print(f"replicas started {tot['replicas_started']:.0f} ({res['churn_per_min']:.0f}/min), restarts by the "
          f"supervisor {tot['restarts']:.0f}, batches {tot['batches_launched']} launched / "
          f"{tot['batches_terminated']} terminated, `restart --pool` {tot['pool_restarts']}, bytes logged "
          f"{tot['bytes_logged']:.0f} (dropped {tot['log_bytes_dropped']:.0f}), {tot['log_files']} log files "
          f"({tot['log_dir_mib']:.1f} MiB), crash loops {tot['crashloops']:.0f}")
    if not res["warm_at_half"]:
        print(f"(the second half began before {res['keep_ended']} replicas had ended: the engine's memory of "
              "ended replicas was still filling, so an RSS slope here is partly that fill)")
    if not res["journal_full_at_half"]:
        print(f"(the second half began before {res['keep_replicas']} replicas had ended: the journal, and "
              "with it logs/, was still filling, so a log_files slope here is partly that fill)")
    print()
    print("| metric (second half) | slope /min | ± stderr | raw slope /min | per live replica | tolerance /min "
          "| first → last (max) | flat |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, s in res["slopes"].items():
        verdict = ("yes" if s["flat"] else "**NO**") + ("" if s["conclusive"] else " (run too short to tell)")
        print(f"| {key} | {s['per_min']:+.3f} | {s['stderr_per_min']:.3f} | {s['raw_per_min']:+.3f} "
              f"| {s['per_live_replica']:+.3f} | {s['tolerance_per_min']:g} | {s['first']:g} → {s['last']:g} "
              f"({s['max']:g}) | {verdict} |")
    print(f"\nRSS slope per churned replica: {res['rss_kib_per_churned_replica']:+.3f} KiB")
    print()
    rows = res["samples"]
    step = max(1, len(rows) // 12)
    print("| t s | RSS MiB | fds | threads | mgr fds | mgr threads | lag ms | status ms | live | zombies (ours) "
          "| log files |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else []):
        print(f"| {s['t']:.1f} | {s['rss_mib']:.2f} | {s['fds']} | {s['threads']} | {s['manager_fds']} "
              f"| {s['manager_threads']} | {s['lag_ms']:.1f} | {s['round_trip_ms']:.1f} | {s['live']} "
              f"| {s['zombies']} ({s['zombies_ours']}) | {s['log_files']} |")
    print()
    if res["problems"]:
        print("Process check: **FAILED**")
        for line in res["problems"]:
            print(f"- {line}")
    else:
        print(f"Process check: ok: {res['processes_checked']} processes recorded over the run are gone, "
              "none carries the daemon's token, no cgroup is left.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:g} s instead of {SECONDS:g} s")
    ap.add_argument("--seconds", type=float, help="length of the churn")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON instead of tables")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that run()'s finally still runs
    res = run(args.quick, lambda msg: print(f"# {msg}", file=sys.stderr, flush=True), args.seconds)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        report(res)
    return 0 if res["clean"] and res["all_flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
