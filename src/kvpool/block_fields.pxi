# Included by _core.pyx: NULL-checking, type-checking access to KVCacheBlock's object fields (ref_cnt, is_null, block_id).

# -- NULL-checking access to the member-descriptor fields -------------------------------
cdef inline int _store(PyObject** field, object value) except -1:
    Py_INCREF(value)
    Py_XDECREF(field[0])
    field[0] = <PyObject*>value
    return 0


cdef inline long _ref_cnt(KVCacheBlock b) except? -1:
    # Native loops accept only ints here (no user __index__ runs inside them).
    cdef PyObject* p = b._ref_cnt_o
    if p is NULL:
        raise AttributeError(f"KVCacheBlock has no ref_cnt (it was deleted)")
    if not kvpool_is_int(p):
        raise TypeError(f"ref_cnt must be an int, got {_type_name(p)}")
    return kvpool_long_value(p)


# Reference counts are small: store shared int objects instead of creating new ones.
cdef tuple _SMALL_INTS = tuple(range(1024))  # immutable: gc.get_referrers reaches it


cdef inline int _set_ref_cnt(KVCacheBlock b, long value) except -1:
    if value == LONG_MAX:
        raise OverflowError("ref_cnt overflow")
    if 0 <= value < 1024:
        return _store(&b._ref_cnt_o, <object>PyTuple_GET_ITEM(_SMALL_INTS, value))
    return _store(&b._ref_cnt_o, value)


cdef inline bint _is_null(KVCacheBlock b) except -1:
    # Native loops accept only bools here (no user __bool__ runs inside them).
    cdef PyObject* p = b._is_null_o
    if p == kvpool_false():
        return 0
    if p == kvpool_true():
        return 1
    if p is NULL:
        raise AttributeError("KVCacheBlock has no is_null (it was deleted)")
    raise TypeError(f"is_null must be a bool, got {_type_name(p)}")


cdef inline object _block_id(KVCacheBlock b):
    return None if b._block_id_o is NULL else <object>b._block_id_o


cdef inline KVCacheBlock _as_block(object obj):
    if not isinstance(obj, KVCacheBlock):
        raise TypeError(f"expected a kvpool KVCacheBlock, got {type(obj).__name__}")
    return <KVCacheBlock>obj
