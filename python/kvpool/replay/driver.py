"""Drive vLLM 0.33.0's real ``Scheduler`` and ``KVCacheManager`` through a workload.

No model runs. Each engine step is ``scheduler.schedule()``, a stand-in model that
builds a ``ModelRunnerOutput`` (one sampled token per scheduled request that is past
its prefill; the stop token once the request's ``output_len`` is reached), and
``scheduler.update_from_output()``. With ``EngineSpec.async_scheduling`` the loop keeps
two batches in flight the way ``EngineCore.step_with_batch_queue`` does (step N+1 is
scheduled before step N's output is processed), so vLLM's deferred block frees
(``defer_block_free``, ``deferred_frees``, ``_drain_deferred_frees``) run as in a
deployment.

Modes (each builds a fresh scheduler):

- ``vanilla``: vLLM's own ``BlockPool``; kvpool is uninstalled first if it is installed.
- ``kvpool``: ``kvpool.install()``; no reorder.
- ``kvpool+reorder``: ``kvpool.install()``; between rounds, after
  ``scheduler.reset_prefix_cache()``, ``reset_free_block_queue_order()`` (RFC Option A)
  on the scheduler, else the KV cache manager, else its block pool, whichever has it.

Every mode calls ``scheduler.reset_prefix_cache()`` between rounds (what the RFC's
driver does after a weight update). vLLM must be imported only after
:func:`kvpool.hf_offline.offline_hf_cache` has been entered (see :mod:`.cli`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.replay import metrics
from kvpool.replay.workloads import STOP_TOKEN_ID, TOKEN_HI, TOKEN_LO, Workload

MODES = ("vanilla", "kvpool", "kvpool+reorder")

_thread_time = time.thread_time
_perf_counter = time.perf_counter


class ModeUnavailable(RuntimeError):
    """A requested mode cannot run here (kvpool not importable, no reorder API)."""


@dataclass(frozen=True)
class PoolSpec:
    num_blocks: int = 85_000
    block_size: int = 32


def _kvpool_api():
    try:
        from kvpool import install, is_installed, uninstall
    except ImportError as e:
        raise ModeUnavailable(
            f"kvpool is not importable ({e}); build it into the venv with "
            "`bash scripts/bootstrap.sh`"
        ) from e
    return install, uninstall, is_installed


def kvpool_unavailable_reason() -> str | None:
    """``None`` when ``kvpool.install`` can be imported, else why not."""
    try:
        _kvpool_api()
    except ModeUnavailable as e:
        return str(e)
    return None


def _kvpool_installed() -> bool | None:
    try:
        _, _, is_installed = _kvpool_api()
    except ModeUnavailable:
        return None
    return bool(is_installed())


def set_mode(mode: str) -> None:
    """Install or uninstall kvpool for ``mode`` (a member of :data:`MODES`)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    if mode == "vanilla":
        try:
            _, uninstall, is_installed = _kvpool_api()
        except ModeUnavailable:
            return  # kvpool cannot be installed if it cannot be imported
        if is_installed():
            uninstall()
        if is_installed():
            raise RuntimeError("kvpool.uninstall() left kvpool installed")
        return
    install, _, is_installed = _kvpool_api()
    install()
    if not is_installed():
        raise RuntimeError("kvpool.install() returned but kvpool.is_installed() is False")


def restore_vanilla() -> None:
    """Uninstall kvpool if it is importable and installed."""
    try:
        _, uninstall, is_installed = _kvpool_api()
    except ModeUnavailable:
        return
    if is_installed():
        uninstall()


