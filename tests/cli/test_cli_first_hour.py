"""What a new user meets first (issue 20): flags checked before any work, results written
before anything that can fail, a verdict, tables that fit, plots whose lines and labels
never hide each other."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cpu_platform import cpu_environment
from kvpool.tools.replay import cli as replay_cli, report
from tests.support.paths import REPO


# -- flags and paths checked before any work ------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--scale", "-1"], "argument --scale: expected a number > 0, got '-1'"),
    (["--scale", "0"], "argument --scale: expected a number > 0"),
    (["--scale", "nan"], "argument --scale: expected a number > 0"),
    (["--rounds", "0"], "argument --rounds: expected an integer >= 1"),
    (["--num-blocks", "1"], "argument --num-blocks: expected an integer >= 2"),
    (["--block-size", "0"], "argument --block-size: expected an integer >= 1"),
    (["--window-steps", "0"], "argument --window-steps: expected an integer >= 1"),
    (["--plot", "/nonexistent/dir/x.png"], "argument --plot: cannot write '/nonexistent/dir/x.png': folder"),
    (["--plot", "{tmp}/x.txt"], "the suffix must be one of .png"),
    (["--json", "/nonexistent/dir/x.json"], "argument --json: cannot write '/nonexistent/dir/x.json'"),
    (["--json", "{tmp}"], "is a directory, not a file path"),
    (["--save-tables"], "--save-tables needs --json PATH"),
    (["--no-plot", "--plot", "{tmp}/x.png"], "--plot and --no-plot exclude each other"),
])
def test_replay_rejects_bad_flags_and_paths_before_any_work(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as info:
        replay_cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_replay_rejects_an_unwritable_output_folder(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        replay_cli.main(["--json", str(locked / "r.json")])
    assert "is not writable" in capsys.readouterr().err


def test_replay_default_outputs_are_the_json_and_a_plot_next_to_it(tmp_path):
    args = replay_cli.build_parser().parse_args(["--json", str(tmp_path / "run.json")])
    assert replay_cli.output_paths(args, replay_cli.build_parser()) == (tmp_path / "run.json", tmp_path / "run.png")
    args = replay_cli.build_parser().parse_args(["--workload", "serving"])
    json_path, plot_path = replay_cli.output_paths(args, replay_cli.build_parser())
    assert json_path == Path(replay_cli.DEFAULT_OUT_DIR) / "serving.json" and plot_path == json_path.with_suffix(".png")
    args = replay_cli.build_parser().parse_args(["--no-plot"])
    assert replay_cli.output_paths(args, replay_cli.build_parser())[1] is None
    # a model's run keeps its own file beside the hand-built group's
    model = ["--model", "Qwen/Qwen3-Next-80B-A3B-Instruct"]
    args = replay_cli.build_parser().parse_args(["--workload", "serving", *model])
    assert replay_cli.output_paths(args, replay_cli.build_parser())[0] == \
        Path(replay_cli.DEFAULT_OUT_DIR) / "serving-Qwen3-Next-80B-A3B-Instruct.json"


SMALL = ["--num-blocks", "800", "--block-size", "16", "--rounds", "2", "--prompt-len", "2000,3000",
         "--output-len", "40,160", "--no-progress"]


@pytest.fixture
def own_environ():
    # The replay runs in this process here: vLLM's CPU platform adds its libraries to
    # os.environ["LD_PRELOAD"], which later subprocesses (the C++ unit test) must not get.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_replay_writes_its_json_with_the_verdict_before_the_plot_can_fail(tmp_path, monkeypatch, own_environ):
    pytest.importorskip("vllm")

    def broken_plot(rep, path):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(report, "plot", broken_plot)
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="the plot failed"):
        replay_cli.main([*SMALL, "--modes", "vanilla,kvpool+reorder", "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rep["verdict"] and rep["verdict"][0].startswith("verdict: ")
    assert set(rep["modes"]) == {"vanilla", "kvpool+reorder"}


def test_replay_cli_ends_with_the_verdict_and_writes_the_plot_by_default(tmp_path):
    pytest.importorskip("vllm")
    env = cpu_environment(dict(os.environ))
    env.pop("COLUMNS", None)
    proc = subprocess.run([sys.executable, "-m", "kvpool", "replay", *SMALL, "--modes", "vanilla,kvpool+reorder"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The verdict comes last (wrapped to the width like everything else).
    tail = proc.stdout[proc.stdout.rindex("verdict: "):]
    verdict = " ".join(tail.split())
    assert "└" not in tail and verdict.startswith("verdict: ")
    assert "kvpool+reorder (min " in verdict and "hits/evictions/preemptions = vanilla's" in verdict
    assert (tmp_path / "replay-out" / "grpo.json").is_file()
    assert (tmp_path / "replay-out" / "grpo.png").stat().st_size > 10_000
    # Piped: a readable fixed width, nothing cut.
    assert max(map(len, proc.stdout.splitlines())) <= replay_cli.PIPED_WIDTH
    assert "…" not in proc.stdout


# -- the verdict -------------------------------------------------------------------------
def _round(i, contiguity, cpu=2e-4, **kw):
    return {"round": i, "contiguity": contiguity, "table_contiguity": contiguity, "sched_cpu_s_per_step": cpu,
            "max_block_id": 100 * (i + 1), "num_steps": 10, **kw}


def _synthetic_report(n=20, collapse_at=14):
    falling = [_round(i, 1.0 if i < collapse_at else 0.0) for i in range(n)]
    flat = [_round(i, 1.0) for i in range(n)]
    modes = {"vanilla": {"rounds": falling}, "kvpool": {"rounds": falling},
             "kvpool+reorder": {"rounds": flat}, "kvpool+contiguous": {"rounds": flat}}
    cmp_ = {m: {"rounds_cache_equal_to_vanilla": n, "rounds_compared": n, "sched_cpu_ratio_vs_vanilla": r,
                "rounds_identical_to_vanilla": n if m == "kvpool" else 0}
            for m, r in (("kvpool", 0.97), ("kvpool+reorder", 1.02), ("kvpool+contiguous", 0.99))}
    cmp_["vanilla"] = {}
    return {"modes": modes, "comparison": cmp_, "workload": {"name": "grpo"},
            "config": {"num_blocks": 1400, "block_size": 32, "seed": 0, "vllm_version": "0.33.0"}}


def test_a_continuous_workload_leaves_out_kvpool_reorder_unless_asked(tmp_path):
    """``serving`` never idles between rounds, so no reorder runs and ``kvpool+reorder``
    would repeat ``kvpool``: without ``--modes`` it is left out there (a fresh-user
    trial's finding) and kept for a drained workload."""
    pytest.importorskip("vllm")
    from kvpool.tools.replay import workloads

    assert replay_cli.default_modes(workloads.grpo(rounds=1)) == replay_cli.MODES
    out = tmp_path / "s.json"
    serving = ["--workload", "serving", "--rounds", "1", "--window-steps", "20", "--num-blocks", "4000",
               "--block-size", "16", "--no-progress", "--no-plot", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "kvpool", "replay", *serving], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert list(rep["modes"]) == rep["config"]["modes_requested"] == ["vanilla", "kvpool", "kvpool+contiguous"]
    # (what it runs is said on stderr before the work, not only in the tables at the end)
    start = "replay serving: 1 round(s) x vanilla, kvpool, kvpool+contiguous; pool 4000 blocks x 16 tokens"
    assert start in proc.stderr and proc.stderr.index(start) < proc.stderr.index("wrote "), proc.stderr
    # (named, it runs: test_replay_writes_its_json_with_the_verdict_before_the_plot_can_fail)


def test_verdict_says_what_collapsed_what_held_and_by_how_much():
    lines = report.verdict(_synthetic_report())
    assert lines == [
        ("verdict: collapsed: vanilla, kvpool (vLLM order, by design) (prompt contiguity 1.000 -> 0.000, "
         "below 0.99 from round 14 of 20); held: kvpool+reorder (min 1.000), kvpool+contiguous (min 1.000) "
         "over 20 rounds."),
        ("         hits/evictions/preemptions = vanilla's in every round for kvpool, kvpool+reorder, "
         "kvpool+contiguous; scheduler CPU per step 0.97-1.02x vanilla's."),
    ]


def test_verdict_does_not_call_contiguity_that_never_fell_a_collapse():
    """A short run whose pool never wraps (a fresh-user trial: gpt-oss, 0.894 -> 0.894)
    is below 0.99 from its first round without falling: "no collapse", with its range;
    a fall of at least DROP_CONTIGUITY from the first round stays "collapsed"."""
    rep = _synthetic_report()
    for m, r in rep["modes"].items():
        r["rounds"] = [dict(x, contiguity=0.894 if m != "kvpool+contiguous" else 0.9 if x["round"] < 3 else 0.85)
                       for x in r["rounds"]]
    assert report.verdict(rep)[0] == (
        "verdict: collapsed: kvpool+contiguous (prompt contiguity 0.900 -> 0.850, below 0.99 from round 0 "
        "of 20); no collapse: vanilla, kvpool, kvpool+reorder (prompt contiguity 0.894-0.894 in every "
        "round, below 0.99 from the first; did the pool wrap?).")


# -- tables fit the terminal -------------------------------------------------------------
def _renderable_report() -> dict:
    """:func:`_synthetic_report` with every field the terminal tables read."""
    rep = _synthetic_report()
    for m, r in rep["modes"].items():
        r["info"] = {"block_pool_class": f"{'vllm' if m == 'vanilla' else 'kvpool'}.block_pool.BlockPool"}
        for x in r["rounds"]:
            x.update(mean_run_length=1409.7, prompt_descending=0.0, prefix_cache_hit_tokens=1_967_232,
                     evictions=0, eviction_digest="", preemptions=0, deferred_frees=0, deferred_blocks=0,
                     prefill_sched_cpu_s=0.02, leaked_blocks=0, drain_cpu_s_per_step=0.0)
    rep["workload"].update(description="GRPO rollout", params={})
    rep["config"].update(max_model_len=88064)
    return rep


@pytest.mark.parametrize("width", [80, 100, 120])
def test_replay_tables_fit_the_console_and_cut_no_value(width):
    from rich.console import Console

    rep = _renderable_report()
    buf = io.StringIO()
    report.render_tables(rep, Console(file=buf, width=width, color_system=None))
    text = buf.getvalue()
    assert max(map(len, text.splitlines())) <= width
    assert "…" not in text
    for value in ("1409.7", "1967232", "BlockPool", "0.97x"):
        assert value in text


def test_the_summary_names_the_group_its_contiguity_reads_on_a_hybrid_model():
    """With several KV cache groups the summary's contiguity is the first full-attention
    group's (as the per-round figures): the row says so; one group, no label."""
    rep = _renderable_report()

    def labels(groups):
        return [label for label, _ in report._summary_rows(rep["modes"], rep["comparison"], False, False, groups)]

    hybrid = labels([{"kind": "SlidingWindowSpec"}, {"kind": "FullAttentionSpec"}])
    assert "min / mean prompt contiguity (group 1, FullAttentionSpec)" in hybrid
    assert "min / mean prompt contiguity" in labels(None)
    assert labels([{"kind": "FullAttentionSpec"}]) == labels(None)


# -- plots: no line or label hides another --------------------------------------------------
def test_replay_plot_draws_coinciding_curves_visibly_and_keeps_the_legend_off_the_axes():
    pytest.importorskip("matplotlib")
    fig = report.figure(_synthetic_report())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        assert len(lines) == 4
        for a in lines:
            for b in lines:
                if a is b or list(a.get_ydata()) != list(b.get_ydata()):
                    continue
                # Same curve: different marker and line style, and the one on top thinner.
                assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())
                top, bottom = (a, b) if a.get_zorder() > b.get_zorder() else (b, a)
                assert top.get_linewidth() < bottom.get_linewidth(), (top.get_label(), bottom.get_label())
        legend_box = fig.legends[0].get_window_extent(renderer)
        assert not legend_box.overlaps(ax.get_window_extent(renderer))
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_locality_plot_labels_do_not_overlap():
    pytest.importorskip("matplotlib")
    from kvpool.tools.locality import cli as locality_cli

    layouts = ["canonical", "descending", "random", "replay:vanilla@19", "replay:kvpool@19",
               "replay:kvpool+reorder@19", "replay:kvpool+contiguous@19"]
    results = [{"batch": b, "layout": lay, "median_s": 1e-3 * (1 + i / 10), "q1_s": 0.9e-3 * (1 + i / 10),
                "q3_s": 1.1e-3 * (1 + i / 10),
                "ratio_vs_canonical": None if lay == "canonical" else 1 + i / 10}
               for b in ("prefill 2048x1", "decode 2048x64") for i, lay in enumerate(layouts)]
    rep = {"results": results, "kernel": "reference", "device": {"name": "cpu"},
           "geometry": {"num_blocks": 16384, "block_size": 32, "num_kv_heads": 8, "head_size": 128, "dtype": "bf16"}}
    fig = locality_cli.figure(rep)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert len(boxes) == len(layouts)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b)
    import matplotlib.pyplot as plt

    plt.close(fig)


