"""``python -m kvpool replay``: metric definitions, workloads, and end-to-end runs of
vLLM's real scheduler (no model) in all three modes.

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

from kvpool.replay import metrics, workloads
from kvpool.replay.driver import MODES, kvpool_unavailable_reason

REPO = Path(__file__).resolve().parents[1]
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
    wl = workloads.from_trace(good)
    assert wl.num_rounds == 2
    assert wl.requests[0] == workloads.RequestSpec(0, 100, 5, "7", 0)
    assert wl.requests[1] == workloads.RequestSpec(1, 50, 3, None, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"round": 0, "prompt_len": 100, "output_len": 5}\n{"round": 0, "prompt_len": 10}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        workloads.from_trace(bad)


def test_kvpool_modes_are_reported_skipped_when_kvpool_is_not_importable(monkeypatch):
    from kvpool.replay import driver

    def unavailable():
        raise driver.ModeUnavailable("kvpool is not importable (test)")

    monkeypatch.setattr(driver, "_kvpool_api", unavailable)
    skipped = []
    res = driver.run_replay(workloads.grpo(rounds=1), driver.PoolSpec(), ("kvpool", "kvpool+reorder"),
                            on_skip=lambda m, why: skipped.append(m))
    assert res["modes"] == {m: {"skipped": "kvpool is not importable (test)"} for m in ("kvpool", "kvpool+reorder")}
    assert skipped == ["kvpool", "kvpool+reorder"]


# --- end to end through vLLM's scheduler ---------------------------------------------


def _replay(tmp_path: Path, *args: str, modes=MODES) -> dict:
    out = tmp_path / "report.json"
    env = dict(os.environ)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "kvpool", "replay", "--no-progress", "--modes", ",".join(modes),
           "--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _modes_here() -> tuple[str, ...]:
    return MODES if kvpool_unavailable_reason() is None else ("vanilla",)


def _need_kvpool():
    why = kvpool_unavailable_reason()
    if why is not None:
        pytest.skip(f"kvpool modes skipped: {why}")


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
            assert ROUND_KEYS <= set(rnd), ROUND_KEYS - set(rnd)
            assert 0.0 <= rnd["contiguity"] <= 1.0
            assert rnd["num_steps"] > 0 and rnd["sched_cpu_s_per_step"] > 0
            assert rnd["leaked_blocks"] == 0, (mode, i)
            assert rnd["preemptions"] == 0
            if i > 0:
                assert rnd["reset_ok"] is True


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
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    cmd = [sys.executable, "-m", "kvpool", "replay", "--num-blocks", "2000", "--rounds", "1",
           "--modes", "kvpool", "--scale", "0.05", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "usable blocks" in proc.stderr and "Traceback" not in proc.stderr
