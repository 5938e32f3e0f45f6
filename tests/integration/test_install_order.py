"""kvpool installs before vLLM builds its KV cache, or refuses and changes nothing.

A pool that vLLM built without kvpool holds vLLM's ``KVCacheBlock`` objects in vLLM's
``BlockHashToBlockMap``, which asserts that every block is the ``KVCacheBlock`` its module
names; ``install()`` rebinds that name to kvpool's class, so such a pool's next
prefix-cache hit or eviction would raise inside vLLM's scheduler. ``install()`` therefore
refuses while such a pool is alive (``PoolsBuiltBeforeInstallError``), before it patches
anything; the plugin, which vLLM loads before it builds an engine, logs the refusal
instead of stopping vLLM.
"""

from __future__ import annotations

import gc
import logging
import sys

import pytest

import kvpool
from kvpool import patching
from tests.support.scheduler import make_request, make_scheduler, runner_output

PREFIX = list(range(1, 65))   # 4 full blocks of 16 tokens


def _round(scheduler, tag: str, n: int = 3, max_tokens: int = 3) -> None:
    """``n`` requests sharing PREFIX (prefix-cache hits from the second on), to completion."""
    for i in range(n):
        scheduler.add_request(make_request(f"{tag}{i}", PREFIX + [1000 + i] * 5, max_tokens=max_tokens))
    for _ in range(200):
        if not scheduler.has_requests():
            return
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out))
    raise AssertionError("the round did not finish")


def _vllm_names():
    from vllm.v1.core import block_pool, kv_cache_utils

    return (kv_cache_utils.KVCacheBlock, block_pool.KVCacheBlock, block_pool.BlockPool,
            block_pool.BlockHashToBlockMap)


def test_install_refuses_while_a_scheduler_built_without_kvpool_is_alive():
    scheduler = make_scheduler(num_blocks=40)
    _round(scheduler, "a")
    before = _vllm_names()
    with pytest.raises(kvpool.PoolsBuiltBeforeInstallError, match="must run before vLLM builds"):
        kvpool.install()
    assert isinstance(kvpool.PoolsBuiltBeforeInstallError("x"), (kvpool.KvpoolError, RuntimeError))
    # Nothing patched: vLLM's names, and the scheduler keeps working (hits, evictions).
    assert not kvpool.is_installed() and _vllm_names() == before
    pool = scheduler.kv_cache_manager.block_pool
    _round(scheduler, "b", n=6)
    assert len(pool.cached_block_hash_to_block) > 0
    del scheduler, pool
    assert kvpool.install() is True


def test_install_refuses_after_an_engine_core_was_built(monkeypatch):
    """The LLM shape: vLLM's engine-core client (an EngineCore in this process, as
    ``LLM`` builds it), created before install()."""
    from tests.integration.test_engine_api import run_client_round
    from tests.support.scripted_engine import make_engine_core_client, make_engine_core_request

    # (vLLM loads kvpool's plugin while it builds the engine: disabled here, so the
    # engine is built without kvpool, as by a vLLM that has no kvpool installed.)
    monkeypatch.setenv("KVPOOL_DISABLE", "1")
    client = make_engine_core_client(multiprocess_mode=False)
    monkeypatch.delenv("KVPOOL_DISABLE")
    assert not kvpool.is_installed()
    try:
        prompts = [PREFIX + [2000 + i] for i in range(3)]
        run_client_round(client, [make_engine_core_request(p, 2) for p in prompts])
        with pytest.raises(kvpool.PoolsBuiltBeforeInstallError):
            kvpool.install()
        assert not kvpool.is_installed()
        # The engine still serves, its prefix cache included.
        run_client_round(client, [make_engine_core_request(p, 2) for p in prompts])
    finally:
        client.shutdown()


def test_without_the_refusal_the_old_pool_breaks_inside_vllm(monkeypatch):
    """Why install() refuses: forced past the check, the scheduler built before it fails
    at its next prefix-cache hit with vLLM's own assertion (vLLM 0.30.0-0.33.0), or
    (0.34.0, whose map of block ids reads no block type) keeps running vLLM's own pool
    while install() reported success."""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    from kvpool.block_pool import BlockPool
    from kvpool.vllm_compat import release_traits

    scheduler = make_scheduler(num_blocks=40)
    _round(scheduler, "a")
    monkeypatch.setattr(patching, "_refuse_pools_built_before_install", lambda: None)
    assert kvpool.install() is True
    if not release_traits().block_ids_map:
        with pytest.raises(AssertionError, match="Invalid KV cache block type"):
            _round(scheduler, "b", n=6)
        return
    _round(scheduler, "b", n=6)
    pool = scheduler.kv_cache_manager.block_pool
    assert type(pool) is VllmBlockPool and not isinstance(pool, BlockPool)


def test_unreachable_pools_do_not_count():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(16, True, 16)
    pool.cycle = pool   # garbage only a collection frees
    del pool
    assert kvpool.install() is True


def test_pools_built_while_installed_stay_acceptable_after_reinstall():
    kvpool.install()
    scheduler = make_scheduler(num_blocks=40)
    _round(scheduler, "a")
    kvpool.uninstall()
    assert patching.vllm_built_pools() == []
    kvpool.install()
    _round(scheduler, "b", n=6)


def test_the_plugin_logs_the_refusal_instead_of_stopping_vllm(caplog):
    from kvpool import plugin

    scheduler = make_scheduler(num_blocks=40)
    with caplog.at_level(logging.WARNING, logger="vllm.kvpool"):
        logging.getLogger("vllm.kvpool").propagate = True
        plugin.register()
    assert not kvpool.is_installed()
    assert any("must run before vLLM builds" in r.getMessage() for r in caplog.records)
    del scheduler


def test_no_vllm_pool_module_means_nothing_to_scan(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm.v1.core.block_pool")
    assert patching.vllm_built_pools() == []
    gc.collect()
