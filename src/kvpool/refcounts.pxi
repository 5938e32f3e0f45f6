# Included by _core.pyx: the per-block loops' field access: borrowed block pointers, ref_cnt by small-int address, batched small-int reference counts.

# -- the hot loops' field access: borrowed block pointers, batched small-int refcounts -----
# The per-block loops below read blocks through borrowed PyObject* (no reference-count
# traffic on the block objects) and recognise ref_cnt values by the address of the
# interpreter's cached small ints (fastint.h). They never run Python code while they
# hold such pointers: fields are type-checked, never converted, and nothing that
# could start a garbage collection is allocated inside them.
if not kvpool_si_init():  # pragma: no cover - every CPython checked has the array
    import warnings
    warnings.warn("kvpool: small-int fast path unavailable on this interpreter; "
                  "block loops use the checked slow path", RuntimeWarning)

def _set_small_int_fast_path(bint enabled):
    """Turn the small-int fast path of the block loops on or off (for tests of the
    checked slow path; call between pool operations). Returns whether it is on."""
    if enabled:
        return bool(kvpool_si_init())
    kvpool_si_disable()
    return False


# Old ref_cnt objects that are not exact ints (an int subclass could run __del__) are
# parked here while a loop runs and released after it.
cdef list _GRAVEYARD = []


cdef inline void _fold_0_to_1(kvpool_refbatch* rb, Py_ssize_t count):
    # Add `count` ref_cnt swaps 0 -> 1 (negative: 1 -> 0) that a loop counted in a
    # register to the pending refcount deltas.
    rb.d[0] -= count
    rb.d[1] += count


cdef inline int _null_state(PyObject* o):
    # 0 or 1; -1 when is_null is missing or not a bool. Never raises.
    cdef PyObject* p = (<KVCacheBlock>o)._is_null_o
    if p == kvpool_false():
        return 0
    if p == kvpool_true():
        return 1
    return -1


cdef inline bint _read_refs(PyObject* o, long* out):
    # ref_cnt into out; False when it is missing, not an int or beyond a C long.
    # Never raises and runs no Python code (an int subclass's value is read as is).
    cdef PyObject* p = (<KVCacheBlock>o)._ref_cnt_o
    cdef long v = kvpool_si_value(p)
    if v >= 0:
        out[0] = v
        return True
    if p is NULL or not kvpool_is_int(p):
        return False
    return kvpool_long_read(p, out)


cdef inline void _release_ref_cnt(PyObject* old):
    # Drop a replaced ref_cnt object. An exact int's deallocation runs no Python code;
    # anything else (an int subclass could have __del__) is parked until _flush.
    if old is NULL:
        return
    if not _PyLong_CheckExact(old) and _PyList_Append(_GRAVEYARD, old) != 0:
        _PyErr_Clear()  # no memory to park it: release it now
    Py_DECREF_ptr(old)


cdef inline int _put_refs(PyObject* o, long value, kvpool_refbatch* rb):
    """Set the ref_cnt of block ``o`` (borrowed) to ``value``. Refcount updates of the
    ints 0..7 go to ``rb`` (flushed by the caller). Never raises: returns E_NONE,
    E_OVERFLOW or E_NO_MEMORY (nothing changed then)."""
    cdef PyObject* old = (<KVCacheBlock>o)._ref_cnt_o
    cdef PyObject* new
    cdef long old_value
    if 0 <= value <= KVPOOL_SI_MAX and kvpool_si_enabled():
        new = kvpool_si_obj(value)
        if value < KVPOOL_BATCHED:
            rb.d[value] += 1
        else:
            Py_INCREF_ptr(new)
    else:
        if value == LONG_MAX:
            return E_OVERFLOW
        new = _PyLong_FromLong(value)  # a new reference
        if new is NULL:
            _PyErr_Clear()
            return E_NO_MEMORY
    (<KVCacheBlock>o)._ref_cnt_o = new
    old_value = kvpool_si_value(old)
    if 0 <= old_value < KVPOOL_BATCHED:
        rb.d[old_value] -= 1
    else:
        _release_ref_cnt(old)
    return E_NONE


cdef inline void _flush(kvpool_refbatch* rb):
    kvpool_refbatch_flush(rb)
    _release_parked()


cdef inline void _release_parked():
    # Release replaced ref_cnt objects parked by the loops (may run Python code).
    if PyList_GET_SIZE(_GRAVEYARD):
        del _GRAVEYARD[:]
