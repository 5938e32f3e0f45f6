# Included by _core.pyx: the exceptions kvpool raises, and the error codes of the per-block loops (which stop, undo, then raise).

from kvpool.errors import KvpoolError  # the one base of kvpool's exceptions


class BlockStateError(KvpoolError, ValueError, RuntimeError):
    """A block is in the wrong state for the operation.

    Raised for a double free, removing a block that is not free, adding a block that
    already is, or a block that belongs to another pool's free list. Subclasses both
    ``ValueError`` and ``RuntimeError`` because vLLM's pure-Python queue raises
    ``RuntimeError`` for some of these and callers may catch either.
    """


class BlockIdOutOfRangeError(KvpoolError, IndexError, ValueError):
    """A block id outside ``[0, num_gpu_blocks)``."""


# Error codes of the free/touch loops. Those loops never raise while they run: they
# stop at the first bad block, undo what they did, and only then build the exception
# (building one allocates, and an allocation may start a garbage collection that runs
# Python code, which could change the caller's list under a borrowed pointer).
cdef enum:
    E_NONE = 0
    E_NOT_BLOCK = 1       # not a kvpool KVCacheBlock
    E_NULL_FIELD = 2      # is_null missing or not a bool
    E_REF_FIELD = 3       # ref_cnt missing, not an int, or beyond a C long
    E_NOT_OURS = 4        # free_blocks: a block of another pool's queue
    E_DOUBLE_FREE = 5
    E_OVERFLOW = 6
    E_NO_MEMORY = 7
    E_TOUCH_FOREIGN = 8   # touch: ref_cnt 0 but not of this queue
    E_TOUCH_NOT_FREE = 9  # touch: ref_cnt 0 but not in the free queue
    E_TAKEN_OVER = 10     # a deferred block was taken over by another queue
    E_CORRUPT_HANDLE = 11 # a deferred-free handle names no table entry
    E_STALE = 12          # free_blocks: a block of this pool registered to a queue it replaced


class _NotABlockError(KvpoolError, TypeError):
    """A free loop met an object that is not a block at all (it can never be freed);
    the deferred drain drops the part that holds it, as vLLM's ``popleft`` loop loses
    that entry, instead of stopping every later free behind it."""


class _StaleQueueBlock(BlockStateError):
    """A free loop met a block of its pool that is registered to a free queue the pool
    has since replaced (``pool.free_block_queue = FreeKVCacheBlockQueue(...)`` while
    requests held blocks). The loop's callers adopt such blocks into the pool's
    current queue and free again; raised to the user only if that is not possible."""


cdef int _raise_loop_error(int err, object blk, str op, long refs) except -1:
    """Raise the exception for a free/touch loop's error code (after its undo)."""
    cdef PyObject* o = <PyObject*>blk
    if err == E_STALE:
        raise _StaleQueueBlock(
            f"{op}(): block {_id_text(o)} of this pool was taken over by a free queue the "
            "pool does not use, and is free there (not held)")
    if err == E_TAKEN_OVER:
        raise BlockStateError(
            "a deferred block was taken over by another free queue before its fence")
    if err == E_CORRUPT_HANDLE:
        raise RuntimeError("corrupt deferred-free handle")
    if err == E_NOT_BLOCK:
        raise _NotABlockError(f"{op}() expects kvpool KVCacheBlock objects, got {_type_name(o)}")
    if err == E_NULL_FIELD:
        _is_null(<KVCacheBlock>blk)  # raises AttributeError / TypeError
    elif err == E_REF_FIELD:
        _ref_cnt(<KVCacheBlock>blk)  # raises AttributeError / TypeError / OverflowError
    elif err == E_NOT_OURS:
        raise BlockStateError(f"{op}(): block {_id_text(o)} does not belong to this pool")
    elif err == E_DOUBLE_FREE:
        raise BlockStateError(f"{op}(): double free of block {_id_text(o)} (ref_cnt={refs})")
    elif err == E_OVERFLOW:
        raise OverflowError(f"{op}(): ref_cnt of block {_id_text(o)} would overflow")
    elif err == E_NO_MEMORY:
        if blk is None:
            raise MemoryError(f"{op}(): out of memory")
        raise MemoryError(f"{op}(): no memory for the ref_cnt of block {_id_text(o)}")
    elif err == E_TOUCH_FOREIGN:
        raise BlockStateError(
            f"{op}(): block {_id_text(o)} has ref_cnt=0 but belongs to another pool's "
            "free queue or none")
    elif err == E_TOUCH_NOT_FREE:
        raise BlockStateError(
            f"{op}(): block {_id_text(o)} has ref_cnt=0 but is not in the free queue")
    raise RuntimeError(f"{op}(): block {_id_text(o)} is in an inconsistent state (error {err})")


cdef str _id_text(PyObject* o):
    # A block's id for an error message, without running Python code (a block_id
    # that is not an exact int could format itself by calling back into Python).
    cdef PyObject* p = (<KVCacheBlock>o)._block_id_o
    if p is NULL:
        return "<no block_id>"
    if _PyLong_CheckExact(p):
        return str(<object>p)
    return f"<{_type_name(p)} object>"


cdef str _type_name(PyObject* p):
    return (<bytes>Py_TYPE(<object>p).tp_name).decode("utf-8", "replace")
