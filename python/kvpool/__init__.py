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


#: Public names resolved lazily (``import kvpool`` must work without vLLM and cost little
#: in every vLLM process): name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(_CORE_NAMES, "kvpool._core"),
    "BlockPool": "kvpool.block_pool",
    # every public exception is defined in kvpool.errors (the extension's in errors.pxi)
    **dict.fromkeys(("KvpoolError", "NotAKvpoolPoolError", "PoolsBuiltBeforeInstallError",
                     "LazyOffloadOrderError", "InvalidSettingError",
                     "UnsupportedVLLMVersionError"), "kvpool.errors"),
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
