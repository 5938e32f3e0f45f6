"""Methods patched after install() are called exactly as vLLM calls them.

For every entry of ``kvpool.vllm_calls.POOL_SELF_CALLS`` (a pool operation kvpool runs
natively, and a method vLLM's version of it calls through ``self.``), the method is
patched after ``install()`` with a recording wrapper of vLLM's function, on the class
(vLLM's ``BlockPool``, which kvpool's inherits, or kvpool's, as ``vllm.v1.core.block_pool
.BlockPool`` names it once installed) or on the instance, and the operation is run on a
kvpool pool and on vLLM's own pool (vLLM's class and code): the calls (method, block id),
the results and the pools' state must be the same.
"""

from __future__ import annotations

import types

import pytest
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

import kvpool
from kvpool.vllm_calls import POOL_SELF_CALLS
from kvpool.vllm_compat import release_traits

CASES = [(op, name) for op, names in POOL_SELF_CALLS.items() for name in names]
NUM_BLOCKS = 24


def _describe(args) -> tuple:
    out = []
    for a in args:
        if hasattr(a, "block_id"):
            out.append(("block", a.block_id))
        elif isinstance(a, list):
            out.append(tuple(getattr(x, "block_id", x) for x in a))
        else:
            out.append(a)
    return tuple(out)


def _prepared(cls, watched: bool):
    """A pool with blocks 1-8 used once, 1-3 of them cached (hashed), all freed, and
    block 9 unpinned with a reuse watcher if ``watched`` (else freed too; a watcher sends
    kvpool's get_new_blocks to vLLM's loop by itself, so only the test of _notify_reuse
    has one): its free queue holds unhashed, hashed (and watched) blocks."""
    pool = cls(NUM_BLOCKS, True, 16)
    blocks = pool.get_new_blocks(9)
    for i, block in enumerate(blocks[:3]):
        key = make_block_hash_with_group_id(bytes([i + 1]) * 4, 0)
        pool._insert_block_hash(key, block, num_tokens=16 * (i + 1))
    pool.free_blocks(blocks[:8])
    if watched:
        pool.unpin_blocks(blocks[8:], lambda block: None)
    else:
        pool.free_blocks(blocks[8:])
    return pool


def _run(op: str, pool):
    if op == "get_new_blocks":
        return [b.block_id for b in pool.get_new_blocks(NUM_BLOCKS - 1)]   # every free block
    if op == "evict_blocks":
        return pool.evict_blocks({1, 2, 3, 4, 5, 9})
    if op == "reset_prefix_cache":
        return pool.reset_prefix_cache()
    raise AssertionError(op)


def _state(pool):
    return (pool.get_num_free_blocks(), [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            sorted(pool.cached_block_hash_to_block._cache), [b.block_hash for b in pool.blocks[:10]])


@pytest.mark.parametrize("where", ["vllm class", "kvpool class", "instance"])
@pytest.mark.parametrize("op,name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_a_method_patched_after_install_is_called_as_vllm_calls_it(monkeypatch, op, name, where):
    from vllm.v1.core import block_pool as vllm_block_pool

    from kvpool.block_pool import BlockPool, VllmBlockPool

    kvpool.install()
    assert vllm_block_pool.BlockPool is BlockPool
    calls: dict[int, list] = {}
    original = getattr(VllmBlockPool, name)

    def recording(self, *args, **kwargs):
        calls.setdefault(id(self), []).append((name, _describe(args)))
        return original(self, *args, **kwargs)

    watched = name == "_notify_reuse"
    vanilla, native = _prepared(VllmBlockPool, watched), _prepared(BlockPool, watched)
    assert native._needs_vllm_loop() is watched
    assert type(native.free_block_queue) is not type(vanilla) and native._kvpool_native
    if where == "instance":
        for pool in (vanilla, native):
            setattr(pool, name, types.MethodType(recording, pool))
    elif where == "vllm class":
        monkeypatch.setattr(VllmBlockPool, name, recording)
    else:
        # kvpool's class for the kvpool pool; vLLM's pool keeps vLLM's class, patched alike.
        monkeypatch.setattr(BlockPool, name, recording)
        monkeypatch.setattr(VllmBlockPool, name, recording)
    results = [(_run(op, pool), _state(pool)) for pool in (vanilla, native)]
    assert results[0] == results[1]
    assert calls.get(id(vanilla)), f"vLLM's {op} did not call {name}: the scenario misses it"
    assert calls.get(id(native)) == calls[id(vanilla)]


def test_five_fresh_blocks_call_the_eviction_hook_as_vllm_does(monkeypatch):
    """The issue's reproducer: vLLM 0.30.0-0.33.0 call the hook once per block they hand
    out; 0.34.0 only for blocks with a hash (none of five fresh ones)."""
    from kvpool.block_pool import BlockPool, VllmBlockPool

    kvpool.install()
    seen = []
    original = VllmBlockPool._remove_cached_block_hashes

    def hook(self, block):
        seen.append(block.block_id)
        return original(self, block)

    monkeypatch.setattr(BlockPool, "_remove_cached_block_hashes", hook)
    pool = BlockPool(16, True, 16)
    pool.get_new_blocks(5)
    assert seen == ([] if release_traits().eviction_hook_hashed_only else [1, 2, 3, 4, 5])


def test_unpatched_pools_keep_the_native_loop():
    from kvpool import _core
    from kvpool.block_pool import _GET_NEW_BLOCKS_CALLS, BlockPool

    kvpool.install()
    pool = BlockPool(16, True, 16)
    assert _GET_NEW_BLOCKS_CALLS.intact(pool) and not pool._needs_vllm_loop()
    # The replay's probe records removed hashes with a list's extend: still native.
    pool._emit_block_removed_events = [].extend
    assert _GET_NEW_BLOCKS_CALLS.intact(pool)
    pool._emit_block_removed_events = print
    assert not _GET_NEW_BLOCKS_CALLS.intact(pool)
    del pool._emit_block_removed_events
    assert _GET_NEW_BLOCKS_CALLS.intact(pool)
    assert isinstance(_GET_NEW_BLOCKS_CALLS, _core.VllmCallGuard)


def _self_calls(cls, name: str, seen: set | None = None) -> set[str]:
    """Every method ``cls.name`` calls through ``self.`` in vLLM's source, transitively."""
    import ast
    import inspect
    import textwrap

    seen = set() if seen is None else seen
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name))))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                and node.func.attr not in seen):
            seen.add(node.func.attr)
            if callable(getattr(cls, node.func.attr, None)):
                _self_calls(cls, node.func.attr, seen)
    return seen


@pytest.mark.parametrize("op", ["get_new_blocks", "evict_blocks", "reset_prefix_cache",
                                "free_blocks", "touch", "unpin_blocks"])
def test_the_table_lists_every_self_call_of_vllms_operation(op):
    """POOL_SELF_CALLS is checked against vLLM's own source, not written from memory
    (kvpool's free_blocks, touch and unpin_blocks: vLLM's call no method through self.)."""
    from kvpool.block_pool import VllmBlockPool

    assert _self_calls(VllmBlockPool, op) <= set(POOL_SELF_CALLS.get(op, ()))
