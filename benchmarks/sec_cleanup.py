"""Clean-up: kill -9 of the daemon → the last process of its replica trees gone.

``benchmarks/bench_containment.py``'s rounds on real detached daemons: N replicas, each a
tree (``sh -c 'sleep 1000 & sleep 1000'``), every process of them pinned with a pidfd,
SIGKILL to the daemon, the time until the last pidfd reports an exit (the watchdog's work:
``cgroup.kill`` per replica cgroup, or its signal sweep of process groups). N = 10, 50, 200;
in each containment mode this host allows: process groups always, cgroups where a writable
cgroup v2 hierarchy is mounted (found from /proc/self/mountinfo, as the daemon does).
Sizes and modes interleaved. Every daemon is stopped by its own pid afterwards, and every
process seen and every cgroup subtree of its state dirs is checked gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from benchmarks.report import summary

SIZES = (10, 50, 200)


def available_modes() -> tuple[dict[str, str], dict[str, str]]:
    """({mode: --cgroup flag}, {mode: why it is skipped})."""
    from watchdog import cgroup

    modes, skipped = {"process-group": "off"}, {}
    mount = cgroup.find_mount()
    own = cgroup.own_path()
    if mount is None or own is None:
        skipped["cgroup"] = "no cgroup v2 hierarchy mounted (/proc/self/mountinfo)"
        return modes, skipped
    probe = os.path.join(own, f"orchestrator-bench-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as err:
        skipped["cgroup"] = f"cannot create a cgroup under {own}: {err.strerror}"
    else:
        modes["cgroup"] = "auto"
    return modes, skipped


def run(quick: bool, progress: Callable[[str], None], *, batches: int | None = None,
        install: bool = True) -> dict[str, Any]:
    """``batches``: kill rounds per (mode, size) (default quick 2/4/1 for 10/50/200, full 15/20/8)."""
    import psutil

    from benchmarks.bench_containment import Daemon, kill_round
    from orchestrator.daemon.containment import subtree_name
    from watchdog import cgroup

    del install  # nothing to install here
    plan = {n: batches for n in SIZES} if batches is not None else (
        {10: 2, 50: 4, 200: 1} if quick else {10: 15, 50: 20, 200: 8})
    modes, skipped = available_modes()
    root = Path(tempfile.mkdtemp(prefix="bench-suite-cleanup-"))
    killers = {(mode, n): Daemon(root, f"kill-{mode}-{n}", flag) for mode, flag in modes.items() for n in SIZES}
    times: dict[tuple[str, int], list[float]] = {k: [] for k in killers}
    procs: dict[tuple[str, int], int] = {}
    leftovers: list[str] = []
    try:
        keys = list(killers)
        rounds = max(plan.values())
        for r in range(rounds):
            order = keys[r % len(keys):] + keys[: r % len(keys)]
            for key in order:
                if len(times[key]) >= plan[key[1]]:
                    continue
                progress(f"{key[0]}, {key[1]} replicas: kill {len(times[key]) + 1}/{plan[key[1]]}")
                elapsed, count = kill_round(killers[key], key[1], first=not times[key])
                times[key].append(elapsed)
                procs[key] = count
        progress("a last start of each daemon (records its replicas LOST), then its stop")
        for d in killers.values():
            d.start()
            d.client.scale("trees", 0)
            d.stop()
    finally:
        for d in killers.values():
            try:
                d.stop()
            except Exception as err:  # noqa: BLE001 - report it, go on cleaning up
                leftovers.append(f"stopping {d.paths.state_dir}: {err}")
        for d in killers.values():
            for pid, ctime in d.seen.items():
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - ctime) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                        leftovers.append(f"process {pid} {p.name()}")
                        p.kill()
                except psutil.Error:
                    pass
        own = cgroup.own_path()
        if own is not None:
            leftovers += [f"cgroup {p}" for p in (os.path.join(own, subtree_name(d.paths.state_dir))
                                                  for d in killers.values()) if os.path.exists(p)]
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, dict[str, Any]] = {}
    for (mode, n), vals in times.items():
        out.setdefault(mode, {})[str(n)] = {**summary(vals), "processes": procs.get((mode, n), 0)}
    return {"modes": out, "skipped": skipped, "leftovers": leftovers}
