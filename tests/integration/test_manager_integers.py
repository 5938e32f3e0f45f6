"""Integers as vLLM reads them: the native ``allocate_slots`` / ``cache_blocks`` and the
pool's counts against vLLM 0.33.0's own Python for integer arguments and fields near
2**31, 2**32, 2**60, 2**63 and negative (hypothesis).

Python ints are unbounded; the native path reads an int at full width and takes it only
below 2**60 (``_nonneg`` in src/kvpool/manager.pxi: three such values summed stay in a
C ``long long``); anything else is vLLM's code. So every call here must give vLLM's
result, vLLM's exception and vLLM's state, never a value read through fewer bits.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import kvpool
from tests.integration.test_manager_fast_path import BLOCK_SIZE, _manager, _running, _summary

pytestmark = [pytest.mark.sanitizer]

_EDGES = (2**31, 2**32, 2**60, 2**62, 2**63, 2**64)
#: Ints at and around each edge (and their negatives), and small ones.
edge_ints = st.one_of(
    st.sampled_from(_EDGES).flatmap(lambda e: st.integers(e - 2, e + 17)),
    st.sampled_from(_EDGES).flatmap(lambda e: st.integers(-e - 17, -e + 2)),
    st.integers(-3, 80),
)
_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


def _pair():
    """(vanilla call, native call) of allocate_slots and of the coordinator's cache_blocks,
    each on its own manager of 200 blocks, max_model_len 1024 (64 blocks)."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.block_pool import VllmBlockPool
    from kvpool.patches.manager_fast_path import _vanilla

    if not kvpool.is_installed():
        kvpool.install()
    vanilla = _manager(200)
    native = _manager(200)
    # The vanilla side runs vLLM's functions where the native side's are bound.
    vanilla.coordinator.cache_blocks = _vanilla(UnitaryKVCacheCoordinator, "cache_blocks").__get__(
        vanilla.coordinator)
    pool = vanilla.block_pool
    pool._maybe_evict_cached_block = VllmBlockPool._maybe_evict_cached_block.__get__(pool)
    return ((vanilla, _vanilla(KVCacheManager, "allocate_slots")),
            (native, KVCacheManager.allocate_slots))


def _outcome(call):
    try:
        return ("returned", call())
    except Exception as exc:  # vLLM's exception, compared by type and message
        return (type(exc).__name__, str(exc))


def _state(manager):
    single = manager.coordinator.single_type_managers[0]
    return ({rid: [b.block_id for b in blocks] for rid, blocks in single.req_to_blocks.items()},
            dict(single.num_cached_block), manager.block_pool.get_num_free_blocks(),
            sorted(manager.block_pool.cached_block_hash_to_block._cache))


@_SETTINGS
@given(arg=st.sampled_from(["num_new_tokens", "num_lookahead_tokens", "reserved_blocks"]),
       value=edge_ints)
@example(arg="num_new_tokens", value=2**32 + 1)     # read as 1 through 32 bits
@example(arg="num_lookahead_tokens", value=2**32 + 1)
@example(arg="reserved_blocks", value=2**32)        # read as 0: allocated where vLLM refuses
def test_allocate_slots_integer_arguments_match_vllm(arg, value):
    results = []
    for manager, allocate_slots in _pair():
        req = _running(manager)
        kwargs = {"num_new_tokens": 1, arg: value}
        out = _outcome(lambda: _summary(manager, allocate_slots(manager, req, **kwargs)))
        results.append((out, _state(manager)))
    assert results[0] == results[1]


@_SETTINGS
@given(field=st.sampled_from(["num_computed_tokens", "max_model_len", "watermark_blocks"]),
       value=edge_ints, waiting=st.booleans())
def test_allocate_slots_integer_fields_match_vllm(field, value, waiting):
    """The request's computed tokens, the manager's max_model_len and watermark (the
    watermark counts for a waiting request)."""
    from vllm.v1.request import RequestStatus

    results = []
    for manager, allocate_slots in _pair():
        req = _running(manager)
        if waiting:
            req.status = RequestStatus.PREEMPTED
        setattr(req if field == "num_computed_tokens" else manager, field, value)
        out = _outcome(lambda: _summary(manager, allocate_slots(manager, req, 17)))
        results.append((out, _state(manager)))
    assert results[0] == results[1]


@_SETTINGS
@given(value=edge_ints)
@example(value=2**32 + 16)   # cached 1 block through 32 bits where vLLM caches 3
def test_cache_blocks_integer_argument_matches_vllm(value):
    results = []
    for manager, _ in _pair():
        req = _running(manager, prompt_len=48)
        # 48 prompt tokens are 3 full blocks; allocate_slots cached them already, so
        # uncache them to let this call do it.
        single = manager.coordinator.single_type_managers[0]
        single.num_cached_block["a"] = 0
        for block in single.req_to_blocks["a"]:
            manager.block_pool._maybe_evict_cached_block(block)
        out = _outcome(lambda: manager.coordinator.cache_blocks(req, value))
        results.append((out, _state(manager),
                        [b.block_hash is not None for b in single.req_to_blocks["a"]]))
    assert results[0] == results[1]


@_SETTINGS
@given(value=st.one_of(edge_ints.filter(lambda v: v >= 0), st.integers(0, 300)))
def test_get_new_blocks_counts_match_vllm(value):
    """The pool's count at any size: vLLM's blocks or vLLM's ValueError (a negative
    count is kvpool's ValueError by design; docs/design.md)."""
    from kvpool.block_pool import BlockPool, VllmBlockPool

    kvpool.install()
    results = []
    for cls in (VllmBlockPool, BlockPool):
        pool = cls(200, True, BLOCK_SIZE)
        out = _outcome(lambda: [b.block_id for b in pool.get_new_blocks(value)])
        results.append((out, pool.get_num_free_blocks()))
    assert results[0] == results[1]
