"""What a replica runs: a command (argv) or a Python callable.

A spec crosses the command channel as plain data (:meth:`WorkerSpec.to_wire`): a command
is a list of strings, a target is ``"module:function"``, and a callable from the Python
API travels pickled (multiprocess's dill) as opaque base64 text that only the worker
unpickles, so neither the Manager server nor the daemon ever runs user code to read it.

In the daemon a spec becomes a ``Runtime`` (``prepare``), and each replica of it a
``LaunchPlan``: plain data, sent to the spawner process and read by the forked child's
set-up (childsetup.py); ``SpawnerKey`` names the spawner that makes a pool's replicas.
Both live here, with no import of the processes that use them, so that every process
may import this module.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypedDict

from .errors import InvalidSpec
from .targets import TargetRef

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_PORT = 65535


@dataclass(frozen=True, slots=True)
class SpawnerKey:
    """What a spawner has imported: its pool's preload modules, found from that pool's
    PYTHONPATH and cwd. The default spawner has the empty key."""

    preload: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = ()
    cwd: str | None = None


class SpecWire(TypedDict, total=False):
    """A spec as the channel carries it and state.db keeps it (``WorkerSpec.to_wire``): one
    of ``command``, ``target`` or ``pickled`` (a callable, dill-pickled, base64)."""

    command: list[str]
    target: str
    pickled: str
    env: dict[str, str]
    cwd: str
    pythonpath: list[str]
    preload: list[str]


@dataclass(frozen=True, slots=True, eq=False)
class LaunchPlan:
    """Everything one worker process is made from: a command (``argv`` + ``exe``, its whole
    environment in ``env``) or a Python ``run`` (a callable, a ``TargetRef`` or pickled bytes
    that only the child loads; ``env`` then holds additions to the forking process's environment)."""

    replica_id: str
    argv: tuple[str, ...] | None = None
    exe: str | None = None
    run: Callable[[], Any] | TargetRef | bytes | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdout: int | None = None  # fds put on 1 and 2 in the child; None: inherited
    stderr: int | None = None
    cgroup: str | None = None  # the replica's cgroup dir, joined first thing in the child
    preload: tuple[str, ...] = ()  # imported before the target (at once if the spawner has them)
    pythonpath: tuple[str, ...] = ()  # the launching caller's, for the preload modules
    # Listening sockets put on fds 3, 4, ... in the child (socket activation; LISTEN_FDS and
    # LISTEN_FDNAMES are in env, LISTEN_PID is set by the child itself)
    listen_fds: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class WorkerSpec:
    """One of ``command``, ``target`` (``"module:function"``), ``func`` or ``pickled``."""

    command: tuple[str, ...] | None = None
    target: str | None = None
    func: Callable[[], Any] | None = None
    pickled: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None  # absolute; None: wherever the forking process is
    pythonpath: tuple[str, ...] = ()  # where a target is looked for first: the launching caller's PYTHONPATH
    preload: tuple[str, ...] = ()  # modules imported once where the pool's replicas are made

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.command, self.target, self.func, self.pickled)]
        if sum(given) != 1:
            raise InvalidSpec("a worker spec needs exactly one of: command, target, callable")
        if self.command is not None:
            if isinstance(self.command, str) or not all(isinstance(a, str) for a in self.command):
                raise InvalidSpec("command must be a list of strings")
            if not self.command or not self.command[0]:
                raise InvalidSpec("empty command")
            object.__setattr__(self, "command", tuple(self.command))
        if self.target is not None:
            mod, sep, fn = self.target.partition(":")
            if not (mod and sep and fn):
                raise InvalidSpec(f"target must be MODULE:FUNCTION, got {self.target!r}")
        if self.func is not None and not callable(self.func):
            raise InvalidSpec("target is not callable")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise InvalidSpec("env must map strings to strings")
        if any(not k or "=" in k for k in self.env):
            raise InvalidSpec("env names must be non-empty and hold no '='")
        if self.cwd is not None and (not isinstance(self.cwd, str) or not os.path.isabs(self.cwd)):
            raise InvalidSpec(f"cwd must be an absolute path, got {self.cwd!r}")
        # The kernel takes C strings: a NUL would make exec raise deep in the spawn path.
        if not all(isinstance(p, str) for p in self.pythonpath):
            raise InvalidSpec("pythonpath must be a list of strings")
        object.__setattr__(self, "pythonpath", tuple(self.pythonpath))
        if isinstance(self.preload, str) or not all(isinstance(m, str) and _MODULE.fullmatch(m) for m in self.preload):
            raise InvalidSpec(f"preload must be module names, got {self.preload!r}")
        if self.preload and self.command is not None:
            raise InvalidSpec("preload is for Python targets; a command imports nothing")
        object.__setattr__(self, "preload", tuple(self.preload))
        texts = [*(self.command or ()), self.target or "", self.cwd or "", *self.env, *self.env.values(),
                 *self.pythonpath]
        if any("\0" in t for t in texts):
            raise InvalidSpec("a command, target, cwd or env entry holds a NUL byte")

    # -- the wire -------------------------------------------------------------------

    def to_wire(self) -> SpecWire:
        """Plain data for the channel; a live callable is pickled here, on the caller's side."""
        wire: SpecWire = {"env": dict(self.env)} if self.env else {}
        if self.cwd is not None:
            wire["cwd"] = self.cwd
        if self.command is not None:
            wire["command"] = list(self.command)
        elif self.target is not None:
            wire["target"] = self.target
        else:
            data = self.pickled
            if data is None:
                import dill  # only a client that sends a live callable pays for dill

                data = dill.dumps(self.func, recurse=True)
            wire["pickled"] = base64.b64encode(data).decode("ascii")
        if self.pythonpath and self.command is None:
            wire["pythonpath"] = list(self.pythonpath)
        if self.preload:
            wire["preload"] = list(self.preload)
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> "WorkerSpec":
        if not isinstance(wire, dict):
            raise InvalidSpec("spec must be an object")
        unknown = set(wire) - {"command", "target", "pickled", "env", "cwd", "pythonpath", "preload"}
        if unknown:
            raise InvalidSpec(f"unknown spec field(s): {', '.join(sorted(unknown))}")
        env = wire.get("env") or {}
        if not isinstance(env, dict):
            raise InvalidSpec("env must be an object")
        pickled = wire.get("pickled")
        if pickled is not None:
            if not isinstance(pickled, str):
                raise InvalidSpec("pickled target must be base64 text")
            try:
                pickled = base64.b64decode(pickled.encode("ascii"), validate=True)
            except ValueError as err:
                raise InvalidSpec(f"pickled target is not valid base64: {err}") from None
        command = wire.get("command")
        if command is not None and not isinstance(command, list):
            raise InvalidSpec("command must be a list of strings")
        target = wire.get("target")
        if target is not None and not isinstance(target, str):
            raise InvalidSpec("target must be MODULE:FUNCTION")
        pythonpath = wire.get("pythonpath") or ()
        if not isinstance(pythonpath, (list, tuple)):
            raise InvalidSpec("pythonpath must be a list of strings")
        preload = wire.get("preload") or ()
        if not isinstance(preload, (list, tuple)):
            raise InvalidSpec("preload must be a list of module names")
        return cls(command=None if command is None else tuple(command), target=target, pickled=pickled, env=env, cwd=wire.get("cwd"),
                   pythonpath=tuple(pythonpath), preload=tuple(preload))


