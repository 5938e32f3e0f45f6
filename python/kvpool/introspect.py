"""What kvpool binds into the running vLLM, read without changing it: the public API the
bundled tools (``kvpool.tools``: replay, conformance, porting, locality) and operators use.

The runtime (everything in ``kvpool`` outside ``kvpool.tools``) is audited alone; the
tools reach it only through ``kvpool``'s own names, :mod:`kvpool.errors`,
:mod:`kvpool.envs`, :mod:`kvpool.vllm_compat`, :mod:`kvpool.cpu_platform` and this module
(``tests/repo/test_import_graph.py`` enforces it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool import _core, patching
from kvpool.patches import manager_fast_path
from kvpool.selfcheck import SelfCheckResult, run as _run_selfcheck

__all__ = [
    "SelfCheckResult",
    "install_beside_vllm_pools",
    "known_manager_sources",
    "kvpool_classes",
    "mirrored_definitions",
    "mirrored_fingerprint",
    "native_manager_path_bound",
    "native_manager_release",
    "patch_modules",
    "run_selfcheck",
    "skipped_patches",
    "vanilla_classes",
]


def install_beside_vllm_pools(*, allocation: str | None = None, lru_window: int | None = None,
                              force: bool = False, skip_selfcheck: bool = False) -> bool:
    """:func:`kvpool.install` in a process that already holds pools vLLM built (a replay's
    vanilla mode, a benchmark, ``python -m kvpool porting``): those pools keep vLLM's code,
    pools built afterwards are kvpool's. ``install()`` refuses that case for users
    (:class:`kvpool.PoolsBuiltBeforeInstallError`), since their engine would keep vLLM's pool.

    ``skip_selfcheck=True`` (with ``force=True`` on a release outside the supported list)
    installs without the self-check, to report what each patch module does on a release
    the self-check refuses; never for serving. Returns what ``install()`` returns; raises
    what it raises (:class:`kvpool.errors.UnsupportedVLLMVersionError`,
    :class:`kvpool.errors.InvalidSettingError`, ...).
    """
    kwargs: dict[str, Any] = {"force": force, "allocation": allocation, "lru_window": lru_window,
                              "allow_vllm_built_pools": True}
    if not skip_selfcheck:
        return patching.install(**kwargs)
    with patching.selfcheck_bypassed():
        return patching.install(**kwargs)


def vanilla_classes() -> dict[str, Any]:
    """vLLM's own classes kvpool replaces, by name (``"BlockPool"``, ``"KVCacheBlock"``, ...),
    as the installed vLLM defines them. Raises ``ImportError``/``AttributeError`` when the
    release lacks one."""
    return patching.vanilla_classes()


def kvpool_classes() -> dict[str, Any]:
    """kvpool's replacements for :func:`vanilla_classes`, by the same names."""
    return patching._replacements()


def run_selfcheck() -> SelfCheckResult:
    """The self-check ``install()`` runs on an untested vLLM release (signatures, fields, the
    prefix-cache map's layout, a scripted pool run beside vLLM's), run now; changes nothing."""
    return _run_selfcheck(vanilla_classes(), kvpool_classes())


def patch_modules() -> tuple[str, ...]:
    """The patch modules ``install()`` runs, in order (``"kvpool.patches.metrics"``, ...)."""
    return patching.PATCH_MODULES


def skipped_patches() -> dict[str, str]:
    """``{patch module: why it was skipped}`` of the current installation (empty when
    every part bound, or when kvpool is not installed)."""
    return patching.skipped_patches()


def native_manager_release() -> str | None:
    """The vLLM release whose mirrored sources the installed vLLM's match (the native KV
    cache manager path binds only then), or None."""
    return manager_fast_path.matching_release()


def known_manager_sources() -> Mapping[str, str]:
    """``{vLLM release: fingerprint of the definitions the native manager path mirrors}``."""
    return manager_fast_path.KNOWN_SOURCES


def mirrored_definitions() -> tuple:
    """The vLLM definitions the native manager path mirrors or whose layout it touches, as
    ``(class name, attribute)`` pairs of vLLM's classes."""
    return manager_fast_path.MIRRORED


def mirrored_fingerprint() -> str:
    """sha256 (hex) of :func:`mirrored_definitions`' sources in the installed vLLM."""
    return manager_fast_path.source_fingerprint()


def native_manager_path_bound() -> bool:
    """Whether vLLM's ``KVCacheManager.allocate_slots`` is kvpool's native function now
    (kvpool installed, and the installed release's mirrored sources known)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return vars(KVCacheManager).get("allocate_slots") is _core.kv_cache_manager_allocate_slots
