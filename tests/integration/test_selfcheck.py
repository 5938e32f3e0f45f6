"""The self-check ``install()`` runs on an untested vLLM before it patches anything
(``kvpool.selfcheck``): it passes on the installed release, and an incompatible release,
simulated by changing vLLM's own classes the way a release changes them, is refused
before any patch with a message naming each difference."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import subprocess
import sys
import textwrap

import pytest

import kvpool
from kvpool import patching, selfcheck, vllm_compat
from kvpool.errors import SelfCheckError

from tests.integration.test_install import _START_VLLM_PROCESS


def _bound_names():
    """The block classes each vLLM module binds (the modules this release has)."""
    import importlib

    out = {}
    for modname in vllm_compat.MODULES_BINDING_BLOCK_CLASSES:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError:  # (vllm.v1.hisparse is new in 0.30.0)
            continue
        for name in ("KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "BlockHashToBlockMap"):
            if name in vars(mod):
                out[(modname, name)] = vars(mod)[name]
    return out


def _classes():
    return patching.vanilla_classes(), patching._replacements()


@pytest.fixture
def compatible():
    """The simulations change a release the self-check passes: the installed one, unless
    it is a release kvpool is not ported to (this file also runs in the 0.29.0 / 0.34.0
    environments, for the tests that take any release)."""
    try:
        result = selfcheck.run(*_classes())
    except (ImportError, AttributeError) as e:
        pytest.skip(f"kvpool's block classes do not bind to this vLLM: {e}")
    if not result.ok:
        pytest.skip(f"this vLLM fails the self-check already: {result.differences[0]}")


@pytest.fixture
def untested(monkeypatch, compatible):
    """The installed vLLM reported as a release outside the supported list (forced)."""
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.99.0")
    monkeypatch.setenv(vllm_compat.ALLOW_UNTESTED_ENV, "1")


def _vllm_untouched(before) -> None:
    """Nothing of kvpool's is bound in vLLM: names, the scheduler's and manager's methods."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    assert not kvpool.is_installed()
    assert _bound_names() == before
    assert BlockPool.__module__ == "vllm.v1.core.block_pool"
    assert KVCacheManager.allocate_slots.__module__ == "vllm.v1.core.kv_cache_manager"
    assert Scheduler._free_request_blocks.__module__ == "vllm.v1.core.sched.scheduler"


def _refusal(monkeypatch) -> SelfCheckError:
    before = _bound_names()
    with pytest.raises(SelfCheckError) as info:
        kvpool.install(force=True)
    _vllm_untouched(before)  # as the simulated release had them
    monkeypatch.undo()
    return info.value


# -- the installed release -----------------------------------------------------------------
def test_selfcheck_passes_on_the_installed_release_and_compares_every_step():
    if not vllm_compat.is_supported(vllm_compat.installed_vllm_version()):
        pytest.skip("the installed vLLM is not a supported release")
    result = selfcheck.run(*_classes())
    assert result.ok, result.differences
    vanilla, ours = _classes()
    steps = []
    for cls in (vanilla["BlockPool"], ours["BlockPool"]):
        requests = {"a": selfcheck._request("a", list(range(12))),
                    "b": selfcheck._request("b", [*range(8), 50, 51, 52, 53])}
        steps.append(selfcheck._run_script(cls, requests)[0])
    # Every step ran on both pools (none raised), and the steps saw evictions and events.
    assert len(steps[0]) == len(steps[1]) >= 15
    assert not any(isinstance(snapshot, str) for _, snapshot in steps[0] + steps[1])
    assert steps[0] == steps[1]
    events = [e for _, snapshot in steps[0] for e in snapshot[4]]
    assert any(e.startswith("BlockStored(") for e in events)
    assert any(e.startswith("BlockRemoved(") for e in events)
    assert events[-1] == "AllBlocksCleared()"


def test_forced_install_on_the_installed_release_runs_the_selfcheck_then_patches(untested, monkeypatch):
    calls = []
    run = selfcheck.run
    monkeypatch.setattr(selfcheck, "run", lambda *a: calls.append(1) or run(*a))
    assert kvpool.install(force=True) is True
    assert calls == [1] and patching.installed_vllm_version() == "0.99.0"


def test_a_supported_release_skips_the_selfcheck(monkeypatch):
    if not vllm_compat.is_supported(vllm_compat.installed_vllm_version()):
        pytest.skip("the installed vLLM is not a supported release")

    def fail(*args):
        raise AssertionError("the self-check ran on a supported release")

    monkeypatch.setattr(selfcheck, "run", fail)
    assert kvpool.install() is True


