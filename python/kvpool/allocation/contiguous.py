"""The contiguous allocation policy (``allocation="contiguous"``): sorted uncached
blocks with per-request extents, vLLM's exact LRU.

The *uncached* free blocks (freed without a hash, or never used: the front segments of
vLLM's free queue) are kept sorted and served by position; the *LRU* segment (freed
with a hash, or released by ``unpin_blocks``) keeps vLLM's exact order and is reached
only when no uncached block is left, as in vLLM. Which cached blocks are hit or
evicted, in which order, the KV events and the preemptions are therefore vLLM's; only
the ids of uncached allocations differ, and where the evicted blocks sit in the table
(below; docs/design.md, "Allocation policies"). Blocks
that stop being cached join the sorted segment where vLLM would serve them at the same
moment anyway: every free block after a successful ``reset_prefix_cache()``, and the
LRU segment's leading blocks without a hash or a reuse watcher.

Per-request extents: every allocation made for a request's block table (the
single-type managers' ``allocate_new_blocks`` / ``allocate_external_computed_blocks``,
one table per request and KV cache group, found by the pool in the calling frames:
:func:`kvpool.allocation.base.table_of_caller`) continues the table at its last block id + 1
when that block is free, and places a table's first new run where its *expected
growth* fits without entering another live table's reserved extent:
``cdiv(num_prompt_tokens + max_tokens, block_size)`` minus the blocks the table
already has (when the request's length is not known: as many blocks as the table
will have after this allocation, so a table doubles its room like a growing array),
capped at 1/16 of the pool (:data:`EXTENT_CAP_FRACTION`) and at least the blocks
asked for. These are preferences only: an allocation is never refused, delayed or
made to preempt because of them (it falls back to the lowest free uncached blocks,
then to other tables' reserved ones, then to the LRU segment). A table's reservation
is released when the request's blocks are freed, every reservation when the pool is
idle.

The blocks an allocation takes from the LRU segment are evicted in vLLM's order and
placed in the table ascending by id, continuing the table's last run when they can
(``cpp/table_placement.h``). ``lru_window=W`` (opt-in, ``KVPOOL_LRU_WINDOW``; default 0,
vLLM's exact LRU) lets an allocation that takes m blocks from the LRU segment take
any m of its m + W oldest, when that makes fewer runs than the m oldest
(``FreeBlockList::take``): which cached blocks are evicted then differs from vLLM's
by at most W blocks per allocation.
"""

from __future__ import annotations

from typing import Any

from kvpool.allocation.base import AllocationPolicy

#: A new table's reserved extent is at most this fraction of the pool.
EXTENT_CAP_FRACTION = 1 / 16


