"""Statistics and the stdout table of ``python -m benchmarks``.

Every figure printed comes from the results dict of the same run; the targets block divides
figures measured side by side, so machine drift cancels out of the ratios it judges.
"""

from __future__ import annotations

import math
from typing import Any

# The project's benchmark targets (README, "Benchmarks"): goals only. The measured values
# come from ``targets()`` below; nothing here is a result.
CHURN_VS_FLOOR = 0.6
CHURN_VS_SUPERVISORD = 25.0
CHURN_VS_PPE = 5.0
CRASH_VS_SUPERVISORD = 20.0
CLEANUP_P99_50_MS = 25.0


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1]; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))
    return s[k]


def summary(values: list[float]) -> dict[str, float]:
    """n, p50, p99, max and mean of ``values`` (seconds in, seconds out)."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": pct(values, 0.5), "p99": pct(values, 0.99), "max": max(values),
            "mean": sum(values) / len(values)}


def _ms(stats: dict | None, key: str) -> str:
    if not stats or key not in stats:
        return "-"
    return f"{stats[key] * 1e3:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A plain-text table with aligned columns (readable in a terminal and in markdown)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]


def _churn(res: dict) -> list[str]:
    from benchmarks.sec_churn import FORK

    variants = res["variants"]
    floor = variants.get(FORK, {}).get("rate") or float("nan")
    rows = []
    for name, v in variants.items():
        unit = "replicas/s" if v["kind"] == "churn" else "replaced/s"
        rows.append([name, f"{v['rate']:.1f} {unit}", f"{v['rate'] / floor:.3f}x", str(v["cycles"]),
                     _ms(v.get("launch_to_running_s"), "p50"), _ms(v.get("launch_to_running_s"), "p99"),
                     _ms(v.get("terminate_to_reaped_s"), "p50"), _ms(v.get("terminate_to_reaped_s"), "p99")])
    out = [f"churn: batches of {res['batch']} x sleep 1000, {res['rounds']} interleaved rounds "
           f"(+{res['warmup_rounds']} warm-up); pools of {res['pool_workers']} workers for the executors",
           *_table(["variant", "rate", "vs floor", "n", "launch→RUNNING p50 ms", "p99", "terminate→reaped p50 ms",
                    "p99"], rows)]
    for name, why in res.get("skipped", {}).items():
        out.append(f"  not run: {name}: {why}")
    if res.get("leftover_cgroups"):
        out.append(f"  LEFT BEHIND: cgroups {res['leftover_cgroups']}")
    return out


def _crash(res: dict) -> list[str]:
    rows = [[name, str(s["n"]), _ms(s, "p50"), _ms(s, "p99"), _ms(s, "max")] for name, s in res["variants"].items()]
    out = ["crash (SIGKILL) → replacement RUNNING, interleaved",
           *_table(["variant", "n", "p50 ms", "p99 ms", "max ms"], rows)]
    for name, why in res.get("skipped", {}).items():
        out.append(f"  not run: {name}: {why}")
    return out


def _cleanup(res: dict) -> list[str]:
    rows = []
    for mode, sizes in res["modes"].items():
        for n, s in sizes.items():
            rows.append([mode, n, str(s["processes"]), str(s["n"]), _ms(s, "p50"), _ms(s, "p99"), _ms(s, "max")])
    out = ["clean-up: kill -9 of the daemon → last process of N replica trees gone",
           *_table(["containment", "replicas", "processes", "rounds", "p50 ms", "p99 ms", "max ms"], rows)]
    for mode, why in res.get("skipped", {}).items():
        out.append(f"  not run: {mode}: {why}")
    out.append(f"  leftovers after the section: {res['leftovers'] or 'none'}")
    return out


def _flat(prefix: str, value: Any, out: list[tuple[str, str]], depth: int = 0) -> None:
    """Scalar leaves of a nested dict as (dotted key, text); lists shown by their length."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "targets":
                continue
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out, depth + 1)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value) and len(value) <= 6:
            out.append((prefix, ", ".join(_num(x) for x in value)))
        else:
            out.append((prefix, f"[{len(value)} items]"))
    else:
        out.append((prefix, _num(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                    else str(value)))


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def _generic(name: str, res: dict, limit: int = 25) -> list[str]:
    """A section whose shape this module does not know: its numeric and yes/no figures
    (prose and long lists stay in the JSON)."""
    rows: list[tuple[str, str]] = []
    _flat("", res, rows)
    rows = [r for r in rows if len(r[1]) <= 24 and not r[1].startswith("[")]
    return [name, *_table(["figure", "value"], [list(r) for r in rows[:limit]]),
            *([f"  ... {len(rows) - limit} more in the JSON"] if len(rows) > limit else [])]


def _picked(name: str, res: dict, keys: list[str]) -> list[str]:
    """The listed figures that are present, then the section's findings and problems."""
    rows: list[tuple[str, str]] = []
    for key in keys:
        if key in res:
            _flat(key, res[key], rows)
    out = [name, *_table(["figure", "value"], [list(r) for r in rows])]
    for key in ("findings", "problems"):
        for item in res.get(key) or []:
            out.append(f"  {key[:-1]}: {item}")
    return out


SCALE_KEYS = ["replicas", "launch_s", "launch_per_s", "daemon_rss_mib", "daemon_rss_kib_per_replica",
              "daemon_fds_per_replica", "daemon_threads", "replica_uss_kib_avg", "status_p50_ms", "status_p99_ms",
              "target_status_p99_ms", "status_p99_ok", "status_cli_json_p50_ms", "status_cli_json_p99_ms", "lag_ms",
              "terminate_s", "clean"]


def _scale(res: dict) -> list[str]:
    return _picked("scale", res, SCALE_KEYS) if "replicas" in res else _generic("scale", res)


def _soak(res: dict) -> list[str]:
    slopes = res.get("slopes")
    if not isinstance(slopes, dict):
        return _generic("soak", res)
    totals = res.get("totals") or {}
    head = f"soak: {res.get('seconds', '?')} s"
    for key, label in (("churn_per_min", "replicas churned/min"), ("replicas_started", "replicas started"),
                       ("restarts", "restarts")):
        value = res.get(key, totals.get(key))
        if isinstance(value, (int, float)):
            head += f", {value:,.0f} {label}"
    rows = []
    for figure, sl in slopes.items():
        if isinstance(sl, dict):
            rows.append([figure, _num(sl.get("first", float("nan"))), _num(sl.get("last", float("nan"))),
                         _num(sl.get("max", float("nan"))), _num(sl.get("per_min", float("nan"))),
                         _num(sl.get("tolerance_per_min", float("nan"))),
                         {True: "flat", False: "NOT flat"}.get(sl.get("flat"), "?")
                         + ("" if sl.get("conclusive", True) else " (inconclusive)")])
    out = [head, *_table(["figure", "first", "last", "max", "slope/min", "tolerance/min", "verdict"], rows)]
    out.append(f"  clean at the end: {res.get('clean', '?')}")
    for item in res.get("problems") or []:
        out.append(f"  problem: {item}")
    return out


def _tasks(res: dict) -> list[str]:
    from benchmarks.sec_tasks import render

    return render(res)


def _conformance(res: dict) -> list[str]:
    from benchmarks.sec_conformance import render

    return render(res)


RENDERERS = {"conformance": _conformance, "tasks": _tasks, "churn": _churn, "crash": _crash, "cleanup": _cleanup, "scale": _scale, "soak": _soak}


def targets(sections: dict[str, dict]) -> list[dict[str, Any]]:
    """Each target: its name, the goal, the measured value (None if a part did not run), ok."""
    from benchmarks import sec_churn as C
    from benchmarks import sec_crash as K

    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, higher: bool, unit: str, why: str = "") -> None:
        ok = None if value is None or math.isnan(value) else (value >= goal if higher else value <= goal)
        out.append({"target": name, "goal": f"{'≥' if higher else '≤'} {goal:g}{unit}",
                    "measured": value, "unit": unit, "ok": ok, "why": why})

    churn = sections.get("churn", {}).get("result")
    rate = lambda n: (churn or {}).get("variants", {}).get(n, {}).get("rate")  # noqa: E731
    ours = rate(C.EMBEDDED)
    for label, other, goal in (("orchestrator churn vs raw os.fork floor", C.FORK, CHURN_VS_FLOOR),
                               ("orchestrator churn vs supervisord", C.SUPERVISORD, CHURN_VS_SUPERVISORD),
                               ("orchestrator churn vs ProcessPoolExecutor dead-worker replacement", C.PPE,
                                CHURN_VS_PPE)):
        theirs = rate(other)
        add(label, ours / theirs if ours and theirs else None, goal, True, "x",
            "" if ours and theirs else "not measured in this run")

    crash = sections.get("crash", {}).get("result")
    cv = (crash or {}).get("variants", {})
    mine = cv.get(K.ORCH_MIN0, {}).get("p99")
    for label, other in (("crash → replacement p99 vs supervisord (its default startsecs=1)", K.SUP_DEFAULT),
                         ("crash → replacement p99 vs supervisord (startsecs=0, its fastest)", K.SUP_ZERO)):
        theirs = cv.get(other, {}).get("p99")
        add(label, theirs / mine if mine and theirs else None, CRASH_VS_SUPERVISORD, True, "x",
            "" if mine and theirs else "not measured in this run")

    cleanup = sections.get("cleanup", {}).get("result")
    for mode, sizes in ((cleanup or {}).get("modes") or {"": {}}).items():
        s = sizes.get("50", {})
        p99 = s.get("p99")
        add(f"clean-up p99, 50 replicas{', ' + mode if mode else ''}", p99 * 1e3 if p99 is not None else None, CLEANUP_P99_50_MS,
            False, " ms", "" if p99 is not None else "not measured in this run")

    scale = sections.get("scale", {}).get("result")
    if isinstance(scale, dict) and "status_p99_ms" in scale and "target_status_p99_ms" in scale:
        add(f"scale: status p99 with {scale.get('replicas', '?')} live replicas", scale["status_p99_ms"],
            scale["target_status_p99_ms"], False, " ms")
    soak = sections.get("soak", {}).get("result")
    if isinstance(soak, dict) and isinstance(soak.get("flat"), dict):
        bad = [k for k, v in soak["flat"].items() if v is False]
        out.append({"target": "soak: every sampled figure flat (slope within its tolerance)", "goal": "all flat",
                    "measured": None, "shown": f"{len(soak['flat']) - len(bad)}/{len(soak['flat'])} flat",
                    "unit": "", "ok": not bad, "why": ("not flat: " + ", ".join(bad)) if bad else ""})

    for name, sec in sections.items():  # targets a section computed itself
        for t in (sec.get("result") or {}).get("targets", []) if isinstance(sec.get("result"), dict) else []:
            if isinstance(t, dict) and "target" in t:
                out.append({"target": f"{name}: {t['target']}", "goal": str(t.get("goal", "")),
                            "measured": t.get("measured"), "unit": str(t.get("unit", "")), "ok": t.get("ok"),
                            "why": str(t.get("why", "")), **({"shown": str(t["shown"])} if "shown" in t else {})})
    return out


