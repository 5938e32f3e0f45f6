"""The native hot loops' shortcuts: small-int ref counts read by address and their
reference counts batched, borrowed block pointers, and the native deferred drain
(``FencedDeferredFreeQueue.free_ready``). Each shortcut must be invisible: same
results as the slow path, balanced reference counts, no Python code inside a loop."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvpool import BlockStateError, FencedDeferredFreeQueue, FreeKVCacheBlockQueue
from kvpool.block_pool import BlockPool

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]

# Ints whose reference counts the loops batch (0..7), recognise by address (8..256)
# or treat as ordinary objects (300).
VALUES = (0, 1, 2, 3, 7, 8, 9, 255, 256, 300)


def refcounts() -> list[int]:
    return [sys.getrefcount(v) for v in VALUES]


def is_immortal(value: object) -> bool:
    """True if references to ``value`` are not counted (PEP 683: small ints are
    immortal from CPython 3.12 on; ``fastint.h`` then leaves their counts alone)."""
    before = sys.getrefcount(value)
    extra = [value] * 8  # eight counted references, unless the object is immortal
    return sys.getrefcount(value) == before and len(extra) == 8


#: Per value in VALUES: immortal on this interpreter (its reference count never moves).
IMMORTAL = tuple(is_immortal(v) for v in VALUES)


def test_the_ledger_sees_what_this_interpreter_counts():
    """The ledger checks each int by what is true here: 0..256 are immortal from
    CPython 3.12 on (their counts must not move), counted before; 300 is always counted."""
    small = [imm for v, imm in zip(VALUES, IMMORTAL) if v <= 256]
    assert small == [sys.version_info >= (3, 12)] * len(small)
    assert IMMORTAL[VALUES.index(300)] is False


def holders(blocks) -> list[int]:
    """Per value in VALUES, how many blocks hold that very int object as ref_cnt."""
    return [sum(1 for b in blocks if b.ref_cnt is v) for v in VALUES]


class RefcountLedger:
    """Checks that each int's reference count moved by exactly the number of blocks
    that started or stopped holding it (what plain Python assignments would do), and
    that an immortal int's count did not move at all."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.held = holders(blocks)  # before counting: this list holds ints too
        self.counts = refcounts()

    def check(self, where: str) -> None:
        counts = refcounts()  # before anything new holds an int
        held = holders(self.blocks)
        moved = [a - b for a, b in zip(counts, self.counts)]
        expected = [0 if immortal else a - b for a, b, immortal in zip(held, self.held, IMMORTAL)]
        assert moved == expected, f"after {where}: refcounts moved {moved}, blocks {expected}"

    def rebase(self) -> None:
        """Count from here (after something other than a block, such as a prefix-cache
        map of block ids, vLLM >= 0.34.0, started holding ints)."""
        self.held = holders(self.blocks)
        self.counts = refcounts()


@contextmanager
def no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def hashed(pool: BlockPool, blocks, tag: str) -> None:
    for i, block in enumerate(blocks):
        pool._insert_block_hash(make_block_hash_with_group_id(f"{tag}{i}".encode(), 0), block, 16 * (i + 1))


def test_small_int_reference_counts_stay_balanced(small_int_path):
    """Every path that changes ref_cnt (fast transitions, other small values, values
    beyond the cache, errors and their undo, the native drain) moves the ints'
    reference counts exactly as plain Python assignments would, checked after each
    step (a batched update lost in one direction and the other would cancel out over
    a whole round trip)."""
    pool = BlockPool(64, enable_caching=True, hash_block_size=16)
    other = BlockPool(16, enable_caching=False, hash_block_size=16)
    every_block = list(pool.blocks) + list(other.blocks)  # created up front
    with no_gc():
        ledger = RefcountLedger(every_block)
        blocks = pool.get_new_blocks(20)
        ledger.check("get_new_blocks")
        hashed(pool, blocks[:10], "h")
        ledger.rebase()  # (the map holds the ids where it stores ids)
        pool.touch(blocks[:5])  # 1 -> 2
        ledger.check("touch 1 -> 2")
        pool.touch(blocks[:2])  # (no loops here: a loop variable would hold an int)
        pool.touch(blocks[:2])
        pool.touch(blocks[:2])  # up to 5
        ledger.check("touch up to 5")
        blocks[5].ref_cnt = 7
        pool.touch([blocks[5], blocks[5]])  # 7 -> 9, out of the batched range
        ledger.check("touch 7 -> 9")
        blocks[6].ref_cnt = 256
        pool.touch([blocks[6]])  # 256 -> 257, beyond the address range
        blocks[7].ref_cnt = 300
        pool.free_blocks([blocks[7]])  # 300 -> 299
        ledger.check("values beyond the cache")
        with pytest.raises(BlockStateError):  # undo of a half-done free
            pool.free_blocks(blocks[8:12] + [pool.blocks[40]])
        ledger.check("undone free")
        with pytest.raises(BlockStateError):  # undo of a half-done touch
            pool.touch(blocks[8:12] + [other.blocks[3]])
        ledger.check("undone touch")
        blocks[5].ref_cnt = blocks[6].ref_cnt = blocks[7].ref_cnt = 1
        pool.free_blocks(blocks[:2])
        pool.free_blocks(blocks[:2])
        pool.free_blocks(blocks[:2])
        pool.free_blocks(blocks[:5])
        ledger.check("free_blocks down to 1")
        foreign = other.get_new_blocks(3)
        queue = FencedDeferredFreeQueue()
        queue.push(1, list(reversed(blocks)) + foreign)
        assert queue.free_ready(1, pool) == 1
        del queue  # (its owner table held the owner indexes 0 and 1)
        ledger.check("free_ready")
        pool.touch(blocks[:10])  # cache hits: 0 -> 1 with removal
        ledger.check("touch of cached free blocks")
        pool.free_blocks(reversed(blocks[:10]))
        ledger.check("free of hashed blocks")
        del blocks, foreign
    assert all(b.ref_cnt == 0 for b in every_block if not b.is_null)
    assert pool.get_num_free_blocks() == 63 and other.get_num_free_blocks() == 15
    pool.free_block_queue.check_invariants()


