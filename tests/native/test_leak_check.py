"""No reference or object leaks in the native hot paths.

kvpool's loops hold borrowed block pointers, write ``ref_cnt`` as pointers into
CPython's small-int array and batch the small ints' reference counts
(``docs/design.md``, "The per-block loops"). A count lost or doubled on any path would
drift with every call. This runs 10^5 random pool operations (``KVPOOL_LEAK_OPS``) after
a warm-up over every hot path: allocation, free, touch, unpin, evict, deferred push and
drain, the canonical reorder, and the error and rollback paths
(``tests/support/pool_workload.py``), and asserts that at quiescent points (everything freed,
deferred queue drained, prefix cache reset) these stay flat within a small fixed slack:

- ``sys.gettotalrefcount()`` (only on a ``Py_DEBUG`` interpreter:
  ``scripts/test-debug-python.sh``; skipped, not faked, elsewhere);
- the live ``KVCacheBlock`` / ``FreeKVCacheBlockQueue`` / ``BlockTable`` /
  ``FencedDeferredFreeQueue`` objects and all GC-tracked objects;
- ``sys.getallocatedblocks()`` (memory blocks held by CPython's allocator).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

import pytest

from kvpool import FencedDeferredFreeQueue, FreeKVCacheBlockQueue, KVCacheBlock
from kvpool._core import BlockTable
from tests.support.pool_workload import KvpoolSide, PoolWorkload

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug, pytest.mark.slow]

NUM_OPS = int(os.environ.get("KVPOOL_LEAK_OPS", "100000"))
SEED = int(os.environ.get("KVPOOL_LEAK_SEED", "11"))
TRACKED_TYPES = (KVCacheBlock, FreeKVCacheBlockQueue, BlockTable, FencedDeferredFreeQueue)
#: A leak of one reference or object per operation would show as ~NUM_OPS; what moves
#: legitimately between two quiescent points (a dict resized, an int cached) is small.
REFCOUNT_SLACK = 200
OBJECT_SLACK = 50
ALLOCATED_BLOCKS_SLACK = 1000


def snapshot() -> dict[str, int]:
    gc.collect()
    gc.collect()
    objects = gc.get_objects()
    counts = {t.__name__: 0 for t in TRACKED_TYPES}
    for o in objects:
        t = type(o)
        if t in TRACKED_TYPES:
            counts[t.__name__] += 1
    counts["gc objects"] = len(objects)
    del objects
    counts["allocated blocks"] = sys.getallocatedblocks()
    if hasattr(sys, "gettotalrefcount"):
        counts["total refcount"] = sys.gettotalrefcount()
    return counts


@pytest.mark.parametrize(
    "small_int_fast_path, policy, lru_window",
    [(True, "vllm", 0), (False, "vllm", 0), (True, "contiguous", 0), (True, "contiguous", 16)],
    ids=["small-int-fast-path", "slow-path", "contiguous-policy", "contiguous-lru-window"],
)
def test_hot_paths_leak_no_references_or_objects(small_int_fast_path, policy, lru_window):
    from kvpool import allocation
    from kvpool._core import _set_small_int_fast_path

    logging.disable(logging.WARNING)  # refused resets warn on every call
    _set_small_int_fast_path(small_int_fast_path)
    try:
        num_ops = NUM_OPS if small_int_fast_path else NUM_OPS // 4
        allocation.set_policy(policy, lru_window)  # the contiguous order's take / sorted insert / put-back
        try:
            side = KvpoolSide(128)
        finally:
            allocation.set_policy("vllm")
        assert side.pool.allocation == policy
        assert side.pool.free_block_queue.policy.lru_window == lru_window
        workload = PoolWorkload([side], seed=SEED, errors=True)
        workload.side = workload.sides[0]
        list(workload.side.pool.blocks)  # every block object created
        workload.run(max(2000, num_ops // 10))  # warm-up: caches, dict sizes, interned ints
        workload.quiesce()
        before = snapshot()
        start = time.perf_counter()
        workload.run(num_ops // 2)
        workload.quiesce()
        middle = snapshot()
        workload.run(num_ops - num_ops // 2)
        workload.quiesce()
        after = snapshot()
        elapsed = time.perf_counter() - start
    finally:
        _set_small_int_fast_path(True)
        logging.disable(logging.NOTSET)
    workload.side.pool.free_block_queue.check_invariants()
    print(f"\nleak check: seed {SEED}, {num_ops} ops in {elapsed:.1f} s, per op {workload.counts}")
    for key in before:
        print(f"  {key:>24}: {before[key]:>10} -> {middle[key]:>10} -> {after[key]:>10}"
              f"  (delta {after[key] - before[key]:+d})")
    if "total refcount" not in before:
        print("  (sys.gettotalrefcount: not a Py_DEBUG interpreter, not checked)")
    for name in (t.__name__ for t in TRACKED_TYPES):
        assert abs(after[name] - before[name]) <= 0, (name, before[name], after[name])
    assert abs(after["gc objects"] - before["gc objects"]) <= OBJECT_SLACK
    assert abs(after["allocated blocks"] - before["allocated blocks"]) <= ALLOCATED_BLOCKS_SLACK
    if "total refcount" in before:
        assert abs(after["total refcount"] - before["total refcount"]) <= REFCOUNT_SLACK
        assert abs(middle["total refcount"] - before["total refcount"]) <= REFCOUNT_SLACK
    assert all(workload.counts[name] > 0 for name in workload.op_names)
