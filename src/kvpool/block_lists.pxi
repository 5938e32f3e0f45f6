# Included by _core.pyx: reading the callers' block iterables without copies (a list, reversed(list)).

cdef object _LIST_REVERSEITERATOR = type(reversed([]))


cdef list _source(object blocks, Py_ssize_t* start, Py_ssize_t* step, Py_ssize_t* count):
    # What to iterate, without copying the common cases: a list, or the list behind
    # `reversed(list)` (vLLM frees that on every request finish; its list and
    # position are the iterator's pickle state). Other iterables (a list subclass
    # or the reverse iterator of one included) are copied once.
    cdef list seq
    cdef Py_ssize_t index
    if type(blocks) is list:
        start[0], step[0], count[0] = 0, 1, PyList_GET_SIZE(<list>blocks)
        return <list>blocks
    if type(blocks) is _LIST_REVERSEITERATOR:
        state = blocks.__reduce__()
        if len(state) >= 3 and type(state[1][0]) is list and type(state[2]) is int:
            seq = <list>state[1][0]
            index = <Py_ssize_t>state[2]
            blocks.__setstate__(-1)  # consumed, as iterating it would leave it
            if 0 <= index < PyList_GET_SIZE(seq):
                start[0], step[0], count[0] = index, -1, index + 1
                return seq
            start[0], step[0], count[0] = 0, 1, 0  # exhausted, as CPython's would be
            return []
    seq = list(blocks)
    start[0], step[0], count[0] = 0, 1, PyList_GET_SIZE(seq)
    return seq


cdef list _private_list(object blocks):
    # A copy nobody else can change, for loops that call into Python per block.
    cdef Py_ssize_t start, step, n
    cdef list seq = _source(blocks, &start, &step, &n)
    if step == 1:
        return seq[start:start + n]
    return seq[start::-1] if n else []
