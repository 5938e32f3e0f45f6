"""kvpool's opt-in vLLM platform plugin (``kvpool.cpu_platform``): vLLM's CPU platform whose
config check does not require triton-cpu (vLLM 0.34.0 raises without it on x86).

The plugin must return None when ``KVPOOL_CPU_PLATFORM`` is off (an out-of-tree platform wins
over CUDA on a GPU host), be the platform vLLM resolves when it is on (only consulted when
``VLLM_TARGET_DEVICE`` is not ``cpu``), let a ``VllmConfig`` and a real scheduler be built, and
leave ``vllm.triton_utils.HAS_TRITON`` as it found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvpool import cpu_platform, envs
from tests.support.paths import REPO

pytest.importorskip("vllm")


def test_plugin_returns_none_when_off_and_the_class_when_on(monkeypatch):
    monkeypatch.delenv("KVPOOL_CPU_PLATFORM", raising=False)
    assert cpu_platform.platform_plugin() is None
    for off in ("0", "off", ""):
        monkeypatch.setenv("KVPOOL_CPU_PLATFORM", off)
        assert cpu_platform.platform_plugin() is None
    monkeypatch.setenv("KVPOOL_CPU_PLATFORM", "1")
    assert cpu_platform.platform_plugin() == "kvpool.cpu_platform.CpuNoTritonPlatform"
    monkeypatch.setenv("KVPOOL_CPU_PLATFORM", "maybe")
    with pytest.raises(envs.InvalidSettingError, match="KVPOOL_CPU_PLATFORM"):
        cpu_platform.platform_plugin()


def test_the_entry_point_is_registered_for_vllm():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="vllm.platform_plugins")}
    assert found.get("kvpool_cpu") == "kvpool.cpu_platform:platform_plugin"


def test_cpu_environment_turns_the_plugin_on_and_drops_target_device_cpu():
    env = cpu_environment_of({"VLLM_TARGET_DEVICE": "CPU"})
    assert env == {"KVPOOL_CPU_PLATFORM": "1"}
    # An explicit off is kept, and then VLLM_TARGET_DEVICE=cpu stays (vLLM's own CpuPlatform).
    env = cpu_environment_of({"KVPOOL_CPU_PLATFORM": "0", "VLLM_TARGET_DEVICE": "cpu"})
    assert env == {"KVPOOL_CPU_PLATFORM": "0", "VLLM_TARGET_DEVICE": "cpu"}
    # Another target device is the user's choice.
    assert cpu_environment_of({"VLLM_TARGET_DEVICE": "cuda"})["VLLM_TARGET_DEVICE"] == "cuda"
    with pytest.raises(envs.InvalidSettingError):
        cpu_environment_of({"KVPOOL_CPU_PLATFORM": "2"})


def cpu_environment_of(env: dict[str, str]) -> dict[str, str]:
    return dict(cpu_platform.cpu_environment(dict(env)))


_CHILD = textwrap.dedent(
    """
    import json
    import vllm.triton_utils as triton_utils
    from vllm.platforms import current_platform, resolve_current_platform_cls_qualname
    from tests.support.scheduler import make_request, make_scheduler

    had = triton_utils.HAS_TRITON
    scheduler = make_scheduler(num_blocks=64)  # VllmConfig(...) runs the platform's check
    scheduler.add_request(make_request("r0", list(range(40))))
    out = scheduler.schedule()
    print(json.dumps({
        "qualname": resolve_current_platform_cls_qualname(),
        "platform": f"{type(current_platform).__module__}.{type(current_platform).__qualname__}",
        "is_cpu": current_platform.is_cpu(),
        "scheduled": out.num_scheduled_tokens,
        "has_triton_before": had, "has_triton_after": triton_utils.HAS_TRITON,
    }))
    """
)


def _child(**settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_CPU_PLATFORM", "VLLM_TARGET_DEVICE")}
    env.update(settings, PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # a fresh process imports vLLM
def test_vllm_resolves_the_plugin_and_a_real_scheduler_runs_on_it():
    proc = _child(KVPOOL_CPU_PLATFORM="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["qualname"] == result["platform"] == "kvpool.cpu_platform.CpuNoTritonPlatform"
    assert result["is_cpu"] is True
    assert result["scheduled"] == {"r0": 40}
    assert result["has_triton_after"] is result["has_triton_before"] is False


@pytest.mark.slow
def test_vllm_target_device_cpu_bypasses_the_plugin():
    # vLLM's explicit CPU target is authoritative: its own CpuPlatform, whatever the plugin says.
    proc = _child(KVPOOL_CPU_PLATFORM="1", VLLM_TARGET_DEVICE="cpu")
    if proc.returncode != 0:  # vLLM 0.34.0 on x86: its own check raises
        assert "requires Triton (triton-cpu)" in proc.stderr
        return
    assert json.loads(proc.stdout.strip().splitlines()[-1])["platform"] == "vllm.platforms.cpu.CpuPlatform"


def test_has_triton_is_restored_when_vllms_check_raises():
    import vllm.triton_utils as triton_utils

    platform = cpu_platform.CpuNoTritonPlatform
    assert triton_utils.HAS_TRITON is False
    with pytest.raises(AttributeError):
        platform.check_and_update_config(object())  # vLLM's check reads vllm_config.model_config
    assert triton_utils.HAS_TRITON is False


def test_a_module_first_imported_during_the_check_gets_has_triton_back(tmp_path, monkeypatch):
    import vllm.triton_utils as triton_utils

    (tmp_path / "kvpool_probe_triton_reader.py").write_text("from vllm.triton_utils import HAS_TRITON\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = {}

    def check(vllm_config):
        import kvpool_probe_triton_reader as reader

        seen["during"] = (triton_utils.HAS_TRITON, reader.HAS_TRITON, vllm_config)

    try:
        cpu_platform._check_without_triton(check, "cfg")
        import kvpool_probe_triton_reader as reader

        assert seen["during"] == (True, True, "cfg")
        assert triton_utils.HAS_TRITON is False and reader.HAS_TRITON is False
    finally:
        sys.modules.pop("kvpool_probe_triton_reader", None)


def test_the_platform_class_is_vllms_cpu_platform_with_one_override():
    from vllm.platforms.cpu import CpuPlatform

    platform = cpu_platform.CpuNoTritonPlatform
    assert platform.__mro__[1] is CpuPlatform
    own = [name for name in vars(platform) if not (name.startswith("__") and name.endswith("__"))]
    assert own == ["check_and_update_config"]
    import pickle

    assert pickle.loads(pickle.dumps(platform)) is platform
