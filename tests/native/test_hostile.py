"""Re-entrant Python code, reachable internals and subclasses from the field (issue 18).

Each test is a way the process once died or lost a block: user code run by a native
loop that changes what the loop reads, the queue's block table handed out by
``gc.get_referents``, and a ``BlockPool`` subclass that builds its own free structures
instead of running ``BlockPool.__init__`` (kvcached's elastic pool).
"""

from __future__ import annotations

import gc
import weakref

import pytest
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue as VllmFreeKVCacheBlockQueue,
    KVCacheBlock as VllmKVCacheBlock,
)

import kvpool
from kvpool._core import FencedDeferredFreeQueue, FreeKVCacheBlockQueue, KVCacheBlock, make_pool_blocks
from kvpool.block_pool import BlockPool, NotAKvpoolPoolError, VllmBlockPool
from tests.support.scheduler import make_request, make_scheduler, runner_output

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]


# -- user code inside a native loop ------------------------------------------------------
@pytest.mark.usefixtures("installed")
def test_evict_blocks_with_an_index_that_empties_a_plain_block_list_raises_like_vllm():
    pool = BlockPool(16, True, 16)
    pool.blocks = list(pool.blocks)  # a pool whose blocks are a plain list (vLLM's type)

    class EmptiesTheBlocks:
        def __index__(self):
            pool.blocks.clear()
            return 3

        def __hash__(self):
            return 3

    with pytest.raises(IndexError):  # once: SIGSEGV; vLLM raises IndexError too
        pool.evict_blocks({EmptiesTheBlocks()})


def test_the_block_table_is_not_reachable_through_the_collector():
    table, queue = make_pool_blocks(None, 32)
    blocks = queue.popleft_n(4)
    referents = gc.get_referents(queue)
    assert not any(type(r) is list for r in referents)  # once: the table itself
    # The collector still sees the blocks the queue holds ...
    assert all(any(r is b for r in referents) for b in blocks)
    # ... and emptying what it hands out cannot reach a native loop.
    for r in referents:
        if isinstance(r, list):
            r.clear()
    assert [b.block_id for b in queue.popleft_n(3)] == [4, 5, 6]
    queue.check_invariants()


@pytest.mark.usefixtures("installed")
def test_a_pool_in_a_reference_cycle_is_still_collected():
    # pool -> queue -> blocks -> pool: the queue's traverse must visit the blocks
    # (its table list is untracked), or the cycle would never be freed.
    pool = BlockPool(64, True, 16)
    pool.free_blocks(list(reversed(pool.get_new_blocks(5))))
    ref = weakref.ref(pool.free_block_queue)
    del pool
    gc.collect()
    assert ref() is None


# -- a BlockPool subclass that does not run BlockPool.__init__ ----------------------------
class ElasticPool(BlockPool):
    """kvcached's pattern (its issue #217): a pool subclass that builds its own free
    structures instead of calling ``BlockPool.__init__``; here vLLM's own
    constructor body, over whatever classes vLLM's module names."""

    def __init__(self, *args, **kwargs):
        VllmBlockPool.__init__(self, *args, **kwargs)


def _drive(scheduler, prompts, steps=4):
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=2))
    trace = []
    for _ in range(steps):
        out = scheduler.schedule()
        trace.append(sorted((r.req_id, tuple(map(tuple, r.block_ids))) for r in out.scheduled_new_reqs))
        scheduler.update_from_output(out, runner_output(out))
    return trace


def _scheduler_with(pool_class):
    # The coordinator builds its pool from this module name; it is swapped only while
    # the scheduler is built, so kvpool's install()/uninstall() never see the test's
    # class as vLLM's binding.
    saved = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = pool_class
    try:
        return make_scheduler(num_blocks=64, enable_prefix_caching=True)
    finally:
        kv_cache_coordinator.BlockPool = saved


PROMPTS = [list(range(1, 40)), list(range(1, 40)), list(range(100, 150))]


