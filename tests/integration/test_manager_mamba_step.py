"""The Mamba groups' part of the native hybrid step (``src/kvpool/mamba_step.pxi``,
``kvpool.patches.hybrid_fast_path.MAMBA_MIRRORED``) against the installed vLLM's own
``KVCacheManager.allocate_slots``, under ``HybridKVCacheCoordinator`` with a
full-attention group beside Mamba groups in ``mamba_cache_mode="align"`` (the Qwen3-Next /
Qwen3.5 shape; the replay's ``--model`` runs vLLM's own resolution of those models).

The differential drives two managers over the same groups with the same random
operations, as tests/integration/test_manager_hybrid_step.py does: new requests through
vLLM's path (prefix hits, block-aligned prefill chunks as vLLM's scheduler splits them in
align mode), running steps with 1-4 new tokens, lookahead tokens, in-flight tokens,
watermarks, reserved blocks and delayed caching, frees, failed allocations, an engine
step's start (``new_step_starts``) every 8 operations. After each
operation it compares the returned blocks, every group's tables and cached counts, each
Mamba manager's per-request bookkeeping (``last_state_block_idx``,
``_num_retired_blocks``, ``_allocated_block_reqs``, ``_checkpoints``, pending
copy-on-write and boundary-state offloads, ``cached_blocks_this_step``), the prefix-cache
map, the free count and free-queue order, the new block ids and the KV events.
Cases: sparse retention (``prefix_cache_retention_interval`` 0, as vLLM sets it for
Qwen3-Next), dense retention (None), a positive interval, the shared-prefix checkpoint on.

    KVPOOL_MANAGER_DIFF_OPS=400000 python -m pytest tests/integration/test_manager_mamba_step.py -s

runs 10^5 operations per case (a quarter of the setting; default 20,000).
"""

from __future__ import annotations

import math
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
from tests.integration.test_manager_hybrid_step import _installed_release_is_known, _NeRaises, _outcome, _state
from tests.support.scheduler import make_request

# Native code reading vLLM's objects: also run under ASan/UBSan and the Py_DEBUG interpreter
# (scripts/test-sanitizers.sh, scripts/test-debug-python.sh: 1,500 operations per case).
pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]

BLOCK_SIZE = 16
NUM_OPS = int(os.environ.get("KVPOOL_MANAGER_DIFF_OPS", "20000"))
SEED = int(os.environ.get("KVPOOL_DIFF_SEED", "20261204"))
PREFIXES = [list(range(9_000 * g, 9_000 * g + n)) for g, n in enumerate((48, 112, 160))]


def _mamba_is_known() -> bool:
    from kvpool.patches.manager_fast_path import matching_release

    release = matching_release()
    return (_installed_release_is_known()
            and hybrid_fast_path.KNOWN_MAMBA_SOURCES.get(release) == hybrid_fast_path.mamba_fingerprint())


needs_known_mamba = pytest.mark.skipif(
    not _mamba_is_known(),
    reason="the installed vLLM's MambaManager is not one the hybrid step was checked against "
           "(test_the_mamba_step_is_armed_only_on_a_known_release covers it)")


def _manager(num_blocks: int, events: bool, retention: int | None, shared_checkpoint: bool,
             num_mamba: int = 2, sliding: bool = False, caching: bool = True,
             mamba_block: int = BLOCK_SIZE, speculative: int = 0, full: bool = True):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    common = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer.full"], FullAttentionSpec(**common))] if full else []
    if sliding:
        groups.append(KVCacheGroupSpec(["layer.swa"], SlidingWindowSpec(**common, sliding_window=3 * BLOCK_SIZE)))
    for i in range(num_mamba):
        # (prefix caching off: vLLM's mamba_cache_mode "none", whose block is max_model_len
        # tokens in vLLM's resolution; smaller here, so that its steps free and allocate)
        spec = MambaSpec(block_size=mamba_block, shapes=((1,),), dtypes=(torch.float32,),
                         mamba_cache_mode="align" if caching else "none", num_speculative_blocks=speculative)
        groups.append(KVCacheGroupSpec([f"layer.mamba{i}"], spec))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                           prefix_cache_retention_interval=retention)
    manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=math.lcm(BLOCK_SIZE, mamba_block),
                             hash_block_size=BLOCK_SIZE, enable_caching=caching, enable_kv_cache_events=events,
                             enable_mamba_shared_prefix_checkpoint=shared_checkpoint)
    for single in manager.coordinator.single_type_managers:
        single._record_new_block_ids = True
        if shared_checkpoint and type(single).__name__ == "MambaManager":
            # vLLM sets it only for an EAGLE group with partial hash hits, whose steps are
            # vLLM's anyway; forced here so that the native test of its branch is exercised
            single.shared_prefix_checkpoint = True
    return manager


