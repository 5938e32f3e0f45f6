# The prefix-cache lookup of a waiting request under vLLM's HybridKVCacheCoordinator
# (full attention beside sliding-window or Mamba groups), with the full-attention
# groups' part native (included by _core.pyx after lookup.pxi).
#
# Mirrors vLLM 0.34.0's KVCacheManager.get_computed_blocks over
# HybridKVCacheCoordinator.find_longest_cache_hit (the iterative fixed point over the
# coordinator's attention_groups), fingerprinted with the hybrid step
# (kvpool.patches.hybrid_fast_path.HYBRID_MIRRORED / HYBRID_LAYOUT). A waiting request
# is looked up again on every step it stays waiting, and the full-attention groups'
# part, one dict look-up per block and group through four Python calls
# (FullAttentionManager.find_longest_cache_hit, BlockPool.get_cached_block,
# make_block_hash_with_group_id, the map's get_one_block), is most of the lookup's
# time on a serving stream.
#
# Native when no group drops an EAGLE block, there is no context parallelism and no KV
# events, and every full-attention group's block is the hash block and the hit
# alignment (then resolve_block_hashes returns the request's hashes and no hit is
# fine-grained). Every sliding-window and Mamba group is looked up by its manager
# class's own find_longest_cache_hit, called with vLLM's arguments in vLLM's order. Every
# other call (another group type, a patched method, EAGLE, events) is handed to vLLM's
# get_computed_blocks before the request is read.


cdef object _hybrid_groups(_AllocateSlotsFastPath fp, _HybridStep hp, coordinator, pool):
    """The coordinator's ``attention_groups`` read before the request is: ``(groups,
    alignment, number of KV cache groups)``, groups a list of
    ``(native, group_ids, manager_cls, spec, first group id, its manager)`` per
    ``SpecGroup`` (the first id read here: code run by a request's read that empties a
    group's list cannot make the loop read past it), native
    for a full-attention group (``FullAttentionSpec`` exactly, ``FullAttentionManager``
    exactly, its managers on ``pool`` with block size = the hash block size = the hit
    alignment, no context parallelism), the hit alignment in tokens; None when the
    lookup is vLLM's (a group of another spec type, EAGLE, a group id that is not an int
    of the coordinator's managers)."""
    cdef long long align, hash_bs, n, gid
    cdef Py_ssize_t n_groups
    partial = coordinator.enable_partial_hash_hits
    if partial is not True and partial is not False:
        return None
    if (not _nonneg(pool.hash_block_size, &hash_bs)
            or not _nonneg(coordinator.hash_block_size if partial else coordinator.scheduler_block_size,
                           &align)
            or align == 0):
        return None
    managers = coordinator.single_type_managers
    groups = coordinator.attention_groups
    config_groups = coordinator.kv_cache_config.kv_cache_groups
    if type(managers) is not tuple or type(groups) is not list or type(config_groups) is not list:
        return None
    n_groups = len(<list>config_groups)
    if n_groups != len(<tuple>managers) or len(<list>groups) == 0:
        return None
    out = []
    for group in <list>groups:
        if type(group) is not hp.spec_group_cls or len(<tuple>group) != 4:
            return None
        spec, group_ids, manager_cls, use_eagle = <tuple>group
        if use_eagle is not False or type(group_ids) is not list or len(<list>group_ids) == 0:
            return None
        for g in <list>group_ids:
            if type(g) is not int or not _nonneg(g, &gid) or gid >= n_groups:
                return None
        first_id = (<list>group_ids)[0]
        first = (<tuple>managers)[<long long>first_id]
        if type(spec) is hp.full_spec_cls:
            if manager_cls is not hp.full_attention_cls:
                return None
            for g in <list>group_ids:
                mgr = (<tuple>managers)[<long long>g]
                if (type(mgr) is not hp.full_attention_cls or mgr.block_pool is not pool
                        or not _is_int_one(mgr.dcp_world_size) or not _is_int_one(mgr.pcp_world_size)
                        or not _nonneg(mgr.block_size, &n) or n != align
                        or mgr.retains_longer_hit is not False):
                    return None
            if not _nonneg(spec.block_size, &n) or n != align or n != hash_bs:
                return None
            out.append((True, group_ids, manager_cls, spec, first_id, first))
        elif type(spec) is hp.sliding_spec_cls or (hp.mamba_spec_cls is not None
                                                   and type(spec) is hp.mamba_spec_cls):
            out.append((False, group_ids, manager_cls, spec, first_id, first))
        else:
            return None
    return (out, align, n_groups)


