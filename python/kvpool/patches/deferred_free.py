"""Fenced deferred frees in native code, and the per-group eviction-order fix.

Patches (applied by ``kvpool.install()``, undone by ``uninstall()``), for vLLM 0.30.0–0.34.0:

* ``Scheduler.deferred_frees`` becomes a :class:`kvpool.FencedDeferredFreeQueue`
  (entries stored as native block handles).
* ``Scheduler._free_request_blocks`` defers a request's blocks as one entry with a
  part per KV cache group, each group's blocks reversed, and
  ``_drain_deferred_frees`` frees each part with a ``free_blocks`` call of its own:
  exactly the calls the immediate path makes (``KVCacheCoordinator.free``: one
  ``free_blocks(reversed(group_blocks))`` per single-type manager). vLLM 0.30.0–0.34.0
  free the flat allocation-order list reversed in one call, so for groups
  A=[1,2,3], B=[4,5,6] hashed blocks leave the LRU tail [6,5,4,3,2,1] instead of
  [3,2,1,6,5,4] (upstream fix #48532, seed 003), and unhashed blocks, which each
  call prepends as one run, come out in yet another order than the immediate
  path's. ``_free_cow_retained_blocks`` queues its blocks as they are (one call
  when freed immediately, so one part): no double reversal.

``KVCacheCoordinator.pop_blocks_for_free`` and ``KVCacheManager.pop_blocks_for_free``
are **not** patched: they keep vLLM's contract (the request's blocks in allocation
order, group by group; the caller frees them reversed). The scheduler asks the
coordinator's single-type managers for the groups instead (:func:`pop_groups_for_free`).

A scheduler whose ``deferred_frees`` was replaced by a plain ``deque`` (test code,
mocks) keeps vLLM 0.30.0–0.34.0's convention for that deque, with one item per KV cache
group: ``(fence, group_blocks)`` in allocation order, freed ``reversed`` by the
drain, so the pool sees the immediate path's calls there too.
"""

from __future__ import annotations

from kvpool._core import FencedDeferredFreeQueue

_vllm_pops = None


def _vllm_pop_methods() -> tuple:
    global _vllm_pops
    if _vllm_pops is None:
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        _vllm_pops = (KVCacheManager.pop_blocks_for_free, KVCacheCoordinator.pop_blocks_for_free)
    return _vllm_pops


def pop_groups_for_free(kv_cache_manager, request) -> list[list]:
    """Pop the request's bookkeeping and return its blocks, without returning them
    to the pool, as one list per ``free_blocks`` call of the immediate path: each
    KV cache group's blocks reversed (tail blocks evicted first), group by group.

    Reads the coordinator's single-type managers, as ``KVCacheCoordinator.free``
    does (vllm/v1/core/kv_cache_coordinator.py, vLLM 0.30.0–0.34.0). A manager or
    coordinator class that overrides ``pop_blocks_for_free`` is asked through that
    override instead, and its result (allocation order, vLLM's contract) is freed
    as one call, reversed, as vLLM's scheduler does.

    Returns:
        ``list[list[KVCacheBlock]]``, empty groups left out.
    """
    manager_pop, coordinator_pop = _vllm_pop_methods()
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    if (
        getattr(type(kv_cache_manager), "pop_blocks_for_free", None) is manager_pop
        and getattr(type(coordinator), "pop_blocks_for_free", None) is coordinator_pop
    ):
        groups = [manager.pop_blocks_for_free(request.request_id) for manager in coordinator.single_type_managers]
    else:
        groups = [kv_cache_manager.pop_blocks_for_free(request)]
    return [group[::-1] for group in groups if group]


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
    # _kvpool_native: BlockPool.__init__ ran (a subclass that skips it runs vLLM's code)
    # and the queue is kvpool's.
    return getattr(type(pool), "free_blocks", None) is _native_free_blocks and getattr(
        pool, "_kvpool_native", False
    )


_VLLM_MANAGERS_MODULE = "vllm.v1.core.single_type_kv_cache_manager"


def _vllm_managers(kv_cache_manager):
    """The coordinator's single-type managers when every ``pop_blocks_for_free`` on
    the way is vLLM's own (so what it pops is known in advance: the manager's
    ``req_to_blocks`` entry without its leading null blocks); else None."""
    manager_pop, coordinator_pop = _vllm_pop_methods()
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    if (
        getattr(type(kv_cache_manager), "pop_blocks_for_free", None) is not manager_pop
        or getattr(type(coordinator), "pop_blocks_for_free", None) is not coordinator_pop
    ):
        return None
    managers = coordinator.single_type_managers
    for manager in managers:
        pop = getattr(type(manager), "pop_blocks_for_free", None)
        if getattr(pop, "__module__", None) != _VLLM_MANAGERS_MODULE or not isinstance(
            getattr(manager, "req_to_blocks", None), dict
        ):
            return None
    return managers


