"""The error types: one family for a lookup that misses, one code per class, and every code
kept across the command channel (an instance encoded as an error reply and decoded again is
the same class with the same message, data and fields), end to end for ``scale`` of an
unknown pool; the exported names; usage errors found after parsing exit 2."""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path

import pytest

import orchestrator
from helpers import DaemonUnderTest, cli
from orchestrator import errors
from orchestrator.errors import (
    ERROR_TYPES, ConfigError, NotFound, OrchestratorError, TaskInterrupted, UnknownPool, UnknownReplica,
    UnknownSession, UnknownTask, WorkerLost,
)
from orchestrator.protocol import error, raise_reply


def _classes() -> list[type[OrchestratorError]]:
    """Every OrchestratorError class errors.py defines (the private base of task ends aside)."""
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, OrchestratorError) and cls.__module__ == errors.__name__
            and not cls.__name__.startswith("_")]


def _instance(cls: type[OrchestratorError]) -> OrchestratorError:
    """One of ``cls`` with each of its wire fields set to a value of its own."""
    fields = {name: (7 if name == "line" else f"{name} of {cls.__name__}") for name in cls.wire_fields}
    err = cls(f"what went wrong: {cls.__name__}", **fields)
    err.data = {"ids": ["web-1"], "code": cls.code}
    return err


def test_one_code_per_class_and_every_class_in_the_table() -> None:
    classes = _classes()
    codes = [cls.code for cls in classes]
    assert len(set(codes)) == len(codes), sorted(codes)
    assert {cls.code: cls for cls in classes} == ERROR_TYPES


@pytest.mark.parametrize("code", sorted(ERROR_TYPES))
def test_each_code_round_trips_the_command_channel(code: str) -> None:
    cls = ERROR_TYPES[code]
    sent = _instance(cls)
    wire = json.loads(json.dumps(error("c1", sent)))  # what crosses: JSON frames
    assert wire["code"] == code and wire["ok"] is False and wire["id"] == "c1"
    with pytest.raises(OrchestratorError) as info:
        raise_reply(wire)
    got = info.value
    assert type(got) is cls and got.code == code
    assert str(got) == str(sent) == f"what went wrong: {cls.__name__}"
    assert got.data == sent.data
    assert {n: getattr(got, n) for n in cls.wire_fields} == {n: getattr(sent, n) for n in cls.wire_fields}


def test_the_fields_that_cross() -> None:
    assert set(WorkerLost.wire_fields) == set(TaskInterrupted.wire_fields) == {"reason", "task"}
    config = ConfigError.at("/etc/o.toml", 3, "pools.web.restart", "must be one of always")
    with pytest.raises(ConfigError) as info:
        raise_reply(json.loads(json.dumps(error(1, config))))
    assert (info.value.source, info.value.line, info.value.key, info.value.problem) == (
        "/etc/o.toml", 3, "pools.web.restart", "must be one of always")
    bare = ConfigError.at("/etc/o.toml", None, "after", "a cycle")  # no line: a field left out, not sent as None
    with pytest.raises(ConfigError) as bare_info:
        raise_reply(json.loads(json.dumps(error(1, bare))))
    assert (bare_info.value.line, bare_info.value.key, str(bare_info.value)) == (None, "after", str(bare))
    lost = WorkerLost("task jobs/3: its worker was lost: killed by SIGKILL", reason="killed by SIGKILL", task="jobs/3")
    with pytest.raises(WorkerLost) as lost_info:
        raise_reply(json.loads(json.dumps(error(1, lost))))
    assert (lost_info.value.reason, lost_info.value.task) == ("killed by SIGKILL", "jobs/3")


def test_a_code_without_a_class_keeps_its_code() -> None:
    with pytest.raises(OrchestratorError) as info:
        raise_reply({"id": 1, "ok": False, "code": "from_a_newer_daemon", "error": "one line",
                     "fields": {"x": [1]}})
    assert type(info.value) is OrchestratorError and info.value.code == "from_a_newer_daemon"
    assert str(info.value) == "one line"
    assert OrchestratorError("x").code == "error"  # the class's own stays


