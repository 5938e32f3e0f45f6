"""The contiguous allocation policy through vLLM's own managers and scheduler, the idle
restore, fragmentation statistics and the install switches (``kvpool.allocation``).

The pool-level differential against vLLM (hits, evictions, events) is in
``test_policy_differential.py``.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import kvpool
from kvpool import allocation
from kvpool.block_pool import BlockPool
from tests.support.scheduler import make_request, make_scheduler, runner_output

COMMON = dict(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
SPECS = {
    "full": FullAttentionSpec(**COMMON),
    "sliding_window": SlidingWindowSpec(**COMMON, sliding_window=4096),
    "chunked_local": ChunkedLocalAttentionSpec(**COMMON, attention_chunk_size=4096),
    "cross_attention": CrossAttentionSpec(**COMMON),
    "mamba": MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,)),
}


def _uncached_manager(spec, pool):
    """vLLM's single-type manager for ``spec`` on ``pool``: KV cache group 0, 16-token
    blocks, no prefix caching."""
    return get_manager_for_kv_cache_spec(
        spec, max_in_flight_tokens=2048, max_model_len=4096, block_pool=pool, enable_caching=False,
        kv_cache_group_id=0, scheduler_block_size=16)


def _grow_interleaved(spec, policy: str) -> tuple[dict[str, list[int]], dict]:
    """Four requests of one KV cache group grow by 3 blocks a step, interleaved (as a
    batch decodes), through vLLM's manager for ``spec`` on a kvpool pool."""
    kvpool.install(allocation=policy)
    try:
        pool = BlockPool(512, False, 16)
        manager = _uncached_manager(spec, pool)
        for r in range(4):
            pool._policy.expect_tokens(f"r{r}", 16 * 15)  # what allocate_slots records: prompt + max_tokens
        for step in range(1, 6):
            for r in range(4):
                manager.allocate_new_blocks(f"r{r}", 16 * 3 * step, 16 * 3 * step)
        tables = {r: [b.block_id for b in blocks if not b.is_null] for r, blocks in manager.req_to_blocks.items()}
        for r in list(manager.req_to_blocks):
            manager.free(r)
        assert pool.free_block_queue.policy.num_reserved_owners == 0  # freeing a table releases its extent
        stats = pool.fragmentation_stats()  # the tables, counted as they were freed
        return tables, stats
    finally:
        kvpool.uninstall()


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_kv_cache_group_type_grows_its_tables_in_one_extent(kind):
    tables, stats = _grow_interleaved(SPECS[kind], "contiguous")
    assert len(tables) == 4 and all(len(t) == 15 for t in tables.values())
    for ids in tables.values():
        assert ids == list(range(ids[0], ids[0] + 15))  # one run: the table's extent
    assert stats["table_contiguity"] == 1.0 and stats["table_pairs"] == 4 * 14
    vanilla_tables, vanilla_stats = _grow_interleaved(SPECS[kind], "vllm")
    assert vanilla_stats["table_contiguity"] < 0.8  # vLLM's order interleaves the requests
    assert sorted(len(t) for t in vanilla_tables.values()) == sorted(len(t) for t in tables.values())


def _run_scheduler(policy: str, num_groups: int, steps: int = 24):
    """A real Scheduler (1-3 KV cache groups, prefix caching on) serving requests that
    share a prefix, with new ones arriving while others decode. Returns per step what
    the scheduler decided (block ids aside) and every request's tables at its end."""
    kvpool.install(allocation=policy)
    try:
        scheduler = make_scheduler(num_blocks=400, num_groups=num_groups, window_blocks=64)
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        shared = list(range(48))
        decisions, tables = [], {}
        for step in range(steps):
            if step % 3 == 0 and step < 15:
                for j in range(2):
                    rid = f"s{step}-{j}"
                    prompt = shared + [1000 + 17 * step + j] * (20 + 13 * j + step)
                    scheduler.add_request(make_request(rid, prompt, max_tokens=6 + 5 * j))
            so = scheduler.schedule()
            for req_id in so.num_scheduled_tokens:
                tables[req_id] = [[b.block_id for b in m.req_to_blocks.get(req_id, []) if not b.is_null]
                                  for m in managers]
            decisions.append((dict(so.num_scheduled_tokens), sorted(so.preempted_req_ids or []),
                              so.num_common_prefix_blocks if hasattr(so, "num_common_prefix_blocks") else None))
            scheduler.update_from_output(so, runner_output(so))
        pool = scheduler.kv_cache_manager.block_pool
        hits = scheduler.kv_cache_manager.prefix_cache_stats
        return decisions, tables, pool, hits
    finally:
        kvpool.uninstall()


