"""The vLLM methods that kvpool's native code skips or calls less often, in one place.

vLLM's own code calls them through ``self.`` (or a module global); other code (plugins,
KV connectors, monitoring, tests) patches them on the class or the instance, at any time.
Where one of them is not vLLM's function any more, kvpool runs vLLM's code for the
operation, which calls it exactly as vLLM does:

- :data:`POOL_SELF_CALLS`: per ``BlockPool`` operation that kvpool runs natively, what
  vLLM's version (``vllm/v1/core/block_pool.py``, 0.30.0-0.34.0) calls through ``self.``.
  ``BlockPool.get_new_blocks`` and ``evict_blocks`` check them on every call
  (``kvpool._core.VllmCallGuard``); kvpool's ``reset_prefix_cache``, ``free_blocks``,
  ``touch`` and ``unpin_blocks`` call theirs through ``self.`` as vLLM does.
- The native KV cache manager path (``kvpool.patches.manager_fast_path``): the
  manager's, coordinator's, single-type manager's, pool's and map's methods below, which
  must not be set on the instances (the classes are checked through
  ``manager_fast_path.MIRRORED``, the module functions through its namespaces).

``tests/pool/test_patched_methods.py`` patches each entry on the class and on the
instance after ``install()`` and compares the calls and results with vLLM's.
"""

from __future__ import annotations

POOL_SELF_CALLS: dict[str, tuple[str, ...]] = {
    # get_num_free_blocks (the count check), _notify_reuse (reuse watchers), and for every
    # block handed out with caching on _maybe_evict_cached_block -> _remove_cached_block_hashes
    # -> _emit_block_removed_events (kvpool's loop: only for blocks that have a hash).
    "get_new_blocks": ("get_num_free_blocks", "_notify_reuse", "_maybe_evict_cached_block",
                       "_remove_cached_block_hashes", "_emit_block_removed_events"),
    # _maybe_evict_cached_block for every id (kvpool's loop: only for hashed blocks).
    "evict_blocks": ("_maybe_evict_cached_block", "_remove_cached_block_hashes",
                     "_emit_block_removed_events"),
    # Called through self. by kvpool's own method, as by vLLM's.
    "reset_prefix_cache": ("get_num_free_blocks", "_notify_reuse"),
}

# The native KV cache manager path: methods it skips, which must not be set on the
# instances (kvpool.patches.manager_fast_path, src/kvpool/manager.pxi, lookup.pxi).
MANAGER_NAMES = ("create_kv_cache_blocks",)
COORDINATOR_NAMES = ("remove_skipped_blocks", "get_num_blocks_to_allocate",
                     "allocate_new_computed_blocks", "allocate_new_blocks", "cache_blocks",
                     "get_num_cacheable_tokens", "get_replay_boundaries")
SINGLE_TYPE_NAMES = ("remove_skipped_blocks", "get_num_skipped_tokens",
                     "get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks",
                     "_cache_partial_tail_block", "reachable_block_mask",
                     "_get_num_evictable_blocks", "_has_partial_local_hit")
# ... and those the hybrid running step skips (kvpool.patches.hybrid_fast_path,
# src/kvpool/hybrid_step.pxi) on HybridKVCacheCoordinator and each group's manager.
HYBRID_COORDINATOR_NAMES = ("remove_skipped_blocks", "get_num_blocks_to_allocate", "allocate_new_blocks",
                            "cache_blocks", "get_num_cacheable_tokens", "_align_cacheable",
                            "allocate_new_computed_blocks")
HYBRID_SINGLE_TYPE_NAMES = ("remove_skipped_blocks", "get_num_skipped_tokens", "_remove_blocks_in_range",
                            "get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks",
                            "_cache_partial_tail_block", "reachable_block_mask", "_get_num_evictable_blocks",
                            "_has_partial_local_hit", "add_local_computed_blocks")
# kvpool's BlockHashToBlockMap methods the native loops replace (class and instance).
MAP_NAMES = ("contain", "insert", "pop", "get_one_block")
# Pool methods the native cache_blocks and eviction skip (_emit_block_removed_events may
# be a list's extend: the native eviction appends to that list as vLLM's would).
POOL_NAMES = ("cache_full_blocks", "_insert_block_hash", "_maybe_evict_cached_block",
              "_remove_cached_block_hashes", "_emit_block_removed_events", "get_cached_block",
              "get_num_free_blocks")
# ... and those the native get_computed_blocks skips (manager, coordinator, single type).
LOOKUP_MANAGER_NAMES = ("prefix_cache_lookup_enabled", "create_kv_cache_blocks")
LOOKUP_COORDINATOR_NAMES = ("find_longest_cache_hit",)
LOOKUP_SINGLE_TYPE_NAMES = ("find_longest_cache_hit",)

__all__ = [
    "COORDINATOR_NAMES",
    "HYBRID_COORDINATOR_NAMES",
    "HYBRID_SINGLE_TYPE_NAMES",
    "LOOKUP_COORDINATOR_NAMES",
    "LOOKUP_MANAGER_NAMES",
    "LOOKUP_SINGLE_TYPE_NAMES",
    "MANAGER_NAMES",
    "MAP_NAMES",
    "POOL_NAMES",
    "POOL_SELF_CALLS",
    "SINGLE_TYPE_NAMES",
]
