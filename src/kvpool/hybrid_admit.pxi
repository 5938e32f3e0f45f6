# A waiting request's first allocation under vLLM's HybridKVCacheCoordinator, and under
# UnitaryKVCacheCoordinator for a model of one full-attention group (both run
# KVCacheCoordinator's allocation methods; kvpool.patches.hybrid_fast_path arms it;
# included by _core.pyx after hybrid_alloc.pxi, whose phases 3-5 it shares).
#
# The scheduler admits a waiting request with one KVCacheManager.allocate_slots call
# carrying its prefix-cache hit (new_computed_blocks, from get_computed_blocks) and,
# by default (scheduler_reserve_full_isl), full_sequence_must_fit. On a model of
# full-attention and sliding-window groups vLLM 0.34.0 runs that as about forty Python
# calls across the coordinator and the groups' managers: the full-sequence admission
# count, remove_skipped_blocks, get_num_blocks_to_allocate, each group's
# add_local_computed_blocks (the hit touched, a sliding window's skipped blocks padded
# with the null block), allocate_new_blocks and cache_blocks. Under the contiguous
# policy each of those allocations also walked the frames to find its table.
# _hybrid_admission runs the same phases in the same order for a request that has no
# block in any group yet, after reading everything it needs: a partial hit (a group's
# copy-on-write tail), external (connector) or encoder tokens, a zeroing skip, a group
# that retains a longer hit, a Mamba group, or a pool whose calls could run code of
# another party (_pool_runs_no_code) keep vLLM's call, before anything is changed.


cdef struct _AdmitGroup:
    # one KV cache group's numbers for a first allocation (blocks, unless named)
    long long bs                 # block_size (tokens)
    long long cap                # max_admission_blocks_per_request (-1: None)
    long long n_hits             # len(new_computed_blocks[i])
    long long skip_total, skip_local   # get_num_skipped_tokens(total / local) // bs
    long long ev_total, ev_local       # evictable hits from those indices on
    bint makes_entry             # remove_skipped_blocks reads the request's table


cdef struct _Admit:
    long long hit                # num_new_computed_tokens (tokens)
    long long local              # num_computed_tokens + hit (tokens)
    long long total              # local, capped at max_model_len (tokens)
    long long request_tokens     # request.num_tokens
    bint full_fit                # full_sequence_must_fit
    bint adopt                   # allocate_new_computed_blocks runs (a hit was given)


cdef bint _admit_arguments(_Step* s, _Admit* a, num_new_tokens, num_new_computed_tokens,
                           num_lookahead_tokens, num_external_computed_tokens,
                           delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                           reserved_blocks, has_scheduled_reqs, tuple args,
                           dict kwargs) except -1:
    """``allocate_slots``' arguments are those of the scheduler's admission of a waiting
    request (exact ints and bools; no external, encoder tokens; ``kwargs`` at most
    ``skip_zeroing_group_ids=()``), read into ``s`` / ``a``; False otherwise (vLLM's
    call, which also raises its ValueError for ``num_new_tokens == 0``)."""
    if args or (kwargs and (len(kwargs) != 1 or type(kwargs.get("skip_zeroing_group_ids")) is not tuple
                            or len(<tuple>kwargs["skip_zeroing_group_ids"]) != 0)):
        return False
    if not (full_sequence_must_fit is True or full_sequence_must_fit is False):
        return False
    a.full_fit = full_sequence_must_fit is True
    return not (not _nonneg(num_new_computed_tokens, &a.hit)
                or type(num_external_computed_tokens) is not int
                or num_external_computed_tokens != 0
                or type(num_encoder_tokens) is not int or num_encoder_tokens != 0
                or (delay_cache_blocks is not False and delay_cache_blocks is not True)
                or (has_scheduled_reqs is not False and has_scheduled_reqs is not True)
                or not _nonneg(num_new_tokens, &s.new_tokens) or s.new_tokens == 0
                or not _nonneg(num_lookahead_tokens, &s.lookahead)
                or not _nonneg(reserved_blocks, &s.reserved))


