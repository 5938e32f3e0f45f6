# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""Native KV cache block metadata, free block queue and block-pool hot loops.

Extension types that vLLM 0.33.0 code touches directly, with the same names,
constructors and attributes as ``vllm/v1/core/kv_cache_utils.py``:

* :class:`KVCacheBlock` - ``block_id``, ``ref_cnt``, ``is_null`` are plain C fields
  exposed as member descriptors (read as fast as a slots dataclass field).
* :class:`FreeKVCacheBlockQueue` - the free list lives in two int32 link arrays
  (``cpp/free_block_list.h``), not in Python object references. A block's
  ``prev_free_block`` / ``next_free_block`` read those arrays, so code that inspects
  the links sees the truth.

The ``pool_*`` functions are the per-block loops of ``BlockPool`` (allocation, free,
touch, unpin, evict). Each validates every block before it changes anything, so a
rejected call leaves ref counts and the free list exactly as they were.
"""

cimport cython
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from cpython.object cimport Py_TYPE
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
import sys
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref

from kvpool.kvpool_cpp cimport FreeBlockList, FencedFreeQueue


cdef extern from "Python.h":
    bint _PyLong_CheckExact "PyLong_CheckExact"(PyObject* o)
    PyObject* _PyLong_FromLong "PyLong_FromLong"(long v)
    int _PyList_Append "PyList_Append"(object lst, PyObject* item)
    void _PyErr_Clear "PyErr_Clear"()
    long _PyLong_AsLong "PyLong_AsLong"(PyObject* o) except? -1
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags
        const char* doc
    ctypedef struct _TypeObject "PyTypeObject":
        PyObject* tp_dict
    object PyDescr_NewMember(_TypeObject* tp, PyMemberDef* member)
    void PyType_Modified(_TypeObject* tp)

cdef extern from "structmember.h":
    int T_OBJECT_EX


cdef extern from "fastint.h":
    long kvpool_long_value(PyObject* o) except? -1
    PyObject* kvpool_true()
    PyObject* kvpool_false()
    PyObject* kvpool_none()
    bint kvpool_is_int(PyObject* o)
    PyObject** kvpool_list_items(PyObject* lst)
    int KVPOOL_SI_MAX
    int KVPOOL_BATCHED
    int kvpool_si_init()
    void kvpool_si_disable()
    long kvpool_si_value(PyObject* p)
    bint kvpool_long_read(PyObject* p, long* out)
    bint kvpool_si_enabled()
    PyObject* kvpool_si_obj(long v)
    ctypedef struct kvpool_refbatch:
        Py_ssize_t d[8]
    void kvpool_refbatch_init(kvpool_refbatch* rb)
    void kvpool_refbatch_flush(kvpool_refbatch* rb)
    void Py_INCREF_ptr "Py_INCREF"(PyObject* o)
    void Py_DECREF_ptr "Py_DECREF"(PyObject* o)

from operator import index as _index
from libc.limits cimport LONG_MAX


cdef int32_t HEAD_SLOT = -2
cdef int32_t TAIL_SLOT = -3
cdef int32_t UNREGISTERED = -1


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
cdef list _SMALL_INTS = list(range(1024))


cdef inline int _set_ref_cnt(KVCacheBlock b, long value) except -1:
    if value == LONG_MAX:
        raise OverflowError("ref_cnt overflow")
    if 0 <= value < 1024:
        return _store(&b._ref_cnt_o, <object>PyList_GET_ITEM(_SMALL_INTS, value))
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


cdef int _raise_loop_error(int err, object blk, str op, long refs) except -1:
    """Raise the exception for a free/touch loop's error code (after its undo)."""
    cdef PyObject* o = <PyObject*>blk
    if err == E_TAKEN_OVER:
        raise BlockStateError(
            "a deferred block was taken over by another free queue before its fence")
    if err == E_CORRUPT_HANDLE:
        raise RuntimeError("corrupt deferred-free handle")
    if err == E_NOT_BLOCK:
        raise TypeError(f"{op}() expects kvpool KVCacheBlock objects, got {_type_name(o)}")
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


cdef inline void _flush(kvpool_refbatch* rb):
    kvpool_refbatch_flush(rb)
    _release_parked()


class BlockStateError(ValueError, RuntimeError):
    """A block is in the wrong state for the operation.

    Raised for a double free, removing a block that is not free, adding a block that
    already is, or a block that belongs to another pool's free list. Subclasses both
    ``ValueError`` and ``RuntimeError`` because vLLM's pure-Python queue raises
    ``RuntimeError`` for some of these and callers may catch either.
    """


class BlockIdOutOfRangeError(IndexError, ValueError):
    """A block id outside ``[0, num_gpu_blocks)``."""


