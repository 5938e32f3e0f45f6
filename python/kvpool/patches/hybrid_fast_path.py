"""The idle running step of a hybrid model natively (full attention beside sliding window
or Mamba / linear-attention groups).

Not a patch module of its own: :func:`kvpool.patches.manager_fast_path.apply` calls
:func:`bind` once it has bound the native ``KVCacheManager.allocate_slots``.

What it replaces: with more than one KV cache group vLLM's ``KVCacheManager`` runs
``HybridKVCacheCoordinator``, several single-type managers over one pool
(``vllm/v1/core/kv_cache_coordinator.py``, vLLM 0.34.0). A running request's decode
step usually changes nothing in any group: no group needs a new block, the sliding
window's last dropped block is already the null block, a Mamba group in
``mamba_cache_mode="align"`` keeps its running state block, every full block is cached.
vLLM still walks about fifteen Python calls across the coordinator and each group's
manager to find that out, and returns the manager's shared empty ``KVCacheBlocks``.
``kvpool._core.kv_cache_manager_allocate_slots`` (``src/kvpool/hybrid_step.pxi``)
recognises that step from the plain attributes vLLM's code reads and returns the same
object (or None where the watermark or reserved blocks refuse it, as vLLM's free-count
check does). Every step that allocates, frees, caches or copies a block, every group
of another manager type (chunked local, cross attention, Mamba in a mode other than
``"align"`` and, with prefix caching off, ``"none"``, ...), an EAGLE group, a
full-attention group whose block is larger than the hash block, and every call whose
methods are patched goes to vLLM's ``allocate_slots`` before anything changes. With
prefix caching off vLLM builds ``KVCacheCoordinatorNoPrefixCache`` for every model;
over groups other than one full-attention group the same step serves it
(docs/design.md, "Hybrid models with prefix caching off").

It is bound only where its reading is vLLM's: the sources of :data:`HYBRID_MIRRORED`
and :data:`HYBRID_LAYOUT` must hash to the entry of :data:`KNOWN_HYBRID_SOURCES` of the
release the native allocate_slots was bound for (recorded after
tests/integration/test_manager_hybrid_step.py passed in that release's environment);
elsewhere hybrid models keep vLLM's Python, with one info line. Mamba groups have their
own fingerprint (:data:`MAMBA_MIRRORED`, :data:`MAMBA_LAYOUT`,
:data:`KNOWN_MAMBA_SOURCES`, checked by tests/integration/test_manager_mamba_step.py): a
release that changes only Mamba keeps the native step of full + sliding-window models.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import types
from typing import Any

from kvpool.vllm_calls import HYBRID_COORDINATOR_NAMES, HYBRID_SINGLE_TYPE_NAMES

logger = logging.getLogger("vllm.kvpool")

#: The vLLM functions whose reading the hybrid step reproduces, as ``(class name,
#: method name)`` resolved on that class (``kv_cache_coordinator``: a function of that
#: module's namespace).
HYBRID_MIRRORED: tuple[tuple[str, str], ...] = (
    ("KVCacheManager", "allocate_slots"),
    ("KVCacheManager", "create_kv_cache_blocks"),
    ("HybridKVCacheCoordinator", "remove_skipped_blocks"),
    ("HybridKVCacheCoordinator", "get_num_blocks_to_allocate"),
    ("HybridKVCacheCoordinator", "allocate_new_blocks"),
    ("HybridKVCacheCoordinator", "cache_blocks"),
    ("HybridKVCacheCoordinator", "get_num_cacheable_tokens"),
    ("HybridKVCacheCoordinator", "_align_cacheable"),
    ("FullAttentionManager", "remove_skipped_blocks"),
    ("FullAttentionManager", "get_num_skipped_tokens"),
    ("FullAttentionManager", "_remove_blocks_in_range"),
    ("FullAttentionManager", "get_num_blocks_to_allocate"),
    ("FullAttentionManager", "allocate_new_blocks"),
    ("FullAttentionManager", "cache_blocks"),
    ("SlidingWindowManager", "remove_skipped_blocks"),
    ("SlidingWindowManager", "get_num_skipped_tokens"),
    ("SlidingWindowManager", "_remove_blocks_in_range"),
    ("SlidingWindowManager", "get_num_blocks_to_allocate"),
    ("SlidingWindowManager", "allocate_new_blocks"),
    ("SlidingWindowManager", "cache_blocks"),
    ("SingleTypeKVCacheManager", "cache_blocks"),
    # prefix caching off: the coordinator's calls, and what get_num_blocks_to_allocate
    # reads for a request without a num_cached_block entry
    ("KVCacheCoordinatorNoPrefixCache", "remove_skipped_blocks"),
    ("KVCacheCoordinatorNoPrefixCache", "get_num_blocks_to_allocate"),
    ("KVCacheCoordinatorNoPrefixCache", "allocate_new_blocks"),
    ("KVCacheCoordinatorNoPrefixCache", "cache_blocks"),
    ("KVCacheCoordinatorNoPrefixCache", "get_num_cacheable_tokens"),
    ("FullAttentionManager", "_get_num_evictable_blocks"),
    ("FullAttentionManager", "_has_partial_local_hit"),
    ("SlidingWindowManager", "_get_num_evictable_blocks"),
    ("SlidingWindowManager", "_has_partial_local_hit"),
    ("FullAttentionSpec", "prefix_cacheable"),
    ("SlidingWindowSpec", "prefix_cacheable"),
    ("kv_cache_coordinator", "replay_boundaries"),
    ("single_type_kv_cache_manager", "cdiv"),
    # a waiting request's prefix-cache lookup (src/kvpool/hybrid_lookup.pxi; with
    # FullAttentionManager.find_longest_cache_hit and BlockPool.get_cached_block, which
    # manager_fast_path.MIRRORED covers)
    ("KVCacheManager", "get_computed_blocks"),
    ("KVCacheManager", "prefix_cache_lookup_enabled"),
    ("HybridKVCacheCoordinator", "find_longest_cache_hit"),
    ("HybridKVCacheCoordinator", "_cache_hit_alignment_tokens"),
    ("kv_cache_coordinator", "cdiv"),
    # a waiting request's first allocation (src/kvpool/hybrid_admit.pxi): its prefix-cache
    # hits adopted group by group
    ("HybridKVCacheCoordinator", "allocate_new_computed_blocks"),
    ("FullAttentionManager", "add_local_computed_blocks"),
    ("SlidingWindowManager", "add_local_computed_blocks"),
)

#: The definitions whose layout the hybrid step reads (``None``: the whole class's source):
#: ``KVCacheBlocks`` (``.blocks`` of the manager's empty one), and the constructors that
#: define the attributes it reads (the
#: coordinator's ``drop_eagle_group_ids``, ``scheduler_block_size``,
#: ``enable_partial_hash_hits``; a manager's ``req_to_blocks``, ``num_cached_block``,
#: ``_partial_hit_reqs``, ``_null_block``, ``sliding_window``, ...; the request's).
HYBRID_LAYOUT: tuple[tuple[str, str | None], ...] = (
    ("KVCacheBlocks", None),
    ("KVCacheCoordinator", "__init__"),
    ("HybridKVCacheCoordinator", "__init__"),
    ("KVCacheCoordinatorNoPrefixCache", "__init__"),
    # the lookup's attention_groups (SpecGroup entries, full attention first)
    ("HybridKVCacheCoordinator", "verify_and_split_kv_cache_groups"),
    ("SpecGroup", None),
    ("SingleTypeKVCacheManager", "__init__"),
    ("SlidingWindowManager", "__init__"),
    ("Request", "__init__"),
    ("Request", "num_tokens"),
)

#: The vLLM functions a Mamba group's part of the step reproduces (``MambaManager`` in
#: ``mamba_cache_mode="align"``, ``src/kvpool/mamba_step.pxi``), as in
#: :data:`HYBRID_MIRRORED`.
MAMBA_MIRRORED: tuple[tuple[str, str], ...] = (
    ("MambaManager", "remove_skipped_blocks"),
    ("MambaManager", "get_num_skipped_tokens"),
    ("MambaManager", "_remove_blocks_in_range"),
    ("MambaManager", "get_num_blocks_to_allocate"),
    ("MambaManager", "_has_partial_local_hit"),
    ("MambaManager", "_needs_internal_checkpoint"),
    ("MambaManager", "_get_num_evictable_blocks"),
    ("MambaManager", "allocate_new_blocks"),
    ("MambaManager", "cache_blocks"),
    ("MambaManager", "_cache_partial_tail_block"),
    # mamba_cache_mode="none" (prefix caching off): what MambaManager's methods call
    # through super()
    ("SingleTypeKVCacheManager", "remove_skipped_blocks"),
    ("SingleTypeKVCacheManager", "_remove_blocks_in_range"),
    ("SingleTypeKVCacheManager", "get_num_blocks_to_allocate"),
    ("SingleTypeKVCacheManager", "allocate_new_blocks"),
    ("MambaSpec", "prefix_cacheable"),
    ("single_type_kv_cache_manager", "get_mamba_prefill_checkpoint_position"),
    ("single_type_kv_cache_manager", "is_mamba_prefill_checkpoint_valid"),
)

#: ... and the definitions whose layout it reads: the Mamba manager's constructor
#: (``last_state_block_idx``, ``_num_retired_blocks``, ``_allocated_block_reqs``,
#: ``_checkpoints``, ``has_prefill_checkpoint_blocks``, ...) and ``MambaSpec``.
MAMBA_LAYOUT: tuple[tuple[str, str | None], ...] = (
    ("MambaManager", "__init__"),
    ("MambaSpec", None),
)

#: sha256 of :func:`hybrid_source` per vLLM release the hybrid step was checked against.
KNOWN_HYBRID_SOURCES: dict[str, str] = {
    "0.34.0": "f79bbcb21e292cb072dade33852495d27fa760c70ec506482dd2e2f87d52a172",
}

#: sha256 of :func:`mamba_source` per vLLM release its Mamba part was checked against.
KNOWN_MAMBA_SOURCES: dict[str, str] = {
    "0.34.0": "f1bed762a08f407267431c75e02ca59215c229adb501ff1f15e0b6679ba14470",
}

#: Methods of a Mamba group's manager, beyond ``HYBRID_SINGLE_TYPE_NAMES``, that must not
#: be set on its instance.
MAMBA_NAMES = ("_needs_internal_checkpoint",)

# The classes whose methods and properties every hybrid step checks (through the
# version tags of all but SingleTypeKVCacheManager: a change to it, whose cache_blocks
# FullAttentionManager.cache_blocks calls through super(), invalidates its subclasses'
# tags). The request's class and its num_tokens property: the native manager path's
# checks, which run before the hybrid step.
_CHECKED = ("HybridKVCacheCoordinator", "FullAttentionManager", "SlidingWindowManager",
            "SingleTypeKVCacheManager", "FullAttentionSpec", "SlidingWindowSpec", "MambaManager", "MambaSpec",
            "KVCacheCoordinatorNoPrefixCache")


def hybrid_classes() -> dict[str, Any]:
    """The installed vLLM's classes and modules :data:`HYBRID_MIRRORED` names: the
    native manager path's (``manager_fast_path._classes``) and the hybrid ones."""
    from vllm.v1 import kv_cache_interface
    from vllm.v1.core import kv_cache_coordinator, single_type_kv_cache_manager

    from kvpool.patches.manager_fast_path import _classes

    return {
        **_classes(),
        "HybridKVCacheCoordinator": kv_cache_coordinator.HybridKVCacheCoordinator,
        "SlidingWindowManager": single_type_kv_cache_manager.SlidingWindowManager,
        "FullAttentionSpec": kv_cache_interface.FullAttentionSpec,
        "SlidingWindowSpec": kv_cache_interface.SlidingWindowSpec,
        "MambaManager": getattr(single_type_kv_cache_manager, "MambaManager", None),
        "MambaSpec": getattr(kv_cache_interface, "MambaSpec", None),
        "SpecGroup": getattr(kv_cache_coordinator, "SpecGroup", None),
    }


