# Included by _core.pyx: FencedDeferredFreeQueue (Scheduler.deferred_frees) over the C++ FencedFreeQueue.

# --------------------------------------------------------------------------------------
# Fenced deferred-free queue (Scheduler.deferred_frees, vllm/v1/core/sched/scheduler.py)
# --------------------------------------------------------------------------------------
cdef int64_t _LOOSE_OWNER = 0x7FFFFFFF  # handle = owner << 32 | slot, kept non-negative


cdef inline dict _untracked_dict(dict table):
    PyObject_GC_UnTrack(<void*>table)  # ints only: nothing to traverse
    return table


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
        self._owners = _untracked([])
        self._owner_index = _untracked_dict({})
        self._loose = _untracked([])

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
        # Only an optimisation (the tables stay valid as they are): it never raises,
        # so an operation that has done its work never reports a MemoryError.
        cdef list owners, loose
        cdef dict owner_index
        if self._q.empty():
            try:
                owners, owner_index, loose = _untracked([]), _untracked_dict({}), _untracked([])
            except MemoryError:
                return
            old = (self._owners, self._owner_index, self._loose, self._last_owner)
            self._owners = owners
            self._owner_index = owner_index
            self._loose = loose
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

    def push_groups(self, fence_seq, groups, *, bint allocation_order=False):
        """Queue one request's blocks as one entry of several parts, one per KV cache
        group, freed once ``processed_step_seq >= fence_seq`` by one ``free_blocks``
        call per part, in order: what ``KVCacheCoordinator.free`` does immediately
        (vLLM 0.33.0, one reversed call per single-type manager).

        Strong: on any error (MemoryError included) nothing is queued.

        Args:
            fence_seq: int, a scheduler step sequence number.
            groups: iterable of block iterables, each in eviction order (a group's
                blocks reversed). Empty groups are skipped; if all are empty nothing
                is queued.
            allocation_order: the groups are in allocation order (as
                ``req_to_blocks`` holds them): each is queued reversed.
        Returns:
            True if an entry was queued (:meth:`discard_last_entry` removes it).
        Raises:
            TypeError: ``fence_seq`` is not an int.
        """
        cdef int64_t fence = _index(fence_seq)
        cdef list parts = []
        cdef vector[int64_t] handles
        cdef vector[size_t] sizes
        cdef Py_ssize_t n
        for g in groups:  # read every group before queuing any
            if allocation_order:
                parts.append(g[::-1] if type(g) is list else list(g)[::-1])
            else:
                parts.append(list(g))
        for blocks in parts:
            if blocks:
                n = self._part_handles(blocks)
                handles.insert(handles.end(), self._handles.begin(), self._handles.begin() + n)
                sizes.push_back(<size_t>n)
        if sizes.size():
            # One entry, all parts or none (strong on MemoryError).
            self._q.push_parts(fence, handles.data(), sizes.data(), sizes.size())
            return True
        return False

    def discard_last_entry(self):
        """Remove the newest entry (one request: all its parts) without freeing its
        blocks: the undo of the :meth:`push_groups` / :meth:`push` that queued it, for
        a caller whose next step failed. Never raises.

        Returns:
            The number of blocks removed (0 if the queue was empty).
        """
        cdef size_t before = self._q.num_blocks()
        self._q.discard_back()
        self._maybe_reset_tables()
        return before - self._q.num_blocks()

    cdef _push_part(self, int64_t fence, object blocks, bint joined):
        cdef Py_ssize_t n = self._part_handles(blocks)
        self._q.push(fence, self._handles.data(), <size_t>n, joined)

    cdef Py_ssize_t _part_handles(self, object blocks) except -1:
        # The handles of `blocks` into self._handles[0..n); returns n.
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
        return n

    def drain(self, processed_step_seq, max_requests=None):
        """Remove the leading entries whose fence is met (at most ``max_requests``
        entries, int >= 0, when given: a caller that frees them one request at a time
        loses no later request when a free raises, as vLLM's ``popleft`` loop).

        Returns:
            ``list[list[KVCacheBlock]]``: one list per ``free_blocks`` call to make, in
            order: each drained entry's parts (its KV cache groups), blocks in eviction
            order, oldest entry first. Free each with its own call (one call for several
            lists would interleave their front/tail placement).
        Raises:
            TypeError: ``processed_step_seq`` or ``max_requests`` is not an int.
            ValueError: ``max_requests < 0``.
            BlockStateError: a queued block was taken over by another free queue;
                nothing is removed then.
        """
        cdef size_t ready, e, start, taken_from, heads
        cdef int64_t limit = -1 if max_requests is None else _index(max_requests)
        cdef FencedFreeQueue.Entry entry
        cdef vector[PyObject*] refs
        cdef vector[size_t] ends
        cdef list result
        cdef uint64_t version
        cdef int64_t processed = _index(processed_step_seq)
        # Build the whole result while the entries are still queued and remove them
        # only then, so a failure (MemoryError included) removes nothing. Making the
        # lists may run Python code (a collection); if that code changed the queue, the
        # lists are dropped and the drain starts over, so no entry is returned twice.
        if limit < -1 or (max_requests is not None and limit < 0):
            raise ValueError(f"drain(max_requests={max_requests!r}): must be >= 0")
        while True:
            version = self._q.version()
            ready = self._q.ready_entries(processed)
            if limit >= 0:
                # The parts of the first `limit` requests (a request's parts are joined).
                e = heads = 0
                while e < ready:
                    if not self._q.entry(e).joined:
                        if heads == <size_t>limit:
                            break
                        heads += 1
                    e += 1
                ready = e
            refs.clear()
            ends.clear()
            taken_from = 0
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
            result = []
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
            if self._q.version() == version:
                break
            result = None  # the queue changed while the lists were made: again
        self._q.discard_front(ready)
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
            TypeError: the part holds an object that is not a block (pushed by
                mistake): that part is dropped (as vLLM's loop loses the entry), the
                ones after it stay queued.
        """
        cdef int64_t processed = _index(processed_step_seq)
        cdef FreeKVCacheBlockQueue queue
        cdef FencedFreeQueue.Entry entry
        cdef bint enable_caching
        cdef size_t n
        cdef Py_ssize_t freed = 0
        cdef int64_t own_owner
        cdef uint64_t version
        cdef vector[PyObject*] foreign
        queue = self._pool_queue(pool)
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
                    version = self._q.version()
                    try:
                        _free_core(pool, queue, NULL, <Py_ssize_t>n, 1, enable_caching,
                                   self, self._q.handles() + entry.begin, own_owner, &foreign)
                    except _NotABlockError:
                        # Never freeable (None, a str, ...): drop the part, as vLLM's
                        # loop pops an entry before freeing it, so later frees go on.
                        if self._q.version() == version:
                            self._q.discard_front(1)
                        raise
                    except _StaleQueueBlock:
                        # Nothing was freed: free the part by its blocks instead, the
                        # ones the pool's replaced queue still holds adopted first.
                        freed += self._free_part_adopting(pool, queue, enable_caching, foreign, version)
                        queue = self._pool_queue(pool)
                        queue_id = id(queue)
                        continue
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

    cdef FreeKVCacheBlockQueue _pool_queue(self, object pool):
        queue_obj = pool.free_block_queue
        if not isinstance(queue_obj, FreeKVCacheBlockQueue):
            raise TypeError(
                f"free_ready() needs a pool with a kvpool free queue, got {type(queue_obj).__name__}")
        return <FreeKVCacheBlockQueue>queue_obj

    cdef int _free_part_adopting(self, object pool, FreeKVCacheBlockQueue queue,
                                 bint enable_caching, vector[PyObject*]& foreign,
                                 uint64_t version) except -1:
        # Returns the number of parts freed (0 or 1). `version`: the queue's, when the
        # part was read; creating the exception that brought us here may have run Python
        # code (a finalizer) that changed the queue or the pool's free queue: then
        # nothing is done here and free_ready's loop looks again.
        # free_ready's front part holds blocks of `pool` registered to a queue the pool
        # has replaced: adopt them (_adopt_stale), free the part through its block
        # objects, and drop it. Python code may run while adopting: the part is
        # looked up again (by version) before it is freed.
        cdef vector[PyObject*] refs
        cdef FencedFreeQueue.Entry entry
        if self._q.empty() or self._q.version() != version or pool.free_block_queue is not queue:
            return 0
        entry = self._q.entry(0)
        self._take(entry.begin, entry.end, refs)
        blocks = _list_from_refs(refs)
        _adopt_stale(pool, queue, blocks)
        if self._q.version() != version or pool.free_block_queue is not queue:
            return 0  # changed meanwhile (adopted blocks stay adopted, held)
        _free_core(pool, queue, kvpool_list_items(<PyObject*>blocks), PyList_GET_SIZE(blocks), 1,
                   enable_caching, None, NULL, -1, &foreign)
        # No Python code ran since _free_core: drop the part before anything else.
        self._q.discard_front(1)
        if foreign.size():
            others = _forwarded(foreign)
            for other_pool, other_blocks in others.items():
                other_pool.free_blocks(other_blocks)
        return 1

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
        cdef uint64_t version
        # The result is built while the entry is still queued and the entry removed only
        # then (a MemoryError removes nothing); if Python code run by the allocation
        # changed the queue, the result is dropped and built again.
        while True:
            if self._q.empty():
                raise IndexError("pop from an empty deque")
            version = self._q.version()
            parts = self._end_of_entry(0)
            fence = self._q.entry(0).fence_seq
            refs.clear()
            self._take(self._q.entry(0).begin, self._q.entry(parts - 1).end, refs)
            blocks = self._list_of(refs, 0, refs.size(), True)  # takes refs, or drops them
            item = (fence, blocks)
            if self._q.version() == version:
                break
            item = None
        self._q.discard_front(parts)
        self._maybe_reset_tables()
        return item

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


# -- the deferred queue's tp_traverse: its owner and loose tables are internal -------------
# Like the free queue's block table (_queue_traverse): the lists and the index dict are
# untracked, and the collector (and gc.get_referents) gets the owner queues and loose
# blocks, never the containers, so no Python code can edit what the handles mean.
cdef traverseproc _deferred_generated_traverse = NULL


cdef int _deferred_traverse(PyObject* o, visitproc visit, void* arg) noexcept:
    cdef FencedDeferredFreeQueue q = <FencedDeferredFreeQueue>o
    cdef _SkipVisit sv
    cdef int r
    sv.visit = visit
    sv.arg = arg
    sv.skip[0] = <PyObject*>q._owners
    sv.skip[1] = <PyObject*>q._owner_index
    sv.skip[2] = <PyObject*>q._loose
    r = _visit_items(sv.skip[0], visit, arg)
    if r:
        return r
    r = _visit_items(sv.skip[2], visit, arg)
    if r:
        return r
    return _deferred_generated_traverse(o, _visit_skipping, &sv)


_deferred_generated_traverse = _install_traverse(
    FencedDeferredFreeQueue, _deferred_traverse, _deferred_generated_traverse)