@pytest.mark.parametrize("num_groups", [1, 2, 3])
def test_scheduler_with_the_policy_decides_as_vllm_and_keeps_tables_contiguous(num_groups):
    vanilla_decisions, vanilla_tables, _, _ = _run_scheduler("vllm", num_groups)
    decisions, tables, pool, _ = _run_scheduler("contiguous", num_groups)
    assert decisions == vanilla_decisions  # same tokens scheduled, same preemptions
    assert tables.keys() == vanilla_tables.keys()

    def own_runs_contiguous(groups) -> bool:
        # After the 3 shared prefix blocks (a cache hit), a request's own blocks.
        return all(ids[3:] == list(range(ids[3], ids[3] + len(ids) - 3)) for ids in groups if len(ids) > 3)

    assert all(own_runs_contiguous(groups) for groups in tables.values()), tables
    assert not all(own_runs_contiguous(groups) for groups in vanilla_tables.values())
    shared = {tuple(groups[g][:3]) for groups in tables.values() for g in range(num_groups)}
    assert len(shared) == num_groups  # the prefix is one cache hit for every request, as in vLLM
    assert pool.fragmentation_stats()["table_pairs"] > 0


def test_reorder_on_idle_restores_the_uncached_segment_and_keeps_the_lru_segment(monkeypatch):
    monkeypatch.setenv(allocation.REORDER_ON_IDLE_ENV, "1")
    pool = BlockPool(64, True, 16)
    queue = pool.free_block_queue
    assert pool.allocation == "vllm" and queue.policy.order == "segments"
    a, b, c = pool.get_new_blocks(5), pool.get_new_blocks(4), pool.get_new_blocks(6)
    for i, block in enumerate(b):
        pool._insert_block_hash(bytes([i]) * 4 + (0).to_bytes(4, "big"), block, num_tokens=16)
    pool.free_blocks(reversed(b))  # hashed: the LRU segment
    pool.free_blocks(reversed(a))
    lru_before = [x.block_id for x in queue.get_all_free_blocks()][-4:]
    assert queue.free_block_ids()[:5] == [5, 4, 3, 2, 1]  # LIFO: vLLM's order while not idle
    pool.free_blocks(c[::2])
    pool.free_blocks(c[1::2])  # the last held block: idle
    ids = queue.free_block_ids()
    assert ids[-4:] == lru_before  # the prefix cache's eviction order is untouched
    assert ids[:-4] == sorted(ids[:-4])  # the uncached blocks are back in block_id order
    assert pool.get_new_blocks(3)[0].block_id == ids[0]


def test_without_the_switches_the_pool_keeps_vllm_s_exact_order():
    pool = BlockPool(32, True, 16)
    assert pool.allocation == "vllm" and pool.free_block_queue.policy.order == "vllm"
    a = pool.get_new_blocks(4)
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.free_block_ids()[:4] == [4, 3, 2, 1]  # LIFO, as vLLM


def test_fragmentation_stats_window_and_free_runs():
    allocation.set_policy("contiguous")
    try:
        pool = BlockPool(32, False, 16)
    finally:
        allocation.set_policy("vllm")
    stats = pool.fragmentation_stats()
    assert stats == {"free_blocks": 31, "free_runs": 1, "largest_free_run": 31, "table_pairs": 0,
                     "table_contiguity": 1.0, "descending_fraction": 0.0, "mean_run_length": 0.0,
                     "table_descriptors": 0, "tables_freed": 0, "mean_descriptors_per_table": 0.0}
    held = pool.get_new_blocks(6)
    pool.free_blocks([held[1], held[3]])
    stats = pool.fragmentation_stats()
    assert stats["free_blocks"] == 27 and stats["free_runs"] == 3 and stats["largest_free_run"] == 25


def test_install_switches(monkeypatch):
    with pytest.raises(ValueError, match="allocation='fastest' is not a valid setting; accepted: vllm, contiguous"):
        kvpool.install(allocation="fastest")
    assert not kvpool.is_installed()
    monkeypatch.setenv(allocation.ALLOCATION_ENV, "contiguous")
    assert kvpool.install()
    try:
        assert allocation.current() == "contiguous"
        assert BlockPool(8, False, 16).free_block_queue.policy.order == "contiguous"
        assert kvpool.install(allocation="contiguous") is False  # idempotent
        with pytest.raises(ValueError, match="uninstall"):
            kvpool.install(allocation="vllm")
    finally:
        kvpool.uninstall()
    assert allocation.current() == "vllm"
    monkeypatch.setenv(allocation.ALLOCATION_ENV, "bogus")
    from kvpool import plugin

    # A typo stops the engine (vLLM's plugin loader does not catch) instead of
    # running it without kvpool.
    with pytest.raises(ValueError, match="KVPOOL_ALLOCATION='bogus'"):
        plugin.register()
    assert not kvpool.is_installed()


