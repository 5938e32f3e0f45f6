"""``KVCacheManager.allocate_slots`` of a running request in one native call (a patch
module; issue 17).

What it replaces: in every engine step vLLM's scheduler calls
``KVCacheManager.allocate_slots`` once per running request
(``vllm/v1/core/kv_cache_manager.py``, vLLM 0.30.0-0.34.0). For a model with one
full-attention KV cache group (``UnitaryKVCacheCoordinator`` over one
``FullAttentionManager``: most dense models) and a running request (no new prefix hit,
no connector or encoder tokens), that call walks five Python layers (the manager, the
coordinator, the single-type manager, ``cdiv``, ``create_kv_cache_blocks``) to compute
how many blocks the request's next tokens need, usually none.

``kvpool._core.kv_cache_manager_allocate_slots`` (``src/kvpool/manager.pxi``) does that
arithmetic in C (with prefix caching off too: vLLM's ``KVCacheCoordinatorNoPrefixCache``
has the same allocation methods) and calls the pool's own ``get_new_blocks`` whenever a
block is allocated, so the pool, the tables and KV events change exactly as in vLLM
(the free count is read from kvpool's queue while ``get_num_free_blocks`` is vLLM's).
When blocks become full it caches them natively too (``kv_cache_coordinator_cache_blocks``,
also bound as ``UnitaryKVCacheCoordinator.cache_blocks``, which vLLM's ``allocate_slots``
calls for a new request): the four Python layers from the coordinator to
``BlockPool._insert_block_hash`` become one loop that sets each new full block's hash
and inserts it into kvpool's ``BlockHashToBlockMap``, for a pool without KV events
whose caching methods are vLLM's (with events, a block already hashed, a patched pool
method: vLLM's code). Beside it, a waiting request's prefix-cache lookup
(``KVCacheManager.get_computed_blocks`` -> the coordinator's and ``FullAttentionManager``'s
``find_longest_cache_hit`` -> ``BlockPool.get_cached_block``) is one native loop over the
request's block hashes (``kv_cache_manager_get_computed_blocks``, ``src/kvpool/lookup.pxi``).
Every other call goes to vLLM's ``allocate_slots`` unchanged: a waiting or preempted request, a
prefix hit, external or encoder tokens, ``full_sequence_must_fit``, a subclass of the
manager, a coordinator or single-type manager of any other type, a pending
copy-on-write block, an argument of another type than vLLM's scheduler passes, or any
of the methods it skips patched on the class or the instance (checked on every call;
classes through their attribute-cache version tag).

It is bound only where its arithmetic is vLLM's: the sources of the vLLM functions it
mirrors (:data:`MIRRORED`) and of the definitions whose data layout it reads and writes
(:data:`LAYOUT`: vLLM's ``BlockHashToBlockMap``, ``KVCacheBlocks``, the constructors of
the objects it reads) must hash to one of :data:`KNOWN_SOURCES` (vLLM 0.30.0-0.34.0,
each recorded after the differential tests passed in that release's environment; a
release whose functions differ keeps vLLM's ``allocate_slots``, with one info line),
and ``KVPOOL_PYTHON_MANAGER`` must not be on. What the releases do differently that the
native code acts on (the EAGLE group attribute the lookup reads, ``get_computed_blocks``'
``max_cache_hit_length``, ``cache_blocks``' test of ``prefix_cacheable``) it reads from
the release's :class:`kvpool.vllm_compat.VllmRelease`. Under a policy with manager hooks
(``allocation="contiguous"``: :mod:`kvpool.patches.manager_hooks`, applied before this
module) the native path does what those hooks do: it tells the policy the request's
expected length and runs the pool's allocation in the table's context. Hybrid models'
idle running steps: :mod:`kvpool.patches.hybrid_fast_path`. ``uninstall()`` puts vLLM's
methods back.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import logging
import types
from typing import Any

from kvpool import allocation, envs
from kvpool.patches import hybrid_fast_path
from kvpool.patches.sources import (
    _source,
    _vanilla,
    definitions_source,
    is_kvpool_wrapper,
    mark_kvpool_wrapper,
    unrelated_abc_pairs,
)

# Method names the native path skips, which must not be set on the instances (listed
# with the pool's in kvpool.vllm_calls).
from kvpool.vllm_calls import (
    COORDINATOR_NAMES as _COORDINATOR_NAMES,
    LOOKUP_COORDINATOR_NAMES as _LOOKUP_COORDINATOR_NAMES,
    LOOKUP_MANAGER_NAMES as _LOOKUP_MANAGER_NAMES,
    LOOKUP_SINGLE_TYPE_NAMES as _LOOKUP_SINGLE_TYPE_NAMES,
    MANAGER_NAMES as _MANAGER_NAMES,
    MAP_NAMES as _MAP_NAMES,
    POOL_NAMES as _POOL_NAMES,
    SINGLE_TYPE_NAMES as _SINGLE_TYPE_NAMES,
)
from kvpool.vllm_compat import VllmRelease, release_traits

logger = logging.getLogger("vllm.kvpool")

#: The vLLM functions whose behaviour the native path reproduces, as
#: ``(class name, method name)``; the class is where the call resolves
#: (``UnitaryKVCacheCoordinator``'s methods come from ``KVCacheCoordinator``);
#: ``block_pool`` / ``kv_cache_coordinator``: a function of that vLLM module's namespace
#: (``vllm.v1.core.block_pool``'s are the names its ``BlockPool`` calls); ``BlockPool``:
#: vLLM's class, which kvpool's pool inherits these methods from.
MIRRORED: tuple[tuple[str, str], ...] = (
    ("KVCacheManager", "allocate_slots"),
    ("KVCacheManager", "create_kv_cache_blocks"),
    ("KVCacheManager", "get_computed_blocks"),
    ("KVCacheManager", "prefix_cache_lookup_enabled"),
    ("UnitaryKVCacheCoordinator", "remove_skipped_blocks"),
    ("UnitaryKVCacheCoordinator", "get_num_blocks_to_allocate"),
    ("UnitaryKVCacheCoordinator", "allocate_new_computed_blocks"),
    ("UnitaryKVCacheCoordinator", "allocate_new_blocks"),
    ("UnitaryKVCacheCoordinator", "cache_blocks"),
    ("UnitaryKVCacheCoordinator", "get_num_cacheable_tokens"),
    ("UnitaryKVCacheCoordinator", "get_replay_boundaries"),
    ("UnitaryKVCacheCoordinator", "find_longest_cache_hit"),
    ("FullAttentionManager", "remove_skipped_blocks"),
    ("FullAttentionManager", "get_num_skipped_tokens"),
    ("FullAttentionManager", "get_num_blocks_to_allocate"),
    # (its branch for a request without a num_cached_block entry: prefix caching off)
    ("FullAttentionManager", "_get_num_evictable_blocks"),
    ("FullAttentionManager", "_has_partial_local_hit"),
    ("FullAttentionManager", "allocate_new_blocks"),
    ("FullAttentionManager", "cache_blocks"),
    ("FullAttentionManager", "reachable_block_mask"),
    ("FullAttentionManager", "find_longest_cache_hit"),
    ("SingleTypeKVCacheManager", "cache_blocks"),
    # What the native cache_blocks reproduces below the single-type manager:
    ("BlockPool", "cache_full_blocks"),
    ("BlockPool", "_insert_block_hash"),
    # ... and what the native eviction of kvpool's pool_get_new_blocks does:
    ("BlockPool", "_maybe_evict_cached_block"),
    ("BlockPool", "_remove_cached_block_hashes"),
    ("BlockPool", "_emit_block_removed_events"),
    ("block_pool", "make_block_hash_with_group_id"),
    ("block_pool", "resolve_block_hashes"),
    ("kv_cache_coordinator", "replay_boundaries"),
    # ... and what the native get_computed_blocks does (lookup.pxi):
    ("BlockPool", "get_cached_block"),
    ("single_type_kv_cache_manager", "resolve_block_hashes"),
    # ... and the free count the native allocate_slots reads from kvpool's queue:
    ("BlockPool", "get_num_free_blocks"),
)

#: The vLLM definitions whose data layout the native code reads or writes directly, as
#: ``(class name, attribute)`` (``None``: the whole class's source; a property: its
#: getter), fingerprinted after :data:`MIRRORED`: vLLM's ``BlockHashToBlockMap``, whose
#: ``_cache`` dict (hash key -> block, or -> {block id: block}) the native caching,
#: eviction and lookup read and write (``manager.pxi``, ``alloc.pxi``, ``lookup.pxi``);
#: ``KVCacheBlocks``, which they build (``KVCacheBlocks((blocks,))``) and read
#: (``.blocks``); and the constructors that define the attributes they read: the
#: request's (``request_id``, ``status``, ``num_computed_tokens``,
#: ``num_in_flight_tokens``, ``num_prompt_tokens``, ``block_hashes``,
#: ``skip_reading_prefix_cache``, ``max_tokens``; ``num_tokens``), the manager's, the
#: coordinators' (with and without prefix caching), the single-type manager's and vLLM's
#: pool's.
LAYOUT: tuple[tuple[str, str | None], ...] = (
    ("BlockHashToBlockMap", None),
    ("KVCacheBlocks", None),
    ("Request", "__init__"),
    ("Request", "num_tokens"),
    ("KVCacheManager", "__init__"),
    ("KVCacheCoordinator", "__init__"),
    ("UnitaryKVCacheCoordinator", "__init__"),
    ("KVCacheCoordinatorNoPrefixCache", "__init__"),
    ("FullAttentionManager", "__init__"),
    ("BlockPool", "__init__"),
)

#: sha256 of :func:`mirrored_source` per vLLM release whose functions the native path
#: was written against, each recorded after tests/integration/test_manager_*.py and
#: test_scheduler_differential.py passed in that release's environment (docs/porting.md);
#: what the releases do differently is read from their ``VllmRelease`` traits.
KNOWN_SOURCES: dict[str, str] = {
    "0.34.0": "8e16be4750fd851913627b844a4bf8ef810ea6ee5cda294113234c7efd615ba2",
    "0.33.0": "38459ee6ed61080082fb68786889f86a8ff92d3a57c9d31d850ac33e9863dd8e",
    "0.32.0": "016296bb7e88e52624424b8a8d047db8ad94374c3368f59a37b96233e1e7a8bb",
    "0.31.0": "5adddf0e5f6be9a5b2bbf508e486703f73e4e764ad8ee3050c60e28b4667402d",
    "0.30.0": "867d473383857978f4f077040a5f97fbe79a878a8a3b9b90dbf1473ecbd5420c",
}

#: sha256 of the source of ``KVCacheBlocks.get_block_ids`` per release whose function
#: ``kvpool._core.kv_cache_blocks_get_block_ids`` compiles (bound beside the above).
KNOWN_GET_BLOCK_IDS: dict[str, str] = {
    "0.34.0": "81cfa55cf5e02cbd46e75d513bd0b1b066022853dc895fae7be7946d94751f6e",
    "0.33.0": "81cfa55cf5e02cbd46e75d513bd0b1b066022853dc895fae7be7946d94751f6e",
    "0.32.0": "81cfa55cf5e02cbd46e75d513bd0b1b066022853dc895fae7be7946d94751f6e",
    "0.31.0": "81cfa55cf5e02cbd46e75d513bd0b1b066022853dc895fae7be7946d94751f6e",
    "0.30.0": "9a4a06f57067c85dc08e93c1e28ed9bfd604c4d9fecb31f857543cff484e69b0",
}

#: ... and of ``KVCacheManager.get_num_cached_tokens`` (vLLM >= 0.34.0's cache-aware
#: admission probe), which ``kv_cache_manager_get_num_cached_tokens`` mirrors (it calls what
#: ``get_computed_blocks`` calls, which :data:`MIRRORED` and the hybrid fingerprint cover).
KNOWN_NUM_CACHED_TOKENS: dict[str, str] = {
    "0.34.0": "46f224b70af6321f1cc3639017e8a3bf9a2359e39628020474d1cd5d196b56dc",
}

# The methods kvpool binds (not checked to be vLLM's: they are kvpool's once bound).
_BOUND = (("KVCacheManager", "allocate_slots"), ("KVCacheManager", "get_computed_blocks"))


def _classes() -> dict[str, Any]:
    from vllm.v1 import request
    from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager, single_type_kv_cache_manager

    from kvpool.block_hash_map import VllmBlockHashToBlockMap
    from kvpool.block_pool import VllmBlockPool

    return {
        "KVCacheManager": kv_cache_manager.KVCacheManager,
        "UnitaryKVCacheCoordinator": kv_cache_coordinator.UnitaryKVCacheCoordinator,
        "KVCacheCoordinatorNoPrefixCache": getattr(kv_cache_coordinator, "KVCacheCoordinatorNoPrefixCache", None),
        "FullAttentionManager": single_type_kv_cache_manager.FullAttentionManager,
        "SingleTypeKVCacheManager": single_type_kv_cache_manager.SingleTypeKVCacheManager,
        "BlockPool": VllmBlockPool,
        # vLLM's map (install() binds kvpool's subclass, which overrides its accessors,
        # as block_pool.BlockHashToBlockMap)
        "BlockHashToBlockMap": VllmBlockHashToBlockMap,
        "KVCacheBlocks": kv_cache_manager.KVCacheBlocks,
        "KVCacheCoordinator": kv_cache_coordinator.KVCacheCoordinator,
        "Request": request.Request,
        "block_pool": block_pool,
        "kv_cache_coordinator": kv_cache_coordinator,
        "single_type_kv_cache_manager": single_type_kv_cache_manager,
    }


#: MIRRORED's classes that every native call checks (through their version tags); vLLM's
#: ``BlockPool`` methods (through kvpool's pool) and the module functions are checked
#: by the native cache_blocks, which alone skips them.
_CHECKED_CLASSES = ("KVCacheManager", "UnitaryKVCacheCoordinator", "FullAttentionManager",
                    "SingleTypeKVCacheManager")


def _bound_function(cls: type, name: str):
    """What ``cls.name`` resolves to, a classmethod by the function it binds."""
    attr = getattr(cls, name, None)
    return getattr(attr, "__func__", attr)


def _foreign_wrapper(attr) -> bool:
    """``attr`` wraps another function (``__wrapped__``) and is not kvpool's wrapper."""
    func = getattr(attr, "__func__", attr)
    return hasattr(func, "__wrapped__") and not is_kvpool_wrapper(func)