def _resolved(classes: dict[str, Any], cls_name: str, name: str):
    """vLLM's function behind ``classes[cls_name].name`` (kvpool's wrappers seen
    through, a classmethod by its function, a property by its getter), or None."""
    from kvpool.patches.manager_fast_path import _vanilla

    func = _vanilla(classes[cls_name], name)
    if isinstance(func, property):
        func = func.fget
    return getattr(func, "__func__", func)


def hybrid_source(classes: dict[str, Any] | None = None) -> str:
    """``manager_fast_path.definitions_source`` of :data:`HYBRID_MIRRORED`, then
    :data:`HYBRID_LAYOUT`, as the installed vLLM defines them."""
    from kvpool.patches.manager_fast_path import definitions_source

    return definitions_source(HYBRID_MIRRORED + HYBRID_LAYOUT, classes or hybrid_classes())


def hybrid_fingerprint(classes: dict[str, Any] | None = None) -> str | None:
    """sha256 (hex) of :func:`hybrid_source`, or None when a source cannot be read (or
    the release has no hybrid coordinator or sliding-window manager)."""
    try:
        return hashlib.sha256(hybrid_source(classes).encode()).hexdigest()
    except (OSError, TypeError, AttributeError, KeyError):
        return None


def mamba_source(classes: dict[str, Any] | None = None) -> str:
    """``definitions_source`` of :data:`MAMBA_MIRRORED`, then :data:`MAMBA_LAYOUT`."""
    from kvpool.patches.manager_fast_path import definitions_source

    return definitions_source(MAMBA_MIRRORED + MAMBA_LAYOUT, classes or hybrid_classes())


