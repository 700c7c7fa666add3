"""``orchestrator [--state-dir DIR] COMMAND [ARGS]``: argument parsing and output only.

Exit codes (docs/design.md): 0 success; 1 an error (one line on stderr); 3 the daemon is not
running (for commands that need it, and for ``status``/``stop``). ``--json`` output goes
to stdout only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .errors import DaemonNotRunning, OrchestratorError
from .store import KEEP_EVENTS, KEEP_REPLICAS, KEEP_SECONDS

EXIT_OK, EXIT_ERROR, EXIT_NOT_RUNNING = 0, 1, 3


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", default=argparse.SUPPRESS, help="the daemon's directory")
    ap = argparse.ArgumentParser(prog="orchestrator", description="Keep pools of worker processes alive.")
    ap.add_argument("--state-dir", default=None, help="default: $ORCHESTRATOR_STATE_DIR, "
                    "$XDG_STATE_HOME/orchestrator or ~/.local/state/orchestrator")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("start", parents=[common], help="start the daemon")
    p.add_argument("--foreground", action="store_true", help="stay attached (systemd, containers)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--keep-replicas", type=int, default=KEEP_REPLICAS, help="ended replicas kept in state.db")
    p.add_argument("--keep-events", type=int, default=KEEP_EVENTS, help="journal events kept in state.db")
    p.add_argument("--keep-days", type=float, default=KEEP_SECONDS / 86400, help="history older than this is pruned")

    p = sub.add_parser("stop", parents=[common], help="SIGTERM the daemon and wait until it is gone")
    p.add_argument("--timeout", type=float, default=60.0)

    p = sub.add_parser("status", parents=[common], help="the daemon and its replicas")
    p.add_argument("--json", action="store_true")
    p.add_argument("--all", action="store_true", help="include ended replicas")

    p = sub.add_parser("launch", parents=[common], help="add replicas to a pool")
    p.add_argument("--pool", required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--target", help="MODULE:FUNCTION to run instead of a command")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--wait", action="store_true", help="return once every new replica runs")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARG...")

    p = sub.add_parser("terminate", parents=[common], help="stop replicas")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("--wait", action="store_true", help="return once they are reaped")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("scale", parents=[common], help="set a pool's size")
    p.add_argument("pool")
    p.add_argument("n", type=int)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("events", parents=[common], help="the event journal")
    p.add_argument("--json", action="store_true")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--replica")
    p.add_argument("--since", type=float, help="unix time")
    p.add_argument("--limit", type=int, default=None)

    p = sub.add_parser("demo", parents=[common], help="churn, a kill -9 and the clean-up, on defaults")
    p.add_argument("--replicas", type=int, default=20)
    p.add_argument("--seconds", type=float, default=4.0)
    return ap


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
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OrchestratorError(f"--env takes KEY=VALUE, got {item!r}")
        env[key] = value
    with _client(paths) as client:
        ids = client.launch(args.pool, cmd or None, target=args.target, count=args.count, env=env,
                            wait=args.wait, timeout=args.timeout)
    _emit(args, {"ids": ids}, ids)
    return EXIT_OK


def cmd_terminate(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        stopped = client.terminate(*args.ids, wait=args.wait)
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
}
