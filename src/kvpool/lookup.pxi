# The prefix-cache lookup of a waiting request in one native call:
# KVCacheManager.get_computed_blocks for a model with one full-attention KV cache group
# (issue 17).
#
# Mirrors vllm/v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks and what
# it calls for that shape (prefix_cache_lookup_enabled; UnitaryKVCacheCoordinator.
# find_longest_cache_hit; FullAttentionManager.find_longest_cache_hit;
# kv_cache_utils.resolve_block_hashes; BlockPool.get_cached_block;
# make_block_hash_with_group_id; kvpool's BlockHashToBlockMap.get_one_block;
# create_kv_cache_blocks), vLLM 0.30.0-0.33.0, fingerprinted with the rest of the
# fast path (kvpool.patches.manager_fast_path.MIRRORED). When the block size is the
# hash block size, the hit is not fine-grained, no EAGLE block is dropped, there is no
# context parallelism and no KV events, those calls reduce to:
#
#   max_length = max_cache_hit_length, or request.num_tokens - 1 when None
#   hit        = the longest run of request.block_hashes[:max_length // block_size]
#                from the start whose (hash + group 0) key is in the prefix-cache map
#                (a key with several blocks: the first inserted)
#   returns    (KVCacheBlocks((hit,)) or the manager's empty_kv_cache_blocks,
#               len(hit) * block_size, 0)
#
# Every call that is not of that shape (another coordinator or manager type, a patched
# method, KV events) is handed to vLLM's get_computed_blocks before the request is read;
# from the request's first read on, the native loop does what vLLM's does with vLLM's
# operations (any hash or map entry type), so nothing is read twice.

from itertools import islice as _islice

cdef object _NOT_GIVEN = object()   # get_computed_blocks' max_cache_hit_length not passed
cdef bytes _GROUP_0 = b"\x00\x00\x00\x00"   # make_block_hash_with_group_id's suffix, group 0
# The pool method the lookup skips (an instance patch of the caching methods, such as the
# replay's probe of cache_full_blocks, does not concern it).
cdef tuple _LOOKUP_POOL_NAMES = ("get_cached_block",)


def configure_prefix_lookup(*, vanilla, lookup_specs, eagle_attr, takes_max_length,
                            manager_names, coordinator_names, single_type_names,
                            prefix_cache_hit_limit=False, num_cached=None):
    """Arm :func:`kv_cache_manager_get_computed_blocks` beside the allocate_slots fast
    path (after :func:`configure_allocate_slots_fast_path`, which disarms it; called by
    ``kvpool.patches.manager_fast_path``). ``vanilla``: vLLM's ``get_computed_blocks``;
    ``lookup_specs``: the spec types ``FullAttentionManager.find_longest_cache_hit``
    asserts; ``eagle_attr``: the coordinator attribute naming its EAGLE groups
    (``VllmRelease.eagle_group_ids_attr``: ``drop_eagle_group_ids`` from 0.33.0);
    ``takes_max_length``: the release's ``get_computed_blocks`` has the
    ``max_cache_hit_length`` parameter; ``*_names``: methods that must not be set on the
    manager / coordinator / single-type manager instances; ``prefix_cache_hit_limit``:
    the release bounds a request's reads by ``Request.prefix_cache_hit_limit`` and
    ``get_max_cache_hit_length`` (vLLM >= 0.34.0) instead of
    ``skip_reading_prefix_cache``; ``num_cached``: vLLM's
    ``KVCacheManager.get_num_cached_tokens`` when
    :func:`kv_cache_manager_get_num_cached_tokens` is bound in its place, else None."""
    _fast_path.vanilla_lookup = vanilla
    _fast_path.lookup_specs = tuple(lookup_specs)
    _fast_path.eagle_attr = str(eagle_attr)
    _fast_path.lookup_takes_max = bool(takes_max_length)
    _fast_path.lookup_entry = _Entry(manager_names, coordinator_names, single_type_names,
                                     reads_enable_caching=True, hybrid_ok=True)
    _fast_path.hit_limit = bool(prefix_cache_hit_limit)
    _fast_path.native_lookups = 0
    _fast_path.vllm_lookups = 0
    _fast_path.vanilla_num_cached = num_cached
    _fast_path.native_probes = _fast_path.vllm_probes = 0
    _fast_path.native_lookup = True


