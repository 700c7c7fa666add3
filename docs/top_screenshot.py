"""Make docs/top.svg, the README's picture of ``orchestrator top`` (Textual's SVG export of
an 80x24 screen): a daemon in a temporary state dir with a web pool that logs, a pool that
keeps crashing and an executor pool with tasks, shown for a few seconds, then stopped.

    .venv/bin/python docs/top_screenshot.py [docs/top.svg]
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """
[pools.web]
command = ["sh", "-c", "while true; do echo \\"GET /health 200 $(date +%T)\\"; sleep 1; done"]
size = 3

[pools.flaky]
command = ["sh", "-c", "echo starting; sleep 2; exit 1"]
size = 1
restart = "always"

[pools.jobs]
kind = "executor"
size = 2
"""


def cli(state_dir: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "orchestrator", "--state-dir", state_dir, *args], check=True,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120).stdout


async def shoot(state_dir: str, out: Path) -> None:
    from orchestrator.client.channel import Client
    from orchestrator.client.topfeed import Feed
    from orchestrator.client.topview import TopApp
    from orchestrator.paths import Paths

    paths = Paths(Path(state_dir))
    app = TopApp(paths, Client(state_dir), Feed(paths, Client(state_dir, timeout=2.0)))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(4.0)  # two samples of CPU, a few log lines
        out.write_text(app.export_screenshot(title="orchestrator top"))
        await pilot.press("q")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/top.svg")
    state_dir = tempfile.mkdtemp(prefix="top-shot-")
    config = Path(state_dir) / "top.toml"
    config.write_text(CONFIG)
    cli(state_dir, "start", "--config", str(config))
    try:
        time.sleep(3)
        for seconds in (20, 30, 40, 50):
            cli(state_dir, "submit", "--pool", "jobs", "--target", "time:sleep", "--arg", json.dumps(seconds))
        time.sleep(2)
        asyncio.run(shoot(state_dir, out))
    finally:
        cli(state_dir, "stop")
        shutil.rmtree(state_dir)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
