"""How a policy with manager hooks (today: ``"contiguous"``) learns the block table an
allocation extends (a patch module, and the pool's look-up).

Installed by ``kvpool.install()`` (``PATCH_MODULES`` in :mod:`kvpool.patching`) only
when the policy being installed sets ``manager_hooks``. The default policy runs vLLM's
managers unwrapped: no kvpool frame between a manager's ``allocate_new_blocks`` and the
pool's ``get_new_blocks``.

* ``pop_blocks_for_free`` of every single-type manager class that defines it is wrapped:
  the request's table is gone (:meth:`AllocationPolicy.end_table`);
* the table an allocation extends is found when it allocates, not on every call:
  ``BlockPool.get_new_blocks`` asks :func:`kvpool.allocation.base.table_of_caller`, which finds in the frames
  calling it the single-type manager's ``allocate_new_blocks`` /
  ``allocate_external_computed_blocks`` (vLLM 0.30.0-0.34.0: full attention, sliding
  window, chunked local, mamba, cross attention, ..., and subclasses defined later) and
  ``KVCacheManager.allocate_slots`` above it (the request's expected length, prompt +
  ``max_tokens`` tokens: :meth:`AllocationPolicy.expect_tokens`). A hybrid model calls
  every group's ``allocate_new_blocks`` on every ``allocate_slots``, mostly to allocate
  nothing: wrappers around those calls cost a Qwen3-Next-shaped scheduler step 4-6 %
  (py-spy, vLLM 0.34.0), the look-up costs only the calls that allocate.

kvpool's native manager path sets ``pool._table_context`` itself (a C frame has no
locals to find), which the pool reads first.
"""

from __future__ import annotations

import functools

from kvpool import allocation
from kvpool.patches.sources import mark_kvpool_wrapper


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

    mark_kvpool_wrapper(wrapper, method)
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
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    for cls in _manager_classes(SingleTypeKVCacheManager):
        if "pop_blocks_for_free" in cls.__dict__:
            patcher.set_attr(cls, "pop_blocks_for_free", _ending_table(cls.__dict__["pop_blocks_for_free"]))

__all__ = ["apply"]
