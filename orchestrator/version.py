"""The version, for ``--version``, ``health`` and the metrics' build_info. Shared.

Written here, and read from here by the build (pyproject.toml: ``dynamic = ["version"]``),
rather than asked of the installed metadata: importlib.metadata costs milliseconds of every CLI
command's start, and this is the same string.
"""

__version__ = "0.2.0"
