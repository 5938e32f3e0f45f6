"""Compare benchmark runs of two kvpool builds measured alternately (scripts/bench-wheel.sh).

Usage: python benchmarks/compare_builds.py --a NAME A1.json A2.json ... --b NAME B1.json B2.json ...

For every group it prints each build's vLLM/kvpool ratios (the median over its runs), the
median of kvpool's own time, and B's ratio relative to A's (B/A: 1.00 = the same, 0.90 =
B's ratio 10% lower). Exit status 1 when B's median ratio is more than --tolerance (default
0.10) below A's in any group that has a target (benchmarks/ratios.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.check_ratios import rows_of  # noqa: E402


def collect(paths: list[str]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for p in paths:
        for r in rows_of(p):
            g = out.setdefault(r["group"], {"ratio": [], "kvpool_s": [], "vllm_s": [], "target": r["target"]})
            g["ratio"].append(r["ratio"])
            g["kvpool_s"].append(r["kvpool_s"])
            g["vllm_s"].append(r["vllm_s"])
    return out


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
    print(f"{'operation':<28}{na + ' ratios':>26}{nb + ' ratios':>26}{'kvpool ' + na:>14}{'kvpool ' + nb:>14}{nb + '/' + na:>10}")
    for group in sorted(a.keys() & b.keys()):
        ra, rb = a[group]["ratio"], b[group]["ratio"]
        rel = statistics.median(rb) / statistics.median(ra)
        if a[group]["target"] is not None:
            worst = min(worst, rel)
        fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        print(f"{group:<28}{fmt(ra):>26}{fmt(rb):>26}"
              f"{statistics.median(a[group]['kvpool_s']) * 1e6:>12.1f}us{statistics.median(b[group]['kvpool_s']) * 1e6:>12.1f}us"
              f"{rel:>10.2f}")
    print(f"worst {nb}/{na} ratio of a targeted group: {worst:.2f} (tolerance {1 - args.tolerance:.2f})")
    return 0 if worst >= 1 - args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