cdef object _hybrid_admission(_AllocateSlotsFastPath fp, manager, request, num_new_tokens,
                              num_new_computed_tokens, new_computed_blocks,
                              num_lookahead_tokens, num_external_computed_tokens,
                              delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                              reserved_blocks, has_scheduled_reqs, tuple args, dict kwargs):
    """vLLM 0.34.0's ``KVCacheManager.allocate_slots`` for a waiting request's first
    allocation on a model of full-attention and sliding-window groups, or of one
    full-attention group: the result vLLM's returns (``KVCacheBlocks`` of the groups'
    new blocks, the manager's empty one, or None where the full-sequence count or the
    free count refuses the request); _VLLM before any change for every other call
    (:func:`_admit_arguments`, :func:`_admission_coordinator`, :func:`_admit_ready`).
    Exceptions of the pool's calls propagate, as from vLLM's."""
    cdef _HybridStep hp = _hybrid
    cdef _Step s
    cdef _Admit a
    cdef _HybridTokens t
    cdef vector[_AdmitGroup] groups
    cdef long long free_blocks = 0
    if not _admit_arguments(&s, &a, num_new_tokens, num_new_computed_tokens,
                            num_lookahead_tokens, num_external_computed_tokens,
                            delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                            reserved_blocks, has_scheduled_reqs, args, kwargs):
        return _VLLM
    try:
        if not _admission_coordinator(fp, manager):
            return _VLLM
        ready = _admit_ready(hp, fp, manager, request, &s, &a, &t, new_computed_blocks,
                             has_scheduled_reqs is True, delay_cache_blocks is True,
                             groups, &free_blocks)
    except AttributeError:   # (an attribute deleted: vLLM's call reads it, or not)
        ready = None
    if ready is None:
        hp.vllm_admissions += 1
        return _VLLM
    hp.native_admissions += 1
    return _admit_run(fp, manager, request, <tuple>ready, &s, &a, &t, groups, free_blocks,
                      delay_cache_blocks is True)


cdef bint _admission_coordinator(_AllocateSlotsFastPath fp, manager) except -1:
    """:func:`_eligible` accepts the call (``allocate_slots``' entry) and its coordinator
    is ``HybridKVCacheCoordinator`` or, for a model of one full-attention group,
    ``UnitaryKVCacheCoordinator``: both run ``KVCacheCoordinator``'s
    ``get_num_blocks_to_allocate``, ``remove_skipped_blocks``,
    ``allocate_new_computed_blocks`` and ``allocate_new_blocks`` (vLLM 0.34.0), which a
    first allocation mirrors group by group; the coordinators' ``cache_blocks`` differ
    and are called, not mirrored. ``KVCacheCoordinatorNoPrefixCache`` (no prefix hit to
    adopt, nothing cached) is vLLM's. AttributeError propagates."""
    eligible = _eligible(fp, fp.allocate_entry, manager, None)
    if eligible is _HYBRID:
        return True
    return (eligible is not None and eligible is not _CACHING_OFF
            and type(manager.coordinator) is fp.coordinator_cls)


