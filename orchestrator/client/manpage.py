"""The manual page ``orchestrator(1)``, in roff, generated from the CLI's argparse parser: the
synopsis, the global options, then each verb with its usage line, its description and each of
its arguments with its help, in the parser's order, so a verb or flag added to the parser is
in the page once it is made again. What the parser cannot say (exit status, environment,
files) is written here.

``docs/orchestrator.1`` is this page, committed, and installed with the package as
``share/man/man1/orchestrator.1`` under the environment's prefix (a venv's own, where ``man``
finds it through ``PATH``: ``man orchestrator`` with the venv's ``bin`` on ``PATH``; else
``man -l docs/orchestrator.1``). tests/test_manpage.py checks that the committed page is
this one and that it renders without a warning. Made again with::

    .venv/bin/python -m orchestrator.client.manpage > docs/orchestrator.1
"""

from __future__ import annotations

import argparse
import re
import sys

__all__ = ["render"]

# One line each, the CLI module's exit codes (cli.py's docstring has their why).
_EXIT_STATUS = (
    ("0", "success."),
    ("1", "an error, told in one line on standard error."),
    ("2", "a usage error: argparse's, or two things where one is wanted, none where one is needed."),
    ("3", "the daemon is not running, for the commands that need it (and for status and stop)."),
)
_ENVIRONMENT = (
    ("ORCHESTRATOR_STATE_DIR", "the state dir when --state-dir is not given."),
    ("XDG_STATE_HOME", "else the state dir is $XDG_STATE_HOME/orchestrator, else ~/.local/state/orchestrator."),
)
_FILES = (
    ("STATE_DIR/state.db", "the journal: pools, replicas, tasks and events (SQLite)."),
    ("STATE_DIR/logs/", "each replica's captured stdout and stderr (ID.out, ID.err), rotated by size; "
                        "the daemon's own daemon.log."),
)


def _text(s: str) -> str:
    """Prose for roff: backslashes escaped, a line never starting with a control character."""
    s = s.replace("\\", "\\e")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in s.splitlines())


def _literal(s: str) -> str:
    """A name the user types (a flag, a verb, a usage line): hyphens as roff's minus."""
    return _text(s).replace("-", "\\-")


def _bold(s: str) -> str:
    return f"\\fB{_literal(s)}\\fR"


def _italic(s: str) -> str:
    return f"\\fI{_literal(s)}\\fR"


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        return action.metavar
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper() if action.option_strings else action.dest


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(prog)s, %%
        params = {**vars(action), "prog": prog}
        if action.choices is not None:
            params["choices"] = ", ".join(map(str, action.choices))
        try:
            text = text % params
        except (KeyError, ValueError, TypeError):
            pass
    if action.choices is not None and action.option_strings == [] and not text:
        text = "one of " + ", ".join(map(str, action.choices))
    return " ".join(text.split())


def _item(action: argparse.Action, prog: str) -> list[str]:
    """A ``.TP`` paragraph: the argument as typed, then its help."""
    if action.option_strings:
        names = ", ".join(_bold(o) for o in action.option_strings)
        label = names if action.nargs == 0 else f"{names} {_italic(_metavar(action))}"
    else:
        label = _italic(_metavar(action))
    text = _help(action, prog)
    return [".TP", label, _text(text) if text else "\\&"]  # \& : an empty body, not none


def _usage(parser: argparse.ArgumentParser) -> str:
    # A width no line reaches: one line, filled by man to the reader's terminal.
    fmt = argparse.HelpFormatter(parser.prog, width=1 << 16)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return " ".join(fmt.format_help().split())


def _shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and not isinstance(
        action, (argparse._HelpAction, argparse._SubParsersAction))


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(verb, its one-line help, its parser), in the order the parser has them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def render(parser: argparse.ArgumentParser) -> str:
    """The page, for ``parser``'s command line."""
    prog = parser.prog
    title = re.sub(r"\s+", " ", parser.description or "").strip().rstrip(".")
    lines = [
        '.\\" Generated from the argparse parser: do not edit; python -m orchestrator.client.manpage',
        f'.TH {prog.upper()} 1 "" "{prog}" "User Commands"',
        ".nh", ".ad l",  # usage lines and flags are typed: never hyphenated, never stretched
        ".SH NAME",
        f"{_literal(prog)} \\- {_text(title[:1].lower() + title[1:])}",
        ".SH SYNOPSIS",
        _literal(_usage(parser)),
        ".SH DESCRIPTION",
        _text(f"{parser.description or ''} Each command is one of the verbs below; "
              f"{prog} COMMAND --help tells the same as its part of this page."),
        ".SH OPTIONS",
    ]
    shared = set()
    for action in parser._actions:
        if _shown(action):
            lines += _item(action, prog)
            shared.add(action.dest)
    lines.append(".SH COMMANDS")
    for name, summary, sub in _commands(parser):
        lines += [f'.SS "{_literal(name)}"', _literal(_usage(sub)), ".PP"]
        about = sub.description or summary
        lines.append(_text(" ".join(about.split()) + ("" if about.endswith(".") else ".")))
        for group in sub._action_groups:
            # a flag every verb takes (--state-dir) is told once, under OPTIONS
            actions = [a for a in group._group_actions if _shown(a) and a.dest not in shared]
            if not actions:
                continue
            if group.title not in ("positional arguments", "options", "optional arguments"):
                lines += [".PP", f"\\fI{_text(group.title or '')}\\fR:"]
            for action in actions:
                lines += _item(action, sub.prog)
    lines.append(".SH EXIT STATUS")
    for code, meaning in _EXIT_STATUS:
        lines += [".TP", _bold(code), _text(meaning)]
    lines.append(".SH ENVIRONMENT")
    for name, meaning in _ENVIRONMENT:
        lines += [".TP", _bold(name), _literal(meaning)]
    lines.append(".SH FILES")
    for name, meaning in _FILES:
        lines += [".TP", _italic(name), _text(meaning)]
    lines += [".SH SEE ALSO", _text("The README of the orchestrator package: the contract, the config "
                                    "file's keys, the HTTP API and the limits worth knowing.")]
    return "\n".join(lines) + "\n"


def main() -> int:
    from .cli import parser

    sys.stdout.write(render(parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