cdef object _hybrid_lookup_ready(_AllocateSlotsFastPath fp, self, bint events_ok):
    """After :func:`_eligible` gave ``_HYBRID``: ``(coordinator, pool, map dict,
    groups, alignment, number of KV cache groups)`` (:func:`_hybrid_groups`) when the
    lookup may be native (the hybrid step's classes unchanged, the coordinator exactly
    ``HybridKVCacheCoordinator`` without an instance ``find_longest_cache_hit``, no KV
    events unless ``events_ok``, no EAGLE group, kvpool's pool and map), else None.
    Reads no request."""
    cdef _HybridStep hp = _hybrid
    if not hp.classes_unchanged() or hp.spec_group_cls is None:
        return None
    coordinator = self.coordinator
    if (type(coordinator) is not hp.coordinator_cls
            or not _not_overridden(coordinator, fp.lookup_entry.coordinator_names)
            or (not events_ok and self.enable_kv_cache_events is not False)):
        return None
    eagle_group_ids = getattr(coordinator, fp.eagle_attr, None)
    if type(eagle_group_ids) not in (list, tuple, set, frozenset) or len(eagle_group_ids) != 0:
        return None
    pool = coordinator.block_pool
    cache_o = _native_map_cache(fp, pool, _LOOKUP_POOL_NAMES)
    if cache_o is None:
        return None
    read = _hybrid_groups(fp, hp, coordinator, pool)
    if read is None:
        return None
    return (coordinator, pool, cache_o) + <tuple>read


cdef object _hybrid_get_computed_blocks(_AllocateSlotsFastPath fp, self, request, max_length_o):
    """``KVCacheManager.get_computed_blocks`` (vLLM 0.34.0) of a manager whose coordinator
    is ``HybridKVCacheCoordinator`` (:func:`_eligible` gave ``_HYBRID``): vLLM's
    ``(KVCacheBlocks, num_computed_tokens, shared_prefix_boundary)`` (tokens), or _VLLM
    before the request is read when the call is vLLM's (see the file's head)."""
    ready = _hybrid_lookup_ready(fp, self, False)
    if ready is None:
        return _VLLM
    coordinator, pool, cache_o, groups, align, n_groups = <tuple>ready
    # From here on the call is this function's (the request is read): vLLM's
    # prefix_cache_lookup_enabled, get_max_cache_hit_length, then the lookup.
    _hybrid.native_lookups += 1
    if not (request.prefix_cache_hit_limit != 0):
        return (self.empty_kv_cache_blocks, 0, 0)
    max_length = request.get_max_cache_hit_length(None if max_length_o is _NOT_GIVEN else max_length_o)
    computed, hit_length, uncached = _hybrid_longest_hit(
        fp, coordinator, <list>groups, request.block_hashes, max_length, pool, <dict>cache_o,
        <long long>align, <Py_ssize_t>n_groups)
    # (get_computed_blocks: KV events are off; create_kv_cache_blocks)
    boundary = hit_length + uncached if uncached else 0
    if any(computed):
        return (fp.manager_module_dict["KVCacheBlocks"](computed), hit_length, boundary)
    return (self.empty_kv_cache_blocks, hit_length, boundary)