def _frames_between_manager_and_native_call(policy: str, monkeypatch) -> list[str]:
    """``module:function`` of every kvpool frame between vLLM's
    ``KVCacheManager.allocate_slots`` and kvpool's native allocation loop (outermost
    first), for one request scheduled through vLLM's Scheduler with
    ``allocation=policy`` and vLLM's own ``allocate_slots`` (``KVPOOL_PYTHON_MANAGER=1``:
    the native manager path, which allocates for every call of this request on vLLM
    0.34.0, its admission included, is covered by tests/integration)."""
    import sys

    from kvpool import block_pool as kp

    seen: list[list[str]] = []
    native = kp.pool_get_new_blocks

    def spy(*args, **kwargs):
        chain, frame = [], sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name == "allocate_slots"
                                         and frame.f_globals.get("__name__") == "vllm.v1.core.kv_cache_manager"):
            module = frame.f_globals.get("__name__", "?")
            if module.startswith("kvpool"):
                chain.append(f"{module}:{frame.f_code.co_name}")
            frame = frame.f_back
        if frame is not None:  # (an allocation outside allocate_slots is not this one)
            seen.append(chain[::-1])
        return native(*args, **kwargs)

    monkeypatch.setattr(kp, "pool_get_new_blocks", spy)
    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install(allocation=policy)
    try:
        scheduler = make_scheduler(num_blocks=64)
        scheduler.add_request(make_request("r", list(range(40)), max_tokens=20))
        for _ in range(3):
            so = scheduler.schedule()
            scheduler.update_from_output(so, runner_output(so))
    finally:
        kvpool.uninstall()
    assert seen, "the native allocation loop never ran"
    return seen[0]


def test_default_policy_runs_no_kvpool_frame_between_vllm_s_manager_and_the_native_loop(monkeypatch):
    # The default policy: vLLM's allocate_new_blocks calls the pool's get_new_blocks,
    # which calls the native loop; no policy wrapper, no context.
    assert _frames_between_manager_and_native_call("vllm", monkeypatch) == ["kvpool.block_pool:get_new_blocks"]


def test_contiguous_policy_runs_its_manager_hook_and_policy(monkeypatch):
    # The policy that needs to know the table does pay, when it allocates: the
    # look-up of the table in the calling frames (allocation.base.table_of_caller, no
    # wrapper around vLLM's allocate_new_blocks) and its extend_table.
    chain = _frames_between_manager_and_native_call("contiguous", monkeypatch)
    assert chain == [
        "kvpool.block_pool:get_new_blocks",
        "kvpool.allocation.contiguous:extend_table",
        "kvpool.block_pool:_take",
    ]


def test_default_policy_installs_no_manager_hook():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    vanilla = (KVCacheManager.allocate_slots, SingleTypeKVCacheManager.allocate_new_blocks,
               FullAttentionManager.pop_blocks_for_free)
    from kvpool import _core

    kvpool.install()
    try:
        # The single-type managers run vLLM's methods unwrapped; allocate_slots is the
        # native path (kvpool.patches.manager_fast_path), no wrapper around vLLM's.
        assert (SingleTypeKVCacheManager.allocate_new_blocks, FullAttentionManager.pop_blocks_for_free) == vanilla[1:]
        assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
        assert KVCacheManager.allocate_slots.__kvpool_wrapped__ is vanilla[0]
    finally:
        kvpool.uninstall()
    kvpool.install(allocation="contiguous")
    try:
        # The native path over vLLM's method; the allocating methods unwrapped (the
        # table is found when the pool allocates); the end of a table is wrapped.
        assert KVCacheManager.allocate_slots.__kvpool_wrapped__ is vanilla[0]
        assert SingleTypeKVCacheManager.allocate_new_blocks is vanilla[1]
        assert FullAttentionManager.pop_blocks_for_free.__kvpool_wrapped__ is vanilla[2]
    finally:
        kvpool.uninstall()
    assert KVCacheManager.allocate_slots is vanilla[0]


