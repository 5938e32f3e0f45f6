"""The terminal report of a ``--model`` run: the KV cache vLLM resolved, and per KV
cache group the contiguity figures of each mode (``rounds[i]["by_group"]``; docs/replay.md,
"Model shapes")."""

from __future__ import annotations

from typing import Any

from kvpool.tools.replay.geometry import describe

#: What a group's figures mean, per spec kind (the report's last column).
MEANING = {
    "FullAttentionSpec": "every block of the table",
    "SlidingWindowSpec": "blocks not yet replaced by the null block (the live window)",
    "MambaSpec": "state blocks kept per request (the rest are null); contiguity: between the kept blocks",
}


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _fmt(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def group_rows(modes: dict[str, Any]) -> list[list[str]]:
    """One row per (group, mode): the means over rounds of prompt contiguity, whole-table
    contiguity and live blocks per prompt, and the minimum prompt contiguity."""
    rows = []
    first = next(iter(modes.values()))["rounds"]
    groups = first[0].get("by_group") or [] if first else []
    for g, grp in enumerate(groups):
        for m, r in modes.items():
            per = [x["by_group"][g] for x in r["rounds"] if x.get("by_group")]
            prompt = [x["contiguity"] for x in per]
            low = min((c for c in prompt if c is not None), default=None)
            rows.append([str(g), grp["kind"], str(grp["block_size"]), m, _fmt(_mean(prompt)), _fmt(low),
                         _fmt(_mean([x["table_contiguity"] for x in per])),
                         _fmt(_mean([x["live_blocks_per_prompt"] for x in per]), "{:.1f}")])
    return rows


def pool_text(cfg: dict[str, Any]) -> str:
    """``"pool N blocks x B tokens"``; with KV cache groups of several block sizes
    (``--model``), their sizes and the scheduler's (their LCM), which no group allocates."""
    geometry = cfg.get("kv_cache_geometry") or {}
    sizes = sorted({g["block_size"] for g in geometry.get("groups", [])})
    if len(sizes) > 1:
        return (f"pool {cfg['num_blocks']} blocks of {' / '.join(map(str, sizes))} tokens by KV cache group "
                f"(scheduler block size {cfg['block_size']})")
    return f"pool {cfg['num_blocks']} blocks x {cfg['block_size']} tokens"


def render(report: dict[str, Any], modes: dict[str, Any], console) -> None:
    """Print the resolved geometry and the per-group table (nothing for a run without
    ``--model``)."""
    geometry = report.get("config", {}).get("kv_cache_geometry")
    if geometry is None:
        return
    from rich.markup import escape
    from rich.table import Table

    console.print(describe(geometry), highlight=False)
    rows = group_rows(modes)
    if not rows:
        return
    t = Table(title=escape("per KV cache group (null blocks left out of each table): contiguity = fraction of "
                           "adjacent live blocks with id[i+1] == id[i]+1, mean over rounds"), title_justify="left")
    for label in ("group", "kind", "block size", "mode", "prompt", "prompt min", "whole table",
                  "live blocks / prompt"):
        t.add_column(label, justify="left" if label in ("kind", "mode") else "right", no_wrap=label == "mode")
    for row in rows:
        t.add_row(*row)
    console.print(t)
    for kind in dict.fromkeys(row[1] for row in rows):
        console.print(f"  {kind}: live blocks = {MEANING.get(kind, 'non-null blocks')}", highlight=False)
