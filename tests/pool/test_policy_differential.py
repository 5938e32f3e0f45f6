"""The contiguous allocation policy against vanilla vLLM 0.33.0's ``BlockPool``: a long
random differential in which only the ids of uncached allocations may differ.

The random operations of ``tests/support/pool_workload.py`` (allocation, frees in random order,
caching under hashes, cache hits with ``touch``, ``evict_blocks``, ``unpin_blocks`` with
reuse watchers, deferred frees of two KV cache groups, resets) plus table growth (a
request's group gets more blocks, as decode does) run on vLLM's pool and on kvpool's
with ``allocation="contiguous"``. Half the allocations name the block table they extend,
as vLLM's single-type managers do once kvpool is installed, so table continuation and
reserved extents are exercised too. vLLM's side has no reorder (vanilla vLLM has none);
kvpool's reorder keeps the LRU segment, so the two stay comparable.

kvpool's blocks are mapped to vLLM's: an allocation pairs the blocks both pools hand
out, position by position. After every operation the free counts, the KV events
(``BlockRemoved``: which hashes were evicted, in which order), the prefix-cache hits and
the reuse callbacks of LRU blocks agree under that mapping, and blocks taken from the
LRU segment must be the mapped ones; every 500 operations the cached keys, the held
blocks' ref counts and the whole LRU segment's order agree too.

    KVPOOL_POLICY_DIFF_OPS=1000000 python -m pytest tests/pool/test_policy_differential.py -s

runs 10^6 operations (default 2*10^4 in the plain suite; CI sets 10^5).
"""

from __future__ import annotations

import os
import time

import pytest
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

from kvpool import allocation
from kvpool.block_pool import BlockPool
from tests.support.pool_workload import KvpoolSide, PoolWorkload, VllmSide

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug, pytest.mark.slow]

NUM_OPS = int(os.environ.get("KVPOOL_POLICY_DIFF_OPS", "20000"))
SEED = int(os.environ.get("KVPOOL_DIFF_SEED", "20261130"))


class _Table:
    """What a single-type manager shows the pool: the request's table and block size."""

    block_size = 16

    def __init__(self):
        self.req_to_blocks: dict[str, list] = {}


class VanillaSide(VllmSide):
    """vLLM 0.33.0's pool with KV events; no reorder (vanilla vLLM has none)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.pool = VllmBlockPool(num_blocks, enable_caching=True, hash_block_size=16,
                                  enable_kv_cache_events=True)

    def alloc(self, n: int, table_key) -> list:
        return self.pool.get_new_blocks(n)

    def reorder(self) -> bool:
        return self.pool.get_num_free_blocks() == self.pool.num_gpu_blocks - 1

    def reset(self, reorder: bool) -> bool:
        return self.pool.reset_prefix_cache()


class ContiguousSide(KvpoolSide):
    """kvpool's pool with the contiguous policy; allocations may name their table."""

    name = "kvpool-contiguous"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        previous = allocation.current()
        allocation.set_policy("contiguous")
        try:
            self.pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16,
                                  enable_kv_cache_events=True)
        finally:
            allocation.set_policy(previous)
        assert self.pool.free_block_queue.policy.order == "contiguous"
        self.manager = _Table()
        # vLLM block id -> kvpool block id, for held blocks and the LRU segment.
        self.to_kvpool: dict[int, int] = {}
        self.to_vllm: dict[int, int] = {}

    def alloc(self, n: int, table_key) -> list:
        pool = self.pool
        self.table_last = None  # the block the allocation continues (for the checks)
        if table_key is None:
            return pool.get_new_blocks(n)
        table = self.manager.req_to_blocks.setdefault(table_key, [])
        self.table_last = table[-1].block_id if table else None
        pool._policy.expected_tokens.setdefault(table_key, 16 * (len(table) + n + 8))
        pool._table_context = (self.manager, table_key)
        try:
            blocks = pool.get_new_blocks(n)
        finally:
            pool._table_context = None
        table.extend(blocks)
        return blocks

    def end_table(self, table_key) -> None:
        self.manager.req_to_blocks.pop(table_key, None)
        self.pool._end_table(self.manager, table_key)

    def free_ready(self, processed_step_seq: int) -> int:
        freed = super().free_ready(processed_step_seq)
        if freed:
            self.pool._after_free()
        return freed


def _events(pool) -> list:
    # What an event says, not its object identity (hashes, never block ids).
    return [(type(e).__name__, getattr(e, "block_hashes", None)) for e in pool.take_events()]