def mirrored_source(classes: dict[str, type] | None = None) -> str:
    """:func:`definitions_source` of :data:`MIRRORED`, then :data:`LAYOUT`."""
    return definitions_source(MIRRORED + LAYOUT, classes or _classes())


def source_fingerprint(classes: dict[str, type] | None = None) -> str:
    """sha256 (hex) of :func:`mirrored_source`."""
    return hashlib.sha256(mirrored_source(classes).encode()).hexdigest()


def matching_release(classes: dict[str, type] | None = None) -> str | None:
    """The release of :data:`KNOWN_SOURCES` whose mirrored sources the installed vLLM
    has, or None (sources differ or cannot be read)."""
    try:
        fingerprint = source_fingerprint(classes)
    except (OSError, TypeError):
        return None
    for release, known in KNOWN_SOURCES.items():
        if known and known == fingerprint:
            return release
    return None


def method_fingerprint(cls: type, name: str) -> str | None:
    """sha256 (hex) of the installed ``cls.name`` source (dedented; kvpool's wrapper seen
    through), or None where there is none or it cannot be read."""
    func = _vanilla(cls, name)
    try:
        source = _source(func) if func is not None else None
    except (OSError, TypeError):
        source = None
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()


def get_block_ids_fingerprint(kv_cache_blocks: type | None = None) -> str | None:
    """:func:`method_fingerprint` of the installed ``KVCacheBlocks.get_block_ids``."""
    if kv_cache_blocks is None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks as kv_cache_blocks
    return method_fingerprint(kv_cache_blocks, "get_block_ids")