def render(doc: dict) -> str:
    """The whole stdout report: machine line, one block per section, the targets."""
    m = doc["machine"]
    lines = [f"python -m benchmarks{' ' + ' '.join(doc['argv']) if doc['argv'] else ''}  ({doc['mode']} mode, "
             f"{doc['wall_s']:.0f} s)",
             f"{m['cpus']} CPUs, {m['python']}, Linux {m['kernel']}, {m['date']}, commit {m['git_commit'] or '?'}, "
             f"load {m['loadavg_start']} → {m.get('loadavg_end', '?')}", ""]
    for name, sec in doc["sections"].items():
        if sec["status"] != "ok":
            lines += [f"{name}: {sec['status']}: {sec.get('reason', '')}", ""]
            continue
        render_one = RENDERERS.get(name)
        body = render_one(sec["result"]) if render_one else _generic(name, sec["result"])
        body[0] += f"  [{sec['seconds']:.1f} s]"
        lines += body + [""]
    rows = []
    for t in doc["targets"]:
        v = t["measured"]
        shown = t["shown"] if "shown" in t else "-" if v is None else (f"{v:.1f}{t['unit']}" if abs(v) >= 10 else f"{v:.2f}{t['unit']}")
        verdict = "not run" if t["ok"] is None else ("PASS" if t["ok"] else "MISS")
        rows.append([t["target"], t["goal"], shown, verdict + (f" ({t['why']})" if t["why"] else "")])
    lines += ["targets (ratios measured side by side in this run)",
              *_table(["target", "goal", "measured", "result"], rows)]
    return "\n".join(lines)
