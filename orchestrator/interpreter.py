"""How the project starts a Python program of its own (the daemon, its manager, spawners,
the upgrade's check): never from a directory it did not choose.

``python -m X`` puts the current directory first on ``sys.path`` and ``python -c`` puts
``''`` (the current directory, whatever it is later) there: root running ``orchestrator
start`` in a directory another user can write, holding an ``orchestrator/`` (or
``multiprocess/``, ``dill/``...) of theirs, would run their code as root. So every such
interpreter is started with ``-P`` (3.11+, ``PYTHONSAFEPATH``): its ``sys.path`` is the
standard library, site-packages and ``PYTHONPATH``, which the operator chose. Not ``-I``:
that would drop ``PYTHONPATH`` and the user site too, which users install into.

What is left of the caller's directory is ``PYTHONPATH`` itself: a relative entry means
"relative to where I typed the command", so :func:`program_env` makes it absolute before
the daemon leaves that directory; an empty entry (``PYTHONPATH=$PYTHONPATH:/x`` with none
set before), which Python reads as the current directory, is dropped.

A pool's replicas are another matter: they import from the PYTHONPATH and cwd the client
recorded for the pool (targets.py), the pool's own choice.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# The directory holding this `orchestrator` package (site-packages, or a source checkout).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAFE_PATH = "-P"  # never the script's or the current directory on sys.path


def python_argv(*args: str) -> list[str]:
    """``[python, -P, *args]``: this interpreter, on the standard path only."""
    return [sys.executable, SAFE_PATH, *args]


def bootstrap_argv(module: str, function: str = "main") -> list[str]:
    """``python -P -c "from MODULE import FUNCTION; FUNCTION()"``, for a child that must run
    this very install: ``PACKAGE_ROOT`` is appended to its path if nothing else there
    provides it (an embedding program run from a checkout finds us through its script's
    directory, which the child no longer gets)."""
    code = (f"import sys; r = {PACKAGE_ROOT!r}; r in sys.path or sys.path.append(r); "
            f"from {module} import {function}; {function}()")
    return python_argv("-c", code)


def absolute_pythonpath(value: str, base: str) -> str:
    """``value`` with each entry as the interpreter started in ``base`` would read it, made
    absolute; empty entries (the current directory, whatever it is) are dropped."""
    return os.pathsep.join(os.path.normpath(os.path.join(base, p)) for p in value.split(os.pathsep) if p)


def _root_came_from_cwd() -> bool:
    """Whether this process imports us only thanks to the first sys.path entry that ``-m``
    or ``-c`` add (``python -m orchestrator`` typed in a source checkout): that was the
    caller's own choice, which ``-P`` would take from the daemon."""
    if sys.flags.safe_path or not sys.path:
        return False
    first = os.path.abspath(sys.path[0] or os.curdir)
    return first == PACKAGE_ROOT and PACKAGE_ROOT not in (os.path.abspath(p) for p in sys.path[1:] if p)


def program_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` for a program of ours that runs elsewhere than the current
    directory: PYTHONPATH made absolute against it (see the module doc), with
    ``PACKAGE_ROOT`` added if only the current directory made us importable."""
    out = dict(env)
    value = out.get("PYTHONPATH", "")
    try:
        entries = absolute_pythonpath(value, os.getcwd())
    except OSError:  # our directory was removed: what was relative to it is nowhere now
        entries = os.pathsep.join(p for p in value.split(os.pathsep) if os.path.isabs(p))
    if _root_came_from_cwd():
        entries = os.pathsep.join(filter(None, [entries, PACKAGE_ROOT]))
    if entries:
        out["PYTHONPATH"] = entries
    else:
        out.pop("PYTHONPATH", None)
    return out


__all__ = ["PACKAGE_ROOT", "SAFE_PATH", "absolute_pythonpath", "bootstrap_argv", "program_env", "python_argv"]
