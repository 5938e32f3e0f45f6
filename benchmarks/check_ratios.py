"""Print saved pytest-benchmark JSONs' ratios and compare them with the targets.

Usage: python benchmarks/check_ratios.py RUN.json [RERUN.json ...] [--rerun-ids FILE]
Exit status 1 if a ratio is below its target in every run given: scripts/test.sh
measures a second time only when the first run has a ratio below target, and then only
those rows (``--rerun-ids``: the pytest node ids of their benchmark groups, one per line,
in the order they ran), so a transient slowdown of the shared machine (another tenant's memory traffic hits
kvpool's memory-bound whole-pool loops far more than vLLM's interpreter-bound ones)
does not fail CI, while a real regression, below target in both runs, does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.ratios import ratio_rows, row_name  # noqa: E402


def rows_of(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return ratio_rows(
        [
            {"group": b["group"], "name": b["name"], "median": b["stats"]["median"], "extra_info": b["extra_info"]}
            for b in data["benchmarks"]
        ]
    )


def rerun_ids(path: str) -> list[str]:
    """The pytest node ids of RUN.json's benchmarks behind its rows below target: every
    benchmark of each such row's group (vLLM's side, every kvpool mode, every round, in
    the order they ran: a replay's rounds continue one another)."""
    below = {r["group"] for r in rows_of(path) if r["target"] is not None and r["ratio"] < r["target"]}
    benchmarks = json.loads(Path(path).read_text())["benchmarks"]

    groups = {b["group"] for b in benchmarks if row_name(b["group"], b["extra_info"]["impl"]) in below}
    return list(dict.fromkeys(b["fullname"] for b in benchmarks if b["group"] in groups))


def main(paths: list[str]) -> int:
    ids_file = None
    if "--rerun-ids" in paths:
        i = paths.index("--rerun-ids")
        ids_file, paths = paths[i + 1], paths[:i] + paths[i + 2:]
        # (written before the verdict: empty when every row met its target)
        Path(ids_file).write_text("".join(f"{n}\n" for n in rerun_ids(paths[-1])))
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