class ContiguousPolicy(AllocationPolicy):
    """Sorted uncached segment, per-table extents, vLLM's LRU (see the module).

    Attributes:
        expected_tokens: ``{request_id: prompt + max_tokens}`` (tokens) of the requests
            whose tables are live, from ``KVCacheManager.allocate_slots`` (its frame, or
            kvpool's native manager path).
        table_owners: ``{(id(manager), request_id): owner}``, the extent owner ids
            of the live tables (1 .. 0x7FFFFFF0).
        extent_cap: the largest extent a table is given (blocks).
        lru_window: the LRU window (blocks; 0: vLLM's exact LRU).
    """

    name = "contiguous"
    manager_hooks = True
    # Sorted uncached blocks: a lazy offloader's cursor walk would see another
    # sequence than vLLM's (docs/design.md, "Lazy CPU offloading").
    keeps_vllm_free_order = False
    setting = 'allocation="contiguous"'

    def __init__(self, num_gpu_blocks: int, lru_window: int = 0):
        super().__init__(num_gpu_blocks)
        #: Blocks W: an allocation taking m blocks from the LRU segment may take any
        #: m of its m + W oldest when that makes fewer runs (0: vLLM's exact LRU;
        #: ``KVPOOL_LRU_WINDOW``).
        self.lru_window = lru_window
        self.expected_tokens: dict[str, int] = {}
        self.table_owners: dict[tuple[int, str], int] = {}
        self._next_owner = 1
        self.extent_cap = max(1, int(num_gpu_blocks * EXTENT_CAP_FRACTION))

    def attach(self, pool: Any) -> None:
        handle = self.queue_policy(pool)
        handle.set_order("contiguous")
        handle.set_lru_window(self.lru_window)

    def extend_table(self, pool: Any, num_blocks: int, manager: Any, request_id: str) -> list:
        table = manager.req_to_blocks.get(request_id)
        last = None
        if table:
            for block in reversed(table):
                if not block.is_null:
                    last = block.block_id
                    break
        key = (id(manager), request_id)
        owner = self.table_owners.get(key)
        if owner is None:
            owner = self.table_owners[key] = self._next_owner
            self._next_owner = self._next_owner % 0x7FFFFFF0 + 1
        held = len(table) if table else 0
        expected = self.expected_tokens.get(request_id)
        # prompt + max_tokens, from allocate_slots; unknown: room to double, as a growing array would
        growth = -(-expected // manager.block_size) - held if expected is not None else held + num_blocks
        want = max(num_blocks, min(growth, self.extent_cap))
        blocks = pool._take(num_blocks, -1 if last is None else last + 1, owner, want)
        self.after_change(pool)
        return blocks

    def after_change(self, pool: Any) -> None:
        # The LRU segment's leading blocks without a hash (or a reuse watcher) are
        # served by vLLM right after the uncached ones; let them join the sorted
        # uncached segment (nothing cached is hit or evicted differently). Runs after
        # an operation has done its work, so it never raises: each block it moves is
        # moved whole, and one it could not move (no memory) stays where vLLM serves it
        # anyway, right behind the uncached segment.
        try:  # noqa: SIM105 (no object allocated to handle a MemoryError: fault-swept)
            self.queue_policy(pool).absorb_unhashed_lru_front(
                pool.cached_block_hashes_by_block, pool._reuse_watchers)
        except MemoryError:
            pass

    def after_free(self, pool: Any) -> None:
        # On idle (only the null block held) no table is live, so no extent is either.
        # Runs after the free is done, so it never raises: without memory to reach the
        # queue (only after the pool replaced it) the extents wait for the next idle
        # moment (they are preferences). (_idle() reads counts the interpreter may
        # have to allocate: inside the try too.)
        try:  # noqa: SIM105 (no object allocated to handle a MemoryError: fault-swept)
            if pool._idle():
                self._release_all(self.queue_policy(pool))
        except MemoryError:
            pass

    def end_table(self, pool: Any, manager: Any, request_id: str) -> None:
        # Runs after vLLM popped the table (its blocks are the caller's to free), so it
        # never raises: without memory to reach the queue the extent stays reserved
        # until the pool is next idle.
        self.expected_tokens.pop(request_id, None)
        try:
            handle = self.queue_policy(pool)
        except MemoryError:
            return
        owner = self.table_owners.pop((id(manager), request_id), None)
        if owner is not None:
            handle.release_extent(owner)

    def expect_tokens(self, request_id: str, num_tokens: int) -> None:
        self.expected_tokens[request_id] = num_tokens

    def order_for_reset(self, pool: Any, reorder: bool) -> None:
        # Nothing will be cached any more: every free block uncached, sorted, which is
        # also what reset_free_block_queue_order() asks for; it would also drop the
        # reserved ranges, as the next idle moment does. (The handle first: after the
        # rebuild nothing may allocate.)
        handle = self.queue_policy(pool)
        pool.free_block_queue.rebuild_canonical()
        if reorder:
            self._release_all(handle)

    def restore_order(self, pool: Any) -> None:
        handle = self.queue_policy(pool)
        if handle.order == "contiguous":
            handle.rebuild_uncached_canonical()
            self._release_all(handle)
        else:
            # A pool whose free_block_queue was replaced by a new queue, which keeps
            # vLLM's order and no segments.
            pool.free_block_queue.rebuild_canonical()

    def _release_all(self, handle: Any) -> None:
        handle.release_all_extents()
        self.table_owners.clear()


#: The methods src/kvpool/contiguous_take.pxi runs natively, as this module defines them
#: (taken at import: a method replaced later, even before ``install()``, is called instead).
NATIVE_MIRRORED = (ContiguousPolicy.extend_table, ContiguousPolicy.after_change,
                   AllocationPolicy.queue_policy, ContiguousPolicy.expect_tokens)

__all__ = ["EXTENT_CAP_FRACTION", "NATIVE_MIRRORED", "ContiguousPolicy"]
