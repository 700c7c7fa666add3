"""The config file of ``start --config FILE`` and ``reload``: daemon settings and pools, in TOML.

    [daemon]
    grace = 5.0                 # seconds between a replica's stop signal and SIGKILL
    stop_budget = 30            # a whole shutdown fits in this many seconds
    metrics_port = 9464         # optional, served on loopback only
    cgroup = "auto"             # auto | off | /an/absolute/cgroup/path
    log_max_bytes = 10485760    # per-replica log rotation (a size string like "10M" works)
    log_backups = 3
    keep_replicas = 5000        # history kept in state.db
    keep_events = 20000
    keep_days = 7
    result_max_bytes = "16M"    # a task's result larger than this fails the task
    http = ["unix:http.sock", "tcp://127.0.0.1:8470"]   # the HTTP control plane (default: the first)
    http_token_file = "http.token"       # TCP needs it: clients send Authorization: Bearer
    http_read_token_file = "read.token"  # optional: a token that may only read

    [pools.web]                 # the keys of a pool are the flags of `launch`, with `_`
    command = ["python3", "-m", "http.server", "{port}"]   # or target = "module:function"
    size = 3
    port_base = 8100
    ready = "http://127.0.0.1:{port}/"
    env = { MODE = "prod" }
    env_file = "web.env"        # KEY=VALUE lines, relative to this file; `env` wins
    cwd = "srv"                 # relative to this file's directory (the default)
    after = ["db", "migrate:completed"]   # starts once those pools of this file are ready / done

    [pools.tasks]               # an executor pool: workers that run submitted tasks
    kind = "executor"
    size = 4                    # workers
    target = "app.tasks:handle" # optional: what `submit` without --target runs
    preload = ["app"]
    max_tasks_per_child = 100   # also: timeout, grace, retries, memory_max, env, cwd
    min_workers = 1             # elastic: starts with 1, grows to `size` on demand
    idle_timeout = 60           # ...a worker idle this long above min_workers retires
    memory_budget = "2G"        # ...no worker starts past this, all workers together
    tenant_weights = { alice = 2 }   # tenants share the workers by weight (default 1)
    max_wait = 600              # seconds a queued task waits before it goes above every priority

``load(path)`` / ``parse(text, source)`` give a :class:`Config`, or raise :class:`ConfigError`,
one line ``FILE:LINE: KEY: what is wrong``. An unknown key is an error (a typo must not be
silently ignored), with the close matches as a suggestion. Everything is checked here, with
the words the daemon would use (``Policy``, ``WorkerSpec``), but nothing is imported or run:
a target is imported in the worker, a cwd is checked when a replica is made.

The file, and every ``env_file`` it names, is read under the state dir's trust rules
(``paths.read_operator_file``): a regular file, owned by the reader's uid or root, that
nobody else can write; a config file of at most 256 KiB, an env file of at most 1 MiB, and
all the env files of one config file at most 4 MiB together. Anything else is refused
with one line before a byte of it is read.

``diff(old, new)`` compares two files: pools added, removed, changed (what runs or how it
is supervised differs) and resized (only ``size`` differs), and the ``[daemon]`` settings
that differ. ``reload`` uses it for those settings only: what it does to a pool is decided
against what runs (``Supervisor.declare``), not against the file read before.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable

from ..errors import ConfigError, InvalidSpec, UnsafeFile
from ..paths import CONFIG_MAX_BYTES, ENV_FILE_MAX_BYTES, parse_env, read_operator_file
from ..policy import (
    LIMIT_KEYS, RESULT_MAX_BYTES, AfterCycle, Policy, after_order, log_backups, log_max_bytes, parse_size,
    result_max_bytes, split_after,
)
from ..protocol import MAX_COUNT, pool_name
from ..spec import SpecWire, make_spec
from ..retention import KEEP_EVENTS, KEEP_REPLICAS, KEEP_SECONDS

__all__ = ["Config", "ConfigError", "DaemonSettings", "Plan", "PoolDecl", "diff", "load", "parse", "parse_size"]

LOG_MAX_BYTES = 10 << 20
LOG_BACKUPS = 3
CPU_WEIGHT_MAX = 10_000  # cgroup v2 cpu.weight is 1..10000
ENV_FILES_MAX_BYTES = 4 << 20  # all the env files one config file names, together

# The cgroup limits are Policy fields too, but a [pools.NAME] table's own keys here (PoolDecl).
POLICY_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Policy) if f.name not in LIMIT_KEYS)
SPEC_KEYS = ("command", "target", "env", "env_file", "cwd")
POOL_KEYS: tuple[str, ...] = ("kind", "size", *SPEC_KEYS, "preload", *LIMIT_KEYS, *POLICY_KEYS)  # log_* are policy keys
POOL_KINDS = ("replicas", "executor")
# An executor pool (kind = "executor"): its workers run the tasks submitted to it; ``target``
# is optional, the task a `submit` without --target runs.
EXECUTOR_KEYS: tuple[str, ...] = ("kind", "size", "target", "preload", "env", "env_file", "cwd", "memory_max",
                                  "max_tasks_per_child", "timeout", "grace", "retries", "log_max_bytes",
                                  "log_backups", "min_workers", "idle_timeout", "memory_budget",
                                  "tenant_weights", "max_wait")
DAEMON_KEYS = ("grace", "stop_budget", "metrics_port", "cgroup", "log_max_bytes", "log_backups",
               "keep_replicas", "keep_events", "keep_days", "result_max_bytes", "http", "http_token_file",
               "http_read_token_file")
TOP_KEYS = ("daemon", "pools")


# -- what a file declares ---------------------------------------------------------------


@dataclass(frozen=True)
class DaemonSettings:
    grace: float = 5.0
    stop_budget: float = 30.0
    metrics_port: int | None = None
    cgroup: str = "auto"  # auto | off | an absolute path
    log_max_bytes: int = LOG_MAX_BYTES
    log_backups: int = LOG_BACKUPS
    keep_replicas: int = KEEP_REPLICAS
    keep_events: int = KEEP_EVENTS
    keep_days: float = KEEP_SECONDS / 86400
    result_max_bytes: int = RESULT_MAX_BYTES
    http: tuple[str, ...] | None = None  # addresses of the HTTP control plane; None: unix:http.sock
    http_token_file: str | None = None  # absolute (relative ones are the config file's directory's)
    http_read_token_file: str | None = None


@dataclass(frozen=True)
class PoolDecl:
    """One ``[pools.NAME]`` table. ``spec`` and ``policy`` are wire dicts, as ``launch``
    sends them (``WorkerSpec.to_wire()``, ``Policy.to_wire()``); ``env`` and ``cwd`` are in
    ``spec`` (env_file merged in, cwd made absolute). None for a log or limit setting: the
    daemon's (logs), or no limit."""

    name: str
    size: int = 1
    spec: SpecWire = field(default_factory=lambda: SpecWire())
    policy: dict[str, Any] = field(default_factory=dict)
    preload: tuple[str, ...] = ()
    log_max_bytes: int | None = None
    log_backups: int | None = None
    memory_max: int | None = None
    pids_max: int | None = None
    cpu_weight: int | None = None
    executor: dict[str, Any] | None = None  # kind = "executor": the executor's options (daemon/taskrecords.py)
    line: int = field(default=0, compare=False)  # of its table header, for messages

    def key(self) -> str:
        """Equal for two declarations iff the same thing runs under the same supervision:
        spec, policy, preload, log rotation and cgroup limits; not ``size`` (a resize is
        not a roll) and not ``name``. Canonical JSON, so it can be stored and compared."""
        return json.dumps(
            {
                "spec": self.spec,
                "policy": self.policy,
                "preload": list(self.preload),
                "log_max_bytes": self.log_max_bytes,
                "log_backups": self.log_backups,
                "memory_max": self.memory_max,
                "pids_max": self.pids_max,
                "cpu_weight": self.cpu_weight,
                "executor": self.executor,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @property
    def env(self) -> dict[str, str]:
        return dict(self.spec.get("env") or {})

    @property
    def cwd(self) -> str | None:
        return self.spec.get("cwd")


@dataclass(frozen=True)
class Config:
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    pools: dict[str, PoolDecl] = field(default_factory=dict)  # in file order
    source: str = field(default="<config>", compare=False)


@dataclass(frozen=True)
class Plan:
    """What a reload does, each list in the new file's order (``removed``: the old one's)."""

    added: list[PoolDecl] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[PoolDecl] = field(default_factory=list)  # rolled onto the new spec (and sized)
    resized: list[PoolDecl] = field(default_factory=list)  # only the size differs
    unchanged: list[str] = field(default_factory=list)
    daemon_changed: list[str] = field(default_factory=list)  # names of [daemon] settings that differ

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.resized or self.daemon_changed)


def diff(old: Config | None, new: Config) -> Plan:
    """How to get from the running config ``old`` (None: nothing yet) to ``new``."""
    plan = Plan()
    before = old.pools if old is not None else {}
    for name, decl in new.pools.items():
        prev = before.get(name)
        if prev is None:
            plan.added.append(decl)
        elif prev.key() != decl.key():
            plan.changed.append(decl)
        elif prev.size != decl.size:
            plan.resized.append(decl)
        else:
            plan.unchanged.append(name)
    plan.removed.extend(name for name in before if name not in new.pools)
    if old is not None:
        plan.daemon_changed.extend(
            f.name for f in fields(DaemonSettings) if getattr(old.daemon, f.name) != getattr(new.daemon, f.name)
        )
    return plan


# -- reading ------------------------------------------------------------------------------


def load(path: str | os.PathLike[str]) -> Config:
    """Read and check a config file; relative paths in it are relative to its directory."""
    source = os.fspath(path)
    try:
        data = read_operator_file(source, "config file", CONFIG_MAX_BYTES)
    except UnsafeFile as err:
        raise ConfigError(str(err), source=source, problem=str(err)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError.at(source, line, "(file)", "not UTF-8 text") from None
    return parse(text, source, base_dir=os.path.dirname(os.path.abspath(source)))


def parse(text: str, source: str = "<config>", *, base_dir: str | os.PathLike[str] | None = None) -> Config:
    """Check a config file's text. ``base_dir``: what relative paths (cwd, env_file) are
    relative to; default the directory of ``source`` when it names a file, else the
    current directory."""
    text = text.removeprefix("\ufeff")
    if base_dir is None:
        base_dir = os.getcwd() if source.startswith("<") else os.path.dirname(os.path.abspath(source))
    return _Reader(text, source, os.path.abspath(base_dir)).read()


class _Reader:
    def __init__(self, text: str, source: str, base_dir: str) -> None:
        self.text, self.source, self.base_dir = text, source, base_dir
        self.lines = _KeyLines(text)
        self.env_files: dict[str, tuple[int, dict[str, str]]] = {}  # path -> (size, variables)
        self.env_bytes = 0

    # errors, with the line of the key they are about
    def fail(self, path: tuple[str, ...], problem: str) -> ConfigError:
        return ConfigError.at(self.source, self.lines.find(path), _dotted(path), problem)

    def unknown(self, path: tuple[str, ...], known: Iterable[str], where: str) -> ConfigError:
        known = list(known)
        close = difflib.get_close_matches(path[-1], known, n=3, cutoff=0.6)
        if close:
            hint = f"did you mean {' or '.join(close)}?"
        else:
            hint = f"{where} takes: {', '.join(known)}"
        return self.fail(path, f"unknown key; {hint}")

    def read(self) -> Config:
        try:
            doc = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as err:
            raise self._syntax(err) from None
        for key in doc:
            if key not in TOP_KEYS:
                raise self.unknown((key,), TOP_KEYS, "the top level")
        daemon = self._daemon(doc.get("daemon", {}))
        pools_doc = doc.get("pools", {})
        if not isinstance(pools_doc, dict):
            raise self.fail(("pools",), "must be a table of [pools.NAME] tables")
        pools: dict[str, PoolDecl] = {}
        for name, table in pools_doc.items():
            pools[name] = self._pool(name, table)
        self._order(pools)
        return Config(daemon=daemon, pools=pools, source=self.source)

    def _syntax(self, err: tomllib.TOMLDecodeError) -> ConfigError:
        message = str(err)
        line: int | None = None
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
        if m:
            line = int(m.group(1))
            message = f"{message[:m.start()]} (column {m.group(2)})"
        elif message.endswith("(at end of document)"):
            line = max(1, len(self.text.splitlines()))
            message = message[: -len("(at end of document)")].rstrip() + " (at the end of the file)"
        what = self.lines.at_line(line) if line else None
        return ConfigError.at(self.source, line, _dotted(what) if what else "(syntax)",
                              f"invalid TOML: {message}")

    # [daemon]

    def _daemon(self, table: Any) -> DaemonSettings:
        if not isinstance(table, dict):
            raise self.fail(("daemon",), "must be a table: [daemon]")
        for key in table:
            if key not in DAEMON_KEYS:
                raise self.unknown(("daemon", key), DAEMON_KEYS, "[daemon]")
        values: dict[str, Any] = {}
        for key, value in table.items():
            path = ("daemon", key)
            try:
                values[key] = self._daemon_value(key, value)
            except InvalidSpec as err:
                raise self.fail(path, str(err)) from None
        return DaemonSettings(**values)

    def _daemon_value(self, key: str, value: Any) -> Any:
        if key == "grace":
            return float(_number(value, key))
        if key == "stop_budget":
            return float(_number(value, key, above=0))
        if key == "keep_days":
            return float(_number(value, key, above=0))
        if key == "metrics_port":
            return _port(value, key)
        if key == "cgroup":
            if value in ("auto", "off"):
                return value
            if isinstance(value, str) and os.path.isabs(value) and "\0" not in value:
                return os.path.normpath(value)
            raise InvalidSpec(f"must be auto, off or an absolute cgroup path, got {value!r}")
        if key == "log_max_bytes":
            return log_max_bytes(value, key)
        if key == "log_backups":
            return log_backups(value, key)
        if key in ("keep_replicas", "keep_events"):
            return _integer(value, key, low=0)
        if key == "result_max_bytes":
            return result_max_bytes(value, key)
        if key == "http":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
                raise InvalidSpec(f"must be an address or a list of them (unix:PATH, tcp://HOST:PORT, off), got {value!r}")
            return tuple(items)
        if key in ("http_token_file", "http_read_token_file"):
            if not isinstance(value, str) or not value or "\0" in value:
                raise InvalidSpec(f"must be a file name, got {value!r}")
            return os.path.join(self.base_dir, value)
        raise AssertionError(key)  # pragma: no cover - DAEMON_KEYS and this stay in step

    # [pools.NAME]

    def _pool(self, name: str, table: Any) -> PoolDecl:
        here = ("pools", name)
        try:
            pool_name(name)
        except InvalidSpec as err:
            raise self.fail(here, str(err)) from None
        if not isinstance(table, dict):
            raise self.fail(here, f"must be a table: [pools.{name}]")
        kind = table.get("kind", "replicas")
        if kind not in POOL_KINDS:
            raise self.fail((*here, "kind"), f"must be one of {', '.join(POOL_KINDS)}, got {kind!r}")
        if kind == "executor":
            return self._executor_pool(name, table)
        for key in table:
            if key not in POOL_KEYS:
                raise self.unknown((*here, key), POOL_KEYS, "a [pools.NAME] table")

        check = self._checker(here, table)

        size = check("size", _integer, low=0, high=MAX_COUNT)
        preload = check("preload", _modules)
        if preload and "command" in table:
            raise self.fail((*here, "preload"), "is for a Python target; a command imports nothing")
        spec = self._spec(here, table, preload or ())
        policy = self._policy(here, table)
        return PoolDecl(
            name=name,
            size=1 if size is None else size,
            spec=spec,
            policy=policy,
            preload=preload or (),
            log_max_bytes=check("log_max_bytes", log_max_bytes),
            log_backups=check("log_backups", log_backups),
            memory_max=check("memory_max", parse_size),
            pids_max=check("pids_max", _integer, low=1),
            cpu_weight=check("cpu_weight", _integer, low=1, high=CPU_WEIGHT_MAX),
            line=self.lines.find(here),
        )

    def _checker(self, here: tuple[str, ...], table: dict[str, Any]) -> Callable[..., Any]:
        """``check(key, fn, ...)``: ``fn(table[key], key, ...)``, None where the key is not
        given, a one-line ConfigError at the key's line where ``fn`` refuses the value."""
        def check(key: str, fn: Any, *args: Any, **kw: Any) -> Any:
            if key not in table:
                return None
            try:
                return fn(table[key], key, *args, **kw)
            except InvalidSpec as err:
                raise self.fail((*here, key), _unprefixed(str(err), key)) from None

        return check

    def _executor_pool(self, name: str, table: dict[str, Any]) -> PoolDecl:
        """A ``kind = "executor"`` table: a pool of task workers (daemon/tasktable.py)."""
        from .taskrecords import parse_options
        from .tasktable import WORKER_TARGET

        here = ("pools", name)
        for key in table:
            if key not in EXECUTOR_KEYS:
                raise self.unknown((*here, key), EXECUTOR_KEYS, 'an executor pool (kind = "executor")')

        check = self._checker(here, table)

        size = check("size", _integer, low=1, high=MAX_COUNT)
        preload = check("preload", _modules) or ()
        target = table.get("target")
        if target is not None and (not isinstance(target, str) or not _TARGET.fullmatch(target)):
            raise self.fail((*here, "target"), f'must be "module:function", got {target!r}')
        raw: dict[str, Any] = {k: table[k] for k in ("max_tasks_per_child", "timeout", "grace", "retries", "min_workers",
                                     "idle_timeout", "tenant_weights", "max_wait") if k in table}
        for key in ("memory_max", "memory_budget"):
            if key in table:
                raw[key] = check(key, parse_size)
        if "min_workers" in table:  # elastic: size is its max_workers
            raw["max_workers"] = 1 if size is None else size
        try:
            options = parse_options(raw)
        except InvalidSpec as err:
            key = next((k for k in raw if k in str(err)), "kind")
            raise self.fail((*here, key), _unprefixed(str(err), key)) from None
        if target is not None:
            options["target"] = target
        spec_table: dict[str, Any] = {k: table[k] for k in ("env", "env_file", "cwd") if k in table}
        spec = self._spec(here, {**spec_table, "target": WORKER_TARGET}, ("orchestrator.taskworker", *preload))
        policy: dict[str, Any] = {"restart": "always", "grace": options["grace"]}
        for key, fn in (("log_max_bytes", log_max_bytes), ("log_backups", log_backups)):
            if key in table:
                policy[key] = check(key, fn)
        return PoolDecl(
            name=name,
            size=1 if size is None else size,
            spec=spec,
            policy=policy,
            preload=tuple(preload),
            log_max_bytes=check("log_max_bytes", log_max_bytes),
            log_backups=check("log_backups", log_backups),
            executor=options,
            line=self.lines.find(here),
        )

    def _order(self, pools: dict[str, PoolDecl]) -> None:
        """Each pool's ``after`` names pools of this file (the file is the desired state:
        what it declares cannot wait for what it may delete), and makes no cycle."""
        graph = {name: [split_after(e)[0] for e in decl.policy.get("after", ())] for name, decl in pools.items()}
        for name, deps in graph.items():
            for dep in deps:
                if dep not in graph:
                    raise self.fail(("pools", name, "after"), f"unknown pool {dep!r}: not a pool of this file")
        try:
            after_order(graph)
        except AfterCycle as err:
            first = min(err.cycle, key=lambda n: self.lines.find(("pools", n, "after")))
            raise self.fail(("pools", first, "after"), _unprefixed(str(err), "after")) from None

    def _spec(self, here: tuple[str, ...], table: dict[str, Any], preload: tuple[str, ...] = ()) -> SpecWire:
        has_command, has_target = "command" in table, "target" in table
        if has_command and has_target:
            first, second = sorted(("command", "target"), key=lambda k: self.lines.find((*here, k)))
            raise self.fail((*here, second), f"a pool runs a command or a target, not both "
                                             f"({first} is on line {self.lines.find((*here, first))})")
        if not (has_command or has_target):
            raise self.fail(here, 'needs command (a list of strings) or target ("module:function")')
        command = target = None
        if has_command:
            command = table["command"]
            if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
                raise self.fail((*here, "command"), f"must be a list of strings, got {command!r}")
            if not command or not command[0]:
                raise self.fail((*here, "command"), "is empty")
        else:
            target = table["target"]
            if not isinstance(target, str) or not _TARGET.fullmatch(target):
                raise self.fail((*here, "target"), f'must be "module:function", got {target!r}')
        env: dict[str, str] = {}
        if "env_file" in table:
            path = table["env_file"]
            if not isinstance(path, str) or not path:
                raise self.fail((*here, "env_file"), f"must be a file name, got {path!r}")
            try:
                env.update(self._env_file(os.path.join(self.base_dir, path)))
            except InvalidSpec as err:
                raise self.fail((*here, "env_file"), str(err)) from None
        if "env" in table:
            extra = table["env"]
            if not isinstance(extra, dict):
                raise self.fail((*here, "env"), "must be a table of NAME = \"value\"")
            for k, v in extra.items():
                if not k or "=" in k or "\0" in k:
                    raise self.fail((*here, "env", k), "an env name must be non-empty and hold no '=' or NUL")
                if not isinstance(v, str):
                    raise self.fail((*here, "env", k), f"env values are strings (quote it), got {v!r}")
            env.update(extra)
        cwd = self.base_dir
        if "cwd" in table:
            value = table["cwd"]
            if not isinstance(value, str) or not value:
                raise self.fail((*here, "cwd"), f"must be a directory name, got {value!r}")
            cwd = os.path.normpath(os.path.join(self.base_dir, value))
        try:
            return make_spec(command=command, target=target, env=env, cwd=cwd, preload=preload).to_wire()
        except InvalidSpec as err:
            # what is left: a NUL byte, or a bad name from the env file
            key = "env_file" if "env_file" in table and "env" in str(err) else "command" if has_command else "target"
            raise self.fail((*here, key), str(err)) from None

    def _env_file(self, path: str) -> dict[str, str]:
        """An env file's variables; each file is read once, but each pool that names one
        counts its size against the bound of all of them together (every pool carries a
        copy in its spec)."""
        if path not in self.env_files:
            data = read_operator_file(path, "env file", ENV_FILE_MAX_BYTES)
            self.env_files[path] = (len(data), parse_env(data, path))
        size, env = self.env_files[path]
        self.env_bytes += size
        if self.env_bytes > ENV_FILES_MAX_BYTES:
            raise InvalidSpec(f"the env files of this config file's pools add up to more than "
                              f"{ENV_FILES_MAX_BYTES >> 20} MiB: refusing {path}")
        return dict(env)

    def _policy(self, here: tuple[str, ...], table: dict[str, Any]) -> dict[str, Any]:
        # Any: the values are as the file has them; Policy checks each one.
        given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                 for k, v in table.items() if k in POLICY_KEYS}
        try:
            return Policy(**given).to_wire()  # the common case, checked once
        except (InvalidSpec, TypeError):
            pass
        port_base = given.get("port_base")
        # Refused: each key on its own, so the error names the key it is about; a probe
        # with {port} is checked with the pool's port base when that one is valid.
        base_ok = False
        if "port_base" in given:
            try:
                Policy(port_base=port_base)
                base_ok = True
            except InvalidSpec:
                pass
        for key in POLICY_KEYS:
            if key not in given:
                continue
            kwargs: dict[str, Any] = {key: given[key]}
            if key in ("ready", "live") and base_ok:
                kwargs["port_base"] = port_base
            try:
                Policy(**kwargs)
            except InvalidSpec as err:
                raise self.fail((*here, key), _unprefixed(str(err), key)) from None
            except TypeError as err:  # pragma: no cover - a value Policy cannot even compare
                raise self.fail((*here, key), f"invalid value {given[key]!r}: {err}") from None
        try:
            return Policy(**given).to_wire()
        except InvalidSpec as err:  # a combination of keys
            about = next((k for k in POLICY_KEYS if k in given and str(err).startswith(k)), None)
            raise self.fail((*here, about) if about else here, str(err)) from None


# -- values ---------------------------------------------------------------------------------

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE = re.compile(rf"{_IDENT}(?:\.{_IDENT})*")
_TARGET = re.compile(rf"{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*")


def _number(value: Any, key: str, *, low: float = 0.0, above: float | None = None) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidSpec(f"must be a finite number, got {value!r}")
    if above is not None and value <= above:
        raise InvalidSpec(f"must be more than {above:g}, got {value!r}")
    if value < low:
        raise InvalidSpec(f"must be at least {low:g}, got {value!r}")
    return value


def _integer(value: Any, key: str, *, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(f"must be a whole number, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise InvalidSpec(f"must be {span}, got {value!r}")
    return value


def _port(value: Any, key: str) -> int:
    return _integer(value, key, low=1, high=65535)


def _modules(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, str) and _MODULE.fullmatch(m) for m in value):
        raise InvalidSpec(f"must be a list of module names, got {value!r}")
    return tuple(value)


def _unprefixed(message: str, key: str) -> str:
    """``restart must be ...`` said of the key ``restart``: the line names the key already."""
    message = message.replace("--port-base", "port_base")
    if message.startswith(key + ": "):
        return message[len(key) + 2:]
    if message.startswith(key + " must "):
        return message[len(key) + 1:]
    return message


_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(p if _BARE.fullmatch(p) else json.dumps(p) for p in path)


# -- where a key is: a best-effort scan of the text ----------------------------------------

_KEY_PART = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|'([^']*)')\s*""")


