"""benchmarks/profile_step.py's reading of py-spy's raw stacks (the step's shares)."""

from __future__ import annotations

from benchmarks.profile_step import parse_frame, step_shares

SCHED = "Scheduler.schedule (vllm/v1/core/sched/scheduler.py:400)"
UPDATE = "Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py:900)"
MANAGER = "KVCacheManager.allocate_slots (vllm/v1/core/kv_cache_manager.py:300)"
POOL = "BlockPool.get_new_blocks (/x/python/kvpool/block_pool.py:210)"
RAW = [
    f"<module> (run.py:1);step (loop.py:5);{SCHED};{MANAGER};{POOL} 6",
    f"<module> (run.py:1);step (loop.py:5);{SCHED};{MANAGER};cache_blocks (vllm/v1/core/kv_cache_manager.py:9) 3",
    f"<module> (run.py:1);step (loop.py:5);{UPDATE};_free (vllm/v1/core/sched/scheduler.py:1000) 1",
    f"<module> (run.py:1);warmup (loop.py:9);{POOL} 40",  # outside the step: not counted
    "garbage line",
]


def test_parse_frame():
    assert parse_frame(SCHED) == ("Scheduler.schedule", "vllm/v1/core/sched/scheduler.py")
    assert parse_frame("<lambda> (x.py)") == ("<lambda>", "x.py")


def test_step_shares_count_only_samples_inside_the_step():
    r = step_shares(RAW, top=2)
    assert r["step_samples"] == 10
    assert r["under_manager"] == 0.9
    assert r["kvpool_leaf"] == 0.6
    assert r["top"] == [("BlockPool.get_new_blocks (block_pool.py)", 0.6), ("cache_blocks (kv_cache_manager.py)", 0.3)]
    assert step_shares([])["step_samples"] == 0
