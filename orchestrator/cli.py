"""``orchestrator [--state-dir DIR] COMMAND [ARGS]``: argument parsing and output only.

Exit codes (docs/design.md): 0 success; 1 an error (one line on stderr); 3 the daemon is not
running (for commands that need it, and for ``status``/``stop``). ``--json`` output goes
to stdout only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

from .errors import DaemonNotRunning, OrchestratorError
from .store import KEEP_EVENTS, KEEP_REPLICAS, KEEP_SECONDS

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds (argparse's float takes nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def _natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2 (``--help`` has the rest)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", default=argparse.SUPPRESS, help="the daemon's directory")
    ap = _Parser(prog="orchestrator", description="Keep pools of worker processes alive.")
    ap.add_argument("--state-dir", default=None, help="default: $ORCHESTRATOR_STATE_DIR, "
                    "$XDG_STATE_HOME/orchestrator or ~/.local/state/orchestrator")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("start", parents=[common], help="start the daemon")
    p.add_argument("--foreground", action="store_true", help="stay attached (systemd, containers)")
    p.add_argument("--grace", type=_seconds, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--keep-replicas", type=_natural, default=KEEP_REPLICAS, help="ended replicas kept in state.db")
    p.add_argument("--keep-events", type=_natural, default=KEEP_EVENTS, help="journal events kept in state.db")
    p.add_argument("--keep-days", type=_positive_seconds, default=KEEP_SECONDS / 86400,
                   help="history older than this many days is pruned")

    p = sub.add_parser("stop", parents=[common], help="SIGTERM the daemon and wait until it is gone")
    p.add_argument("--timeout", type=_seconds, default=60.0)

    p = sub.add_parser("status", parents=[common], help="the daemon and its replicas")
    p.add_argument("--json", action="store_true")
    p.add_argument("--all", action="store_true", help="include ended replicas")

    p = sub.add_parser("launch", parents=[common], help="add replicas to a pool (its spec and policy)")
    p.add_argument("--pool", required=True, help="the pool's name")
    p.add_argument("--count", type=int, default=None, help="replicas to add (default 1; with --replace: the size)")
    p.add_argument("--target", help="MODULE:FUNCTION to run instead of a command")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="an environment addition")
    p.add_argument("--env-file", metavar="FILE", help="KEY=VALUE lines ('#' comments) added to the environment")
    p.add_argument("--cwd", metavar="DIR", help="where the replicas run (default: this directory)")
    p.add_argument("--wait", action="store_true", help="return once every new replica is ready; exit 1 if any failed")
    p.add_argument("--timeout", type=_seconds, default=None, help="bound of --wait, in seconds (default 3600)")
    p.add_argument("--replace", action="store_true", help="roll an existing pool onto this spec and policy")
    _policy_options(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARG...")

    p = sub.add_parser("restart", parents=[common], help="replace replicas with new ones (rolling for a pool)")
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--pool", help="every replica of this pool, a few slots at a time")
    p.add_argument("--max-unavailable", type=int, default=1, help="slots replaced at a time (default 1)")
    p.add_argument("--timeout", type=_seconds, default=600.0, help="give up after this many seconds (default 600)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("delete", parents=[common], help="terminate a pool's replicas and forget the pool")
    p.add_argument("pool")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("signal", parents=[common], help="send a signal to replicas' process trees")
    p.add_argument("sig", metavar="SIG", help="a signal name or number: HUP, USR1, TERM, 9")
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--pool", help="every replica of this pool")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("terminate", parents=[common], help="stop replicas")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("--wait", action="store_true", help="return once they are reaped")
    p.add_argument("--timeout", type=_seconds, default=None, help="bound of --wait, in seconds")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("scale", parents=[common], help="set a pool's size")
    p.add_argument("pool")
    p.add_argument("n", type=int)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("events", parents=[common], help="the event journal")
    p.add_argument("--json", action="store_true")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--replica")
    p.add_argument("--since", type=_seconds, help="only events at or after this unix time")
    p.add_argument("--limit", type=_natural, default=None, help="at most this many (the newest)")

    p = sub.add_parser("demo", parents=[common], help="churn, a kill -9 and the clean-up, on defaults")
    p.add_argument("--replicas", type=_natural, default=20)
    p.add_argument("--seconds", type=_seconds, default=4.0)
    return ap


def _policy_options(p: argparse.ArgumentParser) -> None:
    """The pool policy flags of launch (policy.Policy has the meaning of each)."""
    g = p.add_argument_group("pool policy (docs/design.md, \"Pool policy\")")
    g.add_argument("--restart", choices=("always", "on-failure", "never"), help="replace a replica that "
                   "ended on its own: always, after a failure, or never (default on-failure)")
    g.add_argument("--backoff", metavar="MIN:MAX", help="delay before a replacement, seconds (default 0.1:30)")
    g.add_argument("--healthy-after", type=_seconds, metavar="S", help="RUNNING this long resets the backoff (default 10)")
    g.add_argument("--max-restarts", metavar="N/S", help="more than N replacements within S s: crashloop (default 5/60)")
    g.add_argument("--ready", metavar="PROBE", help="tcp:HOST:PORT, http://127.0.0.1:PORT/PATH, exec:CMD or notify")
    g.add_argument("--ready-timeout", type=_seconds, metavar="S", help="not ready by then: FAILED (default 60)")
    g.add_argument("--start-secs", type=_seconds, metavar="S", help="without --ready: ready once it ran S s (default 0)")
    g.add_argument("--live", metavar="PROBE", help="liveness probe, same forms as --ready")
    g.add_argument("--live-interval", type=_seconds, metavar="S", help="between liveness checks (default 10)")
    g.add_argument("--live-failures", type=int, metavar="N", help="misses in a row that replace it (default 3)")
    g.add_argument("--stop-signal", metavar="SIG", help="how a replica is asked to stop (default TERM)")
    g.add_argument("--grace", type=_seconds, metavar="S", help="stop signal to SIGKILL (default: the daemon's)")
    g.add_argument("--port-base", type=int, metavar="N", help="slot s gets port N+s: {port}, $PORT")


_POLICY_FLAGS = ("restart", "healthy_after", "ready", "ready_timeout", "start_secs", "live", "live_interval",
                 "live_failures", "stop_signal", "grace", "port_base")


def _policy(args: argparse.Namespace) -> dict:
    from .policy import Policy, parse_pair

    wire: dict[str, Any] = {k: getattr(args, k) for k in _POLICY_FLAGS if getattr(args, k) is not None}
    if args.backoff is not None:
        wire["backoff"] = list(parse_pair(args.backoff, ":", "--backoff"))
    if args.max_restarts is not None:
        n, window = parse_pair(args.max_restarts, "/", "--max-restarts")
        if n != int(n):
            raise OrchestratorError(f"--max-restarts takes N/S with a whole N, got {args.max_restarts!r}")
        wire["max_restarts"] = [int(n), window]
    return Policy.from_wire(wire).to_wire()  # refused here, with the same words as the daemon's


def _env_file(path: str) -> dict[str, str]:
    env: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise OrchestratorError(f"--env-file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise OrchestratorError(f"--env-file {path}: not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip():
            raise OrchestratorError(f"--env-file {path}:{number}: expected KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.own_argv = argv is None  # sys.argv is ours: a re-exec of this command line is possible
    from .paths import Paths, check_state_dir, default_state_dir

    paths = Paths(Path(args.state_dir) if args.state_dir else default_state_dir())
    try:
        if args.command != "demo":  # the demo makes a state dir of its own
            # Another user's dir, or one others can write, is refused before anything in it
            # is read; a missing one is fine here (status of a never-used dir: not running).
            check_state_dir(paths, create=False)
        return _COMMANDS[args.command](args, paths)
    except DaemonNotRunning as err:
        print(f"orchestrator: {err}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except OrchestratorError as err:
        print(f"orchestrator: {err}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as err:  # a file of the state dir we may not read, a full disk: one line
        where = f": {err.filename}" if err.filename else ""
        print(f"orchestrator: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def _emit(args: argparse.Namespace, data: Any, lines: Sequence[str] = ()) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data))
    else:
        for line in lines:
            print(line)


def _client(paths: Any) -> Any:
    from .channel import Client

    return Client(paths.state_dir)


def cmd_start(args: argparse.Namespace, paths: Any) -> int:
    from . import daemon

    retention = {"keep_replicas": args.keep_replicas, "keep_events": args.keep_events,
                 "keep_seconds": args.keep_days * 86400}
    if args.foreground:
        if args.own_argv:
            daemon.reexec_with_token()  # returns only if the token is there already
        return daemon.run_foreground(paths, grace=args.grace, ready_fd=args.ready_fd, retention=retention)
    pid = daemon.start_detached(paths, ["--grace", str(args.grace), "--keep-replicas", str(args.keep_replicas),
                                        "--keep-events", str(args.keep_events), "--keep-days", str(args.keep_days)])
    print(pid)
    return EXIT_OK


def cmd_stop(args: argparse.Namespace, paths: Any) -> int:
    from . import daemon

    code = daemon.stop(paths, timeout=args.timeout)
    if code == EXIT_NOT_RUNNING:
        print(f"orchestrator: no daemon is running for {paths.state_dir}", file=sys.stderr)
    elif code == EXIT_ERROR:
        print(f"orchestrator: the daemon did not stop within {args.timeout:g} s", file=sys.stderr)
    return code


def cmd_status(args: argparse.Namespace, paths: Any) -> int:
    from .paths import running_pid

    code = EXIT_OK
    data = None
    if running_pid(paths) is not None:
        try:
            with _client(paths) as client:
                data = client.status(all=args.all)
        except DaemonNotRunning:
            data = None
    if data is None:
        code = EXIT_NOT_RUNNING
        data = {"daemon": {"running": False, "pid": None, "watchdog_pid": None, "manager_pid": None,
                           "started_at": None}, **_stored_status(paths, args.all)}
    data = {"state_dir": str(paths.state_dir), **data}
    if args.json:
        print(json.dumps(data))
    else:
        print(_format_status(data))
    return code


def _stored_status(paths: Any, include_terminal: bool) -> dict:
    if not paths.db.exists():
        return {"pools": [], "replicas": []}
    store = _open_store_readonly(paths)
    try:
        pools = [{"name": p["name"], "desired": p["desired"]} for p in store.pools()]
        return {"pools": pools, "replicas": store.replicas(include_terminal=include_terminal)}
    finally:
        store.close()


def _open_store_readonly(paths: Any) -> Any:
    """The journal for a reader (the daemon may be down); a bad file is a one-line error."""
    from .store import Store, StoreError

    try:
        return Store(paths.db, readonly=True)
    except StoreError as err:
        raise OrchestratorError(str(err)) from None


def _format_status(data: dict) -> str:
    d = data["daemon"]
    if d["running"]:
        head = f"daemon: running (pid {d['pid']}, watchdog {d['watchdog_pid']}, manager {d['manager_pid']})"
    else:
        head = "daemon: not running (from the store)"
    out = [f"{head}  state dir: {data['state_dir']}"]
    if data["pools"]:
        out.append("pools: " + ", ".join(f"{p['name']}={p['desired']}" for p in data["pools"]))
    if data["replicas"]:
        out.append(f"{'ID':<20} {'STATE':<12} {'PID':>8}  REASON")
        for r in data["replicas"]:
            pid = "" if r["pid"] is None else r["pid"]
            out.append(f"{r['id']:<20} {r['state']:<12} {pid:>8}  {r['reason'] or ''}")
    else:
        out.append("no replicas")
    return "\n".join(out)


def cmd_launch(args: argparse.Namespace, paths: Any) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if args.target and cmd:
        raise OrchestratorError("give either --target MODULE:FUNCTION or -- CMD ARG..., not both")
    if not args.target and not cmd:
        raise OrchestratorError("nothing to run: give -- CMD ARG... or --target MODULE:FUNCTION")
    env = _env_file(args.env_file) if args.env_file else {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OrchestratorError(f"--env takes KEY=VALUE, got {item!r}")
        env[key] = value
    policy = _policy(args)
    with _client(paths) as client:
        try:
            ids = client.launch(args.pool, cmd or None, target=args.target, count=args.count, env=env,
                                wait=args.wait, timeout=args.timeout, cwd=args.cwd, policy=policy,
                                replace=args.replace)
        except OrchestratorError as err:  # a wait that timed out still made replicas: say which
            made = err.data.get("ids") if isinstance(err.data, dict) else None
            if made:
                _emit(args, {"ids": made, "error": str(err)}, made)
            raise
        failed = []
        if args.wait:
            states = {r["id"]: r for r in client.status(all=True)["replicas"] if r["id"] in set(ids)}
            failed = [states[i] for i in ids if i in states and states[i]["state"] != "RUNNING"]
    _emit(args, {"ids": ids, "failed": [r["id"] for r in failed]}, ids)
    for r in failed:
        print(f"orchestrator: {r['id']} {r['state']}: {r['reason'] or 'not ready'}", file=sys.stderr)
    return EXIT_ERROR if failed else EXIT_OK


def cmd_restart(args: argparse.Namespace, paths: Any) -> int:
    if bool(args.ids) == bool(args.pool):
        raise OrchestratorError("give either replica ids or --pool POOL")
    with _client(paths) as client:
        result = client.restart(*args.ids, pool=args.pool, max_unavailable=args.max_unavailable,
                                timeout=args.timeout)
    _emit(args, result, [f"{old} -> {new}" for old, new in result["replaced"].items()])
    return EXIT_OK


def cmd_delete(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        result = client.delete(args.pool)
    _emit(args, result, [f"deleted pool {result['pool']}"] + [f"terminating {i}" for i in result["terminated"]])
    return EXIT_OK


def cmd_signal(args: argparse.Namespace, paths: Any) -> int:
    if bool(args.ids) == bool(args.pool):
        raise OrchestratorError("give either replica ids or --pool POOL")
    with _client(paths) as client:
        result = client.signal(args.sig, *args.ids, pool=args.pool)
    _emit(args, result, [f"{result['signal']} -> {i}" for i in result["sent"]])
    return EXIT_OK


def cmd_terminate(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        stopped = client.terminate(*args.ids, wait=args.wait, timeout=args.timeout)
    _emit(args, {"terminated": stopped}, stopped)
    return EXIT_OK


def cmd_scale(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        result = client.scale(args.pool, args.n)
    _emit(args, result, [f"{result['pool']}: desired {result['desired']}"]
          + [f"launched {i}" for i in result["launched"]] + [f"terminating {i}" for i in result["terminated"]])
    return EXIT_OK


def cmd_events(args: argparse.Namespace, paths: Any) -> int:
    if not paths.db.exists() and not args.follow:
        return EXIT_OK
    store = _open_store_readonly(paths)  # with --follow, it picks the file up once it appears
    try:
        seq = 0
        rows = store.events(replica=args.replica, since=args.since, limit=args.limit)
        while True:
            for ev in rows:
                seq = ev["seq"]
                if args.json:
                    print(json.dumps(ev), flush=args.follow)
                else:
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ev["ts"]))
                    who = ev["replica"] or "-"
                    print(f"{ev['seq']:>8} {when} {ev['kind']:<10} {who:<16} {json.dumps(ev['data'])}",
                          flush=args.follow)
            if not args.follow:
                return EXIT_OK
            time.sleep(0.2)  # a reader of another process's file: there is no event to wait on
            rows = store.events(replica=args.replica, since=args.since, after_seq=seq)
    finally:
        store.close()


def cmd_demo(args: argparse.Namespace, paths: Any) -> int:
    from .demo import run_demo

    return run_demo(replicas=args.replicas, seconds=args.seconds)


_COMMANDS = {
    "start": cmd_start,
    "stop": cmd_stop,
    "status": cmd_status,
    "launch": cmd_launch,
    "terminate": cmd_terminate,
    "scale": cmd_scale,
    "events": cmd_events,
    "demo": cmd_demo,
    "restart": cmd_restart,
    "delete": cmd_delete,
    "signal": cmd_signal,
}
