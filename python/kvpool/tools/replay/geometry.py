"""A model's KV cache geometry as vLLM resolves it: groups, specs, block sizes, blocks.

What vLLM 0.34.0's engine does between building a model and building its scheduler,
without a model or a device (``python -m kvpool replay --model NAME``):

1. **Per-layer specs** (:func:`layer_specs`), as the GPU model runner collects them
   from the layers (``Attention.get_kv_cache_spec``,
   ``MambaBase.get_kv_cache_spec``, ``vllm/model_executor/layers``): a
   ``FullAttentionSpec`` per full-attention layer, a ``SlidingWindowSpec`` (its block
   size chosen by vLLM's ``_largest_kernel_block_within``) per sliding-window layer, a
   ``MambaSpec`` per linear-attention (Mamba/GDN) layer with the state shapes and
   dtypes of the model class's own ``get_mamba_state_shape_from_config`` /
   ``get_mamba_state_dtype_from_config``. Layer kinds come from the config's
   ``layer_types``; the attention backend is a GPU one (:data:`BACKEND`, its
   ``customize_spec`` and kernel block sizes), since the replay stands for a GPU engine.
2. **Block sizes** (:func:`align_block_sizes`): the backend's preferred block size
   (``Platform._preferred_block_size_for_backends``) unless ``--block-size`` was given,
   then for hybrid attention + Mamba models vLLM's page-size unification
   (``Platform._align_hybrid_block_size``: the attention block grows until its page
   holds a Mamba state, ``mamba_block_size`` follows it in ``mamba_cache_mode="align"``,
   the Mamba page is padded to the attention page). ``mamba_cache_mode`` itself is
   set by the model's ``verify_and_update_config`` (``MambaModelConfig``: "align" with
   prefix caching on) when the ``VllmConfig`` is built.
3. **Groups and blocks** (:func:`resolve`): ``get_global_kv_cache_groups``,
   ``get_kv_cache_configs`` over the specs with the KV memory (or
   ``num_gpu_blocks_override``), ``generate_scheduler_kv_cache_config``,
   ``cache_config.block_size`` from the groups, and ``resolve_kv_cache_block_sizes``
   (the scheduler's block size and the request hash block size), and the capacity vLLM
   logs (``get_kv_cache_capacity``), as ``EngineCore._initialize_kv_caches`` and
   ``EngineCore.__init__`` do
   (``vllm/v1/engine/core.py``, ``vllm/v1/core/kv_cache_planning.py``, 0.34.0).

vLLM is imported inside the functions (see :mod:`.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: ``layer_types`` spellings of a sliding-window attention layer / a Gated DeltaNet layer
#: (Qwen3-Next, Qwen3.5: ``MambaAttentionBackendEnum.GDN_ATTN``).
SLIDING_LAYER_TYPES = frozenset({"sliding_attention"})
MAMBA_LAYER_TYPES = frozenset({"linear_attention"})
#: The attention backend whose spec layout and kernel block sizes the replay uses.
BACKEND = "FLASH_ATTN"
GIB = 1 << 30


@dataclass
class KvGeometry:
    """What :func:`resolve` got from vLLM (``config.kv_cache_geometry`` in the JSON).

    Attributes:
        block_size: the scheduler's block size in tokens (``resolve_kv_cache_block_sizes``:
            LCM of the groups' block sizes).
        hash_block_size: tokens per request block hash (GCD of the prefix-cacheable
            groups' block sizes; the block size with one group).
        num_blocks: blocks in the shared pool (``KVCacheConfig.num_blocks``).
        groups: one dict per KV cache group: ``kind`` (the spec class),
            ``layers`` (count), ``block_size`` (tokens), ``page_size_bytes``, and
            ``sliding_window`` / ``mamba_cache_mode`` where they apply.
        kv_memory_bytes: the KV memory the pool was sized from (``None`` when the
            block count was given: ``num_gpu_blocks_override``).
        kv_cache_size_tokens: the capacity vLLM logs as "GPU KV cache size: N tokens" and
            reports as ``kv_cache_size_tokens`` (``get_kv_cache_capacity``: ``max_model_len``
            times the requests of ``max_model_len`` tokens the blocks hold, every group's
            blocks per request counted).
        max_concurrency: those requests (float).
    """

    model: str
    backend: str
    block_size: int
    hash_block_size: int
    num_blocks: int
    groups: list[dict[str, Any]]
    kv_memory_bytes: int | None = None
    mamba_cache_mode: str | None = None
    mamba_block_size: int | None = None
    #: vLLM's ``cache_config.mamba_ssm_cache_dtype`` once its platform and model config
    #: updated it (a Mamba group's temporal state; :attr:`.workloads.EngineSpec.mamba_ssm_cache_dtype`).
    mamba_ssm_cache_dtype: str | None = None
    #: The scheduler's ``enable_chunked_prefill`` (vLLM requires it for Mamba prefix
    #: caching, so a Mamba model's replay turns it on: :func:`.engine.replay_vllm_config`).
    chunked_prefill: bool | None = None
    kv_cache_size_tokens: int | None = None
    max_concurrency: float | None = None
    #: The scheduler's ``KVCacheConfig`` (not in the JSON).
    kv_cache_config: Any = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "backend": self.backend, "block_size": self.block_size,
                "hash_block_size": self.hash_block_size, "num_blocks": self.num_blocks,
                "kv_memory_bytes": self.kv_memory_bytes, "mamba_cache_mode": self.mamba_cache_mode,
                "mamba_block_size": self.mamba_block_size, "mamba_ssm_cache_dtype": self.mamba_ssm_cache_dtype,
                "chunked_prefill": self.chunked_prefill,
                "kv_cache_size_tokens": self.kv_cache_size_tokens, "max_concurrency": self.max_concurrency,
                "groups": self.groups}

    def describe(self) -> str:
        """What vLLM resolved, one line per group (:func:`describe`)."""
        return describe(self.to_json())


def describe(geometry: dict[str, Any]) -> str:
    """``config.kv_cache_geometry`` of a report as text: the pool, then one line per
    KV cache group (kind, layers, block size, page bytes, window or Mamba cache mode)."""
    g = geometry
    memory = g.get("kv_memory_bytes")
    sizes = sorted({grp["block_size"] for grp in g["groups"]})
    lcm = " (the LCM of the groups')" if len(sizes) > 1 else ""
    tokens = g.get("kv_cache_size_tokens")
    lines = [f"KV cache geometry resolved by vLLM ({g['model']}, {g['backend']} layout): {g['num_blocks']} blocks, "
             f"scheduler block size {g['block_size']} tokens{lcm}, hash block size {g['hash_block_size']}"
             + ("" if memory is None else f", {memory / GIB:.4g} GiB of KV")
             + ("" if tokens is None else f", KV cache size {tokens:,} tokens "
                f"(max concurrency {g['max_concurrency']:.2f}x)")
             + ("" if g.get("mamba_cache_mode") is None else
                f", mamba_cache_mode {g['mamba_cache_mode']!r}, mamba_block_size {g['mamba_block_size']}, "
                f"mamba_ssm_cache_dtype {g.get('mamba_ssm_cache_dtype')!r}, "
                f"chunked prefill {'on' if g.get('chunked_prefill') else 'off'}")]
    for i, grp in enumerate(g["groups"]):
        extra = "".join(f", {k} {grp[k]}" for k in ("sliding_window", "mamba_cache_mode") if k in grp)
        lines.append(f"  group {i}: {grp['kind']} x {grp['layers']} layers, block size {grp['block_size']} "
                     f"tokens, page {grp['page_size_bytes']} bytes{extra}")
    return "\n".join(lines)


def _backend():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend


def layer_kinds(model_config) -> list[str]:
    """``"full"``, ``"sliding"`` or ``"mamba"`` per hidden layer, from the config's
    ``layer_types`` (every layer ``"full"`` when it has none and is not hybrid).

    Raises:
        ValueError: a hybrid model without ``layer_types``, or a layer type the
            replay does not know.
    """
    n = model_config.get_total_num_hidden_layers()
    types = getattr(model_config.hf_text_config, "layer_types", None)
    if types is None:
        if model_config.is_hybrid:
            raise ValueError(f"{model_config.model}: a hybrid model without layer_types in its config")
        return ["full"] * n
    kinds = []
    for t in list(types)[:n]:
        if t in SLIDING_LAYER_TYPES:
            kinds.append("sliding")
        elif t in MAMBA_LAYER_TYPES:
            kinds.append("mamba")
        elif t in ("attention", "full_attention"):
            kinds.append("full")
        else:
            raise ValueError(f"{model_config.model}: layer type {t!r} is not one the replay knows")
    return kinds


def _attention_spec(vllm_config, backend, sliding_window: int | None):
    # Attention.get_kv_cache_spec (vLLM 0.34.0) for a decoder layer.
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, get_kv_quant_mode

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    common = {"num_kv_heads": mc.get_num_kv_heads(vllm_config.parallel_config), "head_size": mc.get_head_size(),
              "head_size_v": mc.get_head_size(), "dtype": mc.dtype, "kv_quant_mode": get_kv_quant_mode(cc.cache_dtype)}
    if sliding_window is None:
        return FullAttentionSpec(block_size=cc.block_size, **common)
    one = backend.customize_spec(SlidingWindowSpec(block_size=1, sliding_window=sliding_window, **common))
    shared_page = cc.skip_page_size_padded
    per_token = one.real_page_size_bytes
    sw_block = _largest_kernel_block_within(backend, per_token, shared_page or per_token * cc.block_size,
                                            cc.block_size, one, divisor_of=None if shared_page else cc.block_size)
    return SlidingWindowSpec(block_size=sw_block, sliding_window=sliding_window, page_size_padded=shared_page,
                             **common)


def _mamba_spec(vllm_config, model_cls):
    # MambaBase.get_kv_cache_spec (vLLM 0.34.0), shapes and dtypes from the model class.
    from vllm.model_executor.layers.mamba.mamba_utils import mamba_state_alignment
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    cc = vllm_config.cache_config
    alignment = mamba_state_alignment(vllm_config)
    return MambaSpec(shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                     dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                     state_alignment=alignment, block_stride_alignment=alignment,
                     block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode=cc.mamba_cache_mode,
                     num_speculative_blocks=vllm_config.num_speculative_tokens)


def _model_cls(vllm_config):
    from vllm.model_executor.models import ModelRegistry

    mc = vllm_config.model_config
    return ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)[0]


def layer_specs(vllm_config) -> dict[str, Any]:
    """``{layer name: KVCacheSpec}`` of the model's layers, as its model runner's
    ``get_kv_cache_spec`` would return them (see the module doc); call after
    :func:`align_block_sizes`."""
    mc = vllm_config.model_config
    kinds = layer_kinds(mc)
    backend = _backend()
    model_cls = _model_cls(vllm_config) if "mamba" in kinds else None
    specs: dict[str, Any] = {}
    for i, kind in enumerate(kinds):
        if kind == "mamba":
            specs[f"model.layers.{i}.linear_attn"] = _mamba_spec(vllm_config, model_cls)
        else:
            window = mc.get_sliding_window() if kind == "sliding" else None
            specs[f"model.layers.{i}.self_attn.attn"] = _attention_spec(vllm_config, backend, window)
    return specs


def align_block_sizes(vllm_config, user_block_size: int | None) -> None:
    """Set ``cache_config.block_size`` (and for hybrid attention + Mamba models
    ``mamba_block_size``, ``mamba_page_size_padded``) as vLLM's
    ``Platform.update_block_size_for_backend`` does on a GPU (vLLM 0.34.0,
    ``vllm/platforms/interface.py``) for :data:`BACKEND`.

    ``user_block_size``: ``--block-size`` (vLLM's user-specified block size), or
    ``None`` for the backend's preferred one.
    """
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform

    cc = vllm_config.cache_config
    backend = _backend()
    if user_block_size is None:
        cc.block_size = Platform._preferred_block_size_for_backends([backend], CacheConfig.DEFAULT_BLOCK_SIZE,
                                                                    vllm_config)
    else:
        cc.block_size = user_block_size
    if vllm_config.model_config.is_hybrid and "mamba" in layer_kinds(vllm_config.model_config):
        Platform._align_hybrid_block_size(vllm_config, backend)


def _group_json(group) -> dict[str, Any]:
    spec = group.kv_cache_spec
    out: dict[str, Any] = {"kind": type(spec).__name__, "layers": len(group.layer_names),
                           "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes}
    if getattr(spec, "sliding_window", None) is not None:
        out["sliding_window"] = spec.sliding_window
    if hasattr(spec, "mamba_cache_mode"):
        out["mamba_cache_mode"] = spec.mamba_cache_mode
    return out


def model_shapes_unavailable_reason() -> str | None:
    """Why ``--model`` cannot resolve a KV cache with the installed vLLM (a release older
    than 0.34.0: 0.33.0 has planning functions of these names, with other layer
    internals, and what this module calls is 0.34.0's), else None. The replay's refusal,
    and the reason its model-shape tests and benchmarks skip."""
    from kvpool.vllm_compat import installed_vllm_version, release_key

    version = installed_vllm_version() or "0"
    if release_key(version) < (0, 34, 0):
        return (f"--model resolves the KV cache as vLLM 0.34.0's engine does; vLLM {version} is older "
                f"(without --model the replay runs on it)")
    return None


def resolve(vllm_config, *, kv_memory_bytes: int | None = None, num_blocks: int | None = None,
            user_block_size: int | None = None) -> KvGeometry:
    """Resolve the KV cache of ``vllm_config``'s model as vLLM's engine core does (see
    the module doc) and leave ``vllm_config`` as the engine leaves it
    (``cache_config.block_size``, ``num_gpu_blocks``).

    Exactly one of ``kv_memory_bytes`` (bytes of KV memory, as the engine's profiling
    would find) and ``num_blocks`` (``cache_config.num_gpu_blocks_override``) is given.

    Raises:
        ValueError: neither or both sizes; the memory does not hold one request of
            ``max_model_len`` tokens (vLLM's own check); a layer type the replay does
            not know; a vLLM release older than 0.34.0, or without its planning functions.
    """
    import vllm

    reason = model_shapes_unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    try:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_capacity,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    except ImportError as e:  # (the planning API of vLLM 0.34.0)
        raise ValueError(f"--model resolves the KV cache with vLLM 0.34.0's planning functions; vLLM "
                         f"{vllm.__version__} lacks them ({e})") from e

    if (kv_memory_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of kv_memory_bytes and num_blocks")
    cc = vllm_config.cache_config
    align_block_sizes(vllm_config, user_block_size)
    register_all_kvcache_specs(vllm_config)
    specs = [layer_specs(vllm_config)]
    if num_blocks is not None:
        cc.num_gpu_blocks_override = num_blocks
        memory = [1 << 62]  # (replaced by override x bytes per block)
    else:
        memory = [kv_memory_bytes]
    # EngineCore._initialize_kv_caches: one layout for the model (the backend's choice).
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([_backend()])]
    resolve_kv_cache_layout(vllm_config, [layouts], list(specs[0].values()))
    groups = get_global_kv_cache_groups(vllm_config, specs)
    configs = get_kv_cache_configs(vllm_config, specs, memory, groups)
    sched = generate_scheduler_kv_cache_config(configs)
    cc.num_gpu_blocks = sched.num_blocks
    sizes = [g.kv_cache_spec.block_size for g in sched.kv_cache_groups if g.kv_cache_spec.prefix_cacheable]
    cc.block_size = min(sizes or [g.kv_cache_spec.block_size for g in sched.kv_cache_groups])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched, vllm_config)
    tokens, concurrency = get_kv_cache_capacity(vllm_config, sched)
    has_mamba = any(hasattr(g.kv_cache_spec, "mamba_cache_mode") for g in sched.kv_cache_groups)
    return KvGeometry(
        model=vllm_config.model_config.model, backend=BACKEND, block_size=block_size,
        hash_block_size=hash_block_size, num_blocks=sched.num_blocks,
        groups=[_group_json(g) for g in sched.kv_cache_groups], kv_memory_bytes=kv_memory_bytes,
        mamba_cache_mode=cc.mamba_cache_mode if has_mamba else None,
        mamba_block_size=cc.mamba_block_size if has_mamba else None,
        mamba_ssm_cache_dtype=cc.mamba_ssm_cache_dtype if has_mamba else None,
        chunked_prefill=bool(vllm_config.scheduler_config.enable_chunked_prefill),
        kv_cache_size_tokens=int(tokens), max_concurrency=float(concurrency), kv_cache_config=sched)
