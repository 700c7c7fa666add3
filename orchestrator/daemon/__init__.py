"""The daemon process: its control loop and everything that loop runs (the engine, supervision,
probes, logs capture, metrics, the config file, the spawners' launcher side), and
``Orchestrator``, which runs the same loop inside the calling process.

These modules import the shared modules, each other, and the replica's set-up
(``orchestrator.spawn.childsetup``, for a fork done in the daemon), never the client side.
"""
