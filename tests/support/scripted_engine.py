"""vLLM objects for ``test_engine_api.py`` built without a model or an accelerator.

* :func:`make_vllm_config` — a ``VllmConfig`` for ``facebook/opt-125m`` read from the
  config files kvpool ships (a local directory: no Hugging Face lookup).
* :class:`ScriptedExecutor` — a vLLM ``Executor`` whose single in-process "worker"
  runs no model: it declares one full-attention layer, reports ample memory (the
  config's ``num_gpu_blocks_override`` sizes the pool), and answers every
  ``execute_model`` with one sampled token per scheduled request, after
  :data:`STEP_SECONDS`. Everything above it (``EngineCore`` /
  ``EngineCoreProc``, its busy loop and utility dispatch, the ZMQ clients, the
  scheduler and kvpool's pools) is vLLM's and kvpool's own code. The worker records
  the block ids the scheduler hands each request; tests read them through vLLM's
  ``collective_rpc`` utility.

Must stay importable by name in a spawned engine-core process, where the executor
class is unpickled as ``tests.support.scripted_engine.ScriptedExecutor`` (pytest puts the
repository root on ``sys.path``; multiprocessing's spawn passes ``sys.path`` on).
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future
from typing import Any

from vllm.v1.executor.abstract import Executor

#: Token every scripted step samples (inside opt-125m's vocabulary, not its EOS).
SAMPLED_TOKEN_ID = 7
BLOCK_SIZE = 16
#: Wall time of one scripted model step.
STEP_SECONDS = 0.005
HEAD_SIZE = 64


def opt_125m_dir() -> str:
    from kvpool.tools.hf_offline import CONFIG_ROOT

    return str(CONFIG_ROOT / "facebook--opt-125m")


def make_vllm_config(
    num_blocks: int = 48,
    *,
    enable_prefix_caching: bool = True,
    max_model_len: int = 512,
    max_num_seqs: int = 8,
):
    """``VllmConfig`` of a scheduler-only engine: opt-125m from kvpool's shipped
    config, ``num_blocks`` KV blocks of :data:`BLOCK_SIZE` tokens, a token budget
    large enough that no prompt is chunked."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(
        model=opt_125m_dir(),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=4 * max_model_len,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_blocks,
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
    )


def make_scheduler(vllm_config=None, kv_cache_groups=None, num_blocks: int | None = None):
    """A vLLM ``Scheduler`` built as vLLM 0.33.0's ``tests/v1/core/utils.py``
    ``create_scheduler`` builds it (no model, ``kv_cache_tensors=[]``).

    Args:
        kv_cache_groups: ``list[KVCacheGroupSpec]``; default one full-attention group.
        num_blocks: pool size; default the config's ``num_gpu_blocks_override``.
    """
    from kvpool.tools.replay import engine

    vllm_config = vllm_config or make_vllm_config()
    num_blocks = num_blocks or vllm_config.cache_config.num_gpu_blocks_override
    if kv_cache_groups is None:
        kv_cache_groups = [engine.full_attention_group(BLOCK_SIZE, "layer")]
    return engine.scheduler_from_config(vllm_config, kv_cache_groups, num_blocks, BLOCK_SIZE, log_stats=True)


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int):
    """A scheduler ``Request`` with prefix-cache block hashes (sha256, as vLLM's
    tests) that runs exactly ``max_tokens`` decode steps."""
    from kvpool.tools.replay import engine

    return engine.make_request(request_id, prompt_token_ids, max_tokens=max_tokens, eos_token_id=2,
                               hasher=engine.block_hasher(BLOCK_SIZE))


