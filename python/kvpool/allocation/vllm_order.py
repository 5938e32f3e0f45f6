"""vLLM's allocation order: the null policy, and its restore-on-idle variant.

``VllmOrder`` is :class:`~kvpool.allocation.base.AllocationPolicy` itself: vLLM's
``FreeKVCacheBlockQueue`` order (vLLM 0.30.0-0.34.0), no manager hook, no allocation
context, no work per call. ``VllmOrderRestoreOnIdle`` (``KVPOOL_REORDER_ON_IDLE=1``)
keeps that order and, whenever the last held block is freed, restores the uncached
segment to ascending ``block_id`` order; the LRU segment keeps its order, so the
prefix cache is untouched.
"""

from __future__ import annotations

from typing import Any

from kvpool.allocation.base import AllocationPolicy


class VllmOrder(AllocationPolicy):
    """vLLM's exact order (the default policy, ``allocation="vllm"``)."""

    name = "vllm"


class VllmOrderRestoreOnIdle(VllmOrder):
    """vLLM's order; on idle (only the null block held) the uncached segment is put
    back in ``block_id`` order (``KVPOOL_REORDER_ON_IDLE=1``)."""

    # The idle relink moves the uncached blocks around a lazy offloader's cursor.
    keeps_vllm_free_order = False
    setting = 'allocation="vllm" and KVPOOL_REORDER_ON_IDLE=1'

    def attach(self, pool: Any) -> None:
        self.queue_policy(pool).set_order("segments")

    def after_free(self, pool: Any) -> None:
        # Runs after the free is done, so it never raises: a reorder that finds no
        # memory is skipped (the order is only a preference; the next idle moment
        # tries again). (_idle() reads counts the interpreter may have to allocate:
        # inside the try too.)
        try:  # noqa: SIM105 (no object allocated to handle a MemoryError: fault-swept)
            if pool._idle():
                self.queue_policy(pool).rebuild_uncached_canonical()
        except MemoryError:
            pass


__all__ = ["VllmOrder", "VllmOrderRestoreOnIdle"]
