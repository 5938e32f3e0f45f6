"""``python -m kvpool replay``: metric definitions, workloads, and end-to-end runs of
vLLM's real scheduler (no model) in all four modes.

The end-to-end tests run the command line in a subprocess, as a user does: the offline
Hugging Face cache must be entered before vLLM is imported, and kvpool's install state
must not leak into other tests. Workloads are sized so that vanilla vLLM's free list
wraps (and scrambles) within a few rounds of a small pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool.cpu_platform import cpu_environment
from kvpool.tools.replay import metrics, traces, workloads
from kvpool.tools.replay.modes import MODES, kvpool_unavailable_reason, mode_unavailable_reason
from tests.support.paths import REPO

ROUND_KEYS = {
    "round",
    "contiguity",
    "table_contiguity",
    "mean_run_length",
    "sched_cpu_s_per_step",
    "num_steps",
    "prompt_blocks",
    "distinct_blocks",
    "max_block_id",
    "preemptions",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
    "evictions",
    "eviction_digest",
    "deferred_frees",
    "drain_cpu_s_per_step",
    "leaked_blocks",
    "table_digest",
}


# --- metric definitions -------------------------------------------------------------


def test_contiguity_counts_only_consecutive_ascending_pairs():
    assert metrics.contiguity([[1, 2, 3, 4]]) == 1.0
    assert metrics.contiguity([[4, 3, 2, 1]]) == 0.0
    assert metrics.descending_fraction([[4, 3, 2, 1]]) == 1.0
    assert metrics.contiguity([[1, 2, 4, 5]]) == pytest.approx(2 / 3)
    assert metrics.contiguity([[7], []]) is None


def test_contiguity_is_pairs_weighted_across_tables():
    # 9 ascending pairs of 9, and 0 of 1: pairs-weighted 9/10, not the mean 0.5.
    assert metrics.contiguity([list(range(1, 11)), [5, 3]]) == pytest.approx(0.9)


def test_mean_run_length_is_blocks_over_maximal_runs():
    assert metrics.mean_run_length([[1, 2, 5, 6, 7]]) == pytest.approx(5 / 2)
    assert metrics.mean_run_length([[3, 2, 1]]) == 1.0
    assert metrics.mean_run_length([[1, 2, 3], [9]]) == pytest.approx(4 / 2)
    assert metrics.mean_run_length([[]]) is None


# --- workloads ------------------------------------------------------------------------


def test_grpo_workload_is_reproducible_and_shares_prompts_within_a_round():
    a = workloads.grpo(rounds=3, seed=5)
    b = workloads.grpo(rounds=3, seed=5)
    assert a.requests == b.requests
    assert a.requests != workloads.grpo(rounds=3, seed=6).requests
    assert a.num_rounds == 3 and len(a.requests) == 3 * 2 * 4
    for rnd in range(3):
        reqs = a.round_requests(rnd)
        for group in ("p0", "p1"):
            lens = {r.prompt_len for r in reqs if r.prefix_group == group}
            assert len(lens) == 1  # the n samples of one prompt share the prompt
    assert a.engine.enable_prefix_caching and not a.engine.enable_chunked_prefill


def test_scale_shortens_outputs_only():
    full = workloads.long_sequential(scale=1.0)
    short = workloads.long_sequential(scale=0.05)
    assert [r.prompt_len for r in full.requests] == [r.prompt_len for r in short.requests] == [1024] * 7
    assert {r.output_len for r in full.requests} == {65_536}
    assert {r.output_len for r in short.requests} == {round(65_536 * 0.05)}


def test_trace_parses_groups_and_names_the_bad_line(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text(
        "# comment\n"
        '{"round": 0, "prompt_len": 100, "output_len": 5, "prefix_group": 7}\n'
        "\n"
        '{"round": 1, "prompt_len": 50, "output_len": 3, "prefix_group": null, "arrival_step": 2}\n'
    )
    wl = traces.from_trace(good)
    assert wl.num_rounds == 2
    assert wl.requests[0] == workloads.RequestSpec(0, 100, 5, "7", 0)
    assert wl.requests[1] == workloads.RequestSpec(1, 50, 3, None, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"round": 0, "prompt_len": 100, "output_len": 5}\n{"round": 0, "prompt_len": 10}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        traces.from_trace(bad)


def test_kvpool_modes_are_reported_skipped_when_kvpool_is_not_importable(monkeypatch):
    from kvpool.tools.replay import engine, modes, runner

    def unavailable():
        raise modes.ModeUnavailable("kvpool is not importable (test)")

    monkeypatch.setattr(modes, "_kvpool_api", unavailable)
    skipped = []
    res = runner.run_replay(workloads.grpo(rounds=1), engine.PoolSpec(), ("kvpool", "kvpool+reorder"),
                            on_skip=lambda m, why: skipped.append(m))
    assert {m: r.to_json() for m, r in res.items()} == {
        m: {"skipped": "kvpool is not importable (test)"} for m in ("kvpool", "kvpool+reorder")}
    assert skipped == ["kvpool", "kvpool+reorder"]


# --- end to end through vLLM's scheduler ---------------------------------------------


def _replay(tmp_path: Path, *args: str, modes=MODES) -> dict:
    out = tmp_path / "report.json"
    env = cpu_environment(dict(os.environ))
    # The kvpool this test imported (the checkout's python/ when editable, site-packages
    # when installed from a wheel): a plain install has no _core in python/kvpool.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvpool.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "kvpool", "replay", "--no-progress", "--modes", ",".join(modes),
           "--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _modes_here() -> tuple[str, ...]:
    """The modes this environment can run (``kvpool+contiguous`` needs a kvpool whose
    ``install()`` takes ``allocation=``)."""
    return tuple(m for m in MODES if mode_unavailable_reason(m) is None)


def _need_kvpool():
    why = kvpool_unavailable_reason()
    if why is not None:
        pytest.skip(f"kvpool modes skipped: {why}")


def _need_contiguous():
    why = mode_unavailable_reason("kvpool+contiguous")
    if why is not None:
        pytest.skip(f"kvpool+contiguous skipped: {why}")


def _assert_cache_equal_to_vanilla(rep: dict) -> None:
    """Every other mode's rounds have vanilla's prefix-cache hits, evictions (same
    hashes, same order) and preemptions: what no allocation policy may change."""
    van = rep["modes"]["vanilla"]["rounds"]
    for mode, res in rep["modes"].items():
        if mode == "vanilla":
            continue
        for a, b in zip(res["rounds"], van):
            for key in ("prefix_cache_hit_tokens", "evictions", "eviction_digest", "preemptions"):
                assert a[key] == b[key], (mode, a["round"], key, a[key], b[key])
        assert rep["comparison"][mode]["rounds_cache_equal_to_vanilla"] == len(van), mode


# Small GRPO shape whose rounds (~420 blocks of 16 tokens each) wrap a 1,500-block pool
# in round 3: from then on vanilla allocates blocks earlier rounds freed.
GRPO_SMALL = ("--workload", "grpo", "--num-blocks", "1500", "--block-size", "16", "--rounds", "6",
              "--prompt-len", "2000,3000", "--output-len", "40,160", "--seed", "3")


@pytest.fixture(scope="module")
def grpo_report(tmp_path_factory):
    return _replay(tmp_path_factory.mktemp("grpo"), *GRPO_SMALL, modes=_modes_here())


def test_report_has_the_documented_shape(grpo_report):
    rep = grpo_report
    assert rep["workload"]["name"] == "grpo"
    assert rep["config"]["num_blocks"] == 1500 and rep["config"]["block_size"] == 16
    assert set(rep["modes"]) == set(_modes_here())
    for mode, res in rep["modes"].items():
        assert len(res["rounds"]) == 6, mode
        for i, rnd in enumerate(res["rounds"]):
            assert rnd["round"] == i
            assert set(rnd) >= ROUND_KEYS, ROUND_KEYS - set(rnd)
            assert 0.0 <= rnd["contiguity"] <= 1.0
            assert rnd["num_steps"] > 0 and rnd["sched_cpu_s_per_step"] > 0
            assert rnd["leaked_blocks"] == 0, (mode, i)
            assert rnd["preemptions"] == 0
            assert 0 < rnd["prefix_cache_hit_tokens"] <= rnd["prefix_cache_query_tokens"]
            if i > 0:
                assert rnd["reset_ok"] is True
    if len(rep["modes"]) > 1:
        _assert_cache_equal_to_vanilla(rep)


def test_vanilla_runs_vllms_own_block_pool_and_scrambles_after_the_pool_wraps(grpo_report):
    van = grpo_report["modes"]["vanilla"]
    assert van["info"]["block_pool_class"] == "vllm.v1.core.block_pool.BlockPool"
    assert van["info"]["kvpool_installed"] in (False, None)
    contig = [r["contiguity"] for r in van["rounds"]]
    assert min(contig[:2]) >= 0.99  # fresh pool: blocks come off the canonical head
    assert min(contig[-2:]) < 0.9, contig  # recycled blocks: reversed / interleaved


def test_kvpool_allocates_exactly_as_vllm(grpo_report):
    _need_kvpool()
    kv, van = grpo_report["modes"]["kvpool"], grpo_report["modes"]["vanilla"]
    assert kv["info"]["kvpool_installed"] is True
    assert kv["info"]["block_pool_class"] != van["info"]["block_pool_class"]
    assert [r["table_digest"] for r in kv["rounds"]] == [r["table_digest"] for r in van["rounds"]]
    assert grpo_report["comparison"]["kvpool"]["rounds_identical_to_vanilla"] == 6


def test_kvpool_reorder_keeps_every_round_contiguous(grpo_report):
    _need_kvpool()
    ro = grpo_report["modes"]["kvpool+reorder"]
    assert ro["info"]["reorder_api"] is not None
    assert all(r["reorder_ok"] is True for r in ro["rounds"][1:])
    assert all(r["contiguity"] >= 0.99 for r in ro["rounds"]), [r["contiguity"] for r in ro["rounds"]]
    # Every round starts from the canonical order, so no round reaches the pool's end.
    assert max(r["max_block_id"] for r in ro["rounds"]) < 1499
    van = grpo_report["modes"]["vanilla"]
    assert ro["rounds"][0]["table_digest"] == van["rounds"][0]["table_digest"]


def test_kvpool_reorder_round_allocates_like_a_fresh_vllm_pool(grpo_report, tmp_path):
    """After reset + reorder, round r's block tables equal those a brand-new vanilla
    scheduler gives the same requests: the reorder restores the canonical order."""
    _need_kvpool()
    rnd = 4
    wl = workloads.grpo(rounds=6, prompt_len=(2000, 3000), output_len=(40, 160), seed=3)
    trace = tmp_path / "round.jsonl"
    trace.write_text("".join(
        json.dumps({"round": 0, "prompt_len": r.prompt_len, "output_len": r.output_len,
                    "prefix_group": r.prefix_group}) + "\n"
        for r in wl.round_requests(rnd)
    ))
    fresh = _replay(tmp_path, "--trace", str(trace), "--num-blocks", "1500", "--block-size", "16",
                    modes=("vanilla",))
    ro = grpo_report["modes"]["kvpool+reorder"]["rounds"][rnd]
    assert fresh["modes"]["vanilla"]["rounds"][0]["table_digest"] == ro["table_digest"]
    assert grpo_report["modes"]["vanilla"]["rounds"][rnd]["table_digest"] != ro["table_digest"]


def test_pd_async_defers_block_frees_through_the_real_gate(tmp_path):
    # 48 staggered requests of ~3,100 blocks a round: vanilla wraps 8,000 blocks in round 2.
    rep = _replay(tmp_path, "--workload", "pd-async", "--num-blocks", "8000", "--block-size", "16",
                  "--rounds", "3", "--prompt-len", "500,1500", "--output-len", "8,48", modes=_modes_here())
    for mode, res in rep["modes"].items():
        assert res["info"]["defer_block_free"] is True, mode
        assert res["info"]["scheduler_class"].endswith("AsyncScheduler")
        for r in res["rounds"]:
            assert r["deferred_frees"] > 0 and r["drain_calls"] > 0, (mode, r)
            assert r["leaked_blocks"] == 0, (mode, r)
    assert rep["modes"]["vanilla"]["rounds"][2]["contiguity"] < 0.9
    if "kvpool" in rep["modes"]:
        assert rep["comparison"]["kvpool"]["rounds_identical_to_vanilla"] == 3
        assert all(r["contiguity"] >= 0.99 for r in rep["modes"]["kvpool+reorder"]["rounds"])


def test_long_sequential_without_prefix_caching_alternates_direction(tmp_path):
    # vLLM prepends a finished request's un-hashed blocks in reverse, so the next
    # same-sized request gets them in descending order, the one after ascending again.
    rep = _replay(tmp_path, "--workload", "long-sequential", "--scale", "0.01", "--rounds", "4",
                  modes=_modes_here())
    van = [r["contiguity"] for r in rep["modes"]["vanilla"]["rounds"]]
    assert van[0] == 1.0 and van[1] == 0.0 and van[2] == 1.0, van
    assert rep["modes"]["vanilla"]["rounds"][1]["prompt_descending"] == 1.0
    if "kvpool+reorder" in rep["modes"]:
        assert [r["contiguity"] for r in rep["modes"]["kvpool+reorder"]["rounds"]] == [1.0] * 4


def test_a_workload_that_cannot_fit_the_pool_is_an_error_not_a_hang():
    env = cpu_environment(dict(os.environ))
    cmd = [sys.executable, "-m", "kvpool", "replay", "--num-blocks", "2000", "--rounds", "1",
           "--modes", "kvpool", "--scale", "0.05", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "usable blocks" in proc.stderr and "Traceback" not in proc.stderr


def test_kvpool_contiguous_keeps_vanillas_cache_behaviour_and_reports_its_policy(grpo_report):
    _need_contiguous()
    co = grpo_report["modes"]["kvpool+contiguous"]
    assert co["info"]["allocation"] == "contiguous" and co["info"]["pool_allocation"] == "contiguous"
    assert co["info"]["reorder_api"] is None and all("reorder_ok" not in r for r in co["rounds"])
    assert grpo_report["comparison"]["kvpool+contiguous"]["rounds_cache_equal_to_vanilla"] == 6
    assert "sched_cpu_ratio_vs_kvpool" in grpo_report["comparison"]["kvpool+contiguous"]


def test_kvpool_modes_are_reported_unavailable_when_the_extension_is_not_built(monkeypatch):
    # ``import kvpool`` works without the built extension; the replay must say so
    # before a mode starts, not fail later inside ``install()``.
    from kvpool.tools.replay import modes

    monkeypatch.setitem(sys.modules, "kvpool._core", None)
    why = modes.mode_unavailable_reason("kvpool+contiguous")
    assert why is not None and "bootstrap.sh" in why
    assert modes.mode_unavailable_reason("vanilla") is None
    with pytest.raises(modes.ModeUnavailable):
        modes.set_mode("kvpool")


# --- serving: continuous load, rounds are windows ----------------------------------------


def test_serving_arrivals_are_reproducible_poisson_with_shared_system_prompts():
    a = workloads.serving(rounds=4, window_steps=500, seed=1)
    assert a.requests == workloads.serving(rounds=4, window_steps=500, seed=1).requests
    assert a.requests != workloads.serving(rounds=4, window_steps=500, seed=2).requests
    assert a.continuous and a.window_steps == 500 and a.num_rounds == 4
    steps = [r.arrival_step for r in a.requests]
    assert steps == sorted(steps) and steps[0] == 0 and max(steps) < 4 * 500
    assert sum(s == 0 for s in steps) >= 48  # the run starts loaded
    assert all(r.round == r.arrival_step // 500 for r in a.requests)
    # After the initial burst, gaps between arrivals look exponential: mean ~ 1/rate.
    rate = a.params["arrival_rate_per_step"]
    later = [s for s in steps if s > 0]
    assert 0.5 / rate < (later[-1] - later[0]) / (len(later) - 1) < 2.0 / rate
    grouped = [r for r in a.requests if r.prefix_group is not None]
    assert 0.6 < len(grouped) / len(a.requests) < 0.9
    by_group = {}
    for r in grouped:
        by_group.setdefault(r.prefix_group, set()).add(r.prefix_len)
    assert all(len(lens) == 1 for lens in by_group.values())  # one system prompt per group
    assert len({r.prompt_len for r in a.requests}) > 50 and len({r.output_len for r in a.requests}) > 50
    eng = a.engine
    assert eng.enable_prefix_caching and eng.enable_chunked_prefill and eng.max_num_seqs == 64


def test_serving_model_keeps_32_to_64_requests_in_flight():
    """The arrival generator's own engine model (residence = output + prefill steps)."""
    wl = workloads.serving(rounds=6, window_steps=400, seed=0, scale=0.25)
    events = []
    for r in wl.requests:
        events.append((r.arrival_step, 1))
        events.append((r.arrival_step + r.output_len + -(-r.prompt_len // 8192), -1))
    events.sort(key=lambda e: (e[0], e[1]))  # departures before arrivals at one step
    n, seen = 0, []
    for step, d in events:
        n += d
        if 0 < step < 6 * 400:
            seen.append(n)
    assert min(seen) >= 32 and max(seen) <= 64, (min(seen), max(seen))


def test_continuous_trace_carries_arrival_steps_and_windows(tmp_path):
    t = tmp_path / "serve.jsonl"
    t.write_text(
        '{"prompt_len": 300, "output_len": 20, "arrival_step": 0, "prefix_group": "sys", "prefix_len": 128}\n'
        '{"prompt_len": 200, "output_len": 10, "arrival_step": 250}\n'
        '{"prompt_len": 100, "output_len": 5, "arrival_step": 99}\n'
    )
    wl = traces.from_trace(t, window_steps=100)
    assert wl.continuous and wl.window_steps == 100 and wl.num_rounds == 3
    assert [r.round for r in wl.requests] == [0, 2, 0]
    assert [r.arrival_step for r in wl.stream_requests()] == [0, 99, 250]
    assert wl.requests[0].shared_len() == 128 and wl.requests[1].shared_len() == 0
    assert wl.engine.enable_chunked_prefill
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"round": 0, "prompt_len": 10, "output_len": 2}\n'
                     '{"prompt_len": 10, "output_len": 2, "arrival_step": 3}\n')
    with pytest.raises(ValueError, match=r"mixed\.jsonl:2"):
        traces.from_trace(mixed)
    no_arrival = tmp_path / "na.jsonl"
    no_arrival.write_text('{"prompt_len": 10, "output_len": 2}\n')
    with pytest.raises(ValueError, match="arrival_step"):
        traces.from_trace(no_arrival)


SERVING_SMALL = ("--workload", "serving", "--rounds", "2", "--window-steps", "150", "--block-size", "16",
                 "--prompt-len", "256,2048", "--output-len", "16,128")


def test_serving_never_idles_and_keeps_its_requests_in_flight(tmp_path):
    rep = _replay(tmp_path, *SERVING_SMALL, "--num-blocks", "6000", modes=("vanilla",))
    assert rep["workload"]["continuous"] is True
    res = rep["modes"]["vanilla"]
    assert len(res["rounds"]) == 2
    for r in res["rounds"]:
        assert r["num_steps"] == 150 and r["idle_steps"] == 0, r
        assert r["in_flight_min"] >= 32 and r["in_flight_max"] <= 64, r
        assert r["arrivals"] > 0 and r["finished"] > 0
        assert r["contiguity"] is not None and r["prefix_cache_hit_tokens"] > 0
    assert "reset_ok" not in res["rounds"][1]  # never drained, never reset
    drain = res["info"]["drain"]
    assert drain["leaked_blocks"] == 0 and drain["finished"] > 0


def test_serving_under_preemption_keeps_vanillas_hits_evictions_and_preemptions(tmp_path):
    """A pool too small for the load: requests are preempted and cached blocks evicted
    every window; every kvpool mode must hit, evict and preempt exactly as vLLM."""
    _need_kvpool()
    modes = tuple(m for m in _modes_here() if m != "kvpool+reorder")  # reorder never runs mid-stream
    rep = _replay(tmp_path, *SERVING_SMALL, "--num-blocks", "2000", modes=modes)
    van = rep["modes"]["vanilla"]["rounds"]
    assert sum(r["preemptions"] for r in van) > 0 and all(r["evictions"] > 0 for r in van)
    _assert_cache_equal_to_vanilla(rep)
    assert rep["comparison"]["kvpool"]["rounds_identical_to_vanilla"] == 2
    for res in rep["modes"].values():
        assert res["info"]["drain"]["leaked_blocks"] == 0
