"""kvpool.envs: one owner and one parsing rule for every KVPOOL_* variable; a bad value
is an error naming the variable in install(), in the vLLM plugin and in `info`."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

import kvpool
from kvpool import envs, patching
from tests.support.paths import REPO

PACKAGE = REPO / "python" / "kvpool"
SWITCHES = [name for name, v in envs.VARIABLES.items() if v.kind == "switch"]


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("raw,expected", [
    ("1", True), ("true", True), ("YES", True), (" On ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False), (None, False),
])
def test_every_switch_reads_on_and_off_by_the_same_rule(name, raw, expected):
    environ = {} if raw is None else {name: raw}
    assert envs.get(name, environ) is expected


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("raw", ["2", "foo", "y", "enabled", "-1"])
def test_every_switch_rejects_other_values_naming_the_variable(name, raw):
    with pytest.raises(envs.InvalidSettingError) as info:
        envs.get(name, {name: raw})
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert name in msg and repr(raw) in msg and "true" in msg and "off" in msg


@pytest.mark.parametrize("raw,expected", [("contiguous", "contiguous"), (" VLLM ", "vllm"), ("", "vllm")])
def test_allocation_choice(raw, expected):
    assert envs.get(envs.ALLOCATION, {envs.ALLOCATION: raw}) == expected


@pytest.mark.parametrize("raw", ["foo", "contig", "1"])
def test_allocation_rejects_unknown_policies(raw):
    with pytest.raises(envs.InvalidSettingError, match=r"KVPOOL_ALLOCATION=.*vllm, contiguous"):
        envs.get(envs.ALLOCATION, {envs.ALLOCATION: raw})


@pytest.mark.parametrize("raw,expected", [("0", 0.0), ("2.5", 2.5), ("", 1.0)])
def test_metrics_interval_seconds(raw, expected):
    assert envs.get(envs.METRICS_INTERVAL_S, {envs.METRICS_INTERVAL_S: raw}) == expected


@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "inf"])
def test_metrics_interval_rejects_what_is_not_seconds(raw):
    with pytest.raises(envs.InvalidSettingError, match="KVPOOL_METRICS_INTERVAL_S"):
        envs.get(envs.METRICS_INTERVAL_S, {envs.METRICS_INTERVAL_S: raw})


@pytest.mark.parametrize("raw,expected", [("0", 0), ("64", 64), (" 256 ", 256), ("", 0)])
def test_lru_window_blocks(raw, expected):
    assert envs.get(envs.LRU_WINDOW, {envs.LRU_WINDOW: raw}) == expected


@pytest.mark.parametrize("raw", ["-1", "1.5", "many", "2147483648", "٢"])
def test_lru_window_rejects_what_is_not_a_whole_number_of_blocks(raw):
    with pytest.raises(envs.InvalidSettingError, match="KVPOOL_LRU_WINDOW=.*whole number of blocks"):
        envs.get(envs.LRU_WINDOW, {envs.LRU_WINDOW: raw})


def test_lru_window_is_installed_with_the_contiguous_policy_only(monkeypatch):
    from kvpool.block_pool import BlockPool

    try:
        kvpool.install(allocation="contiguous", lru_window=64)
        assert BlockPool(64, enable_caching=True, hash_block_size=16).free_block_queue.policy.lru_window == 64
        assert patching.installed_arguments()[envs.LRU_WINDOW] == 64
        with pytest.raises(ValueError, match="lru_window=64; uninstall"):
            kvpool.install(allocation="contiguous", lru_window=16)
        assert kvpool.install(allocation="contiguous", lru_window=64) is False
        kvpool.uninstall()
        monkeypatch.setenv(envs.LRU_WINDOW, "16")
        kvpool.install(allocation="contiguous")
        assert BlockPool(64, enable_caching=True, hash_block_size=16).free_block_queue.policy.lru_window == 16
        kvpool.uninstall()
        # The variable without the policy is refused, not ignored.
        with pytest.raises(envs.InvalidSettingError, match="KVPOOL_LRU_WINDOW='16'.*needs allocation"):
            kvpool.install()
        assert not kvpool.is_installed()
    finally:
        kvpool.uninstall()
    assert BlockPool(64, enable_caching=True, hash_block_size=16).free_block_queue.policy.lru_window == 0


def test_lru_window_takes_integers_of_any_kind_and_info_checks_the_combination(monkeypatch):
    import numpy as np

    from kvpool import allocation, info

    assert envs.check_argument(envs.LRU_WINDOW, np.int64(3)) == 3
    assert allocation.resolve_lru_window(np.int32(8), "contiguous") == 8
    monkeypatch.setenv(envs.LRU_WINDOW, "5")
    monkeypatch.delenv(envs.ALLOCATION, raising=False)
    row = {r.name: r for r in info.settings()}[envs.LRU_WINDOW]
    assert row.source == "invalid" and "needs KVPOOL_ALLOCATION=contiguous" in row.error
    monkeypatch.setenv(envs.ALLOCATION, "contiguous")
    row = {r.name: r for r in info.settings()}[envs.LRU_WINDOW]
    assert (row.value, row.source) == (5, "environment")


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"allocation": "contiguous", "lru_window": -1}, ValueError, r"lru_window=-1 .*whole number"),
    ({"allocation": "contiguous", "lru_window": 2.0}, ValueError, r"lru_window=2.0"),
    ({"allocation": "contiguous", "lru_window": True}, ValueError, r"lru_window=True"),
    ({"allocation": "vllm", "lru_window": 64}, ValueError, r"lru_window=64 .*needs allocation=\"contiguous\""),
    ({"allocation": 1}, ValueError, r"allocation=1 .*vllm, contiguous"),
    ({"allocation": ""}, ValueError, r"allocation=''"),
    ({"allocation": "foo"}, ValueError, r"allocation='foo'"),
    ({"force": "yes"}, TypeError, r"force=\.\.\.\) takes True or False"),
])
def test_install_rejects_bad_arguments_before_changing_anything(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvpool.install(**kwargs)
    assert not kvpool.is_installed()


def test_install_rejects_a_bad_variable_before_changing_anything(monkeypatch):
    from vllm.v1.core import block_pool

    monkeypatch.setenv(envs.REORDER_ON_RESET, "2")
    with pytest.raises(envs.InvalidSettingError, match="KVPOOL_REORDER_ON_RESET='2'"):
        kvpool.install()
    assert not kvpool.is_installed()
    assert block_pool.BlockPool.__module__ == "vllm.v1.core.block_pool"


def test_reorder_on_reset_accepts_true_like_every_switch(monkeypatch):
    from kvpool.block_pool import BlockPool

    pool = BlockPool(30, enable_caching=True, hash_block_size=16)
    pool.free_blocks(pool.get_new_blocks(10))
    monkeypatch.setenv(envs.REORDER_ON_RESET, "true")  # acted only on "1" before
    assert pool.reset_prefix_cache() is True
    assert pool.free_block_queue.free_block_ids() == list(range(1, 30))


def test_install_records_its_arguments_for_info(installed):
    from kvpool import info

    kvpool.uninstall()
    kvpool.install(allocation="contiguous")
    rows = {r.name: r for r in info.settings()}
    assert rows[envs.ALLOCATION].value == "contiguous"
    assert rows[envs.ALLOCATION].source == "install argument"
    assert rows[envs.REORDER_ON_IDLE].source == "default"
    assert patching.installed_arguments()[envs.ALLOCATION] == "contiguous"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=300, cwd=REPO)


_LOAD_PLUGINS = """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import kvpool
    print("INSTALLED", kvpool.is_installed())
