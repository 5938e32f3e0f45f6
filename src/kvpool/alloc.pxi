# Included by _core.pyx: BlockPool.get_new_blocks.

# --------------------------------------------------------------------------------------
# BlockPool hot loops (vllm/v1/core/block_pool.py, vLLM 0.33.0)
# --------------------------------------------------------------------------------------
cdef dict _native_evict_cache(object pool):
    """``pool.cached_block_hash_to_block._cache`` when the pool's evictions may run
    natively: kvpool's ``BlockPool`` with vLLM's eviction methods (checked as the
    native cache_blocks checks its methods: ``kvpool.patches.manager_fast_path``), no
    KV events, no metrics collector, kvpool's map; else None (vLLM's callback)."""
    if not _fast_path.enabled or pool.metrics_collector is not None:
        return None
    return _native_map_cache(_fast_path, pool)


cdef dict _native_dup_ids(dict cache, object pool):
    """The ``_dup_ids`` of the pool's map (``_native_map_cache`` checked it is a dict)
    when the map stores block ids (vLLM >= 0.34.0); None otherwise."""
    if cache is None or not _fast_path.map_ids:
        return None
    return <dict>pool.cached_block_hash_to_block._dup_ids


cdef bint _evict_natively(dict cache, dict dup_ids, KVCacheBlock blk, list removed_log) except -1:
    """vLLM's ``BlockPool._maybe_evict_cached_block`` for a block with one hash and no
    extra ones, events off, no metrics collector: ``_remove_cached_block_hashes``
    (the map's ``pop(hash, block_id)``, kvpool's ``BlockHashToBlockMap.pop``), then
    ``reset_hash``, then ``_emit_block_removed_events(removed)``: nothing with events
    off, or, where the pool instance's ``_emit_block_removed_events`` is a list's
    ``extend`` (``removed_log``, see ``_removed_events_list``), the removed hash
    appended to that list. False, with nothing changed, when an object involved is
    not of the types this reads without running Python code. ``dup_ids``: the map's
    ``_dup_ids`` when it stores block ids (vLLM >= 0.34.0), else None."""
    key = blk._block_hash
    block_id = _block_id(blk)
    if type(key) is not bytes or type(block_id) is not int:
        return False
    if dup_ids is not None:
        return _evict_id_natively(cache, dup_ids, key, blk, block_id, removed_log)
    entry = cache.get(key)
    if entry is not None and type(entry) is not dict and (
            type(entry) is not KVCacheBlock or type(_block_id(<KVCacheBlock>entry)) is not int):
        return False
    if removed_log is not None and entry is not None and (
            (block_id in <dict>entry) if type(entry) is dict
            else _block_id(<KVCacheBlock>entry) == block_id):
        removed_log.append(key)  # first: a MemoryError here leaves the block as it was
    if entry is not None:
        del cache[key]
        if type(entry) is dict:
            (<dict>entry).pop(block_id, None)
            if len(<dict>entry) > 0:
                cache[key] = entry
        elif _block_id(<KVCacheBlock>entry) != block_id:
            cache[key] = entry
    blk._block_hash = None
    blk._block_hash_num_tokens = None
    _fast_path.native_evictions += 1
    return True


cdef bint _evict_id_natively(dict cache, dict dup_ids, bytes key, KVCacheBlock blk,
                             block_id, list removed_log) except -1:
    """:func:`_evict_natively` on vLLM >= 0.34.0's map of block ids (``dup_ids`` its
    ``_dup_ids``): its ``pop(key, block_id)`` (the key's first remaining id left in
    ``_cache`` when others remain, the ``_dup_ids`` entry dropped at one id), then
    ``reset_hash``. False, nothing changed, for entries of other types."""
    if not _ids_entry_readable(cache, dup_ids, key):
        return False
    dups = dup_ids.get(key)
    if dups is None:
        found = cache.get(key) == block_id
    else:
        found = block_id in <dict>dups
    if removed_log is not None and found:
        removed_log.append(key)  # first: a MemoryError here leaves the block as it was
    if found:
        if dups is None:
            del cache[key]
        else:
            del (<dict>dups)[block_id]
            cache[key] = next(iter(<dict>dups))
            if len(<dict>dups) == 1:
                del dup_ids[key]
    blk._block_hash = None
    blk._block_hash_num_tokens = None
    _fast_path.native_evictions += 1
    return True


