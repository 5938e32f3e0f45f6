"""The KV cache managers' hooks of the policies that need them (a patch module).

Installed by ``kvpool.install()`` (``PATCH_MODULES`` in :mod:`kvpool.patching`) only
when the policy being installed sets ``manager_hooks`` (today: ``"contiguous"``).
The default policy runs vLLM's managers unwrapped: no kvpool frame between a
manager's ``allocate_new_blocks`` and the pool's ``get_new_blocks``.

* every single-type manager class that defines ``allocate_new_blocks`` /
  ``allocate_external_computed_blocks`` (vLLM 0.30.0-0.34.0: full attention, sliding
  window, chunked local, mamba, cross attention, ...) gets it wrapped, so the pool knows
  the block table ``(manager, request_id)`` the allocation extends
  (``pool._table_context`` -> :meth:`AllocationPolicy.extend_table`); subclasses
  defined later inherit the wrapper;
* ``pop_blocks_for_free``: the request's table is gone (:meth:`AllocationPolicy.end_table`);
* ``KVCacheManager.allocate_slots``: the request's expected length, prompt +
  ``max_tokens`` tokens (:meth:`AllocationPolicy.expect_tokens`).
"""

from __future__ import annotations

import functools

from kvpool import allocation

_ALLOCATING = ("allocate_new_blocks", "allocate_external_computed_blocks")


def _extending_table(method):
    """Wrap a single-type manager's allocation method: while it runs, the manager's
    pool knows the table (manager, request_id) it allocates for."""

    @functools.wraps(method)
    def wrapper(self, request_id, *args, **kwargs):
        pool = self.block_pool
        if not getattr(pool, "_kvpool_init", False):  # not a pool kvpool built
            return method(self, request_id, *args, **kwargs)
        outer = pool._table_context
        pool._table_context = (self, request_id)
        try:
            return method(self, request_id, *args, **kwargs)
        finally:
            pool._table_context = outer

    wrapper.__kvpool_wrapped__ = method
    return wrapper


def _ending_table(method):
    """Wrap ``pop_blocks_for_free``: the request's table is gone (its blocks are freed
    by the caller)."""

    @functools.wraps(method)
    def wrapper(self, request_id, *args, **kwargs):
        blocks = method(self, request_id, *args, **kwargs)
        pool = self.block_pool
        if getattr(pool, "_kvpool_init", False):  # _end_table checks the queue
            pool._end_table(self, request_id)
        return blocks

    wrapper.__kvpool_wrapped__ = method
    return wrapper


def _recording_expected_tokens(method):
    """Wrap ``KVCacheManager.allocate_slots``: tell the pool's policy the request's
    expected length (prompt + ``max_tokens``, tokens)."""

    @functools.wraps(method)
    def wrapper(self, request, *args, **kwargs):
        policy = getattr(self.block_pool, "_policy", None)
        if policy is not None:
            policy.expect_tokens(request.request_id, request.num_prompt_tokens + request.max_tokens)
        return method(self, request, *args, **kwargs)

    wrapper.__kvpool_wrapped__ = method
    return wrapper


def _manager_classes(base: type) -> list[type]:
    seen, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def apply(patcher) -> None:
    """Install the hooks when ``patcher.policy`` needs them (called by
    ``kvpool.install()``; every change goes through ``patcher`` and is undone by
    ``uninstall()``). Does nothing for the default policy."""
    if not allocation.needs_manager_hooks(patcher.policy):
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    for cls in _manager_classes(SingleTypeKVCacheManager):
        for name in _ALLOCATING:
            if name in cls.__dict__:
                patcher.set_attr(cls, name, _extending_table(cls.__dict__[name]))
        if "pop_blocks_for_free" in cls.__dict__:
            patcher.set_attr(cls, "pop_blocks_for_free", _ending_table(cls.__dict__["pop_blocks_for_free"]))
    patcher.set_attr(KVCacheManager, "allocate_slots", _recording_expected_tokens(KVCacheManager.allocate_slots))


__all__ = ["apply"]
