"""Everything kvpool knows about particular vLLM versions, in one place.

Supporting a new vLLM version is one diff here: a row in :data:`VLLM_RELEASES` (what
differs from its neighbours that kvpool's code acts on, read from the release itself), a
pin file ``requirements/vllm-X.txt`` for its environment, and, once
``python -m kvpool conformance --vllm-version X`` reports zero regressions, the
version in :data:`SUPPORTED_VLLM_VERSIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from kvpool import envs
from kvpool._version import __version__
from kvpool.errors import (  # noqa: F401  (defined there, re-exported here)
    MissingPatchTargetError,
    UnsupportedVLLMVersionError,
)


@dataclass(frozen=True)
class VllmRelease:
    """What one vLLM release does differently that kvpool's code acts on.

    Everything not named here is the same in every release of the table for kvpool's
    purposes (read from the released wheels side by side: ``KVCacheBlock``, the
    ``FreeKVCacheBlockQueue`` API, ``BlockHashToBlockMap``, ``get_new_blocks``,
    ``unpin_blocks``, ``evict_blocks``, ``reset_prefix_cache``, the coordinator's
    ``free`` / ``pop_blocks_for_free``, the scheduler's deferred-free fields and
    helpers, and the per-group deferred-order bug kvpool fixes). The differences that
    need no code of kvpool's (``num_hash_lookahead_tokens``, the null block's
    ``ref_cnt`` up to 0.32.0, ``_reset_caches`` raising from 0.31.0,
    ``Scheduler.deferred_loads`` in 0.33.0) are in docs/conformance.md, "vLLM
    releases".

    Attributes:
        version: the release, ``"0.33.0"``.
        all_engine_utility_call: ``AsyncMPClient.call_utility_all_async`` exists and
            ``reset_prefix_cache_async`` resets every data-parallel engine (>= 0.32.0).
            Before, vLLM's reset reaches one engine (all with the load-balancing
            client); kvpool's reorder then sends its call to every engine itself
            (``kvpool.patches.engine_api``).
        eagle_group_ids_attr: the ``KVCacheCoordinator`` attribute whose group ids
            ``UnitaryKVCacheCoordinator.find_longest_cache_hit`` drops the EAGLE block
            of: ``eagle_group_ids`` up to 0.32.0, ``drop_eagle_group_ids`` from 0.33.0
            (empty without ``use_eagle``). The native prefix-cache lookup reads it
            (``kvpool.patches.manager_fast_path``, ``src/kvpool/lookup.pxi``).
        lookup_takes_max_length: ``KVCacheManager.get_computed_blocks`` has the
            ``max_cache_hit_length`` parameter (>= 0.33.0); before, the native lookup
            hands a call that passes it to vLLM's, which raises ``TypeError``.
        cache_checks_prefix_cacheable: ``SingleTypeKVCacheManager.cache_blocks``
            returns early for a spec that is not ``prefix_cacheable`` (>= 0.31.0; 0.30.0
            caches it); the native ``cache_blocks`` does the same where this is set.
        block_ids_map: ``BlockHashToBlockMap(blocks)`` stores block *ids* (duplicates
            in ``_dup_ids``), has ``clear()``, and ``reset_prefix_cache`` clears it in
            place (>= 0.34.0). Before, the map holds block objects (a dict of them for
            duplicates) and the reset replaces it.
        weak_block_pool: ``KVCacheBlock.pool`` is a ``weakref.ref`` to the pool
            (``BlockPool._weak_self``), so a pool with live requests is collected
            (>= 0.34.0). Before, the block holds its pool.
        public_block_hash: ``KVCacheBlock.block_hash`` / ``block_hash_num_tokens`` are
            plain writable fields (constructor keywords, printed by the repr;
            >= 0.34.0). Before, they are read-only properties over ``_block_hash`` /
            ``_block_hash_num_tokens``.
        free_blocks_evict_first: ``BlockPool.free_blocks(blocks, evict_first=False)``
            (>= 0.34.0; the CPU offloader passes it).
        prefix_cache_hit_limit: a request's prefix-cache reads are bounded by
            ``Request.prefix_cache_hit_limit`` / ``get_max_cache_hit_length()``
            (>= 0.34.0). Before, ``Request.skip_reading_prefix_cache`` switches them off.
        eviction_hook_hashed_only: ``get_new_blocks`` calls ``_maybe_evict_cached_block``
            only for blocks with a hash (without a metrics collector; >= 0.34.0), as
            kvpool's native loop does on every release. Before, for every block.
        runner_output_index: ``ModelRunnerOutput`` has ``req_id_to_index`` and
            ``CachedRequestData`` has ``resumed_req_ids`` (up to 0.33.0; the replay's
            stand-in model builds the one, the tests read the other).
    """

    version: str
    all_engine_utility_call: bool
    eagle_group_ids_attr: str
    lookup_takes_max_length: bool
    cache_checks_prefix_cacheable: bool
    block_ids_map: bool = False
    weak_block_pool: bool = False
    public_block_hash: bool = False
    free_blocks_evict_first: bool = False
    prefix_cache_hit_limit: bool = False
    eviction_hook_hashed_only: bool = False
    runner_output_index: bool = True


#: The releases kvpool knows, oldest first: its test matrix.
VLLM_RELEASES: dict[str, VllmRelease] = {
    r.version: r
    for r in (
        VllmRelease("0.30.0", all_engine_utility_call=False, eagle_group_ids_attr="eagle_group_ids",
                    lookup_takes_max_length=False, cache_checks_prefix_cacheable=False),
        VllmRelease("0.31.0", all_engine_utility_call=False, eagle_group_ids_attr="eagle_group_ids",
                    lookup_takes_max_length=False, cache_checks_prefix_cacheable=True),
        VllmRelease("0.32.0", all_engine_utility_call=True, eagle_group_ids_attr="eagle_group_ids",
                    lookup_takes_max_length=False, cache_checks_prefix_cacheable=True),
        VllmRelease("0.33.0", all_engine_utility_call=True, eagle_group_ids_attr="drop_eagle_group_ids",
                    lookup_takes_max_length=True, cache_checks_prefix_cacheable=True),
        VllmRelease("0.34.0", all_engine_utility_call=True, eagle_group_ids_attr="drop_eagle_group_ids",
                    lookup_takes_max_length=True, cache_checks_prefix_cacheable=True,
                    block_ids_map=True, weak_block_pool=True, public_block_hash=True,
                    free_blocks_evict_first=True, prefix_cache_hit_limit=True,
                    eviction_hook_hashed_only=True, runner_output_index=False),
    )
}

#: vLLM versions whose own test suite passes with kvpool installed, zero regressions
#: (``python -m kvpool conformance --vllm-version X``, docs/conformance.md).
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")

#: Set to 1 to let ``install()`` patch a vLLM version that is not in the list above.
ALLOW_UNTESTED_ENV = envs.ALLOW_UNTESTED_VLLM

#: vLLM modules that bind the classes kvpool replaces (``from ... import X``), in
#: 0.33.0. ``install()`` rebinds these names in *every* loaded ``vllm.*`` module, so
#: this list is documentation and a test fixture, not the mechanism.
MODULES_BINDING_BLOCK_CLASSES: tuple[str, ...] = (
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.hisparse.block_pool",
    "vllm.v1.simple_kv_offload.manager",
)


def installed_vllm_version() -> str | None:
    """Version string of the installed vLLM distribution, or None if absent."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> str:
    # "0.33.0+cpu" / "0.33.0.dev3" -> "0.33.0": local builds of a release count as it.
    core = version.split("+", 1)[0]
    parts = core.split(".")
    return ".".join(p for p in parts[:3])


