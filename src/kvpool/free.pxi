# Included by _core.pyx: BlockPool.free_blocks, and the free loop the deferred drain shares.

cdef struct HandleTable:
    # The table of the last owner seen while resolving deferred-free handles.
    int64_t current          # owner index, -1: none yet
    PyObject* owner_queue    # its FreeKVCacheBlockQueue; NULL for loose objects
    PyObject** items
    Py_ssize_t size


cdef inline PyObject* _handle_to_block(FencedDeferredFreeQueue deferred, int64_t handle,
                                       HandleTable* t, int* err):
    """The block a deferred-free handle names (borrowed: the owner queue's table or
    ``deferred._loose`` holds it), or NULL with ``err`` set (E_CORRUPT_HANDLE, or
    E_TAKEN_OVER when the block moved to another queue after it was queued). Never
    raises."""
    cdef int64_t owner = handle >> 32
    cdef int64_t slot = <int64_t><uint32_t>handle
    cdef PyObject* table
    cdef PyObject* obj
    if owner != t.current:
        if owner == _LOOSE_OWNER:
            table = <PyObject*>deferred._loose
            t.owner_queue = NULL
        elif 0 <= owner < PyList_GET_SIZE(deferred._owners):
            t.owner_queue = PyList_GET_ITEM(deferred._owners, owner)
            table = <PyObject*>(<FreeKVCacheBlockQueue>t.owner_queue)._blocks
        else:
            err[0] = E_CORRUPT_HANDLE
            return NULL
        t.items = kvpool_list_items(table)
        t.size = PyList_GET_SIZE(<object>table)
        t.current = owner
    if not (0 <= slot < t.size):
        err[0] = E_CORRUPT_HANDLE
        return NULL
    obj = t.items[slot]
    if t.owner_queue is not NULL and (
            not isinstance(<object>obj, KVCacheBlock)
            or <PyObject*>(<KVCacheBlock>obj)._queue != t.owner_queue
            or (<KVCacheBlock>obj)._slot != slot):
        if _adopted_elsewhere(obj, t.owner_queue):
            return obj
        err[0] = E_TAKEN_OVER
        return NULL
    return obj


cdef inline bint _adopted_elsewhere(PyObject* obj, PyObject* owner_queue):
    # The block a handle of `owner_queue` names has moved, *held*, to another queue
    # of a pool: its pool replaced its free queue and adopted it (_adopt_stale; e.g.
    # another request's deferred entry shared it). The handle still names it (the old
    # table keeps the object); the free loop checks it against the pool's queue. A
    # block another queue holds as free stays "taken over".
    cdef FreeKVCacheBlockQueue other
    if not isinstance(<object>obj, KVCacheBlock):
        return False
    if (<KVCacheBlock>obj).pool is None or (<KVCacheBlock>obj)._queue is None:
        return False
    other = (<KVCacheBlock>obj)._queue
    if <PyObject*>other == owner_queue:
        return False
    return (0 <= (<KVCacheBlock>obj)._slot < other._list.capacity()
            and not other._list.contains_unchecked((<KVCacheBlock>obj)._slot))


def pool_free_blocks(object pool, FreeKVCacheBlockQueue queue not None,
                     object ordered_blocks, bint enable_caching):
    """``BlockPool.free_blocks``: decrement ``ref_cnt``; blocks reaching 0 go to the
    front of the free queue if they have no hash (LIFO reuse for GPU locality) or
    caching is off, else to the tail (LRU). The null block is skipped.

    Args:
        ordered_blocks: iterable of ``KVCacheBlock`` in eviction order (first freed is
            evicted first).

    Returns:
        ``dict[pool, list[KVCacheBlock]]`` of blocks owned by other pools (the caller
        forwards them), or None.
    Raises:
        TypeError: not a kvpool block, or ``ref_cnt`` / ``is_null`` of the wrong type.
        BlockStateError: double free (``ref_cnt`` already 0 or the block is already
            free) or a block of another pool's queue with ``pool`` unset. Nothing
            changes in this pool when one of these is raised (an error while the
            other pools' blocks are grouped, after this pool's part is done, leaves
            that part done).
    """
    cdef Py_ssize_t start, step, n
    cdef list seq = _source(ordered_blocks, &start, &step, &n)
    cdef vector[PyObject*] foreign
    if n == 0:
        return None
    cdef vector[PyObject*] stale
    cdef list blocks
    cdef int tries
    if _free_core(pool, queue, kvpool_list_items(<PyObject*>seq) + start, n, step,
                  enable_caching, None, NULL, -1, &foreign, &stale) == 1:
        # Nothing was freed: blocks of this pool are held in a queue the pool has
        # replaced. Adopt them into the pool's queue (Python code may run meanwhile,
        # even replace the queue again: look again until it stays), then free once
        # more over the private list `stale` became.
        blocks = _list_from_refs(stale)
        for tries in range(4):
            _adopt_stale(pool, queue, blocks)
            current = getattr(pool, "free_block_queue", queue)
            if current is queue:
                break
            if not isinstance(current, FreeKVCacheBlockQueue) or tries == 3:
                raise BlockStateError(
                    "free_blocks(): the pool's free_block_queue was replaced while its "
                    "blocks were being freed; nothing was freed")
            queue = <FreeKVCacheBlockQueue>current
        _free_core(pool, queue, kvpool_list_items(<PyObject*>blocks), PyList_GET_SIZE(blocks), 1,
                   enable_caching, None, NULL, -1, &foreign)
    try:
        return _forwarded(foreign)
    finally:
        _release_parked()


