"""install() / uninstall(): every binding replaced and restored; plugin; version guard."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import kvpool
from kvpool import info as kvpool_info, patching, vllm_compat


def _bound_names():
    out = {}
    for modname in vllm_compat.MODULES_BINDING_BLOCK_CLASSES:
        mod = importlib.import_module(modname)
        for name in ("KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool"):
            if name in vars(mod):
                out[(modname, name)] = vars(mod)[name]
    return out


def test_install_replaces_every_binding_and_uninstall_restores_it():
    from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool

    vanilla = patching.vanilla_classes()
    before = _bound_names()
    assert before and all(v is vanilla[k[1]] for k, v in before.items())

    assert kvpool.install() is True
    assert kvpool.is_installed()
    after = _bound_names()
    ours = patching._replacements()
    for key, value in after.items():
        assert value is ours[key[1]], key
    # A subclass defined at import time now inherits kvpool's BlockPool.
    assert SharedEventQueueBlockPool.__mro__[1] is ours["BlockPool"]
    assert kvpool.install() is False  # idempotent

    assert kvpool.uninstall() is True
    assert _bound_names() == before
    assert SharedEventQueueBlockPool.__mro__[1] is vanilla["BlockPool"]
    assert kvpool.uninstall() is False
    assert not kvpool.is_installed()


def test_subclass_built_after_install_runs_on_the_native_pool(installed):
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool

    owner = kvpool.BlockPool(8, True, 16)
    pool = SharedEventQueueBlockPool(8, True, 16, event_owner=owner)
    assert isinstance(pool.blocks[1], KVCacheBlock) and type(pool.blocks[1]) is kvpool.KVCacheBlock
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.free_block_ids()[:3] == [3, 2, 1]
    assert pool.reset_free_block_queue_order()


def test_umbp_lookup_pool_is_rebased_when_importable():
    umbp = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.umbp.scheduler")
    with_install = kvpool.install()
    try:
        assert with_install
        assert umbp._LookupBlockPool.__mro__[1] is kvpool.BlockPool
    finally:
        kvpool.uninstall()
    assert umbp._LookupBlockPool.__mro__[1] is patching.vanilla_classes()["BlockPool"]


def test_scheduler_built_after_install_uses_kvpool(installed):
    from tests.support.scheduler import make_request, make_scheduler

    scheduler = make_scheduler(num_blocks=100)
    pool = scheduler.kv_cache_manager.block_pool
    assert type(pool) is kvpool.BlockPool
    scheduler.add_request(make_request("r", list(range(40))))
    scheduler.schedule()
    assert pool.get_num_free_blocks() == 99 - 3


SUPPORTED_NAMED = ", ".join(vllm_compat.SUPPORTED_VLLM_VERSIONS)


@pytest.mark.parametrize("version", ["0.29.0", "0.35.0"])
def test_unsupported_vllm_version_is_refused_naming_the_supported_ones(monkeypatch, version):
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: version)
    with pytest.raises(vllm_compat.UnsupportedVLLMVersionError) as excinfo:
        kvpool.install()
    assert f"supports vLLM {SUPPORTED_NAMED}; found vLLM {version}" in str(excinfo.value)
    assert not kvpool.is_installed()
    info = kvpool_info.describe()
    assert f"vLLM installed: {version} (NOT supported)" in info
    assert f"supported vLLM: {SUPPORTED_NAMED}" in info
    monkeypatch.setenv(vllm_compat.ALLOW_UNTESTED_ENV, "1")
    assert kvpool.install() is True


def test_every_supported_version_is_a_release_of_the_matrix():
    assert set(vllm_compat.SUPPORTED_VLLM_VERSIONS) <= set(vllm_compat.VLLM_RELEASES)
    assert vllm_compat.release_traits("0.35.0") is vllm_compat.VLLM_RELEASES["0.34.0"]
    assert vllm_compat.release_traits("0.29.0") is vllm_compat.VLLM_RELEASES["0.30.0"]
    assert vllm_compat.release_traits("0.31.0+cpu") is vllm_compat.VLLM_RELEASES["0.31.0"]


def test_plugin_on_an_unsupported_vllm_warns_once_and_changes_nothing():
    proc = _run(
        textwrap.dedent(
            """
            import logging
            from kvpool import vllm_compat
            vllm_compat.installed_vllm_version = lambda: "0.29.0"
            """
        ) + _START_VLLM_PROCESS
    )
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED False vllm.v1.core.block_pool" in proc.stdout
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if "kvpool: not activated" in line]
    assert len(warnings) == 1, out
    assert f"supports vLLM {SUPPORTED_NAMED}; found vLLM 0.29.0" in warnings[0]


def test_failed_patch_leaves_vllm_untouched(monkeypatch):
    before = _bound_names()

    def boom(patcher):
        raise RuntimeError("boom")

    import kvpool.patches.engine_api as engine_api  # noqa: F401 - make sure it is importable

    monkeypatch.setattr(patching, "PATCH_MODULES", ("kvpool.patches.deferred_free", "tests_fake_patch"))
    fake = type(sys)("tests_fake_patch")
    fake.apply = boom
    monkeypatch.setitem(sys.modules, "tests_fake_patch", fake)
    with pytest.raises(RuntimeError, match="boom"):
        kvpool.install()
    assert not kvpool.is_installed()
    assert _bound_names() == before
    from vllm.v1.core.sched.scheduler import Scheduler

    init = Scheduler.__init__
    assert "deferred_frees" not in init.__code__.co_names or not hasattr(init, "__wrapped__")


def test_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvpool"]
    assert eps and eps[0].value == "kvpool.plugin:register"


def _run(code: str, **env):
    import os

    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=300)


#: What a vLLM process runs first (its root logger, then its general plugins); prints
#: whether kvpool is installed and where vLLM's ``BlockPool`` binding comes from.
_START_VLLM_PROCESS = """
from vllm.logger import _configure_vllm_root_logger
_configure_vllm_root_logger()
from vllm.plugins import load_general_plugins
load_general_plugins()
import kvpool
from vllm.v1.core import block_pool
print("INSTALLED", kvpool.is_installed(), block_pool.BlockPool.__module__)
"""


def test_vllm_plugin_loader_activates_kvpool_in_a_fresh_process():
    proc = _run(_START_VLLM_PROCESS)
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED True kvpool.block_pool" in proc.stdout
    assert "kvpool 0.1.0 active" in proc.stdout + proc.stderr
    assert f"vLLM {vllm_compat.installed_vllm_version()}" in proc.stdout + proc.stderr


def test_kvpool_disable_turns_the_plugin_off():
    proc = _run(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import kvpool
        print("INSTALLED", kvpool.is_installed())
        """,
        KVPOOL_DISABLE="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED False" in proc.stdout


