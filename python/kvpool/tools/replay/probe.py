"""Per-round instrumentation of one scheduler instance: block tables, deferred frees,
prefix-cache hits, evictions, preemptions (see docs/replay.md, "What is measured").

Everything is hooked onto instance attributes, so kvpool's native loops (which test the
class) keep their fast paths, and a vanilla and a kvpool scheduler are probed the same way.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from kvpool.tools.replay import metrics

_thread_time = time.thread_time
_perf_counter = time.perf_counter


class RoundProbe:
    """Per-round instrumentation hooked onto one scheduler instance.

    Wraps ``scheduler._free_request_blocks`` (to read a finishing request's block table
    before it is freed, and whether the free is deferred) and
    ``scheduler._drain_deferred_frees`` (CPU time of the drain). The time spent reading
    tables is accumulated in ``probe_cpu`` and subtracted from the scheduler's CPU time.

    Counts, without changing what the pool does (instance attributes only, so kvpool's
    fast paths, which test the class, stay on):

    - prefix-cache hits: ``kv_cache_manager.record_prefix_cache_stats(request,
      num_hits)``, the call vLLM's ``vllm:prefix_cache_hits`` counts (made at
      admission, whether or not stats are logged);
    - evictions: ``block_pool._emit_block_removed_events(hashes)``, called by
      ``_maybe_evict_cached_block`` with the hashes it removed (the ``BlockRemoved``
      events vLLM would publish with KV events on), in order. With KV events off (the
      replay's case) the instance attribute is the list's own ``extend``, which vLLM's
      code calls and kvpool's native eviction appends to as vLLM's would (so the
      native eviction stays on); with events on, a wrapper that also calls vLLM's;
    - preemptions: calls to ``scheduler._preempt_request``;
    - blocks that became full: each single-type manager's ``num_cached_block[rid]``
      (the request's blocks vLLM has cached, ``SingleTypeKVCacheManager.cache_blocks``,
      vLLM 0.33.0) read by :meth:`observe_full_blocks` after each ``schedule()`` and
      ``update_from_output()`` (outside their timed regions), and before a request's
      blocks are freed or it is preempted. The blocks between the previous reading
      (at admission: the prefix-cache hit blocks, ``num_hits // block_size`` from
      ``record_prefix_cache_stats``) and this one, null blocks skipped, are those
      vLLM's ``cache_full_blocks`` cached; ``step_full_blocks`` counts them and
      ``step_copies`` their ascending runs, per request and KV cache group, until
      :meth:`take_step` reads them. (The pool's ``cache_full_blocks`` is not wrapped:
      that would send kvpool's native caching back to vLLM's Python.)
    """

    def __init__(self, scheduler, per_group: bool = False) -> None:
        self.scheduler = scheduler
        #: The KV cache group whose tables ``finished_tables`` holds (:func:`primary_group`).
        self.primary = primary_group(scheduler)
        #: With ``per_group``: ``finished_by_group[g]``, group ``g``'s finished tables.
        self.num_groups = len(group_kinds(scheduler)) if per_group else 0
        self.reset()
        kv = scheduler.kv_cache_manager
        self._probe_full_blocks(kv)
        self._probe_frees(scheduler, kv)
        self._probe_cache(scheduler, kv)

    def _probe_frees(self, scheduler, kv) -> None:
        # Finished tables, deferred frees and the drains' cost.
        orig_free = scheduler._free_request_blocks
        orig_drain = scheduler._drain_deferred_frees
        observe = self._observe_request

        def _free_request_blocks(request):
            t0 = _thread_time()
            rid = request.request_id
            observe(rid, True)
            ids = kv.get_block_ids(rid)
            table = list(ids[self.primary])
            self.finished_tables[rid] = table
            for g, tables in enumerate(self.finished_by_group):
                tables[rid] = list(ids[g])
            deferred = scheduler.defer_block_free and not scheduler._request_blocks_can_be_freed(request)
            if deferred:
                self.deferred_frees += 1
                self.deferred_blocks += len(table)
            self.probe_cpu += _thread_time() - t0
            if not deferred:
                orig_free(request)
                return
            # Deferring costs work at push time too (kvpool converts blocks to native
            # handles there), so push + drain is the cost of one deferred free.
            t1 = _perf_counter()
            orig_free(request)
            self.push_cpu += _perf_counter() - t1

        def _drain_deferred_frees():
            n0 = len(scheduler.deferred_frees)
            # perf_counter (vDSO) rather than thread_time (a syscall on Linux): most
            # drains take a microsecond or less, and the timer must not dominate them.
            t0 = _perf_counter()
            orig_drain()
            self.drain_cpu += _perf_counter() - t0
            self.drain_calls += 1
            self.drained_entries += n0 - len(scheduler.deferred_frees)

        scheduler._free_request_blocks = _free_request_blocks
        scheduler._drain_deferred_frees = _drain_deferred_frees

    def _probe_cache(self, scheduler, kv) -> None:
        # Prefix-cache hits, evictions (in order) and preemptions.
        orig_record = kv.record_prefix_cache_stats
        lookup_enabled = kv.prefix_cache_lookup_enabled

        def record_prefix_cache_stats(request, num_hits):
            t0 = _thread_time()
            if lookup_enabled(request):
                self.hit_tokens += num_hits
                self.query_tokens += request.num_tokens
            # Admission: the hit blocks were cached before; later ones become full.
            self._seen[request.request_id] = [num_hits // bs for bs in self._block_sizes]
            self.probe_cpu += _thread_time() - t0
            orig_record(request, num_hits)

        pool = kv.block_pool
        evicted = self.evicted_hashes
        if getattr(pool, "enable_kv_cache_events", True) is False:
            # vLLM's method does nothing then; the list's extend records what it gets.
            pool._emit_block_removed_events = evicted.extend
        else:
            orig_emit = pool._emit_block_removed_events

            def _emit_block_removed_events(block_hashes):
                evicted.extend(block_hashes)
                orig_emit(block_hashes)

            pool._emit_block_removed_events = _emit_block_removed_events

        orig_preempt = scheduler._preempt_request
        observe = self._observe_request

        def _preempt_request(request, *args, **kwargs):
            self.preemptions += 1
            rid = request.request_id
            t0 = _thread_time()
            observe(rid)  # its blocks are freed (vLLM 0.33.0: through _free_request_blocks)
            self.probe_cpu += _thread_time() - t0
            try:
                return orig_preempt(request, *args, **kwargs)
            finally:
                self._seen.pop(rid, None)  # resumed, it is admitted anew

        kv.record_prefix_cache_stats = record_prefix_cache_stats
        scheduler._preempt_request = _preempt_request

    def _probe_full_blocks(self, kv) -> None:
        # Offloading copies: the blocks vLLM caches (their hash set) are those that
        # became full; an offloading connector stores exactly those, one job per
        # request, and one copy per ascending run of their ids (vLLM PR #35990).
        pool = kv.block_pool
        #: Whether vLLM caches blocks at all (prefix caching on); else no offload figures.
        self.caches_blocks = bool(getattr(pool, "enable_caching", False))
        self._null_id = getattr(getattr(pool, "null_block", None), "block_id", metrics.NULL_BLOCK_ID)
        coordinator = getattr(kv, "coordinator", None)
        self._managers = list(getattr(coordinator, "single_type_managers", ()) or ())
        self._block_sizes = [m.block_size for m in self._managers]
        #: request id -> blocks of each KV cache group counted as cached so far.
        self._seen: dict[str, list[int]] = {}

    def _observe_request(self, rid: str, forget: bool = False) -> None:
        # The blocks of ``rid`` cached since its previous reading (see the class doc).
        seen = self._seen.get(rid)
        null_id = self._null_id
        for g, mgr in enumerate(self._managers):
            n = mgr.num_cached_block.get(rid)
            if n is None:
                continue
            if seen is None:
                seen = self._seen[rid] = [0] * len(self._managers)
            prev = seen[g]
            if n > prev:
                ids = []
                for b in mgr.req_to_blocks[rid][prev:n]:
                    if not b.is_null:
                        ids.append(b.block_id)
                self.step_full_blocks += len(ids)
                self.step_copies += metrics.transfer_descriptors(ids, null_id)
            seen[g] = n
        if forget:
            self._seen.pop(rid, None)

    def observe_full_blocks(self) -> None:
        """Count the blocks that became full since the previous call, for every request
        the single-type managers hold (see the class doc). Called by the replay after
        ``schedule()`` and ``update_from_output()``, outside their timed regions."""
        if not self.caches_blocks:
            return
        live = set()
        for mgr in self._managers:
            live.update(mgr.num_cached_block)
        for rid in live:
            self._observe_request(rid)

    def eviction_digest(self) -> str:
        """Hash of the evicted block hashes, in eviction order."""
        h = hashlib.sha1()
        for key in self.evicted_hashes:
            h.update(key if isinstance(key, bytes) else repr(key).encode())
        return h.hexdigest()[:16]

    def reset(self) -> None:
        self.finished_tables: dict[str, list[int]] = {}
        self.finished_by_group: list[dict[str, list[int]]] = [{} for _ in range(self.num_groups)]
        self.preemptions = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        if hasattr(self, "evicted_hashes"):
            self.evicted_hashes.clear()  # the wrapper holds this list
        else:
            self.evicted_hashes: list = []
        self.deferred_frees = 0
        self.deferred_blocks = 0
        self.drain_cpu = 0.0
        self.push_cpu = 0.0
        self.drain_calls = 0
        self.drained_entries = 0
        self.probe_cpu = 0.0
        self.step_full_blocks = 0
        self.step_copies = 0

    def take_step(self) -> tuple[int, int]:
        """``(blocks that became full, copies)`` since the previous call; resets both."""
        out = (self.step_full_blocks, self.step_copies)
        self.step_full_blocks = self.step_copies = 0
        return out


def group_kinds(scheduler) -> list[str]:
    """The spec class name of each of ``scheduler``'s KV cache groups
    (``FullAttentionSpec``, ``SlidingWindowSpec``, ``MambaSpec``, ...)."""
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None) or []
    return [type(g.kv_cache_spec).__name__ for g in groups]


def primary_index(kinds: list) -> int:
    """Of KV cache groups of spec kinds ``kinds`` (:func:`group_kinds`, or the report's
    ``kv_cache_geometry.groups[i]["kind"]``), the one the single-table figures read: the
    first full-attention group (0 when there is none, or one group)."""
    return kinds.index("FullAttentionSpec") if "FullAttentionSpec" in kinds else 0


def primary_group(scheduler) -> int:
    """The KV cache group whose tables the replay's single-table figures read
    (:func:`primary_index` of the scheduler's groups)."""
    return primary_index(group_kinds(scheduler))


def cache_counts(probe: RoundProbe) -> dict[str, Any]:
    """The round's prefix-cache hits, evictions and preemptions (see :class:`RoundProbe`):
    what an allocation policy must leave exactly as vLLM has them."""
    return {
        "prefix_cache_hit_tokens": probe.hit_tokens,
        "prefix_cache_query_tokens": probe.query_tokens,
        "evictions": len(probe.evicted_hashes),
        "eviction_digest": probe.eviction_digest(),
        "preemptions": probe.preemptions,
    }


def by_request_index(tables: dict[str, list[int]]) -> list[list[int]]:
    """Tables keyed ``"<round>-<index>"`` as a list in request index order."""
    return [tables[rid] for rid in sorted(tables, key=lambda r: int(r.rsplit("-", 1)[1]))]


def table_digest(prompt_tables: dict[str, list[int]], finished_tables: dict[str, list[int]]) -> str:
    """Hash of a round's block tables keyed by request index within the round, so that
    the same shape allocated the same way digests equally in any round and mode."""
    h = hashlib.sha1()
    for name, tables in (("p", prompt_tables), ("f", finished_tables)):
        for rid in sorted(tables, key=lambda r: int(r.rsplit("-", 1)[1])):
            h.update(f"{name}{rid.rsplit('-', 1)[1]}:".encode())
            h.update(np.asarray(tables[rid], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]
