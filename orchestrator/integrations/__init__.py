"""The executor inside engines that already schedule across hosts, one module each, each
imported only by a user who names it (``import orchestrator`` imports none of them):

* ``orchestrator.integrations.dask``: ``ExecutorPlugin``, a ``distributed`` WorkerPlugin
  that gives each Dask worker an ``orchestrator.Executor`` (``pip install
  'orchestrator[dask]'``);
* ``orchestrator.integrations.joblib``: the joblib parallel backend ``"orchestrator"``,
  registered by importing it (``pip install 'orchestrator[joblib]'``).

Both are faces, as ``orchestrator.executor`` is: they put an engine's side and the
executor together, and nothing in the package imports them.
"""
