"""``python -m kvpool locality``: layouts, the recorded replay tables, the FlexAttention
path against the gather + SDPA reference, and a smoke run of the command on a tiny pool.

No timing is asserted: the command's numbers depend on the machine; what is protected
is that every layout times the same requests, that the tables really have the layout
they are named after, and that the kernel reads the block table correctly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpool.cpu_platform import cpu_environment
from kvpool.tools.locality import layouts, replay_tables
from kvpool.tools.replay import metrics
from tests.support.paths import REPO

TINY = ["--num-blocks", "512", "--num-kv-heads", "2", "--num-heads", "4", "--head-size", "64",
        "--prefill", "128x2", "--decode", "96x20", "--warmup", "1", "--reps", "2", "--quiet"]


# --- layouts ----------------------------------------------------------------------


def _flat(tables):
    return [b for t in tables for b in t]


@pytest.mark.parametrize("layout", ["canonical", "descending", "random"])
def test_layout_tables_are_disjoint_and_never_use_the_null_block(layout):
    tables, recorded = layouts.layout_tables(layout, 5, 7, 100, seed=1)
    ids = _flat(tables)
    assert [len(t) for t in tables] == [7] * 5
    assert len(set(ids)) == len(ids) and min(ids) >= 1 and max(ids) <= 99
    assert recorded == 1.0


def test_canonical_tables_are_ascending_runs_and_descending_tables_descending_runs():
    canon, _ = layouts.layout_tables("canonical", 4, 8, 100)
    desc, _ = layouts.layout_tables("descending", 4, 8, 100)
    assert metrics.contiguity(canon) == 1.0 and metrics.mean_run_length(canon) == 8
    assert metrics.descending_fraction(desc) == 1.0 and metrics.contiguity(desc) == 0.0
    assert sorted(_flat(canon)) == sorted(_flat(desc)) == list(range(1, 33))


def test_random_layout_is_a_seeded_selection_from_the_whole_pool():
    a, _ = layouts.layout_tables("random", 4, 50, 1000, seed=7)
    b, _ = layouts.layout_tables("random", 4, 50, 1000, seed=7)
    c, _ = layouts.layout_tables("random", 4, 50, 1000, seed=8)
    assert a == b and a != c
    assert max(_flat(a)) > 500  # drawn from the whole pool, not the first 200 ids
    assert metrics.contiguity(a) < 0.05
    # With every usable block requested, it is a permutation of the pool.
    full, _ = layouts.layout_tables("random", 9, 111, 1000, seed=7)
    assert sorted(_flat(full)) == list(range(1, 1000))


def test_a_batch_larger_than_the_pool_is_a_layout_error():
    with pytest.raises(layouts.LayoutError, match="usable"):
        layouts.layout_tables("canonical", 10, 10, 100)
    with pytest.raises(layouts.LayoutError, match="unknown layout"):
        layouts.layout_tables("sideways", 1, 1, 100)


def test_fold_stream_keeps_runs_skips_repeats_and_fills_ascending():
    stream, recorded = layouts.fold_stream([[5, 6, 7, 14, 15], [3, 5, 1]], num_blocks=11, need=9)
    # 14 -> 4, 15 -> 5 (already taken); then 3, 5 (taken), 1; then unused ids ascending.
    assert stream == [5, 6, 7, 4, 3, 1, 2, 8, 9]
    assert recorded == 6


# --- recorded replay tables ------------------------------------------------------------


def test_run_length_code_round_trips():
    order = [1, 2, 3, 9, 8, 7, 20, 4, 5, 30, 29, 100]
    runs = replay_tables.encode_runs(order)
    assert runs == [[1, 3], [9, -3], [20, 1], [4, 2], [30, -2], [100, 1]]
    assert replay_tables.decode_runs(runs) == order


def test_shipped_replay_tables_are_small_and_show_the_scramble():
    path = replay_tables.DEFAULT_PATH
    assert path.stat().st_size < 400_000
    orders = replay_tables.load(path)
    assert replay_tables.default_layouts(path) == ["replay:vanilla@19", "replay:kvpool+reorder@19"]
    assert orders["kvpool"] == orders["vanilla"]  # kvpool allocates exactly as vLLM
    van = orders["vanilla"][19]
    reo = orders["kvpool+reorder"][19]
    assert len(set(van)) == len(van) and max(van) < 85_000
    assert metrics.contiguity([van]) < 0.2 < 0.8 < metrics.contiguity([reo])
    tables, recorded = layouts.layout_tables(
        "replay:vanilla@19", 8, 256, 85_000,
        replay_orders={"replay:vanilla@19": replay_tables.orders_for(orders, "replay:vanilla@19")})
    assert recorded == 1.0 and metrics.contiguity(tables) < 0.2
    with pytest.raises(ValueError, match="no such mode"):
        replay_tables.orders_for(orders, "replay:vanilla@3")


def test_replay_save_tables_output_loads_as_replay_layouts(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "replay.json"
    env = cpu_environment(dict(os.environ))
    cmd = [sys.executable, "-m", "kvpool", "replay", "--no-progress", "--quiet", "--modes", "vanilla",
           "--num-blocks", "800", "--block-size", "16", "--rounds", "4", "--prompt-len", "2000,3000",
           "--output-len", "40,160", "--seed", "3", "--save-tables", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for rnd in report["modes"]["vanilla"]["rounds"]:
        t = rnd["tables"]
        assert len(t["prompt"]) == len(t["finished"]) == rnd["num_requests"]
        assert metrics.contiguity(t["prompt"]) == pytest.approx(rnd["contiguity"])
        assert all(f[: len(p)] == p for p, f in zip(t["prompt"], t["finished"]))
    orders = replay_tables.load(out)
    assert sorted(orders["vanilla"]) == [0, 1, 2, 3]
    compact = tmp_path / "compact.json"
    assert replay_tables.main([str(out), str(compact), "--rounds", "2-3"]) == 0
    assert replay_tables.load(compact)["vanilla"] == {r: orders["vanilla"][r] for r in (2, 3)}
    assert replay_tables.default_layouts(compact) == ["replay:vanilla@3"]


# --- the transfer phase ------------------------------------------------------------------


def test_shipped_transfer_tables_are_post_wrap_serving_prompts_with_fewer_descriptors():
    from kvpool.tools.locality import transfer

    assert transfer.DEFAULT_PATH.stat().st_size < 400_000
    tables, source = transfer.load()
    assert source["workload"] == "serving" and source["num_blocks"] == 85_000
    assert set(tables) == {"vanilla", "kvpool+contiguous", "kvpool+contiguous+w64"}
    for ts in tables.values():  # the same requests, prompt by prompt (same hits, same lengths)
        assert [len(t) for t in ts] == [len(t) for t in tables["vanilla"]]
        for t in ts:  # the module's descriptors are the replay's
            assert len(transfer.descriptors(t)) == metrics.transfer_descriptors(t)
            assert sum(n for _, n in transfer.descriptors(t)) == sum(1 for b in t if b)
    count = {m: sum(len(transfer.descriptors(t)) for t in ts) for m, ts in tables.items()}
    # Recorded: 82,065 for vanilla, 6,695 with exact LRU, 3,317 with an LRU window of 64.
    assert count["kvpool+contiguous+w64"] < count["kvpool+contiguous"] < 0.25 * count["vanilla"]


def test_transfer_phase_copies_every_descriptor_and_checks_the_blocks(tmp_path, capsys):
    pytest.importorskip("torch")
    from kvpool.tools.locality import transfer

    out = tmp_path / "transfer.json"
    assert transfer.main(["--device", "cpu", "--max-prompts", "40", "--layers", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    tables, _ = transfer.load()
    modes = report["modes"]
    assert list(modes) == list(tables)
    for mode, r in modes.items():
        assert r["prompts"] == 40
        assert r["descriptors"] == sum(metrics.transfer_descriptors(t) for t in tables[mode][:40])
        assert r["copies"] == r["descriptors"] * 2 * 2  # layers x K/V
        assert r["blocks"] == modes["vanilla"]["blocks"] and r["bytes"] == modes["vanilla"]["bytes"]
    assert modes["kvpool+contiguous"]["descriptors"] < modes["vanilla"]["descriptors"]
    assert "one copy_ per descriptor" in capsys.readouterr().out


def test_transfer_phase_refuses_copies_that_misplace_blocks(monkeypatch):
    pytest.importorskip("torch")
    from kvpool.tools.locality import transfer

    tables = {"scrambled": [[5, 6, 7, 9]]}
    good = transfer.measure(tables, device="cpu", layers=1, block_size=1, num_kv_heads=1, head_size=4,
                            warmup=0, reps=1)
    assert good["modes"]["scrambled"]["descriptors"] == 2
    # A descriptor list that reads the runs in the wrong order puts the wrong blocks there.
    monkeypatch.setattr(transfer, "descriptors", lambda t: [(9, 1), (5, 3)])
    with pytest.raises(RuntimeError, match="did not reproduce"):
        transfer.measure(tables, device="cpu", layers=1, block_size=1, num_kv_heads=1, head_size=4,
                         warmup=0, reps=1)


@pytest.mark.parametrize("content,args,message", [
    (None, ["--max-prompts", "-1"], "whole number >= 0"),
    (None, ["--layers", "0"], "integer >= 1"),
    ("{not json", [], "not JSON"),
    ("[1, 2]", [], "neither a replay report"),
    ('{"format": "kvpool-replay-prompt-tables/1", "modes": {"x": {"rounds": {"4": [[[1000000000, 1]]]}}}}',
     [], "block id 1000000000"),
    ('{"format": "kvpool-replay-prompt-tables/1"}', [], "malformed"),
])
def test_transfer_phase_bad_input_is_a_one_line_error(tmp_path, capsys, content, args, message):
    from kvpool.tools.locality import transfer

    if content is not None:
        (tmp_path / "t.json").write_text(content)
        args = [*args, "--tables", str(tmp_path / "t.json")]
    with pytest.raises(SystemExit) as exc:
        transfer.main(["--device", "cpu", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_transfer_extract_keeps_the_post_wrap_prompt_tables(tmp_path):
    from kvpool.tools.locality import transfer

    def rnd(i, evictions, prompts):
        return {"round": i, "evictions": evictions, "tables": {"prompt": prompts, "finished": prompts}}

    report = {"workload": {"name": "serving"}, "config": {"num_blocks": 64},
              "modes": {"vanilla": {"rounds": [rnd(0, 0, [[1, 2]]), rnd(1, 5, [[9, 8, 7], [3]])]},
                        "kvpool+contiguous": {"rounds": [rnd(0, 0, [[1, 2]]), rnd(1, 5, [[7, 8, 9], [3]])]}}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert transfer.main(["--extract", str(tmp_path / "r.json"), str(tmp_path / "c.json")]) == 0
    tables, source = transfer.load(tmp_path / "c.json")
    assert tables == {"vanilla": [[9, 8, 7], [3]], "kvpool+contiguous": [[7, 8, 9], [3]]}
    assert source["num_blocks"] == 64
    del report["modes"]["vanilla"]["rounds"][1]["tables"]
    with pytest.raises(ValueError, match="--save-tables"):
        transfer.extract(report)


# --- kernels ----------------------------------------------------------------------------


def _skip_without_cpu_flex():
    pytest.importorskip("torch")
    from kvpool.tools.locality import kernels

    reason = kernels.flex_unsupported_reason("cpu")
    if reason:
        pytest.skip(reason)


def test_flex_kernel_matches_the_reference_and_reads_the_block_table():
    torch = pytest.importorskip("torch")
    _skip_without_cpu_flex()
    from kvpool.tools.locality import kernels

    torch.manual_seed(0)
    P, bs, hkv, d, hq = 96, 32, 2, 64, 4
    for num_requests, query_len, context_len in [(2, 128, 128), (20, 1, 100)]:
        n = -(-context_len // bs)
        q = torch.randn(num_requests * query_len, hq, d, dtype=torch.bfloat16)
        # The same logical K/V written under two layouts: the output must not change.
        logical_k = torch.randn(num_requests, n, bs, hkv, d, dtype=torch.bfloat16)
        logical_v = torch.randn_like(logical_k)
        flex = kernels.FlexPagedAttention(num_requests, query_len, context_len, P, bs, "cpu")
        outs = {}
        for layout in ("canonical", "random"):
            tables, _ = layouts.layout_tables(layout, num_requests, n, P, seed=3)
            bt = kernels.tables_tensor(tables, "cpu")
            k_cache = torch.randn(P, bs, hkv, d, dtype=torch.bfloat16)  # garbage outside the tables
            v_cache = torch.randn_like(k_cache)
            k_cache[bt.long()] = logical_k
            v_cache[bt.long()] = logical_v
            flex.set_block_table(bt)
            got = flex(q, k_cache, v_cache).float()
            want = kernels.reference_paged_attention(q, k_cache, v_cache, bt, query_len, context_len).float()
            assert got.shape == (num_requests * query_len, hq, d)
            assert (got - want).abs().max().item() < 0.03, (layout, num_requests, query_len)
            outs[layout] = got
        assert (outs["canonical"] - outs["random"]).abs().max().item() < 0.03


def test_reference_decode_equals_the_last_row_of_the_prefill():
    torch = pytest.importorskip("torch")
    from kvpool.tools.locality import kernels

    torch.manual_seed(1)
    k_cache = torch.randn(40, 16, 2, 32)
    v_cache = torch.randn_like(k_cache)
    bt = kernels.tables_tensor(layouts.layout_tables("random", 2, 3, 40, seed=5)[0], "cpu")
    q = torch.randn(2 * 48, 4, 32)
    full = kernels.reference_paged_attention(q, k_cache, v_cache, bt, 48, 48).view(2, 48, 4, 32)
    last = kernels.reference_paged_attention(q.view(2, 48, 4, 32)[:, -1].reshape(2, 4, 32), k_cache, v_cache, bt, 1, 48)
    assert torch.allclose(full[:, -1], last, atol=1e-5)


# --- the command ------------------------------------------------------------------------


def test_locality_command_times_every_layout_for_both_phases(tmp_path, capsys):
    pytest.importorskip("torch")
    from kvpool.__main__ import main

    out = tmp_path / "loc.json"
    assert main(["locality", "--device", "cpu", *TINY, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "geometry: 512 blocks x 32 tokens, 2 KV heads x 64" in printed
    rep = json.loads(out.read_text())
    assert rep["device"]["type"] == "cpu" and rep["kernel"] == "reference"
    assert rep["geometry"]["num_blocks"] == 512 and rep["geometry"]["block_size"] == 32
    want = {"canonical", "descending", "random", "replay:vanilla@19", "replay:kvpool+reorder@19"}
    for phase in ("prefill", "decode"):
        rows = {r["layout"]: r for r in rep["results"] if r["phase"] == phase}
        assert set(rows) == want
        assert rows["canonical"]["ratio_vs_canonical"] == 1.0
        for r in rows.values():
            assert r["median_s"] > 0 and r["iqr_s"] >= 0 and r["reps"] == 2
            assert r["ratio_vs_canonical"] == pytest.approx(r["median_s"] / rows["canonical"]["median_s"])
        assert rows["canonical"]["contiguity"] == 1.0
        assert rows["descending"]["contiguity"] == 0.0 and rows["random"]["contiguity"] < 0.1
        assert rows["replay:vanilla@19"]["contiguity"] < 0.2


def test_locality_command_checks_the_flex_kernel_against_the_reference(tmp_path):
    _skip_without_cpu_flex()
    from kvpool.tools.locality.cli import main

    out = tmp_path / "loc.json"
    args = [*TINY, "--prefill", "64x2", "--decode", "", "--layouts", "canonical,random", "--reps", "1"]
    assert main(["--device", "cpu", "--kernel", "flex", "--check", *args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["layout"] for r in rows] == ["canonical", "random"]
    assert all(r["max_abs_diff_vs_reference"] < 0.03 for r in rows)


def test_bad_arguments_are_errors_not_tracebacks(capsys):
    pytest.importorskip("torch")
    from kvpool.tools.locality.cli import main

    assert main(["--device", "cpu", *TINY, "--decode", "100000x10"]) == 2
    assert "usable" in capsys.readouterr().err
    assert main(["--device", "cpu", *TINY, "--layouts", "canonical,sideways"]) == 2
    assert "unknown layout" in capsys.readouterr().err


def test_flex_on_a_cpu_without_inductor_s_flex_kernel_is_a_one_line_error(monkeypatch, capsys):
    # aarch64 (Grace) or a CPU without AVX2: torch's own check says no, and the command says
    # so instead of failing inside Inductor's compile.
    pytest.importorskip("torch")
    flex_cpu = pytest.importorskip("torch._inductor.kernel.flex.flex_cpu")
    from kvpool.tools.locality import kernels
    from kvpool.tools.locality.cli import main

    monkeypatch.setattr(flex_cpu, "check_cpu_supported", lambda: False)
    assert "needs x86 AVX2" in kernels.flex_unsupported_reason("cpu")
    assert kernels.flex_unsupported_reason("cuda") is None
    assert main(["--device", "cpu", "--kernel", "flex", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kernel flex" in err and "--kernel reference" in err


def test_without_torch_the_command_says_so(monkeypatch, capsys):
    from kvpool.tools.locality.cli import main

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert main(["--device", "cpu"]) == 2
    assert "needs torch" in capsys.readouterr().err