def test_a_line_with_a_code_of_its_own() -> None:
    """The waiters' time-out and the engine's last resort send a line and a code."""
    with pytest.raises(errors.WaitTimeout) as info:
        raise_reply(error(1, "timed out: not yet ready: web-1", "timeout", data={"ids": ["web-1"]}))
    assert info.value.data == {"ids": ["web-1"]}
    with pytest.raises(errors.InternalError):
        raise_reply(error(1, "internal error: KeyError: 'x'", "internal"))


def test_a_lookup_that_misses_is_one_family() -> None:
    for cls in (UnknownReplica, UnknownPool, UnknownTask, UnknownSession):
        err = cls("unknown thing 'x'")
        assert isinstance(err, NotFound) and isinstance(err, KeyError) and isinstance(err, OrchestratorError)
        assert str(err) == "unknown thing 'x'"  # KeyError's own str() would be its repr, quotes and all
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is cls and str(again) == str(err)
    assert not issubclass(UnknownPool, UnknownReplica) and not issubclass(UnknownTask, UnknownReplica)
    assert str(NotFound()) == "not found"


def test_what_reaches_users_is_exported() -> None:
    from orchestrator.taskfutures import RemoteTraceback

    for name in ("NotFound", "UnknownReplica", "UnknownPool", "UnknownTask", "UnknownSession", "FrameTooLarge",
                 "RemoteTraceback", "WaitTimeout", "InternalError"):
        assert name in orchestrator.__all__, name
    assert orchestrator.RemoteTraceback is RemoteTraceback
    assert issubclass(orchestrator.FrameTooLarge, orchestrator.InvalidSpec)
    assert issubclass(orchestrator.FrameTooLarge, ValueError)  # what it was before it had a code
    public = {cls for cls in _classes() if cls is not errors.UsageError}  # the CLI's own
    assert {cls.__name__ for cls in public} <= set(orchestrator.__all__)
    assert all(getattr(orchestrator, cls.__name__) is cls for cls in public)


def test_scale_of_an_unknown_pool_over_the_channel(daemon: DaemonUnderTest) -> None:
    daemon.start()
    with orchestrator.Client(daemon.state_dir) as client:
        with pytest.raises(UnknownPool, match="unknown pool 'nosuch'") as info:
            client.scale("nosuch", 2)
        assert isinstance(info.value, KeyError) and "\n" not in str(info.value)
        with pytest.raises(UnknownPool):
            client.delete("nosuch")
        with pytest.raises(UnknownReplica):
            client.terminate("nosuch-1")
    proc = cli(daemon.state_dir, "scale", "nosuch", "2")
    assert proc.returncode == 1 and proc.stderr == "orchestrator: unknown pool 'nosuch': launch a replica into it first\n"


@pytest.mark.parametrize("argv, line", [
    (["launch", "--pool", "p", "--target", "a:b", "--", "sleep", "1"], "give either --target"),
    (["launch", "--pool", "p", "--env", "bad", "--", "sleep", "1"], "--env takes KEY=VALUE, got 'bad'"),
    (["launch", "--pool", "p"], "nothing to run"),
    (["restart"], "give either replica ids or --pool POOL"),
    (["restart", "p-1", "--pool", "p"], "give either replica ids or --pool POOL"),
    (["signal", "HUP"], "give either replica ids or --pool POOL"),
    (["logs"], "logs needs a replica ID or --pool P"),
])
def test_usage_errors_found_after_parsing_exit_2(tmp_path: Path, argv: list[str], line: str) -> None:
    """Before any daemon is asked (none runs here: that would be exit 3)."""
    proc = cli(tmp_path / "state", *argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith(f"orchestrator {argv[0]}: error: ") and line in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout == ""