# -- set-up is never silent --------------------------------------------------------------
def test_bootstrap_announces_every_install_step_with_a_line():
    lines = [ln.strip() for ln in (REPO / "scripts" / "bootstrap.sh").read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    installs = [i for i, ln in enumerate(code) if re.match(r"(pip|\"\$PY\" -m venv) ", ln)]
    assert len(installs) >= 8
    for i in installs:
        assert code[i - 1].startswith("step "), f"no progress line before: {code[i]}"
    proc = subprocess.run(["bash", "-c", (f"source <(sed -n '/^started=/,/^step()/p' {REPO}/scripts/bootstrap.sh); "
                            "step 'installing torch'")], capture_output=True, text=True)
    assert re.fullmatch(r"bootstrap \[0:0\d\] installing torch\n", proc.stdout), proc.stdout + proc.stderr


def test_replay_prints_the_answer_first_and_per_round_tables_only_when_asked():
    """By default the terminal gets the header and the per-mode summary (one screen, the
    verdict follows); ``--tables`` adds the per-round tables before it."""
    from rich.console import Console

    from kvpool.tools.replay.cli import build_parser

    rep = _renderable_report()
    texts = {}
    for per_round in (False, True):
        buf = io.StringIO()
        report.render_tables(rep, Console(file=buf, width=120, color_system=None), per_round=per_round)
        texts[per_round] = buf.getvalue()
    assert len(texts[False].splitlines()) <= 60
    assert "block-table contiguity" not in texts[False] and "block-table contiguity" in texts[True]
    assert "--tables" in texts[False]
    assert "per mode, all rounds" in texts[False] and "per mode, all rounds" in texts[True]
    assert "desc." not in texts[True]   # (no header that reads as descending or descriptors)
    args = build_parser().parse_args(["--tables"])
    assert args.tables and not build_parser().parse_args([]).tables


def test_small_ratios_keep_their_digits():
    """A 430-fold drop in descriptors reads 0.0023x, not 0.00x."""
    cell = report._ratio("prompt_descriptors_ratio_vs_vanilla")
    assert cell(None, None, {"prompt_descriptors_ratio_vs_vanilla": 1.8 / 778.0}) == "0.0023x"
    assert cell(None, None, {"prompt_descriptors_ratio_vs_vanilla": 0.76}) == "0.76x"
    assert cell(None, None, {"prompt_descriptors_ratio_vs_vanilla": 12.0}) == "12.00x"
