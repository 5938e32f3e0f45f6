"""Block-table contiguity: how the allocator's order shows up in ``block_table[req, :]``.

A request's block table maps logical KV block ``i`` to a physical ``block_id``. An
attention kernel that gathers K/V through the table reads physically adjacent pages
when ``table[i + 1] == table[i] + 1``; the RFC's prefill slowdown comes from tables that
lose this property after the free list has been scrambled. All functions here take
plain ``list[int]`` tables and know nothing of vLLM.

Definitions (used by every workload of ``python -m kvpool replay``):

- *ascending pair*: adjacent logical blocks ``(i, i + 1)`` with
  ``table[i + 1] == table[i] + 1``. *descending pair*: ``table[i + 1] == table[i] - 1``
  (what vLLM's reversed, prepended frees hand out on the next allocation).
- *contiguity* of a set of tables: ascending pairs / adjacent pairs, summed over the
  tables (a pairs-weighted mean, so a 2,500-block prompt weighs 2,500 times more than a
  2-block one). ``None`` when the tables have no adjacent pair at all.
- *run*: a maximal stretch of a table in which every adjacent pair is ascending. A table
  of ``n`` blocks with ``b`` non-ascending pairs has ``b + 1`` runs.
  *mean run length* = total blocks / total runs, over the tables.
- *transfer descriptors* of a list of blocks (:func:`transfer_descriptors`): its runs,
  null blocks left out: what a KV transfer (NIXL, an offloading memcpy) issues when
  only ascending consecutive neighbours coalesce. For a prompt table without null
  blocks it equals the table's run count, so total prompt blocks / total descriptors is
  the mean run length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence


def ascending_pairs(table: Sequence[int]) -> int:
    """Number of ``i`` with ``table[i + 1] == table[i] + 1``."""
    return sum(1 for a, b in zip(table, table[1:]) if b == a + 1)


def descending_pairs(table: Sequence[int]) -> int:
    """Number of ``i`` with ``table[i + 1] == table[i] - 1``."""
    return sum(1 for a, b in zip(table, table[1:]) if b == a - 1)


def _pair_fraction(tables: Iterable[Sequence[int]], count: Callable[[Sequence[int]], int]) -> float | None:
    # Pairs-weighted fraction of adjacent logical blocks that `count` counts.
    counted = pairs = 0
    for t in tables:
        if len(t) > 1:
            counted += count(t)
            pairs += len(t) - 1
    return counted / pairs if pairs else None


def contiguity(tables: Iterable[Sequence[int]]) -> float | None:
    """Pairs-weighted fraction of adjacent logical blocks that are consecutive and ascending.

    Args:
        tables: block tables (``list[int]`` of physical block ids, in logical order).

    Returns:
        ``sum(ascending_pairs) / sum(len(t) - 1)`` over tables with at least two
        blocks, in [0, 1]; ``None`` when there is no adjacent pair.
    """
    return _pair_fraction(tables, ascending_pairs)


def descending_fraction(tables: Iterable[Sequence[int]]) -> float | None:
    """Like :func:`contiguity`, for descending pairs."""
    return _pair_fraction(tables, descending_pairs)


def mean_run_length(tables: Iterable[Sequence[int]]) -> float | None:
    """Mean length, in blocks, of maximal ascending-consecutive runs over ``tables``.

    Returns:
        total blocks / total runs; ``None`` when every table is empty.
    """
    blocks = runs = 0
    for t in tables:
        if t:
            blocks += len(t)
            runs += len(t) - ascending_pairs(t)
    return blocks / runs if runs else None


# --- transfer figures ---------------------------------------------------------------
#
# Moving KV between machines or tiers is where block-id order has a measured price:
# a transfer engine coalesces two blocks into one descriptor (one copy) only when their
# source and destination addresses are adjacent and in the same order. vLLM PR #55841
# ("Prefer contiguous KV block runs for disaggregated transfer"): NIXL merges adjacent
# local/remote ranges, so a prompt costs one descriptor per ascending run of its block
# table (per memory region); vLLM issue #55434 counts up to ~112k descriptors per
# rank-transfer on fragmented tables. vLLM PR #35990 (contiguous allocation for KV
# offloading): memcpy calls per layer fall from 193 to 3 for 193 blocks once the
# offloaded blocks' ids run consecutively.

#: vLLM's null block (``BlockPool.null_block``, the first block popped at start-up).
NULL_BLOCK_ID = 0


def descriptor_runs(block_ids: Sequence[int], null_block_id: int = NULL_BLOCK_ID) -> list[tuple[int, int]]:
    """The descriptors of :func:`transfer_descriptors` themselves: ``(first block id,
    blocks)`` per run, in table order (what ``kvpool.tools.locality.transfer`` copies)."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if b == null_block_id or b < 0:
            continue
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def transfer_descriptors(block_ids: Sequence[int], null_block_id: int = NULL_BLOCK_ID) -> int:
    """Descriptors (copies) needed to move ``block_ids`` when only neighbours with
    ascending consecutive ids coalesce.

    The null block (``null_block_id``) and negative placeholder ids hold no KV and
    are not transferred: they are dropped first, so ``[5, 0, 6]`` is one descriptor.
    Among the rest, every maximal run with ``next == previous + 1`` is one
    descriptor; a descending pair (``next == previous - 1``, what vLLM's reversed
    frees hand out) starts a new one, as does any gap or repeat.

    Args:
        block_ids: physical block ids in logical (table) order.
        null_block_id: the pool's null block id (0 in vLLM).

    Returns:
        Number of descriptors (0 for no transferable block).
    """
    return len(descriptor_runs(block_ids, null_block_id))


