"""``orchestrator top`` against a real daemon: Textual's pilot presses the keys and reads the
screen's tables; what each key did is checked through the CLI, as an operator would. Once,
where tmux is installed, it runs in a real terminal, and ``q`` and Ctrl-C must leave that
terminal as they found it. Without textual (the ``tui`` extra) the UI tests are skipped; the checks that
the CLI never loads it, and says how to install it, run everywhere."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ROOT, DaemonUnderTest, Ident, cli, cli_env, status, wait_for

WEB = """
[pools.web]
command = ["sleep", "1000"]
size = 2
"""
JOBS = """
[pools.jobs]
kind = "executor"
size = 1
"""


def has_textual() -> bool:
    import importlib.util

    return importlib.util.find_spec("textual") is not None


needs_textual = pytest.mark.skipif(not has_textual(), reason="orchestrator top needs the tui extra (textual)")


def start(daemon: DaemonUnderTest, tmp_path: Path, *, executor: bool = False) -> None:
    """The daemon with pool web (two ``sleep``), and with ``executor`` an executor pool jobs
    (one worker) too."""
    config = tmp_path / "top.toml"
    config.write_text(WEB + (JOBS if executor else ""))
    daemon.start("--config", str(config))
    wait_for(lambda: sum(r["state"] == "RUNNING" for r in daemon.status()["replicas"]) == 2 + executor, 30,
             "the pools' replicas to run")


def pool_of(state_dir: Path, name: str) -> dict[str, Any] | None:
    return next((p for p in status(state_dir)["pools"] if p["name"] == name), None)


def live_ids(state_dir: Path, pool: str) -> set[str]:
    return {r["id"] for r in status(state_dir)["replicas"] if r["pool"] == pool and r["state"] == "RUNNING"}


def rows(app: Any, table: str) -> list[str]:
    from textual.widgets import DataTable

    return [str(k.value) for k in app.query_one(f"#{table}", DataTable).rows]


def cell(app: Any, table: str, key: str, column: str) -> str | None:
    from textual.widgets import DataTable

    t = app.query_one(f"#{table}", DataTable)
    return str(t.get_cell(key, column)) if key in rows(app, table) else None


async def until(pilot: Any, cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Let the app run until ``cond()``; the seconds it took (bounded by ``timeout``)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await pilot.pause(0.02)
    return time.monotonic() - start


async def cursor_to(pilot: Any, app: Any, table: str, key: str) -> None:
    """Move ``table``'s cursor onto the row ``key`` with the arrow keys, as an operator would."""
    from textual.widgets import DataTable

    t = app.query_one(f"#{table}", DataTable)
    t.focus()
    await until(pilot, lambda: key in rows(app, table), 10, f"{key} in {table}")
    while rows(app, table)[t.cursor_row] != key:
        await pilot.press("down" if rows(app, table).index(key) > t.cursor_row else "up")


def make_app(state_dir: Path) -> Any:
    from orchestrator.client.channel import Client
    from orchestrator.client.topfeed import Feed
    from orchestrator.client.topview import TopApp
    from orchestrator.paths import Paths

    return TopApp(Paths(state_dir), Client(state_dir), Feed(Paths(state_dir), Client(state_dir, timeout=2.0)))


def run_app(state_dir: Path, body: Callable[[Any, Any], Any]) -> Any:
    """Run ``body(app, pilot)`` in an 80x24 app on this daemon; the app's return code."""
    app = make_app(state_dir)

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await body(app, pilot)

    try:
        asyncio.run(main())
    finally:
        app.client.close()
        app.feed.client.close()
    return app.return_code


