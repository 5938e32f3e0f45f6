"""vLLM platform plugin (``vllm.platform_plugins``): vLLM's CPU platform without Triton.

vLLM 0.34.0's ``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``) raises
``RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")`` when
``vllm.triton_utils.HAS_TRITON`` is false; 0.30.0-0.33.0 only warn (0.33.0) or do not
check (0.30.0). triton-cpu is not on the package index, so every ``VllmConfig`` built on
an x86 CPU machine fails there. The check guards the CPU *model runner* (its kernels are
triton-cpu kernels); the scheduler, the KV cache manager and the block pool, which is all
that vLLM's scheduler tests, kvpool's tests and the replay build, never build a model
runner, a worker or an attention backend.

:class:`CpuNoTritonPlatform` is vLLM's ``CpuPlatform`` with one difference: its
``check_and_update_config`` runs vLLM's own with ``HAS_TRITON`` true for that call only,
restored afterwards (also in any module first imported during the call that copied it),
so nothing after the call believes Triton works and a real CPU engine still fails where
it needs a kernel.

Opt-in: :func:`platform_plugin` returns ``None`` unless ``KVPOOL_CPU_PLATFORM`` is on (an
out-of-tree platform wins over CUDA, so a GPU host must never get it by accident). vLLM
(``vllm.platforms.resolve_current_platform_cls_qualname``, 0.30.0-0.34.0) consults
platform plugins only when ``VLLM_TARGET_DEVICE`` is not ``cpu``: with ``cpu`` it takes
its own ``CpuPlatform`` at once. :func:`cpu_environment` sets up an environment for it.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any

from kvpool import envs

#: What :func:`platform_plugin` returns: the class vLLM resolves for ``current_platform``.
PLATFORM_QUALNAME = "kvpool.cpu_platform.CpuNoTritonPlatform"

_platform_class: type | None = None


def platform_plugin() -> str | None:
    """The ``vllm.platform_plugins`` entry point ``kvpool_cpu``.

    Returns:
        :data:`PLATFORM_QUALNAME` when ``KVPOOL_CPU_PLATFORM`` is on, else ``None`` (vLLM
        then picks its platform as without kvpool). Imports nothing from vLLM.

    Raises:
        kvpool.envs.InvalidSettingError: ``KVPOOL_CPU_PLATFORM`` has a value that is not
            a switch (vLLM logs a warning and treats the plugin as not activated).
    """
    return PLATFORM_QUALNAME if envs.get(envs.CPU_PLATFORM) else None


def cpu_environment(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Make ``env`` (``os.environ`` or a child's copy) select :class:`CpuNoTritonPlatform`.

    Sets ``KVPOOL_CPU_PLATFORM=1`` unless it is set already (an explicit ``0`` is kept),
    and, when the plugin is then on, removes ``VLLM_TARGET_DEVICE=cpu`` (vLLM would take
    its own ``CpuPlatform`` before consulting plugins). Any other ``VLLM_TARGET_DEVICE`` is
    left as it is. Returns ``env``.

    Raises:
        kvpool.envs.InvalidSettingError: ``KVPOOL_CPU_PLATFORM`` in ``env`` is not a switch.
    """
    env.setdefault(envs.CPU_PLATFORM, "1")
    if envs.get(envs.CPU_PLATFORM, env) and env.get("VLLM_TARGET_DEVICE", "").strip().lower() == "cpu":
        del env["VLLM_TARGET_DEVICE"]
    return env


def _check_without_triton(check: Any, vllm_config: Any) -> None:
    """Run ``check(vllm_config)`` with ``vllm.triton_utils.HAS_TRITON`` true, then restore
    it, and reset ``HAS_TRITON`` in every module first imported during the call that
    copied the true value (``from vllm.triton_utils import HAS_TRITON`` at import time)."""
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON
    before = set(sys.modules)
    triton_utils.HAS_TRITON = True
    try:
        check(vllm_config)
    finally:
        triton_utils.HAS_TRITON = had
        for name in set(sys.modules) - before:
            # (sys.modules may hold objects other than modules, without a __dict__)
            namespace = getattr(sys.modules.get(name), "__dict__", None)
            if isinstance(namespace, dict) and namespace.get("HAS_TRITON") is True:
                namespace["HAS_TRITON"] = had


def _build_platform_class() -> type:
    """Define :class:`CpuNoTritonPlatform` (importing vLLM's CPU platform on first use)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum

    class CpuNoTritonPlatform(CpuPlatform):
        """vLLM's ``CpuPlatform`` (``vllm/platforms/cpu.py``, 0.30.0-0.34.0) whose config
        check does not require triton-cpu; everything else is vLLM's."""

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            """vLLM's ``CpuPlatform.check_and_update_config`` with ``HAS_TRITON`` true for
            this call only (on an x86 CPU without Triton; otherwise vLLM's unchanged)."""
            import vllm.triton_utils as triton_utils

            check = super().check_and_update_config
            if triton_utils.HAS_TRITON or cls.get_cpu_architecture() != CpuArchEnum.X86:
                return check(vllm_config)
            return _check_without_triton(check, vllm_config)

    CpuNoTritonPlatform.__module__ = __name__
    CpuNoTritonPlatform.__qualname__ = "CpuNoTritonPlatform"
    return CpuNoTritonPlatform


def __getattr__(name: str) -> Any:
    """``CpuNoTritonPlatform``: built on first access, so that importing this module
    (vLLM loads the entry point on every platform resolution) imports no vLLM code."""
    global _platform_class
    if name != "CpuNoTritonPlatform":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _platform_class is None:
        _platform_class = _build_platform_class()
    return _platform_class


__all__ = ["PLATFORM_QUALNAME", "cpu_environment", "platform_plugin"]
