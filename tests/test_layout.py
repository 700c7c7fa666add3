"""The house's arrows point one way: no import cycle among ``orchestrator/`` modules
(function-level imports count), each module imports only what the process that runs it may
(its path says which: ``client/``, ``daemon/``, ``spawn/``, ``manager/``, or shared at the top;
the faces, ``__init__`` and ``executor``, put the sides together and nothing imports them),
an exception to that only where no shared module could carry the import, ``watchdog/``
imports nothing of ``orchestrator``, and no class uses a private name that only a base class
in another file defines (one object in two files)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


PACKAGES = ("client", "daemon", "spawn", "manager")  # orchestrator's subpackages: one per kind of process


def _dotted(top: Path, path: Path) -> str:
    """A module of the package in ``top`` by its dotted name under it: ``errors``,
    ``daemon.engine``; a subpackage's ``__init__`` by the subpackage's name (``daemon``)."""
    parts = list(path.relative_to(top).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return ".".join(parts)


def _module_names(package: str) -> set[str]:
    """Every module of ``package``, by its dotted name under it."""
    return {_dotted(ROOT / package, path) for path in (ROOT / package).rglob("*.py")}


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
        name = _dotted(ROOT / package, path)
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


# The faces: what a user imports, each putting the processes' sides together for its public
# names. Nothing but a face imports a face (``__init__`` names the others' names, lazily; an
# integration is the executor inside another engine), so a face may import any side without
# making a circle.
FACES = {
    "__init__": "re-exports the public names, each loaded on first use",
    "executor": "Executor() runs its pool's loop in this process (daemon.embedded) or reaches a daemon's "
                "(client.channel); Client(DIR).executor(P) is Executor(state_dir=DIR, pool=P)",
    "integrations.dask": "ExecutorPlugin gives each Dask worker an Executor (the executor face) and reaches "
                         "its tasks' futures (taskfutures) from Dask's worker plugin hooks",
    "integrations.joblib": "the joblib backend 'orchestrator' runs each Parallel call's tasks in an Executor "
                           "(the executor face) and cancels their futures on an abort",
}


def test_no_import_cycle_in_orchestrator():
    graph = _graph("orchestrator")
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_nothing_imports_a_face():
    graph = _graph("orchestrator")
    importers = sorted((m, face) for m, deps in graph.items() for face in FACES
                       if face in deps and m not in FACES)
    assert importers == [], f"modules importing a face: {importers}"
    assert not [m for m, deps in graph.items() if "__init__" in deps], "a module imports the package itself"


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
# An import across the lines, each with its reason: only where this process becomes (or
# does the work of) the other side. What two sides share (the channel's frames, auth key and
# address: channelwire.py; prctl: prctl.py) is a shared module, not an exception.
EXCEPTIONS = {
    ("client.cli", "daemon.main"): "start --foreground: this process becomes the daemon",
    ("client.cli", "daemon.config"): "start --config: the file is checked before a daemon starts, in the "
                                     "daemon's own words (its executor pools' options are the task table's)",
}
# The list, as it should be: an exception added is a decision, made here as well.
EXPECTED_EXCEPTIONS = {("client.cli", "daemon.main"), ("client.cli", "daemon.config")}


def _crossings(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports across the processes' lines: a face's are its nature, the rest must be
    exceptions."""
    return sorted((m, d) for m, deps in graph.items() if m not in FACES for d in deps
                  if _side(d) not in ALLOWED[_side(m)])


def test_every_module_imports_only_what_its_side_may():
    wrong = [pair for pair in _crossings(_graph("orchestrator")) if pair not in EXCEPTIONS]
    assert not wrong, f"imports across the processes' lines: {wrong}"


# -- what a module takes from another, by name ----------------------------------------------
#
# The checkers below read the package in ``top`` (``ROOT / "orchestrator"``, or one planted in
# a test's tmp_path), its modules named as ``_dotted`` names them.


