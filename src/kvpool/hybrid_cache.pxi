# HybridKVCacheCoordinator.cache_blocks when it caches nothing (included by _core.pyx after
# hybrid_step.pxi and mamba_step.pxi; kv_cache_coordinator_cache_blocks, bound as the
# hybrid coordinator's cache_blocks by kvpool.patches.hybrid_fast_path, calls it).
#
# With Mamba layers, prefix caching on and synchronous scheduling, vLLM 0.34.0's
# Scheduler.update_from_output calls KVCacheManager.cache_blocks for every running
# request after every step, to publish finished states; on a decode step nearly all of
# those calls cache nothing in any group, after about a dozen Python calls per group.
# _hybrid_cache_blocks recognises them from what vLLM's code reads, as the idle step's
# caching test does; every other call is vLLM's.


cdef object _hybrid_cache_blocks(_AllocateSlotsFastPath fp, coordinator, request,
                                 num_computed_tokens, long long n):
    """vLLM 0.34.0's ``KVCacheCoordinator.cache_blocks(request, n)`` on
    ``HybridKVCacheCoordinator``: None at once when no group would cache a block or a
    partial tail (:func:`_hybrid_caches_nothing`), else vLLM's function. An attribute
    missing where the test reads one leaves the call to vLLM's code, which reads it, or
    not, as it does."""
    cdef _HybridStep hp = _hybrid
    cdef int served = 0
    try:
        managers = _hybrid_cache_prelude(hp, fp, coordinator, request, &served)
        nothing = managers is not None and _hybrid_caches_nothing(hp, coordinator, request,
                                                                   <tuple>managers, n)
        if managers is not None and not nothing and served == 1:
            # read again: the test between read pool attributes (as the changing step does)
            managers = _hybrid_cache_prelude(hp, fp, coordinator, request, &served)
    except AttributeError:
        managers, nothing = None, False
    if nothing:
        hp.native_cache_calls += 1
        return None
    if managers is not None and served == 1:
        hp.group_cache_calls += 1
        _hybrid_cache_groups(hp, fp, coordinator, <tuple>managers, request, num_computed_tokens, n)
        return None
    hp.vllm_cache_calls += 1
    return fp.vanilla_cache_blocks(coordinator, request, num_computed_tokens)


cdef tuple _hybrid_cache_prelude(_HybridStep hp, _AllocateSlotsFastPath fp, coordinator,
                                 request, int* served):
    """The checks both native ``cache_blocks`` paths start with, read only: the request
    of the native path's class, the mirrored classes unchanged, a coordinator of served
    managers (``served``: 1, or 2 with a Mamba group; :func:`_hybrid_managers_served`)
    with no mirrored method on its instance and plain numbers
    (:func:`_hybrid_coordinator_plain`), the request's id a ``str`` and its prompt
    length an int (``replay_boundaries`` reads it). Returns the coordinator's managers;
    None otherwise (vLLM's function). AttributeError propagates (the caller's: vLLM's
    function)."""
    if type(request) is not fp.request_cls or not hp.classes_unchanged():
        return None
    managers = coordinator.single_type_managers
    served[0] = _hybrid_managers_served(hp, managers)
    if (not served[0]
            or not _not_overridden(coordinator, hp.coordinator_names)
            or not _hybrid_coordinator_plain(coordinator, False)
            or type(request.request_id) is not str or type(request.num_prompt_tokens) is not int):
        return None
    return <tuple>managers


cdef int _hybrid_cache_groups(_HybridStep hp, _AllocateSlotsFastPath fp, coordinator,
                              tuple managers, request, num_computed_tokens,
                              long long n) except -1:
    """vLLM 0.34.0's ``KVCacheCoordinator.cache_blocks`` on a full + sliding-window
    ``HybridKVCacheCoordinator`` without EAGLE (:func:`_hybrid_cache_prelude`), group by
    group in vLLM's order: ``replay_boundaries`` without EAGLE is ``(num_prompt_tokens -
    1,)``; a group with caching off is skipped; a full-attention group caches its full
    blocks natively (:func:`_full_group_cache_native`) where it can; every other group's
    ``cache_blocks`` is called as vLLM calls it, with the coordinator's
    ``get_num_cacheable_tokens`` for it, ``retention_interval`` and the boundaries."""
    cdef Py_ssize_t i
    cdef long long sbs, n_cacheable = n
    if coordinator.enable_partial_hash_hits is False:   # (a bool: _hybrid_coordinator_plain)
        _nonneg(coordinator.scheduler_block_size, &sbs)
        n_cacheable = n // sbs * sbs
    boundaries = (request.num_prompt_tokens - 1,)
    for i in range(len(managers)):
        mgr = managers[i]
        if not mgr.enable_caching:
            continue
        if _full_group_cache_native(hp, fp, mgr, request, n_cacheable):
            continue
        mgr.cache_blocks(request, coordinator.get_num_cacheable_tokens(num_computed_tokens, i),
                         retention_interval=coordinator.retention_interval,
                         replay_boundaries=boundaries)
    return 0


