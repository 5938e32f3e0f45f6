"""Benchmarks of vLLM's Python block pool and kvpool, in the same run.

Each operation has one benchmark per implementation in the same pytest-benchmark
group; the terminal summary prints the ratio of medians (vLLM / kvpool; for numbered
rounds of the same work, the median of the rounds' ratios) and ns per block. No test
asserts an absolute time. CI saves the run and fails when a ratio is below its target:
``python benchmarks/check_ratios.py RESULT.json`` (targets in benchmarks/ratios.py,
results in docs/performance.md).
"""

from __future__ import annotations

import os

from kvpool.cpu_platform import cpu_environment

cpu_environment(os.environ)  # vLLM's CPU platform via kvpool's platform plugin


def pytest_configure(config):
    # The scheduler-step benchmark builds vLLM configs: from the model config files
    # kvpool ships, offline, never from the hub (as tests/conftest.py does).
    import tempfile

    from kvpool.tools.hf_offline import materialize_hf_cache, offline_env

    home = tempfile.mkdtemp(prefix="kvpool-bench-hf-")
    materialize_hf_cache(home)
    os.environ.update(offline_env(home))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    from benchmarks.ratios import ratio_rows

    rows = ratio_rows(
        [
            {"group": b.group, "name": b.name, "median": b.stats.median, "extra_info": b.extra_info}
            for b in session.benchmarks
            if b.stats is not None and b.stats.data
        ]
    )
    tr = terminalreporter
    from vllm import __version__ as vllm_version

    tr.write_sep("-", f"kvpool vs vLLM {vllm_version} (same run; medians; rounds' ratios: benchmarks/ratios.py)")
    tr.write_line(f"{'operation':<34}{'vLLM':>12}{'kvpool':>12}{'ratio':>9}{'kvpool ns/block':>17}{'target':>8}")
    for r in rows:
        target = f"{r['target']:.3g}x" if r["target"] else ""
        tr.write_line(
            f"{r['group']:<34}{r['vllm_s'] * 1e6:>10.1f}us{r['kvpool_s'] * 1e6:>10.1f}us"
            f"{r['ratio']:>8.2f}x{r['kvpool_ns_per_block']:>17.1f}{target:>8}"
        )