@pytest.mark.parametrize("policy", ["vllm", "contiguous"])
def test_table_statistics_count_each_freed_table_through_vllm_s_manager(policy):
    # One request's table of 9 blocks, allocated in 3 steps and freed by vLLM's manager
    # (tail first): 8 pairs of that table, whatever the policy.
    kvpool.install(allocation=policy)
    try:
        pool = BlockPool(64, False, 16)
        manager = _uncached_manager(SPECS["full"], pool)
        for step in range(1, 4):
            manager.allocate_new_blocks("r", 16 * 3 * step, 16 * 3 * step)
        table = [b.block_id for b in manager.req_to_blocks["r"]]
        assert pool.fragmentation_stats()["table_pairs"] == 0  # counted when freed
        manager.free("r")
        stats = pool.fragmentation_stats()
    finally:
        kvpool.uninstall()
    ascending = sum(b == a + 1 for a, b in zip(table, table[1:]))
    descending = sum(b == a - 1 for a, b in zip(table, table[1:]))
    assert stats["table_pairs"] == 8
    assert stats["table_contiguity"] == ascending / 8 and stats["descending_fraction"] == descending / 8
    assert pool.fragmentation_stats()["table_pairs"] == 0  # the window was reset


def test_a_free_that_raises_counts_no_table_pair():
    pool = BlockPool(32, False, 16)
    blocks = pool.get_new_blocks(6)
    pool.free_blocks([blocks[5]])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(reversed(blocks))  # blocks[5] is already free: nothing is freed
    assert pool.free_block_queue.table_counters() == (1, 0, 0, 0)
    pool.free_blocks(reversed(blocks[:5]))
    assert pool.free_block_queue.table_counters(reset=True) == (6, 4, 4, 0)


def _cached_contiguous_pool(lru_window: int, num_blocks: int = 16):
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    allocation.set_policy("contiguous", lru_window)
    try:
        pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    finally:
        allocation.set_policy("vllm")
    blocks = pool.get_new_blocks(num_blocks - 1)
    for i, block in enumerate(blocks):
        block._block_hash = make_block_hash_with_group_id(BlockHash(b"h%d" % i), 0)
        pool.cached_block_hash_to_block.insert(block.block_hash, block)
    pool.free_blocks(blocks)  # every block cached, in the LRU segment
    return pool


@pytest.mark.parametrize("lru_window", [0, 2])
@pytest.mark.parametrize("meddle", ["set_order", "rebuild", "evict_all"])
def test_a_raising_eviction_hook_that_rearranges_the_queue_loses_no_block(lru_window, meddle):
    """Hostile eviction callbacks (found by a breaker run): one that switches the queue's
    order then raises (crashed the LRU window's undo), and ones that only relink free
    blocks then raise (their moves were counted as frees, so the undo kept the popped
    blocks out). Every block ends free, once."""
    pool = _cached_contiguous_pool(lru_window)
    queue = pool.free_block_queue

    def hook(block):
        if meddle == "set_order":
            queue.policy.set_order("vllm")
        elif meddle == "rebuild":
            queue.policy.rebuild_uncached_canonical()
        else:  # (with vLLM's own eviction callback meanwhile)
            del pool._maybe_evict_cached_block
            pool.evict_blocks(set(range(1, pool.num_gpu_blocks)))
            pool._maybe_evict_cached_block = hook
        raise RuntimeError("hook")

    pool._maybe_evict_cached_block = hook
    with pytest.raises(RuntimeError, match="hook"):
        pool.get_new_blocks(4)
    del pool._maybe_evict_cached_block
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert sorted(queue.free_block_ids()) == list(range(1, pool.num_gpu_blocks))
    assert all(pool.blocks[i].ref_cnt == 0 for i in range(1, pool.num_gpu_blocks))
    queue.check_invariants()


def test_lru_window_handle_takes_whole_numbers_only():
    queue = _cached_contiguous_pool(0).free_block_queue
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError):
            queue.policy.set_lru_window(bad)
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match="lru_window"):
            queue.policy.set_lru_window(bad)
    queue.policy.set_lru_window(2**31 - 1)  # clamped where it is used, allocates nothing big
    assert queue.policy.lru_window == 2**31 - 1
    assert len(queue.popleft_n(3)) == 3


class _RaisingCollector:
    """vLLM's KV cache metrics collector interface; raises on the third allocation."""

    def __init__(self):
        self.allocated = 0

    def on_block_allocated(self, block):
        self.allocated += 1
        if self.allocated == 3:
            raise RuntimeError("collector")

    def on_block_accessed(self, block):
        pass

    def on_block_evicted(self, block):
        pass

    def reset(self):
        pass


