"""``orchestrator completion bash|zsh``: the scripts are made from the parser, so what they
offer is checked against the parser itself (every verb, every verb's flags), by sourcing the
script in a real bash and calling its completion function as bash would (COMP_WORDS,
COMP_CWORD); names come from the running daemon, and from none: nothing, silently."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli, cli_env, wait_for
from orchestrator.client import cli as cli_module
from orchestrator.client import completion

pytest.importorskip("shtab", reason="the completion extra (shtab) is not installed")

ORCHESTRATOR = str(Path(sys.executable).parent / "orchestrator")  # what a user's TAB runs


def _verbs() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli_module.parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings if o.startswith("--")}


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "orchestrator.bash"
    proc = cli(path.parent / "state", "completion", "bash")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    path.write_text(proc.stdout)
    return path


def _complete(script: Path, *lines: list[str]) -> list[list[str]]:
    """What bash offers for each command line (its last word the one being completed), from
    one bash that sourced ``script`` and calls the function it registered for orchestrator."""
    body = [f"source {shlex.quote(str(script))}",
            "fn=$(complete -p orchestrator | sed -E 's/.* -F ([^ ]+) .*/\\1/')",
            'comp() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}; '
            'COMPREPLY=(); "$fn" "$1" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"; '
            'printf "%s\\n" "${COMPREPLY[@]}"; echo "--end--"; }']
    body += ["comp " + " ".join(shlex.quote(w) for w in words) for words in lines]
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", "\n".join(body)], capture_output=True, text=True,
                          timeout=60, env=cli_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    replies = proc.stdout.split("--end--\n")
    assert replies[-1] == "" and len(replies) == len(lines) + 1, proc.stdout
    return [[w for w in r.splitlines() if w] for r in replies[:-1]]


def test_bash_offers_every_verb_of_the_parser(bash_script):
    verbs = _verbs()
    assert {"import", "completion", "start", "logs", "submit"} <= set(verbs)  # each module's verbs
    lines = [["orchestrator", ""]] + [["orchestrator", v[:3]] for v in verbs] + [["orchestrator", v] for v in verbs]
    first, *rest = _complete(bash_script, *lines)
    assert sorted(first) == sorted(verbs)
    for verb, offered in zip([*verbs, *verbs], rest):
        assert verb in offered and all(o.startswith(verb[:3]) for o in offered), (verb, offered)
    assert "__complete" not in first  # the hidden first word is no verb


def test_bash_offers_each_verbs_flags_as_the_parser_has_them(bash_script):
    verbs = _verbs()
    got = _complete(bash_script, *[["orchestrator", v, "--"] for v in verbs])
    for (verb, parser), offered in zip(verbs.items(), got):
        assert set(offered) == _long_flags(parser), verb
    assert "--ready-fd" not in _long_flags(verbs["start"])  # a hidden flag is not offered


def test_bash_completes_one_flag_its_choices_and_the_shell_of_completion(bash_script):
    flag, choices, shells, after_flag = _complete(
        bash_script, ["orchestrator", "launch", "--po"], ["orchestrator", "launch", "--restart", ""],
        ["orchestrator", "completion", ""], ["orchestrator", "--state-dir", "/x", "scale", "--js"])
    assert sorted(flag) == ["--pool", "--port-base"]
    assert sorted(choices) == ["always", "never", "on-failure"]
    assert sorted(shells) == sorted(completion.SHELLS) == sorted(cli_module._SHELLS)
    assert after_flag == ["--json"]


def test_bash_completes_a_procfile_as_a_file(bash_script, tmp_path):
    (tmp_path / "Procfile").write_text("web: x\n")
    (offered,) = _complete(bash_script, ["orchestrator", "import", str(tmp_path / "Proc")])
    assert offered == [str(tmp_path / "Procfile")]


def test_names_come_from_the_running_daemon(bash_script, daemon):
    daemon.start()
    for pool in ("web", "worker"):
        assert cli(daemon.state_dir, "launch", "--pool", pool, "--count", "2", "--", "sleep", "300").returncode == 0
    ids = sorted(r["id"] for r in daemon.status()["replicas"])
    assert len(ids) == 4
    line = [ORCHESTRATOR, "--state-dir", str(daemon.state_dir)]
    pools, pools_w, replicas, flag_pool, logs_ids = _complete(
        bash_script, [*line, "scale", ""], [*line, "delete", "w"], [*line, "terminate", ""],
        [*line, "restart", "--pool", ""], [*line, "logs", "web"])
    assert sorted(pools) == ["web", "worker"] and sorted(pools_w) == ["web", "worker"]
    assert sorted(replicas) == ids and sorted(flag_pool) == ["web", "worker"]
    assert sorted(logs_ids) == [i for i in ids if i.startswith("web")]
    # The state dir of the line is the one asked, after the verb too
    after, other = _complete(bash_script, [ORCHESTRATOR, "scale", "--state-dir", str(daemon.state_dir), ""],
                             [ORCHESTRATOR, "--state-dir", str(daemon.state_dir.parent / "none"), "scale", ""])
    assert (sorted(after), other) == (["web", "worker"], [])


def test_no_daemon_no_names_and_no_word_on_stderr(tmp_path):
    for kind in ("pools", "replicas"):
        proc = subprocess.run([ORCHESTRATOR, "__complete", kind, "--state-dir", str(tmp_path / "none")],
                              capture_output=True, text=True, timeout=60, env=cli_env())
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    proc = subprocess.run([ORCHESTRATOR, "__complete", "nonsense"], capture_output=True, text=True, timeout=60,
                          env=cli_env())
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "")


def test_what_an_argument_completes_to_is_read_off_the_parser():
    p = argparse.ArgumentParser()
    acts = {a.dest: a for a in (
        p.add_argument("--pool"), p.add_argument("pools", nargs="*"), p.add_argument("--other", metavar="POOL"),
        p.add_argument("ids", nargs="*", metavar="ID"), p.add_argument("--replica"),
        p.add_argument("task", metavar="TASK"), p.add_argument("--config", metavar="FILE"),
        p.add_argument("procfile", metavar="PROCFILE"), p.add_argument("--cwd", metavar="DIR"),
        p.add_argument("--count", type=int))}
    assert {d: completion.kind_of(a) for d, a in acts.items()} == {
        "pool": "pools", "pools": "pools", "other": "pools", "ids": "replicas", "replica": "replicas",
        "task": None, "config": "file", "procfile": "file", "cwd": "dir", "count": None}


def test_no_other_command_loads_the_completion_or_its_library():
    code = ("import sys, orchestrator.client.cli\n"
            "print(sorted(m for m in sys.modules if m.startswith(('shtab', 'orchestrator.client.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env=cli_env()).stdout
    for lazy in ("shtab", "orchestrator.client.completion", "orchestrator.client.manpage",
                 "orchestrator.client.procfile"):
        assert f"'{lazy}'" not in out, out


def _zsh(script: Path, *steps: tuple[str, str]) -> list[str]:
    """What zsh lists in a terminal (zsh/zpty: zsh completes only in its line editor) for
    each step's keys once the output matches its zsh pattern: the words the last step
    listed, each line's first. Keys go one step at a time, as a user types them: zsh lists
    nothing while more input is waiting."""
    lines = ["zmodload zsh/zpty", "zpty z zsh -f -i",
             "zpty -w z " + shlex.quote(f'stty rows 200 columns 250; LISTMAX=0; PS1="> "; autoload -U compinit; '
                                        f'compinit -u -d {shlex.quote(str(script.parent / "zcompdump"))}; '
                                        f'eval "$(<{shlex.quote(str(script))})"; print RE""ADY'),
             "zpty -r z out $'*\\nREADY*'"]
    for keys, until in steps:
        lines += [f"zpty -w -n z {shlex.quote(keys)}$'\\t'", f"zpty -r z out {shlex.quote(until)}"]
    lines += ['print -r -- "$out"', "zpty -d z"]
    proc = subprocess.run(["zsh", "-f", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=30,
                          env=cli_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]|[\a\r]", "", proc.stdout)
    described = [line.split()[0] for line in text.splitlines() if " -- " in line]  # NAME  -- its help
    if described:
        return described
    typed = "".join(keys for keys, _ in steps).strip()  # else names in columns, under the echoed line
    return [w for line in text.splitlines() if typed not in line and not line.startswith("#") for w in line.split()]


@pytest.fixture(scope="module")
def zsh_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    path = tmp_path_factory.mktemp("zsh") / "_orchestrator"
    proc = cli(path.parent / "state", "completion", "zsh")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    path.write_text(proc.stdout)
    return path


def test_zsh_offers_every_verb_and_a_verbs_flags(zsh_script):
    verbs = sorted(_verbs())
    assert _zsh(zsh_script, ("orchestrator ", f"*\n{verbs[-1]} *-- *")) == verbs
    assert _zsh(zsh_script, ("orchestrator launch --po", "*--port-base*-- *")) == ["--pool", "--port-base"]


def test_zsh_offers_the_running_daemons_pools(zsh_script, daemon):
    daemon.start()
    for pool in ("web", "worker"):
        assert cli(daemon.state_dir, "launch", "--pool", pool, "--", "sleep", "300").returncode == 0
    line = f"{ORCHESTRATOR} --state-dir {daemon.state_dir} scale "
    # the first TAB inserts what both names start with, the second lists them
    assert _zsh(zsh_script, (line, "*scale w*"), ("", "*web*worker*")) == ["web", "worker"]


def test_without_the_extra_it_says_what_to_install_in_one_line():
    code = ("import sys\nsys.modules['shtab'] = None  # as if it were not installed\n"
            "from orchestrator.client.cli import main\nsys.exit(main(['completion', 'bash']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env())
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"orchestrator: {completion.INSTALL}\n")


def test_a_daemon_that_does_not_answer_holds_a_tab_no_longer_than_the_bound(daemon):
    """The manager server stopped (SIGSTOP): the connection is accepted by the kernel and
    never answered. The TAB's names come back empty within the bound, still silently."""
    daemon.start()
    manager = daemon.status()["daemon"]["manager_pid"]
    os.kill(manager, signal.SIGSTOP)
    try:
        start = time.monotonic()
        proc = subprocess.run([ORCHESTRATOR, "__complete", "pools", "--state-dir", str(daemon.state_dir)],
                              capture_output=True, text=True, timeout=60, env=cli_env())
        took = time.monotonic() - start
    finally:
        os.kill(manager, signal.SIGCONT)
    assert (proc.stdout, proc.stderr) == ("", "")
    assert proc.returncode in (0, -signal.SIGALRM), proc.returncode
    assert took < completion.NAMES_TIMEOUT + 0.5 + 2.0, took  # the timer's bound, and an interpreter's start
