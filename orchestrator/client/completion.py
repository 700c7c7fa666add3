"""``orchestrator completion bash|zsh``: a shell completion script, generated from the CLI's
argparse parser each time it is asked for, so every verb and flag any module adds to the
parser is in it with no list kept here. shtab (the ``completion`` extra) writes the script;
it is imported by this command alone, so no other command's start-up pays for it.

What a word completes to is read off the parser, not from a list of verbs:

- a verb, a flag, a flag's ``choices``: shtab, from the parser itself;
- pool names for an argument whose dest is ``pool`` or ``pools`` (``--pool``, ``scale POOL``)
  or whose metavar is ``POOL``; replica ids for a metavar ``ID`` or a dest ``replica``
  (``terminate ID...``, ``events --replica``): names asked of the running daemon, each time
  the user presses TAB, by the hidden ``orchestrator __complete pools|replicas [--state-dir
  DIR]`` (not in the parser: nothing lists it), with the ``--state-dir DIR`` of the line being
  completed (bash splits ``--state-dir=DIR`` at the ``=``, which shtab's script does not
  follow: there, names need the form with a space);
- file names for a metavar that ends in ``FILE`` (``FILE``, ``PROCFILE``), directories for ``DIR``.

A new verb's arguments complete as these conventions say, without an edit here.

``__complete`` prints one name a line, and nothing at all when no daemon runs, the state dir
cannot be read or the daemon does not answer: a TAB never prints an error into the user's
command line, and never hangs it. Its call to the daemon is bounded by ``NAMES_TIMEOUT``;
half a second later a real-time timer, whose default action ends the process, ends it
whatever it still waits on (a connect or a handshake the channel bounds more loosely).
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Sequence

from ..errors import OrchestratorError

__all__ = ["INSTALL", "NAMES_TIMEOUT", "SHELLS", "kind_of", "names", "script", "main_names"]

SHELLS = ("bash", "zsh")
NAMES_TIMEOUT = 1.0  # seconds a TAB may wait for the daemon's names
INSTALL = "completion scripts need the completion extra (shtab): pip install 'orchestrator[completion]'"

# The shell functions the generated script calls for names. Each runs the command being
# completed (its first word: a venv's bin/orchestrator works unactivated) with the state dir
# given on the line, if any.
_BASH = r'''
_orchestrator_names() {
  local i cmd="${COMP_WORDS[0]/#\~/$HOME}" dir=()
  for ((i = 1; i < COMP_CWORD; i++)); do
    [[ ${COMP_WORDS[i]} == --state-dir ]] && dir=(--state-dir "${COMP_WORDS[i+1]}")
  done
  "$cmd" __complete "$1" "${dir[@]}" 2>/dev/null
}
_orchestrator_pools() { compgen -W "$(_orchestrator_names pools)" -- "$1"; }
_orchestrator_replicas() { compgen -W "$(_orchestrator_names replicas)" -- "$1"; }
'''
_ZSH = r'''
_orchestrator_names() {
  # the line as typed ($words is the verb's own by now: _arguments shifts it)
  local i
  local -a line dir
  line=(${(z)LBUFFER})
  for ((i = 2; i <= $#line; i++)); do
    [[ $line[i] == --state-dir ]] && dir=(--state-dir ${(Q)line[i+1]})
    [[ $line[i] == --state-dir=* ]] && dir=(--state-dir ${(Q)line[i]#--state-dir=})
  done
  ${~${(Q)line[1]}} __complete $1 $dir 2>/dev/null
}
_orchestrator_pools() { local -a names; names=(${(f)"$(_orchestrator_names pools)"}); compadd -a names }
_orchestrator_replicas() { local -a names; names=(${(f)"$(_orchestrator_names replicas)"}); compadd -a names }
'''
_NAMES = {"pools": {"bash": "_orchestrator_pools", "zsh": "_orchestrator_pools"},
          "replicas": {"bash": "_orchestrator_replicas", "zsh": "_orchestrator_replicas"}}


def kind_of(action: argparse.Action) -> str | None:
    """What an argument's values are, by the conventions of the module docstring: "pools",
    "replicas", "file", "dir" or None (nothing to offer but what the parser says)."""
    meta = action.metavar if isinstance(action.metavar, str) else None
    if action.dest in ("pool", "pools") or meta == "POOL":
        return "pools"
    if meta == "ID" or action.dest == "replica":
        return "replicas"
    if meta is not None and meta.endswith("FILE"):
        return "file"
    if meta == "DIR":
        return "dir"
    return None


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    # argparse keeps a command's parsers in its subparsers action's choices, public in use
    # (shtab reads them the same way) if not in name.
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias maps to its parser again
                found += [sub, *_subparsers(sub)]
    return found


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for ``shell`` (one of SHELLS) of ``parser``'s command line."""
    try:
        import shtab
    except ImportError:
        raise OrchestratorError(INSTALL) from None
    files = {"file": shtab.FILE, "dir": shtab.DIRECTORY}
    for sub in [parser, *_subparsers(parser)]:
        for action in sub._actions:
            kind = kind_of(action)
            if kind is not None:
                # shtab reads this attribute off the action (its documented way to name one)
                action.complete = _NAMES.get(kind) or files[kind]  # type: ignore[attr-defined]
    text: str = shtab.complete(parser, shell=shell, preamble={"bash": _BASH, "zsh": _ZSH}[shell])
    return text if text.endswith("\n") else text + "\n"


def names(kind: str, state_dir: Path) -> list[str]:
    """The pools' names or the replicas' ids of the daemon of ``state_dir``, [] if none runs.
    OrchestratorError or OSError where it cannot say."""
    from ..paths import Paths, running_pid
    from .channel import Client

    if running_pid(Paths(state_dir)) is None:
        return []
    with Client(state_dir, timeout=NAMES_TIMEOUT) as client:
        data = client.status()
    if kind == "pools":
        return [str(p["name"]) for p in data.get("pools", ())]
    return [str(r["id"]) for r in data.get("replicas", ())]


def main_names(argv: Sequence[str]) -> int:
    """``orchestrator __complete pools|replicas [--state-dir DIR]``: exit 0 and one name a
    line, or nothing; never a word on stderr (the shell's line is the user's)."""
    from ..paths import default_state_dir

    # A real-time timer whose default action ends this process: a daemon that accepts the
    # connection and never answers cannot hold the user's TAB past the bound.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, NAMES_TIMEOUT + 0.5)
    args: list[str] = list(argv)
    state_dir: Path | None = None
    if len(args) == 3 and args[1] == "--state-dir":
        state_dir = Path(args[2])
        del args[1:]
    if len(args) != 1 or args[0] not in ("pools", "replicas"):
        return 2
    try:
        found = names(args[0], state_dir or default_state_dir())
    except (OrchestratorError, OSError, KeyError, TypeError):
        return 0
    for name in found:
        print(name)
    return 0
