"""benchmarks/manager_share.py: its timed manager leaves kvpool's native path on and
counts the scheduler's calls; its per-step arithmetic."""

from __future__ import annotations

import collections

import kvpool
from benchmarks.manager_share import TimedManager, summary
from kvpool import _core
from tests.support.scheduler import make_request, make_scheduler, runner_output


def test_the_timed_manager_keeps_the_native_path_and_counts_calls():
    kvpool.install()
    try:
        scheduler = make_scheduler(num_blocks=64, block_size=16)
        acc = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
        scheduler.kv_cache_manager = TimedManager(scheduler.kv_cache_manager, acc, lambda: "m")
        scheduler.add_request(make_request("a", list(range(40)), max_tokens=4))
        before = _core.allocate_slots_fast_path_state()["fast_calls"]
        for _ in range(4):
            so = scheduler.schedule()
            scheduler.update_from_output(so, runner_output(so))
        assert _core.allocate_slots_fast_path_state()["fast_calls"] > before
        assert acc["m"]["allocate_slots"][1] >= 4
        assert acc["m"]["allocate_slots"][0] > 0
    finally:
        kvpool.uninstall()


def test_summary_per_step():
    s = summary({"allocate_slots": [0.003, 30], "take_events": [0.001, 10]}, 0.010, 10)
    assert round(s["step_us"]) == 1000 and round(s["manager_us"]) == 400 and round(s["rest_us"]) == 600
    assert abs(s["rest_share"] - 0.6) < 1e-9
    assert [m[0] for m in s["methods"]] == ["allocate_slots", "take_events"]
    assert s["methods"][0][2] == 3.0
