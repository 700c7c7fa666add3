"""``orchestrator top``: the entry of the live view. Textual is the ``tui`` extra, so this
module checks it is installed (without importing it) and only then loads the screen
(client/topview.py); no other command imports either.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading

from ..paths import Paths

EXIT_ERROR = 1
INSTALL = "orchestrator top: needs the tui extra (Textual): pip install 'orchestrator[tui]'"
# The feed's reads: a hung daemon delays the exit by at most this and the channel's margin
# (the terminal is restored first); the keys' commands keep the client's default.
FEED_TIMEOUT = 2.0


def textual_missing() -> bool:
    return importlib.util.find_spec("textual") is None


def cmd_top(args: argparse.Namespace, paths: Paths) -> int:
    if textual_missing():
        print(INSTALL, file=sys.stderr)
        return EXIT_ERROR
    from .channel import Client
    from .topfeed import Feed

    client = Client(paths.state_dir)  # no daemon: DaemonNotRunning, exit 3, as for every command
    try:
        with Client(paths.state_dir, timeout=FEED_TIMEOUT) as feed_client:
            feed = Feed(paths, feed_client)
            # The first reads overlap the UI library's import (~0.3 s, most of the start-up):
            # they mostly wait on the daemon, the import mostly runs Python.
            primer = threading.Thread(target=feed.prime, name="top: first reads", daemon=True)
            primer.start()
            from .topview import run

            primer.join(FEED_TIMEOUT)  # past that, the UI starts empty and the feed's loop waits for it
            return run(paths, client, feed)
    finally:
        client.close()
