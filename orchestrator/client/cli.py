"""``orchestrator [--state-dir DIR] COMMAND [ARGS]``: argument parsing and output only.

Client side: it runs in a user's shell, and imports at module level only what every process
shares (errors, paths, retention's defaults, version) and its own light modules (argtypes,
logcli's parser, taskcli's parsers). What one command needs is imported in that command: ``start`` the daemon
(control.py spawns it, or daemon/main.py runs it in the foreground), ``status`` the channel
and the table (display.py), ``logs`` its readers, so that ``--version``, ``status`` or ``health`` in a script or an exec probe start fast.

Exit codes (docs/design.md): 0 success; 1 an error (one line on stderr); 2 a usage error,
argparse's or one found after it (``UsageError``: two things where one is wanted, none where one is
needed), one line either way; 3 the daemon is not running (for commands that need it, and for
``status``/``stop``). ``is-active POOL`` exits as systemctl's does: 0 active, 3 not (or no
daemon), 4 no such pool.
``--json`` output goes to stdout only.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

from ..errors import DaemonNotRunning, OrchestratorError, UnknownReplica, UsageError
from ..paths import Paths, read_env_file
from ..retention import KEEP_EVENTS, KEEP_REPLICAS, KEEP_SECONDS
from ..version import __version__
from .argtypes import natural as _natural
from .argtypes import port as _port
from .argtypes import result_size as _size
from .argtypes import positive_seconds as _positive_seconds
from .argtypes import seconds as _seconds
from .logcli import add_parser as _add_logs_parser
from .logcli import cmd_logs
from .taskcli import COMMANDS as _TASK_COMMANDS
from .taskcli import add_parsers as _add_task_parsers

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3
EXIT_NO_SUCH_POOL = 4  # is-active's, as systemctl's for a unit it does not know
POOL_WAIT = 120.0  # stop/start POOL wait this long for the replicas by default (a ready probe's 60 s, and more)
_SHELLS = ("bash", "zsh")  # completion.SHELLS, which is not imported for every command
# The hidden first word the completion scripts run for names (client/completion.py); not a
# verb of the parser, so neither the scripts nor the man page offer it.
COMPLETE_NAMES = "__complete"
# Commands that read no state dir: an unsafe or missing one is not their business.
_NO_STATE_DIR = ("demo", "import", "completion")


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2 (``--help`` has the rest)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)  # the parent of every command (its class: what add_parser expects)
    common.add_argument("--state-dir", default=argparse.SUPPRESS, help="the daemon's directory")
    ap = _Parser(prog="orchestrator", description="Keep pools of worker processes alive.")
    ap.add_argument("--state-dir", default=None, help="default: $ORCHESTRATOR_STATE_DIR, "
                    "$XDG_STATE_HOME/orchestrator or ~/.local/state/orchestrator")
    ap.add_argument("--version", action="version", version=f"orchestrator {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("start", parents=[common], help="start the daemon; with POOL...: start those stopped pools "
                       "of the running daemon again, back to their size",
                       description="Without a POOL: start the daemon (the flags below). With POOL...: bring "
                       "those pools, stopped by `stop POOL`, back to their size, and wait until their "
                       "replicas run (exit 1 if one failed), as systemctl start does.")
    p.add_argument("pools", nargs="*", metavar="POOL", help="pools of the running daemon to start (no daemon flag then)")
    p.add_argument("--no-block", action="store_true", help="with POOL: return once launched, not once running")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help=f"with POOL: give up waiting after this many seconds (default {POOL_WAIT:g})")
    p.add_argument("--json", action="store_true", help="with POOL: the result as one JSON object")
    p.add_argument("--foreground", action="store_true", help="stay attached (systemd, containers)")
    p.add_argument("--config", metavar="FILE", help="pools and [daemon] settings from this TOML file")
    p.add_argument("--grace", type=_seconds, help="seconds from a replica's stop signal to SIGKILL (default 5)")
    p.add_argument("--stop-budget", type=_positive_seconds, metavar="S",
                   help="a stop (SIGTERM) finishes within this many seconds, graces cut to fit (default 30)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT", help="serve /metrics on 127.0.0.1:PORT (default: off)")
    p.add_argument("--http", action="append", metavar="ADDR", help="serve the HTTP control plane on unix:PATH or "
                   "tcp://HOST:PORT (repeatable; off: none; default unix:http.sock in the state dir)")
    p.add_argument("--http-token-file", metavar="FILE", help="the token TCP clients send (Authorization: Bearer)")
    p.add_argument("--http-read-token-file", metavar="FILE", help="a token that may only read")
    p.add_argument("--cgroup", metavar="auto|off|PATH", help="a cgroup per replica: auto (where this host allows it, "
                   "else process groups), off, or under the cgroup2 dir PATH (default auto)")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--keep-replicas", type=_natural, help=f"ended replicas kept in state.db (default {KEEP_REPLICAS})")
    p.add_argument("--keep-events", type=_natural, help=f"journal events kept in state.db (default {KEEP_EVENTS})")
    p.add_argument("--result-max-bytes", type=_size, metavar="BYTES",
                   help="a task's result larger than this fails the task (default 16M)")
    p.add_argument("--keep-days", type=_positive_seconds,
                   help=f"history older than this many days is pruned (default {KEEP_SECONDS / 86400:g})")

    p = sub.add_parser("stop", parents=[common], help="SIGTERM the daemon and wait until it is gone; with POOL...: "
                       "stop those pools' replicas and keep the pools stopped",
                       description="Without a POOL: stop the daemon (its pools come back at its next start). "
                       "With POOL...: stop those pools' replicas as `scale 0` would (each pool's stop signal, "
                       "SIGKILL after its grace) and wait until they have ended; the pools keep their size and "
                       "spec, show as stopped, and stay stopped across daemon restarts, upgrades and reloads "
                       "until `start POOL`.")
    p.add_argument("pools", nargs="*", metavar="POOL", help="pools to stop (the daemon keeps running)")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="give up waiting after this many seconds (default 60 for the daemon, "
                   f"{POOL_WAIT:g} for pools)")
    p.add_argument("--no-block", action="store_true", help="with POOL: return once the stop is asked, not ended")
    p.add_argument("--json", action="store_true", help="with POOL: the result as one JSON object")

    p = sub.add_parser("show", parents=[common], help="every property of a pool, as Key=Value lines",
                       description="Every property of a pool, as systemctl show gives a unit's: its state, "
                       "size and counts, what it runs, its policy with every default resolved (the "
                       "daemon's grace and log rotation where the pool sets none), its order and sockets.")
    p.add_argument("pool", metavar="POOL")
    p.add_argument("--json", action="store_true", help="one JSON object (the policy as declared too)")

    p = sub.add_parser("is-active", parents=[common], help="exit 0 if the pool is ok, 3 if not, 4 if no such pool",
                       description="For scripts: exit 0 when every replica of the pool's size is RUNNING "
                       "(ready), it is not stopped, no replacement waits for a backoff and nothing failed "
                       "(a crash loop, a failed replica not replaced); 3 otherwise, or when no daemon "
                       "runs; 4 when the daemon has no such pool (one line on stderr). Nothing is printed "
                       "unless asked: -v prints the state (active, activating, deactivating, inactive, "
                       "failed), --json an object.")
    p.add_argument("pool", metavar="POOL")
    p.add_argument("-v", "--verbose", action="store_true", help="print the state word")
    p.add_argument("--json", action="store_true", help='print {"pool", "active", "state"}')

    p = sub.add_parser("reset-failed", parents=[common], help="forget pools' crash loops and restart counters, "
                       "and start their failed replicas again",
                       description="Clear each pool's crash loop, failed slots, backoff and restart "
                       "counters, and bring it back to its size with the failed slots filled again (a "
                       "stopped pool stays stopped: its size is what start brings back).")
    p.add_argument("pools", nargs="+", metavar="POOL")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("reload", parents=[common], help="re-read the config file and apply the difference")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("upgrade", parents=[common],
                       help="make the daemon re-execute itself on the code installed now, keeping its replicas")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("health", parents=[common], help="exit 0 only if the daemon, its watchdog and manager "
                       "live and the loop answers within 1 s")
    p.add_argument("--json", action="store_true")

    sub.add_parser("metrics", parents=[common], help="the daemon's metrics, Prometheus text format")
    _add_logs_parser(sub, common)

    p = sub.add_parser("status", parents=[common], help="the daemon and its replicas")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--all", action="store_true", help="include ended replicas")
    p.add_argument("--watch", action="store_true", help="a live table, redrawn in place, until Ctrl-C")
    p.add_argument("--interval", type=_positive_seconds, default=1.0, help="seconds between redraws (default 1)")

    p = sub.add_parser("launch", parents=[common], help="add replicas to a pool (its spec and policy)")
    p.add_argument("--pool", required=True, help="the pool's name")
    p.add_argument("--count", type=int, default=None, help="replicas to add (default 1; with --replace: the size)")
    p.add_argument("--target", help="MODULE:FUNCTION to run instead of a command")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="an environment addition")
    p.add_argument("--env-file", metavar="FILE", help="KEY=VALUE lines ('#' comments) added to the environment")
    p.add_argument("--cwd", metavar="DIR", help="where the replicas run (default: this directory)")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE",
                   help="import MODULE once in the pool's spawner, so each replica of a --target starts warm")
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

    p = sub.add_parser("scale", parents=[common], help="set a pool's size (of a stopped pool: nothing starts "
                       "until start POOL)")
    p.add_argument("pool")
    p.add_argument("n", type=int)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("events", parents=[common], help="the event journal")
    p.add_argument("--json", action="store_true")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--replica")
    p.add_argument("--since", type=_seconds, help="only events at or after this unix time")
    p.add_argument("--limit", type=_natural, default=None, help="at most this many (the newest)")

    _add_task_parsers(sub, common)

    sub.add_parser("top", parents=[common], help="a live view of pools, replicas, tasks, logs and events, "
                   "with keys to act on them (the tui extra)")

    p = sub.add_parser("demo", parents=[common], help="churn, a kill -9 and the clean-up, on defaults")
    p.add_argument("--replicas", type=_natural, default=20)
    p.add_argument("--seconds", type=_seconds, default=4.0)

    p = sub.add_parser("import", help="print a Procfile (foreman's, honcho's) as the config file that "
                       "start --config runs", description="One pool per process type, each run by /bin/sh "
                       "-c; $PORT as {port} with port_base 5000, 5100, ... (foreman's convention); the env "
                       "file as each pool's env_file; the Procfile's directory as their cwd.")
    p.add_argument("procfile", metavar="PROCFILE", help="the Procfile to read")
    p.add_argument("--env", metavar="FILE", help="the env file (KEY=VALUE lines) of every pool "
                   "(default: .env beside the Procfile, if there is one)")
    p.add_argument("--port-base", type=_port, metavar="N",
                   help="the first process type's port (default: PORT of the env file, else 5000)")

    p = sub.add_parser("completion", help="print a bash or zsh completion script",
                       description="Every verb and flag, and the pools and replicas of the running daemon "
                       "(the completion extra). bash: source <(orchestrator completion bash); zsh, after "
                       "compinit: eval \"$(orchestrator completion zsh)\", or save it as _orchestrator in $fpath.")
    p.add_argument("shell", choices=_SHELLS)
    return ap


def parser() -> argparse.ArgumentParser:
    """The command line's parser: what the completion scripts and the man page are made from."""
    return _parser()


