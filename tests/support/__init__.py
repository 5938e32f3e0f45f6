"""Helpers shared by kvpool's tests and benchmarks, one module per kind of object built.

Imported one way everywhere, ``from tests.support.<module> import <names>``, with the
repository root on ``sys.path`` (``pythonpath`` in pyproject.toml's pytest settings;
a child process inserts it itself):

- :mod:`tests.support.paths`: the repository root.
- :mod:`tests.support.scheduler`: real vLLM schedulers, requests and model outputs
  without a model (over :mod:`kvpool.tools.replay.engine`), 1-3 KV cache groups.
- :mod:`tests.support.scripted_engine`: a model-less vLLM ``Executor``
  (``ScriptedExecutor``) and its ``VllmConfig``, for ``EngineCore`` and the engine-core
  clients; importable by name in a spawned engine-core process.
- :mod:`tests.support.pool_workload`: random block-pool operations in lockstep on
  vLLM's ``BlockPool`` and kvpool's (the long differentials, the leak check).

This module imports none of them: a test that needs only the root pulls in no vLLM.
"""