def test_an_int_subclass_ref_cnt_with_a_finalizer_runs_after_the_loop():
    """A replaced ref_cnt object whose deallocation runs Python code is released
    only after the loop is done with the caller's list."""
    pool = BlockPool(32, enable_caching=False, hash_block_size=16)
    blocks = pool.get_new_blocks(10)
    callers_list = list(blocks)
    seen = []

    class Finalizing(int):
        def __del__(self):
            seen.append(len(callers_list))
            callers_list.clear()

    blocks[0].ref_cnt = Finalizing(1)
    pool.free_blocks(callers_list)
    assert seen == [10] and callers_list == []
    assert all(b.ref_cnt == 0 for b in blocks)
    assert pool.free_block_queue.free_block_ids()[:10] == [b.block_id for b in blocks]

    blocks = pool.get_new_blocks(3)
    callers_list = list(blocks)
    blocks[1].ref_cnt = Finalizing(1)
    pool.touch(callers_list)
    assert [b.ref_cnt for b in blocks] == [2, 2, 2] and seen[-1] == 3
    pool.free_blocks(blocks)
    pool.free_blocks(blocks)
    pool.free_block_queue.check_invariants()

    # unpin_blocks: the finalizer runs only after the released blocks are linked, so
    # from there a released block is a normal free block (a prefix-cache hit can
    # take it again).
    blocks = pool.get_new_blocks(2)
    errors = []

    class TouchesAgain(int):
        def __del__(self):
            try:
                pool.touch([blocks[0]])
            except Exception as e:  # noqa: BLE001 - recorded and checked below
                errors.append(type(e).__name__)

    blocks[0].ref_cnt = TouchesAgain(1)
    pool.unpin_blocks(blocks, on_reuse=lambda block: None)
    assert errors == []
    assert [b.ref_cnt for b in blocks] == [1, 0]
    assert blocks[0] not in pool.free_block_queue and blocks[1] in pool.free_block_queue
    pool.free_block_queue.check_invariants()


def test_error_messages_run_no_user_code_before_the_undo():
    """A block_id that formats itself by mutating the caller's list cannot reach the
    loop or its undo: the message names it by type."""
    pool = BlockPool(32, enable_caching=False, hash_block_size=16)
    blocks = pool.get_new_blocks(6)
    callers_list = list(blocks)

    class LoudId:
        def __format__(self, spec):
            callers_list.clear()
            return "loud"

        __str__ = __repr__ = lambda self: self.__format__("")

    blocks[3].ref_cnt = 0  # a double free at position 3
    blocks[3].block_id = LoudId()
    with pytest.raises(BlockStateError, match="double free of block <LoudId object>"):
        pool.free_blocks(callers_list)
    assert len(callers_list) == 6
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 0, 1, 1]  # undone
    assert pool.get_num_free_blocks() == 31 - 6


def _two_pools():
    pool = BlockPool(64, enable_caching=True, hash_block_size=16)
    other = BlockPool(16, enable_caching=True, hash_block_size=16)
    return pool, other


def _fill(queue: FencedDeferredFreeQueue, pool: BlockPool, other: BlockPool) -> None:
    a = pool.get_new_blocks(6)
    hashed(pool, a[:3], "a")
    b = pool.get_new_blocks(4)
    c = other.get_new_blocks(3)
    hashed(other, c[:1], "c")
    shared = pool.get_new_blocks(2)
    pool.touch(shared)  # held twice
    queue.push(1, list(reversed(a)) + [pool.null_block] + c)
    queue.push(1, list(reversed(shared)))
    queue.push(2, list(reversed(b)) + list(reversed(shared)))
    queue.push(5, list(reversed(pool.get_new_blocks(2))))  # fence not met below


