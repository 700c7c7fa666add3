"""A Pool is the one writer of its own fields (daemon/pools.py): the transitions it refuses,
what its row stores (an executor pool's options from their one home, the task table's
ExecPool), and a scan that no other module writes a pool's field."""

from __future__ import annotations

import ast
import base64
from pathlib import Path
from typing import Any

import pytest

from orchestrator.daemon.pools import BACKOFF, CRASHLOOP, OK, Pool, PoolError
from orchestrator.daemon.taskrecords import ExecPool
from orchestrator.policy import Policy
from orchestrator.states import Replica

DAEMON = Path(__file__).resolve().parent.parent / "orchestrator" / "daemon"


class _Timer:
    """A reactor Timer's face: what a pool does with its scheduled replacements."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _pool(**kw: Any) -> Pool:
    return Pool("web", None, Policy(), **kw)


def test_a_pool_refuses_the_transitions_it_does_not_make() -> None:
    pool = _pool(desired=2)
    with pytest.raises(PoolError, match="not deleted"):
        pool.reopen(None, Policy())  # type: ignore[arg-type]  # refused before the runtime is looked at
    with pytest.raises(PoolError, match="a size of -1"):
        pool.scale_to(-1)
    with pytest.raises(PoolError):
        pool.grow(-3)
    assert pool.desired == 2  # a refused change changes nothing
    pool.delete()
    assert (pool.desired, pool.deleted) == (0, True)
    with pytest.raises(PoolError, match="deleted already"):
        pool.delete()


def test_lowering_stops_at_zero_and_reopening_forgets_the_earlier_life() -> None:
    pool = _pool(desired=1)
    pool.lower()
    pool.lower()  # a surge's extra replica terminated too: it held no place
    assert pool.desired == 0
    pool.crashloop("3 restarts within 60 s")
    pool.left_failed(0, "web-1 failed (exit 1)")
    pool.delete()
    pool.reopen(None, Policy(restart="never"))  # type: ignore[arg-type]
    assert (pool.deleted, pool.state, pool.reason, pool.failed) == (False, OK, None, {})
    assert pool.policy.restart == "never"


def test_numbers_live_and_failed_slots_follow_the_replicas() -> None:
    pool = _pool()
    pool.left_failed(0, "web-1 failed")
    assert [pool.take_number(), pool.take_number()] == [1, 2]
    rep = Replica("web-2", "web", 2, created_at=0.0, slot=0)
    pool.add(rep)
    assert pool.live == {"web-2": rep} and pool.failed == {}  # the slot is filled again
    pool.remove(rep)
    pool.remove(rep)  # twice: nothing left to remove
    assert pool.live == {} and pool.next_n == 3


def test_scheduled_replacements_set_the_state() -> None:
    pool = _pool(desired=2)
    first, second = _Timer(1.0), _Timer(2.0)
    pool.schedule(0, first)
    pool.schedule(1, second)
    assert pool.state == BACKOFF
    assert pool.take_scheduled(0) is first and pool.state == BACKOFF
    assert pool.take_scheduled(0) is None  # due twice: the second finds nothing
    pool.cancel_replacement(1)
    assert second.cancelled and pool.pending == {} and pool.state == OK
    pool.schedule(0, _Timer(3.0))
    pool.crashloop("gave up")
    pool.cancel_replacements()
    assert pool.state == CRASHLOOP  # only an operator's act (clear) ends a crash loop
    pool.count_restart(0)
    pool.count_restart(0)
    assert pool.slot_restarts == {0: 2}


def test_an_executor_pools_row_stores_the_options_from_their_one_home() -> None:
    """The row's executor part is what the task table's ExecPool holds now: a change of its
    options (a reload) is in the next row without a second copy to update."""
    row = {"options": {"grace": 1.0, "retries": 0}, "init": base64.b64encode(b"INIT").decode(), "next_task": 7,
           "about": "setup()"}
    pool = Pool.restored("jobs", None, Policy(), next_n=3, extra={"executor": row, "declared": True,
                                                                   "failed": {"1": "jobs-2 failed", "x": "?"}})
    assert (pool.next_n, pool.declared, pool.failed) == (3, True, {1: "jobs-2 failed"})
    assert pool.stored()["executor"] == row  # not taken by the task table yet: written back as it was
    assert pool.to_dict()["kind"] == "executor"
    xp = ExecPool("jobs", {"grace": 1.0, "retries": 0}, b"INIT", next_n=9, reserved=9, about="setup()")
    pool.make_executor(xp)
    assert pool.stored_executor is None and pool.executor is xp
    xp.options = {"grace": 2.0, "retries": 1}
    assert pool.stored()["executor"] == {"options": {"grace": 2.0, "retries": 1},
                                         "init": base64.b64encode(b"INIT").decode(), "next_task": 9,
                                         "about": "setup()"}
    assert "kind" not in _pool().to_dict()


# -- nobody else writes a pool ---------------------------------------------------------

_FIELDS = {"runtime", "policy", "desired", "next_n", "live", "state", "reason", "restarts", "deleted",
           "declared", "pending", "unresolved", "slot_restarts", "executor", "stored_executor", "failed"}
_MUTATORS = {"pop", "clear", "update", "setdefault", "popitem", "append", "popleft"}


def _pool_name(node: ast.expr) -> bool:
    """A name that holds a Pool by this code base's habit (pool, gone, p in a pools loop)."""
    return isinstance(node, ast.Name) and ("pool" in node.id.lower() or node.id == "gone")


def _writes(tree: ast.AST) -> list[int]:
    lines: list[int] = []

    def field_of_pool(node: ast.expr) -> bool:
        if isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and node.attr in _FIELDS and _pool_name(node.value)

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
              and field_of_pool(node.func.value)):
            lines.append(node.lineno)
        lines += [node.lineno for t in targets if field_of_pool(t)]
    return sorted(lines)


def test_the_scan_finds_a_write_to_a_pools_field() -> None:
    code = ("pool.desired -= 1\npool.failed[0] = 'x'\npool.pending.pop(0)\n"
            "gone.deleted, gone.policy = False, None\nrep.state = 1\nn = pool.desired\n")
    assert _writes(ast.parse(code)) == [1, 2, 3, 4, 4]


def test_no_module_but_pools_py_writes_a_pools_field() -> None:
    found = {path.name: _writes(ast.parse(path.read_text())) for path in sorted(DAEMON.glob("*.py"))
             if path.name != "pools.py"}
    assert {name: lines for name, lines in found.items() if lines} == {}