def _trim_null_head(blocks):
    # vllm.v1.core.kv_cache_utils.trim_null_head (vLLM 0.33.0): blocks without their
    # leading null blocks; blocks itself if none.
    n = 0
    for block in blocks:
        if not block.is_null:
            break
        n += 1
    return blocks[n:] if n else blocks


def _same_blocks(popped, peeked) -> bool:
    # Both came from the same req_to_blocks list: the same list, or equal slices.
    if popped is peeked:
        return True
    return len(popped) == len(peeked) and (not popped or (popped[0] is peeked[0] and popped[-1] is peeked[-1]))


def _defer_then_pop(queue, fence_seq: int, managers, request_id) -> None:
    # Queue the request's blocks first, then pop its bookkeeping: a MemoryError while
    # queuing (push_groups is strong) leaves the request with its blocks, as it was;
    # popping first would lose them.
    peeked = [_trim_null_head(manager.req_to_blocks.get(request_id) or ()) for manager in managers]
    popped = [None] * len(managers)
    queued = queue.push_groups(fence_seq, peeked, allocation_order=True)
    try:
        for i, manager in enumerate(managers):
            popped[i] = manager.pop_blocks_for_free(request_id)
    except BaseException:
        # A pop failed part-way: the entry must hold exactly the groups that were
        # popped (a group still in its table is freed by a later call).
        if queued:
            _keep_popped_groups(queue, fence_seq, managers, peeked, request_id)
        raise
    # A plain loop, not all(<generator>): CPython 3.12's MAKE_FUNCTION crashes the
    # interpreter when the generator's function object cannot be allocated (a
    # double decref of the code object; python/cpython#122752, #151763), and a
    # MemoryError here must stay one.
    for got, peek in zip(popped, peeked):
        if not _same_blocks(got, peek):
            break
    else:
        return
    # Not what vLLM's code pops (its bookkeeping changed under us): queue what was
    # popped instead.
    if queued:
        queue.discard_last_entry()
    queue.push_groups(fence_seq, popped, allocation_order=True)


def _keep_popped_groups(queue, fence_seq: int, managers, peeked, request_id) -> None:
    # After a failed pop: a manager whose table still holds the request was not popped.
    unpopped = [bool(peek) and request_id in manager.req_to_blocks for manager, peek in zip(managers, peeked)]
    if not any(unpopped):
        return
    queue.discard_last_entry()
    popped = [peek for peek, still in zip(peeked, unpopped) if not still]
    if any(popped):
        queue.push_groups(fence_seq, popped, allocation_order=True)


def _free_request_blocks(self, request) -> None:
    """Free the request's blocks, deferring their return to the pool while a
    dispatched step may still write them (``Scheduler._free_request_blocks``).

    With kvpool's deferred queue and vLLM's own managers, the blocks are queued
    before the request's bookkeeping is popped, so a MemoryError while queuing
    leaves the request holding its blocks (nothing lost, the call can be retried)."""
    if self._request_blocks_can_be_freed(request):
        self.kv_cache_manager.free(request)
        return
    if _is_native(self.deferred_frees):
        managers = _vllm_managers(self.kv_cache_manager)
        if managers is not None:
            _defer_then_pop(self.deferred_frees, self.sched_step_seq, managers, request.request_id)
            return
    groups = pop_groups_for_free(self.kv_cache_manager, request)
    if not groups:
        return
    if _is_native(self.deferred_frees):
        self.deferred_frees.push_groups(self.sched_step_seq, groups)
    else:
        for blocks in groups:
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
    otherwise each drained part (KV cache group) goes through the pool's ``free_blocks``."""
    queue = self.deferred_frees
    pool = self.kv_cache_manager.block_pool
    if _is_native(queue):
        if queue:
            if _frees_natively(pool):
                if queue.free_ready(self.processed_step_seq, pool):
                    pool._after_free()
            else:
                # One request at a time, as vLLM pops one entry before freeing it: a
                # free_blocks override that raises loses no later request's blocks.
                while True:
                    parts = queue.drain(self.processed_step_seq, max_requests=1)
                    if not parts:
                        break
                    for blocks in parts:
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
    from vllm.v1.core.sched.scheduler import Scheduler

    # What the replacements below replace and call (vLLM 0.29.0 has no
    # _request_blocks_can_be_freed, for one).
    patcher.require(Scheduler, "_free_request_blocks", "_free_cow_retained_blocks", "_drain_deferred_frees",
                    "_request_blocks_can_be_freed")
    original_init = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.deferred_frees = FencedDeferredFreeQueue(self.deferred_frees)

    __init__.__wrapped__ = original_init
    __init__.__doc__ = original_init.__doc__

    patcher.set_attr(Scheduler, "__init__", __init__)
    patcher.set_attr(Scheduler, "_free_request_blocks", _free_request_blocks)
    patcher.set_attr(Scheduler, "_free_cow_retained_blocks", _free_cow_retained_blocks)
    patcher.set_attr(Scheduler, "_drain_deferred_frees", _drain_deferred_frees)
