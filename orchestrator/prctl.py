"""``prctl(2)``, the two options the house sets, for every process that sets one: a forked
replica and the spawner and manager processes (``PR_SET_PDEATHSIG``: never outlive their
parent), the daemon and a task worker (``PR_SET_CHILD_SUBREAPER``: a descendant that
daemonizes is re-parented to them, not to PID 1, and stays theirs to end).

Standard library only, and light: the manager and a task worker import it without the
replica's set-up (``spawn/childsetup.py``). The symbol is resolved at import: a process
that forks imports this module first, so that no forked child pays for the lookup itself.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_prctl = ctypes.CDLL(None, use_errno=True).prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def prctl(option: int, arg: int) -> None:
    """``prctl(option, arg, 0, 0, 0)``; OSError if refused."""
    if _prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_pdeathsig(sig: int) -> None:
    """``sig`` to this process when its parent dies."""
    prctl(PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper() -> None:
    """Orphaned descendants are re-parented to this process, which reaps them (PID 1 may not)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


__all__ = ["PR_SET_CHILD_SUBREAPER", "PR_SET_PDEATHSIG", "prctl", "set_child_subreaper", "set_pdeathsig"]