def test_a_subclass_that_skips_init_runs_like_it_does_on_vllm():
    # vLLM alone: the subclass over vLLM's classes.
    class VllmElastic(VllmBlockPool):
        def __init__(self, *args, **kwargs):
            VllmBlockPool.__init__(self, *args, **kwargs)

    vanilla = _scheduler_with(VllmElastic)
    want = _drive(vanilla, PROMPTS)
    want_free = vanilla.kv_cache_manager.block_pool.get_num_free_blocks()
    del vanilla   # (install() refuses while a pool of vLLM's blocks is alive)

    kvpool.install()
    try:
        scheduler = _scheduler_with(ElasticPool)
        pool = scheduler.kv_cache_manager.block_pool
        assert type(pool) is ElasticPool and not pool._kvpool_native
        assert _drive(scheduler, PROMPTS) == want
        # Every request finished: once 3 blocks leaked here (AttributeError
        # '_table_owners' after the blocks were popped) and a request stayed.
        assert pool.get_num_free_blocks() == want_free == 63
        assert not scheduler.requests
        # Running requests preempted and freed by a reset, as on vLLM.
        scheduler.add_request(make_request("late", list(range(200, 240)), max_tokens=8))
        scheduler.update_from_output(out := scheduler.schedule(), runner_output(out))
        assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
        assert pool.get_num_free_blocks() == 63
        # kvpool's additions say what is wrong, naming the subclass.
        for call in (pool.fragmentation_stats, pool.reset_free_block_queue_order,
                     lambda: pool.reset_prefix_cache(reorder_free_queue=True)):
            with pytest.raises(NotAKvpoolPoolError, match="ElasticPool did not run BlockPool.__init__"):
                call()
        assert issubclass(NotAKvpoolPoolError, TypeError) and issubclass(NotAKvpoolPoolError, kvpool.KvpoolError)
        # kvpool's /metrics hook treats it as vLLM's own pool: no samples, no error.
        from kvpool.patches.metrics import pool_snapshot
        assert pool_snapshot(scheduler, now=1e9) is None
    finally:
        kvpool.uninstall()


@pytest.mark.usefixtures("installed")
def test_a_pool_whose_queue_is_replaced_by_another_kind_runs_vllms_code():
    pool = BlockPool(16, True, 16)
    assert pool._kvpool_native
    # vLLM's own pure-Python structures in place of kvpool's (bound before install).
    pool.blocks = [VllmKVCacheBlock(i) for i in range(16)]
    pool.free_block_queue = VllmFreeKVCacheBlockQueue(pool.blocks)
    pool.null_block = pool.free_block_queue.popleft()
    pool.null_block.is_null = True
    assert not pool._kvpool_native
    blocks = pool.get_new_blocks(3)  # once: TypeError from the native loop
    assert [b.block_id for b in blocks] == [1, 2, 3] and all(type(b) is VllmKVCacheBlock for b in blocks)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 15
    with pytest.raises(NotAKvpoolPoolError, match="replaced free_block_queue"):
        pool.fragmentation_stats()
    # A kvpool queue again (the RFC's reorder body builds one): kvpool's code again.
    pool.blocks = [KVCacheBlock(i) for i in range(16)]
    pool.free_block_queue = kvpool.FreeKVCacheBlockQueue(pool.blocks)
    assert pool._kvpool_native


def test_the_kvpool_error_base_covers_every_kvpool_exception():
    from kvpool import BlockIdOutOfRangeError, BlockStateError, KvpoolError, UnsupportedVLLMVersionError

    for cls in (BlockStateError, BlockIdOutOfRangeError, UnsupportedVLLMVersionError, NotAKvpoolPoolError,
                kvpool.LazyOffloadOrderError):
        assert issubclass(cls, KvpoolError), cls
    # The built-in bases existing except clauses rely on are kept.
    assert issubclass(BlockStateError, ValueError) and issubclass(BlockStateError, RuntimeError)
    assert issubclass(BlockIdOutOfRangeError, IndexError)
    assert issubclass(UnsupportedVLLMVersionError, RuntimeError)
    assert issubclass(kvpool.LazyOffloadOrderError, ValueError)


# -- found by the second break-it pass ---------------------------------------------------
def test_the_deferred_queues_tables_are_not_reachable_through_the_collector():
    _, queue = make_pool_blocks(None, 16)
    held = queue.popleft_n(3)
    for b in held:
        b.ref_cnt = 1
    deferred = FencedDeferredFreeQueue()
    deferred.push(1, list(reversed(held)))
    referents = gc.get_referents(deferred)
    # Once: its owner list and index dict, whose edits made a drain read a bytes
    # object as a queue (SIGSEGV) or free another pool's held block.
    assert not any(type(r) in (list, dict) for r in referents)
    assert any(r is queue for r in referents)  # the owner queue is still visited
    assert [b.block_id for _, blocks in deferred for b in blocks] == [0, 1, 2]


def test_the_small_int_table_cannot_be_emptied():
    referrers = gc.get_referrers(5)
    # Once a list, found this way and cleared: the next block creation read past it.
    # (now a tuple of ints, which the collector does not even track)
    assert not any(type(r) is list and r == list(range(1024)) for r in referrers)


def test_a_block_ids_comparison_cannot_run_while_a_batch_is_collected():
    taken = []

    class Id(int):
        def __gt__(self, other):
            taken.append(FreeKVCacheBlockQueue([a]))  # would take a over mid-append
            return int(self) > int(other)

        __hash__ = int.__hash__

    a, b = KVCacheBlock(Id(1)), KVCacheBlock(Id(2))
    queue = FreeKVCacheBlockQueue([])
    queue.append_n([a, b])
    assert not taken  # once: a was linked in both queues and handed out twice
    assert queue.free_block_ids() == [1, 2]
    queue.check_invariants()


