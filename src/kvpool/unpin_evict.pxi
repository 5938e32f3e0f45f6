# Included by _core.pyx: BlockPool.unpin_blocks and evict_blocks.

# An entry of pool_unpin_blocks' saved watchers: the block id had none before.
cdef object _NO_WATCHER = object()


def pool_unpin_blocks(FreeKVCacheBlockQueue queue not None, object blocks,
                      dict reuse_watchers, object on_reuse, object pool=None):
    """``BlockPool.unpin_blocks`` (vLLM 0.33.0): ``ref_cnt -= 1``, register ``on_reuse``
    for each block (``reuse_watchers[block_id]``), and append blocks reaching 0 to the
    tail of the free queue.

    Strong: every block is checked and decremented, then every watcher registered,
    then the blocks reaching 0 linked; on any error (a bad block, or MemoryError in
    either step) everything done so far is undone and nothing has changed. No Python
    code runs until the call has done its work (block ids must be exact ints, so
    registering a watcher runs no ``__hash__``/``__eq__``; replaced watchers are kept
    alive until then).

    ``pool`` (the queue's ``BlockPool``, optional): its blocks still held in a free
    queue the pool has replaced are adopted into ``queue`` first, as ``free_blocks``
    adopts them.

    Raises:
        TypeError: not a kvpool block, a field of the wrong type, or a block_id that
            is not an int.
        BlockStateError: a null block, a block with ``ref_cnt <= 0`` (counting repeats
            in ``blocks``), or a block of another queue.
        MemoryError: no memory for a ref_cnt or a watcher entry.
    """
    cdef list blist = _private_list(blocks)
    cdef Py_ssize_t n = PyList_GET_SIZE(blist), i = 0, j
    cdef PyObject* o
    cdef PyObject* prev
    cdef object key
    cdef KVCacheBlock b
    cdef long refs = 0
    cdef int32_t slot
    cdef int32_t capacity = queue._list.capacity()
    cdef vector[int32_t] released
    cdef vector[PyObject*] kept
    cdef vector[Py_ssize_t] kept_idx
    cdef kvpool_refbatch rb
    cdef kvpool_refjournal jn
    cdef int err = E_NONE
    cdef bint bad_id = False, stale = False
    cdef list saved
    if n == 0:
        return
    # Everything is allocated before anything changes (a GC-tracked allocation can
    # start a collection, which runs Python code).
    released.reserve(n)
    kept.resize(n)
    kept_idx.resize(n)
    saved = [None] * n
    kvpool_refbatch_init(&rb)
    _journal_init(&jn, kept.data(), kept_idx.data())
    # Check and decrement: no Python code runs (fields are type-checked, never
    # converted), so blist's items and the blocks cannot change under the loop.
    while i < n:
        o = PyList_GET_ITEM(blist, i)
        if not isinstance(<object>o, KVCacheBlock):
            err = E_NOT_BLOCK
            break
        if _null_state(o) != 0 or not _read_refs(o, &refs):
            err = E_REF_FIELD
            break
        b = <KVCacheBlock>o
        slot = b._slot
        if (refs <= 0 or b._queue is not queue or not (0 <= slot < capacity)
                or queue._list.contains_unchecked(slot)):
            err = E_DOUBLE_FREE
            stale = pool is not None and b.pool is pool and b._queue is not None and b._queue is not queue
            break
        if b._block_id_o is NULL or not _PyLong_CheckExact(b._block_id_o):
            err = E_NOT_BLOCK
            bad_id = True
            break
        err = _put_refs_kept(o, refs - 1, &rb, &jn, i)
        if err != E_NONE:
            break
        if refs == 1:
            released.push_back(slot)  # (reserved: cannot allocate)
        i += 1
    if err == E_NONE:
        # Register the watchers. Keys are exact ints: no Python code runs; a replaced
        # watcher stays alive in `saved`, so its release runs nothing either.
        j = 0
        while j < n:
            key = <object>(<KVCacheBlock>PyList_GET_ITEM(blist, j))._block_id_o
            prev = PyDict_GetItem(reuse_watchers, key)
            saved[j] = _NO_WATCHER if prev is NULL else <object>prev
            try:
                reuse_watchers[key] = on_reuse
            except MemoryError:
                err = E_NO_MEMORY
                break
            j += 1
        if err != E_NONE:
            # Put back what the first j registrations replaced, last first: the keys
            # are present, so neither step allocates.
            while j > 0:
                j -= 1
                key = <object>(<KVCacheBlock>PyList_GET_ITEM(blist, j))._block_id_o
                if saved[j] is _NO_WATCHER:
                    del reuse_watchers[key]
                else:
                    reuse_watchers[key] = saved[j]
    if err != E_NONE:
        # Undo the decrements, last first; the journal gives back replaced ref_cnt
        # objects, so nothing is allocated.
        j = i - 1  # (i == n when the watchers failed)
        while j >= 0:
            o = PyList_GET_ITEM(blist, j)
            _read_refs(o, &refs)
            _undo_refs(o, refs + 1, &rb, &jn, j)
            j -= 1
        _flush(&rb)
        if stale:
            # Nothing changed: adopt the pool's blocks that its replaced queue holds,
            # then unpin once more (without `pool`: a second stale block is refused).
            _adopt_stale(pool, queue, blist)
            return pool_unpin_blocks(queue, blist, reuse_watchers, on_reuse)
        if err == E_NO_MEMORY:
            raise MemoryError("unpin_blocks(): no memory for a ref_cnt or a reuse watcher")
        b = _as_block(<object>PyList_GET_ITEM(blist, i))
        if bad_id:
            raise TypeError("unpin_blocks(): block_id must be an int, got "
                            + ("nothing (deleted)" if b._block_id_o is NULL else _type_name(b._block_id_o)))
        refs = _ref_cnt(b)
        _is_null(b)
        raise BlockStateError(
            f"unpin_blocks(): block {_id_text(<PyObject*>b)} is null, not held "
            f"(ref_cnt={refs}) or not in this pool")
    # Link: every released block was checked (held, in range, not free), so this
    # cannot fail. Then the parked objects and the saved watchers are released (that
    # may run Python code: the call's work is done).
    if released.size():
        queue._list.append_n_unchecked(released.data(), <int32_t>released.size())
    _journal_release(&jn)
    _flush(&rb)
    del saved


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
