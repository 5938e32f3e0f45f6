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
- ``kvpool+contiguous``: ``kvpool.install(allocation="contiguous")``: kvpool's
  contiguity-keeping allocation policy, no reset-time reorder.

Every mode calls ``scheduler.reset_prefix_cache()`` between the rounds of a round-based
workload (what the RFC's driver does after a weight update). A continuous workload
(``serving``) never drains: its rounds are windows of engine steps, with no reset.
vLLM must be imported only after :func:`kvpool.hf_offline.offline_hf_cache` has been
entered (see :mod:`.cli`).
"""

from __future__ import annotations

import gc
import hashlib
import inspect
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

from kvpool.errors import KvpoolError
from kvpool.replay import metrics
from kvpool.replay.workloads import STOP_TOKEN_ID, TOKEN_HI, TOKEN_LO, Workload

MODES = ("vanilla", "kvpool", "kvpool+reorder", "kvpool+contiguous")
#: ``kvpool.install(allocation=...)`` per kvpool mode: "vllm" is vLLM's exact order.
ALLOCATION = {"kvpool": "vllm", "kvpool+reorder": "vllm", "kvpool+contiguous": "contiguous"}

_thread_time = time.thread_time
_perf_counter = time.perf_counter


class ModeUnavailable(KvpoolError, RuntimeError):
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


def _install_kwargs(install, allocation: str) -> dict[str, Any]:
    """``install()`` keyword arguments that select ``allocation``.

    A kvpool without the allocation policy has no ``allocation`` parameter: vLLM's
    order is all it does, so the plain call is right for ``"vllm"``.

    Raises:
        ModeUnavailable: ``allocation`` is not ``"vllm"`` and ``install`` cannot take it.
    """
    try:
        params = inspect.signature(install).parameters
    except (TypeError, ValueError):  # no signature to read: assume the contract
        return {"allocation": allocation}
    if "allocation" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {"allocation": allocation}
    if allocation == "vllm":
        return {}
    raise ModeUnavailable(
        f"this kvpool build has no allocation policy: kvpool.install() takes no "
        f"allocation= argument, so allocation={allocation!r} cannot be selected "
        "(rebuild kvpool from a checkout that has it)"
    )


def mode_unavailable_reason(mode: str) -> str | None:
    """``None`` when ``mode`` can run here (kvpool importable, and for
    ``kvpool+contiguous`` an ``install()`` that takes ``allocation=``), else why not."""
    if mode == "vanilla":
        return None
    try:
        install, _, _ = _kvpool_api()
        _install_kwargs(install, ALLOCATION[mode])
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
    install, uninstall, is_installed = _kvpool_api()
    kwargs = _install_kwargs(install, ALLOCATION[mode])
    # The allocation policy is read when a pool is created, from what the last
    # install() was given: reinstall so that a previous mode's choice does not linger.
    if is_installed():
        uninstall()
    try:
        install(**kwargs)
    except TypeError as e:
        raise ModeUnavailable(f"kvpool.install(**{kwargs}) failed: {e}") from e
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


def build_scheduler(workload: Workload, pool: PoolSpec, log_stats: bool = False):
    """A vLLM ``Scheduler`` (``AsyncScheduler`` for async workloads) without a model.

    Mirrors ``create_scheduler`` in vLLM 0.33.0's ``tests/v1/core/utils.py``: one
    full-attention KV cache group of ``pool.num_blocks`` blocks of ``pool.block_size``
    tokens. When the workload needs a longer context than the shipped model config
    declares, ``hf_overrides`` raises ``max_position_embeddings`` (only the scheduler's
    length checks read it; nothing runs the model). ``log_stats``: as the engine core's
    (``make_stats()`` returns ``SchedulerStats``); the replay keeps it off.
    """
    with _quiet_config_warnings():
        return _build_scheduler(workload, pool, log_stats)


def _build_scheduler(workload: Workload, pool: PoolSpec, log_stats: bool = False):
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
        log_stats=log_stats,
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

    Counts, without changing what the pool does (instance attributes only, so kvpool's
    fast paths, which test the class, stay on):

    - prefix-cache hits: ``kv_cache_manager.record_prefix_cache_stats(request,
      num_hits)``, the call vLLM's ``vllm:prefix_cache_hits`` counts (made at
      admission, whether or not stats are logged);
    - evictions: ``block_pool._emit_block_removed_events(hashes)``, called by
      ``_maybe_evict_cached_block`` with the hashes it removed (the ``BlockRemoved``
      events vLLM would publish with KV events on), in order;
    - preemptions: calls to ``scheduler._preempt_request``.
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

        orig_record = kv.record_prefix_cache_stats
        lookup_enabled = kv.prefix_cache_lookup_enabled

        def record_prefix_cache_stats(request, num_hits):
            if lookup_enabled(request):
                self.hit_tokens += num_hits
                self.query_tokens += request.num_tokens
            orig_record(request, num_hits)

        pool = kv.block_pool
        orig_emit = pool._emit_block_removed_events
        evicted = self.evicted_hashes

        def _emit_block_removed_events(block_hashes):
            evicted.extend(block_hashes)
            orig_emit(block_hashes)

        orig_preempt = scheduler._preempt_request

        def _preempt_request(*args, **kwargs):
            self.preemptions += 1
            return orig_preempt(*args, **kwargs)

        kv.record_prefix_cache_stats = record_prefix_cache_stats
        pool._emit_block_removed_events = _emit_block_removed_events
        scheduler._preempt_request = _preempt_request

    def eviction_digest(self) -> str:
        """Hash of the evicted block hashes, in eviction order."""
        h = hashlib.sha1()
        for key in self.evicted_hashes:
            h.update(key if isinstance(key, bytes) else repr(key).encode())
        return h.hexdigest()[:16]

    def reset(self) -> None:
        self.finished_tables: dict[str, list[int]] = {}
        self.preemptions = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        if hasattr(self, "evicted_hashes"):
            self.evicted_hashes.clear()  # the wrapper holds this list
        else:
            self.evicted_hashes: list = []
        self.deferred_frees = 0
        self.deferred_blocks = 0
        self.drain_cpu = 0.0
        self.push_cpu = 0.0
        self.drain_calls = 0
        self.drained_entries = 0
        self.probe_cpu = 0.0


def _prompt_tokens(workload: Workload, rnd: int, seed: int) -> dict[str, list[int]]:
    """Token ids per request id of round ``rnd``; a prefix group shares one list's
    prefixes (each request takes ``spec.shared_len()`` tokens from it, the rest its own)."""
    specs = workload.round_requests(rnd)
    group_len: dict[str, int] = {}
    for s in specs:
        if s.prefix_group is not None:
            group_len[s.prefix_group] = max(group_len.get(s.prefix_group, 0), s.shared_len())
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
            shared = s.shared_len()
            out[rid] = toks if len(toks) == shared else toks[:shared]
            if shared < s.prompt_len:
                rng = np.random.default_rng([seed, rnd, 1, i])
                out[rid] = out[rid] + rng.integers(TOKEN_LO, TOKEN_HI, size=s.prompt_len - shared).tolist()
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


def _stand_in_model(scheduler, target: dict[str, int], salt: dict[str, int]) -> Callable[[Any], Any]:
    """``model_output(scheduler_output) -> ModelRunnerOutput``: one sampled token per
    scheduled request past its prefill, the stop token once request ``rid`` has
    produced ``target[rid]`` tokens (token ids vary with ``salt[rid]``)."""
    from vllm.v1.outputs import ModelRunnerOutput

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

    return model_output


def _by_request_index(tables: dict[str, list[int]]) -> list[list[int]]:
    """Tables keyed ``"<round>-<index>"`` as a list in request index order."""
    return [tables[rid] for rid in sorted(tables, key=lambda r: int(r.rsplit("-", 1)[1]))]


def _digest(prompt_tables: dict[str, list[int]], finished_tables: dict[str, list[int]]) -> str:
    """Hash of a round's block tables keyed by request index within the round, so that
    the same shape allocated the same way digests equally in any round and mode."""
    h = hashlib.sha1()
    for name, tables in (("p", prompt_tables), ("f", finished_tables)):
        for rid in sorted(tables, key=lambda r: int(r.rsplit("-", 1)[1])):
            h.update(f"{name}{rid.rsplit('-', 1)[1]}:".encode())
            h.update(np.asarray(tables[rid], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def run_round(
    scheduler,
    probe: _RoundProbe,
    workload: Workload,
    rnd: int,
    seed: int,
    pool: PoolSpec,
    save_tables: bool = False,
) -> dict[str, Any]:
    """Run round ``rnd`` to completion on ``scheduler``; return its metrics (see docs/replay.md).

    With ``save_tables`` the result also holds ``"tables"``: ``{"prompt": [...],
    "finished": [...]}``, one ``list[int]`` of physical block ids per request of the round,
    in request order: the prompt's blocks after its prefill, and the whole table when the
    request finished (what ``python -m kvpool locality`` lays its requests out with).
    """
    max_model_len = workload.max_model_len()
    depth = 2 if workload.engine.async_scheduling else 1
    bs = pool.block_size
    kv = scheduler.kv_cache_manager

    _check_fits(workload.round_requests(rnd), pool, f"round {rnd}")
    specs_reqs = _make_requests(workload, rnd, seed, bs, max_model_len)
    target = {req.request_id: s.output_len for s, req in specs_reqs}
    salt = {req.request_id: (i * 104_729) for i, (_, req) in enumerate(specs_reqs)}
    pending = deque(sorted(specs_reqs, key=lambda sr: sr[0].arrival_step))
    awaiting_prompt = {req.request_id: (req, math.ceil(s.prompt_len / bs)) for s, req in specs_reqs}
    prompt_tables: dict[str, list[int]] = {}
    probe.reset()
    model_output = _stand_in_model(scheduler, target, salt)

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
        **_cache_counts(probe),
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
        **({"tables": {"prompt": _by_request_index(prompt_tables),
                       "finished": _by_request_index(probe.finished_tables)}}
           if save_tables else {}),
    }


def _check_fits(specs, pool: PoolSpec, where: str) -> None:
    usable = pool.num_blocks - 1  # block 0 is the null block
    for spec in specs:
        need = math.ceil((spec.prompt_len + spec.output_len) / pool.block_size)
        if need > usable:
            raise ValueError(
                f"{where}: a request of {spec.prompt_len} prompt + {spec.output_len} output "
                f"tokens needs {need} blocks of {pool.block_size} tokens, but the pool has {usable} usable "
                f"blocks; raise --num-blocks or shorten the request (--scale)")


class _StreamRequests:
    """``vllm.v1.request.Request`` objects of a continuous workload, built at arrival
    (a long run's prompts would not fit in memory at once). Request ``k`` (arrival
    order) is ``"s-<k>"``; a prefix group's tokens come from ``(seed, group)`` and are
    shared by the whole run, the rest of a prompt from ``(seed, k)``."""

    def __init__(self, workload: Workload, seed: int, block_size: int) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        global _none_hash_ready
        if not _none_hash_ready:
            init_none_hash(sha256)
            _none_hash_ready = True
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.seed = seed
        self.max_model_len = workload.max_model_len()
        self.specs = workload.stream_requests()
        group_len: dict[str, int] = {}
        for s in self.specs:
            if s.prefix_group is not None:
                group_len[s.prefix_group] = max(group_len.get(s.prefix_group, 0), s.shared_len())
        self.group_tokens = {
            g: np.random.default_rng([seed, 3, k]).integers(TOKEN_LO, TOKEN_HI, size=n).tolist()
            for k, (g, n) in enumerate(sorted(group_len.items()))
        }

    def make(self, k: int):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        s = self.specs[k]
        shared = s.shared_len()
        tokens = self.group_tokens[s.prefix_group][:shared] if shared else []
        if shared < s.prompt_len:
            rng = np.random.default_rng([self.seed, 2, k])
            tokens = tokens + rng.integers(TOKEN_LO, TOKEN_HI, size=s.prompt_len - shared).tolist()
        return Request(
            request_id=f"s-{k}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=self.max_model_len - s.prompt_len,
                                           stop_token_ids=[STOP_TOKEN_ID]),
            pooling_params=None,
            block_hasher=self.hasher,
        )


def run_stream(
    scheduler,
    probe: _RoundProbe,
    workload: Workload,
    seed: int,
    pool: PoolSpec,
    on_round: Callable[[int], None] | None = None,
    save_tables: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run a continuous workload (``workload.continuous``): requests join at their
    ``arrival_step`` while others run, and round ``r`` is the window of engine steps
    ``[r * window_steps, (r + 1) * window_steps)``. Nothing is reset between windows.

    Each window reports the keys of :func:`run_round` for what happened in it (prompts
    whose allocation completed, requests that finished, hits, evictions, preemptions,
    scheduler CPU) plus ``arrivals``, ``finished``, ``in_flight_min/max/mean``
    (requests added and not finished, at each ``schedule()``), ``running_min/max``
    and ``idle_steps`` (steps that scheduled no token). After the last window the
    remaining requests run to completion ("drain", not a round).

    Returns:
        ``(rounds, drain)``: per-window dicts, and ``{"steps", "sched_cpu_s",
        "finished", "free_blocks_after", "leaked_blocks"}`` of the drain.
    """
    if workload.engine.async_scheduling:
        raise ValueError("continuous workloads run synchronous scheduling only")
    bs = pool.block_size
    window = workload.window_steps
    horizon = workload.num_rounds * window
    _check_fits(workload.requests, pool, "serving")
    factory = _StreamRequests(workload, seed, bs)
    specs = factory.specs
    target = {f"s-{k}": s.output_len for k, s in enumerate(specs)}
    salt = {f"s-{k}": k * 104_729 for k in range(len(specs))}
    model_output = _stand_in_model(scheduler, target, salt)
    kv = scheduler.kv_cache_manager
    requests = scheduler.requests
    awaiting_prompt: dict[str, tuple[Any, int]] = {}
    rounds: list[dict[str, Any]] = []
    next_k = 0
    step = 0
    stalled = 0  # consecutive steps that scheduled nothing while requests were in flight

    def new_window() -> dict[str, Any]:
        probe.reset()
        return {"sched_cpu": 0.0, "prefill_cpu": 0.0, "steps": 0, "idle": 0, "arrivals": 0,
                "prompt_tables": {}, "in_min": None, "in_max": 0, "in_sum": 0, "run_min": None, "run_max": 0,
                "wall0": time.perf_counter()}

    def close(w: dict[str, Any]) -> dict[str, Any]:
        ptables = list(w["prompt_tables"].values())
        ftables = list(probe.finished_tables.values())
        all_ids = {b for t in ftables for b in t} | {b for t in ptables for b in t}
        steps = max(w["steps"], 1)
        out = {
            "round": len(rounds),
            "num_requests": w["arrivals"],
            "arrivals": w["arrivals"],
            "finished": len(ftables),
            "num_steps": w["steps"],
            "idle_steps": w["idle"],
            "in_flight_min": w["in_min"],
            "in_flight_max": w["in_max"],
            "in_flight_mean": w["in_sum"] / steps,
            "running_min": w["run_min"],
            "running_max": w["run_max"],
            "contiguity": metrics.contiguity(ptables),
            "table_contiguity": metrics.contiguity(ftables),
            "mean_run_length": metrics.mean_run_length(ptables),
            "prompt_descending": metrics.descending_fraction(ptables),
            "sched_cpu_s_per_step": w["sched_cpu"] / steps,
            "sched_cpu_s": w["sched_cpu"],
            "prefill_sched_cpu_s": w["prefill_cpu"],
            "prompt_blocks": sum(len(t) for t in ptables),
            "distinct_blocks": len(all_ids),
            "max_block_id": max(all_ids, default=0),
            **_cache_counts(probe),
            "deferred_frees": 0,
            "deferred_blocks": 0,
            "drain_calls": 0,
            "drain_cpu_s": 0.0,
            "drain_cpu_s_per_step": 0.0,
            "defer_push_s": 0.0,
            "deferred_free_s_per_block": None,
            "free_blocks_after": kv.block_pool.get_num_free_blocks(),
            "leaked_blocks": 0,  # blocks are in use mid-stream; checked after the drain
            "table_digest": _digest(w["prompt_tables"], probe.finished_tables),
            "wall_s": time.perf_counter() - w["wall0"],
        }
        if save_tables:
            out["tables"] = {"prompt": _by_request_index(w["prompt_tables"]),
                             "finished": _by_request_index(probe.finished_tables)}
        return out

    gc.collect()
    w = new_window()
    while True:
        if step == (len(rounds) + 1) * window and len(rounds) < workload.num_rounds:
            rounds.append(close(w))
            if on_round is not None:
                on_round(len(rounds) - 1)
            w = new_window()
        while next_k < len(specs) and specs[next_k].arrival_step <= step:
            req = factory.make(next_k)
            scheduler.add_request(req)
            awaiting_prompt[req.request_id] = (req, math.ceil(specs[next_k].prompt_len / bs))
            w["arrivals"] += 1
            next_k += 1
        if stalled > 1000:
            raise RuntimeError(
                f"step {step}: the scheduler made no progress for {stalled} steps with "
                f"{len(scheduler.waiting)} request(s) waiting; the pool ({pool.num_blocks} blocks of "
                f"{bs} tokens) is too small for this workload's requests in flight. Raise --num-blocks.")
        if not scheduler.has_requests():
            if next_k >= len(specs):
                break
            # Nothing in flight: an idle step (a serving workload should have none).
            w["steps"] += 1
            w["idle"] += 1
            w["in_min"] = 0
            w["run_min"] = 0
            step += 1
            continue
        n_in = len(requests)
        w["in_min"] = n_in if w["in_min"] is None else min(w["in_min"], n_in)
        w["in_max"] = max(w["in_max"], n_in)
        w["in_sum"] += n_in
        probe_before = probe.probe_cpu
        t0 = _thread_time()
        so = scheduler.schedule()
        dt = _thread_time() - t0 - (probe.probe_cpu - probe_before)
        n_run = len(scheduler.running)  # the scheduler rebinds its running list
        w["run_min"] = n_run if w["run_min"] is None else min(w["run_min"], n_run)
        w["run_max"] = max(w["run_max"], n_run)
        if so.total_num_scheduled_tokens == 0:
            w["idle"] += 1
            stalled += 1
        else:
            stalled = 0
        if so.scheduled_new_reqs:
            w["prefill_cpu"] += dt
        for rid in so.num_scheduled_tokens:
            entry = awaiting_prompt.get(rid)
            if entry is not None and entry[0].num_computed_tokens >= entry[0].num_prompt_tokens:
                w["prompt_tables"][rid] = list(kv.get_block_ids(rid)[0][: entry[1]])
                del awaiting_prompt[rid]
        mro = model_output(so)
        probe_before = probe.probe_cpu
        t1 = _thread_time()
        scheduler.update_from_output(so, mro)
        dt += _thread_time() - t1 - (probe.probe_cpu - probe_before)
        w["sched_cpu"] += dt
        w["steps"] += 1
        step += 1
    while len(rounds) < workload.num_rounds:  # a trace that ends before its last window
        rounds.append(close(w))
        if on_round is not None:
            on_round(len(rounds) - 1)
        w = new_window()
    if awaiting_prompt:
        raise RuntimeError(f"prompts never fully allocated: {sorted(awaiting_prompt)[:5]}")
    free_after = kv.block_pool.get_num_free_blocks()
    drain = {
        "steps": w["steps"],
        "sched_cpu_s": w["sched_cpu"],
        "finished": len(probe.finished_tables),
        **_cache_counts(probe),
        "free_blocks_after": free_after,
        "leaked_blocks": pool.num_blocks - 1 - free_after,
        "horizon_steps": horizon,
    }
    return rounds, drain


def _cache_counts(probe: _RoundProbe) -> dict[str, Any]:
    """The round's prefix-cache hits, evictions and preemptions (see :class:`_RoundProbe`):
    what an allocation policy must leave exactly as vLLM has them."""
    return {
        "prefix_cache_hit_tokens": probe.hit_tokens,
        "prefix_cache_query_tokens": probe.query_tokens,
        "evictions": len(probe.evicted_hashes),
        "eviction_digest": probe.eviction_digest(),
        "preemptions": probe.preemptions,
    }


def _warmup(workload: Workload, pool: PoolSpec, seed: int) -> None:
    """Run a throwaway scheduler through a few short requests of the same engine shape,
    so that one-time costs (lazy imports, first-call paths, allocator growth) do not land
    in the first measured round of whichever mode runs first."""
    first = workload.round_requests(0)[:4]
    tiny = replace(
        workload,
        continuous=False,
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
    save_tables: bool = False,
) -> dict[str, Any]:
    """Run every round of ``workload`` in ``mode`` on a fresh scheduler.

    ``save_tables``: keep each round's per-request block tables (see :func:`run_round`).

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
    if mode in ALLOCATION:
        # What was asked, and what the pool says it does (kvpool's BlockPool.allocation).
        info["allocation"] = ALLOCATION[mode]
        info["pool_allocation"] = getattr(block_pool, "allocation", None)
        if mode == "kvpool+contiguous" and info["pool_allocation"] != "contiguous":
            raise ModeUnavailable(
                f"kvpool.install(allocation='contiguous') built a pool whose allocation is "
                f"{info['pool_allocation']!r}")
    probe = _RoundProbe(scheduler)
    if workload.continuous:
        rounds, info["drain"] = run_stream(
            scheduler, probe, workload, seed, pool,
            on_round=None if on_round is None else (lambda rnd: on_round(mode, rnd)),
            save_tables=save_tables,
        )
        info["wall_s"] = time.perf_counter() - wall0
        return {"info": info, "rounds": rounds}
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
        stats = run_round(scheduler, probe, workload, rnd, seed, pool, save_tables=save_tables)
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
    save_tables: bool = False,
) -> dict[str, Any]:
    """Run ``workload`` in each of ``modes``; kvpool is uninstalled afterwards.

    ``save_tables``: keep each round's per-request block tables (see :func:`run_round`).

    Returns:
        ``{"modes": {mode: {"info", "rounds"} | {"skipped": reason}}}``; a mode that
        cannot run (:class:`ModeUnavailable`) is reported as skipped, not raised.
    """
    results: dict[str, Any] = {}
    try:
        for mode in modes:
            try:
                results[mode] = run_mode(mode, workload, pool, seed, on_round, save_tables=save_tables)
            except ModeUnavailable as e:
                results[mode] = {"skipped": str(e)}
                if on_skip is not None:
                    on_skip(mode, str(e))
    finally:
        restore_vanilla()
    return {"modes": results}


#: ``compare()`` keys: rounds in which these per-round fields equal vanilla's.
_CACHE_EQUALITY = {
    "rounds_cache_equal_to_vanilla": (
        "prefix_cache_hit_tokens", "evictions", "eviction_digest", "preemptions"),
    "rounds_hits_equal_to_vanilla": ("prefix_cache_hit_tokens",),
    "rounds_evictions_equal_to_vanilla": ("evictions", "eviction_digest"),
    "rounds_preemptions_equal_to_vanilla": ("preemptions",),
}


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
            # What every allocation policy must keep: the same prefix-cache hits, the
            # same blocks evicted in the same order, the same preemptions.
            for key, fields in _CACHE_EQUALITY.items():
                entry[key] = sum(
                    all(a.get(f) == b.get(f) for f in fields) for a, b in zip(rounds, base["rounds"])
                )
            entry["rounds_compared"] = min(len(rounds), len(base["rounds"]))
            entry["rounds_identical_to_vanilla"] = sum(same)
            entry["first_round_differing_from_vanilla"] = next(
                (i for i, s in enumerate(same) if not s), None
            )
        out[mode] = entry
    ref = out.get("kvpool", {}).get("sched_cpu_s_per_step")
    for mode, entry in out.items():
        if mode != "kvpool" and ref:
            entry["sched_cpu_ratio_vs_kvpool"] = entry["sched_cpu_s_per_step"] / ref
    return out


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