def test_a_queue_used_by_the_iterable_it_is_built_from_is_refused():
    queue = FreeKVCacheBlockQueue.__new__(FreeKVCacheBlockQueue)
    stale = KVCacheBlock(100)

    def blocks():
        queue.append(stale)  # registered in the table __init__ would replace
        yield KVCacheBlock(0)

    with pytest.raises(RuntimeError, match="was used while its blocks were read"):
        queue.__init__(blocks())
    assert stale in queue and queue.free_block_ids() == [100]  # once: stale, then lost
    queue.check_invariants()


def test_a_subclass_that_skips_init_frees_deferred_blocks_like_vllm():
    from vllm.v1.request import RequestStatus

    kvpool.install()
    try:
        scheduler = _scheduler_with(ElasticPool)
        pool = scheduler.kv_cache_manager.block_pool
        scheduler.defer_block_free = True  # async scheduling with a KV consumer
        scheduler.add_request(make_request("r", list(range(40))))
        scheduler.schedule()
        scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)  # a step in flight
        assert len(scheduler.deferred_frees) == 1
        scheduler.processed_step_seq = scheduler.sched_step_seq
        scheduler._drain_deferred_frees()  # once: AttributeError 'allocation'
        assert pool.get_num_free_blocks() == 63 and not scheduler.deferred_frees
    finally:
        kvpool.uninstall()


# -- a subclass that rebuilds free_block_queue while requests hold blocks -----------------
def _reordering(base):
    """The RFC's reorder body as a pool method (vLLM #40244, Option A, as users wrote
    it before kvpool): a new free queue over the free blocks sorted by id, built from
    whatever ``FreeKVCacheBlockQueue`` vLLM's module names (kvpool's once installed)."""
    from vllm.v1.core import kv_cache_utils

    class ReorderingPool(base):
        def reorder_free_queue(self):
            free = sorted((b for b in self.blocks if b.ref_cnt == 0 and not b.is_null),
                          key=lambda b: b.block_id)
            self.free_block_queue = kv_cache_utils.FreeKVCacheBlockQueue(free)

    return ReorderingPool


def _drive_with_reorder(scheduler, defer: bool):
    # Requests hold blocks when the queue is rebuilt, and finish afterwards; with
    # `defer`, they are aborted while their step is in flight (async scheduling with a
    # KV consumer), so their blocks wait in the deferred-free queue, and two of them
    # share their prompt's blocks (one deferred entry frees them after the other).
    from vllm.v1.request import RequestStatus

    pool = scheduler.kv_cache_manager.block_pool
    scheduler.defer_block_free = defer
    for i, prompt in enumerate([list(range(1, 40)), list(range(100, 170)), list(range(1, 40))]):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=20))
    trace, deferred = [], 0
    for step in range(30):
        if step == 2:
            pool.reorder_free_queue()
        out = scheduler.schedule()
        trace.append(sorted((r.req_id, tuple(map(tuple, r.block_ids))) for r in out.scheduled_new_reqs))
        for when, ids in ((4, ["r1"]), (7, ["r0", "r2"])):
            if step == when:
                scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)  # step in flight
                deferred = max(deferred, len(scheduler.deferred_frees))
        scheduler.update_from_output(out, runner_output(out))
        if defer:
            scheduler.processed_step_seq = scheduler.sched_step_seq
            scheduler._drain_deferred_frees()
    return trace, pool.get_num_free_blocks(), len(scheduler.requests), deferred >= (2 if defer else 0)


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_subclass_that_rebuilds_the_free_queue_while_blocks_are_held_runs_like_vllm(defer):
    # Once: "free_blocks(): block 3 does not belong to this pool" when the requests
    # that held blocks across the rebuild finished, and they stayed in the scheduler.
    want = _drive_with_reorder(_scheduler_with(_reordering(VllmBlockPool)), defer)
    assert want[1:] == (63, 0, True)
    kvpool.install()
    try:
        scheduler = _scheduler_with(_reordering(BlockPool))
        pool = scheduler.kv_cache_manager.block_pool
        got = _drive_with_reorder(scheduler, defer)
        assert pool._kvpool_native and type(pool.free_block_queue) is FreeKVCacheBlockQueue
        assert got == want
        pool.free_block_queue.check_invariants()
        assert sorted(pool.free_block_queue.free_block_ids()) == list(range(1, 64))
    finally:
        kvpool.uninstall()


