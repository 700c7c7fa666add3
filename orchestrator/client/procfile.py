"""``orchestrator import Procfile [--env FILE]``: a Procfile (foreman's, honcho's, Heroku's
format) as the TOML config file that ``start --config`` runs. Client side: it reads two of
the user's files with the user's own rights and prints text; nothing is started.

    web: gunicorn app:wsgi -b 127.0.0.1:$PORT      [pools.web]
    worker: celery -A app worker              ->    command = ["/bin/sh", "-c", "gunicorn ... 127.0.0.1:{port}"]
                                                    size = 1
                                                    port_base = 5000
                                                    cwd = "/srv/app"
                                                    env_file = "/srv/app/.env"
                                                    [pools.worker] ... port_base = 5100

What makes it equivalent, process type by process type, as foreman and honcho run them:

- one pool per process type, in the file's order, of size 1 (foreman's default formation);
- the command is a shell command line, so it runs under ``/bin/sh -c`` as theirs does;
- ports: the first type's base is 5000 (``--port-base N``, or ``PORT`` in the env file, as
  both tools take it), each next type's 100 more; a replica in slot s gets base + s, so web's
  first replica has foreman's web.1 port. ``$PORT`` and ``${PORT}`` in a command become
  ``{port}`` (the daemon fills it in; a command sees ``$PORT`` in its environment too, so
  ``${PORT:-80}`` and the like still work);
- the env file (``--env``, else ``.env`` beside the Procfile if there is one, as both tools
  read it) is the pools' ``env_file``; the Procfile's directory is their ``cwd`` (foreman's
  application root). Both are absolute paths: the printed file may be saved anywhere.

A line is ``TYPE: COMMAND``; blank lines and ``#`` comments are skipped. Where foreman
skips any other line in silence, this refuses it with one line that names the file and the
line (``Procfile:3: expected 'TYPE: COMMAND'``): a typo would otherwise drop a process.
The same goes for a type named twice, an empty command, a type that is no pool name.
What is left as it is: a ``{slot}`` or ``{port}`` already in a command is filled in by the
daemon as well.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import OrchestratorError
from ..paths import CONFIG_MAX_BYTES, read_env_file, read_operator_file
from ..protocol import pool_name

__all__ = ["DEFAULT_PORT_BASE", "PORT_STEP", "Process", "ProcfileError", "parse", "to_toml", "convert"]

DEFAULT_PORT_BASE = 5000  # foreman's and honcho's
PORT_STEP = 100  # between two process types' bases, theirs too
SHELL = "/bin/sh"  # what foreman (Ruby's spawn of a string) and honcho (shell=True) run a line with

_LINE = re.compile(r"\s*([^:\s]+)\s*:(.*)")
_PORT = re.compile(r"(?<!\\)\$(?:PORT\b|\{PORT\})")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class ProcfileError(OrchestratorError):
    """A Procfile line that cannot be a process type, in one line: ``FILE:LINE: what``."""


@dataclass(frozen=True)
class Process:
    """One ``TYPE: COMMAND`` line of a Procfile."""

    name: str
    command: str
    line: int


def parse(text: str, source: str = "Procfile") -> list[Process]:
    """The process types of a Procfile's text, in its order; ProcfileError for a bad line."""
    found: dict[str, Process] = {}
    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        line = raw.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise ProcfileError(f"{source}:{number}: expected 'TYPE: COMMAND', got {line.strip()!r}")
        name, command = m.group(1), m.group(2).strip()
        try:
            pool_name(name)
        except OrchestratorError as err:
            raise ProcfileError(f"{source}:{number}: {err}") from None
        if not command:
            raise ProcfileError(f"{source}:{number}: {name}: no command after the ':'")
        if "\0" in command:
            raise ProcfileError(f"{source}:{number}: {name}: the command holds a NUL byte")
        if name in found:
            raise ProcfileError(f"{source}:{number}: {name}: a second entry for this process type "
                                f"(the first is on line {found[name].line})")
        found[name] = Process(name, command, number)
    if not found:
        raise ProcfileError(f"{source}: no process types (lines of 'TYPE: COMMAND')")
    return list(found.values())


def to_toml(processes: list[Process], *, cwd: str, env_file: str | None = None,
            port_base: int = DEFAULT_PORT_BASE, source: str = "Procfile") -> str:
    """The config file's text: a ``[pools.TYPE]`` table a process type, as the module
    docstring says."""
    last = port_base + PORT_STEP * (len(processes) - 1)
    if last > 65535:
        raise ProcfileError(f"{source}: port base {port_base} with {len(processes)} process types: "
                            f"the last would start at port {last}, past 65535")
    out = [f"# From {source} by `orchestrator import`: a pool a process type, as foreman runs them",
           f"# (PORT {port_base}, {PORT_STEP} more a type; slot s of a pool gets port_base + s).",
           "# Run it with: orchestrator start --config FILE"]
    for i, proc in enumerate(processes):
        key = proc.name if _BARE_KEY.fullmatch(proc.name) else _string(proc.name)
        command = _PORT.sub("{port}", proc.command)
        out += ["", f"[pools.{key}]",
                f"command = [{_string(SHELL)}, \"-c\", {_string(command)}]",
                "size = 1",
                f"port_base = {port_base + PORT_STEP * i}",
                f"cwd = {_string(cwd)}"]
        if env_file is not None:
            out.append(f"env_file = {_string(env_file)}")
    return "\n".join(out) + "\n"


def convert(procfile: str, env: str | None = None, port_base: int | None = None) -> str:
    """Read the Procfile at ``procfile`` (and the env file: ``env``, else ``.env`` beside
    it if one is there) and give the config file's text. One-line errors: ProcfileError for
    the Procfile, OrchestratorError for a file that cannot be read."""
    path = os.path.abspath(procfile)
    try:
        text = read_operator_file(path, "Procfile", CONFIG_MAX_BYTES, trusted=False).decode("utf-8")
    except UnicodeDecodeError:
        raise ProcfileError(f"{procfile}: not UTF-8 text") from None
    processes = parse(text, procfile)
    root = os.path.dirname(path)
    env_path = os.path.abspath(env) if env is not None else os.path.join(root, ".env")
    variables: dict[str, str] = {}
    if env is not None or os.path.exists(env_path):
        # Read now, with the caller's rights: a file that cannot work is this command's error,
        # not the daemon's at start (which reads it again, under the daemon's trust rules).
        variables = read_env_file(env_path, trusted=False)
    else:
        env_path = ""
    if port_base is None:
        port_base = _env_port(variables.get("PORT"), env_path) if "PORT" in variables else DEFAULT_PORT_BASE
    return to_toml(processes, cwd=root, env_file=env_path or None, port_base=port_base, source=procfile)


def _env_port(text: str | None, env_path: str) -> int:
    try:
        port = int(text or "")
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ProcfileError(f"{env_path}: PORT must be a port number (1..65535), got {text!r}")
    return port


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\t":
            out.append(ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)

