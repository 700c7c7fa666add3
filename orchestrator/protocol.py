"""The shapes that cross between a caller and the control loop, in one place.

A command is plain data, the same object in-process (the embedded API) and on the wire
(the daemon's channel)::

    {"id": <str | int | None>, "op": "launch", "args": {...}}

A reply answers one command, by its id::

    {"id": ..., "ok": true, "result": ...}
    {"id": ..., "ok": false, "code": "<error code>", "error": "<one line>"}

and, where the error has them, ``"data"`` (what a failed command still has to say) and
``"fields"`` (its ``wire_fields``: ``{"reason": ..., "task": ...}`` of a WorkerLost). Error
codes map to the typed errors of ``errors.py``, one table both ways (``error`` builds the
reply, ``raise_reply`` raises the same class again); the shapes are ``Command``, ``OkReply``
and ``ErrorReply`` below, and a reply goes to a ``ReplyTo``. Between the
manager server and the daemon, commands and replies travel as length-prefixed JSON frames
(``encode_frame``/``FrameReader``): JSON cannot carry code, and NaN is refused on the way in.

The argument checks that every command shares (pool names, counts, time-outs) live here
too, so the engine, the CLI and the API refuse the same inputs with the same words.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any, Callable, Literal, Mapping, NotRequired, TypedDict

from .errors import FrameTooLarge, InvalidSpec, OrchestratorError, from_wire, to_wire

MAX_COUNT = 10_000  # replicas one launch may add, and the largest size a scale may set
DEFAULT_WAIT = 3600.0  # a wait without a time-out is still bounded
DEFERRED = object()  # a command handler's result when its reply comes later (a wait)
READ_ONLY = frozenset({"status", "wait", "ping", "health", "metrics", "show", "is_active"})  # never journaled, never need the disk
# Never journaled as ``command`` events either: reads and polls. An idle daemon-mode
# executor polls task_events about once a second; journaled, it pushed the real history out.
UNJOURNALED = READ_ONLY | {"task_events", "tasks", "task_result"}

_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_REPLICA_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,63})-([0-9]{1,18})")
_TASK_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/([1-9][0-9]{0,17})")
_FRAME = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a command or reply this large is refused with an error, never sent


# -- commands and replies ----------------------------------------------------------


# A caller's own name for its command, echoed in the reply (one that came over the wire is
# echoed as it came: the loop does not check it).
CommandId = str | int | None


class Command(TypedDict):
    """One command, in-process and on the wire."""

    id: CommandId
    op: str
    args: Mapping[str, Any]  # the command's own arguments, checked by its handler


class OkReply(TypedDict):
    id: CommandId
    ok: Literal[True]
    result: Any  # the command's result: plain data (``is_plain``), its shape the command's
    unsaved: NotRequired[str]  # applied, but the journal's commit failed: why (Engine.settle)


class ErrorReply(TypedDict):
    id: CommandId
    ok: Literal[False]
    code: str  # an error code of ``errors.ERROR_TYPES``
    error: str  # one line
    data: NotRequired[Any]  # what the caller may still want (the ids a launch made)
    fields: NotRequired[dict[str, Any]]  # the error's wire_fields that are set (errors.to_wire)


Reply = OkReply | ErrorReply
ReplyTo = Callable[[Reply], None]  # where the loop sends a command's reply


def command(op: str, args: Mapping[str, Any] | None = None, cmd_id: CommandId = None) -> Command:
    return {"id": cmd_id, "op": op, "args": args or {}}


def ok(cmd_id: CommandId, result: Any) -> OkReply:
    return {"id": cmd_id, "ok": True, "result": result}


def error(cmd_id: CommandId, err: OrchestratorError | str, code: str | None = None, data: Any = None) -> ErrorReply:
    """An error reply; ``data`` is what the caller may still want (the ids a launch made).
    A typed error keeps its code, data and fields (``errors.to_wire``); a bare line is an
    OrchestratorError's, or ``code``'s."""
    if isinstance(err, str):
        err = OrchestratorError(err)
    wire = to_wire(err)
    msg: ErrorReply = {"id": cmd_id, "ok": False, "code": code or wire["code"], "error": wire["error"]}
    if "fields" in wire:
        msg["fields"] = wire["fields"]
    if data is not None or "data" in wire:
        msg["data"] = data if data is not None else wire["data"]
    return msg


def raise_reply(msg: Mapping[str, Any]) -> Any:
    """The result of a reply, or the typed error it carries. ``msg`` as it came (a peer's
    JSON is read, not trusted to be a ``Reply``)."""
    if msg.get("ok"):
        return msg.get("result")
    raise from_wire(msg)


# -- argument checks ----------------------------------------------------------------


def pool_name(name: Any) -> str:
    if not isinstance(name, str) or not _POOL_NAME.fullmatch(name):
        raise InvalidSpec(f"invalid pool name {name!r} (up to 64 letters, digits, '_', '.', '-')")
    return name


def parse_replica_id(rid: str) -> tuple[str, int] | None:
    """(pool, n) of a well-formed id ``<pool>-<n>``, else None. ASCII digits only: a
    Unicode digit passes str.isdigit() and then breaks int()."""
    m = _REPLICA_ID.fullmatch(rid)
    return (m.group(1), int(m.group(2))) if m else None


KEY_MAX = 200  # bytes of a task's key (UTF-8)


def task_key(raw: Any) -> str:
    """A task's key (``options(key=)``, ``submit --key``): a str of 1 to KEY_MAX bytes in
    UTF-8, without ``/`` (``POOL/@KEY`` names its task); else InvalidSpec, one line."""
    if not isinstance(raw, str):
        raise InvalidSpec(f"a task key must be a str, got {type(raw).__name__}")
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidSpec(f"a task key must be text that UTF-8 can encode, got {raw[:40]!r}") from None
    if not size or size > KEY_MAX:
        raise InvalidSpec(f"a task key must be 1 to {KEY_MAX} bytes in UTF-8, got {size}")
    if "/" in raw:
        raise InvalidSpec(f"a task key must not contain '/', got {raw[:40]!r}")
    return raw


def parse_task_ref(text: Any) -> tuple[str, int | str] | None:
    """A task named by its id (``POOL/N``: (pool, n)) or by its key (``POOL/@KEY``: (pool,
    key)); None if ``text`` is neither (a key is checked as ``task_key`` checks it)."""
    if not isinstance(text, str):
        return None
    pool, sep, rest = text.partition("/")
    if sep and rest.startswith("@") and _POOL_NAME.fullmatch(pool):
        try:
            return pool, task_key(rest[1:])
        except InvalidSpec:
            return None
    return parse_task_id(text)


def parse_task_id(task_id: Any) -> tuple[str, int] | None:
    """(pool, n) of a task id as the daemon hands them out (``<pool>/<n>``, n from 1, no
    leading zero), else None. ASCII digits only: ``jobs/²`` passes str.isdigit() and breaks
    int(), and ``jobs/１`` or ``jobs/01`` would be read as ``jobs/1``, which they are not."""
    m = _TASK_ID.fullmatch(task_id) if isinstance(task_id, str) else None
    return (m.group(1), int(m.group(2))) if m else None


def replica_ids(ids: Any, what: str, *, one_is_enough: bool = False) -> list[str]:
    if isinstance(ids, str) and one_is_enough:
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidSpec(f"{what} needs a list of replica ids")
    return ids


def count(value: Any, *, low: int = 1, what: str = "count") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_COUNT:
        raise InvalidSpec(f"{what} must be an integer from {low} to {MAX_COUNT}, got {value!r}")
    return value


def seconds(value: Any, what: str, *, allow_none: bool = False) -> float | None:
    """A finite, non-negative number of seconds (a NaN would stall the timer heap, an inf
    wait forever; a bool is no number of seconds)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0
    ):
        raise InvalidSpec(f"{what} must be a finite non-negative number, got {value!r}")
    return float(value)


