"""vLLM 0.33.0's Python block pool vs kvpool at 85,000 blocks, same process.

Run: ``.venv/bin/python -m pytest benchmarks/ --benchmark-only`` (the summary prints
ratios). kvpool is *not* installed here: vLLM's classes and kvpool's are used side
by side directly.
"""

from __future__ import annotations

import gc
from collections import deque
from types import SimpleNamespace

import pytest
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue as VllmFreeQueue, make_block_hash_with_group_id
from vllm.v1.core.sched.scheduler import Scheduler

from kvpool import FencedDeferredFreeQueue, allocation
from kvpool.block_pool import BlockPool as KvpoolBlockPool
from kvpool.patches import deferred_free as kv_deferred

NUM_BLOCKS = 85_000
REQUEST_BLOCKS = 2_100
IMPLS = {"vllm": VllmBlockPool, "kvpool": KvpoolBlockPool}

pytestmark = pytest.mark.parametrize("impl", ["vllm", "kvpool"])


def _pool(impl, **kw):
    return IMPLS[impl](NUM_BLOCKS, enable_caching=True, hash_block_size=16, **kw)


def _collect():
    gc.collect()


def _tag(benchmark, group, impl, blocks):
    benchmark.group = group
    benchmark.extra_info.update(impl=impl, blocks=blocks)


def test_pool_creation(benchmark, impl):
    # gc.collect() before each round: the previous round's pool (a reference cycle)
    # is reclaimed outside the timed region, so each round times creation alone,
    # including the collections its own allocations trigger.
    _tag(benchmark, "pool_creation", impl, NUM_BLOCKS)
    benchmark.pedantic(lambda: _pool(impl), setup=_collect, rounds=9, iterations=1, warmup_rounds=1)


def test_first_use_of_every_block(benchmark, impl):
    """Creation plus allocating and freeing the whole pool once: kvpool creates
    block objects on first use, so this is where its deferred creation cost shows."""

    def create_and_use():
        pool = _pool(impl)
        pool.free_blocks(reversed(pool.get_new_blocks(NUM_BLOCKS - 1)))

    _tag(benchmark, "first_use_whole_pool", impl, NUM_BLOCKS)
    benchmark.pedantic(create_and_use, setup=_collect, rounds=7, iterations=1, warmup_rounds=1)


def _vllm_reorder(pool):
    # The RFC's Option A body (vLLM #40244) on vLLM's classes.
    for block in pool.blocks:
        block.prev_free_block = None
        block.next_free_block = None
    pool.free_block_queue = VllmFreeQueue(pool.blocks)
    pool.free_block_queue.popleft()
    return True


def test_reorder(benchmark, impl):
    pool = _pool(impl)
    pool.free_blocks(reversed(pool.get_new_blocks(REQUEST_BLOCKS)))  # not canonical
    fn = _vllm_reorder if impl == "vllm" else type(pool).reset_free_block_queue_order
    _tag(benchmark, "reorder", impl, NUM_BLOCKS)
    assert benchmark(fn, pool) is True
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]


@pytest.mark.parametrize("num", [REQUEST_BLOCKS, NUM_BLOCKS - 1], ids=["2100", "whole_pool"])
def test_alloc_free(benchmark, impl, num):
    pool = _pool(impl)

    def alloc_free():
        pool.free_blocks(reversed(pool.get_new_blocks(num)))

    # One call before timing: kvpool creates block objects on first use (timed apart
    # in first_use_whole_pool); with that call inside pytest-benchmark's calibration,
    # its estimate of one call's time is the first use's and kvpool's side ran 5 rounds.
    alloc_free()
    _tag(benchmark, "alloc_free_2100" if num == REQUEST_BLOCKS else "alloc_free_whole_pool", impl, num)
    benchmark(alloc_free)
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_alloc_free_contiguous_policy(benchmark, impl):
    """A request's whole life under ``allocation="contiguous"``: 2,100 blocks for a new
    block table (named to the pool as vLLM's managers do once kvpool is installed, so
    the pool places an extent), then freed. vLLM's side: its own order, as always."""
    if impl == "vllm":
        pool = _pool(impl)

        def alloc_free():
            pool.free_blocks(reversed(pool.get_new_blocks(REQUEST_BLOCKS)))
    else:
        allocation.set_policy("contiguous")
        try:
            pool = _pool(impl)
        finally:
            allocation.set_policy("vllm")
        manager = SimpleNamespace(req_to_blocks={}, block_size=16)

        def alloc_free():
            manager.req_to_blocks["r"] = []
            pool._table_context = (manager, "r")
            blocks = pool.get_new_blocks(REQUEST_BLOCKS)
            pool._table_context = None
            pool._end_table(manager, "r")
            pool.free_blocks(reversed(blocks))

    _tag(benchmark, "alloc_free_2100_contiguous", impl, REQUEST_BLOCKS)
    benchmark(alloc_free)
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_touch_free_hashed(benchmark, impl):
    pool = _pool(impl)
    blocks = pool.get_new_blocks(REQUEST_BLOCKS)
    for i, block in enumerate(blocks):
        pool._insert_block_hash(make_block_hash_with_group_id(f"b{i}".encode(), 0), block, 16 * (i + 1))
    pool.free_blocks(reversed(blocks))  # cached eviction candidates at the LRU tail

    def touch_free():
        pool.touch(blocks)
        pool.free_blocks(reversed(blocks))

    _tag(benchmark, "touch_free_2100_hashed", impl, REQUEST_BLOCKS)
    benchmark(touch_free)
    assert all(b.block_hash is not None and b.ref_cnt == 0 for b in blocks)


def test_deferred_drain(benchmark, impl):
    """Drain one deferred entry of 2,100 blocks whose fence is met: vLLM's
    ``Scheduler._drain_deferred_frees`` over its deque vs kvpool's over the native
    queue (the same function bodies the scheduler runs, on a stand-in scheduler)."""
    pool = _pool(impl)
    sched = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool), processed_step_seq=1)
    if impl == "vllm":
        sched.deferred_frees = deque()
        drain = Scheduler._drain_deferred_frees

        def setup():
            sched.deferred_frees.append((1, pool.get_new_blocks(REQUEST_BLOCKS)))
    else:
        sched.deferred_frees = FencedDeferredFreeQueue()
        drain = kv_deferred._drain_deferred_frees

        def setup():
            sched.deferred_frees.push(1, reversed(pool.get_new_blocks(REQUEST_BLOCKS)))

    _tag(benchmark, "deferred_drain_2100", impl, REQUEST_BLOCKS)
    benchmark.pedantic(drain, args=(sched,), setup=setup, rounds=300, warmup_rounds=10)
    assert not sched.deferred_frees and pool.get_num_free_blocks() == NUM_BLOCKS - 1
