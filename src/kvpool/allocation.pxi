# Included by _core.pyx: the table statistics of the allocation policies (fragmentation_stats).

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
    cdef Py_ssize_t n = PyList_GET_SIZE(blocks), i
    cdef long prev, cur, pairs = 0, asc = 0, desc = 0
    cdef bint have_prev = prev_last is not None
    cdef PyObject* o
    cdef PyObject* p
    if type(counters) is not list or len(counters) != 4:
        raise TypeError("counters must be a list of 4 ints")
    if have_prev:
        prev = prev_last
    for i in range(n):
        o = PyList_GET_ITEM(blocks, i)
        if <void*>Py_TYPE(<object>o) != <void*>KVCacheBlock:
            raise TypeError(f"expected a kvpool KVCacheBlock, got {_type_name(o)}")
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
