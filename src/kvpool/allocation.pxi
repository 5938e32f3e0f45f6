# Included by _core.pyx: the table statistics of the allocation policies (fragmentation_stats).

@cython.boundscheck(True)
def count_table_pairs(object prev_last, list blocks, object counters):
    """Add the adjacent block pairs that ``blocks`` appends to a block table to
    ``counters`` (a ``list[int]`` of 4: blocks, pairs, ascending pairs, descending
    pairs). ``prev_last``: the ``block_id`` the table ended with before, or None for
    a new table. A pair is ascending when the next id is the previous + 1, descending
    when it is the previous - 1. Native: no Python code per block.

    Raises:
        TypeError: an item is not a kvpool ``KVCacheBlock`` or a ``block_id`` is not
            an int, or ``counters`` is not a list of 4 ints.
    """
    cdef Py_ssize_t n, i
    cdef long prev, cur, pairs = 0, asc = 0, desc = 0
    cdef bint have_prev = prev_last is not None
    cdef PyObject* o
    cdef PyObject* p
    cdef object q
    if type(counters) is not list or len(counters) != 4:
        raise TypeError("counters must be a list of 4 ints")
    if have_prev:
        prev = prev_last  # may run prev_last's __int__/__index__: before `blocks` is read
    # From here on no Python code runs until the counters are updated.
    n = PyList_GET_SIZE(blocks)
    for i in range(n):
        o = PyList_GET_ITEM(blocks, i)
        if <void*>Py_TYPE(<object>o) != <void*>KVCacheBlock:
            raise TypeError(f"expected a kvpool KVCacheBlock, got {_type_name(o)}")
        q = (<KVCacheBlock>o)._queue
        if q is not None and (<FreeKVCacheBlockQueue>q)._lazy and (<KVCacheBlock>o)._slot >= 0:
            cur = (<KVCacheBlock>o)._slot  # a pool's block: its slot is its block_id
        else:
            p = (<KVCacheBlock>o)._block_id_o
            if p is NULL or not kvpool_is_int(p) or not kvpool_long_read(p, &cur):
                raise TypeError("block_id must be an int")
        if have_prev:
            pairs += 1
            if cur == prev + 1:
                asc += 1
            elif cur == prev - 1:
                desc += 1
        prev = cur
        have_prev = True
    counters[0] += n
    counters[1] += pairs
    counters[2] += asc
    counters[3] += desc


@cython.boundscheck(True)
cdef int _count_slot_pairs(const int32_t* slots, Py_ssize_t n, long prev, object counters) except -1:
    # count_table_pairs over a pool's slots (slot == block_id), without visiting the
    # block objects: what pool_get_new_blocks does with the slots it took.
    cdef Py_ssize_t i
    cdef long pairs = 0, asc = 0, desc = 0, cur
    for i in range(n):
        cur = slots[i]
        if prev >= 0:
            pairs += 1
            if cur == prev + 1:
                asc += 1
            elif cur == prev - 1:
                desc += 1
        prev = cur
    if type(counters) is not list or len(counters) != 4:
        raise TypeError("counters must be a list of 4 ints")
    counters[0] += n
    counters[1] += pairs
    counters[2] += asc
    counters[3] += desc
    return 0
