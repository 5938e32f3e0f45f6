# The running request's step under vLLM's HybridKVCacheCoordinator when it changes
# something (kvpool.patches.hybrid_fast_path; included by _core.pyx after
# hybrid_step.pxi, whose idle step is tried first).
#
# A model of full-attention and sliding-window groups only (gpt-oss, Gemma 3): every
# block_size tokens of a decode, and on every prefill chunk, a running request's step
# frees the blocks that left a sliding window, allocates a block in each group and
# caches the blocks it filled. vLLM 0.34.0's KVCacheManager.allocate_slots runs that
# as about thirty Python calls across the coordinator and the groups' managers.
# _hybrid_step_changes runs the same phases in the same order: the window's blocks
# freed group by group through the pool's free_blocks, the free-count check, each
# group's blocks from the pool's get_new_blocks, then the coordinator's cache_blocks
# (kvpool's binding: group by group) and the KVCacheBlocks vLLM's
# create_kv_cache_blocks builds. It reads everything before the first change, so it
# runs only where nothing between the changes can run code of another party: the
# pool's free_blocks and get_new_blocks are kvpool's own (class and instance), with no
# reuse watcher, metrics collector or patched pool method (_needs_vllm_loop), and
# every group's new_block_ids bookkeeping is a plain bool and list. vLLM's code
# re-reads the managers between the phases; code run there (a patched pool method)
# could change what it reads, so such a pool keeps vLLM's call from the start.


cdef bint _sliding_skip(mgr, long long processed, long long bs, Py_ssize_t n_table,
                        long long* n_skip) except -1:
    """``SlidingWindowManager.get_num_skipped_tokens(processed) // block_size``, capped
    at the table's length as ``remove_skipped_blocks`` caps it, into ``n_skip`` (0:
    nothing to walk); False when ``sliding_window`` or ``extra_retained_tokens`` is not
    an exact non-negative int (vLLM's arithmetic)."""
    cdef long long window, extra, skipped
    if not _nonneg(mgr.sliding_window, &window) or not _nonneg(mgr.extra_retained_tokens, &extra):
        return False
    skipped = processed - window + 1 - extra
    n_skip[0] = 0
    if skipped > 0:
        n_skip[0] = skipped // bs
        if n_skip[0] > n_table:
            n_skip[0] = n_table
    return True


cdef Py_ssize_t _removal_end(list blocks, long long n_skip, object null_block,
                             object pool) except -3:
    """``_remove_blocks_in_range(request_id, 0, n_skip)``'s walk, read only: the index
    below which it stops (the last null block at or below ``n_skip - 1``, else -1), or
    -2 when a block it would compare with the null block is not one whose ``==`` is
    False without running Python code (kvpool's exact ``KVCacheBlock`` with an int id
    other than the null block's: the dataclass equality compares ids first), or is not
    ``pool``'s own (the pool's free would forward it to another pool, whose free could
    raise after this pool's: :func:`_remove_skipped` puts the blocks back into the
    table only when nothing was freed). The null block itself: kvpool's exact
    ``KVCacheBlock`` with an int id (checked by the caller)."""
    cdef Py_ssize_t i
    cdef KVCacheBlock blk
    null_id = <object>(<KVCacheBlock>null_block)._block_id_o
    owner = _block_owner(pool)
    if n_skip > len(blocks):
        return -2
    for i in range(n_skip - 1, -1, -1):
        b = blocks[i]
        if b is null_block:
            return i
        if type(b) is not KVCacheBlock:
            return -2
        blk = <KVCacheBlock>b
        if blk._block_id_o is NULL or type(<object>blk._block_id_o) is not int \
                or <object>blk._block_id_o == null_id or blk.pool is not owner:
            return -2
    return -1