def _source(top: Path, module: str) -> Path:
    if module == "__init__":
        return top / "__init__.py"
    base = top.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _from_base(top: Path, path: Path, node: ast.ImportFrom) -> list[str] | None:
    """The module a ``from X import ...`` in ``path`` names, as parts under ``top``; None for
    another package's."""
    if node.level:
        here = list(path.relative_to(top).parent.parts)
        if node.level - 1 > len(here):
            return None
        return here[:len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    dotted = (node.module or "").split(".")
    return dotted[1:] if dotted[0] == top.name else None


def _bindings(top: Path, path: Path, nodes: list[ast.stmt]) -> dict[str, tuple[str, str | None]]:
    """The names the import statements among ``nodes`` (and in the top-level ``if``/``try``
    blocks among them) bind to the package: name -> (module, its attribute, or None for the
    module itself)."""
    known = {_dotted(top, p) for p in top.rglob("*.py")}
    out: dict[str, tuple[str, str | None]] = {}
    todo = list(nodes)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ImportFrom) and (base := _from_base(top, path, node)) is not None:
            for alias in node.names:
                sub = ".".join(base + [alias.name])
                out[alias.asname or alias.name] = (sub, None) if sub in known else (".".join(base) or "__init__", alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                dotted = alias.name.split(".")
                if dotted[0] == top.name and alias.asname:
                    out[alias.asname] = (".".join(dotted[1:]) or "__init__", None)
    return out


def _needs_its_side(top: Path, user: str, module: str) -> bool:
    """Whether what ``user`` takes from ``module`` needs a module of ``module``'s own side: the
    names it imports from there (all of it, for an import of the module itself), followed
    through ``module``'s top-level definitions, reach an import of that side. If not, a
    shared module could hold them, and ``user``'s import would not cross a line."""
    side = _side(module)
    user_path, path = _source(top, user), _source(top, module)
    wanted: set[str] = set()
    whole = False
    for node in ast.walk(ast.parse(user_path.read_text(), str(user_path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for mod, attr in _bindings(top, user_path, [node]).values():
                if mod == module:
                    whole |= attr is None
                    wanted |= {attr} if attr else set()
            whole |= isinstance(node, ast.Import) and any(
                a.name == f"{top.name}.{module}" for a in node.names)
    tree = ast.parse(path.read_text(), str(path))
    bound = _bindings(top, path, tree.body)
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defs[name.id] = node
    todo, seen = list(set(defs) | set(bound) if whole else wanted), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in bound:
            if _side(bound[name][0]) == side:
                return True
            continue
        for sub in ast.walk(defs[name]) if name in defs else ():
            if isinstance(sub, ast.Name):
                todo.append(sub.id)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):  # a function-level import
                if any(_side(mod) == side for mod, _ in _bindings(top, path, [sub]).values()):
                    return True
    return False


def test_the_exceptions_are_few_each_with_its_reason():
    """Every exception is an import that exists, gives its reason, and takes from the other
    side something that needs that side (else a shared module would do: the channel's frames
    and keys are ``channelwire.py``, ``prctl`` is ``prctl.py``); and the list is the
    expected one."""
    graph = _graph("orchestrator")
    assert set(EXCEPTIONS) == EXPECTED_EXCEPTIONS
    assert all(len(reason.split()) >= 3 for reason in EXCEPTIONS.values()), "an exception without its reason"
    assert all(len(reason.split()) >= 3 for reason in FACES.values()), "a face without its reason"
    used = set(_crossings(graph))
    assert not [pair for pair in EXCEPTIONS if pair not in used], "an exception no import needs"
    top = ROOT / "orchestrator"
    replaceable = [pair for pair in EXCEPTIONS if not _needs_its_side(top, *pair)]
    assert not replaceable, f"a shared module would do: {replaceable}"


def _plant(top: Path, files: dict[str, str]) -> None:
    for name, src in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(textwrap.dedent(src).lstrip("\n"))


def test_the_exception_checker_sees_where_a_shared_module_would_do(tmp_path):
    top = tmp_path / "orchestrator"
    _plant(top, {
        "errors.py": "class ChannelError(Exception): pass\n",
        "client/taskhandle.py": "class TaskHandle: pass\n",
        "client/channel.py": """
            from ..errors import ChannelError
            KEY = "k"

            def read_key():
                if not KEY:
                    raise ChannelError()
                return KEY

            class Client:
                def task(self):
                    from .taskhandle import TaskHandle
                    return TaskHandle()
            """,
        "manager/server.py": "from ..client.channel import read_key\n",
        "manager/other.py": "def f():\n    from ..client.channel import Client\n",
        "manager/whole.py": "from ..client import channel\n",
    })
    assert not _needs_its_side(top, "manager.server", "client.channel")  # read_key: a shared module would do
    assert _needs_its_side(top, "manager.other", "client.channel")  # Client.task reaches client.taskhandle
    assert _needs_its_side(top, "manager.whole", "client.channel")  # all of it: Client too


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


# -- one object, one file: no private name of a base class in another file ----------------
#
# A class that uses ``self._x`` (or ``cls._x``) which only a base class in another file defines
# is one object in two files: the base's private state, reached past its public face. Give
# the base a public API and hand it to a collaborator instead (a subclass is for a variant).


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _ClassInfo:
    """A class of the package: the private names it defines (methods and attributes in its
    body, ``__slots__``, what its code assigns to ``self._x``/``cls._x``) and the ones its
    code reads."""

    def __init__(self, module: str, path: Path, node: ast.ClassDef) -> None:
        self.module, self.path, self.name, self.bases = module, path, node.name, node.bases
        self.defined: set[str] = set()
        self.used: list[tuple[str, int]] = []
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
                self.defined |= names
                if "__slots__" in names and stmt.value is not None:
                    self.defined |= {c.value for c in ast.walk(stmt.value)
                                     if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        todo: list[ast.AST] = list(node.body)
        while todo:
            sub = todo.pop()
            if isinstance(sub, ast.ClassDef):
                continue  # a nested class is a class of its own
            todo.extend(ast.iter_child_nodes(sub))
            if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                    and sub.value.id in ("self", "cls") and _private(sub.attr)):
                if isinstance(sub.ctx, ast.Store):
                    self.defined.add(sub.attr)
                else:
                    self.used.append((sub.attr, sub.lineno))


def _private_crossings(top: Path) -> list[str]:
    """Every use (``file:line``) of a private name by a class where that name is defined only
    by base classes of the package in other files (not by the class itself, nor by a base in
    its own file). Bases are followed through imports and re-exports; a base from outside
    the package (the standard library's) is not this rule's business."""
    classes: dict[tuple[str, str], _ClassInfo] = {}
    bound: dict[str, dict[str, tuple[str, str | None]]] = {}
    for path in sorted(top.rglob("*.py")):
        module = _dotted(top, path)
        tree = ast.parse(path.read_text(), str(path))
        bound[module] = _bindings(top, path, tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault((module, node.name), _ClassInfo(module, path, node))

    def find(module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        if (module, name) in classes:
            return module, name
        mod, attr = bound.get(module, {}).get(name, (None, None))
        return find(mod, attr, depth + 1) if mod is not None and attr is not None and depth < 10 else None

    def base_of(module: str, expr: ast.expr) -> tuple[str, str] | None:
        if isinstance(expr, ast.Subscript):  # Base[T]
            expr = expr.value
        if isinstance(expr, ast.Name):
            return find(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):  # module.Base
            mod, attr = bound.get(module, {}).get(expr.value.id, (None, None))
            return find(mod, expr.attr) if mod is not None and attr is None else None
        return None

    found = []
    for info in classes.values():
        ancestors: list[_ClassInfo] = []
        todo = [info]
        while todo:
            cls = todo.pop()
            for expr in cls.bases:
                key = base_of(cls.module, expr)
                if key is not None and classes[key] not in ancestors and classes[key] is not info:
                    ancestors.append(classes[key])
                    todo.append(classes[key])
        if all(a.path == info.path for a in ancestors):
            continue
        for name, line in info.used:
            if name in info.defined:
                continue
            owners = [a for a in ancestors if name in a.defined]
            if owners and all(a.path != info.path for a in owners):
                where = ", ".join(f"{a.name} ({a.path.relative_to(top)})" for a in owners)
                found.append(f"{info.path.relative_to(top)}:{line}: {info.name} uses self.{name}, defined only by {where}")
    return sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def test_no_class_uses_a_private_name_of_a_base_in_another_file():
    found = _private_crossings(ROOT / "orchestrator")
    assert not found, f"{len(found)} uses of a base class's private names from another file:\n" + "\n".join(found)


def test_the_private_name_checker_finds_a_planted_crossing(tmp_path):
    top = tmp_path / "orchestrator"
    files = {
        "daemon/table.py": """
            class Table:
                _limit = 3
                def __init__(self):
                    self._rows = {}
                def _grow(self):
                    pass
                def size(self):
                    return len(self._rows)
            """,
        "daemon/again.py": "from .table import Table as Table\n",  # a re-export
        "daemon/commands.py": """
            from . import again
            from .table import Table

            class Commands(again.Table):  # line 5
                def __init__(self):
                    super().__init__()
                    self._own = 1
                def add(self, key):
                    self._rows[key] = self._own
                    self._grow()
                @classmethod
                def limit(cls):
                    return cls._limit

            class Near(Table):  # only the public API: fine
                def f(self):
                    return self.size()

            class Deeper(Commands):  # a base in this file, its base in another
                def g(self):
                    return self._own, self._rows
            """,
        "daemon/near.py": """
            class Base:
                def __init__(self):
                    self._x = 1

            class Sub(Base):  # the same file: one object in one file
                def f(self):
                    return self._x
            """,
    }
    _plant(top, files)
    assert _private_crossings(top) == [
        "daemon/commands.py:9: Commands uses self._rows, defined only by Table (daemon/table.py)",
        "daemon/commands.py:10: Commands uses self._grow, defined only by Table (daemon/table.py)",
        "daemon/commands.py:13: Commands uses self._limit, defined only by Table (daemon/table.py)",
        "daemon/commands.py:21: Deeper uses self._rows, defined only by Table (daemon/table.py)",
    ]


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
