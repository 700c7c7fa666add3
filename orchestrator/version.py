"""The installed version, for ``--version``, ``health`` and the metrics' build_info."""

from importlib import metadata

try:
    __version__ = metadata.version("orchestrator")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
