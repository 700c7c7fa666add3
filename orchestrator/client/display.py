"""What the CLI prints about a daemon: the status table, `show`'s lines and the health line, and the
status read from the journal when the daemon is down. Client side: it formats what the
daemon answered (or what state.db last recorded) and imports nothing of the daemon.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import OrchestratorError
from ..paths import Paths

if TYPE_CHECKING:
    from ..store import Store


def format_health(ok: bool, info: Mapping[str, Any]) -> str:
    """One line for ``orchestrator health``, from the daemon's ``health`` answer."""
    lag = info.get("lag")
    lag_text = f"loop lag {lag * 1000:.1f} ms" if isinstance(lag, (int, float)) else "loop lag unknown"
    if ok:
        return f"healthy: daemon, watchdog and manager alive; {lag_text}"
    failed = list(info.get("failed") or ())
    words = []
    for part in failed:
        if part == "journal":
            words.append(journal_line(info.get("journal") or {}))
        elif part == "loop":
            limit = info.get("lag_limit")
            words.append(f"control loop slow ({lag_text}, limit {limit:g} s)" if isinstance(limit, (int, float))
                         else f"control loop slow ({lag_text})")
        else:
            words.append(f"{part} down")
    if "loop" not in failed:
        words.append(lag_text)
    return "unhealthy: " + "; ".join(words or ["unknown"])


def journal_line(journal: Mapping[str, Any]) -> str:
    """``state not saved since 12:00:01 (disk full writing ...); 40 changes wait``: the
    journal's fault, as health and status say it."""
    since = journal.get("since")
    when = f" since {clock(since)}" if isinstance(since, (int, float)) else ""
    text = f"state not saved{when} ({journal.get('fault') or 'unknown fault'})"
    unsaved = journal.get("unsaved")
    if isinstance(unsaved, int) and unsaved:
        text += f"; {unsaved} changes wait to be written, the daemon retries every second"
    return text


def open_store_readonly(paths: Paths) -> Store:
    """The journal for a reader (the daemon may be down); a bad file is a one-line error."""
    from ..store import Store, StoreError

    try:
        return Store(paths.db, readonly=True)
    except StoreError as err:
        raise OrchestratorError(str(err)) from None


def stored_status(paths: Paths, include_terminal: bool) -> dict[str, Any]:
    """Pools and replicas as state.db last recorded them (for ``status`` with the daemon down)."""
    if not paths.db.exists():
        return {"pools": [], "replicas": []}
    from ..store import unpack_pool_row

    store = open_store_readonly(paths)
    try:
        pools = []
        for p in store.pools():
            spec, policy, extra = unpack_pool_row(p["spec"])
            if not extra.get("deleted"):
                pools.append({"name": p["name"], "desired": p["desired"], "spec": spec, "policy": policy or {},
                              "state": "stopped" if extra.get("stopped") else "crashloop" if extra.get("crashloop")
                              else None, "stopped": bool(extra.get("stopped")),
                              "reason": extra.get("crashloop")})
        return {"pools": pools, "replicas": store.replicas(include_terminal=include_terminal)}
    finally:
        store.close()


