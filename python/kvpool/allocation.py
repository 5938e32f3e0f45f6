"""Allocation policies of kvpool's ``BlockPool`` and per-request extents.

Policies (``kvpool.install(allocation=...)``, or ``KVPOOL_ALLOCATION`` for the plugin
and for ``install()`` without the argument):

* ``"vllm"`` (the default): vLLM 0.33.0's exact order. Blocks freed without a
  prefix-cache hash are prepended (LIFO), blocks freed with one appended (LRU).
* ``"contiguous"``: the *uncached* free blocks (freed without a hash, or never used:
  the front segments of vLLM's free queue) are kept sorted and served by position;
  the *LRU* segment (freed with a hash, or released by ``unpin_blocks``) keeps
  vLLM's exact order and is reached only when no uncached block is left, as in
  vLLM. Which cached blocks are hit or evicted, in which order, the KV events and
  the preemptions are therefore vLLM's; only the ids of uncached allocations
  differ (docs/design.md, "Allocation policies"). Blocks that stop being cached join
  the sorted segment where vLLM would serve them at the same moment anyway: every free
  block after a successful ``reset_prefix_cache()``, and the LRU segment's leading
  blocks without a hash or a reuse watcher.

Per-request extents (contiguous policy): every allocation made for a request's
block table (the single-type managers' ``allocate_new_blocks`` /
``allocate_external_computed_blocks``, one table per request and KV cache group)
tells the pool which table it extends. The pool then continues the table at its
last block id + 1 when that block is free, and places a table's first new run
where its *expected growth* fits without entering another live table's reserved
extent: ``cdiv(num_prompt_tokens + max_tokens, block_size)`` minus the blocks the
table already has (when the request's length is not known: as many blocks as the
table will have after this allocation, so a table doubles its room like a growing
array), capped at 1/16 of the pool (:data:`EXTENT_CAP_FRACTION`) and at least the
blocks asked for. These are preferences only: an allocation is never
refused, delayed or made to preempt because of them (it falls back to the lowest
free uncached blocks, then to other tables' reserved ones, then to the LRU segment).
A table's reservation is released when the request's blocks are freed.

``KVPOOL_REORDER_ON_IDLE=1`` (with the ``"vllm"`` policy): whenever the last held
block is freed, the uncached segment is restored to ascending ``block_id`` order;
the LRU segment keeps its order (so the prefix cache is untouched).
"""

from __future__ import annotations

import functools

from kvpool import envs

#: The policies ``install(allocation=...)`` accepts.
POLICIES: tuple[str, ...] = envs.ALLOCATION_POLICIES
#: Environment variable naming the policy for the plugin and for ``install()``.
ALLOCATION_ENV = envs.ALLOCATION
#: ``KVPOOL_REORDER_ON_IDLE=1``: restore the uncached segment's order on idle.
REORDER_ON_IDLE_ENV = envs.REORDER_ON_IDLE
#: A new table's reserved extent is at most this fraction of the pool.
EXTENT_CAP_FRACTION = 1 / 16

_policy = "vllm"


def resolve(allocation: str | None) -> str:
    """The policy to install: ``allocation``, else ``$KVPOOL_ALLOCATION``, else
    ``"vllm"``.

    Raises:
        kvpool.envs.InvalidSettingError: (a ``ValueError``) not one of :data:`POLICIES`
            (case-insensitive), or not a string; the message names the argument or
            the variable, the value and the policies.
    """
    if allocation is not None:
        return envs.check_argument(ALLOCATION_ENV, allocation)
    return envs.get(ALLOCATION_ENV)


def current() -> str:
    """The policy pools built now get (``"vllm"`` while kvpool is not installed)."""
    return _policy


def set_policy(name: str) -> None:
    """Set the policy for pools built from now on (``install()`` / ``uninstall()``)."""
    global _policy
    _policy = resolve(name)


def reorder_on_idle() -> bool:
    """True when ``KVPOOL_REORDER_ON_IDLE`` is on (:mod:`kvpool.envs` switch rule).

    Raises:
        kvpool.envs.InvalidSettingError: a value that is neither on nor off.
    """
    return envs.get(REORDER_ON_IDLE_ENV)


# -- patches: tell the pool which block table an allocation extends -----------------------
def _extending_table(method):
    """Wrap a single-type manager's allocation method: while it runs, the manager's
    pool knows the table (manager, request_id) it allocates for."""

    @functools.wraps(method)
    def wrapper(self, request_id, *args, **kwargs):
        pool = self.block_pool
        if not getattr(pool, "_kvpool_init", False):  # not a pool kvpool built
            return method(self, request_id, *args, **kwargs)
        outer = pool._table_context
        pool._table_context = (self, request_id)
        try:
            return method(self, request_id, *args, **kwargs)
        finally:
            pool._table_context = outer

    wrapper.__kvpool_wrapped__ = method
    return wrapper


def _releasing_extent(method):
    """Wrap ``pop_blocks_for_free``: the request's tables are gone, so are their
    reserved extents (the blocks themselves are freed by the caller)."""

    @functools.wraps(method)
    def wrapper(self, request_id, *args, **kwargs):
        blocks = method(self, request_id, *args, **kwargs)
        pool = self.block_pool
        if getattr(pool, "_kvpool_init", False):  # _end_table checks the queue
            pool._end_table(self, request_id)
        return blocks

    wrapper.__kvpool_wrapped__ = method
    return wrapper


def _recording_expected_tokens(method):
    """Wrap ``KVCacheManager.allocate_slots``: record the request's expected length
    (prompt + ``max_tokens``) for the extents of its tables."""

    @functools.wraps(method)
    def wrapper(self, request, *args, **kwargs):
        expected = getattr(self.block_pool, "_expected_tokens", None)
        if expected is not None:
            expected[request.request_id] = request.num_prompt_tokens + request.max_tokens
        return method(self, request, *args, **kwargs)

    wrapper.__kvpool_wrapped__ = method
    return wrapper


_ALLOCATING = ("allocate_new_blocks", "allocate_external_computed_blocks")


def _manager_classes(base: type) -> list[type]:
    seen, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def apply(patcher) -> None:
    """Install the table-context patches (called by ``kvpool.install()``): every
    single-type manager class that defines an allocation method gets it wrapped, so
    the pool knows which table an allocation extends (the table statistics of
    ``fragmentation_stats``, any policy; the contiguous policy's continuation).
    Subclasses defined later inherit them.

    Only with the contiguous policy (``patcher.policy``): ``pop_blocks_for_free``
    (release a table's extent) and ``KVCacheManager.allocate_slots`` (record a
    request's expected length) are wrapped as well. The default policy has no extents,
    so it does not pay for those wrappers on every call (``allocate_slots`` runs for
    every scheduled request in every step)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    extents = patcher.policy == "contiguous"
    for cls in _manager_classes(SingleTypeKVCacheManager):
        for name in _ALLOCATING:
            if name in cls.__dict__:
                patcher.set_attr(cls, name, _extending_table(cls.__dict__[name]))
        if extents and "pop_blocks_for_free" in cls.__dict__:
            patcher.set_attr(cls, "pop_blocks_for_free", _releasing_extent(cls.__dict__["pop_blocks_for_free"]))
    if extents:
        patcher.set_attr(KVCacheManager, "allocate_slots", _recording_expected_tokens(KVCacheManager.allocate_slots))