cdef int _adopt_stale(object pool, FreeKVCacheBlockQueue queue, list blocks) except -1:
    """Register with ``queue`` (as held blocks) the blocks of ``pool`` in ``blocks``
    that are held in a free queue the pool has replaced: what vLLM's Python code
    allows (its blocks carry no queue), e.g. a ``BlockPool`` subclass that rebuilds
    ``free_block_queue`` from the free blocks while requests still hold others
    (break-it C10). A block that is free in its old queue is left alone (freeing it
    is a double free there).

    Raises:
        MemoryError: no room to register a block (those adopted before stay adopted:
            held either way, now in the pool's current queue).
    """
    cdef KVCacheBlock b
    cdef FreeKVCacheBlockQueue old
    cdef Py_ssize_t i
    owner = _block_owner(pool)
    for i in range(PyList_GET_SIZE(blocks)):
        obj = <object>PyList_GET_ITEM(blocks, i)
        if not isinstance(obj, KVCacheBlock):
            continue
        b = <KVCacheBlock>obj
        old = b._queue
        if b.pool is not owner or old is None or old is queue:
            continue
        if 0 <= b._slot < old._list.capacity() and old._list.contains(b._slot):
            continue
        # The old queue keeps the object in its table (a replaced queue is not used
        # again); the block now names its slot in the current one.
        queue._register(b)
    return 0


cdef dict _forwarded(vector[PyObject*]& foreign):
    # {pool: [blocks]} of the blocks _free_core left for other pools; takes over the
    # references `foreign` holds (all of them, even when this raises).
    cdef size_t j = 0
    cdef dict others = None
    try:
        if foreign.size():
            others = {}
            while j < foreign.size():
                obj = <object>foreign[j]
                Py_DECREF_ptr(foreign[j])  # `obj` holds it now
                j += 1
                other = _owner_pool((<KVCacheBlock>obj).pool)
                if other is not None:  # (a weakly held pool that is gone: dropped, as vLLM)
                    others.setdefault(other, []).append(obj)
        return others
    finally:
        while j < foreign.size():
            Py_DECREF_ptr(foreign[j])
            j += 1
        foreign.clear()


# What the free loop does with one block (the general case, _free_one).
cdef enum:
    A_SKIP = 0        # a null block
    A_FOREIGN = 1     # another pool's block: forwarded to it after the loop
    A_HELD = 2        # decremented, still held (or a placeholder no pool owns)
    A_FIRST = 3       # reached 0: to the front of the free queue
    A_LAST = 4        # reached 0, hashed: to the tail (LRU)