cdef tuple _admit_ready(_HybridStep hp, _AllocateSlotsFastPath fp, manager, request, _Step* s,
                        _Admit* a, _HybridTokens* t, new_computed_blocks, bint has_scheduled_reqs,
                        bint delay_cache_blocks, vector[_AdmitGroup]& groups,
                        long long* free_blocks):
    """The checks of :func:`_hybrid_admission`, read only: the hybrid step's prelude
    (:func:`_hybrid_step_prelude`: classes, coordinator, request numbers) on a
    ``HybridKVCacheCoordinator`` without Mamba groups or a ``UnitaryKVCacheCoordinator``
    (:func:`_admission_coordinator`), no group retaining a longer hit,
    ``new_computed_blocks`` None or of vLLM's ``KVCacheBlocks`` class with one list per
    group, the pool's calls kvpool's (:func:`_pool_runs_no_code`), every group ready
    (:func:`_admit_group_ready`), then the pool's free count read natively.
    Returns ``(managers, request_id, hits)`` with the token counts in ``t`` / ``a``;
    None when vLLM's ``allocate_slots`` runs the call. AttributeError propagates."""
    cdef Py_ssize_t i
    cdef _AdmitGroup g
    pre = _hybrid_step_prelude(hp, fp, manager, request, s, has_scheduled_reqs,
                               delay_cache_blocks, t)
    if pre is None or t.served != 1 or t.no_prefix:
        return None
    managers, request_id, empty_blocks = pre
    retained = manager.retained_hit_group_ids
    if type(retained) is not tuple or len(<tuple>retained) != 0:
        return None
    if new_computed_blocks is None:
        hits = empty_blocks
    elif type(new_computed_blocks) is not fp.manager_module_dict["KVCacheBlocks"]:
        return None
    else:
        hits = new_computed_blocks.blocks
        if type(hits) is not tuple or len(<tuple>hits) != len(<tuple>managers):
            return None
    # (vLLM's test: the hit is not the manager's empty KVCacheBlocks' own tuple)
    a.adopt = hits is not empty_blocks
    pool = manager.block_pool
    if not _pool_runs_no_code(hp, pool):
        return None
    a.local = s.computed + a.hit
    a.total = a.local if a.local < s.max_len else s.max_len
    a.request_tokens = t.request_tokens
    t.main = a.total + s.new_tokens
    t.need = t.main + s.lookahead if t.main + s.lookahead < s.max_len else s.max_len
    t.processed = a.total - t.in_flight if a.total > t.in_flight else 0
    groups.clear()
    for i in range(len(<tuple>managers)):
        if not _admit_group_ready(hp, (<tuple>managers)[i], <str>request_id,
                                  (<tuple>empty_blocks)[i], (<tuple>hits)[i], pool, a, t, &g):
            return None
        groups.push_back(g)
    # (after the request's look-ups, as vLLM's get_num_free_blocks comes after them)
    if not _native_free_count(fp, pool, free_blocks):
        return None
    return (managers, request_id, hits)


