"""vLLM 0.33.0's scheduler without a model: the scheduler, a stand-in model, requests.

What ``create_scheduler`` / ``create_requests`` of vLLM 0.33.0's
``tests/v1/core/utils.py`` (which ships only in the sdist) build, as one module that the
replay and kvpool's tests share:

- :func:`scheduler_from_config`: a ``Scheduler`` over a ``KVCacheConfig`` with no
  tensors (``kv_cache_tensors=[]``): nothing is allocated, nothing runs a model.
- :func:`build_scheduler`: the replay's scheduler for a :class:`~.workloads.Workload`.
- :func:`make_request`, :class:`RequestFactory`: ``vllm.v1.request.Request`` objects
  with prefix-cache block hashes (sha256, as the engine core's default).
- :func:`stand_in_model`, :func:`model_runner_output`: a ``ModelRunnerOutput`` for a
  ``SchedulerOutput``, as a model runner would return it.

vLLM is imported inside the functions: the replay must enter
:func:`kvpool.tools.hf_offline.offline_hf_cache` before vLLM is imported (see :mod:`.cli`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.tools.replay.workloads import STOP_TOKEN_ID, TOKEN_HI, TOKEN_LO, RequestSpec, Workload


@dataclass(frozen=True)
class PoolSpec:
    """Block pool geometry: ``num_blocks`` blocks (block 0 is vLLM's null block) of
    ``block_size`` tokens.

    With ``resolved`` (``--model``) the KV cache groups, their block sizes and the
    scheduler's are vLLM's own (:func:`.geometry.resolve`): ``num_blocks`` and
    ``block_size`` are what it resolved (the scheduler's block size), ``hash_block_size``
    the request hash block size, ``user_block_size`` the ``--block-size`` given (``None``:
    the attention backend's preferred one), ``group_block_size`` the smallest KV cache
    group's block size (the scheduler's is their LCM: with a Mamba group in
    ``mamba_cache_mode="none"``, whose block is ``max_model_len`` tokens, it can be millions
    of tokens).
    """

    num_blocks: int = 85_000
    block_size: int = 32
    resolved: bool = False
    hash_block_size: int | None = None
    user_block_size: int | None = None
    group_block_size: int | None = None

    @property
    def smallest_block(self) -> int:
        """Tokens in the smallest block any KV cache group allocates."""
        return self.group_block_size or self.block_size

    @property
    def hash_size(self) -> int:
        """Tokens per request block hash."""
        return self.hash_block_size or self.block_size


# --- the scheduler ------------------------------------------------------------------


def full_attention_group(block_size: int, layer: str = "layer", *, num_kv_heads: int = 1,
                         head_size: int = 1, dtype=None):
    """One ``KVCacheGroupSpec`` of a ``FullAttentionSpec`` for ``layer`` (dtype default
    ``torch.float32``)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.float32 if dtype is None else dtype)
    return KVCacheGroupSpec([layer], spec)


def scheduler_from_config(vllm_config, kv_cache_groups: list, num_blocks: int, block_size: int, *,
                          log_stats: bool = False, scheduler_cls=None, kv_cache_config=None,
                          hash_block_size: int | None = None):
    """A ``Scheduler`` (or ``scheduler_cls``) over ``num_blocks`` blocks of
    ``block_size`` tokens in ``kv_cache_groups`` (``list[KVCacheGroupSpec]``).

    Mirrors the tail of ``create_scheduler`` in vLLM 0.33.0's ``tests/v1/core/utils.py``:
    sets ``cache_config.num_gpu_blocks``, registers the KV cache specs, no tensors.
    ``kv_cache_config``: a ``KVCacheConfig`` vLLM resolved (:func:`.geometry.resolve`),
    used as is instead of one built from ``kv_cache_groups``; ``hash_block_size`` is then
    passed on as ``EngineCore`` passes it (``None``: the scheduler's default).
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if kv_cache_config is None:
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups)
    register_all_kvcache_specs(vllm_config)
    extra = {} if hash_block_size is None else {"hash_block_size": hash_block_size}
    return (scheduler_cls or Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=log_stats,
        **extra,
    )


def _native_context_len(model: str) -> int | None:
    """The native context length of ``model``, in tokens: ``max_position_embeddings`` of
    the config kvpool ships for it; None when kvpool ships no config for it or the
    config has no such field."""
    from kvpool.tools.hf_offline import CONFIG_ROOT

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


def _has_mamba_layers(model_config) -> bool:
    from kvpool.tools.replay.geometry import layer_kinds

    return model_config.is_hybrid and "mamba" in layer_kinds(model_config)


def replay_vllm_config(workload: Workload, pool: PoolSpec):
    """The ``VllmConfig`` a workload runs with: its ``EngineSpec``, the model config
    kvpool ships (no weights) with the workload's ``hf_overrides`` (vLLM's ``--hf-overrides``),
    ``max_position_embeddings`` raised when the workload needs a longer context (only the
    scheduler's length checks read it)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    eng = workload.engine
    max_model_len = workload.max_model_len()
    native_len = _native_context_len(eng.model)
    overrides = dict(eng.hf_overrides or {})
    if native_len is not None and max_model_len > native_len:
        overrides.setdefault("max_position_embeddings", max_model_len)
    model_config = ModelConfig(model=eng.model, dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_model_len, hf_overrides=overrides)
    max_num_batched_tokens = eng.max_num_batched_tokens or max_model_len
    chunked = eng.enable_chunked_prefill
    if not chunked:
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        # vLLM requires chunked prefill for Mamba prefix caching (MambaModelConfig);
        # with the whole context as the step budget no prompt is cut.
        chunked = pool.resolved and eng.enable_prefix_caching and _has_mamba_layers(model_config)
    scheduler_config = SchedulerConfig(
        max_num_seqs=eng.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=chunked,
        async_scheduling=eng.async_scheduling, is_encoder_decoder=False,
    )
    # (--model runs only: a hand-built pool has no Mamba group)
    mamba = {"mamba_ssm_cache_dtype": eng.mamba_ssm_cache_dtype} if pool.resolved else {}
    cache_config = CacheConfig(block_size=pool.user_block_size or pool.block_size, cache_dtype="auto",
                               enable_prefix_caching=eng.enable_prefix_caching, **mamba)
    kv_transfer_config = None
    if eng.kv_connector is not None:
        kv_transfer_config = KVTransferConfig(kv_connector=eng.kv_connector, kv_role=eng.kv_role)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, parallel_config=ParallelConfig(),
                             kv_transfer_config=kv_transfer_config)
    if eng.async_scheduling:
        # CpuPlatform.check_and_update_config forces async_scheduling off ("not
        # required on CPU"); a GPU platform keeps it. Restore it so that
        # max_concurrent_batches == 2 and the scheduler's own gate turns
        # defer_block_free on, as on a GPU decode instance.
        vllm_config.scheduler_config.async_scheduling = True
    return vllm_config


