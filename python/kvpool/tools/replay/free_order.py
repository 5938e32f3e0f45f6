"""Deferred frees against the immediate path's order, per KV cache group (``--model`` runs).

vLLM's immediate free of a finished request (``KVCacheCoordinator.free``, vLLM 0.34.0)
makes one ``block_pool.free_blocks(reversed(blocks))`` call per KV cache group, group by
group. kvpool's fenced deferred frees claim to leave the free queue (the eviction order)
exactly as those calls would, when the fence is met; vLLM 0.34.0's own deferred path
frees all groups' blocks in one reversed call (seed 003's bug). What this module adds:

- the reference mode ``vanilla+immediate-order`` (:func:`defer_by_group`): vLLM's own
  classes, a deferred request queued as one ``deferred_frees`` item per KV cache group in
  allocation order, which vLLM's drain frees ``reversed``: the immediate path's calls, at
  the moment vLLM's drain frees, so the run takes the same decisions as a deferring one;
- per round, the free queue's order after the round (:func:`free_queue_figures`): a digest
  of the whole queue, and per group of the blocks that group's finished tables held
  (the blocks its request frees return: a sliding-window group's live window, a Mamba
  group's kept state blocks) in the order the queue holds them;
- :func:`versus_immediate_order`: per mode, the rounds whose tables, evictions and free
  queue equal the reference's, whole and per group.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import numpy as np

#: The reference mode's name (:mod:`.modes`).
REFERENCE = "vanilla+immediate-order"


def _free_request_blocks_by_group(self, request) -> None:
    # Scheduler._free_request_blocks (vLLM 0.34.0) deferring each KV cache group as an
    # item of its own: the drain frees each reversed, one free_blocks call per group.
    if self._request_blocks_can_be_freed(request):
        self.kv_cache_manager.free(request)
        return
    for manager in self.kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.pop_blocks_for_free(request.request_id)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))


def defer_by_group(scheduler) -> None:
    """Make ``scheduler`` (vLLM's own, kvpool not installed) defer a request's frees as the
    immediate path's calls (see the module doc). Instance-level: other schedulers keep
    vLLM's method.

    Raises:
        TypeError: the scheduler's ``deferred_frees`` is not vLLM's ``deque`` (kvpool is
            installed: this reference must run vLLM's drain).
    """
    from collections import deque

    if type(scheduler.deferred_frees) is not deque:
        raise TypeError(f"{REFERENCE} needs vLLM's deferred_frees deque, got "
                        f"{type(scheduler.deferred_frees).__name__} (is kvpool installed?)")
    scheduler._free_request_blocks = types.MethodType(_free_request_blocks_by_group, scheduler)


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def free_queue_order(pool) -> list[int]:
    """Block ids of the pool's free queue, first evicted (allocated) first; read, not
    changed (``FreeKVCacheBlockQueue.get_all_free_blocks``)."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def free_queue_figures(scheduler, finished_by_group: list[dict[str, list[int]]],
                       null_block_id: int) -> tuple[str, list[dict[str, Any]]]:
    """``(digest of the whole free queue, per group {"freed_blocks", "free_order_digest"})``
    after a round: per KV cache group, the non-null blocks of its finished tables, in the
    free queue's order (blocks reused within the round count in every group that held
    them)."""
    order = free_queue_order(scheduler.kv_cache_manager.block_pool)
    per_group = []
    for tables in finished_by_group:
        held = {b for t in tables.values() for b in t if b != null_block_id}
        mine = [b for b in order if b in held]
        per_group.append({"freed_blocks": len(held), "free_order_digest": _digest(mine)})
    return _digest(order), per_group


def _equal_rounds(rounds: list[dict], base: list[dict], keys: tuple[str, ...]) -> int:
    return sum(all(a.get(k) == b.get(k) for k in keys) for a, b in zip(rounds, base))


def _group_rounds(rounds: list[dict], base: list[dict], g: int) -> dict[str, int]:
    pairs = [(a["by_group"][g], b["by_group"][g]) for a, b in zip(rounds, base)
             if a.get("by_group") and b.get("by_group")]
    return {"rounds_tables_equal": sum(a.get("table_digest") == b.get("table_digest") for a, b in pairs),
            "rounds_free_order_equal": sum(a.get("free_order_digest") == b.get("free_order_digest")
                                           for a, b in pairs)}


def versus_immediate_order(modes: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode other than the reference, when the reference ran: ``{"rounds_compared",
    "rounds_tables_equal", "rounds_evictions_equal", "rounds_free_queue_equal",
    "by_group": [{"group", "kind", "rounds_tables_equal", "rounds_free_order_equal"}]}``
    against :data:`REFERENCE` (``modes``: mode name -> its rounds' JSON)."""
    base = modes.get(REFERENCE)
    if base is None:
        return {}
    out = {}
    for mode, rounds in modes.items():
        if mode == REFERENCE:
            continue
        groups = (rounds[0].get("by_group") or []) if rounds else []
        out[mode] = {
            "rounds_compared": min(len(rounds), len(base)),
            "rounds_tables_equal": _equal_rounds(rounds, base, ("table_digest",)),
            "rounds_evictions_equal": _equal_rounds(rounds, base, ("evictions", "eviction_digest")),
            "rounds_free_queue_equal": _equal_rounds(rounds, base, ("free_queue_digest",)),
            "by_group": [{"group": g, "kind": grp["kind"], **_group_rounds(rounds, base, g)}
                         for g, grp in enumerate(groups)],
        }
    return out


def summary_lines(comparison: dict[str, Any]) -> list[str]:
    """One line per mode compared with the reference (nothing when it did not run)."""
    lines = []
    for mode, c in comparison.items():
        vs = c.get("vs_immediate_order")
        if not vs:
            continue
        n = vs["rounds_compared"]
        groups = ", ".join(f"group {g['group']} {g['kind']}: tables {g['rounds_tables_equal']}/{n}, free order "
                           f"{g['rounds_free_order_equal']}/{n}" for g in vs["by_group"])
        lines.append(f"{mode} vs {REFERENCE} (the immediate free path's calls): tables {vs['rounds_tables_equal']}/{n}"
                     f" rounds, evictions {vs['rounds_evictions_equal']}/{n}, free queue after the round "
                     f"{vs['rounds_free_queue_equal']}/{n}" + (f"; {groups}" if groups else ""))
    return lines
