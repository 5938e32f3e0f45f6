# Declarations of the plain C++17 core in cpp/ (no Python headers there).
# `except +` turns std::out_of_range into IndexError, std::invalid_argument into
# ValueError and any other std::exception into RuntimeError.
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector
from libcpp.utility cimport pair


cdef extern from "free_block_list.h" namespace "kvpool" nogil:
    ctypedef enum Order "kvpool::FreeBlockList::Order":
        ORDER_VLLM "kvpool::FreeBlockList::kVllmOrder"
        ORDER_SEGMENTS "kvpool::FreeBlockList::kSegments"
        ORDER_CONTIGUOUS "kvpool::FreeBlockList::kContiguous"

    cdef cppclass SlotBitmap:
        int32_t count()

    cdef cppclass FreeBlockList:
        FreeBlockList()  # allocates nothing, cannot throw: must be reset() before use
        FreeBlockList(int32_t capacity, cbool all_free) except +
        void reset(int32_t capacity, cbool all_free) except +
        void swap(FreeBlockList& other)
        int32_t capacity()
        int32_t size()
        cbool empty()
        cbool contains(int32_t slot) except +
        int32_t front()
        int32_t back()
        int32_t next_of(int32_t slot) except +
        int32_t prev_of(int32_t slot) except +
        int32_t popleft() except +
        void popleft_n(int32_t n, int32_t* out) except +
        void remove(int32_t slot) except +
        void append(int32_t slot) except +
        void append_n(const int32_t* slots, int32_t n) except +
        void prepend_n(const int32_t* slots, int32_t n) except +
        void append_n_unchecked(const int32_t* slots, int32_t n)
        void prepend_n_unchecked(const int32_t* slots, int32_t n)
        cbool contains_unchecked(int32_t slot)
        const int32_t* free_marks()
        uint64_t insertions()
        const int32_t* next_links()
        void detach_front(const int32_t* slots, int32_t k)
        void remove_recording(int32_t slot, int32_t* prev_node, int32_t* next_node)
        void undo_remove(int32_t slot, int32_t prev_node, int32_t next_node)
        Order order()
        void set_order(Order order) except +
        const SlotBitmap& uncached()
        int32_t take(int32_t n, int32_t hint, int32_t owner, int32_t want, int32_t* out,
                     int32_t lru_window) except +
        void reinsert_front(const int32_t* slots, int32_t n) except +
        int32_t lru_front_slots(int32_t span, int32_t* out)
        void restore_lru_front(const int32_t* slots, int32_t n)
        int32_t lru_front()
        void make_uncached(int32_t slot) except +
        void release(int32_t owner)
        void release_all()
        int32_t num_reserved_owners()
        int32_t num_extents(int32_t owner)
        void truncate_extents(int32_t owner, int32_t keep)
        void rebuild_uncached_canonical() except +
        void free_runs(int32_t* num_runs, int32_t* longest)
        void grow(int32_t extra) except +
        void ungrow(int32_t extra)
        void rebuild_canonical()
        void rebuild_in_order(const int32_t* slots, int32_t n) except +
        vector[int32_t] to_vector() except +
        void check_invariants() except +


cdef extern from "fenced_free_queue.h" namespace "kvpool" nogil:
    cdef cppclass FencedFreeQueue:
        cppclass Entry:
            int64_t fence_seq
            size_t begin
            size_t end
            cbool joined
        void push(int64_t fence_seq, const int64_t* handles, size_t n, cbool joined) except +
        void push_parts(int64_t fence_seq, const int64_t* handles, const size_t* sizes, size_t num_parts) except +
        size_t ready_entries(int64_t processed_step_seq)
        size_t drain(int64_t processed_step_seq, vector[int64_t]& out, vector[size_t]* entry_ends) except +
        void pop_front(vector[int64_t]& out) except +
        void discard_front(size_t k) except +
        size_t discard_back()
        size_t num_entries()
        uint64_t version()
        size_t num_heads()
        size_t num_blocks()
        cbool empty()
        const Entry& entry(size_t i) except +
        const int64_t* handles()
        void clear()


ctypedef void* ObjPtr

cdef extern from "table_placement.h" namespace "kvpool" nogil:
    # Sort ids[0..n) (and objs alike) ascending, starting at `cont` when present;
    # `scratch` must have capacity >= n (nothing is allocated; cannot fail).
    void place_ascending "kvpool::place_ascending<void*>"(
        int32_t* ids, ObjPtr* objs, int32_t n, int32_t cont, vector[pair[int32_t, ObjPtr]]& scratch)