# --------------------------------------------------------------------------------------
# KVCacheBlock
# --------------------------------------------------------------------------------------
@cython.auto_pickle(False)
cdef class KVCacheBlock:
    """KV-cache block metadata (mirrors ``vllm.v1.core.kv_cache_utils.KVCacheBlock``,
    vLLM 0.33.0, a ``@dataclass(slots=True)``).

    Args:
        block_id: block id, ``0 <= block_id < num_gpu_blocks`` (``-1`` for the fake
            head/tail of a free queue). C ``int``.
        ref_cnt: number of requests holding the block.
        _block_hash / _block_hash_num_tokens: prefix-cache key and the tokens it covers.
        prev_free_block / next_free_block: only honoured for a block that no kvpool
            free queue owns; a queue-owned block's links are the queue's.
        is_null: the null block (block 0 of a pool), never freed or cached.
        pool: keyword only; the pool that owns the block (deferred frees may hold
            blocks of several pools). Not part of equality.

    Equality is the dataclass's field-by-field equality (``pool`` excluded) and the
    type is unhashable, as in vLLM.
    """

    def __cinit__(self):
        self._slot = UNREGISTERED
        _store(&self._block_id_o, 0)
        _store(&self._ref_cnt_o, 0)
        _store(&self._is_null_o, False)

    def __dealloc__(self):
        Py_XDECREF(self._block_id_o)
        Py_XDECREF(self._ref_cnt_o)
        Py_XDECREF(self._is_null_o)
        self._block_id_o = self._ref_cnt_o = self._is_null_o = NULL

    def __init__(self, block_id, ref_cnt=0, _block_hash=None,
                 _block_hash_num_tokens=None, prev_free_block=None,
                 next_free_block=None, is_null=False, *, pool=None):
        _store(&self._block_id_o, block_id)
        _store(&self._ref_cnt_o, ref_cnt)
        _store(&self._is_null_o, is_null)
        self._block_hash = _block_hash
        self._block_hash_num_tokens = _block_hash_num_tokens
        self.pool = pool
        if prev_free_block is not None:
            self.prev_free_block = prev_free_block
        if next_free_block is not None:
            self.next_free_block = next_free_block

    @property
    def block_hash(self):
        """The hash key (block hash + KV cache group id), or None if not cached."""
        return self._block_hash

    @property
    def block_hash_num_tokens(self):
        """Number of prefix tokens covered by ``block_hash`` (None if not cached)."""
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash, num_tokens=None):
        """Set the prefix-cache key. Raises AssertionError if the block already has one
        (as vLLM's ``assert`` does)."""
        if self._block_hash is not None or self._block_hash_num_tokens is not None:
            raise AssertionError("The block already has a hash. This should not happen.")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self):
        """Reset the block hash when the block is evicted."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    @property
    def prev_free_block(self):
        """Previous block in the free queue (the fake head for the first free block),
        or None when the block is not free."""
        if self._queue is None:
            return self._prev_py
        return self._queue._neighbour(self, False)

    @prev_free_block.setter
    def prev_free_block(self, value):
        _set_link(self, value, False)

    @prev_free_block.deleter
    def prev_free_block(self):
        _set_link(self, None, False)

    @property
    def next_free_block(self):
        """Next block in the free queue (the fake tail for the last free block), or None
        when the block is not free."""
        if self._queue is None:
            return self._next_py
        return self._queue._neighbour(self, True)

    @next_free_block.setter
    def next_free_block(self, value):
        _set_link(self, value, True)

    @next_free_block.deleter
    def next_free_block(self):
        _set_link(self, None, True)

    @property
    def is_free(self):
        """True if the block is in a kvpool free queue."""
        if self._queue is None or self._slot < 0:
            return False
        return self._queue._list.contains(self._slot)

    def __repr__(self):
        prev_block = self.prev_free_block
        next_block = self.next_free_block
        prev_block_id = prev_block.block_id if prev_block else None
        next_block_id = next_block.block_id if next_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, "
            f"ref_cnt={self.ref_cnt}, "
            f"_block_hash={self._block_hash!r}, "
            f"_block_hash_num_tokens={self._block_hash_num_tokens}, "
            f"prev_free_block={prev_block_id}, "
            f"next_free_block={next_block_id})"
        )

    def __eq__(self, other):
        if self is other:
            return True
        if type(other) is not type(self):
            return NotImplemented
        return _astuple(self) == _astuple(<KVCacheBlock>other)

    __hash__ = None


cdef _set_link(KVCacheBlock self, value, bint forward):
    if self._queue is None:
        if forward:
            self._next_py = value
        else:
            self._prev_py = value
        return
    if self._slot == HEAD_SLOT or self._slot == TAIL_SLOT:
        self._queue._set_sentinel_link(self, value, forward)
        return
    # vLLM code (and the RFC's reorder body) clears links before rebuilding a
    # queue; for a natively linked block that is a no-op.
    if value is None:
        return
    raise AttributeError(
        f"links of KVCacheBlock {_block_id(self)} are managed by its "
        "kvpool FreeKVCacheBlockQueue; use the queue's methods to move it")


cdef tuple _astuple(KVCacheBlock self):
    return (self.block_id, self.ref_cnt, self._block_hash,
            self._block_hash_num_tokens, self.prev_free_block,
            self.next_free_block, self.is_null)


# --------------------------------------------------------------------------------------
# FreeKVCacheBlockQueue
# --------------------------------------------------------------------------------------
cdef inline KVCacheBlock _new_block(object block_id, object pool):
    cdef KVCacheBlock b = KVCacheBlock.__new__(KVCacheBlock)
    _store(&b._block_id_o, block_id)
    b.pool = pool
    return b


@cython.auto_pickle(False)
cdef class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order, native links.

    Mirrors ``vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue`` (vLLM 0.33.0): the
    front is allocated (evicted) first; ``popleft``/``popleft_n`` take from the front,
    ``append``/``append_n`` add at the tail (LRU), ``prepend_n`` at the front (LIFO
    reuse), ``remove`` takes a block out of the middle in O(1). The queue starts in
    the order of the given blocks. ``fake_free_list_head`` / ``fake_free_list_tail``
    are ``KVCacheBlock(block_id=-1)`` sentinels whose links read the native list.

    Each block belongs to at most one queue. Building a queue from blocks owned by
    another queue takes them over (the RFC's reorder body builds a new queue from
    ``pool.blocks``). Blocks no queue owns are adopted when appended.

    Errors (nothing is changed when one is raised):
        TypeError: an object that is not a kvpool ``KVCacheBlock``.
        BlockStateError (ValueError, RuntimeError): removing a block that is not
            free, adding one that already is or appears twice, a block of another
            queue.
        ValueError: popping from an empty queue ("No free blocks available") or more
            blocks than are free.
    """

    def __cinit__(self):
        # A queue that was never initialised is an empty queue, not a crash.
        self._blocks = []
        self._list = FreeBlockList(0, True)
        self.fake_free_list_head = _new_block(-1, None)
        self.fake_free_list_head._queue = self
        self.fake_free_list_head._slot = HEAD_SLOT
        self.fake_free_list_tail = _new_block(-1, None)
        self.fake_free_list_tail._queue = self
        self.fake_free_list_tail._slot = TAIL_SLOT

    def __init__(self, blocks):
        cdef list blist
        cdef Py_ssize_t n, i
        cdef KVCacheBlock b
        cdef set seen = set()
        if self._initialized or PyList_GET_SIZE(self._blocks):
            raise RuntimeError("FreeKVCacheBlockQueue is already initialised; build a new one")
        blist = list(blocks)
        n = len(blist)
        for i in range(n):
            obj = blist[i]
            if not isinstance(obj, KVCacheBlock):
                raise TypeError(
                    f"FreeKVCacheBlockQueue takes kvpool KVCacheBlock objects, got {type(obj).__name__}")
            if id(obj) in seen:
                raise BlockStateError(f"block {(<KVCacheBlock>obj).block_id} appears twice")
            seen.add(id(obj))
        # Compare ids before taking any block over: a comparison error must leave the
        # blocks with their old queue.
        ids_ascending = True
        try:
            for i in range(1, n):
                if not (_block_id(<KVCacheBlock>blist[i]) > _block_id(<KVCacheBlock>blist[i - 1])):
                    ids_ascending = False
                    break
        except TypeError:
            ids_ascending = False
        for i in range(n):
            b = <KVCacheBlock>blist[i]
            if b._queue is not None and b._queue is not self:
                b._queue._release(b)
            b._queue = self
            b._slot = <int32_t>i
            b._prev_py = None
            b._next_py = None
        self._init_registered(blist, ids_ascending)

    cdef _init_registered(self, list blist, bint ids_ascending):
        if PyList_GET_SIZE(blist) >= 2**31 - 2:
            raise ValueError("a free queue holds at most 2**31 - 3 blocks")
        self._blocks = blist
        self._list = FreeBlockList(<int32_t>PyList_GET_SIZE(blist), True)
        self._ids_ascending = ids_ascending
        self._initialized = True

    # -- internal helpers ---------------------------------------------------------------
    cdef int32_t _slot_of(self, KVCacheBlock block) except -1:
        if block._queue is not self or block._slot < 0:
            if block._queue is None:
                raise BlockStateError(f"block {block.block_id} is not part of this free queue")
            raise BlockStateError(
                f"foreign block {block.block_id}: it belongs to another pool's free queue")
        return block._slot

    cdef int32_t _register(self, KVCacheBlock block) except -1:
        cdef int32_t slot = <int32_t>len(self._blocks)
        self._list.grow(1)
        self._blocks.append(block)
        block._queue = self
        block._slot = slot
        block._prev_py = None
        block._next_py = None
        if slot > 0 and self._ids_ascending:
            prev_obj = self._block_at(slot - 1)
            try:
                ascending = _block_id(block) > _block_id(<KVCacheBlock>prev_obj)
            except TypeError:
                ascending = False
            if not ascending:
                self._ids_ascending = False
        return slot

    cdef void _release(self, KVCacheBlock block):
        # Another queue takes the block over: forget it here, keeping the slot empty.
        cdef int32_t slot = block._slot
        if slot >= 0 and block._queue is self:
            if self._list.contains(slot):
                self._list.remove(slot)
            # The block object stays in this table (pool.blocks[i] is still the
            # block); its _queue/_slot now name the queue that took it over.
        block._queue = None
        block._slot = UNREGISTERED

    cdef inline object _block_at(self, int32_t slot):
        cdef object obj = <object>PyList_GET_ITEM(self._blocks, slot)
        if obj is None and self._lazy:
            return self._materialize(slot)
        return obj

    cdef object _materialize(self, int32_t slot):
        # A pool's blocks are created on first use (make_pool_blocks): block_id ==
        # slot, owned by this queue and the pool.
        cdef KVCacheBlock b = KVCacheBlock.__new__(KVCacheBlock)
        # Creating the object may have started a collection whose Python code created
        # this very block already: there is one object per slot, keep that one.
        existing = <object>PyList_GET_ITEM(self._blocks, slot)
        if existing is not None:
            return existing
        if slot < 1024:
            _store(&b._block_id_o, <object>PyList_GET_ITEM(_SMALL_INTS, slot))
        else:
            _store(&b._block_id_o, slot)
        b.pool = self._lazy_pool
        b._queue = self
        b._slot = slot
        self._blocks[slot] = b
        return b

    cdef _set_sentinel_link(self, KVCacheBlock sentinel, value, bint forward):
        # vLLM's own tests cut the fake head's next / fake tail's prev link to check
        # that a broken queue refuses work. Model exactly that: a cut link reads None
        # and the operations that need it raise as vLLM's do. Setting the true
        # neighbour back repairs it; any other value is refused.
        cdef bint head = sentinel._slot == HEAD_SLOT
        cdef bint* cut = &self._head_cut if head else &self._tail_cut
        cdef bint was_cut
        if head != forward:
            if value is None:
                return  # the fake head's prev / fake tail's next is always None
            raise AttributeError("the fake head has no prev and the fake tail no next")
        if value is None:
            cut[0] = True
            return
        was_cut = cut[0]
        cut[0] = False
        truth = self._neighbour(sentinel, head)
        if truth is not value:
            cut[0] = was_cut
            raise AttributeError(
                f"the fake {'head' if head else 'tail'}'s link is managed natively; only its "
                f"true {'next' if head else 'prev'} block can be set back")

    cdef int _check_tail(self) except -1:
        if self._tail_cut:
            raise AssertionError("prev_free_block of fake_free_list_tail should always exist")
        return 0

    cdef int _check_head(self) except -1:
        if self._head_cut:
            raise AssertionError("next_free_block of fake_free_list_head should always exist")
        return 0

    cdef object _neighbour(self, KVCacheBlock block, bint forward):
        cdef int32_t slot = block._slot, other
        if slot == HEAD_SLOT:
            if not forward or self._head_cut:
                return None
            return self.fake_free_list_tail if self._list.empty() else self._block_at(self._list.front())
        if slot == TAIL_SLOT:
            if forward or self._tail_cut:
                return None
            return self.fake_free_list_head if self._list.empty() else self._block_at(self._list.back())
        if slot < 0 or not self._list.contains(slot):
            return None
        if forward:
            other = self._list.next_of(slot)
            return self.fake_free_list_tail if other < 0 else self._block_at(other)
        other = self._list.prev_of(slot)
        return self.fake_free_list_head if other < 0 else self._block_at(other)

    cdef list _pop_front(self, int32_t n):
        # Local buffers, not the queue's scratch space: creating a block object may
        # run Python code that uses this queue. The list is built last, so Python
        # code never sees it half filled.
        cdef list out
        cdef Py_ssize_t i = 0, j, nback = 0
        cdef vector[int32_t] slots
        cdef vector[PyObject*] refs
        if n < 0:
            raise ValueError(f"cannot pop a negative number of blocks ({n})")
        if n > self._list.size():
            raise ValueError(f"cannot pop {n} blocks: only {self._list.size()} free")
        slots.resize(n)
        refs.resize(n)
        self._list.popleft_n(n, slots.data())
        try:
            while i < n:
                b = self._block_at(slots[i])
                Py_INCREF(b)
                refs[i] = <PyObject*>b
                i += 1
            out = PyList_New(n)
        except BaseException:
            for j in range(i):
                Py_DECREF_ptr(refs[j])
            for j in range(n):  # back in front, in order, unless already back
                if not self._list.contains(slots[j]):
                    slots[nback] = slots[j]
                    nback += 1
            if nback:
                self._list.prepend_n_unchecked(slots.data(), <int32_t>nback)
            raise
        for i in range(n):
            kvpool_list_items(<PyObject*>out)[i] = refs[i]  # the list takes the reference
        return out

    cdef int _collect_slots(self, object blocks, vector[int32_t]& slots, str op) except -1:
        # Slots of `blocks` into `slots` (a caller's local buffer: adopting a block may
        # run Python code that uses this queue); adopts blocks that no queue owns.
        # Only blocks that may be free pass: vLLM's own code never inserts the null
        # block (the pool's free_blocks/touch skip it) nor a block whose ref_cnt is
        # not 0, and either one in the free list is handed out while still in use.
        cdef list blist = _private_list(blocks)
        cdef Py_ssize_t n = PyList_GET_SIZE(blist), i
        cdef object obj
        cdef KVCacheBlock b
        cdef long refs
        slots.resize(n)
        for i in range(n):
            obj = <object>PyList_GET_ITEM(blist, i)
            if not isinstance(obj, KVCacheBlock):
                raise TypeError(f"expected a kvpool KVCacheBlock, got {type(obj).__name__}")
            b = <KVCacheBlock>obj
            if _is_null(b):
                raise BlockStateError(
                    f"{op}() of block {b.block_id!r}: it is the null block, which is never free")
            refs = _ref_cnt(b)
            if refs != 0:
                raise BlockStateError(
                    f"{op}() of block {b.block_id!r} with ref_cnt {refs}: only blocks that "
                    "no request holds (ref_cnt 0) can be free")
            if b._queue is None:
                self._register(b)
            slots[i] = self._slot_of(b)
        return 0

    # -- vLLM 0.33.0 API ---------------------------------------------------------------------
    @property
    def num_free_blocks(self):
        """Number of free blocks in the queue (int).

        In vLLM this is a plain counter, and vLLM's own tests overwrite it to fake a
        full cache (``queue.num_free_blocks = 0`` makes ``get_num_free_blocks()``
        report 0 and the scheduler preempt). kvpool keeps that contract: an assigned
        value is remembered as an offset from the true count, which every later
        operation moves in step, exactly as vLLM's counter moves. The pool's
        allocation checks read this value, as vLLM's do; the native list never hands
        out more blocks than it really holds.
        """
        return self._list.size() + self._count_offset

    @num_free_blocks.setter
    def num_free_blocks(self, value):
        self._count_offset = <Py_ssize_t>value - self._list.size()

    def popleft(self):
        """Pop the first free block. Raises ValueError("No free blocks available")."""
        cdef int32_t slot
        if self._list.empty():
            raise ValueError("No free blocks available")
        if self._head_cut:
            raise AssertionError(
                f"num_free_blocks ({self._list.size()}) is out of sync with the free list.")
        slot = self._list.popleft()
        return self._block_at(slot)

    def popleft_n(self, n):
        """Pop the first ``n`` free blocks, as a list of length ``n`` in queue order.

        Raises TypeError if ``n`` is not an int, ValueError if it is negative or more
        than ``num_free_blocks``.
        """
        cdef Py_ssize_t count = _index(n)
        if count < 0 or count > self._list.size():
            raise ValueError(f"cannot pop {count} blocks: {self._list.size()} free")
        return self._pop_front(<int32_t>count)

    def remove(self, KVCacheBlock block not None):
        """Remove a free block from anywhere in the queue, O(1).

        Raises BlockStateError if the block is not free or belongs to another queue.
        """
        cdef int32_t slot = self._slot_of(block)
        if not self._list.contains(slot):
            raise BlockStateError(f"remove() called on block {block.block_id}, which is not free")
        self._list.remove(slot)

    def append(self, KVCacheBlock block not None):
        """Put a block at the tail (evicted last).

        Raises:
            BlockStateError: the block is already free, belongs to another queue, is
                the null block or has ``ref_cnt != 0``; nothing changes.
        """
        cdef vector[int32_t] slots
        if self._tail_cut:
            raise RuntimeError("prev_free_block of fake_free_list_tail should always exist")
        self._collect_slots([block], slots, "append")
        try:
            self._list.append_n(slots.data(), 1)
        except ValueError as e:
            raise BlockStateError(f"append() of block {block.block_id}: {e}") from None

    def append_n(self, blocks):
        """Put ``blocks`` (iterable of blocks) at the tail, in the given order.

        Raises:
            BlockStateError: as :meth:`append`, for any of the blocks; the free list
                is unchanged then.
        """
        self._insert(blocks, False)

    def prepend_n(self, blocks):
        """Put ``blocks`` (iterable of blocks) at the front (allocated first), in the
        given order.

        Raises:
            BlockStateError: as :meth:`append`, for any of the blocks; the free list
                is unchanged then.
        """
        self._insert(blocks, True)

    cdef _insert(self, blocks, bint front):
        cdef vector[int32_t] slots
        if not blocks:
            return
        if front:
            self._check_head()
        else:
            self._check_tail()
        self._collect_slots(blocks, slots, "prepend_n" if front else "append_n")
        try:
            if front:
                self._list.prepend_n(slots.data(), <int32_t>slots.size())
            else:
                self._list.append_n(slots.data(), <int32_t>slots.size())
        except ValueError as e:
            raise BlockStateError(f"{'prepend_n' if front else 'append_n'}(): {e}") from None

    def get_all_free_blocks(self):
        """All free blocks in eviction order (a new list)."""
        cdef vector[int32_t] order
        if self._head_cut:
            raise RuntimeError("next_free_block of fake_free_list_head should always exist")
        order = self._list.to_vector()
        return [self._block_at(s) for s in order]

    def iter_blocks_after(self, cursor):
        """Iterate free blocks in eviction order after ``cursor`` (from the front when
        ``cursor`` is None). Follows the live links, like vLLM's generator."""
        curr = self.fake_free_list_head.next_free_block if cursor is None else cursor.next_free_block
        tail = self.fake_free_list_tail
        while curr is not None and curr is not tail:
            yield curr
            curr = curr.next_free_block

    # -- kvpool additions --------------------------------------------------------------------
    def rebuild_canonical(self):
        """Relink every free block in ascending ``block_id`` order, O(N) (O(N log N)
        for a queue whose blocks were not registered in ascending id order). The set of
        free blocks is unchanged."""
        cdef vector[int32_t] order
        self._count_offset = 0  # a rebuilt queue counts truly, like vLLM's new queue
        if self._ids_ascending:
            self._list.rebuild_canonical()
            return
        free = self.get_all_free_blocks()
        free.sort(key=lambda blk: blk.block_id)
        order.reserve(len(free))
        for blk in free:
            order.push_back((<KVCacheBlock>blk)._slot)
        self._list.rebuild_in_order(order.data(), <int32_t>order.size())

    def free_block_ids(self):
        """Block ids of the free blocks in eviction order (a new list of int)."""
        cdef vector[int32_t] order = self._list.to_vector()
        return [_block_id(<KVCacheBlock>self._block_at(s)) for s in order]

    def __contains__(self, block):
        if not isinstance(block, KVCacheBlock):
            return False
        cdef KVCacheBlock b = <KVCacheBlock>block
        return b._queue is self and b._slot >= 0 and self._list.contains(b._slot)

    def check_invariants(self):
        """Raise RuntimeError if the native links are inconsistent. For tests."""
        self._list.check_invariants()