# -- forced untested vLLM releases degrade instead of crashing ------------------------------
def test_forced_untested_vllm_skips_what_it_lacks_with_one_warning_and_installs_the_rest(monkeypatch, caplog):
    # vLLM 0.29.0's KVCacheCoordinator has no reset_prefix_cache() (checked against the
    # real 0.29.0 wheel, docs/conformance.md); simulated here on the installed release.
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.29.0")
    monkeypatch.delattr(KVCacheCoordinator, "reset_prefix_cache")
    before = _bound_names()
    drain = Scheduler.__dict__["_drain_deferred_frees"]
    with caplog.at_level("WARNING", logger="vllm.kvpool"):
        assert kvpool.install(force=True) is True
    try:
        warnings = [r.getMessage() for r in caplog.records if "not patched" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "kvpool.patches.engine_api" in warnings[0]
        assert "KVCacheCoordinator defines no reset_prefix_cache()" in warnings[0]
        assert "untested vLLM 0.29.0" in warnings[0]
        assert list(patching.skipped_patches()) == ["kvpool.patches.engine_api"]
        # engine_api's changes made before the missing method were taken back ...
        assert not hasattr(KVCacheCoordinator, "reset_free_block_queue_order")
        # ... and the rest installed: the classes and the other patch modules.
        assert all(v is patching._replacements()[k[1]] for k, v in _bound_names().items())
        assert Scheduler.__dict__["_drain_deferred_frees"] is not drain
    finally:
        assert kvpool.uninstall() is True
    assert _bound_names() == before
    assert Scheduler.__dict__["_drain_deferred_frees"] is drain


def test_missing_patch_target_on_a_supported_vllm_refuses_cleanly(monkeypatch):
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    monkeypatch.delattr(KVCacheCoordinator, "reset_prefix_cache")
    before = _bound_names()
    with pytest.raises(vllm_compat.UnsupportedVLLMVersionError, match="defines no reset_prefix_cache") as info:
        kvpool.install()
    assert not isinstance(info.value, AttributeError)
    assert not kvpool.is_installed() and _bound_names() == before
    assert not hasattr(KVCacheCoordinator, "reset_free_block_queue_order")


def test_forced_untested_vllm_without_bindable_block_classes_refuses_before_changing_anything(monkeypatch):
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.29.0")
    monkeypatch.setenv("KVPOOL_ALLOW_UNTESTED_VLLM", "yes")

    def missing():
        raise ImportError("cannot import name 'BlockHashToBlockMap' from 'vllm.v1.core.block_pool'")

    monkeypatch.setattr(patching, "vanilla_classes", missing)
    with pytest.raises(vllm_compat.UnsupportedVLLMVersionError, match="untested vLLM 0.29.0.*nothing was changed"):
        kvpool.install()
    assert not kvpool.is_installed()


def test_forced_untested_vllm_skips_a_patch_whose_replacement_calls_a_missing_helper(monkeypatch):
    # vLLM 0.29.0's Scheduler has no _request_blocks_can_be_freed, which kvpool's
    # _free_request_blocks calls: patching it anyway crashed the first freed request.
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.29.0")
    monkeypatch.delattr(Scheduler, "_request_blocks_can_be_freed")
    free = Scheduler.__dict__["_free_request_blocks"]
    assert kvpool.install(force=True) is True
    try:
        assert "kvpool.patches.deferred_free" in patching.skipped_patches()
        assert "_request_blocks_can_be_freed" in patching.skipped_patches()["kvpool.patches.deferred_free"]
        assert Scheduler.__dict__["_free_request_blocks"] is free
        assert "kvpool.patches.engine_api" not in patching.skipped_patches()
    finally:
        kvpool.uninstall()


def test_a_vllm_module_imported_while_installed_gets_vllm_s_classes_back(monkeypatch):
    # A vLLM module first imported while kvpool is installed binds kvpool's classes and
    # subclasses kvpool's BlockPool; uninstall() gives it vLLM's, as to one imported
    # before install(). (Once: such bindings outlived uninstall(), so a later test in
    # the same process saw kvpool's classes in vLLM's modules.)
    import types

    vanilla = patching.vanilla_classes()
    kvpool.install()
    try:
        late = types.ModuleType("vllm._kvpool_late_import")
        monkeypatch.setitem(sys.modules, late.__name__, late)
        exec(textwrap.dedent("""
            from vllm.v1.core.block_pool import BlockPool
            from vllm.v1.core.kv_cache_utils import KVCacheBlock

            class LatePool(BlockPool):
                pass
        """), late.__dict__)
        late.LatePool.__module__ = late.__name__
        assert late.BlockPool is kvpool.BlockPool and late.KVCacheBlock is kvpool.KVCacheBlock
    finally:
        kvpool.uninstall()
    assert late.BlockPool is vanilla["BlockPool"] and late.KVCacheBlock is vanilla["KVCacheBlock"]
    assert late.LatePool.__bases__ == (vanilla["BlockPool"],)
    assert all(v is vanilla[k[1]] for k, v in _bound_names().items())
