"""``python -m kvpool info``: versions, install state and the effective configuration.

Each ``KVPOOL_*`` setting is printed with its value and where it came from: the
environment, the default, or an ``install()`` argument (in this process). A value
kvpool does not accept is printed with its error, and the command exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any

from kvpool import envs, vllm_compat
from kvpool._version import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvpool info",
        description="Print kvpool's and vLLM's versions, whether the vLLM plugin is registered, "
        "and every KVPOOL_* setting with its effective value and its source "
        "(environment, default, install argument). Exit status 2 if a setting is invalid.",
    )
    p.add_argument("--json", action="store_true", help="print the same as one JSON object")
    return p


def settings(arguments: dict[str, Any] | None = None) -> list[envs.Setting]:
    """:func:`kvpool.envs.effective` with the ``install()`` arguments of this process."""
    if arguments is None:
        mod = sys.modules.get("kvpool.patching")
        arguments = mod.installed_arguments() if mod is not None else {}
    return envs.effective(arguments)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "-" if value is None else str(value)


def render(rows: list[envs.Setting]) -> str:
    """The settings as aligned text lines: name, value, source (and the error)."""
    width = max(len(r.name) for r in rows)
    lines = ["settings (KVPOOL_*; value, source):"]
    for r in rows:
        if r.error:
            lines.append(f"  {r.name:<{width}}  INVALID {r.raw!r}: {r.error}")
        else:
            raw = f" ({r.raw!r})" if r.source == "environment" else ""
            lines.append(f"  {r.name:<{width}}  {_show(r.value)}  [{r.source}{raw}]")
    return "\n".join(lines)


def describe() -> str:
    """Versions, support, plugin registration, install state and the native core, one
    line each (the head of ``python -m kvpool info``)."""
    version = vllm_compat.installed_vllm_version()
    supported = vllm_compat.is_supported(version)
    lines = [
        f"kvpool {__version__}",
        f"vLLM installed: {version or 'no'}"
        + ("" if version is None else (" (supported)" if supported else " (NOT supported)")),
        f"supported vLLM: {', '.join(vllm_compat.SUPPORTED_VLLM_VERSIONS)}",
    ]
    try:
        eps = metadata.entry_points(group="vllm.general_plugins")
        registered = any(ep.value == "kvpool.plugin:register" for ep in eps)
    except Exception:  # pragma: no cover - broken metadata
        registered = False
    lines.append(
        "vLLM plugin entry point: "
        + ("registered (every vLLM process installs kvpool unless KVPOOL_DISABLE is on)" if registered
           else "NOT registered")
    )
    from kvpool import is_installed

    lines.append(f"installed in this process: {'yes' if is_installed() else 'no'}")
    try:
        from kvpool import _core  # noqa: F401

        lines.append("native core: built")
    except ImportError as e:  # pragma: no cover - only on a broken install
        lines.append(f"native core: NOT importable ({e})")
    if version is not None:
        lines.append("native KV cache manager path (allocate_slots of a running request): "
                     + _manager_path_state())
        lines.append("native running step of hybrid models (full attention + sliding window): "
                     + _hybrid_step_state())
        lines.append("... and the idle step of their Mamba groups (mamba_cache_mode align, or none "
                     "with prefix caching off): "
                     + _hybrid_step_state(mamba=True))
    return "\n".join(lines)


def _hybrid_step_state(mamba: bool = False) -> str:
    """Whether ``kvpool.patches.hybrid_fast_path`` can arm on this vLLM (beside the
    native manager path, which it needs); ``mamba``: its Mamba groups' part too."""
    try:
        from kvpool.patches import hybrid_fast_path, manager_fast_path

        release = manager_fast_path.matching_release()
        known = hybrid_fast_path.KNOWN_HYBRID_SOURCES.get(release or "")
        matches = bool(known) and hybrid_fast_path.hybrid_fingerprint() == known
        known_mamba = hybrid_fast_path.KNOWN_MAMBA_SOURCES.get(release or "")
        matches_mamba = bool(known_mamba) and hybrid_fast_path.mamba_fingerprint() == known_mamba
    except Exception as e:  # noqa: BLE001 - info reports, never fails on vLLM's internals
        return f"unknown ({type(e).__name__}: {e})"
    if not matches:
        return ("off: this vLLM's hybrid coordinator and managers are not a release's it was checked "
                f"against ({', '.join(hybrid_fast_path.KNOWN_HYBRID_SOURCES)})")
    if mamba and not matches_mamba:
        return ("off: this vLLM's MambaManager is not a release's it was checked against "
                f"({', '.join(r for r, h in hybrid_fast_path.KNOWN_MAMBA_SOURCES.items() if h)})")
    if envs.get(envs.PYTHON_MANAGER):
        return f"off: {envs.PYTHON_MANAGER} is on"
    return f"on ({release}'s)"


def _manager_path_state() -> str:
    """Whether ``kvpool.patches.manager_fast_path`` can bind on this vLLM."""
    try:
        from kvpool.patches import manager_fast_path

        release = manager_fast_path.matching_release()
    except Exception as e:  # noqa: BLE001 - info reports, never fails on vLLM's internals
        return f"unknown ({type(e).__name__}: {e})"
    if release is None:
        return ("off: this vLLM's allocate_slots and the methods it calls are not a release's "
                f"it was checked against ({', '.join(manager_fast_path.KNOWN_SOURCES)})")
    if envs.get(envs.PYTHON_MANAGER):
        return f"off: {envs.PYTHON_MANAGER} is on"
    return f"on (the mirrored vLLM functions are {release}'s)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = settings()
    if args.json:
        out = {
            "describe": describe().splitlines(),
            "settings": {r.name: {"value": r.value, "source": r.source, "raw": r.raw, "error": r.error}
                         for r in rows},
        }
        print(json.dumps(out, indent=2))
    else:
        print(describe())
        mod = sys.modules.get("kvpool.patching")
        for name, why in (mod.skipped_patches() if mod is not None else {}).items():
            print(f"patch skipped on this untested vLLM: {name} ({why})")
        print(render(rows))
    return 2 if any(r.error for r in rows) else 0