def kv_cache_manager_get_computed_blocks(self, request, max_cache_hit_length=_NOT_GIVEN,
                                         *args, **kwargs):
    """``KVCacheManager.get_computed_blocks`` (vllm/v1/core/kv_cache_manager.py, vLLM
    0.30.0-0.33.0): the request's longest prefix-cache hit, as
    ``(KVCacheBlocks, num_computed_tokens, shared_prefix_boundary)`` (tokens; the blocks
    are full and in table order), done natively for a one-group full-attention model
    and by vLLM's function otherwise; same arguments (``max_cache_hit_length`` only
    where the release has it), results and exceptions as vLLM's. Changes nothing."""
    cdef _AllocateSlotsFastPath fp = _fast_path
    result = _VLLM
    if fp.enabled and fp.native_lookup and not args and not kwargs:
        result = _get_computed_blocks_native(fp, self, request, max_cache_hit_length)
    if result is not _VLLM:
        fp.native_lookups += 1
        return result
    fp.vllm_lookups += 1
    if max_cache_hit_length is _NOT_GIVEN:
        return fp.vanilla_lookup(self, request, *args, **kwargs)
    return fp.vanilla_lookup(self, request, max_cache_hit_length, *args, **kwargs)


cdef inline bint _is_int_one(object x):
    return type(x) is int and x == 1


cdef object _get_computed_blocks_native(_AllocateSlotsFastPath fp, self, request,
                                        max_length_o):
    """The lookup, or _VLLM when the call is vLLM's. Everything that decides is read from
    the manager, its coordinator, managers and pool before the request is read; from the
    request's first read on, the call is this function's to finish, reading what vLLM
    reads in vLLM's order with vLLM's operations, so that a request or map entry whose
    Python code (a property, ``__eq__``, ``__bool__``) counts or changes things sees
    exactly vLLM's reads."""
    if max_length_o is not _NOT_GIVEN and not fp.lookup_takes_max:
        return _VLLM        # (vLLM's raises the TypeError)
    # prefix_cache_lookup_enabled's `self.enable_caching` (read by _eligible first), then
    # UnitaryKVCacheCoordinator.find_longest_cache_hit ->
    # FullAttentionManager.find_longest_cache_hit (group 0, the coordinator's pool/spec)
    mgr = _eligible(fp, fp.lookup_entry, self, None)
    if mgr is None:
        return _VLLM
    if mgr is _HYBRID:
        # (HybridKVCacheCoordinator, its step armed: hybrid_lookup.pxi; vLLM >= 0.34.0)
        return _hybrid_get_computed_blocks(fp, self, request, max_length_o) if fp.hit_limit else _VLLM
    if mgr is _CACHING_OFF:
        return (self.empty_kv_cache_blocks, 0, 0)
    ready = _unitary_lookup_ready(fp, self, False)
    if ready is None:
        return _VLLM
    pool, cache_o, block_size = <tuple>ready
    # From here on the call is this function's (the request is read).
    if fp.hit_limit:
        # vLLM >= 0.34.0: `request.prefix_cache_hit_limit != 0`, then
        # `request.get_max_cache_hit_length(max_cache_hit_length)`.
        if not (request.prefix_cache_hit_limit != 0):
            return (self.empty_kv_cache_blocks, 0, 0)
        max_length_o = request.get_max_cache_hit_length(
            None if max_length_o is _NOT_GIVEN else max_length_o)
    else:
        if request.skip_reading_prefix_cache:
            return (self.empty_kv_cache_blocks, 0, 0)
        if max_length_o is _NOT_GIVEN or max_length_o is None:
            max_length_o = request.num_tokens - 1
    return _longest_hit(fp, self, request.block_hashes, pool, <dict>cache_o, <long long>block_size,
                        max_length_o)


cdef object _unitary_lookup_ready(_AllocateSlotsFastPath fp, self, bint events_ok):
    """After :func:`_eligible` gave the one full-attention manager: ``(pool, map dict,
    block size)`` when the lookup of a ``UnitaryKVCacheCoordinator`` may be native (no
    KV events unless ``events_ok``, no context parallelism, no EAGLE group, the block
    the hash block and the alignment), else None. Reads no request."""
    cdef long long block_size, n
    if not events_ok and self.enable_kv_cache_events is not False:
        return None
    coordinator = self.coordinator
    pool = coordinator.block_pool
    cache_o = _native_map_cache(fp, pool, _LOOKUP_POOL_NAMES)
    if (cache_o is None or not _is_int_one(coordinator.dcp_world_size)
            or not _is_int_one(coordinator.pcp_world_size)):
        return None
    eagle_group_ids = getattr(coordinator, fp.eagle_attr, None)
    if type(eagle_group_ids) not in (list, tuple, set, frozenset) or 0 in eagle_group_ids:
        return None
    spec = coordinator.kv_cache_spec
    if (not isinstance(spec, fp.lookup_specs)
            or not _nonneg(spec.block_size, &block_size) or block_size == 0
            or not _nonneg(coordinator.block_size, &n) or n != block_size  # alignment
            or not _nonneg(pool.hash_block_size, &n) or n != block_size):
        return None
    return (pool, cache_o, block_size)


