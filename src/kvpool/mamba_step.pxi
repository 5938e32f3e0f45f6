# A Mamba / linear-attention KV cache group's part of the hybrid idle step
# (hybrid_step.pxi; included by _core.pyx after it; kvpool.patches.hybrid_fast_path arms
# it with MAMBA_MIRRORED's fingerprint).
#
# In vLLM 0.34.0's mamba_cache_mode="align" a decoding request keeps one running state
# block per group (and the prompt's boundary state); its table grows by one block each
# block_size tokens. The other steps of MambaManager's remove_skipped_blocks /
# get_num_blocks_to_allocate / allocate_new_blocks / cache_blocks read the request's
# bookkeeping (_num_retired_blocks, last_state_block_idx, _checkpoints,
# _allocated_block_reqs, _partial_hit_reqs) and change nothing. _mamba_group_idle
# recognises those steps from the same attributes; every other one (a block retired or
# allocated, a checkpoint, a partial tail cached, a copy-on-write) is vLLM's.
# With prefix caching off (mamba_cache_mode="none") a request holds one state block of
# max_model_len tokens per group, and _mamba_none_idle recognises the base class's steps
# that keep it.


cdef inline long long _floor_div(long long a, long long b):
    """Python's ``a // b`` for ``b > 0`` (C's division truncates toward zero)."""
    if a >= 0:
        return a // b
    return -((-a + b - 1) // b)


cdef long long _mamba_checkpoint_position(long long num_tokens, long long hash_bs,
                                          bint drop_eagle_block, long long lookahead):
    """vLLM 0.34.0's ``kv_cache_interface.get_mamba_prefill_checkpoint_position``
    (``hash_bs > 0``, ``lookahead >= 0``)."""
    cdef long long proof_limit = num_tokens
    if not drop_eagle_block:
        proof_limit -= lookahead if lookahead > 1 else 1
    cdef long long position = _floor_div(proof_limit, hash_bs) * hash_bs
    if drop_eagle_block:
        position -= hash_bs
    return position if position > 0 else 0


cdef bint _mamba_state_kept(mgr, dict retired, dict last_state, str request_id, list blocks,
                            long long processed, long long bs) except -1:
    """``MambaManager.remove_skipped_blocks`` (align mode) changes nothing: the blocks
    before the last computed token's are already retired (``_num_retired_blocks`` covers
    ``min((processed - 1) // block_size, len(table))``: vLLM's ``_remove_blocks_in_range``
    would otherwise walk them and write the count), and the state block of two steps ago
    (``last_state_block_idx``) is still needed or already the null block (by identity;
    one merely equal to it is vLLM's)."""
    cdef long long n_skip, n_retired = 0, last_idx
    if processed - 1 > 0:
        value = retired.get(request_id)
        if value is not None and not _nonneg(value, &n_retired):
            return False
        n_skip = (processed - 1) // bs
        if n_skip > len(blocks):   # (read after the look-up, which may run a key's __eq__)
            n_skip = len(blocks)
        if n_skip > n_retired:
            return False
    value = last_state.get(request_id)
    if value is None:
        return True
    if not _nonneg(value, &last_idx):
        return False
    if last_idx >= (processed + bs - 1) // bs - 1:
        return last_idx < len(blocks)   # (vLLM reads no block; one past the table is vLLM's)
    return _null_block_at(mgr, blocks, last_idx)   # (vLLM compares with !=)


cdef bint _mamba_tail_cached(mgr, request, str request_id, list blocks, long long n_tokens,
                             long long bs, long long hash_bs, long long computed) except -1:
    """``MambaManager._cache_partial_tail_block`` (align mode, no checkpoint this step)
    registers nothing for ``n_tokens`` cacheable tokens: not a positive multiple of the
    hash block, not the prompt's last hash boundary (nor, with
    ``shared_prefix_checkpoint``, the request's shared-prefix boundary inside the prompt
    chunk being computed), or its block is past the table, the null block or already
    keyed at ``n_tokens``."""
    cdef long long lookahead, boundary, prompt
    cdef Py_ssize_t block_idx
    if n_tokens <= 0 or n_tokens % hash_bs != 0:
        return True
    drop = mgr.drop_eagle_checkpoint_block
    shared = mgr.shared_prefix_checkpoint
    if ((drop is not True and drop is not False) or (shared is not True and shared is not False)
            or not _nonneg(mgr.block_pool.num_hash_lookahead_tokens, &lookahead)
            or not _nonneg(request.num_prompt_tokens, &prompt)):
        return False
    boundary = _mamba_checkpoint_position(prompt, hash_bs, drop is True, lookahead)
    if n_tokens != boundary:
        if shared is False:
            return True
        # vLLM: shared and n_tokens == request.shared_prefix_boundary and computed < n_tokens
        # <= prompt, in that order (an == of another type than int or None may run code)
        spb = request.shared_prefix_boundary
        if spb is None:
            return True
        if type(spb) is not int:
            return False
        return spb != n_tokens or computed >= n_tokens or n_tokens > prompt
    block_idx = (n_tokens + bs - 1) // bs - 1
    if block_idx >= len(blocks):
        return True
    source = blocks[block_idx]
    if type(source) is not KVCacheBlock:
        return False
    # (vLLM tests is_null's truth; a value other than a bool is vLLM's to test)
    is_null = (<KVCacheBlock>source)._is_null_o
    if is_null == kvpool_true():
        return True
    if is_null != kvpool_false():
        return False
    cached_at = (<KVCacheBlock>source)._block_hash_num_tokens
    return type(cached_at) is int and cached_at == n_tokens


cdef bint _mamba_none_idle(mgr, str request_id, long long need, long long processed,
                           long long bs, empty_list) except -1:
    """One Mamba group in ``mamba_cache_mode="none"`` (prefix caching off: vLLM's
    ``KVCacheCoordinatorNoPrefixCache``; one state block of ``max_model_len`` tokens per
    request) does nothing in this step. vLLM 0.34.0's ``MambaManager`` then runs the
    base class's methods: ``remove_skipped_blocks`` keeps the last computed token's
    state (``get_num_skipped_tokens``: ``processed - 1``) and frees no block (the walk's
    first block, ``(processed - 1) // block_size - 1`` capped at the table, is none or
    already the null block, by identity); ``get_num_blocks_to_allocate`` and
    ``allocate_new_blocks`` find ``cdiv(need + block_size * num_speculative_blocks,
    block_size)`` blocks within the table (either branch of the former then gives 0);
    ``cache_blocks`` skips the group (``enable_caching`` False, which vLLM requires of
    this mode). False: vLLM's code runs the call."""
    cdef long long n_spec, spec_bs, n_skip, required
    if mgr.enable_caching is not False or not _nonneg(mgr.num_speculative_blocks, &n_spec):
        return False
    if n_spec > 0:
        # (get_num_blocks_to_allocate adds the spec's block size, allocate_new_blocks the
        # manager's: vLLM sets both from the spec)
        if (not _nonneg(mgr.kv_cache_spec.block_size, &spec_bs) or spec_bs != bs
                or bs > _NATIVE_INT_LIMIT // n_spec):
            return False
    # (num_cached_block: vLLM's get_num_blocks_to_allocate tests the request's entry, on
    # either of its branches the same count here)
    blocks = _group_table(mgr, request_id, empty_list, NULL, True)
    if blocks is None:
        return False
    n_skip = (processed - 1) // bs if processed > 1 else 0
    if n_skip > len(<list>blocks):
        n_skip = len(<list>blocks)
    if n_skip > 0 and not _null_block_at(mgr, <list>blocks, n_skip - 1):   # (vLLM's walk: ==)
        return False
    required = (need + n_spec * bs + bs - 1) // bs
    return required <= len(<list>blocks)


cdef bint _mamba_group_idle(_HybridStep hp, mgr, request, str request_id, long long main,
                            long long need, long long processed, long long n_cacheable,
                            Py_ssize_t n_hashes, long long computed, empty_list,
                            long long* to_alloc) except -1:
    """One Mamba group (``MambaManager`` of a ``MambaSpec`` in ``mamba_cache_mode="align"``)
    of a running request does nothing in this step, in vLLM 0.34.0's code:
    ``remove_skipped_blocks`` retires and frees no block (:func:`_mamba_state_kept`),
    ``get_num_blocks_to_allocate`` finds ``cdiv(main, block_size) +
    num_speculative_blocks`` within the table (its result, at most 0, is added to
    ``to_alloc``), no prefill checkpoint (``has_prefill_checkpoint_blocks`` False) and no
    pending copy-on-write or checkpoint of the request, ``allocate_new_blocks`` finds the
    request already in ``_allocated_block_reqs``, and ``cache_blocks`` (``n_cacheable``:
    the coordinator's ``get_num_cacheable_tokens``; -1: not called) finds its full blocks
    cached and no partial tail to register (:func:`_mamba_tail_cached`). A group in
    ``mamba_cache_mode="none"`` is :func:`_mamba_none_idle`'s (``need``: the tokens
    that need a slot, lookahead included). False: vLLM's code runs the call."""
    cdef long long bs, n_spec, align, hash_bs, n_cached, lookahead, required
    if (type(mgr.kv_cache_spec) is not hp.mamba_spec_cls   # (its prefix_cacheable: vLLM's, checked)
            or not _not_overridden(mgr, hp.single_type_names)
            or not _not_overridden(mgr, hp.mamba_names)
            or not _nonneg(mgr.block_size, &bs) or bs == 0):
        return False
    mode = mgr.mamba_cache_mode
    if type(mode) is str and mode == "none":
        return _mamba_none_idle(mgr, request_id, need, processed, bs, empty_list)
    if type(mode) is not str or mode != "align" or mgr.has_prefill_checkpoint_blocks is not False:
        return False
    # (get_num_blocks_to_allocate computes the checkpoint position before it finds no
    # checkpoint block: the numbers it reads must not make it raise)
    drop = mgr.drop_eagle_checkpoint_block
    if (not _nonneg(mgr.num_speculative_blocks, &n_spec)
            or not _nonneg(mgr.cache_hit_alignment_tokens, &align) or align == 0
            or (drop is not True and drop is not False)
            or not _nonneg(mgr.block_pool.num_hash_lookahead_tokens, &lookahead)):
        return False
    req_to_blocks = mgr.req_to_blocks
    num_cached_block = mgr.num_cached_block
    retired = mgr._num_retired_blocks
    last_state = mgr.last_state_block_idx
    allocated = mgr._allocated_block_reqs
    if (not (type(req_to_blocks) is dict or type(req_to_blocks) is _defaultdict)
            or type(num_cached_block) is not dict or type(retired) is not dict
            or type(last_state) is not dict or type(allocated) is not set
            or type(mgr._partial_hit_reqs) is not dict or type(mgr._checkpoints) is not dict
            or not (type(empty_list) is tuple or type(empty_list) is list) or len(empty_list) != 0):
        return False
    blocks = (<dict>req_to_blocks).get(request_id)
    cached = (<dict>num_cached_block).get(request_id)
    if (type(blocks) is not list or cached is None or not _nonneg(cached, &n_cached)
            or request_id in <dict>mgr._partial_hit_reqs or request_id in <dict>mgr._checkpoints
            or request_id not in <set>allocated
            or not _mamba_state_kept(mgr, <dict>retired, <dict>last_state, request_id,
                                     <list>blocks, processed, bs)):
        return False
    required = (main + bs - 1) // bs + n_spec
    if required > len(<list>blocks):
        return False
    to_alloc[0] += required - len(<list>blocks)
    if n_cacheable < 0 or mgr.enable_caching is False:   # (-1: caching delayed)
        return True
    if (not _full_blocks_cached(mgr, n_cached, n_cacheable, n_hashes, bs, &hash_bs)
            or hash_bs == 0):
        return False
    return _mamba_tail_cached(mgr, request, request_id, <list>blocks, n_cacheable, bs, hash_bs,
                              computed)
