"""Launch cost against the launcher's size: does a big host slow launches down?

``fork()`` copies the page tables of whatever forks, so before the spawner existed a host
holding 1 GiB launched 12-24x slower than a small one. Measured here, side by side in one
run: churn (batches of 20: launch and wait RUNNING, terminate and wait reaped) through the
embedded API from a host process holding 10 MiB and 1 GiB (a touched bytearray), for
commands and Python targets, next to the raw floors at both sizes (``os.fork``,
fork+exec, ``posix_spawn``); and churn through the daemon for a target whose module takes
200 MB at import, with ``--preload`` and without.

Every host is its own subprocess (so its size is what it allocated), run in rotating
order, a few batches each per round; figures are replicas/s over the counted batches.
``--baseline DIR`` also runs the embedded variants from another checkout of the project
(a ``git worktree`` of an older commit), to compare with what was there before.

Run: .venv/bin/python benchmarks/bench_spawn.py [--quick] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
BATCH = 20
SIZES = (10, 1024)  # MiB the host holds
HOST_VARIANTS = ("orch-command", "orch-python", "raw-fork", "raw-fork-exec", "posix-spawn")
SLEEP = shutil.which("sleep") or "/bin/sleep"


# -- one host process ---------------------------------------------------------------------

def _py_sleeper() -> None:
    time.sleep(1000)


def _hold(mib: int) -> bytearray:
    block = bytearray(mib << 20)
    for i in range(0, len(block), 4096):  # touched: every page is really there
        block[i] = 1
    return block


def _raw(variant: str) -> None:
    """One batch of the floor: 20 children start, are seen running, SIGTERMed, reaped."""
    pids = []
    if variant == "posix-spawn":
        for _ in range(BATCH):
            pids.append(os.posix_spawn(SLEEP, [SLEEP, "1000"], os.environ))  # returns once exec'd
    else:
        r, w = os.pipe()
        for _ in range(BATCH):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                if variant == "raw-fork-exec":
                    os.close(r)  # w is close-on-exec: EOF once every child has exec'd
                    os.execv(SLEEP, [SLEEP, "1000"])
                os.write(w, b"x")
                time.sleep(1000)
                os._exit(0)
            pids.append(pid)
        os.close(w)
        got = 0
        while True:
            chunk = os.read(r, 64)
            if not chunk:
                break
            got += len(chunk)
            if variant == "raw-fork" and got >= BATCH:
                break
        os.close(r)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for pid in pids:
        os.waitpid(pid, 0)


def host_main(mib: int, variant: str, batches: int) -> dict:
    held = _hold(mib)
    times: list[float] = []
    if variant.startswith("orch-"):
        from orchestrator import Orchestrator

        with Orchestrator(grace=5.0) as orch:
            for i in range(batches + 1):
                t0 = time.perf_counter()
                if variant == "orch-command":
                    ids = orch.launch("b", ["sleep", "1000"], count=BATCH, wait=True, timeout=120)
                else:
                    ids = orch.launch("p", target=_py_sleeper, count=BATCH, wait=True, timeout=120)
                orch.terminate(*ids, wait=True, timeout=120)  # *ids: older checkouts take no list
                if i:  # the first batch warms up (the spawner's first fork, imports)
                    times.append(time.perf_counter() - t0)
    else:
        for i in range(batches + 1):
            t0 = time.perf_counter()
            _raw(variant)
            if i:
                times.append(time.perf_counter() - t0)
    del held
    return {"batch_s": times}


# -- the daemon with a 200 MB preload ------------------------------------------------------

_HEAVY = """
import time
BIG = bytearray({mib} << 20)
for _i in range(0, len(BIG), 4096):
    BIG[_i] = 1

def main():
    time.sleep(1000)
