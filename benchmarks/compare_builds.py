"""Compare benchmark runs of two kvpool builds measured alternately (scripts/bench-wheel.sh).

Usage: python benchmarks/compare_builds.py --a NAME A1.json A2.json ... --b NAME B1.json B2.json ...

A's and B's runs are given in the order they were measured, A1 B1 A2 B2 ... alternating, so
Ai and Bi are neighbours in time: pair i. For every group it prints each build's vLLM/kvpool
ratio per run, the median of kvpool's own time, and B's ratio relative to A's as the median
over the pairs of Bi's ratio / Ai's (1.00 = the same, 0.90 = B's ratio 10% lower), the way
benchmarks/ratios.py compares the step benchmark's modes round by round: the shared host's
speed moves between minutes (vLLM's own Python time, the same code in both builds, moved
1.4x between neighbouring runs of 2026-12-03), and a pair sees one state of it where a median
of each build's runs can set a fast state of one build against a slow one of the other.
Exit status 1 when that paired median is more than --tolerance (default 0.10) below 1 in any
group that has a target (benchmarks/ratios.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.check_ratios import rows_of  # noqa: E402


def collect(paths: list[str]) -> dict[str, dict]:
    """Per group: the runs' ratios, kvpool and vLLM times (seconds), in the order given."""
    out: dict[str, dict] = {}
    for p in paths:
        for r in rows_of(p):
            g = out.setdefault(r["group"], {"ratio": [], "kvpool_s": [], "vllm_s": [], "target": r["target"]})
            g["ratio"].append(r["ratio"])
            g["kvpool_s"].append(r["kvpool_s"])
            g["vllm_s"].append(r["vllm_s"])
    return out


def paired_relative(a_ratios: list[float], b_ratios: list[float]) -> float:
    """Median over pairs i of b_ratios[i] / a_ratios[i]; a run without a partner is left out.

    Raises ValueError when there is no pair.
    """
    pairs = [b / a for a, b in zip(a_ratios, b_ratios)]
    if not pairs:
        raise ValueError("no pair of runs to compare")
    return statistics.median(pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--a", nargs="+", required=True, metavar="NAME_OR_JSON")
    p.add_argument("--b", nargs="+", required=True, metavar="NAME_OR_JSON")
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args(argv)
    (na, *pa), (nb, *pb) = args.a, args.b
    if not pa or not pb:
        p.error("--a and --b each take a name and at least one JSON")
    a, b = collect(pa), collect(pb)
    worst = 1.0
    # One line a group: the verdict and kvpool's own medians first, then every run's ratio
    # (as many as rounds were run, so they go last and are never cut to a column).
    print(f"{'operation':<34}{nb + '/' + na:>12}{'kvpool ' + na:>16}{'kvpool ' + nb:>16}   ratios per run")
    for group in sorted(a.keys() & b.keys()):
        ra, rb = a[group]["ratio"], b[group]["ratio"]
        rel = paired_relative(ra, rb)
        if a[group]["target"] is not None:
            worst = min(worst, rel)
        fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        us_a, us_b = (statistics.median(x[group]["kvpool_s"]) * 1e6 for x in (a, b))
        print(f"{group:<34}{rel:>12.2f}"
              f"{us_a:>14.1f}us{us_b:>14.1f}us"
              f"   {na} {fmt(ra)} | {nb} {fmt(rb)}")
    print(f"worst {nb}/{na} paired median ratio of a targeted group: {worst:.2f} (tolerance {1 - args.tolerance:.2f})")
    return 0 if worst >= 1 - args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
