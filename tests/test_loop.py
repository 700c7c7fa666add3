"""One builder of the control loop (daemon/loop.py) for the daemon and the embedded
Orchestrator: the same engine on the same reactor, the daemon's additions given at
construction (its commands, status, limits, log files, turn ends), none for the embedded."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Iterator

import pytest

from orchestrator import protocol
from orchestrator.daemon.engine import EngineConfig
from orchestrator.daemon.limits import FdReserve, Limits
from orchestrator.daemon.loop import DaemonParts, Loop, build_loop


@pytest.fixture
def reserve() -> Iterator[FdReserve]:
    held = FdReserve(4)
    try:
        yield held
    finally:
        held.close()


def _close(loop: Loop) -> None:
    loop.engine.shutdown()
    loop.engine.close()
    if loop.log_capture is not None:
        loop.log_capture.close()


def _send(loop: Loop, op: str, **args: Any) -> list[dict[str, Any]]:
    box: list[dict[str, Any]] = []
    loop.engine.handle({"id": 1, "op": op, "args": args}, box.append)
    loop.engine.run_once(0)
    return box


def test_the_embedded_loop_is_the_daemons_without_its_additions(fake: Any, tmp_path: Path,
                                                                  reserve: FdReserve) -> None:
    seen: list[str] = []
    deferred: list[Any] = []

    def upgrade(args: dict[str, Any], reply: Any, cmd_id: Any) -> Any:
        deferred.append((reply, cmd_id))
        return protocol.DEFERRED

    reopen = lambda: None  # noqa: E731
    parts = DaemonParts(logs=tmp_path / "logs", log_max_bytes=1 << 20, log_backups=2,
                        status=lambda: {"daemon": {"running": True}},
                        commands={"health": lambda args: {"healthy": True}}, deferred={"upgrade": upgrade},
                        limits=Limits(reserve), reserve=reserve, reopen_store=reopen,
                        turn_end=(lambda: seen.append("turn end"),))
    embedded = build_loop(EngineConfig(env={}), os_api=fake, store=None, link=None, containment=None)
    daemon = build_loop(EngineConfig(env={}), os_api=fake, store=None, link=None, containment=None, daemon=parts)
    try:
        for loop in (embedded, daemon):
            assert loop.engine.reactor is loop.reactor and loop.watchdog is None  # no link: no watchdog
            assert _send(loop, "ping")[0]["result"] == "pong"
            assert _send(loop, "scale", pool="web", n=0, spec={"command": ["sleep", "1"]})[0]["ok"]
            assert [p["name"] for p in loop.engine.status()["pools"]] == ["web"]
        # the embedded loop has none of the daemon's additions
        assert embedded.log_capture is None and embedded.engine.log_capture is None and embedded.engine.limits is None
        assert _send(embedded, "health")[0]["error"] == "unknown command 'health'"
        assert "daemon" not in embedded.engine.status()
        # the daemon's, all given at construction
        assert daemon.engine.log_capture is daemon.log_capture is not None
        assert daemon.engine.journal.forgotten == daemon.log_capture.forget  # a replica's logs go with its record
        assert daemon.engine.journal.reopen is reopen and daemon.engine.limits is parts.limits
        assert daemon.engine.status()["daemon"] == {"running": True}
        assert _send(daemon, "health")[0]["result"] == {"healthy": True}
        assert _send(daemon, "upgrade") == [] and len(deferred) == 1  # its reply waits
        # a turn end runs after the engine's settle, which sent the turn's replies
        events: list[Any] = []
        seen.clear()
        daemon.engine.handle({"id": 2, "op": "ping"}, lambda msg: events.append(seen[:]))
        daemon.engine.run_once(0)
        assert events == [[]] and seen == ["turn end"]
    finally:
        _close(embedded)
        _close(daemon)


# -- nothing is set on a built engine ----------------------------------------------------

DAEMON = Path(__file__).resolve().parent.parent / "orchestrator" / "daemon"
# Set while the loop runs, by design: the lag is measured once a start is over (a long
# restore is no lag of the loop), and a reload changes the grace of the stops after it.
_RUNTIME_SETTINGS = {("metrics", "lag"), ("config", "grace")}
_POKES = {"at_turn_end", "add_command", "update"}


def _engine_chain(node: ast.expr) -> list[str] | None:
    """``engine.a.b`` / ``self._engine.a.b`` / ``self.engine.a.b`` as [a, b], else None."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        if node.attr in ("engine", "_engine") and isinstance(node.value, ast.Name) and node.value.id == "self":
            return names[::-1]
        names.append(node.attr)
        node = node.value
    return names[::-1] if isinstance(node, ast.Name) and node.id == "engine" else None


def _pokes(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _POKES:
            chain = _engine_chain(node.func)
            if chain:
                found.append(".".join(chain))
        for target in targets:
            chain = _engine_chain(target)
            if chain and tuple(chain[-2:]) not in _RUNTIME_SETTINGS:
                found.append(".".join(chain))
    return found


def test_the_scan_finds_an_attribute_set_on_a_built_engine() -> None:
    code = ("engine.limits = x\nself._engine.journal.reopen = f\nengine.reactor.at_turn_end(g)\n"
            "engine.extra_commands.update(a=b)\nengine.metrics.lag = m\nself.engine = e\nn = engine.limits\n")
    assert _pokes(ast.parse(code)) == ["limits", "journal.reopen", "reactor.at_turn_end", "extra_commands.update"]


def test_the_daemon_and_the_embedded_loop_set_nothing_on_a_built_engine() -> None:
    found = {name: _pokes(ast.parse((DAEMON / name).read_text())) for name in ("main.py", "embedded.py")}
    assert found == {"main.py": [], "embedded.py": []}
