"""The manager process (``python -m orchestrator.manager.server``): the command queue's server, bridged
to the daemon over two pipes. It imports the shared modules, ``channelserver`` and the
client's wire code (``orchestrator.client.channel``), never the daemon's.
"""
