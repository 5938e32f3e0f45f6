"""kvpool's BlockPool against vLLM 0.33.0's, plus the reorder API and bad input."""

from __future__ import annotations

import logging
import random

import pytest
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvpool import BlockIdOutOfRangeError, BlockStateError, KVCacheBlock
from kvpool.block_pool import BlockPool

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]


def order(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def state(pool):
    return (
        order(pool),
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        sorted(pool.cached_block_hash_to_block._cache),
        [type(e).__name__ for e in pool.take_events()],
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_collector", [False, True])
def test_random_workload_matches_vllm_block_pool(seed, with_collector, small_int_path):
    """Same random alloc / cache / touch / free / evict sequence on vLLM's pool and
    kvpool's: identical free-queue order, ref counts, hashes and KV events."""
    rng = random.Random(seed)
    pools = [
        cls(64, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True,
            metrics_collector=KVCacheMetricsCollector() if with_collector else None)
        for cls in (VllmBlockPool, BlockPool)
    ]
    held: list[list[int]] = []  # block ids per live "request"
    for step in range(120):
        op = rng.choice(["alloc", "alloc", "free", "touch", "evict"])
        if op == "alloc":
            n = rng.randint(0, min(10, pools[0].get_num_free_blocks()))
            got = [p.get_new_blocks(n) for p in pools]
            assert [b.block_id for b in got[0]] == [b.block_id for b in got[1]]
            if n and rng.random() < 0.6:  # cache a prefix of them
                k = rng.randint(1, n)
                for p, blocks in zip(pools, got):
                    for i, blk in enumerate(blocks[:k]):
                        key = make_block_hash_with_group_id(f"s{step}b{i}".encode(), 0)
                        p._insert_block_hash(key, blk, num_tokens=16 * (i + 1))
            held.append([b.block_id for b in got[0]])
        elif op == "free" and held:
            ids = held.pop(rng.randrange(len(held)))
            for p in pools:
                p.free_blocks(reversed([p.blocks[i] for i in ids]))
        elif op == "touch":
            cached = [b.block_id for b in pools[0].blocks if b.block_hash is not None]
            if cached:
                ids = rng.sample(cached, rng.randint(1, min(4, len(cached))))
                for p in pools:
                    p.touch([p.blocks[i] for i in ids])
                held.append(ids)
        elif op == "evict":
            ids = set(rng.sample(range(64), 5))
            for p in pools:
                p.evict_blocks(ids)
        assert state(pools[0]) == state(pools[1]), f"diverged at step {step} ({op})"
    pools[1].free_block_queue.check_invariants()


def test_reset_free_block_queue_order_restores_canonical_order():
    pool = BlockPool(1000, enable_caching=True, hash_block_size=16)
    rng = random.Random(0)
    for _ in range(5):  # scramble the way requests do
        reqs = [pool.get_new_blocks(rng.randint(10, 80)) for _ in range(8)]
        rng.shuffle(reqs)
        for blocks in reqs:
            pool.free_blocks(reversed(blocks))
    assert order(pool) != list(range(1, 1000))
    assert pool.reset_free_block_queue_order() is True
    assert order(pool) == list(range(1, 1000))
    assert [b.block_id for b in pool.get_new_blocks(7)] == [1, 2, 3, 4, 5, 6, 7]


def test_reset_free_block_queue_order_refuses_while_blocks_in_use(caplog):
    pool = BlockPool(100, enable_caching=True, hash_block_size=16)
    held = pool.get_new_blocks(3)
    pool.free_blocks(reversed(pool.get_new_blocks(10)))
    before = order(pool)
    with caplog.at_level(logging.WARNING):
        assert pool.reset_free_block_queue_order() is False
    assert "not freed yet" in caplog.text
    assert order(pool) == before
    pool.free_blocks(held)
    assert pool.reset_free_block_queue_order() is True


def test_reset_prefix_cache_option_b_and_env_switch(monkeypatch):
    pool = BlockPool(50, enable_caching=True, hash_block_size=16)
    pool.free_blocks(pool.get_new_blocks(10))  # scrambled: 1..10 freed in order
    scrambled = order(pool)
    assert pool.reset_prefix_cache() is True
    assert order(pool) == scrambled  # plain reset keeps the order, as in vLLM
    assert pool.reset_prefix_cache(reorder_free_queue=True) is True
    assert order(pool) == list(range(1, 50))
    pool.free_blocks(pool.get_new_blocks(10))
    monkeypatch.setenv("KVPOOL_REORDER_ON_RESET", "1")
    assert pool.reset_prefix_cache() is True
    assert order(pool) == list(range(1, 50))


def test_double_free_raises_and_loses_nothing():
    pool = BlockPool(20, enable_caching=False, hash_block_size=16)
    a = pool.get_new_blocks(3)
    pool.free_blocks([a[0]])
    before = state(pool)
    with pytest.raises(BlockStateError, match="double free"):
        pool.free_blocks([a[1], a[0]])
    assert state(pool) == before  # a[1]'s decrement was rolled back
    assert a[1].ref_cnt == 1


def test_same_block_twice_in_one_free_with_one_reference_is_a_double_free():
    pool = BlockPool(20, enable_caching=False, hash_block_size=16)
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(BlockStateError):
        pool.free_blocks([b, b])
    assert b.ref_cnt == 1 and b not in pool.free_block_queue


def test_foreign_block_is_refused():
    pool = BlockPool(20, enable_caching=False, hash_block_size=16)
    stray = KVCacheBlock(3, ref_cnt=1)  # not owned by any pool
    with pytest.raises(BlockStateError, match="does not belong"):
        pool.free_blocks([stray])
    vllm_block = VllmBlockPool(5, False, 16).get_new_blocks(1)[0]
    with pytest.raises(TypeError):
        pool.free_blocks([vllm_block])
    assert pool.get_num_free_blocks() == 19


def test_blocks_of_another_pool_are_forwarded_to_it():
    p1 = BlockPool(10, enable_caching=False, hash_block_size=16)
    p2 = BlockPool(10, enable_caching=False, hash_block_size=16)
    a, b = p1.get_new_blocks(2), p2.get_new_blocks(2)
    p1.free_blocks(a + b)
    assert p1.get_num_free_blocks() == 9 and p2.get_num_free_blocks() == 9


def test_out_of_range_block_ids_are_refused():
    pool = BlockPool(10, enable_caching=True, hash_block_size=16)
    for bad in ({10}, {-1}, {3, 99}):
        with pytest.raises(BlockIdOutOfRangeError):
            pool.evict_blocks(bad)
    with pytest.raises(IndexError):
        pool.evict_blocks({2**40})


def test_removing_a_block_that_is_not_free_is_refused():
    pool = BlockPool(10, enable_caching=True, hash_block_size=16)
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(BlockStateError):
        pool.free_block_queue.remove(b)
    b.ref_cnt = 0  # corrupt from outside: touch must not unlink a block that is not free
    with pytest.raises(BlockStateError):
        pool.touch([b])
    assert pool.get_num_free_blocks() == 8


def test_allocating_more_than_free_raises_valueerror():
    pool = BlockPool(10, enable_caching=True, hash_block_size=16)
    with pytest.raises(ValueError, match="Cannot get 10 free blocks"):
        pool.get_new_blocks(10)
    assert pool.get_num_free_blocks() == 9


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_invalid_pool_size_is_refused(bad):
    with pytest.raises(ValueError):
        BlockPool(bad, enable_caching=True, hash_block_size=16)


def test_unpin_blocks_matches_vllm():
    pools = [cls(10, True, 16) for cls in (VllmBlockPool, BlockPool)]
    seen = {0: [], 1: []}
    for i, p in enumerate(pools):
        blocks = p.get_new_blocks(4)
        p.touch(blocks[:2])
        p.unpin_blocks(blocks, seen[i].append)
        p.get_new_blocks(p.get_num_free_blocks())
    assert order(pools[0]) == order(pools[1])
    assert [b.block_id for b in seen[0]] == [b.block_id for b in seen[1]]
    with pytest.raises(BlockStateError):
        pools[1].unpin_blocks([pools[1].null_block], print)


def test_num_free_blocks_can_be_overwritten_like_vllms_counter():
    """vLLM's tests set ``free_block_queue.num_free_blocks = 0`` to fake a full cache;
    the counter then moves with every operation, as vLLM's plain int does."""
    pools = [cls(20, True, 16) for cls in (VllmBlockPool, BlockPool)]
    for p in pools:
        held = p.get_new_blocks(4)
        p.free_block_queue.num_free_blocks = 0
        assert p.get_num_free_blocks() == 0
        with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
            p.get_new_blocks(1)
        p.free_blocks(held[:2])
        assert p.get_num_free_blocks() == 2
        assert len(p.get_new_blocks(2)) == 2
    assert [p.get_num_free_blocks() for p in pools] == [0, 0]
    assert pools[1].free_block_queue.free_block_ids() == list(range(5, 20))


def test_placeholder_blocks_no_pool_owns_are_decremented_like_vllm():
    pools = [cls(10, False, 16) for cls in (VllmBlockPool, BlockPool)]
    for p, block_cls in zip(pools, (type(pools[0].blocks[0]), KVCacheBlock)):
        placeholder = block_cls(1000)  # ref_cnt 0, owned by no pool
        p.free_blocks([placeholder])
        assert placeholder.ref_cnt == -1
        assert p.get_num_free_blocks() == 9
