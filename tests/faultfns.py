"""Tasks and objects for test_executor_faults.py: values whose pickling or unpickling
raises (SystemExit, KeyboardInterrupt...), a manager proxy's user, an initializer that
logs through a queue. Importable by name in every worker (embedded and the daemon's)."""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing.process
import os
from typing import Any

_EXCEPTIONS: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt, "GeneratorExit": GeneratorExit,
    "ValueError": ValueError,
}


def _raise(kind: str) -> Any:
    raise _EXCEPTIONS[kind](f"{kind} from a pickle")


def _terminated() -> Any:
    from orchestrator import Terminated

    raise Terminated()


class ExplodesOnLoad:
    """Pickles fine; its unpickling (in the client, for a result) raises ``kind``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __reduce__(self) -> Any:
        return _raise, (self.kind,)


class ExplodesOnDump:
    """Its pickling raises ``kind`` (in the worker for a result; in ``submit`` for an
    argument): "Terminated" stands for a SIGTERM that arrives while it pickles."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __reduce__(self) -> Any:
        if self.kind == "Terminated":
            _terminated()
        _raise(self.kind)


class LoadError(Exception):
    """An exception the client cannot unpickle: its rebuild raises ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind

    def __reduce__(self) -> Any:
        return _raise, (self.kind,)


class DumpError(Exception):
    """An exception whose pickling (in the worker) raises ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind

    def __reduce__(self) -> Any:
        _raise(self.kind)


def returns(value: Any) -> Any:
    return value


def raise_it(exc: BaseException) -> None:
    raise exc


def returns_unloadable(kind: str) -> ExplodesOnLoad:
    return ExplodesOnLoad(kind)


def returns_undumpable(kind: str) -> ExplodesOnDump:
    return ExplodesOnDump(kind)


def raises_unloadable(kind: str) -> None:
    raise LoadError(kind)


def raises_undumpable(kind: str) -> None:
    raise DumpError(kind)


def pid() -> int:
    return os.getpid()


_arrived: list[int] = []


def _arrive(x: int) -> int:
    _arrived.append(x)
    return x


class Arrives:
    """An int whose unpickling in a worker notes it there: the items of one task arrive
    together (its payload is loaded whole) before any of them runs."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __reduce__(self) -> Any:
        return _arrive, (self.x,)


def arrived_by_then(x: int) -> tuple[int, int]:
    """``x`` and the last item that had arrived in this worker when ``x`` ran."""
    return x, _arrived[-1]


def authkey() -> bytes:
    return bytes(multiprocessing.process.current_process().authkey)


def store(mapping: Any, key: str, value: Any) -> int:
    """A manager's dict proxy, written to from the worker."""
    mapping[key] = value
    return os.getpid()


def append(items: Any, value: Any) -> int:
    items.append(value)
    return len(items)


def log_to(queue: Any) -> None:
    """The logging cookbook's initializer: each worker's records go to one queue."""
    root = logging.getLogger()
    root.addHandler(logging.handlers.QueueHandler(queue))
    root.setLevel(logging.INFO)


def log(message: str) -> int:
    logging.getLogger("faultfns").info(message)
    return os.getpid()