def _policy_options(p: argparse.ArgumentParser) -> None:
    """The pool policy flags of launch (policy.Policy has the meaning of each)."""
    g = p.add_argument_group("pool policy (docs/design.md, \"Pools, policies and slots\")")
    g.add_argument("--restart", choices=("always", "on-failure", "never"), help="replace a replica that "
                   "ended on its own: always, after a failure, or never (default on-failure)")
    g.add_argument("--backoff", metavar="MIN:MAX", help="delay before a replacement, seconds (default 0.1:30)")
    g.add_argument("--healthy-after", type=_seconds, metavar="S", help="RUNNING this long resets the backoff (default 10)")
    g.add_argument("--max-restarts", metavar="N/S", help="more than N replacements within S s: crashloop (default 5/60)")
    g.add_argument("--ready", metavar="PROBE", help="tcp:HOST:PORT, http://127.0.0.1:PORT/PATH, exec:CMD or notify")
    g.add_argument("--ready-timeout", type=_seconds, metavar="S", help="not ready by then: FAILED (default 60)")
    g.add_argument("--probe-timeout", type=_seconds, metavar="S",
                   help="one attempt of --ready or --live is cut after S s (default 1)")
    g.add_argument("--start-secs", type=_seconds, metavar="S", help="without --ready: ready once it ran S s (default 0)")
    g.add_argument("--live", metavar="PROBE", help="liveness probe, same forms as --ready")
    g.add_argument("--live-interval", type=_seconds, metavar="S", help="between liveness checks (default 10)")
    g.add_argument("--live-failures", type=int, metavar="N", help="misses in a row that replace it (default 3)")
    g.add_argument("--stop-signal", metavar="SIG", help="how a replica is asked to stop (default TERM)")
    g.add_argument("--grace", type=_seconds, metavar="S", help="stop signal to SIGKILL (default: the daemon's)")
    g.add_argument("--port-base", type=int, metavar="N", help="slot s gets port N+s: {port}, $PORT")
    g.add_argument("--socket", dest="sockets", action="append", metavar="ADDR",
                   help="tcp://HOST:PORT, unix:/PATH or fd:NAME: the daemon listens, every replica gets it "
                   "as fd 3, 4, ... (LISTEN_FDS, as systemd passes them); repeatable")
    g.add_argument("--memory-max", metavar="BYTES", help="cgroup memory.max of each replica: bytes or 512M, 2G")
    g.add_argument("--pids-max", type=int, metavar="N", help="cgroup pids.max of each replica")
    g.add_argument("--cpu-weight", type=int, metavar="W", help="cgroup cpu.weight of each replica, 1..10000")
    # Strings, checked by Policy: a bad value is one line and exit 1, as from a config file.
    g.add_argument("--log-max-bytes", metavar="N", help="rotate each replica's .out/.err at this size: bytes or "
                   "20K, 10M; at least 16K (default: the daemon's, 10M)")
    g.add_argument("--log-backups", metavar="K", help="rotated files kept per stream, 0..100 "
                   "(default: the daemon's, 3)")
    g.add_argument("--after", action="append", metavar="POOL[:ready|started|completed]",
                   help="start only once POOL is ready (default), started, or completed (its replicas "
                   "exited 0); repeatable")