def _ids(value):
    """Block objects as their ids, inside the containers the Mamba bookkeeping uses."""
    if isinstance(value, (list, tuple)):
        return type(value)(_ids(v) for v in value)
    return getattr(value, "block_id", value)


def _mamba_state(manager) -> list:
    out = []
    for single in manager.coordinator.single_type_managers:
        if type(single).__name__ != "MambaManager":
            continue
        if single.mamba_cache_mode != "align":   # (the align mode's bookkeeping only)
            out.append(({k: _ids(v) for k, v in single._partial_hit_reqs.items()},
                        sorted(single.cached_blocks_this_step)))
            continue
        out.append((dict(single.last_state_block_idx), dict(single._num_retired_blocks),
                    sorted(single._allocated_block_reqs), dict(single._checkpoints),
                    {k: _ids(v) for k, v in single._partial_hit_reqs.items()},
                    _ids(list(single._pending_boundary_state_offloads)),
                    _ids(list(single._pending_cow_copies)),
                    sorted(single.cached_blocks_this_step)))
    return out


def _chunk(rng: random.Random, prefill_left: int) -> int:
    """A step's new tokens as vLLM's scheduler gives them in align mode: prefill chunks of
    whole blocks (or the prompt's remainder), then decode steps of 1-4 tokens."""
    if prefill_left > 0:
        return min(BLOCK_SIZE * rng.choice((1, 4, 19)), prefill_left)
    return rng.choice((1,) * 12 + (2, 4))