def sorted_descriptors(block_ids: Sequence[int], null_block_id: int = NULL_BLOCK_ID) -> int:
    """:func:`transfer_descriptors` of the same blocks listed in ascending id order: the
    fewest descriptors any order of ``block_ids`` can post (each maximal set of
    consecutive ids is one descriptor at best), so ``sorted_descriptors(t) <=
    transfer_descriptors(t)``. What is left of a table's count once it equals this floor
    is fixed by *which* blocks the table holds (vLLM's evictions and hits), not by where
    they sit: ``[9, 8, 7, 2]`` is 4 descriptors, sorted 2.

    Args:
        block_ids: physical block ids in logical (table) order; null (``null_block_id``)
            and negative ids are dropped, as in :func:`transfer_descriptors`.
        null_block_id: the null block's id, which posts nothing.

    Returns:
        Number of descriptors of the ascending order (0 for no transferable block).
    """
    return transfer_descriptors(sorted(block_ids), null_block_id)


def live_blocks(table: Sequence[int], null_block_id: int = NULL_BLOCK_ID) -> list[int]:
    """``table`` without its null (``null_block_id``) and negative placeholder ids: the
    blocks a request holds. A sliding-window table's live window; a Mamba table's
    kept state blocks (the rest are null once vLLM frees them)."""
    return [b for b in table if b != null_block_id and b >= 0]


def group_figures(prompt_tables: Iterable[Sequence[int]], finished_tables: Iterable[Sequence[int]],
                  null_block_id: int = NULL_BLOCK_ID) -> dict[str, float | int | None]:
    """One KV cache group's figures over a round's tables, each table's null blocks
    left out first (:func:`live_blocks`): ``contiguity`` (prompt tables),
    ``table_contiguity`` (finished tables), ``mean_run_length``, ``prompt_blocks``
    (live prompt blocks) and ``live_blocks_per_prompt`` (their mean per prompt table;
    ``None`` without tables)."""
    prompts = [live_blocks(t, null_block_id) for t in prompt_tables]
    finished = [live_blocks(t, null_block_id) for t in finished_tables]
    blocks = sum(len(t) for t in prompts)
    return {"contiguity": contiguity(prompts), "table_contiguity": contiguity(finished),
            "mean_run_length": mean_run_length(prompts), "prompt_blocks": blocks,
            "live_blocks_per_prompt": blocks / len(prompts) if prompts else None}


def nearest_rank(values: Sequence[float], q: float):
    """Nearest-rank percentile: the smallest value with at least ``q`` of ``values``
    at or below it (an observed value, never an interpolation); ``None`` when empty.

    ``q`` in (0, 1]: 0.5 is the (lower) median, 0.9 the p90, 1.0 the maximum.
    """
    if not values:
        return None
    xs = sorted(values)
    k = math.ceil(q * len(xs) - 1e-9)  # 0.9 * 10 is 9.000000000000002
    return xs[min(max(k, 1), len(xs)) - 1]


def spread(values: Sequence[int]) -> dict[str, int | None]:
    """``{"median", "p90", "max", "total"}`` of ``values`` (nearest rank; ``None``
    but total 0 when empty), so ``median <= p90 <= max <= total`` for counts."""
    return {"median": nearest_rank(values, 0.5), "p90": nearest_rank(values, 0.9),
            "max": max(values) if values else None, "total": sum(values)}


def pd_descriptors(prefill_table: Sequence[int], decode_table: Sequence[int]) -> int:
    """Descriptors of one prompt moved from its prefill-side table to its decode-side
    table (P/D): NIXL merges two blocks only when the local and the remote addresses
    are both adjacent and in the same order (vLLM PR #55841), so a descriptor is a
    maximal run of positions in which both tables ascend by exactly 1. Null blocks
    (id 0 on either side) are not transferred.

    Raises:
        ValueError: the tables differ in length (not the same prompt).
    """
    if len(prefill_table) != len(decode_table):
        raise ValueError(f"P/D tables of different lengths ({len(prefill_table)} and {len(decode_table)})")
    runs = 0
    prev = None
    for p, d in zip(prefill_table, decode_table):
        if p == 0 or d == 0:
            continue
        if prev is None or p != prev[0] + 1 or d != prev[1] + 1:
            runs += 1
        prev = (p, d)
    return runs

