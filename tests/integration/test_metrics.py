"""kvpool's block-pool metrics on vLLM's ``/metrics`` (``kvpool.patches.metrics``, docs/metrics.md).

A real ``vllm serve`` cannot start on this CPU environment (vLLM is installed without
its CPU kernels and there are no weights), so the end-to-end tests run
tests/integration/metrics_harness.py in a fresh process: vLLM's real ``Scheduler`` (no model) steps
a few requests with ``log_stats=True``; ``make_stats()`` output goes through vLLM's
``MsgpackEncoder`` / ``MsgpackDecoder(EngineCoreOutputs)`` (what crosses from the engine
core to the API server) into vLLM's ``StatLoggerManager``; then vLLM's ``/metrics`` route
is served by uvicorn on 127.0.0.1 and scraped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvpool
from kvpool.cpu_platform import cpu_environment
from kvpool.patches import metrics
from tests.support.paths import REPO

HARNESS = Path(__file__).resolve().with_name("metrics_harness.py")

LABELS = {"model_name": "Qwen/Qwen3-0.6B", "engine": "0"}
GAUGE_KEYS = {name: key for name, key, _, _ in metrics.GAUGES}


def _samples(text: str) -> dict[str, dict[str, object]]:
    """``{sample name: {"labels": {...}, "value": float}}`` of an exposition (one sample
    per name is enough here: one engine)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = {"labels": dict(s.labels), "value": s.value}
    return out


def _harness(*args: str, disable_plugin: bool) -> dict:
    env = cpu_environment(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvpool.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    if disable_plugin:
        env["KVPOOL_DISABLE"] = "1"
    cmd = [sys.executable, str(HARNESS), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_exported(text: str, snapshot: dict[str, float]) -> None:
    samples = _samples(text)
    assert samples["vllm:num_requests_running"]["labels"] == LABELS  # vLLM's own, same registry
    for name, key in GAUGE_KEYS.items():
        assert samples[name]["labels"] == LABELS, name
        assert samples[name]["value"] == pytest.approx(snapshot[key]), name
    pairs = snapshot["table_pairs"]
    assert samples["vllm:kvpool_table_pairs_total"]["value"] == pairs
    assert samples["vllm:kvpool_table_ascending_pairs_total"]["value"] == round(snapshot["table_contiguity"] * pairs)


def test_pool_metrics_travel_from_make_stats_through_msgpack_to_the_metrics_route():
    """vLLM's own pool given a Python ``fragmentation_stats``: only ``kvpool.patches.metrics``
    is applied (no native build needed), and uninstalling it restores vLLM."""
    rep = _harness("fake", disable_plugin=True)
    snap = rep["snapshot"]
    assert snap is not None and set(snap) >= set(GAUGE_KEYS.values()) | {"table_pairs"}
    assert rep["decoded"] == snap  # the SchedulerStats field survives msgspec
    _assert_exported(rep["exposition"], snap)
    scraped = rep["scraped"]
    assert "error" not in scraped, scraped
    assert scraped["status"] == 200 and scraped["content_type"].startswith("text/plain")
    _assert_exported(scraped["body"], snap)
    assert rep["after_uninstall"] == {"field_gone": True, "make_stats_vanilla": True, "prom_vanilla": True}


def _kvpool_has_fragmentation_stats() -> str | None:
    try:
        from kvpool import _core  # noqa: F401
        from kvpool.block_pool import BlockPool
    except ImportError as e:
        return f"kvpool's BlockPool cannot be imported here ({e})"
    if not hasattr(BlockPool, "fragmentation_stats"):
        return "this kvpool build has no BlockPool.fragmentation_stats"
    return None


@pytest.mark.parametrize("contiguous", [False, True], ids=["vllm-order", "contiguous"])
def test_kvpool_pool_exports_its_free_runs_and_table_contiguity(contiguous):
    why = _kvpool_has_fragmentation_stats()
    if why:
        pytest.skip(why)
    rep = _harness("kvpool", *(["--contiguous"] if contiguous else []), disable_plugin=False)
    assert rep["pool_class"] == "kvpool.block_pool.BlockPool"
    if contiguous:
        assert rep["allocation"] == "contiguous"
    snap = rep["snapshot"]
    assert rep["decoded"] == snap
    # Free runs read natively equal those recomputed from the free list's block ids.
    for key in ("free_blocks", "free_runs", "largest_free_run"):
        assert snap[key] == rep["reference"][key], key
    assert snap["table_pairs"] > 0 and 0.0 <= snap["table_contiguity"] <= 1.0
    _assert_exported(rep["exposition"], snap)
    _assert_exported(rep["scraped"]["body"], snap)
    assert all(rep["after_uninstall"].values()), rep["after_uninstall"]


# --- KVPoolProm and the engine-core snapshot, in process -------------------------------


def _stat_logger(registry: CollectorRegistry, engines=(0,)):
    """What KVPoolProm reads from a PrometheusStatLogger, on a private registry."""

    def gauge(**kw):
        return Gauge(registry=registry, **kw)

    def counter(**kw):
        return Counter(registry=registry, **kw)

    return types.SimpleNamespace(
        _gauge_cls=gauge, _counter_cls=counter,
        per_engine_labelvalues={i: ["m", str(i)] for i in engines},
    )


def test_table_gauges_keep_their_value_through_an_interval_without_table_growth():
    reg = CollectorRegistry()
    prom = metrics.KVPoolProm(_stat_logger(reg))
    assert "vllm:kvpool_free_runs{" not in generate_latest(reg).decode()  # no samples before a report
    base = {"free_blocks": 90, "free_runs": 3, "largest_free_run": 50, "descending_fraction": 0.0}
    prom.observe({**base, "table_pairs": 8, "table_contiguity": 0.75, "mean_run_length": 4.0}, 0)
    prom.observe({**base, "free_runs": 5, "table_pairs": 0, "table_contiguity": 1.0, "mean_run_length": 0.0}, 0)
    s = _samples(generate_latest(reg).decode())
    assert s["vllm:kvpool_free_runs"]["value"] == 5  # pool state: always the latest
    assert s["vllm:kvpool_table_contiguity"]["value"] == 0.75  # not the empty window's 1.0
    assert s["vllm:kvpool_mean_run_length_blocks"]["value"] == 4.0
    assert s["vllm:kvpool_table_pairs_total"]["value"] == 8
    assert s["vllm:kvpool_table_ascending_pairs_total"]["value"] == 6
    assert s["vllm:kvpool_free_runs"]["labels"] == {"model_name": "m", "engine": "0"}
    prom.observe(base | {"table_pairs": 1, "table_contiguity": 1.0}, 7)  # unknown engine: ignored


def test_engine_core_reads_the_pool_at_most_once_per_interval(monkeypatch):
    calls = []

    def fragmentation_stats(reset=True):
        calls.append(reset)
        return {"free_runs": 2, "table_pairs": 0}

    pool = types.SimpleNamespace(fragmentation_stats=fragmentation_stats)
    sched = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(block_pool=pool))
    monkeypatch.setenv(metrics.INTERVAL_ENV, "1.5")
    assert metrics.pool_snapshot(sched, now=10.0) == {"free_runs": 2.0, "table_pairs": 0.0}
    assert metrics.pool_snapshot(sched, now=11.0) is None
    assert metrics.pool_snapshot(sched, now=11.5) is not None
    assert calls == [True, True]  # each read starts a new table window
    vanilla = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(block_pool=object()))
    assert metrics.pool_snapshot(vanilla, now=0.0) is None
