# Included by _core.pyx: BlockPool.touch.

cdef inline int _touch_one(PyObject* o, FreeKVCacheBlockQueue queue, int32_t* removed,
                           Py_ssize_t* nremoved, Py_ssize_t* n01, kvpool_refbatch* rb,
                           kvpool_refjournal* jn, Py_ssize_t k):
    # One block of pool_touch off its common case (a null block, another ref_cnt, a
    # bad field): E_NONE when it is done (a removal from the free queue recorded in
    # removed[3 * nremoved ...], a 0 -> 1 counted in n01), else the error; the caller
    # undoes what its loop did. Runs no Python code.
    cdef PyObject* p
    cdef long refs = 0
    cdef int32_t slot
    cdef int32_t capacity = queue._list.capacity()
    if not isinstance(<object>o, KVCacheBlock):
        return E_NOT_BLOCK
    p = (<KVCacheBlock>o)._is_null_o
    if p != kvpool_false():
        return E_NONE if p == kvpool_true() else E_NULL_FIELD
    p = (<KVCacheBlock>o)._ref_cnt_o
    if p == kvpool_si_obj(0):
        refs = 0
    elif not _read_refs(o, &refs):
        return E_REF_FIELD
    if refs == 0:
        slot = (<KVCacheBlock>o)._slot
        if (<PyObject*>(<KVCacheBlock>o)._queue != <PyObject*>queue
                or not (0 <= slot < capacity)):
            return E_TOUCH_FOREIGN
        if not queue._list.contains_unchecked(slot):
            return E_TOUCH_NOT_FREE
        removed[3 * nremoved[0]] = slot
        queue._list.remove_recording(slot, &removed[3 * nremoved[0] + 1],
                                     &removed[3 * nremoved[0] + 2])
        nremoved[0] += 1
        if p == kvpool_si_obj(0):
            (<KVCacheBlock>o)._ref_cnt_o = kvpool_si_obj(1)  # the common case, counted in n01
            n01[0] += 1
            return E_NONE
    if refs == LONG_MAX:
        return E_OVERFLOW
    return _put_refs_kept(o, refs + 1, rb, jn, k)  # (a recorded removal is undone by the caller)


def pool_touch(FreeKVCacheBlockQueue queue not None, object blocks):
    """``BlockPool.touch``: ``ref_cnt += 1``; a block with ``ref_cnt == 0`` (an
    eviction candidate) is first removed from the free queue. Null blocks are skipped.

    Raises:
        TypeError: not a kvpool block, or a field of the wrong type.
        BlockStateError: a block with ``ref_cnt == 0`` that is not in this pool's free
            queue. Nothing changes when raised: removals are undone in reverse order,
            which puts every block back exactly where it was.
    """
    cdef Py_ssize_t start, step, n, k = 0, j, n01 = 0, nremoved = 0
    cdef list seq = _source(blocks, &start, &step, &n)
    cdef PyObject** items = kvpool_list_items(<PyObject*>seq) + start
    cdef PyObject* o
    cdef PyObject* false_ = kvpool_false()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef PyObject* one = kvpool_si_obj(1)
    cdef long refs = 0
    cdef int32_t slot
    cdef int err = E_NONE
    cdef int32_t* removed  # (slot, prev node, next node) triples, for the undo
    cdef kvpool_refbatch rb
    cdef kvpool_refjournal jn
    cdef object culprit
    cdef PyObject* queue_o = <PyObject*>queue
    cdef void* block_type = <void*>KVCacheBlock
    cdef const int32_t* free_marks = queue._list.free_marks()
    cdef uint32_t ucapacity = <uint32_t>queue._list.capacity()
    if n == 0:
        return
    queue._scratch.resize(3 * n)
    removed = queue._scratch.data()
    queue._ptr_scratch.resize(n)
    queue._idx_scratch.resize(n)
    _journal_init(&jn, queue._ptr_scratch.data(), queue._idx_scratch.data())
    kvpool_refbatch_init(&rb)
    # No Python code runs in this loop or its undo (field types are checked, not
    # converted; nothing is allocated that could start a garbage collection), so
    # `items` stays valid.
    while k < n:
        o = items[k * step]
        # The common case (a prefix-cache hit on a free block): take it out of the
        # free queue, ref_cnt 0 -> 1.
        if (<void*>Py_TYPE(<object>o) == block_type
                and (<KVCacheBlock>o)._ref_cnt_o == zero
                and (<KVCacheBlock>o)._is_null_o == false_
                and <PyObject*>(<KVCacheBlock>o)._queue == queue_o):
            slot = (<KVCacheBlock>o)._slot
            if <uint32_t>slot < ucapacity and free_marks[slot] >= 0:
                removed[3 * nremoved] = slot
                queue._list.remove_recording(slot, &removed[3 * nremoved + 1],
                                             &removed[3 * nremoved + 2])
                nremoved += 1
                (<KVCacheBlock>o)._ref_cnt_o = one  # counted in n01
                n01 += 1
                k += 1
                continue
        err = _touch_one(o, queue, removed, &nremoved, &n01, &rb, &jn, k)
        if err != E_NONE:
            break
        k += 1
    _fold_0_to_1(&rb, n01)
    if err != E_NONE:
        # Blocks items[0 .. k-1] (null blocks excepted) were incremented once per
        # occurrence: undone last first, the journal giving back replaced ref_cnt
        # objects (nothing is allocated); removals are undone in reverse order.
        j = k - 1
        while j >= 0:
            o = items[j * step]
            if _null_state(o) != 1:
                _read_refs(o, &refs)
                _undo_refs(o, refs - 1, &rb, &jn, j)
            j -= 1
        j = nremoved - 1
        while j >= 0:
            queue._list.undo_remove(removed[3 * j], removed[3 * j + 1], removed[3 * j + 2])
            j -= 1
        culprit = <object>items[k * step]
        _flush(&rb)
        _raise_loop_error(err, culprit, "touch", 0)
    _journal_release(&jn)
    _flush(&rb)