def test_free_ready_frees_like_drain_then_free_blocks(small_int_path):
    """The native drain leaves the free queues (order, front/tail placement, other
    pools' blocks forwarded) exactly as draining and calling free_blocks per entry."""
    native, native_other = _two_pools()
    q1 = FencedDeferredFreeQueue()
    _fill(q1, native, native_other)
    assert q1.free_ready(2, native) == 3
    slow, slow_other = _two_pools()
    q2 = FencedDeferredFreeQueue()
    _fill(q2, slow, slow_other)
    for blocks in q2.drain(2):
        slow.free_blocks(blocks)
    for a, b in ((native, slow), (native_other, slow_other)):
        assert a.free_block_queue.free_block_ids() == b.free_block_queue.free_block_ids()
        assert [x.ref_cnt for x in a.blocks] == [x.ref_cnt for x in b.blocks]
        a.free_block_queue.check_invariants()
    assert len(q1) == len(q2) == 1 and q1.num_blocks == 2


def test_free_ready_stops_at_a_bad_entry_and_keeps_it():
    pool = BlockPool(32, enable_caching=False, hash_block_size=16)
    first, second, third = pool.get_new_blocks(2), pool.get_new_blocks(3), pool.get_new_blocks(2)
    q = FencedDeferredFreeQueue()
    q.push(1, first)
    q.push(1, second)
    q.push(1, third)
    second[2].ref_cnt = 0  # a double free inside the second entry
    with pytest.raises(BlockStateError, match="double free"):
        q.free_ready(1, pool)
    assert len(q) == 2 and q.num_blocks == 5  # the first entry went through
    assert all(b.ref_cnt == 0 for b in first)
    assert [b.ref_cnt for b in second] == [1, 1, 0]  # nothing of the bad entry changed
    second[2].ref_cnt = 1
    FreeKVCacheBlockQueue([third[1]])  # another queue takes a queued block over
    with pytest.raises(BlockStateError, match="taken over"):
        q.free_ready(1, pool)
    assert len(q) == 1 and q.num_blocks == 2
    assert all(b.ref_cnt == 0 for b in second)
    assert third[0].ref_cnt == 1
    pool.free_block_queue.check_invariants()


def test_free_ready_refuses_a_pool_without_a_kvpool_queue():
    class NotAPool:
        free_block_queue = []
        enable_caching = True

    q = FencedDeferredFreeQueue()
    with pytest.raises(TypeError, match="kvpool free queue"):
        q.free_ready(1, NotAPool())


def test_the_scheduler_drain_uses_a_subclass_override_of_free_blocks(installed):
    """A pool subclass that overrides free_blocks sees every deferred free (the
    native drain is only taken for kvpool's own free_blocks)."""
    from kvpool.patches import deferred_free

    calls = []

    class Watching(BlockPool):
        def free_blocks(self, ordered_blocks):
            ordered_blocks = list(ordered_blocks)
            calls.append([b.block_id for b in ordered_blocks])
            super().free_blocks(ordered_blocks)

    for cls, expect_calls in ((BlockPool, 0), (Watching, 1)):
        pool = cls(16, enable_caching=False, hash_block_size=16)
        assert deferred_free._frees_natively(pool) is (cls is BlockPool)
        blocks = pool.get_new_blocks(3)

        class Sched:
            kv_cache_manager = type("KVM", (), {"block_pool": pool})()
            processed_step_seq = 1
            deferred_frees = FencedDeferredFreeQueue()

        Sched.deferred_frees.push(1, list(reversed(blocks)))
        calls.clear()
        deferred_free._drain_deferred_frees(Sched())
        assert len(calls) == expect_calls
        assert pool.free_block_queue.free_block_ids()[:3] == [b.block_id for b in reversed(blocks)]


def test_free_ready_drops_a_part_that_holds_no_block_and_goes_on():
    # Something that is not a block, queued by mistake, can never be freed: once, it
    # stopped every later deferred free for good. vLLM's loop pops an entry before
    # freeing it (losing that entry); kvpool drops that part and frees the rest.
    pool = BlockPool(16, enable_caching=False, hash_block_size=16)
    good = pool.get_new_blocks(3)
    q = FencedDeferredFreeQueue()
    q.push(1, [None])
    q.push(1, good)
    with pytest.raises(TypeError, match="got NoneType"):
        q.free_ready(1, pool)
    assert len(q) == 1 and q.num_blocks == 3
    assert q.free_ready(1, pool) == 1 and pool.get_num_free_blocks() == 15 and not q
