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


cdef inline int _ref_obj(long value, kvpool_refbatch* rb, PyObject** out):
    # The object to store for ref_cnt ``value`` in *out: a new reference, or one of the
    # batched small ints whose count goes to ``rb``. Never raises: E_NONE, E_OVERFLOW or
    # E_NO_MEMORY (nothing made then).
    if 0 <= value <= KVPOOL_SI_MAX and kvpool_si_enabled():
        out[0] = kvpool_si_obj(value)
        if value < KVPOOL_BATCHED:
            rb.d[value] += 1
        else:
            Py_INCREF_ptr(out[0])
        return E_NONE
    if value == LONG_MAX:
        return E_OVERFLOW
    out[0] = _PyLong_FromLong(value)  # a new reference
    if out[0] is NULL:
        _PyErr_Clear()
        return E_NO_MEMORY
    return E_NONE


cdef inline bint _batched(PyObject* old, kvpool_refbatch* rb):
    # A replaced ref_cnt object that is one of the batched small ints: its count goes to
    # ``rb`` (True). Anything else is the caller's to release or keep (False).
    cdef long old_value = kvpool_si_value(old)
    if 0 <= old_value < KVPOOL_BATCHED:
        rb.d[old_value] -= 1
        return True
    return False


cdef inline int _put_refs(PyObject* o, long value, kvpool_refbatch* rb):
    """Set the ref_cnt of block ``o`` (borrowed) to ``value``. Refcount updates of the
    ints 0..7 go to ``rb`` (flushed by the caller). Never raises: returns E_NONE,
    E_OVERFLOW or E_NO_MEMORY (nothing changed then)."""
    cdef PyObject* old = (<KVCacheBlock>o)._ref_cnt_o
    cdef PyObject* new
    cdef int err = _ref_obj(value, rb, &new)
    if err != E_NONE:
        return err
    (<KVCacheBlock>o)._ref_cnt_o = new
    if not _batched(old, rb):
        _release_ref_cnt(old)
    return E_NONE


# The undo journal of a loop that changes ref_cnts: a replaced ref_cnt object that is
# not one of the batched small ints (a value above 7, or an int that is not the
# interpreter's cached one) is kept here, its reference with it, instead of being
# released. The undo puts it back, so an undo never allocates an int (a failed
# allocation there would leave a held block one reference short); the success path
# releases them (_journal_release). `obj` and `idx` have room for one entry per loop
# index: the caller reserves them before the loop changes anything.
ctypedef struct kvpool_refjournal:
    PyObject** obj     # the replaced objects (owned references), in loop order
    Py_ssize_t* idx    # the loop index each was replaced at
    Py_ssize_t n


cdef inline void _journal_init(kvpool_refjournal* jn, PyObject** obj, Py_ssize_t* idx):
    jn.obj = obj
    jn.idx = idx
    jn.n = 0


cdef inline int _put_refs_kept(PyObject* o, long value, kvpool_refbatch* rb,
                               kvpool_refjournal* jn, Py_ssize_t at):
    """:func:`_put_refs` for loop index ``at``, keeping the replaced object in ``jn``
    (unless it is a batched small int) for :func:`_undo_refs`. Never raises."""
    cdef PyObject* old = (<KVCacheBlock>o)._ref_cnt_o
    cdef PyObject* new
    cdef int err = _ref_obj(value, rb, &new)
    if err != E_NONE:
        return err
    (<KVCacheBlock>o)._ref_cnt_o = new
    if not _batched(old, rb):
        jn.obj[jn.n] = old
        jn.idx[jn.n] = at
        jn.n += 1
    return E_NONE


cdef inline void _undo_refs(PyObject* o, long value, kvpool_refbatch* rb,
                            kvpool_refjournal* jn, Py_ssize_t at):
    # Undo the change made at loop index `at` (call in reverse loop order): put the
    # kept object back, or else set `value`, which was then a batched small int (no
    # allocation). Never raises and runs no Python code.
    cdef PyObject* cur
    if jn.n and jn.idx[jn.n - 1] == at:
        jn.n -= 1
        cur = (<KVCacheBlock>o)._ref_cnt_o
        (<KVCacheBlock>o)._ref_cnt_o = jn.obj[jn.n]
        if not _batched(cur, rb):
            _release_ref_cnt(cur)
    else:
        _put_refs(o, value, rb)


cdef inline void _journal_release(kvpool_refjournal* jn):
    # The loop succeeded: drop the kept objects (exact ints run no Python code when
    # freed; anything else is parked until _flush).
    cdef Py_ssize_t i
    for i in range(jn.n):
        _release_ref_cnt(jn.obj[i])
    jn.n = 0


cdef inline void _flush(kvpool_refbatch* rb):
    kvpool_refbatch_flush(rb)
    _release_parked()


cdef inline void _release_parked():
    # Release replaced ref_cnt objects parked by the loops (may run Python code).
    if PyList_GET_SIZE(_GRAVEYARD):
        del _GRAVEYARD[:]