def pool_get_new_blocks(FreeKVCacheBlockQueue queue not None, num_blocks,
                        bint enable_caching, dict cached_block_hashes_by_block,
                        object evict_cached_block, int32_t hint=-1, int32_t owner=0,
                        int32_t want=0, object pool=None):
    """``BlockPool.get_new_blocks`` without per-block Python calls.

    Pops ``num_blocks`` from the front of the free queue (with the contiguous
    allocation policy: the blocks ``FreeBlockList::take`` chooses for the table of
    ``owner`` that continues at block ``hint``, expecting ``want`` more blocks,
    those it takes from the LRU front evicted in vLLM's order and returned in
    ascending id order, from ``hint`` on if it is one of them; docs/design.md,
    "Allocation policies"). For a block that still has
    a prefix-cache hash (or extra hashes in ``cached_block_hashes_by_block``) calls
    ``evict_cached_block(block)``; checks ``ref_cnt == 0`` (after the callback, as
    vLLM's ``assert`` does) and sets it to 1. One pass over the blocks. ``pool``: the
    ``BlockPool`` whose ``_maybe_evict_cached_block`` is ``evict_cached_block``; where
    that is vLLM's method on kvpool's pool without KV events or a metrics collector
    (``_native_evict_cache``), a block's one hash is removed from the pool's map here,
    as vLLM's ``_remove_cached_block_hashes`` does, without the Python call.

    Returns:
        ``list[KVCacheBlock]`` of length ``num_blocks``.
    Raises:
        TypeError: ``num_blocks`` is not an int.
        ValueError: ``num_blocks`` negative or more than the free blocks.
        BlockStateError: a block with ``ref_cnt != 0`` (the pool is corrupted). On any
            error the popped blocks that are still off the free list and unchanged by
            others are put back in front, in their old order, with ``ref_cnt`` 0.
    """
    cdef Py_ssize_t n, i = 0, nset = 0, j, n01 = 0
    cdef list ret
    cdef bint has_extra = bool(cached_block_hashes_by_block)
    cdef vector[int32_t] popped
    cdef vector[int32_t] left  # the rollback's record, allocated before any change
    cdef vector[PyObject*] taken  # owned references to the blocks of this call
    cdef kvpool_refbatch rb
    cdef uint64_t insertions
    cdef int32_t uncached, extents_before = 0, nfront = 0
    cdef vector[pair[int32_t, ObjPtr]] placement  # the table order's scratch
    cdef vector[int32_t] lru_front  # with an LRU window: the LRU front, for an undo
    # Compared as Python ints first: a count past Py_ssize_t gets vLLM's ValueError,
    # not an OverflowError from the conversion.
    n_o = _index(num_blocks)
    if n_o < 0:
        raise ValueError(f"cannot get a negative number of blocks ({n_o})")
    if n_o > queue._list.size() + queue._count_offset:
        raise ValueError(f"Cannot get {n_o} free blocks from the pool")
    n = n_o
    uncached = <int32_t>n
    if n > queue._list.size():
        raise ValueError(f"Cannot get {n} free blocks from the pool "
                         f"(only {queue._list.size()} are really free)")
    # Every allocation of the call before its first change (strong on MemoryError).
    popped.resize(n)
    taken.resize(n)
    left.reserve(n)
    kvpool_refbatch_init(&rb)
    # The common case first (_take_chosen, _take_front), then the rest (_take_rest). No
    # Python code runs until every block of the call is off the free list, as in vLLM;
    # the returned list is built last, so Python code never sees it half filled.
    if queue._list.order() == ORDER_CONTIGUOUS:
        # The policy chooses the blocks and unlinks them at once.
        placement.reserve(n)
        if queue._lru_window > 0:  # (at most the free blocks: the window is clamped)
            lru_front.resize(min(<Py_ssize_t>n + queue._lru_window, <Py_ssize_t>queue._list.size()))
            nfront = queue._list.lru_front_slots(<int32_t>lru_front.size(), lru_front.data())
        extents_before = queue._list.num_extents(owner) if owner > 0 else 0
        uncached = queue._list.take(<int32_t>n, hint, owner, want, popped.data(),
                                    queue._lru_window)
        i = _take_chosen(queue, n, popped.data(), taken.data(), enable_caching, has_extra)
    else:
        i = _take_front(queue, n, popped.data(), taken.data(), enable_caching, has_extra)
    n01 = nset = i   # (each taken block's ref_cnt 0 -> 1, counted in n01)
    insertions = queue._list.insertions()
    try:
        _take_rest(queue, n, popped.data(), taken.data(), enable_caching, has_extra,
                   cached_block_hashes_by_block, evict_cached_block, pool, &rb,
                   &i, &nset, &n01)
        ret = PyList_New(n)
    except BaseException:
        _fold_0_to_1(&rb, n01)
        kvpool_refbatch_flush(&rb)
        _undo_get_new_blocks(queue, n, i, nset, popped.data(), taken.data(), left,
                             insertions, lru_front.data(), nfront, owner, extents_before,
                             &rb)
        raise
    if uncached < n:
        # The blocks evicted from the LRU front (in vLLM's order, above) go into the
        # table ascending, continuing the table's last run when they can (the
        # contiguous policy; cpp/table_placement.h). Which blocks, and the order of
        # their evictions, stay vLLM's.
        place_ascending(popped.data() + uncached, <ObjPtr*>taken.data() + uncached,
                        <int32_t>(n - uncached),
                        popped[uncached - 1] + 1 if uncached > 0 else hint, placement)
    for j in range(n):
        kvpool_list_items(<PyObject*>ret)[j] = taken[j]  # the list takes the reference
    _fold_0_to_1(&rb, n01)
    _flush(&rb)
    return ret


