# C-level declarations of kvpool's extension types, for other Cython modules.
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.vector cimport vector
from cpython.ref cimport PyObject

from kvpool.kvpool_cpp cimport FreeBlockList, FencedFreeQueue


cdef class KVCacheBlock:
    # block_id, ref_cnt and is_null are read by vLLM's Python hot loops. They are
    # stored as object pointers and exposed through T_OBJECT_EX member descriptors
    # (created at import, see _install_member_descriptors), the descriptor kind
    # CPython's LOAD_ATTR specialises, so a read costs what a slots-dataclass read
    # costs. Cython code reads them through the NULL-checking helpers in _core.pyx.
    #
    # Field order is deliberate: the fields the native loops read for every block
    # come first, so with the object header they share one 64-byte cache line.
    cdef PyObject* _ref_cnt_o
    cdef PyObject* _is_null_o
    # The native free list this block is registered in (None: not registered) and its
    # slot there. Fake head/tail blocks use the sentinel slots HEAD_SLOT/TAIL_SLOT.
    cdef FreeKVCacheBlockQueue _queue
    cdef int32_t _slot
    cdef public object pool
    cdef public object _block_hash
    cdef PyObject* _block_id_o
    cdef public object _block_hash_num_tokens
    # Links of a block that no native queue owns (plain Python semantics).
    cdef object _prev_py
    cdef object _next_py

    # (No cdef methods: a vtable pointer would push _block_hash off the first line.)


cdef class FreeKVCacheBlockQueue:
    cdef FreeBlockList _list
    cdef list _blocks
    cdef bint _ids_ascending
    cdef bint _initialized
    cdef bint _head_cut
    cdef Py_ssize_t _count_offset
    cdef bint _lazy            # block objects are created on first use
    cdef object _lazy_pool
    cdef bint _tail_cut
    # The contiguous order's plan for the next popleft_n (policy.set_plan).
    cdef int32_t _plan_hint
    cdef int32_t _plan_owner
    cdef int32_t _plan_want
    # How many blocks the last contiguous take() found uncached (the rest: the LRU's).
    cdef int32_t _last_take_uncached
    # The last popleft_n: its slots, the insertion count after it, and a counter of
    # popleft_n calls (policy.undo_pop: the undo of vLLM's own allocation loop).
    cdef vector[int32_t] _last_pop
    cdef vector[int32_t] _last_pop_front   # with an LRU window: the LRU front before it
    cdef uint64_t _last_pop_insertions
    cdef uint64_t _pop_seq
    # The contiguous order's opt-in LRU window (blocks; 0: vLLM's exact LRU).
    cdef int32_t _lru_window
    cdef vector[int32_t] _scratch
    cdef vector[PyObject*] _ptr_scratch
    cdef vector[Py_ssize_t] _idx_scratch  # the ref_cnt undo journal's loop indices
    # Table statistics of the block lists freed into this queue (blocks, pairs,
    # table-ascending pairs, table-descending pairs), kept by the free loop.
    cdef int64_t _table_stats[4]
    cdef readonly KVCacheBlock fake_free_list_head
    cdef readonly KVCacheBlock fake_free_list_tail
    cdef object __weakref__

    cdef _init_registered(self, list blist, bint ids_ascending)
    cdef object _neighbour(self, KVCacheBlock block, bint forward)
    cdef _set_sentinel_link(self, KVCacheBlock sentinel, value, bint forward)
    cdef int _check_tail(self) except -1
    cdef int _check_head(self) except -1
    cdef int32_t _slot_of(self, KVCacheBlock block) except -1
    cdef int32_t _register(self, KVCacheBlock block) except -1
    cdef void _release(self, KVCacheBlock block)
    cdef inline object _block_at(self, int32_t slot)
    cdef object _materialize(self, int32_t slot)
    cdef list _pop_front(self, int32_t n)
    cdef list _blocks_at(self, const vector[int32_t]& slots)
    cdef int _collect_slots(self, object blocks, vector[int32_t]& slots, str op) except -1
    cdef _insert(self, blocks, bint front)
