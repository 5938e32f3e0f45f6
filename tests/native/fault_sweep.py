"""Fault-injection sweep (run by tests/native/test_fault_injection.py in a child process).

With tests/native/failmalloc.cpp preloaded and PYTHONMALLOC=malloc, for each pool
operation and every k = 0, 1, 2, ... the k-th allocation inside the operation fails
once (malloc returns NULL, operator new throws bad_alloc). Each try starts from a
fresh pool in the same state. The operation must then either succeed or raise
(MemoryError, or another Python exception) and leave the pool exactly as it was
(strong guarantee): the free list in the same order, every block's ref_cnt, the
contiguous policy's reservations. The sweep of an operation ends at the first k
whose failure was never reached. A crash ends the process: the parent sees which
operation and k it was from the last line printed.

    python tests/native/fault_sweep.py [OPERATION ...]   # default: all
"""

from __future__ import annotations

import os
import sys
import types

MAX_K = int(os.environ.get("KVPOOL_FAULT_MAX_K", "5000"))

from failmalloc_ctl import disarm, lib  # noqa: E402  (tests/native: the script's own folder)
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402

from kvpool import _core, allocation  # noqa: E402, F401  (_core: the extension loaded before any fault is armed)
from kvpool._core import (  # noqa: E402
    BlockStateError,
    FencedDeferredFreeQueue,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_pool_blocks,
    pool_free_blocks,
    pool_get_new_blocks,
    pool_touch,
    pool_unpin_blocks,
)
from kvpool.block_pool import BlockPool  # noqa: E402

NUM_BLOCKS = 64
#: CPython's debug build (3.11.2) asserts in its own bytecode error paths when an
#: allocation fails inside a Python frame (docs/native-checks.md): there, operations
#: whose armed call is Python code are skipped and the native calls are swept.
DEBUG_INTERPRETER = hasattr(sys, "gettotalrefcount")
_K = 0  # the allocation to fail, for the current try


class _SkipPython(Exception):
    pass


class State:
    """A pool in a used state: some blocks held, some cached, free list scrambled."""

    def __init__(self, policy: str = "vllm", order: str | None = None):
        allocation.set_policy(policy)
        try:
            self.pool = BlockPool(NUM_BLOCKS, True, 16)
        finally:
            allocation.set_policy("vllm")
        pool = self.pool
        if order is not None:
            pool.free_block_queue.policy.set_order(order)
        self.held = pool.get_new_blocks(20)
        cached = self.held[:6]
        for i, block in enumerate(cached):
            block._block_hash = make_block_hash_with_group_id(BlockHash(b"h%d" % i), 0)
            pool.cached_block_hash_to_block.insert(block.block_hash, block)
        pool.free_blocks(list(reversed(self.held[:10])))  # 6 cached at the LRU tail
        self.held = self.held[10:]
        self.deferred = FencedDeferredFreeQueue()

    def snapshot(self):
        queue = self.pool.free_block_queue
        blocks = self.pool.blocks.materialized()
        return (
            queue.free_block_ids(),
            # Blocks not created yet have ref_cnt 0; a creation is not a change.
            [(b.block_id, b.ref_cnt) for b in blocks if b.ref_cnt != 0],
            queue.num_free_blocks,
            queue.policy.order,
            queue.policy.num_reserved_owners,
            queue.policy.num_uncached_free,
            queue.table_counters(),  # a free that raises counts nothing
            len(self.deferred),
            self.deferred.num_blocks,
            sorted(self.pool._reuse_watchers),
            sorted(b.block_id for b in blocks if b.block_hash is not None),
            len(self.pool.cached_block_hash_to_block),
        )

    def check(self):
        """Every block free or held exactly once, the free list consistent, and the
        pool still works (an allocation and its free: where a half-switched order
        once wrote through an empty array)."""
        self._check_accounting()
        blocks = self.pool.get_new_blocks(2)
        self.pool.free_blocks(list(reversed(blocks)))
        self._check_accounting()

    def _check_accounting(self):
        pool = self.pool
        queue = pool.free_block_queue
        queue.check_invariants()
        free = queue.free_block_ids()
        assert len(free) == len(set(free)) == queue.num_free_blocks, "free count"
        held = {b.block_id for b in self.held}
        deferred = {b.block_id for _, blocks in self.deferred for b in blocks}
        assert not (set(free) & held), "a block both free and held"
        assert set(free) | held | deferred | {0} == set(range(NUM_BLOCKS)), "a lost block"
        for block in pool.blocks.materialized():
            if block.block_id in held:
                assert block.ref_cnt >= 1, f"held block {block.block_id} has ref_cnt {block.ref_cnt}"
            elif block.block_id in free:
                assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"


