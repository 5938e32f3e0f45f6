"""Ratio table of a benchmark run (used by conftest.py and check_ratios.py)."""

from __future__ import annotations

import statistics

#: Minimum vLLM/kvpool ratios (issue 4), at 85,000 blocks on a 2-core machine.
TARGETS = {
    "reorder": 200,
    "pool_creation": 30,
    "alloc_free_2100": 25,
    "alloc_free_2100_contiguous": 25,  # issue 9: the contiguous policy's alloc+free
    # 25x on the day it was set (issue 4: 36x in that session's CI). On 2026-11-30 the
    # same machine kind ran kvpool's memory-bound 85,000-block loops about 1.9x slower
    # (0.9 -> 1.7 ms, vLLM's interpreter-bound ones 1.2x), and the previous session's
    # build measured the same there as this one: 22-24x quiet (docs/measurements.md).
    # CI gates at 20x until the host question is settled; 25x stays the goal.
    "alloc_free_whole_pool": 20,
    "touch_free_2100_hashed": 20,
    "deferred_drain_2100": 20,
    # The scheduler step (benchmarks/test_scheduler_step_bench.py, issue 17): vanilla's
    # CPU per step / kvpool's (schedule() + update_from_output() only), the median of
    # the per-round ratios of 15 interleaved rounds of 400 steps (_ratio below). Issue
    # 17's targets: kvpool <= 0.7x of vanilla's CPU per step (>= 1/0.7 = 1.43x) with
    # the default policy, <= 0.75x (>= 1.33x) with the contiguous one, on both shapes.
    # On 2026-12-02 (a waiting request's lookup and prefix caching off native too) five
    # runs on the 2-core machine, nothing else running, measured serving 1.46-1.55x
    # (contiguous 1.42-1.51x), grpo 1.46-1.52x (contiguous 1.36-1.46x); CI measures
    # again and fails only when a ratio is below in both runs
    # (docs/measurements.md, "The step benchmark measures the step").
    "scheduler_step_serving": 1 / 0.7,
    "scheduler_step_serving_contiguous": 1 / 0.75,
    "scheduler_step_grpo": 1 / 0.7,
    "scheduler_step_grpo_contiguous": 1 / 0.75,
    # Every built-in replay workload (benchmarks/test_replay_bench.py, issue 17: "no
    # built-in replay workload slower than vanilla"): vanilla's scheduler CPU per round /
    # kvpool's, the median of the per-round ratios of 5 interleaved rounds (15 shorter
    # ones for long_sequential), the replay's own figures (pd_async is also the decode
    # side of the pd workload, pd_prefill its prefill side). On 2026-12-02, three runs on
    # the 2-core machine (the first two with long_sequential at 5 rounds): grpo
    # 1.56-2.33x (contiguous 1.78-1.89x), long_sequential 1.17-1.26x (1.07-1.14x; 15
    # rounds: 1.13x, 1.14x), pd_async 1.22-2.36x (1.40-1.57x), pd_prefill 2.79-2.89x
    # (2.12-2.81x), serving 1.52-1.60x (1.37-1.65x).
    # pd-serving through the real NIXL (benchmarks/test_pd_serving_nixl_bench.py): not a
    # time but NIXL's descriptors (descCount summed) over the prompts transferred in a
    # window after both pools wrap, vanilla's / kvpool+contiguous's, the median of 3
    # windows. A count: the same on every machine and run. On 2026-12-04 (vLLM 0.34.0,
    # NIXL 1.5.1): 2.74x (windows 4.30x, 2.66x, 2.74x); the gate keeps contiguous's count
    # at most half of vanilla's.
    "pd_serving_nixl_desc_contiguous": 2.0,
    **{f"replay_{w}{suffix}": 1.0
       for w in ("grpo", "long_sequential", "pd_async", "pd_prefill", "serving")
       for suffix in ("", "_contiguous")},
    # serving at the replay's default scale on the dense shape (one full-attention
    # group; the row beside the two hybrid shapes', 10 rounds: issue 36, "<= 0.7x on
    # every shape"). The step's floor is 0.58-0.60x (a KV cache manager that cost
    # nothing: 40 % of vanilla's step samples are under it in a py-spy profile,
    # benchmarks/profile_step.py, 4 % of kvpool's), so 0.7x leaves the row little room:
    # about 6 % at its slowest. Gated at 0.75x until five clean-clone CI runs in a row
    # (2026-12-06, vLLM 0.34.0, 2-core Zen 4) measured kvpool 1.53-1.62x and contiguous
    # 1.52-1.60x, none below 1.52x (0.66x); a row fails only when below its target in
    # both measurements of a run (check_ratios.py).
    "replay_serving_dense": 1 / 0.7,
    "replay_serving_dense_contiguous": 1 / 0.7,
    # serving on gpt-oss's KV cache groups (full attention + sliding window, vLLM's
    # HybridKVCacheCoordinator; issue 36: kvpool and kvpool+contiguous <= 0.7x of
    # vanilla's scheduler CPU). Where a hybrid model's running step is native (vLLM
    # 0.34.0, kvpool.patches.hybrid_fast_path; TARGETS_BY_RELEASE holds the others).
    # On 2026-12-04: kvpool 1.51-1.58x in three runs beside other work; the contiguous
    # policy 1.41-1.53x (0.65-0.71x), at the 0.7x line under load. Both gated at 0.7x
    # since the steps that free and allocate became native; clean-clone CI runs measured
    # the contiguous row at 1.31-1.70x in its first measurement. On 2026-12-06, quiet,
    # 10 rounds: 1.75x / 1.73x (its rounds' ratios spread 1.58-2.12x in one run, hence
    # 10 rounds, not 5).
    "replay_serving_gpt_oss": 1 / 0.7,
    "replay_serving_gpt_oss_contiguous": 1 / 0.7,
    # serving on Qwen3-Next's KV cache groups (three Mamba groups in "align" mode + full
    # attention; issue 36: <= 0.7x), whose idle running steps are native with the Mamba
    # groups' part (src/kvpool/mamba_step.pxi), and the coordinator's cache_blocks that
    # caches nothing (hybrid_cache.pxi). On 2026-12-05: kvpool 2.14x (0.47x), contiguous
    # 2.08x (0.48x); the idle step alone 1.71x / 1.69x; before it 0.96-0.99x.
    "replay_serving_qwen3_next": 1 / 0.7,
    "replay_serving_qwen3_next_contiguous": 1 / 0.7,
    # the same with prefix caching off (KVCacheCoordinatorNoPrefixCache, Mamba groups in
    # mamba_cache_mode="none"), whose running steps became native on 2026-12-06: before,
    # 1.01x in the replay (every step vLLM's Python)
    "replay_serving_qwen3_next_no_cache": 1 / 0.7,
    "replay_serving_qwen3_next_no_cache_contiguous": 1 / 0.7,
}


