"""Random block-pool operations applied in lockstep to vLLM 0.33.0's ``BlockPool`` and
kvpool's (``tests/pool/test_long_differential.py``), or to kvpool's alone with its error and
rollback paths (``tests/native/test_leak_check.py``, which also runs under a debug interpreter).

One operation draws its arguments once from the workload's ``random.Random`` and applies
them to every side; with two sides, what each returns (block ids, free counts, reuse
callbacks, refusals) must agree after every operation, and every ``full_check_every``
operations the whole free-queue order, ref counts and hashes too.

Requests hold blocks of one or two KV cache groups of the same pool (as a hybrid model's
full-attention and sliding-window managers do). A request is freed immediately (one
``free_blocks(reversed(group))`` call per group, what ``KVCacheCoordinator.free`` does) or
deferred behind a fence: kvpool's side queues it in a ``FencedDeferredFreeQueue`` and
drains with ``free_ready``; vLLM's side keeps the entry and frees it group by group the
same way as the immediate path when the fence is met (vLLM 0.33.0's own deferred path
reverses the group order, ``/work/shared/notes/vllm-0.33-facts.md``; kvpool's must give
the immediate order).
"""

from __future__ import annotations

import random
from collections import deque

from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue as VllmFreeKVCacheBlockQueue,
    make_block_hash_with_group_id,
)

from kvpool import BlockIdOutOfRangeError, BlockStateError, FencedDeferredFreeQueue
from kvpool.block_pool import BlockPool

#: Operation -> relative weight. Allocation is weighted so that the pool runs near full
#: (evictions of cached blocks) without being full all the time.
OPERATIONS = {
    "alloc": 10,
    "free": 6,
    "free_deferred": 4,
    "step": 4,  # one scheduler step: processed_step_seq += 1, ready deferred frees drained
    "touch": 5,
    "evict": 2,
    "unpin": 2,
    "reset": 1,  # reset_prefix_cache (refused while blocks are held), sometimes reordered
    "reorder": 1,  # reset_free_block_queue_order (refused while blocks are held)
    "flush": 0.3,  # free everything, then reset + canonical reorder
}
#: kvpool-only error and rollback paths (the leak check); vLLM has asserts or nothing there.
ERROR_OPERATIONS = {
    "err_double_free": 1,
    "err_touch_foreign": 1,
    "err_alloc_too_many": 1,
    "err_evict_out_of_range": 1,
    "err_evict_hook_raises": 1,
    "err_free_ready_double_free": 1,
}


class VllmSide:
    """vLLM 0.33.0's pool; deferred frees kept here and freed per group when ready."""

    name = "vllm"

    def __init__(self, num_blocks: int):
        self.pool = VllmBlockPool(num_blocks, enable_caching=True, hash_block_size=16)
        self.deferred: deque[tuple[int, list[list]]] = deque()

    def push_deferred(self, fence_seq: int, groups: list[list]) -> None:
        groups = [g for g in groups if g]
        if groups:
            self.deferred.append((fence_seq, groups))

    def free_ready(self, processed_step_seq: int) -> int:
        """Returns the ``free_blocks`` calls made (kvpool's ``free_ready`` counts parts)."""
        calls = 0
        while self.deferred and self.deferred[0][0] <= processed_step_seq:
            for group in self.deferred.popleft()[1]:
                self.pool.free_blocks(group)
                calls += 1
        return calls

    def num_deferred(self) -> int:
        return len(self.deferred)

    def reorder(self) -> bool:
        """The RFC's Option A body on vLLM's classes: rebuild the free queue in
        block_id order (only when every block but the null block is free, as kvpool)."""
        pool = self.pool
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            return False
        pool.free_block_queue = VllmFreeKVCacheBlockQueue(pool.blocks[1:])
        return True

    def reset(self, reorder: bool) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok and reorder:
            assert self.reorder()
        return ok


