# Included by _core.pyx: FreeKVCacheBlockQueue (vllm/v1/core/kv_cache_utils.py) over the C++ FreeBlockList, and make_pool_blocks.

# --------------------------------------------------------------------------------------
# FreeKVCacheBlockQueue
# --------------------------------------------------------------------------------------
cdef inline KVCacheBlock _new_block(object block_id, object pool):
    cdef KVCacheBlock b = KVCacheBlock.__new__(KVCacheBlock)
    _store(&b._block_id_o, block_id)
    b.pool = pool
    return b


_ORDER_NAMES = ("vllm", "segments", "contiguous")  # indexed by FreeBlockList::Order


cdef inline list _untracked(list table):
    # A queue's block table is never handed to Python code: the collector does not
    # track it and the queue's tp_traverse visits its blocks instead of the list
    # (_queue_traverse), so gc.get_referents(queue) gives blocks, not a list a caller
    # could empty while a native loop reads it.
    PyObject_GC_UnTrack(<void*>table)
    return table


cdef void _drop_refs(vector[PyObject*]& refs) noexcept:
    cdef size_t i
    for i in range(refs.size()):
        Py_DECREF_ptr(refs[i])
    refs.clear()


cdef list _list_from_refs(vector[PyObject*]& refs):
    # A new list that takes the owned references in `refs` (all of them dropped if
    # the list cannot be made).
    cdef list out
    cdef size_t i
    try:
        out = PyList_New(<Py_ssize_t>refs.size())
    except BaseException:
        _drop_refs(refs)
        raise
    for i in range(refs.size()):
        kvpool_list_items(<PyObject*>out)[i] = refs[i]  # the list takes the reference
    refs.clear()
    return out


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
        # A queue that was never initialised is an empty queue, not a crash. The C++
        # member was built by its non-allocating constructor; a bad_alloc here is a
        # MemoryError from tp_new (never std::terminate).
        self._list.reset(0, True)
        self._blocks = _untracked([])
        self._plan_hint = -1
        self._last_take_uncached = -1
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
        if self._initialized or PyList_GET_SIZE(self._blocks):  # the iterable's code used it
            raise RuntimeError("FreeKVCacheBlockQueue was used while its blocks were read; build a new one")
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
        if self._initialized or PyList_GET_SIZE(self._blocks):  # a block id's __gt__ used it
            raise RuntimeError("FreeKVCacheBlockQueue was used while its blocks were read; build a new one")
        # Allocate before any block is taken over: a MemoryError leaves every block
        # with its old queue.
        cdef FreeBlockList fresh
        if n >= 2**31 - 2:
            raise ValueError("a free queue holds at most 2**31 - 3 blocks")
        fresh.reset(<int32_t>n, True)
        for i in range(n):
            b = <KVCacheBlock>blist[i]
            if b._queue is not None and b._queue is not self:
                b._queue._release(b)
            b._queue = self
            b._slot = <int32_t>i
            b._prev_py = None
            b._next_py = None
        self._list.swap(fresh)
        self._blocks = _untracked(blist)
        self._ids_ascending = ids_ascending
        self._initialized = True

    cdef _init_registered(self, list blist, bint ids_ascending):
        if PyList_GET_SIZE(blist) >= 2**31 - 2:
            raise ValueError("a free queue holds at most 2**31 - 3 blocks")
        self._list.reset(<int32_t>PyList_GET_SIZE(blist), True)  # strong: MemoryError
        self._blocks = _untracked(blist)
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
        self._list.grow(1)  # strong
        try:
            self._blocks.append(block)
        except BaseException:
            self._list.ungrow(1)
            raise
        block._queue = self
        block._slot = slot
        block._prev_py = None
        block._next_py = None
        if slot > 0 and self._ids_ascending:
            # Exact ints only: a caller's __gt__ must not run while a batch's slots are
            # being collected (it could hand a collected block to another queue).
            prev_obj = self._block_at(slot - 1)
            new_id = _block_id(block)
            prev_id = _block_id(<KVCacheBlock>prev_obj)
            if not (type(new_id) is int and type(prev_id) is int and new_id > prev_id):
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
            _store(&b._block_id_o, <object>PyTuple_GET_ITEM(_SMALL_INTS, slot))
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
        cdef int32_t hint = -1, owner = 0, want = 0, extents_before = 0, nfront = 0
        cdef vector[int32_t] lru_front  # with an LRU window: the LRU front, for an undo
        if n < 0:
            raise ValueError(f"cannot pop a negative number of blocks ({n})")
        if n > self._list.size():
            raise ValueError(f"cannot pop {n} blocks: only {self._list.size()} free")
        slots.resize(n)
        refs.resize(n)
        self._last_pop.reserve(n)  # (its record below then allocates nothing)
        self._last_pop_front.clear()
        if self._list.order() == ORDER_CONTIGUOUS:
            # The policy's choice (for the table policy.set_plan named, if any).
            hint, owner, want = self._plan_hint, self._plan_owner, self._plan_want
            self._plan_hint, self._plan_owner, self._plan_want = -1, 0, 0
            extents_before = self._list.num_extents(owner) if owner > 0 else 0
            if self._lru_window > 0:  # (at most the free blocks: the window is clamped)
                lru_front.resize(min(<Py_ssize_t>n + self._lru_window, <Py_ssize_t>self._list.size()))
                nfront = self._list.lru_front_slots(<int32_t>lru_front.size(), lru_front.data())
                self._last_pop_front.reserve(nfront)  # (recorded below, allocating nothing)
            self._last_take_uncached = self._list.take(n, hint, owner, want, slots.data(),
                                                      self._lru_window)
        else:
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
                self._list.reinsert_front(slots.data(), <int32_t>nback)
            if nfront and nback == n and self._list.order() == ORDER_CONTIGUOUS:
                # the LRU window took from inside the front
                self._list.restore_lru_front(lru_front.data(), nfront)
            if self._list.order() == ORDER_CONTIGUOUS and owner > 0:
                self._list.truncate_extents(owner, extents_before)
            raise
        for i in range(n):
            kvpool_list_items(<PyObject*>out)[i] = refs[i]  # the list takes the reference
        self._last_pop.resize(n)  # within the reserved capacity
        for i in range(n):
            self._last_pop[i] = slots[i]
        for i in range(nfront):
            self._last_pop_front.push_back(lru_front[i])   # (within the reserved capacity)
        self._last_pop_insertions = self._list.insertions()
        self._pop_seq += 1
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
        count = _index(n)   # (a Python int: any size gets the ValueError)
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
        return self._blocks_at(order)

    cdef list _blocks_at(self, const vector[int32_t]& slots):
        # The blocks of `slots` (created on first use) as a new list, built last so
        # Python code run by a creation never sees it half filled; no list
        # comprehension (docs/native-checks.md, "Cython's list comprehensions").
        cdef vector[PyObject*] refs
        cdef Py_ssize_t i
        refs.reserve(slots.size())
        try:
            for i in range(<Py_ssize_t>slots.size()):
                b = self._block_at(slots[i])
                Py_INCREF(b)
                refs.push_back(<PyObject*>b)
        except BaseException:
            _drop_refs(refs)
            raise
        return _list_from_refs(refs)

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
        if self._ids_ascending:
            self._list.rebuild_canonical()
        else:
            free = self.get_all_free_blocks()
            free.sort(key=lambda blk: blk.block_id)
            order.reserve(len(free))
            for blk in free:
                order.push_back((<KVCacheBlock>blk)._slot)
            self._list.rebuild_in_order(order.data(), <int32_t>order.size())
        self._count_offset = 0  # a rebuilt queue counts truly, like vLLM's new queue

    # -- the allocation policy's handle (policy_handle.pxi) -----------------------------
    @property
    def policy(self):
        """The allocation policy's side of this queue (a :class:`FreeQueuePolicy`: its
        order, the contiguous order's extents and plan), apart from vLLM's API. A new
        handle each time (it holds the queue, the queue does not hold it)."""
        return FreeQueuePolicy(self)

    def free_runs(self):
        """``(num_runs, longest)``: maximal runs of consecutive free slots, and the
        longest one's length in blocks. O(num_blocks)."""
        cdef int32_t runs = 0, longest = 0
        self._list.free_runs(&runs, &longest)
        return runs, longest

    def table_counters(self, bint reset=False):
        """``(blocks, pairs, ascending, descending)``: the block tables freed into this
        queue since the last reset, counted by the free loop (kvpool addition).

        Every ``free_blocks`` call (and every freed deferred entry) is one list in
        eviction order; vLLM frees a request's table tail first
        (``SingleTypeKVCacheManager.free``, vLLM 0.30.0-0.33.0), so a pair of
        consecutive listed blocks of this queue is one pair of the table, *ascending*
        when the table's next block id is the previous + 1 (the later-listed block's
        id is the earlier one's - 1), *descending* when it is the previous - 1. Null
        blocks and other pools' blocks are not counted; blocks still held after the
        decrement (shared prefix-cache hits) are. A call that raises counts nothing.

        Args:
            reset: start a new window (the counters go back to 0).
        Returns:
            ``tuple[int, int, int, int]`` (blocks, pairs, ascending pairs, descending
            pairs).
        """
        out = (self._table_stats[0], self._table_stats[1], self._table_stats[2], self._table_stats[3])
        if reset:
            self._table_stats[0] = self._table_stats[1] = self._table_stats[2] = self._table_stats[3] = 0
        return out

    def free_block_ids(self):
        """Block ids of the free blocks in eviction order (a new list of int)."""
        cdef vector[int32_t] order = self._list.to_vector()
        cdef vector[PyObject*] refs
        cdef Py_ssize_t i
        refs.reserve(order.size())
        try:
            for i in range(<Py_ssize_t>order.size()):
                block_id = _block_id(<KVCacheBlock>self._block_at(order[i]))
                Py_INCREF(block_id)
                refs.push_back(<PyObject*>block_id)
        except BaseException:
            _drop_refs(refs)
            raise
        return _list_from_refs(refs)

    def __contains__(self, block):
        if not isinstance(block, KVCacheBlock):
            return False
        cdef KVCacheBlock b = <KVCacheBlock>block
        return b._queue is self and b._slot >= 0 and self._list.contains(b._slot)

    def check_invariants(self):
        """Raise RuntimeError if the native links are inconsistent. For tests."""
        self._list.check_invariants()


