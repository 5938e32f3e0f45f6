"""The vLLM test folders the conformance runner runs, and the tests it leaves out.

Data only; the one place to edit when vLLM's test tree changes. Paths are relative to
the sdist root, as pytest prints node ids from there.

Every exclusion names a test file, a test function (all its parametrizations) or one
parametrized case, and says why it cannot run on a CPU machine without network
access. Tests that fail for kvpool-specific reasons are never excluded: those are
regressions to fix.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Test folders and files run by default: all of vLLM's v1 core tests, plus the KV
#: connector unit tests that drive the block pool through the scheduler (offloading
#: connector scheduler, remote prefill/decode lifecycles, invalid blocks, KV load
#: failure recovery, decode-bench connector) and the connectors that subclass or walk
#: the block pool (hisparse's ``SharedEventQueueBlockPool``, Mooncake store's
#: ``ExternalCachedBlockPool``, the simple CPU offload manager's free-queue walk).
DEFAULT_SUITES: tuple[str, ...] = (
    "tests/v1/core",
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_decode_bench_connector.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
    "tests/v1/kv_connector/unit/test_simple_cpu_offload_connector.py",
    "tests/v1/kv_connector/unit/test_nixl_simple_cpu_offload.py",
    "tests/v1/kv_connector/unit/test_hisparse_connector.py",
    "tests/v1/kv_connector/unit/test_mooncake_store_coordinator.py",
    "tests/v1/kv_connector/unit/test_mooncake_store_worker.py",
    "tests/v1/simple_kv_offload",
)

#: Default suites vLLM removed, keyed by the first release whose sdist lacks them: the
#: suite list of release X leaves out the entries of every release up to X.
REMOVED_SUITES: dict[str, tuple[str, ...]] = {
    "0.34.0": ("tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",),
}

#: Files outside ``tests/`` that the suites read from the sdist, keyed by the first release
#: whose tests read them (the runner extracts them to the same path relative to the sdist
#: root; later releases get them too). 0.34.0's ``tests/v1/core/test_prompt_block_hash_vectors.py``
#: compares vLLM's prompt block hashes with the Rust engine client's vector file.
SDIST_DATA_FILES: dict[str, tuple[str, ...]] = {
    "0.34.0": ("rust/src/engine-core-client/src/tests/prompt_block_hash_vectors.json",),
}


def _release_key(version: str) -> tuple[int, ...]:
    # "0.34.0+cpu" -> (0, 34, 0): a local build of a release counts as it.
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("+", 1)[0].split(".")[:3])


def _up_to(table: dict[str, tuple[str, ...]], version: str) -> list[str]:
    """The entries of ``table`` keyed by a release no later than ``version``."""
    chosen: list[str] = []
    for release, entries in table.items():
        if _release_key(release) <= _release_key(version):
            chosen += entries
    return chosen


def default_suites(version: str) -> list[str]:
    """:data:`DEFAULT_SUITES` for vLLM ``version`` (``"0.34.0"``): less the suites
    :data:`REMOVED_SUITES` says that release no longer has."""
    removed = set(_up_to(REMOVED_SUITES, version))
    return [s for s in DEFAULT_SUITES if s not in removed]


def data_files(version: str) -> list[str]:
    """The sdist files outside ``tests/`` that vLLM ``version``'s suites read
    (:data:`SDIST_DATA_FILES`), relative to the sdist root."""
    return _up_to(SDIST_DATA_FILES, version)


#: vLLM's LLaVA and Qwen2.5-VL model modules import transformers' image processors,
#: which import torchvision; ``ModelConfig`` imports the model module (in a
#: subprocess) to inspect the architecture. PyPI's x86_64 torchvision wheels are CUDA
#: builds, which cannot load next to the CPU torch.
NEEDS_TORCHVISION = (
    "needs torchvision (GPU stack): ModelConfig({model}) inspects vLLM's {arch} model module, "
    "which imports transformers' image processors and through them torchvision; PyPI's "
    "x86_64 torchvision wheels are CUDA builds that cannot load next to the CPU torch"
)
LLAVA = NEEDS_TORCHVISION.format(model="llava-hf/llava-1.5-7b-hf", arch="LLaVA")
QWEN2_5_VL = NEEDS_TORCHVISION.format(model="Qwen/Qwen2.5-VL-3B-Instruct", arch="Qwen2.5-VL")
#: The LLaVA tests new in vLLM 0.34.0: there the model module's import stops earlier, at
#: ``mistral_common`` (not installed either; it comes with the same GPU-side stack).
LLAVA_0_34 = LLAVA + " (vLLM 0.34.0: its LLaVA module's import first needs mistral_common)"


@dataclass(frozen=True)
class Exclusion:
    """A test left out of both runs.

    Attributes:
        nodeid: a file (``tests/x/test_y.py``), a test (``...::test_z``, all its
            parametrizations) or one case (``...::test_z[param]``).
        reason: why it cannot run here, e.g. ``needs a GPU: CUDA graphs``.
    """

    nodeid: str
    reason: str

    def matches(self, nodeid: str) -> bool:
        """True if ``nodeid`` (a collected test) is this exclusion or lies under it."""
        return nodeid == self.nodeid or nodeid.startswith((self.nodeid + "::", self.nodeid + "["))

    @property
    def is_file(self) -> bool:
        return "::" not in self.nodeid


EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion(
        "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py",
        "needs model weights: serves Qwen/Qwen3.5-0.8B through an OpenAI-compatible server",
    ),
    Exclusion(
        "tests/v1/core/test_reset_prefix_cache_e2e.py::test_reset_prefix_cache_e2e",
        "needs model weights: runs LLMEngine on Qwen/Qwen3-0.6B end to end",
    ),
    Exclusion(
        "tests/v1/core/test_scheduler_e2e.py",
        "needs model weights: runs LLM on hmellor/tiny-random-LlamaForCausalLM end to end",
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_async_scheduling_pp_allows_rescheduling_with_output_placeholders",
        (
            "needs a GPU: async scheduling with pipeline parallelism needs Model Runner V2, which "
            "vLLM selects only where Triton (a GPU compiler) is installed"
        ),
    ),
    Exclusion(
        "tests/v1/kv_connector/unit/test_hisparse_connector.py::test_draft_layer_rows_mirrored_after_drafter",
        "needs a GPU: allocates pinned host memory (pin_memory=True needs an accelerator)",
    ),
    Exclusion(
        "tests/v1/core/test_priority_scheduler_random.py::test_priority_scheduling_blast",
        QWEN2_5_VL,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_cpu_encoder_input_updates_preserve_shm_handles",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_cpu_encoder_input_updates_restore_after_kv_load_failure",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_cpu_encoder_input_updates_resume_and_abort",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_cpu_encoder_input_updates_wait_for_completed_prefill",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_eagle3_mm_encoder_cache_with_shift",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_allocate_encoder_tokens_with_external_load",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_cache_hit_external_load",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_cache_miss_computes_locally",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_defers_running_request_for_async_reload",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_ensure_cache_available_defers_request",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_schedule_multiple_requests",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_text_only_request",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_unable_to_allocate",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_update_connector_output_called",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_waits_for_embeddings_in_prefix_replay",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_ec_connector_with_partial_cache_hit_multi_round",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_accepts_matching_embed_count",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_embed_count_mismatch_restores_prior_hit_state",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_recomputed_when_evicted_during_preemption",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count_within_request",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_retained_across_preemption_and_resume",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_only_prompt_longer_than_budget_is_chunked",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_free_encoder_inputs_notifies_the_ec_connector",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_free_encoder_inputs_respects_unconfirmed_placeholders",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_free_encoder_inputs_unchanged_without_spec_decode",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_no_mm_input_chunking",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_no_mm_input_chunking_at_item_boundary",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_no_mm_input_chunking_for_same_step_duplicate",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_priority_scheduling_ec_connector_preemption_and_resumption",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_same_step_duplicate_encoder_input_stays_cached",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_schedule_multimodal_requests",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_schedule_partial_requests",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_unavailable_encoder_input_fails_the_request_as_retryable",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_waiting_encoder_stall_does_not_starve_later_requests",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_waiting_encoder_stall_is_counted_as_deferred",
        LLAVA,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_waiting_encoder_stall_kv_holder_keeps_drain_priority",
        LLAVA,
    ),
    # Tests of newer releases of the matrix only (absent from 0.33.0's tree).
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_encoder_cache_pressure_respects_disabled_chunked_prefill",
        LLAVA_0_34,
    ),
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_no_mm_input_chunking_after_prefix_cache_hit_inside_item",
        LLAVA_0_34,
    ),
    # Tests of older releases of the matrix only (absent from 0.33.0's tree).
    Exclusion(
        "tests/v1/core/test_scheduler.py::test_free_encoder_inputs_defers_for_eagle_lookahead",
        LLAVA + " (vLLM 0.32.0)",
    ),
)


def exclusions_for(suites: list[str] | tuple[str, ...]) -> list[Exclusion]:
    """The exclusions that lie inside any of ``suites`` (paths relative to the sdist root)."""
    chosen = []
    for exclusion in EXCLUSIONS:
        path = exclusion.nodeid.split("::", 1)[0]
        if any(path == s.rstrip("/") or path.startswith(s.rstrip("/") + "/") for s in suites):
            chosen.append(exclusion)
    return chosen