def test_forced_install_installs_or_refuses_before_patching():
    # On whatever vLLM this environment holds (a supported one, or 0.29.0 / 0.34.0 in
    # their own environments): a forced install either patches or refuses with nothing
    # changed; it never patches and then fails.
    before = _bound_names()
    try:
        assert kvpool.install(force=True) is True
    except vllm_compat.UnsupportedVLLMVersionError:
        _vllm_untouched(before)
        return
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(16, True, 4, enable_kv_cache_events=True)
    pool.free_blocks(pool.get_new_blocks(3))
    assert pool.reset_prefix_cache() is True


# -- simulated incompatible releases ------------------------------------------------------
def test_a_map_constructor_taking_the_blocks_is_refused_naming_it(untested, monkeypatch):
    from vllm.v1.core import block_pool

    vanilla_init = block_pool.BlockHashToBlockMap.__init__

    def __init__(self, blocks):  # vLLM 0.34.0's signature
        vanilla_init(self)
        self._blocks = blocks

    monkeypatch.setattr(block_pool.BlockHashToBlockMap, "__init__", __init__)
    error = _refusal(monkeypatch)
    assert "BlockHashToBlockMap.__init__: vLLM takes (self, blocks), kvpool's takes (self)" in error.differences
    assert "BlockHashToBlockMap.__init__: vLLM takes (self, blocks), kvpool's takes (self)" in str(error)
    assert "nothing was patched" in str(error)
    assert isinstance(error, vllm_compat.UnsupportedVLLMVersionError)


def _renamed_block_class(vanilla: type) -> type:
    """vLLM's KVCacheBlock with ``_block_hash`` / ``_block_hash_num_tokens`` renamed to
    public, writable fields (as vLLM 0.34.0 did)."""

    @dataclasses.dataclass
    class KVCacheBlock:
        block_id: int
        ref_cnt: int = 0
        pool: object = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)
        block_hash: bytes | None = None
        block_hash_num_tokens: int | None = None
        prev_free_block: KVCacheBlock | None = None
        next_free_block: KVCacheBlock | None = None
        is_null: bool = False

        def set_block_hash(self, block_hash, num_tokens=None):
            self.block_hash, self.block_hash_num_tokens = block_hash, num_tokens

        def reset_hash(self):
            self.block_hash = self.block_hash_num_tokens = None

    KVCacheBlock.__module__ = vanilla.__module__
    return KVCacheBlock


def test_a_renamed_block_field_is_refused_naming_it(untested, monkeypatch):
    from vllm.v1.core import block_pool, kv_cache_utils

    renamed = _renamed_block_class(kv_cache_utils.KVCacheBlock)
    monkeypatch.setattr(kv_cache_utils, "KVCacheBlock", renamed)
    monkeypatch.setattr(block_pool, "KVCacheBlock", renamed)
    error = _refusal(monkeypatch)
    text = "\n".join(error.differences)
    assert "KVCacheBlock._block_hash: kvpool's native code reads and writes it, vLLM's KVCacheBlock has no such field" in text
    assert "KVCacheBlock.block_hash: a writable field of vLLM's KVCacheBlock, read-only on kvpool's" in text
    assert "KVCacheBlock.__init__: vLLM takes (self, block_id, ref_cnt=0, block_hash=None," in text


def test_a_new_keyword_of_an_overridden_method_is_refused_naming_it(untested, monkeypatch):
    from vllm.v1.core import block_pool

    vanilla_free = block_pool.BlockPool.free_blocks

    def free_blocks(self, ordered_blocks, evict_first=False):  # vLLM 0.34.0's signature
        return vanilla_free(self, ordered_blocks)

    monkeypatch.setattr(block_pool.BlockPool, "free_blocks", free_blocks)
    error = _refusal(monkeypatch)
    assert error.differences == (
        "BlockPool.free_blocks: vLLM takes (self, ordered_blocks, evict_first=False), "
        "kvpool's takes (self, ordered_blocks)",)


def test_a_changed_method_contract_is_refused_naming_the_step(untested, monkeypatch):
    # vLLM's free_blocks (which kvpool's pool replaces natively) now returns hashed
    # blocks to the front of the free queue: same signature, other free-queue order.
    from vllm.v1.core import block_pool

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        self.free_block_queue.prepend_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])

    monkeypatch.setattr(block_pool.BlockPool, "free_blocks", free_blocks)
    error = _refusal(monkeypatch)
    assert len(error.differences) == 1, error.differences
    assert error.differences[0].startswith(
        "contract: free_blocks(a reversed): vLLM's BlockPool gave (None, [3, 2, 1, 8,")
    assert "kvpool's gave (None, [8, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1]" in error.differences[0]


