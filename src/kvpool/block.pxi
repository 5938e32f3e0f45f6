# Included by _core.pyx: KVCacheBlock (vllm/v1/core/kv_cache_utils.py).

# --------------------------------------------------------------------------------------
# KVCacheBlock
# --------------------------------------------------------------------------------------
# vLLM >= 0.34.0 (kvpool.vllm_compat.VllmRelease.public_block_hash): ``block_hash`` and
# ``block_hash_num_tokens`` are the dataclass's own writable fields, printed without the
# underscore. Set once by kvpool.block_pool for the installed vLLM.
from weakref import ref as _WeakRef
cdef bint _public_block_hash = False
# vLLM >= 0.34.0 (VllmRelease.weak_block_pool): a block's ``pool`` is a weak reference
# to its pool (the pool's ``_weak_self``), so request block lists hidden from the
# garbage collector cannot keep a pool alive.
cdef bint _weak_block_pool = False


def configure_block_fields(bint public_block_hash, bint weak_block_pool=False):
    """Make ``KVCacheBlock.block_hash`` / ``block_hash_num_tokens`` writable fields as in
    vLLM >= 0.34.0 (``True``) or read-only properties as in vLLM 0.30.0-0.33.0
    (``False``, the default; also the repr's field names); ``weak_block_pool``: the
    pool loops expect a block's ``pool`` to be its pool's ``_weak_self`` (vLLM >=
    0.34.0) instead of the pool."""
    global _public_block_hash, _weak_block_pool
    _public_block_hash = public_block_hash
    _weak_block_pool = weak_block_pool


cdef object _block_owner(object pool):
    """What the ``pool`` field of ``pool``'s blocks holds: the pool, or its
    ``_weak_self`` (vLLM >= 0.34.0)."""
    if _weak_block_pool and pool is not None:
        weak = getattr(pool, "_weak_self", None)
        if weak is not None:
            return weak
    return pool


cdef object _owner_pool(object owner):
    """The pool a block's ``pool`` field names (None once a weakly held pool is gone)."""
    if type(owner) is _WeakRef:
        return owner()
    return owner


@cython.auto_pickle(False)
cdef class KVCacheBlock:
    """KV-cache block metadata (mirrors ``vllm.v1.core.kv_cache_utils.KVCacheBlock``,
    vLLM 0.30.0-0.34.0, a ``@dataclass(slots=True)``).

    Args:
        block_id: block id, ``0 <= block_id < num_gpu_blocks`` (``-1`` for the fake
            head/tail of a free queue). C ``int``.
        ref_cnt: number of requests holding the block.
        block_hash / block_hash_num_tokens: prefix-cache key and the tokens it covers
            (vLLM >= 0.34.0's keywords; ``_block_hash`` / ``_block_hash_num_tokens``,
            vLLM 0.30.0-0.33.0's, are accepted as keywords too).
        prev_free_block / next_free_block: only honoured for a block that no kvpool
            free queue owns; a queue-owned block's links are the queue's.
        is_null: the null block (block 0 of a pool), never freed or cached.
        pool: keyword only; the pool that owns the block (deferred frees may hold
            blocks of several pools): the pool itself up to vLLM 0.33.0, a
            ``weakref.ref`` to it from 0.34.0 (``BlockPool._weak_self``). Not part of
            equality.

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

    def __init__(self, block_id, ref_cnt=0, block_hash=None,
                 block_hash_num_tokens=None, prev_free_block=None,
                 next_free_block=None, is_null=False, *, pool=None,
                 _block_hash=None, _block_hash_num_tokens=None):
        _store(&self._block_id_o, block_id)
        _store(&self._ref_cnt_o, ref_cnt)
        _store(&self._is_null_o, is_null)
        self._block_hash = block_hash if _block_hash is None else _block_hash
        self._block_hash_num_tokens = (block_hash_num_tokens if _block_hash_num_tokens is None
                                       else _block_hash_num_tokens)
        self.pool = pool
        if prev_free_block is not None:
            self.prev_free_block = prev_free_block
        if next_free_block is not None:
            self.next_free_block = next_free_block

    @property
    def block_hash(self):
        """The hash key (block hash + KV cache group id), or None if not cached.
        Writable where vLLM's field is (vLLM >= 0.34.0: ``configure_block_fields``);
        read-only before, as vLLM's property."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, value):
        if not _public_block_hash:
            raise AttributeError("property 'block_hash' of 'KVCacheBlock' object has no setter")
        self._block_hash = value

    @property
    def block_hash_num_tokens(self):
        """Number of prefix tokens covered by ``block_hash`` (None if not cached);
        writable as ``block_hash`` is."""
        return self._block_hash_num_tokens

    @block_hash_num_tokens.setter
    def block_hash_num_tokens(self, value):
        if not _public_block_hash:
            raise AttributeError(
                "property 'block_hash_num_tokens' of 'KVCacheBlock' object has no setter")
        self._block_hash_num_tokens = value

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
        prefix = "" if _public_block_hash else "_"
        return (
            f"KVCacheBlock(block_id={self.block_id}, "
            f"ref_cnt={self.ref_cnt}, "
            f"{prefix}block_hash={self._block_hash!r}, "
            f"{prefix}block_hash_num_tokens={self._block_hash_num_tokens}, "
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
