"""The replay's results, and with them the JSON schema of ``--json``.

Each dataclass is one object of the report; ``to_json()`` gives its JSON form, keys in
field order. docs/replay.md ("What is measured") defines each field; the names here are
the JSON keys. Fields marked *optional* appear only when set (``None`` omitted), fields
marked *window* only in a continuous workload's rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

_OPTIONAL = {"optional": True}
_WINDOW = {"window": True}
#: Comparison fields added with the transfer figures: written after the others.
_TRANSFER = {"transfer": True}


@dataclass
class RoundResult:
    """``modes[mode]["rounds"][i]``: one round (a continuous workload: one window of
    engine steps, the *window* fields added)."""

    round: int
    num_requests: int
    arrivals: int | None = field(default=None, metadata=_WINDOW)
    finished: int | None = field(default=None, metadata=_WINDOW)
    num_steps: int = 0
    idle_steps: int | None = field(default=None, metadata=_WINDOW)
    in_flight_min: int | None = field(default=None, metadata=_WINDOW)
    in_flight_max: int | None = field(default=None, metadata=_WINDOW)
    in_flight_mean: float | None = field(default=None, metadata=_WINDOW)
    running_min: int | None = field(default=None, metadata=_WINDOW)
    running_max: int | None = field(default=None, metadata=_WINDOW)
    contiguity: float | None = None
    table_contiguity: float | None = None
    mean_run_length: float | None = None
    prompt_descending: float | None = None
    sched_cpu_s_per_step: float = 0.0
    sched_cpu_s: float = 0.0
    prefill_sched_cpu_s: float = 0.0
    prompt_blocks: int = 0
    distinct_blocks: int = 0
    max_block_id: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    evictions: int = 0
    eviction_digest: str = ""
    preemptions: int = 0
    deferred_frees: int = 0
    deferred_blocks: int = 0
    drain_calls: int = 0
    drain_cpu_s: float = 0.0
    drain_cpu_s_per_step: float = 0.0
    defer_push_s: float = 0.0
    #: Push (at finish) + drain (after the fence step) per deferred block.
    deferred_free_s_per_block: float | None = None
    free_blocks_after: int = 0
    #: Blocks still held after every request finished (null block excluded): 0 unless
    #: the pool loses blocks. A window: 0 (blocks are in use mid-stream; the drain checks).
    leaked_blocks: int = 0
    table_digest: str = ""
    wall_s: float = 0.0
    #: Transfer figures (docs/replay.md, "Transfer figures"). The prompts counted
    #: (those of ``contiguity``), and per prompt the descriptors of its prompt blocks
    #: summed over KV cache groups: runs of ids ascending by exactly 1 (vLLM PR #55841),
    #: nearest-rank median / p90, maximum, total; the total per KV cache group.
    prompts: int = 0
    prompt_descriptors_median: int | None = None
    prompt_descriptors_p90: int | None = None
    prompt_descriptors_max: int | None = None
    prompt_descriptors_total: int = 0
    prompt_descriptors_by_group: list[int] = field(default_factory=list)
    #: The same prompts with each one's blocks in ascending id order
    #: (``metrics.sorted_descriptors``, the fewest descriptors any placement of the
    #: blocks it holds can post): median and total.
    prompt_descriptors_sorted_median: int | None = None
    prompt_descriptors_sorted_total: int = 0
    #: Offloading (vLLM PR #35990): blocks that became full (cached), the steps that
    #: cached any, and per such step the copies (runs among its new full blocks, per
    #: request and group). ``None`` without prefix caching (vLLM caches no block).
    offload_blocks: int | None = None
    offload_steps: int | None = None
    offload_copies_per_step_median: int | None = None
    offload_copies_per_step_p90: int | None = None
    offload_copies_per_step_max: int | None = None
    offload_copies_total: int | None = None
    #: The P/D workload (``pd``) only: the prefill side's round (its own scheduler and
    #: pool, the same requests to their first token) and the transfer between the two
    #: sides: per prompt, runs in which both tables ascend by exactly 1 (vLLM PR #55841).
    prefill_prompt_descriptors_median: int | None = field(default=None, metadata=_OPTIONAL)
    prefill_prompt_descriptors_total: int | None = field(default=None, metadata=_OPTIONAL)
    prefill_evictions: int | None = field(default=None, metadata=_OPTIONAL)
    prefill_prefix_cache_hit_tokens: int | None = field(default=None, metadata=_OPTIONAL)
    prefill_preemptions: int | None = field(default=None, metadata=_OPTIONAL)
    prefill_leaked_blocks: int | None = field(default=None, metadata=_OPTIONAL)
    pd_descriptors_median: int | None = field(default=None, metadata=_OPTIONAL)
    pd_descriptors_p90: int | None = field(default=None, metadata=_OPTIONAL)
    pd_descriptors_max: int | None = field(default=None, metadata=_OPTIONAL)
    pd_descriptors_total: int | None = field(default=None, metadata=_OPTIONAL)
    #: ``--nixl`` only: each prompt read by the decode side through the real NIXL
    #: (:mod:`kvpool.tools.replay.nixl`): NIXL's own descriptor count (``descCount``, every KV
    #: region), posting time and completion time (microseconds, UCX over loopback TCP).
    nixl_descriptors_median: int | None = field(default=None, metadata=_OPTIONAL)
    nixl_descriptors_p90: int | None = field(default=None, metadata=_OPTIONAL)
    nixl_descriptors_total: int | None = field(default=None, metadata=_OPTIONAL)
    nixl_post_us_median: float | None = field(default=None, metadata=_OPTIONAL)
    nixl_post_us_total: float | None = field(default=None, metadata=_OPTIONAL)
    nixl_xfer_us_median: float | None = field(default=None, metadata=_OPTIONAL)
    nixl_xfer_us_total: float | None = field(default=None, metadata=_OPTIONAL)
    nixl_regions: int | None = field(default=None, metadata=_OPTIONAL)
    #: ``--save-tables``: ``{"prompt": [...], "finished": [...]}``, one ``list[int]`` per request
    #: (P/D: also ``"prefill_prompt"``, the prefill side's prompt tables).
    tables: dict[str, list[list[int]]] | None = field(default=None, metadata=_OPTIONAL)
    #: The calls made before this round (rounds >= 1; the reorder in ``kvpool+reorder``).
    reset_ok: bool | None = field(default=None, metadata=_OPTIONAL)
    reset_cpu_s: float | None = field(default=None, metadata=_OPTIONAL)
    reorder_ok: bool | None = field(default=None, metadata=_OPTIONAL)
    reorder_cpu_s: float | None = field(default=None, metadata=_OPTIONAL)
    #: ``--model`` runs: per KV cache group (vLLM's order) ``{"group", "kind", "block_size",
    #: "contiguity", "table_contiguity", "mean_run_length", "prompt_blocks",
    #: "live_blocks_per_prompt"}`` over each table's non-null blocks
    #: (``metrics.group_figures``; docs/replay.md, "Model shapes"), with the group's
    #: ``table_digest``, ``freed_blocks`` and ``free_order_digest`` (``free_order``).
    by_group: list[dict[str, Any]] | None = field(default=None, metadata=_OPTIONAL)
    #: ``--model`` runs: digest of the pool's whole free queue after the round, in order.
    free_queue_digest: str | None = field(default=None, metadata=_OPTIONAL)
    #: Not in the JSON: whether the *window* fields are.
    window: bool = field(default=False, repr=False, metadata={"internal": True})

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("internal") or (f.metadata.get("window") and not self.window):
                continue
            if f.metadata.get("optional") and value is None:
                continue
            out[f.name] = value
        return out


@dataclass
class DrainResult:
    """``modes[mode]["info"]["drain"]`` of a continuous workload: the steps after the
    last window, until every request finished."""

    steps: int
    sched_cpu_s: float
    finished: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    evictions: int
    eviction_digest: str
    preemptions: int
    free_blocks_after: int
    leaked_blocks: int
    horizon_steps: int

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ModeInfo:
    """``modes[mode]["info"]``: what the mode's scheduler was built from."""

    kvpool_installed: bool | None
    scheduler_class: str
    block_pool_class: str
    free_block_queue_class: str
    defer_block_free: bool
    reorder_api: str | None
    num_blocks: int
    #: kvpool modes only: ``install(allocation=...)``, and the pool's own ``allocation``.
    allocation: str | None = None
    pool_allocation: str | None = None
    #: ``kvpool+contiguous+wW`` modes only: the pool's LRU window (blocks).
    lru_window: int | None = None
    #: Continuous workloads only.
    drain: DrainResult | None = None
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                               if f.name not in ("allocation", "pool_allocation", "lru_window", "drain",
                                                 "wall_s")}
        if self.allocation is not None:
            out["allocation"] = self.allocation
            out["pool_allocation"] = self.pool_allocation
        if self.lru_window:
            out["lru_window"] = self.lru_window
        if self.drain is not None:
            out["drain"] = self.drain.to_json()
        out["wall_s"] = self.wall_s
        return out