cdef Py_ssize_t _take_chosen(FreeKVCacheBlockQueue queue, Py_ssize_t n, int32_t* popped,
                             PyObject** taken, bint enable_caching, bint has_extra):
    # pool_get_new_blocks' common case over the blocks the contiguous policy chose
    # (popped[0 .. n-1], already unlinked): each plain free block, up to the first
    # that is not, set to ref_cnt 1 and held in taken. Returns how many. No Python code.
    cdef Py_ssize_t i = 0
    cdef PyObject* o
    cdef PyObject** table = kvpool_list_items(<PyObject*>queue._blocks)
    cdef PyObject* none = kvpool_none()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef PyObject* one = kvpool_si_obj(1)
    while i < n:
        o = table[popped[i]]
        if (o == none or (<KVCacheBlock>o)._ref_cnt_o != zero or (enable_caching and (
                <PyObject*>(<KVCacheBlock>o)._block_hash != none or has_extra))):
            break
        (<KVCacheBlock>o)._ref_cnt_o = one  # counted in the caller's n01
        Py_INCREF_ptr(o)
        taken[i] = o
        i += 1
    return i


cdef Py_ssize_t _take_front(FreeKVCacheBlockQueue queue, Py_ssize_t n, int32_t* popped,
                            PyObject** taken, bint enable_caching, bint has_extra):
    # pool_get_new_blocks' common case in vLLM's order: walk the front of the free list
    # while taking the blocks (the walk's chain of dependent loads overlaps the
    # per-block work), up to the first that is not a plain free block; the walked run
    # is unlinked in one go, the rest of the n popped one at a time (into popped).
    # Returns how many were taken (ref_cnt 1, held in taken). No Python code.
    cdef Py_ssize_t i = 0
    cdef PyObject* o
    cdef PyObject** table = kvpool_list_items(<PyObject*>queue._blocks)
    cdef PyObject* none = kvpool_none()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef PyObject* one = kvpool_si_obj(1)
    cdef const int32_t* next_links = queue._list.next_links()
    cdef int32_t node = next_links[0]  # the fake head's next
    cdef int32_t slot
    while i < n:
        slot = node - 2
        o = table[slot]
        if (o == none or (<KVCacheBlock>o)._ref_cnt_o != zero or (enable_caching and (
                <PyObject*>(<KVCacheBlock>o)._block_hash != none or has_extra))):
            break
        popped[i] = slot
        (<KVCacheBlock>o)._ref_cnt_o = one  # counted in the caller's n01
        Py_INCREF_ptr(o)
        taken[i] = o
        i += 1
        node = next_links[node]
    queue._list.detach_front(popped, <int32_t>i)
    if i < n:
        queue._list.popleft_n(<int32_t>(n - i), popped + i)
    return i


