"""The native ``KVCacheManager.allocate_slots`` (``kvpool.patches.manager_fast_path``,
``src/kvpool/manager.pxi``) against the installed vLLM's own method (0.30.0-0.33.0).

The differential drives two ``KVCacheManager``s (kvpool installed, so both on kvpool's
pool, which tests/pool checks against vLLM's) with the same random operations: one
called through vLLM's ``allocate_slots``, one through the native function (which hands
every call it does not take to vLLM's). After every operation: the returned blocks' ids (or None, and
whether it is the manager's shared empty ``KVCacheBlocks``), every request's block table
and cached-block count, the free block count, the new block ids for zeroing, and the KV
events are compared.

    KVPOOL_MANAGER_DIFF_OPS=1000000 python -m pytest tests/integration/test_manager_fast_path.py -s

runs 10^6 operations (default 20,000).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import sys

import pytest
import torch

import kvpool
from kvpool import _core
from kvpool.block_hash_map import BLOCK_IDS_MAP
from tests.support.map_view import map_entries
from tests.support.scheduler import copied_once, make_request


def _put_several(hash_map, key, first_id, first_value) -> None:
    """Make ``key`` cached by two blocks, ``first_id`` first (``first_value`` is what the
    map stores for it where it stores blocks: vLLM <= 0.33.0)."""
    cache = hash_map._cache
    if BLOCK_IDS_MAP:
        hash_map._dup_ids[key] = {first_id: None, cache[key]: None}
        cache[key] = first_id
    else:
        cache[key] = {first_id: first_value, cache[key].block_id: cache[key]}

pytestmark = [pytest.mark.sanitizer, pytest.mark.debug]

BLOCK_SIZE = 16
NUM_OPS = int(os.environ.get("KVPOOL_MANAGER_DIFF_OPS", "20000"))
SEED = int(os.environ.get("KVPOOL_DIFF_SEED", "20261201"))
PREFIXES = [list(range(5_000 * g, 5_000 * g + n)) for g, n in enumerate((48, 100, 160))]


def _manager(num_blocks: int, max_model_len: int = 1024, **kwargs):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE, **kwargs)
    # As for a model whose new blocks the worker zeroes (vLLM sets it from the config).
    manager.coordinator.single_type_managers[0]._record_new_block_ids = True
    return manager


def _vanilla_allocate_slots():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.patches.manager_fast_path import _vanilla

    return _vanilla(KVCacheManager, "allocate_slots")


def _vanilla_get_computed_blocks():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.patches.manager_fast_path import _vanilla

    return _vanilla(KVCacheManager, "get_computed_blocks")


def _lookup_summary(manager, result):
    """``get_computed_blocks``' triple with the blocks as ids per group, and whether
    they are the manager's shared empty ``KVCacheBlocks``."""
    blocks, hit, boundary = result
    return (_summary(manager, blocks), hit, boundary)


def _summary(manager, result):
    if result is None:
        return None
    return (result is manager.empty_kv_cache_blocks, [[b.block_id for b in g] for g in result.blocks])


class _Side:
    def __init__(self, manager, allocate_slots):
        self.manager = manager
        self.allocate_slots = allocate_slots
        self.requests: dict[str, object] = {}
        #: The removed block hashes when the pool's _emit_block_removed_events is this
        #: list's extend (as the replay's probe sets it), else None.
        self.removed: list | None = None

    def state(self):
        single = self.manager.coordinator.single_type_managers[0]
        pool = self.manager.block_pool
        tables = {rid: [b.block_id for b in blocks] for rid, blocks in single.req_to_blocks.items()}
        hashes = {rid: [(b.block_hash, b.block_hash_num_tokens) for b in blocks]
                  for rid, blocks in single.req_to_blocks.items()}
        cached = {key: sorted(ids) for key, ids in map_entries(pool.cached_block_hash_to_block).items()}
        events = [repr(e) for e in self.manager.take_events()]
        removed = None
        if self.removed is not None:
            removed = list(self.removed)
            self.removed.clear()
        return (tables, hashes, cached, dict(single.num_cached_block), pool.get_num_free_blocks(),
                self.manager.take_new_block_ids(), events, removed)


