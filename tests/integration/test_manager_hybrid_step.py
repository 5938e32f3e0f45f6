"""The hybrid running step of the native ``KVCacheManager.allocate_slots``
(``kvpool.patches.hybrid_fast_path``, ``src/kvpool/hybrid_step.pxi``) against the
installed vLLM's own method, under ``HybridKVCacheCoordinator``.

The differential drives two ``KVCacheManager``s over the same KV cache groups (full
attention + sliding window; with a chunked-local group too, which the step hands to
vLLM's code) with the same random operations: one called through vLLM's
``allocate_slots``, one through the native function. After every operation: the
returned blocks (or None, and whether it is the manager's shared empty
``KVCacheBlocks``), every group's block tables (null blocks included) and cached-block
counts, the cached hashes, the free block count and free-queue order, the new block ids
and the KV events are compared.

    KVPOOL_MANAGER_DIFF_OPS=400000 python -m pytest tests/integration/test_manager_hybrid_step.py -s

runs 10^5 operations per differential case (a quarter of the setting; default 20,000).
"""

from __future__ import annotations

import os
import random
import types

import pytest

import kvpool
from kvpool import _core
from kvpool.patches import hybrid_fast_path
from kvpool.patches.manager_fast_path import _vanilla
from tests.integration.test_manager_fast_path import (
    _lookup_summary,
    _summary,
    _vanilla_allocate_slots,
    _vanilla_get_computed_blocks,
)
from tests.support.map_view import map_entries
from tests.support.scheduler import copied_once, kv_cache_groups, make_request

# Native code reading and changing vLLM's objects (hybrid_step.pxi, hybrid_alloc.pxi,
# hybrid_cache.pxi): also run under ASan/UBSan and the Py_DEBUG interpreter
# (scripts/test-sanitizers.sh: 1,500 operations per case; scripts/test-debug-python.sh: 500).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]

BLOCK_SIZE = 16
# (KVPOOL_HYBRID_DIFF_OPS: this file's own setting, for the debug interpreter's short run)
NUM_OPS = int(os.environ.get("KVPOOL_HYBRID_DIFF_OPS", os.environ.get("KVPOOL_MANAGER_DIFF_OPS", "20000")))
SEED = int(os.environ.get("KVPOOL_DIFF_SEED", "20261204"))
PREFIXES = [list(range(7_000 * g, 7_000 * g + n)) for g, n in enumerate((48, 100, 160))]


def _installed_release_is_known() -> bool:
    from kvpool.patches.manager_fast_path import matching_release

    release = matching_release()
    return release is not None and hybrid_fast_path.KNOWN_HYBRID_SOURCES.get(release) == \
        hybrid_fast_path.hybrid_fingerprint()


