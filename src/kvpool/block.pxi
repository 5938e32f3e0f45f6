# Included by _core.pyx: KVCacheBlock (vllm/v1/core/kv_cache_utils.py).

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
