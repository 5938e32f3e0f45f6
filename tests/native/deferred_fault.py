"""Fault injection through a real vLLM Scheduler's deferred-free path (run by
tests/native/test_fault_injection.py in a child process, like fault_sweep.py).

A request finishes while the step that may still write its blocks is in flight
(async scheduling with a KV consumer): ``Scheduler._free_request_blocks`` queues its
blocks in the deferred-free queue. For every k the k-th allocation inside that call
fails once. The call must then either succeed or raise MemoryError with each KV
cache group's blocks either still in the request's table or queued, never both and
never neither, so that a retry frees the rest; and once the step is processed every
block is back in the pool.

    python tests/native/deferred_fault.py [--hybrid]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MAX_K = int(os.environ.get("KVPOOL_FAULT_MAX_K", "5000"))
from failmalloc_ctl import disarm, lib  # noqa: E402  (tests/native: the script's own folder)

import kvpool  # noqa: E402

kvpool.install()

from tests.support.scheduler import make_request, make_scheduler  # noqa: E402


def tables(scheduler, request_id):
    # Each KV cache group's block table of the request, as block identities.
    return [[id(b) for b in m.req_to_blocks.get(request_id, ())]
            for m in scheduler.kv_cache_manager.coordinator.single_type_managers]


def sweep(hybrid: bool) -> int:
    for k in range(MAX_K):
        scheduler = make_scheduler(num_blocks=64, enable_prefix_caching=True, hybrid=hybrid)
        pool = scheduler.kv_cache_manager.block_pool
        scheduler.defer_block_free = True
        request = make_request("r", list(range(70)))
        scheduler.add_request(request)
        scheduler.schedule()  # the step is in flight: the free is deferred
        before = tables(scheduler, "r")
        assert sum(map(len, before)) >= 5
        print(f"hybrid={hybrid} k={k}", flush=True)
        lib.kvpool_fault_arm(k)
        try:
            scheduler._free_request_blocks(request)
            error = None
        except MemoryError as exc:
            error = exc
        finally:
            hit = disarm()
        if error is not None:
            # Each group is either still in its table or queued, never both or
            # neither (vLLM's own pop may fail after an earlier group was popped).
            after = tables(scheduler, "r")
            queued = sorted(id(b) for _, blocks in scheduler.deferred_frees for b in blocks)
            held = sorted(i for table in after for i in table)
            assert sorted(queued + held) == sorted(i for table in before for i in table), (
                f"k={k}: {error!r}: blocks lost or both queued and held")
            assert all(t == [] or t == b for t, b in zip(after, before)), f"k={k}: a table changed"
            scheduler._free_request_blocks(request)  # the retry
        assert tables(scheduler, "r") == [[] for _ in before]
        assert len(scheduler.deferred_frees) >= 1
        scheduler.processed_step_seq = scheduler.sched_step_seq
        scheduler._drain_deferred_frees()
        pool.free_block_queue.check_invariants()
        free = pool.get_num_free_blocks()
        assert free == pool.num_gpu_blocks - 1, f"k={k}: {pool.num_gpu_blocks - 1 - free} blocks lost"
        if not hit:
            return k
    raise AssertionError(f"still hitting allocations after {MAX_K} tries")


if __name__ == "__main__":
    hybrid = "--hybrid" in sys.argv[1:]
    print(f"OK hybrid={hybrid}: {sweep(hybrid)} allocation points, each failing once", flush=True)
