"""kvpool: a native (C++/Cython) KV block pool for vLLM.

``import kvpool; kvpool.install()`` replaces vLLM's ``KVCacheBlock``,
``FreeKVCacheBlockQueue`` and ``BlockPool`` with kvpool's in every vLLM module that
bound them; ``kvpool.uninstall()`` puts vLLM's back. Installed as a package next to
vLLM, kvpool activates itself through vLLM's ``vllm.general_plugins`` entry point
(set ``KVPOOL_DISABLE=1`` to opt out).

The extension types (``KVCacheBlock``, ``FreeKVCacheBlockQueue``) need neither torch
nor vLLM; ``BlockPool`` and ``install()`` import vLLM when first used.
"""

from kvpool._version import __version__

__all__ = [
    "BlockIdOutOfRangeError",
    "BlockPool",
    "BlockStateError",
    "FencedDeferredFreeQueue",
    "FreeKVCacheBlockQueue",
    "InvalidSettingError",
    "KVCacheBlock",
    "KvpoolError",
    "LazyOffloadOrderError",
    "NotAKvpoolPoolError",
    "PoolsBuiltBeforeInstallError",
    "UnsupportedVLLMVersionError",
    "__version__",
    "install",
    "is_installed",
    "uninstall",
]

_CORE_NAMES = {
    "KVCacheBlock",
    "FreeKVCacheBlockQueue",
    "FencedDeferredFreeQueue",
    "BlockStateError",
    "BlockIdOutOfRangeError",
}


def install(*, force: bool = False, allocation: str | None = None, lru_window: int | None = None) -> bool:
    """Replace vLLM's block pool classes with kvpool's; ``allocation="contiguous"``
    opts into the contiguity-preserving policy (``lru_window=W`` blocks: its opt-in
    relaxation of vLLM's LRU). See :func:`kvpool.patching.install` (raises
    :class:`InvalidSettingError`, a ``ValueError``, for a bad ``allocation``,
    ``lru_window`` or ``KVPOOL_*`` value; ``TypeError`` for a non-bool ``force``)."""
    from kvpool import patching

    return patching.install(force=force, allocation=allocation, lru_window=lru_window)


def uninstall() -> bool:
    """Put vLLM's own classes back. See :func:`kvpool.patching.uninstall`."""
    from kvpool import patching

    return patching.uninstall()


def is_installed() -> bool:
    """True while kvpool's classes are bound in vLLM."""
    import sys

    mod = sys.modules.get("kvpool.patching")
    return bool(mod is not None and mod.is_installed())


def __getattr__(name: str):
    # Lazy: `import kvpool` must work without vLLM (and cheaply in every vLLM process).
    if name in _CORE_NAMES:
        from kvpool import _core

        return getattr(_core, name)
    if name == "BlockPool":
        from kvpool.block_pool import BlockPool

        return BlockPool
    if name in ("KvpoolError", "NotAKvpoolPoolError", "PoolsBuiltBeforeInstallError"):
        from kvpool import errors

        return getattr(errors, name)
    if name == "LazyOffloadOrderError":
        from kvpool.patches.lazy_offload import LazyOffloadOrderError

        return LazyOffloadOrderError
    if name == "InvalidSettingError":
        from kvpool.envs import InvalidSettingError

        return InvalidSettingError
    if name == "UnsupportedVLLMVersionError":
        from kvpool.vllm_compat import UnsupportedVLLMVersionError

        return UnsupportedVLLMVersionError
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
