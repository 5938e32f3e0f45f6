"""The GB10 / GB200 case of the RFC thread (seed 000), resolved by vLLM 0.34.0's own code.

The GB200 reply ran Qwen3.6-35B-A3B (10 full-attention + 30 Gated DeltaNet layers) with
``--block-size 32``, ``--max-model-len 262144``, 52.77 GiB of KV and prefix caching off,
and read from vLLM: 1,056-token attention pages, 2,619 blocks, a KV cache of 2,724,425
tokens. kvpool ships no config of that model (none is in vLLM's or transformers' sources);
its KV cache has the per-layer shapes of the shipped Qwen3-Next config (2 KV heads of 256,
GDN heads 16 x 128 keys / 32 x 128 values, conv kernel 4) with 40 layers instead of 48,
which vLLM's ``--hf-overrides`` gives (docs/replay.md, "The GB10 case"). These tests pin
what vLLM resolves for that shape, with prefix caching off (the GB200 run) and on.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from tests.cli.test_replay_models import MAMBA, _env
from tests.support.paths import REPO

#: ``--kv-memory-gib 52.77`` (the GB200 run's ``kv-cache-memory-bytes=56661356052``).
KV_BYTES = int(52.77 * (1 << 30))
GB10_OVERRIDES = {"num_hidden_layers": 40}

RESOLVE = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    from kvpool.tools.hf_offline import offline_hf_cache
    model, memory, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    host = json.loads(sys.argv[4])   # {"avx512_bf16": bool or None, "engine": {...}, "caching": [...]}
    if host.get("avx512_bf16") is not None:   # what vLLM's CpuPlatform asks of the host CPU
        import torch
        torch.cpu._is_avx512_bf16_supported = lambda: host["avx512_bf16"]
    with offline_hf_cache([model]):
        from kvpool.tools.replay import engine, workloads
        out = {}
        for caching in host.get("caching", (False, True)):
            wl = workloads.long_sequential(enable_prefix_caching=caching)
            wl = replace(wl, engine=replace(wl.engine, model=model, max_model_len=262144,
                                            hf_overrides=overrides or None, **host.get("engine", {})))
            pool, geo = engine.resolve_pool(wl, kv_memory_bytes=memory, num_blocks=0, user_block_size=32)
            sched = engine.build_scheduler(wl, pool)
            mc = sched.vllm_config.model_config
            layers = mc.get_total_num_hidden_layers()
            out["on" if caching else "off"] = {
                "geometry": geo.to_json(), "smallest_block": pool.smallest_block,
                "scheduler_block_size": sched.block_size, "cache_block_size": sched.cache_config.block_size,
                "layers": layers, "kinds": list(mc.hf_text_config.layer_types)[:layers]}
        print(json.dumps(out))
""")


def _resolve(overrides: dict, host: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", RESOLVE, MAMBA, str(KV_BYTES), json.dumps(overrides),
                           json.dumps(host or {})], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gb10() -> dict:
    return _resolve(GB10_OVERRIDES)


def _attention(geo: dict) -> dict:
    (full,) = [g for g in geo["groups"] if g["kind"] == "FullAttentionSpec"]
    return full


def test_the_gb10_shape_has_10_attention_and_30_gdn_layers(gb10):
    for r in gb10.values():
        assert r["layers"] == 40
        assert r["kinds"].count("full_attention") == 10 and r["kinds"].count("linear_attention") == 30
        groups = r["geometry"]["groups"]
        assert [g["kind"] for g in groups].count("MambaSpec") == 3
        assert all(g["layers"] == 10 for g in groups)