cdef tuple _hybrid_longest_hit(_AllocateSlotsFastPath fp, coordinator, list groups, block_hashes,
                               max_length, pool, dict cache, long long align, Py_ssize_t n_groups):
    """``HybridKVCacheCoordinator.find_longest_cache_hit`` without EAGLE groups: each
    attention group accepts the candidate length or shortens it, and a shorter length
    starts the round again (one round for full attention + one other group type); then
    the full-attention groups' hits are cut to the agreed length. Returns ``(blocks per
    KV cache group, hit length, uncached common prefix)`` (tokens)."""
    hit_length = max_length
    longest = 0
    hit_blocks = [None] * n_groups
    hit_lengths = [0] * n_groups
    # (full attention first, SpecGroup's order: _hybrid_groups checked the types)
    cdef bint simple = len(groups) == 2 and (<tuple>groups[0])[0]
    while True:
        curr = hit_length
        for group in groups:
            native, group_ids, manager_cls, spec, first_id, first = <tuple>group
            if native and hit_blocks[first_id] is not None:
                # (full attention is downward-closed: trim to the shorter length)
                curr = min(curr, hit_lengths[first_id])
                continue
            if native:
                hit, new_length = _full_groups_hit(fp, block_hashes, pool, cache, align, curr,
                                                   <list>group_ids)
            else:
                hit, new_length = manager_cls.find_longest_cache_hit(
                    block_hashes=block_hashes, max_length=curr, kv_cache_group_ids=group_ids,
                    block_pool=first.block_pool, kv_cache_spec=spec, drop_eagle_block=False,
                    alignment_tokens=coordinator._cache_hit_alignment_tokens,
                    dcp_world_size=first.dcp_world_size, pcp_world_size=first.pcp_world_size)
            curr = new_length
            for group_id, blocks in zip(group_ids, hit):
                hit_blocks[group_id] = blocks
                hit_lengths[group_id] = new_length
            longest = max(longest, curr)
        if curr >= hit_length:
            break
        hit_length = curr
        if simple:
            break
    # the full-attention groups' hits cut to the agreed length (their managers' block:
    # the alignment; retains_longer_hit False, checked)
    num_blocks = -(hit_length // -align)   # (vLLM's cdiv)
    for group in groups:
        if not (<tuple>group)[0]:
            continue
        for group_id in (<tuple>group)[1]:
            blocks = hit_blocks[group_id]
            if blocks is not None:
                del blocks[num_blocks:]
    cdef list per_group = []   # (by hand: no comprehension in the extension)
    for blocks in hit_blocks:
        per_group.append(blocks if blocks is not None else [])
    return (tuple(per_group), hit_length, longest - hit_length)


cdef tuple _full_groups_hit(_AllocateSlotsFastPath fp, block_hashes, pool, dict cache,
                            long long block_size, max_length, list group_ids):
    """``FullAttentionManager.find_longest_cache_hit`` for ``group_ids`` when the block is
    the hash block and the alignment (no fine-grained hit, no EAGLE drop, no context
    parallelism): the longest run of the hashes, from the start and at most
    ``max_length // block_size``, whose ``hash + group id`` key
    (``make_block_hash_with_group_id``) has a block in every group (``get_cached_block``:
    the map's first block, ``if not block``). Returns ``(one list of blocks per group,
    hit length in tokens)``."""
    cdef Py_ssize_t i, n
    cdef list suffixes = [], lists = []   # (by hand: no comprehension in the extension)
    cdef list cached
    for g in group_ids:
        suffixes.append((<object>g).to_bytes(4, "big", signed=False))
        lists.append([])
    n = len(suffixes)
    cdef tuple computed = tuple(lists)
    hash_map = pool.cached_block_hash_to_block
    for block_hash in _islice(block_hashes, max_length // block_size):
        cached = []
        for i in range(n):
            key = (block_hash + <bytes>suffixes[i]) if type(block_hash) is not bytes \
                else <bytes>block_hash + <bytes>suffixes[i]
            current = pool.cached_block_hash_to_block
            if current is not hash_map or hash_map._cache is not cache:
                # (Python code run by a look-up, a key's __eq__, replaced the map: the
                # map's own get_one_block from here on, as vLLM's loop calls it)
                entry = current.get_one_block(key)
            else:
                entry = _cached_entry(fp, hash_map, cache, key)
            if not entry:
                cached = None
                break
            cached.append(entry)
        if not cached:
            break
        for i in range(n):
            (<list>computed[i]).append(cached[i])
    if n == 0:
        # (a group list emptied by code a request's read ran: vLLM's computed_blocks[0])
        raise IndexError("tuple index out of range")
    return (computed, len(<list>computed[0]) * block_size)
