"""The commands as methods, shared by the daemon's ``Client`` and the embedded ``Orchestrator``.

Both only say how one command reaches the control loop (``call``); what the commands are,
how their arguments are shaped and how long a caller waits for a command that itself
waits, is written once, here.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from .protocol import client_bound
from .spec import make_spec


def _ids(ids: Iterable[str | Sequence[str]]) -> list[str]:
    """``terminate("a", "b")`` and ``terminate(["a", "b"])`` (what launch returned) alike."""
    out: list[str] = []
    for item in ids:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)  # type: ignore[arg-type]
    return out


class Verbs:
    """launch / terminate / scale / status / wait / ping over an abstract ``call``."""

    def call(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """Send one command, wait (bounded) for its reply, return its result or raise its
        typed error; ``timeout`` bounds the wait for the reply (None: the caller's default)."""
        raise NotImplementedError

    def launch(
        self,
        pool: str,
        command: Sequence[str] | None = None,
        *,
        target: str | Callable[[], Any] | None = None,
        count: int = 1,
        env: dict[str, str] | None = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> list[str]:
        """Add ``count`` replicas to ``pool``; returns their ids. ``wait``: until each runs."""
        spec = make_spec(command, target, env).to_wire()
        args = {"pool": pool, "count": count, "spec": spec, "wait": wait, "timeout": timeout}
        return list(self.call("launch", args, client_bound(timeout)))

    def terminate(self, *ids: str | Sequence[str], wait: bool = False, timeout: float | None = None) -> list[str]:
        """Stop these replicas; already-ended ones are a no-op. ``wait``: until reaped."""
        args = {"ids": _ids(ids), "wait": wait, "timeout": timeout}
        return list(self.call("terminate", args, client_bound(timeout)))

    def scale(
        self,
        pool: str,
        n: int,
        *,
        command: Sequence[str] | None = None,
        target: str | Callable[[], Any] | None = None,
    ) -> dict:
        """Set ``pool``'s size to ``n``; a spec creates the pool if it does not exist."""
        spec = make_spec(command, target).to_wire() if command is not None or target is not None else None
        return self.call("scale", {"pool": pool, "n": n, "spec": spec})

    def status(self, all: bool = False) -> dict:  # noqa: A002 - mirrors `status --all`
        return self.call("status", {"all": all})

    def wait(self, ids: Sequence[str], until: str = "running", timeout: float = 60.0) -> dict:
        """Block until every replica is RUNNING (or ended), or ``until="ended"``: reaped."""
        return self.call("wait", {"ids": _ids([ids]), "until": until, "timeout": timeout}, client_bound(timeout))

    def ping(self) -> str:
        return self.call("ping")