cdef bint _admit_group_ready(_HybridStep hp, mgr, str request_id, empty_list, hits, pool,
                             _Admit* a, _HybridTokens* t, _AdmitGroup* g) except -1:
    """One group of a first allocation is read plainly: the manager and its spec of
    the exact classes the step mirrors with no mirrored method on the instance, a
    positive int ``block_size``, caching on, the pool's, plain ``new_block_ids``
    bookkeeping; ``req_to_blocks`` a ``defaultdict`` of vLLM's factory
    (``_HybridStep.table_factory``) with no block of the request,
    which has no ``num_cached_block`` / ``_partial_hit_reqs`` entry, the three dicts' keys
    all exact strs (``kvpool_str_keys_only``); the group's hit a
    list of kvpool blocks (:func:`_evictable_hits`; or an empty tuple) that ends on a block boundary (else
    the copy-on-write tail: vLLM's); the window's numbers exact ints. Fills ``g``;
    False: vLLM's code runs the call."""
    cdef long long skipped
    if (not _group_manager_plain(hp, mgr, &g.bs)
            or mgr.block_pool is not pool or mgr.enable_caching is not True
            or type(mgr._record_new_block_ids) is not bool or type(mgr.new_block_ids) is not list):
        return False
    g.cap = -1
    if a.full_fit:
        # (read before the request's dict look-ups, as get_num_blocks_to_allocate reads it)
        cap = mgr.max_admission_blocks_per_request
        if cap is not None and not _nonneg(cap, &g.cap):
            return False
    req_to_blocks = mgr.req_to_blocks
    num_cached_block = mgr.num_cached_block
    partial = mgr._partial_hit_reqs
    if (type(req_to_blocks) is not _defaultdict or hp.table_factory is None
            or req_to_blocks.default_factory is not hp.table_factory
            or type(num_cached_block) is not dict or type(partial) is not dict
            or not (type(empty_list) is tuple or type(empty_list) is list) or len(empty_list) != 0
            or not (type(hits) is list or (type(hits) is tuple and len(<tuple>hits) == 0))):
        return False
    # (every key an exact str: the look-ups below and vLLM's, of which it makes more, run
    # no Python code; a key whose __eq__ changes what is read next is vLLM's to call)
    if (not kvpool_str_keys_only(<PyObject*>req_to_blocks)
            or not kvpool_str_keys_only(<PyObject*>num_cached_block)
            or not kvpool_str_keys_only(<PyObject*>partial)):
        return False
    table = (<dict>req_to_blocks).get(request_id)
    if ((table is not None and (type(table) is not list or len(<list>table) != 0))
            or request_id in <dict>num_cached_block or request_id in <dict>partial):
        return False
    g.n_hits = len(hits)
    if g.n_hits > 0 and a.local % g.bs != 0:   # (_has_partial_local_hit)
        return False
    g.skip_total = g.skip_local = 0
    g.makes_entry = False
    if type(mgr) is hp.sliding_window_cls:
        # (remove_skipped_blocks reads the table when the window skips a token: the
        # skipped tokens are _sliding_skip's count in 1-token blocks)
        if (not _sliding_skip(mgr, a.total, g.bs, _NATIVE_INT_LIMIT, &g.skip_total)
                or not _sliding_skip(mgr, a.local, g.bs, _NATIVE_INT_LIMIT, &g.skip_local)
                or not _sliding_skip(mgr, t.processed, 1, _NATIVE_INT_LIMIT, &skipped)):
            return False
        g.makes_entry = skipped > 0
        if a.adopt and g.skip_local > 0:
            null_block = mgr._null_block
            if type(null_block) is not KVCacheBlock:
                return False
    g.ev_total = g.ev_local = 0
    if g.n_hits > 0:
        g.ev_total = _evictable_hits(<list>hits, g.skip_total)
        g.ev_local = _evictable_hits(<list>hits, g.skip_local)
    return g.ev_total >= 0 and g.ev_local >= 0


cdef long long _evictable_hits(list hits, long long start) except -2:
    """``_get_num_evictable_blocks(hits[start:])``: the blocks with ``ref_cnt == 0`` that
    are not the null block; -1 when a block is not kvpool's ``KVCacheBlock`` with an
    exact int ``ref_cnt`` and a bool ``is_null`` (its comparisons could run code)."""
    cdef Py_ssize_t i
    cdef long long n = 0
    cdef KVCacheBlock blk
    for i in range(start if start < len(hits) else len(hits), len(hits)):
        b = hits[i]
        if type(b) is not KVCacheBlock:
            return -1
        blk = <KVCacheBlock>b
        if (blk._ref_cnt_o is NULL or type(<object>blk._ref_cnt_o) is not int
                or (blk._is_null_o != kvpool_true() and blk._is_null_o != kvpool_false())):
            return -1
        if <object>blk._ref_cnt_o == 0 and blk._is_null_o == kvpool_false():
            n += 1
    return n


cdef inline long long _admit_count(long long num_tokens, _AdmitGroup* g, bint full) noexcept:
    """``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` (vLLM 0.34.0) for a
    request with no block in the group and no partial hit: ``full`` the full-sequence
    admission's call (``total_computed_tokens`` capped, ``apply_admission_cap``)."""
    cdef long long required = (num_tokens + g.bs - 1) // g.bs
    cdef long long skip = g.skip_total if full else g.skip_local
    if full and g.cap >= 0 and g.cap < required:
        required = g.cap
    required -= skip if skip > g.n_hits else g.n_hits
    return (required if required > 0 else 0) + (g.ev_total if full else g.ev_local)