@dataclass
class ModeResult:
    """``modes[mode]``: ``{"info", "rounds"}``, or ``{"skipped": reason}`` when the mode
    could not run here."""

    info: ModeInfo | None = None
    rounds: list[RoundResult] = field(default_factory=list)
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {"info": self.info.to_json(), "rounds": [r.to_json() for r in self.rounds]}


@dataclass
class VersusVanilla:
    """The part of a :class:`ModeComparison` that compares a mode with vanilla's run."""

    sched_cpu_ratio_vs_vanilla: float | None
    drain_cpu_ratio_vs_vanilla: float | None
    deferred_free_ratio_vs_vanilla: float | None
    #: Rounds in which prefix-cache hits, evictions (count and digest) and preemptions
    #: all equal vanilla's; then each item alone.
    rounds_cache_equal_to_vanilla: int
    rounds_hits_equal_to_vanilla: int
    rounds_evictions_equal_to_vanilla: int
    rounds_preemptions_equal_to_vanilla: int
    rounds_compared: int
    #: Rounds whose ``table_digest`` equals vanilla's, and the first that does not.
    rounds_identical_to_vanilla: int
    first_round_differing_from_vanilla: int | None
    #: Prefix-cache hit tokens over all rounds / vanilla's (1.0 when the cache is kept).
    hit_tokens_ratio_vs_vanilla: float | None = None
    #: Total prompt descriptors / vanilla's, offloading copies / vanilla's.
    prompt_descriptors_ratio_vs_vanilla: float | None = field(default=None, metadata=_TRANSFER)
    offload_copies_ratio_vs_vanilla: float | None = field(default=None, metadata=_TRANSFER)
    #: P/D workload only: ``pd_descriptors_total`` / vanilla's.
    pd_descriptors_ratio_vs_vanilla: float | None = field(default=None, metadata={**_TRANSFER, **_OPTIONAL})