def make_engine_core_client(multiprocess_mode: bool, num_blocks: int = 48):
    """vLLM's sync engine-core client over :class:`ScriptedExecutor`, made by vLLM's
    ``EngineCoreClient.make_client`` as ``LLM`` makes it: an ``InprocClient`` (an
    ``EngineCore`` in this process), or with ``multiprocess_mode`` a ``SyncMPClient``
    (vLLM starts the engine-core process). ``num_blocks``: the pool size, in blocks."""
    from vllm.v1.engine.core_client import EngineCoreClient

    return EngineCoreClient.make_client(
        multiprocess_mode=multiprocess_mode,
        asyncio_mode=False,
        vllm_config=make_vllm_config(num_blocks),
        executor_class=ScriptedExecutor,
        log_stats=False,
    )


def make_engine_core_request(prompt_token_ids: list[int], max_tokens: int, request_id: str | None = None):
    """An ``EngineCoreRequest`` (what ``LLM.generate`` sends to the engine core)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return EngineCoreRequest(
        request_id=request_id,
        external_req_id=request_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def scripted_output(scheduler_output):
    """``ModelRunnerOutput`` sampling :data:`SAMPLED_TOKEN_ID` for every request the
    step scheduled (prompts are never chunked under :func:`make_vllm_config`)."""
    from kvpool.tools.replay import engine

    req_ids = list(scheduler_output.num_scheduled_tokens)
    return engine.model_runner_output(req_ids, [[SAMPLED_TOKEN_ID] for _ in req_ids])


class ScriptedWorker:
    """The worker side of :class:`ScriptedExecutor` (methods named as vLLM's
    ``WorkerBase`` RPCs)."""

    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config
        #: request id -> block ids of KV cache group 0, in block-table order.
        self.tables: dict[str, list[int]] = {}

    # -- engine start-up -----------------------------------------------------------------
    def _spec(self):
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float16)

    def get_kv_cache_spec(self):
        return {"model.decoder.layers.0.self_attn.attn": self._spec()}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int = 1) -> None:
        # (vLLM 0.30.0 sends the layout name only.)
        pass

    def determine_available_memory(self) -> int:
        # Room for many more blocks than the engine will use: vLLM checks that one
        # max_model_len request fits before num_gpu_blocks_override caps the pool.
        return 1 << 30

    def initialize_from_config(self, kv_cache_configs) -> None:
        pass

    def compile_or_warm_up_model(self):
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self):
        return ("generate",)

    def supports_draft_weight_updates(self) -> bool:
        return False

    # -- steps ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output):
        # A step takes a little time, as on a device, so that a request with a few
        # hundred tokens to go is still running when a test's next utility call lands.
        time.sleep(STEP_SECONDS)
        for new in scheduler_output.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is None:
                continue
            if rid in getattr(cached, "resumed_req_ids", ()):  # (vLLM <= 0.33.0)
                self.tables[rid] = list(new_ids[0])
            else:
                self.tables.setdefault(rid, []).extend(new_ids[0])
        return scripted_output(scheduler_output)

    def sample_tokens(self, grammar_output):
        raise AssertionError("execute_model always returns the sampled tokens")

    def take_draft_token_ids(self):
        return None

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    # -- read by the tests through EngineCore.collective_rpc ------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    def set_environ(self, name: str, value: str | None) -> None:
        """Set (``None``: unset) an environment variable of the engine-core process."""
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _done(value: Any) -> Future:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class ScriptedExecutor(Executor):
    """vLLM ``Executor`` over one in-process :class:`ScriptedWorker`."""

    def _init_executor(self) -> None:
        self.worker = ScriptedWorker(self.vllm_config)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        if isinstance(method, str):
            result = [getattr(self.worker, method)(*args, **(kwargs or {}))]
        else:
            result = [method(self.worker, *args, **(kwargs or {}))]
        return _done(result) if non_block else result

    def execute_model(self, scheduler_output, non_block: bool = False):
        # As UniProcExecutor: one value, not a list of one per worker.
        output = self.worker.execute_model(scheduler_output)
        return _done(output) if non_block else output

    def sample_tokens(self, grammar_output, non_block: bool = False):
        output = self.worker.sample_tokens(grammar_output)
        return _done(output) if non_block else output

    def check_health(self) -> None:
        pass