#: Targets that differ on a vLLM release, because vLLM's own Python (the ratio's
#: numerator) changed speed. vLLM 0.34.0's ``get_new_blocks`` sets ``ref_cnt = 1`` and
#: calls the eviction hook only for hashed blocks, and its ``free_blocks`` and deferred
#: drain got cheaper: its alloc + free of 2,100 blocks takes 0.44 ms where 0.33.0's took
#: 0.80 ms (kvpool's 0.020 ms on both), the contiguous policy's pair 0.30 ms (0.79), the
#: whole pool 19.7 ms (32.4), the drain 0.19 ms (0.25), on the 2-core machine
#: (docs/performance.md, "Pool operations"). kvpool's own times did not move, except touch +
#: free of 2,100 hashed blocks (0.031 ms on 0.34.0, 0.025 ms on 0.33.0; not yet
#: explained). The scheduler step's ratios fall with vLLM's cheaper pool calls: a quiet
#: run measured serving 1.34x (contiguous 1.23x), grpo 1.24x (1.20x) on 0.34.0, where
#: issue 17's targets (1.43x / 1.33x) hold on 0.33.0; those targets are not met on 0.34.0
#: yet, and the gates below keep what 0.34.0 measures from regressing.
TARGETS_BY_RELEASE: dict[str, dict[str, float]] = {
    "0.34.0": {
        # 17.2x quiet; a clean-clone CI run at load 3.5 (three other jobs) measured 13.2x
        # and 14.9x: kvpool's loop slows under memory traffic, vLLM's 0.34.0 loop less.
        "alloc_free_2100": 12,
        "alloc_free_2100_contiguous": 8,
        # alloc_free_whole_pool: 14.7x / 15.6x quiet (590-630 rounds) on the machine the
        # targets were set on. It depends on the last-level cache: 85,000 blocks' objects
        # and list nodes outgrow an 8 MiB L3 (a 2-core AMD EPYC Zen 1 machine, 2026-12-05),
        # where kvpool's alloc + free costs 54-68 ns per block against 16-18 ns at 2,100
        # and 10,000 blocks, vLLM's 490 against 280: a clean-clone CI run 6.27x, its rerun 6.92x,
        # 7.51x alone. The 2,100-block rows gate the per-block work at 12x on any machine.
        "alloc_free_whole_pool": 5,
        "deferred_drain_2100": 12,
        "touch_free_2100_hashed": 12,
        "scheduler_step_serving": 1.25,
        "scheduler_step_serving_contiguous": 1.15,
        "scheduler_step_grpo": 1.15,
        "scheduler_step_grpo_contiguous": 1.1,
    },
    # (The model-shape rows, replay_serving_gpt_oss and replay_serving_qwen3_next, run on
    # vLLM 0.34.0 only: the replay's --model resolves the KV cache with 0.34.0's code and
    # an older release refuses it; benchmarks/test_replay_bench.py skips them there.)
}


