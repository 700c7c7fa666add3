"""The manager process (``python -m orchestrator.manager.server``): the command queue's server, bridged
to the daemon over two pipes. It imports the shared modules, ``channelserver`` and the
wire it shares with the client (``orchestrator.channelwire``), never the client's or the daemon's.
"""