def mamba_fingerprint(classes: dict[str, Any] | None = None) -> str | None:
    """sha256 (hex) of :func:`mamba_source`, or None when a source cannot be read (or the
    release has no Mamba manager)."""
    try:
        return hashlib.sha256(mamba_source(classes).encode()).hexdigest()
    except (OSError, TypeError, AttributeError, KeyError):
        return None


def _step_globals(classes: dict[str, Any], mirrored=HYBRID_MIRRORED) -> tuple[tuple[dict, str, Any], ...]:
    """``(namespace dict, name, value)`` of every function and class the mirrored
    methods read from their modules (``cdiv``, ``round_down``, ``replay_boundaries``,
    ``CrossAttentionManager``, ...), and ``(namespace dict, name, None)`` of every
    builtin they call (``max``, ``len``, ...), which no module name may shadow: replaced
    or shadowed there after install, the step is vLLM's."""
    found: dict[tuple[int, str], tuple[dict, str, Any]] = {}
    for cls_name, name in mirrored:
        func = _resolved(classes, cls_name, name)
        if not isinstance(func, types.FunctionType):
            continue
        names = inspect.getclosurevars(func)
        for gname, value in names.globals.items():
            if isinstance(value, (types.FunctionType, type)) and func.__globals__.get(gname) is value:
                found[(id(func.__globals__), gname)] = (func.__globals__, gname, value)
        for bname in names.builtins:
            if bname not in func.__globals__:
                found[(id(func.__globals__), bname)] = (func.__globals__, bname, None)
    return tuple(found.values())