def targets(vllm_version: str | None = None) -> dict[str, float]:
    """:data:`TARGETS`, with the rows of :data:`TARGETS_BY_RELEASE` for ``vllm_version``
    (default: the installed vLLM's release)."""
    if vllm_version is None:
        from importlib import metadata

        try:
            vllm_version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            vllm_version = ""
    release = ".".join(vllm_version.split("+", 1)[0].split(".")[:3])
    return {**TARGETS, **TARGETS_BY_RELEASE.get(release, {})}


def _ratio(vllm: dict, kvpool: dict) -> float:
    """vLLM's time / kvpool's. Benchmarks run as numbered rounds of the same work in
    every mode (the scheduler step: round r of a mode is the same 200 engine steps of
    the same deterministic stream, checked by its decision trace) are compared round
    by round: the median of the rounds' ratios, so that a round that is cheap or dear
    for every mode (prompt admissions, pure decode) does not tilt the ratio as a
    median of unequal rounds would. Others: the ratio of the medians."""
    rounds = sorted(r for r in vllm["by_round"] if r is not None and r in kvpool["by_round"])
    if len(rounds) > 1:
        return statistics.median(vllm["by_round"][r] / kvpool["by_round"][r] for r in rounds)
    return vllm["median"] / kvpool["median"]


def row_name(group: str, impl: str) -> str | None:
    """The ratio row of a benchmark of ``group`` run by ``impl``: the group for "kvpool",
    "<group>_<mode>" for a further kvpool mode ("kvpool_<mode>"), None for vLLM's side."""
    if impl == "kvpool":
        return group
    if impl.startswith("kvpool_"):
        return f"{group}_{impl[len('kvpool_'):]}"
    return None


def ratio_rows(benchmarks: list[dict]) -> list[dict]:
    """``benchmarks``: dicts with group, name, median (s), extra_info['impl'/'blocks']."""
    # Several benchmarks of one group and implementation (the scheduler step's
    # interleaved rounds, one benchmark each) count as one: the median of their medians.
    by_group: dict[str, dict[str, dict]] = {}
    for b in benchmarks:
        impls = by_group.setdefault(b["group"], {})
        impl = b["extra_info"]["impl"]
        if impl in impls:
            impls[impl]["medians"].append(b["median"])
        else:
            impls[impl] = {**b, "medians": [b["median"]]}
        impls[impl].setdefault("by_round", {})[b["extra_info"].get("round")] = b["median"]
    for impls in by_group.values():
        for b in impls.values():
            b["median"] = statistics.median(b["medians"])
    rows = []
    goals = targets()
    for group, impls in sorted(by_group.items()):
        if "vllm" not in impls:
            continue
        # "kvpool", and further kvpool modes of the same group ("kvpool_contiguous":
        # row "<group>_contiguous").
        for impl in sorted(i for i in impls if row_name(group, i) is not None):
            name = row_name(group, impl)
            v, k = impls["vllm"]["median"], impls[impl]["median"]
            blocks = impls[impl]["extra_info"].get("blocks") or 1
            rows.append(
                {
                    "group": name,
                    "vllm_s": v,
                    "kvpool_s": k,
                    "ratio": _ratio(impls["vllm"], impls[impl]),
                    "kvpool_ns_per_block": k / blocks * 1e9,
                    "target": goals.get(name),
                }
            )
    return rows
