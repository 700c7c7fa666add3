"""``orchestrator logs``: its arguments and its output. Client side: it reads the files
(logread.py) and never talks to the daemon, so it works with the daemon down. A task's log
(``logs POOL/N``) is read the same way, and so are journalctl's filters (``--since``,
``--until``, ``--grep``, ``--timestamps``, ``--json``: logread.LineFilter); a task's
``--follow`` ends when the journal (state.db, read-only) says the task has ended, which the
daemon records only once its output is in the files."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from ..errors import NotFound, UsageError
from .argtypes import natural

if TYPE_CHECKING:
    from ..logread import Line
    from ..paths import Paths

P = TypeVar("P", bound=argparse.ArgumentParser)  # the CLI's own parser class


def add_parser(sub: argparse._SubParsersAction[P], common: P) -> None:
    """Add ``logs`` to the CLI's subparsers."""
    p = sub.add_parser("logs", parents=[common],
                       help="a replica's captured stdout or stderr (works with the daemon down)",
                       description="Print the last lines of replicas' captured output, from the files in "
                                   "the state dir's logs/ (rotated files included).")
    p.add_argument("ids", nargs="*", metavar="ID",
                   help="replica id(s) (web-3) or task id(s) (POOL/N or POOL/@KEY: that task's own output); more than one "
                        "prefixes each line with its id (default: none, give --pool)")
    p.add_argument("--pool", metavar="P", default=None,
                   help="every replica of pool P that has logs, each line prefixed with its id (default: none)")
    p.add_argument("--lines", "-n", type=natural, default=None, metavar="N",
                   help="lines shown from the end of each log; 0 shows none (default 10, or with --since, "
                        "--until or --grep every line they keep)")
    p.add_argument("--stderr", action="store_true",
                   help="show the captured stderr instead of stdout (default: stdout)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="then keep printing lines as they are written, until Ctrl-C or, for tasks, until "
                        "they have all ended (default: off)")
    p.add_argument("--since", metavar="T", default=None,
                   help="only lines the daemon read at or after T: an ISO 8601 time (2026-12-02T06:00:00, local "
                        "time unless it says Z or +HH:MM) or a span ago (30s, 10m, 2h, 1d) (default: from the start)")
    p.add_argument("--until", metavar="T", default=None,
                   help="only lines read at or before T, given as for --since; with --follow, following ends at T "
                        "(default: to the end)")
    p.add_argument("--grep", metavar="REGEX", default=None,
                   help="only lines a Python regular expression finds a match in (default: every line)")
    p.add_argument("--timestamps", "-t", action="store_true",
                   help="prefix each line with the time the daemon read it, ISO 8601 local time to the "
                        "millisecond (default: off)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object a line: time, ts (unix seconds), replica or task, stream, line "
                        "(default: off)")


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
    """``orchestrator logs ID... [--follow] [--lines N] [--stderr] [--since T] [--until T]
    [--grep RE] [--timestamps] [--json]`` / ``logs --pool P``."""
    from ..logfiles import log_paths
    from ..logread import LineFilter, compile_grep, follow, follow_lines, parse_when, pool_replicas, read_lines, tail
    from ..protocol import parse_replica_id, parse_task_id, pool_name

    stream = "err" if args.stderr else "out"
    now = time.time()
    filt = LineFilter(since=None if args.since is None else parse_when(args.since, now),
                      until=None if args.until is None else parse_when(args.until, now),
                      grep=None if args.grep is None else compile_grep(args.grep))
    filtering = filt.timed or filt.grep is not None
    timed = filtering or args.timestamps or args.json
    lines = args.lines if args.lines is not None else (None if filtering else 10)
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
        ids = [_by_key(paths, rid) for rid in ids]
        for rid in ids:
            if parse_task_id(rid) is not None:
                if not (log_paths(logs_dir, rid, "out") or log_paths(logs_dir, rid, "err")) and \
                        _task_state(paths, rid) is None:
                    raise NotFound(f"no task {rid!r} in {paths.state_dir} (or its record was retired, "
                                   f"its log with it)")
                continue  # known, and it has written nothing (yet): its log is empty
            if parse_replica_id(rid) is None or not (log_paths(logs_dir, rid, "out")
                                                    or log_paths(logs_dir, rid, "err")):
                raise NotFound(f"no logs of replica {rid!r} in {logs_dir}")  # it may run and not have written yet
    prefix = pool is not None or len(ids) > 1
    tasks = [i for i in ids if parse_task_id(i) is not None]
    stop = stdout_gone
    if tasks and len(tasks) == len(ids):
        stop = _tasks_ended(paths, tasks)
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")  # type: ignore[union-attr]
    out = sys.stdout
    show = _shower(prefix, args.timestamps, args.json)
    try:
        if args.follow and (filt.until is None or filt.until > now):  # an end in the past: just print
            if filt.until is not None:
                stop = _by_then(stop, filt.until)
            try:
                if not timed:
                    for text in follow(logs_dir, ids, stream=stream, prefix=prefix, stop=stop,
                                       lines=lines or 0, pool=pool):
                        out.write(text + "\n")
                        out.flush()
                else:
                    for line in follow_lines(logs_dir, ids, stream=stream, stop=stop, lines=lines, pool=pool,
                                             filt=filt, timed=True):
                        out.write(show(line))
                        out.flush()
            except KeyboardInterrupt:  # Ctrl-C is how a follow ends
                out.flush()
            return 0
        if not timed:
            for rid in ids:
                for text in tail(logs_dir, rid, stream=stream, lines=lines or 0):
                    out.write(f"{rid} | {text}\n" if prefix else f"{text}\n")
        else:
            found = [line for rid in ids for line in read_lines(logs_dir, rid, stream=stream, lines=lines,
                                                                  filt=filt)]
            if len(ids) > 1:
                found.sort(key=lambda line: line.time)  # one story, as journalctl tells it (stable: each in order)
            for line in found:
                out.write(show(line))
        out.flush()
    except BrokenPipeError:
        _quiet_stdout()
    return 0