cdef int _free_one(PyObject* o, PyObject* pool, FreeKVCacheBlockQueue queue,
                   bint enable_caching, kvpool_refbatch* rb, long* refs_out,
                   kvpool_refjournal* jn, Py_ssize_t at):
    # The general case of one block of the free loop (the loop inlines the common
    # one): returns an A_* action, or -E_* with nothing changed for this block.
    # Never raises and runs no Python code.
    cdef PyObject* p
    cdef long refs
    cdef int32_t slot
    cdef int err
    if not isinstance(<object>o, KVCacheBlock):
        return -E_NOT_BLOCK
    p = (<KVCacheBlock>o)._is_null_o
    if p != kvpool_false():
        return A_SKIP if p == kvpool_true() else -E_NULL_FIELD
    if not _read_refs(o, &refs):
        return -E_REF_FIELD
    refs_out[0] = refs
    p = <PyObject*>(<KVCacheBlock>o).pool
    if p != kvpool_none() and p != pool:
        return A_FOREIGN
    if (<KVCacheBlock>o)._queue is None and refs != 1:
        # A placeholder block no pool owns (vLLM's own tests build block tables of
        # bare KVCacheBlock(id)): vLLM decrements its ref_cnt and, as it does not
        # reach 0, never links it anywhere. Do the same; it cannot reach the free
        # list. One that would reach 0 is refused below as foreign.
        err = _put_refs_kept(o, refs - 1, rb, jn, at)
        return -err if err != E_NONE else A_HELD
    slot = (<KVCacheBlock>o)._slot
    if (<PyObject*>(<KVCacheBlock>o)._queue != <PyObject*>queue
            or not (0 <= slot < queue._list.capacity())):
        if p == pool and (<KVCacheBlock>o)._queue is not None:
            return -E_STALE  # this pool's block, registered to a queue it replaced
        return -E_NOT_OURS
    if refs <= 0 or queue._list.contains_unchecked(slot):
        return -E_DOUBLE_FREE
    err = _put_refs_kept(o, refs - 1, rb, jn, at)
    if err != E_NONE:
        return -err
    if refs != 1:
        return A_HELD
    if not enable_caching or <PyObject*>(<KVCacheBlock>o)._block_hash == kvpool_none():
        return A_FIRST
    return A_LAST


cdef inline void _tally(bint by_slot, PyObject* o, int32_t slot,
                        int64_t* prev, int64_t* t) noexcept:
    # One block of this pool freed from a list in eviction order (a request's block
    # table arrives tail first): count it, and whether it and the block before it in
    # the list are table-ascending (t[2]) or table-descending (t[3]) neighbours; the
    # pairs are counted per list (t[1], at the end). `by_slot`: `slot` is the block_id
    # (a pool's queue); other queues read block_id (one that is not an int is not
    # counted). Branch-free on the pool's path; runs no Python code.
    cdef long cur = slot
    cdef PyObject* p
    cdef unsigned long d
    cdef int64_t has_prev = t[0] != 0
    if not by_slot:
        p = (<KVCacheBlock>o)._block_id_o
        if p is NULL or not kvpool_is_int(p) or not kvpool_long_read(p, &cur):
            return
    d = <unsigned long>cur - <unsigned long>prev[0]  # (wraps, never overflows)
    t[0] += 1
    t[2] += has_prev & (d == <unsigned long>-1)  # ascending in the table
    t[3] += has_prev & (d == 1)
    prev[0] = cur


cdef inline int32_t _own_held_once_slot(PyObject* o, PyObject* pool_o, PyObject* queue_o,
                                        uint32_t capacity, const int32_t* free_marks):
    # _free_core's common case: the slot of `o` when it is a held-once block of this
    # pool (pool_o) and queue (queue_o), not the null block and not free; else -1.
    cdef int32_t slot
    if (<void*>Py_TYPE(<object>o) == <void*>KVCacheBlock
            and (<KVCacheBlock>o)._ref_cnt_o == kvpool_si_obj(1)
            and (<KVCacheBlock>o)._is_null_o == kvpool_false()
            and <PyObject*>(<KVCacheBlock>o).pool == pool_o
            and <PyObject*>(<KVCacheBlock>o)._queue == queue_o):
        slot = (<KVCacheBlock>o)._slot
        if <uint32_t>slot < capacity and free_marks[slot] < 0:
            return slot
    return -1


cdef inline PyObject* _own_handle_block(int64_t h, int64_t own_owner, PyObject** own_items,
                                        int64_t own_size, PyObject* queue_o, PyObject* pool_o,
                                        const int32_t* free_marks, int32_t* fast_slot):
    # _free_core's common case for a deferred-free handle: the block of this pool's own
    # queue that handle `h` still names (the block at that slot of own_items is
    # registered there), with fast_slot set when it is a held-once block of this pool,
    # not null and not free; NULL when the handle names another owner's block or one
    # that moved (_handle_to_block resolves it then). Runs no Python code.
    cdef int64_t hslot = <int64_t><uint32_t>h
    cdef PyObject* o
    if (h >> 32) != own_owner or hslot >= own_size:
        return NULL
    o = own_items[hslot]
    if (<void*>Py_TYPE(<object>o) != <void*>KVCacheBlock
            or <PyObject*>(<KVCacheBlock>o)._queue != queue_o
            or (<KVCacheBlock>o)._slot != hslot):
        return NULL
    if ((<KVCacheBlock>o)._ref_cnt_o == kvpool_si_obj(1)
            and (<KVCacheBlock>o)._is_null_o == kvpool_false()
            and <PyObject*>(<KVCacheBlock>o).pool == pool_o
            and free_marks[hslot] < 0):
        fast_slot[0] = <int32_t>hslot
    return o


