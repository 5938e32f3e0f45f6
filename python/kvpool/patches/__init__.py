"""The patch modules: what ``kvpool.install()`` changes in vLLM beyond the block classes.

Each module has an ``apply(patcher)`` that makes every change through the
:class:`kvpool.patching.Patcher` it is handed, so ``kvpool.uninstall()`` undoes it;
``kvpool.patching.PATCH_MODULES`` lists them in the order ``install()`` runs them:

* :mod:`kvpool.patches.manager_hooks`: the KV cache managers' hooks of an allocation
  policy that needs them (only ``allocation="contiguous"``; nothing for the default);
* :mod:`kvpool.patches.deferred_free`: the scheduler's deferred frees through kvpool's
  fenced queue, in vLLM's eviction order;
* :mod:`kvpool.patches.metrics`: the pool's fragmentation gauges on vLLM's stats and
  ``/metrics``;
* :mod:`kvpool.patches.engine_api`: the reorder API through vLLM's engine layers.
* :mod:`kvpool.patches.lazy_offload`: vLLM's lazy CPU offloader refuses a pool whose
  policy does not keep vLLM's free-queue order (``allocation="contiguous"``,
  ``KVPOOL_REORDER_ON_IDLE=1``).

On a forced untested vLLM release a module whose targets are missing is skipped (with
one warning naming it) and the rest installs (``kvpool.patching.skipped_patches``).
"""
