"""Block tables for the layouts ``python -m kvpool locality`` compares (no torch needed).

A layout turns a *block stream* (distinct physical block ids, in the order an
allocator hands them out) into one table per request: request ``r`` of a batch whose
requests need ``n`` blocks each gets ``stream[r * n:(r + 1) * n]``, as consecutive
``allocate_slots`` calls on vLLM's free list would give. Block 0 is vLLM's null block
and never appears.

- ``canonical``: ``1, 2, 3, ...``: every table one ascending run (a fresh pool, or
  kvpool's reorder between rounds).
- ``descending``: the same ids, highest first: every table one descending run, the
  signature of vLLM's reversed frees handed out again.
- ``random``: a uniformly random selection from the whole pool, in random order (a
  permutation of ``1 .. num_blocks - 1``, cut short): the worst case.
- ``replay:MODE@ROUND``: the allocation order ``python -m kvpool replay`` recorded for
  ``MODE`` in round ``ROUND`` (:mod:`kvpool.tools.locality.replay_tables`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from kvpool.errors import LayoutError  # (defined there, re-exported here)

BASE_LAYOUTS = ("canonical", "descending", "random")


def _check(num_requests: int, blocks_per_request: int, num_blocks: int) -> int:
    if num_requests < 1 or blocks_per_request < 1:
        raise LayoutError(f"need at least one request of one block, got {num_requests} x {blocks_per_request}")
    need = num_requests * blocks_per_request
    if need > num_blocks - 1:
        raise LayoutError(
            f"{num_requests} requests x {blocks_per_request} blocks = {need} blocks, but a pool of "
            f"{num_blocks} blocks has {num_blocks - 1} usable (block 0 is the null block); "
            "raise --num-blocks or shrink the batch")
    return need


def split(stream: Sequence[int], num_requests: int, blocks_per_request: int) -> list[list[int]]:
    """Cut the first ``num_requests * blocks_per_request`` ids of ``stream`` into tables.

    Returns:
        ``list[list[int]]``: ``num_requests`` tables of ``blocks_per_request`` block ids.
    """
    n = blocks_per_request
    return [list(stream[r * n:(r + 1) * n]) for r in range(num_requests)]


def canonical_stream(need: int) -> list[int]:
    """Block ids ``1 .. need``: what a fresh (or reordered) free list hands out."""
    return list(range(1, need + 1))


def descending_stream(need: int) -> list[int]:
    """Block ids ``need .. 1``: each table a descending run."""
    return list(range(need, 0, -1))


def random_stream(need: int, num_blocks: int, seed: int) -> list[int]:
    """``need`` distinct ids from ``1 .. num_blocks - 1``, uniformly at random, in random order."""
    return random.Random(seed).sample(range(1, num_blocks), need)


def fold_stream(orders: Iterable[Sequence[int]], num_blocks: int, need: int) -> tuple[list[int], int]:
    """A stream of ``need`` distinct ids in ``1 .. num_blocks - 1`` from recorded orders.

    Recorded ids are folded into the pool (``1 + (id - 1) % (num_blocks - 1)``: runs stay
    runs on a pool smaller than the recording's), taken in order from each of ``orders``
    in turn, skipping ids already taken; when the orders run out, the pool's unused ids
    follow in ascending order (what a canonical free list hands out next).

    Returns:
        ``(stream, recorded)``: the ids, and how many of them came from ``orders``.
    """
    taken: set[int] = set()
    stream: list[int] = []
    usable = num_blocks - 1
    for order in orders:
        for b in order:
            b = 1 + (b - 1) % usable
            if b not in taken:
                taken.add(b)
                stream.append(b)
                if len(stream) == need:
                    return stream, need
    recorded = len(stream)
    for b in range(1, num_blocks):
        if len(stream) == need:
            break
        if b not in taken:
            stream.append(b)
    return stream, recorded


def layout_tables(
    layout: str,
    num_requests: int,
    blocks_per_request: int,
    num_blocks: int,
    *,
    seed: int = 0,
    replay_orders: dict[str, list[list[int]]] | None = None,
) -> tuple[list[list[int]], float]:
    """Block tables of ``layout`` for a batch of equal requests.

    Args:
        layout: one of :data:`BASE_LAYOUTS`, or ``"replay:MODE@ROUND"``.
        num_requests: requests in the batch.
        blocks_per_request: blocks each request's table holds.
        num_blocks: blocks in the pool, the null block 0 included.
        seed: seed of the ``random`` layout.
        replay_orders: for ``replay:*`` layouts, the recorded orders to draw from, keyed
            by layout name, the selected round's first
            (:func:`kvpool.tools.locality.replay_tables.orders_for`).

    Returns:
        ``(tables, recorded_fraction)``: ``num_requests`` tables of ``blocks_per_request``
        distinct ids in ``1 .. num_blocks - 1`` (no id in two tables), and the fraction of
        blocks that came from a recording (1.0 for the synthetic layouts).

    Raises:
        LayoutError: unknown layout, or the batch needs more blocks than the pool has.
    """
    need = _check(num_requests, blocks_per_request, num_blocks)
    if layout == "canonical":
        stream, recorded = canonical_stream(need), need
    elif layout == "descending":
        stream, recorded = descending_stream(need), need
    elif layout == "random":
        stream, recorded = random_stream(need, num_blocks, seed), need
    elif layout.startswith("replay:"):
        if not replay_orders or layout not in replay_orders:
            raise LayoutError(f"no recorded tables for {layout!r}")
        stream, recorded = fold_stream(replay_orders[layout], num_blocks, need)
    else:
        raise LayoutError(f"unknown layout {layout!r}; choose from {', '.join(BASE_LAYOUTS)} or replay:MODE@ROUND")
    return split(stream, num_requests, blocks_per_request), recorded / need