cdef void _free_core_link(FreeKVCacheBlockQueue queue, int32_t* first, Py_ssize_t nfirst,
                          int32_t* last, Py_ssize_t nlast, vector[PyObject*]* foreign_out,
                          Py_ssize_t nforeign, int64_t* tally):
    # _free_core's success path: every block was checked (in range, not free, listed
    # once per reference), so these batch links cannot fail; the forwarded blocks'
    # references taken, the table statistics added. Runs no Python code.
    cdef Py_ssize_t j
    if nfirst:
        queue._list.prepend_n_unchecked(first, <int32_t>nfirst)
    if nlast:
        queue._list.append_n_unchecked(last, <int32_t>nlast)
    for j in range(nforeign):
        Py_INCREF_ptr(deref(foreign_out)[j])
    tally[1] = tally[0] - 1 if tally[0] > 0 else 0  # one list: n blocks, n - 1 pairs
    for j in range(4):
        queue._table_stats[j] += tally[j]


cdef int _free_core_failed(PyObject** items, Py_ssize_t n, Py_ssize_t step,
                           FencedDeferredFreeQueue deferred, const int64_t* handles,
                           PyObject* pool_o, int err, Py_ssize_t k, long refs,
                           kvpool_refbatch* rb, kvpool_refjournal* jn,
                           vector[PyObject*]* stale_out) except -1:
    # _free_core's error path (err at block k; refs: the loop's last read count):
    # undo, then raise; or, for a stale block with stale_out given, return 1 (the
    # caller adopts the blocks and frees again).
    cdef HandleTable ht
    cdef Py_ssize_t j
    cdef PyObject* o
    cdef PyObject* none = kvpool_none()
    cdef int action
    cdef object culprit
    # Undo, last block first: every block before the failing one that is neither
    # null nor another pool's was decremented once per occurrence; the journal
    # gives back the replaced ref_cnt objects, so nothing is allocated. Nothing
    # was linked yet.
    ht.current = -1
    j = k - 1
    while j >= 0:
        o = items[j * step] if handles is NULL else _handle_to_block(deferred, handles[j], &ht, &action)
        j -= 1
        if _null_state(o) == 1:
            continue
        if (<PyObject*>(<KVCacheBlock>o).pool != none
                and <PyObject*>(<KVCacheBlock>o).pool != pool_o):
            continue
        _read_refs(o, &refs)
        _undo_refs(o, refs + 1, rb, jn, j + 1)  # the value it had
    if err == E_STALE and stale_out is not NULL and handles is NULL:
        # A block of this pool held in a queue the pool replaced: the caller adopts
        # it and frees again (returns 1). It gets the blocks as owned references
        # before any Python code can run (the flush below, or an exception's
        # creation, could run a finalizer that changes the caller's list).
        try:
            deref(stale_out).resize(n)
        except MemoryError:
            deref(stale_out).clear()  # no room: raised as an error below
        else:
            for j in range(n):
                o = items[j * step]
                Py_INCREF_ptr(o)
                deref(stale_out)[j] = o
            _flush(rb)
            return 1
    if k == n or err == E_TAKEN_OVER or err == E_CORRUPT_HANDLE:
        culprit = None
    elif handles is NULL:
        culprit = <object>items[k * step]
    else:
        culprit = <object>_handle_to_block(deferred, handles[k], &ht, &action)
    if culprit is not None and err == E_DOUBLE_FREE:
        _read_refs(<PyObject*>culprit, &refs)
    _flush(rb)
    _raise_loop_error(err, culprit, "free_blocks", refs)
    return -1   # (not reached: _raise_loop_error raises)


