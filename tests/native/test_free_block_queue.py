"""kvpool's FreeKVCacheBlockQueue against vLLM 0.33.0's pure-Python one."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.core import kv_cache_utils as vllm_utils

from kvpool import BlockStateError, FreeKVCacheBlockQueue, KVCacheBlock

# The native-check scripts select by these marks (scripts/test-sanitizers.sh, test-debug-python.sh; pyproject.toml).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]

N = 24


def ids(blocks):
    return [b.block_id for b in blocks]


class QueueDifferential(RuleBasedStateMachine):
    """Random operation sequences on vLLM's queue and ours: same block-id order
    (and the same links) after every step."""

    def __init__(self):
        super().__init__()
        self.v_blocks = [vllm_utils.KVCacheBlock(i) for i in range(N)]
        self.k_blocks = [KVCacheBlock(i) for i in range(N)]
        self.vq = vllm_utils.FreeKVCacheBlockQueue(self.v_blocks)
        self.kq = FreeKVCacheBlockQueue(self.k_blocks)
        self.taken: list[int] = []  # popped block ids, not free

    def _free_ids(self):
        return ids(self.vq.get_all_free_blocks())

    @precondition(lambda self: self.vq.num_free_blocks > 0)
    @rule()
    def popleft(self):
        a, b = self.vq.popleft(), self.kq.popleft()
        assert a.block_id == b.block_id
        self.taken.append(a.block_id)

    @rule(data=st.data())
    def popleft_n(self, data):
        n = data.draw(st.integers(0, self.vq.num_free_blocks))
        a, b = self.vq.popleft_n(n), self.kq.popleft_n(n)
        assert ids(a) == ids(b)
        self.taken.extend(ids(a))

    @precondition(lambda self: self.vq.num_free_blocks > 0)
    @rule(data=st.data())
    def remove(self, data):
        bid = data.draw(st.sampled_from(self._free_ids()))
        self.vq.remove(self.v_blocks[bid])
        self.kq.remove(self.k_blocks[bid])
        self.taken.append(bid)

    def _draw_taken(self, data, max_size=None):
        chosen = data.draw(st.lists(st.sampled_from(self.taken), unique=True, max_size=max_size)) if self.taken else []
        for bid in chosen:
            self.taken.remove(bid)
        return chosen

    @precondition(lambda self: self.taken)
    @rule(data=st.data())
    def append(self, data):
        (bid,) = self._draw_taken(data, 1) or (self.taken.pop(),)
        self.vq.append(self.v_blocks[bid])
        self.kq.append(self.k_blocks[bid])

    @rule(data=st.data())
    def append_n(self, data):
        chosen = self._draw_taken(data)
        self.vq.append_n([self.v_blocks[i] for i in chosen])
        self.kq.append_n([self.k_blocks[i] for i in chosen])

    @rule(data=st.data())
    def prepend_n(self, data):
        chosen = self._draw_taken(data)
        self.vq.prepend_n([self.v_blocks[i] for i in chosen])
        self.kq.prepend_n([self.k_blocks[i] for i in chosen])

    @rule()
    def rebuild_canonical(self):
        # vLLM has no in-place reorder; its equivalent is the sorted free list.
        free = sorted(self._free_ids())
        taken = list(self.taken)
        self.v_blocks = [vllm_utils.KVCacheBlock(i) for i in range(N)]
        self.vq = vllm_utils.FreeKVCacheBlockQueue([self.v_blocks[i] for i in free])
        self.kq.rebuild_canonical()
        self.taken = taken

    @invariant()
    def same_order_and_links(self):
        self.kq.check_invariants()
        assert self.kq.num_free_blocks == self.vq.num_free_blocks
        assert self.kq.free_block_ids() == self._free_ids()
        assert ids(self.kq.get_all_free_blocks()) == self._free_ids()
        head = self.kq.fake_free_list_head.next_free_block
        assert head.block_id == self.vq.fake_free_list_head.next_free_block.block_id
        for bid in range(N):
            kb = self.k_blocks[bid]
            vb = self.v_blocks[bid]
            kp, vp = kb.prev_free_block, vb.prev_free_block
            assert (kp is None) == (vp is None)
            if kp is not None:
                assert kp.block_id == vp.block_id
            assert [b.block_id for b in self.kq.iter_blocks_after(kb if kb.prev_free_block else None)] == [
                b.block_id for b in self.vq.iter_blocks_after(vb if vb.prev_free_block else None)
            ]


TestQueueDifferential = QueueDifferential.TestCase
TestQueueDifferential.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_links_and_sentinels_read_the_native_list():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.fake_free_list_head.next_free_block is blocks[0]
    assert q.fake_free_list_tail.prev_free_block is blocks[3]
    assert blocks[1].prev_free_block is blocks[0] and blocks[1].next_free_block is blocks[2]
    b = q.popleft()
    assert b.prev_free_block is None and b.next_free_block is None
    assert blocks[1].prev_free_block is q.fake_free_list_head
    q.popleft_n(3)
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


@pytest.mark.parametrize(
    "operation, error",
    [
        ("remove_not_free", BlockStateError),
        ("append_already_free", BlockStateError),
        ("append_n_duplicate", BlockStateError),
        ("prepend_n_already_free", BlockStateError),
        ("foreign_block", BlockStateError),
        ("not_a_block", TypeError),
        ("pop_too_many", ValueError),
        ("pop_negative", ValueError),
    ],
)
def test_misuse_raises_and_changes_nothing(operation, error):
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    taken = q.popleft_n(2)
    other = FreeKVCacheBlockQueue([KVCacheBlock(100)])
    foreign = other.popleft()
    before = q.free_block_ids()
    with pytest.raises(error):
        if operation == "remove_not_free":
            q.remove(taken[0])
        elif operation == "append_already_free":
            q.append(blocks[3])
        elif operation == "append_n_duplicate":
            q.append_n([taken[0], taken[1], taken[0]])
        elif operation == "prepend_n_already_free":
            q.prepend_n([taken[0], blocks[4]])
        elif operation == "foreign_block":
            q.append_n([taken[0], foreign])
        elif operation == "not_a_block":
            q.append_n([taken[0], object()])
        elif operation == "pop_too_many":
            q.popleft_n(5)
        elif operation == "pop_negative":
            q.popleft_n(-1)
    assert q.free_block_ids() == before
    q.check_invariants()


def test_block_state_error_is_also_runtime_error_like_vllm():
    # vLLM's queue raises RuntimeError for remove() of an invalid block.
    q = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)


def test_kv_cache_block_matches_vllm_dataclass_semantics():
    a, b = KVCacheBlock(3, 1), KVCacheBlock(3, 1)
    va = vllm_utils.KVCacheBlock(3, 1)
    assert a == b and a is not b
    assert repr(a) == repr(va)
    with pytest.raises(TypeError):
        hash(a)
    a.set_block_hash(b"h", num_tokens=16)
    assert a.block_hash == b"h" and a.block_hash_num_tokens == 16
    with pytest.raises(AssertionError):
        a.set_block_hash(b"other")
    a.reset_hash()
    assert a.block_hash is None and a != KVCacheBlock(3, 2)
    c = KVCacheBlock(block_id=5, pool="p")
    assert c.pool == "p" and c.ref_cnt == 0 and c.is_null is False
    c.ref_cnt += 2
    assert c.ref_cnt == 2


def test_block_attributes_are_member_descriptors():
    # The kind of descriptor CPython's LOAD_ATTR specialises, as for a slots dataclass.
    import types

    for name in ("block_id", "ref_cnt", "is_null"):
        assert type(KVCacheBlock.__dict__[name]) is types.MemberDescriptorType


def test_new_queue_takes_blocks_over_like_the_rfc_reorder_body():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q1 = FreeKVCacheBlockQueue(blocks)
    q1.popleft_n(2)
    for b in blocks:  # the RFC's Option A body clears links first
        b.prev_free_block = None
        b.next_free_block = None
    q2 = FreeKVCacheBlockQueue(blocks)
    assert q2.free_block_ids() == [0, 1, 2, 3, 4]
    assert q1.num_free_blocks == 0
    q1.check_invariants()
    q2.check_invariants()


def test_rebuild_canonical_sorts_by_block_id_when_registration_order_differs():
    blocks = [KVCacheBlock(i) for i in (5, 3, 9, 1, 7)]
    q = FreeKVCacheBlockQueue(blocks)
    q.append(q.popleft())
    assert q.free_block_ids() == [3, 9, 1, 7, 5]
    q.rebuild_canonical()
    assert q.free_block_ids() == [1, 3, 5, 7, 9]
    q.check_invariants()


def test_lazily_created_blocks_of_a_pool_without_owner():
    from kvpool._core import make_pool_blocks

    blocks, q = make_pool_blocks(None, 6)
    assert q.popleft().block_id == 0 and blocks[3].block_id == 3 and blocks[3].pool is None
    popped = q.popleft_n(2)
    q.prepend_n(popped)
    assert q.free_block_ids() == [1, 2, 3, 4, 5]
