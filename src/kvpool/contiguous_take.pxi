# The contiguous policy's allocation for a table the native manager path knows
# (included by _core.pyx after alloc.pxi; _extend_table calls it).
#
# Under allocation="contiguous" every allocation of a block table went through five
# Python frames: BlockPool.get_new_blocks (the table context), ContiguousPolicy.extend_table
# (the table's last block, its extent owner, its expected growth), BlockPool._take,
# then ContiguousPolicy.after_change and queue_policy (the LRU front's unhashed blocks
# absorbed). On a hybrid model's serving stream that was about 22 us per allocation
# beyond the native loop, more than the policy saved. _contiguous_take runs the same
# code natively where every one of those methods is kvpool's own (class and instance)
# and every value it reads is of the type kvpool's code keeps there; anything else
# returns None before anything is changed, and the caller goes through the pool.


@cython.auto_pickle(False)
cdef class _ContiguousTake:
    """kvpool's functions ``_contiguous_take`` mirrors, captured when the hybrid step is
    armed (``configure_hybrid_running_step(contiguous=...)``), and its counter."""
    cdef public object policy_cls, extend_table, after_change, queue_policy, expect_tokens
    cdef public object pool_take
    cdef public Py_ssize_t native_takes

    def __init__(self):
        self.policy_cls = None
        self.native_takes = 0


cdef _ContiguousTake _contiguous = _ContiguousTake()
cdef tuple _CONTIGUOUS_POLICY_NAMES = ("extend_table", "after_change", "queue_policy", "expect_tokens")


cdef int _configure_contiguous_take(contiguous) except -1:
    """``contiguous``: None (disarmed), or kvpool's ``(ContiguousPolicy,
    ContiguousPolicy.extend_table, ContiguousPolicy.after_change,
    AllocationPolicy.queue_policy, ContiguousPolicy.expect_tokens, BlockPool._take)``."""
    _contiguous.policy_cls = None
    _contiguous.native_takes = 0
    if contiguous is not None:
        (cls, _contiguous.extend_table, _contiguous.after_change, _contiguous.queue_policy,
         _contiguous.expect_tokens, _contiguous.pool_take) = contiguous
        _contiguous.policy_cls = cls
    return 0


cdef bint _contiguous_policy_plain(_ContiguousTake c, policy, pool) except -1:
    """``policy`` is exactly kvpool's ``ContiguousPolicy`` whose mirrored methods are
    the captured ones (on its class, not set on the instance), and the pool's ``_take``
    is kvpool's (the caller checked the pool's other calls: ``_pool_runs_no_code``)."""
    cls = type(policy)
    return (c.policy_cls is not None and cls is c.policy_cls
            and getattr(cls, "extend_table", None) is c.extend_table
            and getattr(cls, "after_change", None) is c.after_change
            and getattr(cls, "queue_policy", None) is c.queue_policy
            and getattr(cls, "expect_tokens", None) is c.expect_tokens
            and getattr(type(pool), "_take", None) is c.pool_take
            and _not_overridden(policy, _CONTIGUOUS_POLICY_NAMES)
            and _not_overridden(pool, ("_take",)))


cdef object _contiguous_take(pool, mgr, str request_id, list table, Py_ssize_t num_blocks):
    """``pool.get_new_blocks(num_blocks)`` for table ``(mgr, request_id)`` under kvpool's
    contiguous policy: ``ContiguousPolicy.extend_table`` (kvpool/allocation/contiguous.py)
    and ``BlockPool._take``'s native loop, then ``after_change``. Returns the blocks; None
    before any change when a value it reads is not what kvpool's code keeps there
    (exact dicts and ints, the table's blocks kvpool's) or a method is not kvpool's."""
    cdef _ContiguousTake c = _contiguous
    cdef Py_ssize_t i
    cdef long long last = -1, held, growth, want, bs, expected_n, owner_n, next_n, cap
    cdef KVCacheBlock blk
    policy = pool._policy
    queue = pool.free_block_queue
    if type(queue) is not FreeKVCacheBlockQueue or not _contiguous_policy_plain(c, policy, pool):
        return None
    owners = policy.table_owners
    expected_tokens = policy.expected_tokens
    if type(owners) is not dict or type(expected_tokens) is not dict:
        return None
    # the table's last block that is not the null block (its id + 1: where to continue)
    for i in range(len(table) - 1, -1, -1):
        b = table[i]
        if type(b) is not KVCacheBlock:
            return None
        blk = <KVCacheBlock>b
        if blk._is_null_o == kvpool_false():
            if blk._block_id_o is NULL or type(<object>blk._block_id_o) is not int:
                return None
            last = <object>blk._block_id_o
            break
        if blk._is_null_o != kvpool_true():
            return None
    # (read in extend_table's order: a dict look-up may run a key's __eq__, which could
    # change what is read after it)
    key = (id(mgr), request_id)
    owner = (<dict>owners).get(key)
    if owner is None:
        if not _nonneg(policy._next_owner, &next_n):
            return None
        owner_n = next_n
    elif not _nonneg(owner, &owner_n):
        return None
    expected = (<dict>expected_tokens).get(request_id)
    if ((expected is not None and (not _nonneg(expected, &expected_n)
                                   or not _nonneg(mgr.block_size, &bs) or bs == 0))
            or not _nonneg(policy.extent_cap, &cap)):
        return None
    held = len(table)
    growth = (expected_n + bs - 1) // bs - held if expected is not None else held + num_blocks
    want = growth if growth < cap else cap
    if want < num_blocks:
        want = num_blocks
    if owner_n > 0x7FFFFFF0 or want > 0x7FFFFFFF or last >= 0x7FFFFFFF:
        return None   # (the pool's int32 arguments: kvpool's path raises OverflowError)
    if owner is None:
        (<dict>owners)[key] = next_n
        policy._next_owner = next_n % 0x7FFFFFF0 + 1
    blocks = pool_get_new_blocks(queue, num_blocks, pool.enable_caching,
                                 pool.cached_block_hashes_by_block, pool._maybe_evict_cached_block,
                                 -1 if last < 0 else last + 1, owner_n, want, pool=pool)
    c.native_takes += 1
    # ContiguousPolicy.after_change (never raises: a MemoryError leaves the LRU front as is)
    try:
        handle = policy._handle
        if handle is None or handle.queue is not queue:
            handle = policy._handle = queue.policy
        handle.absorb_unhashed_lru_front(pool.cached_block_hashes_by_block, pool._reuse_watchers)
    except MemoryError:
        pass
    return blocks
