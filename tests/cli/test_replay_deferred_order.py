"""Seed 003 on real hybrid shapes: kvpool's fenced deferred frees leave every KV cache
group's free-queue (eviction) order as vLLM's immediate free path would.

``--workload pd-async`` (async scheduling with a KV consumer: vLLM turns deferred block
frees on) with ``--model`` for a full + sliding-window shape (gpt-oss-20b) and a full +
Mamba/GDN shape (Qwen3-Next), in three modes: ``kvpool``; ``vanilla+immediate-order``,
vLLM's own classes making the immediate path's calls (one reversed ``free_blocks`` per KV
cache group, ``KVCacheCoordinator.free``) when its drain frees, so with the same
decisions; and ``vanilla``, vLLM 0.34.0's deferred path (one reversed call over all
groups), which shows the comparison can tell the orders apart.
"""

from __future__ import annotations

import pytest

from kvpool.tools.replay.free_order import REFERENCE
from kvpool.tools.replay.modes import mode_unavailable_reason
from tests.cli.test_replay_models import MAMBA, SLIDING, _replay

pytestmark = pytest.mark.skipif(mode_unavailable_reason("kvpool") is not None,
                                reason="kvpool's extension is not built")
MODES = ("vanilla", "kvpool", REFERENCE)


def _check_kvpool_is_the_immediate_order(rep: dict, kinds: list[str]) -> None:
    kv = rep["comparison"]["kvpool"]["vs_immediate_order"]
    n = kv["rounds_compared"]
    assert n == len(rep["modes"]["kvpool"]["rounds"]) > 0
    assert kv["rounds_tables_equal"] == kv["rounds_evictions_equal"] == kv["rounds_free_queue_equal"] == n
    assert [g["kind"] for g in kv["by_group"]] == kinds
    for g in kv["by_group"]:
        assert g["rounds_tables_equal"] == g["rounds_free_order_equal"] == n, g
    for mode in ("kvpool", REFERENCE):
        for x in rep["modes"][mode]["rounds"]:
            assert x["deferred_frees"] > 0 and x["leaked_blocks"] == 0, (mode, x["round"])
            assert all(g["freed_blocks"] > 0 for g in x["by_group"]), (mode, x["round"])
    assert f"kvpool vs {REFERENCE}" in rep["stdout"]


def test_sliding_window_shape_deferred_frees_keep_each_groups_immediate_order(tmp_path):
    rep = _replay(tmp_path, "--workload", "pd-async", "--rounds", "2", "--scale", "0.05", "--model", SLIDING,
                  "--kv-memory-gib", "1", modes=MODES)
    _check_kvpool_is_the_immediate_order(rep, ["SlidingWindowSpec", "FullAttentionSpec"])
    # vLLM 0.34.0's own deferred path frees both groups' cached blocks in one reversed
    # call: the free queue and the tables after the first reuse differ from the reference.
    van = rep["comparison"]["vanilla"]["vs_immediate_order"]
    assert van["rounds_free_queue_equal"] < van["rounds_compared"]
    assert van["rounds_tables_equal"] < van["rounds_compared"]
    assert any(g["rounds_free_order_equal"] < van["rounds_compared"] for g in van["by_group"])


def test_mamba_shape_deferred_frees_keep_each_groups_immediate_order(tmp_path):
    rep = _replay(tmp_path, "--workload", "pd-async", "--rounds", "1", "--model", MAMBA, "--kv-memory-gib", "4",
                  modes=MODES)
    _check_kvpool_is_the_immediate_order(rep, ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"])
    geo = rep["config"]["kv_cache_geometry"]
    assert geo["mamba_cache_mode"] == "align"
