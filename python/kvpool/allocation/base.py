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

import importlib
import sys
from typing import Any, ClassVar

_ALLOCATING = ("allocate_new_blocks", "allocate_external_computed_blocks")
#: How many frames above ``get_new_blocks`` the table's method may be: vLLM 0.30.0-0.34.0
#: call the pool from it or from a helper it calls (1-2 frames), and ``allocate_slots``
#: is 3-5 frames up.
MAX_DEPTH = 8


def _vllm_class(module: str, name: str) -> type:
    # vLLM's class as ``from module import name`` gives it, read from sys.modules (an
    # import statement per call cost a hybrid model's table look-up a third of its time)
    loaded = sys.modules.get(module)
    if loaded is None:
        loaded = importlib.import_module(module)
    return getattr(loaded, name)


def table_of_caller(frame: Any, told: tuple[None, str, int | None] | None = None
                    ) -> tuple[Any, str, int | None] | None:
    """The block table a pool allocation extends, from the frames calling it.

    Args:
        frame: the frame that called ``BlockPool.get_new_blocks`` (``sys._getframe(1)``).
        told: ``(None, request_id, expected_tokens)``, what kvpool's native manager path
            knows around vLLM's own ``KVCacheManager.allocate_slots`` on a hybrid model
            (the request, not which group's manager allocates): the walk then stops at
            the allocating frame and returns its manager and request id with
            ``expected_tokens`` (what the ``allocate_slots`` frame above it holds).

    Returns:
        ``(manager, request_id, expected_tokens)`` for the innermost frame within
        :data:`MAX_DEPTH` that runs a single-type manager's ``allocate_new_blocks`` /
        ``allocate_external_computed_blocks`` (its ``self`` a vLLM
        ``SingleTypeKVCacheManager``, its ``request_id`` a ``str``), and the request's
        ``num_prompt_tokens + max_tokens`` (tokens) when a ``KVCacheManager.allocate_slots``
        frame above it holds a ``request`` with both as ints (else None); None when no such
        frame is found (the allocation then extends no known table, a preference only).
        Reads the frames' locals (``frame.f_locals``); changes nothing.
    """
    single_type = _vllm_class("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager")
    table = None
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        name = frame.f_code.co_name
        if table is None and name in _ALLOCATING:
            local = frame.f_locals
            manager, request_id = local.get("self"), local.get("request_id")
            if isinstance(manager, single_type) and type(request_id) is str:
                if told is not None:
                    return (manager, request_id, told[2])
                table = (manager, request_id)
        elif table is not None and name == "allocate_slots":
            local = frame.f_locals
            if isinstance(local.get("self"), _vllm_class("vllm.v1.core.kv_cache_manager", "KVCacheManager")):
                request = local.get("request")
                prompt = getattr(request, "num_prompt_tokens", None)
                max_tokens = getattr(request, "max_tokens", None)
                if type(prompt) is int and type(max_tokens) is int:
                    return (*table, prompt + max_tokens)
                break
        frame = frame.f_back
    return None if table is None else (*table, None)


class AllocationPolicy:
    """vLLM's allocation order (``FreeKVCacheBlockQueue``, vLLM 0.30.0-0.34.0).

    Args:
        num_gpu_blocks: blocks in the pool the policy serves.
    """

    #: The name ``install(allocation=...)`` takes (``kvpool.allocation.POLICIES``).
    name: ClassVar[str] = "vllm"
    #: True: the policy needs to know which block table an allocation extends (the
    #: pool then looks it up: :func:`table_of_caller`) and when a table ends (the
    #: managers' hooks, :mod:`kvpool.patches.manager_hooks`, which ``install()``
    #: installs only then).
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
        (for a policy with ``manager_hooks``: the table :func:`table_of_caller` found,
        or the one kvpool's native manager path set as ``pool._table_context``).

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
        ``max_tokens``), told before an allocation for its table (from the
        ``KVCacheManager.allocate_slots`` frame :func:`table_of_caller` found, or by
        kvpool's native manager path)."""

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


__all__ = ["MAX_DEPTH", "AllocationPolicy", "table_of_caller"]
