"""Fenced deferred frees: native queue, per-group eviction order, scheduler level."""

from __future__ import annotations

from collections import deque

import pytest

import kvpool
from kvpool import FencedDeferredFreeQueue
from kvpool.block_pool import BlockPool
from vllm_helpers import eviction_order, make_request, make_scheduler


def _two_group_eviction_order(deferred: bool) -> tuple[list[int], list[list[int]]]:
    """Free one request of a full-attention + sliding-window scheduler, immediately
    or through the deferred path; return the pool's eviction order and the groups'
    block ids in allocation order."""
    scheduler = make_scheduler(num_blocks=64, hybrid=True)
    scheduler.defer_block_free = True
    request = make_request("r", list(range(64)))  # 4 full blocks per group
    scheduler.add_request(request)
    scheduler.schedule()
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    groups = [[b.block_id for b in m.req_to_blocks["r"] if not b.is_null] for m in managers]
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    assert request.last_sched_seq == scheduler.sched_step_seq == 1
    if deferred:
        scheduler._free_request_blocks(request)  # step 1 still in flight
        assert len(scheduler.deferred_frees) == 1
        scheduler.processed_step_seq = 1
        scheduler._drain_deferred_frees()
        assert not scheduler.deferred_frees
    else:
        scheduler.processed_step_seq = 1
        scheduler._free_request_blocks(request)
    return eviction_order(scheduler.kv_cache_manager.block_pool), groups


def test_deferred_free_leaves_the_immediate_eviction_order_for_two_kv_cache_groups(installed):
    immediate, groups = _two_group_eviction_order(deferred=False)
    deferred, groups_again = _two_group_eviction_order(deferred=True)
    assert groups == groups_again
    assert deferred == immediate
    # Hashed (prompt) blocks go to the LRU tail, each group reversed, group by group.
    a, b = groups
    assert immediate[-8:] == a[::-1] + b[::-1]


def test_vanilla_vllm_0_33_deferred_free_reverses_group_order():
    """Documents the bug kvpool fixes: vLLM 0.33.0 flattens the groups and reverses
    once, so group B is evicted before group A on the deferred path."""
    assert not kvpool.is_installed()
    immediate, (a, b) = _two_group_eviction_order(deferred=False)
    deferred, _ = _two_group_eviction_order(deferred=True)
    assert immediate[-8:] == a[::-1] + b[::-1]
    assert deferred[-8:] == b[::-1] + a[::-1]
    assert deferred != immediate


def test_pop_blocks_for_free_returns_each_group_reversed(installed):
    scheduler = make_scheduler(num_blocks=64, hybrid=True)
    request = make_request("r", list(range(64)))
    scheduler.add_request(request)
    scheduler.schedule()
    coordinator = scheduler.kv_cache_manager.coordinator
    allocated = [[b for b in m.req_to_blocks["r"] if not b.is_null] for m in coordinator.single_type_managers]
    expected = [blk for group in allocated for blk in reversed(group)]
    assert coordinator.pop_blocks_for_free("r") == expected


def test_cow_retained_blocks_deferred_free_like_immediate_without_double_reversal(installed):
    orders = []
    for deferred in (False, True):
        scheduler = make_scheduler(num_blocks=32)
        scheduler.defer_block_free = True
        pool = scheduler.kv_cache_manager.block_pool
        blocks = pool.get_new_blocks(5)
        scheduler.processed_step_seq = 0 if deferred else 1
        scheduler._free_cow_retained_blocks(list(blocks), fence_seq=1)
        if deferred:
            # Stored as given (eviction order); the deque view keeps vLLM 0.33's
            # convention (reversed) for code that inspects it.
            assert scheduler.deferred_frees.entries() == [(1, blocks)]
            assert scheduler.deferred_frees == deque([(1, blocks[::-1])])
            scheduler.processed_step_seq = 1
            scheduler._drain_deferred_frees()
        orders.append(eviction_order(pool))
    assert orders[0] == orders[1]


def test_scheduler_deferred_frees_is_native_and_readable(installed):
    scheduler = make_scheduler(num_blocks=32)
    assert type(scheduler.deferred_frees) is FencedDeferredFreeQueue
    assert len(scheduler.deferred_frees) == 0 and not scheduler.deferred_frees


def test_a_plain_deque_keeps_vllm_0_33_semantics(installed):
    """Code that swaps in its own deque (vLLM's own tests do) gets 0.33.0's
    convention for it, and the same eviction order reaches the pool."""
    scheduler = make_scheduler(num_blocks=32)
    scheduler.defer_block_free = True
    scheduler.deferred_frees = deque()
    pool = scheduler.kv_cache_manager.block_pool
    blocks = pool.get_new_blocks(3)
    scheduler._free_cow_retained_blocks(list(blocks), fence_seq=2)
    assert scheduler.deferred_frees == deque([(2, blocks[::-1])])
    scheduler.processed_step_seq = 2
    scheduler._drain_deferred_frees()
    assert eviction_order(pool)[:3] == [b.block_id for b in blocks]


def test_fenced_queue_drains_in_fifo_order_and_stops_at_first_unmet_fence():
    p1 = BlockPool(16, False, 16)
    p2 = BlockPool(16, False, 16)
    a, b, c = p1.get_new_blocks(2), p2.get_new_blocks(2), p1.get_new_blocks(1)
    q = FencedDeferredFreeQueue()
    q.push(1, a + b)  # one entry may span pools
    q.push(3, c)
    q.push(2, b[:1])  # behind an unmet fence: waits even though 2 <= 2
    assert q.ready_entries(2) == 1 and q.num_blocks == 6
    assert q.drain(2) == [a + b]
    assert len(q) == 2 and q[0][0] == 3
    assert q.drain(3) == [c, b[:1]]
    assert not q and q.num_blocks == 0


def test_fenced_queue_deque_view_round_trips():
    pool = BlockPool(8, False, 16)
    blocks = pool.get_new_blocks(3)
    q = FencedDeferredFreeQueue([(4, blocks)])
    assert q == deque([(4, blocks)]) and q[-1] == (4, blocks)
    assert q.entries() == [(4, blocks[::-1])]
    assert q.popleft() == (4, blocks)
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(IndexError):
        q[0]
    loose = [object(), object()]  # anything not natively owned is kept as is
    q.push(1, loose)
    assert q.drain(1) == [loose]