def test_a_map_storing_block_ids_is_refused_naming_the_layout(untested, monkeypatch):
    # vLLM 0.34.0's map keeps block ids in _cache; kvpool's native code reads blocks.
    from vllm.v1.core import block_pool

    vanilla_insert = block_pool.BlockHashToBlockMap.insert

    def insert(self, key, block):
        vanilla_insert(self, key, block)
        self._cache[key] = block.block_id

    def get_one_block(self, key):
        block_id = self._cache.get(key)
        return None if block_id is None else self._pool_blocks[block_id]

    monkeypatch.setattr(block_pool.BlockHashToBlockMap, "insert", insert)
    monkeypatch.setattr(block_pool.BlockHashToBlockMap, "get_one_block", get_one_block)
    error = _refusal(monkeypatch)
    assert any(d.startswith("BlockHashToBlockMap layout: vLLM's map stores int values in _cache")
               for d in error.differences), error.differences


def test_the_plugin_logs_a_failed_selfcheck_and_leaves_vllm_vanilla(compatible):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from kvpool import vllm_compat
        vllm_compat.installed_vllm_version = lambda: "0.99.0"
        from vllm.v1.core import block_pool
        init = block_pool.BlockHashToBlockMap.__init__
        def __init__(self, blocks):
            init(self)
        block_pool.BlockHashToBlockMap.__init__ = __init__
        """) + _START_VLLM_PROCESS], capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "KVPOOL_ALLOW_UNTESTED_VLLM": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED False vllm.v1.core.block_pool" in proc.stdout
    out = proc.stdout + proc.stderr
    assert "kvpool: not activated: kvpool 0.1.0 does not install into vLLM 0.99.0: its self-check found" in out
    assert "BlockHashToBlockMap.__init__: vLLM takes (self, blocks), kvpool's takes (self)" in out


def test_a_selfcheck_that_raises_refuses(untested, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(selfcheck, "check_fields", broken)
    error = _refusal(monkeypatch)
    assert error.differences == ("the self-check itself raised RuntimeError: boom",)


def test_the_selfcheck_holds_back_the_pools_log_lines(caplog, compatible):
    with caplog.at_level(logging.DEBUG):
        assert selfcheck.run(*_classes()).ok
    assert not [r for r in caplog.records if "prefix cache" in r.getMessage()]


# -- the signature rule --------------------------------------------------------------------
def _sig(func) -> inspect.Signature:
    return inspect.signature(func)


@pytest.mark.parametrize(("theirs", "ours", "ok"), [
    (lambda self, a: 0, lambda self, a: 0, True),
    (lambda self, a: 0, lambda self, a, extra=1: 0, True),  # a kvpool addition with a default
    (lambda self, a: 0, lambda self, a, extra: 0, False),  # ... without one
    (lambda self, a, b=0: 0, lambda self, a: 0, False),  # vLLM's new keyword
    (lambda self, a, b=0: 0, lambda self, a, b: 0, False),  # kvpool's requires what vLLM's defaults
    (lambda self, a: 0, lambda self, b: 0, False),  # renamed
    (lambda self, a, b: 0, lambda self, b, a: 0, False),  # reordered
    (lambda self, *, a=0: 0, lambda self, a=0: 0, True),
    (lambda self, a, /: 0, lambda self, a: 0, True),
    (lambda self, a: 0, lambda self, a, /: 0, False),  # vLLM's may be passed by name
    (lambda self, *args: 0, lambda self: 0, False),
])
def test_accepts(theirs, ours, ok):
    assert selfcheck.accepts(_sig(theirs), _sig(ours)) is ok


def test_without_the_type_stub_the_extension_s_signatures_are_not_guessed(monkeypatch, compatible):
    # A build that ships no _core.pyi: the extension's __init__ reads as (self, /, *args,
    # **kwargs), which says nothing; it must not be reported as a difference.
    from kvpool import _core

    monkeypatch.setattr(selfcheck, "_STUB", selfcheck._STUB.with_name("no-such-stub.pyi"))
    selfcheck._stub_functions.cache_clear()
    try:
        assert selfcheck._signature(_core.KVCacheBlock, "__init__") is None
        assert selfcheck.run(*_classes()).ok
    finally:
        monkeypatch.undo()
        selfcheck._stub_functions.cache_clear()
    assert "_block_hash" in str(selfcheck._signature(_core.KVCacheBlock, "__init__"))