@needs_textual
def test_pools_appear_a_kill_shows_within_a_second_and_a_daemon_gone_leaves_its_last_view(
        daemon: DaemonUnderTest, tmp_path: Path) -> None:
    start(daemon, tmp_path)
    seen: dict[str, float] = {}

    async def body(app: Any, pilot: Any) -> None:
        from textual.widgets import Static

        await until(pilot, lambda: rows(app, "pools") == ["web"], 10, "the pool on screen")
        assert cell(app, "pools", "web", "SIZE") == "2/2"
        await until(pilot, lambda: len(rows(app, "replicas")) == 2, 10, "web's replicas on screen")
        victim = rows(app, "replicas")[0]
        pid = int(cell(app, "replicas", victim, "PID") or 0)
        assert Ident.of(pid) is not None
        os.kill(pid, signal.SIGKILL)
        seen["kill"] = await until(pilot, lambda: cell(app, "replicas", victim, "STATE") in (None, "FAILED", "EXITED"),
                                   5, f"{victim}'s end on screen")
        assert any(e.who == victim and "FAILED" in e.text for e in app.last.events)
        await until(pilot, lambda: len(rows(app, "replicas")) == 2, 10, "its replacement on screen")

        assert cli(daemon.state_dir, "stop", "--timeout", "30").returncode == 0
        header = app.query_one("#header", Static)
        await until(pilot, lambda: header.has_class("gone"), 5, "the header to say the daemon is gone")
        assert "is gone" in str(header.render())
        assert rows(app, "pools") == ["web"] and len(rows(app, "replicas")) == 2  # the last view, kept
        await pilot.press("ctrl+c")

    assert run_app(daemon.state_dir, body) == 0
    assert seen["kill"] <= 1.0, f"the kill showed after {seen['kill']:.2f} s"


