"""What a CLI command costs to start, against a bare interpreter, side by side in one run.

    .venv/bin/python benchmarks/bench_cli.py [-n 40] [--baseline DIR]

Runs each of these N times, interleaved (one of each, then the next round), so that the
machine's drift falls on all of them alike:

    -c pass                                  a bare interpreter: the floor
    -m orchestrator --version                argument parsing, nothing else
    -m orchestrator status --json            against a running daemon (started here, in a temp state dir)
    -m orchestrator health                   the same daemon

With ``--baseline DIR`` (another checkout, e.g. ``git worktree add /tmp/base <commit>``) the
three commands also run from it, with the same interpreter, against a daemon of its own.
Each checkout is put first on ``PYTHONPATH``, so both run their own code with this venv's
packages. Prints the median and p90 of each, in ms, and the median's ratio to ``-c pass``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Checkout:
    """One tree's code, and a daemon of it in a temp state dir."""

    def __init__(self, label: str, root: Path, tmp: Path) -> None:
        self.label = label
        self.env = {**_base_env(tmp), "PYTHONPATH": str(root)}
        self.env.pop("ORCHESTRATOR_STATE_DIR", None)
        self.state_dir = tmp / label
        self.state_dir.mkdir(mode=0o700)
        self.started = False

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "orchestrator", "--state-dir", str(self.state_dir), *args]

    def start(self) -> None:
        subprocess.run(self.argv("start", "--grace", "1"), env=self.env, check=True, stdout=subprocess.DEVNULL,
                       timeout=120, cwd=self.state_dir)
        self.started = True

    def stop(self) -> None:
        if self.started:
            subprocess.run(self.argv("stop"), env=self.env, timeout=120, check=False, cwd=self.state_dir)


def _base_env(tmp: Path) -> dict[str, str]:
    """Bytecode cached, as an installed package has it (PYTHONDONTWRITEBYTECODE would make
    every run compile every module it imports), in the temp dir rather than the checkouts."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    os.makedirs(env["PYTHONPYCACHEPREFIX"], exist_ok=True)
    return env


def _time(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    # cwd: `-m` puts the working directory first on sys.path, before PYTHONPATH.
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
                          cwd=env["PYTHONPYCACHEPREFIX"])
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.decode().strip()}")
    return took


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=40, help="rounds (default 40)")
    ap.add_argument("--baseline", metavar="DIR", help="another checkout to measure alongside this one")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        checkouts = [Checkout("this", ROOT, Path(tmp))]
        if args.baseline:
            checkouts.append(Checkout("baseline", Path(args.baseline).resolve(), Path(tmp)))
        cases: list[tuple[str, list[str], dict[str, str]]] = [
            ("-c pass", [sys.executable, "-c", "pass"], _base_env(Path(tmp)))]
        for c in checkouts:
            cases += [(f"{c.label}: --version", c.argv("--version"), c.env),
                      (f"{c.label}: status --json", c.argv("status", "--json"), c.env),
                      (f"{c.label}: health", c.argv("health"), c.env)]
        try:
            for c in checkouts:
                c.start()
            times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
            for name, argv, env in cases:  # one warm-up each: the page cache, .pyc files
                _time(argv, env)
            for _ in range(args.n):
                for name, argv, env in cases:
                    times[name].append(_time(argv, env))
        finally:
            for c in checkouts:
                c.stop()
    floor = statistics.median(times["-c pass"])
    print(f"{sys.executable} ({sys.version.split()[0]}), {os.cpu_count()} CPUs, {args.n} rounds, interleaved")
    print(f"{'':28} {'median':>9} {'p90':>9} {'vs -c pass':>11}")
    for name, xs in times.items():
        med = statistics.median(xs)
        print(f"{name:28} {med * 1000:7.1f}ms {_p90(xs) * 1000:7.1f}ms {med / floor:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
