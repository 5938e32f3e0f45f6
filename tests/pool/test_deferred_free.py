"""Fenced deferred frees: native queue, per-group eviction order, scheduler level."""

from __future__ import annotations

from collections import deque

import pytest
from vllm.v1.request import RequestStatus

import kvpool
from kvpool import FencedDeferredFreeQueue
from kvpool.block_pool import BlockPool
from tests.support.scheduler import block_ids, eviction_order, make_request, make_scheduler

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer]


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


def _pop_results(request_id: str = "r") -> tuple[list[int], list[int], list[list[int]]]:
    """What vLLM's public pops return for a two-group request, and its groups in
    allocation order."""
    results = []
    for via_manager in (True, False):
        scheduler = make_scheduler(num_blocks=64, hybrid=True)
        request = make_request(request_id, list(range(64)))
        scheduler.add_request(request)
        scheduler.schedule()
        manager = scheduler.kv_cache_manager
        groups = [[b.block_id for b in m.req_to_blocks[request_id] if not b.is_null]
                  for m in manager.coordinator.single_type_managers]
        if via_manager:
            popped = manager.pop_blocks_for_free(request)
        else:
            popped = manager.coordinator.pop_blocks_for_free(request_id)
        results.append(block_ids(popped))
    return results[0], results[1], groups


def test_pop_blocks_for_free_keeps_vllm_return_contract():
    """KVCacheManager / KVCacheCoordinator.pop_blocks_for_free return what vLLM's
    return (allocation order, group by group), so a caller that follows vLLM's
    docstring and frees them reversed evicts the tail of the prefix chain first."""
    vanilla = _pop_results()
    kvpool.install()
    try:
        with_kvpool = _pop_results()
    finally:
        kvpool.uninstall()
    assert with_kvpool == vanilla
    by_manager, by_coordinator, (a, b) = with_kvpool
    assert by_manager == by_coordinator == a + b


class _RecordingPool(BlockPool):
    """kvpool's pool with a ``free_blocks`` override: the scheduler's drain must then
    make the calls through Python (``drain()``), and the test sees each call."""

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        self.calls.append(block_ids(blocks))
        super().free_blocks(blocks)


def _free_queue_after_a_finished_request(
    *, deferred: bool, num_groups: int, caching: bool, prompt_len: int, drain: str = "native"
) -> tuple[list[int], list[list[int]]]:
    """Schedule one request (a real Scheduler, ``num_groups`` KV cache groups, windows
    wide enough to keep every block), abort it through ``finish_requests``, either
    after its step's output arrived (immediate free) or while the step is in flight
    (deferred, then drained through ``_drain_deferred_frees``). Returns the whole free
    queue in eviction order and the pool's ``free_blocks`` calls (``drain='python'``:
    a pool whose ``free_blocks`` is overridden; ``'deque'``: ``deferred_frees``
    replaced by a plain deque; ``'native'``: kvpool's native drain)."""
    scheduler = make_scheduler(num_blocks=96, num_groups=num_groups, window_blocks=64,
                               enable_prefix_caching=caching)
    scheduler.defer_block_free = True
    pool = scheduler.kv_cache_manager.block_pool
    pool.calls = []
    if drain == "python":
        pool.__class__ = _RecordingPool
    elif drain == "deque":
        scheduler.deferred_frees = deque()
    request = make_request("r", list(range(prompt_len)))
    scheduler.add_request(request)
    scheduler.schedule()
    assert request.last_sched_seq == scheduler.sched_step_seq == 1
    if not deferred:
        scheduler.processed_step_seq = scheduler.sched_step_seq  # the step's output arrived
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert (len(scheduler.deferred_frees) > 0) == deferred
    scheduler.processed_step_seq = scheduler.sched_step_seq
    scheduler._drain_deferred_frees()
    assert not scheduler.deferred_frees
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return eviction_order(pool), pool.calls


@pytest.mark.parametrize("drain", ["native", "python", "deque"])
@pytest.mark.parametrize("prompt_len", [3 * 16 + 5, 4 * 16, 5], ids=["hashed+partial", "hashed", "partial"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching-on", "caching-off"])
@pytest.mark.parametrize("num_groups", [1, 2, 3])
def test_deferred_free_leaves_the_whole_free_queue_of_an_immediate_free(
    installed, num_groups, caching, prompt_len, drain
):
    """The whole free-queue order (unhashed blocks prepended per group, hashed blocks
    appended per group) after a deferred free equals the immediate path's, and the pool
    sees the same ``free_blocks`` calls: one per KV cache group."""
    kwargs = dict(num_groups=num_groups, caching=caching, prompt_len=prompt_len, drain=drain)
    immediate, immediate_calls = _free_queue_after_a_finished_request(deferred=False, **kwargs)
    deferred, deferred_calls = _free_queue_after_a_finished_request(deferred=True, **kwargs)
    assert deferred == immediate
    if drain == "python":
        assert len(immediate_calls) == num_groups
        assert deferred_calls == immediate_calls


@pytest.mark.parametrize(
    "caching, prompt_len, expected_front",
    [
        (False, 3 * 16 + 5, [8, 7, 6]),  # vLLM: immediate and deferred alike
        (True, 3 * 16 + 5, [8, 4, 9]),
        (True, 5 * 16 + 3, [12, 6, 13]),
    ],
)
def test_deferred_free_without_hashes_in_two_groups_reuses_blocks_as_vllm_immediate_free(
    installed, caching, prompt_len, expected_front
):
    """The reported cases (full attention + sliding window, block size 16): the next
    allocation after a deferred free gets the blocks vLLM 0.33.0's immediate free
    leaves at the front (kvpool used to give [4, 3, 2] and [4, 8, 9])."""
    order, _ = _free_queue_after_a_finished_request(
        deferred=True, num_groups=2, caching=caching, prompt_len=prompt_len)
    assert order[:3] == expected_front
    kvpool.uninstall()
    vanilla_immediate, _ = _free_queue_after_a_finished_request(
        deferred=False, num_groups=2, caching=caching, prompt_len=prompt_len)
    assert order == vanilla_immediate


def test_push_groups_is_one_deque_entry_freed_by_one_call_per_group():
    pool = _RecordingPool(32, False, 16)
    pool.calls = []
    a, b, c = pool.get_new_blocks(3), pool.get_new_blocks(2), pool.get_new_blocks(1)
    q = FencedDeferredFreeQueue()
    q.push_groups(4, [a[::-1], [], b[::-1]])
    q.push(5, c)
    assert len(q) == 2 and q.ready_entries(4) == 1 and q.num_blocks == 6
    # vLLM 0.33.0's deque convention: one item per entry, reverse of eviction order.
    assert q[0] == (4, b + a) and q[1] == (5, c)
    assert q.entries() == [(4, a[::-1] + b[::-1]), (5, c)]
    assert q.drain(4) == [a[::-1], b[::-1]]  # one list per free_blocks call
    q.push_groups(6, [a[::-1], b[::-1]])
    q.push_groups(6, [])  # nothing queued
    assert len(q) == 2 and q.popleft() == (5, c) and q.popleft() == (6, b + a)
    q.push_groups(7, [a[::-1], b[::-1]])
    assert q.free_ready(7, pool) == 2
    assert pool.calls == [] and not q  # freed natively, not through the override
    with pytest.raises(TypeError):
        q.push_groups(1.5, [c])


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
