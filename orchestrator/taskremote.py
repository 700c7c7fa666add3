"""The executor's side of a pool in a running daemon (``Executor(state_dir=...)``, in
executor.py): the command channel with its reconnects (``Remote``), the thread that sends
submits in batches, and the session's own task numbers (``Numbers``). ``Backend`` is what
both kinds of executor reach their control loop through (the embedded one: executor.py).

A daemon that goes away (``stop`` then ``start``, a kill -9 then ``start``, an upgrade)
does not end the client: the call that finds it away waits while one thread reconnects
(the daemon's new auth key, a new connection) and registers the session again (the
executor's ``rejoin``), for up to ``reconnect_timeout`` seconds. Each task carries the
number its session was granted, so a batch sent again (its reply never came) can never
run a task twice: the daemon takes a number it has as that task.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any, Callable, Mapping, NotRequired, Protocol, TypedDict, TypeVar, cast

from .errors import AWAY, ChannelError, OrchestratorError, ShuttingDown
from .paths import Paths
from .protocol import error

FIRST_BLOCK = 16  # task numbers a session is granted first; each next block twice as many...
BLOCK_MAX = 1024  # ...up to this
EMBEDDED_BLOCK = 1 << 31  # an embedded pool is its session's alone: one block that never runs out
SPARE_WAIT = 5.0  # the next block, asked for with a batch, is waited for this long at most

R = TypeVar("R")
F = TypeVar("F")  # the executor's future


class Place(TypedDict, total=False):
    """A task's own options, from a view of its executor (``Executor.options``): where it
    goes in its pool's queue, its timeout and retries in place of the pool's, its key, its
    deadline and backoff (its retry_on travels in its pickled call: the loop loads no payload)."""

    priority: int
    tenant: str
    timeout: float | None
    retries: int
    key: str  # names one task of the pool: a second submit with it is that task
    deadline: float  # seconds from the submit: past it the task is TIMED_OUT
    backoff: list[float]  # [MIN, MAX] seconds before a re-run after an exception of retry_on


class Submit(Place):
    """One task as an executor hands it to its ``Backend`` (``task_submit``'s arguments, from
    an embedded executor as they are); a view's options (``Place``) too."""

    pool: str
    session: str
    ref: int  # the executor's own name for it, until the loop names it
    payload: bytes  # the pickled (fn, args, kwargs): opaque to the loop
    n: int | None  # the task number its session was granted (``Numbers``); None: a daemon that grants none


class NumbersAsk(TypedDict):
    """``task_numbers``'s arguments: a block of ``count`` task numbers for a session."""

    pool: str
    session: str
    count: int


class BatchTask(Place):
    """A task in a ``task_submit`` batch on the daemon's channel (JSON: no bytes)."""

    payload: str  # base64 of Submit's payload
    ref: int
    n: int | None


class SubmitBatch(TypedDict):
    """``task_submit``'s arguments from ``Remote``: the tasks of one session, one round trip."""

    pool: str
    session: str
    tasks: list[BatchTask]
    numbers: NotRequired[int]  # also a block of this many task numbers, in the reply
    resend: NotRequired[bool]  # sent before, its reply lost: a task the daemon has is that task


Answer = Callable[[Mapping[str, Any]], None]  # a submit's reply, or ``{"ok": False, "error", "code"}``


class Channel(Protocol):
    """What ``Remote`` uses of the daemon's ``Client`` (client/channel.py), handed to it."""

    @property
    def paths(self) -> Paths: ...  # where its tasks' logs are (a handle's log())
    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any: ...
    def through_restart(self, attempt: Callable[[], R], err: OrchestratorError, window: float,
                        stop: threading.Event | None = None) -> R: ...
    def close_thread(self) -> None: ...
    def close(self) -> None: ...