def make_pool_blocks(object pool, int num_blocks):
    """The blocks (ids ``0..num_blocks-1``, ``pool=pool``) and free queue of a pool,
    all blocks free in id order.

    Block objects are created on first use (popped, indexed, iterated), not here: a
    pool of 85,000 blocks starts with two int32 arrays and one list of placeholders,
    and a deployment that uses 3% of its KV cache creates 3% of the objects.

    Returns:
        ``(blocks, free_block_queue)``: a :class:`BlockTable` (a sequence of
        ``num_blocks`` ``KVCacheBlock``) and the queue.
    Raises:
        ValueError: ``num_blocks <= 0``.
    """
    cdef FreeKVCacheBlockQueue queue
    if num_blocks <= 0:
        raise ValueError(f"num_gpu_blocks must be > 0, got {num_blocks}")
    queue = FreeKVCacheBlockQueue.__new__(FreeKVCacheBlockQueue)
    queue._lazy = True
    queue._lazy_pool = pool
    queue._init_registered([None] * num_blocks, True)
    return BlockTable(queue), queue


@cython.auto_pickle(False)
cdef class BlockTable:
    """``BlockPool.blocks`` of a kvpool pool: a read-only sequence of all
    ``num_gpu_blocks`` blocks, ``blocks[block_id].block_id == block_id``.

    Behaves like vLLM's ``list[KVCacheBlock]`` for reading (indexing, negative
    indices, slices, iteration, ``len``, ``in``, ``index``, equality with a list)
    and creates each block object the first time it is needed.
    """
    cdef FreeKVCacheBlockQueue _queue

    def __cinit__(self, FreeKVCacheBlockQueue queue not None):
        self._queue = queue

    def __len__(self):
        return PyList_GET_SIZE(self._queue._blocks)

    cdef object _get(self, object index):
        cdef Py_ssize_t n = PyList_GET_SIZE(self._queue._blocks)
        i = _index(index)
        if i < 0:
            i += n
        if not (0 <= i < n):
            raise IndexError("block index out of range")
        return self._queue._block_at(<int32_t>i)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(len(self)))]
        return self._get(index)

    def __iter__(self):
        cdef Py_ssize_t i
        for i in range(PyList_GET_SIZE(self._queue._blocks)):
            yield self._queue._block_at(<int32_t>i)

    def __reversed__(self):
        cdef Py_ssize_t i
        for i in range(PyList_GET_SIZE(self._queue._blocks) - 1, -1, -1):
            yield self._queue._block_at(<int32_t>i)

    def __contains__(self, item):
        cdef KVCacheBlock b
        if not isinstance(item, KVCacheBlock):
            return False
        b = <KVCacheBlock>item
        i = _block_id(b)
        return (type(i) is int and 0 <= i < len(self)
                and <object>PyList_GET_ITEM(self._queue._blocks, <Py_ssize_t>i) is b)

    def index(self, item):
        if item in self:
            return _block_id(<KVCacheBlock>item)
        raise ValueError(f"{item!r} is not in the pool's blocks")

    def count(self, item):
        return 1 if item in self else 0

    def materialized(self):
        """The block objects created so far (``list[KVCacheBlock]``, id order).
        Blocks not created yet are free, unhashed and have ``ref_cnt == 0``."""
        return [b for b in self._queue._blocks if b is not None]

    def __eq__(self, other):
        if isinstance(other, (list, tuple, BlockTable)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return (f"BlockTable({len(self)} blocks, "
                f"{len(self.materialized())} created)")


# --------------------------------------------------------------------------------------
# BlockPool hot loops (vllm/v1/core/block_pool.py, vLLM 0.33.0)
# --------------------------------------------------------------------------------------
cdef inline KVCacheBlock _as_block(object obj):
    if not isinstance(obj, KVCacheBlock):
        raise TypeError(f"expected a kvpool KVCacheBlock, got {type(obj).__name__}")
    return <KVCacheBlock>obj


def pool_get_new_blocks(FreeKVCacheBlockQueue queue not None, num_blocks,
                        bint enable_caching, dict cached_block_hashes_by_block,
                        object evict_cached_block):
    """``BlockPool.get_new_blocks`` without per-block Python calls.

    Pops ``num_blocks`` from the front of the free queue; for a block that still has
    a prefix-cache hash (or extra hashes in ``cached_block_hashes_by_block``) calls
    ``evict_cached_block(block)``; checks ``ref_cnt == 0`` (after the callback, as
    vLLM's ``assert`` does) and sets it to 1. One pass over the blocks.

    Returns:
        ``list[KVCacheBlock]`` of length ``num_blocks``.
    Raises:
        TypeError: ``num_blocks`` is not an int.
        ValueError: ``num_blocks`` negative or more than the free blocks.
        BlockStateError: a block with ``ref_cnt != 0`` (the pool is corrupted). On any
            error the popped blocks that are still off the free list and unchanged by
            others are put back in front, in their old order, with ``ref_cnt`` 0.
    """
    cdef Py_ssize_t n = _index(num_blocks), i = 0, j, nset = 0, nback = 0
    cdef list ret
    cdef PyObject* o
    cdef PyObject** table
    cdef PyObject* none = kvpool_none()
    cdef bint has_extra = bool(cached_block_hashes_by_block)
    cdef vector[int32_t] popped
    cdef vector[PyObject*] taken  # owned references to the blocks of this call
    cdef kvpool_refbatch rb
    cdef Py_ssize_t n01 = 0
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef PyObject* one = kvpool_si_obj(1)
    cdef const int32_t* next_links
    cdef int32_t node, slot
    cdef long refs
    cdef uint64_t insertions
    if n < 0:
        raise ValueError(f"cannot get a negative number of blocks ({n})")
    if n > queue._list.size() + queue._count_offset:
        raise ValueError(f"Cannot get {n} free blocks from the pool")
    if n > queue._list.size():
        raise ValueError(f"Cannot get {n} free blocks from the pool "
                         f"(only {queue._list.size()} are really free)")
    popped.resize(n)
    taken.resize(n)
    kvpool_refbatch_init(&rb)
    table = kvpool_list_items(<PyObject*>queue._blocks)
    # The common case first: walk the front of the free list while taking the blocks
    # (the walk's chain of dependent loads overlaps the per-block work), up to the
    # first block that needs Python code (creation, an eviction callback) or is not
    # a plain free block; the walked run is then unlinked in one go. No Python code
    # runs until every block of the call is off the free list, as in vLLM. The
    # returned list is built last, so Python code never sees it half filled.
    next_links = queue._list.next_links()
    node = next_links[0]  # the fake head's next
    while i < n:
        slot = node - 2
        o = table[slot]
        if (o == none or (<KVCacheBlock>o)._ref_cnt_o != zero or (enable_caching and (
                <PyObject*>(<KVCacheBlock>o)._block_hash != none or has_extra))):
            break
        popped[i] = slot
        (<KVCacheBlock>o)._ref_cnt_o = one  # counted in n01
        n01 += 1
        Py_INCREF_ptr(o)
        taken[i] = o
        i += 1
        node = next_links[node]
    nset = i
    queue._list.detach_front(popped.data(), <int32_t>i)
    # The rest, popped first, one block at a time.
    if i < n:
        queue._list.popleft_n(<int32_t>(n - i), popped.data() + i)
    insertions = queue._list.insertions()
    try:
        while i < n:
            table = kvpool_list_items(<PyObject*>queue._blocks)  # Python code may have run
            o = table[popped[i]]
            if o == none:
                _fold_0_to_1(&rb, n01)  # a creation may run Python code (gc)
                n01 = 0
                kvpool_refbatch_flush(&rb)
                queue._block_at(popped[i])  # creates it in the table
                o = kvpool_list_items(<PyObject*>queue._blocks)[popped[i]]
                if not isinstance(<object>o, KVCacheBlock):
                    raise BlockStateError(f"free slot {popped[i]} holds no block; the pool is corrupted")
            Py_INCREF_ptr(o)
            taken[i] = o
            i += 1
            if enable_caching and (<PyObject*>(<KVCacheBlock>o)._block_hash != none or (
                    has_extra and _block_id(<KVCacheBlock>o) in cached_block_hashes_by_block)):
                _fold_0_to_1(&rb, n01)
                n01 = 0
                kvpool_refbatch_flush(&rb)
                evict_cached_block(<object>o)
            if (<KVCacheBlock>o)._ref_cnt_o == zero:
                (<KVCacheBlock>o)._ref_cnt_o = one  # the common case, counted in n01
                n01 += 1
            else:
                refs = _ref_cnt(<KVCacheBlock>o)
                if refs != 0:
                    raise BlockStateError(
                        f"free block {_id_text(o)} has ref_cnt={refs}; the pool is corrupted")
                if _put_refs(o, 1, &rb) != E_NONE:
                    raise MemoryError("get_new_blocks(): no memory for a ref_cnt")
            nset = i
        ret = PyList_New(n)
    except BaseException:
        _fold_0_to_1(&rb, n01)
        kvpool_refbatch_flush(&rb)
        # Put back, in their old order and unheld, the popped blocks that are still
        # off the free list and still as this call left them. Python code that ran in
        # between (a callback, a finalizer) may have freed some of them, or freed and
        # taken them again: if anything was put into the free list meanwhile, a block
        # this call set to ref_cnt 1 may be someone else's now, and is left as it is.
        queue_changed = queue._list.insertions() != insertions
        left = []
        for j in range(n):
            slot = popped[j]
            if queue._list.contains(slot):
                continue  # already back in the free list
            if j < nset:  # this call set ref_cnt 1
                o = taken[j]
                if not _read_refs(o, &refs) or refs != 1 or queue_changed:
                    left.append(slot)
                    continue
                _put_refs(o, 0, &rb)
            else:
                o = taken[j] if j < i else kvpool_list_items(<PyObject*>queue._blocks)[slot]
                if o != none and _read_refs(o, &refs) and refs != 0:
                    left.append(slot)  # not set by this call, but held now
                    continue
            popped[nback] = slot
            nback += 1
        if nback:
            queue._list.prepend_n_unchecked(popped.data(), <int32_t>nback)
        for j in range(i):
            Py_DECREF_ptr(taken[j])
        _flush(&rb)
        if left:
            exc = sys.exc_info()[1]
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"kvpool: get_new_blocks() left blocks in slots {left} as the Python "
                    "code that ran during the call left them (freed and possibly taken "
                    "again); the other popped blocks were put back")
        raise
    for j in range(n):
        kvpool_list_items(<PyObject*>ret)[j] = taken[j]  # the list takes the reference
    _fold_0_to_1(&rb, n01)
    _flush(&rb)
    return ret


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
        err[0] = E_TAKEN_OVER
        return NULL
    return obj


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
    _free_core(pool, queue, kvpool_list_items(<PyObject*>seq) + start, n, step,
               enable_caching, None, NULL, -1, &foreign)
    try:
        return _forwarded(foreign)
    finally:
        _release_parked()


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
                others.setdefault((<KVCacheBlock>obj).pool, []).append(obj)
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
                   bint enable_caching, kvpool_refbatch* rb, long* refs_out):
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
        err = _put_refs(o, refs - 1, rb)
        return -err if err != E_NONE else A_HELD
    slot = (<KVCacheBlock>o)._slot
    if (<PyObject*>(<KVCacheBlock>o)._queue != <PyObject*>queue
            or not (0 <= slot < queue._list.capacity())):
        return -E_NOT_OURS
    if refs <= 0 or queue._list.contains_unchecked(slot):
        return -E_DOUBLE_FREE
    err = _put_refs(o, refs - 1, rb)
    if err != E_NONE:
        return -err
    if refs != 1:
        return A_HELD
    if not enable_caching or <PyObject*>(<KVCacheBlock>o)._block_hash == kvpool_none():
        return A_FIRST
    return A_LAST


