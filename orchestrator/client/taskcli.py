"""``orchestrator submit | tasks | cancel | result``: the tasks of executor pools from the
command line. Client side: it speaks the daemon's task commands (daemon/taskcommands.py has their
meaning) and, with the daemon down, reads the journal (state.db) read-only, so a finished
task's result can be fetched later from any shell. A task is named by its id (``POOL/N``)
or by its key (``POOL/@KEY``, ``submit --key``), wherever a command takes one.

The CLI imports this module for its parsers: what only a command needs is imported in it.

A result travels as bytes (base64 over the channel) with a one-byte head: ``j`` JSON (a
``--target`` task's result, when it is JSON), ``p`` pickle, ``d`` dill. JSON is printed as
JSON, a pickle as the repr of what it loads; a dill pickle is not loaded here (the CLI never
imports dill: it is for Python callers), and is said to be one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

from ..errors import ChannelError, DaemonNotRunning, InvalidSpec, OrchestratorError, UnknownTask
from ..paths import Paths, running_pid
from ..protocol import parse_task_ref, task_key
from .argtypes import natural, positive_seconds, seconds

if TYPE_CHECKING:
    from .channel import Client

P = TypeVar("P", bound=argparse.ArgumentParser)  # the CLI's own parser class

EXIT_OK, EXIT_ERROR, EXIT_NOT_RUNNING = 0, 1, 3
WAIT_CHUNK = 2.0  # a wait is a series of bounded waits: a daemon that dies is noticed within a chunk
LISTING = ("id", "pool", "n", "state", "attempts", "retries", "timeout", "worker", "queued_at", "started_at",
           "ended_at", "reason", "kind", "priority", "tenant", "key", "deadline", "waits", "wait_until",
           "wait_reason", "figures")


def _json_value(text: str) -> Any:
    """A JSON argument (``--arg``, the value of ``--kwarg``); NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({err})") from None


def _priority(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _key(text: str) -> str:
    try:
        return task_key(text)
    except InvalidSpec as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _kwarg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"takes NAME=JSON with NAME a Python identifier, got {text!r}")
    return key, _json_value(value)


def add_parsers(sub: argparse._SubParsersAction[P], common: P) -> None:
    """Add ``submit``, ``tasks``, ``cancel`` and ``result`` to the CLI's subparsers."""
    p = sub.add_parser("submit", parents=[common], help="queue a task (MODULE:FUNC) in an executor pool")
    p.add_argument("--pool", required=True, help="the executor pool")
    p.add_argument("--target", metavar="MODULE:FUNC",
                   help="what the task calls, imported by the worker from this PYTHONPATH and directory "
                        "(default: the pool's own target, from the config file's key)")
    p.add_argument("--arg", action="append", type=_json_value, default=[], metavar="JSON",
                   help="a positional argument, as JSON (repeat for more)")
    p.add_argument("--kwarg", action="append", type=_kwarg, default=[], metavar="NAME=JSON",
                   help="a keyword argument, its value as JSON (repeat for more)")
    p.add_argument("--timeout", type=positive_seconds, metavar="S",
                   help="seconds the task may run (default: the pool's)")
    p.add_argument("--retries", type=natural, metavar="N",
                   help="runs again this often if its worker dies (default: the pool's)")
    p.add_argument("--deadline", type=positive_seconds, metavar="S",
                   help="seconds from now that bound every wait and retry of the task (it may raise "
                        "orchestrator.Retry): past it, TIMED_OUT wherever it is (default: none)")
    p.add_argument("--priority", type=_priority, metavar="N",
                   help="a whole number: a task of a higher priority starts first (default 0)")
    p.add_argument("--tenant", metavar="T",
                   help="whose task it is: the tenants with queued tasks share the workers by the pool's "
                        "tenant_weights (default: none, one tenant of weight 1)")
    p.add_argument("--key", type=_key, metavar="K",
                   help="names the task in its pool (POOL/@K): a task there with this key already is that task, "
                        "not a second run (1 to 200 bytes, no '/')")
    p.add_argument("--wait", action="store_true", help="print its result once it ends; exit 1 if it did not succeed")
    p.add_argument("--json", action="store_true", help="the id (or with --wait the outcome) as JSON")

    p = sub.add_parser("tasks", parents=[common], help="queued and running tasks of executor pools")
    p.add_argument("id", nargs="?", metavar="TASK", help="this task's record alone (POOL/N or POOL/@KEY)")
    p.add_argument("--pool", metavar="P", help="this pool's only")
    p.add_argument("--all", action="store_true", help="finished tasks too")
    p.add_argument("--json", action="store_true", help="one JSON list on stdout")
    p.add_argument("--watch", action="store_true", help="a live table, redrawn in place, until Ctrl-C")
    p.add_argument("--interval", type=positive_seconds, default=1.0, help="seconds between redraws (default 1)")

    p = sub.add_parser("cancel", parents=[common], help="cancel queued, waiting or running tasks")
    p.add_argument("ids", nargs="+", metavar="TASK")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("result", parents=[common], help="a task's result or why it failed (the daemon may be down)")
    p.add_argument("id", metavar="TASK")
    p.add_argument("--wait", action="store_true", help="wait until it has ended")
    p.add_argument("--timeout", type=seconds, metavar="S", help="bound of --wait, in seconds (default: none)")
    p.add_argument("--json", action="store_true", help="the outcome as one JSON object")


