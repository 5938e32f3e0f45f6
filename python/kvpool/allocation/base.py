"""The interface of an allocation policy: the hooks kvpool's ``BlockPool`` calls.

``BlockPool`` (:mod:`kvpool.block_pool`) holds one policy object per pool
(``pool._policy``, built by :func:`kvpool.allocation.new_policy` when the pool is) and
calls these hooks unconditionally, in the manner of SGLang's
``srt/mem_cache/allocator`` base class. The base class is vLLM's behaviour: every hook
does nothing, or what vLLM 0.30.0-0.34.0's ``BlockPool`` does. A policy overrides
what it changes; whatever it changes must keep vLLM's prefix-cache semantics (the
same blocks hit and evicted, in the same order, the same KV events and free counts),
checked against vLLM's own pool by ``tests/pool/test_policy_differential.py``.

Every hook runs after vLLM's part of the operation has been done (except
:meth:`AllocationPolicy.extend_table`, which *is* the allocation, and
:meth:`AllocationPolicy.order_for_reset`, which runs before the reset takes effect), so
a hook must not raise for an operation that already happened: a reorder that finds no
memory is skipped, not raised.
"""

from __future__ import annotations

from typing import Any, ClassVar


class AllocationPolicy:
    """vLLM's allocation order (``FreeKVCacheBlockQueue``, vLLM 0.30.0-0.34.0).

    Args:
        num_gpu_blocks: blocks in the pool the policy serves.
    """

    #: The name ``install(allocation=...)`` takes (``kvpool.allocation.POLICIES``).
    name: ClassVar[str] = "vllm"
    #: True: the policy needs the single-type managers' hooks
    #: (:mod:`kvpool.patches.manager_hooks`) to know which block table an
    #: allocation extends; ``install()`` installs them only then.
    manager_hooks: ClassVar[bool] = False
    #: True: the free queue keeps vLLM's order at every step, so a walk from a saved
    #: cursor block (``iter_blocks_after``, the lazy CPU offloader's scan) sees what
    #: it sees in vLLM. False (an order of its own): ``install()``'s offload guard
    #: (:mod:`kvpool.patches.lazy_offload`) refuses to attach a lazy offloader.
    keeps_vllm_free_order: ClassVar[bool] = True
    #: How a user selects the policy (for messages).
    setting: ClassVar[str] = 'allocation="vllm"'

    def __init__(self, num_gpu_blocks: int):
        self.num_gpu_blocks = num_gpu_blocks
        self._handle: Any = None

    def queue_policy(self, pool: Any) -> Any:
        """``pool.free_block_queue.policy`` (the queue's ``FreeQueuePolicy``), kept
        while the pool keeps its queue: a hook that must not fail after an operation
        committed allocates nothing to reach it (only the first call, from
        :meth:`attach`, and the first after the pool's queue was replaced do).

        Raises:
            MemoryError: only from those first calls.
        """
        queue = pool.free_block_queue
        handle = self._handle
        if handle is None or handle.queue is not queue:
            handle = self._handle = queue.policy
        return handle

    def attach(self, pool: Any) -> None:
        """Called once by ``BlockPool.__init__``, before the null block is popped:
        set the free queue's order (``free_block_queue.policy.set_order``)."""

    def extend_table(self, pool: Any, num_blocks: int, manager: Any, request_id: str) -> list:
        """``get_new_blocks(num_blocks)`` for block table ``(manager, request_id)``
        (only while a manager hook has set ``pool._table_context``).

        Returns:
            ``num_blocks`` blocks with ``ref_cnt = 1`` (what ``pool._take`` returns).

        Raises:
            ValueError: as ``BlockPool.get_new_blocks``.
        """
        return pool._take(num_blocks)

    def after_change(self, pool: Any) -> None:
        """Blocks were allocated, touched, unpinned or evicted from the prefix cache."""

    def after_free(self, pool: Any) -> None:
        """Blocks were freed (``free_blocks``, ``unpin_blocks``, a drained deferred
        free). ``pool._idle()`` says whether only the null block is held now."""

    def end_table(self, pool: Any, manager: Any, request_id: str) -> None:
        """Request ``request_id``'s block table in ``manager`` is gone
        (``pop_blocks_for_free``; its blocks are freed by the caller)."""

    def expect_tokens(self, request_id: str, num_tokens: int) -> None:
        """The request will hold at most ``num_tokens`` tokens (prompt +
        ``max_tokens``), recorded by ``KVCacheManager.allocate_slots``."""

    def order_for_reset(self, pool: Any, reorder: bool) -> None:
        """``reset_prefix_cache`` is about to drop every hash (its precondition holds:
        only the null block is in use). ``reorder``: the caller asked for the canonical
        order too (``reorder_free_queue=True`` / ``KVPOOL_REORDER_ON_RESET``).

        Runs before the reset takes effect: a ``MemoryError`` here leaves the pool as
        it was (the reorders are strong)."""
        if reorder:
            self.restore_order(pool)

    def restore_order(self, pool: Any) -> None:
        """``reset_free_block_queue_order()`` with no block in use: restore the
        canonical order (blocks 1, 2, ... first). Strong on ``MemoryError``."""
        pool.free_block_queue.rebuild_canonical()


__all__ = ["AllocationPolicy"]