def _is_native(fn) -> bool:
    # kvpool._core's functions, methods and types (callbacks they run may still be
    # Python code: vLLM's eviction hook).
    if isinstance(fn, types.MethodType):  # Cython's methods bind like Python's
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        return False
    if isinstance(fn, type):
        return fn.__module__ == "kvpool._core"
    return True


def armed(fn, *args):
    """Call the pool operation with the fault armed (the _K-th allocation inside it
    fails), and disarm right after it: the sweep's own code never takes the failure."""
    if DEBUG_INTERPRETER and not _is_native(fn):
        raise _SkipPython(getattr(fn, "__qualname__", repr(fn)))
    lib.kvpool_fault_arm(_K)
    try:
        return fn(*args)
    finally:
        disarm()


def op_create(state):
    blocks = [KVCacheBlock(i) for i in range(8)]
    armed(make_pool_blocks, None, NUM_BLOCKS)
    armed(FreeKVCacheBlockQueue, blocks)


def op_create_pool(state):
    armed(BlockPool, NUM_BLOCKS, True, 16)


def op_create_contiguous(state):
    allocation.set_policy("contiguous")
    try:
        armed(BlockPool, NUM_BLOCKS, True, 16)
    finally:
        allocation.set_policy("vllm")


def op_takeover(state):
    # The RFC's reorder body: a new queue over the pool's free blocks takes them over.
    free = [b for b in state.pool.blocks[1:12] if b.ref_cnt == 0]
    armed(FreeKVCacheBlockQueue, free)
    raise _DONE  # the pool's queue gave those blocks away: nothing more to check


def op_get_new_blocks_pool(state):
    state.held += armed(state.pool.get_new_blocks, 30)  # BlockPool's Python glue too


def _get(state, n, hint=-1, owner=0, want=0):
    pool = state.pool
    state.held += armed(pool_get_new_blocks, pool.free_block_queue, n, True,
                        pool.cached_block_hashes_by_block, pool._maybe_evict_cached_block,
                        hint, owner, want)


def op_get_new_blocks(state):
    _get(state, 30)  # evicts cached blocks too (vLLM's eviction callback)


def op_get_new_blocks_contiguous(state):
    _get(state, 12, 40, 7, 16)


def op_get_new_blocks_extent(state):
    # The table ends at block 7: its continuation 8, 9, 10 is free, 11 is held, so the
    # rest goes to a new extent (reserved for owner 7 after the continuation was taken).
    _get(state, 12, 8, 7, 16)


def _lru_window(state):
    state.pool.free_block_queue.policy.set_lru_window(8)


def op_get_new_blocks_lru_window(state):
    # Every uncached block and two of the LRU segment's, chosen in an LRU window. The
    # eviction callback keeps the hashes: an eviction that ran before the failing
    # allocation would stay done (vLLM's callback has no undo), and the sweep checks the
    # free list's exact order after the undo (restore_lru_front).
    pool = state.pool
    queue = pool.free_block_queue
    state.held += armed(pool_get_new_blocks, queue, queue.policy.num_uncached_free + 2, True,
                        pool.cached_block_hashes_by_block, lambda block: None, -1, 0, 0)


def op_free_blocks(state):
    blocks = list(reversed(state.held[:6]))
    armed(pool_free_blocks, state.pool, state.pool.free_block_queue, blocks, True)
    del state.held[:6]


def op_free_blocks_pool(state):
    blocks = list(reversed(state.held[:6]))
    armed(state.pool.free_blocks, blocks)
    del state.held[:6]


def op_touch(state):
    free = state.pool.free_block_queue.get_all_free_blocks()[-4:]  # cached ones
    armed(pool_touch, state.pool.free_block_queue, free)
    state.held += free


def op_set_order(state):
    armed(state.pool.free_block_queue.policy.set_order, "contiguous")


def op_set_order_segments(state):
    armed(state.pool.free_block_queue.policy.set_order, "segments")


def _free_all(state):
    state.pool.free_blocks(list(reversed(state.held)))
    state.held = []


def op_reorder(state):
    armed(state.pool.free_block_queue.rebuild_canonical)


def op_reorder_pool(state):
    armed(state.pool.reset_free_block_queue_order)


def op_rebuild_uncached(state):
    armed(state.pool.free_block_queue.policy.rebuild_uncached_canonical)


