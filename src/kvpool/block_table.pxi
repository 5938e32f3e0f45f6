# Included by _core.pyx: BlockTable: a pool's blocks, created on first use.

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
        cdef Py_ssize_t start, stop, step, i
        cdef vector[int32_t] slots
        if isinstance(index, slice):
            # A new list built last (no list comprehension: docs/native-checks.md).
            # slice.indices runs the slice's __index__ before any block is read.
            start, stop, step = index.indices(PyList_GET_SIZE(self._queue._blocks))
            for i in range(start, stop, step):
                slots.push_back(<int32_t>i)
            return self._queue._blocks_at(slots)
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

    def reset_hashes(self):
        """``reset_hash()`` of every block created so far (blocks not created yet hold
        no hash), as ``for block in pool.blocks: block.reset_hash()`` does in
        ``BlockPool.reset_prefix_cache`` (vLLM 0.33.0). Allocates nothing, so it
        cannot fail part-way; the table is re-read after each block (releasing a
        hash object could run Python code)."""
        cdef Py_ssize_t i = 0
        cdef PyObject* o
        cdef KVCacheBlock b
        while i < PyList_GET_SIZE(self._queue._blocks):
            o = PyList_GET_ITEM(self._queue._blocks, i)
            i += 1
            if <object>o is None:
                continue
            b = <KVCacheBlock>o  # (holds a reference while the old hashes are released)
            b._block_hash = None
            b._block_hash_num_tokens = None

    def materialized(self):
        """The block objects created so far (``list[KVCacheBlock]``, id order).
        Blocks not created yet are free, unhashed and have ``ref_cnt == 0``."""
        cdef list out = []
        cdef Py_ssize_t i
        cdef PyObject* o
        for i in range(PyList_GET_SIZE(self._queue._blocks)):
            o = PyList_GET_ITEM(self._queue._blocks, i)
            if <object>o is not None:
                out.append(<object>o)
        return out

    def __eq__(self, other):
        if isinstance(other, (list, tuple, BlockTable)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return (f"BlockTable({len(self)} blocks, "
                f"{len(self.materialized())} created)")