def _bind_get_block_ids(patcher, kv_cache_blocks: type) -> None:
    """``kv_cache_blocks_get_block_ids`` as ``KVCacheBlocks.get_block_ids`` where the
    installed source is one it compiles (:data:`KNOWN_GET_BLOCK_IDS`)."""
    from kvpool import _core

    patcher.require(kv_cache_blocks, "get_block_ids")
    fingerprint = get_block_ids_fingerprint(kv_cache_blocks)
    if fingerprint is not None and fingerprint in KNOWN_GET_BLOCK_IDS.values():
        fast_ids = _core.kv_cache_blocks_get_block_ids
        mark_kvpool_wrapper(fast_ids, kv_cache_blocks.get_block_ids)
        patcher.set_attr(kv_cache_blocks, "get_block_ids", fast_ids)


def _bind_cache_blocks(patcher, classes: dict[str, Any]) -> bool:
    """``kv_cache_coordinator_cache_blocks`` as ``UnitaryKVCacheCoordinator.cache_blocks``
    (vLLM's ``allocate_slots`` calls it for a waiting request, the native path for a
    running one) while kvpool's pool inherits vLLM's caching methods unwrapped; True
    when bound (the native cache_blocks is then armed too)."""
    from kvpool import _core
    from kvpool.block_pool import BlockPool

    if not all(getattr(BlockPool, n, None) is _vanilla(classes["BlockPool"], n) for n in _POOL_NAMES):
        return False
    coordinator_cls = classes["UnitaryKVCacheCoordinator"]
    fast_cache = _core.kv_cache_coordinator_cache_blocks
    mark_kvpool_wrapper(fast_cache, coordinator_cls.cache_blocks)
    patcher.set_attr(coordinator_cls, "cache_blocks", fast_cache)
    return True


