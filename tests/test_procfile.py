"""``orchestrator import Procfile``: the Procfile's lines as pools (client/procfile.py), the
printed TOML as the config file reads it (daemon/config.py), bad lines refused with their
line number, and honcho's and foreman's own Procfiles (tests/data/procfiles) run unchanged by
``start --config``."""

from __future__ import annotations

import os
import socket
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import TESTS, cli, free_port_range, one_line_error, serves, wait_for
from orchestrator.client import procfile
from orchestrator.daemon import config

DATA = TESTS / "data" / "procfiles"


def _imported(path: Path, *args: str) -> str:
    proc = cli(path.parent / "no-state", "import", str(path), *args)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return proc.stdout


def _write(tmp_path: Path, text: str, name: str = "Procfile") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the lines --------------------------------------------------------------------------


def test_types_in_order_with_comments_blank_lines_and_crlf_skipped():
    text = "# the app\r\nweb: gunicorn app -b :$PORT\r\n\r\n   # indented comment\nworker:   celery worker  \n"
    got = procfile.parse(text)
    assert [(p.name, p.command, p.line) for p in got] == [
        ("web", "gunicorn app -b :$PORT", 2), ("worker", "celery worker", 5)]


@pytest.mark.parametrize("text, message", [
    ("web: ok\nthis is no entry\n", "Procfile:2: expected 'TYPE: COMMAND', got 'this is no entry'"),
    ("web: ok\n\nweb: again\n", "Procfile:3: web: a second entry for this process type (the first is on line 1)"),
    ("web:\n", "Procfile:1: web: no command after the ':'"),
    ("web:   \t\n", "Procfile:1: web: no command after the ':'"),
    ("w/eb: x\n", "Procfile:1: invalid pool name 'w/eb' (up to 64 letters, digits, '_', '.', '-')"),
    (f"{'a' * 65}: x\n", "Procfile:1: invalid pool name"),
    ("# only comments\n\n", "Procfile: no process types (lines of 'TYPE: COMMAND')"),
    ("web: a\0b\n", "Procfile:1: web: the command holds a NUL byte"),
])
def test_a_bad_line_is_one_error_with_its_line_number(text, message):
    with pytest.raises(procfile.ProcfileError) as info:
        procfile.parse(text)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_the_command_line_says_a_bad_line_in_one_line_and_exits_1(tmp_path):
    path = _write(tmp_path, "web: ok\nworker celery\n")
    proc = cli(tmp_path / "state", "import", str(path))
    assert one_line_error(proc) == f"orchestrator: {path}:2: expected 'TYPE: COMMAND', got 'worker celery'"
    assert proc.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["{dir}/missing/Procfile"], "missing/Procfile: cannot read the Procfile: No such file or directory"),
    (["{dir}/Procfile", "--env", "{dir}/nope.env"], "nope.env: cannot read the env file: No such file or directory"),
    (["{dir}/Procfile", "--port-base", "0"], "error: argument --port-base"),
])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path, args, message):
    _write(tmp_path, "web: ok\n")
    proc = cli(tmp_path / "state", "import", *[a.format(dir=tmp_path) for a in args])
    assert proc.returncode == (2 if "--port-base" in args else 1) and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_an_env_file_that_is_no_env_file_is_refused_before_anything_is_printed(tmp_path):
    _write(tmp_path, "web: ok\n")
    _write(tmp_path, "FOO=1\njust words\n", ".env")
    proc = cli(tmp_path / "state", "import", str(tmp_path / "Procfile"))
    assert one_line_error(proc).endswith(".env:2: expected KEY=VALUE") and proc.stdout == ""


# -- the config file it prints ------------------------------------------------------------


def test_the_printed_file_is_one_pool_a_type_on_foremans_ports(tmp_path):
    path = _write(tmp_path, "web: serve --port $PORT --also ${PORT} $PORTS $PORT_X \\$PORT\nworker: work\n"
                            "clock: tick\n")
    text = procfile.convert(str(path))
    cfg = config.parse(text, "<import>")
    assert list(cfg.pools) == ["web", "worker", "clock"]
    web = cfg.pools["web"]
    # $PORT and ${PORT} are the daemon's {port}; other names and an escaped one stay the shell's
    assert web.spec["command"] == ["/bin/sh", "-c", "serve --port {port} --also {port} $PORTS $PORT_X \\$PORT"]
    assert [p.policy["port_base"] for p in cfg.pools.values()] == [5000, 5100, 5200]
    assert {p.size for p in cfg.pools.values()} == {1}
    assert {p.cwd for p in cfg.pools.values()} == {str(tmp_path)}
    assert "env_file" not in text  # no --env and no .env beside it