def format_status(data: Mapping[str, Any], *, samples: dict[int, tuple[float, float]] | None = None,
                  health: str | None = None) -> str:
    """The table: daemon, pools (in the order they start, each with the pools it starts
    after and what its PENDING replicas wait for), then one line per replica with its uptime, restarts, CPU%
    and RSS (psutil; CPU% since its start, or since the last redraw with --watch) and the
    command it runs. With the daemon down, replicas are what the store last knew."""
    d = data["daemon"]
    now = time.time()
    if d["running"]:
        up = duration(now - d["started_at"]) if d.get("started_at") else "?"
        head = (f"daemon: running (pid {d['pid']}, watchdog {d['watchdog_pid']}, manager {d['manager_pid']}, "
                f"up {up}, containment {d.get('containment', 'process-group')})")
    else:
        head = "daemon: not running; replicas below are as last known, not live"
    out = [f"{head}  state dir: {data['state_dir']}"]
    journal = d.get("journal")
    if isinstance(journal, Mapping) and journal.get("ok") is False:
        out.append("journal: " + journal_line(journal))
    if (d.get("logs") or {}).get("dropped"):
        out.append(f"logs: {d['logs']['dropped']} bytes of replica output dropped (disk full or too fast)")
    if health:
        out.append(health)
    for p in data["pools"]:
        state = p.get("state") or ("stopped" if not d["running"] else "ok")
        extra = f" ({p['reason']})" if p.get("reason") else ""
        line = f"pool {p['name']}: {state}{extra}, size {p['desired']}, restarts {p.get('restarts', 0)}"
        if p.get("kind") == "executor" and p.get("workers"):
            line += f", workers {_worker_counts(p['workers'])}"
        if p.get("kind") == "executor" and p.get("tasks"):
            line += f", tasks {_task_counts(p['tasks'])}"
        after = p.get("after") or (p.get("policy") or {}).get("after")
        if after:
            line += f", after {' '.join(after)}"
        if p.get("waiting"):
            line += f"; {p['waiting']}"
        out.append(line)
        if p.get("kind") == "executor" and isinstance((p.get("tasks") or {}).get("tenants"), Mapping):
            if tenants := _tenant_counts(p["tasks"]["tenants"]):
                out.append(f"  tenants (queued/running): {tenants}")
    commands = {p["name"]: _command_text(p.get("spec")) for p in data["pools"]}
    if not data["replicas"]:
        out.append("no replicas")
        return "\n".join(out)
    out.append(f"{'ID':<18} {'STATE':<12} {'PID':>7} {'UPTIME':>8} {'RESTARTS':>8} {'CPU%':>6} {'RSS':>8}  COMMAND / REASON")
    for r in data["replicas"]:
        state = r["state"] if not r.get("last_known") else f"({r['state']})"
        cpu, rss = _usage(r["pid"], samples) if d["running"] and r["pid"] else ("", "")
        started = r.get("started_at") or (r.get("created_at") if r["state"] == "RUNNING" else None)
        uptime = duration(now - started) if started and r["ended_at"] is None and d["running"] else ""
        tail = r["reason"] if r["reason"] and r["state"] not in ("RUNNING", "STARTING") else commands.get(r["pool"], "")
        out.append(f"{r['id']:<18} {state:<12} {r['pid'] or '':>7} {uptime:>8} {r.get('restarts', 0):>8} "
                   f"{cpu:>6} {rss:>8}  {tail}")
    return "\n".join(out)


def _task_counts(counts: Mapping[str, int]) -> str:
    """``2 queued, 1 running, 40 done, 3 failed``: done is a result; the other ends (failed,
    cancelled, timed out, lost) are shown apart, each once there is one, as are the tasks
    waiting for a time (``1 waiting``, after running)."""
    text = f"{counts.get('queued', 0)} queued, {counts.get('running', 0)} running"
    if counts.get("waiting"):
        text += f", {counts['waiting']} waiting"
    text += f", {counts.get('done', 0)} done"
    for key in ("failed", "cancelled", "timed_out", "lost"):
        if counts.get(key):
            text += f", {counts[key]} {key.replace('_', ' ')}"
    return text


TENANTS_SHOWN = 8  # a pool's status line names the tenants with the most tasks, up to this many


def _tenant_counts(tenants: Mapping[str, Mapping[str, int]]) -> str:
    """``alice 12/2, bob 0/1, (none) 3/0, 4 more 9/0``: an executor pool's queued and
    running tasks by tenant, the busiest first; empty unless a task has a tenant."""
    if not any(tenants):
        return ""
    rows = sorted(tenants.items(), key=lambda kv: (-(kv[1].get("queued", 0) + kv[1].get("running", 0)), kv[0]))
    parts = [f"{name or '(none)'} {c.get('queued', 0)}/{c.get('running', 0)}" for name, c in rows[:TENANTS_SHOWN]]
    rest = rows[TENANTS_SHOWN:]
    if rest:
        parts.append(f"{len(rest)} more {sum(c.get('queued', 0) for _, c in rest)}/"
                     f"{sum(c.get('running', 0) for _, c in rest)}")
    return ", ".join(parts)