def _client(paths: Paths) -> Client:
    from .channel import Client

    return Client(paths.state_dir)


# -- submit -------------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace, paths: Paths) -> int:
    call: dict[str, Any] = {"pool": args.pool, "args": list(args.arg), "kwargs": dict(args.kwarg)}
    if args.target is not None:  # else the pool's own target, from where the pool was declared
        # Where the worker imports the target from: ours, as `launch --target` records it.
        call.update(target=args.target, cwd=os.getcwd(),
                    pythonpath=[os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if args.timeout is not None:
        call["timeout"] = args.timeout
    if args.retries is not None:
        call["retries"] = args.retries
    if args.deadline is not None:
        call["deadline"] = args.deadline
    if args.priority is not None:
        call["priority"] = args.priority
    if args.tenant is not None:
        call["tenant"] = args.tenant
    if args.key is not None:
        call["key"] = args.key
    with _client(paths) as client:
        task_id = client.call("task_submit", call)
        if not args.wait:
            print(json.dumps({"id": task_id}) if args.json else task_id)
            return EXIT_OK
        outcome = _wait(client, task_id, None)
    return _report(args, outcome, None)


# -- result -------------------------------------------------------------------------------


def _well_formed(task_ids: Sequence[str]) -> None:
    """What cannot be an id the daemon handed out (``jobs/²``, ``jobs/１``) nor a key
    (``jobs/@``, ``jobs/@a/b``) is refused here, in one line, whether the daemon runs or not."""
    for task_id in task_ids:
        if parse_task_ref(task_id) is None:
            raise UnknownTask(f"unknown task {task_id!r}: a task is POOL/N or POOL/@KEY "
                              "(a key of 1 to 200 bytes, no '/')")


def _stored_rows(store: Any, task: str) -> list[dict[str, Any]]:
    """The stored record of ``task`` (an id, or ``POOL/@KEY``: the task that key names)."""
    ref = parse_task_ref(task)
    if ref is not None and isinstance(ref[1], str):
        rows: list[dict[str, Any]] = store.tasks(pool=ref[0], key=ref[1])
        return rows[-1:]
    return list(store.tasks(task_id=task))


def cmd_result(args: argparse.Namespace, paths: Paths) -> int:
    _well_formed([args.id])
    timeout = args.timeout if args.wait else None
    if running_pid(paths) is None:
        return _report(args, _stored_outcome(paths, args.id), timeout)
    try:
        with _client(paths) as client:
            if args.wait:
                outcome = _wait(client, args.id, args.timeout)
            else:
                outcome = client.call("task_result", {"id": args.id})
    except (DaemonNotRunning, ChannelError):
        if running_pid(paths) is not None:
            raise
        outcome = _stored_outcome(paths, args.id)  # it stopped meanwhile: what it recorded
    return _report(args, outcome, timeout)


def _wait(client: Client, task_id: str, timeout: float | None) -> dict[str, Any]:
    """The task's outcome once it has ended, or its state at ``timeout`` (None: no bound)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        chunk = WAIT_CHUNK if deadline is None else max(0.0, min(WAIT_CHUNK, deadline - time.monotonic()))
        outcome: dict[str, Any] = client.call("task_result", {"id": task_id, "wait": True, "timeout": chunk},
                                    timeout=chunk + 3.0)
        if _ended(outcome["state"]) or (deadline is not None and time.monotonic() >= deadline):
            return outcome


def _ended(state: str) -> bool:
    from ..states import TaskState

    return TaskState(state).terminal


def _stored_outcome(paths: Paths, task_id: str) -> dict[str, Any]:
    """A task's outcome as the journal recorded it (the daemon is down): a finished task's;
    DaemonNotRunning if it has none (unknown there, or it had not finished)."""
    from .display import open_store_readonly

    rows = []
    if paths.db.exists():
        store = open_store_readonly(paths)
        try:
            rows = _stored_rows(store, task_id)
        finally:
            store.close()
    down = f"no daemon is running for {paths.state_dir}"
    if not rows:
        raise DaemonNotRunning(f"{down}, and its journal has no task {task_id!r}")
    row = rows[0]
    if not _ended(row["state"]):
        raise DaemonNotRunning(f"{down}; task {task_id} was {row['state']} when it stopped")
    return {k: row.get(k) for k in ("id", "state", "kind", "result", "reason")}


def _report(args: argparse.Namespace, outcome: dict[str, Any], waited: float | None) -> int:
    """Print an outcome (``task_result``'s answer): the value of a DONE task, else one line
    on stderr that says why there is none; the exit code."""
    from ..states import TaskState

    task_id, state = outcome["id"], TaskState(outcome["state"])
    value, text = _value(task_id, outcome.get("result")) if state is TaskState.DONE else (None, None)
    if args.json:
        print(json.dumps({"id": task_id, "state": state.value, "kind": outcome.get("kind"), "result": value,
                          "repr": text, "reason": outcome.get("reason")}))
    if state is TaskState.DONE:
        if not args.json:
            print(text if text is not None else json.dumps(value))
        return EXIT_OK
    if state.terminal:
        why = outcome.get("reason") or outcome.get("kind") or "no reason recorded"
        print(f"orchestrator: task {task_id} {state.value}: {why}", file=sys.stderr)
    elif waited is not None:
        print(f"orchestrator: task {task_id} is still {state.value} after {waited:g} s", file=sys.stderr)
    else:
        print(f"orchestrator: task {task_id} is {state.value}, not finished (--wait waits for it)", file=sys.stderr)
    return EXIT_ERROR


def _value(task_id: str, result: Any) -> tuple[Any, str | None]:
    """(the JSON value, None) of a JSON result; (None, a line to print) of any other."""
    import base64
    import pickle

    data = base64.b64decode(result) if isinstance(result, str) else result
    if not isinstance(data, bytes) or not data:
        return None, "None"
    head, body = data[:1], data[1:]
    if head == b"j":
        return json.loads(body), None
    if head == b"d":
        return None, f"<task {task_id}: its result was pickled with dill; load it from Python>"
    try:
        return None, repr(pickle.loads(body))
    # Unpickling runs the result's own code (its classes' __reduce__, their imports): whatever
    # it raises means "cannot be loaded here", which is said, never a traceback.
    except Exception as err:
        return None, f"<task {task_id}: a pickled result that cannot be loaded here: {type(err).__name__}: {err}>"


# -- tasks, cancel ------------------------------------------------------------------------


def cmd_tasks(args: argparse.Namespace, paths: Paths) -> int:
    if args.watch:
        from .display import redraw

        def frame() -> str:
            code, rows = _listing(args, paths)
            return _table(rows, running=code == EXIT_OK)

        return redraw(args.interval, frame)
    code, rows = _listing(args, paths)
    if args.json:
        print(json.dumps(rows))
    else:
        print(_table(rows, running=code == EXIT_OK))
    return code


def _listing(args: argparse.Namespace, paths: Paths) -> tuple[int, list[dict[str, Any]]]:
    """(exit code, tasks): the daemon's answer, or with it down (exit 3) the journal's;
    with a TASK, that task's record alone."""
    if args.id is not None:
        _well_formed([args.id])
    if running_pid(paths) is not None:
        try:
            with _client(paths) as client:
                if args.id is not None:
                    return EXIT_OK, client.call("tasks", {"id": args.id})
                return EXIT_OK, client.call("tasks", {"pool": args.pool, "all": args.all})
        except DaemonNotRunning:
            pass
    if not paths.db.exists():
        if args.id is not None:
            raise DaemonNotRunning(f"no daemon is running for {paths.state_dir}, and it has no journal")
        return EXIT_NOT_RUNNING, []
    from .display import open_store_readonly

    store = open_store_readonly(paths)
    try:
        if args.id is not None:
            rows = _stored_rows(store, args.id)
            if not rows:
                raise DaemonNotRunning(f"no daemon is running for {paths.state_dir}, and its journal has no "
                                       f"task {args.id!r}")
        else:
            rows = store.tasks(pool=args.pool, include_terminal=args.all)
    finally:
        store.close()
    return EXIT_NOT_RUNNING, [{k: row.get(k) for k in LISTING} for row in rows]


def _table(rows: Sequence[dict[str, Any]], *, running: bool) -> str:
    from .display import clock

    out = [] if running else ["daemon: not running; tasks below are as last known"]
    if not rows:
        return "\n".join([*out, "no tasks"])
    width = max(len("ID"), *(len(r["id"]) for r in rows))
    worker = max(len("WORKER"), *(len(r["worker"] or "") for r in rows))
    tenant = max(len("TENANT"), *(len(r.get("tenant") or "") for r in rows))
    out.append(f"{'ID':<{width}} {'STATE':<11} {'PRIO':>4} {'TENANT':<{tenant}} {'WORKER':<{worker}} {'QUEUED':<19} "
               f"{'STARTED':<19} {'ENDED':<19} REASON")
    for r in rows:
        state = r["state"] if running else f"({r['state']})"
        out.append(f"{r['id']:<{width}} {state:<11} {r.get('priority') or 0:>4} {r.get('tenant') or '-':<{tenant}} "
                   f"{r['worker'] or '-':<{worker}} {clock(r['queued_at']):<19} "
                   f"{clock(r['started_at']):<19} {clock(r['ended_at']):<19} {_why(r)}".rstrip())
    return "\n".join(out)


def _why(row: dict[str, Any]) -> str:
    """A task's REASON column: how it ended, or for a queued or WAITING one why it waits."""
    if row.get("reason"):
        return str(row["reason"])
    if row.get("wait_until") is not None:
        from .display import clock

        return f"waiting until {clock(row['wait_until'])}: {row.get('wait_reason') or ''}".rstrip(": ")
    return f"waiting: {row['waiting']}" if row.get("waiting") else ""


def cmd_cancel(args: argparse.Namespace, paths: Paths) -> int:
    _well_formed(args.ids)
    with _client(paths) as client:
        done = client.call("task_cancel", {"ids": list(args.ids)})
    if args.json:
        print(json.dumps({"cancelled": [i for i, ok in zip(args.ids, done) if ok],
                          "ended": [i for i, ok in zip(args.ids, done) if not ok]}))
    else:
        for task_id, ok in zip(args.ids, done):
            print(f"cancelled {task_id}" if ok else f"{task_id} had ended already: not cancelled")
    return EXIT_OK


COMMANDS = {"submit": cmd_submit, "tasks": cmd_tasks, "cancel": cmd_cancel, "result": cmd_result}