def make_spec(
    command: Sequence[str] | None = None,
    target: str | Callable[[], Any] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    preload: Sequence[str] = (),
) -> WorkerSpec:
    """A WorkerSpec from the arguments the API and the CLI take; a relative ``cwd`` is the
    caller's, made absolute here."""
    where = os.path.abspath(cwd) if cwd is not None else None
    preload = tuple(preload)
    # A target and preload modules are imported where the replicas are made, from the
    # caller's PYTHONPATH (recorded with the spec, made absolute), never in the daemon.
    path = tuple(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p) \
        if target is not None and command is None and (preload or not callable(target)) else ()
    if callable(target):
        return WorkerSpec(func=target, env=dict(env or {}), cwd=where, pythonpath=path, preload=preload)
    return WorkerSpec(
        command=tuple(command) if command is not None else None, target=target, env=dict(env or {}), cwd=where,
        pythonpath=path, preload=preload,
    )


def resolve_executable(command: tuple[str, ...], env: dict[str, str], cwd: str | None = None) -> str:
    """The absolute path exec will run; resolved once per launch, not in every child. A
    relative path (``./run.sh``) is the launching caller's: relative to the spec's cwd."""
    prog = command[0]
    if os.sep in prog:
        if cwd is not None:
            prog = os.path.join(cwd, prog)
        if not os.access(prog, os.X_OK):
            raise InvalidSpec(f"not an executable file: {prog}")
        return prog
    path = shutil.which(prog, path=env.get("PATH", os.environ.get("PATH", os.defpath)))
    if path is None:
        raise InvalidSpec(f"command not found: {prog}")
    return path