def _worker_counts(counts: Mapping[str, Any]) -> str:
    """``2 busy, 1 idle (min 1, max 3), memory 120 MiB of 512 MiB``: an executor pool's
    workers (starting ones once there are), its size bounds and its memory budget (and the
    workers whose start it holds back, once there are)."""
    text = f"{counts.get('busy', 0)} busy, {counts.get('idle', 0)} idle"
    if counts.get("starting"):
        text += f", {counts['starting']} starting"
    text += f" (min {counts.get('min')}, max {counts.get('max')})"
    budget = counts.get("budget")
    if isinstance(budget, Mapping):
        text += f", memory {budget.get('used', 0) / (1 << 20):.0f} MiB of {budget.get('limit', 0) / (1 << 20):.0f} MiB"
        if budget.get("held"):
            text += f" ({budget['held']} held back by it)"
    return text


# show's keys: what each part of the pool's properties is called (systemd's name where it
# has one); the declared policy is left out of the text, its every value is under effective.
_SPEC_KEYS = {"command": "ExecStart", "target": "Target", "env": "Environment", "cwd": "WorkingDirectory",
              "pythonpath": "PythonPath", "preload": "Preload"}
_SHOW_SKIPPED = ("policy", "spec", "effective", "counts", "after")


def format_show(data: Mapping[str, Any]) -> list[str]:
    """``show POOL``: one ``Key=Value`` line per property, as ``systemctl show`` gives a
    unit's; a list is space-separated, a mapping ``k=v`` pairs, a flag yes or no, nothing empty."""
    lines = [f"{_camel(key)}={_show_value(value)}" for key, value in data.items() if key not in _SHOW_SKIPPED]
    spec = data.get("spec") or {}
    for key, value in spec.items():
        if key == "command":
            import shlex

            lines.append(f"ExecStart={shlex.join(str(v) for v in value)}")
        elif key != "pickled":
            lines.append(f"{_SPEC_KEYS.get(key, _camel(key))}={_show_value(value)}")
    if "pickled" in spec:
        lines.append("Target=(a pickled callable)")
    lines += [f"{_camel(key)}={_show_value(value)}" for key, value in (data.get("effective") or {}).items()]
    lines += [f"Replicas{_camel(state.lower())}={n}" for state, n in (data.get("counts") or {}).items()]
    return lines


def _camel(key: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in key.split("_"))


def _show_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return " ".join(f"{k}={_show_value(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return " ".join(_show_value(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def clock(ts: float | None) -> str:
    """A wall-clock time as the tables and ``events`` show it (local time; ``-`` for none)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts is not None else "-"


def redraw(interval: float, frame: Callable[[], str]) -> int:
    """``--watch``: redraw ``frame()`` in place (cursor home, clear to the end) every
    ``interval`` seconds until Ctrl-C; the exit code (0)."""
    try:
        while True:
            text = frame()
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S  ") + text + "\n")
            sys.stdout.flush()
            time.sleep(interval)  # a terminal's redraw rate, not a wait on the daemon
    except KeyboardInterrupt:
        return 0


def _command_text(spec: Mapping[str, Any] | None) -> str:
    if not spec:
        return ""
    if spec.get("command"):
        return " ".join(spec["command"])
    return spec.get("target") or "<python callable>"


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _usage(pid: int, samples: dict[int, tuple[float, float]] | None) -> tuple[str, str]:
    """CPU% (since the process started, or since the last sample) and RSS of ``pid``."""
    import psutil

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            t = p.cpu_times()
            busy = t.user + t.system
            rss = p.memory_info().rss
            born = p.create_time()
    except psutil.Error:
        return "", ""
    now = time.time()
    last = samples.get(pid) if samples is not None else None
    if samples is not None:
        samples[pid] = (now, busy)
    since, before = last if last is not None else (born, 0.0)
    cpu = 100.0 * (busy - before) / max(now - since, 1e-3)
    return f"{cpu:.1f}", size_text(rss)


def size_text(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}G"