cdef bint _hybrid_groups_ready(_HybridStep hp, tuple managers, str request_id,
                               tuple empty_blocks, pool, _HybridTokens* t,
                               long long computed, list tables, vector[long long]& sizes,
                               vector[long long]& skips, vector[long long]& floors) except -1:
    """Every group of a full + sliding-window coordinator is one the step reads plainly
    (:func:`_hybrid_group_ready`) on ``pool``, its ``_record_new_block_ids`` a bool and
    ``new_block_ids`` a list, and a sliding window's blocks to free
    compare with its null block without running Python code (:func:`_removal_end`):
    its table appended to ``tables``, its block size and the number of blocks its
    removal walk starts from (0: nothing to free) to ``sizes`` / ``skips``, and to
    ``floors`` the table length below which vLLM's ``get_num_blocks_to_allocate`` does
    not count (0; with prefix caching off, for a request without a ``num_cached_block``
    entry, the blocks ``get_num_skipped_tokens(computed)`` skips). False: vLLM's code
    runs the call."""
    cdef long long bs, n_cached, n_skip, n_floor
    cdef Py_ssize_t i
    for i in range(len(managers)):
        mgr = managers[i]
        blocks = _hybrid_group_ready(hp, mgr, request_id, empty_blocks[i], &bs, &n_cached,
                                     t.no_prefix)
        if (blocks is None or mgr.block_pool is not pool
                or type(mgr._record_new_block_ids) is not bool or type(mgr.new_block_ids) is not list):
            return False
        n_skip = n_floor = 0
        if type(mgr) is hp.sliding_window_cls:
            if not _sliding_skip(mgr, t.processed, bs, len(<list>blocks), &n_skip):
                return False
            if n_cached < 0 and not _sliding_skip(mgr, computed, bs, _NATIVE_INT_LIMIT, &n_floor):
                return False
            if n_skip > 0:
                null_block = mgr._null_block
                if (type(null_block) is not KVCacheBlock
                        or (<KVCacheBlock>null_block)._block_id_o is NULL
                        or type(<object>(<KVCacheBlock>null_block)._block_id_o) is not int
                        or _removal_end(<list>blocks, n_skip, null_block, pool) == -2):
                    return False
        tables.append(blocks)
        sizes.push_back(bs)
        skips.push_back(n_skip)
        floors.push_back(n_floor)
    return True


cdef int _remove_skipped(tuple managers, str request_id, list tables,
                         vector[long long]& skips) except -1:
    """``coordinator.remove_skipped_blocks``: group by group, the blocks of the walk
    replaced by the null block and handed to the pool's ``free_blocks`` in the walk's
    (descending) order, as ``_remove_blocks_in_range`` does. The checks found the walks
    plain and the pool's free runs no code of another party (module comment); a table
    that changed all the same (a finalizer run by the garbage collector; none does in
    vLLM) raises RuntimeError rather than free what the checks did not see. An
    exception while a group's walk is collected or freed puts its blocks back in
    the table (the pool's free changes nothing when it raises)."""
    cdef Py_ssize_t i, j, end
    for i in range(len(managers)):
        if skips[i] == 0:
            continue
        mgr = managers[i]
        blocks = tables[i]
        null_block = mgr._null_block
        freed = []              # (before the walk is read: creating it may run the collector)
        if ((<dict>mgr.req_to_blocks).get(request_id) is not blocks
                or type(null_block) is not KVCacheBlock):
            end = -2
        else:
            end = _removal_end(<list>blocks, skips[i], null_block, mgr.block_pool)
        if end == -2:
            raise RuntimeError(f"kvpool: the block tables of request {request_id!r} changed "
                               f"during allocate_slots")
        if end == skips[i] - 1:
            continue            # the walk's first block is already the null block
        pool = mgr.block_pool
        try:
            for j in range(skips[i] - 1, end, -1):
                freed.append((<list>blocks)[j])
                (<list>blocks)[j] = null_block
            # kvpool's BlockPool.free_blocks (the pool's own: _pool_runs_no_code) in two
            # parts: its native free, all or nothing and without a Python frame between
            # it and this code where a signal's exception could surface, ...
            others = pool_free_blocks(pool, pool.free_block_queue, freed, pool.enable_caching)
        except BaseException:
            # A MemoryError growing freed, or from the native free (which then freed
            # nothing: its first use of a longer list grows its scratch arrays): the
            # blocks taken out of the table go back into it, where vLLM's walk would
            # keep them held by no table (tests/native/manager_fault.py).
            for j in range(len(freed)):
                (<list>blocks)[skips[i] - 1 - j] = freed[j]
            raise
        # ... then what it does after its loop (the blocks are freed: nothing goes back)
        if others:
            for other, other_blocks in others.items():
                other.free_blocks(other_blocks)
        pool._policy.after_free(pool)
    return 0


