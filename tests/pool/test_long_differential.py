"""A long random differential: kvpool's ``BlockPool`` against vLLM 0.33.0's, side by
side in one process (kvpool not installed), over allocation, frees in random order,
caching under hashes, cache hits with ``touch``, ``evict_blocks``, ``unpin_blocks`` with
reuse watchers, deferred frees of two KV cache groups through the fenced queue,
``reset_prefix_cache`` and the canonical reorder (``tests/support/pool_workload.py``).

Returned ids, free counts and reuse callbacks are compared after every operation, the
whole free-queue order, ref counts and hashes every 500 operations.

    KVPOOL_DIFF_OPS=1000000 python -m pytest tests/pool/test_long_differential.py -s

runs 10^6 operations (default: 10^4 in the plain suite; CI sets 10^5);
``KVPOOL_DIFF_SEED`` picks the seed (printed either way).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support.pool_workload import KvpoolSide, PoolWorkload, VllmSide

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.slow]

NUM_OPS = int(os.environ.get("KVPOOL_DIFF_OPS", "10000"))
SEED = int(os.environ.get("KVPOOL_DIFF_SEED", "20261130"))


@pytest.mark.parametrize("num_blocks", [96, 1024])
def test_long_random_workload_matches_vllm_block_pool(num_blocks, quiet_pool_logs):
    """Half the operations on a small pool (constant eviction pressure), half on a
    larger one (long free lists, many cached blocks)."""
    num_ops = NUM_OPS // 2
    workload = PoolWorkload([VllmSide(num_blocks), KvpoolSide(num_blocks)], seed=SEED + num_blocks)
    start = time.perf_counter()
    workload.run(num_ops)
    workload.check_full()
    workload.quiesce()
    workload.check_full()
    elapsed = time.perf_counter() - start
    print(f"\nlong differential: seed {SEED + num_blocks}, {num_blocks} blocks, {workload.ops_done} ops "
          f"in {elapsed:.1f} s; per op: {workload.counts}")
    assert all(workload.counts[name] > 0 for name in ("alloc", "free", "free_deferred", "step", "touch",
                                                       "evict", "unpin", "reset", "reorder")) or num_ops < 1000