def _no_prefix_cache_coordinator(classes: dict[str, Any]):
    """vLLM's ``KVCacheCoordinatorNoPrefixCache`` (the coordinator of every model when
    prefix caching is off) when each coordinator method the native allocate_slots
    skips is the vLLM function ``UnitaryKVCacheCoordinator`` has (the fingerprinted
    one), else None (its calls stay vLLM's)."""
    cls = classes.get("KVCacheCoordinatorNoPrefixCache")
    unitary = classes["UnitaryKVCacheCoordinator"]
    if cls is None:
        return None
    for name in _COORDINATOR_NAMES:
        if _bound_function(cls, name) is not _bound_function(unitary, name) \
                and _bound_function(cls, name) is not _vanilla(unitary, name):
            return None
    return cls


#: Module functions the mirrored methods call only with KV events on (the native caching
#: runs with events off) or that the native path reads itself on every call.
#: (``generate_block_hash_extra_keys``: up to 0.32.0 ``cache_full_blocks`` calls it for
#: its stored-block event; 0.33.0 through ``self._generate_event_extra_keys``.)
_EVENTS_ONLY_GLOBALS = ("maybe_convert_block_hash", "get_block_hash", "get_group_id",
                        "generate_block_hash_extra_keys")


def mirrored_globals(classes: dict[str, Any]) -> tuple[tuple[dict, str, Any], ...]:
    """``(namespace dict, name, function)`` of every plain function that a mirrored
    method reads from its module's namespace (vLLM's source, ``inspect.getclosurevars``):
    ``cdiv``, ``resolve_block_hashes``, ...; patched there after install, the native path
    hands its calls to vLLM's code. Events-only helpers are left out."""
    found: dict[tuple[int, str], tuple[dict, str, Any]] = {}
    for c, n in MIRRORED:
        if c in _MODULES:
            continue
        func = _vanilla(classes[c], n)
        func = getattr(func, "__func__", func)
        if not isinstance(func, types.FunctionType):
            continue
        for name, value in inspect.getclosurevars(func).globals.items():
            if isinstance(value, types.FunctionType) and name not in _EVENTS_ONLY_GLOBALS:
                found[(id(func.__globals__), name)] = (func.__globals__, name, value)
    return tuple(found.values())


