"""``orchestrator logs``: its arguments and its output. Client side: it reads the files
(logread.py) and never talks to the daemon, so it works with the daemon down."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..errors import NotFound, UsageError
from .argtypes import natural

if TYPE_CHECKING:
    from ..paths import Paths

P = TypeVar("P", bound=argparse.ArgumentParser)  # the CLI's own parser class


def add_parser(sub: argparse._SubParsersAction[P], common: P) -> None:
    """Add ``logs`` to the CLI's subparsers."""
    p = sub.add_parser("logs", parents=[common],
                       help="a replica's captured stdout or stderr (works with the daemon down)",
                       description="Print the last lines of replicas' captured output, from the files in "
                                   "the state dir's logs/ (rotated files included).")
    p.add_argument("ids", nargs="*", metavar="ID",
                   help="replica id(s); more than one prefixes each line with its id (default: none, give --pool)")
    p.add_argument("--pool", metavar="P", default=None,
                   help="every replica of pool P that has logs, each line prefixed with its id (default: none)")
    p.add_argument("--lines", "-n", type=natural, default=10, metavar="N",
                   help="lines shown from the end of each log; 0 shows none (default 10)")
    p.add_argument("--stderr", action="store_true",
                   help="show the captured stderr instead of stdout (default: stdout)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="then keep printing lines as they are written, until Ctrl-C (default: off)")


def stdout_gone() -> bool:
    """Nobody can read what we would write: stdout is closed, or it is a pipe whose reader
    has exited (``| head -1``). A follow that has nothing new to write asks this, or it
    would wait for the next line to find out (as ``tail -f`` did before coreutils 8.28)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return True
    poll = select.poll()
    poll.register(fd, 0)  # POLLERR, POLLHUP and POLLNVAL are reported without asking
    return bool(poll.poll(0))


def _quiet_stdout() -> None:
    """stdout's reader is gone (``| head -1``): point fd 1 at /dev/null, so the flush at
    exit finds somewhere to write and no traceback is printed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    finally:
        os.close(devnull)


def cmd_logs(args: argparse.Namespace, paths: Paths) -> int:
    """``orchestrator logs ID... [--follow] [--lines N] [--stderr]`` / ``logs --pool P``."""
    from ..logfiles import log_paths
    from ..protocol import parse_replica_id, pool_name
    from ..logread import follow, pool_replicas, tail

    stream = "err" if args.stderr else "out"
    ids = list(args.ids or ())
    pool = args.pool
    logs_dir = Path(paths.logs)
    if ids and pool is not None:
        raise UsageError("logs takes replica IDs or --pool P, not both")
    if pool is not None:
        pool_name(pool)
        ids = pool_replicas(logs_dir, pool, stream)
        if not ids:
            raise NotFound(f"no logs of pool {pool!r} in {logs_dir}")
    elif not ids:
        raise UsageError("logs needs a replica ID or --pool P")
    else:
        for rid in ids:
            if parse_replica_id(rid) is None or not (log_paths(logs_dir, rid, "out")
                                                    or log_paths(logs_dir, rid, "err")):
                raise NotFound(f"no logs of replica {rid!r} in {logs_dir}")  # it may run and not have written yet
    prefix = pool is not None or len(ids) > 1
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")  # type: ignore[union-attr]
    out = sys.stdout
    try:
        if args.follow:
            try:
                for line in follow(logs_dir, ids, stream=stream, prefix=prefix, stop=stdout_gone,
                                   lines=args.lines, pool=pool):
                    out.write(line + "\n")
                    out.flush()
            except KeyboardInterrupt:  # Ctrl-C is how a follow ends
                out.flush()
            return 0
        for rid in ids:
            for line in tail(logs_dir, rid, stream=stream, lines=args.lines):
                out.write(f"{rid} | {line}\n" if prefix else f"{line}\n")
        out.flush()
    except BrokenPipeError:
        _quiet_stdout()
    return 0
