"""How much history state.db keeps unless told otherwise (``start --keep-*``, the config
file's ``[daemon]`` table). Shared: the store applies them, the config file and the CLI's
help show them; a module of its own so that showing them loads nothing else.
"""

KEEP_REPLICAS = 5_000  # ended replicas kept
KEEP_EVENTS = 20_000  # journal events kept
KEEP_SECONDS = 7 * 86400.0  # history older than this is pruned
