"""PNG plots of a ``python -m benchmarks`` run (matplotlib, Agg backend: no display needed).

Small on purpose (a few tens of KB each) so they can be checked in and shown in the README:
the churn comparison as bars (log scale: the variants span three orders of magnitude), the
crash → replacement p99 against supervisord (log scale), clean-up p99 per size and
containment mode, and the soak's RSS and loop lag over time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from benchmarks.peers import ensure_package

DPI = 90


def _plt(install: bool, say: Callable[[str], None]) -> Any:
    matplotlib = ensure_package("matplotlib", "matplotlib", install=install, say=say)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(plt: Any, fig: Any, out: Path, name: str, files: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(out / name, dpi=DPI)
    plt.close(fig)
    files.append(name)


def _hbars(plt: Any, labels: list[str], values: list[float], colors: list[str], xlabel: str, title: str) -> Any:
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(labels) + 1.1))
    y = range(len(labels))
    ax.barh(list(y), values, color=colors)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    fig.suptitle(title)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}" if v >= 10 else f" {v:.2g}", va="center")
    ax.set_xlim(min(values) / 2, max(values) * 4)
    return fig


def _churn(plt: Any, res: dict, out: Path, files: list[str]) -> None:
    variants = res["variants"]
    labels = [n for n in variants if variants[n]["rate"] > 0]
    if not labels:
        return
    values = [variants[n]["rate"] for n in labels]
    colors = ["tab:blue" if n.startswith("orchestrator") else "tab:gray" if n.startswith("raw") or "multiprocess" in n
              else "tab:orange" for n in labels]
    fig = _hbars(plt, [n + ("" if variants[n]["kind"] == "churn" else " (/s)") for n in labels], values, colors,
                 "replicas/s (executors: dead workers replaced/s), log scale",
                 f"churn, batches of {res['batch']}: orchestrator (blue), floors (gray), peers (orange)")
    _save(plt, fig, out, "churn.png", files)


def _crash(plt: Any, res: dict, out: Path, files: list[str]) -> None:
    variants = res["variants"]
    labels = list(variants)
    if not labels:
        return
    values = [variants[n]["p99"] * 1e3 for n in labels]
    colors = ["tab:blue" if n.startswith("orchestrator") else "tab:orange" for n in labels]
    fig = _hbars(plt, labels, values, colors, "p99 ms, log scale (lower is better)",
                 "crash (SIGKILL) → replacement RUNNING, p99")
    _save(plt, fig, out, "crash.png", files)


def _cleanup(plt: Any, res: dict, out: Path, files: list[str]) -> None:
    modes = res["modes"]
    if not modes:
        return
    sizes = sorted({n for m in modes.values() for n in m}, key=int)
    fig, ax = plt.subplots(figsize=(6, 2.8))
    width = 0.8 / len(modes)
    for i, (mode, per) in enumerate(modes.items()):
        xs = [j + i * width for j in range(len(sizes))]
        ys = [per.get(n, {}).get("p99", float("nan")) * 1e3 for n in sizes]
        ax.bar(xs, ys, width, label=mode)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.1f}", ha="center", va="bottom")
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(sizes))], [f"{n} replicas" for n in sizes])
    ax.axhline(25, color="tab:red", lw=0.8, ls="--", label="target for 50: 25 ms")
    ax.set_ylabel("p99 ms")
    ax.set_title("kill -9 of the daemon → last replica tree gone")
    ax.legend(frameon=False)
    _save(plt, fig, out, "cleanup.png", files)


def _soak(plt: Any, res: dict, out: Path, files: list[str], name: str = "soak.png") -> None:
    samples = [s for s in res.get("samples") or [] if isinstance(s, dict) and "t" in s]
    if not samples:
        return
    t = [s["t"] for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(6.5, 3.8), sharex=True)
    a.plot(t, [s.get("rss_mib", float("nan")) for s in samples], color="tab:blue", lw=1)
    a.set_ylabel("daemon RSS MiB")
    a.set_ylim(bottom=0)
    a.set_title("soak: the daemon under churn")
    b.plot(t, [s.get("lag_ms", float("nan")) for s in samples], color="tab:orange", lw=1, label="loop lag")
    if any("round_trip_ms" in s for s in samples):
        b.plot(t, [s.get("round_trip_ms", float("nan")) for s in samples], color="tab:green", lw=1,
               label="command round trip")
        b.legend(frameon=False)
    b.set_ylabel("ms")
    b.set_ylim(bottom=0)
    b.set_xlabel("seconds")
    _save(plt, fig, out, name, files)


PLOTS = {"churn": _churn, "crash": _crash, "cleanup": _cleanup, "soak": _soak}


def write_all(doc: dict, out: Path, *, install: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Every plot the run has data for; returns {"files": [...]} (names inside ``out``)."""
    files: list[str] = []
    wanted = [n for n in PLOTS if doc["sections"].get(n, {}).get("status") == "ok"]
    if not wanted:
        return {"files": files}
    say("plots")
    plt = _plt(install, say)
    for name in wanted:
        PLOTS[name](plt, doc["sections"][name]["result"], out, files)
    return {"files": files}


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.plots --soak RESULT.json``: the soak plot of a standalone
    ``soak.py --json`` run (e.g. the 10-minute one), beside that file."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--soak", required=True, type=Path, metavar="RESULT.json")
    args = ap.parse_args(argv)
    files: list[str] = []
    _soak(_plt(True, print), json.loads(args.soak.read_text()), args.soak.parent, files,
          name=args.soak.with_suffix(".png").name)
    print(*(str(args.soak.parent / f) for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
