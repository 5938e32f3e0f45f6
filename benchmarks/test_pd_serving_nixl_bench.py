"""``pd-serving`` through the real NIXL: vanilla vs kvpool+contiguous, the descriptors
NIXL posts for the transferred prompts after both pools wrap (a gate on a count, not a
time; ``benchmarks/ratios.py``, row ``pd_serving_nixl_desc_contiguous``).

The replay's own run (``python -m kvpool replay --workload pd-serving --nixl``) at a small
size: both sides' pools wrap in window 0 or 1, and windows ``WRAP`` .. ``WRAP + WINDOWS - 1``
are the benchmark's rounds. The benchmark's timer is the sum of NIXL's ``descCount`` over
the prompts transferred so far (``RoundResult.nixl_descriptors_total``), so one benchmark
round's "time" is a window's NIXL descriptors, and the row's ratio is the median over the
windows of vanilla's total / kvpool+contiguous's. The modes' windows alternate, one
NIXL agent pair shared. Skipped where NIXL does not import (scripts/bootstrap.sh installs it).

Run: ``.venv/bin/python -m pytest benchmarks/test_pd_serving_nixl_bench.py --benchmark-only``.
"""

from __future__ import annotations

import pytest

from kvpool.tools.replay import modes as replay_modes, nixl
from kvpool.tools.replay.engine import PoolSpec
from kvpool.tools.replay.runner import ModeRun
from kvpool.tools.replay.workloads import pd_serving

try:
    nixl.require_nixl()
except nixl.NixlUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)

#: The first window after the wrap, and the windows measured from it.
WRAP, WINDOWS = 2, 3
POOL = PoolSpec(num_blocks=4_000, block_size=16)
MODES = {"vllm": "vanilla", "kvpool_contiguous": "kvpool+contiguous"}

_RUNS: dict[str, ModeRun] = {}
_TRANSFER: list = []
#: The benchmarks' "timer": NIXL descriptors posted in the measured windows so far.
_DESCRIPTORS = [0.0]


def _descriptor_clock() -> float:
    return _DESCRIPTORS[0]


def _workload():
    return pd_serving(rounds=WRAP + WINDOWS, window_steps=200, in_flight=(16, 32), prompt_len=(512, 4_096),
                      prefix_len=(256, 2_048), output_len=(32, 256), seed=0)


@pytest.fixture(scope="module", autouse=True)
def _close_transfer():
    yield
    for transfer in _TRANSFER:
        transfer.close()


def _run(impl: str) -> ModeRun:
    if not _TRANSFER:
        _TRANSFER.append(nixl.NixlTransfer(POOL.num_blocks))
    if impl not in _RUNS:
        try:
            _RUNS[impl] = ModeRun(MODES[impl], _workload(), POOL, 0, nixl=_TRANSFER[0])
        finally:
            replay_modes.restore_vanilla()
    return _RUNS[impl]


@pytest.mark.benchmark(timer=_descriptor_clock)
@pytest.mark.parametrize("window,impl", [(w, impl) for w in range(WRAP, WRAP + WINDOWS) for impl in MODES])
def test_pd_serving_nixl_window(benchmark, window, impl):
    run = _run(impl)

    def setup():
        replay_modes.set_mode(run.mode)
        while len(run.rounds) < window:  # the windows before the wrap: run, not measured
            assert run.next_round()
        return (), {}

    def one_window():
        assert run.next_round()
        _DESCRIPTORS[0] += run.rounds[-1].nixl_descriptors_total

    benchmark.group = "pd_serving_nixl_desc"
    try:
        benchmark.pedantic(one_window, setup=setup, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        replay_modes.restore_vanilla()
    result = run.rounds[-1]
    assert result.round == window
    assert max(r.max_block_id for r in run.rounds) == POOL.num_blocks - 1, "the decode side's pool never wrapped"
    assert result.evictions > 0 and result.prefill_evictions > 0, "both pools evict after the wrap"
    assert result.nixl_descriptors_total == result.pd_descriptors_total * result.nixl_regions
    benchmark.extra_info.update(impl=impl, blocks=result.prompts, per="prompt", round=window,
                                nixl_descriptors=result.nixl_descriptors_total)
