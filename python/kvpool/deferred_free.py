"""Fenced deferred frees in native code, and the per-group eviction-order fix.

Patches (applied by ``kvpool.install()``, undone by ``uninstall()``), for vLLM 0.33.0:

* ``KVCacheCoordinator.pop_blocks_for_free`` returns each KV cache group's blocks
  **reversed**, concatenated group by group: the order in which the immediate path
  (``KVCacheCoordinator.free``: one reversed ``free_blocks`` call per group) frees
  them. vLLM 0.33.0 returns allocation order and the drain reverses the flat list
  once, so for groups A=[1,2,3], B=[4,5,6] a deferred free leaves eviction order
  [6,5,4,3,2,1] instead of [3,2,1,6,5,4] (upstream fix #48532, seed 003).
* ``Scheduler.deferred_frees`` becomes a :class:`kvpool.FencedDeferredFreeQueue`
  (entries stored as native block handles), and ``_free_request_blocks``,
  ``_free_cow_retained_blocks`` and ``_drain_deferred_frees`` push and drain it in
  eviction order, freeing each entry as it is: no reversal at drain time, so the
  copy-on-write retention path gets no double reversal.

A scheduler whose ``deferred_frees`` was replaced by a plain ``deque`` (test code,
mocks) keeps vLLM 0.33.0's convention for that deque: entries hold blocks in the
reverse of their eviction order and the drain frees ``reversed(blocks)``. The
eviction order that reaches the pool is the same either way.
"""

from __future__ import annotations

from kvpool._core import FencedDeferredFreeQueue, FreeKVCacheBlockQueue


def pop_blocks_for_free(self, request_id: str) -> list:
    """Pop the request's bookkeeping from all single-type managers and return its
    blocks, without returning them to the pool, in **eviction order**: each KV
    cache group's blocks reversed (tail blocks evicted first), group by group.

    Mirrors ``KVCacheCoordinator.pop_blocks_for_free`` (vllm/v1/core/
    kv_cache_coordinator.py, vLLM 0.33.0) with upstream #48532's ordering: pass the
    result to ``block_pool.free_blocks`` as it is.

    Returns:
        ``list[KVCacheBlock]``.
    """
    blocks: list = []
    for manager in self.single_type_managers:
        blocks.extend(reversed(manager.pop_blocks_for_free(request_id)))
    return blocks


def _is_native(queue) -> bool:
    return type(queue) is FencedDeferredFreeQueue


_native_free_blocks = None


def _frees_natively(pool) -> bool:
    # kvpool's BlockPool.free_blocks, not overridden (a subclass's override must see
    # every call), on kvpool's queue.
    global _native_free_blocks
    if _native_free_blocks is None:
        from kvpool.block_pool import BlockPool

        _native_free_blocks = BlockPool.free_blocks
    return getattr(type(pool), "free_blocks", None) is _native_free_blocks and isinstance(
        getattr(pool, "free_block_queue", None), FreeKVCacheBlockQueue
    )


def _free_request_blocks(self, request) -> None:
    """Free the request's blocks, deferring their return to the pool while a
    dispatched step may still write them (``Scheduler._free_request_blocks``)."""
    if self._request_blocks_can_be_freed(request):
        self.kv_cache_manager.free(request)
        return
    blocks = self.kv_cache_manager.pop_blocks_for_free(request)
    if not blocks:
        return
    if _is_native(self.deferred_frees):
        self.deferred_frees.push(self.sched_step_seq, blocks)
    else:
        self.deferred_frees.append((self.sched_step_seq, blocks[::-1]))


def _free_cow_retained_blocks(self, blocks: list, fence_seq: int) -> None:
    """Release copy-on-write retentions, deferring them while the step that runs
    the copy may be in flight (``Scheduler._free_cow_retained_blocks``). The blocks
    are already in the order the immediate path frees them."""
    if not self.defer_block_free or fence_seq <= self.processed_step_seq:
        self.kv_cache_manager.block_pool.free_blocks(blocks)
        return
    if _is_native(self.deferred_frees):
        self.deferred_frees.push(fence_seq, blocks)
    else:
        self.deferred_frees.append((fence_seq, blocks[::-1]))


def _drain_deferred_frees(self) -> None:
    """Return deferred blocks whose fence step has been processed, oldest first,
    stopping at the first unmet fence (``Scheduler._drain_deferred_frees``).

    With kvpool's pool (whose ``free_blocks`` no subclass overrides) the entries are
    freed natively from their block handles (:meth:`FencedDeferredFreeQueue.free_ready`);
    otherwise each drained entry goes through the pool's ``free_blocks``."""
    queue = self.deferred_frees
    pool = self.kv_cache_manager.block_pool
    if _is_native(queue):
        if queue:
            if _frees_natively(pool):
                queue.free_ready(self.processed_step_seq, pool)
            else:
                for blocks in queue.drain(self.processed_step_seq):
                    pool.free_blocks(blocks)
        return
    free_blocks = pool.free_blocks
    while queue:
        fence, _ = queue[0]
        if fence > self.processed_step_seq:
            break
        _, blocks = queue.popleft()
        free_blocks(reversed(blocks))


def apply(patcher) -> None:
    """Install the patches above (called by ``kvpool.install()``)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler

    original_init = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.deferred_frees = FencedDeferredFreeQueue(self.deferred_frees)

    __init__.__wrapped__ = original_init
    __init__.__doc__ = original_init.__doc__

    patcher.set_attr(KVCacheCoordinator, "pop_blocks_for_free", pop_blocks_for_free)
    patcher.set_attr(Scheduler, "__init__", __init__)
    patcher.set_attr(Scheduler, "_free_request_blocks", _free_request_blocks)
    patcher.set_attr(Scheduler, "_free_cow_retained_blocks", _free_cow_retained_blocks)
    patcher.set_attr(Scheduler, "_drain_deferred_frees", _drain_deferred_frees)