def build_scheduler(workload: Workload, pool: PoolSpec, log_stats: bool = False):
    """A vLLM ``Scheduler`` (``AsyncScheduler`` for async workloads) without a model.

    One full-attention KV cache group of ``pool.num_blocks`` blocks of
    ``pool.block_size`` tokens, with the model's KV heads and head size.
    ``log_stats``: as the engine core's (``make_stats()`` returns ``SchedulerStats``);
    the replay keeps it off.

    Raises:
        RuntimeError: an async workload whose scheduler did not turn
            ``defer_block_free`` on.
    """
    with _quiet_config_warnings():
        import torch
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        vllm_config = replay_vllm_config(workload, pool)
        is_async = workload.engine.async_scheduling
        cls = AsyncScheduler if is_async else None
        if pool.resolved:
            scheduler = _resolved_scheduler(vllm_config, pool, log_stats, cls)
        else:
            model_config = vllm_config.model_config
            group = full_attention_group(
                pool.block_size, "model.layers.0.self_attn.attn", dtype=torch.bfloat16,
                num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
                head_size=model_config.get_head_size())
            scheduler = scheduler_from_config(vllm_config, [group], pool.num_blocks, pool.block_size,
                                              log_stats=log_stats, scheduler_cls=cls)
    if is_async and not scheduler.defer_block_free:
        kv_transfer_config = vllm_config.kv_transfer_config
        raise RuntimeError(
            "async workload but Scheduler.defer_block_free is off "
            f"(max_concurrent_batches={vllm_config.max_concurrent_batches}, "
            f"kv consumer={kv_transfer_config and kv_transfer_config.is_kv_consumer})"
        )
    return scheduler


