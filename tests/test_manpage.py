"""orchestrator(1): docs/orchestrator.1 is the page client/manpage.py makes from the parser
now (as docs/openapi.json is the routes'), it names every verb and every flag the parser
has, it renders without a warning, and the package installs it where man looks."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tomllib

import pytest

from helpers import ROOT
from orchestrator.client import cli, manpage

PAGE = ROOT / "docs" / "orchestrator.1"
REMAKE = ".venv/bin/python -m orchestrator.client.manpage > docs/orchestrator.1"


def test_the_committed_page_is_the_parsers():
    assert PAGE.read_text() == manpage.render(cli.parser()), f"out of date with the parser: {REMAKE}"


def test_the_page_names_every_verb_and_flag():
    page = PAGE.read_text()
    (sub,) = [a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)]
    sections = {part.split('"', 1)[0]: part for part in page.split('.SS "')[1:]}
    options = page.split(".SH OPTIONS", 1)[1].split(".SH COMMANDS", 1)[0]
    for verb, parser in sub.choices.items():
        assert verb.replace("-", "\\-") in sections, verb
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                told = "\\fB" + flag.replace("-", "\\-") + "\\fR"
                assert told in sections[verb.replace("-", "\\-")] or (flag == "--state-dir" and told in options), (verb, flag)
    assert "ready\\-fd" not in page  # a hidden flag stays hidden


def _render(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MANPAGER": "cat", "PAGER": "cat"})


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_groff_renders_it_without_a_warning():
    proc = _render("groff", "-ww", "-z", "-man", str(PAGE))
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
def test_man_renders_it_without_a_warning():
    proc = _render("man", "--warnings", "-l", str(PAGE))
    assert (proc.returncode, proc.stderr) == (0, "")
    text = proc.stdout
    assert "orchestrator - keep pools of worker processes alive" in text
    for heading in ("SYNOPSIS", "OPTIONS", "COMMANDS", "EXIT STATUS", "ENVIRONMENT"):
        assert f"\n{heading}\n" in text, heading
    assert "orchestrator import [-h] [--env FILE] [--port-base N] PROCFILE" in text


def test_text_that_roff_would_read_as_requests_is_escaped():
    p = argparse.ArgumentParser(prog="x", description="What it does.")
    p.add_argument("--a", help=".starts with a dot, \\ a backslash and 50%% of it")
    p.add_argument("--b", help="'a quote first")
    page = manpage.render(p).splitlines()
    assert "\\&.starts with a dot, \\e a backslash and 50% of it" in page and "\\&'a quote first" in page


def test_the_package_installs_it_under_share_man():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["tool"]["setuptools"]["data-files"]["share/man/man1"] == ["docs/orchestrator.1"]