class Numbers:
    """A session's task numbers: the block in use, [next, end), and in daemon mode the next
    block (``spare``), asked for with a batch of submits as soon as the one before it is
    taken into use, so that a burst of submits does not wait for a grant of its own. Blocks
    start small (a client that submits a few tasks and leaves skips few numbers; it gives
    the rest back) and double up to BLOCK_MAX. ``lock`` is held by whoever takes one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.came = threading.Condition(self.lock)  # a spare asked for came (or will not)
        self.next = self.end = self.size = 0
        self.spare: list[int] | None = None
        self.asked = False  # a spare is on its way (asked for with a batch)

    def use(self, block: list[int]) -> None:
        first, count = block
        self.next, self.end, self.size = first, first + count, count

    def next_size(self) -> int:
        return max(min(self.size * 2, BLOCK_MAX), self.size)

    def use_spare(self) -> bool:
        """The spare taken into use; one asked for is waited for (its batch's reply is on its
        way: a grant of its own would take as long), a bounded while."""
        self.came.wait_for(lambda: not self.asked, timeout=SPARE_WAIT)
        if self.spare is None:
            return False
        block, self.spare = self.spare, None
        self.use(block)
        return True

    def add_spare(self, block: list[int] | None) -> None:
        """What the batch that asked brought (None: nothing, it failed; the sender's thread)."""
        with self.lock:
            self.asked = False
            if block:
                self.spare = block
            self.came.notify_all()

    def held(self) -> list[list[int]]:
        """[first, end) of the numbers granted and not used yet: the block in use, the spare.
        Read without ``lock``: a reconnect asks (the executor's rejoin) while a submit may
        hold it, waiting for that reconnect (its own grant); a number taken meanwhile is
        named once too often, which the daemon takes as arrived when it comes."""
        first, end, spare = self.next, self.end, self.spare
        held = [[first, end]] if first < end else []
        if spare is not None:
            held.append([spare[0], spare[0] + spare[1]])
        return held

    def unused(self) -> list[int] | None:
        """[first, end] of the numbers granted and not used, if they are one range that
        ends with the latest grant (the spare follows the block in use unless another
        session took numbers in between); forgotten here."""
        with self.lock:
            latest = self.spare if self.spare is not None else [self.next, self.end - self.next]
            first, end = latest[0], latest[0] + latest[1]
            if self.spare is not None and self.spare[0] == self.end:
                first = self.next
            self.spare, self.next, self.end = None, 0, 0
        return [first, end] if first < end else None


class Backend:
    """How an executor reaches the control loop that runs its pool."""

    handle: Any  # what runs the pool: the embedded Orchestrator, or the daemon's Client (Executor.orchestrator)

    def call(self, op: str, args: Mapping[str, Any], timeout: float | None = None, *, retry: bool = True) -> Any:
        raise NotImplementedError

    def submit(self, args: Submit, on_reply: Answer) -> None:
        raise NotImplementedError

    def ask_numbers(self, args: NumbersAsk, deliver: Callable[[list[int] | None], None]) -> None:
        """Ask for a block of task numbers (``task_numbers`` with ``args``) without waiting:
        ``deliver`` gets it (or None) when it comes."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Remote(Backend):
    """A running daemon, over its command channel (``Client``). Submits are sent in batches
    by a thread of their own: each waits for nothing, and a burst costs one round trip per
    batch, not per task.

    A daemon that goes away does not end this client: the call that finds it away waits
    (``recover``) while one thread reconnects (the daemon's new key, a new connection) and
    registers the session again (``rejoin``, the executor's), for up to
    ``reconnect_timeout`` seconds; then every waiting call tries again. A batch whose reply
    did not come is sent again (``resend``): the daemon knows each task by the number this
    side gave it, so a task that arrived the first time is not queued twice."""

    def __init__(self, client: Channel, reconnect_timeout: float) -> None:
        """``client``: the daemon's ``Client`` (made by the executor: a shared module does
        not import the client's side itself)."""
        if isinstance(reconnect_timeout, bool) or not isinstance(reconnect_timeout, (int, float)) or \
                not 0 <= reconnect_timeout < float("inf"):
            raise ValueError(f"reconnect_timeout must be a finite number of seconds, got {reconnect_timeout!r}")
        self.handle: Channel = client
        self.reconnect_timeout = float(reconnect_timeout)
        self.rejoin: Callable[[float], None] = lambda timeout: None  # the executor's
        self.gone = threading.Event()  # the executor is closing: a reconnect gives up
        self._link = threading.Condition()
        self._generation = 0  # reconnects so far
        self._recovering = False
        self._broken: OrchestratorError | None = None  # the window passed: every call fails with it
        self._unsent: list[tuple[Submit, Answer]] = []
        self._inflight: set[int] = set()  # the refs of the batch on its way...
        self._inflight_n: list[int] = []  # ...and their task numbers
        self._want_numbers = 0  # task numbers to ask for with the next batch...
        self._on_numbers: Callable[[list[int] | None], None] = lambda block: None  # ...and where they go
        self._wake = threading.Condition()
        self._sending = threading.Lock()  # held while a batch is on its way
        self._closed = False
        self._sender = threading.Thread(target=self._send, name="executor-submit", daemon=True)
        self._sender.start()

    def raw_call(self, op: str, args: Mapping[str, Any], timeout: float | None = None) -> Any:
        """One call, as it goes: no waiting for a daemon that is away."""
        if op == "executor" and isinstance(args.get("init"), bytes):
            args = {**args, "init": base64.b64encode(args["init"]).decode("ascii")}  # JSON carries no bytes
        # A TypedDict (SubmitBatch) is a dict at run time: no copy.
        return self.handle.call(op, args if isinstance(args, dict) else dict(args), timeout)

    def call(self, op: str, args: Mapping[str, Any], timeout: float | None = None, *, retry: bool = True) -> Any:
        """A call; one that finds the daemon away is made again once this client is back
        with it (``recover``), unless ``retry`` is False."""
        while True:
            seen = self._generation
            try:
                return self.raw_call(op, args, timeout)
            except AWAY as err:
                if not retry:
                    raise
                self.recover(seen, err)

    def recover(self, seen: int, err: OrchestratorError) -> None:
        """A call made at reconnect ``seen`` failed with ``err``, as a call to a daemon that
        is away does. Returns once this client is back with its daemon (the caller tries
        again); raises the error that ends this executor once ``reconnect_timeout`` has
        passed (or at once, if it has passed already, or the executor is closing)."""
        with self._link:
            while True:
                if self._broken is not None:
                    raise self._broken
                if self._generation != seen:
                    return  # another thread reconnected meanwhile
                if self.gone.is_set():
                    raise ShuttingDown("the executor is shutting down")
                if not self._recovering:
                    self._recovering = True
                    break
                self._link.wait()
        broken: OrchestratorError | None = ChannelError("the executor shut down while it reconnected")
        try:
            broken = self._reconnect(err)
        finally:
            with self._link:
                self._recovering = False
                if broken is None:
                    self._generation += 1
                else:
                    self._broken = broken
                self._link.notify_all()
        if broken is not None:
            raise broken

    def _reconnect(self, err: OrchestratorError) -> OrchestratorError | None:
        """Until the daemon takes this session again (None), or the error that ends this
        executor: the window passed (ChannelError), or the daemon refuses the session (its
        pool was deleted meanwhile)."""
        deadline = time.monotonic() + self.reconnect_timeout

        def rejoin() -> None:
            self.rejoin(max(1.0, min(deadline - time.monotonic(), 30.0)))

        try:
            self.handle.through_restart(rejoin, err, self.reconnect_timeout, self.gone)
        except OrchestratorError as end:
            return end
        return None

    def submit(self, args: Submit, on_reply: Answer) -> None:
        with self._wake:
            if self._closed:
                raise ShuttingDown("the executor is shutting down")
            self._unsent.append((args, on_reply))
            self._wake.notify()

    def unsend(self, ref: int) -> bool:
        """Take a task back before it was sent (its cancel); False if it has been sent,
        in which case the daemon has it by the time this returns."""
        with self._sending, self._wake:
            for i, (args, _) in enumerate(self._unsent):
                if args["ref"] == ref:
                    del self._unsent[i]
                    return True
        return False

    def take_back(self) -> list[int]:
        """Every task not sent yet, taken back (a shutdown that cancels): their refs."""
        with self._sending, self._wake:
            taken, self._unsent = self._unsent, []
        return [args["ref"] for args, _ in taken]

    def ask_numbers(self, args: NumbersAsk, deliver: Callable[[list[int] | None], None]) -> None:
        """With the next batch of submits: no round trip of its own."""
        with self._wake:
            self._want_numbers, self._on_numbers = args["count"], deliver

    def acknowledged(self, items: list[tuple[int, F]]) -> list[tuple[int, F]]:
        """Of (ref, future) ``items``, those whose submit the daemon acknowledged (not
        waiting to be sent, nor on their way: those are sent again, to the daemon as it is)."""
        with self._wake:
            waiting = self._inflight | {args["ref"] for args, _ in self._unsent}
        return [(ref, fut) for ref, fut in items if ref not in waiting]

    def unacknowledged(self) -> list[int]:
        """The task numbers of the submits not sent yet or on their way (a reconnect: the
        daemon is told they are coming, so that a cancel by id of one lands meanwhile)."""
        with self._wake:
            return self._inflight_n + [n for args, _ in self._unsent if (n := args["n"]) is not None]

    def _send(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._unsent and not self._closed:
                        self._wake.wait()
                    if not self._unsent:
                        return
                    self._sending.acquire()  # before the batch leaves _unsent: unsend() waits for it
                    batch, self._unsent = self._unsent, []
                    self._inflight = {args["ref"] for args, _ in batch}
                    self._inflight_n = [n for args, _ in batch if (n := args["n"]) is not None]
                    want, self._want_numbers = self._want_numbers, 0
                    deliver = self._on_numbers
                try:
                    self._send_batch(batch, want, deliver)
                finally:
                    with self._wake:
                        self._inflight, self._inflight_n = set(), []
                    self._sending.release()
        finally:
            self.handle.close_thread()  # its own connection: the Client's close() closes only its caller's

    def _send_batch(self, batch: list[tuple[Submit, Answer]], want: int,
                    deliver: Callable[[list[int] | None], None]) -> None:
        first = batch[0][0]
        tasks = [_batch_task(args) for args, _ in batch]
        request: SubmitBatch = {"pool": first["pool"], "session": first["session"], "tasks": tasks}
        if want:
            request["numbers"] = want
        try:
            while True:
                seen = self._generation
                try:
                    got = self.raw_call("task_submit", request)
                    if want:  # None from a daemon that grants none with a batch
                        deliver(got.get("numbers") if isinstance(got, dict) else None)
                        want = 0
                    self._keyed_answers(batch, got)
                    return
                except AWAY as err:
                    # Perhaps it arrived, perhaps not: sent again once back, each task
                    # named by its number (the daemon takes a task it has as that one).
                    self.recover(seen, err)
                    request["resend"] = True
        except OrchestratorError as err:  # refused, or the daemon did not come back: each future's error
            msg = error(None, err)  # the same error again at each future: its class, data and fields
            for _, on_reply in batch:
                on_reply(msg)
        finally:
            if want:
                deliver(None)  # none came: a submit that waits for them asks itself

    @staticmethod
    def _keyed_answers(batch: list[tuple[Submit, Answer]], got: Any) -> None:
        """Each keyed submit of ``batch`` waits for its task's id (``got``, the batch's
        answer: its ids, and which of them another future has: ``shared``)."""
        ids, shared = (got["ids"], set(got.get("shared") or ())) if isinstance(got, dict) else (got, set())
        for (args, on_reply), task_id in zip(batch, ids):
            if "key" in args:
                on_reply({"ok": True, "result": {"id": task_id, "shared": task_id in shared}})

    def drain(self) -> None:
        """No more submits; returns once the sender delivered what it holds (or gave up)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._sender.join()

    def close(self) -> None:
        self.drain()
        self.gone.set()
        with self._link:
            self._link.notify_all()
        self.handle.close()


_PLACE_KEYS = Place.__optional_keys__  # a view's options: a batch's task carries each one given


def _batch_task(args: Submit) -> BatchTask:
    """A task of a batch on the channel: its payload as base64 text, a view's options kept."""
    options = {name: value for name, value in args.items() if name in _PLACE_KEYS}
    return cast(BatchTask, {**options, "payload": base64.b64encode(args["payload"]).decode("ascii"),
                            "ref": args["ref"], "n": args["n"]})
