"""Build real vLLM 0.33.0 schedulers and KV cache managers without a model.

The scheduler, requests and model outputs come from the replay's model-less engine
(:mod:`kvpool.tools.replay.engine`, after ``create_scheduler`` / ``create_requests`` of vLLM
0.33.0's ``tests/v1/core/utils.py``); this module adds what kvpool's tests need on top:
opt-125m's config, a hybrid (full attention + sliding window + chunked local) KV cache
config.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from kvpool.tools.replay import engine

MODEL = "facebook/opt-125m"
EOS_TOKEN_ID = 50256
init_none_hash(sha256)


def kv_cache_groups(block_size: int, num_groups: int, window_blocks: int = 4) -> list[KVCacheGroupSpec]:
    """1 to 3 KV cache groups: full attention, then sliding window, then chunked local
    attention (window and chunk ``window_blocks`` blocks)."""
    common = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = [
        FullAttentionSpec(**common),
        SlidingWindowSpec(**common, sliding_window=window_blocks * block_size),
        ChunkedLocalAttentionSpec(**common, attention_chunk_size=window_blocks * block_size),
    ]
    names = ["layer.full", "layer.swa", "layer.chunked"]
    if not 1 <= num_groups <= len(specs):
        raise ValueError(f"num_groups must be 1..{len(specs)}, got {num_groups}")
    return [KVCacheGroupSpec([names[i]], specs[i]) for i in range(num_groups)]


def make_scheduler(
    num_blocks: int = 1000,
    block_size: int = 16,
    hybrid: bool = False,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int = 2048,
    num_groups: int | None = None,
    window_blocks: int = 4,
) -> Scheduler:
    """A real Scheduler over ``num_blocks`` blocks. ``hybrid`` = two KV cache groups
    (full attention + sliding window); ``num_groups`` (1-3) overrides it."""
    model_config = ModelConfig(model=MODEL, dtype="float16", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_num_batched_tokens)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_num_batched_tokens, enable_chunked_prefill=True,
        is_encoder_decoder=False, watermark=0.0,
    )
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto",
                               enable_prefix_caching=enable_prefix_caching)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config)
    groups = kv_cache_groups(block_size, num_groups or (2 if hybrid else 1), window_blocks)
    return engine.scheduler_from_config(vllm_config, groups, num_blocks, block_size)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, block_size: int = 16) -> Request:
    """A request that ignores opt-125m's EOS and runs exactly ``max_tokens`` decode steps."""
    return engine.make_request(request_id, prompt, max_tokens=max_tokens, eos_token_id=EOS_TOKEN_ID,
                               hasher=engine.block_hasher(block_size))


def runner_output(scheduler_output, token_id: int = 7) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return engine.model_runner_output(req_ids, [[token_id] for _ in req_ids], logprobs=None,
                                      prompt_logprobs_dict={}, pooler_output=[])


def block_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def eviction_order(pool) -> list[int]:
    """Free block ids of ``pool`` in eviction order (first evicted first)."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


@contextlib.contextmanager
def copied_once(obj):
    """``copy.copy(obj)`` inside the block, which makes ``copyreg`` store ``__slotnames__``
    (a list) on ``type(obj)`` the first time (asserted); removed again on exit if it was
    not there before, so that later tests see vLLM's classes unchanged."""
    cls = type(obj)
    had = "__slotnames__" in cls.__dict__
    try:
        copy.copy(obj)
        assert "__slotnames__" in cls.__dict__   # (what a caller's case is about)
        yield
    finally:
        if not had and "__slotnames__" in cls.__dict__:
            type.__delattr__(cls, "__slotnames__")
