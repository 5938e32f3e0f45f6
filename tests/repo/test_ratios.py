"""The benchmark ratio table CI gates (benchmarks/ratios.py, benchmarks/check_ratios.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks import check_ratios
from benchmarks.ratios import TARGETS, ratio_rows


def _bench(group, impl, median, round_=None):
    extra = {"impl": impl, "blocks": 10}
    if round_ is not None:
        extra["round"] = round_
    return {"group": group, "name": f"{group}[{impl}]", "median": median, "extra_info": extra}


def test_numbered_rounds_are_compared_round_by_round():
    """Round r of every mode is the same work: the ratio is the median of the rounds'
    ratios (0.5, 4, 4/3 -> 4/3), not the ratio of the modes' medians (4 / 2)."""
    vllm, kvpool = [1.0, 4.0, 4.0], [2.0, 1.0, 3.0]
    rows = ratio_rows([_bench("g", "vllm", v, r) for r, v in enumerate(vllm)]
                      + [_bench("g", "kvpool", k, r) for r, k in enumerate(kvpool)])
    assert rows[0]["ratio"] == pytest.approx(4 / 3)
    assert (rows[0]["vllm_s"], rows[0]["kvpool_s"]) == (4.0, 2.0)  # the printed medians


def test_benchmarks_without_rounds_use_the_ratio_of_medians():
    rows = ratio_rows([_bench("reorder", "vllm", 3.0), _bench("reorder", "kvpool", 0.01)])
    assert rows[0]["ratio"] == pytest.approx(300.0) and rows[0]["target"] == TARGETS["reorder"]


def _write(tmp_path, name, ratio):
    path = tmp_path / name
    benchmarks = [{"group": "reorder", "name": n, "stats": {"median": m}, "extra_info": {"impl": i}}
                  for n, i, m in (("a", "vllm", 1.0), ("b", "kvpool", 1.0 / ratio))]
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    return str(path)


def test_ci_fails_only_when_a_ratio_is_below_target_in_every_run(tmp_path, capsys):
    low, high = TARGETS["reorder"] / 2, TARGETS["reorder"] * 2
    assert check_ratios.main([_write(tmp_path, "1.json", high)]) == 0
    assert check_ratios.main([_write(tmp_path, "2.json", low)]) == 1
    assert check_ratios.main([_write(tmp_path, "2.json", low), _write(tmp_path, "3.json", high)]) == 0
    assert check_ratios.main([_write(tmp_path, "2.json", low), _write(tmp_path, "4.json", low)]) == 1
    assert "below target in every run: reorder" in capsys.readouterr().out


def test_two_builds_are_compared_pair_by_pair(tmp_path, capsys):
    """scripts/bench-wheel.sh alternates the builds: run i of each is a pair. The host's
    fast and slow states fall in different runs (vLLM's own Python moved 1.4x between
    neighbouring runs): the median of the pairs' relative ratios sees each pair in one
    state, where the ratio of each build's median would set a fast source run against a
    slow wheel run."""
    from benchmarks import compare_builds

    # Source and wheel equal in each pair (relative 1.0), the host twice as slow for pair 2.
    src = [300.0, 150.0, 300.0, 150.0]
    whl = [300.0, 150.0, 290.0, 150.0]
    assert compare_builds.paired_relative(src, whl) == pytest.approx(1.0)
    a = [_write(tmp_path, f"a{i}.json", r) for i, r in enumerate(src)]
    b = [_write(tmp_path, f"b{i}.json", r) for i, r in enumerate(whl)]
    assert compare_builds.main(["--a", "source", *a, "--b", "wheel", *b]) == 0
    # A wheel 20% below in every pair fails, whatever the host did.
    b = [_write(tmp_path, f"c{i}.json", r * 0.8) for i, r in enumerate(src)]
    assert compare_builds.main(["--a", "source", *a, "--b", "wheel", *b]) == 1
    assert "paired median ratio of a targeted group: 0.80" in capsys.readouterr().out
    # A run without a partner is left out; no pair at all is an error, not a verdict.
    assert compare_builds.paired_relative([1.0, 2.0], [1.0]) == 1.0
    with pytest.raises(ValueError, match="no pair"):
        compare_builds.paired_relative([], [1.0])


def test_the_second_measurement_reruns_only_the_groups_of_the_rows_below_target(tmp_path):
    """``--rerun-ids``: the node ids of every benchmark of a row's group (vLLM's side, each
    kvpool mode, each round, in the order they ran) when the row is below target; nothing
    of a group whose rows all met theirs; an empty file when every row did."""
    goal = TARGETS["replay_serving_dense_contiguous"]
    benchmarks = []
    for group, contiguous_ratio in (("replay_serving_dense", goal / 2), ("replay_grpo", 3.0)):
        for r in range(2):
            for impl, median in (("vllm", 1.0), ("kvpool", 0.1), ("kvpool_contiguous", 1.0 / contiguous_ratio)):
                node = f"b.py::t[{group}-{r}-{impl}]"
                benchmarks.append({"group": group, "name": node, "fullname": node,
                                   "stats": {"median": median}, "extra_info": {"impl": impl, "round": r}})
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"benchmarks": benchmarks}))
    ids = tmp_path / "rerun.ids"
    assert check_ratios.main([str(run), "--rerun-ids", str(ids)]) == 1
    assert ids.read_text().splitlines() == [f"b.py::t[replay_serving_dense-{r}-{impl}]" for r in range(2)
                                            for impl in ("vllm", "kvpool", "kvpool_contiguous")]
    for b in benchmarks:
        b["stats"]["median"] = 0.1 if b["extra_info"]["impl"] != "vllm" else 1.0
    run.write_text(json.dumps({"benchmarks": benchmarks}))
    assert check_ratios.main([str(run), "--rerun-ids", str(ids)]) == 0
    assert ids.read_text() == ""
