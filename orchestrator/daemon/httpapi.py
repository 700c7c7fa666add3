"""The JSON/HTTP control plane: the CLI's verbs under ``/v1/``, served by the control loop.

One table (``ROUTES``) says, for every route, its method and path, the loop command it
becomes (``op``; the command's arguments are the request's JSON body, its query parameters
and its path parameters together), whether it writes, the schema of its body and of its
reply, and how the command's result is turned into the CLI's ``--json`` shape (``shape``).
Dispatch, argument checks and ``GET /openapi.json`` (OpenAPI 3.1) are all read from it:
there is no handler per verb. Three routes are not loop commands: ``/v1/events`` (the
journal, and with ``follow=1`` a Server-Sent Events stream), ``/v1/logs/{id}`` (a replica's
captured output, and with ``follow=1`` its lines as they are written) and the document.

A command reaches the loop as the channel's do (``Engine.handle`` with a reply callback),
in the loop's own turn: a command that waits (``wait``, ``launch`` with ``wait``, a task's
``result`` with ``wait``) is answered when its reply comes, and the loop never waits for it.
Errors are ``{"error": {"code", "message"}}`` (and ``data`` where the command has some)
with the status their code calls for (``STATUS``): bad input is a 4xx, never a 500.

Who may ask: on a unix listener, processes of the daemon's uid (or root), checked with
SO_PEERCRED on accept (httpserver.py); on TCP, a client that sends ``Authorization: Bearer
TOKEN`` with the token of ``--http-token-file`` (anything), or of ``--http-read-token-file``
(routes that only read; a write is 403). No token: 401.

Streams follow the journal and the log files at the end of every turn (after the turn's
commit, so an event is sent once it is durable, in ``seq`` order): the event followers
together cost one indexed query in a turn that committed events (each event encoded once
for all of them), a log follower one stat in a turn, nothing otherwise.
``Last-Event-ID`` (or ``after``) resumes an event stream after that ``seq``: the journal's
seqs are never reused, so a client that reconnects gets every event once, with no gap.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import re
import signal
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .. import protocol
from ..errors import ERROR_TYPES, InvalidSpec, NotFound, OrchestratorError, UnsafeFile
from ..paths import read_operator_file
from ..policy import Policy
from ..version import __version__
from .httpserver import Exchange, HttpServer, Request, tcp_listener, unix_listener
from .reactor import Reactor, Timer
from .taskrecords import PRIORITY_MAX, PRIORITY_MIN

log = logging.getLogger("orchestrator")

JSON = "application/json"
SSE = "text/event-stream"
TEXT = "text/plain; charset=utf-8"
PAGE = 500  # events (or log lines' reads) sent to one follower in one turn; the rest in the next
KEEPALIVE = 15.0  # seconds between SSE comments on an idle stream: a gone client is noticed
TOKEN_MAX_BYTES = 4096
DEFAULT_SOCKET = "http.sock"
MAX_CONNECTIONS = 64  # per listener; beyond, a client gets a 503 at once
MAX_STREAMS = 48  # followed events and logs, all listeners together: the rest is left to commands (429 beyond)

# error code -> HTTP status; the NotFound family is 404 by its class (STATUS_OF)
STATUS = {"invalid": 400, "usage": 400, "config": 400, "unsafe_file": 400, "frame_too_large": 413,
          "shutting_down": 503, "not_running": 503, "store": 503, "channel": 503, "timeout": 409,
          "error": 409, "internal": 500}


def status_of(code: str) -> int:
    cls = ERROR_TYPES.get(code)
    if cls is not None and issubclass(cls, NotFound):
        return 404
    if cls is not None and issubclass(cls, InvalidSpec) and code not in STATUS:
        return 400
    return STATUS.get(code, 409)


# -- schemas (JSON Schema 2020-12, as OpenAPI 3.1 takes it) -----------------------------

ANY: dict[str, Any] = {}
OBJ: dict[str, Any] = {"type": "object"}
STR: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer"}
NUM: dict[str, Any] = {"type": "number", "minimum": 0}
BOOL: dict[str, Any] = {"type": "boolean"}
STRS: dict[str, Any] = {"type": "array", "items": STR}
OPT_NUM: dict[str, Any] = {"type": ["number", "null"], "minimum": 0}
POOL_NAME: dict[str, Any] = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"}  # protocol.pool_name
REPLICA_ID: dict[str, Any] = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}-[0-9]{1,18}$"}
TASK_ID: dict[str, Any] = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/[1-9][0-9]{0,17}$"}
IDS: dict[str, Any] = {"type": "array", "items": STR, "minItems": 1}
POOLS: dict[str, Any] = {"type": "array", "items": POOL_NAME, "minItems": 1}
SIZE: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": protocol.MAX_COUNT}
_SIGNALS = sorted(signal.Signals, key=int)
SIGNAL: dict[str, Any] = {"oneOf": [  # what policy.signal_number reads: TERM, SIGTERM, term, 15
    {"type": "string", "enum": sorted({w for s in _SIGNALS for n in (s.name, s.name[3:], str(int(s)))
                                       for w in (n, n.lower())})},
    {"type": "integer", "enum": sorted({int(s) for s in _SIGNALS})}]}
IDS_OR_POOL: list[dict[str, Any]] = [{"required": ["ids"]}, {"required": ["pool"]}]  # one, not both


def body(required: Sequence[str] = (), one_of: list[dict[str, Any]] | None = None,
         **props: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}
    if one_of is not None:
        schema["oneOf"] = one_of
    return schema


def reply(**props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


TEXT_NO_NUL: dict[str, Any] = {"type": "string", "pattern": "^[^\\x00]*$"}  # the kernel takes C strings
SPEC: dict[str, Any] = {  # WorkerSpec.from_wire's checks, but whether the command exists here
    "type": "object", "additionalProperties": False, "properties": {
        "command": {"type": "array", "items": TEXT_NO_NUL, "prefixItems": [{**TEXT_NO_NUL, "minLength": 1}],
                    "minItems": 1},
        "target": {"type": "string", "pattern": "^[^:\\x00]+:[^\\x00]+$"},
        "env": {"type": "object", "propertyNames": {"pattern": "^[^=\\x00]+$"}, "additionalProperties": TEXT_NO_NUL},
        "cwd": {"type": "string", "pattern": "^/[^\\x00]*$"},
        "pythonpath": {"type": "array", "items": TEXT_NO_NUL},
        "preload": {"type": "array", "items": {"type": "string",
                                               "pattern": r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"}}},
    "oneOf": [{"required": ["command"], "not": {"required": ["target"]}, "properties": {"preload": {"maxItems": 0}}},
              {"required": ["target"], "not": {"required": ["command"]}}]}
# launch's policy: Policy's keys (policy.py checks their values, in its own words)
POLICY: dict[str, Any] = {"type": "object", "additionalProperties": False,
                          "properties": {f.name: ANY for f in dataclasses.fields(Policy)}}
REPLICA = {"type": "object", "properties": {"id": STR, "pool": STR, "state": STR}, "required": ["id", "state"]}
POOL = {"type": "object", "properties": {"name": STR}, "required": ["name"]}
STATUS_REPLY = {"type": "object", "properties": {"state_dir": STR, "daemon": OBJ,
                                                 "pools": {"type": "array", "items": POOL},
                                                 "replicas": {"type": "array", "items": REPLICA}},
                "required": ["daemon", "pools", "replicas"]}
EVENT = reply(seq=INT, ts={"type": "number"}, kind=STR, replica={"type": ["string", "null"]}, data=OBJ)
TASK = {"type": "object", "properties": {"id": STR, "pool": STR, "state": STR}, "required": ["id", "state"]}
ERROR = {"type": "object", "properties": {"error": {
    "type": "object", "properties": {"code": STR, "message": STR, "data": ANY}, "required": ["code", "message"]}},
    "required": ["error"]}


BOOL_WORDS = ("true", "false", "1", "0")  # a query's boolean: what a client may write


@dataclass(frozen=True)
class Param:
    """A query parameter: its name, JSON type (boolean, integer, number, string), meaning,
    and the bounds of its value (``limits``: minimum, maximum, enum, pattern)."""

    name: str
    type: str
    description: str
    required: bool = False
    limits: Mapping[str, Any] = field(default_factory=dict)

    @property
    def schema(self) -> dict[str, Any]:
        """As the document gives it (a boolean is one of BOOL_WORDS in a query string)."""
        if self.type == "boolean":
            return {"type": "string", "enum": list(BOOL_WORDS)}
        return {"type": self.type, **self.limits}


@dataclass(frozen=True)
class Route:
    """One route of the table; see the module docstring."""

    method: str
    path: str  # "/v1/logs/{id}": a {name} is a path parameter (no "/" in it)
    summary: str
    op: str | None = None  # the loop command; None: served by HttpApi itself (``local``)
    write: bool = False
    query: tuple[Param, ...] = ()
    body: dict[str, Any] | None = None  # the request body's schema (an object); None: no body
    result: dict[str, Any] = field(default_factory=dict)  # the 200 reply's schema
    shape: Callable[[Any, Mapping[str, Any], "HttpApi"], Any] | None = None  # result -> the --json shape
    ctype: str = JSON
    local: str | None = None  # for op None: what serves it ("events", "logs", "openapi")
    stream: str | None = None  # the content type of its ?follow=1 stream

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.path) + "$")


def _status(result: Any, args: Mapping[str, Any], api: HttpApi) -> Any:
    return {"state_dir": api.state_dir, **result}


def _launched(result: Any, args: Mapping[str, Any], api: HttpApi) -> Any:
    ids = list(result["ids"]) if isinstance(result, dict) and "ids" in result else list(result)
    failed: list[str] = []
    if args.get("wait"):
        for rid in ids:
            rep = api.engine.replica(rid)
            if rep is not None and rep.state.value != "RUNNING":
                failed.append(rid)
    return {"ids": ids, "failed": failed}


def _cancelled(result: Any, args: Mapping[str, Any], api: HttpApi) -> Any:
    ids = list(args["ids"])
    return {"cancelled": [i for i, ok in zip(ids, result) if ok], "ended": [i for i, ok in zip(ids, result) if not ok]}


def _outcome(result: Any, args: Mapping[str, Any], api: HttpApi) -> Any:
    """``result --json``'s shape. A JSON result is given as its value; a pickled one is not
    loaded here (unpickling runs the result's code, and the daemon never does): ``repr``
    says so, and ``pickled`` carries its bytes, base64, for a Python client."""
    raw = result.get("result")
    data = base64.b64decode(raw) if isinstance(raw, str) else raw
    value, text, pickled = None, None, None
    if result.get("state") == "DONE":
        if isinstance(data, bytes) and data[:1] == b"j":
            value = json.loads(data[1:])
        elif isinstance(data, bytes) and data:
            text = f"<task {result['id']}: a pickled result; load it from Python>"
            pickled = base64.b64encode(data).decode("ascii")
        else:
            text = "None"
    out = {"id": result["id"], "state": result["state"], "kind": result.get("kind"), "result": value,
           "repr": text, "reason": result.get("reason")}
    if pickled is not None:
        out["pickled"] = pickled
    return out


def _pick(key: str) -> Callable[[Any, Mapping[str, Any], HttpApi], Any]:
    return lambda result, args, api: result[key]


ALL = Param("all", "boolean", "ended ones too")
ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/ping", "the loop answers", op="ping", result=STR),
    Route("GET", "/v1/status", "the daemon, its pools and replicas (`status --json`)", op="status",
          query=(ALL,), result=STATUS_REPLY, shape=_status),
    Route("GET", "/v1/pools", "the pools (`status --json`'s pools)", op="status",
          result={"type": "array", "items": POOL}, shape=_pick("pools")),
    Route("GET", "/v1/replicas", "the replicas (`status --json`'s replicas)", op="status", query=(ALL,),
          result={"type": "array", "items": REPLICA}, shape=_pick("replicas")),
    Route("GET", "/v1/health", "`health --json` (503 when unhealthy)", op="health",
          result={"type": "object", "properties": {"healthy": BOOL}, "required": ["healthy"]}),
    Route("GET", "/v1/metrics", "`metrics`: Prometheus text", op="metrics", ctype=TEXT, result=STR),
    Route("POST", "/v1/launch", "`launch --json`: add replicas to a pool", op="launch", write=True,
          body=body(("pool", "spec"), pool=POOL_NAME, spec=SPEC, count={**SIZE, "minimum": 1}, wait=BOOL,
                    timeout=OPT_NUM, policy=POLICY, replace=BOOL),
          result=reply(ids=STRS, failed=STRS), shape=_launched),
    Route("POST", "/v1/terminate", "`terminate --json`", op="terminate", write=True,
          body=body(("ids",), ids=IDS, wait=BOOL, timeout=OPT_NUM),
          result=reply(terminated=STRS), shape=lambda result, args, api: {"terminated": list(result)}),
    Route("POST", "/v1/scale", "`scale --json`: set a pool's size", op="scale", write=True,
          body=body(("pool", "n"), pool=POOL_NAME, n=SIZE, spec=SPEC),
          result=reply(pool=STR, desired=INT, launched=STRS, terminated=STRS)),
    Route("POST", "/v1/restart", "`restart --json`: replace replicas (rolling for a pool)", op="restart",
          write=True, body=body((), IDS_OR_POOL, ids=IDS, pool=POOL_NAME,
                                max_unavailable={"type": "integer", "minimum": 1},
                                timeout=NUM),
          result={"type": "object", "properties": {"replaced": OBJ}, "required": ["replaced"]}),
    Route("POST", "/v1/delete", "`delete --json`: end a pool's replicas and forget it", op="delete", write=True,
          body=body(("pool",), pool=POOL_NAME), result={"type": "object", "properties": {
              "pool": STR, "terminated": STRS}, "required": ["pool", "terminated"]}),
    Route("POST", "/v1/signal", "`signal --json`", op="signal", write=True,
          body=body(("signal",), IDS_OR_POOL, signal=SIGNAL, ids=IDS, pool=POOL_NAME),
          result={"type": "object", "properties": {"signal": ANY, "sent": STRS}, "required": ["sent"]}),
    Route("GET", "/v1/pools/{pool}", "`show POOL --json`: every property of a pool", op="show",
          result={"type": "object", "properties": {"name": STR, "state": STR, "active_state": STR,
                                                   "effective": OBJ, "counts": OBJ},
                  "required": ["name", "state", "active_state", "effective", "counts"]}),
    Route("GET", "/v1/pools/{pool}/active", "`is-active POOL --json` (200 whether it is active or not)",
          op="is_active", result=reply(pool=STR, active=BOOL, state=STR)),
    Route("POST", "/v1/stop", "`stop POOL... --json`: stop pools' replicas; the pools stay stopped",
          op="stop_pools", write=True, body=body(("pools",), pools=POOLS, wait=BOOL, timeout=OPT_NUM),
          result=reply(stopped=STRS, terminating=STRS)),
    Route("POST", "/v1/start", "`start POOL... --json`: stopped pools back to their size", op="start_pools",
          write=True, body=body(("pools",), pools=POOLS, wait=BOOL, timeout=OPT_NUM),
          result=reply(started=STRS, launched=STRS)),
    Route("POST", "/v1/reset-failed", "`reset-failed POOL... --json`: forget crash loops and restart counters",
          op="reset_failed", write=True, body=body(("pools",), pools=POOLS), result=reply(reset=STRS, launched=STRS)),
    Route("POST", "/v1/wait", "until replicas run (or have ended)", op="wait",
          body=body(("ids",), ids=IDS, until={"enum": ["running", "ended"]}, timeout=NUM), result=OBJ),
    Route("POST", "/v1/reload", "`reload --json`: apply the config file again", op="reload", write=True,
          body=body(), result=OBJ),
    Route("GET", "/v1/events", "`events --json` (a list); with follow=1 a Server-Sent Events stream",
          local="events", stream=SSE, result={"type": "array", "items": EVENT},
          query=(Param("replica", "string", "this replica's only", limits=REPLICA_ID),
                 Param("since", "number", "at or after this unix time", limits={"minimum": 0}),
                 Param("after", "integer", "after this seq (Last-Event-ID says it too)",
                       limits={"minimum": 0, "maximum": 2 ** 63 - 1}),
                 Param("limit", "integer", "at most this many", limits={"minimum": 0, "maximum": 2 ** 63 - 1}),
                 Param("follow", "boolean", "then stream events as they are journaled"))),
    Route("GET", "/v1/logs/{id}", "`logs ID`: the last lines; with follow=1 then the lines as they come",
          local="logs", stream=TEXT, result=reply(id=STR, stream=STR, lines=STRS),
          query=(Param("lines", "integer", "lines from the end (default 10)",
                       limits={"minimum": 0, "maximum": 100_000}),
                 Param("stream", "string", "out (default) or err", limits={"enum": ["out", "err"]}),
                 Param("follow", "boolean", "then stream lines as they are written"))),
    Route("GET", "/v1/tasks", "`tasks --json`: tasks of executor pools", op="tasks",
          query=(Param("pool", "string", "this pool's only", limits=POOL_NAME), ALL),
          result={"type": "array", "items": TASK}),
    Route("POST", "/v1/submit", "`submit --json`: queue a task (MODULE:FUNC, JSON arguments)", op="task_submit",
          write=True, body=body(("pool",), pool=POOL_NAME, target=STR, args={"type": "array"}, kwargs=OBJ,
                                timeout={"type": "number", "exclusiveMinimum": 0},
                                retries={"type": "integer", "minimum": 0},
                                priority={"type": "integer", "minimum": PRIORITY_MIN, "maximum": PRIORITY_MAX},
                                tenant=STR, cwd=STR,
                                pythonpath=STRS),
          result=reply(id=STR), shape=lambda result, args, api: {"id": result}),
    Route("POST", "/v1/cancel", "`cancel --json`", op="task_cancel", write=True,
          body=body(("ids",), ids=IDS),
          result=reply(cancelled=STRS, ended=STRS), shape=_cancelled),
    Route("GET", "/v1/result", "`result --json`: a task's outcome", op="task_result",
          query=(Param("id", "string", "the task (POOL/N)", required=True, limits=TASK_ID),
                 Param("wait", "boolean", "until it has ended"),
                 Param("timeout", "number", "bound of wait", limits={"minimum": 0})),
          result={"type": "object", "properties": {"id": STR, "state": STR}, "required": ["id", "state"]},
          shape=_outcome),
    Route("POST", "/v1/upgrade", "`upgrade --json`: the daemon re-executes the code installed now, in place",
          op="upgrade", write=True, body=body(), result=reply(**{"from": STR, "to": STR, "pid": INT, "replicas": INT})),
    Route("GET", "/openapi.json", "this document", local="openapi", result=OBJ),
)


# -- checks ------------------------------------------------------------------------------

_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict), "null": lambda v: v is None}


def check(value: Any, schema: Mapping[str, Any], where: str = "body") -> Any:
    """``value`` if it conforms to ``schema``, else InvalidSpec with one line (the subset of
    JSON Schema this table uses: type, enum, oneOf, not, minimum, exclusiveMinimum, maximum,
    pattern, minLength, minItems, maxItems, prefixItems, items, properties, required,
    propertyNames, additionalProperties). A float
    with no fraction is an integer to JSON Schema: where one is wanted, it is returned as an
    int (the commands check ``int``); nothing else is changed. The tests check replies with it."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if "integer" in names and isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
            value = int(value)
        if not any(_TYPES[t](value) for t in names):
            raise InvalidSpec(f"{where} must be {' or '.join(names)}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise InvalidSpec(f"{where} must be one of {schema['enum']}, got {value!r}"[:300])
    if "oneOf" in schema:
        fits = []
        for alternative in schema["oneOf"]:
            try:
                fits.append(check(value, alternative, where))
            except InvalidSpec:
                pass
        if len(fits) != 1:
            alternatives = [a.get("required", a.get("type")) for a in schema["oneOf"]]
            raise InvalidSpec(f"{where} must be one of {alternatives}, exactly one, got {value!r}"[:300])
        value = fits[0]
    if "not" in schema:
        try:
            check(value, schema["not"], where)
        except InvalidSpec:
            pass
        else:
            raise InvalidSpec(f"{where} must not be {schema['not']}"[:300])
    number = _TYPES["number"](value)
    if number and "minimum" in schema and value < schema["minimum"]:
        raise InvalidSpec(f"{where} must be at least {schema['minimum']}, got {value!r}")
    if number and "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise InvalidSpec(f"{where} must be more than {schema['exclusiveMinimum']}, got {value!r}")
    if number and "maximum" in schema and value > schema["maximum"]:
        raise InvalidSpec(f"{where} must be at most {schema['maximum']}, got {value!r}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        raise InvalidSpec(f"{where} is not well formed: {value!r}"[:300])
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        raise InvalidSpec(f"{where} must not be empty")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise InvalidSpec(f"{where} needs at least {schema['minItems']} item(s)")
        if len(value) > schema.get("maxItems", len(value)):
            raise InvalidSpec(f"{where} takes at most {schema['maxItems']} item(s)")
        prefix = schema.get("prefixItems", [])  # the first items' schemas; "items" is the rest's (2020-12)
        value = [check(item, prefix[i] if i < len(prefix) else schema.get("items", {}), f"{where}[{i}]")
                 for i, item in enumerate(value)]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                raise InvalidSpec(f"{where} needs {key!r}")
        out = {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if "propertyNames" in schema:
                check(key, schema["propertyNames"], f"{where}: the name {key!r}")
            if key in props:
                out[key] = check(item, props[key], f"{where}.{key}")
            elif extra is False:
                raise InvalidSpec(f"{where}: unknown field {key!r} (known: {', '.join(props) or 'none'})"[:300])
            else:
                out[key] = check(item, extra, f"{where}.{key}") if isinstance(extra, dict) else item
        value = out
    return value


def _query_value(param: Param, text: str) -> Any:
    where = f"query {param.name}"
    value: Any = text
    if param.type == "boolean":
        if text.lower() not in BOOL_WORDS:
            raise InvalidSpec(f"{where} must be true or false (or 1, 0), got {text!r}")
        return text.lower() in ("true", "1")
    if param.type == "integer":
        if not re.fullmatch(r"-?[0-9]{1,30}", text):
            raise InvalidSpec(f"{where} must be a whole number, got {text!r}")
        value = int(text)
    elif param.type == "number":
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise InvalidSpec(f"{where} must be a finite number, got {text!r}")
    return check(value, param.schema, where)


def query_args(route: Route, query: Mapping[str, list[str]]) -> dict[str, Any]:
    known = {p.name: p for p in route.query}
    out: dict[str, Any] = {}
    for name, values in query.items():
        param = known.get(name)
        if param is None:
            raise InvalidSpec(f"unknown query parameter {name!r} (known: {', '.join(known) or 'none'})")
        out[name] = _query_value(param, values[-1])
    for p in route.query:
        if p.required and p.name not in out:
            raise InvalidSpec(f"query parameter {p.name!r} is required")
    return out


# -- tokens and addresses ---------------------------------------------------------------


def read_token(path: str, what: str) -> str:
    """A token file, trusted as a config file is (a regular file, ours or root's, nobody
    else may write it: paths.read_operator_file) and, being a secret, readable by nobody
    else either; its first line is the token (at least 16 printable characters)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as err:
        raise UnsafeFile(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    data = read_operator_file(path, what, TOKEN_MAX_BYTES)
    if mode & 0o077:
        raise UnsafeFile(f"{path}: the {what} is readable by group or others (mode {mode:04o}): "
                         f"refusing to use it (chmod 600 it)")
    lines = data.decode("utf-8", "replace").splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16 or not re.fullmatch(r"[\x21-\x7e]+", token):
        raise UnsafeFile(f"{path}: the {what} must hold a token of at least 16 printable characters, no spaces")
    return token


@dataclass(frozen=True)
class Address:
    """Where to serve: ``unix:PATH`` or ``tcp://HOST:PORT`` (HOST empty: loopback)."""

    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp://{self.host}:{self.port}"


def parse_address(text: Any, state_dir: str | os.PathLike[str]) -> Address:
    """An ``--http`` value; a relative unix path is the state dir's. InvalidSpec if malformed."""
    if not isinstance(text, str):
        raise InvalidSpec(f"an http address must be a string, got {text!r}")
    if text.startswith("unix:"):
        path = text[5:]
        if not path or "\0" in path:
            raise InvalidSpec(f"http address {text!r}: unix: needs a path")
        return Address("unix", path=os.path.join(os.fspath(state_dir), path))
    m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]*):([0-9]{1,5})", text)
    if m is None or int(m.group(2)) > 65535:
        raise InvalidSpec(f"http address {text!r}: expected unix:PATH or tcp://HOST:PORT")
    host = m.group(1).strip("[]") or "127.0.0.1"
    return Address("tcp", host=host, port=int(m.group(2)))


# -- the API ------------------------------------------------------------------------------


class _EventFollower:
    __slots__ = ("exchange", "cursor", "replica", "since")

    def __init__(self, exchange: Exchange, cursor: int, replica: str | None, since: float | None) -> None:
        self.exchange = exchange
        self.cursor = cursor
        self.replica = replica
        self.since = since


class _LogFollower:
    __slots__ = ("exchange", "follower", "dirfd")

    def __init__(self, exchange: Exchange, follower: Any, dirfd: int) -> None:
        self.exchange = exchange
        self.follower = follower
        self.dirfd = dirfd


class _Answer:
    """Where a command's reply goes (a ``protocol.ReplyTo``): its client, as its route
    shapes it. ``key`` names it across an upgrade (``HttpApi.hand_over``)."""

    __slots__ = ("api", "route", "args", "exchange", "key")

    def __init__(self, api: HttpApi, route: Route, args: dict[str, Any], exchange: Exchange, key: int) -> None:
        self.api, self.route, self.args, self.exchange, self.key = api, route, args, exchange, key

    def __call__(self, msg: protocol.Reply) -> None:
        self.api.respond(self, msg)


class HttpApi:
    """The routes of ``ROUTES`` on the listeners of ``addresses`` (see the module
    docstring); ``engine`` answers the commands, ``logs_dir`` holds the captured logs.
    ``token``/``read_token``: what a TCP client must send; a TCP address without ``token``
    is refused (OSError, one line), and so is an address that cannot be bound. ``carried``:
    what an earlier image's ``hand_over`` gave (its listeners are served again, the
    commands it carried answered from here: ``reply_for``). ``on_response(method, route,
    status, seconds)`` hears every answer (``Metrics.api_request``), labelled by the route of
    the table it matched ("other": none)."""

    def __init__(self, engine: Any, reactor: Reactor, addresses: Sequence[Address], *, state_dir: str,
                 logs_dir: str | os.PathLike[str], token: str | None = None, read_token: str | None = None,
                 carried: Mapping[str, Any] | None = None,
                 on_response: Callable[[str, str, int, float], None] | None = None, **server_options: Any) -> None:
        self.engine = engine
        self.reactor = reactor
        self.state_dir = state_dir
        self.logs_dir = Path(logs_dir)
        self.token = token
        self.read_token = read_token
        self.servers: list[HttpServer] = []
        self.closed = False
        self._events: list[_EventFollower] = []
        self._written = (0, -1)  # (the store, its events_written) the event streams were pumped at
        self._behind = False  # a follower has more than one page to send: pumped next turn too
        self._logs: list[_LogFollower] = []
        self._keepalive: Timer | None = None
        self._document = json.dumps(openapi(), separators=(",", ":")).encode()
        self._answers: dict[int, _Answer] = {}  # the commands whose answer is to come, by key
        self._next_key = 0
        self._handed: list[Exchange] = []  # what hand_over made inheritable (given back by keep)
        self._addresses: list[str] = []  # each server's address, as given
        inherited = {str(item["address"]): int(item["fd"]) for item in (carried or {}).get("listeners", [])}
        uids = {os.geteuid(), 0}
        try:
            for addr in addresses:
                if addr.kind == "tcp" and token is None:
                    raise OSError(0, f"http {addr}: TCP needs --http-token-file (clients send Authorization: Bearer)")
                fd = inherited.pop(str(addr), None)
                if fd is not None:  # an upgrade's: a client that connected during the exec waits in its backlog
                    sock = socket.socket(fileno=fd)
                else:
                    sock = (unix_listener(addr.path) if addr.kind == "unix"
                            else tcp_listener(addr.host, addr.port))
                options = {"max_connections": MAX_CONNECTIONS, "on_response": on_response, **server_options}
                unix = addr.kind == "unix"
                self.servers.append(HttpServer(reactor, sock, self._serve, uids=uids if unix else None,
                                               path=addr.path if unix else None, **options))
                self._addresses.append(str(addr))
            for fd in inherited.values():  # an address the new settings do not name
                os.close(fd)
            if carried is not None:
                self._adopt(carried)
        except BaseException:
            self.close()
            raise
        reactor.at_turn_end(self._turn_end)

    def addresses(self) -> list[str]:
        """Where it listens (a tcp port 0 made concrete)."""
        out = []
        for s in self.servers:
            out.append(f"unix:{s.address}" if s.unix else f"tcp://{s.address[0]}:{s.address[1]}")
        return out

    # -- a request -------------------------------------------------------------------

    def _serve(self, request: Request, exchange: Exchange) -> None:
        try:
            route, params = self._route(request)
            exchange.method, exchange.route = route.method, route.path  # a HEAD is its GET's
            if request.peer_uid is None:
                self._authorize(request, route)
            args = self._args(route, request, params)
        except _Refused as refused:
            self._error(exchange, refused.status, refused.code, refused.message, headers=refused.headers)
            return
        except OrchestratorError as err:
            self._error(exchange, status_of(err.code), err.code, str(err))
            return
        if route.op is None:
            if request.method == "HEAD" and args.get("follow"):
                self._error(exchange, 400, "invalid", "a stream has no HEAD: GET it")
                return
            if args.get("follow") and len(self._events) + len(self._logs) >= MAX_STREAMS:
                self._error(exchange, 429, "too_many_streams", f"{MAX_STREAMS} streams are open already: "
                                                               f"try again once one has closed")
                return
            getattr(self, f"_local_{route.local}")(route, args, request, exchange)
            return
        self._command(route, args, exchange)

    def _route(self, request: Request) -> tuple[Route, dict[str, str]]:
        allowed: list[str] = []
        for route in ROUTES:
            m = route.pattern.match(request.path)
            if m is None:
                continue
            if route.method == request.method or (route.method == "GET" and request.method == "HEAD"):
                return route, m.groupdict()
            allowed.append(route.method)
        if allowed:
            raise _Refused(405, "method_not_allowed", f"{request.method} {request.path}: use {', '.join(allowed)}",
                           [("Allow", ", ".join(allowed))])
        raise _Refused(404, "no_route", f"no route {request.path!r} (GET /openapi.json lists them)")

    def _authorize(self, request: Request, route: Route) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        given = given.strip()
        challenge = [("WWW-Authenticate", 'Bearer realm="orchestrator"')]
        if scheme.lower() != "bearer" or not given:
            raise _Refused(401, "unauthorized", "send Authorization: Bearer TOKEN", challenge)
        if self.token is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            return
        if self.read_token is not None and hmac.compare_digest(given.encode(), self.read_token.encode()):
            if route.write:
                raise _Refused(403, "read_only", f"{route.method} {route.path} changes the daemon: "
                                                 f"this token may only read")
            return
        raise _Refused(401, "unauthorized", "the token is not valid", challenge)

    def _args(self, route: Route, request: Request, params: Mapping[str, str]) -> dict[str, Any]:
        args: dict[str, Any] = {}
        if route.body is not None and request.body.strip():
            try:
                doc = json.loads(request.body, parse_constant=_no_constant)
            except (ValueError, RecursionError) as err:
                raise InvalidSpec(f"the body is not JSON: {str(err).splitlines()[0]}") from None
            args.update(check(doc, route.body))
        elif route.body is not None:
            check({}, route.body)
        elif request.body.strip():
            raise InvalidSpec(f"{route.method} {route.path} takes no body")
        args.update(query_args(route, request.query))
        args.update(params)
        if route.op == "launch" and isinstance(args.get("spec"), dict) and "pickled" in args["spec"]:
            raise InvalidSpec("spec.pickled: a pickled callable is for Python clients, not over HTTP")
        return args

    def _error(self, exchange: Exchange, status: int, code: str, message: str, data: Any = None,
               headers: Sequence[tuple[str, str]] = ()) -> None:
        err: dict[str, Any] = {"code": code, "message": message.splitlines()[0] if message else code}
        if data is not None:
            err["data"] = data
        exchange.respond(status, JSON, _dumps({"error": err}), headers)

    def _command(self, route: Route, args: dict[str, Any], exchange: Exchange) -> None:
        self.engine.handle(protocol.command(route.op or "", args, "http"), self._answer(route, args, exchange))

    def _answer(self, route: Route, args: dict[str, Any], exchange: Exchange) -> _Answer:
        self._next_key += 1
        answer = _Answer(self, route, args, exchange, self._next_key)
        self._answers[answer.key] = answer
        exchange.on_close = functools.partial(self._forget, answer.key)
        return answer

    def _forget(self, key: int) -> None:
        self._answers.pop(key, None)

    def respond(self, answer: _Answer, msg: protocol.Reply) -> None:
        """A command's reply, to its client as the route shapes it (``_Answer`` calls it)."""
        self._answers.pop(answer.key, None)
        route, args, exchange = answer.route, answer.args, answer.exchange
        if exchange.closed:
            return  # the client left while its command waited
        if not msg["ok"]:
            self._error(exchange, status_of(msg["code"]), msg["code"], msg["error"], msg.get("data"))
            return
        try:
            result = msg["result"]
            if route.shape is not None:
                result = route.shape(result, args, self)
            if route.ctype == JSON:
                status = 503 if route.op == "health" and not result.get("healthy") else 200
                exchange.respond(status, JSON, _dumps(result))
            else:
                exchange.respond(200, route.ctype, str(result).encode())
        except Exception as err:  # a shape's bug is this request's 500, never the loop's
            log.exception("http: %s %s", route.method, route.path)
            self._error(exchange, 500, "internal", f"{type(err).__name__}: {err}")

    # -- an upgrade (handover.py) ------------------------------------------------------

    def key_of(self, reply: Any) -> int | None:
        """The key by which an upgrade carries ``reply`` (a command of ours whose answer is
        still to come), else None."""
        if isinstance(reply, _Answer) and self._answers.get(reply.key) is reply and not reply.exchange.closed:
            return reply.key
        return None

    def hand_over(self, replies: Sequence[Any]) -> dict[str, Any]:
        """Before an upgrade's exec: every listener, and the connections of ``replies`` (the
        upgrade's own, the open waits': ``key_of``), carried (their fds made inheritable);
        the streams ended cleanly once what is journaled is sent (a client resumes with
        Last-Event-ID, on the same listener, and misses nothing); the connections whose
        request is not read whole yet carried too, with what was read of it (the next image
        reads on); anything else (an answer being written) closes with the exec. What the
        next image's ``HttpApi(carried=...)`` takes."""
        self._turn_end()  # what the last commit journaled reaches every follower first
        for follower in self._events:
            follower.exchange.end()
        for entry in self._logs:
            entry.exchange.end()
        listeners = []
        for address, server in zip(self._addresses, self.servers):
            server.listener().set_inheritable(True)
            listeners.append({"address": address, "fd": server.listener().fileno()})
        pending = []
        for reply in replies:
            key = self.key_of(reply)
            if key is None:
                continue
            answer = self._answers[key]
            conn = answer.exchange.hand_over()
            if conn is not None:
                self._handed.append(answer.exchange)
                pending.append({**conn, "key": key, "server": self.servers.index(answer.exchange.server),
                                "route": [answer.route.method, answer.route.path], "args": answer.args})
        reading = [{**conn, "server": index} for index, server in enumerate(self.servers)
                   for conn in server.hand_over_reading()]
        return {"listeners": listeners, "pending": pending, "reading": reading}

    def keep(self) -> None:
        """The exec did not happen: what ``hand_over`` made inheritable is this image's again."""
        for server in self.servers:
            server.listener().set_inheritable(False)
            server.keep_reading()
        for exchange in self._handed:
            exchange.keep()
        self._handed.clear()

    def reply_for(self, key: Any) -> protocol.ReplyTo | None:
        """Where the answer of a command an earlier image carried (``hand_over``) goes."""
        return self._answers.get(key) if isinstance(key, int) else None

    def _adopt(self, carried: Mapping[str, Any]) -> None:
        for item in carried.get("pending", []):
            sock = socket.socket(fileno=int(item["fd"]))
            method, path = item["route"]
            route = next((r for r in ROUTES if r.method == method and r.path == path), None)
            address = carried["listeners"][int(item["server"])]["address"]
            if route is None or address not in self._addresses:
                sock.close()  # its listener is not served any more: nobody to answer it
                continue
            exchange = self.servers[self._addresses.index(address)].adopt(sock, str(item["version"]), str(item["method"]),
                                                 str(item["target"]))
            exchange.method, exchange.route = route.method, route.path
            answer = _Answer(self, route, dict(item["args"]), exchange, int(item["key"]))
            self._answers[answer.key] = answer
            self._next_key = max(self._next_key, answer.key)
            exchange.on_close = functools.partial(self._forget, answer.key)
        for item in carried.get("reading", []):
            sock = socket.socket(fileno=int(item["fd"]))
            address = carried["listeners"][int(item["server"])]["address"]
            if address not in self._addresses:
                sock.close()
                continue
            self.servers[self._addresses.index(address)].adopt_reading(sock, str(item["data"]))

    # -- served here -----------------------------------------------------------------

    def _local_openapi(self, route: Route, args: dict[str, Any], request: Request, exchange: Exchange) -> None:
        exchange.respond(200, JSON, self._document)

    def _store(self) -> Any:
        return self.engine.journal.store

    def _local_events(self, route: Route, args: dict[str, Any], request: Request, exchange: Exchange) -> None:
        replica, since, limit = args.get("replica"), args.get("since"), args.get("limit")
        store = self._store()
        if replica is not None and (store is None or not store.events(replica=replica, limit=1)):
            # as `events --replica` says it: a replica the journal has no event of is unknown
            self._error(exchange, 404, "unknown_replica", f"unknown replica {replica!r}")
            return
        after = args.get("after", 0)
        last_id = request.headers.get("last-event-id", "").strip()
        if last_id:
            if not re.fullmatch(r"[0-9]{1,18}", last_id):
                self._error(exchange, 400, "invalid", f"Last-Event-ID must be an event seq, got {last_id!r}")
                return
            after = int(last_id)
        if not args.get("follow"):
            rows = store.events(replica=replica, since=since, after_seq=after, limit=limit) if store else []
            exchange.respond(200, JSON, _dumps(rows))
            return
        exchange.start(200, SSE, [("X-Accel-Buffering", "no")])
        follower = _EventFollower(exchange, after, replica, since)
        if limit is not None and store is not None:  # the last ``limit`` of what there is, then what comes
            follower.cursor = max(after, store.last_seq() - limit)
        exchange.send(b": orchestrator " + __version__.encode() + b"\n\n")
        self._events.append(follower)
        exchange.on_close = lambda: self._events.remove(follower) if follower in self._events else None
        self._pump_events(store.last_seq() if store is not None else 0)
        self._arm_keepalive()

    def _local_logs(self, route: Route, args: dict[str, Any], request: Request, exchange: Exchange) -> None:
        from ..logread import Follower, tail  # file readers: they never ask the daemon anything
        from ..logfiles import log_paths, open_dir

        rid, stream, lines = args["id"], args.get("stream", "out"), args.get("lines", 10)
        if protocol.parse_replica_id(rid) is None or not (log_paths(self.logs_dir, rid, "out")
                                                        or log_paths(self.logs_dir, rid, "err")):
            self._error(exchange, 404, "not_found", f"no logs of replica {rid!r}")
            return
        if not args.get("follow"):
            exchange.respond(200, JSON, _dumps({"id": rid, "stream": stream,
                                                "lines": tail(self.logs_dir, rid, stream=stream, lines=lines)}))
            return
        dirfd = open_dir(self.logs_dir)
        if dirfd is None:
            self._error(exchange, 404, "not_found", f"no logs of replica {rid!r}")
            return
        follower = Follower(rid, f"{rid}.{stream}")
        exchange.start(200, TEXT)
        first = follower.start(dirfd, self.logs_dir, lines)
        exchange.send(b"".join(line + b"\n" for line in first))
        entry = _LogFollower(exchange, follower, dirfd)
        self._logs.append(entry)

        def closed() -> None:
            if entry in self._logs:
                self._logs.remove(entry)
            follower.close()
            os.close(dirfd)

        exchange.on_close = closed
        self._arm_keepalive()

    # -- streams, at the end of every turn ------------------------------------------------

    def _turn_end(self) -> None:
        if self.closed:
            return
        if self._events:
            store = self._store()
            # Only once this turn committed events (or a follower has pages left): no query
            # of the journal in a turn that wrote none.
            if store is not None and (self._behind or (id(store), store.events_written) != self._written):
                self._written = (id(store), store.events_written)
                try:
                    self._pump_events(store.last_seq())
                except Exception:  # a store that fails to read: the streams wait for the next turn
                    self._behind = True
                    log.exception("http: reading events")
        if self._logs:
            now = self.reactor.monotonic()
            for entry in list(self._logs):
                try:
                    lines = entry.follower.poll(entry.dirfd, self.logs_dir, now)
                except OSError:
                    continue
                if lines:
                    entry.exchange.send(b"".join(line + b"\n" for line in lines))

    def _pump_events(self, top: int) -> None:
        """What the journal has up to ``top`` to every follower behind it: one query for them
        all (from the furthest behind, a page at most), each event encoded once, then each
        follower's filter in Python (a query per follower made the last of 20 clients wait
        for 20 queries: the tail of an event's way to a client)."""
        store = self._store()
        behind = [f for f in self._events if f.cursor < top]
        if store is None or not behind:
            self._behind = False
            return
        rows = store.events(after_seq=min(f.cursor for f in behind), limit=PAGE)
        end = rows[-1]["seq"] if len(rows) == PAGE else top  # read up to here: a page more next turn
        frames: dict[int, bytes] = {}  # seq -> its frame, made when a follower first wants it

        def frame(row: Any) -> bytes:
            seq = row["seq"]
            if seq not in frames:
                frames[seq] = (f"id: {seq}\nevent: {row['kind']}\n"
                               f"data: {json.dumps(row, separators=(',', ':'))}\n\n").encode()
            return frames[seq]

        more = False
        for f in behind:
            chunk = b"".join(frame(row) for row in rows if row["seq"] > f.cursor
                             and (f.replica is None or row["replica"] == f.replica)
                             and (f.since is None or row["ts"] >= f.since))
            f.cursor = max(f.cursor, end)  # filtered out up to end: seen
            if chunk:
                f.exchange.send(chunk)
            more = more or f.cursor < top
        self._behind = more
        if more:  # the rest in the next turn, which this makes happen
            self.reactor.call_soon(lambda: None)

    def _arm_keepalive(self) -> None:
        if self._keepalive is None and not self.closed:
            self._keepalive = self.reactor.call_later(KEEPALIVE, self._on_keepalive)

    def _on_keepalive(self) -> None:
        self._keepalive = None
        for f in list(self._events):
            f.exchange.send(b": keepalive\n\n")
        if self._events or self._logs:
            self._arm_keepalive()

    def close(self) -> None:
        """Every listener and connection closed (streams end). Idempotent."""
        self.closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        for server in self.servers:
            server.close()


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, list(headers)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _dumps(doc: Any) -> bytes:
    return (json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n").encode()


# -- the document -----------------------------------------------------------------------


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``ROUTES``."""
    paths: dict[str, dict[str, Any]] = {}
    errors = {str(s): {"description": d, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
              for s, d in ((400, "bad input"), (401, "no valid token"), (403, "a read-only token writing"),
                           (404, "not found"), (405, "another method"), (409, "refused in this state"),
                           (413, "body too large"), (429, "too many streams open"),
                           (503, "shutting down, busy or the journal failing"))}
    for route in ROUTES:
        op: dict[str, Any] = {
            "operationId": route.path.strip("/").replace("/", "_").replace("{", "").replace("}", "").replace(".", "_")
            + ("" if route.method == "GET" else f"_{route.method.lower()}"),
            "summary": route.summary,
            "tags": ["write" if route.write else "read"],
        }
        params = [{"name": p.name, "in": "query", "required": p.required, "description": p.description,
                   "schema": p.schema} for p in route.query]
        params += [{"name": name, "in": "path", "required": True, "schema": REPLICA_ID}
                   for name in re.findall(r"\{(\w+)\}", route.path)]  # the one path parameter: a replica's id
        if params:
            op["parameters"] = params
        if route.body is not None:
            op["requestBody"] = {"required": bool(route.body.get("required") or route.body.get("oneOf")),
                                 "content": {JSON: {"schema": route.body}}}
        content: dict[str, Any] = {route.ctype: {"schema": route.result}}
        if route.stream == SSE:  # one event, as a client's parser gives it (data: an event of `events`, as JSON)
            content[SSE] = {"schema": {"type": "object", "properties": {"id": STR, "event": STR, "data": STR}}}
        elif route.stream is not None:
            content[route.stream] = {"schema": STR}
        op["responses"] = {"200": {"description": "done", "content": content}, **errors}
        if route.op == "health":
            op["responses"]["503"] = {"description": "unhealthy", "content": {JSON: {"schema": route.result}}}
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "orchestrator control plane", "version": __version__,
                 "description": "The CLI's verbs as JSON over HTTP; replies are the CLI's --json shapes."},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }


__all__ = ["ROUTES", "Address", "HttpApi", "Route", "check", "openapi", "parse_address", "read_token"]

if __name__ == "__main__":  # the document, for docs/openapi.json: python -m orchestrator.daemon.httpapi
    print(json.dumps(openapi(), indent=1, sort_keys=True))
