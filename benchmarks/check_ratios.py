"""Print a saved pytest-benchmark JSON's ratios and compare them with the targets.

Usage: python benchmarks/check_ratios.py .benchmarks/.../0001_run.json
Exit status 1 if a ratio is below its target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.ratios import ratio_rows  # noqa: E402


def main(path: str) -> int:
    data = json.loads(Path(path).read_text())
    rows = ratio_rows(
        [
            {"group": b["group"], "name": b["name"], "median": b["stats"]["median"], "extra_info": b["extra_info"]}
            for b in data["benchmarks"]
        ]
    )
    bad = 0
    for r in rows:
        ok = r["target"] is None or r["ratio"] >= r["target"]
        bad += not ok
        target = f"{r['target']}x" if r["target"] is not None else "none"
        print(f"{r['group']:<28}{r['ratio']:>8.1f}x  target {target:<6}{'ok' if ok else 'BELOW'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