def bind(release: str, patcher=None) -> bool:
    """Arm the hybrid step of the native allocate_slots (bound by
    ``manager_fast_path.apply`` for ``release``) when the installed hybrid sources are
    that release's (:data:`KNOWN_HYBRID_SOURCES`) and none is wrapped by other code;
    True when armed, else False with one info line. With ``patcher`` (install's), also
    binds ``_core.kv_cache_coordinator_cache_blocks`` as
    ``HybridKVCacheCoordinator.cache_blocks`` while that is vLLM's
    ``KVCacheCoordinator.cache_blocks``: a call that caches nothing in any group returns
    at once (``src/kvpool/hybrid_cache.pxi``). ``uninstall()`` unbinds both; the next
    install disarms the step first (``_core.disable_allocate_slots_fast_path``)."""
    from kvpool import _core
    from kvpool.allocation import NATIVE_HOOKS, AllocationPolicy
    from kvpool.allocation.contiguous import NATIVE_MIRRORED, ContiguousPolicy
    from kvpool.block_pool import NATIVE_TAKE, BlockPool
    from kvpool.patches.manager_fast_path import _bound_function, _foreign_wrapper
    from kvpool.patches.sources import mark_kvpool_wrapper

    try:
        classes = hybrid_classes()
    except (ImportError, AttributeError):
        return False
    known = KNOWN_HYBRID_SOURCES.get(release)
    if not known or hybrid_fingerprint(classes) != known:
        logger.info("kvpool: the running step of hybrid models (HybridKVCacheCoordinator) stays "
                    "vLLM's Python: this vLLM's coordinator and managers are not those of a release "
                    "kvpool's hybrid step was checked against (%s)", ", ".join(KNOWN_HYBRID_SOURCES))
        return False
    foreign = [f"{c}.{n}" for c, n in HYBRID_MIRRORED
               if c in classes and isinstance(classes[c], type) and _foreign_wrapper(getattr(classes[c], n, None))]
    if foreign:
        logger.info("kvpool: the running step of hybrid models stays vLLM's Python: %s wrapped by "
                    "other code", ", ".join(foreign))
        return False
    mirrored = HYBRID_MIRRORED + (MAMBA_MIRRORED if _mamba_known(release, classes) else ())
    coordinator_cls = classes["HybridKVCacheCoordinator"]
    vanilla_cache = classes["KVCacheCoordinator"].cache_blocks
    if patcher is not None and coordinator_cls.cache_blocks is vanilla_cache:
        fast_cache = _core.kv_cache_coordinator_cache_blocks
        mark_kvpool_wrapper(fast_cache, vanilla_cache)
        patcher.set_attr(coordinator_cls, "cache_blocks", fast_cache)
    # (what the classes resolve to now: under the contiguous policy its manager hooks'
    # wrappers, which an idle step has nothing to do for; the native step tells the
    # policy the request's length as the hook on allocate_slots does)
    class_checks = [(classes[c], n, _bound_function(classes[c], n)) for c, n in mirrored if c in _CHECKED]
    mamba = mirrored is not HYBRID_MIRRORED
    _core.configure_hybrid_running_step(
        coordinator_cls=classes["HybridKVCacheCoordinator"],
        full_attention_cls=classes["FullAttentionManager"],
        sliding_window_cls=classes["SlidingWindowManager"],
        full_spec_cls=classes["FullAttentionSpec"],
        sliding_spec_cls=classes["SlidingWindowSpec"],
        class_checks=class_checks,
        coordinator_names=HYBRID_COORDINATOR_NAMES,
        single_type_names=HYBRID_SINGLE_TYPE_NAMES,
        step_globals=_step_globals(classes, mirrored),
        mamba_cls=classes["MambaManager"] if mamba else None,
        mamba_spec_cls=classes["MambaSpec"] if mamba else None,
        mamba_names=MAMBA_NAMES,
        pool_methods=(BlockPool.free_blocks, BlockPool.get_new_blocks, BlockPool._needs_vllm_loop,
                      BlockPool.touch),
        no_prefix_cls=classes["KVCacheCoordinatorNoPrefixCache"],
        spec_group_cls=classes["SpecGroup"],
        table_factory=getattr(classes["single_type_kv_cache_manager"], "untracked_list", None),
        contiguous=(ContiguousPolicy, *NATIVE_MIRRORED, NATIVE_TAKE),
        policy_hooks=NATIVE_HOOKS,
        policy_noop_change=AllocationPolicy.__dict__["after_change"],
    )
    return True