cdef bint _pool_runs_no_code(_HybridStep hp, pool) except -1:
    """The pool's ``free_blocks``, ``get_new_blocks`` and ``touch`` are kvpool's own (``hp``'s, on
    its class and not set on the instance) and take kvpool's native loops: a pool
    ``BlockPool.__init__`` built, with its kvpool queue, no reuse watcher, metrics
    collector or patched method they call (``_needs_vllm_loop``). (The step calls the
    native free and touch those methods run directly: :func:`_remove_skipped`,
    :func:`_adopt_hits`.)"""
    cls = type(pool)
    return (hp.pool_free_blocks is not None
            and getattr(pool, "_kvpool_init", False) is True
            and type(getattr(pool, "free_block_queue", None)) is FreeKVCacheBlockQueue
            and getattr(cls, "free_blocks", None) is hp.pool_free_blocks
            and getattr(cls, "get_new_blocks", None) is hp.pool_get_new_blocks
            and getattr(cls, "_needs_vllm_loop", None) is hp.pool_needs_vllm_loop
            and getattr(cls, "touch", None) is hp.pool_touch
            and _not_overridden(pool, _POOL_STEP_NAMES)
            and pool._needs_vllm_loop() is False
            and _policy_hooks_own(hp, pool._policy))


cdef tuple _POOL_STEP_NAMES = ("free_blocks", "get_new_blocks", "_needs_vllm_loop", "touch")
cdef tuple _POLICY_HOOK_NAMES = ("after_change", "after_free")


cdef bint _policy_hooks_own(_HybridStep hp, policy) except -1:
    """``policy`` is of one of kvpool's policy classes whose ``after_change`` and
    ``after_free`` are kvpool's (``hp.policy_hooks``), not set on the instance: the hooks
    the steps run after the pool's native loops, in another place than the pool's methods
    run them (after the table changed), are code that reads no table. A hook patched
    after install keeps vLLM's call, which runs it where the pool's method does."""
    cls = type(policy)
    for hooks in hp.policy_hooks:
        if (<tuple>hooks)[0] is cls:
            return (getattr(cls, "after_change", None) is (<tuple>hooks)[1]
                    and getattr(cls, "after_free", None) is (<tuple>hooks)[2]
                    and _not_overridden(policy, _POLICY_HOOK_NAMES))
    return False


cdef tuple _hybrid_changes_ready(_HybridStep hp, _AllocateSlotsFastPath fp, manager, request,
                                 _Step* s, bint has_scheduled_reqs, bint delay_cache_blocks,
                                 _HybridTokens* t, long long* free_blocks, list tables,
                                 vector[long long]& sizes, vector[long long]& skips,
                                 vector[long long]& floors):
    """The checks of :func:`_hybrid_step_changes`, read only: the step's prelude
    (:func:`_hybrid_step_prelude`, read again: the idle test between may have read a
    pool attribute), no Mamba group, the pool's free count read natively into
    ``free_blocks`` and its free / allocation running no code of another party
    (:func:`_pool_runs_no_code`), every group ready (:func:`_hybrid_groups_ready`: its
    table in ``tables``, block size in ``sizes``, the block its removal walk starts
    from in ``skips``, its allocation count's floor in ``floors``). Returns the
    coordinator's managers, the token counts in ``t``; None when vLLM's
    ``allocate_slots`` runs the call."""
    pre = _hybrid_step_prelude(hp, fp, manager, request, s, has_scheduled_reqs,
                               delay_cache_blocks, t)
    if pre is None or t.served != 1:
        return None
    managers, request_id, empty_blocks = pre
    pool = manager.block_pool
    if not _native_free_count(fp, pool, free_blocks) or not _pool_runs_no_code(hp, pool):
        return None
    del tables[:]
    sizes.clear()
    skips.clear()
    floors.clear()
    if not _hybrid_groups_ready(hp, <tuple>managers, <str>request_id, <tuple>empty_blocks,
                                pool, t, s.computed, tables, sizes, skips, floors):
        return None
    return <tuple>managers


