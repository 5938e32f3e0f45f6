# Included by _core.pyx: BlockPool.unpin_blocks and evict_blocks.

# An entry of pool_unpin_blocks' saved watchers: the block id had none before.
cdef object _NO_WATCHER = object()


cdef inline int _unpin_check(PyObject* o, FreeKVCacheBlockQueue queue, long* refs):
    # Whether block `o` can be unpinned once more (E_NONE), or why not. Never raises and
    # runs no Python code.
    cdef int32_t slot
    if not isinstance(<object>o, KVCacheBlock):
        return E_NOT_BLOCK
    if _null_state(o) != 0 or not _read_refs(o, refs):
        return E_REF_FIELD
    slot = (<KVCacheBlock>o)._slot
    if (refs[0] <= 0 or (<KVCacheBlock>o)._queue is not queue
            or not (0 <= slot < queue._list.capacity()) or queue._list.contains_unchecked(slot)):
        return E_DOUBLE_FREE
    return E_NONE


cdef object _watcher_of(object reuse_watchers, object key):
    if type(reuse_watchers) is dict:
        return (<dict>reuse_watchers).get(key, _NO_WATCHER)
    try:
        return reuse_watchers[key]
    except KeyError:
        return _NO_WATCHER


cdef void _restore_watchers(object reuse_watchers, list blist, list saved, Py_ssize_t j):
    # Put back what the first j registrations replaced, last first. Best effort: a key
    # whose __eq__ raises leaves its entry as it is (the pool's blocks are untouched).
    cdef object key
    while j > 0:
        j -= 1
        key = _block_id(<KVCacheBlock>PyList_GET_ITEM(blist, j))
        try:
            if saved[j] is _NO_WATCHER:
                del reuse_watchers[key]
            else:
                reuse_watchers[key] = saved[j]
        except Exception:
            pass


cdef int _unpin_decrement(list blist, FreeKVCacheBlockQueue queue, vector[int32_t]& released,
                          kvpool_refbatch* rb, kvpool_refjournal* jn, Py_ssize_t* at):
    # Step 3 of pool_unpin_blocks: check every block of blist again and decrement it,
    # the slots of those reaching 0 appended to `released` (reserved: cannot
    # allocate). No Python code runs. Returns E_NONE, or the error with at[0] the
    # failing index and every decrement undone, last first (the journal gives back
    # replaced ref_cnt objects: nothing is allocated), rb flushed.
    cdef Py_ssize_t n = PyList_GET_SIZE(blist), i = 0, j
    cdef PyObject* o
    cdef long refs = 0
    cdef int err = E_NONE
    while i < n:
        o = PyList_GET_ITEM(blist, i)
        err = _unpin_check(o, queue, &refs)
        if err == E_NONE:
            err = _put_refs_kept(o, refs - 1, rb, jn, i)
        if err != E_NONE:
            break
        if refs == 1:
            released.push_back((<KVCacheBlock>o)._slot)
        i += 1
    at[0] = i
    if err != E_NONE:
        j = i - 1
        while j >= 0:
            o = PyList_GET_ITEM(blist, j)
            _read_refs(o, &refs)
            _undo_refs(o, refs + 1, rb, jn, j)
            j -= 1
        _flush(rb)
    return err


def pool_unpin_blocks(FreeKVCacheBlockQueue queue not None, object blocks,
                      object reuse_watchers, object on_reuse, object pool=None):
    """``BlockPool.unpin_blocks`` (vLLM 0.33.0): ``ref_cnt -= 1``, register ``on_reuse``
    for each block (``reuse_watchers[block_id]``, any mapping), and append blocks
    reaching 0 to the tail of the free queue.

    Strong: the blocks are checked first; then the watchers are registered, while no
    block has changed (registering can run Python code: a key's ``__eq__``, a mapping's
    ``__setitem__``); then every block is checked again and decremented, and those
    reaching 0 linked, with no Python code running. On any error everything done so far
    is undone (the watchers as far as their keys allow) and no block has changed.

    ``pool`` (the queue's ``BlockPool``, optional): its blocks still held in a free
    queue the pool has replaced are adopted into ``queue`` first, as ``free_blocks``
    adopts them.

    Raises:
        TypeError: not a kvpool block, or a field of the wrong type.
        BlockStateError: a null block, a block with ``ref_cnt <= 0`` (counting repeats
            in ``blocks``), or a block of another queue.
        MemoryError: no memory for a ref_cnt or a watcher entry.
    """
    cdef list blist = _private_list(blocks)
    cdef Py_ssize_t n = PyList_GET_SIZE(blist), i = 0, j
    cdef PyObject* o
    cdef KVCacheBlock b
    cdef long refs = 0
    cdef vector[int32_t] released
    cdef vector[PyObject*] kept
    cdef vector[Py_ssize_t] kept_idx
    cdef kvpool_refbatch rb
    cdef kvpool_refjournal jn
    cdef int err = E_NONE
    cdef bint stale = False
    cdef list saved
    if n == 0:
        return
    # Allocated before anything changes (a GC-tracked allocation can start a
    # collection, which runs Python code).
    released.reserve(n)
    kept.resize(n)
    kept_idx.resize(n)
    saved = [None] * n
    # 1. Check (nothing changes, no Python code): a bad block is refused here, before
    #    the watchers are touched.
    while i < n:
        o = PyList_GET_ITEM(blist, i)
        err = _unpin_check(o, queue, &refs)
        if err != E_NONE:
            stale = (err == E_DOUBLE_FREE and pool is not None and refs > 0
                     and (<KVCacheBlock>o).pool is _block_owner(pool)
                     and (<KVCacheBlock>o)._queue is not None)
            break
        i += 1
    if err == E_NONE:
        # 2. Register the watchers, keeping the ones they replace (alive, so their
        #    release runs nothing until the end). Python code may run here; no block
        #    has changed yet, and step 3 checks every block again.
        j = 0
        try:
            while j < n:
                key = _block_id(<KVCacheBlock>PyList_GET_ITEM(blist, j))
                saved[j] = _watcher_of(reuse_watchers, key)
                reuse_watchers[key] = on_reuse
                j += 1
        except BaseException:
            _restore_watchers(reuse_watchers, blist, saved, j)
            raise
        # 3. Check and decrement (no Python code: blist's items and the blocks cannot
        #    change under the loop).
        kvpool_refbatch_init(&rb)
        _journal_init(&jn, kept.data(), kept_idx.data())
        err = _unpin_decrement(blist, queue, released, &rb, &jn, &i)
        if err != E_NONE:
            _restore_watchers(reuse_watchers, blist, saved, n)  # (the decrements are undone)
    if err != E_NONE:
        if stale:
            # Nothing changed: adopt the pool's blocks that its replaced queue holds,
            # then unpin once more (without `pool`: a second stale block is refused).
            _adopt_stale(pool, queue, blist)
            return pool_unpin_blocks(queue, blist, reuse_watchers, on_reuse)
        if err == E_NO_MEMORY:
            raise MemoryError("unpin_blocks(): no memory for a ref_cnt")
        b = _as_block(<object>PyList_GET_ITEM(blist, i))
        refs = _ref_cnt(b)
        _is_null(b)
        raise BlockStateError(
            f"unpin_blocks(): block {_id_text(<PyObject*>b)} is null, not held "
            f"(ref_cnt={refs}) or not in this pool")
    # 4. Link: every released block was checked (held, in range, not free), so this
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