def _module_checks(classes: dict[str, Any]) -> tuple[tuple, tuple]:
    """``(module_functions, step_globals)`` for the native path: MIRRORED's module
    functions (checked by the native caching, eviction and lookup), and every function
    the mirrored methods read from their modules (:func:`mirrored_globals`), checked by
    every native call: vLLM calls some on every step even where nothing is cached
    (``replay_boundaries`` through ``cache_blocks``)."""
    module_functions = tuple((vars(classes[c]), n, getattr(classes[c], n)) for c, n in MIRRORED
                             if c in _MODULES and hasattr(classes[c], n))
    return module_functions, mirrored_globals(classes)


#: MIRRORED's entries that are functions of a vLLM module's namespace.
_MODULES = ("block_pool", "kv_cache_coordinator", "single_type_kv_cache_manager")


def _bind_get_computed_blocks(patcher, classes: dict[str, Any], traits: VllmRelease) -> None:
    """``kv_cache_manager_get_computed_blocks`` as ``KVCacheManager.get_computed_blocks``
    (a waiting request's prefix-cache lookup; it reads the map the native caching
    writes, so it is bound only beside it)."""
    from kvpool import _core

    manager_cls = classes["KVCacheManager"]
    module = classes["single_type_kv_cache_manager"]
    vanilla = manager_cls.get_computed_blocks
    # (get_num_cached_tokens: where the installed function is the release's known one)
    known = KNOWN_NUM_CACHED_TOKENS.get(traits.version)
    num_cached = manager_cls.get_num_cached_tokens if known and known == method_fingerprint(
        manager_cls, "get_num_cached_tokens") and not _foreign_wrapper(manager_cls.get_num_cached_tokens) else None
    _core.configure_prefix_lookup(
        vanilla=vanilla,
        # what FullAttentionManager.find_longest_cache_hit asserts its spec is
        lookup_specs=(module.FullAttentionSpec, module.ChunkedLocalAttentionSpec),
        eagle_attr=traits.eagle_group_ids_attr,
        takes_max_length=traits.lookup_takes_max_length,
        prefix_cache_hit_limit=traits.prefix_cache_hit_limit,
        manager_names=_LOOKUP_MANAGER_NAMES,
        coordinator_names=_LOOKUP_COORDINATOR_NAMES,
        single_type_names=_LOOKUP_SINGLE_TYPE_NAMES,
        num_cached=num_cached,
    )
    lookup = _core.kv_cache_manager_get_computed_blocks
    mark_kvpool_wrapper(lookup, vanilla)
    patcher.set_attr(manager_cls, "get_computed_blocks", lookup)
    if num_cached is not None:
        probe = _core.kv_cache_manager_get_num_cached_tokens
        mark_kvpool_wrapper(probe, num_cached)
        patcher.set_attr(manager_cls, "get_num_cached_tokens", probe)