# The loop of pool_free_blocks over items[0], items[step], ... (n of them, borrowed
# references the caller keeps alive), or, when `handles` is not NULL, over the
# blocks named by handles[0 .. n-1] of `deferred` (resolved as the loop goes;
# `own_owner` is the owner index of `queue` there, -1 if none). No Python code
# runs and nothing that could start a garbage collection is allocated until the
# loop and its undo are done, so the items cannot change under it.
#
# On success every block of this pool is freed and linked, other pools' blocks
# are in *foreign_out (owned references), and still no Python code has run: the
# caller can record the free (e.g. drop a deferred entry) before anything else
# happens, then forward the foreign blocks and call _release_parked(). On error
# nothing is changed, parked objects are released, and the exception is raised
# (_free_core_failed).
cdef int _free_core(object pool, FreeKVCacheBlockQueue queue, PyObject** items,
                    Py_ssize_t n, Py_ssize_t step, bint enable_caching,
                    FencedDeferredFreeQueue deferred, const int64_t* handles,
                    int64_t own_owner, vector[PyObject*]* foreign_out,
                    vector[PyObject*]* stale_out=NULL) except -1:
    cdef HandleTable ht
    cdef int32_t fast_slot
    cdef PyObject** own_items = kvpool_list_items(<PyObject*>queue._blocks)
    cdef int64_t own_size = PyList_GET_SIZE(queue._blocks)
    cdef Py_ssize_t k = 0, nfirst = 0, nlast = 0, nforeign = 0, n10 = 0
    cdef PyObject* o
    cdef PyObject* none = kvpool_none()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef object owner = _block_owner(pool)  # what the pool's blocks hold as `pool`
    cdef PyObject* pool_o = <PyObject*>owner
    cdef PyObject* queue_o = <PyObject*>queue
    cdef long refs = 0
    cdef int32_t slot
    cdef uint32_t capacity = <uint32_t>queue._list.capacity()
    cdef const int32_t* free_marks = queue._list.free_marks()
    cdef int err = E_NONE, action
    cdef int32_t* first
    cdef int32_t* last
    cdef PyObject** foreign
    cdef kvpool_refbatch rb
    cdef kvpool_refjournal jn
    cdef int64_t tally[4]
    cdef int64_t tally_prev = 0
    cdef bint by_slot = queue._lazy  # a pool's queue: slot == block_id
    tally[0] = tally[1] = tally[2] = tally[3] = 0
    # Scratch space of the queue (no allocation per call once it has grown). Only the
    # loop and its links use it, before any Python code (which could call into this
    # queue again) can run.
    queue._scratch.resize(2 * n)
    first = queue._scratch.data()
    last = first + n
    queue._ptr_scratch.resize(2 * n)
    foreign = queue._ptr_scratch.data()
    queue._idx_scratch.resize(n)
    _journal_init(&jn, foreign + n, queue._idx_scratch.data())
    kvpool_refbatch_init(&rb)
    ht.current = -1
    while k < n:
        # The common case (fast_slot >= 0), a held-once block of this pool; else _free_one.
        if handles is NULL:
            o = items[k * step]
            fast_slot = _own_held_once_slot(o, pool_o, queue_o, capacity, free_marks)
        else:
            fast_slot = -1
            o = _own_handle_block(handles[k], own_owner, own_items, own_size, queue_o,
                                  pool_o, free_marks, &fast_slot)
            if o is NULL:
                o = _handle_to_block(deferred, handles[k], &ht, &err)
                if o is NULL:
                    break
        if fast_slot >= 0:
            (<KVCacheBlock>o)._ref_cnt_o = zero  # counted in n10
            n10 += 1
            _tally(by_slot, o, fast_slot, &tally_prev, tally)
            if not enable_caching or <PyObject*>(<KVCacheBlock>o)._block_hash == none:
                first[nfirst] = fast_slot
                nfirst += 1
            else:
                last[nlast] = fast_slot
                nlast += 1
            k += 1
            continue
        action = _free_one(o, pool_o, queue, enable_caching, &rb, &refs, &jn, k)
        if action < 0:
            err = -action
            break
        if action == A_FOREIGN:
            foreign[nforeign] = o
            nforeign += 1
        elif action == A_FIRST or action == A_LAST or (
                action == A_HELD and <PyObject*>(<KVCacheBlock>o)._queue == queue_o):
            slot = (<KVCacheBlock>o)._slot
            if action == A_FIRST:
                first[nfirst] = slot
                nfirst += 1
            elif action == A_LAST:
                last[nlast] = slot
                nlast += 1
            _tally(by_slot, o, slot, &tally_prev, tally)
        k += 1
    _fold_0_to_1(&rb, -n10)
    if err == E_NONE and nforeign:
        # The forwarded blocks leave the scratch space before anything else can use it.
        try:
            foreign_out.assign(foreign, foreign + nforeign)
        except MemoryError:
            err = E_NO_MEMORY
            k = n  # undo everything; the error names no block
    if err != E_NONE:
        return _free_core_failed(items, n, step, deferred, handles, pool_o, err, k, refs,
                                 &rb, &jn, stale_out)
    _free_core_link(queue, first, nfirst, last, nlast, foreign_out, nforeign, tally)
    _journal_release(&jn)  # (exact ints run no Python code; others are parked)
    kvpool_refbatch_flush(&rb)  # (the ints' counts only: no Python code)
    return 0