def wait_timeout(args: Mapping[str, Any]) -> float:
    """A wait's bound, checked before the command does anything."""
    timeout = seconds(args.get("timeout"), "timeout", allow_none=True)
    return DEFAULT_WAIT if timeout is None else timeout


def client_bound(timeout: float | None) -> float | None:
    """How long a caller waits for the reply of a command that itself waits ``timeout``."""
    return None if timeout is None else timeout + 10.0


# -- frames between the manager server and the daemon ---------------------------------


def encode_frame(msg: Any, what: str = "message") -> bytes:
    """One frame; FrameTooLarge (errors.py) over ``MAX_FRAME``, ValueError for NaN and friends."""
    data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_FRAME:
        raise FrameTooLarge(f"{what} is too large: {len(data) / (1 << 20):.1f} MiB as JSON, "
                            f"the limit is {MAX_FRAME >> 20} MiB")
    return _FRAME.pack(len(data)) + data


class FrameReader:
    """Splits a byte stream into JSON frames; a frame that is not JSON is skipped."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.errors = 0

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            (size,) = _FRAME.unpack_from(self._buf)
            if size > MAX_FRAME:  # no sender of ours writes one: a corrupt stream, never resynchronised
                self._buf.clear()
                self.errors += 1
                break
            if len(self._buf) < 4 + size:
                break
            raw = bytes(self._buf[4 : 4 + size])
            del self._buf[: 4 + size]
            try:
                out.append(json.loads(raw))
            except ValueError:
                self.errors += 1
        return out


def is_plain(obj: Any, depth: int = 0) -> bool:
    """Plain data only: dict (str keys), list, str, int, float, bool, None; bounded depth."""
    if depth > 32:
        return False
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return True
    if isinstance(obj, list):
        return all(is_plain(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and is_plain(v, depth + 1) for k, v in obj.items())
    return False
