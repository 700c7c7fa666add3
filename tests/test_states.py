"""orchestrator.states: the one transition table, checked edge by edge.

Parametrized lists are built in the enum's declaration order (never from a set), so
every xdist worker collects the same ids in the same order.
"""

from __future__ import annotations

import pytest

from orchestrator.states import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Replica,
    ReplicaState,
    transition,
)

S = ReplicaState
STATES = list(ReplicaState)  # declaration order
TERMINAL_STATES = [s for s in STATES if s in TERMINAL]
LIVE_STATES = [s for s in STATES if s not in TERMINAL]

LEGAL = [(old, new) for old in STATES for new in STATES if new in TRANSITIONS[old]]
ILLEGAL = [(old, new) for old in STATES for new in STATES if new not in TRANSITIONS[old]]


def edge_id(edge: tuple[ReplicaState, ReplicaState]) -> str:
    return f"{edge[0].value}->{edge[1].value}"


def make(state: ReplicaState = S.PENDING) -> Replica:
    return Replica("web-1", "web", 1, state=state, created_at=100.0)


def test_table_covers_every_state_and_matches_the_design():
    assert sorted(TRANSITIONS) == sorted(STATES)  # the dict order is not part of the contract
    assert set(TERMINAL_STATES) == {S.TERMINATED, S.EXITED, S.FAILED, S.INTERRUPTED, S.LOST}
    # The diagram of docs/design.md, written out edge by edge.
    assert LEGAL == [
        (S.PENDING, S.STARTING), (S.PENDING, S.FAILED), (S.PENDING, S.INTERRUPTED),
        (S.PENDING, S.LOST),
        (S.STARTING, S.RUNNING), (S.STARTING, S.FAILED), (S.STARTING, S.INTERRUPTED),
        (S.STARTING, S.LOST),
        (S.RUNNING, S.STOPPING), (S.RUNNING, S.EXITED), (S.RUNNING, S.FAILED),
        (S.RUNNING, S.LOST),
        (S.STOPPING, S.TERMINATED), (S.STOPPING, S.LOST),
    ]  # fmt: skip
    for s in LIVE_STATES:
        assert S.LOST in TRANSITIONS[s], f"{s} must be able to become LOST"
    for s in STATES:
        assert s not in TRANSITIONS[s], f"{s} has a self-loop"
        assert s.terminal == (s in TERMINAL)


@pytest.mark.parametrize("edge", LEGAL, ids=edge_id)
def test_legal_transition(edge):
    old, new = edge
    rep = make(old)
    ticks = iter([1234.5])
    returned = transition(rep, new, "because", exit_code=7, clock=lambda: next(ticks))
    assert returned is old
    assert rep.state is new
    assert rep.reason == "because"
    assert rep.exit_code == 7
    if new in TERMINAL:
        assert rep.ended_at == 1234.5
    else:
        assert rep.ended_at is None


@pytest.mark.parametrize("edge", ILLEGAL, ids=edge_id)
def test_illegal_transition_raises_and_changes_nothing(edge):
    old, new = edge
    rep = make(old)
    rep.reason, rep.exit_code, rep.ended_at = "before", 3, 50.0 if old in TERMINAL else None
    before = rep.to_record()

    def clock() -> float:
        raise AssertionError("an illegal transition must not read the clock")

    with pytest.raises(IllegalTransition) as info:
        transition(rep, new, "after", exit_code=9, clock=clock)
    assert (info.value.replica_id, info.value.old, info.value.new) == ("web-1", old, new)
    assert f"{old} -> {new}" in str(info.value)
    assert rep.to_record() == before


@pytest.mark.parametrize("terminal", TERMINAL_STATES, ids=str)
def test_terminal_states_are_sticky(terminal):
    assert TRANSITIONS[terminal] == frozenset()
    rep = make(terminal)
    for new in STATES:
        with pytest.raises(IllegalTransition):
            transition(rep, new, "late")
    assert rep.state is terminal


@pytest.mark.parametrize(
    "path",
    [
        [S.STARTING, S.RUNNING, S.STOPPING, S.TERMINATED],
        [S.STARTING, S.RUNNING, S.EXITED],
        [S.STARTING, S.RUNNING, S.FAILED],
        [S.INTERRUPTED],
        [S.STARTING, S.INTERRUPTED],
        [S.FAILED],
        [S.STARTING, S.FAILED],
        [S.STARTING, S.RUNNING, S.STOPPING, S.LOST],
    ],
    ids=lambda p: "-".join(s.value for s in p),
)
def test_lifecycle_paths_set_ended_at_once_at_the_end(path):
    rep = make()
    for i, new in enumerate(path, 1):
        transition(rep, new, f"step {i}", clock=lambda i=i: float(i))
        assert rep.ended_at == (float(i) if new in TERMINAL else None)
    assert rep.state.terminal
    assert rep.reason == f"step {len(path)}"
    # Nothing may follow the end, not even the state a late event would want.
    for late in (S.TERMINATED, S.EXITED, S.FAILED, S.INTERRUPTED):
        with pytest.raises(IllegalTransition):
            transition(rep, late, "late event")
    assert rep.reason == f"step {len(path)}"


def test_interrupted_cannot_be_overwritten_by_a_late_reap():
    rep = make(S.STARTING)
    transition(rep, S.INTERRUPTED, "terminated", clock=lambda: 5.0)
    for late in (S.RUNNING, S.EXITED, S.FAILED, S.TERMINATED):
        with pytest.raises(IllegalTransition):
            transition(rep, late, "exit code 0", exit_code=0)
    assert (rep.state, rep.reason, rep.exit_code, rep.ended_at) == (S.INTERRUPTED, "terminated", None, 5.0)


def test_none_reason_and_exit_code_keep_the_previous_values():
    rep = make()
    transition(rep, S.STARTING, "spawned")
    transition(rep, S.RUNNING)
    assert rep.reason == "spawned"
    transition(rep, S.FAILED, "exit code 2", exit_code=2)
    assert (rep.reason, rep.exit_code) == ("exit code 2", 2)


def test_state_values_and_record_shape():
    assert [str(s) for s in STATES] == [s.value for s in STATES]
    rep = make()
    assert rep.to_dict() == {
        "id": "web-1", "pool": "web", "state": "PENDING", "pid": None, "exit_code": None,
        "reason": None, "created_at": 100.0, "ended_at": None,
        # added by the restart policy (the contract allows extra keys, never renames)
        "slot": None, "restarts": 0, "ready": False, "started_at": None,
    }  # fmt: skip
    assert rep.to_record() == {**rep.to_dict(), "n": 1, "start_time": None}