@needs_textual
def test_each_key_does_what_its_label_says(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    from orchestrator.client.topview import KEYS

    for label in ("r[/] restart", "scale", "t[/] term", "s[/] signal", "c[/] cancel", "d[/] delete", "/[/] filter",
                  "q[/] quit"):
        assert label in KEYS
    start(daemon, tmp_path, executor=True)
    d = daemon.state_dir
    got = cli(d, "submit", "--pool", "jobs", "--target", "taskfns:sleep_then", "--arg", "60", "--arg", "1")
    assert got.returncode == 0, got.stderr
    task = got.stdout.strip()

    async def body(app: Any, pilot: Any) -> None:
        await cursor_to(pilot, app, "pools", "web")
        await pilot.press("plus")
        await until(pilot, lambda: pool_of(d, "web")["desired"] == 3, 10, "web scaled to 3")
        await until(pilot, lambda: cell(app, "pools", "web", "SIZE") == "3/3", 10, "3/3 on screen")
        await pilot.press("minus")
        await until(pilot, lambda: pool_of(d, "web")["desired"] == 2, 10, "web scaled back to 2")

        before = live_ids(d, "web")
        await until(pilot, lambda: set(rows(app, "replicas")) == before, 10, "web's replicas on screen")
        await pilot.press("r")
        await until(pilot, lambda: len(live_ids(d, "web")) == 2 and not live_ids(d, "web") & before, 30,
                    "every replica of web replaced")

        await until(pilot, lambda: set(rows(app, "replicas")) == live_ids(d, "web"), 10, "the new replicas on screen")
        await cursor_to(pilot, app, "replicas", rows(app, "replicas")[0])
        victim = rows(app, "replicas")[0]
        await pilot.press("t")
        await until(pilot, lambda: victim not in live_ids(d, "web"), 10, f"{victim} terminated")
        ended = {r["id"]: r for r in status(d, all=True)["replicas"]}
        assert ended[victim]["state"] == "TERMINATED", ended[victim]

        await until(pilot, lambda: victim not in rows(app, "replicas"), 10, f"{victim} gone from the screen")
        target = sorted(live_ids(d, "web"))[0]  # terminate is not a failure: the pool is not refilled for it
        await cursor_to(pilot, app, "replicas", target)
        await pilot.press("s")
        await pilot.press(*["backspace"] * 3, "U", "S", "R", "1", "enter")
        await until(pilot, lambda: target not in live_ids(d, "web"), 10, f"{target} ended by SIGUSR1")
        ended = {r["id"]: r for r in status(d, all=True)["replicas"]}
        assert "SIGUSR1" in (ended[target]["reason"] or ""), ended[target]

        await cursor_to(pilot, app, "pools", "jobs")
        await cursor_to(pilot, app, "tasks", task)
        await pilot.press("c")
        await until(pilot, lambda: json.loads(cli(d, "tasks", "--json", "--all").stdout)[0]["state"] == "CANCELLED",
                    10, f"{task} cancelled")

        await pilot.press("slash", "w", "e", "b", "enter")
        await until(pilot, lambda: rows(app, "pools") == ["web"], 5, "only web through the filter")
        await pilot.press("escape")
        await until(pilot, lambda: set(rows(app, "pools")) == {"web", "jobs"}, 5, "the filter cleared")

        await cursor_to(pilot, app, "pools", "web")
        await pilot.press("d")
        await pilot.press("n")
        await pilot.pause(0.3)
        assert pool_of(d, "web") is not None  # asked first: no is no
        await pilot.press("d")
        await pilot.press("y")
        await until(pilot, lambda: pool_of(d, "web") is None, 10, "web deleted")
        await until(pilot, lambda: "web" not in rows(app, "pools"), 5, "web gone from the screen")
        await pilot.press("q")

    assert run_app(d, body) == 0


def test_without_textual_top_says_how_to_install_it_and_exits_1(state_dir: Path) -> None:
    code = ("import sys; sys.modules['textual'] = None\n"  # as if it were not installed
            "from orchestrator.client.cli import main\n"
            f"sys.exit(main(['--state-dir', {str(state_dir)!r}, 'top']))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env(),
                         stdin=subprocess.DEVNULL)
    assert got.returncode == 1, got
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'orchestrator[tui]'" in lines[0], got.stderr


def test_no_other_command_loads_textual(state_dir: Path) -> None:
    code = ("import sys\nfrom orchestrator.client.cli import main\n"
            f"for argv in (['--version'], ['status'], ['events'], ['tasks']):\n"
            f"    try:\n        main(['--state-dir', {str(state_dir)!r}, *argv])\n"
            "    except SystemExit:\n        pass\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich') or 'top' in m)\n"
            "print('LOADED', loaded, file=sys.stderr)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env(),
                         stdin=subprocess.DEVNULL)
    assert "LOADED []" in got.stderr, got.stderr


@needs_textual
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_q_and_ctrl_c_in_a_real_terminal_restore_it(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    start(daemon, tmp_path)
    sock = tmp_path / "tmux.sock"
    top = shlex.join([sys.executable, "-m", "orchestrator", "--state-dir", str(daemon.state_dir), "top"])
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cli_env().items()
                   if k in ("PYTHONPATH", "ORCH_TEST_TAG", "ORCH_SESSION_TAG", "PATH"))
    script = tmp_path / "run.sh"  # top twice (ended by q, then by Ctrl-C), the tty's modes around each
    script.write_text(f"cd {shlex.quote(str(ROOT))}\nexport {env}\nstty -g > {tmp_path}/before\n"
                      f"for n in 1 2; do {top}; echo $? > {tmp_path}/code$n; stty -g > {tmp_path}/after$n; "
                      "echo TERMINAL-BACK-$n; done\nexec sleep 60\n")

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-S", str(sock), *args], capture_output=True, text=True, timeout=10,
                              check=True, stdin=subprocess.DEVNULL).stdout

    tmux("new-session", "-d", "-x", "80", "-y", "24", f"bash --norc --noprofile {script}")
    server = Ident.of(int(tmux("display-message", "-p", "#{pid}").strip()))
    try:
        for n, key in ((1, "q"), (2, "C-c")):
            wait_for(lambda: "web" in tmux("capture-pane", "-p") and "filter" in tmux("capture-pane", "-p")
                     and tmux("display-message", "-p", "#{alternate_on}").strip() == "1", 20,
                     f"top drawn in the terminal ({n})")
            tmux("send-keys", key)
            wait_for(lambda: (tmp_path / f"after{n}").exists() and f"TERMINAL-BACK-{n}" in tmux("capture-pane", "-p"),
                     10, f"top to exit on {key}")
            assert (tmp_path / f"code{n}").read_text().strip() == "0"
            # The tty's modes as they were; the main screen, the cursor shown, no mouse, no keypad mode.
            assert (tmp_path / "before").read_text() == (tmp_path / f"after{n}").read_text()
            flags = tmux("display-message", "-p", "#{alternate_on} #{cursor_flag} #{mouse_any_flag} #{keypad_flag}")
            assert flags.split() == ["0", "1", "0", "0"], (key, flags)
    finally:
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True, timeout=10,
                       stdin=subprocess.DEVNULL)
        if server is not None:
            wait_for(lambda: not server.alive(), 10, "the tmux server to end")
