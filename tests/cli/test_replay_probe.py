"""The replay's probe (kvpool.tools.replay.probe) measures without changing what runs: its
figures for the blocks that became full equal what vLLM's own ``cache_full_blocks``
is called with, and under it kvpool's native caching and eviction stay on (issue 17:
the replay's per-step figures are kvpool's, not kvpool with vLLM's Python caching).

In-process, through vLLM's real scheduler (no model): the tests' offline Hugging Face
cache is entered by tests/conftest.py; kvpool is uninstalled after each test.
"""

from __future__ import annotations

import inspect

import pytest

# vLLM, and huggingface_hub below it (which reads HF_HOME once, at import), imported at
# collection under tests/conftest.py's offline cache, as the other in-process scheduler
# tests do: imported first inside a command's own throwaway cache (an in-process
# `replay` main() of another test), later configs would be looked up in a deleted one.
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

from kvpool.tools.replay import metrics, modes as replay_modes, workloads
from kvpool.tools.replay.engine import PoolSpec
from kvpool.tools.replay.modes import kvpool_unavailable_reason
from kvpool.tools.replay.runner import ModeRun


@pytest.fixture(autouse=True)
def _vanilla_after():
    yield
    replay_modes.restore_vanilla()


def _counting_cache_full_blocks(pool) -> dict:
    """Wrap ``pool.cache_full_blocks`` (the instance) to count, per call, the blocks it
    caches (``blocks[num_cached_blocks:num_full_blocks]``, null and masked ones skipped)
    and their ascending runs: the reference for the probe's figures."""
    orig = pool.cache_full_blocks
    bind = inspect.signature(orig).bind
    null_id = pool.null_block.block_id
    seen = {"blocks": 0, "copies": 0, "calls": 0}

    def cache_full_blocks(*args, **kwargs):
        a = bind(*args, **kwargs).arguments
        lo, hi, mask = a["num_cached_blocks"], a["num_full_blocks"], a.get("block_mask")
        ids = [b.block_id for i, b in enumerate(a["blocks"][lo:hi])
               if not b.is_null and (mask is None or mask[i])]
        seen["blocks"] += len(ids)
        seen["copies"] += metrics.transfer_descriptors(ids, null_id)
        seen["calls"] += 1
        return orig(*args, **kwargs)

    pool.cache_full_blocks = cache_full_blocks
    return seen


def _serving_small():
    return workloads.serving(rounds=3, window_steps=150, prompt_len=(256, 2048), output_len=(16, 128))


def _rounds(run: ModeRun, workload):
    """The rounds (windows) of ``run``, as the replay runs them (its probe, the reset
    between rounds); a stream's drain is not run."""
    for rnd in range(workload.num_rounds):
        assert run.next_round()
        result = run.rounds[-1]
        assert result.round == rnd and getattr(result, "reset_ok", None) is not False
        yield result


@pytest.mark.parametrize("name", ["serving-preempting", "pd-async", "grpo"])
def test_blocks_that_became_full_are_those_vllm_caches(name):
    """On vanilla vLLM (every block cached by vLLM's cache_full_blocks, wrapped here as
    the reference), the probe's offload figures of every round equal the wrapper's:
    blocks and copies, through admissions with prefix hits, preemptions (the small
    serving pool), deferred frees with a KV consumer (pd-async) and reset rounds."""
    workload, pool = {
        "serving-preempting": (_serving_small(), PoolSpec(num_blocks=2000, block_size=16)),
        "pd-async": (workloads.pd_async(rounds=2, scale=0.05), PoolSpec(num_blocks=12_000, block_size=32)),
        "grpo": (workloads.grpo(rounds=2, scale=0.05), PoolSpec(num_blocks=12_000, block_size=32)),
    }[name]
    run = ModeRun("vanilla", workload, pool, 0)
    ref = _counting_cache_full_blocks(run.scheduler.kv_cache_manager.block_pool)
    preemptions = 0
    for result in _rounds(run, workload):
        assert (result.offload_blocks, result.offload_copies_total) == (ref["blocks"], ref["copies"])
        assert ref["blocks"] > 0
        preemptions += result.preemptions
        ref.update(blocks=0, copies=0)
    if name == "serving-preempting":
        assert preemptions > 0


@pytest.mark.skipif(kvpool_unavailable_reason() is not None, reason="kvpool not importable")
@pytest.mark.parametrize("mode", ["kvpool", "kvpool+contiguous"])
def test_under_the_probe_kvpools_caching_and_eviction_stay_native(mode):
    """The probe hooks only what kvpool's native path tolerates: with it on, a kvpool
    scheduler caches the blocks that became full and evicts natively (every call of
    this workload: none needs vLLM's caching, such as a partial block's promotion, and
    every eviction is counted natively), while the
    probe's figures (blocks that became full, evicted hashes in order, hits,
    preemptions; with the default policy the copies too) equal vanilla's on the same
    workload."""
    from kvpool import _core

    workload, pool = _serving_small(), PoolSpec(num_blocks=2000, block_size=16)
    figures = {}
    for m in ("vanilla", mode):
        run = ModeRun(m, workload, pool, 0)
        before = _core.allocate_slots_fast_path_state()
        figures[m] = [(r.offload_blocks, r.offload_copies_total, r.evictions, r.eviction_digest,
                       r.prefix_cache_hit_tokens, r.preemptions)
                      for r in _rounds(run, workload)]
        after = _core.allocate_slots_fast_path_state()
        replay_modes.restore_vanilla()
    if mode == "kvpool":
        assert figures[mode] == figures["vanilla"]
    else:   # the same blocks become full, in fewer runs (the policy's point)
        assert [f[:1] + f[2:] for f in figures[mode]] == [f[:1] + f[2:] for f in figures["vanilla"]]
        assert all(c[1] < v[1] for c, v in zip(figures[mode], figures["vanilla"]))
    assert all(f[2] > 0 for f in figures[mode])   # the pool evicts in every window
    native_evictions = after["native_evictions"] - before["native_evictions"]
    assert native_evictions == sum(f[2] for f in figures[mode])
    native_cache = after["native_cache_calls"] - before["native_cache_calls"]
    vllm_cache = after["vllm_cache_calls"] - before["vllm_cache_calls"]
    assert native_cache > 0 and vllm_cache == 0