def test_prefix_caching_off_resolves_the_gb200_numbers(gb10):
    r = gb10["off"]
    geo = r["geometry"]
    assert _attention(geo)["block_size"] == 1056 == r["smallest_block"] == r["cache_block_size"]
    assert geo["num_blocks"] == 2619
    assert geo["kv_cache_size_tokens"] == 2_724_425
    assert geo["kv_memory_bytes"] == KV_BYTES == 56_661_356_052
    # Mamba groups in mode 'none': one state block of max_model_len tokens per request.
    assert geo["mamba_cache_mode"] == "none" and geo["mamba_block_size"] == 262144
    for g in geo["groups"]:
        assert g["block_size"] == (1056 if g["kind"] == "FullAttentionSpec" else 262144)
        assert g["page_size_bytes"] == 1056 * 2 * 2 * 256 * 2  # K and V, 2 heads of 256, bf16
    # The scheduler's block size is vLLM's LCM of the groups' (resolve_kv_cache_block_sizes):
    # no group allocates blocks of that size.
    assert geo["block_size"] == r["scheduler_block_size"] == math.lcm(1056, 262144) == 8_650_752
    assert geo["hash_block_size"] == geo["block_size"]
    assert geo["mamba_ssm_cache_dtype"] == "float32"   # as Qwen3.5/3.6 configs' mamba_ssm_dtype


@pytest.mark.parametrize("avx512_bf16", [True, False])
def test_what_vllm_resolves_does_not_depend_on_the_host_cpu(avx512_bf16):
    """vLLM's CpuPlatform turns an 'auto' SSM state dtype into float32 on an AVX512-BF16 host
    only (the model dtype elsewhere, and on a GPU), which halves or doubles the Mamba page and so
    every group's block size. The replay fixes float32 (EngineSpec.mamba_ssm_cache_dtype), so
    both hosts resolve the GB200 geometry; with 'auto' they would not."""
    fixed = _resolve(GB10_OVERRIDES, {"avx512_bf16": avx512_bf16, "caching": [False]})["off"]["geometry"]
    assert _attention(fixed)["block_size"] == 1056 and fixed["num_blocks"] == 2619
    auto = _resolve(GB10_OVERRIDES, {"avx512_bf16": avx512_bf16, "caching": [False],
                                     "engine": {"mamba_ssm_cache_dtype": "auto"}})["off"]["geometry"]
    # bfloat16 state: 1,048,576 + 49,152 bytes fit 544-token pages (544 x 2,048 bytes per layer)
    assert (auto["mamba_ssm_cache_dtype"], _attention(auto)["block_size"]) == (
        ("float32", 1056) if avx512_bf16 else ("auto", 544))


def test_prefix_caching_on_keeps_1056_token_blocks_in_every_group(gb10):
    geo = gb10["on"]["geometry"]
    assert geo["mamba_cache_mode"] == "align" and geo["mamba_block_size"] == 1056
    assert {g["block_size"] for g in geo["groups"]} == {1056}
    assert geo["block_size"] == geo["hash_block_size"] == gb10["on"]["scheduler_block_size"] == 1056
    assert geo["num_blocks"] == 2619  # the same pages: the block count does not depend on the mode


def test_the_shipped_48_layer_config_gives_fewer_blocks_of_the_same_size():
    r = _resolve({})["off"]
    geo = r["geometry"]
    assert r["layers"] == 48 and all(g["layers"] == 12 for g in geo["groups"])
    assert _attention(geo)["block_size"] == 1056
    assert geo["num_blocks"] == KV_BYTES // (1056 * 2048 * 12) == 2183


@pytest.mark.parametrize("argv, message", [
    (["--model", MAMBA, "--hf-overrides", "[40]"], "expected a JSON object"),
    (["--model", MAMBA, "--hf-overrides", "{num_hidden_layers: 40}"], "expected a JSON object"),
    (["--hf-overrides", '{"num_hidden_layers": 40}'], "--hf-overrides needs --model"),
    (["--mamba-ssm-cache-dtype", "auto"], "--mamba-ssm-cache-dtype needs --model"),
    (["--workload", "long-sequential", "--max-model-len", "66560"], "not longer than the workload's longest"),
])
def test_bad_overrides_and_context_lengths_are_clear_errors(argv, message, tmp_path, capsys):
    from kvpool.tools.replay import cli as replay_cli

    with pytest.raises(SystemExit) as exc:
        replay_cli.main([*argv, "--json", str(tmp_path / "r.json"), "--no-plot"])
    assert message in str(exc.value) + capsys.readouterr().err
