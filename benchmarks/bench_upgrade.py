"""`orchestrator upgrade` under load: the longest gap in command replies while the daemon
re-executes itself, with N live replicas.

A daemon (CLI ``start``, its own temporary state dir) runs N ``sleep 1000`` replicas; one
client thread sends ``ping`` back to back over the command channel and stamps every reply;
``upgrade`` runs from the CLI. Reported: the longest gap between two replies from the
moment ``upgrade`` was sent until it returned (the pause clients see), the upgrade
command's own time, the hand-over's share of it as the daemon logs it, and whether every
replica kept its pid. Run from the repo root:

    .venv/bin/python benchmarks/bench_upgrade.py [--replicas 200 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def cli(state_dir: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", state_dir, *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def launch_idle(state_dir: str, n: int, pool: str) -> None:
    """``n`` idle ``sleep 1000`` replicas in ``pool``, each RUNNING when this returns."""
    left = n
    while left:  # in batches: one launch --wait of thousands would wait on its slowest
        count = min(left, 500)
        got = cli(state_dir, "launch", "--pool", pool, "--count", str(count), "--wait", "--timeout", "600",
                  "--", "sleep", "1000")
        assert got.returncode == 0, got.stderr
        left -= count


def pids(state_dir: str) -> dict[str, int]:
    data = json.loads(cli(state_dir, "status", "--json").stdout)
    return {r["id"]: r["pid"] for r in data["replicas"] if r["state"] == "RUNNING"}


def one(n: int) -> dict:
    from orchestrator.client.channel import Client

    state_dir = tempfile.mkdtemp(prefix="bench-upgrade-")
    try:
        got = cli(state_dir, "start")
        assert got.returncode == 0, got.stderr
        launch_idle(state_dir, n, "many")
        before = pids(state_dir)
        assert len(before) == n
        stamps: list[float] = []
        stop = threading.Event()
        errors: list[str] = []

        def pinger() -> None:
            with Client(state_dir, timeout=60) as client:
                while not stop.is_set():
                    try:
                        client.call("ping")
                    except Exception as err:  # a failed command is what this measures
                        errors.append(str(err))
                    stamps.append(time.monotonic())

        thread = threading.Thread(target=pinger, daemon=True)
        thread.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        got = cli(state_dir, "upgrade")
        t1 = time.monotonic()
        time.sleep(0.5)
        stop.set()
        thread.join(60)
        assert got.returncode == 0, got.stderr
        window = [t0] + [t for t in stamps if t0 <= t <= t1] + [t for t in stamps if t > t1][:1]
        gap = max(b - a for a, b in zip(window, window[1:]))
        log = (Path(state_dir) / "logs" / "daemon.log").read_text()
        handover = re.findall(r"exec of \S+ after (\d+) ms of hand-over", log)
        after = pids(state_dir)
        return {"replicas": n, "longest_gap_ms": round(gap * 1e3, 1), "upgrade_ms": round((t1 - t0) * 1e3, 1),
                "handover_ms": int(handover[-1]) if handover else None, "pids_kept": after == before,
                "ping_errors": len(errors)}
    finally:
        cli(state_dir, "stop", "--timeout", "120")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[200, 2000])
    args = parser.parse_args()
    print(f"{'replicas':>8} {'longest gap':>12} {'upgrade':>9} {'hand-over':>10} {'pids kept':>9} errors")
    for n in args.replicas:
        r = one(n)
        print(f"{r['replicas']:>8} {r['longest_gap_ms']:>9.1f} ms {r['upgrade_ms']:>6.0f} ms "
              f"{r['handover_ms'] if r['handover_ms'] is not None else '?':>7} ms {str(r['pids_kept']):>9} "
              f"{r['ping_errors']}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    sys.exit(main())