cdef int _free_core(object pool, FreeKVCacheBlockQueue queue, PyObject** items,
                    Py_ssize_t n, Py_ssize_t step, bint enable_caching,
                    FencedDeferredFreeQueue deferred, const int64_t* handles,
                    int64_t own_owner, vector[PyObject*]* foreign_out) except -1:
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
    # nothing is changed, parked objects are released, and the exception is raised.
    cdef HandleTable ht
    cdef int64_t h, hslot
    cdef int32_t fast_slot
    cdef PyObject** own_items = kvpool_list_items(<PyObject*>queue._blocks)
    cdef int64_t own_size = PyList_GET_SIZE(queue._blocks)
    cdef Py_ssize_t k = 0, j, nfirst = 0, nlast = 0, nforeign = 0, n10 = 0
    cdef PyObject* o
    cdef PyObject* none = kvpool_none()
    cdef PyObject* false_ = kvpool_false()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef PyObject* one = kvpool_si_obj(1)
    cdef PyObject* pool_o = <PyObject*>pool
    cdef PyObject* queue_o = <PyObject*>queue
    cdef void* block_type = <void*>KVCacheBlock
    cdef long refs = 0
    cdef int32_t slot
    cdef uint32_t capacity = <uint32_t>queue._list.capacity()
    cdef const int32_t* free_marks = queue._list.free_marks()
    cdef int err = E_NONE, action
    cdef int32_t* first
    cdef int32_t* last
    cdef PyObject** foreign
    cdef kvpool_refbatch rb
    cdef object culprit
    # Scratch space of the queue (no allocation per call once it has grown). Only the
    # loop and its links use it, before any Python code (which could call into this
    # queue again) can run.
    queue._scratch.resize(2 * n)
    first = queue._scratch.data()
    last = first + n
    queue._ptr_scratch.resize(n)
    foreign = queue._ptr_scratch.data()
    kvpool_refbatch_init(&rb)
    ht.current = -1
    while k < n:
        # The common case, checked inline: a held-once block of this pool that is not
        # the null block (fast_slot >= 0 then); anything else goes to _free_one.
        fast_slot = -1
        if handles is NULL:
            o = items[k * step]
            if (<void*>Py_TYPE(<object>o) == block_type
                    and (<KVCacheBlock>o)._ref_cnt_o == one
                    and (<KVCacheBlock>o)._is_null_o == false_
                    and <PyObject*>(<KVCacheBlock>o).pool == pool_o
                    and <PyObject*>(<KVCacheBlock>o)._queue == queue_o):
                slot = (<KVCacheBlock>o)._slot
                if <uint32_t>slot < capacity and free_marks[slot] < 0:
                    fast_slot = slot
        else:
            h = handles[k]
            hslot = <int64_t><uint32_t>h
            o = NULL
            if (h >> 32) == own_owner and hslot < own_size:
                # A block of this pool's own queue: the handle still names it if the
                # block there is registered at that slot of that queue.
                o = own_items[hslot]
                if (<void*>Py_TYPE(<object>o) == block_type
                        and <PyObject*>(<KVCacheBlock>o)._queue == queue_o
                        and (<KVCacheBlock>o)._slot == hslot):
                    if ((<KVCacheBlock>o)._ref_cnt_o == one
                            and (<KVCacheBlock>o)._is_null_o == false_
                            and <PyObject*>(<KVCacheBlock>o).pool == pool_o
                            and free_marks[hslot] < 0):
                        fast_slot = <int32_t>hslot
                else:
                    o = NULL
            if o is NULL:
                o = _handle_to_block(deferred, h, &ht, &err)
                if o is NULL:
                    break
        if fast_slot >= 0:
            (<KVCacheBlock>o)._ref_cnt_o = zero  # counted in n10
            n10 += 1
            if not enable_caching or <PyObject*>(<KVCacheBlock>o)._block_hash == none:
                first[nfirst] = fast_slot
                nfirst += 1
            else:
                last[nlast] = fast_slot
                nlast += 1
            k += 1
            continue
        action = _free_one(o, pool_o, queue, enable_caching, &rb, &refs)
        if action < 0:
            err = -action
            break
        if action == A_FOREIGN:
            foreign[nforeign] = o
            nforeign += 1
        elif action == A_FIRST:
            first[nfirst] = (<KVCacheBlock>o)._slot
            nfirst += 1
        elif action == A_LAST:
            last[nlast] = (<KVCacheBlock>o)._slot
            nlast += 1
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
        # Undo: every block before the failing one that is neither null nor another
        # pool's was decremented once per occurrence. Nothing was linked yet.
        ht.current = -1
        for j in range(k):
            o = items[j * step] if handles is NULL else _handle_to_block(deferred, handles[j], &ht, &action)
            if _null_state(o) == 1:
                continue
            if (<PyObject*>(<KVCacheBlock>o).pool != none
                    and <PyObject*>(<KVCacheBlock>o).pool != pool_o):
                continue
            _read_refs(o, &refs)
            _put_refs(o, refs + 1, &rb)  # restores the value it had (cannot overflow)
        if k == n or err == E_TAKEN_OVER or err == E_CORRUPT_HANDLE:
            culprit = None
        elif handles is NULL:
            culprit = <object>items[k * step]
        else:
            culprit = <object>_handle_to_block(deferred, handles[k], &ht, &action)
        if culprit is not None and err == E_DOUBLE_FREE:
            _read_refs(<PyObject*>culprit, &refs)
        _flush(&rb)
        _raise_loop_error(err, culprit, "free_blocks", refs)
    # Every block was checked above (in range, not free, listed once per reference),
    # so these batch links cannot fail.
    if nfirst:
        queue._list.prepend_n_unchecked(first, <int32_t>nfirst)
    if nlast:
        queue._list.append_n_unchecked(last, <int32_t>nlast)
    for j in range(nforeign):
        Py_INCREF_ptr(deref(foreign_out)[j])
    kvpool_refbatch_flush(&rb)  # (the ints' counts only: no Python code)
    return 0