"""


def daemon_preload(batches: int, mib: int = 200, slow_count: int = BATCH) -> dict:
    """Churn through the daemon's channel for a target whose module takes ``mib`` at
    import: with ``--preload`` (imported once, in the pool's spawner) and without (every
    replica imports it)."""
    from orchestrator.client.channel import Client

    tmp = Path(tempfile.mkdtemp(prefix="bench-spawn-"))
    (tmp / "code").mkdir()
    (tmp / "code" / "heavy_bench_mod.py").write_text(_HEAVY.format(mib=mib))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "code"), str(ROOT),
                                                                          os.environ.get("PYTHONPATH")]))}
    state = tmp / "state"
    cli = [sys.executable, "-m", "orchestrator", "--state-dir", str(state)]
    with open(tmp / "daemon.out", "w") as out:
        subprocess.run([*cli, "start"], check=True, env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the client records the caller's PYTHONPATH
    results: dict[str, list[float]] = {"preload": [], "no-preload": []}
    try:
        with Client(state) as client:
            for name, preload, n, warmup, count in (("preload", ["heavy_bench_mod"], batches, 1, BATCH),
                                                    ("no-preload", [], 1, 0, slow_count)):
                for i in range(warmup + n):  # preload's warm-up: its spawner starts and imports
                    t0 = time.perf_counter()
                    ids = client.launch(name, target="heavy_bench_mod:main", count=count, wait=True,
                                        timeout=600, preload=preload)
                    client.terminate(ids, wait=True, timeout=120)
                    if i >= warmup:
                        results[name].append((time.perf_counter() - t0) * BATCH / count)
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
        subprocess.run([*cli, "stop", "--timeout", "60"], env=env, capture_output=True, stdin=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)
    return {k: {"batch_s": v} for k, v in results.items()}


# -- side by side -------------------------------------------------------------------------

def _run_host(mib: int, variant: str, batches: int, path: str | None) -> list[float]:
    env = dict(os.environ)
    if path is not None:  # another checkout's orchestrator, first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    # Run from the checkout measured: a spawner started with ``python -c`` finds the package
    # in its cwd before PYTHONPATH, and from another checkout's cwd it would load that one.
    proc = subprocess.run([sys.executable, __file__, "--host", str(mib), variant, str(batches)],
                          capture_output=True, text=True, env=env, timeout=900, stdin=subprocess.DEVNULL,
                          cwd=path or ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} at {mib} MiB failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["batch_s"]


def _rate(batch_s: list[float]) -> float:
    return BATCH * len(batch_s) / sum(batch_s) if batch_s else 0.0


def run(quick: bool, progress: Callable[[str], None], baseline: str | None = None) -> dict:
    rounds, batches = (2, 2) if quick else (4, 4)
    jobs: list[tuple[str, int, str, str | None]] = [(v, m, v, None) for m in SIZES for v in HOST_VARIANTS]
    if baseline:
        jobs += [(f"baseline {v}", m, v, baseline) for m in SIZES for v in ("orch-command", "orch-python")]
    samples: dict[str, list[float]] = {f"{name} @{m}MiB": [] for name, m, _, _ in jobs}
    for r in range(rounds):
        order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]  # drift hits every variant alike
        for name, mib, variant, path in order:
            progress(f"launch cost: round {r + 1}/{rounds}: {name} from a {mib} MiB host")
            samples[f"{name} @{mib}MiB"] += _run_host(mib, variant, batches, path)
    rates = {k: round(_rate(v), 1) for k, v in samples.items()}
    progress("launch cost: the daemon with a 200 MB --preload")
    pre = daemon_preload(1 if quick else 3, slow_count=4 if quick else BATCH)
    rates["daemon, 200 MB target, --preload"] = round(_rate(pre["preload"]["batch_s"]), 1)
    rates["daemon, 200 MB target, no preload"] = round(_rate(pre["no-preload"]["batch_s"]), 1)

    def ratio(a: str, b: str) -> float | None:
        return round(rates[a] / rates[b], 2) if rates.get(a) and rates.get(b) else None

    ratios = {
        "commands: 1 GiB host / 10 MiB host": ratio("orch-command @1024MiB", "orch-command @10MiB"),
        "python: 1 GiB host / 10 MiB host": ratio("orch-python @1024MiB", "orch-python @10MiB"),
        "commands (10 MiB host) / raw fork+exec floor": ratio("orch-command @10MiB", "raw-fork-exec @10MiB"),
        "commands (10 MiB host) / posix_spawn floor": ratio("orch-command @10MiB", "posix-spawn @10MiB"),
        "python (10 MiB host) / raw fork floor": ratio("orch-python @10MiB", "raw-fork @10MiB"),
        "daemon: --preload / no preload": ratio("daemon, 200 MB target, --preload", "daemon, 200 MB target, no preload"),
    }
    if baseline:
        for kind in ("command", "python"):
            for m in SIZES:
                ratios[f"{kind} @{m}MiB: now / baseline"] = ratio(f"orch-{kind} @{m}MiB", f"baseline orch-{kind} @{m}MiB")
    return {"batch": BATCH, "rounds": rounds, "batches_per_round": batches, "replicas_per_s": rates,
            "ratios": ratios, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (~1 minute)")
    ap.add_argument("--baseline", metavar="DIR", help="also run the embedded variants from this checkout")
    ap.add_argument("--json", metavar="FILE", help="write the results here too")
    ap.add_argument("--host", nargs=3, metavar=("MIB", "VARIANT", "BATCHES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.host:
        mib, variant, batches = args.host
        print(json.dumps(host_main(int(mib), variant, int(batches))))
        return 0
    res = run(args.quick, lambda msg: print(msg, file=sys.stderr, flush=True), args.baseline)
    print(f"\nreplicas/s (batches of {BATCH}; {res['rounds']} rounds x {res['batches_per_round']} batches)")
    for name, rate in res["replicas_per_s"].items():
        spread = res["samples"].get(name)
        cv = f"  (batch p50 {statistics.median(spread) * 1e3:.0f} ms)" if spread else ""
        print(f"  {name:<44} {rate:8.1f}{cv}")
    print("\nratios")
    for name, value in res["ratios"].items():
        print(f"  {name:<48} {value if value is not None else '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