cdef int _take_rest(FreeKVCacheBlockQueue queue, Py_ssize_t n, int32_t* popped,
                    PyObject** taken, bint enable_caching, bint has_extra,
                    dict cached_block_hashes_by_block, object evict_cached_block,
                    object pool, kvpool_refbatch* rb, Py_ssize_t* i, Py_ssize_t* nset,
                    Py_ssize_t* n01) except -1:
    # pool_get_new_blocks' blocks popped[i[0] ..] (off the free list, not yet taken),
    # one at a time: created where the table has none, their prefix-cache hash evicted
    # (natively, _evict_natively, or by evict_cached_block), checked ref_cnt 0 and set
    # to 1. Python code may run (creation, callbacks). i, nset (blocks this call set to
    # ref_cnt 1) and n01 are kept current for the caller's rollback when this raises.
    cdef PyObject* o
    cdef PyObject* none = kvpool_none()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef long refs
    cdef int evict_state = 0 if pool is not None else 2   # 0 unknown, 1 native, 2 callback
    cdef dict evict_cache = None
    cdef dict evict_dups = None
    cdef list evict_log = None
    while i[0] < n:
        o = kvpool_list_items(<PyObject*>queue._blocks)[popped[i[0]]]  # (Python code may have run)
        if o == none:
            _fold_0_to_1(rb, n01[0])  # a creation may run Python code (gc)
            n01[0] = 0
            kvpool_refbatch_flush(rb)
            queue._block_at(popped[i[0]])  # creates it in the table
            o = kvpool_list_items(<PyObject*>queue._blocks)[popped[i[0]]]
            if not isinstance(<object>o, KVCacheBlock):
                raise BlockStateError(f"free slot {popped[i[0]]} holds no block; the pool is corrupted")
        Py_INCREF_ptr(o)
        taken[i[0]] = o
        i[0] += 1
        if enable_caching and (<PyObject*>(<KVCacheBlock>o)._block_hash != none or (
                has_extra and _block_id(<KVCacheBlock>o) in cached_block_hashes_by_block)):
            if evict_state == 0:
                evict_cache = _native_evict_cache(pool)
                evict_dups = _native_dup_ids(evict_cache, pool)
                evict_state = 1 if evict_cache is not None else 2
                if evict_state == 1:
                    evict_log = _removed_events_list(pool)
            if not (evict_state == 1 and not (
                    has_extra and _block_id(<KVCacheBlock>o) in cached_block_hashes_by_block)
                    and _evict_natively(evict_cache, evict_dups, <KVCacheBlock>o, evict_log)):
                _fold_0_to_1(rb, n01[0])
                n01[0] = 0
                kvpool_refbatch_flush(rb)
                evict_cached_block(<object>o)
                if pool is not None:
                    evict_state = 0  # Python code ran: the next eviction checks again
        if (<KVCacheBlock>o)._ref_cnt_o == zero:
            (<KVCacheBlock>o)._ref_cnt_o = kvpool_si_obj(1)  # the common case, counted in n01
            n01[0] += 1
        else:
            refs = _ref_cnt(<KVCacheBlock>o)
            if refs != 0:
                raise BlockStateError(
                    f"free block {_id_text(o)} has ref_cnt={refs}; the pool is corrupted")
            if _put_refs(o, 1, rb) != E_NONE:
                raise MemoryError("get_new_blocks(): no memory for a ref_cnt")
        nset[0] = i[0]
    return 0


cdef int _undo_get_new_blocks(FreeKVCacheBlockQueue queue, Py_ssize_t n, Py_ssize_t i,
                              Py_ssize_t nset, int32_t* popped, PyObject** taken,
                              vector[int32_t]& left, uint64_t insertions,
                              int32_t* lru_front, int32_t nfront, int32_t owner,
                              int32_t extents_before, kvpool_refbatch* rb) except -1:
    # pool_get_new_blocks' rollback (in its except clause; rb folded and flushed).
    # Put back, in their old order and unheld, the popped blocks that are still off the
    # free list and still as this call left them. Python code that ran in between (a
    # callback, a finalizer) may have freed some of them, or freed and taken them
    # again: if anything was put into the free list meanwhile, a block this call set
    # to ref_cnt 1 may be someone else's now, and is left as it is. No allocation on
    # this path: `left` has room for every slot.
    cdef Py_ssize_t j, nback = 0
    cdef PyObject* o
    cdef PyObject* none = kvpool_none()
    cdef int32_t slot
    cdef long refs
    queue_changed = queue._list.insertions() != insertions
    for j in range(n):
        slot = popped[j]
        if queue._list.contains(slot):
            continue  # already back in the free list
        if j < nset:  # this call set ref_cnt 1
            o = taken[j]
            if not _read_refs(o, &refs) or refs != 1 or queue_changed:
                left.push_back(slot)
                continue
            _put_refs(o, 0, rb)
        else:
            o = taken[j] if j < i else kvpool_list_items(<PyObject*>queue._blocks)[slot]
            if o != none and _read_refs(o, &refs) and refs != 0:
                left.push_back(slot)  # not set by this call, but held now
                continue
        popped[nback] = slot
        nback += 1
    if nback:
        queue._list.reinsert_front(popped, <int32_t>nback)
    if nfront and not queue_changed and queue._list.order() == ORDER_CONTIGUOUS:
        queue._list.restore_lru_front(lru_front, nfront)  # the LRU window took from inside the front
    if owner > 0 and queue._list.order() == ORDER_CONTIGUOUS:
        queue._list.truncate_extents(owner, extents_before)  # the extent this call reserved
    for j in range(i):
        Py_DECREF_ptr(taken[j])
    _flush(rb)
    if left.size():
        exc = sys.exc_info()[1]
        if hasattr(exc, "add_note"):
            try:
                exc.add_note(
                    f"kvpool: get_new_blocks() left blocks in slots {list(left)} as the "
                    "Python code that ran during the call left them (freed and possibly "
                    "taken again); the other popped blocks were put back")
            except MemoryError:
                pass  # the note is a courtesy; the original error is what counts
    return 0