@pytest.mark.parametrize("policy", ["vllm", "contiguous"])
def test_vllm_s_own_loop_that_raises_gives_its_popped_blocks_back(policy):
    """With a metrics collector kvpool runs vLLM's own allocation loop (every callback
    sees every block), which has no undo: a raising callback used to leave the popped
    blocks neither free nor held. kvpool puts them back, in their old order."""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    allocation.set_policy(policy)
    try:
        pool = BlockPool(32, enable_caching=True, hash_block_size=16, metrics_collector=_RaisingCollector())
    finally:
        allocation.set_policy("vllm")
    pool.metrics_collector.allocated = -10**6  # (the set-up's allocations never raise)
    blocks = pool.get_new_blocks(31)
    for i, block in enumerate(blocks[:20]):
        block._block_hash = make_block_hash_with_group_id(BlockHash(b"m%d" % i), 0)
        pool.cached_block_hash_to_block.insert(block.block_hash, block)
    pool.free_blocks(blocks[::2] + blocks[1::2][::-1])
    pool.metrics_collector.allocated = 0
    queue = pool.free_block_queue
    before = queue.free_block_ids()
    with pytest.raises(RuntimeError, match="collector"):
        pool.get_new_blocks(6)
    assert queue.free_block_ids() == before
    assert all(pool.blocks[i].ref_cnt == 0 for i in range(1, 32))
    queue.check_invariants()
    assert queue.policy.undo_pop(queue.policy.pop_seq) == 0  # the record is used once


@pytest.mark.parametrize("num_groups", [1, 2])
def test_the_contiguous_policy_finds_each_allocation_s_table_in_vllm_s_frames(monkeypatch, num_groups):
    # table_of_caller, through vLLM's Scheduler (prefill and decode, 1-2 groups): every
    # allocation of a group's table reaches extend_table with that group's manager and
    # the request, after the request's prompt + max_tokens was told; an allocation
    # outside a manager's method (a direct call) extends no table.
    from kvpool.allocation.contiguous import ContiguousPolicy

    seen, vanilla_extend = [], ContiguousPolicy.extend_table

    def extend_table(self, pool, num_blocks, manager, request_id):
        seen.append((manager, request_id, self.expected_tokens.get(request_id)))
        return vanilla_extend(self, pool, num_blocks, manager, request_id)

    monkeypatch.setattr(ContiguousPolicy, "extend_table", extend_table)
    kvpool.install(allocation="contiguous")
    try:
        scheduler = make_scheduler(num_blocks=200, num_groups=num_groups, window_blocks=64)
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        for r in range(3):
            scheduler.add_request(make_request(f"r{r}", list(range(100 * r, 100 * r + 40 + 9 * r)), max_tokens=30))
        for _ in range(40):
            so = scheduler.schedule()
            scheduler.update_from_output(so, runner_output(so))
        pool = scheduler.kv_cache_manager.block_pool
        found = len(seen)
        assert pool.get_new_blocks(2) and len(seen) == found  # no manager frame: no table
    finally:
        kvpool.uninstall()
    assert {(id(m), r) for m, r, _ in seen} == {(id(m), f"r{r}") for m in managers for r in range(3)}
    assert {r: n for _, r, n in seen} == {f"r{r}": 40 + 9 * r + 30 for r in range(3)}


def test_table_of_caller_reads_only_a_manager_s_allocating_frame():
    # A later subclass's own allocate_new_blocks is found (by name, on any subclass);
    # a function of that name that is not a manager's, or a request id that is not a
    # str, is not a table; frames deeper than MAX_DEPTH are not searched.
    import sys

    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from kvpool.allocation.base import MAX_DEPTH, table_of_caller

    class Later(FullAttentionManager):
        def allocate_new_blocks(self, request_id, *args):
            return table_of_caller(sys._getframe(0))

    def allocate_new_blocks(self, request_id):
        return table_of_caller(sys._getframe(0))

    def nested(depth):
        return nested(depth - 1) if depth else table_of_caller(sys._getframe(0))

    later = Later.__new__(Later)
    assert Later.allocate_new_blocks(later, "r") == (later, "r", None)
    assert Later.allocate_new_blocks(later, 7) is None
    assert allocate_new_blocks(object(), "r") is None

    def outer(self, request_id, depth):
        return nested(depth)

    outer.__code__ = outer.__code__.replace(co_name="allocate_new_blocks")
    assert outer(later, "r", MAX_DEPTH - 2) == (later, "r", None)
    assert outer(later, "r", MAX_DEPTH) is None