cdef inline void _release_parked():
    # Release replaced ref_cnt objects parked by the loops (may run Python code).
    if PyList_GET_SIZE(_GRAVEYARD):
        del _GRAVEYARD[:]


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
    cdef PyObject* p
    cdef PyObject* true_ = kvpool_true()
    cdef PyObject* false_ = kvpool_false()
    cdef PyObject* zero = kvpool_si_obj(0)
    cdef PyObject* one = kvpool_si_obj(1)
    cdef long refs = 0
    cdef int32_t slot
    cdef int32_t capacity = queue._list.capacity()
    cdef int err = E_NONE
    cdef int32_t* removed  # (slot, prev node, next node) triples, for the undo
    cdef kvpool_refbatch rb
    cdef object culprit
    cdef PyObject* queue_o = <PyObject*>queue
    cdef void* block_type = <void*>KVCacheBlock
    cdef const int32_t* free_marks = queue._list.free_marks()
    cdef uint32_t ucapacity = <uint32_t>capacity
    if n == 0:
        return
    queue._scratch.resize(3 * n)
    removed = queue._scratch.data()
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
        if not isinstance(<object>o, KVCacheBlock):
            err = E_NOT_BLOCK
            break
        p = (<KVCacheBlock>o)._is_null_o
        if p != false_:
            if p == true_:
                k += 1
                continue
            err = E_NULL_FIELD
            break
        p = (<KVCacheBlock>o)._ref_cnt_o
        if p == zero:
            refs = 0
        elif not _read_refs(o, &refs):
            err = E_REF_FIELD
            break
        if refs == 0:
            slot = (<KVCacheBlock>o)._slot
            if (<PyObject*>(<KVCacheBlock>o)._queue != <PyObject*>queue
                    or not (0 <= slot < capacity)):
                err = E_TOUCH_FOREIGN
                break
            if not queue._list.contains_unchecked(slot):
                err = E_TOUCH_NOT_FREE
                break
            removed[3 * nremoved] = slot
            queue._list.remove_recording(slot, &removed[3 * nremoved + 1], &removed[3 * nremoved + 2])
            nremoved += 1
            if p == zero:
                (<KVCacheBlock>o)._ref_cnt_o = one  # the common case, counted in n01
                n01 += 1
                k += 1
                continue
        if refs == LONG_MAX:
            err = E_OVERFLOW
            break
        err = _put_refs(o, refs + 1, &rb)  # (a recorded removal is undone below)
        if err != E_NONE:
            break
        k += 1
    _fold_0_to_1(&rb, n01)
    if err != E_NONE:
        # Blocks items[0 .. k-1] (null blocks excepted) were incremented once per
        # occurrence; removals are undone in reverse order.
        for j in range(k):
            o = items[j * step]
            if _null_state(o) == 1:
                continue
            _read_refs(o, &refs)
            _put_refs(o, refs - 1, &rb)
        j = nremoved - 1
        while j >= 0:
            queue._list.undo_remove(removed[3 * j], removed[3 * j + 1], removed[3 * j + 2])
            j -= 1
        culprit = <object>items[k * step]
        _flush(&rb)
        _raise_loop_error(err, culprit, "touch", 0)
    _flush(&rb)