_POLICY_FLAGS = ("restart", "healthy_after", "ready", "ready_timeout", "start_secs", "live", "live_interval",
                 "live_failures", "stop_signal", "grace", "port_base", "memory_max", "pids_max", "cpu_weight",
                 "probe_timeout", "sockets")


def _policy(args: argparse.Namespace) -> dict[str, Any]:
    from ..policy import Policy, parse_pair

    wire: dict[str, Any] = {k: getattr(args, k) for k in _POLICY_FLAGS if getattr(args, k) is not None}
    if args.backoff is not None:
        wire["backoff"] = list(parse_pair(args.backoff, ":", "--backoff"))
    if args.max_restarts is not None:
        n, window = parse_pair(args.max_restarts, "/", "--max-restarts")
        if n != int(n):
            raise OrchestratorError(f"--max-restarts takes N/S with a whole N, got {args.max_restarts!r}")
        wire["max_restarts"] = [int(n), window]
    if args.log_max_bytes is not None:
        wire["log_max_bytes"] = args.log_max_bytes  # "20000" or "20K": Policy reads either
    if args.log_backups is not None:
        try:
            wire["log_backups"] = int(args.log_backups)
        except ValueError:
            wire["log_backups"] = args.log_backups  # refused by Policy, in its words
    if args.after:
        wire["after"] = args.after
    return Policy.from_wire(wire).to_wire()  # refused here, with the same words as the daemon's