def op_reset_prefix_cache(state):
    armed(state.pool.reset_prefix_cache, True)


def op_lists(state):
    queue = state.pool.free_block_queue
    window = slice(2, 40)
    armed(queue.get_all_free_blocks)
    armed(queue.free_block_ids)
    armed(state.pool.blocks.__getitem__, window)
    armed(state.pool.blocks.materialized)


def op_deferred(state):
    groups = [list(reversed(state.held[:3])), list(reversed(state.held[3:5]))]
    armed(state.deferred.push_groups, 4, groups)  # (a copy of each group is read first)
    del state.held[:5]


def op_free_ready(state):
    armed(state.deferred.free_ready, 4, state.pool)


def op_drain(state):
    parts = armed(state.deferred.drain, 4)
    for part in parts:
        state.pool.free_blocks(part)


def _refused(fn, *args, expected=BlockStateError):
    # An operation that is refused by design (a bad block at the end of its list):
    # with an allocation failing in its loop or in its undo it must still leave the
    # pool as it was.
    try:
        armed(fn, *args)
    except expected as exc:
        raise _Refused(exc) from exc
    raise AssertionError(f"{fn!r} was not refused")


def op_free_refused(state):
    # held[:3] hold 3,000 references each (_big_refs): each decrement, and each undo of
    # one, needs a new int, so a failure can land in the undo too.
    free_block = state.pool.free_block_queue.get_all_free_blocks()[0]
    pool = state.pool
    _refused(pool_free_blocks, pool, pool.free_block_queue, list(state.held[:4]) + [free_block], True)


def op_touch_refused(state):
    _refused(pool_touch, state.pool.free_block_queue, list(state.held[:4]) + [KVCacheBlock(99)])


def op_unpin_refused(state):
    pool = state.pool
    _refused(pool_unpin_blocks, pool.free_block_queue, list(state.held[:4]) + [pool.null_block],
             pool._reuse_watchers, _on_reuse)


def op_unpin(state):
    # ref_cnts to decrement (3,000 and 1), watchers to register, blocks to link.
    blocks = list(state.held[:6])
    pool = state.pool
    armed(pool_unpin_blocks, pool.free_block_queue, blocks, pool._reuse_watchers, _on_reuse)
    state.held = [b for b in state.held if b.ref_cnt > 0]


def _on_reuse(block):
    pass


def op_adopt(state):
    queue = FreeKVCacheBlockQueue([])
    blocks = [KVCacheBlock(1000 + i) for i in range(5)]
    armed(queue.append_n, blocks)
    queue.check_invariants()


class _Done(Exception):
    pass


class _Refused(Exception):
    pass


_DONE = _Done()  # made before any fault is armed


def _idle(state):
    _free_all(state)


def _big_refs(state):
    # Counts beyond the interpreter's cached ints: changing one allocates an int.
    for block in state.held[:3]:
        block.ref_cnt = 3000
    state.pool._reuse_watchers[state.held[0].block_id] = print  # one watcher replaced


def _queued(state):
    state.deferred.push_groups(4, [list(reversed(state.held[:3])), list(reversed(state.held[3:5]))])
    del state.held[:5]