def pool_unpin_blocks(FreeKVCacheBlockQueue queue not None, object blocks,
                      dict reuse_watchers, object on_reuse):
    """``BlockPool.unpin_blocks``: ``ref_cnt -= 1``, register ``on_reuse`` for each
    block, and append blocks reaching 0 to the tail of the free queue.

    Raises:
        BlockStateError: a null block, a block with ``ref_cnt <= 0`` (counting repeats
            in ``blocks``), or a block of another queue. Nothing changes when raised.
    """
    cdef list blist = _private_list(blocks)
    cdef Py_ssize_t n = PyList_GET_SIZE(blist), i = 0, j
    cdef KVCacheBlock b
    cdef long refs
    cdef int32_t capacity = queue._list.capacity()
    cdef vector[int32_t] released
    cdef kvpool_refbatch rb
    kvpool_refbatch_init(&rb)
    released.reserve(n)
    try:
        while i < n:
            b = _as_block(<object>PyList_GET_ITEM(blist, i))
            refs = _ref_cnt(b)
            if (_is_null(b) or refs <= 0 or b._queue is not queue
                    or not (0 <= b._slot < capacity) or queue._list.contains_unchecked(b._slot)):
                raise BlockStateError(
                    f"unpin_blocks(): block {_id_text(<PyObject*>b)} is null, not held "
                    f"(ref_cnt={refs}) or not in this pool")
            # (the replaced ref_cnt object is parked: its release could run Python code)
            if _put_refs(<PyObject*>b, refs - 1, &rb) != E_NONE:
                raise MemoryError("unpin_blocks(): no memory for a ref_cnt")
            if refs == 1:
                released.push_back(b._slot)
            i += 1
    except BaseException:
        kvpool_refbatch_flush(&rb)
        for j in range(i):
            b = <KVCacheBlock>PyList_GET_ITEM(blist, j)
            _set_ref_cnt(b, _ref_cnt(b) + 1)
        _flush(&rb)
        raise
    # Link before anything can run Python code (parked objects, a block_id's
    # __hash__ while registering the watchers).
    if released.size():
        queue._list.append_n_unchecked(released.data(), <int32_t>released.size())
    _flush(&rb)
    for i in range(n):
        reuse_watchers[_block_id(<KVCacheBlock>PyList_GET_ITEM(blist, i))] = on_reuse


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
            obj = blocks[i]
        b = _as_block(obj)
        if every_block or b._block_hash is not None or _block_id(b) in cached_block_hashes_by_block:
            out.append(b)
    return out