def test_the_env_file_is_every_pools_env_file_and_its_port_the_base(tmp_path):
    path = _write(tmp_path, "web: a\nworker: b\n")
    _write(tmp_path, "PORT=8000\nFOO=bar\n", ".env")  # beside the Procfile: read as foreman reads it
    doc = tomllib.loads(procfile.convert(str(path)))
    assert [(t["env_file"], t["port_base"]) for t in doc["pools"].values()] == [
        (str(tmp_path / ".env"), 8000), (str(tmp_path / ".env"), 8100)]
    cfg = config.parse(procfile.convert(str(path)), str(tmp_path / "orchestrator.toml"))
    assert cfg.pools["web"].env == {"PORT": "8000", "FOO": "bar"}
    other = _write(tmp_path, "FOO=baz\n", "other.env")
    doc = tomllib.loads(procfile.convert(str(path), env=str(other), port_base=7000))
    assert [(t["env_file"], t["port_base"]) for t in doc["pools"].values()] == [
        (str(other), 7000), (str(other), 7100)]


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_a_port_in_the_env_file_that_is_no_port_is_refused(tmp_path, port):
    path = _write(tmp_path, "web: a\n")
    _write(tmp_path, f"PORT={port}\n", ".env")
    with pytest.raises(procfile.ProcfileError, match="PORT must be a port number"):
        procfile.convert(str(path))


def test_ports_past_65535_are_refused():
    procs = procfile.parse("a: x\nb: y\n")
    assert "port_base = 65435" in procfile.to_toml(procs, cwd="/", port_base=65335)
    with pytest.raises(procfile.ProcfileError, match="past 65535"):
        procfile.to_toml(procs, cwd="/", port_base=65500)


def test_any_text_is_a_toml_string_that_reads_back(tmp_path):
    command = 'printf "%s\\n" \'a\tb\' \\\\ \x7f \x01 é 😀 "quoted" #not a comment'
    procs = [procfile.Process("my.type", command, 1)]
    odd = tmp_path / 'dir "with" \\ quotes'
    doc = tomllib.loads(procfile.to_toml(procs, cwd=str(odd), env_file=str(odd / ".env")))
    table = doc["pools"]["my.type"]
    assert table["command"] == ["/bin/sh", "-c", command]
    assert table["cwd"] == str(odd) and table["env_file"] == str(odd / ".env")


def test_honchos_env_fixture_reads_as_its_environment():
    text = _imported(DATA / "honcho" / "Procfile.env")
    cfg = config.parse(text, str(DATA / "honcho" / "orchestrator.toml"))
    assert cfg.pools["animals"].env == {"TEST_ANIMAL": "giraffe"}
    assert cfg.pools["animals"].spec["command"] == ["/bin/sh", "-c", 'echo I like "${TEST_ANIMAL}s"']


# -- honcho's and foreman's Procfiles, run by the daemon ------------------------------------


def _by_pool(daemon, pool: str) -> list[dict]:
    return [r for r in daemon.status(all=True)["replicas"] if r["pool"] == pool]


def _logged(daemon, pool: str, text: str) -> bool:
    for rep in _by_pool(daemon, pool):
        if text in cli(daemon.state_dir, "logs", rep["id"], "--lines", "50").stdout:
            return True
    return False


def _run(tmp_path: Path, daemon, text: str, *start: str) -> None:
    path = tmp_path / "orchestrator.toml"
    path.write_text(text)
    daemon.start("--config", str(path), *start)


def test_honchos_ports_procfile_runs_on_honchos_ports(tmp_path, daemon):
    """honcho's test_ports: web.1 gets 5000, worker.1 5100, redis.1 5200, es.1 5300. Each
    echoes its $PORT and exits 0 (so, restart on-failure, ends there): no port is bound."""
    _run(tmp_path, daemon, _imported(DATA / "honcho" / "Procfile.ports"))
    for pool, port in (("web", 5000), ("worker", 5100), ("redis", 5200), ("es", 5300)):
        wait_for(lambda: _logged(daemon, pool, f"PORT={port}"), 30, f"{pool} to print PORT={port}")


def test_foremans_example_runs_with_its_env_and_serves_on_its_port(tmp_path, daemon, monkeypatch):
    """foreman's data/example: ``./ticker $PORT`` (gets its port as an argument, $FOO from the
    .env beside it, ignores SIGTERM: the stop's SIGKILL ends it) and a web type that must
    answer HTTP on its port."""
    base = _free_pair(100)
    # `python` of the Procfile is this interpreter, as it would be in the app's own venv
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    _run(tmp_path, daemon, _imported(DATA / "foreman" / "Procfile", "--port-base", str(base)), "--grace", "1")
    wait_for(lambda: serves(base + 100), 30, f"web to serve on {base + 100}")
    wait_for(lambda: _logged(daemon, "ticker", f"tick: {base} -- FOO:bar"), 30, "the ticker's tick")


def _free_pair(step: int) -> int:
    """A port that is free, and free ``step`` ports above it too, right now."""
    for _ in range(100):
        base = free_port_range(1)
        if base + step < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", base + step))
                except OSError:
                    continue
            return base
    raise RuntimeError("no two free ports")