def _resolved_scheduler(vllm_config, pool: PoolSpec, log_stats: bool, scheduler_cls):
    # --model: the KV cache vLLM resolves for the model, with pool.num_blocks blocks.
    from kvpool.tools.replay.geometry import resolve

    geo = resolve(vllm_config, num_blocks=pool.num_blocks, user_block_size=pool.user_block_size)
    if (geo.block_size, geo.hash_block_size) != (pool.block_size, pool.hash_size):
        raise RuntimeError(f"vLLM resolved block size {geo.block_size} (hash {geo.hash_block_size}) for this "
                           f"engine, the run's pool has {pool.block_size} (hash {pool.hash_size})")
    return scheduler_from_config(vllm_config, [], geo.num_blocks, geo.block_size, log_stats=log_stats,
                                 scheduler_cls=scheduler_cls, kv_cache_config=geo.kv_cache_config,
                                 hash_block_size=geo.hash_block_size)


def resolve_pool(workload: Workload, *, kv_memory_bytes: int | None, num_blocks: int,
                 user_block_size: int | None):
    """``(PoolSpec, KvGeometry)`` of a ``--model`` run: the KV cache vLLM resolves for
    ``workload``'s engine (:func:`.geometry.resolve`) with ``kv_memory_bytes`` of KV
    memory, or ``num_blocks`` blocks when it is ``None``.

    Raises:
        ValueError: vLLM's own checks (the memory holds no request of the workload's
            ``max_model_len``), a layer type the replay does not know.
    """
    from kvpool.tools.replay.geometry import resolve

    with _quiet_config_warnings():
        probe = PoolSpec(resolved=True, user_block_size=user_block_size)
        vllm_config = replay_vllm_config(workload, probe)
        geo = resolve(vllm_config, kv_memory_bytes=kv_memory_bytes,
                      num_blocks=None if kv_memory_bytes is not None else num_blocks,
                      user_block_size=user_block_size)
    pool = PoolSpec(num_blocks=geo.num_blocks, block_size=geo.block_size, resolved=True,
                    hash_block_size=geo.hash_block_size, user_block_size=user_block_size,
                    group_block_size=min(g["block_size"] for g in geo.groups))
    return pool, geo


# --- requests -----------------------------------------------------------------------

_none_hash_ready = False


def block_hasher(block_size: int):
    """vLLM's request block hasher (sha256) for ``block_size``-token blocks; sets
    ``NONE_HASH`` once per process first, as ``EngineCore`` does at start-up."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    return get_request_block_hasher(block_size, sha256)


def make_request(request_id: str, prompt_token_ids: list[int], *, max_tokens: int, hasher,
                 stop_token_ids: list[int] | None = None, eos_token_id: int | None = None):
    """A ``vllm.v1.request.Request`` hashed by ``hasher`` (:func:`block_hasher`).

    Args:
        request_id: the request's id.
        prompt_token_ids: the prompt, token ids.
        hasher: the block hasher (:func:`block_hasher`) for the engine's block size.
        max_tokens: output tokens at most.
        stop_token_ids: the request ends when one is sampled (the replay's requests,
            like an EOS).
        eos_token_id: the model's EOS, which the request ignores (``ignore_eos``): it
            runs exactly ``max_tokens`` decode steps, as vLLM's tests' requests.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    if eos_token_id is None:
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    else:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, eos_token_id)
    return Request(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
                   pooling_params=None, block_hasher=hasher)


def _group_tokens(specs: Sequence[RequestSpec], key: Callable[[int], list[int]], ordered: bool) -> dict:
    """Token ids per prefix group, as long as the group's longest shared part; group
    ``k`` (first-appearance order, or sorted by name with ``ordered``) draws from
    ``default_rng(key(k))``."""
    group_len: dict[str, int] = {}
    for s in specs:
        if s.prefix_group is not None:
            group_len[s.prefix_group] = max(group_len.get(s.prefix_group, 0), s.shared_len())
    items = sorted(group_len.items()) if ordered else list(group_len.items())
    return {g: np.random.default_rng(key(k)).integers(TOKEN_LO, TOKEN_HI, size=n).tolist()
            for k, (g, n) in enumerate(items)}