def _bindable_release(classes: dict[str, Any]) -> str | None:
    """The release of :data:`KNOWN_SOURCES` the installed vLLM's mirrored functions are,
    when none is wrapped by other code; else None, with one info line saying why."""
    release = matching_release(classes)
    if release is None:
        logger.info("kvpool: KVCacheManager.allocate_slots stays vLLM's Python: this vLLM's "
                    "allocate_slots and the methods it calls are not those of a release "
                    "kvpool's native path was checked against (%s)", ", ".join(KNOWN_SOURCES))
        return None
    foreign = [f"{c}.{n}" for c, n in MIRRORED if _foreign_wrapper(getattr(classes[c], n, None))]
    if foreign:
        # functools.wraps hides a wrapper from the fingerprint (inspect follows
        # __wrapped__), and the native path would skip what it adds.
        logger.info("kvpool: KVCacheManager.allocate_slots stays vLLM's Python: %s "
                    "wrapped by other code", ", ".join(foreign))
        return None
    return release


def apply(patcher) -> None:
    """Bind ``kvpool._core.kv_cache_manager_allocate_slots`` as
    ``KVCacheManager.allocate_slots``, ``kv_cache_coordinator_cache_blocks`` as
    ``UnitaryKVCacheCoordinator.cache_blocks`` and ``kv_cache_manager_get_computed_blocks``
    as ``KVCacheManager.get_computed_blocks`` when the installed vLLM's mirrored
    functions are a known release's and none is wrapped by other code (doing what the
    policy's manager hooks do, if it has them), and ``kv_cache_blocks_get_block_ids``
    when ``get_block_ids`` is (by ``kvpool.install()``; undone by ``uninstall()``)."""
    from kvpool import _core

    _core.disable_allocate_slots_fast_path()
    if envs.get(envs.PYTHON_MANAGER):
        return
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.request import RequestStatus

    _bind_get_block_ids(patcher, kv_cache_manager.KVCacheBlocks)
    classes = _classes()
    patcher.require(classes["KVCacheManager"], "allocate_slots", "create_kv_cache_blocks")
    release = _bindable_release(classes)
    if release is None:
        return
    traits = release_traits(release)
    manager_cls = classes["KVCacheManager"]
    coordinator_cls = classes["UnitaryKVCacheCoordinator"]
    from kvpool.block_hash_map import BlockHashToBlockMap
    from kvpool.block_pool import BlockPool

    vanilla_cache_blocks = coordinator_cls.cache_blocks
    native_cache = _bind_cache_blocks(patcher, classes)
    class_checks = [(classes[c], n, _bound_function(classes[c], n)) for c, n in MIRRORED
                    if c in _CHECKED_CLASSES and (c, n) not in _BOUND]
    class_checks.append((classes["Request"], "num_tokens", _bound_function(classes["Request"], "num_tokens")))
    no_prefix_cache_cls = _no_prefix_cache_coordinator(classes)
    if no_prefix_cache_cls is not None:
        class_checks += [(no_prefix_cache_cls, n, _bound_function(no_prefix_cache_cls, n))
                         for n in _COORDINATOR_NAMES if hasattr(no_prefix_cache_cls, n)]
    vanilla = manager_cls.allocate_slots
    module_functions, step_globals = _module_checks(classes)
    pairs = unrelated_abc_pairs()
    if type(pairs) is str:
        logger.info("kvpool: KVCacheManager.allocate_slots stays vLLM's Python: %s", pairs)
        return
    _core.configure_virtual_subclass_check(abc.get_cache_token, pairs)
    _core.configure_allocate_slots_fast_path(
        no_prefix_cache_cls=no_prefix_cache_cls,
        manager_cls=manager_cls,
        coordinator_cls=coordinator_cls,
        full_attention_cls=classes["FullAttentionManager"],
        vanilla=vanilla,
        waiting=RequestStatus.WAITING,
        preempted=RequestStatus.PREEMPTED,
        manager_module_dict=vars(kv_cache_manager),
        class_checks=class_checks,
        manager_names=_MANAGER_NAMES,
        coordinator_names=_COORDINATOR_NAMES,
        single_type_names=_SINGLE_TYPE_NAMES,
        manager_hooks=allocation.needs_manager_hooks(patcher.policy),
        pool_cls=BlockPool,
        hash_map_cls=BlockHashToBlockMap,
        pool_names=_POOL_NAMES,
        map_names=_MAP_NAMES,
        cache_checks=[(BlockPool, n, getattr(BlockPool, n, None)) for n in _POOL_NAMES]
        + [(BlockHashToBlockMap, n, getattr(BlockHashToBlockMap, n, None)) for n in _MAP_NAMES],
        native_cache=native_cache,
        check_prefix_cacheable=traits.cache_checks_prefix_cacheable,
        vanilla_cache_blocks=vanilla_cache_blocks,
        block_ids_map=traits.block_ids_map,
        module_functions=module_functions,
        step_globals=step_globals,
        request_cls=classes["Request"],
    )
    fast = _core.kv_cache_manager_allocate_slots
    mark_kvpool_wrapper(fast, vanilla)   # (inspect.signature() shows vLLM's)
    patcher.set_attr(manager_cls, "allocate_slots", fast)
    if native_cache:
        _bind_get_computed_blocks(patcher, classes, traits)
    hybrid_fast_path.bind(release, patcher)


__all__ = ["KNOWN_SOURCES", "LAYOUT", "MIRRORED", "apply", "matching_release", "mirrored_source", "source_fingerprint"]
