"""Tasks the resource tests submit (importable by name in every worker)."""

from __future__ import annotations

import os


def record(path: str, i: int, blob: bytes) -> tuple[int, int]:
    """Append ``i`` to ``path`` (one line, one write: every run of the task is counted),
    and return it with the size of ``blob`` (a large argument: a large journal row)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{i}\n".encode())
    finally:
        os.close(fd)
    return i, len(blob)