def _env_file(path: str) -> dict[str, str]:
    try:
        return read_env_file(path, trusted=False)  # read with the caller's own rights
    except OrchestratorError as err:
        raise OrchestratorError(f"--env-file {err}") from None


class _ClosedStdout(io.TextIOBase):
    """stdout when fd 1 was closed (``>&-``): a write fails as it would on the fd, so a
    command that has something to say ends with one line, and a ``--watch`` ends at all."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "cannot write to standard output: it is closed")


def _standard_fds() -> None:
    """Give a closed fd 0, 1 or 2 /dev/null, so that no file or socket opened later lands
    there (a child would inherit it as its stdout); a closed stdout is remembered as one."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()


def _silence_stdout() -> None:
    """What stdout still buffers cannot be written (its reader is gone, the disk is full):
    point fd 1 at /dev/null, so the flush at exit neither fails nor prints a traceback."""
    try:
        sys.stdout.flush()
        return
    except OSError:
        pass
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    os.dup2(null, 1)
    os.close(null)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Whatever it raises on purpose, and every failure to write its
    output (a closed stdout, a reader that exited, a full disk), ends as an exit code and at
    most one line on stderr, never a traceback."""
    _standard_fds()
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == [COMPLETE_NAMES]:
        from .completion import main_names

        return main_names(words[1:])
    try:
        return _main(argv)
    except BrokenPipeError:  # `| head`: the reader has all it wanted; no traceback, no noise
        return EXIT_OK
    except OSError as err:  # stdout closed or full, a state dir file we may not read: one line
        where = f": {err.filename}" if err.filename else ""
        print(f"orchestrator: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        _silence_stdout()


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    args.own_argv = argv is None  # sys.argv is ours: a re-exec of this command line is possible
    from ..paths import Paths, check_state_dir, default_state_dir

    paths = Paths(Path(args.state_dir) if args.state_dir else default_state_dir())
    try:
        if args.command not in _NO_STATE_DIR:  # the demo makes a state dir of its own
            # Another user's dir, or one others can write, is refused before anything in it
            # is read; a missing one is fine here (status of a never-used dir: not running).
            check_state_dir(paths, create=False)
        code = _COMMANDS[args.command](args, paths)
        sys.stdout.flush()  # here, where a failure is caught, not in the interpreter's exit
        return code
    except DaemonNotRunning as err:
        print(f"orchestrator: {err}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except UsageError as err:  # as argparse says its own (_Parser.error), for this command
        prog = f"orchestrator {args.command}"
        print(f"{prog}: error: {err} (see {prog} --help)", file=sys.stderr)
        return EXIT_USAGE
    except OrchestratorError as err:
        print(f"orchestrator: {err}", file=sys.stderr)
        return EXIT_ERROR


def _emit(args: argparse.Namespace, data: Any, lines: Sequence[str] = ()) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data))
    else:
        for line in lines:
            print(line)


def _client(paths: Any, timeout: float | None = None) -> Any:
    from .channel import Client

    return Client(paths.state_dir) if timeout is None else Client(paths.state_dir, timeout=timeout)


# start's settings: flag -> Daemon keyword (only the ones given are passed on, so that a
# config file's [daemon] table fills in the rest)
_START_SETTINGS = {"--grace": "grace", "--stop-budget": "stop_budget", "--metrics-port": "metrics_port",
                   "--config": "config_path", "--cgroup": "cgroup", "--result-max-bytes": "result_max_bytes",
                   "--http": "http", "--http-token-file": "http_token_file",
                   "--http-read-token-file": "http_read_token_file"}
UPGRADE_TIMEOUT = 120.0  # the check (imports), the drain of ended replicas' cgroups, the exec and the take-over
_RETENTION = {"--keep-replicas": "keep_replicas", "--keep-events": "keep_events", "--keep-days": "keep_days"}


def cmd_start(args: argparse.Namespace, paths: Paths) -> int:
    from . import control

    if args.pools:
        return _start_pools(args, paths)
    if args.no_block or args.timeout is not None or args.json:
        raise UsageError("--no-block, --timeout and --json are for start POOL...")

    if args.config is not None:
        from ..daemon import config as config_file

        args.config = os.path.abspath(args.config)
        config_file.load(args.config)  # an invalid file: one line here, before anything starts
    for flag in ("http_token_file", "http_read_token_file"):  # the daemon runs in /: absolute paths
        if getattr(args, flag) is not None:
            setattr(args, flag, os.path.abspath(getattr(args, flag)))
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in (*_START_SETTINGS, *_RETENTION)}
    given = {flag: value for flag, value in given.items() if value is not None}
    if args.foreground:
        if args.own_argv:
            control.reexec_with_token()  # returns only if the token is there already
        from ..daemon import main as daemon  # this process becomes the daemon: only now is it loaded

        settings = {_START_SETTINGS[f]: v for f, v in given.items() if f in _START_SETTINGS}
        kept = {_RETENTION[f]: v for f, v in given.items() if f in _RETENTION}
        if kept:
            settings["retention"] = {"keep_replicas": kept.get("keep_replicas", KEEP_REPLICAS),
                                     "keep_events": kept.get("keep_events", KEEP_EVENTS),
                                     "keep_seconds": kept.get("keep_days", KEEP_SECONDS / 86400) * 86400}
        return daemon.run_foreground(paths, ready_fd=args.ready_fd, **settings)
    pid = control.start_detached(paths, [item for flag, value in given.items()
                                         for one in (value if isinstance(value, list) else [value])
                                         for item in (flag, str(one))])
    print(pid)
    return EXIT_OK


def cmd_reload(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        done = client.call("reload")
    _emit(args, done, [f"{what}: {', '.join(names)}" for what, names in done.items() if names])
    return EXIT_OK


def cmd_upgrade(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths, timeout=UPGRADE_TIMEOUT) as client:
        done = client.call("upgrade", timeout=UPGRADE_TIMEOUT)
    _emit(args, done, [f"upgraded: daemon {done['pid']} runs {done['to']} (was {done['from']}); "
                       f"{done['replicas']} replica(s) kept"])
    return EXIT_OK


def cmd_health(args: argparse.Namespace, paths: Any) -> int:
    from ..errors import ChannelError
    from .channel import manager_down
    from .display import format_health

    try:
        with _client(paths, timeout=1.0) as client:
            info = client.call("health", timeout=1.0)
    except ChannelError as err:
        reason = manager_down(paths)
        if reason is not None:  # nobody answers because the manager is down: say why
            info = {"healthy": False, "parts": {"daemon": True, "manager": False}, "failed": ["manager"],
                    "lag": None, "reason": reason, "error": str(err)}
        else:  # the loop did not answer within 1 s: that is the failure
            info = {"healthy": False, "parts": {"loop": False}, "failed": ["loop"], "lag": None, "error": str(err)}
    ok = bool(info.get("healthy"))
    if args.json:
        print(json.dumps(info))
    elif "reason" in info:
        print(f"unhealthy: manager down ({info['reason']})")
    else:
        print(format_health(ok, info) if "error" not in info else f"unhealthy: {info['error']}")
    return EXIT_OK if ok else EXIT_ERROR


def cmd_metrics(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        sys.stdout.write(client.call("metrics"))
    return EXIT_OK


def cmd_stop(args: argparse.Namespace, paths: Paths) -> int:
    from . import control

    if args.pools:
        return _stop_pools(args, paths)
    if args.no_block or args.json:
        raise UsageError("--no-block and --json are for stop POOL...")
    timeout = 60.0 if args.timeout is None else args.timeout
    code = control.stop(paths, timeout=timeout)
    if code == EXIT_NOT_RUNNING:
        print(f"orchestrator: no daemon is running for {paths.state_dir}", file=sys.stderr)
    elif code == EXIT_ERROR:
        print(f"orchestrator: the daemon did not stop within {timeout:g} s", file=sys.stderr)
    return code


# -- systemctl's verbs on pools ------------------------------------------------------------

_DAEMON_FLAGS = ("foreground", "config", "grace", "stop_budget", "metrics_port", "http", "http_token_file",
                 "http_read_token_file", "cgroup", "ready_fd", "keep_replicas", "keep_events",
                 "result_max_bytes", "keep_days")


def _start_pools(args: argparse.Namespace, paths: Any) -> int:
    given = [f"--{name.replace('_', '-')}" for name in _DAEMON_FLAGS if getattr(args, name) not in (None, False)]
    if given:
        raise UsageError(f"{', '.join(given)} start the daemon; start POOL... starts pools of a running daemon")
    wait = not args.no_block
    timeout = POOL_WAIT if args.timeout is None else args.timeout
    with _client(paths) as client:
        result = client.start_pools(*args.pools, wait=wait, timeout=timeout)
        failed = []
        if wait and result["launched"]:
            launched = set(result["launched"])
            failed = [r for r in client.status(all=True)["replicas"] if r["id"] in launched and r["state"] != "RUNNING"]
    started = set(result["started"])
    _emit(args, {**result, "failed": [r["id"] for r in failed]},
          [f"started pool {name}" if name in started else f"{name}: not stopped, left as it is"
           for name in dict.fromkeys(args.pools)] + [f"launched {i}" for i in result["launched"]])
    for r in failed:
        print(f"orchestrator: {r['id']} {r['state']}: {r['reason'] or 'not ready'}", file=sys.stderr)
    return EXIT_ERROR if failed else EXIT_OK


def _stop_pools(args: argparse.Namespace, paths: Any) -> int:
    wait = not args.no_block
    with _client(paths) as client:
        result = client.stop_pools(*args.pools, wait=wait, timeout=POOL_WAIT if args.timeout is None else args.timeout)
    _emit(args, result, [f"stopped pool {name}" for name in result["stopped"]]
          + [f"terminating {i}" for i in result["terminating"]])
    return EXIT_OK


def cmd_show(args: argparse.Namespace, paths: Any) -> int:
    from .display import format_show

    with _client(paths) as client:
        data = client.show(args.pool)
    _emit(args, data, format_show(data))
    return EXIT_OK


def cmd_is_active(args: argparse.Namespace, paths: Any) -> int:
    from ..errors import UnknownPool

    try:
        with _client(paths) as client:
            info = client.call("is_active", {"pool": args.pool})
    except UnknownPool as err:
        print(f"orchestrator: {err}", file=sys.stderr)
        return EXIT_NO_SUCH_POOL
    if args.json:
        print(json.dumps(info))
    elif args.verbose:
        print(info["state"])
    return EXIT_OK if info["active"] else EXIT_NOT_RUNNING


def cmd_reset_failed(args: argparse.Namespace, paths: Any) -> int:
    with _client(paths) as client:
        result = client.reset_failed(*args.pools)
    _emit(args, result, [f"reset pool {name}" for name in result["reset"]]
          + [f"launched {i}" for i in result["launched"]])
    return EXIT_OK


def cmd_status(args: argparse.Namespace, paths: Any) -> int:
    if args.watch:
        return _watch(args, paths)
    code, data = _status(args, paths)
    if args.json:
        print(json.dumps(data))
    else:
        from .display import format_status

        print(format_status(data))
    return code


def _watch(args: argparse.Namespace, paths: Any) -> int:
    """Redraw the table in place until Ctrl-C (CPU% since the last redraw)."""
    from .display import format_status, redraw

    samples: dict[int, tuple[float, float]] = {}

    def frame() -> str:
        _, data = _status(args, paths)
        return format_status(data, samples=samples, health=_health_line(paths, data))

    return redraw(args.interval, frame)


def _health_line(paths: Any, data: dict[str, Any]) -> str:
    if not data["daemon"]["running"]:
        return "health: daemon not running"
    from .display import format_health

    try:
        with _client(paths, timeout=1.0) as client:
            info = client.call("health", timeout=1.0)
    except OrchestratorError as err:
        return f"health: {err}"
    return "health: " + format_health(bool(info.get("healthy")), info)


def _status(args: argparse.Namespace, paths: Any) -> tuple[int, dict[str, Any]]:
    from ..paths import running_pid
    from .display import stored_status

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
                           "started_at": None}, **stored_status(paths, args.all)}
        for rep in data["replicas"]:
            rep["last_known"] = True  # what the store last heard, not what runs now
    return code, {"state_dir": str(paths.state_dir), **data}


def cmd_launch(args: argparse.Namespace, paths: Any) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if args.target and cmd:
        raise UsageError("give either --target MODULE:FUNCTION or -- CMD ARG..., not both")
    if not args.target and not cmd:
        raise UsageError("nothing to run: give -- CMD ARG... or --target MODULE:FUNCTION")
    given: dict[str, str] = {}
    for item in args.env:  # checked first: a usage error is told before any file is read
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env takes KEY=VALUE, got {item!r}")
        given[key] = value
    env = {**(_env_file(args.env_file) if args.env_file else {}), **given}  # --env wins over the file
    policy = _policy(args)
    with _client(paths) as client:
        try:
            ids = client.launch(args.pool, cmd or None, target=args.target, count=args.count, env=env,
                                wait=args.wait, timeout=args.timeout, cwd=args.cwd, policy=policy,
                                replace=args.replace, preload=[m for arg in args.preload for m in arg.split(",") if m])
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
        raise UsageError("give either replica ids or --pool POOL")
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
        raise UsageError("give either replica ids or --pool POOL")
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
    from .display import clock, open_store_readonly
    from .logcli import stdout_gone

    if args.replica is not None and not _known_replica(paths, args.replica):
        raise UnknownReplica(f"unknown replica {args.replica!r}")  # as terminate says it: one line, exit 1
    if not paths.db.exists() and not args.follow:
        return EXIT_OK
    store = open_store_readonly(paths)  # with --follow, it picks the file up once it appears
    try:
        seq = 0
        rows = store.events(replica=args.replica, since=args.since, limit=args.limit, newest=True)
        while True:
            for ev in rows:
                seq = ev["seq"]
                if args.json:
                    print(json.dumps(ev), flush=args.follow)
                else:
                    when = clock(ev["ts"])
                    who = ev["replica"] or "-"
                    print(f"{ev['seq']:>8} {when} {ev['kind']:<10} {who:<16} {json.dumps(ev['data'])}",
                          flush=args.follow)
            if not args.follow or stdout_gone():
                return EXIT_OK
            time.sleep(0.2)  # a reader of another process's file: there is no event to wait on
            rows = store.events(replica=args.replica, since=args.since, after_seq=seq)
    finally:
        store.close()


def _known_replica(paths: Any, rid: str) -> bool:
    """A replica the journal knows: its row, or (its row pruned) an event of it."""
    from .display import open_store_readonly

    if not paths.db.exists():
        return False
    store = open_store_readonly(paths)
    try:
        return bool(store.events(replica=rid, limit=1)) or any(r["id"] == rid for r in store.replicas(True))
    finally:
        store.close()


def cmd_top(args: argparse.Namespace, paths: Paths) -> int:
    from .top import cmd_top as top

    return top(args, paths)


def cmd_demo(args: argparse.Namespace, paths: Any) -> int:
    from .demo import run_demo

    return run_demo(replicas=args.replicas, seconds=args.seconds)


def cmd_import(args: argparse.Namespace, paths: Any) -> int:
    from .procfile import convert

    sys.stdout.write(convert(args.procfile, env=args.env, port_base=args.port_base))
    return EXIT_OK


def cmd_completion(args: argparse.Namespace, paths: Any) -> int:
    from .completion import script

    sys.stdout.write(script(args.shell, _parser()))
    return EXIT_OK


_COMMANDS = {
    "start": cmd_start,
    "stop": cmd_stop,
    "status": cmd_status,
    "launch": cmd_launch,
    "terminate": cmd_terminate,
    "scale": cmd_scale,
    "events": cmd_events,
    "demo": cmd_demo,
    "top": cmd_top,
    "restart": cmd_restart,
    "delete": cmd_delete,
    "signal": cmd_signal,
    "reload": cmd_reload,
    "upgrade": cmd_upgrade,
    "health": cmd_health,
    "metrics": cmd_metrics,
    "show": cmd_show,
    "is-active": cmd_is_active,
    "reset-failed": cmd_reset_failed,
    "logs": cmd_logs,
    "import": cmd_import,
    "completion": cmd_completion,
    **_TASK_COMMANDS,
}