"""


@pytest.mark.parametrize("name,raw", [("KVPOOL_ALLOCATION", "foo"), ("KVPOOL_REORDER_ON_IDLE", "2"),
                                      ("KVPOOL_DISABLE", "maybe")])
def test_plugin_stops_the_process_on_a_bad_setting(name, raw):
    # vLLM's own loader, as every vLLM process runs it before building an engine.
    proc = _run(_LOAD_PLUGINS, **{name: raw})
    assert proc.returncode != 0, proc.stdout
    assert "INSTALLED" not in proc.stdout
    assert "InvalidSettingError" in proc.stderr and f"{name}={raw!r}" in proc.stderr


@pytest.mark.parametrize("raw", ["1", "true", "ON"])
def test_plugin_disable_takes_every_on_value(raw):
    proc = _run(_LOAD_PLUGINS, KVPOOL_DISABLE=raw)
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED False" in proc.stdout


def test_plugin_installs_with_valid_settings():
    proc = _run(_LOAD_PLUGINS, KVPOOL_DISABLE="off", KVPOOL_ALLOCATION="Contiguous")
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED True" in proc.stdout


def test_info_prints_each_setting_with_its_source():
    proc = _run("from kvpool.__main__ import main; raise SystemExit(main(['info']))",
                KVPOOL_ALLOCATION="contiguous")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"KVPOOL_ALLOCATION\s+contiguous\s+\[environment \('contiguous'\)\]", proc.stdout)
    assert re.search(r"KVPOOL_REORDER_ON_RESET\s+off\s+\[default\]", proc.stdout)
    for name in envs.VARIABLES:
        assert name in proc.stdout


def test_info_says_whether_the_native_manager_path_binds():
    code = "from kvpool.__main__ import main; raise SystemExit(main(['info']))"
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    from kvpool import vllm_compat

    release = vllm_compat._release(vllm_compat.installed_vllm_version())
    assert ("native KV cache manager path (allocate_slots of a running request): on (the mirrored "
            f"vLLM functions are {release}'s)") in proc.stdout
    from kvpool.patches import hybrid_fast_path

    hybrid = "on" if release in hybrid_fast_path.KNOWN_HYBRID_SOURCES else "off: this vLLM's hybrid"
    assert f"native running step of hybrid models (full attention + sliding window): {hybrid}" in proc.stdout
    mamba = "on" if hybrid == "on" and release in hybrid_fast_path.KNOWN_MAMBA_SOURCES else "off: this vLLM's"
    assert ("... and the idle step of their Mamba groups (mamba_cache_mode align, or none with prefix caching off): "
            f"{mamba}") in proc.stdout
    proc = _run(code, KVPOOL_PYTHON_MANAGER="1")
    assert "allocate_slots of a running request): off: KVPOOL_PYTHON_MANAGER is on" in proc.stdout
    if hybrid == "on":
        assert "sliding window): off: KVPOOL_PYTHON_MANAGER is on" in proc.stdout


def test_info_names_an_invalid_setting_and_exits_2():
    proc = _run("from kvpool.__main__ import main; raise SystemExit(main(['info']))",
                KVPOOL_REORDER_ON_RESET="yes please")
    assert proc.returncode == 2
    assert re.search(r"KVPOOL_REORDER_ON_RESET +INVALID 'yes please': .*accepted: on: 1, true", proc.stdout)


def _kvpool_imports(name: str) -> list[str]:
    tree = ast.parse((PACKAGE / name).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    return [m for m in imported if m.split(".")[0] == "kvpool"]


def test_envs_is_the_bottom_layer():
    # Only the exception base, which itself imports nothing from kvpool.
    assert _kvpool_imports("envs.py") == ["kvpool.errors"]
    assert _kvpool_imports("errors.py") == []
    assert issubclass(envs.InvalidSettingError, kvpool.KvpoolError)


def test_no_module_but_envs_names_a_kvpool_variable_in_code():
    # A string constant that is exactly a variable name is a read (or set) outside envs.
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"KVPOOL_[A-Z0-9_]+", node.value):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value}")
    assert not offenders


def test_envs_names_every_kvpool_variable_of_the_project():
    known = set(envs.VARIABLES) | set(envs.SCRIPT_VARIABLES)
    found: dict[str, str] = {}
    files = [*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.sh"), *(REPO / "tests").rglob("*.py"),
             *(REPO / "docs").glob("*.md"), REPO / "README.md", *(REPO / ".ci").rglob("*")]
    for path in files:
        if not path.is_file():
            continue
        for name in re.findall(r"\bKVPOOL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(REPO)))
    unknown = {n: where for n, where in found.items() if n not in known}
    assert not unknown