def _windows_groups(windows: tuple[tuple[int, int], ...]) -> list:
    """Full attention, then one sliding-window group per ``(sliding_window,
    extra_retained_tokens)`` (tokens), as Gemma 3 has one full group beside five
    sliding ones."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    common = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer.full"], FullAttentionSpec(**common))]
    for i, (window, extra) in enumerate(windows):
        groups.append(KVCacheGroupSpec([f"layer.swa{i}"], SlidingWindowSpec(
            **common, sliding_window=window, extra_retained_tokens=extra)))
    return groups


def _manager(num_blocks: int, num_groups: int, events: bool, window_blocks: int,
             windows: tuple[tuple[int, int], ...] = (), caching: bool = True):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig

    groups = _windows_groups(windows) if windows else kv_cache_groups(BLOCK_SIZE, num_groups, window_blocks)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(config, max_model_len=2048, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE, enable_caching=caching,
                             enable_kv_cache_events=events)
    for single in manager.coordinator.single_type_managers:
        single._record_new_block_ids = True
    return manager


def _decoding(allocate_slots):
    """A manager (full attention + a 3-block sliding window, 200 blocks) and a request
    decoding after a 70-token prompt, whose next 1-token step is idle in every group
    (the first decode step freed the block that left the window), both through
    ``allocate_slots``."""
    from vllm.v1.request import RequestStatus

    manager = _manager(200, 2, False, 3)
    req = make_request("a", list(range(70)), max_tokens=100, block_size=BLOCK_SIZE)
    assert allocate_slots(manager, req, 70) is not None
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 70
    req.append_output_token_ids(7)
    # (this step frees the block that left the sliding window: not idle)
    assert allocate_slots(manager, req, 1) is manager.empty_kv_cache_blocks
    req.num_computed_tokens += 1
    req.append_output_token_ids(8)
    return manager, req


def _state(manager) -> tuple:
    pool = manager.block_pool
    groups = []
    for single in manager.coordinator.single_type_managers:
        groups.append(({rid: [b.block_id for b in blocks] for rid, blocks in single.req_to_blocks.items()},
                       dict(single.num_cached_block)))
    cached = {key: sorted(ids) for key, ids in map_entries(pool.cached_block_hash_to_block).items()}
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    return (groups, cached, pool.get_num_free_blocks(), queue, manager.take_new_block_ids(),
            [repr(e) for e in manager.take_events()])


def _run(num_ops: int, num_blocks: int, num_groups: int, seed: int, events: bool = False,
         window_blocks: int = 3, windows: tuple[tuple[int, int], ...] = (), setup=None,
         caching: bool = True, allocation: str = "vllm") -> dict:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    kvpool.install(allocation=allocation)
    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    vanilla_fn = _vanilla_allocate_slots()
    sides = [(_manager(num_blocks, num_groups, events, window_blocks, windows, caching), vanilla_fn, {}),
             (_manager(num_blocks, num_groups, events, window_blocks, windows, caching),
              KVCacheManager.allocate_slots, {})]
    # vLLM's side is vLLM's Python throughout: its coordinator's cache_blocks (which kvpool
    # binds on the hybrid class) is vLLM's function, set on the instance.
    vanilla = sides[0][0].coordinator
    vanilla.cache_blocks = types.MethodType(KVCacheCoordinator.cache_blocks, vanilla)
    for manager, _, _ in sides if setup is not None else ():
        setup(manager)
    lookups = (_vanilla_get_computed_blocks(), KVCacheManager.get_computed_blocks)
    probes = (_vanilla(KVCacheManager, "get_num_cached_tokens"), KVCacheManager.get_num_cached_tokens)
    assert probes[1] is _core.kv_cache_manager_get_num_cached_tokens
    probes_before = _core.allocate_slots_fast_path_state()["native_probes"]
    before = _core.hybrid_running_step_state()
    live: list[str] = []
    next_id = 0
    counts = {"add": 0, "step": 0, "none": 0, "free": 0, "hits": 0, "refused": 0}
    for op in range(num_ops):
        roll = rng.random()
        if len(live) < 3 or (roll < 0.05 and len(live) < 10):
            rid, next_id = f"r{next_id}", next_id + 1
            prompt = list(rng.choice(PREFIXES)) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 150))]
            chunk = rng.choice((16, 64, 512))
            # (the scheduler's admission: full_sequence_must_fit (scheduler_reserve_full_isl,
            # on by default), skip_zeroing_group_ids=(); now and then other arguments)
            admit = {"full_sequence_must_fit": rng.random() < 0.7, "skip_zeroing_group_ids": ()}
            if rng.random() < 0.2:
                admit["has_scheduled_reqs"] = rng.random() < 0.5
            if rng.random() < 0.15:
                admit["num_lookahead_tokens"] = rng.choice((1, 3, 40))
            if rng.random() < 0.15:
                admit["reserved_blocks"] = rng.choice((1, 8, num_blocks // 2, num_blocks))
            if rng.random() < 0.05:
                admit["delay_cache_blocks"] = True
            results, lookup_results = [], []
            for manager, allocate_slots, requests in sides:
                req = make_request(rid, prompt, max_tokens=10_000, block_size=BLOCK_SIZE)
                # (vLLM's side: vLLM's get_computed_blocks; kvpool's: hybrid_lookup.pxi)
                native_side = manager is sides[1][0]
                probed = probes[native_side](manager, req)   # (the scheduler's cache-aware probe)
                found = lookups[native_side](manager, req)
                lookup_results.append((probed, _lookup_summary(manager, found)))
                blocks, hit = found[:2]
                n = min(chunk, len(prompt) - hit)
                out = allocate_slots(manager, req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                     **admit)
                results.append((hit, _summary(manager, out)))
                if out is not None:
                    req.status = RequestStatus.RUNNING
                    req.num_computed_tokens = hit + n
                    requests[rid] = req
            assert lookup_results[0] == lookup_results[1], (op, "lookup", lookup_results)
            assert results[0] == results[1], (op, "add", results)
            counts["hits"] += lookup_results[0][1][1] > 0
            if results[0][1] is not None:
                live.append(rid)
            counts["add"] += 1
            counts["refused"] += results[0][1] is None
        elif roll < 0.09 or sides[0][2][live[0]].num_tokens > 1500:
            rid = live.pop(rng.randrange(len(live)) if roll < 0.09 else 0)
            freed = [_outcome(lambda: manager.free(requests.pop(rid))) for manager, _, requests in sides]
            assert freed[0] == freed[1], (op, "free", freed)
            counts["free"] += 1
        else:
            rid = rng.choice(live)
            req0 = sides[0][2][rid]
            prefill_left = req0.num_prompt_tokens - req0.num_computed_tokens
            n = min(rng.choice((1, 16, 64, 300)), prefill_left) if prefill_left > 0 else 1
            kwargs = {}
            if rng.random() < 0.15:
                kwargs["num_lookahead_tokens"] = rng.choice((1, 3, 40))
            if rng.random() < 0.15:
                kwargs["reserved_blocks"] = rng.choice((1, 8, num_blocks // 2, num_blocks))
            if rng.random() < 0.1:
                kwargs["has_scheduled_reqs"] = rng.random() < 0.5
            if rng.random() < 0.05:
                kwargs["delay_cache_blocks"] = True
            status = rng.choice((RequestStatus.RUNNING,) * 8 + (RequestStatus.PREEMPTED,))
            in_flight = rng.choice((0,) * 6 + (1, 5))
            token = rng.randrange(1, 30_000)
            results = []
            for manager, allocate_slots, requests in sides:
                req = requests[rid]
                req.status = status
                req.num_in_flight_tokens = in_flight
                out = _outcome(lambda: allocate_slots(manager, req, n, **kwargs))
                if out[0] == "raised":
                    results.append(out)
                    out = None
                    continue
                out = out[1]
                results.append(_summary(manager, out))
                req.num_in_flight_tokens = 0
                if out is not None:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens >= req.num_tokens:
                        req.append_output_token_ids(token)
                    req.status = RequestStatus.RUNNING
            assert results[0] == results[1], (op, "step", rid, n, kwargs, status, results)
            counts["step"] += 1
            counts["none"] += results[0] is None
        assert _state(sides[0][0]) == _state(sides[1][0]), (op, counts)
    after = _core.hybrid_running_step_state()
    counts["native_steps"] = after["native_steps"] - before["native_steps"]
    counts["vllm_steps"] = after["vllm_steps"] - before["vllm_steps"]
    counts["native_lookups"] = after["native_lookups"] - before["native_lookups"]
    counts["native_admissions"] = after["native_admissions"] - before["native_admissions"]
    counts["contiguous_takes"] = after["contiguous_takes"] - before["contiguous_takes"]
    counts["native_probes"] = _core.allocate_slots_fast_path_state()["native_probes"] - probes_before
    counts["native_changes"] = after["native_changes"] - before["native_changes"]
    counts["group_cache_calls"] = after["group_cache_calls"] - before["group_cache_calls"]
    return counts


needs_known_release = pytest.mark.skipif(
    not _installed_release_is_known(),
    reason="the installed vLLM's hybrid coordinator is not one the hybrid step was checked against "
           "(test_the_hybrid_step_is_bound_only_on_a_known_release covers it)")


@needs_known_release
@pytest.mark.parametrize("events", [False, True], ids=["no-events", "kv-events"])
@pytest.mark.parametrize("num_blocks", [48, 600])
def test_hybrid_running_step_matches_vllm(num_blocks, events):
    """Full attention + a 3-block sliding window: small pool (constant eviction,
    refusals), larger pool (long tables, prefix hits, the window's null blocks); KV
    events on and off. Most steps are idle and answered natively, the steps that free
    or allocate blocks too (src/kvpool/hybrid_alloc.pxi), and the two managers stay
    identical. Every lookup of a new request is native without events
    (src/kvpool/hybrid_lookup.pxi) and gives vLLM's blocks, hit and boundary."""
    counts = _run(NUM_OPS // 4, num_blocks, 2, SEED + num_blocks, events)
    print(f"\nhybrid differential: {num_blocks} blocks, events {events}: {counts}")
    assert counts["native_steps"] > counts["step"] // 3
    assert counts["native_changes"] > counts["step"] // 10 and counts["free"] > 0
    assert counts["group_cache_calls"] > 0
    assert counts["none"] > 0 or num_blocks > 48
    assert counts["native_lookups"] == (0 if events else counts["add"]) and counts["hits"] > 0
    assert counts["native_probes"] == counts["add"]
    # (every admission is native: src/kvpool/hybrid_admit.pxi; refusals among them)
    assert counts["native_admissions"] == counts["add"]
    assert counts["refused"] > 0 or num_blocks > 48


@needs_known_release
@pytest.mark.parametrize("events", [False, True], ids=["no-events", "kv-events"])
def test_several_sliding_windows_match_vllm(events):
    """Gemma 3's shape: full attention beside sliding windows that end mid-block (40 and
    100 tokens of 16-token blocks) and one that keeps 5 extra trailing tokens; the
    steps that free a window's blocks in several groups at once and allocate in every
    group are native, and the managers stay identical. The lookups (four attention
    groups: vLLM's fixed point over several rounds) are native without events."""
    counts = _run(NUM_OPS // 4, 300, 0, SEED + 7, events, windows=((40, 0), (100, 5), (33, 0)))
    print(f"\nseveral windows, events {events}: {counts}")
    assert counts["native_steps"] > counts["step"] // 4
    assert counts["native_admissions"] == counts["add"] and counts["refused"] > 0
    assert counts["native_changes"] > counts["step"] // 10 and counts["none"] > 0
    assert counts["group_cache_calls"] > 0
    assert counts["native_lookups"] == (0 if events else counts["add"]) and counts["hits"] > 0
    assert counts["native_probes"] == counts["add"]


@needs_known_release
@pytest.mark.parametrize("num_blocks", [48, 300])
def test_prefix_caching_off_matches_vllm(num_blocks):
    """Prefix caching off (gpt-oss or Gemma 3 served without it): vLLM's
    ``KVCacheCoordinatorNoPrefixCache`` over full attention and sliding windows, whose
    requests have no ``num_cached_block`` entry. Idle steps and the steps that free a
    window's blocks and allocate are native, refusals included, and the two managers
    stay identical."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinatorNoPrefixCache

    kvpool.install()
    assert type(_manager(64, 0, False, 3, ((40, 0),), caching=False).coordinator) is KVCacheCoordinatorNoPrefixCache
    counts = _run(NUM_OPS // 4, num_blocks, 0, SEED + 17 + num_blocks, windows=((40, 0), (100, 5)),
                  caching=False)
    print(f"\nprefix caching off, {num_blocks} blocks: {counts}")
    assert counts["native_steps"] > counts["step"] // 4
    assert counts["native_changes"] > counts["step"] // 10 and counts["free"] > 0
    assert counts["none"] > 0 or num_blocks > 48


@needs_known_release
@pytest.mark.parametrize("num_blocks", [48, 300])
def test_the_contiguous_policy_runs_natively_with_its_python_tables(num_blocks):
    """Under ``allocation="contiguous"`` the native path's allocations run the policy
    natively (src/kvpool/contiguous_take.pxi: the table's last block, its extent owner
    and expected growth, the planned take, the LRU front absorbed). vLLM's side runs
    vLLM's ``allocate_slots`` on a pool that finds each table in the frames and runs
    ``ContiguousPolicy.extend_table`` in Python: after every operation the block ids of
    every table, the free queue's order and the prefix cache are the same."""
    try:
        counts = _run(NUM_OPS // 8, num_blocks, 0, SEED + 23 + num_blocks, windows=((40, 0), (100, 5)),
                      allocation="contiguous")
    finally:
        kvpool.uninstall()
    print(f"\ncontiguous, {num_blocks} blocks: {counts}")
    assert counts["native_admissions"] == counts["add"] and counts["native_changes"] > 0
    assert counts["contiguous_takes"] > counts["add"] and counts["hits"] > 0


@needs_known_release
@pytest.mark.parametrize("allocation", ["vllm", "contiguous"])
@pytest.mark.parametrize("num_blocks", [8, 10])
def test_a_key_whose_eq_changes_what_vllm_reads_next_gives_vllms_admission(num_blocks, allocation):
    """A key in a dict the admission looks the request up in, whose hash is the
    request's and whose ``__eq__`` changes what vLLM's code reads after that look-up
    (found by an adversarial run): in the sliding-window group's ``num_cached_block``,
    one that sets the group's ``max_admission_blocks_per_request`` to 0 (vLLM reads the cap
    before the look-up: refused at 8-10 blocks); in the contiguous policy's
    ``table_owners``, one that moves ``_next_owner`` (read after the look-up). The
    native admission reads both in vLLM's (and ``extend_table``'s) order: same outcome,
    same owners, same number of ``__eq__`` calls."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kvpool.install(allocation=allocation)
    try:
        outcomes = []
        for allocate_slots in (_vanilla_allocate_slots(), KVCacheManager.allocate_slots):
            manager = _manager(num_blocks, 2, False, 3)
            swa = manager.coordinator.single_type_managers[1]
            policy = manager.block_pool._policy
            calls = []

            class Key:
                def __hash__(self):
                    return hash("a")

                def __eq__(self, other):
                    calls.append(1)
                    swa.max_admission_blocks_per_request = 0
                    if allocation == "contiguous":
                        policy._next_owner = 77
                    return False

            swa.num_cached_block[Key()] = 0
            if allocation == "contiguous":
                full = manager.coordinator.single_type_managers[0]
                policy.table_owners[type("K", (Key,), {"__hash__": lambda self: hash((id(full), "a"))})()] = 1
            req = make_request("a", list(range(1, 101)), max_tokens=100, block_size=BLOCK_SIZE)
            out = allocate_slots(manager, req, 16, num_new_computed_tokens=0, new_computed_blocks=None,
                                 full_sequence_must_fit=True, skip_zeroing_group_ids=())
            owners = sorted(v for k, v in getattr(policy, "table_owners", {}).items() if type(k) is tuple)
            outcomes.append((_summary(manager, out), len(calls), owners, getattr(policy, "_next_owner", None),
                             [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]))
    finally:
        kvpool.uninstall()
    assert outcomes[0] == outcomes[1]


def _hostile_frees(manager) -> None:
    """The pool's ``free_blocks``, set on the instance (vLLM's and the native step call
    it through the pool): every call gives the request's other sliding-window tables
    new list objects (same blocks) and drops a pending ``new_block_ids`` entry; every
    seventh call raises after freeing."""
    pool, calls = manager.block_pool, [0]
    free_blocks = pool.free_blocks
    swa = manager.coordinator.single_type_managers[1:]

    def hostile(blocks, *args, **kwargs):
        calls[0] += 1
        free_blocks(blocks, *args, **kwargs)
        for single in swa:
            for rid in list(single.req_to_blocks):
                single.req_to_blocks[rid] = list(single.req_to_blocks[rid])
        if calls[0] % 7 == 0:
            raise RuntimeError("a free's callback failed")

    pool.free_blocks = hostile


@needs_known_release
def test_code_run_by_a_free_gives_vllms_outcome():
    """A ``free_blocks`` set on the pool instance (code that changes the tables the step
    reads next, or raises) could change what vLLM's code reads between the step's
    phases: such a pool's changing steps are vLLM's from the start, the idle ones stay
    native, and every outcome and the managers' states are vLLM's."""
    counts = _run(min(4_000, NUM_OPS // 5), 300, 0, SEED + 11, windows=((40, 0), (100, 5)), setup=_hostile_frees)
    assert counts["vllm_steps"] > 0 and counts["native_changes"] == 0 < counts["native_steps"]


def _watched(manager) -> None:
    """A reuse watcher on the pool (vLLM's ``unpin_blocks`` callback list), which kvpool's
    allocation calls for every block: vLLM's loop, whose callbacks may run any code."""
    manager.block_pool._reuse_watchers[-1] = lambda *args: None


@needs_known_release
@pytest.mark.parametrize("foreign", [False, True], ids=["own-blocks", "a-block-of-another-pool"])
def test_a_window_holding_a_block_of_another_pool_gives_vllms_step(foreign):
    """The step that frees the block that left the sliding window, with that block one of
    another pool (a plugin's or a test's table): the pool's free would forward it there,
    after freeing its own, so the native step, which puts the blocks back into the table
    when the free raises, hands it to vLLM's code (the control, the table's own block:
    native); both give vLLM's outcome and states."""
    from vllm.v1.request import RequestStatus

    from kvpool.block_pool import BlockPool

    kvpool.install()
    results = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(200, 2, False, 3)
        req = make_request("a", list(range(70)), max_tokens=100, block_size=BLOCK_SIZE)
        assert allocate_slots(manager, req, 70) is not None
        req.status, req.num_computed_tokens = RequestStatus.RUNNING, 70
        req.append_output_token_ids(7)
        other = BlockPool(8, True, BLOCK_SIZE)
        if foreign:
            table = manager.coordinator.single_type_managers[1].req_to_blocks["a"]
            own, table[0] = table[0], other.get_new_blocks(1)[0]
            manager.block_pool.free_blocks([own])
        before = _core.hybrid_running_step_state()
        outcome = _outcome(lambda: _summary(manager, allocate_slots(manager, req, 1)))
        after = _core.hybrid_running_step_state()
        if allocate_slots is _core.kv_cache_manager_allocate_slots:
            native = after["native_changes"] - before["native_changes"]
            assert native == (0 if foreign else 1)
            assert after["vllm_steps"] - before["vllm_steps"] == (1 if foreign else 0)
        results.append((outcome, _state(manager), other.get_num_free_blocks()))
    assert results[0] == results[1]
    assert results[0][2] == 7   # (the other pool's block was freed into it)


@needs_known_release
def test_a_pool_whose_calls_run_callbacks_keeps_vllms_changing_steps():
    counts = _run(min(2_000, NUM_OPS // 10), 300, 0, SEED + 13, windows=((40, 0),), setup=_watched)
    assert counts["vllm_steps"] > 0 and counts["native_changes"] == 0


@needs_known_release
def test_a_group_of_another_type_keeps_vllms_step():
    """A chunked-local group beside them: no step is answered natively (its manager's
    step is vLLM's), and the managers stay identical."""
    counts = _run(min(2_000, NUM_OPS // 10), 600, 3, SEED)
    assert counts["native_steps"] == 0 < counts["vllm_steps"]


def test_the_hybrid_step_is_bound_only_on_a_known_release():
    """install() arms the hybrid step exactly when the installed vLLM's hybrid sources
    are the bound release's (KNOWN_HYBRID_SOURCES); after uninstall() vLLM's
    allocate_slots runs every step again."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kvpool.install()
    try:
        assert _core.hybrid_running_step_state()["enabled"] == _installed_release_is_known()
    finally:
        kvpool.uninstall()
    assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots


@needs_known_release
@pytest.mark.parametrize("where", ["class", "instance", "coordinator instance", "base class"])
def test_a_patched_method_sends_hybrid_steps_to_vllm(monkeypatch, where):
    """A skipped method patched after install (on a manager's class, a manager
    instance, the coordinator instance, the managers' base class, whose cache_blocks
    FullAttentionManager's calls through super()) is called as vLLM calls it: the step
    is vLLM's."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, SlidingWindowManager

    kvpool.install()
    manager = _manager(200, 2, False, 3)
    req = make_request("a", list(range(40)), max_tokens=100, block_size=BLOCK_SIZE)
    from vllm.v1.request import RequestStatus

    assert manager.allocate_slots(req, 40) is not None
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 40
    req.append_output_token_ids(7)
    swa = manager.coordinator.single_type_managers[1]
    seen = []
    original = SlidingWindowManager.get_num_skipped_tokens

    def counting(self, *args, **kwargs):
        seen.append(args)
        return original(self, *args, **kwargs)

    if where == "class":
        monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", counting)
    elif where == "base class":
        vanilla_cache = SingleTypeKVCacheManager.cache_blocks

        def counting_cache(self, *args, **kwargs):
            seen.append(args)
            return vanilla_cache(self, *args, **kwargs)

        monkeypatch.setattr(SingleTypeKVCacheManager, "cache_blocks", counting_cache)
    elif where == "instance":
        swa.get_num_skipped_tokens = counting.__get__(swa)
    else:
        coordinator = manager.coordinator
        vanilla_remove = type(coordinator).remove_skipped_blocks
        coordinator.remove_skipped_blocks = lambda *a, **k: (seen.append(a), vanilla_remove(coordinator, *a, **k))[1]
    state = _core.hybrid_running_step_state()
    assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
    assert seen, "vLLM's code did not run the patched method"
    # (vLLM's: from the hybrid step's own checks, or before it from the manager path's,
    # which also guard the managers' base class)
    assert _core.hybrid_running_step_state()["native_steps"] == state["native_steps"]


@needs_known_release
@pytest.mark.parametrize("where", ["coordinator class", "coordinator instance", "full-attention class",
                                   "pool instance", "sliding-window class"])
def test_a_patched_lookup_method_is_called_as_vllm_calls_it(monkeypatch, where):
    """What the native hybrid lookup skips (the coordinator's ``find_longest_cache_hit``
    on its class or instance, ``FullAttentionManager.find_longest_cache_hit``, the
    pool's ``get_cached_block``), patched after install, is called for both
    ``get_computed_blocks`` and the scheduler's probe ``get_num_cached_tokens``, with
    vLLM's results. So is what it calls as vLLM does
    (``SlidingWindowManager.find_longest_cache_hit``): a change to a checked class sends
    the lookup to vLLM's code too."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

    kvpool.install()
    manager = _manager(200, 2, False, 3)
    prompt = list(range(90))
    first = make_request("a", prompt, max_tokens=100, block_size=BLOCK_SIZE)
    assert manager.allocate_slots(first, 90) is not None   # caches 5 full blocks
    req = make_request("b", prompt, max_tokens=100, block_size=BLOCK_SIZE)
    vanilla = (_vanilla(KVCacheManager, "get_computed_blocks")(manager, req),
               _vanilla(KVCacheManager, "get_num_cached_tokens")(manager, req))
    assert vanilla[0][1] == vanilla[1] == 80
    seen = []
    owner, name = {"coordinator class": (HybridKVCacheCoordinator, "find_longest_cache_hit"),
                   "coordinator instance": (manager.coordinator, "find_longest_cache_hit"),
                   "full-attention class": (FullAttentionManager, "find_longest_cache_hit"),
                   "pool instance": (manager.block_pool, "get_cached_block"),
                   "sliding-window class": (SlidingWindowManager, "find_longest_cache_hit")}[where]
    on_class = isinstance(owner, type)
    original = getattr(owner, name)
    func = getattr(original, "__func__", original) if on_class else original

    def counting(*args, **kwargs):
        seen.append(args)
        return func(*args, **kwargs)

    if on_class:
        monkeypatch.setattr(owner, name, classmethod(counting)
                            if isinstance(owner.__dict__.get(name), classmethod) else counting)
    else:
        setattr(owner, name, counting)   # (on the instance; removed below)
    state = _core.hybrid_running_step_state()
    probes = _core.allocate_slots_fast_path_state()["native_probes"]
    blocks, hit, boundary = manager.get_computed_blocks(req)
    assert (_lookup_summary(manager, (blocks, hit, boundary)) == _lookup_summary(manager, vanilla[0]))
    assert manager.get_num_cached_tokens(req) == vanilla[1]
    assert seen, "the patched method was not called"
    assert _core.hybrid_running_step_state()["native_lookups"] == state["native_lookups"]
    assert _core.allocate_slots_fast_path_state()["native_probes"] == probes
    # (and native again once the patch is gone)
    monkeypatch.undo()
    if not on_class:
        del vars(owner)[name]
    assert _lookup_summary(manager, manager.get_computed_blocks(req)) == _lookup_summary(manager, vanilla[0])
    assert manager.get_num_cached_tokens(req) == vanilla[1]
    assert _core.hybrid_running_step_state()["native_lookups"] == state["native_lookups"] + 1
    assert _core.allocate_slots_fast_path_state()["native_probes"] == probes + 1


@needs_known_release
@pytest.mark.parametrize("where,name", [("SlidingWindowManager", "req_to_blocks"),
                                        ("SingleTypeKVCacheManager", "req_to_blocks"),
                                        ("FullAttentionManager", "num_cached_block")])
def test_a_property_added_over_an_instance_attribute_sends_hybrid_steps_to_vllm(monkeypatch, where, name):
    """A property added after install over an attribute the hybrid step reads from the
    instances (a manager's ``req_to_blocks`` on its class or the managers' base, the
    full-attention manager's ``num_cached_block``), which vLLM's code reads through it:
    the step is vLLM's, and native again once the property is gone."""
    from vllm.v1.core import single_type_kv_cache_manager

    kvpool.install()
    manager, req = _decoding(_core.kv_cache_manager_allocate_slots)
    state = _core.hybrid_running_step_state()
    assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
    assert _core.hybrid_running_step_state()["native_steps"] == state["native_steps"] + 1
    cls = getattr(single_type_kv_cache_manager, where)
    reads = []

    def read(self):
        reads.append(1)
        return self.__dict__[name]

    state = _core.hybrid_running_step_state()
    with monkeypatch.context() as m:
        m.setattr(cls, name, property(read), raising=False)
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert reads, "vLLM's code did not read through the property"
        assert _core.hybrid_running_step_state()["native_steps"] == state["native_steps"]
    assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
    assert _core.hybrid_running_step_state()["native_steps"] == state["native_steps"] + 1


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the exception's type is what is compared
        return ("raised", type(e).__name__)


@needs_known_release
@pytest.mark.parametrize("target,attr,value", [
    (None, None, None),   # the control: this step is idle, and native
    ("request", "num_computed_tokens", True),
    ("request", "num_computed_tokens", 2**70),
    ("request", "num_in_flight_tokens", 2.0),
    ("request", "num_in_flight_tokens", -3),
    ("request", "block_hashes", ()),
    ("swa", "sliding_window", 48.0),
    ("swa", "extra_retained_tokens", None),
    ("swa", "enable_caching", 1),
    ("swa", "req_to_blocks", {}),
    ("coordinator", "drop_eagle_group_ids", {1}),
    ("coordinator", "enable_partial_hash_hits", 0),
], ids=lambda v: repr(v)[:20])
def test_odd_values_get_vllms_step(target, attr, value):
    """A value of another type or range where vLLM's code reads a number, a set, a dict
    (a test's or a plugin's assignment): the step is vLLM's, which returns or raises
    what it does on vLLM's own managers (the control, with every value vLLM's own: the
    same step is native)."""
    kvpool.install()
    outcomes = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager, req = _decoding(allocate_slots)
        if target is not None:
            owner = {"request": req, "swa": manager.coordinator.single_type_managers[1],
                     "coordinator": manager.coordinator}[target]
            setattr(owner, attr, value)
        before = _core.hybrid_running_step_state()["native_steps"]
        outcome = _outcome(lambda: _summary(manager, allocate_slots(manager, req, 1)))
        native = target is None and allocate_slots is _core.kv_cache_manager_allocate_slots
        assert _core.hybrid_running_step_state()["native_steps"] == before + native
        outcomes.append((outcome, _state(manager)))
    assert outcomes[0] == outcomes[1]


class _NeRaises:
    def __ne__(self, other):
        raise RuntimeError("compared")

    __eq__ = __ne__
    __hash__ = object.__hash__


def _counting_property(calls: list, original: property, result=None) -> property:
    def getter(self):
        calls.append(type(self).__name__)
        return original.fget(self) if result is None else result

    return property(getter)


@needs_known_release
@pytest.mark.parametrize("case", ["retention interval", "builtin shadowed", "spec property", "num_tokens property",
                                  "free count of another type", "missing attribute, refused", "delayed caching"])
def test_what_vllm_reads_is_read_as_vllm_reads_it(monkeypatch, case):
    """What vLLM's step reads and the idle test does not (or reads fewer times), made
    observable: a ``retention_interval`` whose comparison raises, a module name
    shadowing a builtin vLLM calls, a patched spec or request property that counts its
    calls, a ``get_num_free_blocks`` patched on the pool to return a float (vLLM calls
    it once), an attribute deleted that vLLM reads only after refusing the step, and
    ``request.block_hashes`` deleted where vLLM delays the caching (never reading it).
    vLLM's and the native call return or raise the same and see the same calls."""
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.request import Request

    kvpool.install()
    outcomes = []
    kwargs = {"reserved_blocks": 10_000} if case == "missing attribute, refused" else \
        {"delay_cache_blocks": True} if case == "delayed caching" else {}
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager, req = _decoding(allocate_slots)
        calls: list = []
        with monkeypatch.context() as m:
            if case == "retention interval":
                manager.coordinator.retention_interval = _NeRaises()
            elif case == "builtin shadowed":
                m.setattr(kv_cache_manager, "max", lambda *a: calls.append(a) or max(*a), raising=False)
            elif case == "spec property":
                m.setattr(SlidingWindowSpec, "prefix_cacheable",
                          _counting_property(calls, SlidingWindowSpec.prefix_cacheable))
            elif case == "num_tokens property":
                m.setattr(Request, "num_tokens", _counting_property(calls, Request.num_tokens))
            elif case == "free count of another type":
                pool = manager.block_pool
                pool.get_num_free_blocks = lambda: calls.append(1) or float(type(pool).get_num_free_blocks(pool))
            elif case == "missing attribute, refused":
                del manager.coordinator.single_type_managers[1]._partial_hit_reqs
            else:
                del req.block_hashes
            before = _core.hybrid_running_step_state()["native_steps"]
            outcome = _outcome(lambda: _summary(manager, allocate_slots(manager, req, 1, **kwargs)))
            assert _core.hybrid_running_step_state()["native_steps"] == before or case == "delayed caching"
        outcomes.append((outcome, calls))
    assert outcomes[0] == outcomes[1]


@needs_known_release
@pytest.mark.parametrize("copied", ["manager", "coordinator", "single-type manager", "pool"])
def test_copying_an_object_keeps_the_hybrid_step_native(copied):
    """``copy.copy`` of the KV cache manager, its coordinator, a group's manager or the
    pool (a test's snapshot, a plugin's): ``copyreg`` stores ``__slotnames__`` on the
    object's class the first time, a class attribute nothing the step reads. The next
    hybrid step stays native (a change of the classes' other attributes sends it to
    vLLM: test_a_property_added_over_an_instance_attribute_sends_hybrid_steps_to_vllm)."""
    kvpool.install()
    manager, req = _decoding(_core.kv_cache_manager_allocate_slots)
    obj = {"manager": manager, "coordinator": manager.coordinator,
           "single-type manager": manager.coordinator.single_type_managers[0],
           "pool": manager.block_pool}[copied]
    with copied_once(obj):
        state = _core.hybrid_running_step_state()
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert _core.hybrid_running_step_state()["native_steps"] == state["native_steps"] + 1