class PolicyWorkload(PoolWorkload):
    """``PoolWorkload`` with block ids kept in vLLM's id space and mapped to kvpool's."""

    def __init__(self, num_blocks: int, seed: int, full_check_every: int = 500):
        self.vllm_side = VanillaSide(num_blocks)
        self.ours = ContiguousSide(num_blocks)
        super().__init__([self.vllm_side, self.ours], seed=seed, full_check_every=full_check_every)
        self.op_names.append("grow")
        self.op_weights.append(8)
        self.counts["grow"] = 0
        self.table_keys: dict[int, list] = {}  # id(request groups) -> table key per group
        self.next_key = 0
        self.lru_hits = 0
        self.lru_rotations = 0  # LRU blocks placed to continue a table's last block
        self.lru_taken: set[int] = set()  # vLLM ids taken from the LRU segment this op

    # -- id mapping ----------------------------------------------------------------------
    def _blocks(self, side, ids):
        if side is self.ours:
            return [side.pool.blocks[side.to_kvpool[i]] for i in ids]
        return super()._blocks(side, ids)

    def _ids_of(self, side, blocks) -> list:
        if side is self.ours:
            return [side.to_vllm.get(b.block_id) for b in blocks]
        return super()._ids_of(side, blocks)

    def _pair(self, vllm_blocks, our_blocks, uncached_before: int) -> list[int]:
        """Map the blocks both pools handed out, position by position (a table position
        is what gets a hash). Those beyond the uncached ones came from the LRU segment:
        the same (mapped) blocks on both sides, evicted in vLLM's order (the events say
        so), which kvpool places in the table ascending by id, starting at the block
        that continues the uncached ones when it is among them."""
        assert len(vllm_blocks) == len(our_blocks)
        ours = self.ours
        lru_v = [v.block_id for v in vllm_blocks[uncached_before:]]
        lru_k = [k.block_id for k in our_blocks[uncached_before:]]
        if lru_v:
            self.lru_hits += len(lru_v)
            self.lru_taken.update(lru_v)
            assert sorted(ours.to_kvpool.get(i) for i in lru_v) == sorted(lru_k), (
                f"op {self.ops_done}: vLLM took LRU blocks {lru_v} (kvpool's "
                f"{[ours.to_kvpool.get(i) for i in lru_v]}), kvpool took {lru_k}")
            start = lru_k.index(min(lru_k))
            assert lru_k[start:] + lru_k[:start] == sorted(lru_k), f"LRU blocks not placed ascending: {lru_k}"
            if start:  # rotated: only to continue the table's previous block
                before = (our_blocks[uncached_before - 1].block_id if uncached_before
                          else ours.table_last)
                assert before is not None and lru_k[0] == before + 1, (
                    f"LRU blocks {lru_k} rotated without continuing block {before}")
                self.lru_rotations += 1
        for v, k in zip(vllm_blocks, our_blocks):
            stale = ours.to_vllm.pop(k.block_id, None)
            if stale is not None and ours.to_kvpool.get(stale) == k.block_id:
                del ours.to_kvpool[stale]
            old = ours.to_kvpool.pop(v.block_id, None)
            if old is not None and ours.to_vllm.get(old) == v.block_id:
                del ours.to_vllm[old]
            ours.to_kvpool[v.block_id] = k.block_id
            ours.to_vllm[k.block_id] = v.block_id
        return [v.block_id for v in vllm_blocks]

    def _alloc_ids(self, size: int, table_key) -> list[int]:
        uncached = self.ours.pool.free_block_queue.policy.num_uncached_free
        got_v = self.vllm_side.alloc(size, table_key)
        seen = len(self.reused[1])
        got_k = self.ours.alloc(size, table_key)
        # The reuse callbacks this allocation made name kvpool's blocks; in vLLM's ids
        # as mapped before the allocation (which _pair then re-maps by table position).
        self.reused[1][seen:] = [(t, -2 - self.ours.to_vllm.get(i, -1)) for t, i in self.reused[1][seen:]]
        return self._pair(got_v, got_k, uncached)

    def _check_reuse_callbacks(self, name: str) -> None:
        """Reuse callbacks (``unpin_blocks`` watchers) agree for the blocks both pools
        hand out alike: those taken from the LRU segment. A watched block that was freed
        again without a hash is uncached, and which uncached block is reused first is
        the policy's choice, so which watchers are still waiting differs too; a reset
        notifies and drops the waiting ones on both sides."""
        vllm_seen, ours_seen = self.reused
        if name in ("reset", "flush"):
            if self.vllm_side.pool.get_num_free_blocks() == self.num_blocks - 1:  # the reset ran
                self._agree([dict(self.vllm_side.pool._reuse_watchers), dict(self.ours.pool._reuse_watchers)],
                            "watchers after a reset")
            return
        # (an id < -1 is a vLLM id already mapped at its allocation: -2 - id)
        ours = [(t, -2 - i if i < -1 else self.ours.to_vllm.get(i, -1)) for t, i in ours_seen]
        self._agree([[c for c in vllm_seen if c[1] in self.lru_taken], [c for c in ours if c[1] in self.lru_taken]],
                    "reuse callbacks of LRU blocks")

    # -- operations that allocate or end tables --------------------------------------------
    def op_alloc(self) -> None:
        free = self.vllm_side.pool.get_num_free_blocks()
        num_groups = 1 if self.rng.random() < 0.5 else 2
        sizes = [self.rng.randint(0, self.max_request_blocks) for _ in range(num_groups)]
        named = self.rng.random() < 0.5
        if sum(sizes) > free:
            return
        keys = []
        groups = []
        for size in sizes:
            key = None
            if named:
                key = f"t{self.next_key}"
                self.next_key += 1
            keys.append(key)
            groups.append(self._alloc_ids(size, key))
        self._cache_prefixes(groups)
        self.requests.append(groups)
        self.table_keys[id(groups)] = keys

    def op_grow(self) -> None:
        """Decode: a live request's group gets more blocks at the end of its table."""
        if not self.requests:
            return
        groups = self.requests[self.rng.randrange(len(self.requests))]
        keys = self.table_keys.get(id(groups))
        g = self.rng.randrange(len(groups))
        n = self.rng.randint(1, 4)
        if n > self.vllm_side.pool.get_num_free_blocks():
            return
        groups[g].extend(self._alloc_ids(n, keys[g] if keys else None))

    def _pop_request(self):
        groups = super()._pop_request()
        if groups is not None:
            # (a shuffled copy keeps no key; the original list's key is found by scan)
            for key_list in [self.table_keys.pop(k) for k in list(self.table_keys)
                             if not any(id(r) == k for r in self.requests)]:
                for key in key_list:
                    if key is not None:
                        self.ours.end_table(key)
        return groups

    def op_evict(self) -> None:
        ids = set(self.rng.sample(range(self.num_blocks), self.rng.randint(1, 8)))
        # In vLLM's iteration order of the set (evictions, and their events, follow it).
        hashed = [i for i in ids if self.vllm_side.pool.blocks[i].block_hash is not None]
        self.vllm_side.pool.evict_blocks(ids)
        self.ours.pool.evict_blocks([self.ours.to_kvpool[i] for i in hashed])

    def quiesce(self) -> None:
        while self.requests:
            self.op_free()
        self.sched_step_seq += 4
        self.processed_step_seq = self.sched_step_seq
        self._agree([s.free_ready(self.processed_step_seq) for s in self.sides], "free_ready calls")
        self._agree([s.reset(True) for s in self.sides], "reset")
        queue = self.ours.pool.free_block_queue
        assert queue.policy.num_reserved_owners == 0, "extents left after every table ended"
        order = queue.free_block_ids()
        uncached = order[: queue.policy.num_uncached_free]
        assert uncached == sorted(uncached)

    def check_full(self) -> None:
        v, k = self.vllm_side.pool, self.ours.pool
        self._agree([sorted(v.cached_block_hash_to_block._cache), sorted(k.cached_block_hash_to_block._cache)],
                    "cached keys")
        held = [b.block_id for b in v.blocks if b.ref_cnt > 0 and not b.is_null]
        self._agree([[v.blocks[i].ref_cnt for i in held],
                     [k.blocks[self.ours.to_kvpool[i]].ref_cnt for i in held]], "ref counts")
        queue = k.free_block_queue
        lru = queue.free_block_ids()[queue.policy.num_uncached_free:]
        vorder = [b.block_id for b in v.free_block_queue.get_all_free_blocks()]
        self._agree([vorder[len(vorder) - len(lru):], [self.ours.to_vllm[i] for i in lru]], "LRU segment")
        queue.check_invariants()

    def run(self, num_ops: int) -> None:
        choices = self.rng.choices(self.op_names, weights=self.op_weights, k=num_ops)
        for name in choices:
            self.lru_taken.clear()
            getattr(self, "op_" + name)()
            self.counts[name] += 1
            self.ops_done += 1
            self._agree([_events(s.pool) for s in self.sides], "KV events")
            self._agree([s.pool.get_num_free_blocks() for s in self.sides], "free count")
            self._check_reuse_callbacks(name)
            if self.ops_done % self.full_check_every == 0:
                self.check_full()
            for seen in self.reused:
                seen.clear()


@pytest.mark.parametrize("num_blocks", [96, 1024])
def test_contiguous_policy_keeps_vllm_hits_evictions_and_events(num_blocks, quiet_pool_logs):
    num_ops = NUM_OPS // 2
    workload = PolicyWorkload(num_blocks, seed=SEED + num_blocks)
    start = time.perf_counter()
    workload.run(num_ops)
    workload.check_full()
    workload.quiesce()
    elapsed = time.perf_counter() - start
    print(f"\npolicy differential: seed {SEED + num_blocks}, {num_blocks} blocks, {workload.ops_done} ops "
          f"in {elapsed:.1f} s, {workload.lru_hits} blocks taken from the LRU segment "
          f"({workload.lru_rotations} placements continuing a table); {workload.counts}")
    assert workload.lru_hits > 0 or num_ops < 1000  # the LRU segment was reached
    assert workload.lru_rotations > 0 or num_ops < 1000  # and continued a table
    assert all(workload.counts[name] > 0 for name in ("alloc", "grow", "free", "free_deferred", "touch",
                                                       "evict", "unpin", "reset")) or num_ops < 1000
