"""The commands as methods, shared by the daemon's ``Client`` and the embedded ``Orchestrator``.

Both only say how one command reaches the control loop (``call``); what the commands are,
how their arguments are shaped and how long a caller waits for a command that itself
waits, is written once, here.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence, cast

from .protocol import DEFAULT_WAIT, client_bound


def _ids(ids: Iterable[str | Sequence[str]]) -> list[str]:
    """``terminate("a", "b")`` and ``terminate(["a", "b"])`` (what launch returned) alike."""
    out: list[str] = []
    for item in ids:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)  # type: ignore[arg-type]
    return out


def _bound(wait: bool, timeout: float | None) -> float | None:
    """How long to wait for the reply of a verb that may wait (the loop's bound, or DEFAULT_WAIT)."""
    return client_bound(DEFAULT_WAIT if timeout is None else timeout) if wait else None


def _object(result: Any) -> dict[str, Any]:
    """A command's result that is a JSON object, as the loop answers it (not checked)."""
    return cast("dict[str, Any]", result)


class Verbs:
    """launch / terminate / scale / status / wait / ping, and the pool verbs (stop_pools,
    start_pools, reset_failed, show, is_active), over an abstract ``call``."""

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Send one command, wait (bounded) for its reply, return its result or raise its
        typed error; ``timeout`` bounds the wait for the reply (None: the caller's default).
        Any: the result is the command's JSON, its shape the command's (the methods below
        say which)."""
        raise NotImplementedError

    def launch(
        self,
        pool: str,
        command: Sequence[str] | None = None,
        *,
        target: str | Callable[[], Any] | None = None,
        count: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = False,
        timeout: float | None = None,
        cwd: str | os.PathLike[str] | None = None,
        policy: dict[str, Any] | None = None,
        replace: bool = False,
        preload: Sequence[str] = (),
    ) -> list[str]:
        """Add ``count`` (default 1) replicas to ``pool``; returns their ids. ``wait``: until
        each is ready. ``cwd``: where they run (default: this process's working directory, so
        that a relative path means what it means to the caller). ``policy``: the pool's
        restart policy and probes (keys of policy.Policy); a pool runs one spec and one
        policy: ``replace`` rolls it onto new ones (``count`` is then its new size).
        ``preload``: modules a Python target's replicas start with, imported once in the
        pool's spawner process, never in the daemon."""
        from .spec import make_spec  # only the commands that carry a spec pay for its import

        spec = make_spec(command, target, env, os.getcwd() if cwd is None else cwd, preload).to_wire()
        args: dict[str, Any] = {"pool": pool, "spec": spec, "wait": wait, "timeout": timeout}
        if count is not None:
            args["count"] = count
        if policy:
            args["policy"] = policy
        if replace:
            args["replace"] = True
        result = self.call("launch", args, client_bound(timeout if timeout is not None or not replace else 3600.0))
        return list(result["ids"]) if isinstance(result, dict) and "ids" in result else list(result)

    def terminate(self, *ids: str | Sequence[str], wait: bool = False, timeout: float | None = None) -> list[str]:
        """Stop these replicas; already-ended ones are a no-op. ``wait``: until reaped."""
        args: dict[str, Any] = {"ids": _ids(ids), "wait": wait, "timeout": timeout}
        return list(self.call("terminate", args, client_bound(timeout)))

    def scale(
        self,
        pool: str,
        n: int,
        *,
        command: Sequence[str] | None = None,
        target: str | Callable[[], Any] | None = None,
    ) -> dict[str, Any]:
        """Set ``pool``'s size to ``n``; a spec creates the pool if it does not exist."""
        from .spec import make_spec

        # Recorded with this directory, as launch does: the same pool launched from here is the same spec.
        spec = make_spec(command, target, cwd=os.getcwd()).to_wire() if command is not None or target is not None else None
        return _object(self.call("scale", {"pool": pool, "n": n, "spec": spec}))

    def status(self, all: bool = False) -> dict[str, Any]:  # noqa: A002 - mirrors `status --all`
        return _object(self.call("status", {"all": all}))

    def wait(self, ids: Sequence[str], until: str = "running", timeout: float = 60.0) -> dict[str, Any]:
        """Block until every replica is RUNNING (or ended), or ``until="ended"``: reaped."""
        return _object(self.call("wait", {"ids": _ids([ids]), "until": until, "timeout": timeout}, client_bound(timeout)))

    def restart(self, *ids: str | Sequence[str], pool: str | None = None, max_unavailable: int = 1,
                timeout: float = 600.0) -> dict[str, Any]:
        """Replace replicas (or a whole pool, rolling) with new ones; returns once every new
        one is ready: ``{"pool", "replaced": {old: new}, "pending": [...]}``."""
        args: dict[str, Any] = {"timeout": timeout}
        if pool is not None:
            args.update(pool=pool, max_unavailable=max_unavailable)
        else:
            args["ids"] = _ids(ids)
        return _object(self.call("restart", args, client_bound(timeout)))

    def delete(self, pool: str) -> dict[str, Any]:
        """Terminate a pool's replicas and forget the pool."""
        return _object(self.call("delete", {"pool": pool}))

    def signal(self, sig: str | int, *ids: str | Sequence[str], pool: str | None = None) -> dict[str, Any]:
        """Send ``sig`` to replicas' process trees (or to every replica of ``pool``)."""
        args: dict[str, Any] = {"signal": sig}
        if pool is not None:
            args["pool"] = pool
        else:
            args["ids"] = _ids(ids)
        return _object(self.call("signal", args))

    # -- systemctl's verbs on pools ------------------------------------------------------

    def stop_pools(self, *pools: str, wait: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Stop these pools' replicas (each pool's stop signal, SIGKILL after its grace) and
        keep the pools stopped, across daemon restarts too, with their size and spec, until
        ``start_pools``: ``{"stopped": [pool...], "terminating": [id...]}``. ``wait``: until
        every replica has ended. An unknown pool is UnknownPool, and nothing is stopped."""
        args: dict[str, Any] = {"pools": list(pools), "wait": wait, "timeout": timeout}
        return _object(self.call("stop_pools", args, _bound(wait, timeout)))

    def start_pools(self, *pools: str, wait: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Bring stopped pools back to their size (a pool not stopped is left as it is):
        ``{"started": [pool...], "launched": [id...]}``. ``wait``: until those run (or ended)."""
        args: dict[str, Any] = {"pools": list(pools), "wait": wait, "timeout": timeout}
        return _object(self.call("start_pools", args, _bound(wait, timeout)))

    def reset_failed(self, *pools: str) -> dict[str, Any]:
        """Forget these pools' crash loops, failed slots, backoff and restart counters, and
        bring each (unless stopped) back to its size: ``{"reset": [...], "launched": [...]}``."""
        return _object(self.call("reset_failed", {"pools": list(pools)}))

    def show(self, pool: str) -> dict[str, Any]:
        """Every property of ``pool``: its status row, spec and policy, the policy with each
        default resolved (``effective``), ``active_state``, order, sockets and counts."""
        return _object(self.call("show", {"pool": pool}))

    def is_active(self, pool: str) -> bool:
        """Whether ``pool`` is ok: not stopped, not failed, every replica of its size RUNNING."""
        return bool(_object(self.call("is_active", {"pool": pool}))["active"])

    def ping(self) -> str:
        return cast(str, self.call("ping"))