@dataclass(slots=True)
class Runtime:
    """A spec made ready to fork: resolved once per launch, reused for every replica."""

    wire: SpecWire  # the spec as it is stored and sent
    cwd: str | None = None
    run: Callable[[], Any] | TargetRef | bytes | None = None  # a target, or pickled bytes only the child loads
    argv: tuple[str, ...] | None = None
    exe: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    templated: bool = False  # argv or env hold {slot}/{port}: expanded per replica
    preload: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = ()
    key: SpawnerKey = SpawnerKey()  # the spawner that makes its replicas

    @property
    def uses_port(self) -> bool:
        """Whether argv or an env value holds ``{port}`` (which needs a port base)."""
        return self.templated and any("{port}" in t for t in (*self.wire.get("command", ()),
                                                                 *self.wire.get("env", {}).values()))

    def plan(self, replica_id: str, pool: str, slot: int | None, port: int | None, token: str | None) -> LaunchPlan:
        """What one replica is made from: its argv and environment, slot and port filled in.
        A port out of range is InvalidSpec (the declaration refuses a size that reaches one;
        a slot can still go past the size for a moment, while older replicas stop)."""
        if port is not None and not 1 <= port <= MAX_PORT:
            raise InvalidSpec(f"slot {slot} would get port {port}, past {MAX_PORT}")
        env = {"ORCHESTRATOR_REPLICA_ID": replica_id, "ORCHESTRATOR_POOL": pool}
        if token:
            env["ORCHESTRATOR_DAEMON_TOKEN"] = token
        if slot is not None:
            env["ORCHESTRATOR_SLOT"] = str(slot)
            if port is not None:
                env["PORT"] = str(port)
        argv = self.argv
        if self.env:  # a command's whole environment, or a Python target's additions
            extra = {k: expand(v, slot, port) for k, v in self.env.items()} if self.templated else self.env
            env = {**extra, **env}
        if self.templated and argv is not None:
            argv = tuple(expand(a, slot, port) for a in argv)
        return LaunchPlan(replica_id, argv, self.exe, self.run, env, self.cwd,
                          preload=self.preload, pythonpath=self.pythonpath)


def expand(text: str, slot: int | None, port: int | None) -> str:
    """``{slot}`` and ``{port}``, and nothing else: a command's own braces stay as they are."""
    if slot is not None:
        text = text.replace("{slot}", str(slot))
    if port is not None:
        text = text.replace("{port}", str(port))
    return text


def prepare(wire: Any, base_env: dict[str, str]) -> Runtime:
    """Check a wire spec and resolve what every replica of it needs (the executable's
    path, a command's whole environment); a bad spec raises InvalidSpec."""
    spec = WorkerSpec.from_wire(wire)
    if spec.cwd is not None and not os.path.isdir(spec.cwd):
        raise InvalidSpec(f"cwd is not a directory: {spec.cwd}")
    rt = Runtime(spec.to_wire(), spec.cwd)
    if spec.command is not None:
        env = {**base_env, **spec.env}
        rt.argv, rt.exe, rt.env = spec.command, resolve_executable(spec.command, env, spec.cwd), env
    else:
        rt.env = dict(spec.env)
        # Only the worker ever imports the target or unpickles a callable.
        rt.run = TargetRef(spec.target, spec.pythonpath) if spec.target is not None else spec.pickled
        if spec.pickled is not None:
            import dill  # noqa: F401  (for a worker forked here, not by a spawner: loaded once)
        if spec.preload:
            rt.preload, rt.pythonpath = spec.preload, spec.pythonpath
            rt.key = SpawnerKey(spec.preload, spec.pythonpath, spec.cwd)
    rt.templated = any("{slot}" in t or "{port}" in t for t in (*(spec.command or ()), *spec.env.values()))
    return rt
