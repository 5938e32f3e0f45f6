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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def ascending_pairs(table: Sequence[int]) -> int:
    """Number of ``i`` with ``table[i + 1] == table[i] + 1``."""
    return sum(1 for a, b in zip(table, table[1:]) if b == a + 1)


def descending_pairs(table: Sequence[int]) -> int:
    """Number of ``i`` with ``table[i + 1] == table[i] - 1``."""
    return sum(1 for a, b in zip(table, table[1:]) if b == a - 1)


def contiguity(tables: Iterable[Sequence[int]]) -> float | None:
    """Pairs-weighted fraction of adjacent logical blocks that are consecutive and ascending.

    Args:
        tables: block tables (``list[int]`` of physical block ids, in logical order).

    Returns:
        ``sum(ascending_pairs) / sum(len(t) - 1)`` over tables with at least two
        blocks, in [0, 1]; ``None`` when there is no adjacent pair.
    """
    asc = pairs = 0
    for t in tables:
        if len(t) > 1:
            asc += ascending_pairs(t)
            pairs += len(t) - 1
    return asc / pairs if pairs else None


def descending_fraction(tables: Iterable[Sequence[int]]) -> float | None:
    """Like :func:`contiguity`, for descending pairs."""
    desc = pairs = 0
    for t in tables:
        if len(t) > 1:
            desc += descending_pairs(t)
            pairs += len(t) - 1
    return desc / pairs if pairs else None


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
