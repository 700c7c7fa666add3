"""``python -m benchmarks``: every comparison of the project in one run on one machine.

Each section is a module with ``run(quick, progress) -> dict`` (the harness's own sections
also take ``batches=`` and ``install=``); they run one after the other, so they never
compete for the CPUs, and within a section the variants are interleaved. A section whose
module is missing is shown as "not run"; one that fails is shown with its error, and the
others still run. At the end: a table on stdout, the targets block (ratios measured in this
run, judged PASS/MISS), ``results.json`` with the machine's facts and every raw figure, and
PNG plots, in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"

# section name -> (module, what it measures)
SECTIONS: dict[str, tuple[str, str]] = {
    "churn": ("benchmarks.sec_churn", "churn: orchestrator (embedded, channel, CLI), floors, executors, supervisord"),
    "crash": ("benchmarks.sec_crash", "crash → replacement RUNNING, against supervisord's respawn"),
    "cleanup": ("benchmarks.sec_cleanup", "kill -9 of the daemon → last replica tree gone, per containment mode"),
    "tasks": ("benchmarks.sec_tasks", "tasks: orchestrator.Executor vs ProcessPoolExecutor, loky, pebble"),
    "spawn": ("benchmarks.bench_spawn", "launch cost against the launcher's size"),
    "scale": ("benchmarks.scale", "2,000 live replicas"),
    "soak": ("benchmarks.soak", "soak: RSS, fds, loop lag over time"),
    "daemon-tasks": ("benchmarks.sec_daemon_tasks", "tasks in the daemon: tiny tasks/s through 1 and 4 clients, "
                     "queue-to-start latency, a cancel by id from another process, the embedded "
                     "executor beside them"),
    "conformance": ("benchmarks.sec_conformance", "conformance: the same 12 questions of ProcessPoolExecutor, loky, "
                    "pebble, Dask and orchestrator.Executor, each cell measured"),
}


class Progress:
    """One progress line on stderr: redrawn in place on a terminal, plain lines otherwise."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self.prefix = ""
        self._width = 0

    def section(self, index: int, total: int, name: str) -> None:
        self.prefix = f"[{index}/{total} {name}]"
        self("starting")

    def __call__(self, message: str) -> None:
        text = f"{time.monotonic() - self.t0:6.1f} s {self.prefix} {message}"
        if self.tty:
            text = text[:max(20, os.get_terminal_size(self.stream.fileno()).columns - 1)]
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        self._width = 0


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    """The facts that make figures from two runs comparable (or not)."""
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "kernel": platform.release(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "loadavg_start": _loadavg(),
    }


def _run_section(name: str, quick: bool, progress: Progress, opts: dict[str, Any]) -> dict[str, Any]:
    module_name, what = SECTIONS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name not in (module_name, module_name.rpartition(".")[0]):
            raise
        return {"status": "not run", "reason": f"{module_name} is not there", "what": what}
    run = getattr(module, "run")
    accepted = inspect.signature(run).parameters
    kwargs = {k: v for k, v in opts.items() if k in accepted}
    t0 = time.monotonic()
    try:
        result = run(quick, progress, **kwargs)
    except Exception as err:  # noqa: BLE001 - one section failing does not lose the others
        traceback.print_exc(file=sys.stderr)
        return {"status": "error", "reason": f"{type(err).__name__}: {err}", "what": what,
                "seconds": time.monotonic() - t0}
    return {"status": "ok", "what": what, "seconds": time.monotonic() - t0, "result": result}


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Every comparison of the project in one run: a table on stdout, results.json and PNG plots.",
        epilog="sections: " + "; ".join(f"{k} ({v[1]})" for k, v in SECTIONS.items()))
    ap.add_argument("--quick", action="store_true", help="about a minute on 2 cores (soak 30 s)")
    ap.add_argument("--only", metavar="SECTION[,SECTION]", help="run only these sections")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG")
    ap.add_argument("--batches", type=int, metavar="N",
                    help="rounds per section of this harness (churn rounds, crashes, kill rounds): a size knob")
    ap.add_argument("--no-install", action="store_true",
                    help="never pip-install a peer (loky, pebble, supervisor, matplotlib): skip what is missing")
    args = ap.parse_args(argv)
    args.sections = list(SECTIONS)
    if args.only:
        args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in args.sections if s not in SECTIONS]
        if unknown:
            ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.batches is not None and args.batches < 1:
        ap.error("--batches must be at least 1")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from benchmarks import report

    args = _parse(argv)
    shown_argv = sys.argv[1:] if argv is None else list(argv)
    # SIGTERM unwinds like Ctrl-C, so every section's finally stops what it started; the
    # processes this one forks (the workers being measured) get the default action back.
    signal.signal(signal.SIGTERM, _interrupt)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    progress = Progress()
    opts = {"batches": args.batches, "install": not args.no_install, "out": args.out}
    doc: dict[str, Any] = {"argv": shown_argv, "mode": "quick" if args.quick else "full", "machine": machine(),
                           "sections": {}}
    t0 = time.monotonic()
    interrupted = False
    try:
        for i, name in enumerate(args.sections, 1):
            progress.section(i, len(args.sections), name)
            doc["sections"][name] = _run_section(name, args.quick, progress, opts)
    except KeyboardInterrupt:
        interrupted = True
        progress.done()
        print("interrupted: sections run so far are reported", file=sys.stderr)
    progress.done()
    for name in args.sections:
        doc["sections"].setdefault(name, {"status": "not run", "reason": "interrupted", "what": SECTIONS[name][1]})
    doc["wall_s"] = time.monotonic() - t0
    doc["machine"]["loadavg_end"] = _loadavg()
    doc["targets"] = report.targets(doc["sections"])
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        from benchmarks import plots

        progress.prefix = "[plots]"
        try:
            doc["plots"] = plots.write_all(doc, args.out, install=not args.no_install, say=progress)
        except Exception as err:  # noqa: BLE001 - the figures matter more than the pictures
            doc["plots"] = {"error": f"{type(err).__name__}: {err}"}
        progress.done()
    (args.out / "results.json").write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    print(report.render(doc))
    print(f"\nresults: {args.out / 'results.json'}" + (
        "" if args.no_plots or "error" in doc.get("plots", {}) else
        "; plots: " + ", ".join(sorted(doc["plots"].get("files", [])))))
    if "error" in doc.get("plots", {}):
        print(f"plots: {doc['plots']['error']}")
    if interrupted:
        return 130
    return 1 if any(s["status"] == "error" for s in doc["sections"].values()) else 0