# --------------------------------------------------------------------------------------
# T_OBJECT_EX member descriptors for KVCacheBlock.block_id / ref_cnt / is_null
# --------------------------------------------------------------------------------------
cdef PyMemberDef _block_members[3]


cdef _install_member_descriptors():
    cdef KVCacheBlock probe = KVCacheBlock.__new__(KVCacheBlock)
    cdef char* base = <char*><PyObject*>probe
    cdef _TypeObject* tp = <_TypeObject*>KVCacheBlock
    cdef int i
    _block_members[0].name = b"block_id"
    _block_members[0].offset = <char*>&probe._block_id_o - base
    _block_members[1].name = b"ref_cnt"
    _block_members[1].offset = <char*>&probe._ref_cnt_o - base
    _block_members[2].name = b"is_null"
    _block_members[2].offset = <char*>&probe._is_null_o - base
    for i in range(3):
        _block_members[i].type = T_OBJECT_EX
        _block_members[i].flags = 0
        _block_members[i].doc = NULL
        descr = PyDescr_NewMember(tp, &_block_members[i])
        (<dict>tp.tp_dict)[(<bytes>_block_members[i].name).decode()] = descr
    PyType_Modified(tp)


_install_member_descriptors()


# --------------------------------------------------------------------------------------
# Fenced deferred-free queue (Scheduler.deferred_frees, vllm/v1/core/sched/scheduler.py)
# --------------------------------------------------------------------------------------
cdef int64_t _LOOSE_OWNER = 0x7FFFFFFF  # handle = owner << 32 | slot, kept non-negative