def kv_cache_manager_get_num_cached_tokens(self, request, *args, **kwargs):
    """``KVCacheManager.get_num_cached_tokens`` (vllm/v1/core/kv_cache_manager.py, vLLM
    0.34.0): how many of the request's tokens (at most ``request.num_tokens - 1``) its
    longest prefix-cache hit covers, 0 when the lookup is off; the scheduler's
    cache-aware admission asks it for each waiting request of its window on every step.
    Native for the shapes ``get_computed_blocks`` is (one full-attention group, or the
    hybrid coordinator: ``hybrid_lookup.pxi``; KV events do not matter, as the probe
    emits none), vLLM's function otherwise; same results and exceptions. Changes
    nothing."""
    cdef _AllocateSlotsFastPath fp = _fast_path
    result = _VLLM
    if fp.enabled and fp.native_lookup and fp.hit_limit and not args and not kwargs:
        result = _num_cached_native(fp, self, request)
    if result is not _VLLM:
        fp.native_probes += 1
        return result
    fp.vllm_probes += 1
    return fp.vanilla_num_cached(self, request, *args, **kwargs)


cdef object _num_cached_native(_AllocateSlotsFastPath fp, self, request):
    """The probe, or _VLLM before the request is read (as :func:`_get_computed_blocks_native`):
    ``prefix_cache_lookup_enabled``, then the coordinator's ``find_longest_cache_hit``
    of ``(request.block_hashes, request.num_tokens - 1)``, its hit length."""
    mgr = _eligible(fp, fp.lookup_entry, self, None)
    if mgr is None:
        return _VLLM
    if mgr is _CACHING_OFF:
        return 0
    if mgr is _HYBRID:
        ready = _hybrid_lookup_ready(fp, self, True)
    else:
        ready = _unitary_lookup_ready(fp, self, True)
    if ready is None:
        return _VLLM
    # From here on the call is this function's (the request is read).
    if not (request.prefix_cache_hit_limit != 0):
        return 0
    block_hashes = request.block_hashes
    max_length = request.num_tokens - 1
    if mgr is _HYBRID:
        coordinator, pool, cache_o, groups, align, n_groups = <tuple>ready
        return _hybrid_longest_hit(fp, coordinator, <list>groups, block_hashes, max_length, pool,
                                   <dict>cache_o, <long long>align, <Py_ssize_t>n_groups)[1]
    pool, cache_o, block_size = <tuple>ready
    return _longest_hit(fp, self, block_hashes, pool, <dict>cache_o, <long long>block_size,
                        max_length)[1]


cdef object _longest_hit(_AllocateSlotsFastPath fp, self, block_hashes, pool, dict cache,
                         long long block_size, max_length):
    """Phase 1 of ``FullAttentionManager.find_longest_cache_hit`` on ``cache`` (the map's
    dict; ``resolve_block_hashes`` returns ``block_hashes`` itself when the block is the
    hash block) and ``create_kv_cache_blocks``, with vLLM's operations: ``islice`` of the
    hashes, ``hash + group id`` (``make_block_hash_with_group_id``), the map's
    ``get_one_block`` (a dict's first block) and ``get_cached_block``'s ``if not block``."""
    cdef list hit = []
    hash_map = pool.cached_block_hash_to_block
    for block_hash in _islice(block_hashes, max_length // block_size):
        if pool.cached_block_hash_to_block is not hash_map or hash_map._cache is not cache:
            # (Python code run by a lookup, a key's __eq__, replaced the map: vLLM's
            # get_cached_block from here on, as vLLM's loop would call it.)
            cached = pool.get_cached_block(block_hash, [0])
            if not cached:
                break
            hit.append(cached[0])
            continue
        if type(block_hash) is bytes:
            key = <bytes>block_hash + _GROUP_0
        else:
            key = block_hash + (0).to_bytes(4, "big", signed=False)
        entry = _cached_entry(fp, hash_map, cache, key)
        if not entry:
            break
        hit.append(entry)
    if len(hit) == 0:
        return (self.empty_kv_cache_blocks, 0, 0)
    return (fp.manager_module_dict["KVCacheBlocks"]((hit,)), len(hit) * block_size, 0)


cdef inline object _cached_entry(_AllocateSlotsFastPath fp, hash_map, dict cache, key):
    """The map's ``get_one_block(key)`` read from its dict ``cache``: the block, the first
    inserted of several, or None."""
    entry = cache.get(key)
    if entry is None:
        return None
    if fp.map_ids:
        return hash_map._blocks[entry]   # vLLM >= 0.34.0: the map stores block ids
    if type(entry) is dict:
        return next(iter((<dict>entry).values()))
    return entry
