"""A waiting request's first ``allocate_slots`` on a model of one full-attention group
(vLLM's ``UnitaryKVCacheCoordinator``), natively (``src/kvpool/hybrid_admit.pxi``, armed
with the hybrid step on vLLM 0.34.0), against the installed vLLM's own method.

The differential is ``test_manager_hybrid_step``'s (two ``KVCacheManager``s, vLLM's
``allocate_slots`` and lookup on one, kvpool's on the other; after every operation the
returned blocks, tables, cached counts, prefix-cache map, free-queue order, new block ids
and KV events compared) over one full-attention group: its admissions carry the
scheduler's arguments (a prefix-cache hit, ``full_sequence_must_fit``,
``skip_zeroing_group_ids=()``, now and then lookahead, reserved blocks or delayed caching).
"""

from __future__ import annotations

import pytest

import kvpool
from kvpool import _core
from tests.integration.test_manager_hybrid_step import (
    BLOCK_SIZE,
    NUM_OPS,
    SEED,
    _manager,
    _run,
    _state,
    _summary,
    _vanilla_allocate_slots,
    needs_known_release,
)
from tests.support.scheduler import make_request

pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]


@needs_known_release
@pytest.mark.parametrize("num_blocks,events,allocation", [
    (48, False, "vllm"), (600, True, "vllm"), (48, False, "contiguous"), (600, False, "contiguous"),
], ids=["48-no-events", "600-kv-events", "48-contiguous", "600-contiguous"])
def test_a_dense_models_admissions_match_vllm(num_blocks, events, allocation):
    """Every admission of the differential is native (refusals among them on the small
    pool, prefix-cache hits adopted), and the two managers stay identical, under both
    policies and with KV events on (then vLLM's caching runs inside the native call)."""
    try:
        counts = _run(NUM_OPS // 8, num_blocks, 1, SEED + 31 + num_blocks, events, allocation=allocation)
    finally:
        kvpool.uninstall()
    print(f"\ndense admissions, {num_blocks} blocks, events {events}, {allocation}: {counts}")
    assert counts["native_admissions"] == counts["add"] and counts["hits"] > 0
    assert counts["refused"] > 0 or num_blocks > 48
    assert counts["contiguous_takes"] > 0 or allocation == "vllm"


def _admit(allocate_slots, manager, req):
    """``req``'s lookup and first ``allocate_slots`` as the scheduler makes them (its
    whole prompt in one chunk): ``(hit tokens, the result's summary)``."""
    blocks, hit = manager.get_computed_blocks(req)[:2]
    out = allocate_slots(manager, req, req.num_tokens - hit, num_new_computed_tokens=hit,
                         new_computed_blocks=blocks, full_sequence_must_fit=True,
                         skip_zeroing_group_ids=())
    return hit, _summary(manager, out)


def _admit_with_hit(allocate_slots, manager):
    """Request ``a`` (64 tokens, cached), then ``b`` sharing its first 48 tokens, admitted
    with its hit. Returns ``b``'s hit and summary."""
    from vllm.v1.request import RequestStatus

    a = make_request("a", list(range(64)), max_tokens=10, block_size=BLOCK_SIZE)
    assert _admit(allocate_slots, manager, a)[1] is not None
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 64
    b = make_request("b", list(range(48)) + [9_000 + i for i in range(30)], max_tokens=10,
                     block_size=BLOCK_SIZE)
    result = _admit(allocate_slots, manager, b)
    assert result[0] == 48 and result[1] is not None
    return result


@needs_known_release
@pytest.mark.parametrize("where", ["coordinator class", "coordinator instance", "manager class",
                                   "manager instance"])
def test_a_patched_admission_method_gives_vllms_admission(monkeypatch, where):
    """``allocate_new_computed_blocks`` (the coordinator's) or ``add_local_computed_blocks``
    (the full-attention manager's) patched after install, on the class or the instance:
    the admission is vLLM's, which calls it, with vLLM's outcome; unpatched, the same
    admission is native (the control)."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    kvpool.install()
    reference = _manager(200, 1, False, 3)
    expected = _admit_with_hit(_vanilla_allocate_slots(), reference)
    reference_state = _state(reference)   # (it takes the new block ids and events: once)
    native = _manager(200, 1, False, 3)
    before = _core.hybrid_running_step_state()["native_admissions"]
    assert _admit_with_hit(_core.kv_cache_manager_allocate_slots, native) == expected
    # (a's admission and b's, with its hit)
    assert _core.hybrid_running_step_state()["native_admissions"] - before == 2
    assert _state(native) == reference_state

    manager = _manager(200, 1, False, 3)
    assert type(manager.coordinator) is UnitaryKVCacheCoordinator
    seen = []
    owner, name = ((UnitaryKVCacheCoordinator, "allocate_new_computed_blocks") if "coordinator" in where
                   else (FullAttentionManager, "add_local_computed_blocks"))
    original = getattr(owner, name)

    def counting(self, *args, **kwargs):
        seen.append(name)
        return original(self, *args, **kwargs)

    if where.endswith("class"):
        monkeypatch.setattr(owner, name, counting)
    else:
        target = manager.coordinator if owner is UnitaryKVCacheCoordinator else \
            manager.coordinator.single_type_managers[0]
        setattr(target, name, counting.__get__(target))
    before = _core.hybrid_running_step_state()
    assert _admit_with_hit(_core.kv_cache_manager_allocate_slots, manager) == expected
    after = _core.hybrid_running_step_state()
    assert seen == [name], "vLLM's code did not run the patched method"
    assert after["native_admissions"] == before["native_admissions"]
    assert _state(manager) == reference_state


@needs_known_release
@pytest.mark.parametrize("num_groups", [1, 2], ids=["full-attention", "full-and-sliding-window"])
@pytest.mark.parametrize("change", ["drain the pool", "max_model_len", "nothing"])
def test_a_key_whose_eq_runs_code_gives_vllms_admission(num_groups, change):
    """A key in the full-attention group's ``num_cached_block`` whose hash is the admitted
    request's and whose ``__eq__`` runs code (found by an adversarial run): vLLM's
    ``allocate_slots`` looks the request up more often than the native admission would
    (its two ``get_num_blocks_to_allocate``) and reads the free count and
    ``max_model_len`` after some of those look-ups, so a key that takes the pool's free
    blocks made the native admission adopt the hit and then raise where vLLM's refuses,
    and one that lowers ``max_model_len`` made it allocate a block more. A dict with a key
    that is not an exact str gives vLLM's call: same outcome, same state, as many
    ``__eq__`` calls."""
    from vllm.v1.request import RequestStatus

    kvpool.install()
    outcomes = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(200, num_groups, False, 3)
        full = manager.coordinator.single_type_managers[0]
        a = make_request("a", list(range(64)), max_tokens=10, block_size=BLOCK_SIZE)
        assert _admit(allocate_slots, manager, a)[1] is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 64
        calls = []

        class Key:
            def __hash__(self):
                return hash("b")

            def __eq__(self, other):
                calls.append(other)
                if change == "drain the pool" and len(calls) == 1:
                    pool = manager.block_pool
                    calls.append(pool.get_new_blocks(pool.get_num_free_blocks() - 1))
                elif change == "max_model_len":
                    manager.max_model_len = 50
                return False

        full.num_cached_block[Key()] = 0
        b = make_request("b", list(range(48)) + [9_000 + i for i in range(30)], max_tokens=10,
                         block_size=BLOCK_SIZE)
        before = _core.hybrid_running_step_state()["native_admissions"]
        try:
            outcome = _admit(allocate_slots, manager, b)
        except Exception as exc:   # (the native admission raised ValueError before the fix)
            outcome = (type(exc).__name__, str(exc))
        assert _core.hybrid_running_step_state()["native_admissions"] == before
        refs = [manager.block_pool.blocks[i].ref_cnt for i in range(1, 5)]
        del full.num_cached_block[next(k for k in full.num_cached_block if type(k) is Key)]
        outcomes.append((outcome, len(calls), refs, _state(manager)))
    assert outcomes[0] == outcomes[1]


@needs_known_release
@pytest.mark.parametrize("hook", ["records", "raises"])
def test_a_policy_hook_patched_after_install_runs_where_vllms_call_runs_it(monkeypatch, hook):
    """The default policy's ``after_change`` patched on its class after install (code
    the pool's ``get_new_blocks`` runs after its loop): the native step, which calls the
    loop itself and no hook, hands the allocation to the pool's method, so the hook
    sees the table as vLLM's call shows it (before it grows) and, raising, leaves what
    vLLM's leaves (found by an adversarial run: the native step ran it after the table
    grew, and raising there left the new blocks in the table without their zeroing ids)."""
    from vllm.v1.request import RequestStatus

    from kvpool.allocation.vllm_order import VllmOrder

    kvpool.install()
    outcomes = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(200, 1, False, 3)
        full = manager.coordinator.single_type_managers[0]
        a = make_request("a", list(range(64)), max_tokens=10, block_size=BLOCK_SIZE)
        assert _admit(allocate_slots, manager, a)[1] is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 64
        a.append_output_token_ids(5)
        seen = []

        def after_change(self, pool):
            seen.append({rid: len(table) for rid, table in full.req_to_blocks.items()})
            if hook == "raises":
                raise RuntimeError("hook failed")

        with monkeypatch.context() as m:
            m.setattr(VllmOrder, "after_change", after_change, raising=False)
            try:   # (a running step that allocates 2 blocks)
                outcome = _summary(manager, allocate_slots(manager, a, 1, num_lookahead_tokens=20))
            except RuntimeError as exc:
                outcome = str(exc)
        outcomes.append((outcome, seen, _state(manager)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == [{"a": 4}]
