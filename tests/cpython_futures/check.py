"""What a run of ``run.py`` is held to: ``expected.toml``, both ways (see its header)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected.toml"
README = HERE.parent.parent / "README.md"
KINDS = {"documented": "readme", "private": "attribute", "undocumented": "contract", "bug": "item"}


def load(path: Path = EXPECTED) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _last(detail: str) -> str:
    lines = [line for line in detail.splitlines() if line.strip()]
    return " | ".join(lines[-2:])[:300]


def _module(name: str) -> str:
    return name.split(".", 1)[0]


def problems(doc: dict[str, Any], expected: dict[str, Any], readme: str, counts: bool = True) -> list[str]:
    """Every way the run differs from the list, one line each (empty: they agree). Only the
    entries of the modules the run ran (``doc["modules"]``) count; ``counts``: each of those
    modules ran as many tests as the list's ``counts`` say."""
    out: list[str] = []
    tests: dict[str, dict[str, Any]] = doc.get("tests", {})
    modules = set(doc.get("modules") or {_module(name) for name in tests})
    listed = {k: v for k, v in expected.get("tests", {}).items() if _module(k) in modules}
    skips = {k: v for k, v in expected.get("skipped", {}).items() if _module(k) in modules}
    for module in sorted(modules) if counts else ():
        ran, want = sum(_module(name) == module for name in tests), expected.get("counts", {}).get(module)
        if ran != want:
            out.append(f"{module}: {ran} tests ran, expected.toml's counts say {want}")
    readme_flat = _flat(readme)
    for name, entry in sorted(listed.items()):
        kind = entry.get("kind")
        if kind not in KINDS or not entry.get(KINDS[kind]) or not entry.get("match"):
            out.append(f"{name}: an entry needs a kind of {sorted(KINDS)}, its {KINDS.get(kind, 'reason')} "
                       f"and a match")
            continue
        if kind == "documented" and _flat(entry["readme"]) not in readme_flat:
            out.append(f"{name}: README.md no longer says {entry['readme']!r}")
        rec = tests.get(name)
        if rec is None:
            out.append(f"{name}: listed ({kind}) but not run")
        elif rec["outcome"] == "pass":
            if not entry.get("may_pass"):
                out.append(f"{name}: listed ({kind}) but passes now: remove it from expected.toml")
        elif rec["outcome"] == "skip":
            out.append(f"{name}: listed ({kind}) but skipped: {rec['detail'][:200]}")
        elif entry["match"] not in rec["detail"]:
            out.append(f"{name}: fails otherwise than listed ({kind}: {entry['match']!r} is not in its "
                       f"failure): {rec['outcome']}: {_last(rec['detail'])}")
    for name, entry in sorted(skips.items()):
        rec = tests.get(name)
        if rec is None:
            out.append(f"{name}: listed as skipped but not run")
        elif rec["outcome"] != "skip":
            out.append(f"{name}: listed as skipped but {rec['outcome']}: {_last(rec['detail'])}")
        elif entry.get("match", "") not in rec["detail"]:
            out.append(f"{name}: skipped for another reason: {rec['detail'][:200]}")
    for name, rec in sorted(tests.items()):
        if name in listed or name in skips:
            continue
        if rec["outcome"] == "skip":
            out.append(f"{name}: skipped, not listed: {rec['detail'][:200]}")
        elif rec["outcome"] != "pass":
            out.append(f"{name}: {rec['outcome']}, not listed: {_last(rec['detail'])}")
    return out


def table(doc: dict[str, Any], expected: dict[str, Any]) -> str:
    """The run's outcomes against the list: a line per test that does not simply pass."""
    listed = expected.get("tests", {})
    rows = []
    for name, rec in sorted(doc.get("tests", {}).items()):
        entry = listed.get(name) or {}
        if rec["outcome"] == "pass" and not entry:
            continue
        kind = entry.get("kind", "skipped" if name in expected.get("skipped", {}) else "-")
        what = entry.get(KINDS.get(kind, ""), "")
        rows.append(f"{rec['outcome']:5} {kind:12} {str(what)[:60]:60} {name}")
    return "\n".join(rows)