def _by_then(stop: Callable[[], bool], until: float) -> Callable[[], bool]:
    """``stop``, or it is past ``until`` (--follow --until T: nothing later is shown anyway)."""
    return lambda: stop() or time.time() > until


def _shower(prefix: bool, timestamps: bool, as_json: bool) -> Callable[[Line], str]:
    """How a line is printed: as JSON, or its text after its time and its id."""
    from ..logread import stamp

    if as_json:
        return lambda line: json.dumps(line.as_dict(), ensure_ascii=False) + "\n"

    def show(line: Line) -> str:
        head = f"{stamp(line.time)} " if timestamps else ""
        return f"{head}{line.log_id} | {line.text}\n" if prefix else f"{head}{line.text}\n"

    return show


TASK_POLL = 0.25  # seconds between two looks at a followed task's state in the journal


def _by_key(paths: Paths, text: str) -> str:
    """``POOL/@KEY``'s task id, as the journal has it (the daemon up or down); any other
    text as it is. A key that names no task there is one line (NotFound)."""
    from ..protocol import parse_task_ref
    from .display import open_store_readonly

    ref = parse_task_ref(text)
    if ref is None or not isinstance(ref[1], str):
        return text
    rows = []
    if paths.db.exists():
        store = open_store_readonly(paths)
        try:
            rows = store.tasks(pool=ref[0], key=ref[1])
        finally:
            store.close()
    if not rows:
        raise NotFound(f"no task of pool {ref[0]!r} has the key {ref[1]!r} in {paths.state_dir} "
                       f"(or its record was retired, its log with it)")
    return str(rows[-1]["id"])


def _task_state(paths: Paths, task_id: str) -> str | None:
    """The task's state as the journal has it (committed each turn), None if it has no such task."""
    from .display import open_store_readonly

    if not paths.db.exists():
        return None
    store = open_store_readonly(paths)
    try:
        rows = store.tasks(task_id=task_id)
    finally:
        store.close()
    return str(rows[0]["state"]) if rows else None


def _tasks_ended(paths: Paths, task_ids: list[str]) -> Callable[[], bool]:
    """``follow``'s stop for tasks: all have ended (or are unknown: retired, never there),
    or nobody reads our output. Asked every TASK_POLL seconds, not at every poll of the files."""
    from ..paths import running_pid
    from ..states import TaskState

    left = list(task_ids)
    next_look = 0.0

    def stop() -> bool:
        nonlocal next_look
        if stdout_gone():
            return True
        now = time.monotonic()
        if now >= next_look and running_pid(paths) is None:
            return True  # no daemon: nothing writes these logs until one starts
        if now < next_look:
            return False
        next_look = now + TASK_POLL
        while left:
            state = _task_state(paths, left[0])
            if state is not None and not TaskState(state).terminal:
                return False
            left.pop(0)
        return True

    return stop
