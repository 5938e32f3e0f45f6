"""``--workload pd-serving``: P/D as a continuous stream (kvpool.tools.replay.pd_stream).

Run against vLLM's real schedulers on both sides (the decode side with vLLM's
``DecodeBenchConnector`` under async scheduling) and, where NIXL imports, the real NIXL:
NIXL's ``descCount`` for every transferred prompt must be the replay's own P/D count times
the KV regions.
"""

from __future__ import annotations

import json

import pytest

# vLLM (and huggingface_hub, which reads HF_HOME once) imported at collection under
# tests/conftest.py's offline cache, as tests/cli/test_replay_probe.py explains.
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

from kvpool.tools.replay import metrics, nixl
from kvpool.tools.replay.engine import PoolSpec
from kvpool.tools.replay.runner import run_replay
from kvpool.tools.replay.workloads import as_pd_serving, grpo, pd_serving

POOL = PoolSpec(num_blocks=700, block_size=16)


def _small(**kwargs):
    return pd_serving(rounds=3, window_steps=60, in_flight=(4, 8), prompt_len=(100, 900), prefix_len=(64, 400),
                      output_len=(8, 40), prefix_groups=3, seed=1, **kwargs)


def _nixl_missing() -> bool:
    try:
        nixl.require_nixl()
    except nixl.NixlUnavailable:
        return True
    return False


def test_both_sides_run_continuously_and_hand_over_every_prompt():
    wl = _small()
    assert wl.continuous and wl.prefill.continuous and wl.engine.async_scheduling
    assert not wl.prefill.engine.async_scheduling and wl.engine.kv_role == "kv_consumer"
    modes = run_replay(wl, POOL, ("vanilla", "kvpool+contiguous"))
    for name, result in modes.items():
        assert result.skipped is None, name
        rounds = result.rounds
        assert [r.round for r in rounds] == [0, 1, 2]
        # Every request reached the decode side (arrivals: the prefill side's completions).
        assert sum(r.arrivals for r in rounds) <= len(wl.requests)
        assert sum(r.finished for r in rounds) + result.info.drain.finished == len(wl.requests), name
        assert result.info.drain.leaked_blocks == 0
        assert all(r.pd_descriptors_total is not None and r.prefill_prompt_descriptors_total is not None
                   for r in rounds)
        # Both pools wrap and evict; the prefill side's shared system prompts hit its cache.
        assert max(r.max_block_id for r in rounds) == POOL.num_blocks - 1
        assert sum(r.evictions for r in rounds) > 0 and sum(r.prefill_evictions for r in rounds) > 0
        assert sum(r.prefill_prefix_cache_hit_tokens for r in rounds) > 0
        assert sum(r.deferred_frees for r in rounds) > 0, "async scheduling defers frees"


def test_a_round_based_workload_is_not_a_stream():
    with pytest.raises(ValueError, match="not continuous"):
        as_pd_serving(grpo(rounds=1))


@pytest.mark.skipif(_nixl_missing(), reason="NIXL does not import (scripts/bootstrap.sh installs it)")
def test_nixl_counts_what_the_replay_counts_for_every_prompt(monkeypatch):
    """Every transferred prompt of a small pd-serving replay, through the real NIXL: its
    ``descCount`` is the replay's P/D count of the same tables times the regions."""
    seen = []
    read = nixl.NixlTransfer.read

    def recording(self, prefill_ids, decode_ids):
        stat = read(self, prefill_ids, decode_ids)
        seen.append((list(prefill_ids), list(decode_ids), stat.descriptors, self.num_regions))
        return stat
    monkeypatch.setattr(nixl.NixlTransfer, "read", recording)
    modes = run_replay(_small(), POOL, ("vanilla", "kvpool+contiguous"), nixl=True)
    prompts = prompt_blocks = 0
    for name, result in modes.items():
        assert result.skipped is None, name
        for r in result.rounds:
            prompts += r.prompts
            prompt_blocks += r.prompt_blocks
            assert r.nixl_regions == 2
            assert r.nixl_descriptors_total == r.pd_descriptors_total * 2, (name, r.round)
            assert r.nixl_post_us_total > 0 and r.nixl_xfer_us_median is not None
    transfers = seen[1:]  # (the first: NixlTransfer's own connecting read)
    assert len(transfers) >= prompts - 5 > 0   # (a prompt wholly in the decode side's cache moves nothing)
    # The decode side's own prefix-cache hits are not transferred.
    assert sum(len(d) for _, d, _, _ in transfers) < prompt_blocks
    for p, d, count, regions in transfers:
        assert count == metrics.pd_descriptors(p, d) * regions
    assert any(count > regions for _, _, count, regions in transfers), "some prompt took more than one run"


def test_cli_runs_a_continuous_trace_as_pd_serving(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    from kvpool.tools.replay.cli import main

    trace = tmp_path / "stream.jsonl"
    trace.write_text("".join(f'{{"prompt_len": {100 + 37 * i}, "output_len": {5 + i % 7}, "arrival_step": {3 * i}}}\n'
                             for i in range(20)))
    out = tmp_path / "r.json"
    rc = main(["--workload", "pd-serving", "--trace", str(trace), "--window-steps", "30", "--num-blocks", "400",
               "--block-size", "16", "--modes", "vanilla", "--no-plot", "--quiet", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["workload"]["name"] == "pd-serving"
    assert all(r["pd_descriptors_total"] is not None for r in report["modes"]["vanilla"]["rounds"])
    round_trace = tmp_path / "rounds.jsonl"
    round_trace.write_text('{"round": 0, "prompt_len": 100, "output_len": 5}\n')
    with pytest.raises(SystemExit, match="pd-serving --trace: .* not continuous"):
        main(["--workload", "pd-serving", "--trace", str(round_trace), "--no-plot", "--quiet", "--json", str(out)])
