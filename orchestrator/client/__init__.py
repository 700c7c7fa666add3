"""The CLI and ``Client``: what runs in an operator's shell or an application that talks to a daemon.

These modules import the shared modules (``orchestrator/*.py``) and each other, never the
daemon's: a command starts in a bare interpreter's time (``tests/test_layout.py`` holds them
to it). The CLI's exceptions: ``start --foreground`` becomes the daemon, and ``start --config``
checks the file before a daemon starts.
"""