class RequestFactory:
    """The ``Request`` objects of a workload's specs, built one at a time (a long
    stream's prompts would not fit in memory at once).

    Request ``i`` is named ``request_ids[i]``; its prompt is ``spec.shared_len()``
    tokens of its prefix group, then tokens of its own from ``default_rng(own_key(i))``.
    It ends on :data:`STOP_TOKEN_ID` after ``spec.output_len`` tokens
    (:meth:`targets`); ``max_tokens`` is only the context limit.
    """

    def __init__(self, specs: Sequence[RequestSpec], request_ids: list[str], group_tokens: dict[str, list[int]],
                 own_key: Callable[[int], list[int]], max_model_len: int, block_size: int) -> None:
        self.specs = list(specs)
        self.request_ids = request_ids
        self.group_tokens = group_tokens
        self.own_key = own_key
        self.max_model_len = max_model_len
        self.hasher = block_hasher(block_size)

    @classmethod
    def for_round(cls, workload: Workload, rnd: int, seed: int, block_size: int) -> RequestFactory:
        """Round ``rnd``'s requests ``"<rnd>-<i>"``: token ids from ``(seed, rnd, group)``,
        so a prefix group is shared within the round and no two rounds share a block hash."""
        specs = workload.round_requests(rnd)
        return cls(specs, [f"{rnd}-{i}" for i in range(len(specs))],
                   _group_tokens(specs, lambda k: [seed, rnd, 0, k], ordered=False),
                   lambda i: [seed, rnd, 1, i], workload.max_model_len(), block_size)

    @classmethod
    def for_stream(cls, workload: Workload, seed: int, block_size: int) -> RequestFactory:
        """A continuous workload's requests ``"s-<k>"`` (arrival order): prefix groups
        from ``(seed, group)``, shared by the whole run, the rest from ``(seed, k)``."""
        specs = workload.stream_requests()
        return cls(specs, [f"s-{k}" for k in range(len(specs))],
                   _group_tokens(specs, lambda k: [seed, 3, k], ordered=True),
                   lambda k: [seed, 2, k], workload.max_model_len(), block_size)

    def __len__(self) -> int:
        return len(self.specs)

    def prompt(self, i: int) -> list[int]:
        s = self.specs[i]
        shared = s.shared_len()
        tokens = self.group_tokens[s.prefix_group][:shared] if shared else []
        if shared < s.prompt_len:
            rng = np.random.default_rng(self.own_key(i))
            tokens = tokens + rng.integers(TOKEN_LO, TOKEN_HI, size=s.prompt_len - shared).tolist()
        return tokens

    def make(self, i: int):
        return make_request(self.request_ids[i], self.prompt(i), hasher=self.hasher,
                            max_tokens=self.max_model_len - self.specs[i].prompt_len,
                            stop_token_ids=[STOP_TOKEN_ID])

    def targets(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(target, salt)`` for :func:`stand_in_model`: output tokens per request id,
        and a per-request offset that varies the sampled token ids."""
        target = {rid: s.output_len for rid, s in zip(self.request_ids, self.specs)}
        salt = {rid: i * 104_729 for i, rid in enumerate(self.request_ids)}
        return target, salt


# --- the stand-in model --------------------------------------------------------------


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]], **kwargs):
    """``ModelRunnerOutput`` of one step: ``sampled_token_ids[i]`` for ``req_ids[i]``."""
    import vllm
    from vllm.v1.outputs import ModelRunnerOutput

    from kvpool.vllm_compat import is_supported, release_traits

    # The imported vLLM's version string where it names a supported release: the
    # distribution's metadata (release_traits() without one) is parsed anew on every
    # call, 0.86 ms on 2026-12-07, and this runs once a step.
    version = getattr(vllm, "__version__", None)
    if release_traits(version if is_supported(version) else None).runner_output_index:    # (vLLM <= 0.33.0)
        kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids, **kwargs)


def stand_in_model(scheduler, target: dict[str, int], salt: dict[str, int]) -> Callable[[Any], Any]:
    """``model_output(scheduler_output) -> ModelRunnerOutput``: one sampled token per
    scheduled request past its prefill, the stop token once request ``rid`` has
    produced ``target[rid]`` tokens (token ids vary with ``salt[rid]``)."""
    requests = scheduler.requests
    span = TOKEN_HI - TOKEN_LO

    def model_output(so):
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
        return model_runner_output(ids, sampled)

    return model_output
