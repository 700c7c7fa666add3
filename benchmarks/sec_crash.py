"""Crash → replacement RUNNING: the orchestrator's restart policy against supervisord's respawn.

One ``sleep 1000`` replica is SIGKILLed and the clock runs until a new one is RUNNING in its
place (``benchmarks/bench_restart.py``'s rounds: the loop stamps RUNNING itself; supervisord
is polled over XML-RPC every millisecond for the new pid). The orchestrator with
``restart=always`` at backoff MIN 0 and at its default 0.1 s; supervisord with
``autorestart=true`` at ``startsecs=0`` (its fastest) and at its default ``startsecs=1``
(fewer rounds: each costs a second). All interleaved in one run.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from benchmarks import peers
from benchmarks.report import summary

ORCH_MIN0 = "orchestrator, backoff MIN 0"
ORCH_DEFAULT = "orchestrator, backoff MIN 0.1 s (default)"
SUP_ZERO = "supervisord (autorestart, startsecs=0)"
SUP_DEFAULT = "supervisord (autorestart, default startsecs=1)"


def run(quick: bool, progress: Callable[[str], None], *, batches: int | None = None,
        install: bool = True) -> dict[str, Any]:
    """``batches``: crashes per fast variant (default 20 quick, 100 full); supervisord at its
    default startsecs gets a fifth of them (at least 3): each one takes a second."""
    from benchmarks.bench_restart import orchestrator_round, trace_running
    from orchestrator import Orchestrator

    crashes = batches if batches is not None else (20 if quick else 100)
    slow_every = 5
    results: dict[str, list[float]] = {ORCH_MIN0: [], ORCH_DEFAULT: [], SUP_ZERO: [], SUP_DEFAULT: []}
    skipped: dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-suite-crash-"))
    sup = None
    try:
        with Orchestrator(grace=1.0, state_dir=str(tmp / "embedded")) as orch:
            stamps = trace_running(orch)
            policy = {"restart": "always", "max_restarts": [100000, 1]}
            orch.launch("zero", ["sleep", "1000"], policy={**policy, "backoff": [0, 0]}, wait=True)
            orch.launch("dflt", ["sleep", "1000"], policy={**policy, "backoff": [0.1, 0.1]}, wait=True)
            try:
                progress("starting supervisord")
                (tmp / "supervisord-home").mkdir()
                sup = peers.SupervisordBatch(tmp / "supervisord-home", 1, install=install, say=progress)
            except peers.Unavailable as err:
                skipped[SUP_ZERO] = skipped[SUP_DEFAULT] = str(err)
            slow = max(3, crashes // slow_every)
            for i in range(crashes):
                progress(f"crash {i + 1}/{crashes}")
                results[ORCH_MIN0].append(orchestrator_round(orch, stamps, "zero"))
                results[ORCH_DEFAULT].append(orchestrator_round(orch, stamps, "dflt"))
                if sup is not None:
                    results[SUP_ZERO].append(sup.crash_round("sleeper"))
                    if i % max(1, crashes // slow) == 0 and len(results[SUP_DEFAULT]) < slow:
                        results[SUP_DEFAULT].append(sup.crash_round("defaults"))
            while sup is not None and len(results[SUP_DEFAULT]) < slow:
                progress(f"supervisord, default startsecs: crash {len(results[SUP_DEFAULT]) + 1}/{slow}")
                results[SUP_DEFAULT].append(sup.crash_round("defaults"))
    finally:
        try:
            if sup is not None:
                sup.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"variants": {k: summary(v) for k, v in results.items() if v}, "skipped": skipped}