def _native_context(model: str) -> int | None:
    from kvpool.hf_offline import CONFIG_ROOT

    cfg = CONFIG_ROOT / model.replace("/", "--", 1) / "config.json"
    try:
        return int(json.loads(cfg.read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return None


@contextmanager
def _quiet_config_warnings():
    """Building ModelConfig offline logs warnings that do not apply to a replay (no
    weights to find, no Triton for a model runner); keep errors only, while building."""
    loggers = [logging.getLogger(name) for name in ("vllm", "transformers", "huggingface_hub")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def build_scheduler(workload: Workload, pool: PoolSpec):
    """A vLLM ``Scheduler`` (``AsyncScheduler`` for async workloads) without a model.

    Mirrors ``create_scheduler`` in vLLM 0.33.0's ``tests/v1/core/utils.py``: one
    full-attention KV cache group of ``pool.num_blocks`` blocks of ``pool.block_size``
    tokens. When the workload needs a longer context than the shipped model config
    declares, ``hf_overrides`` raises ``max_position_embeddings`` (only the scheduler's
    length checks read it; nothing runs the model).
    """
    with _quiet_config_warnings():
        return _build_scheduler(workload, pool)


def _build_scheduler(workload: Workload, pool: PoolSpec):
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    eng = workload.engine
    max_model_len = workload.max_model_len()
    overrides = {}
    native = _native_context(eng.model)
    if native is not None and max_model_len > native:
        overrides["max_position_embeddings"] = max_model_len
    model_config = ModelConfig(
        model=eng.model,
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        hf_overrides=overrides,
    )
    max_num_batched_tokens = eng.max_num_batched_tokens or max_model_len
    if not eng.enable_chunked_prefill:
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=eng.enable_chunked_prefill,
        async_scheduling=eng.async_scheduling,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=pool.block_size,
        cache_dtype="auto",
        enable_prefix_caching=eng.enable_prefix_caching,
    )
    kv_transfer_config = None
    if eng.kv_connector is not None:
        kv_transfer_config = KVTransferConfig(kv_connector=eng.kv_connector, kv_role=eng.kv_role)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
        kv_transfer_config=kv_transfer_config,
    )
    if eng.async_scheduling:
        # CpuPlatform.check_and_update_config forces async_scheduling off ("not
        # required on CPU"); a GPU platform keeps it. Restore it so that
        # max_concurrent_batches == 2 and the scheduler's own gate turns
        # defer_block_free on, as on a GPU decode instance.
        vllm_config.scheduler_config.async_scheduling = True
    cache_config.num_gpu_blocks = pool.num_blocks
    spec = FullAttentionSpec(
        block_size=pool.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=torch.bfloat16,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=pool.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    register_all_kvcache_specs(vllm_config)
    cls = AsyncScheduler if eng.async_scheduling else Scheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=pool.block_size,
        log_stats=False,
    )
    if eng.async_scheduling and not scheduler.defer_block_free:
        raise RuntimeError(
            "async workload but Scheduler.defer_block_free is off "
            f"(max_concurrent_batches={vllm_config.max_concurrent_batches}, "
            f"kv consumer={kv_transfer_config and kv_transfer_config.is_kv_consumer})"
        )
    return scheduler


def _reorder_api(scheduler) -> tuple[Callable[[], bool], str]:
    owners = (scheduler, scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool)
    for owner in owners:
        fn = getattr(owner, "reset_free_block_queue_order", None)
        if callable(fn):
            return fn, f"{type(owner).__name__}.reset_free_block_queue_order"
    raise ModeUnavailable(
        "no reset_free_block_queue_order on the Scheduler, KVCacheManager or "
        f"{type(owners[-1]).__qualname__} (is kvpool installed?)"
    )


def _qualname(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class _RoundProbe:
    """Per-round instrumentation hooked onto one scheduler instance.

    Wraps ``scheduler._free_request_blocks`` (to read a finishing request's block table
    before it is freed, and whether the free is deferred) and
    ``scheduler._drain_deferred_frees`` (CPU time of the drain). The time spent reading
    tables is accumulated in ``probe_cpu`` and subtracted from the scheduler's CPU time.
    """

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.reset()
        orig_free = scheduler._free_request_blocks
        orig_drain = scheduler._drain_deferred_frees
        kv = scheduler.kv_cache_manager

        def _free_request_blocks(request):
            t0 = _thread_time()
            rid = request.request_id
            table = list(kv.get_block_ids(rid)[0])
            self.finished_tables[rid] = table
            self.preemptions += request.num_preemptions
            deferred = scheduler.defer_block_free and not scheduler._request_blocks_can_be_freed(request)
            if deferred:
                self.deferred_frees += 1
                self.deferred_blocks += len(table)
            self.probe_cpu += _thread_time() - t0
            if not deferred:
                orig_free(request)
                return
            # Deferring costs work at push time too (kvpool converts blocks to native
            # handles there), so push + drain is the cost of one deferred free.
            t1 = _perf_counter()
            orig_free(request)
            self.push_cpu += _perf_counter() - t1

        def _drain_deferred_frees():
            n0 = len(scheduler.deferred_frees)
            # perf_counter (vDSO) rather than thread_time (a syscall on Linux): most
            # drains take a microsecond or less, and the timer must not dominate them.
            t0 = _perf_counter()
            orig_drain()
            self.drain_cpu += _perf_counter() - t0
            self.drain_calls += 1
            self.drained_entries += n0 - len(scheduler.deferred_frees)

        scheduler._free_request_blocks = _free_request_blocks
        scheduler._drain_deferred_frees = _drain_deferred_frees

    def reset(self) -> None:
        self.finished_tables: dict[str, list[int]] = {}
        self.preemptions = 0
        self.deferred_frees = 0
        self.deferred_blocks = 0
        self.drain_cpu = 0.0
        self.push_cpu = 0.0
        self.drain_calls = 0
        self.drained_entries = 0
        self.probe_cpu = 0.0


def _prompt_tokens(workload: Workload, rnd: int, seed: int) -> dict[str, list[int]]:
    """Token ids per request id of round ``rnd``; a prefix group shares one list's prefixes."""
    specs = workload.round_requests(rnd)
    group_len: dict[str, int] = {}
    for s in specs:
        if s.prefix_group is not None:
            group_len[s.prefix_group] = max(group_len.get(s.prefix_group, 0), s.prompt_len)
    group_tokens = {}
    for k, (g, n) in enumerate(group_len.items()):
        rng = np.random.default_rng([seed, rnd, 0, k])
        group_tokens[g] = rng.integers(TOKEN_LO, TOKEN_HI, size=n).tolist()
    out = {}
    for i, s in enumerate(specs):
        rid = f"{rnd}-{i}"
        if s.prefix_group is None:
            rng = np.random.default_rng([seed, rnd, 1, i])
            out[rid] = rng.integers(TOKEN_LO, TOKEN_HI, size=s.prompt_len).tolist()
        else:
            toks = group_tokens[s.prefix_group]
            out[rid] = toks if len(toks) == s.prompt_len else toks[: s.prompt_len]
    return out


_none_hash_ready = False


def _make_requests(workload: Workload, rnd: int, seed: int, block_size: int, max_model_len: int):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _none_hash_ready
    if not _none_hash_ready:  # once per process, as EngineCore does at startup
        init_none_hash(sha256)
        _none_hash_ready = True
    hasher = get_request_block_hasher(block_size, sha256)
    tokens = _prompt_tokens(workload, rnd, seed)
    reqs = []
    for i, s in enumerate(workload.round_requests(rnd)):
        rid = f"{rnd}-{i}"
        params = SamplingParams(
            max_tokens=max_model_len - s.prompt_len,
            stop_token_ids=[STOP_TOKEN_ID],
        )
        req = Request(
            request_id=rid,
            prompt_token_ids=tokens[rid],
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        reqs.append((s, req))
    return reqs


def _digest(prompt_tables: dict[str, list[int]], finished_tables: dict[str, list[int]]) -> str:
    """Hash of a round's block tables keyed by request index within the round, so that
    the same shape allocated the same way digests equally in any round and mode."""
    h = hashlib.sha1()
    for name, tables in (("p", prompt_tables), ("f", finished_tables)):
        for rid in sorted(tables, key=lambda r: int(r.rsplit("-", 1)[1])):
            h.update(f"{name}{rid.rsplit('-', 1)[1]}:".encode())
            h.update(np.asarray(tables[rid], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def run_round(scheduler, probe: _RoundProbe, workload: Workload, rnd: int, seed: int, pool: PoolSpec) -> dict[str, Any]:
    """Run round ``rnd`` to completion on ``scheduler``; return its metrics (see docs/replay.md)."""
    from vllm.v1.outputs import ModelRunnerOutput

    max_model_len = workload.max_model_len()
    depth = 2 if workload.engine.async_scheduling else 1
    bs = pool.block_size
    kv = scheduler.kv_cache_manager

    usable = pool.num_blocks - 1  # block 0 is the null block
    for spec in workload.round_requests(rnd):
        need = math.ceil((spec.prompt_len + spec.output_len) / bs)
        if need > usable:
            raise ValueError(
                f"round {rnd}: a request of {spec.prompt_len} prompt + {spec.output_len} output "
                f"tokens needs {need} blocks of {bs} tokens, but the pool has {usable} usable "
                f"blocks; raise --num-blocks or shorten the request (--scale)")
    specs_reqs = _make_requests(workload, rnd, seed, bs, max_model_len)
    target = {req.request_id: s.output_len for s, req in specs_reqs}
    salt = {req.request_id: (i * 104_729) for i, (_, req) in enumerate(specs_reqs)}
    pending = deque(sorted(specs_reqs, key=lambda sr: sr[0].arrival_step))
    awaiting_prompt = {req.request_id: (req, math.ceil(s.prompt_len / bs)) for s, req in specs_reqs}
    prompt_tables: dict[str, list[int]] = {}
    probe.reset()
    requests = scheduler.requests
    span = TOKEN_HI - TOKEN_LO

    def model_output(so) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = requests.get(rid)
            if req is None or req.is_finished():
                sampled.append([TOKEN_LO])  # over-scheduled step of a finished request
            elif req.is_prefill_chunk:
                sampled.append([])
            else:
                n = req.num_output_tokens
                tok = STOP_TOKEN_ID if n + 1 >= target[rid] else TOKEN_LO + (n * 7919 + salt[rid]) % span
                sampled.append([tok])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )

    gc.collect()
    sched_cpu = prefill_cpu = 0.0
    num_steps = 0
    step_clock = 0
    batch_queue: deque = deque()
    wall0 = time.perf_counter()
    idle_steps = 0  # consecutive steps that scheduled nothing with nothing in flight
    while True:
        while pending and pending[0][0].arrival_step <= step_clock:
            scheduler.add_request(pending.popleft()[1])
        if scheduler.has_requests():
            probe_before = probe.probe_cpu
            t0 = _thread_time()
            so = scheduler.schedule()
            if so.total_num_scheduled_tokens == 0 and not batch_queue:
                idle_steps += 1
                if idle_steps > 1000:
                    raise RuntimeError(
                        f"round {rnd}: the scheduler made no progress for {idle_steps} steps "
                        f"with {len(scheduler.waiting)} request(s) waiting; the pool "
                        f"({pool.num_blocks} blocks of {bs} tokens) is too small for this "
                        "round's concurrent requests. Raise --num-blocks.")
            else:
                idle_steps = 0
            dt = _thread_time() - t0 - (probe.probe_cpu - probe_before)
            sched_cpu += dt
            num_steps += 1
            step_clock += 1
            if so.scheduled_new_reqs:
                prefill_cpu += dt
            if awaiting_prompt:
                for rid in so.num_scheduled_tokens:
                    entry = awaiting_prompt.get(rid)
                    if entry is not None and entry[0].num_computed_tokens >= entry[0].num_prompt_tokens:
                        prompt_tables[rid] = list(kv.get_block_ids(rid)[0][: entry[1]])
                        del awaiting_prompt[rid]
            batch_queue.appendleft(so)
            if len(batch_queue) < depth and (so.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                continue
        if not batch_queue:
            if pending:
                step_clock = pending[0][0].arrival_step  # idle until the next arrival
                continue
            break
        so = batch_queue.pop()
        mro = model_output(so)
        probe_before = probe.probe_cpu
        t0 = _thread_time()
        scheduler.update_from_output(so, mro)
        sched_cpu += _thread_time() - t0 - (probe.probe_cpu - probe_before)
    wall = time.perf_counter() - wall0

    if scheduler.has_requests() or getattr(scheduler, "deferred_frees", None):
        raise RuntimeError(f"round {rnd}: requests or deferred frees left after the last step")
    if awaiting_prompt:
        raise RuntimeError(f"round {rnd}: prompts never fully allocated: {sorted(awaiting_prompt)[:5]}")

    free_after = kv.block_pool.get_num_free_blocks()
    ptables = [prompt_tables[rid] for rid in sorted(prompt_tables)]
    ftables = [probe.finished_tables[rid] for rid in sorted(probe.finished_tables)]
    all_ids = {b for t in ftables for b in t} | {b for t in ptables for b in t}
    steps = max(num_steps, 1)
    return {
        "round": rnd,
        "num_requests": len(specs_reqs),
        "num_steps": num_steps,
        "contiguity": metrics.contiguity(ptables),
        "table_contiguity": metrics.contiguity(ftables),
        "mean_run_length": metrics.mean_run_length(ptables),
        "prompt_descending": metrics.descending_fraction(ptables),
        "sched_cpu_s_per_step": sched_cpu / steps,
        "sched_cpu_s": sched_cpu,
        "prefill_sched_cpu_s": prefill_cpu,
        "prompt_blocks": sum(len(t) for t in ptables),
        "distinct_blocks": len(all_ids),
        "max_block_id": max(all_ids, default=0),
        "preemptions": probe.preemptions,
        "deferred_frees": probe.deferred_frees,
        "deferred_blocks": probe.deferred_blocks,
        "drain_calls": probe.drain_calls,
        "drain_cpu_s": probe.drain_cpu,
        "drain_cpu_s_per_step": probe.drain_cpu / steps,
        "defer_push_s": probe.push_cpu,
        # Push (at finish) + drain (after the fence step) per deferred block.
        "deferred_free_s_per_block": (
            (probe.push_cpu + probe.drain_cpu) / probe.deferred_blocks if probe.deferred_blocks else None
        ),
        "free_blocks_after": free_after,
        # Blocks still held after every request finished (null block excluded): 0
        # unless the pool loses blocks.
        "leaked_blocks": pool.num_blocks - 1 - free_after,
        "table_digest": _digest(prompt_tables, probe.finished_tables),
        "wall_s": wall,
    }


def _warmup(workload: Workload, pool: PoolSpec, seed: int) -> None:
    """Run a throwaway scheduler through a few short requests of the same engine shape,
    so that one-time costs (lazy imports, first-call paths, allocator growth) do not land
    in the first measured round of whichever mode runs first."""
    first = workload.round_requests(0)[:4]
    tiny = replace(
        workload,
        requests=[replace(r, prompt_len=min(r.prompt_len, 4 * pool.block_size + 1),
                          output_len=min(r.output_len, 2 * pool.block_size), arrival_step=0)
                  for r in first],
    )
    scheduler = build_scheduler(tiny, PoolSpec(min(pool.num_blocks, 4096), pool.block_size))
    run_round(scheduler, _RoundProbe(scheduler), tiny, 0, seed, PoolSpec(min(pool.num_blocks, 4096), pool.block_size))


def run_mode(
    mode: str,
    workload: Workload,
    pool: PoolSpec,
    seed: int,
    on_round: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Run every round of ``workload`` in ``mode`` on a fresh scheduler.

    Returns:
        ``{"info": {...}, "rounds": [per-round dict, ...]}`` (keys in docs/replay.md).

    Raises:
        ModeUnavailable: kvpool is needed but not importable, or has no reorder API.
    """
    set_mode(mode)
    wall0 = time.perf_counter()
    _warmup(workload, pool, seed)
    scheduler = build_scheduler(workload, pool)
    if mode == "vanilla" and _kvpool_installed():
        # A vllm.general_plugins entry point may have installed kvpool while the
        # config was built; vanilla must run vLLM's own classes.
        restore_vanilla()
        scheduler = build_scheduler(workload, pool)
    reorder, reorder_name = (None, None)
    if mode == "kvpool+reorder":
        reorder, reorder_name = _reorder_api(scheduler)
    block_pool = scheduler.kv_cache_manager.block_pool
    info = {
        "kvpool_installed": _kvpool_installed(),
        "scheduler_class": _qualname(scheduler),
        "block_pool_class": _qualname(block_pool),
        "free_block_queue_class": _qualname(getattr(block_pool, "free_block_queue", None)),
        "defer_block_free": bool(scheduler.defer_block_free),
        "reorder_api": reorder_name,
        "num_blocks": pool.num_blocks,
    }
    probe = _RoundProbe(scheduler)
    rounds = []
    for rnd in range(workload.num_rounds):
        between = {}
        if rnd > 0:
            t0 = _thread_time()
            between["reset_ok"] = bool(scheduler.reset_prefix_cache())
            between["reset_cpu_s"] = _thread_time() - t0
            if reorder is not None:
                t0 = _thread_time()
                between["reorder_ok"] = bool(reorder())
                between["reorder_cpu_s"] = _thread_time() - t0
        stats = run_round(scheduler, probe, workload, rnd, seed, pool)
        stats.update(between)
        rounds.append(stats)
        if on_round is not None:
            on_round(mode, rnd)
    info["wall_s"] = time.perf_counter() - wall0
    return {"info": info, "rounds": rounds}


def run_replay(
    workload: Workload,
    pool: PoolSpec,
    modes: tuple[str, ...] = MODES,
    seed: int = 0,
    on_round: Callable[[str, int], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """Run ``workload`` in each of ``modes``; kvpool is uninstalled afterwards.

    Returns:
        ``{"modes": {mode: {"info", "rounds"} | {"skipped": reason}}}``; a mode that
        cannot run (:class:`ModeUnavailable`) is reported as skipped, not raised.
    """
    results: dict[str, Any] = {}
    try:
        for mode in modes:
            try:
                results[mode] = run_mode(mode, workload, pool, seed, on_round)
            except ModeUnavailable as e:
                results[mode] = {"skipped": str(e)}
                if on_skip is not None:
                    on_skip(mode, str(e))
    finally:
        restore_vanilla()
    return {"modes": results}


def _median(values) -> float | None:
    xs = sorted(v for v in values if v is not None)
    return xs[len(xs) // 2] if xs else None


def compare(results: dict[str, Any]) -> dict[str, Any]:
    """Cross-mode checks: kvpool's block tables equal vanilla's; CPU ratios vs vanilla."""
    modes = {m: r for m, r in results.items() if "rounds" in r}
    out: dict[str, Any] = {}
    base = modes.get("vanilla")
    for mode, res in modes.items():
        rounds = res["rounds"]
        steps = sum(r["num_steps"] for r in rounds)
        cpu = sum(r["sched_cpu_s"] for r in rounds)
        drain = sum(r["drain_cpu_s"] for r in rounds)
        contig = [r["contiguity"] for r in rounds if r["contiguity"] is not None]
        entry = {
            "sched_cpu_s_per_step": cpu / max(steps, 1),
            "drain_cpu_s_per_step": drain / max(steps, 1),
            # Median over rounds: robust to a round disturbed by other load.
            "deferred_free_s_per_block_median": _median(r["deferred_free_s_per_block"] for r in rounds),
            "min_contiguity": min(contig, default=None),
            "mean_contiguity": sum(contig) / len(contig) if contig else None,
            "max_leaked_blocks": max((r["leaked_blocks"] for r in rounds), default=0),
        }
        if base is not None and mode != "vanilla":
            bcpu = sum(r["sched_cpu_s"] for r in base["rounds"]) / max(
                sum(r["num_steps"] for r in base["rounds"]), 1
            )
            entry["sched_cpu_ratio_vs_vanilla"] = entry["sched_cpu_s_per_step"] / bcpu if bcpu else None
            bdrain = sum(r["drain_cpu_s"] for r in base["rounds"])
            entry["drain_cpu_ratio_vs_vanilla"] = drain / bdrain if bdrain else None
            bmed = _median(r["deferred_free_s_per_block"] for r in base["rounds"])
            med = entry["deferred_free_s_per_block_median"]
            entry["deferred_free_ratio_vs_vanilla"] = med / bmed if med and bmed else None
            same = [
                a["table_digest"] == b["table_digest"] for a, b in zip(rounds, base["rounds"])
            ]
            entry["rounds_identical_to_vanilla"] = sum(same)
            entry["first_round_differing_from_vanilla"] = next(
                (i for i, s in enumerate(same) if not s), None
            )
        out[mode] = entry
    return out


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
