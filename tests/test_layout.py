"""The house's arrows point one way: no import cycle among ``orchestrator/`` modules
(function-level imports count), each module imports only what the process that runs it may
(its path says which: ``client/``, ``daemon/``, ``spawn/``, ``manager/``, or shared at the top),
and ``watchdog/`` imports nothing of ``orchestrator``."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


PACKAGES = ("client", "daemon", "spawn", "manager")  # orchestrator's subpackages: one per kind of process


def _module_names(package: str) -> set[str]:
    """Every module of ``package`` by its dotted name under it: ``errors``,
    ``daemon.engine``; a subpackage's ``__init__`` by the subpackage's name (``daemon``)."""
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT / package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] or ["__init__"]
        names.add(".".join(parts))
    return names


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports anywhere in its body, by their dotted
    names under it ("__init__" for the package itself)."""
    known = _module_names(package)
    parts = list(path.parts)
    inside = package in parts[:-1]
    here = parts[len(parts) - 1 - parts[::-1].index(package):-1] if inside else []  # e.g. [package, "daemon"]
    found: set[str] = set()

    def add(dotted: list[str], names: list[str]) -> None:
        if dotted and dotted[0] == package:
            rest = ".".join(dotted[1:])
            for name in names:  # from X import name: a submodule if there is one
                sub = f"{rest}.{name}" if rest else name
                if sub in known:
                    found.add(sub)
                    continue
                found.add(rest or "__init__")

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if not inside:
                    continue
                base = here[:len(here) - (node.level - 1)]
                add(base + (node.module.split(".") if node.module else []), [a.name for a in node.names])
            elif node.module:
                add(node.module.split("."), [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                dotted = alias.name.split(".")
                if dotted[0] == package:
                    found.add(".".join(dotted[1:]) or "__init__")
    return found


def _graph(package: str) -> dict[str, set[str]]:
    graph = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT / package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] or ["__init__"]
        name = ".".join(parts)
        graph[name] = _imports(path, package) - {name}
    return graph


def _side(module: str) -> str:
    """Which process runs ``module``: its subpackage, or "shared" for a top-level module
    (``__main__`` is the CLI's entry)."""
    head = module.split(".")[0]
    return head if head in PACKAGES else "client" if module == "__main__" else "shared"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


# Two doors to one thing, by contract: ``Client(DIR).executor(P)`` and ``Executor(state_dir=DIR)``;
# each import is inside a function, so neither module needs the other to load. The same for
# ``Client(DIR).task(ID)``, the door to a task's handle (which reaches the daemon through
# the Executor's side of things: its futures and exceptions).
CYCLE_EDGES_ALLOWED = {("client.channel", "executor"), ("client.channel", "client.taskhandle")}


def test_no_import_cycle_in_orchestrator():
    graph = _graph("orchestrator")
    for src, dst in CYCLE_EDGES_ALLOWED:
        graph[src].discard(dst)
    # The package's __init__ re-exports the public names: it sits on top, nothing imports it.
    importers = sorted(m for m, deps in graph.items() if "__init__" in deps)
    assert importers == [], f"modules importing the package itself: {importers}"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_are_seen(tmp_path):
    src = "def f():\n    from ..daemon import engine\n    from .. import errors\n    from . import cli\n"
    (tmp_path / "orchestrator" / "client").mkdir(parents=True)
    path = tmp_path / "orchestrator" / "client" / "m.py"
    path.write_text(src)
    assert _imports(path, "orchestrator") == {"daemon.engine", "errors", "client.cli"}


def test_watchdog_imports_nothing_of_orchestrator():
    for path in (ROOT / "watchdog").glob("*.py"):
        assert not _imports(path, "orchestrator"), f"{path.name} imports orchestrator"


def test_an_import_of_orchestrator_from_watchdog_is_seen(tmp_path):
    (tmp_path / "watchdog").mkdir()
    path = tmp_path / "watchdog" / "m.py"
    path.write_text("def f():\n    import orchestrator.daemon.engine\n")
    assert _imports(path, "orchestrator") == {"daemon.engine"}


# -- a module's path says which process runs it, and what it may import -------------------

# Each side may import these sides (function-level imports count). The daemon forks a
# replica itself while no spawner is ready, so it runs the child's set-up (spawn/).
ALLOWED = {"shared": {"shared"}, "client": {"shared", "client"}, "daemon": {"shared", "daemon", "spawn"},
           "spawn": {"shared", "spawn"}, "manager": {"shared", "manager"}}
EXCEPTIONS = {
    ("client.cli", "daemon.main"),  # start --foreground: this process becomes the daemon
    ("client.cli", "daemon.config"),  # start --config is checked before the daemon starts
    ("manager.channelserver", "client.channel"),  # the server end of the client's wire code:
    ("manager.server", "client.channel"),  # the frames, the auth key and the socket's address
    ("manager.server", "spawn.childsetup"),  # PR_SET_PDEATHSIG, as a replica sets it
    ("taskworker", "spawn.childsetup"),  # PR_SET_CHILD_SUBREAPER: a task's daemonized children stay below it
    ("executor", "daemon.embedded"),  # Executor() runs its pool's control loop in this process
    ("executor", "client.channel"),  # Executor(state_dir=...): its pool is in that daemon
}


def test_every_module_imports_only_what_its_side_may():
    graph = _graph("orchestrator")
    wrong = sorted((m, d) for m, deps in graph.items() if m != "__init__" for d in deps
                   if _side(d) not in ALLOWED[_side(m)] and (m, d) not in EXCEPTIONS)
    assert not wrong, f"imports across the processes' lines: {wrong}"


def test_the_side_checker_sees_a_wrong_arrow(tmp_path):
    (tmp_path / "orchestrator" / "client").mkdir(parents=True)
    path = tmp_path / "orchestrator" / "client" / "m.py"
    path.write_text("from ..daemon import engine\n")
    (dep,) = _imports(path, "orchestrator")
    assert _side(dep) not in ALLOWED[_side("client.m")]


def test_the_cli_and_client_load_no_daemon_module():
    code = ("import sys, orchestrator.client.cli, orchestrator.client.channel\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('orchestrator', 'watchdog'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    loaded = {m.split(".", 1)[1] for m in out if m.startswith("orchestrator.")}
    assert {_side(m) for m in loaded} <= {"shared", "client"}, f"loaded: {sorted(loaded)}"
    assert not [m for m in out if m.startswith("watchdog")], out
    # The Client speaks the Manager protocol itself: multiprocess (and dill) cost ~50 ms a command.
    code = "import sys, orchestrator.client.cli, orchestrator.client.channel\nprint(sorted(sys.modules))"
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "'multiprocess" not in mods and "'dill" not in mods


# -- the public names ----------------------------------------------------------------------


def _documented_names() -> list[str]:
    """The names listed in the README's API section: each bullet's leading `Name`s."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    names: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            head = line[2:].split(":", 1)[0]
            names += re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", head)
    return names


def test_exported_names_are_exactly_the_documented_ones():
    import orchestrator

    documented = _documented_names()
    assert len(documented) == len(set(documented)), documented
    assert sorted(orchestrator.__all__) == sorted(documented)


def test_every_exported_name_imports():
    code = ("import orchestrator\n"
            "for name in orchestrator.__all__:\n"
            "    getattr(orchestrator, name)\n"
            "from orchestrator import *\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_error_types_are_orchestrator_errors_where_documented():
    import orchestrator
    from orchestrator import errors

    for name in ("UnsafeStateDir", "UnsafeFile", "ConfigError", "StoreError"):
        cls = getattr(orchestrator, name)
        assert cls.__module__ == "orchestrator.errors" and issubclass(cls, orchestrator.OrchestratorError)
    assert issubclass(orchestrator.UnsafeFile, orchestrator.InvalidSpec)
    assert orchestrator.SpawnerLost is errors.SpawnerLost


def test_the_engine_and_its_collaborators_meet_only_through_their_interfaces():
    """supervision.py and spawning.py act on the engine through a Protocol of their own, so
    they never import engine.py; containment.py decides for both and imports neither."""
    graph = _graph("orchestrator")
    for module in ("supervision", "spawning", "containment", "rollout", "waiters"):
        assert "daemon.engine" not in graph[f"daemon.{module}"], f"{module}.py imports engine.py"
    assert not {"daemon.supervision", "daemon.spawning"} & graph["daemon.containment"]
    assert "daemon.spawning" not in graph["daemon.supervision"]


# -- one module sends every signal ---------------------------------------------------------

SIGNAL_MODULE = "signals.py"
_OS_SENDERS = {"kill", "killpg"}
_CGROUP_SENDERS = {"kill", "signal_members", "send_signal", "kill_and_remove"}  # watchdog.cgroup's


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _signal_sends(source: str, name: str = "<src>") -> list[str]:
    """Where ``source`` sends a signal itself: ``os.kill``, ``os.killpg``,
    ``pidfd_send_signal``, ``watchdog.cgroup``'s killers and signallers, ``Subtree.kill_all``,
    or a ``cgroup.kill`` path in code (a docstring or comment may name it)."""
    tree = ast.parse(source, name)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if ((base == "os" and node.attr in _OS_SENDERS) or node.attr in ("pidfd_send_signal", "kill_all")
                    or (base == "cgroup" and node.attr in _CGROUP_SENDERS)):
                found.append(f"{name}:{line}: {base}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = {a.name for a in node.names}
            wanted = {"os": _OS_SENDERS, "signal": {"pidfd_send_signal"}, "watchdog.cgroup": _CGROUP_SENDERS}
            if names & wanted.get(node.module or "", set()):
                found.append(f"{name}:{line}: from {node.module} import {', '.join(sorted(names))}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and "cgroup.kill" in node.value
              and id(node) not in docs):
            found.append(f"{name}:{line}: {node.value!r}")
    return found


def test_every_signal_is_sent_by_the_signals_module():
    found = []
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        if path != ROOT / "orchestrator" / SIGNAL_MODULE:
            found += _signal_sends(path.read_text(), str(path.relative_to(ROOT / "orchestrator")))
    assert found == [], "signals sent outside orchestrator/signals.py:\n" + "\n".join(found)
    assert _signal_sends((ROOT / "orchestrator" / SIGNAL_MODULE).read_text()), "the checker sees nothing there"


def test_the_signal_checker_sees_each_form():
    sends = [
        "os.kill(pid, 9)", "os.killpg(pgid, 15)", "signal.pidfd_send_signal(fd, 15)",
        "from os import kill", "from signal import pidfd_send_signal", "cgroup.kill(path)",
        "cgroup.signal_members(path, 15)", "subtree.kill_all()", "open(path + '/cgroup.kill', 'w')",
        "from watchdog.cgroup import kill",
    ]
    for src in sends:
        assert _signal_sends(src), src
    quiet = ['"""Killed by ``cgroup.kill``."""', "# os.kill(pid)", "signals.to_child(pid, 9)", "proc.kill()",
             "self.containment.kill(path)"]
    for src in quiet:
        assert not _signal_sends(src), src


# -- the spawner process and the data it is sent ---------------------------------------------

def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_spawner_process_loads_none_of_the_daemon():
    """spawner.py (the spawner process) and childsetup.py (the forked replica) run outside the
    daemon; spec.py and probespec.py are data any process may import."""
    graph = _graph("orchestrator")
    for module in ("spawn.spawner", "spawn.childsetup", "spec", "probespec"):
        daemon = {m for m in _reach(graph, module) if _side(m) == "daemon"}
        assert not daemon, f"{module} reaches {daemon}"


def test_signals_imports_nothing_of_orchestrator():
    """The CLI's stop and the spawner send signals too: signals.py must stay light for them."""
    assert _imports(ROOT / "orchestrator" / "signals.py", "orchestrator") == set()


def test_every_package_is_installed():
    """pyproject.toml lists its packages by name (no discovery, for the `watchdog` name's
    sake): a subpackage missing there would be absent from a wheel, though an editable
    install still finds it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("orchestrator", "watchdog")
             for p in (ROOT / top).rglob("__init__.py")}
    assert listed == found
