"""Everything kvpool knows about particular vLLM versions, in one place.

Supporting a new vLLM version is one diff here (plus ``kvpool.block_pool`` if vLLM
changed ``BlockPool.__init__``): add it to :data:`SUPPORTED_VLLM_VERSIONS` once
``python -m kvpool conformance`` reports zero regressions on it.
"""

from __future__ import annotations

import os
from importlib import metadata

#: vLLM versions whose own test suite passes with kvpool installed
#: (``python -m kvpool conformance``, docs/conformance.md).
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.33.0",)

#: Set to 1 to let ``install()`` patch a vLLM version that is not in the list above.
ALLOW_UNTESTED_ENV = "KVPOOL_ALLOW_UNTESTED_VLLM"

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


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not one kvpool has been validated against."""


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


def is_supported(version: str | None) -> bool:
    """True if ``version`` (a vLLM version string) is in the supported range."""
    return version is not None and _release(version) in SUPPORTED_VLLM_VERSIONS


def check_vllm_version(force: bool = False) -> str:
    """Return the installed vLLM version, or raise if kvpool does not support it.

    Raises:
        UnsupportedVLLMVersionError: vLLM is missing, or its version is not in
            :data:`SUPPORTED_VLLM_VERSIONS` and neither ``force`` nor
            ``KVPOOL_ALLOW_UNTESTED_VLLM=1`` is set.
    """
    version = installed_vllm_version()
    if version is None:
        raise UnsupportedVLLMVersionError("kvpool.install() needs vLLM, which is not installed")
    if is_supported(version) or force or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return version
    raise UnsupportedVLLMVersionError(
        f"kvpool {_kvpool_version()} supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
        f"found vLLM {version}. Run `python -m kvpool conformance` against it and set "
        f"{ALLOW_UNTESTED_ENV}=1 (or install(force=True)) to try it anyway."
    )


def _kvpool_version() -> str:
    from kvpool import __version__

    return __version__


def describe() -> str:
    """One paragraph for ``python -m kvpool info``."""
    version = installed_vllm_version()
    lines = [
        f"kvpool {_kvpool_version()}",
        f"vLLM installed: {version or 'no'}"
        + ("" if version is None else (" (supported)" if is_supported(version) else " (NOT supported)")),
        f"supported vLLM: {', '.join(SUPPORTED_VLLM_VERSIONS)}",
        f"KVPOOL_DISABLE={os.environ.get('KVPOOL_DISABLE', '')!r}",
    ]
    try:
        eps = metadata.entry_points(group="vllm.general_plugins")
        registered = any(ep.value == "kvpool.plugin:register" for ep in eps)
    except Exception:  # pragma: no cover - broken metadata
        registered = False
    lines.append(
        "vLLM plugin entry point: "
        + ("registered (every vLLM process installs kvpool unless KVPOOL_DISABLE=1)" if registered else "NOT registered")
    )
    from kvpool import is_installed

    lines.append(f"installed in this process: {'yes' if is_installed() else 'no'}")
    try:
        from kvpool import _core  # noqa: F401

        lines.append("native core: built")
    except ImportError as e:  # pragma: no cover - only on a broken install
        lines.append(f"native core: NOT importable ({e})")
    return "\n".join(lines)