def _key_path(text: str, pos: int, end: str) -> tuple[tuple[str, ...], int] | None:
    """The dotted key at ``pos`` followed by ``end`` ('=' or ']'), and where it ends."""
    parts: list[str] = []
    while True:
        m = _KEY_PART.match(text, pos)
        if not m:
            return None
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            try:
                parts.append(tomllib.loads(f'k = "{m.group(2)}"')["k"])
            except tomllib.TOMLDecodeError:
                parts.append(m.group(2))
        else:
            parts.append(m.group(3))
        pos = m.end()
        if text.startswith(".", pos):
            pos += 1
            continue
        if text.startswith(end, pos):
            return tuple(parts), pos + len(end)
        return None


class _KeyLines:
    """Line numbers of table headers and keys, by their full path: ``('pools', 'web',
    'size')`` for ``size = 3`` under ``[pools.web]`` (or ``web.size = 3`` under
    ``[pools]``). The first mention wins."""

    def __init__(self, text: str) -> None:
        self.where: dict[tuple[str, ...], int] = {}
        self.what: dict[int, tuple[str, ...]] = {}  # the key or header on a line
        self.table_of: dict[int, tuple[str, ...]] = {}  # the table a line is in
        table: tuple[str, ...] = ()
        closing: str | None = None  # inside a multi-line string that ends with this
        for number, line in enumerate(text.splitlines(), 1):
            self.table_of[number] = table
            if closing is not None:
                if _closes(line, closing):
                    closing = None
                continue
            s = line.lstrip()
            if s.startswith("["):
                array = s.startswith("[[")
                found = _key_path(s, 2 if array else 1, "]]" if array else "]")
                if found:
                    table = found[0]
                    self.where.setdefault(table, number)
                    self.what[number] = self.table_of[number] = table
                continue
            found = _key_path(s, 0, "=")
            if found is None:
                continue
            path, after = found
            full = table + path
            for i in range(len(table) + 1, len(full) + 1):
                self.where.setdefault(full[:i], number)
            self.what[number] = full
            rest = s[after:].lstrip()
            for quote in ('"""', "'''"):
                if rest.startswith(quote) and not _closes(rest[3:], quote):
                    closing = quote
                    break

    def find(self, path: tuple[str, ...]) -> int:
        """The line of ``path``, else of its nearest enclosing table or key, else 1."""
        for i in range(len(path), 0, -1):
            if path[:i] in self.where:
                return self.where[path[:i]]
        return 1

    def at_line(self, number: int) -> tuple[str, ...] | None:
        """The key or header on a line, else the table the line is in (None: top level)."""
        return self.what.get(number) or self.table_of.get(number) or None


def _closes(text: str, quote: str) -> bool:
    if quote == "'''":
        return quote in text
    i = 0
    while (j := text.find(quote, i)) >= 0:
        backslashes = len(text[:j]) - len(text[:j].rstrip("\\"))
        if backslashes % 2 == 0:
            return True
        i = j + 1
    return False
