# Included by _core.pyx: FreeQueuePolicy, the allocation policy's handle on a
# FreeKVCacheBlockQueue (free_block_queue.policy). The queue keeps vLLM's API; what
# the allocation policies (python/kvpool/allocation/) change in it goes through here.

# --------------------------------------------------------------------------------------
# FreeQueuePolicy
# --------------------------------------------------------------------------------------
@cython.auto_pickle(False)
cdef class FreeQueuePolicy:
    """The allocation policy's side of a kvpool ``FreeKVCacheBlockQueue``
    (``free_block_queue.policy``; docs/design.md, "Allocation policies"): the free list's
    order mode, the contiguous order's per-table extents (``cpp/extent_reservations.h``)
    and its plan for vLLM's own allocation loop. Every call acts on the queue at once.

    Args:
        queue: the ``FreeKVCacheBlockQueue`` (not None).
    """

    cdef FreeKVCacheBlockQueue _queue

    def __cinit__(self, FreeKVCacheBlockQueue queue not None):
        self._queue = queue

    @property
    def queue(self):
        """The queue this handle acts on."""
        return self._queue

    @property
    def order(self):
        """``"vllm"`` (vLLM's order, the default), ``"segments"`` (vLLM's order, each free
        block remembering whether it is in the uncached or the LRU segment) or
        ``"contiguous"`` (uncached blocks kept sorted, served by position)."""
        return _ORDER_NAMES[<int>self._queue._list.order()]

    def set_order(self, str order):
        """Switch the order (see :attr:`order`). Leaving ``"vllm"`` treats every free
        block as uncached, so switch on a queue that was never used (a pool sets it at
        construction).

        Raises:
            ValueError: an unknown order, or a queue whose slots are not in block-id
                order (only a pool's queue, whose slot is the block id, can order by
                position).
        """
        cdef int code
        if order not in _ORDER_NAMES:
            raise ValueError(f"unknown allocation order {order!r}; choose from {_ORDER_NAMES}")
        code = _ORDER_NAMES.index(order)
        if code != <int>ORDER_VLLM and not self._queue._ids_ascending:
            raise ValueError("an allocation order needs a queue whose blocks were registered "
                             "in ascending block_id order (a pool's queue)")
        self._queue._list.set_order(<Order>code)

    def rebuild_uncached_canonical(self):
        """Relink the uncached segment (blocks freed without a hash, never-used blocks)
        in ascending ``block_id`` order; the LRU segment (blocks freed with a hash or
        released by ``unpin``) keeps its order behind it. O(num_blocks).

        Raises:
            BlockStateError: the queue does not track its segments (order ``"vllm"``).
        """
        try:
            self._queue._list.rebuild_uncached_canonical()
        except ValueError as e:
            raise BlockStateError(str(e)) from None

    def absorb_unhashed_lru_front(self, dict cached_block_hashes_by_block, dict reuse_watchers):
        """Contiguous order: move the LRU segment's leading blocks that hold no
        prefix-cache hash (``block_hash`` None, no entry in
        ``cached_block_hashes_by_block``) and no reuse watcher into the sorted uncached
        segment. vLLM hands those out right after the uncached blocks and before the
        first cached one, exactly as the uncached segment is served, so which cached
        blocks are hit or evicted, and when, does not change. Block id = slot (a pool's
        queue).

        Returns:
            Number of blocks moved (int).
        """
        cdef FreeKVCacheBlockQueue queue = self._queue
        cdef int32_t slot
        cdef Py_ssize_t moved = 0
        cdef KVCacheBlock b
        if queue._list.order() != ORDER_CONTIGUOUS:
            return 0
        while True:
            slot = queue._list.lru_front()
            if slot < 0:
                break
            o = <object>PyList_GET_ITEM(queue._blocks, slot)
            if o is not None:
                b = <KVCacheBlock>o
                if b._block_hash is not None:
                    break
                if cached_block_hashes_by_block and slot in cached_block_hashes_by_block:
                    break
            if reuse_watchers and slot in reuse_watchers:
                break
            queue._list.make_uncached(slot)
            moved += 1
        return moved

    def set_plan(self, int32_t hint, int32_t owner, int32_t want):
        """Contiguous order: the queue's next ``popleft_n`` takes its blocks for the
        table of ``owner`` (an int > 0) that continues at block ``hint`` (-1: a new
        table) and expects ``want`` more blocks, as ``FreeBlockList::take`` chooses
        them. Used when vLLM's own allocation loop runs (reuse watchers, a metrics
        collector); one call only. ``set_plan(-1, 0, 0)`` withdraws it."""
        self._queue._plan_hint, self._queue._plan_owner, self._queue._plan_want = hint, owner, want

    def place_taken(self, list blocks not None, int32_t hint=-1):
        """Contiguous order: put the blocks of the queue's last ``popleft_n`` (``blocks``,
        the list it returned, after vLLM's own allocation loop evicted them in that
        order) in the table order the native ``get_new_blocks`` gives: those taken
        from the LRU front ascending by id, from the one that continues the table
        (the block after the uncached ones taken, else ``hint``) if it is among them
        (``cpp/table_placement.h``). In place; once per ``popleft_n``. Does nothing
        when ``blocks`` is not that call's list of this queue's blocks, or without
        memory for its scratch space: the allocation has happened, and where its
        blocks sit in the table is a preference. Never raises.
        """
        cdef FreeKVCacheBlockQueue queue = self._queue
        cdef Py_ssize_t n = PyList_GET_SIZE(blocks), k = queue._last_take_uncached, i
        cdef PyObject** items = kvpool_list_items(<PyObject*>blocks)
        cdef PyObject* o
        cdef vector[int32_t] slots
        cdef vector[pair[int32_t, ObjPtr]] scratch
        queue._last_take_uncached = -1
        if k < 0 or k >= n:
            return
        try:
            slots.reserve(n)
            scratch.reserve(n)
        except MemoryError:
            return
        for i in range(n):
            o = items[i]
            if (not isinstance(<object>o, KVCacheBlock) or (<KVCacheBlock>o)._queue is not queue
                    or (<KVCacheBlock>o)._slot < 0):
                return
            slots.push_back((<KVCacheBlock>o)._slot)
        place_ascending(slots.data() + k, <ObjPtr*>items + k, <int32_t>(n - k),
                        slots[k - 1] + 1 if k > 0 else hint, scratch)

    @property
    def pop_seq(self):
        """How many ``popleft_n`` calls this queue has served (for :meth:`undo_pop`)."""
        return self._queue._pop_seq

    def undo_pop(self, seq):
        """Put back the blocks of the queue's last ``popleft_n`` after the allocation
        loop around it failed (vLLM's own ``BlockPool.get_new_blocks``, which kvpool runs
        when callbacks must see every block, has no undo), if that call was the
        ``seq``-th (:attr:`pop_seq`; a nested ``popleft_n`` from a callback makes the
        record someone else's, and nothing is done). A popped block still off the free
        list goes back, at the front in its old order (uncached ones at their sorted
        places; with an LRU window the LRU front as it was, when every block came back
        and nothing was freed since), when its ``ref_cnt`` is 0, or 1 and nothing was freed into the queue
        since (then the 1 is the loop's). Evictions already done stay done, as in the
        native loop's undo. Never raises (it runs while an exception propagates).

        Returns:
            the number of blocks put back (0 when the record is not that call's).
        """
        cdef FreeKVCacheBlockQueue queue = self._queue
        cdef vector[int32_t] back
        cdef int32_t slot
        cdef long refs
        cdef bint changed
        cdef kvpool_refbatch rb
        if not isinstance(seq, int) or queue._pop_seq != seq:
            return 0
        queue._pop_seq += 1  # (the record is used once)
        changed = queue._list.insertions() != queue._last_pop_insertions
        try:
            back.reserve(queue._last_pop.size())
        except MemoryError:
            return 0
        kvpool_refbatch_init(&rb)
        for slot in queue._last_pop:
            if slot < 0 or slot >= PyList_GET_SIZE(queue._blocks) or queue._list.contains(slot):
                continue
            o = <object>PyList_GET_ITEM(queue._blocks, slot)
            if not isinstance(o, KVCacheBlock) or not _read_refs(<PyObject*>o, &refs):
                continue
            if refs == 1 and not changed:
                if _put_refs(<PyObject*>o, 0, &rb) != E_NONE:
                    continue
            elif refs != 0:
                continue
            back.push_back(slot)
        if back.size():
            queue._list.reinsert_front(back.data(), <int32_t>back.size())
            if (back.size() == queue._last_pop.size() and queue._last_pop_front.size()
                    and not changed and queue._list.order() == ORDER_CONTIGUOUS):
                # The LRU window took from inside the LRU front: its old order, as the
                # native loop's undo restores it.
                queue._list.restore_lru_front(queue._last_pop_front.data(),
                                              <int32_t>queue._last_pop_front.size())
        _flush(&rb)
        return back.size()

    @property
    def lru_window(self):
        """The contiguous order's LRU window (blocks; 0, the default: vLLM's exact
        LRU). With W > 0 an allocation that takes m blocks from the LRU segment may
        take any m of its m + W oldest when that makes fewer runs of consecutive ids
        (``FreeBlockList::take``); which cached blocks are evicted then differs from
        vLLM's."""
        return self._queue._lru_window

    def set_lru_window(self, blocks):
        """Set :attr:`lru_window` (blocks: an int >= 0 and < 2**31).

        Raises:
            TypeError: ``blocks`` is not an integer (a bool or a float is not).
            ValueError: ``blocks`` out of range, or > 0 while the queue is not in the
                contiguous order.
        """
        if isinstance(blocks, (bool, float)):
            raise TypeError(f"lru_window takes a whole number of blocks, got {blocks!r}")
        blocks = _index(blocks)
        if not 0 <= blocks < 2**31:
            raise ValueError(f"lru_window must be >= 0 and < 2**31 blocks, got {blocks}")
        if blocks and self._queue._list.order() != ORDER_CONTIGUOUS:
            raise ValueError("an LRU window needs the contiguous order (allocation=\"contiguous\")")
        self._queue._lru_window = blocks

    def release_extent(self, int32_t owner):
        """Forget the block ranges reserved for ``owner`` (contiguous order)."""
        self._queue._list.release(owner)

    def release_all_extents(self):
        """Forget every reserved block range (contiguous order)."""
        self._queue._list.release_all()

    @property
    def num_reserved_owners(self):
        """Owners (request, KV cache group) holding a reserved block range."""
        return self._queue._list.num_reserved_owners()

    @property
    def num_uncached_free(self):
        """Free blocks of the uncached segment (contiguous order; 0 otherwise)."""
        return self._queue._list.uncached().count()
