"""The allocation order ``python -m kvpool replay --save-tables`` recorded, for the ``replay`` layouts.

``python -m kvpool replay --save-tables --json FULL.json`` keeps every round's
per-request block tables (``modes[MODE]["rounds"][i]["tables"]``, tens of MB for the
default GRPO run). What a layout needs from a round is its *block order*: the distinct
physical block ids of the round's final tables, request by request, in first-use order
(a GRPO round's shared prompt blocks once, then each sample's output blocks). The
compact file (``data/replay_grpo.json``, made by ``python -m
kvpool.tools.locality.replay_tables FULL.json OUT.json``) keeps only that, run-length coded:
``[start, n]`` is ``start, start + 1, ..., start + n - 1`` for ``n > 0`` and ``start,
start - 1, ..., start + n + 1`` for ``n < 0``. A mode whose orders equal another mode's
in every kept round is stored as ``{"same_as": OTHER}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT = "kvpool-replay-block-orders/1"
#: Shipped recording: default GRPO replay, 85,000 blocks x 32 tokens (see docs/locality.md).
DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "replay_grpo.json"


def block_order(tables: Sequence[Sequence[int]]) -> list[int]:
    """Distinct block ids of ``tables`` (request order, then logical order), first use kept."""
    seen: set[int] = set()
    order: list[int] = []
    for table in tables:
        for b in table:
            if b not in seen:
                seen.add(b)
                order.append(b)
    return order


def encode_runs(order: Sequence[int]) -> list[list[int]]:
    """Run-length code ``order`` into ``[start, n]`` pairs (module docstring)."""
    runs: list[list[int]] = []
    i, n = 0, len(order)
    while i < n:
        j = i + 1
        step = order[j] - order[i] if j < n and abs(order[j] - order[i]) == 1 else 0
        if step:
            while j < n and order[j] - order[j - 1] == step:
                j += 1
        runs.append([order[i], (j - i) * (step or 1)])
        i = j
    return runs


def decode_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    """Inverse of :func:`encode_runs`."""
    order: list[int] = []
    for start, n in runs:
        step = 1 if n > 0 else -1
        order.extend(range(start, start + n, step))
    return order


def extract(report: dict[str, Any], modes: Sequence[str] | None = None,
            rounds: Sequence[int] | None = None) -> dict[str, Any]:
    """Compact block orders from a ``replay --save-tables`` report.

    Args:
        report: the parsed JSON of ``python -m kvpool replay --save-tables --json``.
        modes: modes to keep (default: every mode that ran).
        rounds: rounds to keep (default: all).

    Raises:
        ValueError: the report has no tables (run the replay with ``--save-tables``).
    """
    out_modes: dict[str, Any] = {}
    kept: dict[str, dict[int, list[int]]] = {}
    for mode, res in report["modes"].items():
        if "rounds" not in res or (modes is not None and mode not in modes):
            continue
        orders: dict[int, list[int]] = {}
        for rnd in res["rounds"]:
            if rounds is not None and rnd["round"] not in rounds:
                continue
            if "tables" not in rnd:
                raise ValueError(f"mode {mode} round {rnd['round']} has no tables: "
                                 "run `python -m kvpool replay` with --save-tables")
            orders[rnd["round"]] = block_order(rnd["tables"]["finished"])
        twin = next((m for m, o in kept.items() if o == orders), None)
        if twin is not None:
            out_modes[mode] = {"same_as": twin}
            continue
        kept[mode] = orders
        by_round = {x["round"]: x for x in res["rounds"]}
        out_modes[mode] = {"rounds": {
            str(r): {"contiguity": by_round[r]["contiguity"], "runs": encode_runs(o)}
            for r, o in orders.items()}}
    cfg = report.get("config", {})
    return {
        "format": FORMAT,
        "source": {
            "workload": report.get("workload", {}).get("name"),
            "description": report.get("workload", {}).get("description"),
            **{k: cfg.get(k) for k in ("num_blocks", "block_size", "seed", "scale", "vllm_version", "argv")},
        },
        "modes": out_modes,
    }


def load(path: str | Path = DEFAULT_PATH) -> dict[str, dict[int, list[int]]]:
    """Block orders per mode and round from a compact file or a ``--save-tables`` report.

    Returns:
        ``{mode: {round: list[int] of block ids}}``.

    Raises:
        OSError: unreadable file. ValueError: neither format, or a report without tables.
    """
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        if "modes" not in data:
            raise ValueError(f"{path}: neither a replay report nor a {FORMAT} file")
        data = extract(data)
    out: dict[str, dict[int, list[int]]] = {}
    for mode, entry in data["modes"].items():
        if "rounds" in entry:
            out[mode] = {int(r): decode_runs(x["runs"]) for r, x in entry["rounds"].items()}
    for mode, entry in data["modes"].items():
        if "same_as" in entry:
            out[mode] = out[entry["same_as"]]
    return out


def distinct_modes(data: dict[str, Any]) -> list[str]:
    """Modes of a compact file that are not stored as ``same_as`` another."""
    return [m for m, e in data["modes"].items() if "rounds" in e]


def default_layouts(path: str | Path = DEFAULT_PATH) -> list[str]:
    """``replay:MODE@ROUND`` for the last round of each distinct mode of ``path``."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        data = extract(data)
    return [f"replay:{m}@{max(int(r) for r in data['modes'][m]['rounds'])}" for m in distinct_modes(data)]


def parse_layout(name: str) -> tuple[str, int]:
    """``"replay:MODE@ROUND"`` -> ``(MODE, ROUND)``. Raises ValueError if malformed."""
    body = name.removeprefix("replay:")
    mode, sep, rnd = body.rpartition("@")
    if not name.startswith("replay:") or not sep or not mode or not rnd.isdigit():
        raise ValueError(f"expected replay:MODE@ROUND, got {name!r}")
    return mode, int(rnd)


def orders_for(orders: dict[str, dict[int, list[int]]], layout: str) -> list[list[int]]:
    """The orders a ``replay:MODE@ROUND`` layout draws from: ROUND's, then earlier rounds'
    (newest first) for batches that need more blocks than one round allocated.

    Raises:
        ValueError: malformed name, or no such mode or round in ``orders``.
    """
    mode, rnd = parse_layout(layout)
    if mode not in orders or rnd not in orders[mode]:
        have = {m: sorted(r) for m, r in orders.items()}
        raise ValueError(f"{layout}: no such mode/round in the recorded tables (have {have})")
    return [orders[mode][r] for r in sorted(orders[mode], reverse=True) if r <= rnd]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvpool.tools.locality.replay_tables",
        description="Compact a `python -m kvpool replay --save-tables --json` report into block orders.")
    p.add_argument("report", help="replay JSON written with --save-tables")
    p.add_argument("out", help="compact JSON to write")
    p.add_argument("--modes", help="comma-separated modes to keep (default: all)")
    p.add_argument("--rounds", help="rounds to keep, e.g. 13-19 or 0,13,19 (default: all)")
    args = p.parse_args(argv)
    rounds = None
    if args.rounds:
        rounds = []
        for part in args.rounds.split(","):
            lo, _, hi = part.partition("-")
            rounds.extend(range(int(lo), int(hi or lo) + 1))
    modes = args.modes.split(",") if args.modes else None
    data = extract(json.loads(Path(args.report).read_text()), modes, rounds)
    Path(args.out).write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