def test_a_replaced_queues_blocks_are_adopted_when_freed_and_its_free_ones_refused():
    from kvpool._core import BlockStateError

    pool = BlockPool(16, True, 16)
    held = pool.get_new_blocks(3)  # blocks 1, 2, 3
    old_free_elsewhere = pool.blocks[12]
    pool.free_block_queue = FreeKVCacheBlockQueue([pool.blocks[i] for i in range(5, 10)])
    assert pool.get_num_free_blocks() == 5
    # Free in the replaced queue, never handed out: freeing it is a double free there.
    with pytest.raises(BlockStateError, match="taken over by a free queue the pool does not use, and is free there"):
        pool.free_blocks([old_free_elsewhere])
    assert pool.get_num_free_blocks() == 5 and old_free_elsewhere.ref_cnt == 0
    pool.free_blocks(list(reversed(held)))  # held across the replacement: adopted
    # Unhashed: one run to the front, in the order freed, as vLLM's free_blocks does.
    assert pool.free_block_queue.free_block_ids() == [3, 2, 1, 5, 6, 7, 8, 9]
    pool.free_block_queue.check_invariants()
    again = pool.get_new_blocks(8)
    assert [b.block_id for b in again] == [3, 2, 1, 5, 6, 7, 8, 9]
    pool.free_blocks(list(reversed(again)))
    assert pool.get_num_free_blocks() == 8


def test_blocks_pinned_across_a_queue_rebuild_are_unpinned_like_vllm():
    # vLLM's unpin_blocks decrements and appends to whatever queue the pool has now.
    pools = {}
    for name, cls in (("vllm", _reordering(VllmBlockPool)), ("kvpool", _reordering(BlockPool))):
        if name == "kvpool":
            kvpool.install()
        try:
            pool = cls(16, True, 16)
            held = pool.get_new_blocks(4)
            pool.reorder_free_queue()
            seen = []
            pool.unpin_blocks(held[:3], seen.append)
            pool.free_blocks(reversed(held[3:]))
            pools[name] = (pool.free_block_queue.free_block_ids() if name == "kvpool"
                           else [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                           sorted(pool._reuse_watchers), pool.get_num_free_blocks())
        finally:
            pool = held = None   # (install() refuses while a pool of vLLM's blocks is alive)
            if name == "kvpool":
                kvpool.uninstall()
    assert pools["kvpool"] == pools["vllm"]
    assert pools["kvpool"][2] == 15


def test_a_free_blocks_override_that_raises_in_the_deferred_drain_loses_what_vllm_loses():
    # The drain for a pool whose class overrides free_blocks goes one request at a
    # time, as vLLM pops one entry before freeing it: once, every ready entry was
    # removed first and a raise lost all of them (9 blocks where vLLM loses 3).
    from vllm.v1.request import RequestStatus

    def flaky(base):
        class Flaky(base):
            calls = 0

            def free_blocks(self, ordered_blocks):
                type(self).calls += 1
                if type(self).calls == 1:
                    raise RuntimeError("transient failure in a subclass hook")
                return base.free_blocks(self, ordered_blocks)

        return Flaky

    def run(base):
        scheduler = _scheduler_with(flaky(base))
        pool = scheduler.kv_cache_manager.block_pool
        scheduler.defer_block_free = True
        for i in range(3):
            scheduler.add_request(make_request(f"r{i}", list(range(i * 100, i * 100 + 40))))
        scheduler.schedule()
        scheduler.finish_requests(["r0", "r1", "r2"], RequestStatus.FINISHED_ABORTED)  # in flight
        scheduler.processed_step_seq = scheduler.sched_step_seq
        with pytest.raises(RuntimeError, match="transient"):
            scheduler._drain_deferred_frees()
        left = len(scheduler.deferred_frees)
        scheduler._drain_deferred_frees()
        return left, pool.get_num_free_blocks()

    want = run(VllmBlockPool)
    assert want == (2, 60)
    kvpool.install()
    try:
        assert run(BlockPool) == want
    finally:
        kvpool.uninstall()


def test_a_contiguous_pool_whose_queue_was_rebuilt_still_restores_the_canonical_order():
    # The rebuilt queue keeps vLLM's order and no segments: once, the reorder raised
    # "the free list does not track its segments".
    kvpool.install(allocation="contiguous")
    try:
        pool = _reordering(BlockPool)(16, True, 16)
        held = pool.get_new_blocks(5)
        pool.reorder_free_queue()
        pool.free_blocks(reversed(held))  # adopted, to the front: 1..5 reversed
        assert pool.free_block_queue.free_block_ids()[:5] == [5, 4, 3, 2, 1]
        assert pool.reset_free_block_queue_order() is True
        assert pool.free_block_queue.free_block_ids() == list(range(1, 16))
        assert pool.reset_prefix_cache(reorder_free_queue=True) is True
        pool.free_block_queue.check_invariants()
    finally:
        kvpool.uninstall()