def _run_differential(num_ops: int, num_blocks: int, seed: int, watermark: float = 0.0,
                      events: bool = True, caching: bool = True, removed_log: bool = False) -> dict:
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.request import RequestStatus

    from kvpool.block_pool import VllmBlockPool
    from kvpool.patches.manager_fast_path import _vanilla

    rng = random.Random(seed)
    kvpool.install()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    assert UnitaryKVCacheCoordinator.cache_blocks is _core.kv_cache_coordinator_cache_blocks
    options = dict(enable_kv_cache_events=events, watermark=watermark, enable_caching=caching)
    # Both on kvpool's pool (itself checked against vLLM's by tests/pool): what differs
    # is only the allocate_slots and the coordinator's cache_blocks that run (vLLM's on
    # the vanilla side: bound on its coordinator).
    vanilla = _Side(_manager(num_blocks, **options), _vanilla_allocate_slots())
    coordinator = vanilla.manager.coordinator
    coordinator.cache_blocks = _vanilla(UnitaryKVCacheCoordinator, "cache_blocks").__get__(coordinator)
    # ... and vLLM's eviction callback for every cached block its pool hands out (the
    # native side's pool evicts them itself).
    pool = vanilla.manager.block_pool
    pool._maybe_evict_cached_block = VllmBlockPool._maybe_evict_cached_block.__get__(pool)
    # ... and vLLM's prefix-cache lookup (the native side's is lookup.pxi's).
    vanilla_lookup = _vanilla(KVCacheManager, "get_computed_blocks")
    vanilla.manager.get_computed_blocks = vanilla_lookup.__get__(vanilla.manager)
    takes_max = "max_cache_hit_length" in inspect.signature(vanilla_lookup).parameters
    # ... and its probe of a waiting request (vLLM >= 0.34.0's cache-aware admission)
    probes = hasattr(KVCacheManager, "get_num_cached_tokens")
    if probes:
        vanilla.manager.get_num_cached_tokens = \
            _vanilla(KVCacheManager, "get_num_cached_tokens").__get__(vanilla.manager)
    native = _Side(_manager(num_blocks, **options), KVCacheManager.allocate_slots)
    sides = (vanilla, native)
    if removed_log:   # the replay probe's recorder of the removed hashes (events off)
        for side in sides:
            side.removed = []
            side.manager.block_pool._emit_block_removed_events = side.removed.extend
    live: list[str] = []
    next_id = 0
    counts = {"add": 0, "step": 0, "none": 0, "free": 0, "reset": 0}
    admissions = _core.hybrid_running_step_state()["native_admissions"]
    for op in range(num_ops):
        roll = rng.random()
        if len(live) < 3 or (roll < 0.08 and len(live) < 12):
            rid = f"r{next_id}"
            next_id += 1
            prompt = list(rng.choice(PREFIXES)) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 200))]
            chunk = rng.choice((16, 64, 512))
            lookup_args = (rng.choice((None, 0, 15, 16, rng.randrange(len(prompt)))),) \
                if takes_max and rng.random() < 0.3 else ()
            results = []
            for side in sides:
                req = make_request(rid, prompt, max_tokens=10_000, block_size=BLOCK_SIZE)
                probed = side.manager.get_num_cached_tokens(req) if probes else None
                blocks, hit, boundary = side.manager.get_computed_blocks(req, *lookup_args)
                looked_up = (probed, hit, boundary, _summary(side.manager, blocks))
                n = min(chunk, len(prompt) - hit)
                out = side.allocate_slots(side.manager, req, n, num_new_computed_tokens=hit,
                                          new_computed_blocks=blocks)
                results.append((looked_up, _summary(side.manager, out)))
                if out is not None:
                    req.status = RequestStatus.RUNNING
                    req.num_computed_tokens = hit + n
                    side.requests[rid] = req
            assert results[0] == results[1], (op, "add", results)
            if results[0][1] is not None:
                live.append(rid)
            counts["add"] += 1
        elif roll < 0.14 or vanilla.requests[live[0]].num_tokens > 900:
            rid = live.pop(rng.randrange(len(live)) if roll < 0.14 else 0)
            for side in sides:
                side.manager.free(side.requests.pop(rid))
            counts["free"] += 1
        elif roll < 0.141:
            assert len({side.manager.reset_prefix_cache() for side in sides}) == 1
            counts["reset"] += 1
        else:
            rid = rng.choice(live)
            req0 = vanilla.requests[rid]
            prefill_left = req0.num_prompt_tokens - req0.num_computed_tokens
            n = min(rng.choice((1, 16, 64, 300)), prefill_left) if prefill_left > 0 else 1
            kwargs = {}
            if rng.random() < 0.2:
                kwargs["num_lookahead_tokens"] = rng.choice((1, 3, 40))
            if rng.random() < 0.2:
                kwargs["reserved_blocks"] = rng.choice((1, 8, num_blocks // 2))
            if rng.random() < 0.1:
                kwargs["delay_cache_blocks"] = True
            if rng.random() < 0.2:
                kwargs["has_scheduled_reqs"] = rng.random() < 0.5
            status = rng.choice((RequestStatus.RUNNING,) * 6 + (RequestStatus.PREEMPTED, RequestStatus.WAITING))
            token = rng.randrange(1, 30_000)
            results = []
            for side in sides:
                req = side.requests[rid]
                req.status = status
                out = side.allocate_slots(side.manager, req, n, **kwargs)
                results.append(_summary(side.manager, out))
                if out is not None:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens >= req.num_tokens:
                        req.append_output_token_ids(token)
                    req.status = RequestStatus.RUNNING
            assert results[0] == results[1], (op, "step", rid, n, kwargs, status, results)
            counts["step"] += 1
            counts["none"] += results[0] is None
        assert vanilla.state() == native.state(), (op, counts)
    counts.update(_core.allocate_slots_fast_path_state())
    counts["probes"] = probes
    # (a waiting request's first allocation: native on vLLM 0.34.0, hybrid_admit.pxi)
    counts["native_admissions"] = _core.hybrid_running_step_state()["native_admissions"] - admissions
    return counts


@pytest.mark.parametrize("events", [True, False, "removed-log", "no-caching"],
                         ids=["kv-events", "no-events", "removed-log", "no-caching"])
@pytest.mark.parametrize("num_blocks,watermark", [(64, 0.0), (400, 0.05)])
def test_native_allocate_slots_matches_vllm(num_blocks, watermark, events):
    """Small pool: constant eviction, many refusals (None); larger pool with a
    watermark: long tables, prefix hits, the waiting/preempted watermark rule. With KV
    events the blocks are cached by vLLM's cache_full_blocks (the events are compared);
    without, natively (every block's hash and the hash map are compared; the vanilla
    side's pool evicts through vLLM's callback, the native side's in kvpool's loop);
    "removed-log": without events, the pools' _emit_block_removed_events set on the
    instance to a list's extend, as the replay's probe does (the native caching and
    eviction stay on, and the lists of removed hashes are compared after every
    operation). With prefix caching off (vLLM's KVCacheCoordinatorNoPrefixCache)
    nothing is cached or hit and the native path takes every call that has no
    computed blocks."""
    caching = events != "no-caching"
    removed_log = events == "removed-log"
    events = events is True
    counts = _run_differential(NUM_OPS // 4 if caching else NUM_OPS // 8, num_blocks,
                               SEED + num_blocks, watermark, events, caching, removed_log)
    print(f"\nmanager differential: seed {SEED + num_blocks}, {num_blocks} blocks, "
          f"events {events}, caching {caching}: {counts}")
    assert counts["fast_calls"] > counts["vllm_calls"]
    if caching and _core.hybrid_running_step_state()["enabled"]:
        # (every admission native on vLLM 0.34.0: src/kvpool/hybrid_admit.pxi)
        assert counts["native_admissions"] == counts["add"] and counts["vllm_calls"] == 0
    else:
        # (vLLM's: earlier releases, and KVCacheCoordinatorNoPrefixCache's admissions)
        assert counts["vllm_calls"] > 0 and counts["native_admissions"] == 0
    assert counts["free"] > 0 and (counts["none"] > 0 or num_blocks > 64)
    if not caching:
        assert counts["native_cache_calls"] == counts["vllm_cache_calls"] == 0
        assert counts["native_evictions"] == 0
        assert counts["native_lookups"] == counts["add"] and counts["vllm_lookups"] == 0
    elif events:
        assert counts["native_cache_calls"] == 0 < counts["vllm_cache_calls"]
        assert counts["native_evictions"] == 0
        assert counts["native_lookups"] == 0 < counts["vllm_lookups"]
    else:
        assert counts["native_cache_calls"] > 10 * counts["vllm_cache_calls"]
        assert counts["native_evictions"] > 100
        assert counts["native_lookups"] == counts["add"] and counts["vllm_lookups"] == 0
    # the probe (vLLM >= 0.34.0) emits no events: native in every case
    if counts["probes"]:
        assert counts["native_probes"] == counts["add"] and counts["vllm_probes"] == 0


# -- when the native path runs, and when vLLM's does ------------------------------------
def _install_and_check_bound(name: str, native) -> object:
    """kvpool.install(); ``KVCacheManager.<name>`` is then ``native``, wrapping vLLM's
    function (returned) with its signature."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.patches.manager_fast_path import _vanilla

    vanilla = getattr(KVCacheManager, name)
    kvpool.install()
    assert getattr(KVCacheManager, name) is native
    assert _vanilla(KVCacheManager, name) is vanilla
    assert inspect.signature(getattr(KVCacheManager, name)) == inspect.signature(vanilla)
    return vanilla


def test_bound_by_install_and_undone_by_uninstall(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    vanilla = _install_and_check_bound("allocate_slots", _core.kv_cache_manager_allocate_slots)
    kvpool.uninstall()
    assert KVCacheManager.allocate_slots is vanilla
    kvpool.install(allocation="contiguous")  # the native path does what its hooks do
    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    assert _core.allocate_slots_fast_path_state()["manager_hooks"] is True
    kvpool.uninstall()
    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install()
    assert KVCacheManager.allocate_slots is vanilla


def test_the_installed_vllm_is_a_release_whose_sources_it_mirrors():
    """The installed release's functions hash to its recorded fingerprint (every release
    of the matrix, 0.30.0-0.34.0, has one, and the native path is bound on it); a change
    to any mirrored function or to a definition whose layout the native code reads
    (another release) keeps vLLM's allocate_slots."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool import vllm_compat
    from kvpool.patches import manager_fast_path as fp

    release = vllm_compat.release_traits().version
    assert set(fp.KNOWN_SOURCES) == set(vllm_compat.VLLM_RELEASES)
    assert fp.matching_release() == release
    kvpool.install()
    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    assert KVCacheManager.get_computed_blocks is _core.kv_cache_manager_get_computed_blocks
    print(f"\nvLLM {release}: the native allocate_slots, cache_blocks and get_computed_blocks are bound")
    kvpool.uninstall()
    classes = fp._classes()

    class Edited(classes["FullAttentionManager"]):
        def get_num_blocks_to_allocate(self, *args, **kwargs):  # another body
            return 0

    assert fp.matching_release({**classes, "FullAttentionManager": Edited}) is None

    class BlockIdMap(classes["BlockHashToBlockMap"]):   # another layout of the map's dict
        def insert(self, key, block) -> None:
            self._cache.setdefault(key, {})[block.block_id] = block.block_id

    assert fp.matching_release({**classes, "BlockHashToBlockMap": BlockIdMap}) is None

    class Request(classes["Request"]):   # another definition of a field it reads
        @property
        def num_tokens(self) -> int:
            return 0

    assert fp.matching_release({**classes, "Request": Request}) is None


def test_a_fingerprint_read_again_after_a_mirrored_function_changes_in_place(monkeypatch):
    """The mirrored sources are read once per process (install() computes the
    fingerprints on each call), by the identity of what was read: a method replaced on
    vLLM's own class, or its code object replaced, is read again and refused, and the
    release matches again once it is back."""
    from kvpool import vllm_compat
    from kvpool.patches import hybrid_fast_path as hfp, manager_fast_path as fp

    release = vllm_compat.release_traits().version
    classes = fp._classes()
    cls = classes["FullAttentionManager"]
    assert fp.matching_release() == release
    original = cls.find_longest_cache_hit

    def other(*args, **kwargs):  # another body, another code object
        return None

    with monkeypatch.context() as m:
        m.setattr(cls, "find_longest_cache_hit", other)
        assert fp.matching_release() is None
    assert fp.matching_release() == release
    func = getattr(original, "__func__", original)
    code = func.__code__
    with monkeypatch.context() as m:
        m.setattr(func, "__code__", other.__code__)
        assert fp.matching_release() is None
    assert func.__code__ is code and fp.matching_release() == release
    known = hfp.KNOWN_HYBRID_SOURCES.get(release)
    if known:   # (the hybrid fingerprint, through a classmethod bound anew on each read)
        evictable = vars(classes["SingleTypeKVCacheManager"]).get("_get_num_evictable_blocks")
        assert hfp.hybrid_fingerprint() == known
        if isinstance(evictable, classmethod):
            with monkeypatch.context() as m:
                m.setattr(evictable.__func__, "__code__", other.__code__)
                assert hfp.hybrid_fingerprint() != known
        assert hfp.hybrid_fingerprint() == known


def _running(manager, rid="a", prompt_len=40):
    from vllm.v1.request import RequestStatus

    req = make_request(rid, list(range(1, prompt_len + 1)), max_tokens=100, block_size=BLOCK_SIZE)
    assert manager.allocate_slots(req, prompt_len) is not None
    req.num_computed_tokens = prompt_len
    req.status = RequestStatus.RUNNING
    req.append_output_token_ids(7)
    return req


def _calls():
    """(native ``allocate_slots`` calls, vLLM's): the running requests' native calls and
    the native first allocations (hybrid_admit.pxi, vLLM 0.34.0) against vLLM's calls."""
    state = _core.allocate_slots_fast_path_state()
    return state["fast_calls"] + _core.hybrid_running_step_state()["native_admissions"], state["vllm_calls"]


def _admissions_native() -> bool:
    """A waiting request's first allocation is native (the hybrid step is armed: vLLM
    0.34.0) on a model of one full-attention group with prefix caching on."""
    return _core.hybrid_running_step_state()["enabled"]


@pytest.mark.parametrize("where", ["class", "base class", "instance"])
def test_a_patched_skipped_method_sends_calls_to_vllm(monkeypatch, where):
    """A method the native path skips, patched afterwards, is called again (tests and
    other extensions patch vLLM's classes at any time)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    fast, slow = _calls()
    manager.allocate_slots(req, 1)
    assert _calls() == (fast + 1, slow)
    seen = []
    single = manager.coordinator.single_type_managers[0]
    original = SingleTypeKVCacheManager.get_num_blocks_to_allocate

    def counting(self, *args, **kwargs):
        seen.append(args[0])
        return original(self, *args, **kwargs)

    if where == "class":
        monkeypatch.setattr(FullAttentionManager, "get_num_blocks_to_allocate", counting)
    elif where == "base class":
        monkeypatch.setattr(SingleTypeKVCacheManager, "get_num_blocks_to_allocate", counting)
    else:
        monkeypatch.setattr(single, "get_num_blocks_to_allocate", counting.__get__(single))
    assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
    assert seen == ["a"] and _calls() == (fast + 1, slow + 1)
    monkeypatch.undo()
    manager.allocate_slots(req, 1)
    assert _calls() == (fast + 2, slow + 1)



@pytest.mark.parametrize("where", ["pool instance", "pool class", "queue count assigned"])
def test_the_free_count_is_the_pools_own(monkeypatch, where):
    """The native path reads the free count from kvpool's queue only while
    ``get_num_free_blocks`` is vLLM's on the pool's class and instance; patched, it is
    called (a full pool reported: None, as vLLM's allocate_slots returns); a count a
    test assigned to the queue (vLLM's tests fake a full cache so) is what it reads."""
    from kvpool.block_pool import BlockPool

    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    pool = manager.block_pool
    for _ in range(BLOCK_SIZE - 40 % BLOCK_SIZE):   # decode to the end of the last block
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(7)
    fast, slow = _calls()
    seen: list = []
    if where == "queue count assigned":
        pool.free_block_queue.num_free_blocks = 0
    else:
        target = pool if where == "pool instance" else BlockPool
        _patch_counting(monkeypatch, target, "get_num_free_blocks", lambda *a: 0, seen)
    assert manager.allocate_slots(req, 1) is None        # the next token needs a block
    assert _calls() == (fast + 1, slow) and (seen or where == "queue count assigned")
    monkeypatch.undo()
    if where == "queue count assigned":
        pool.free_block_queue.num_free_blocks = pool.free_block_queue.num_free_blocks + 60
    assert manager.allocate_slots(req, 1) is not None


def _cache_calls():
    state = _core.allocate_slots_fast_path_state()
    return state["native_cache_calls"], state["vllm_cache_calls"]


def _fill_a_block(manager, req):
    """Decode until the request's next block fills: allocate_slots caches it."""
    for _ in range(BLOCK_SIZE):
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(7)


def _patch_counting(monkeypatch, target, name, original, seen: list) -> None:
    """Set ``target.name`` (a class, a module or an instance, bound to it) to a wrapper
    of ``original`` that records each call's arguments in ``seen``."""
    import types

    def counting(*args, **kwargs):
        seen.append(args)
        return original(*args, **kwargs)

    if isinstance(target, (type, types.ModuleType)):
        monkeypatch.setattr(target, name, counting)
    else:
        monkeypatch.setattr(target, name, types.MethodType(counting, target))


@pytest.mark.parametrize("where", ["pool class", "vLLM's pool class", "pool instance", "module function",
                                   "map class", "map instance", "coordinator's module function"])
def test_a_patched_caching_function_is_called(monkeypatch, where):
    """What the native cache_blocks skips (the pool's cache_full_blocks, patched on
    kvpool's pool class, on vLLM's, on the instance as the replay's probe does; the hash
    function in vLLM's block_pool namespace) is called again once patched, for the
    running request's cache (the native allocate_slots) and a new request's (vLLM's
    allocate_slots through the coordinator); so is kvpool's map's insert, patched on its
    class or on the pool's map, and replay_boundaries (vLLM 0.32.0 and later)."""
    from vllm.v1.core import block_pool as vllm_block_pool

    from kvpool.block_pool import BlockPool, VllmBlockPool

    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    native, vllm = _cache_calls()
    _fill_a_block(manager, req)
    assert _cache_calls() == (native + 1, vllm)
    pool = manager.block_pool
    seen = []
    if where in ("module function", "coordinator's module function"):
        from vllm.v1.core import kv_cache_coordinator

        module, name = ((vllm_block_pool, "make_block_hash_with_group_id") if where == "module function"
                        else (kv_cache_coordinator, "replay_boundaries"))
        if not hasattr(module, name):
            pytest.skip(f"this vLLM has no {module.__name__}.{name} (before 0.32.0: get_replay_boundaries)")
        _patch_counting(monkeypatch, module, name, getattr(module, name), seen)
    elif where.startswith("map"):
        from kvpool.block_pool import BlockHashToBlockMap

        target = BlockHashToBlockMap if where == "map class" else pool.cached_block_hash_to_block
        _patch_counting(monkeypatch, target, "insert", BlockHashToBlockMap.insert, seen)
    else:
        target = {"pool class": BlockPool, "vLLM's pool class": VllmBlockPool}.get(where, pool)
        _patch_counting(monkeypatch, target, "cache_full_blocks", VllmBlockPool.cache_full_blocks, seen)
    _fill_a_block(manager, req)
    assert seen and _cache_calls()[0] == native + 1
    seen.clear()
    other = make_request("b", list(range(1, 41)), max_tokens=100, block_size=BLOCK_SIZE)
    assert manager.allocate_slots(other, 40) is not None     # a new request: vLLM's path
    assert seen and _cache_calls()[0] == native + 1
    monkeypatch.undo()
    _fill_a_block(manager, req)
    assert _cache_calls()[0] == native + 2


def _not_prefix_cacheable_run() -> tuple:
    """A running request filling a block on a manager whose spec is not
    ``prefix_cacheable``: what is cached (counts, block hashes, map keys)."""
    import dataclasses

    manager = _manager(64)
    single = manager.coordinator.single_type_managers[0]
    spec = single.kv_cache_spec

    class NotCacheable(type(spec)):
        @property
        def prefix_cacheable(self) -> bool:
            return False

    single.kv_cache_spec = NotCacheable(**{f.name: getattr(spec, f.name)
                                           for f in dataclasses.fields(spec) if f.init})
    req = _running(manager)
    _fill_a_block(manager, req)
    return (dict(single.num_cached_block), [b.block_hash for b in single.req_to_blocks["a"]],
            sorted(manager.block_pool.cached_block_hash_to_block._cache))


def test_a_spec_that_is_not_prefix_cacheable_is_cached_as_the_release_caches_it(monkeypatch):
    """``VllmRelease.cache_checks_prefix_cacheable``: from 0.31.0 vLLM's
    ``SingleTypeKVCacheManager.cache_blocks`` caches nothing for a spec that is not
    ``prefix_cacheable`` (0.30.0's caches it); the native caching (a new request's
    through the bound coordinator method, a running one's through the native
    allocate_slots) does what the installed release's Python does."""
    from kvpool.vllm_compat import release_traits

    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install()
    vanilla = _not_prefix_cacheable_run()
    kvpool.uninstall()
    monkeypatch.delenv("KVPOOL_PYTHON_MANAGER")
    kvpool.install()
    native, _ = _cache_calls()
    assert _not_prefix_cacheable_run() == vanilla
    assert bool(vanilla[2]) is not release_traits().cache_checks_prefix_cacheable
    if vanilla[2]:
        assert _cache_calls()[0] > native      # (0.30.0: cached natively)


def test_a_map_entry_of_another_type_is_read_by_vllms_code():
    """A prefix-cache entry that is not a kvpool block (reading its ``block_id`` could run
    Python code that changes the table the native loop walks) hands the rest of the
    call to vLLM's ``cache_full_blocks``, which reads it as vLLM does."""
    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    single = manager.coordinator.single_type_managers[0]
    reads = []

    class Foreign:
        # Read as a block (vLLM <= 0.33.0's map) or compared as an id (0.34.0's).
        @property
        def block_id(self):
            reads.append(1)
            return -5

        def __ne__(self, other):
            reads.append(1)
            return True

        __hash__ = object.__hash__

    # Decode until the next block's hash exists (its last token appended), then put a
    # foreign entry under that hash (group 0) before the step that caches the block.
    next_block = single.num_cached_block["a"]
    cache = manager.block_pool.cached_block_hash_to_block._cache
    key = None
    for _ in range(2 * BLOCK_SIZE):
        if key is None and len(req.block_hashes) > next_block:
            key = req.block_hashes[next_block] + (0).to_bytes(4, "big")
            cache[key] = Foreign()
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(7)
    assert key is not None and reads, "vLLM's code did not read the foreign entry"
    block = single.req_to_blocks["a"][next_block]
    if BLOCK_IDS_MAP:
        assert block.block_id in manager.block_pool.cached_block_hash_to_block._dup_ids[key]
    else:
        assert isinstance(cache[key], dict) and cache[key][block.block_id] is block
    assert single.num_cached_block["a"] > next_block


def test_native_cache_blocks_bound_by_install_and_undone_by_uninstall():
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator, UnitaryKVCacheCoordinator

    assert "cache_blocks" not in vars(UnitaryKVCacheCoordinator)
    kvpool.install()
    assert UnitaryKVCacheCoordinator.cache_blocks is _core.kv_cache_coordinator_cache_blocks
    assert _core.allocate_slots_fast_path_state()["native_cache"] is True
    kvpool.uninstall()
    assert "cache_blocks" not in vars(UnitaryKVCacheCoordinator)
    assert UnitaryKVCacheCoordinator.cache_blocks is KVCacheCoordinator.cache_blocks


def test_a_method_wrapped_by_other_code_keeps_vllms_python(monkeypatch):
    """A mirrored method wrapped with functools.wraps before install (its source reads
    as vLLM's): the native path would skip the wrapper, so it is not bound."""
    import functools

    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    original = SingleTypeKVCacheManager.cache_blocks
    seen = []

    @functools.wraps(original)
    def traced(self, *args, **kwargs):
        seen.append(args[0].request_id)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SingleTypeKVCacheManager, "cache_blocks", traced)
    kvpool.install()
    assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots
    manager = _manager(64)
    req = _running(manager)
    _fill_a_block(manager, req)
    assert "a" in seen


def _mirrored_function(classes, cls_name, name):
    from kvpool.patches.sources import _vanilla

    func = _vanilla(classes[cls_name], name)
    return getattr(func, "__func__", func)


def _first_with(what):
    """The first mirrored (class name, function) of the unitary fingerprint with ``what``
    (``"kwdefaults"``, ``"closure"``), or None on this release."""
    from kvpool.patches import manager_fast_path as fp

    classes = fp._classes()
    for cls_name, name in fp.MIRRORED + fp.LAYOUT:
        func = _mirrored_function(classes, cls_name, name) if name else None
        if func is not None and getattr(func, "__" + what + "__", None):
            return cls_name, func
    return None


@pytest.mark.parametrize("edit", ["defaults", "bool for int", "kwdefaults in place", "closure cell"])
def test_a_mirrored_function_edited_in_place_is_not_fingerprinted_as_vllms(monkeypatch, edit):
    """Defaults and closure cells change without changing the source text the
    fingerprint reads: an edited one refuses the release, which matches again once
    the edit is undone (read on every fingerprint, not from the per-process cache)."""
    from kvpool import vllm_compat
    from kvpool.patches import manager_fast_path as fp

    release = vllm_compat.release_traits().version
    assert fp.matching_release() == release
    classes = fp._classes()
    if edit in ("defaults", "bool for int"):
        func = _mirrored_function(classes, "KVCacheManager", "allocate_slots")
        defaults = func.__defaults__
        assert type(defaults[2]) is int   # num_lookahead_tokens=0
        value = 64 if edit == "defaults" else False
        with monkeypatch.context() as m:
            m.setattr(func, "__defaults__", defaults[:2] + (value,) + defaults[3:])
            assert fp.matching_release() is None
    elif edit == "kwdefaults in place":
        found = _first_with("kwdefaults")
        if found is None:
            pytest.skip("no mirrored function with keyword-only defaults on this release")
        kwdefaults = found[1].__kwdefaults__
        key = next(iter(kwdefaults))
        before = kwdefaults[key]
        kwdefaults[key] = "edited"
        try:
            assert fp.matching_release() is None
        finally:
            kwdefaults[key] = before
    else:
        found = _first_with("closure")
        if found is None:
            pytest.skip("no mirrored function with a closure on this release")
        cell = found[1].__closure__[0]
        before = cell.cell_contents
        cell.cell_contents = int   # super() would now read int's MRO
        try:
            assert fp.matching_release() is None
        finally:
            cell.cell_contents = before
    assert fp.matching_release() == release


def test_allocate_slots_defaults_edited_before_install_stay_vllms(monkeypatch):
    """``allocate_slots``' ``num_lookahead_tokens`` default set to 64 before install: the
    native path (which has its own defaults) is not bound, and a call that leaves the
    argument out reserves the 64 tokens, as vLLM's edited function does."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    func = KVCacheManager.allocate_slots
    defaults = func.__defaults__
    monkeypatch.setattr(func, "__defaults__", defaults[:2] + (64,) + defaults[3:])
    kvpool.install()
    assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots
    manager = _manager(64)
    req = _running(manager)   # (its first allocate_slots(req, 40) reserves 40 + 64 slots)
    assert len(manager.get_block_ids("a")[0]) == -(-(40 + 64) // BLOCK_SIZE)
    assert manager.allocate_slots(req, 1) is not None
    assert len(manager.get_block_ids("a")[0]) == -(-(40 + 1 + 64) // BLOCK_SIZE)


class _Index:
    """An int-like argument whose __index__ counts its calls (vLLM accepts it where it
    does arithmetic; the native path must not read it differently)."""

    def __init__(self, v):
        self.v, self.reads = v, 0

    def __index__(self):
        self.reads += 1
        return self.v

    def __add__(self, other):
        return self.v + other

    __radd__ = __add__


@pytest.mark.parametrize("arg,value", [
    ("num_new_tokens", True), ("num_new_tokens", 2.0), ("num_lookahead_tokens", -1),
    ("reserved_blocks", 2**70), ("delay_cache_blocks", 1), ("has_scheduled_reqs", "yes"),
])
def test_arguments_of_other_types_get_vllm_behaviour(arg, value):
    """Whatever vLLM does with an odd argument (compute, raise), the call does the same:
    the native path takes exact ints and bools only."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.patches.manager_fast_path import _vanilla

    kvpool.install()
    results = []
    for call in (_vanilla(KVCacheManager, "allocate_slots"), KVCacheManager.allocate_slots):
        manager = _manager(64)
        req = _running(manager)
        kwargs = {"num_new_tokens": 1, arg: value}
        try:
            out = call(manager, req, **kwargs)
            results.append(_summary(manager, out))
        except Exception as exc:  # the same exception on both
            results.append((type(exc), str(exc)))
        results.append([b.block_id for b in manager.coordinator.single_type_managers[0].req_to_blocks["a"]])
    assert results[:2] == results[2:]


def test_an_int_like_request_field_goes_to_vllm():

    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    fast, slow = _calls()
    req.num_computed_tokens = _Index(40)
    with contextlib.suppress(TypeError):
        manager.allocate_slots(req, 1)
    assert _calls() == (fast, slow + 1)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("field", ["num_prompt_tokens", "num_in_flight_tokens"])
def test_a_request_field_vllm_reads_and_discards_is_still_vllms_to_read(field, caching):
    """vLLM's allocate_slots reads the prompt length and the in-flight tokens even when
    they change nothing for this shape; of another type its arithmetic raises, and so
    does the bound one's (a breaker's finding)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.patches.manager_fast_path import _vanilla

    kvpool.install()
    results = []
    for call in (_vanilla(KVCacheManager, "allocate_slots"), KVCacheManager.allocate_slots):
        manager = _manager(64, enable_caching=caching)
        req = _running(manager)
        setattr(req, field, None)
        try:
            results.append(_summary(manager, call(manager, req, 1)))
        except Exception as exc:
            results.append((type(exc), str(exc)))
    assert results[0] == results[1], results    # (0.33.0: both raise TypeError)


# -- the prefix-cache lookup of a waiting request (lookup.pxi) -------------------------
def _lookups():
    state = _core.allocate_slots_fast_path_state()
    return state["native_lookups"], state["vllm_lookups"]


def _looked_up(manager, result):
    blocks, hit, boundary = result
    return (hit, boundary, blocks is manager.empty_kv_cache_blocks,
            [[b if not hasattr(b, "block_id") else b.block_id for b in g] for g in blocks.blocks])


def _cached_prefix(manager, prompt_len=70):
    """Request "a" with a ``prompt_len``-token prompt, its full blocks cached; a
    request "b" with the same prompt (not yet scheduled) to look up."""
    _running(manager, "a", prompt_len)
    return make_request("b", list(range(1, prompt_len + 1)), max_tokens=100, block_size=BLOCK_SIZE)


def test_native_lookup_bound_by_install_and_undone_by_uninstall(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    vanilla = _install_and_check_bound("get_computed_blocks", _core.kv_cache_manager_get_computed_blocks)
    assert _core.allocate_slots_fast_path_state()["native_lookup"] is True
    manager = _manager(64)
    req = _cached_prefix(manager)
    native, vllm = _lookups()
    hit = manager.get_computed_blocks(req)
    assert _lookups() == (native + 1, vllm)
    assert _looked_up(manager, hit) == _looked_up(manager, vanilla(manager, req))
    assert hit[1] == 64 and hit[0].blocks[0] == manager.coordinator.single_type_managers[0].req_to_blocks["a"][:4]
    kvpool.uninstall()
    assert KVCacheManager.get_computed_blocks is vanilla
    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install()
    assert KVCacheManager.get_computed_blocks is vanilla


def _patch_classmethod_counting(monkeypatch, cls, name, seen: list) -> None:
    original = getattr(cls, name).__func__

    def counting(klass, *args, **kwargs):
        seen.append(args)
        return original(klass, *args, **kwargs)

    monkeypatch.setattr(cls, name, classmethod(counting))


@pytest.mark.parametrize("where", [
    "manager class", "manager instance", "coordinator class", "coordinator instance",
    "single-type class", "pool class", "pool instance", "map class", "map instance",
    "module function"])
def test_a_patched_lookup_function_is_called(monkeypatch, where):
    """What the native get_computed_blocks skips, patched after install on a class or
    an instance (or vLLM's resolve_block_hashes in the single-type managers' module),
    is called again, and the lookup's result is vLLM's."""
    from vllm.v1.core import single_type_kv_cache_manager as single_type
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.block_pool import BlockHashToBlockMap, BlockPool, VllmBlockPool

    kvpool.install()
    manager = _manager(64)
    req = _cached_prefix(manager)
    native, vllm = _lookups()
    expected = _looked_up(manager, manager.get_computed_blocks(req))
    assert expected[0] == 64 and _lookups() == (native + 1, vllm)
    seen: list = []
    coordinator = manager.coordinator
    pool = manager.block_pool
    targets = {
        "manager class": (KVCacheManager, "prefix_cache_lookup_enabled", KVCacheManager.prefix_cache_lookup_enabled),
        "manager instance": (manager, "create_kv_cache_blocks", KVCacheManager.create_kv_cache_blocks),
        "coordinator class": (UnitaryKVCacheCoordinator, "find_longest_cache_hit",
                              UnitaryKVCacheCoordinator.find_longest_cache_hit),
        "coordinator instance": (coordinator, "find_longest_cache_hit",
                                 UnitaryKVCacheCoordinator.find_longest_cache_hit),
        "pool class": (BlockPool, "get_cached_block", VllmBlockPool.get_cached_block),
        "pool instance": (pool, "get_cached_block", VllmBlockPool.get_cached_block),
        "map class": (BlockHashToBlockMap, "get_one_block", BlockHashToBlockMap.get_one_block),
        "map instance": (pool.cached_block_hash_to_block, "get_one_block", BlockHashToBlockMap.get_one_block),
        "module function": (single_type, "resolve_block_hashes", single_type.resolve_block_hashes),
    }
    if where == "single-type class":
        _patch_classmethod_counting(monkeypatch, single_type.FullAttentionManager, "find_longest_cache_hit", seen)
    else:
        _patch_counting(monkeypatch, *targets[where], seen)
    assert _looked_up(manager, manager.get_computed_blocks(req)) == expected
    assert seen and _lookups() == (native + 1, vllm + 1)
    monkeypatch.undo()
    assert _looked_up(manager, manager.get_computed_blocks(req)) == expected
    assert _lookups() == (native + 2, vllm + 1)


def test_the_lookup_stays_native_under_wrapped_pool_methods():
    """A tool that wraps the pool's cache_full_blocks and _emit_block_removed_events on
    the instance (as the replay's probe once did: the caching and eviction then are
    vLLM's) leaves the lookup, which calls neither, native."""
    from kvpool.block_pool import VllmBlockPool

    kvpool.install()
    manager = _manager(64)
    req = _cached_prefix(manager)
    pool = manager.block_pool
    for name in ("cache_full_blocks", "_emit_block_removed_events"):
        pool.__dict__[name] = getattr(VllmBlockPool, name).__get__(pool)
    native, vllm = _lookups()
    assert manager.get_computed_blocks(req)[1] == 64
    assert _lookups() == (native + 1, vllm)


class _ListSubclass(list):
    pass


@pytest.mark.parametrize("recorder", ["list extend", "list subclass extend", "deque extend",
                                      "list append", "function"])
def test_evictions_recorded_by_a_lists_extend_stay_native(recorder):
    """The replay's probe records evictions with ``pool._emit_block_removed_events =
    hashes.extend`` (events off): the native eviction appends to that list what vLLM's
    would pass to it, and stays native. Any other callable there (a list subclass's or
    a deque's extend, a list's append, a function) is vLLM's to call: the eviction is
    vLLM's, and so is what the callable gets."""
    import collections

    kvpool.install()
    results = []
    for side in ("vllm", "native"):
        manager = _manager(8)
        pool = manager.block_pool
        got = {"list extend": [], "list subclass extend": _ListSubclass(),
               "deque extend": collections.deque(), "list append": [], "function": []}[recorder]
        if recorder == "function":
            pool._emit_block_removed_events = lambda hashes: got.append(list(hashes))
        elif recorder == "list append":
            pool._emit_block_removed_events = got.append
        else:
            pool._emit_block_removed_events = got.extend
        if side == "vllm":   # vLLM's eviction of every cached block the pool hands out
            from kvpool.block_pool import VllmBlockPool

            pool._maybe_evict_cached_block = VllmBlockPool._maybe_evict_cached_block.__get__(pool)
        manager.free(_running(manager, "a", 6 * BLOCK_SIZE))   # 6 cached blocks freed
        before = _core.allocate_slots_fast_path_state()["native_evictions"]
        taken = pool.get_new_blocks(pool.get_num_free_blocks())
        evicted = _core.allocate_slots_fast_path_state()["native_evictions"] - before
        results.append(([b.block_id for b in taken], list(got)))
        if side == "native":
            assert evicted == (6 if recorder == "list extend" else 0)
    assert results[0] == results[1]
    assert len(results[0][1]) == 6   # six hashes (list append: six one-hash lists)


class _Foreign:
    block_id = -3   # a prefix-cache entry that is not a kvpool block


@pytest.mark.parametrize("case", [
    "max True", "max -1", "max 2.5", "max int-like", "max huge", "max 0", "max 33",
    "max None", "skip reading", "caching off", "no tokens", "several blocks", "foreign entry",
    "foreign in several", "events on", "counted property", "tuple of hashes", "key's __eq__"])
def test_lookups_of_odd_arguments_and_entries_get_vllm_behaviour(case):
    """Whatever vLLM's get_computed_blocks does with an odd argument, request or map
    entry (computes, raises, returns a foreign object), the bound one does the same; a
    key holding several blocks gives the first inserted."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.patches.manager_fast_path import _vanilla

    kvpool.install()
    vanilla = _vanilla(KVCacheManager, "get_computed_blocks")
    results = []
    for call in (vanilla, KVCacheManager.get_computed_blocks):
        manager = _manager(64, enable_kv_cache_events=case == "events on")
        req = _cached_prefix(manager)
        cache = manager.block_pool.cached_block_hash_to_block._cache
        key = req.block_hashes[1] + (0).to_bytes(4, "big")
        args = ()
        if case.startswith("max "):
            args = ({"max True": True, "max -1": -1, "max 2.5": 2.5, "max int-like": _Index(40),
                     "max huge": 2**70, "max 0": 0, "max 33": 33, "max None": None}[case],)
        elif case == "skip reading":
            req.skip_reading_prefix_cache = True
        elif case == "caching off":
            manager.enable_caching = False
        elif case == "no tokens":
            req = make_request("c", [], max_tokens=1, block_size=BLOCK_SIZE)
        elif case == "several blocks":
            other = manager.block_pool.get_new_blocks(1)[0]   # inserted first
            _put_several(manager.block_pool.cached_block_hash_to_block, key, other.block_id, other)
        elif case == "foreign entry":
            cache[key] = _Foreign()
        elif case == "foreign in several":
            _put_several(manager.block_pool.cached_block_hash_to_block, key, -3, _Foreign())
        elif case in ("counted property", "tuple of hashes"):
            # A property that is False only on its first read: read twice, the lookup
            # would differ (a breaker's finding); with a tuple of hashes too.
            reads = []
            sub = type("CountingRequest", (type(req),), {"skip_reading_prefix_cache": property(
                lambda self: (reads.append(1), len(reads) > 1)[1])})
            state = dict(vars(req))
            state.pop("skip_reading_prefix_cache", None)
            req.__class__ = sub
            req.__dict__.clear()
            req.__dict__.update(state)
            if case == "tuple of hashes":
                req.block_hashes = tuple(req.block_hashes)
        elif case == "key's __eq__":
            # A map key whose __eq__ runs during the lookup and changes the request's
            # hashes (the next one becomes an equal bytes subclass) and answers equal once.
            calls = []
            hashes = req.block_hashes

            class Key:
                def __hash__(self):
                    return hash(hashes[0] + (0).to_bytes(4, "big"))

                def __eq__(self, other):
                    calls.append(1)
                    if len(calls) == 1:
                        hashes[1] = type("B", (bytes,), {})(hashes[1])
                    return len(calls) == 1

            first = hashes[0] + (0).to_bytes(4, "big")
            cache[Key()] = cache.pop(first)
        native = _lookups()[0]
        try:
            results.append(_looked_up(manager, call(manager, req, *args)))
        except Exception as exc:  # the same exception on both
            results.append((type(exc), str(exc)))
        results.append(_lookups()[0] - native)
    assert results[0] == results[2], results
    # vLLM's own function counts nothing; the bound one does every lookup that returns
    # natively but with KV events on (vLLM 0.30.0's get_computed_blocks has no
    # max_cache_hit_length: both raise its TypeError).
    raised = isinstance(results[2][0], type)
    takes_max = "max_cache_hit_length" in inspect.signature(vanilla).parameters
    native = not raised and case != "events on" and (takes_max or not case.startswith("max "))
    assert results[1] == 0 and results[3] == native, results


# -- through vLLM's Scheduler: kvpool (native allocate_slots) against vLLM itself -------
def _scheduler_trace(num_steps: int, num_blocks: int, seed: int, caching: bool = True) -> list:
    from tests.support.scheduler import make_scheduler, runner_output

    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, enable_prefix_caching=caching)
    manager = scheduler.kv_cache_manager
    trace, next_id = [], 0
    for _ in range(num_steps):
        while len(scheduler.requests) < 16:
            prompt = list(rng.choice(PREFIXES)) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 400))]
            scheduler.add_request(make_request(f"q{next_id}", prompt, max_tokens=rng.randrange(1, 120)))
            next_id += 1
        out = scheduler.schedule()
        tables = {rid: manager.get_block_ids(rid) for rid in sorted(scheduler.requests)}
        trace.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids or ()),
                      [(r.req_id, r.block_ids) for r in out.scheduled_new_reqs],
                      tables, manager.block_pool.get_num_free_blocks()))
        scheduler.update_from_output(out, runner_output(out))
    return trace


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_scheduler_with_native_allocate_slots_matches_vllm(caching):
    """A never-idle stream (16 requests, shared prefixes, chunked prefill, a pool small
    enough to preempt): every step's scheduled tokens, preemptions, new requests' block
    ids, every table and the free count equal vLLM's own run, with prefix caching on
    and off (vLLM's KVCacheCoordinatorNoPrefixCache)."""
    from kvpool import patching

    kvpool.uninstall()
    vanilla = _scheduler_trace(600, 300, SEED, caching)
    # (The vanilla scheduler is never stepped again, but a log record's traceback may keep
    # its frames, and so its pool, alive for the rest of the test.)
    patching.install(allow_vllm_built_pools=True)
    fast, slow = _calls()
    native_lookups = _lookups()[0]
    admitted = _core.hybrid_running_step_state()["native_admissions"]
    native = _scheduler_trace(600, 300, SEED, caching)
    fast_after, slow_after = _calls()
    admitted = _core.hybrid_running_step_state()["native_admissions"] - admitted
    assert admitted > 100 if caching and _admissions_native() else admitted == 0
    # (with prefix caching on every call may be native: the admissions too, on 0.34.0)
    assert fast_after - fast > 3 * (slow_after - slow) >= (0 if caching and _admissions_native() else 1)
    assert _lookups()[0] > native_lookups + 100      # the waiting requests' lookups
    assert any(step[1] for step in vanilla), "the pool never preempted"
    for i, (a, b) in enumerate(zip(vanilla, native)):
        assert a == b, f"step {i}"


def test_native_get_block_ids_matches_vllm():
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from kvpool.patches.manager_fast_path import KNOWN_GET_BLOCK_IDS, _vanilla, get_block_ids_fingerprint
    from kvpool.vllm_compat import release_traits

    assert get_block_ids_fingerprint() == KNOWN_GET_BLOCK_IDS[release_traits().version]
    vanilla = KVCacheBlocks.get_block_ids
    kvpool.install()
    assert KVCacheBlocks.get_block_ids is _core.kv_cache_blocks_get_block_ids
    assert _vanilla(KVCacheBlocks, "get_block_ids") is vanilla
    manager = _manager(64)
    pool = manager.block_pool
    rng = random.Random(SEED)
    cases = 0
    for _ in range(300):
        groups = tuple(rng.choice((lambda: pool.get_new_blocks(rng.randrange(0, 4)), tuple, list))()
                       for _ in range(rng.randrange(1, 4)))
        value = KVCacheBlocks(groups)
        for kwargs in ({}, {"allow_none": True}, {"allow_none": 0}, {"group_ids": [0]},
                       {"group_ids": [len(groups) - 1, 0], "allow_none": True}, {"group_ids": [5]},
                       {"group_ids": 3}, {"allow_none": True, "group_ids": ()}):
            results = []
            for call in (vanilla, KVCacheBlocks.get_block_ids):
                try:
                    results.append(call(value, **kwargs))
                except Exception as exc:
                    results.append(type(exc))
            assert results[0] == results[1], (groups, kwargs, results)
            cases += 1
        for group in groups:
            if group:
                pool.free_blocks(group)
    kvpool.uninstall()
    assert KVCacheBlocks.get_block_ids is vanilla


def test_contiguous_policy_with_native_allocate_slots_matches_its_python_path(monkeypatch):
    """Under ``allocation="contiguous"`` the native path does what the policy's manager
    hooks do (expected length, the table's context for the pool's allocation): every
    step equals the same policy with ``KVPOOL_PYTHON_MANAGER=1`` (vLLM's Python
    through the hooks, the pool finding each table in the frames). The calls the
    native path hands to vLLM's ``allocate_slots`` (waiting requests, new hits) give
    the pool the table up front: no frame walk."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool import block_pool

    walks = []
    walk = block_pool.table_of_caller
    monkeypatch.setattr(block_pool, "table_of_caller", lambda frame: walks.append(1) or walk(frame))
    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install(allocation="contiguous")
    assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots
    python_path = _scheduler_trace(600, 300, SEED + 1)
    kvpool.uninstall()
    assert walks
    monkeypatch.delenv("KVPOOL_PYTHON_MANAGER")
    kvpool.install(allocation="contiguous")
    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    fast, slow = _calls()
    del walks[:]
    native = _scheduler_trace(600, 300, SEED + 1)
    fast_after, slow_after = _calls()
    assert fast_after - fast > 3 * (slow_after - slow) >= (0 if _admissions_native() else 1)
    assert walks == []
    for i, (a, b) in enumerate(zip(python_path, native)):
        assert a == b, f"step {i}"


def test_a_patched_request_property_sends_calls_to_vllm(monkeypatch):
    """``Request.num_tokens`` patched after install (a property that counts its reads):
    vLLM's allocate_slots reads it more often than the native arithmetic would, so the
    call is vLLM's and the property sees vLLM's reads."""
    from vllm.v1.request import Request

    kvpool.install()
    original = Request.num_tokens
    counts = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(64)
        req = _running(manager)
        seen: list = []
        with monkeypatch.context() as m:
            m.setattr(Request, "num_tokens", property(lambda self: seen.append(1) or original.fget(self)))
            fast, slow = _calls()
            assert _summary(manager, allocate_slots(manager, req, 1)) == (True, [[]])
            if allocate_slots is _core.kv_cache_manager_allocate_slots:
                assert _calls() == (fast, slow + 1)
        counts.append(len(seen))
    assert counts[0] == counts[1] > 0


@pytest.mark.parametrize("where", ["class", "base class"])
def test_a_property_added_over_an_instance_attribute_sends_calls_to_vllm(monkeypatch, where):
    """A data descriptor added after install to a class whose instances the native path
    reads (a property over ``FullAttentionManager``'s ``block_size`` that counts its
    reads, on the class or on its base) hides the instance's value, and vLLM's code
    reads through it as often as it reads the attribute: the call is vLLM's, with its
    result; once the property is gone the call is native again."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    fast, slow = _calls()
    manager.allocate_slots(req, 1)
    assert _calls() == (fast + 1, slow)
    reads = []

    def block_size(self):
        reads.append(1)
        return self.__dict__["block_size"]

    cls = FullAttentionManager if where == "class" else SingleTypeKVCacheManager
    with monkeypatch.context() as m:
        m.setattr(cls, "block_size", property(block_size), raising=False)
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert reads and _calls() == (fast + 1, slow + 1)
    manager.allocate_slots(req, 1)
    assert _calls() == (fast + 2, slow + 1)


@pytest.mark.parametrize("copied", ["manager", "coordinator", "single-type manager", "pool", "request"])
def test_copying_an_object_keeps_calls_native(copied):
    """``copy.copy`` of an object the native path reads (a test's snapshot, a plugin's):
    ``copyreg`` stores ``__slotnames__`` on its class the first time, a class attribute
    neither vLLM's mirrored code nor the native path reads. The next call stays native
    (before, the class re-check counted it as a changed class and every later call in
    the process was vLLM's)."""
    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    obj = {"manager": manager, "coordinator": manager.coordinator,
           "single-type manager": manager.coordinator.single_type_managers[0],
           "pool": manager.block_pool, "request": req}[copied]
    with copied_once(obj):
        fast, slow = _calls()
        manager.allocate_slots(req, 1)
        assert _calls() == (fast + 1, slow)


class _VllmsOnTheClass:
    """A callable descriptor that gives vLLM's function when read from the class (what
    ``getattr(cls, name)`` and ``inspect`` see; recorded in ``class_reads`` when given)
    and a wrapper recording the function's name in ``reads`` on an instance."""

    def __init__(self, original, reads, class_reads=None):
        self.original, self.reads, self.class_reads = original, reads, class_reads

    def __call__(self, *args):
        pass

    def __get__(self, obj, cls=None):
        if obj is None:
            if self.class_reads is not None:
                self.class_reads.append("read from the class")
            return self.original
        original, reads = self.original, self.reads
        return lambda *a, **k: (reads.append(original.__name__), original(obj, *a, **k))[1]


class _CountingDescriptor:
    """A callable descriptor that counts its reads from instances and returns the
    instance's own value of ``name``."""

    def __init__(self, name, reads):
        self.name, self.reads = name, reads

    def __call__(self, *args):
        pass

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        self.reads.append(self.name)
        return obj.__dict__[self.name]


class _Hidden(_CountingDescriptor):
    """A data descriptor to CPython (its type's set slot is filled by ``__set__ = None``)
    though ``getattr(type, "__set__")`` is None."""

    __set__ = None


class _LaterData(_CountingDescriptor):
    """A non-data descriptor whose type gains ``__set__`` once it is on the class (no
    version tag of a checked class changes then)."""


class _Unbound:
    """A lazy proxy whose ``__class__`` raises while unbound (as werkzeug's does)."""

    @property
    def __class__(self):
        raise RuntimeError("proxy not bound")


@pytest.mark.parametrize("case", ["hidden data descriptor", "__set__ added later", "__getattribute__",
                                  "method descriptor", "unrelated proxy"])
def test_what_a_class_gains_after_install_gets_vllms_call(monkeypatch, case):
    """Attributes added after install to ``FullAttentionManager`` that change what an
    instance read returns without being a plain property (a data descriptor by its type's
    slot only; a descriptor whose type gains ``__set__`` after it is on the class; a
    ``__getattribute__``; a callable descriptor that gives vLLM's function on the class and
    a wrapper on an instance), and an unrelated attribute whose own code raises when
    inspected: the call is vLLM's, with vLLM's reads and result, and nothing of the
    attribute's code runs in kvpool's check."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    kvpool.install()
    results = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(64)
        req = _running(manager)
        manager.allocate_slots(req, 1)
        reads: list = []
        with monkeypatch.context() as m:
            if case == "hidden data descriptor":
                m.setattr(FullAttentionManager, "block_size", _Hidden("block_size", reads), raising=False)
            elif case == "__set__ added later":
                m.setattr(FullAttentionManager, "block_size", _LaterData("block_size", reads), raising=False)
                allocate_slots(manager, req, 1)   # (the class re-checked with it in place)
                m.setattr(_LaterData, "__set__", lambda self, obj, value: None, raising=False)
            elif case == "__getattribute__":
                def getattribute(self, name):
                    reads.append(name)
                    return object.__getattribute__(self, name)

                m.setattr(FullAttentionManager, "__getattribute__", getattribute, raising=False)
            elif case == "method descriptor":   # (vLLM reads it from instances only)
                m.setattr(FullAttentionManager, "allocate_new_blocks",
                          _VllmsOnTheClass(FullAttentionManager.allocate_new_blocks, reads, class_reads=reads))
            else:
                m.setattr(FullAttentionManager, "some_unrelated_attr", _Unbound(), raising=False)
            fast, slow = _calls()
            blocks = allocate_slots(manager, req, 30)
            if allocate_slots is _core.kv_cache_manager_allocate_slots:
                assert _calls() == (fast, slow + 1), case
        results.append((_summary(manager, blocks), sorted(set(reads))))
    assert results[0] == results[1]
    assert case == "unrelated proxy" or results[0][1], "vLLM's code read nothing through the attribute"
    # (kvpool's re-check compares the attributes before it resolves any: vLLM's code reads
    # the method from instances only, and so do kvpool's checks, in either run)
    assert "read from the class" not in results[0][1]


def test_a_descriptor_placed_before_install_keeps_vllms_python(monkeypatch):
    """A mirrored method replaced before install by a descriptor that reads as vLLM's
    function on the class and wraps it on an instance: the fingerprints read the
    classes' own dicts, not ``getattr``, so neither native path binds and the wrapper
    sees vLLM's calls. The unitary and hybrid fingerprints match again once it is gone."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from kvpool import vllm_compat
    from kvpool.patches import hybrid_fast_path as hfp, manager_fast_path as fp

    release = vllm_compat.release_traits().version
    known_hybrid = hfp.KNOWN_HYBRID_SOURCES.get(release)
    reads: list = []
    original = FullAttentionManager.allocate_new_blocks
    with monkeypatch.context() as m:
        m.setattr(FullAttentionManager, "allocate_new_blocks", _VllmsOnTheClass(original, reads))
        assert FullAttentionManager.allocate_new_blocks is original   # (what getattr sees)
        assert fp.matching_release() is None
        if known_hybrid:
            assert hfp.hybrid_fingerprint() != known_hybrid
        kvpool.install()
        try:
            assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots
            manager = _manager(64)
            req = _running(manager)
            manager.allocate_slots(req, 30)
            assert reads == ["allocate_new_blocks"] * 2
        finally:
            kvpool.uninstall()
    assert fp.matching_release() == release
    assert not known_hybrid or hfp.hybrid_fingerprint() == known_hybrid


class _Booby:
    """An object whose attribute reads (``__func__``, ``__code__``, ``__class__``, ...)
    are recorded and raise."""

    def __init__(self, reads):
        object.__setattr__(self, "_reads", reads)

    def __getattribute__(self, name):
        object.__getattribute__(self, "_reads").append(name)
        raise RuntimeError(f"read {name}")


def test_a_foreign_object_in_a_mirrored_method_s_place_is_refused_unread(monkeypatch):
    """The fingerprints refuse an object that is not a function, a classmethod or
    staticmethod of one, a property or a class in a mirrored name's place without reading
    any of its attributes (an error from its code would otherwise leave ``install()``)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from kvpool.patches import hybrid_fast_path as hfp, manager_fast_path as fp

    reads: list = []
    monkeypatch.setattr(FullAttentionManager, "allocate_new_blocks", _Booby(reads))
    assert fp.matching_release() is None
    hfp.hybrid_fingerprint()
    assert reads == []
    kvpool.install()
    assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots


def _raising_tuple_defaults(func):
    class T(tuple):
        def __bool__(self):
            raise RuntimeError("__bool__ ran")

        def __len__(self):
            raise RuntimeError("__len__ ran")

    return T(func.__defaults__)


@pytest.mark.parametrize("edit", ["foreign globals", "__getattribute__", "defaults tuple subclass",
                                  "module subclass", "staticmethod", "classmethod", "bound method",
                                  "fake kvpool marker", "wrapped property getter"])
def test_edits_before_install_that_the_source_text_does_not_show_are_refused(monkeypatch, edit):
    """An adversarial run's edits made before install that keep every mirrored source's
    text: the same code with other globals, an attribute hook on a mirrored class, a
    defaults tuple of another type (whose methods raise), a module of another class
    whose attribute reads give vLLM's function, vLLM's own function put back as a
    staticmethod / classmethod / bound method, a foreign wrapper carrying kvpool's
    ``__kvpool_wrapped__`` attribute, a property whose getter is wrapped with
    ``functools.wraps``. Each one refuses the release without running the edit's code
    (``matching_release()`` None, ``install()`` keeps vLLM's ``allocate_slots``), and the
    release matches again once it is undone."""
    import functools
    import types

    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager
    from vllm.v1.request import Request

    from kvpool import vllm_compat
    from kvpool.patches import manager_fast_path as fp

    release = vllm_compat.release_traits().version
    ran: list = []
    f = FullAttentionManager.get_num_blocks_to_allocate
    with monkeypatch.context() as m:
        if edit == "foreign globals":
            g = dict(f.__globals__, cdiv=lambda a, b: (ran.append("cdiv"), -(-a // b) + 100)[1])
            m.setattr(FullAttentionManager, "get_num_blocks_to_allocate",
                      types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__))
        elif edit == "__getattribute__":
            def getattribute(self, name):
                return object.__getattribute__(self, name)

            m.setattr(FullAttentionManager, "__getattribute__", getattribute, raising=False)
        elif edit == "defaults tuple subclass":
            func = KVCacheManager.allocate_slots
            m.setattr(func, "__defaults__", _raising_tuple_defaults(func))
        elif edit == "module subclass":
            class Module(types.ModuleType):
                pass

            m.setattr(kv_cache_coordinator, "__class__", Module)
        elif edit in ("staticmethod", "classmethod"):
            m.setattr(FullAttentionManager, "get_num_blocks_to_allocate", {"staticmethod": staticmethod,
                                                                           "classmethod": classmethod}[edit](f))
        elif edit == "bound method":
            m.setattr(FullAttentionManager, "get_num_blocks_to_allocate", types.MethodType(f, object()))
        elif edit == "fake kvpool marker":
            original = SingleTypeKVCacheManager.allocate_new_blocks

            def traced(self, *args, **kwargs):
                ran.append("traced")
                return original(self, *args, **kwargs)

            traced.__wrapped__ = traced.__kvpool_wrapped__ = original
            m.setattr(SingleTypeKVCacheManager, "allocate_new_blocks", traced)
        else:
            getter = Request.num_tokens.fget
            m.setattr(Request, "num_tokens", property(functools.wraps(getter)(lambda self: getter(self))))
        assert fp.matching_release() is None
        kvpool.install()
        try:
            assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots
        finally:
            kvpool.uninstall()
    assert ran == []
    assert fp.matching_release() == release


def test_a_staticmethod_put_over_a_mirrored_method_after_install_sends_calls_to_vllm(monkeypatch):
    """vLLM's own function set back as a staticmethod after install resolves, through
    ``getattr``, to the same function; the class re-check keeps classmethod and
    staticmethod objects, so the call is vLLM's (which then raises, as it does
    without kvpool)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    kvpool.install()
    manager = _manager(64)
    req = _running(manager)
    f = FullAttentionManager.get_num_blocks_to_allocate
    monkeypatch.setattr(FullAttentionManager, "get_num_blocks_to_allocate", staticmethod(f))
    fast, slow = _calls()
    with pytest.raises(TypeError):
        manager.allocate_slots(req, 30)
    assert _calls() == (fast, slow + 1)


@pytest.fixture
def abc_registry():
    """Undo ABC registrations of vLLM's single-type managers (``register()`` has no
    inverse but CPython's ``_abc_registry_clear``, for tests)."""
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager, MambaManager

    yield
    for cls in (CrossAttentionManager, MambaManager):
        cls._abc_registry_clear()
        cls._abc_caches_clear()


@pytest.mark.parametrize("when", ["after install", "before install"])
def test_a_manager_registered_as_a_virtual_subclass_gets_vllms_call(abc_registry, when):
    """``CrossAttentionManager.register(FullAttentionManager)``: vLLM's coordinator then
    sizes the full-attention group as cross-attention (by the encoder tokens, 0 here:
    no block), which the native arithmetic does not do. After install the call is
    vLLM's (the ABC cache token moved); before install the native path is not bound.
    Registering an unrelated class leaves the native path on."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager, FullAttentionManager

    class Unrelated:
        pass

    if when == "before install":
        CrossAttentionManager.register(FullAttentionManager)
        kvpool.install()
        assert KVCacheManager.allocate_slots is not _core.kv_cache_manager_allocate_slots
        return
    kvpool.install()
    results = []
    for allocate_slots in (_vanilla_allocate_slots(), _core.kv_cache_manager_allocate_slots):
        manager = _manager(64)
        req = _running(manager)
        CrossAttentionManager.register(Unrelated)
        fast, slow = _calls()
        allocate_slots(manager, req, 1)
        if allocate_slots is _core.kv_cache_manager_allocate_slots:
            assert _calls() == (fast + 1, slow)   # (an unrelated registration: native)
        CrossAttentionManager.register(FullAttentionManager)
        fast, slow = _calls()
        blocks = allocate_slots(manager, req, 40)
        if allocate_slots is _core.kv_cache_manager_allocate_slots:
            assert _calls() == (fast, slow + 1)
        results.append(_summary(manager, blocks))
        CrossAttentionManager._abc_registry_clear()
        CrossAttentionManager._abc_caches_clear()
    assert results[0] == results[1]


def test_an_attribute_whose_code_raises_when_inspected_does_not_stop_install(monkeypatch):
    """kvpool's snapshot of the classes at install runs none of their attributes' code:
    an unbound lazy proxy on ``FullAttentionManager`` before install leaves install and
    the native path as they are."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    monkeypatch.setattr(FullAttentionManager, "some_unrelated_attr", _Unbound(), raising=False)
    kvpool.install()
    assert KVCacheManager.allocate_slots is _core.kv_cache_manager_allocate_slots
    manager = _manager(64)
    req = _running(manager)
    fast, slow = _calls()
    manager.allocate_slots(req, 1)
    assert _calls() == (fast + 1, slow)


def test_the_table_given_to_vllm_s_call_is_its_request_s_and_is_cleared_after_it(monkeypatch):
    """Under ``allocation="contiguous"`` a call the native path hands to vLLM's
    ``allocate_slots`` (a new request's) tells the pool the table up front: the
    policy's ``extend_table`` gets the manager's one group and the request, the pool
    its expected length (prompt + max_tokens). The pool's context is cleared after the
    call, also when an allocation raises; a request of another class is found in the
    frames, as before."""
    from vllm.v1.request import Request

    from kvpool import block_pool
    from kvpool.allocation.contiguous import ContiguousPolicy

    walks, seen = [], []
    walk = block_pool.table_of_caller
    monkeypatch.setattr(block_pool, "table_of_caller", lambda frame: walks.append(1) or walk(frame))
    extend = ContiguousPolicy.extend_table

    def extend_table(self, pool, num_blocks, manager, request_id):
        seen.append((manager, request_id, self.expected_tokens.get(request_id)))
        if request_id == "boom":
            raise RuntimeError("boom")
        return extend(self, pool, num_blocks, manager, request_id)

    monkeypatch.setattr(ContiguousPolicy, "extend_table", extend_table)
    kvpool.install(allocation="contiguous")
    try:
        manager = _manager(64)
        mgr = manager.coordinator.single_type_managers[0]
        pool = manager.block_pool
        fast, slow = _calls()
        req = make_request("a", list(range(1, 41)), max_tokens=100, block_size=BLOCK_SIZE)
        assert manager.allocate_slots(req, 40) is not None
        assert _calls() == (fast, slow + 1)   # vLLM's call (a new request)
        assert seen == [(mgr, "a", 140)] and walks == [] and pool._table_context is None
        boom = make_request("boom", list(range(1, 41)), max_tokens=8, block_size=BLOCK_SIZE)
        with pytest.raises(RuntimeError, match="boom"):
            manager.allocate_slots(boom, 40)
        assert seen[-1] == (mgr, "boom", 48) and walks == [] and pool._table_context is None

        class OtherRequest(Request):
            pass

        other = make_request("b", list(range(1, 41)), max_tokens=100, block_size=BLOCK_SIZE)
        other.__class__ = OtherRequest
        assert manager.allocate_slots(other, 40) is not None
        assert seen[-1] == (mgr, "b", 140) and len(walks) == 1 and pool._table_context is None
    finally:
        kvpool.uninstall()


@pytest.mark.parametrize("inner_kind", ["another request class", "an int request_id"])
def test_a_call_inside_vllm_s_call_does_not_take_the_outer_call_s_table(inner_kind):
    """A call to ``allocate_slots`` made while vLLM's call for another request runs (here
    from Python code vLLM's arithmetic runs: an int subclass's ``__add__``) and whose
    table the pool is not told (a request of another class, an id that is not a str)
    must not get the enclosing call's table: the pool finds its table in the frames, as
    without kvpool's context, and the outer request's table is the same as then."""
    from vllm.v1.request import Request

    from kvpool.allocation.base import table_of_caller
    from kvpool.allocation.contiguous import ContiguousPolicy

    class OtherRequest(Request):
        pass

    def tables(outer_walks: bool):
        seen = []
        extend = ContiguousPolicy.extend_table

        def extend_table(self, pool, num_blocks, manager, request_id):
            walk = table_of_caller(sys._getframe(2))
            seen.append((request_id, None if walk is None else walk[1]))
            return extend(self, pool, num_blocks, manager, request_id)

        ContiguousPolicy.extend_table = extend_table
        kvpool.install(allocation="contiguous")
        try:
            manager = _manager(64)
            inner = make_request("b", list(range(1, 41)), max_tokens=8, block_size=BLOCK_SIZE)
            if inner_kind == "an int request_id":
                inner.request_id = 7
            else:
                inner.__class__ = OtherRequest

            class Nesting(int):
                fired = False

                def __add__(self, other):
                    if not Nesting.fired:
                        Nesting.fired = True
                        manager.allocate_slots(inner, 40)
                    return int(self) + other

            outer = make_request("a", list(range(1, 41)), max_tokens=100, block_size=BLOCK_SIZE)
            if outer_walks:
                outer.__class__ = OtherRequest
            outer.num_computed_tokens = Nesting(0)
            assert manager.allocate_slots(outer, 40) is not None
            mgr = manager.coordinator.single_type_managers[0]
            assert manager.block_pool._table_context is None
            return seen, {rid: [b.block_id for b in blocks] for rid, blocks in mgr.req_to_blocks.items()}
        finally:
            kvpool.uninstall()
            ContiguousPolicy.extend_table = extend

    told, told_tables = tables(outer_walks=False)
    walked, walked_tables = tables(outer_walks=True)
    # every allocation extends the table the frames name (the inner one: b's, or none)
    # every allocation that extends a table extends the one the frames name (b's; an int
    # id names none: a plain allocation), a's once
    assert all(rid == walk for rid, walk in told) and [rid for rid, _ in told].count("a") == 1
    assert told == walked and told_tables == walked_tables and len(told_tables) == 2


def test_the_table_is_given_only_to_kvpool_s_own_pool_object():
    """A single-type manager whose ``block_pool`` is another object (a proxy that logs
    every attribute access) gets no table context: the proxy sees only what vLLM's call
    reads, and an error its ``__getattr__`` raises for kvpool's attributes cannot
    surface."""
    log = []

    class PoolProxy:
        def __init__(self, pool):
            object.__setattr__(self, "_pool", pool)

        def __getattr__(self, name):
            log.append(name)
            if name.startswith(("_kvpool", "_table")):
                raise RuntimeError(f"proxy: {name}")
            return getattr(object.__getattribute__(self, "_pool"), name)

        def __setattr__(self, name, value):
            log.append("set " + name)
            setattr(object.__getattribute__(self, "_pool"), name, value)

    kvpool.install(allocation="contiguous")
    try:
        manager = _manager(64)
        manager.coordinator.single_type_managers[0].block_pool = PoolProxy(manager.block_pool)
        req = make_request("a", list(range(1, 41)), max_tokens=100, block_size=BLOCK_SIZE)
        assert manager.allocate_slots(req, 40).get_block_ids() == ([1, 2, 3],)
    finally:
        kvpool.uninstall()
    assert "get_new_blocks" in log and not [n for n in log if "_kvpool" in n or "_table" in n]
