# Included by _core.pyx: BlockPool.unpin_blocks and evict_blocks.

def pool_unpin_blocks(FreeKVCacheBlockQueue queue not None, object blocks,
                      dict reuse_watchers, object on_reuse):
    """``BlockPool.unpin_blocks``: ``ref_cnt -= 1``, register ``on_reuse`` for each
    block, and append blocks reaching 0 to the tail of the free queue.

    Raises:
        BlockStateError: a null block, a block with ``ref_cnt <= 0`` (counting repeats
            in ``blocks``), or a block of another queue. Nothing changes when raised.
    """
    cdef list blist = _private_list(blocks)
    cdef Py_ssize_t n = PyList_GET_SIZE(blist), i = 0, j
    cdef KVCacheBlock b
    cdef long refs
    cdef int32_t capacity = queue._list.capacity()
    cdef vector[int32_t] released
    cdef kvpool_refbatch rb
    kvpool_refbatch_init(&rb)
    released.reserve(n)
    try:
        while i < n:
            b = _as_block(<object>PyList_GET_ITEM(blist, i))
            refs = _ref_cnt(b)
            if (_is_null(b) or refs <= 0 or b._queue is not queue
                    or not (0 <= b._slot < capacity) or queue._list.contains_unchecked(b._slot)):
                raise BlockStateError(
                    f"unpin_blocks(): block {_id_text(<PyObject*>b)} is null, not held "
                    f"(ref_cnt={refs}) or not in this pool")
            # (the replaced ref_cnt object is parked: its release could run Python code)
            if _put_refs(<PyObject*>b, refs - 1, &rb) != E_NONE:
                raise MemoryError("unpin_blocks(): no memory for a ref_cnt")
            if refs == 1:
                released.push_back(b._slot)
            i += 1
    except BaseException:
        kvpool_refbatch_flush(&rb)
        for j in range(i):
            b = <KVCacheBlock>PyList_GET_ITEM(blist, j)
            _set_ref_cnt(b, _ref_cnt(b) + 1)
        _flush(&rb)
        raise
    # Link before anything can run Python code (parked objects, a block_id's
    # __hash__ while registering the watchers).
    if released.size():
        queue._list.append_n_unchecked(released.data(), <int32_t>released.size())
    _flush(&rb)
    for i in range(n):
        reuse_watchers[_block_id(<KVCacheBlock>PyList_GET_ITEM(blist, i))] = on_reuse


@cython.boundscheck(True)
def pool_blocks_to_evict(object blocks, object block_ids,
                         dict cached_block_hashes_by_block, bint every_block):
    """Blocks named by ``block_ids`` that ``BlockPool.evict_blocks`` must visit: those
    with a prefix-cache hash, or all of them when ``every_block`` (a metrics collector
    wants an eviction callback for each). Blocks never created have no hash.

    Args:
        blocks: the pool's ``blocks`` (a :class:`BlockTable` or a list).
    Raises:
        TypeError: an id that is not an int.
        BlockIdOutOfRangeError: an id outside ``[0, num_gpu_blocks)`` (checked for
            every id before any block is returned).
    """
    cdef Py_ssize_t n = len(blocks), i
    cdef vector[Py_ssize_t] ids
    cdef list out = []
    cdef BlockTable table = blocks if isinstance(blocks, BlockTable) else None
    for block_id in block_ids:
        try:
            i = _index(block_id)
        except OverflowError:
            i = -1
        if not (0 <= i < n):
            raise BlockIdOutOfRangeError(
                f"Invalid block_id {block_id}: the pool has blocks [0, {n}). This "
                "indicates a bug in the KV connector - workers should only report "
                "block IDs that were allocated by the scheduler.")
        ids.push_back(i)
    for i in ids:
        if table is not None:
            if not every_block and <object>PyList_GET_ITEM(table._queue._blocks, i) is None:
                continue  # never created: no hash
            obj = table._queue._block_at(<int32_t>i)
        else:
            obj = blocks[i]  # checked: an id's __index__ may have changed a plain list
        b = _as_block(obj)
        if every_block or b._block_hash is not None or _block_id(b) in cached_block_hashes_by_block:
            out.append(b)
    return out