@cython.auto_pickle(False)
cdef class FencedDeferredFreeQueue:
    """FIFO of ``(fence_seq, blocks)`` deferred frees, stored natively.

    Mirrors ``Scheduler.deferred_frees`` of vLLM 0.33.0: a finished or preempted
    request's blocks may still be written by a dispatched step whose output has not
    been processed (async scheduling with a KV consumer, pipeline parallelism); they
    are queued with ``fence_seq`` and become reusable once
    ``processed_step_seq >= fence_seq``. :meth:`drain` releases entries in FIFO order
    and stops at the first unmet fence. Blocks of several pools may share an entry.

    kvpool's scheduler code uses :meth:`push_groups` / :meth:`free_ready` (or
    :meth:`drain`), whose block lists are in **eviction order** (freed as they are).
    An entry keeps one part per KV cache group, and each part is freed by a
    ``free_blocks`` call of its own, as ``KVCacheCoordinator.free`` frees each group:
    one call over all groups would prepend the groups' unhashed blocks in another
    order. For code written against vLLM 0.33.0's ``deque``, the sequence view
    (``len``, indexing, iteration, equality) and ``append`` / ``popleft`` keep that
    version's convention: one item per entry, its blocks listed in the reverse of
    their eviction order, and the drain frees ``reversed(blocks)``.
    """
    cdef FencedFreeQueue _q
    cdef list _owners
    cdef dict _owner_index
    cdef object _last_owner
    cdef int64_t _last_owner_index
    cdef list _loose
    cdef vector[int64_t] _handles

    def __cinit__(self):
        self._owners = []
        self._owner_index = {}
        self._loose = []

    def __init__(self, entries=()):
        for item in entries:
            self.append(item)

    cdef int64_t _handle_of(self, object obj) except -1:
        cdef KVCacheBlock b
        cdef int64_t owner
        if isinstance(obj, KVCacheBlock):
            b = <KVCacheBlock>obj
            if b._queue is not None and b._slot >= 0:
                if b._queue is self._last_owner:  # blocks of one pool come in runs
                    return (self._last_owner_index << 32) | <int64_t>b._slot
                key = id(b._queue)
                found = self._owner_index.get(key)
                if found is None:
                    owner = len(self._owners)
                    self._owners.append(b._queue)
                    self._owner_index[key] = owner
                else:
                    owner = <int64_t>found
                self._last_owner = b._queue
                self._last_owner_index = owner
                return (owner << 32) | <int64_t>b._slot
        # Not natively owned (or not a kvpool block): keep the object itself.
        self._loose.append(obj)
        return (_LOOSE_OWNER << 32) | <int64_t>(len(self._loose) - 1)

    cdef int _take(self, size_t begin, size_t end, vector[PyObject*]& out) except -1:
        # The blocks named by handles [begin, end) of the queue's buffer, appended to
        # `out` as owned references. Resolving and taking the references runs no
        # Python code, so the entries cannot change in between. On an error nothing
        # is appended.
        cdef size_t i, base = out.size()
        cdef HandleTable t
        cdef int err = E_NONE
        cdef PyObject* obj
        cdef const int64_t* handles
        out.resize(base + (end - begin))  # may raise MemoryError; nothing taken yet
        handles = self._q.handles()
        t.current = -1
        for i in range(begin, end):
            obj = _handle_to_block(self, handles[i], &t, &err)
            if obj is NULL:
                out.resize(base)
                _raise_loop_error(err, None, "deferred free", 0)
            out[base + i - begin] = obj
        for i in range(base, out.size()):
            Py_INCREF_ptr(out[i])
        return 0

    cdef list _list_of(self, vector[PyObject*]& refs, size_t begin, size_t end, bint reverse):
        # A new list taking over the references refs[begin:end] (in reverse when
        # `reverse`); they are released if the list cannot be made.
        cdef size_t n = end - begin, i
        cdef list out
        try:
            out = PyList_New(<Py_ssize_t>n)
        except BaseException:
            for i in range(begin, end):
                Py_DECREF_ptr(refs[i])
            raise
        for i in range(n):
            kvpool_list_items(<PyObject*>out)[i] = refs[end - 1 - i if reverse else begin + i]
        return out

    cdef size_t _part_of_entry(self, size_t index) except? 0:
        # The first part of entry `index` (entries count heads, parts do not).
        cdef size_t part = 0, heads = 0, n = self._q.num_entries()
        while part < n:
            if not self._q.entry(part).joined:
                if heads == index:
                    return part
                heads += 1
            part += 1
        raise IndexError("deque index out of range")

    cdef size_t _end_of_entry(self, size_t part):
        # One past the last part of the entry whose first part is `part`.
        cdef size_t n = self._q.num_entries()
        part += 1
        while part < n and self._q.entry(part).joined:
            part += 1
        return part

    cdef list _objects(self, size_t part, bint reverse):
        # The blocks of the entry starting at `part`, all its parts (they lie
        # contiguous in the buffer), as a new list (in reverse when `reverse`).
        cdef vector[PyObject*] refs
        cdef size_t last = self._end_of_entry(part) - 1
        self._take(self._q.entry(part).begin, self._q.entry(last).end, refs)
        return self._list_of(refs, 0, refs.size(), reverse)

    cdef void _maybe_reset_tables(self):
        # Fresh tables first, the old ones dropped last: dropping a loose object can
        # run its __del__, which may push again and must see consistent tables.
        if self._q.empty():
            old = (self._owners, self._owner_index, self._loose, self._last_owner)
            self._owners = []
            self._owner_index = {}
            self._loose = []
            self._last_owner = None
            self._last_owner_index = 0
            del old

    # -- kvpool API (eviction order) -------------------------------------------------------
    def push(self, fence_seq, blocks):
        """Queue ``blocks`` (iterable of blocks, in eviction order) to be freed once
        ``processed_step_seq >= fence_seq`` (int, a scheduler step sequence number),
        by one ``free_blocks`` call.

        Raises:
            TypeError: ``fence_seq`` is not an int (a float fence would be met early).
        """
        self._push_part(_index(fence_seq), blocks, False)

    def push_groups(self, fence_seq, groups):
        """Queue one request's blocks as one entry of several parts, one per KV cache
        group, freed once ``processed_step_seq >= fence_seq`` by one ``free_blocks``
        call per part, in order: what ``KVCacheCoordinator.free`` does immediately
        (vLLM 0.33.0, one reversed call per single-type manager).

        Args:
            fence_seq: int, a scheduler step sequence number.
            groups: iterable of block iterables, each in eviction order (a group's
                blocks reversed). Empty groups are skipped; if all are empty nothing
                is queued.
        Raises:
            TypeError: ``fence_seq`` is not an int.
        """
        cdef int64_t fence = _index(fence_seq)
        cdef bint joined = False
        for blocks in [list(g) for g in groups]:  # read every group before queuing any
            if blocks:
                self._push_part(fence, blocks, joined)
                joined = True

    cdef _push_part(self, int64_t fence, object blocks, bint joined):
        cdef Py_ssize_t start, step, n, k
        cdef list seq = _source(blocks, &start, &step, &n)
        cdef PyObject** items = kvpool_list_items(<PyObject*>seq) + start
        cdef PyObject* o
        cdef PyObject* last
        cdef int64_t last_index
        cdef int64_t* out
        cdef void* block_type = <void*>KVCacheBlock
        self._handles.resize(n)
        out = self._handles.data()
        last = <PyObject*>self._last_owner
        last_index = self._last_owner_index
        # No Python code runs in this loop (_handle_of reads fields, looks up the
        # owner table by id and appends to internal lists), so `items` stays valid.
        for k in range(n):
            o = items[k * step]
            if (<void*>Py_TYPE(<object>o) == block_type and last != kvpool_none()
                    and <PyObject*>(<KVCacheBlock>o)._queue == last
                    and (<KVCacheBlock>o)._slot >= 0):
                out[k] = (last_index << 32) | <int64_t>(<KVCacheBlock>o)._slot
            else:
                out[k] = self._handle_of(<object>o)
                last = <PyObject*>self._last_owner
                last_index = self._last_owner_index
        self._q.push(fence, out, <size_t>n, joined)

    def drain(self, processed_step_seq):
        """Remove the leading entries whose fence is met.

        Returns:
            ``list[list[KVCacheBlock]]``: one list per ``free_blocks`` call to make, in
            order: each drained entry's parts (its KV cache groups), blocks in eviction
            order, oldest entry first. Free each with its own call (one call for several
            lists would interleave their front/tail placement).
        Raises:
            TypeError: ``processed_step_seq`` is not an int.
            BlockStateError: a queued block was taken over by another free queue;
                nothing is removed then.
        """
        cdef size_t ready, e, start, taken_from = 0
        cdef FencedFreeQueue.Entry entry
        cdef vector[PyObject*] refs
        cdef vector[size_t] ends
        cdef list result = []
        ready = self._q.ready_entries(<int64_t>_index(processed_step_seq))
        # Take every ready entry's blocks (owned references) and only then remove the
        # entries, with no Python code in between: a failure removes nothing, and
        # Python code that runs while the lists are built (a collection) sees the
        # queue already without them.
        try:
            ends.reserve(ready)
            for e in range(ready):
                entry = self._q.entry(e)
                self._take(entry.begin, entry.end, refs)
                ends.push_back(refs.size())
        except BaseException:
            for e in range(refs.size()):
                Py_DECREF_ptr(refs[e])
            raise
        self._q.discard_front(ready)
        try:
            for e in range(ready):
                # refs[:taken_from] are handed over (_list_of releases its range if it fails).
                start = taken_from
                taken_from = ends[e]
                result.append(self._list_of(refs, start, taken_from, False))
        except BaseException:
            for e in range(taken_from, refs.size()):
                Py_DECREF_ptr(refs[e])
            raise
        finally:
            self._maybe_reset_tables()
        return result

    def free_ready(self, processed_step_seq, pool):
        """Free the leading entries whose fence is met through ``pool`` (a kvpool
        ``BlockPool``), oldest first, without building block lists: each part (KV
        cache group) of an entry is freed exactly as ``pool.free_blocks(blocks)``
        would free it (its own call, blocks of other pools forwarded to their
        ``free_blocks``). What ``Scheduler._drain_deferred_frees`` does (vLLM
        0.33.0), in native code, with the group order of the immediate path.

        Args:
            processed_step_seq: int, the scheduler's processed step sequence number.
            pool: the scheduler's block pool; its ``free_block_queue`` must be a
                kvpool ``FreeKVCacheBlockQueue``.
        Returns:
            Number of parts freed (int): the ``free_blocks`` calls made, one per KV
            cache group of each entry.
        Raises:
            TypeError: ``processed_step_seq`` is not an int, or the pool's queue is not
                kvpool's.
            BlockStateError: a block of the part was taken over by another queue, or
                the part would double free a block; that part and the ones after it
                stay queued, the ones before it are freed.
        """
        cdef int64_t processed = _index(processed_step_seq)
        cdef FreeKVCacheBlockQueue queue
        cdef FencedFreeQueue.Entry entry
        cdef bint enable_caching
        cdef size_t n
        cdef Py_ssize_t freed = 0
        cdef int64_t own_owner
        cdef vector[PyObject*] foreign
        queue_obj = pool.free_block_queue
        if not isinstance(queue_obj, FreeKVCacheBlockQueue):
            raise TypeError(
                f"free_ready() needs a pool with a kvpool free queue, got {type(queue_obj).__name__}")
        queue = <FreeKVCacheBlockQueue>queue_obj
        enable_caching = bool(pool.enable_caching)
        queue_id = id(queue)
        try:
            while not self._q.empty() and self._q.entry(0).fence_seq <= processed:
                own = self._owner_index.get(queue_id)
                own_owner = -1 if own is None else <int64_t>own
                # From here until the entry is dropped no Python code runs (_free_core's
                # contract), so the entry cannot be freed twice, by a re-entrant call or
                # after an error.
                entry = self._q.entry(0)
                n = entry.end - entry.begin
                if n:
                    _free_core(pool, queue, NULL, <Py_ssize_t>n, 1, enable_caching,
                               self, self._q.handles() + entry.begin, own_owner, &foreign)
                self._q.discard_front(1)
                freed += 1
                if foreign.size():
                    others = _forwarded(foreign)
                    for other_pool, blocks in others.items():
                        other_pool.free_blocks(blocks)
        finally:
            _release_parked()
        self._maybe_reset_tables()
        return freed

    def ready_entries(self, processed_step_seq):
        """Number of leading entries whose fence is met (nothing is removed)."""
        cdef size_t parts = self._q.ready_entries(<int64_t>_index(processed_step_seq)), i
        cdef size_t heads = 0
        for i in range(parts):  # an entry's parts share its fence
            heads += not self._q.entry(i).joined
        return heads

    @property
    def num_blocks(self):
        """Blocks waiting in all entries."""
        return self._q.num_blocks()

    def entries(self):
        """``list[tuple[int, list[KVCacheBlock]]]``: every entry, blocks in eviction order
        (its parts one after the other)."""
        cdef size_t i
        out = []
        i = 0
        while i < self._q.num_heads():  # (re-read: building a list may run Python code)
            part = self._part_of_entry(i)
            out.append((self._q.entry(part).fence_seq, self._objects(part, False)))
            i += 1
        return out

    # -- vLLM 0.33.0 deque view (blocks in reverse eviction order) ------------------------------
    def append(self, item):
        """``deque.append((fence_seq, blocks))`` with vLLM 0.33.0's convention: the drain
        frees ``reversed(blocks)``."""
        fence_seq, blocks = item
        self.push(fence_seq, reversed(list(blocks)))

    def popleft(self):
        """Remove and return the first entry as ``(fence_seq, blocks)`` in vLLM 0.33.0's
        convention, regardless of its fence. Raises IndexError if empty."""
        cdef vector[PyObject*] refs
        cdef size_t parts
        cdef int64_t fence
        if self._q.empty():
            raise IndexError("pop from an empty deque")
        parts = self._end_of_entry(0)
        fence = self._q.entry(0).fence_seq
        # owned, then removed: no Python code between
        self._take(self._q.entry(0).begin, self._q.entry(parts - 1).end, refs)
        self._q.discard_front(parts)
        try:
            return (fence, self._list_of(refs, 0, refs.size(), True))
        finally:
            self._maybe_reset_tables()

    def clear(self):
        self._q.clear()
        self._maybe_reset_tables()

    def __len__(self):
        return self._q.num_heads()

    def __bool__(self):
        return not self._q.empty()

    def __getitem__(self, index):
        cdef Py_ssize_t n = self._q.num_heads()
        cdef Py_ssize_t i = index
        cdef size_t part
        if i < 0:
            i += n
        if i < 0 or i >= n:
            raise IndexError("deque index out of range")
        part = self._part_of_entry(<size_t>i)
        return (self._q.entry(part).fence_seq, self._objects(part, True))

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other):
        try:
            return list(self) == list(other)
        except TypeError:  # not iterable
            return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"FencedDeferredFreeQueue({list(self)!r})"