def release_traits(version: str | None = None) -> VllmRelease:
    """The :class:`VllmRelease` row of ``version`` (default: the installed vLLM).

    A version outside the table (only reachable with ``install(force=True)`` or
    ``KVPOOL_ALLOW_UNTESTED_VLLM=1``) gets the row of the nearest release below it, or
    the oldest row if it is older than all of them.
    """
    version = _release(version or installed_vllm_version() or max(VLLM_RELEASES, key=release_key))
    if version in VLLM_RELEASES:
        return VLLM_RELEASES[version]
    older = [v for v in VLLM_RELEASES if release_key(v) <= release_key(version)]
    return VLLM_RELEASES[max(older, key=release_key) if older else min(VLLM_RELEASES, key=release_key)]


def release_key(version: str) -> tuple[int, ...]:
    """Sort key of a release string: ``"0.34.0"`` -> ``(0, 34, 0)`` (a part that is not
    a number counts as 0)."""
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def is_supported(version: str | None) -> bool:
    """True if ``version`` (a vLLM version string) is in the supported range."""
    return version is not None and _release(version) in SUPPORTED_VLLM_VERSIONS


def check_vllm_version(force: bool = False) -> str:
    """Return the installed vLLM version, or raise if kvpool does not support it.

    Raises:
        UnsupportedVLLMVersionError: vLLM is missing, or its version is not in
            :data:`SUPPORTED_VLLM_VERSIONS` and neither ``force`` nor
            ``KVPOOL_ALLOW_UNTESTED_VLLM=1`` is set.
        kvpool.envs.InvalidSettingError: ``KVPOOL_ALLOW_UNTESTED_VLLM`` is neither on
            nor off.
    """
    version = installed_vllm_version()
    if version is None:
        raise UnsupportedVLLMVersionError("kvpool.install() needs vLLM, which is not installed")
    if is_supported(version) or force or envs.get(ALLOW_UNTESTED_ENV):
        return version
    raise UnsupportedVLLMVersionError(
        f"kvpool {__version__} supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
        f"found vLLM {version}. Run `python -m kvpool conformance` against it and set "
        f"{ALLOW_UNTESTED_ENV}=1 (or install(force=True)) to try it anyway."
    )