cdef bint _full_group_cache_native(_HybridStep hp, _AllocateSlotsFastPath fp, mgr, request,
                                   long long n_cacheable) except -1:
    """One full-attention group's ``cache_blocks(request, n_cacheable)`` natively: the
    manager and spec of vLLM's exact classes, no mirrored method on the instance, no
    EAGLE (``get_num_cacheable_tokens`` is then ``n_cacheable``), the request's
    ``shared_prefix_boundary`` an int or None (vLLM tests its truth; a full-attention
    group's mask is None either way), then :func:`_cache_group_native`. False before
    any change: the group's ``cache_blocks`` is vLLM's to run."""
    if (type(mgr) is not hp.full_attention_cls or type(mgr.kv_cache_spec) is not hp.full_spec_cls
            or not _not_overridden(mgr, hp.single_type_names) or mgr.use_eagle is not False):
        return False
    boundary = request.shared_prefix_boundary
    if boundary is not None and type(boundary) is not int:
        return False
    return _cache_group_native(fp, mgr, request, request.request_id, n_cacheable)


cdef bint _hybrid_caches_nothing(_HybridStep hp, coordinator, request, tuple managers,
                                 long long n) except -1:
    """After :func:`_hybrid_cache_prelude` (``managers``): every group with
    ``enable_caching`` caches nothing for ``get_num_cacheable_tokens(n)`` tokens
    (:func:`_group_caches_nothing`; the request's ``block_hashes`` a list, its
    ``num_computed_tokens`` an exact int, which a Mamba group's tail reads); False
    otherwise."""
    cdef long long sbs, n_cacheable, computed
    cdef Py_ssize_t i, n_hashes
    request_id = request.request_id
    block_hashes = request.block_hashes
    if type(block_hashes) is not list or not _nonneg(request.num_computed_tokens, &computed):
        return False
    n_hashes = len(<list>block_hashes)
    n_cacheable = n
    if coordinator.enable_partial_hash_hits is False:   # (a bool: _hybrid_coordinator_plain)
        _nonneg(coordinator.scheduler_block_size, &sbs)
        n_cacheable = n // sbs * sbs
    for i in range(len(managers)):
        if not _group_caches_nothing(hp, managers[i], request, <str>request_id,
                                     n_cacheable, n_hashes, computed):
            return False
    return True


cdef bint _group_caches_nothing(_HybridStep hp, mgr, request, str request_id,
                                long long n_cacheable, Py_ssize_t n_hashes,
                                long long computed) except -1:
    """One group's ``cache_blocks(request, n_cacheable)`` caches nothing in vLLM 0.34.0's
    code: caching off for it (the coordinator skips it), or its full blocks up to
    ``min(n_cacheable, hashed tokens)`` cached (``num_cached_block``, 0 when absent, as
    vLLM reads it), with no partial prompt tail (a full-attention group's block the hash
    block; a Mamba group in align mode with no checkpoint this step and
    :func:`_mamba_tail_cached`). False: vLLM's code runs the call."""
    cdef long long bs, hash_bs, n_cached = 0
    cdef object t = type(mgr)
    if mgr.enable_caching is False:
        return True
    if t is hp.full_attention_cls:
        spec_cls = hp.full_spec_cls
    elif t is hp.sliding_window_cls:
        spec_cls = hp.sliding_spec_cls
    else:
        spec_cls = hp.mamba_spec_cls   # (_hybrid_managers_served: MambaManager, armed)
        if not _not_overridden(mgr, hp.mamba_names):
            return False
    if (type(mgr.kv_cache_spec) is not spec_cls   # (its prefix_cacheable: vLLM's, checked)
            or not _not_overridden(mgr, hp.single_type_names)
            or not _nonneg(mgr.block_size, &bs) or bs == 0):
        return False
    num_cached_block = mgr.num_cached_block
    if type(num_cached_block) is not dict:
        return False
    cached = (<dict>num_cached_block).get(request_id)
    if cached is not None and not _nonneg(cached, &n_cached):
        return False
    if (not _full_blocks_cached(mgr, n_cached, n_cacheable, n_hashes, bs, &hash_bs)
            or hash_bs == 0):
        return False
    if t is hp.full_attention_cls:
        return bs == hash_bs
    if t is hp.sliding_window_cls:
        return True
    mode = mgr.mamba_cache_mode
    checkpoints = mgr._checkpoints
    req_to_blocks = mgr.req_to_blocks
    if (type(mode) is not str or mode != "align" or type(checkpoints) is not dict
            or request_id in <dict>checkpoints
            or not (type(req_to_blocks) is dict or type(req_to_blocks) is _defaultdict)):
        return False
    blocks = (<dict>req_to_blocks).get(request_id)
    if type(blocks) is not list:
        return False
    return _mamba_tail_cached(mgr, request, request_id, <list>blocks, n_cacheable, bs, hash_bs,
                              computed)
