"""Adversarial input: clear exceptions, no crash, nothing lost (findings of a
break-it session, each kept as a regression test)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvpool import BlockIdOutOfRangeError, BlockStateError, FencedDeferredFreeQueue, FreeKVCacheBlockQueue, KVCacheBlock
from kvpool.block_pool import BlockPool


def free_ids(pool):
    return pool.free_block_queue.free_block_ids()


def test_evict_blocks_checks_the_value_it_uses():
    class LyingInt(int):
        def __ge__(self, other):
            return True

        def __lt__(self, other):
            return True

    pool = BlockPool(10, True, 16)
    with pytest.raises(BlockIdOutOfRangeError):
        pool.evict_blocks({LyingInt(10**8)})


def test_user_code_in_fields_cannot_reach_into_a_native_loop():
    pool = BlockPool(100, True, 16)
    blocks = pool.get_new_blocks(50)
    callers_list = list(blocks)

    class MutatingIndex:
        def __index__(self):
            callers_list.clear()
            return 1

    blocks[0].ref_cnt = MutatingIndex()
    with pytest.raises(TypeError, match="ref_cnt must be an int"):
        pool.free_blocks(callers_list)
    assert [b.ref_cnt for b in blocks[1:]] == [1] * 49  # rolled back
    blocks[0].ref_cnt = 1

    class Falsy:
        def __bool__(self):
            callers_list.append(10**30)
            return False

    blocks[1].is_null = Falsy()
    with pytest.raises(TypeError, match="is_null must be a bool"):
        pool.touch(list(blocks))
    blocks[1].is_null = False
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 99
    pool.free_block_queue.check_invariants()


@pytest.mark.parametrize("bad", [2**70, 0.0, "delete"])
def test_get_new_blocks_puts_popped_blocks_back_on_any_error(bad):
    pool = BlockPool(10, True, 16)
    before = free_ids(pool)
    if bad == "delete":
        del pool.blocks[3].ref_cnt
    else:
        pool.blocks[3].ref_cnt = bad
    with pytest.raises((TypeError, OverflowError, AttributeError)):
        pool.get_new_blocks(5)
    assert free_ids(pool) == before and pool.get_num_free_blocks() == 9
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 4, 5)] == [0, 0, 0, 0]


def test_free_blocks_rolls_back_on_an_unexpected_error_midway():
    pool = BlockPool(10, True, 16)
    blocks = pool.get_new_blocks(4)
    blocks[2].ref_cnt = 1.0
    with pytest.raises(TypeError):
        pool.free_blocks(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1.0, 1] and pool.get_num_free_blocks() == 5


def test_unpin_a_block_listed_once_per_reference():
    pool = BlockPool(10, True, 16)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.unpin_blocks([b, b], lambda blk: None)
    assert b.ref_cnt == 0 and pool.get_num_free_blocks() == 9


def test_a_live_queue_cannot_be_reinitialised():
    pool = BlockPool(10, True, 16)
    with pytest.raises(RuntimeError, match="already initialised"):
        pool.free_block_queue.__init__([])
    assert pool.get_num_free_blocks() == 9


def test_uninitialised_queue_is_empty_not_a_crash():
    q = FreeKVCacheBlockQueue.__new__(FreeKVCacheBlockQueue)
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()


def test_takeover_keeps_the_pools_block_table():
    pool = BlockPool(10, True, 16)
    block = pool.blocks[3]
    FreeKVCacheBlockQueue([block])
    assert pool.blocks[3] is block and pool.get_num_free_blocks() == 8
    pool.evict_blocks({3})


@pytest.mark.parametrize("count", [2.7, Decimal("2.9"), -0.5, "2"])
def test_non_integer_counts_are_refused_not_truncated(count):
    pool = BlockPool(10, True, 16)
    with pytest.raises(TypeError):
        pool.get_new_blocks(count)
    with pytest.raises(TypeError):
        pool.free_block_queue.popleft_n(count)
    assert pool.get_num_free_blocks() == 9


def test_float_fences_are_refused():
    pool = BlockPool(10, True, 16)
    q = FencedDeferredFreeQueue()
    with pytest.raises(TypeError):
        q.push(4.5, pool.get_new_blocks(2))
    with pytest.raises(TypeError):
        q.drain(4.0)


def test_a_failing_drain_loses_no_entry():
    pool = BlockPool(20, True, 16)
    a, b = pool.get_new_blocks(3), pool.get_new_blocks(3)
    q = FencedDeferredFreeQueue()
    q.push(1, a)
    q.push(2, b)
    FreeKVCacheBlockQueue([b[0]])  # another queue takes a queued block over
    with pytest.raises(BlockStateError):
        q.drain(5)
    assert len(q) == 2 and q.num_blocks == 6
    assert q.drain(1) == [a]


def test_a_refused_sentinel_link_assignment_changes_nothing():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(AttributeError):
        q.fake_free_list_head.next_free_block = blocks[3]
    assert q.popleft() is blocks[0]


def test_deleted_is_null_never_frees_the_null_block():
    pool = BlockPool(10, True, 16)
    del pool.null_block.is_null
    pool.null_block.ref_cnt = 1
    with pytest.raises(AttributeError):
        pool.free_blocks([pool.null_block])
    assert 0 not in free_ids(pool)


def test_reversed_iterator_over_a_shrunk_list_frees_nothing_like_cpython():
    pool = BlockPool(10, True, 16)
    blocks = pool.get_new_blocks(3)
    it = reversed(blocks)
    del blocks[1:]
    pool.free_blocks(it)  # CPython's iterator is exhausted in this state
    assert pool.get_num_free_blocks() == 6


def test_ref_cnt_does_not_overflow_silently():
    pool = BlockPool(10, True, 16)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 2**63 - 1
    with pytest.raises(OverflowError):
        pool.touch([b])
    assert b.ref_cnt == 2**63 - 1