# -- tp_traverse of the queues: their internal tables are visited item by item ------------
# A table the native loops read (an untracked list, see _untracked) is never handed to the
# collector or to gc.get_referents: its items are, one by one, and the list itself is
# skipped in Cython's generated traverse, so the collector still sees every object held.
cdef struct _SkipVisit:
    visitproc visit
    void* arg
    PyObject* skip[3]


cdef int _visit_skipping(PyObject* o, void* arg) noexcept:
    cdef _SkipVisit* sv = <_SkipVisit*>arg
    if o == sv.skip[0] or o == sv.skip[1] or o == sv.skip[2]:
        return 0
    return sv.visit(o, sv.arg)


cdef int _visit_items(PyObject* table, visitproc visit, void* arg) noexcept:
    # Visit the items of an untracked list (not the list).
    cdef PyObject** items
    cdef Py_ssize_t i
    cdef int r
    if table == NULL or not _PyList_CheckExact(table):
        return 0
    items = kvpool_list_items(table)
    for i in range(_Py_SIZE(table)):
        if items[i] != NULL:
            r = visit(items[i], arg)
            if r:
                return r
    return 0


cdef traverseproc _queue_generated_traverse = NULL


cdef int _queue_traverse(PyObject* o, visitproc visit, void* arg) noexcept:
    cdef _SkipVisit sv
    cdef int r
    sv.visit = visit
    sv.arg = arg
    sv.skip[0] = <PyObject*>(<FreeKVCacheBlockQueue>o)._blocks
    sv.skip[1] = sv.skip[2] = NULL
    r = _visit_items(sv.skip[0], visit, arg)
    if r:
        return r
    return _queue_generated_traverse(o, _visit_skipping, &sv)


cdef traverseproc _install_traverse(object cls, traverseproc own, traverseproc generated):
    # Put `own` in the type's tp_traverse; returns the generated one it calls (already
    # installed: `generated`, as it was).
    cdef _GCTypeObject* tp = <_GCTypeObject*>cls
    if tp.tp_traverse == own:
        return generated
    generated = tp.tp_traverse
    tp.tp_traverse = own
    PyType_Modified(<_TypeObject*>tp)
    return generated


_queue_generated_traverse = _install_traverse(
    FreeKVCacheBlockQueue, _queue_traverse, _queue_generated_traverse)


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
