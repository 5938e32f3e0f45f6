"""Print saved pytest-benchmark JSONs' ratios and compare them with the targets.

Usage: python benchmarks/check_ratios.py RUN.json [RERUN.json ...]
Exit status 1 if a ratio is below its target in every run given: scripts/test.sh
measures a second time only when the first run has a ratio below target, so a
transient slowdown of the shared machine (another tenant's memory traffic hits
kvpool's memory-bound whole-pool loops far more than vLLM's interpreter-bound ones)
does not fail CI, while a real regression, below target in both runs, does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.ratios import ratio_rows  # noqa: E402


def rows_of(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return ratio_rows(
        [
            {"group": b["group"], "name": b["name"], "median": b["stats"]["median"], "extra_info": b["extra_info"]}
            for b in data["benchmarks"]
        ]
    )


def main(paths: list[str]) -> int:
    met: dict[str, bool] = {}
    for path in paths:
        if len(paths) > 1:
            print(f"-- {path}")
        for r in rows_of(path):
            ok = r["target"] is None or r["ratio"] >= r["target"]
            met[r["group"]] = met.get(r["group"], False) or ok
            target = f"{r['target']:.3g}x" if r["target"] is not None else "none"
            print(f"{r['group']:<34}{r['ratio']:>8.2f}x  target {target:<6}{'ok' if ok else 'BELOW'}")
    failed = sorted(group for group, ok in met.items() if not ok)
    if failed and len(paths) > 1:
        print(f"below target in every run: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