class KvpoolSide:
    """kvpool's pool and its native fenced deferred-free queue."""

    name = "kvpool"

    def __init__(self, num_blocks: int):
        self.pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
        self.deferred = FencedDeferredFreeQueue()

    def push_deferred(self, fence_seq: int, groups: list[list]) -> None:
        self.deferred.push_groups(fence_seq, groups)

    def free_ready(self, processed_step_seq: int) -> int:
        return self.deferred.free_ready(processed_step_seq, self.pool)

    def num_deferred(self) -> int:
        return len(self.deferred)

    def reorder(self) -> bool:
        return self.pool.reset_free_block_queue_order()

    def reset(self, reorder: bool) -> bool:
        return self.pool.reset_prefix_cache(reorder_free_queue=reorder)


def free_order(pool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def full_state(pool) -> tuple:
    """Free-queue order, every block's ref count and hash, the prefix-cache keys."""
    return (
        free_order(pool),
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        sorted(pool.cached_block_hash_to_block._cache),
        sorted(pool._reuse_watchers),
    )


class PoolWorkload:
    """Random operations on ``sides`` (``VllmSide`` / ``KvpoolSide`` instances over pools
    of the same size), compared after each one when there are two sides.

    Args:
        sides: one or two sides; with two, the first is the reference.
        seed: seed of the operation stream (the same seed gives the same stream).
        errors: also draw kvpool's error and rollback operations (kvpool side only).
        full_check_every: compare the full state every this many operations.
    """

    def __init__(self, sides, seed: int, errors: bool = False, full_check_every: int = 500):
        self.sides = list(sides)
        self.rng = random.Random(seed)
        self.num_blocks = self.sides[0].pool.num_gpu_blocks
        ops = dict(OPERATIONS)
        if errors:
            assert all(isinstance(s, KvpoolSide) for s in self.sides)
            ops.update(ERROR_OPERATIONS)
        self.op_names = list(ops)
        self.op_weights = list(ops.values())
        self.full_check_every = full_check_every
        # Live requests: per request, per KV cache group, block ids in allocation order.
        self.requests: list[list[list[int]]] = []
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.max_request_blocks = max(12, self.num_blocks // 16)  # per KV cache group
        self.hash_space = 4 * self.num_blocks  # small enough for duplicate hashes
        self.reused: list[list[tuple[int, int]]] = [[] for _ in self.sides]
        self.ops_done = 0
        self.counts: dict[str, int] = dict.fromkeys(self.op_names, 0)

    # -- helpers ----------------------------------------------------------------------
    def _blocks(self, side, ids):
        blocks = side.pool.blocks
        return [blocks[i] for i in ids]

    def _ids_of(self, side, blocks) -> list:
        """``blocks``' ids in the reference side's id space (here: their block ids)."""
        return [b.block_id for b in blocks]

    def _agree(self, values, what: str):
        if len(values) > 1 and any(v != values[0] for v in values[1:]):
            raise AssertionError(
                f"op {self.ops_done} ({what}): {self.sides[0].name} {values[0]!r} != "
                f"{self.sides[1].name} {values[1]!r}")
        return values[0]

    def _watcher(self, i: int, tag: int):
        seen = self.reused[i]
        return lambda block: seen.append((tag, block.block_id))

    def check_full(self) -> None:
        self._agree([full_state(s.pool) for s in self.sides], "full state")
        for s in self.sides:
            if isinstance(s, KvpoolSide):
                s.pool.free_block_queue.check_invariants()

    # -- operations ---------------------------------------------------------------------
    def op_alloc(self) -> None:
        free = self.sides[0].pool.get_num_free_blocks()
        num_groups = 1 if self.rng.random() < 0.5 else 2
        sizes = [self.rng.randint(0, self.max_request_blocks) for _ in range(num_groups)]
        if sum(sizes) > free:
            return
        groups = []
        for size in sizes:
            got = self._agree([[b.block_id for b in s.pool.get_new_blocks(size)] for s in self.sides],
                              "get_new_blocks ids")
            groups.append(got)
        self._cache_prefixes(groups)
        self.requests.append(groups)

    def _cache_prefixes(self, groups: list[list[int]]) -> None:
        """Cache a random prefix of each group under hashes (group id in the key, as
        vLLM does), on every side."""
        for g, ids in enumerate(groups):
            if ids and self.rng.random() < 0.6:
                k = self.rng.randint(1, len(ids))
                keys = [make_block_hash_with_group_id(
                    self.rng.randrange(self.hash_space).to_bytes(4, "little"), g) for _ in range(k)]
                for s in self.sides:
                    for i, (key, block) in enumerate(zip(keys, self._blocks(s, ids[:k]))):
                        s.pool._insert_block_hash(key, block, num_tokens=16 * (i + 1))

    def _pop_request(self):
        if not self.requests:
            return None
        i = self.rng.randrange(len(self.requests))
        self.requests[i], self.requests[-1] = self.requests[-1], self.requests[i]
        groups = self.requests.pop()
        if self.rng.random() < 0.1:  # an unusual order: shuffled within the group
            groups = [self.rng.sample(g, len(g)) for g in groups]
        return groups

    def op_free(self) -> None:
        groups = self._pop_request()
        if groups is None:
            return
        for s in self.sides:
            for ids in groups:  # KVCacheCoordinator.free: one reversed call per group
                s.pool.free_blocks(reversed(self._blocks(s, ids)))

    def op_free_deferred(self) -> None:
        groups = self._pop_request()
        if groups is None:
            return
        fence = self.sched_step_seq + self.rng.randint(0, 3)
        for s in self.sides:
            s.push_deferred(fence, [self._blocks(s, ids)[::-1] for ids in groups])

    def op_step(self) -> None:
        self.sched_step_seq += 1
        # Steps in flight: processed_step_seq trails sched_step_seq, never goes back.
        self.processed_step_seq = max(self.processed_step_seq,
                                      self.sched_step_seq - self.rng.randint(0, 2))
        self._agree([s.free_ready(self.processed_step_seq) for s in self.sides], "free_ready calls")
        self._agree([s.num_deferred() for s in self.sides], "deferred entries left")

    def op_touch(self) -> None:
        """A prefix-cache hit: look hashes up, touch the hits, hold them as a request."""
        ref = self.sides[0].pool
        cached = list(ref.cached_block_hash_to_block._cache)
        if not cached:
            return
        keys = self.rng.sample(cached, min(len(cached), self.rng.randint(1, 6)))
        ids = []
        for key in sorted(keys):  # (set order of the sample is not part of the stream)
            got = self._agree([self._ids_of(s, s.pool.get_cached_block(key[:-4], [key_group(key)]) or [])
                               for s in self.sides], "get_cached_block")
            ids.extend(got)
        for s in self.sides:
            s.pool.touch(self._blocks(s, ids))
        self.requests.append([ids])

    def op_evict(self) -> None:
        ids = set(self.rng.sample(range(self.num_blocks), self.rng.randint(1, 8)))
        for s in self.sides:
            s.pool.evict_blocks(ids)

    def op_unpin(self) -> None:
        """Release a request's blocks with a reuse watcher (offloading keeps reading them
        until they are handed out again)."""
        groups = self._pop_request()
        if groups is None:
            return
        tag = self.ops_done
        for i, s in enumerate(self.sides):
            for ids in groups:
                s.pool.unpin_blocks(self._blocks(s, ids), self._watcher(i, tag))

    def op_reset(self) -> None:
        reorder = self.rng.random() < 0.5
        self._agree([s.reset(reorder) for s in self.sides], "reset_prefix_cache")

    def op_reorder(self) -> None:
        self._agree([s.reorder() for s in self.sides], "reset_free_block_queue_order")

    def op_flush(self) -> None:
        self.quiesce()

    def quiesce(self) -> None:
        """Free every held block, drain every deferred free, reset the prefix cache
        and restore the canonical order: the pool as new, with its objects created."""
        while self.requests:
            self.op_free()
        self.sched_step_seq += 4  # past every fence pushed so far
        self.processed_step_seq = self.sched_step_seq
        self._agree([s.free_ready(self.processed_step_seq) for s in self.sides], "free_ready calls")
        assert all(s.num_deferred() == 0 for s in self.sides)
        self._agree([s.reset(True) for s in self.sides], "reset + reorder")
        self._agree([free_order(s.pool) for s in self.sides], "canonical order")

    # -- kvpool's error and rollback paths (kvpool sides only) ---------------------------
    def _double_free_ids(self) -> list[int]:
        """A held request's first group ([] when no request holds blocks)."""
        return self.requests[self.rng.randrange(len(self.requests))][0] if self.requests else []

    def _double_free_list(self, side, ids: list[int]):
        """``ids``' blocks with the first listed once more than it is held."""
        blocks = self._blocks(side, ids)
        return blocks + blocks[:1] * (blocks[0].ref_cnt + 1)

    def op_err_double_free(self) -> None:
        ids = self._double_free_ids()
        if not ids:
            return
        for s in self.sides:
            blocks = self._double_free_list(s, ids)
            before = free_order(s.pool)
            try:
                s.pool.free_blocks(blocks)
            except BlockStateError:
                pass
            else:
                raise AssertionError("double free not refused")
            assert free_order(s.pool) == before

    def op_err_touch_foreign(self) -> None:
        for s in self.sides:
            other = BlockPool(4, enable_caching=True, hash_block_size=16)
            foreign = [other.blocks[2]]  # free in its own pool: this pool cannot unlink it
            before = free_order(s.pool)
            free_ids = before[: self.rng.randint(0, 3)]
            try:
                s.pool.touch(self._blocks(s, free_ids) + foreign)
            except BlockStateError:
                pass
            else:
                raise AssertionError("foreign touch not refused")
            assert free_order(s.pool) == before  # the removals were undone in place

    def op_err_alloc_too_many(self) -> None:
        for s in self.sides:
            try:
                s.pool.get_new_blocks(s.pool.get_num_free_blocks() + 1)
            except ValueError:
                pass
            else:
                raise AssertionError("over-allocation not refused")

    def op_err_evict_out_of_range(self) -> None:
        for s in self.sides:
            try:
                s.pool.evict_blocks({1, self.num_blocks + self.rng.randint(0, 5)})
            except BlockIdOutOfRangeError:
                pass
            else:
                raise AssertionError("out-of-range evict not refused")

    def op_err_evict_hook_raises(self) -> None:
        """An eviction hook that raises mid-allocation: the popped blocks go back in place.
        (Only on the native path: with reuse watchers registered kvpool runs vLLM's loop,
        which has no rollback.)"""
        for s in self.sides:
            pool = s.pool
            if pool._reuse_watchers:
                continue
            before = free_order(pool)
            n = min(len(before), self.rng.randint(1, 16))

            def hook(block):
                raise RuntimeError("hook")

            # An instance attribute: kvpool runs vLLM's loop for it (kvpool.vllm_calls),
            # which calls the hook for every block, and undoes the pop when it raises.
            pool._maybe_evict_cached_block = hook
            try:
                pool.get_new_blocks(n)
            except RuntimeError:
                assert free_order(pool) == before
            else:  # no cached block among them: a plain allocation, given back
                got = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
                assert len(got) == len(before) - n
                del pool._maybe_evict_cached_block
                pool.free_blocks(reversed(self._blocks(s, before[:n])))
                continue
            finally:
                pool.__dict__.pop("_maybe_evict_cached_block", None)

    def op_err_free_ready_double_free(self) -> None:
        """A deferred entry that would double free stays queued; nothing of it is freed."""
        ids = self._double_free_ids()
        if not ids:
            return
        for s in self.sides:
            blocks = self._double_free_list(s, ids)
            queue = FencedDeferredFreeQueue()
            queue.push(0, blocks)
            before = free_order(s.pool)
            try:
                queue.free_ready(0, s.pool)
            except BlockStateError:
                pass
            else:
                raise AssertionError("deferred double free not refused")
            assert len(queue) == 1 and free_order(s.pool) == before
            queue.clear()

    # -- driver --------------------------------------------------------------------------
    def run(self, num_ops: int) -> None:
        """Run ``num_ops`` random operations, checking after each one."""
        choices = self.rng.choices(self.op_names, weights=self.op_weights, k=num_ops)
        for name in choices:
            getattr(self, "op_" + name)()
            self.counts[name] += 1
            self.ops_done += 1
            if len(self.sides) > 1:
                self._agree([s.pool.get_num_free_blocks() for s in self.sides], "free count")
                self._agree(self.reused, "reuse callbacks")
                if self.ops_done % self.full_check_every == 0:
                    self.check_full()
            for seen in self.reused:
                seen.clear()


def key_group(key: bytes) -> int:
    """Group id of a ``BlockHashWithGroupId`` (its last 4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big")
