"""The house's arrows point one way: no import cycle among ``orchestrator/`` modules
(function-level imports count), and ``watchdog/`` imports nothing of ``orchestrator``."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_names(package: str) -> set[str]:
    return {p.stem for p in (ROOT / package).glob("*.py")}


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports anywhere in its body ("__init__" for the
    package itself)."""
    names = _module_names(package)
    relative_is_ours = path.parent.name == package  # a relative import stays in its own package
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if (node.level == 1 and relative_is_ours) or (node.level == 0 and node.module and node.module.split(".")[0] == package):
                parts = (node.module or "").split(".")
                if node.level == 0:
                    parts = parts[1:]
                if parts and parts[0]:
                    found.add(parts[0])
                else:  # from . import x: a module if there is one, else a name of __init__
                    for alias in node.names:
                        found.add(alias.name if alias.name in names else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package:
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def _graph(package: str) -> dict[str, set[str]]:
    return {p.stem: _imports(p, package) - {p.stem} for p in (ROOT / package).glob("*.py")}


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


def test_no_import_cycle_in_orchestrator():
    graph = _graph("orchestrator")
    # The package's __init__ re-exports the public names: it sits on top, nothing imports it.
    importers = sorted(m for m, deps in graph.items() if "__init__" in deps)
    assert importers == [], f"modules importing the package itself: {importers}"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_are_seen(tmp_path):
    src = "def f():\n    from .daemon import Paths\n    from . import engine\n"
    (tmp_path / "orchestrator").mkdir()
    path = tmp_path / "orchestrator" / "m.py"
    path.write_text(src)
    assert {"daemon", "engine"} <= _imports(path, "orchestrator")


def test_watchdog_imports_nothing_of_orchestrator():
    for path in (ROOT / "watchdog").glob("*.py"):
        assert not _imports(path, "orchestrator"), f"{path.name} imports orchestrator"


def test_an_import_of_orchestrator_from_watchdog_is_seen(tmp_path):
    (tmp_path / "watchdog").mkdir()
    path = tmp_path / "watchdog" / "m.py"
    path.write_text("def f():\n    import orchestrator.engine\n")
    assert _imports(path, "orchestrator") == {"engine"}


# -- the client side loads none of the daemon ------------------------------------------

# What a process of any kind may load (errors, paths, the wire protocol...); and what the
# CLI and Client are themselves. Anything else of orchestrator/ (the engine, the reactor,
# pools, probes, the spawner, metrics, the config's daemon side...) is the daemon's.
SHARED = {"errors", "states", "version", "protocol", "spec", "paths", "store", "policy", "argtypes", "targets",
          "worker", "retention", "logfiles", "signals"}
CLIENT = {"cli", "channel", "verbs", "control", "display", "logread", "logcli", "demo"}


def test_the_cli_and_client_load_no_daemon_module():
    code = ("import sys, orchestrator.cli, orchestrator.channel\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('orchestrator', 'watchdog'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    loaded = {m.split(".", 1)[1] if "." in m else "__init__" for m in out if m.startswith("orchestrator")}
    assert loaded <= SHARED | CLIENT | {"__init__"}, f"daemon modules loaded: {sorted(loaded - SHARED - CLIENT)}"
    assert not [m for m in out if m.startswith("watchdog")], out
    # The Client speaks the Manager protocol itself: multiprocess (and dill) cost ~50 ms a command.
    code = "import sys, orchestrator.cli, orchestrator.channel\nprint(sorted(sys.modules))"
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "'multiprocess" not in mods and "'dill" not in mods


def test_client_modules_import_only_shared_and_client_modules():
    """Function-level imports count: what one command imports is still the client's."""
    graph = _graph("orchestrator")
    allowed = SHARED | CLIENT
    # start --foreground turns this process into the daemon: the one arrow into it.
    exceptions = {("cli", "daemon"), ("cli", "config")}  # config: start --config is checked before the start
    wrong = sorted((m, d) for m in CLIENT for d in graph.get(m, set()) - allowed if (m, d) not in exceptions)
    assert not wrong, f"client modules importing daemon modules: {wrong}"


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
        assert "engine" not in graph[module], f"{module}.py imports engine.py"
    assert not {"supervision", "spawning"} & graph["containment"]
    assert "spawning" not in graph["supervision"]


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
    for path in sorted((ROOT / "orchestrator").glob("*.py")):
        if path.name != SIGNAL_MODULE:
            found += _signal_sends(path.read_text(), path.name)
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

_DAEMON_SIDE = {"engine", "supervision", "reactor", "pools", "probes", "launcher", "osapi", "containment",
                "metrics", "httpserver", "journal", "recovery", "children", "daemon", "api", "signals"}


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
    for module in ("spawner", "childsetup", "spec", "probespec"):
        assert not _reach(graph, module) & _DAEMON_SIDE, f"{module} reaches {_reach(graph, module) & _DAEMON_SIDE}"


def test_signals_imports_nothing_of_orchestrator():
    """The CLI's stop and the spawner send signals too: signals.py must stay light for them."""
    assert _imports(ROOT / "orchestrator" / "signals.py", "orchestrator") == set()