def _run(num_ops: int, num_blocks: int, seed: int, *, events: bool = False, retention: int | None = 0,
         shared_checkpoint: bool = False, sliding: bool = False, caching: bool = True,
         mamba_block: int = BLOCK_SIZE, speculative: int = 0, full: bool = True,
         allocation: str = "vllm") -> dict:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    kvpool.install(allocation=allocation)
    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    made = [_manager(num_blocks, events, retention, shared_checkpoint, sliding=sliding, caching=caching,
                     mamba_block=mamba_block, speculative=speculative, full=full) for _ in range(2)]
    # vLLM's side is vLLM's Python throughout: its coordinator's cache_blocks (which kvpool
    # binds on HybridKVCacheCoordinator) is vLLM's function, set on the instance
    vanilla = made[0].coordinator
    vanilla.cache_blocks = types.MethodType(KVCacheCoordinator.cache_blocks, vanilla)
    sides = [(made[0], _vanilla_allocate_slots(), {}), (made[1], KVCacheManager.allocate_slots, {})]
    lookups = (_vanilla_get_computed_blocks(), KVCacheManager.get_computed_blocks)
    probes = (_vanilla(KVCacheManager, "get_num_cached_tokens"), KVCacheManager.get_num_cached_tokens)
    assert probes[1] is _core.kv_cache_manager_get_num_cached_tokens
    probes_before = _core.allocate_slots_fast_path_state()["native_probes"]
    before = _core.hybrid_running_step_state()
    live: list[str] = []
    next_id = 0
    counts = {"add": 0, "step": 0, "none": 0, "free": 0, "cache": 0, "hits": 0}
    for op in range(num_ops):
        if op % 8 == 0:   # an engine step starts (the scheduler's call; Mamba defers same-step hits)
            for manager, _, _ in sides:
                manager.new_step_starts()
        roll = rng.random()
        if len(live) < 3 or (roll < 0.05 and len(live) < 10):
            rid, next_id = f"r{next_id}", next_id + 1
            prompt = list(rng.choice(PREFIXES)) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 150))]
            junction = rng.choice((0, BLOCK_SIZE * rng.randrange(1, len(prompt) // BLOCK_SIZE + 2)))
            results, lookup_results = [], []
            for manager, allocate_slots, requests in sides:
                req = make_request(rid, prompt, max_tokens=10_000, block_size=BLOCK_SIZE)
                req.shared_prefix_boundary = junction   # (vLLM's scheduler sets it on a detected junction)
                # (vLLM's side: vLLM's get_computed_blocks; kvpool's: hybrid_lookup.pxi)
                native_side = manager is sides[1][0]
                probed = probes[native_side](manager, req)   # (the scheduler's cache-aware probe)
                found = lookups[native_side](manager, req)
                lookup_results.append((probed, _lookup_summary(manager, found)))
                blocks, hit = found[:2]
                n = _chunk(random.Random(op), len(prompt) - hit)
                out = allocate_slots(manager, req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks)
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
        elif roll < 0.3:   # Scheduler.update_from_output's publishing call
            rid, lag = rng.choice(live), rng.choice((0, 0, 0, 1, 17))
            for manager, _, requests in sides:   # (as update_from_output calls it for a Mamba model)
                req = requests[rid]
                manager.cache_blocks(req, max(0, req.num_computed_tokens - lag))
            counts["cache"] += 1
        elif roll < 0.34 or sides[0][2][live[0]].num_tokens > 1200:
            rid = live.pop(rng.randrange(len(live)) if roll < 0.34 else 0)
            for manager, _, requests in sides:
                manager.free(requests.pop(rid))
            counts["free"] += 1
        else:
            rid = rng.choice(live)
            req0 = sides[0][2][rid]
            n = _chunk(rng, req0.num_prompt_tokens - req0.num_computed_tokens)
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
            tokens = [rng.randrange(1, 30_000) for _ in range(n)]
            results = []
            for manager, allocate_slots, requests in sides:
                req, toks = requests[rid], list(tokens)
                req.status = status
                req.num_in_flight_tokens = in_flight
                out = allocate_slots(manager, req, n, **kwargs)
                results.append(_summary(manager, out))
                req.num_in_flight_tokens = 0
                if out is not None:
                    req.num_computed_tokens += n
                    while req.num_computed_tokens >= req.num_tokens:
                        req.append_output_token_ids(toks.pop() if toks else 5)
                    req.status = RequestStatus.RUNNING
            assert results[0] == results[1], (op, "step", rid, n, kwargs, status, results)
            counts["step"] += 1
            counts["none"] += results[0] is None
        assert _state(sides[0][0]) == _state(sides[1][0]), (op, counts)
        assert _mamba_state(sides[0][0]) == _mamba_state(sides[1][0]), (op, counts)
    after = _core.hybrid_running_step_state()
    counts["native_steps"] = after["native_steps"] - before["native_steps"]
    counts["vllm_steps"] = after["vllm_steps"] - before["vllm_steps"]
    counts["native_lookups"] = after["native_lookups"] - before["native_lookups"]
    counts["native_probes"] = _core.allocate_slots_fast_path_state()["native_probes"] - probes_before
    counts["native_cache_calls"] = after["native_cache_calls"] - before["native_cache_calls"]
    counts["vllm_cache_calls"] = after["vllm_cache_calls"] - before["vllm_cache_calls"]
    return counts


@needs_known_mamba
@pytest.mark.parametrize("sliding", [False, True], ids=["mamba", "mamba-sliding"])
def test_the_contiguous_policy_gets_each_group_s_table_in_vllm_s_calls_on_a_hybrid_model(monkeypatch, sliding):
    """Under ``allocation="contiguous"`` a hybrid model's call that kvpool hands to vLLM's
    ``allocate_slots`` (a new request's, a prefix hit's) tells the pool the request and
    its expected length; the pool finds only the allocating group's manager in the
    frames (``table_of_caller(frame, told)``), not the ``allocate_slots`` frame above
    it. Every table, the free queue and the Mamba bookkeeping then equal those of vLLM's
    own ``allocate_slots`` on a pool that walks the frames for all of it, call by call."""
    from kvpool import block_pool
    from kvpool.allocation.contiguous import ContiguousPolicy

    walks, extended = [], []
    walk, extend = block_pool.table_of_caller, ContiguousPolicy.extend_table

    def counting_walk(frame, told=None):
        found = walk(frame, told)
        walks.append((told, found))
        return found

    def counting_extend(self, pool, num_blocks, manager, request_id):
        extended.append((type(manager).__name__, request_id, self.expected_tokens.get(request_id)))
        return extend(self, pool, num_blocks, manager, request_id)

    monkeypatch.setattr(block_pool, "table_of_caller", counting_walk)
    monkeypatch.setattr(ContiguousPolicy, "extend_table", counting_extend)
    try:
        counts = _run(min(NUM_OPS, 3_000), 200, SEED + 7, sliding=sliding, allocation="contiguous")
    finally:
        kvpool.uninstall()
    told = [(t, f) for t, f in walks if t is not None]
    walked = [f for t, f in walks if t is None]
    # both sides allocated for new requests; the native side was told, vLLM's walked
    assert counts["add"] > 20 and len(told) > 20 and len(walked) > 20, (counts, len(told), len(walked))
    assert all(f is not None and f[1] == t[1] and f[2] == t[2] for t, f in told)
    kinds = {k for k, _, _ in extended}
    assert {"FullAttentionManager", "MambaManager"} <= kinds
    assert ("SlidingWindowManager" in kinds) is sliding
    # every allocation knew the request's prompt + max_tokens (make_request: 10,000)
    assert all(n is not None and n > 10_000 for _, _, n in extended)


@needs_known_mamba
@pytest.mark.parametrize("case", [
    dict(num_blocks=60, events=True),                        # small pool: eviction, refusals
    dict(num_blocks=600),                                    # long tables, prefix hits
    dict(num_blocks=600, events=True, retention=None),       # dense retention
    dict(num_blocks=200, retention=2 * BLOCK_SIZE),          # one state per 2-block segment
    dict(num_blocks=200, shared_checkpoint=True),            # the shared-prefix junction (forced on)
    dict(num_blocks=200, sliding=True, events=True),         # + a sliding-window group
    dict(num_blocks=300, sliding=True),                      # ... native lookups of three types
], ids=["60-events", "600", "600-dense-events", "200-interval", "200-shared", "200-sliding-events",
        "300-sliding"])
def test_mamba_running_step_matches_vllm(case):
    """Most running steps are idle and answered natively; every other one (a state
    block retired or allocated, a block cached, a partial tail, a copy-on-write) is
    vLLM's, and the two managers stay identical in every group. A new request's lookup
    is native without events (MambaManager's own find_longest_cache_hit called as vLLM's
    coordinator calls it) and gives vLLM's blocks, hit and shared-prefix boundary."""
    counts = _run(NUM_OPS // 4, seed=SEED + case["num_blocks"], **case)
    print(f"\nmamba differential {case}: {counts}")
    assert counts["native_steps"] > counts["step"] // 4
    assert counts["vllm_steps"] > 0 and counts["free"] > 0
    assert counts["native_cache_calls"] > counts["cache"] // 4 and counts["vllm_cache_calls"] > 0
    assert counts["none"] > 0 or case["num_blocks"] > 60
    assert counts["native_lookups"] == (0 if case.get("events") else counts["add"]) and counts["hits"] > 0
    assert counts["native_probes"] == counts["add"]


@needs_known_mamba
@pytest.mark.parametrize("case", [
    dict(num_blocks=60, mamba_block=4096),                   # vLLM's shape: one state block per request
    dict(num_blocks=300, mamba_block=64, speculative=1),     # states that retire, a speculative block
    dict(num_blocks=200, mamba_block=16, sliding=True),      # + a sliding-window group
    # (a Mamba block smaller than the attention block, not a shape vLLM resolves: the Mamba
    # groups' own allocation then decides steps the full-attention group does not)
    dict(num_blocks=300, mamba_block=8, speculative=2),
    dict(num_blocks=100, mamba_block=64, full=False),        # Mamba groups only (a Mamba2 model)
], ids=["60-one-block", "300-64-speculative", "200-16-sliding", "300-8-speculative", "100-mamba-only"])
def test_prefix_caching_off_matches_vllm(case):
    """Prefix caching off (Qwen3-Next, Qwen3.5 served or rolled out without it): vLLM's
    ``KVCacheCoordinatorNoPrefixCache`` with the Mamba groups in
    ``mamba_cache_mode="none"``. The steps that keep every group's blocks are native
    (src/kvpool/mamba_step.pxi, ``_mamba_none_idle``), the others vLLM's, and the two
    managers stay identical."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinatorNoPrefixCache

    kvpool.install()
    manager = _manager(64, False, 0, False, caching=False, mamba_block=case["mamba_block"])
    assert type(manager.coordinator) is KVCacheCoordinatorNoPrefixCache
    counts = _run(NUM_OPS // 4, seed=SEED + 31 + case["num_blocks"], caching=False, **case)
    print(f"\nmamba differential, prefix caching off {case}: {counts}")
    assert counts["native_steps"] > counts["step"] // 4
    assert counts["vllm_steps"] > 0 and counts["free"] > 0
    assert counts["none"] > 0 or case["num_blocks"] > 60


def test_the_mamba_step_is_armed_only_on_a_known_release(monkeypatch):
    """install() arms the Mamba groups' part exactly when the installed MambaManager's
    sources are the bound release's (KNOWN_MAMBA_SOURCES); with another fingerprint
    recorded, the full + sliding-window step stays armed and a Mamba model's running
    step is vLLM's."""
    from kvpool.patches.manager_fast_path import matching_release

    kvpool.install()
    try:
        assert _core.hybrid_running_step_state()["mamba"] == _mamba_is_known()
    finally:
        kvpool.uninstall()
    release = matching_release()
    if release is None or not _installed_release_is_known():
        return
    monkeypatch.setitem(hybrid_fast_path.KNOWN_MAMBA_SOURCES, release, "0" * 64)
    kvpool.install()
    try:
        state = _core.hybrid_running_step_state()
        assert state["enabled"] and not state["mamba"]
        counts = _run(300, 600, SEED)
        assert counts["native_steps"] == 0 < counts["vllm_steps"]
    finally:
        kvpool.uninstall()


@needs_known_mamba
@pytest.mark.parametrize("target,attr,value", [
    (None, None, None),   # the control: this step is idle, and native
    ("mamba", "mamba_cache_mode", "all"),
    ("mamba", "mamba_cache_mode", "none"),   # (with caching on: not a mode vLLM builds)
    ("mamba", "has_prefill_checkpoint_blocks", 0),
    ("mamba", "num_speculative_blocks", -1),
    ("mamba", "cache_hit_alignment_tokens", 0),
    ("mamba", "_allocated_block_reqs", frozenset()),
    ("mamba", "_num_retired_blocks", {"a": 2.0}),
    ("mamba", "last_state_block_idx", {"a": 10**6}),
    ("mamba", "shared_prefix_checkpoint", 1),
    ("mamba", "_needs_internal_checkpoint", lambda *a: True),
    ("null block", "is_null", 1),   # vLLM tests its truth; the step reads it at the prompt boundary
], ids=lambda v: repr(v)[:24])
def test_odd_mamba_values_get_vllms_step(target, attr, value):
    """A value of another type or range where vLLM's Mamba code reads a mode, a flag, a
    number, a set or a dict, or a method set on the instance: the step is vLLM's, which
    returns or raises what it does on vLLM's own managers (the control: native)."""
    outcomes = []
    for allocate_slots, manager, req in _decoding_pair():
        if target is not None:
            owner = {"request": req, "null block": manager.block_pool.null_block}.get(
                target, manager.coordinator.single_type_managers[1])
            setattr(owner, attr, value)
        before = _core.hybrid_running_step_state()["native_steps"]
        outcome = _outcome(lambda: _summary(manager, allocate_slots(manager, req, 1)))
        native = target is None and allocate_slots is _core.kv_cache_manager_allocate_slots
        assert _core.hybrid_running_step_state()["native_steps"] == before + native
        outcomes.append((outcome, _state(manager), _mamba_state(manager)))
    assert outcomes[0] == outcomes[1]


@needs_known_mamba
@pytest.mark.parametrize("where", ["class", "instance", "none"])
def test_a_patched_mamba_method_gets_vllms_cache_blocks(monkeypatch, where):
    """``KVCacheManager.cache_blocks`` as the scheduler calls it after a step: with a
    Mamba method the test reads patched on the class or set on an instance, vLLM's
    coordinator code runs and calls it; unpatched, the call that caches nothing returns
    natively."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.request import RequestStatus

    kvpool.install()
    manager = _manager(200, False, 0, False)
    req = make_request("a", list(range(70)), max_tokens=100, block_size=BLOCK_SIZE)
    assert manager.allocate_slots(req, 64) is not None
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 64
    assert manager.allocate_slots(req, 6) is not None
    req.num_computed_tokens = 70
    req.append_output_token_ids(7)
    seen = []
    original = MambaManager._cache_partial_tail_block

    def counting(self, *args, **kwargs):
        seen.append(args)
        return original(self, *args, **kwargs)

    mamba = manager.coordinator.single_type_managers[1]
    if where == "class":
        monkeypatch.setattr(MambaManager, "_cache_partial_tail_block", counting)
    elif where == "instance":
        mamba._cache_partial_tail_block = counting.__get__(mamba)
    state = _core.hybrid_running_step_state()
    manager.cache_blocks(req, 70)
    after = _core.hybrid_running_step_state()
    assert (after["native_cache_calls"] - state["native_cache_calls"]) == (where == "none")
    assert bool(seen) == (where != "none")


class _HostileKey:
    """A dict key that collides with ``name`` and clears ``victim`` the first time it is
    compared (a dict look-up of ``name`` runs its ``__eq__``)."""

    def __init__(self, name, victim: list):
        self.name, self.victim, self.armed = name, victim, True

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        if self.armed:
            self.armed = False
            self.victim.clear()
        return False


def _decoding_pair():
    """vLLM's and the native allocate_slots, each with its manager and a request decoding
    past a 70-token prompt (the next 1-token step idle in every group)."""
    from vllm.v1.request import RequestStatus

    kvpool.install()
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(200, False, 0, False)
        req = make_request("a", list(range(70)), max_tokens=100, block_size=BLOCK_SIZE)
        assert allocate_slots(manager, req, 64) is not None
        req.status, req.num_computed_tokens = RequestStatus.RUNNING, 64
        assert allocate_slots(manager, req, 6) is not None
        req.num_computed_tokens = 70
        req.append_output_token_ids(7)
        # (this step retires the prompt's last state block: not idle)
        assert allocate_slots(manager, req, 1) is manager.empty_kv_cache_blocks
        req.num_computed_tokens = 71
        req.append_output_token_ids(8)
        yield allocate_slots, manager, req


@needs_known_mamba
def test_a_shared_prefix_boundary_is_compared_as_vllm_compares_it():
    """With ``shared_prefix_checkpoint`` on, vLLM compares the cacheable tokens with
    ``request.shared_prefix_boundary`` before it looks at the request's range: a boundary
    whose ``==`` raises raises in ``cache_blocks`` on both sides, wherever the cacheable
    tokens are not the prompt's boundary (64 here: 48, 80), and the step (at it) is the
    same on both sides."""
    outcomes = []
    for allocate_slots, manager, req in _decoding_pair():
        for single in manager.coordinator.single_type_managers[1:]:
            single.shared_prefix_checkpoint = True
        req.shared_prefix_boundary = _NeRaises()
        outcomes.append((_outcome(lambda: _summary(manager, allocate_slots(manager, req, 1))),
                         _outcome(lambda: manager.cache_blocks(req, 48)),
                         _outcome(lambda: manager.cache_blocks(req, 80)),
                         _state(manager), _mamba_state(manager)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == outcomes[0][2] == ("raised", "RuntimeError")


@needs_known_mamba
@pytest.mark.parametrize("where", ["_num_retired_blocks", "last_state_block_idx", "instance dict"])
def test_code_run_by_a_look_up_does_not_crash_the_native_read(where):
    """A dict key whose ``__eq__`` clears the request's Mamba table during a look-up the
    native step makes (in the request's bookkeeping, or in the manager's ``__dict__``
    beside ``_null_block``): the table is read with its bound checked at the access, so
    the call returns or raises a Python exception (vLLM's outcome where vLLM makes the
    same look-up first), never reads past the list."""
    outcomes = []
    for allocate_slots, manager, req in _decoding_pair():
        mamba = manager.coordinator.single_type_managers[1]
        blocks = mamba.req_to_blocks["a"]
        mamba.last_state_block_idx["a"] = 0   # block 0 is the null block: still idle
        if where == "instance dict":
            null_block = mamba.__dict__.pop("_null_block")
            mamba.__dict__[_HostileKey("_null_block", blocks)] = None
            mamba.__dict__["_null_block"] = null_block
        else:
            hostile = {_HostileKey("a", blocks): 99}
            hostile["a"] = getattr(mamba, where)["a"]
            setattr(mamba, where, hostile)
        outcomes.append(_outcome(lambda: _summary(manager, allocate_slots(manager, req, 1))))
    if where != "instance dict":   # (vLLM reads _null_block after the block: its clear comes too late)
        assert outcomes[0] == outcomes[1]
    assert outcomes[1][0] in ("ok", "raised")


# --- prefix caching off: what vLLM reads is read as vLLM reads it ----------------------


class _NeverEqual:
    """A null block stand-in that is not equal even to itself (vLLM's walk compares with ``==``)."""

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__


def _off_pair(groups: str, setup):
    """vLLM's and the native allocate_slots, each with a manager with prefix caching off
    (``groups``: "full+mamba", "mamba" or "full+swa"; Mamba states of 16-token blocks in
    mamba_cache_mode "none") and a request decoding past a 70-token prompt, driven there
    by vLLM's function; then ``setup(manager, request)``."""
    from vllm.v1.request import RequestStatus

    kvpool.install()
    vanilla = _vanilla_allocate_slots()
    for allocate_slots in (vanilla, _core.kv_cache_manager_allocate_slots):
        manager = _manager(200, False, 0, False, num_mamba=0 if groups == "full+swa" else 2,
                           sliding=groups == "full+swa", caching=False, full=groups != "mamba")
        req = make_request("a", list(range(70)), max_tokens=100, block_size=BLOCK_SIZE)
        assert vanilla(manager, req, 70) is not None
        req.status, req.num_computed_tokens = RequestStatus.RUNNING, 70
        for _ in range(2):
            req.append_output_token_ids(7)
            assert vanilla(manager, req, 1) is not None
            req.num_computed_tokens += 1
        req.append_output_token_ids(8)
        setup(manager, req)
        yield allocate_slots, manager, req


def _null_never_equal(manager, req):
    """Every group's null block an object not equal to itself, at the slot the removal walk
    of the next step starts from (which holds the null block there)."""
    for single in manager.coordinator.single_type_managers:
        if type(single).__name__ == "FullAttentionManager":
            continue
        table, stand_in = single.req_to_blocks["a"], _NeverEqual()
        for i, block in enumerate(table):
            if block is single._null_block:
                table[i] = stand_in
        single._null_block = stand_in


def _entry_none_short_table(manager, req):
    """A sliding window's table emptied (below the blocks vLLM's get_num_blocks_to_allocate
    skips on its other branch), and the request's num_cached_block entry None (vLLM tests
    the entry's presence)."""
    single = manager.coordinator.single_type_managers[1]
    table = single.req_to_blocks["a"]
    rest = table[:]
    del table[:]
    manager.block_pool.free_blocks([b for b in rest if not b.is_null])
    single.num_cached_block["a"] = None


def _no_change(manager, req):
    pass


def _off_state(manager) -> tuple:
    """Every group's tables (block ids; another object by its type's name), cached counts
    (any value), new block ids, and the free queue: what the cases below compare."""
    groups = []
    for single in manager.coordinator.single_type_managers:
        cached = single.num_cached_block
        groups.append(({rid: [getattr(b, "block_id", type(b).__name__) for b in blocks]
                        for rid, blocks in single.req_to_blocks.items()},
                       dict(cached) if isinstance(cached, dict) else repr(cached), list(single.new_block_ids)))
    pool = manager.block_pool
    return groups, [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _mamba_attr(name, value):
    def setup(manager, req):
        for single in manager.coordinator.single_type_managers:
            if type(single).__name__ == "MambaManager":
                setattr(single, name, value)
    return setup


@needs_known_mamba
@pytest.mark.parametrize("groups,setup,step", [
    ("full+mamba", _no_change, {}),                               # the control: idle, native
    ("mamba", _no_change, {}),                                    # ... Mamba groups only
    ("full+mamba", _mamba_attr("num_cached_block", None), {}),    # vLLM's `in` raises
    ("mamba", _mamba_attr("num_cached_block", []), {}),
    ("full+mamba", _mamba_attr("num_speculative_blocks", 2**62), {}),
    ("full+mamba", _mamba_attr("mamba_cache_mode", "all"), {}),
    ("full+mamba", _mamba_attr("enable_caching", True), {}),
    ("full+mamba", _null_never_equal, {}),
    ("full+swa", _null_never_equal, {}),
    ("full+swa", _entry_none_short_table, {"reserved_blocks": "four left"}),
], ids=["control", "mamba-only", "cached-None", "cached-list", "speculative-huge", "mode-all", "caching-on",
        "null-never-equal", "swa-null-never-equal", "swa-entry-None"])
def test_odd_values_with_prefix_caching_off_get_vllms_outcome(groups, setup, step):
    """Under KVCacheCoordinatorNoPrefixCache: a value of another type or range where vLLM's
    code reads one (a Mamba group's num_cached_block, which vLLM's get_num_blocks_to_allocate
    tests with ``in``; a null block ``==`` does not find equal to itself; a
    ``num_cached_block`` entry whose value is None, which still sends vLLM down its first
    branch) gives vLLM's result or exception and vLLM's state (the controls: native)."""
    outcomes = []
    for allocate_slots, manager, req in _off_pair(groups, setup):
        kwargs = dict(step)
        if kwargs.get("reserved_blocks") == "four left":
            # (vLLM counts 5 blocks for the emptied window table; its other branch, 4)
            kwargs["reserved_blocks"] = manager.block_pool.get_num_free_blocks() - 4
        before = _core.hybrid_running_step_state()["native_steps"]
        outcome = _outcome(lambda: _summary(manager, allocate_slots(manager, req, 1, **kwargs)))
        native = _core.hybrid_running_step_state()["native_steps"] - before
        outcomes.append((outcome, _off_state(manager)))
    assert outcomes[0] == outcomes[1]
    if setup is _no_change:   # (the controls: the native step answered, idle)
        assert native == 1 and outcomes[0][0][0] == "ok"


@needs_known_mamba
def test_a_step_needing_more_blocks_than_a_long_long_holds_is_refused_as_vllm_refuses_it():
    """Nine full-attention groups of 1-token blocks with prefix caching off and
    ``max_model_len`` near 2**60: one step's blocks summed over the groups pass 2**63,
    where vLLM's Python int refuses the step (None) and a C sum would wrap negative."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import RequestStatus

    kvpool.install()
    vanilla, limit = _vanilla_allocate_slots(), 2**60
    outcomes = []
    for allocate_slots in (vanilla, _core.kv_cache_manager_allocate_slots):
        spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], spec) for i in range(9)])
        manager = KVCacheManager(config, max_model_len=limit - 1, scheduler_block_size=1, hash_block_size=1,
                                 enable_caching=False, enable_kv_cache_events=False)
        req = make_request("a", [1, 2, 3], max_tokens=10, block_size=1)
        assert vanilla(manager, req, 3) is not None
        req.status, req.num_computed_tokens = RequestStatus.RUNNING, 3
        req.append_output_token_ids(7)
        before = _core.hybrid_running_step_state()["native_changes"]
        outcomes.append((_outcome(lambda: allocate_slots(manager, req, limit - 10)), _state(manager)))
        changes = _core.hybrid_running_step_state()["native_changes"] - before
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == ("ok", None)
    assert changes == 1   # (the native step's refusal)
