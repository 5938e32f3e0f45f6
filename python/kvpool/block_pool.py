"""kvpool's drop-in ``BlockPool`` for vLLM 0.33.0.

A subclass of ``vllm.v1.core.block_pool.BlockPool`` whose blocks and free queue are
kvpool's extension types and whose per-block loops (``get_new_blocks``,
``free_blocks``, ``touch``, ``unpin_blocks``, ``evict_blocks``) run in Cython/C++.
Everything else (prefix-cache bookkeeping, KV cache events, partial blocks) is
vLLM's own code, inherited unchanged.

Fast paths skip only work that is provably not needed: with a metrics collector or
reuse watchers registered, ``get_new_blocks`` and ``touch`` run vLLM's loop (over
kvpool's queue) so every callback fires exactly as in vLLM; so does
``get_new_blocks`` of a subclass that overrides ``_maybe_evict_cached_block``.

A subclass that does not run ``BlockPool.__init__`` (kvcached's elastic pool builds
its own free structures) or that replaces ``free_block_queue`` with another kind of
queue runs vLLM's own methods unchanged; kvpool's additions on it
(:meth:`BlockPool.reset_free_block_queue_order`, :meth:`BlockPool.fragmentation_stats`,
``reset_prefix_cache(reorder_free_queue=True)``) raise :class:`NotAKvpoolPoolError`
(a ``TypeError``) naming the subclass.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared
from vllm.v1.core import block_pool as _vllm_block_pool

from kvpool import allocation, envs
from kvpool.errors import KvpoolError
from kvpool._core import (
    BlockTable,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    count_table_pairs,
    make_pool_blocks,
    pool_blocks_to_evict,
    pool_free_blocks,
    pool_get_new_blocks,
    pool_touch,
    pool_unpin_blocks,
)

# vLLM's own block-pool logger ("vllm.v1.core.block_pool"): kvpool's pool is vLLM's
# BlockPool to an operator, so its lines (vLLM's reset messages included) go where
# vLLM's would, with vLLM's handler, format and per-logger levels.
logger = _vllm_block_pool.logger

#: ``KVPOOL_REORDER_ON_RESET=1``: every successful prefix-cache reset also restores
#: the canonical free-queue order (the RFC's Option B, switched on for a deployment).
REORDER_ON_RESET_ENV = envs.REORDER_ON_RESET

VllmBlockPool = _vllm_block_pool.BlockPool
# kvpool's loop calls the eviction hook only for blocks that have a hash (vLLM's
# returns at once for the others); a subclass that overrides it gets vLLM's loop.
_VLLM_MAYBE_EVICT = VllmBlockPool._maybe_evict_cached_block
VllmBlockHashToBlockMap = _vllm_block_pool.BlockHashToBlockMap


class BlockHashToBlockMap(VllmBlockHashToBlockMap):
    """vLLM's prefix-cache map, told apart from its dict case by ``type(x) is dict``.

    vLLM's version tests ``isinstance(x, KVCacheBlock)`` against the name bound in
    ``block_pool``'s namespace, which is vLLM's dataclass unless kvpool is installed;
    this keeps a kvpool pool correct whether or not kvpool is installed.
    """

    def get_one_block(self, key):
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is dict:
            return next(iter(blocks.values()))
        return blocks

    def contain(self, key, block_id: int) -> bool:
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if type(blocks) is dict:
            return block_id in blocks
        return blocks.block_id == block_id

    def insert(self, key, block) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif type(blocks) is dict:
            blocks[block.block_id] = block
        else:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}

    def pop(self, key, block_id: int):
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if type(blocks) is dict:
            block = blocks.pop(block_id, None)
            if len(blocks) > 0:
                self._cache[key] = blocks
            return block
        if blocks.block_id == block_id:
            return blocks
        self._cache[key] = blocks
        return None


class NotAKvpoolPoolError(KvpoolError, TypeError):
    """A kvpool addition called on a pool that kvpool did not build: a ``BlockPool``
    subclass that skipped ``BlockPool.__init__`` or replaced its ``free_block_queue``
    with another kind of queue (vLLM's own methods still work on it)."""


class BlockPool(VllmBlockPool):
    """Drop-in for ``vllm.v1.core.block_pool.BlockPool`` (vLLM 0.33.0).

    Same constructor and attributes. Block 0 is the null block, popped at
    construction and never freed. Adds :meth:`reset_free_block_queue_order` (the
    RFC's Option A), ``reset_prefix_cache(reorder_free_queue=True)`` (Option B),
    :meth:`fragmentation_stats`, and the allocation policy in force when the pool is
    built (:attr:`allocation`, see :mod:`kvpool.allocation`).

    Args:
        num_gpu_blocks: blocks in the pool, ``> 0``.
        enable_caching: prefix caching on/off.
        hash_block_size: tokens per block hash.
        enable_kv_cache_events, metrics_collector, num_hash_lookahead_tokens, medium:
            as in vLLM.

    Raises:
        ValueError: ``num_gpu_blocks`` is not a positive int.
    """

    #: Set by ``BlockPool.__init__``; a subclass that skips it keeps this False and
    #: runs vLLM's methods (so does a pool whose ``free_block_queue`` was replaced by
    #: another kind of queue: each method checks the queue's type too).
    _kvpool_init = False

    @property
    def _kvpool_native(self) -> bool:
        """True when kvpool's code runs this pool: built by ``BlockPool.__init__`` and
        its ``free_block_queue`` a kvpool queue."""
        return self._kvpool_init and type(getattr(self, "free_block_queue", None)) is FreeKVCacheBlockQueue

    def _require_native(self, what: str) -> None:
        if not self._kvpool_native:
            raise NotAKvpoolPoolError(
                f"{what} is a kvpool addition and needs a pool that kvpool.BlockPool.__init__ "
                f"built with its kvpool free queue; {type(self).__qualname__} "
                + ("did not run BlockPool.__init__" if not self._kvpool_init
                   else "replaced free_block_queue with a "
                   f"{type(getattr(self, 'free_block_queue', None)).__qualname__}")
                + " (vLLM's own BlockPool methods still work on it)")

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
    ):
        if not isinstance(num_gpu_blocks, int) or isinstance(num_gpu_blocks, bool) or num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
        if num_gpu_blocks >= 2**31 - 2:
            raise ValueError(f"num_gpu_blocks {num_gpu_blocks} exceeds the int32 block id range")
        self.num_gpu_blocks = num_gpu_blocks
        self.medium = medium
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        # All blocks (a BlockTable: objects created on first use) and the free
        # queue, natively linked in block_id order.
        self.blocks, self.free_block_queue = make_pool_blocks(self, num_gpu_blocks)
        #: "vllm" or "contiguous" (kvpool.allocation), fixed for the pool's life.
        self.allocation = allocation.current()
        self._restore_on_idle = self.allocation == "vllm" and allocation.reorder_on_idle()
        if self.allocation == "contiguous":
            self.free_block_queue.set_allocation_order("contiguous")
        elif self._restore_on_idle:
            self.free_block_queue.set_allocation_order("segments")
        # The block table the current allocation extends (set by the single-type
        # managers' wrapped allocation methods), tables' owner ids and expected
        # lengths (tokens) for the extents, and the table statistics' counters
        # (blocks, pairs, ascending pairs, descending pairs).
        self._table_context = None
        self._table_owners: dict = {}
        self._next_owner = 1
        self._expected_tokens: dict = {}
        self._table_counters = [0, 0, 0, 0]
        self._extent_cap = max(1, int(num_gpu_blocks * allocation.EXTENT_CAP_FRACTION))
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block = {}
        # Block 0 is the null block: a placeholder whose ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue = []
        self.metrics_collector = metrics_collector
        self._reuse_watchers = {}
        self._kvpool_init = True

    # -- hot paths ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the free queue (evicting their cached hashes)
        with ``ref_cnt = 1``. Mirrors ``BlockPool.get_new_blocks``.

        Returns:
            ``list[KVCacheBlock]`` of length ``num_blocks``, in free-queue order.
        Raises:
            ValueError: more blocks than are free ("Cannot get N free blocks from the
                pool") or ``num_blocks < 0``.
        """
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.get_new_blocks(self, num_blocks)
        context = self._table_context
        if context is not None:
            return self._extend_table(num_blocks, *context)
        if self._needs_vllm_loop():
            blocks = VllmBlockPool.get_new_blocks(self, num_blocks)
        else:
            blocks = self._native_get_new_blocks(num_blocks)
        if self.allocation == "contiguous":
            self._absorb_unhashed()
        return blocks

    def _extend_table(self, num_blocks: int, manager, request_id: str) -> list[KVCacheBlock]:
        # get_new_blocks for the table (manager, request_id): with the contiguous
        # policy, continue it / give it an extent; in any policy, count its pairs.
        table = manager.req_to_blocks.get(request_id)
        last = None
        if table:
            for block in reversed(table):
                if not block.is_null:
                    last = block.block_id
                    break
        if self.allocation == "contiguous":
            key = (id(manager), request_id)
            owner = self._table_owners.get(key)
            if owner is None:
                owner = self._table_owners[key] = self._next_owner
                self._next_owner = self._next_owner % 0x7FFFFFF0 + 1
            held = len(table) if table else 0
            expected = self._expected_tokens.get(request_id)
            if expected is not None:  # prompt + max_tokens, from allocate_slots
                growth = -(-expected // manager.block_size) - held
            else:  # unknown: room to double, as a growing array would
                growth = held + num_blocks
            want = max(num_blocks, min(growth, self._extent_cap))
            hint = -1 if last is None else last + 1
            if self._needs_vllm_loop():  # on the policy's blocks
                self.free_block_queue.set_allocation_plan(hint, owner, want)
                try:
                    blocks = VllmBlockPool.get_new_blocks(self, num_blocks)
                finally:
                    self.free_block_queue.set_allocation_plan(-1, 0, 0)
                self._count_pairs(last, blocks)
            else:
                blocks = self._native_get_new_blocks(num_blocks, hint, owner, want, table_last=last)
            self._absorb_unhashed()
        elif self._needs_vllm_loop():
            blocks = VllmBlockPool.get_new_blocks(self, num_blocks)
            self._count_pairs(last, blocks)
        else:
            # The default policy's common path (a request's table grows), one call
            # straight into the native loop (_native_get_new_blocks, inlined).
            blocks = pool_get_new_blocks(
                self.free_block_queue,
                num_blocks,
                self.enable_caching,
                self.cached_block_hashes_by_block,
                self._maybe_evict_cached_block,
                -1,
                0,
                0,
                self._table_counters,
                -1 if last is None else last,
            )
        return blocks

    def _native_get_new_blocks(
        self, num_blocks: int, hint: int = -1, owner: int = 0, want: int = 0, table_last: int | None = -1
    ) -> list:
        # The native loop (alloc.pxi). hint/owner/want: the contiguous policy's table;
        # table_last: the extended table's last block id (None: a new table), whose
        # pairs with the new blocks are counted; -1: no table, nothing counted.
        counting = table_last is None or table_last >= 0
        return pool_get_new_blocks(
            self.free_block_queue,
            num_blocks,
            self.enable_caching,
            self.cached_block_hashes_by_block,
            self._maybe_evict_cached_block,
            hint,
            owner,
            want,
            self._table_counters if counting else None,
            -1 if table_last is None else table_last,
        )

    def _needs_vllm_loop(self) -> bool:
        # Callbacks that must see every allocated block (reuse watchers, a metrics
        # collector, a subclass's eviction hook) get vLLM's own allocation loop.
        return bool(
            self._reuse_watchers
            or self.metrics_collector is not None
            or type(self)._maybe_evict_cached_block is not _VLLM_MAYBE_EVICT
        )

    def _count_pairs(self, last, blocks) -> None:
        # The table statistics after vLLM's loop: best-effort, like the native loop's,
        # so a failure (no memory) never drops the allocation that was made.
        try:
            count_table_pairs(last, blocks, self._table_counters)
        except MemoryError:
            pass

    def _absorb_unhashed(self) -> None:
        # Contiguous policy: the LRU segment's leading blocks without a hash (or a reuse
        # watcher) are served by vLLM right after the uncached ones; let them join the
        # sorted uncached segment (nothing cached is hit or evicted differently). Runs
        # after an operation has done its work, so it never raises: each block it moves
        # is moved whole, and one it could not move (no memory) stays where vLLM
        # serves it anyway, right behind the uncached segment.
        try:
            self.free_block_queue.absorb_unhashed_lru_front(self.cached_block_hashes_by_block, self._reuse_watchers)
        except MemoryError:
            pass

    def _end_table(self, manager, request_id: str) -> None:
        # The request's table in `manager` is gone: release its reserved extent.
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return
        owner = self._table_owners.pop((id(manager), request_id), None)
        if owner is not None:
            self.free_block_queue.release_extent(owner)
        self._expected_tokens.pop(request_id, None)

    def _after_free(self) -> None:
        # Blocks were freed. On idle (only the null block held): no table is live, so
        # no extent is either; with KVPOOL_REORDER_ON_IDLE=1 the uncached segment is
        # restored to block_id order.
        # Runs after the free is done, so it never raises: a reorder that finds no
        # memory is skipped (the order is only a preference; the next idle moment
        # tries again).
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return
        if self.allocation == "contiguous":
            self.free_block_queue.release_all_extents()
            self._table_owners.clear()
        elif self._restore_on_idle:
            try:
                self.free_block_queue.rebuild_uncached_canonical()
            except MemoryError:
                pass

    def free_blocks(self, ordered_blocks) -> None:
        """Decrement ``ref_cnt``; blocks reaching 0 return to the free queue, hashed
        ones at the LRU tail, others at the front. Blocks of another pool are forwarded
        to it. Mirrors ``BlockPool.free_blocks``.

        Args:
            ordered_blocks: iterable of ``KVCacheBlock`` in eviction order.
        Raises:
            BlockStateError: double free or a block of another pool (nothing freed).
        """
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.free_blocks(self, ordered_blocks)
        others = pool_free_blocks(self, self.free_block_queue, ordered_blocks, self.enable_caching)
        if others:
            for pool, blocks in others.items():
                pool.free_blocks(blocks)
        if self._restore_on_idle or self.allocation == "contiguous":
            self._after_free()

    def touch(self, blocks) -> None:
        """``ref_cnt += 1`` for each block (prefix-cache hit), taking eviction
        candidates out of the free queue. Mirrors ``BlockPool.touch``."""
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.touch(self, blocks)
        if self.metrics_collector is not None:
            VllmBlockPool.touch(self, blocks)
        else:
            pool_touch(self.free_block_queue, blocks)
        if self.allocation == "contiguous":
            self._absorb_unhashed()

    def unpin_blocks(self, blocks, on_reuse) -> None:
        """Release references to blocks that stay readable until reused. Mirrors
        ``BlockPool.unpin_blocks``."""
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.unpin_blocks(self, blocks, on_reuse)
        pool_unpin_blocks(self.free_block_queue, blocks, self._reuse_watchers, on_reuse, self)
        if self.allocation == "contiguous":
            self._absorb_unhashed()
        if self._restore_on_idle or self.allocation == "contiguous":
            self._after_free()

    def evict_blocks(self, block_ids) -> None:
        """Evict blocks from the prefix cache by id (``set[int]``). Mirrors
        ``BlockPool.evict_blocks``.

        Raises:
            BlockIdOutOfRangeError: an id outside ``[0, num_gpu_blocks)``; nothing is
                evicted.
        """
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.evict_blocks(self, block_ids)
        every_block = self.metrics_collector is not None
        for block in pool_blocks_to_evict(
            self.blocks, block_ids, self.cached_block_hashes_by_block, every_block
        ):
            self._maybe_evict_cached_block(block)
        if self.allocation == "contiguous":
            self._absorb_unhashed()

    # -- reset / reorder ---------------------------------------------------------------
    def reset_prefix_cache(self, reorder_free_queue: bool = False) -> bool:
        """Reset the prefix cache (``BlockPool.reset_prefix_cache``, vLLM 0.33.0),
        plus the RFC's Option B.

        Same precondition and effects as vLLM's: refused (False, warning) unless only
        the null block is in use; drops every hash, notifies reuse watchers, resets
        the metrics collector, emits ``AllBlocksCleared``. Only blocks that exist as
        objects can hold a hash, so only those are visited.

        A MemoryError before the reset takes effect leaves the pool as it was (the
        reorder runs first); once it has, only vLLM's own steps after it (notifying
        the reuse watchers and their callbacks, the log line, the event) can still
        raise, as on vLLM.

        Args:
            reorder_free_queue: after a successful reset, also restore the canonical
                free-queue order (:meth:`reset_free_block_queue_order`). Also on when
                ``KVPOOL_REORDER_ON_RESET=1``.

        Returns:
            True if the prefix cache was reset.
        Raises:
            NotAKvpoolPoolError: ``reorder_free_queue=True`` on a pool kvpool did not
                build (see the module docstring); ``KVPOOL_REORDER_ON_RESET=1`` does not
                apply to such a pool.
        """
        if not self._kvpool_native:
            if reorder_free_queue:
                self._require_native("reset_prefix_cache(reorder_free_queue=True)")
            return VllmBlockPool.reset_prefix_cache(self)
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # The null block is always marked as used
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False
        # All or nothing for the pool: what the reset needs is allocated first, then
        # the reorders run (they allocate; each is strong), and only then does
        # anything change. A MemoryError up to there leaves the pool as it was.
        # vLLM's own effects after that (the reuse watchers it calls, the log line,
        # the event) can still raise, as they can on vLLM, with the reset done.
        new_map = BlockHashToBlockMap()
        table = self.blocks if isinstance(self.blocks, BlockTable) else None
        blocks = None if table is not None else list(self.blocks)
        watched = [self.blocks[block_id] for block_id in list(self._reuse_watchers)] if self._reuse_watchers else None
        event = AllBlocksCleared() if self.enable_kv_cache_events else None
        reorder = reorder_free_queue or envs.get(REORDER_ON_RESET_ENV)
        # One reorder, strong (it reads no hash, and needs only the precondition above).
        if self.allocation == "contiguous":
            # Nothing will be cached any more: every free block uncached, sorted, which
            # is also what reset_free_block_queue_order() asks for; it would also drop
            # the reserved ranges, as the next idle moment does.
            self.free_block_queue.rebuild_canonical()
            if reorder:
                self.free_block_queue.release_all_extents()
                self._table_owners.clear()
        elif reorder:
            self.reset_free_block_queue_order()
        self.cached_block_hash_to_block = new_map
        self.cached_block_hashes_by_block.clear()
        if watched:
            self._notify_reuse(watched)
        if table is not None:
            table.reset_hashes()
        else:
            for block in blocks:
                block.reset_hash()
        if self.metrics_collector:
            self.metrics_collector.reset()
        logger.info("Successfully reset prefix cache")
        if event is not None:
            self.kv_event_queue.append(event)
        return True

    def reset_free_block_queue_order(self) -> bool:
        """Rebuild the free queue in canonical ``block_id`` order (RFC vLLM #40244,
        Option A), O(num_gpu_blocks) in C++.

        Long-running sessions scramble the free queue, so later allocations get
        non-contiguous block ids and attention kernels lose locality in prefill.
        Call between rounds, when no request holds blocks (the precondition of
        ``reset_prefix_cache``). Prefix-cache hashes are kept.

        With the contiguous allocation policy the uncached blocks are always in
        order already; the LRU segment (cached blocks) keeps its order, so the
        prefix cache's eviction order is untouched (see :mod:`kvpool.allocation`).

        Returns:
            True on success: afterwards ``get_new_blocks(k)`` returns blocks 1..k
            (with the contiguous policy: the k lowest uncached blocks).
            False, with a warning, while any block other than the null block is in
            use; nothing changes then.
        Raises:
            NotAKvpoolPoolError: a pool kvpool did not build (see the module docstring).
        """
        self._require_native("reset_free_block_queue_order()")
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block is always in use
            logger.warning(
                "Failed to reset free_block_queue order because some blocks (%d) "
                "are not freed yet",
                num_used_blocks - 1,
            )
            return False
        if self.allocation == "contiguous" and self.free_block_queue.allocation_order == "contiguous":
            self.free_block_queue.rebuild_uncached_canonical()
            self.free_block_queue.release_all_extents()
            self._table_owners.clear()
        else:
            # (Also a contiguous pool whose free_block_queue was replaced by a new
            # queue, which keeps vLLM's order and no segments.)
            self.free_block_queue.rebuild_canonical()
        return True

    def fragmentation_stats(self, reset: bool = True) -> dict[str, float]:
        """Fragmentation of the free blocks and contiguity of the block tables
        allocated since the last reset (kvpool addition, any allocation policy).

        Args:
            reset: start a new measurement window for the ``table_*`` values.

        Returns:
            ``free_blocks`` (blocks), ``free_runs`` (maximal runs of consecutive free
            block ids), ``largest_free_run`` (blocks); over the blocks appended to
            request block tables in the window: ``table_pairs`` (adjacent pairs,
            including a table's old last block and its first new one),
            ``table_contiguity`` (fraction of pairs with next id = previous + 1; 1.0
            without pairs), ``descending_fraction`` (previous - 1), and
            ``mean_run_length`` (blocks per ascending run started in the window).
            O(num_gpu_blocks).
        Raises:
            NotAKvpoolPoolError: a pool kvpool did not build (see the module docstring).
        """
        self._require_native("fragmentation_stats()")
        runs, longest = self.free_block_queue.free_runs()
        blocks, pairs, ascending, descending = self._table_counters
        started = blocks - ascending
        if reset:
            self._table_counters = [0, 0, 0, 0]
        return {
            "free_blocks": self.get_num_free_blocks(),
            "free_runs": runs,
            "largest_free_run": longest,
            "table_pairs": pairs,
            "table_contiguity": ascending / pairs if pairs else 1.0,
            "descending_fraction": descending / pairs if pairs else 0.0,
            "mean_run_length": blocks / started if started > 0 else float(blocks),
        }


__all__ = ["BlockHashToBlockMap", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "NotAKvpoolPoolError"]
