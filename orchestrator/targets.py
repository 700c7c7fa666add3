"""A ``--target MODULE:FUNCTION``: resolved in the worker, never in the daemon.

The daemon records the target with the launching caller's PYTHONPATH; the forked worker
puts that and its own cwd in front of ``sys.path`` and imports the module, so a slow,
thread-starting or broken import costs that replica alone (a broken one is its FAILED
"could not start: ..."), and editing the module changes what the next replica runs.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import InvalidSpec


@dataclass(frozen=True)
class TargetRef:
    """A ``module:function`` that the worker imports itself (childsetup.run_child), from
    ``pythonpath`` and its cwd first: the daemon never imports or runs user code."""

    target: str
    pythonpath: tuple[str, ...] = ()


def load_target(ref: TargetRef, cwd: str | None) -> Callable[[], Any]:
    """Runs in the worker: its sys.path gets the caller's PYTHONPATH and the replica's cwd
    in front, then the target is imported (InvalidSpec, one line, if it cannot be)."""
    import sys

    sys.path[:0] = [p for p in (*ref.pythonpath, cwd or os.getcwd()) if p not in sys.path]
    return resolve_target(ref.target)


def load_preload(modules: tuple[str, ...], pythonpath: tuple[str, ...], cwd: str | None) -> None:
    """Import a pool's ``preload`` modules (in its spawner, once; or in a worker forked
    without one), from the caller's PYTHONPATH and the pool's cwd first, like a target."""
    import sys

    sys.path[:0] = [p for p in (*pythonpath, cwd or os.getcwd()) if p not in sys.path]
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise InvalidSpec(f"cannot import preload module {name!r}: {err}") from None
        except (Exception, SystemExit) as err:
            raise InvalidSpec(f"cannot import preload module {name!r}: {type(err).__name__}: {err}") from None


def resolve_target(target: str) -> Callable[[], Any]:
    """Import ``module:function`` here (in a worker: see load_target); a bad target is an
    InvalidSpec with one line that says why."""
    mod_name, _, attr = target.partition(":")
    # The boundary to user code: whatever its import raises (SyntaxError, SystemExit, a
    # RuntimeError of its own) is a bad target for this launch, not a crash of the loop.
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise InvalidSpec(f"cannot import module {mod_name!r}: {err}") from None
    except (Exception, SystemExit) as err:
        raise InvalidSpec(f"cannot import module {mod_name!r}: {type(err).__name__}: {err}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidSpec(f"module {mod_name!r} has no attribute {attr!r}") from None
        except (Exception, SystemExit) as err:  # a module __getattr__ of the user's
            raise InvalidSpec(f"{target}: {type(err).__name__}: {err}") from None
    if not callable(obj):
        raise InvalidSpec(f"{target} is not callable")
    found: Callable[[], Any] = obj  # callable, as checked: what it takes is its own affair
    return found
