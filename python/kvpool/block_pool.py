"""kvpool's drop-in ``BlockPool`` for vLLM 0.30.0–0.34.0.

A subclass of ``vllm.v1.core.block_pool.BlockPool`` whose blocks and free queue are
kvpool's extension types and whose per-block loops (``get_new_blocks``,
``free_blocks``, ``touch``, ``unpin_blocks``, ``evict_blocks``) run in Cython/C++.
Everything else (prefix-cache bookkeeping, KV cache events, partial blocks) is
vLLM's own code, inherited unchanged.

Fast paths skip only work that is provably not needed: with a metrics collector or
reuse watchers registered, or a method vLLM's loop calls patched (``kvpool.vllm_calls``),
``get_new_blocks`` and ``touch`` run vLLM's loop (over kvpool's queue) so every callback
fires exactly as in vLLM.

A subclass that does not run ``BlockPool.__init__`` (kvcached's elastic pool builds
its own free structures) or that replaces ``free_block_queue`` with another kind of
queue runs vLLM's own methods unchanged; kvpool's additions on it
(:meth:`BlockPool.reset_free_block_queue_order`, :meth:`BlockPool.fragmentation_stats`,
``reset_prefix_cache(reorder_free_queue=True)``) raise :class:`NotAKvpoolPoolError`
(a ``TypeError``) naming the subclass.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared
from vllm.v1.core import block_pool as _vllm_block_pool

from kvpool import allocation, envs
from kvpool._core import (
    BlockTable,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    VllmCallGuard,
    configure_block_fields,
    make_pool_blocks,
    pool_blocks_to_evict,
    pool_free_blocks,
    pool_get_new_blocks,
    pool_touch,
    pool_unpin_blocks,
)
from kvpool.allocation.base import table_of_caller
from kvpool.block_hash_map import BLOCK_IDS_MAP, TRAITS as _TRAITS, BlockHashToBlockMap, new_map
from kvpool.errors import NotAKvpoolPoolError
from kvpool.vllm_calls import POOL_SELF_CALLS

# vLLM's own block-pool logger ("vllm.v1.core.block_pool"): kvpool's pool is vLLM's
# BlockPool to an operator, so its lines (vLLM's reset messages included) go where
# vLLM's would, with vLLM's handler, format and per-logger levels.
logger = _vllm_block_pool.logger

#: ``KVPOOL_REORDER_ON_RESET=1``: every successful reset also restores the canonical order.
REORDER_ON_RESET_ENV = envs.REORDER_ON_RESET

VllmBlockPool = _vllm_block_pool.BlockPool


# kvpool's loops call the eviction hook only for hashed blocks (vLLM's, for every block):
# what vLLM's get_new_blocks / evict_blocks call through self. patched -> vLLM's loop.
_GET_NEW_BLOCKS_CALLS = VllmCallGuard(VllmBlockPool, POOL_SELF_CALLS["get_new_blocks"])
_EVICT_BLOCKS_CALLS = VllmCallGuard(VllmBlockPool, POOL_SELF_CALLS["evict_blocks"])

# vLLM >= 0.34.0: blocks hold their pool weakly (BlockPool._weak_self).
_WEAK_BLOCK_POOL = _TRAITS.weak_block_pool
configure_block_fields(_TRAITS.public_block_hash, _TRAITS.weak_block_pool)

class BlockPool(VllmBlockPool):
    """Drop-in for ``vllm.v1.core.block_pool.BlockPool`` (vLLM 0.30.0–0.34.0).

    Same constructor and attributes. Block 0 is the null block, popped at
    construction and never freed. Adds :meth:`reset_free_block_queue_order` (the
    RFC's Option A), ``reset_prefix_cache(reorder_free_queue=True)`` (Option B),
    :meth:`fragmentation_stats`, and the allocation policy in force when the pool is
    built (:attr:`allocation`, the policy object's name; see :mod:`kvpool.allocation`).

    Args:
        num_gpu_blocks: blocks in the pool, ``> 0``.
        enable_caching: prefix caching on/off.
        hash_block_size: tokens per block hash.
        enable_kv_cache_events, metrics_collector, medium: as in vLLM.
        num_hash_lookahead_tokens: as in vLLM 0.33.0 (tokens after each block covered
            by its hash, for KV events); accepted and stored on 0.30.0–0.32.0 too,
            whose code neither passes nor reads it.

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
        # What each block's `pool` holds: the pool, or (vLLM >= 0.34.0) a weak
        # reference to it, as vLLM's blocks do; the native loops compare it by identity.
        if _WEAK_BLOCK_POOL:
            self._weak_self = weakref.ref(self)
        owner = self._weak_self if _WEAK_BLOCK_POOL else self
        # All blocks (a BlockTable: objects created on first use) and the free
        # queue, natively linked in block_id order.
        self.blocks, self.free_block_queue = make_pool_blocks(owner, num_gpu_blocks)
        #: The allocation policy object (kvpool.allocation), fixed for the pool's life;
        #: its hooks are called unconditionally (the default's do nothing).
        self._policy = allocation.new_policy(num_gpu_blocks)
        #: "vllm" or "contiguous": the policy's name.
        self.allocation = self._policy.name
        self._policy.attach(self)
        # The block table the current allocation extends: (manager, request_id), set
        # by kvpool's native manager path under a policy with manager hooks (or what it
        # knows of the table around vLLM's own allocate_slots: get_new_blocks), else None
        # (vLLM's managers' tables are found by kvpool.allocation.base.table_of_caller).
        self._table_context = None
        self.cached_block_hash_to_block = new_map(self.blocks)
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
            ``list[KVCacheBlock]`` of length ``num_blocks``, in free-queue order (with
            ``allocation="contiguous"``: the blocks taken from the LRU segment, evicted
            in free-queue order, are returned ascending by id; docs/design.md).

        Raises:
            ValueError: more blocks than are free ("Cannot get N free blocks from the
                pool") or ``num_blocks < 0``.
        """
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.get_new_blocks(self, num_blocks)
        # (manager, request_id), set by kvpool's native manager path around its own
        # allocation, or (manager, request_id, expected tokens) around vLLM's
        # allocate_slots on a one-group model: what table_of_caller would find; around
        # vLLM's allocate_slots on a hybrid model (None, request_id, expected tokens):
        # the group's manager is the allocating frame's
        context = self._table_context
        if context is None:
            if self._policy.manager_hooks:
                context = table_of_caller(sys._getframe(1))
        elif context[0] is None:
            context = table_of_caller(sys._getframe(1), context)
        if context is not None:
            if len(context) == 3:
                manager, request_id, expected = context
                if expected is not None:
                    self._policy.expect_tokens(request_id, expected)
                return self._policy.extend_table(self, num_blocks, manager, request_id)
            return self._policy.extend_table(self, num_blocks, *context)
        if _GET_NEW_BLOCKS_CALLS.needs_vllm_loop(self):   # (= self._needs_vllm_loop())
            blocks = self._take(num_blocks)
        else:
            # The native loop (alloc.pxi), straight from vLLM's manager.
            blocks = pool_get_new_blocks(
                self.free_block_queue,
                num_blocks,
                self.enable_caching,
                self.cached_block_hashes_by_block,
                self._maybe_evict_cached_block,
                pool=self,
            )
        self._policy.after_change(self)
        return blocks

    def _take(self, num_blocks: int, hint: int = -1, owner: int = 0, want: int = 0) -> list[KVCacheBlock]:
        """``get_new_blocks`` for a policy: the native loop, or vLLM's loop when
        callbacks must see every block (:meth:`_needs_vllm_loop`), on the queue's
        order. ``hint``/``owner``/``want``: the contiguous order's plan (the block id
        to continue at, the table's extent owner, the extent's blocks;
        ``free_block_queue.policy.set_plan``)."""
        if _GET_NEW_BLOCKS_CALLS.needs_vllm_loop(self):   # (= self._needs_vllm_loop())
            handle = self._policy.queue_policy(self)  # (allocates nothing once made)
            if owner:
                handle.set_plan(hint, owner, want)
            seq = handle.pop_seq + 1  # the popleft_n vLLM's loop is about to make
            try:
                blocks = VllmBlockPool.get_new_blocks(self, num_blocks)
            except BaseException:
                # vLLM's loop has no undo: a callback that raised (an eviction hook, a
                # reuse watcher, the metrics collector) would leave its popped blocks
                # neither free nor held. Put them back as the native loop does.
                handle.undo_pop(seq)
                raise
            finally:
                if owner:
                    handle.set_plan(-1, 0, 0)
            # The table order the native loop gives (contiguous order; never raises).
            handle.place_taken(blocks, hint)
            return blocks
        return pool_get_new_blocks(
            self.free_block_queue,
            num_blocks,
            self.enable_caching,
            self.cached_block_hashes_by_block,
            self._maybe_evict_cached_block,
            hint,
            owner,
            want,
            pool=self,
        )

    def _needs_vllm_loop(self) -> bool:
        # Callbacks that must see every allocated block (reuse watchers, a metrics
        # collector, an eviction hook patched on the class or the instance, a subclass's)
        # get vLLM's own allocation loop (one native call: the allocation paths call it).
        return _GET_NEW_BLOCKS_CALLS.needs_vllm_loop(self)

    def _idle(self) -> bool:
        # Only the null block is held.
        return self.free_block_queue.num_free_blocks == self.num_gpu_blocks - 1

    def _end_table(self, manager, request_id: str) -> None:
        # The request's table in `manager` is gone (the policy's manager hook).
        if self._kvpool_native:
            self._policy.end_table(self, manager, request_id)

    def _after_free(self) -> None:
        # Blocks were freed (also by a drained deferred free: kvpool.patches.deferred_free).
        self._policy.after_free(self)

    def free_blocks(self, ordered_blocks, evict_first: bool = False) -> None:
        """Decrement ``ref_cnt``; blocks reaching 0 return to the free queue, hashed
        ones at the LRU tail, others at the front. Blocks of another pool are forwarded
        to it. Mirrors ``BlockPool.free_blocks``.

        Args:
            ordered_blocks: iterable of ``KVCacheBlock`` in eviction order.
            evict_first: hashed blocks reaching 0 go to the front too, and other pools
                are asked the same (vLLM >= 0.34.0's keyword; for blocks another tier
                holds). Accepted on every release; vLLM 0.30.0-0.33.0 never pass it.

        Raises:
            BlockStateError: double free or a block of another pool (nothing freed).
        """
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            if evict_first:
                return VllmBlockPool.free_blocks(self, ordered_blocks, evict_first=evict_first)
            return VllmBlockPool.free_blocks(self, ordered_blocks)
        # (evict_first: hashed blocks reaching 0 go to the front, as with caching off.)
        others = pool_free_blocks(self, self.free_block_queue, ordered_blocks,
                                  self.enable_caching and not evict_first)
        if others:
            for pool, blocks in others.items():
                if evict_first:
                    pool.free_blocks(blocks, evict_first=evict_first)
                else:
                    pool.free_blocks(blocks)
        self._policy.after_free(self)

    def touch(self, blocks) -> None:
        """``ref_cnt += 1`` for each block (prefix-cache hit), taking eviction
        candidates out of the free queue. Mirrors ``BlockPool.touch``."""
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.touch(self, blocks)
        if self.metrics_collector is not None:
            VllmBlockPool.touch(self, blocks)
        else:
            pool_touch(self.free_block_queue, blocks)
        self._policy.after_change(self)

    def unpin_blocks(self, blocks, on_reuse) -> None:
        """Release references to blocks that stay readable until reused. Mirrors
        ``BlockPool.unpin_blocks``."""
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.unpin_blocks(self, blocks, on_reuse)
        pool_unpin_blocks(self.free_block_queue, blocks, self._reuse_watchers, on_reuse, self)
        self._policy.after_change(self)
        self._policy.after_free(self)

    def evict_blocks(self, block_ids) -> None:
        """Evict blocks from the prefix cache by id (``set[int]``). Mirrors
        ``BlockPool.evict_blocks``.

        Raises:
            BlockIdOutOfRangeError: an id outside ``[0, num_gpu_blocks)``; nothing is
                evicted.
        """
        if not self._kvpool_init or type(self.free_block_queue) is not FreeKVCacheBlockQueue:
            return VllmBlockPool.evict_blocks(self, block_ids)
        # vLLM's loop calls the eviction hook for every id; kvpool's for hashed blocks,
        # unless the hook (or what it calls) is patched, or a metrics collector counts.
        every_block = self.metrics_collector is not None or not _EVICT_BLOCKS_CALLS.intact(self)
        for block in pool_blocks_to_evict(
            self.blocks, block_ids, self.cached_block_hashes_by_block, every_block
        ):
            self._maybe_evict_cached_block(block)
        self._policy.after_change(self)

    # -- reset / reorder ---------------------------------------------------------------
    def reset_prefix_cache(self, reorder_free_queue: bool = False) -> bool:
        """Reset the prefix cache (``BlockPool.reset_prefix_cache``, vLLM 0.30.0–0.34.0),
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
        # (vLLM >= 0.34.0 clears its map in place, after gc.freeze() too.)
        fresh_map = None if BLOCK_IDS_MAP else new_map(self.blocks)
        table = self.blocks if isinstance(self.blocks, BlockTable) else None
        blocks = None if table is not None else list(self.blocks)
        watched = [self.blocks[block_id] for block_id in list(self._reuse_watchers)] if self._reuse_watchers else None
        event = AllBlocksCleared() if self.enable_kv_cache_events else None
        reorder = reorder_free_queue or envs.get(REORDER_ON_RESET_ENV)
        # The policy's one reorder, strong (it reads no hash, and needs only the
        # precondition above).
        self._policy.order_for_reset(self, bool(reorder))
        if fresh_map is None:
            self.cached_block_hash_to_block.clear()
        else:
            self.cached_block_hash_to_block = fresh_map
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
        self._policy.restore_order(self)
        return True

    def fragmentation_stats(self, reset: bool = True) -> dict[str, float]:
        """Fragmentation of the free blocks and contiguity of the block tables freed
        since the last reset (kvpool addition, any allocation policy).

        The table figures come from counters the native free loop keeps
        (``FreeKVCacheBlockQueue.table_counters``): vLLM frees a request's block table
        tail first (``SingleTypeKVCacheManager.free``, vLLM 0.30.0–0.34.0), so every
        table is counted whole once, when its request finishes or is preempted, with
        no per-allocation work in any policy.

        Args:
            reset: start a new measurement window for the ``table_*`` values.

        Returns:
            ``free_blocks`` (blocks), ``free_runs`` (maximal runs of consecutive free
            block ids), ``largest_free_run`` (blocks); over the block tables freed in
            the window (null blocks and other pools' blocks left out):
            ``table_pairs`` (adjacent pairs), ``table_contiguity`` (fraction of pairs
            with next id = previous + 1; 1.0 without pairs), ``descending_fraction``
            (previous - 1), ``mean_run_length`` (blocks per ascending run),
            ``table_descriptors`` (ascending runs, summed over the tables: what a
            KV transfer that coalesces only ascending consecutive ids, such as
            NIXL's, posts per memory region for them; vLLM PR #55841),
            ``tables_freed`` (freed tables with at least one counted block; one
            per request and KV cache group, each preemption's free included) and
            ``mean_descriptors_per_table`` (0.0 without a table).
            O(num_gpu_blocks).

        Raises:
            NotAKvpoolPoolError: a pool kvpool did not build (see the module docstring).
        """
        self._require_native("fragmentation_stats()")
        runs, longest = self.free_block_queue.free_runs()
        blocks, pairs, ascending, descending = self.free_block_queue.table_counters(reset)
        # Each freed list starts with a block that has no pair before it, so
        # blocks - ascending pairs are its runs, and blocks - pairs its lists.
        started = blocks - ascending
        tables = blocks - pairs
        return {
            "free_blocks": self.get_num_free_blocks(),
            "free_runs": runs,
            "largest_free_run": longest,
            "table_pairs": pairs,
            "table_contiguity": ascending / pairs if pairs else 1.0,
            "descending_fraction": descending / pairs if pairs else 0.0,
            "mean_run_length": blocks / started if started > 0 else float(blocks),
            "table_descriptors": started,
            "tables_freed": tables,
            "mean_descriptors_per_table": started / tables if tables > 0 else 0.0,
        }


#: ``BlockPool._take`` as defined here (src/kvpool/contiguous_take.pxi runs it natively only then).
NATIVE_TAKE = BlockPool._take

__all__ = ["NATIVE_TAKE", "BlockHashToBlockMap", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock",
           "NotAKvpoolPoolError"]