cdef object _admit_run(_AllocateSlotsFastPath fp, manager, request, tuple ready, _Step* s,
                       _Admit* a, _HybridTokens* t, vector[_AdmitGroup]& groups,
                       long long free_blocks, bint delay_cache_blocks):
    """The phases of vLLM's ``allocate_slots`` after :func:`_admit_ready`: the
    full-sequence count against the free blocks, ``remove_skipped_blocks`` (no block to
    free: a sliding window's entry made where vLLM's reads the table), the count
    against the free blocks less the reserved ones, each group's
    ``add_local_computed_blocks`` (:func:`_adopt_hits`), then phases 3-5 of the hybrid
    step (:func:`_hybrid_allocate_and_cache`)."""
    cdef Py_ssize_t i, n = groups.size()
    cdef long long to_alloc = 0, full_tokens
    cdef vector[long long] sizes
    managers, request_id, hits = ready
    if a.full_fit:
        full_tokens = a.request_tokens if a.request_tokens < s.max_len else s.max_len
        for i in range(n):
            to_alloc += _admit_count(full_tokens, &groups[i], True)
            if to_alloc > _NATIVE_INT_LIMIT:
                to_alloc = _NATIVE_INT_LIMIT
        if to_alloc + s.watermark > free_blocks:
            return None
        to_alloc = 0
    for i in range(n):
        if groups[i].makes_entry:
            _request_table((<tuple>managers)[i], <str>request_id)
    for i in range(n):
        to_alloc += _admit_count(t.need, &groups[i], False)
        if to_alloc > _NATIVE_INT_LIMIT:
            to_alloc = _NATIVE_INT_LIMIT
        sizes.push_back(groups[i].bs)
    if to_alloc + s.watermark > free_blocks - s.reserved:
        return None
    if a.adopt:
        for i in range(n):
            _adopt_hits((<tuple>managers)[i], <str>request_id, (<tuple>hits)[i],
                        groups[i].skip_local)
    return _hybrid_allocate_and_cache(fp, manager, manager.coordinator, <tuple>managers, request,
                                      <str>request_id, to_alloc, t.need, t.main, sizes,
                                      delay_cache_blocks)


cdef list _request_table(mgr, str request_id):
    """``mgr.req_to_blocks[request_id]`` on vLLM's ``defaultdict`` (of vLLM's factory,
    checked by :func:`_admit_group_ready`): the request's table, which has no block yet,
    made by the factory when absent, as vLLM's code makes it."""
    table = mgr.req_to_blocks[request_id]
    if type(table) is not list or len(<list>table) != 0:
        raise RuntimeError(f"kvpool: the block tables of request {request_id!r} changed "
                           f"during allocate_slots")
    return <list>table


cdef int _adopt_hits(mgr, str request_id, hits, long long skip) except -1:
    """``SingleTypeKVCacheManager.add_local_computed_blocks`` (vLLM 0.34.0) for a
    request without blocks and a hit on a block boundary: the hit past the window's
    ``skip`` blocks touched (the pool's ``touch``), the table padded with ``skip`` null
    blocks and extended with it, ``num_cached_block`` its length.

    The table grows before the hit is touched (vLLM touches first; no code runs
    between the two here), and the touch is kvpool's ``BlockPool.touch`` (the pool's
    own: ``_pool_runs_no_code``) in two parts, the native touch (all or nothing, no
    Python frame between it and this code where a signal's exception could surface),
    then the policy's ``after_change``: an exception while the table grows or from the
    native touch leaves the table and the blocks as they were, where vLLM's order
    would keep the touched blocks held by no table (tests/native/manager_fault.py)."""
    table = _request_table(mgr, request_id)
    kept = hits[skip:] if skip > 0 else hits
    pool = mgr.block_pool
    cdef Py_ssize_t start = len(table)
    try:
        if skip > 0:
            table.extend([mgr._null_block] * skip)
        table.extend(kept)
        pool_touch(pool.free_block_queue, kept)
    except BaseException:
        while len(table) > start:
            table.pop()
        raise
    pool._policy.after_change(pool)
    mgr.num_cached_block[request_id] = len(table)
    return 0
