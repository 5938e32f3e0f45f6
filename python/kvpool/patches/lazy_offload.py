"""The lazy CPU offloader's guard: refuse a pool whose free order is not vLLM's (a
patch module).

vLLM's ``SimpleCPUOffloadConnector`` in lazy mode (``lazy_offload=True``;
``SimpleCPUOffloadScheduler._prepare_lazy_store_specs`` in
``vllm/v1/simple_kv_offload/manager.py``) stores nothing when a request computes its
blocks: each step it walks the GPU free queue, counts ``target_free`` free blocks and
copies the cached ones among them to the CPU tier. What it stores, and what the GPU
prefix cache keeps, depends on where cached blocks sit among the free blocks, uncached
ones included:

- vLLM 0.30.0-0.33.0 walk from a saved cursor block
  (``free_block_queue.iter_blocks_after(cursor)``). A policy that orders the uncached
  blocks otherwise moves them before or behind that cursor, so the walk reaches other
  cached blocks at other steps: other stores, fewer CPU hits.
- vLLM 0.34.0 walks from the queue's head and returns the stored blocks with
  ``free_blocks(..., evict_first=True)``: cached blocks at the *front* of the queue,
  which vLLM evicts next. A policy that keeps the front of the queue sorted by block id
  (``allocation="contiguous"``) serves them by position instead, and one that relinks the
  uncached blocks by id when the pool empties (``KVPOOL_REORDER_ON_IDLE=1``) sorts them
  among those: they leave the GPU's prefix cache at other moments than on vLLM's pool
  (later or sooner): other GPU hits and evictions.

The policies that order the free queue otherwise than vLLM (``allocation="contiguous"``;
``KVPOOL_REORDER_ON_IDLE=1``: relinked by id when the pool empties) keep every
prefix-cache hit and eviction of vLLM without the lazy offloader, not with it
(docs/design.md, "Lazy CPU offloading"). Such a pool is refused when the offloader binds
it (``bind_gpu_block_pool``, called when vLLM's ``Scheduler`` is built), with
:class:`LazyOffloadOrderError`, before anything is served. The eager offloader (the
default, ``lazy_offload=False``) stores from the requests' block tables, not from the
free queue, and runs on every policy unchanged; kvpool's default order serves both.

Installed by every ``kvpool.install()`` (the policy is per pool, chosen when the pool
is built); a wrapper of one method vLLM calls once per engine, which passes through
for the eager offloader and for pools that keep vLLM's order.
"""

from __future__ import annotations

import functools
from typing import Any

from kvpool.errors import LazyOffloadOrderError  # (defined there, re-exported here)
from kvpool.patches.sources import mark_kvpool_wrapper
from kvpool.vllm_compat import release_traits

if release_traits().free_blocks_evict_first:
    _WALK = ("from its head, and returns them with evict_first=True to the front, where "
             "vLLM evicts them next")
    _CONSEQUENCE = ("those blocks would leave the GPU's prefix cache at other moments (later or sooner), "
                    "with other hits and evictions")
else:
    _WALK = "from a saved cursor block"
    _CONSEQUENCE = "the CPU tier would get other stores and fewer hits"


def check_lazy_offload_pool(pool: Any) -> None:
    """Raise :class:`LazyOffloadOrderError` when ``pool`` is a kvpool pool whose policy
    orders the free queue otherwise than vLLM; nothing for vLLM's own pools and for
    kvpool's default order."""
    if not getattr(pool, "_kvpool_init", False):
        return
    policy = getattr(pool, "_policy", None)
    if policy is None or policy.keeps_vllm_free_order:
        return
    raise LazyOffloadOrderError(
        f"vLLM's lazy CPU offloading (SimpleCPUOffloadConnector with lazy_offload=True) "
        f"cannot run on a kvpool block pool with {policy.setting}: the lazy offloader "
        f"stores the cached blocks it meets walking the GPU free queue ({_WALK}), and "
        f"this policy orders the free queue's uncached blocks differently from vLLM, so "
        f"{_CONSEQUENCE} than on vLLM's pool. Use the eager offloader (lazy_offload=False, the default), which this "
        f"policy serves exactly as vLLM, or kvpool's default order (allocation=\"vllm\" "
        f"without KVPOOL_REORDER_ON_IDLE).")


def _refusing_reordered_pools(method):
    """Wrap ``SimpleCPUOffloadScheduler.bind_gpu_block_pool``: a lazy offloader checks
    the pool first (:func:`check_lazy_offload_pool`)."""

    @functools.wraps(method)
    def wrapper(self, gpu_block_pool, *args, **kwargs):
        # (A lazy offloader without a target, no prefix-cacheable group, never walks.)
        if getattr(self, "_lazy_mode", False) and getattr(self, "_target_free", 1) > 0:
            check_lazy_offload_pool(gpu_block_pool)
        return method(self, gpu_block_pool, *args, **kwargs)

    mark_kvpool_wrapper(wrapper, method)
    return wrapper


def apply(patcher) -> None:
    """Wrap the simple CPU offloader's ``bind_gpu_block_pool`` (called by
    ``kvpool.install()``; undone by ``uninstall()``). Nothing when this vLLM has no
    simple CPU offloader."""
    try:
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
    except ImportError:
        return
    patcher.require(SimpleCPUOffloadScheduler, "bind_gpu_block_pool")
    patcher.set_attr(SimpleCPUOffloadScheduler, "bind_gpu_block_pool",
                     _refusing_reordered_pools(SimpleCPUOffloadScheduler.bind_gpu_block_pool))


__all__ = ["LazyOffloadOrderError", "apply", "check_lazy_offload_pool"]
