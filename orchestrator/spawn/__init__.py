"""What runs in the spawner processes and in a new replica before its exec or its target: the
spawner's main (``python -m orchestrator.spawn.spawner``) and the child's set-up. They import
the shared modules and each other, never the daemon's.
"""
