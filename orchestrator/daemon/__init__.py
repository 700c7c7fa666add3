"""The daemon process: its control loop and everything that loop runs (the engine, supervision,
probes, logs capture, metrics, the config file, the spawners' launcher side), and
``Orchestrator``, which runs the same loop inside the calling process.

These modules import the shared modules, each other, and two of ``orchestrator.spawn``: the
replica's set-up (``childsetup``, for a fork done in the daemon) and the spawner's frames
(``spawner``, for the launcher); never the client side.
"""