cdef object _hybrid_step_changes(_HybridStep hp, _AllocateSlotsFastPath fp, manager, request,
                                 _Step* s, bint has_scheduled_reqs, bint delay_cache_blocks):
    """vLLM 0.34.0's ``KVCacheManager.allocate_slots`` for a running request of a model
    whose groups are all full attention or sliding window (no Mamba group), when the
    step frees, allocates or caches: the result vLLM's returns (``KVCacheBlocks`` of
    the groups' new blocks, the manager's empty one, or None where the free count
    refuses the step after the window's blocks were freed, as vLLM's does); _VLLM
    before any change when a check fails (:func:`_hybrid_changes_ready`; an attribute
    missing where it reads one counts as a failed check: vLLM's code reads it, or not).
    Exceptions of the pool's calls propagate, as from vLLM's."""
    cdef long long free_blocks, to_alloc = 0, n, n_table
    cdef _HybridTokens t
    cdef vector[long long] sizes, skips, floors
    cdef Py_ssize_t i
    tables = []
    try:
        managers = _hybrid_changes_ready(hp, fp, manager, request, s, has_scheduled_reqs,
                                         delay_cache_blocks, &t, &free_blocks, tables, sizes,
                                         skips, floors)
    except AttributeError:
        return _VLLM
    if managers is None:
        return _VLLM
    coordinator = manager.coordinator
    request_id = request.request_id
    # 1. remove_skipped_blocks (before the free-count check, as vLLM's)
    _remove_skipped(<tuple>managers, <str>request_id, tables, skips)
    if not _native_free_count(fp, manager.block_pool, &free_blocks):
        raise RuntimeError("kvpool: the block pool changed during allocate_slots")
    # 2. get_num_blocks_to_allocate (a running request: no new hit) and the free count
    for i in range(len(tables)):
        n_table = len(<list>tables[i])
        n = (t.need + sizes[i] - 1) // sizes[i] - (floors[i] if floors[i] > n_table else n_table)
        if n > 0:
            to_alloc += n
            if to_alloc > _NATIVE_INT_LIMIT:   # (refused below whatever the free count:
                to_alloc = _NATIVE_INT_LIMIT   # vLLM's sum, a Python int, never wraps)
    hp.native_changes += 1
    if to_alloc + s.watermark > free_blocks - s.reserved:
        return None
    return _hybrid_allocate_and_cache(fp, manager, coordinator, <tuple>managers, request,
                                      <str>request_id, to_alloc, t.need, t.main, sizes,
                                      delay_cache_blocks)


cdef object _hybrid_allocate_and_cache(_AllocateSlotsFastPath fp, manager, coordinator,
                                       tuple managers, request, str request_id,
                                       long long to_alloc, long long need, long long main,
                                       vector[long long]& sizes, bint delay_cache_blocks):
    """The step's phases 3-5: each group's ``allocate_new_blocks`` in group order
    (:func:`_extend_table`: the pool's ``get_new_blocks``, the table and
    ``new_block_ids`` extended), the coordinator's ``cache_blocks(request,
    min(computed + new tokens, request.num_tokens))`` unless delayed, and
    ``create_kv_cache_blocks``: ``KVCacheBlocks`` of the per-group lists when a group
    got blocks, else the manager's empty one."""
    cdef Py_ssize_t i
    cdef bint any_new = False
    if fp.manager_hooks and to_alloc > 0:
        # what kvpool.allocation.base.table_of_caller finds above vLLM's managers
        policy = getattr(manager.block_pool, "_policy", None)
        prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
        if policy is not None and type(prompt) is int and type(max_tokens) is int:
            policy.expect_tokens(request_id, prompt + max_tokens)
    new_blocks = []
    for i in range(len(managers)):
        group_new = _extend_table(fp, managers[i], request_id, need, sizes[i])
        if group_new is None:
            group_new = []
        elif len(<list>group_new) > 0:
            any_new = True
        new_blocks.append(group_new)
    if not delay_cache_blocks:
        coordinator.cache_blocks(request, min(main, request.num_tokens))
    if not any_new:
        return manager.empty_kv_cache_blocks
    return fp.manager_module_dict["KVCacheBlocks"](tuple(new_blocks))