# name: (operation, policy, free-list order, set-up after the common state)
OPERATIONS = {
    "create": (op_create, "vllm", None, None),
    "create_pool": (op_create_pool, "vllm", None, None),
    "create_contiguous": (op_create_contiguous, "vllm", None, None),
    "takeover": (op_takeover, "vllm", None, None),
    "get_new_blocks": (op_get_new_blocks, "vllm", None, None),
    "get_new_blocks_pool": (op_get_new_blocks_pool, "vllm", None, None),
    "get_new_blocks_contiguous": (op_get_new_blocks_contiguous, "contiguous", None, None),
    "get_new_blocks_segments": (op_get_new_blocks, "vllm", "segments", None),
    "get_new_blocks_extent": (op_get_new_blocks_extent, "contiguous", None, None),
    "get_new_blocks_lru_window": (op_get_new_blocks_lru_window, "contiguous", None, _lru_window),
    "free_blocks": (op_free_blocks, "vllm", None, None),
    "free_blocks_pool": (op_free_blocks_pool, "vllm", None, None),
    "free_blocks_contiguous": (op_free_blocks, "contiguous", None, None),
    "touch": (op_touch, "vllm", None, None),
    "touch_contiguous": (op_touch, "contiguous", None, None),
    "set_order_contiguous": (op_set_order, "vllm", None, None),
    "set_order_segments": (op_set_order_segments, "vllm", None, None),
    "reorder": (op_reorder, "vllm", None, _idle),
    "reorder_pool": (op_reorder_pool, "vllm", None, _idle),
    "reorder_contiguous": (op_reorder_pool, "contiguous", None, _idle),
    "rebuild_uncached": (op_rebuild_uncached, "contiguous", None, None),
    "reset_prefix_cache": (op_reset_prefix_cache, "vllm", None, _idle),
    "reset_prefix_cache_contiguous": (op_reset_prefix_cache, "contiguous", None, _idle),
    "lists": (op_lists, "vllm", None, None),
    "deferred_push_groups": (op_deferred, "vllm", None, None),
    # free_ready frees an entry part by part (one KV cache group each): a failure
    # leaves the failing part queued and the parts before it freed (its docstring),
    # so it is checked for consistency, not for being unchanged.
    "deferred_free_ready": (op_free_ready, "vllm", None, _queued),
    "deferred_drain": (op_drain, "vllm", None, _queued),
    "adopt": (op_adopt, "vllm", None, None),
    "free_refused_big_refs": (op_free_refused, "vllm", None, _big_refs),
    "touch_refused_big_refs": (op_touch_refused, "vllm", None, _big_refs),
    "unpin_refused_big_refs": (op_unpin_refused, "vllm", None, _big_refs),
    "unpin": (op_unpin, "vllm", None, _big_refs),
    "unpin_contiguous": (op_unpin, "contiguous", None, _big_refs),
}


#: Operations that may stop part-way (each step kept consistent).
PARTIAL = {"deferred_free_ready"}


def _reset_done(state, before, after) -> bool:
    # reset_prefix_cache(reorder_free_queue=True) all done: a failure in vLLM's own
    # effects after the reset (its log line) may be raised with the reset done.
    free, refs, num_free, order, owners, uncached, tables, entries, deferred, watchers, hashed, mapped = after
    return (free == sorted(before[0]) and not hashed and mapped == 0
            and (refs, num_free, order, tables, entries, deferred, watchers)
            == (before[1], before[2], before[3], *before[6:10]))


#: Operations that may also raise with their work complete: name -> test of that state.
DONE_THEN_RAISED = {"reset_prefix_cache": _reset_done, "reset_prefix_cache_contiguous": _reset_done}


def sweep(name: str) -> int:
    op, policy, order, setup = OPERATIONS[name]
    global _K
    for k in range(MAX_K):
        state = State(policy, order)
        if setup is not None:
            setup(state)
        before = state.snapshot()
        print(f"{name} k={k}", flush=True)
        _K = k
        lib.kvpool_fault_arm(-1)  # counts reset; armed() arms around each call
        gave_away = False  # _Done: the operation handed the pool's blocks elsewhere
        try:
            op(state)
            error = None
        except _Done:
            error = None
            gave_away = True
        except _Refused as refused:
            error = refused  # refused by design: unchanged, hit or not
        except _SkipPython as skipped:
            return -1 if k == 0 else _fail(f"{name}: {skipped} skipped after k={k}")
        except Exception as exc:  # MemoryError, or what the operation made of it
            error = exc
        hit = disarm()
        if not hit:
            assert error is None or isinstance(error, _Refused), (
                f"{name}: {error!r} without an injected failure")
            if error is not None:
                assert state.snapshot() == before, f"{name}: the refused call changed the pool"
                state.check()
            return k
        if error is None:
            # The failure was absorbed (e.g. a courtesy note, or the harness's own
            # disarm call, failmalloc_ctl.disarm): still consistent.
            if not gave_away:
                state.check()
            continue
        after = state.snapshot()
        done = name in DONE_THEN_RAISED and DONE_THEN_RAISED[name](state, before, after)
        assert name in PARTIAL or after == before or done, (
            f"{name} k={k}: {type(error).__name__}: {error} changed the pool\n"
            f"before {before}\nafter  {after}")
        state.check()
    raise AssertionError(f"{name}: still hitting allocations after {MAX_K} tries")


def _fail(message: str):
    raise AssertionError(message)


def main(argv: list[str]) -> int:
    names = argv or list(OPERATIONS)
    for name in names:
        n = sweep(name)
        if n < 0:
            print(f"SKIP {name}: its armed call is Python code (Py_DEBUG interpreter)", flush=True)
        else:
            print(f"OK {name}: {n} allocation points, each failing once", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
