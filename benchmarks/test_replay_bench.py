"""Every built-in replay workload through vLLM 0.33.0's real ``Scheduler``: vanilla vs
kvpool (default policy) vs kvpool with the contiguous policy, in the same run (issue
17: "no built-in replay workload slower than vanilla").

Each workload is what ``python -m kvpool replay --workload W --scale SCALE --num-blocks
NUM_BLOCKS`` runs (fewer rounds), on a pool small enough that it wraps and evicts:
``grpo``, ``long_sequential`` (prefix caching off), ``pd_async`` (async scheduling with
a KV consumer; the same requests are the decode side of ``pd``), ``pd_prefill`` (the
prefill side of ``pd``: a KV producer on its own pool) and ``serving`` (never idle, the
rounds are windows of engine steps). One pytest-benchmark round is one replay round of
one mode: its scheduler CPU (``schedule()`` + ``update_from_output()``, the replay's
own ``RoundResult.sched_cpu_s``: thread CPU, the probe's reads subtracted) is what the
benchmark's timer measures, so the figures are the replay's, and the ratio is the
median of the rounds' ratios (``benchmarks/ratios.py``).

The modes' rounds alternate (round 0 of every mode, then round 1, ...; one scheduler
per mode, built once under its mode, kvpool installed for that mode's rounds only), so
a change of the machine's speed reaches every mode alike. Round r of every mode is the
same requests; each mode must leave vLLM's prefix-cache hits, evicted hashes (in order)
and preemptions exactly as vanilla's (checked per round).

Run: ``.venv/bin/python -m pytest benchmarks/test_replay_bench.py --benchmark-only``.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from kvpool.tools.replay import modes as replay_modes, workloads
from kvpool.tools.replay.engine import PoolSpec, resolve_pool
from kvpool.tools.replay.geometry import model_shapes_unavailable_reason
from kvpool.tools.replay.runner import ModeRun

#: Rounds (windows) per mode; the ratio is the median of the rounds' ratios.
ROUNDS = int(os.environ.get("KVPOOL_REPLAY_BENCH_ROUNDS", "5"))
SCALE = 0.05
POOL = PoolSpec(num_blocks=12_000, block_size=32)
SEED = 0

#: name -> (rounds, the workload): the replay's built-in ones at SCALE. long_sequential
#: (one request a round, ~80 us steps whose CPU moves by up to a third between rounds
#: on a shared machine, and kvpool's lead there the thinnest) runs three times as many
#: rounds of half the length, so the modes interleave more finely and the median has
#: more rounds.
WORKLOADS = {
    "grpo": (ROUNDS, lambda: workloads.grpo(rounds=ROUNDS, scale=SCALE)),
    "long_sequential": (3 * ROUNDS, lambda: workloads.long_sequential(rounds=3 * ROUNDS, scale=SCALE / 2)),
    "pd_async": (ROUNDS, lambda: workloads.pd_async(rounds=ROUNDS, scale=SCALE)),
    "pd_prefill": (ROUNDS, lambda: workloads.pd(rounds=ROUNDS, scale=SCALE).prefill),
    "serving": (ROUNDS, lambda: workloads.serving(rounds=ROUNDS, window_steps=400, scale=SCALE)),
    # serving at the replay's default scale on the dense shape (one full-attention
    # group, POOL): the dense row beside the hybrid shapes' below (issue 36: each shape
    # <= 0.7x on the serving workload), where "serving" above is its prefill-heavy
    # variant at SCALE. The same 4,000 steps as ten 400-step windows, in forty of 100
    # steps: the modes alternate every ~0.15 s instead of every ~0.6 s, so a slowdown
    # of the shared machine lasting a second reaches the three modes' windows alike.
    # Its ratio sits closest to its gate (1.42-1.59x here at ten windows; the project's
    # CI measured 1.33-1.51x on 2026-12-07); at forty windows, two runs here gave
    # 1.57x / 1.54x both times, the median within 0.05x of the CPU-per-step ratio
    # (docs/performance.md, "Every built-in replay workload").
    "serving_dense": (8 * ROUNDS, lambda: workloads.serving(rounds=8 * ROUNDS, window_steps=100)),
    # serving on a hybrid model's KV cache groups as vLLM resolves them (full attention
    # + sliding window: docs/replay.md, "Model shapes"), POOL.num_blocks blocks, at the
    # replay's default scale (outputs of 64-1,024 tokens: at SCALE, 3-51, every step
    # admits or prefills, and a hybrid model's prefill and caching are vLLM's Python).
    # Ten rounds, as the dense row: its rounds' ratios spread widely (1.58-2.12x in one
    # quiet run), and a median of five moved by 0.1-0.2x between runs of one commit
    "serving_gpt_oss": (2 * ROUNDS, lambda: _on_model(workloads.serving(rounds=2 * ROUNDS, window_steps=400),
                                                      "openai/gpt-oss-20b")),
    # ... and on Qwen3-Next's (three Mamba groups in mamba_cache_mode="align" + full
    # attention, 1,088-token blocks): 321 blocks, what 8 GiB of KV memory gives, so the
    # pool wraps. Its idle running steps are native, Mamba groups included
    # (docs/performance.md, "Hybrid models"). Ten rounds, as the two rows above: a
    # clean-clone run on 2026-12-06 measured its five rounds' ratios 1.52-2.65x
    # (median 1.70x) where the clean-clone runs before measured 1.98-2.56x.
    "serving_qwen3_next": (2 * ROUNDS, lambda: _on_model(workloads.serving(rounds=2 * ROUNDS, window_steps=400),
                                                         "Qwen/Qwen3-Next-80B-A3B-Instruct")),
    # ... and with prefix caching off (the replay's --prefix-caching off): vLLM's
    # KVCacheCoordinatorNoPrefixCache, the Mamba groups in mamba_cache_mode="none" (one
    # state block of max_model_len tokens per request and group; 200-step windows of
    # about 0.2 s each, ten of them: the same run measured its contiguous row's five
    # rounds 1.09-2.75x, median 1.43x, at its gate)
    "serving_qwen3_next_no_cache": (2 * ROUNDS, lambda: _on_model(
        workloads.serving(rounds=2 * ROUNDS, window_steps=200), "Qwen/Qwen3-Next-80B-A3B-Instruct",
        prefix_caching=False)),
}
#: benchmark impl -> the replay's mode.
MODES = {"vllm": "vanilla", "kvpool": "kvpool", "kvpool_contiguous": "kvpool+contiguous"}


def _on_model(wl, model: str, prefix_caching: bool | None = None):
    """``wl`` as ``python -m kvpool replay --model MODEL`` runs it (``--prefix-caching
    off`` for ``prefix_caching=False``)."""
    engine = replace(wl.engine, model=model)
    if prefix_caching is not None:
        engine = replace(engine, enable_prefix_caching=prefix_caching)
    return replace(wl, engine=engine)


#: The WORKLOADS run on a model's own KV cache groups (``--model``) -> their blocks.
MODEL_SHAPES = {"serving_gpt_oss": POOL.num_blocks, "serving_qwen3_next": 321, "serving_qwen3_next_no_cache": 321}


def _pool(name: str, wl) -> PoolSpec:
    """POOL, or for a workload of MODEL_SHAPES the KV cache vLLM resolves for its model
    with that many blocks (the replay's ``--model M --num-blocks N``)."""
    if name not in MODEL_SHAPES:
        return POOL
    return resolve_pool(wl, kv_memory_bytes=None, num_blocks=MODEL_SHAPES[name], user_block_size=None)[0]


_RUNS: dict[tuple[str, str], ModeRun] = {}
#: (workload, round) -> impl -> what must equal vanilla's.
_CACHE: dict[tuple[str, int], dict[str, tuple]] = {}
#: The benchmarks' timer: the scheduler CPU seconds of the replay rounds run so far.
_SCHED_CPU = [0.0]


def _replay_clock() -> float:
    return _SCHED_CPU[0]


def _run(name: str, impl: str) -> ModeRun:
    """The replay's own run of workload ``name`` in ``impl`` (built once, under its mode:
    the warm-up, the schedulers; the reset between rounds, as the replay does)."""
    key = (name, impl)
    if key not in _RUNS:
        try:
            wl = WORKLOADS[name][1]()
            run = ModeRun(MODES[impl], wl, _pool(name, wl), SEED)
            pool = run.scheduler.kv_cache_manager.block_pool
            assert type(pool).__module__.startswith("kvpool" if run.mode.uses_kvpool else "vllm")
            _RUNS[key] = run
        finally:
            replay_modes.restore_vanilla()
    return _RUNS[key]


def _bench_round(benchmark, name: str, round_: int, impl: str) -> None:
    """Round ``round_`` of workload ``name`` in ``impl``: one pytest-benchmark round
    whose time is the round's scheduler CPU (``ModeRun.next_round``, which freezes the
    objects built before the round out of the garbage collector, as vLLM's engine core
    does)."""
    run = _run(name, impl)

    def setup():
        replay_modes.set_mode(run.mode)  # the class patches of this mode only
        return (), {}

    def one_round():
        assert run.next_round()
        _SCHED_CPU[0] += run.rounds[-1].sched_cpu_s

    benchmark.group = f"replay_{name}"
    try:
        benchmark.pedantic(one_round, setup=setup, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        replay_modes.restore_vanilla()
    result = run.rounds[-1]
    assert result.round == round_ and getattr(result, "reset_ok", None) is not False
    benchmark.extra_info.update(impl=impl, blocks=result.num_steps, per="step", round=round_,
                                evictions=result.evictions, hit_tokens=result.prefix_cache_hit_tokens)
    seen = _CACHE.setdefault((name, round_), {})
    seen[impl] = (result.num_steps, result.prefix_cache_hit_tokens, result.evictions,
                  result.eviction_digest, result.preemptions)
    if impl != "vllm" and "vllm" in seen:
        assert seen[impl] == seen["vllm"], f"{impl}: not vanilla's steps/hits/evictions/preemptions in round {round_}"


#: (workload, round, mode) in the order the benchmarks run: the modes alternate.
INTERLEAVED = [(name, r, impl) for name, (rounds, _) in WORKLOADS.items() for r in range(rounds) for impl in MODES]


@pytest.mark.benchmark(timer=_replay_clock)  # the replay's scheduler CPU per round
@pytest.mark.parametrize("name,round_,impl", INTERLEAVED)
def test_replay_round(benchmark, name, round_, impl):
    if name in MODEL_SHAPES and model_shapes_unavailable_reason():
        pytest.skip(model_shapes_unavailable_reason())
    _bench_round(benchmark, name, round_, impl)