@dataclass
class ModeComparison:
    """``comparison[mode]``: one mode's rounds aggregated, and compared with vanilla's
    (absent for vanilla itself) and kvpool's CPU (absent for kvpool)."""

    sched_cpu_s_per_step: float
    drain_cpu_s_per_step: float
    #: Median over rounds: robust to a round disturbed by other load.
    deferred_free_s_per_block_median: float | None
    min_contiguity: float | None
    mean_contiguity: float | None
    max_leaked_blocks: int
    vs_vanilla: VersusVanilla | None = None
    sched_cpu_ratio_vs_kvpool: float | None = None
    #: With the ``vanilla+immediate-order`` reference in the run: rounds equal to it
    #: (``free_order.versus_immediate_order``).
    vs_immediate_order: dict[str, Any] | None = field(default=None, metadata=_OPTIONAL)
    #: Over all rounds: prompt descriptors (sum, per prompt, the largest of one prompt),
    #: offloading copies (sum) and blocks per copy (1.0: no two blocks coalesced).
    prompt_descriptors_total: int = field(default=0, metadata=_TRANSFER)
    prompt_descriptors_per_prompt: float | None = field(default=None, metadata=_TRANSFER)
    prompt_descriptors_max: int | None = field(default=None, metadata=_TRANSFER)
    offload_copies_total: int | None = field(default=None, metadata=_TRANSFER)
    offload_blocks_per_copy: float | None = field(default=None, metadata=_TRANSFER)
    #: P/D workload only: descriptors moved prefill -> decode over all rounds, and the
    #: prefill side's own prompt descriptors.
    pd_descriptors_total: int | None = field(default=None, metadata={**_TRANSFER, **_OPTIONAL})
    prefill_prompt_descriptors_total: int | None = field(default=None, metadata={**_TRANSFER, **_OPTIONAL})
    #: ``--nixl`` only: NIXL's descriptors and posting time over all rounds.
    nixl_descriptors_total: int | None = field(default=None, metadata={**_TRANSFER, **_OPTIONAL})
    nixl_post_us_total: float | None = field(default=None, metadata={**_TRANSFER, **_OPTIONAL})

    def to_json(self) -> dict[str, Any]:
        added = [f for f in fields(self) if f.metadata.get("transfer")]
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("vs_vanilla", "sched_cpu_ratio_vs_kvpool", "vs_immediate_order")
               and f not in added}
        vs = [] if self.vs_vanilla is None else fields(self.vs_vanilla)
        out.update((f.name, getattr(self.vs_vanilla, f.name)) for f in vs if not f.metadata.get("transfer"))
        if self.sched_cpu_ratio_vs_kvpool is not None:
            out["sched_cpu_ratio_vs_kvpool"] = self.sched_cpu_ratio_vs_kvpool
        shown = [(f, getattr(self, f.name)) for f in added]
        shown += [(f, getattr(self.vs_vanilla, f.name)) for f in vs if f.metadata.get("transfer")]
        # (an optional field, the P/D ones, only when set)
        out.update((f.name, v) for f, v in shown if v is not None or not f.metadata.get("optional"))
        if self.vs_immediate_order is not None:
            out["vs_immediate_order"] = self.vs_immediate_order
        return out


@dataclass
class RunConfig:
    """``config``: what the run was asked for, and where it ran. (``workload`` is
    :meth:`~.workloads.Workload.to_json`, ``comparison`` per mode a
    :class:`ModeComparison`, ``verdict`` the summary lines of :func:`~.report.verdict`.)"""

    num_blocks: int
    block_size: int
    seed: int
    scale: float
    model: str
    max_model_len: int
    modes_requested: list[str]
    #: ``["python", "-m", "kvpool", "replay", ...]``
    argv: list[str]
    wall_s: float
    #: ``{"python", "machine", "vllm_version", "kvpool_version"}``, merged into the object.
    versions: dict[str, Any] = field(default_factory=dict)
    #: ``--model`` runs: ``KvGeometry.to_json()``, the KV cache vLLM resolved (after the
    #: versions; absent otherwise).
    kv_cache_geometry: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("versions", "kv_cache_geometry")}
        out.update(self.versions)
        if self.kv_cache_geometry is not None:
            out["kv_cache_geometry"] = self.kv_cache_geometry
        return out