def _mamba_known(release: str, classes: dict[str, Any]) -> bool:
    """The Mamba groups' part is armed: :func:`mamba_fingerprint` is ``release``'s entry
    of :data:`KNOWN_MAMBA_SOURCES` and none of :data:`MAMBA_MIRRORED` is wrapped by
    other code; else False with one info line (Mamba models keep vLLM's step)."""
    from kvpool.patches.manager_fast_path import _foreign_wrapper

    known = KNOWN_MAMBA_SOURCES.get(release)
    if not known or mamba_fingerprint(classes) != known:
        logger.info("kvpool: the running step of hybrid models with Mamba groups stays vLLM's Python: "
                    "this vLLM's MambaManager is not that of a release kvpool's step was checked "
                    "against (%s)", ", ".join(r for r, h in KNOWN_MAMBA_SOURCES.items() if h))
        return False
    foreign = [f"{c}.{n}" for c, n in MAMBA_MIRRORED
               if isinstance(classes.get(c), type) and _foreign_wrapper(getattr(classes[c], n, None))]
    if foreign:
        logger.info("kvpool: the running step of hybrid models with Mamba groups stays vLLM's Python: "
                    "%s wrapped by other code", ", ".join(foreign))
        return False
    return True


__all__ = ["HYBRID_LAYOUT", "HYBRID_MIRRORED", "KNOWN_HYBRID_SOURCES", "KNOWN_MAMBA_SOURCES", "MAMBA_LAYOUT",
           "MAMBA_MIRRORED", "bind", "hybrid_fingerprint", "hybrid_source", "mamba_fingerprint", "mamba_source"]
