"""Cross-mode comparison: each mode's rounds aggregated, and checked against vanilla's.

For ``kvpool`` the table digests are a differential check of the whole allocator
against vLLM's; for an allocation policy (``kvpool+contiguous``) the tables differ by
design and the cache columns are the check: a policy may change which uncached block
ids a request gets, never what the prefix cache hits or evicts, nor what is preempted.
Works on the JSON form of the rounds (``RoundResult.to_json()``), so a saved report can
be compared again.
"""

from __future__ import annotations

from typing import Any

from kvpool.tools.replay.free_order import versus_immediate_order
from kvpool.tools.replay.results import ModeComparison, VersusVanilla

#: ``VersusVanilla`` fields: rounds in which these per-round fields equal vanilla's.
CACHE_EQUALITY = {
    "rounds_cache_equal_to_vanilla": (
        "prefix_cache_hit_tokens", "evictions", "eviction_digest", "preemptions",
        # (P/D: the prefill side's too; absent, hence equal, in other workloads)
        "prefill_prefix_cache_hit_tokens", "prefill_evictions", "prefill_preemptions"),
    "rounds_hits_equal_to_vanilla": ("prefix_cache_hit_tokens",),
    "rounds_evictions_equal_to_vanilla": ("evictions", "eviction_digest"),
    "rounds_preemptions_equal_to_vanilla": ("preemptions",),
}


def _median(values) -> float | None:
    xs = sorted(v for v in values if v is not None)
    return xs[len(xs) // 2] if xs else None


def _cpu_per_step(rounds: list[dict[str, Any]]) -> float:
    return sum(r["sched_cpu_s"] for r in rounds) / max(sum(r["num_steps"] for r in rounds), 1)


def _total_if_any(rounds: list[dict[str, Any]], key: str) -> int | None:
    """Sum of a count that only some reports have; ``None`` when no round has it (the
    ``offload_*`` counts: prefix caching off, or a report saved before the transfer
    figures; the ``pd_*`` / ``prefill_*`` ones: not a P/D workload)."""
    xs = [r[key] for r in rounds if r.get(key) is not None]
    return sum(xs) if xs else None


def _aggregate(rounds: list[dict[str, Any]]) -> ModeComparison:
    steps = sum(r["num_steps"] for r in rounds)
    contig = [r["contiguity"] for r in rounds if r["contiguity"] is not None]
    prompts = sum(r.get("prompts", 0) for r in rounds)
    descriptors = sum(r.get("prompt_descriptors_total", 0) for r in rounds)
    copies = _total_if_any(rounds, "offload_copies_total")
    offloaded = _total_if_any(rounds, "offload_blocks")
    return ModeComparison(
        sched_cpu_s_per_step=_cpu_per_step(rounds),
        drain_cpu_s_per_step=sum(r["drain_cpu_s"] for r in rounds) / max(steps, 1),
        deferred_free_s_per_block_median=_median(r["deferred_free_s_per_block"] for r in rounds),
        min_contiguity=min(contig, default=None),
        mean_contiguity=sum(contig) / len(contig) if contig else None,
        max_leaked_blocks=max((r["leaked_blocks"] for r in rounds), default=0),
        prompt_descriptors_total=descriptors,
        prompt_descriptors_per_prompt=descriptors / prompts if prompts else None,
        prompt_descriptors_max=max((r["prompt_descriptors_max"] for r in rounds
                                    if r.get("prompt_descriptors_max") is not None), default=None),
        offload_copies_total=copies,
        offload_blocks_per_copy=offloaded / copies if copies else None,
        pd_descriptors_total=_total_if_any(rounds, "pd_descriptors_total"),
        prefill_prompt_descriptors_total=_total_if_any(rounds, "prefill_prompt_descriptors_total"),
        nixl_descriptors_total=_total_if_any(rounds, "nixl_descriptors_total"),
        nixl_post_us_total=_total_if_any(rounds, "nixl_post_us_total"),
    )


def _versus(rounds: list[dict[str, Any]], base: list[dict[str, Any]], entry: ModeComparison) -> VersusVanilla:
    bcpu = _cpu_per_step(base)
    drain = sum(r["drain_cpu_s"] for r in rounds)
    bdrain = sum(r["drain_cpu_s"] for r in base)
    bmed = _median(r["deferred_free_s_per_block"] for r in base)
    med = entry.deferred_free_s_per_block_median
    same = [a["table_digest"] == b["table_digest"] for a, b in zip(rounds, base)]
    # What every allocation policy must keep: the same prefix-cache hits, the same
    # blocks evicted in the same order, the same preemptions.
    equal = {key: sum(all(a.get(f) == b.get(f) for f in fs) for a, b in zip(rounds, base))
             for key, fs in CACHE_EQUALITY.items()}
    return VersusVanilla(
        sched_cpu_ratio_vs_vanilla=entry.sched_cpu_s_per_step / bcpu if bcpu else None,
        drain_cpu_ratio_vs_vanilla=drain / bdrain if bdrain else None,
        deferred_free_ratio_vs_vanilla=med / bmed if med and bmed else None,
        **equal,
        rounds_compared=min(len(rounds), len(base)),
        rounds_identical_to_vanilla=sum(same),
        first_round_differing_from_vanilla=next((i for i, s in enumerate(same) if not s), None),
        hit_tokens_ratio_vs_vanilla=_ratio(sum(r["prefix_cache_hit_tokens"] for r in rounds),
                                           sum(r["prefix_cache_hit_tokens"] for r in base)),
        prompt_descriptors_ratio_vs_vanilla=_ratio(entry.prompt_descriptors_total,
                                                   sum(r.get("prompt_descriptors_total", 0) for r in base)),
        offload_copies_ratio_vs_vanilla=_ratio(entry.offload_copies_total,
                                               _total_if_any(base, "offload_copies_total")),
        pd_descriptors_ratio_vs_vanilla=_ratio(entry.pd_descriptors_total,
                                               _total_if_any(base, "pd_descriptors_total")),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(results: dict[str, Any]) -> dict[str, Any]:
    """``comparison`` of the report: per mode that ran, its :class:`ModeComparison`
    (JSON form), with vanilla's and kvpool's runs as references.

    Args:
        results: the report's ``modes``: mode name -> ``{"info", "rounds"}`` or
            ``{"skipped"}`` (skipped modes are left out).
    """
    modes = {m: r["rounds"] for m, r in results.items() if "rounds" in r}
    base = modes.get("vanilla")
    out = {}
    for mode, rounds in modes.items():
        entry = _aggregate(rounds)
        if base is not None and mode != "vanilla":
            entry.vs_vanilla = _versus(rounds, base, entry)
        out[mode] = entry
    for mode, versus in versus_immediate_order(modes).items():
        out[mode].vs_immediate_order = versus
    ref = out["kvpool"].sched_cpu_s_per_step if "kvpool" in out else None
    for mode, entry in out.items():
        if mode != "kvpool" and ref:
            entry.sched_cpu_ratio_vs_kvpool = entry.sched_cpu_s_per_step / ref
    return {mode: entry.to_json() for mode, entry in out.items()}
