"""argparse types for the command line: numbers a user types, refused with one line.

argparse's own ``float`` takes ``nan`` and ``inf``; these do not, and say why.
"""

from __future__ import annotations

import argparse
import math


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds (argparse's float takes nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {text!r}")
    return value


def natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def result_size(text: str) -> int:
    """A task result's bound: bytes, or a size such as ``16M``."""
    from ..errors import InvalidSpec
    from ..policy import result_max_bytes

    try:
        return result_max_bytes(text, "--result-max-bytes")
    except InvalidSpec as err:
        raise argparse.ArgumentTypeError(str(err)) from None
