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
    it is a release kvpool is not ported to (this file also runs in the 0.29.0
    environment, for the tests that take any release)."""
    try:
        result = selfcheck.run(*_classes())
    except (ImportError, AttributeError) as e:
        pytest.skip(f"kvpool's block classes do not bind to this vLLM: {e}")
    if not result.ok:
        pytest.skip(f"this vLLM fails the self-check already: {result.differences[0]}")


def _untested_version() -> str:
    """A version outside the supported list whose release traits are the installed
    release's (the nearest row below it: ``0.33.99`` on 0.33.0), so that kvpool's
    modules, wherever they read the traits, act as they do on the installed release."""
    row = vllm_compat.release_traits().version
    version = row.rsplit(".", 1)[0] + ".99"
    assert not vllm_compat.is_supported(version)
    assert vllm_compat.release_traits(version) == vllm_compat.release_traits()
    return version


@pytest.fixture
def untested(monkeypatch, compatible):
    """The installed vLLM reported as a release outside the supported list (forced)."""
    version = _untested_version()
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: version)
    monkeypatch.setenv(vllm_compat.ALLOW_UNTESTED_ENV, "1")
    return version


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
def _ported_to_the_installed_release() -> bool:
    """True when the installed vLLM is a release of kvpool's table (supported, or ported
    to and not yet in the supported list, as 0.34.0 before its conformance run)."""
    version = vllm_compat.installed_vllm_version()
    return version is not None and vllm_compat.release_traits(version).version == version.split("+", 1)[0]


def test_selfcheck_passes_on_the_installed_release_and_compares_every_step():
    if not _ported_to_the_installed_release():
        pytest.skip("kvpool is not ported to the installed vLLM")
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
    assert calls == [1] and patching.installed_vllm_version() == untested


def test_a_supported_release_skips_the_selfcheck(monkeypatch):
    if not vllm_compat.is_supported(vllm_compat.installed_vllm_version()):
        pytest.skip("the installed vLLM is not a supported release")

    def fail(*args):
        raise AssertionError("the self-check ran on a supported release")

    monkeypatch.setattr(selfcheck, "run", fail)
    assert kvpool.install() is True


def test_forced_install_installs_or_refuses_before_patching():
    # On whatever vLLM this environment holds (a supported one, 0.34.0 before it is in
    # the supported list, or 0.29.0 in its own environment): a forced install either
    # patches or refuses with nothing changed; it never patches and then fails.
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
# Each simulation changes the installed release's own classes away from it (whatever
# release it is), the way a next release could, so that it is an incompatibility on every
# release kvpool serves; the expected lines are built from vLLM's classes as installed.
def _unannotated(sig: inspect.Signature) -> inspect.Signature:
    P = inspect.Parameter
    return sig.replace(parameters=[p.replace(annotation=P.empty) for p in sig.parameters.values()],
                       return_annotation=P.empty)


def _declaring_one_more(func, name: str, default=inspect.Parameter.empty):
    """``func`` declaring a new last parameter ``name`` (a release adding it). Calls
    without it still run ``func`` (the argument is dropped), so that the declaration is
    the only change: vLLM's own pool runs as before."""
    sig = inspect.signature(func)
    taken = len(sig.parameters)

    def declared(*args, **kwargs):
        kwargs.pop(name, None)
        return func(*args[:taken], **kwargs)

    new = inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
    declared.__signature__ = sig.replace(parameters=[*sig.parameters.values(), new])
    declared.__name__, declared.__qualname__ = func.__name__, func.__qualname__
    return declared


def test_a_new_required_map_constructor_parameter_is_refused_naming_it(untested, monkeypatch):
    # kvpool's pool builds vLLM's map with the arguments the installed release takes
    # (INHERITED_CALLS); a release whose constructor requires one more is refused.
    from vllm.v1.core import block_pool

    vanilla_init = block_pool.BlockHashToBlockMap.__init__
    names = list(inspect.signature(vanilla_init).parameters)  # (self) / (self, blocks)
    declared = _declaring_one_more(vanilla_init, "capacity")
    monkeypatch.setattr(block_pool.BlockHashToBlockMap, "__init__", declared)
    error = _refusal(monkeypatch)
    line = (f"BlockHashToBlockMap.__init__: vLLM takes {_unannotated(inspect.signature(declared))}, "
            f"kvpool's takes ({', '.join(names)})")
    assert f"({', '.join([*names, 'capacity'])})" in line
    assert error.differences == (line,)
    assert line in str(error)
    assert "nothing was patched" in str(error)
    assert isinstance(error, vllm_compat.UnsupportedVLLMVersionError)


def _hash_fields(block_cls: type) -> dict[str, str]:
    """The installed KVCacheBlock's hash fields (``_block_hash`` / ``block_hash``, and
    ``..._num_tokens``) -> the names a release renaming them gives them."""
    renamed = {}
    for f in dataclasses.fields(block_cls):
        if "block_hash" in f.name:
            renamed[f.name] = f.name.replace("block_hash", "cached_hash")
    assert len(renamed) == 2, renamed
    return renamed


def _renamed_block_class(vanilla: type, renames: dict[str, str]) -> type:
    """vLLM's KVCacheBlock with the fields ``renames`` names renamed, all else kept (order,
    defaults, keyword-only, repr, compare, slots); ``block_hash`` / ``block_hash_num_tokens``
    stay readable (properties over the new fields) and ``set_block_hash`` / ``reset_hash``
    write the new fields, so that vLLM's own pool runs as before."""
    fields = [(renames.get(f.name, f.name), f.type,
               dataclasses.field(default=f.default, repr=f.repr, compare=f.compare, kw_only=f.kw_only))
              for f in dataclasses.fields(vanilla)]
    hash_name = next(new for old, new in renames.items() if not old.endswith("_num_tokens"))
    tokens_name = next(new for old, new in renames.items() if old.endswith("_num_tokens"))

    def set_block_hash(self, block_hash, num_tokens=None):
        assert getattr(self, hash_name) is None and getattr(self, tokens_name) is None
        setattr(self, hash_name, block_hash)
        setattr(self, tokens_name, num_tokens)

    def reset_hash(self):
        setattr(self, hash_name, None)
        setattr(self, tokens_name, None)

    def __repr__(self):
        hash_value = getattr(self, hash_name)
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, {hash_name}={hash_value!r})"

    namespace = {
        "block_hash": property(lambda self: getattr(self, hash_name)),
        "block_hash_num_tokens": property(lambda self: getattr(self, tokens_name)),
        "set_block_hash": set_block_hash, "reset_hash": reset_hash, "__repr__": __repr__,
    }
    cls = dataclasses.make_dataclass("KVCacheBlock", fields, namespace=namespace, slots=True)
    cls.__module__ = vanilla.__module__
    return cls


def test_a_renamed_block_hash_field_is_refused_naming_it(untested, monkeypatch):
    from vllm.v1.core import block_pool, kv_cache_utils

    vanilla = kv_cache_utils.KVCacheBlock
    renames = _hash_fields(vanilla)
    renamed = _renamed_block_class(vanilla, renames)
    monkeypatch.setattr(kv_cache_utils, "KVCacheBlock", renamed)
    monkeypatch.setattr(block_pool, "KVCacheBlock", renamed)
    error = _refusal(monkeypatch)
    text = "\n".join(error.differences)
    for old, new in renames.items():
        assert (f"KVCacheBlock.{old}: kvpool's native code reads and writes it, vLLM's KVCacheBlock has no such "
                f"field (vLLM's: ") in text, error.differences
        assert f"KVCacheBlock.{new}: a field of vLLM's KVCacheBlock, not an attribute of kvpool's" in text
    first, second = renames.values()
    assert f"KVCacheBlock.__init__: vLLM takes (self, block_id, ref_cnt=0, {first}=None, {second}=None," in text
    # vLLM's own pool ran the script with the renamed block as before: no contract line.
    assert not [d for d in error.differences if d.startswith("contract:")], error.differences


def test_a_new_keyword_of_an_overridden_method_is_refused_naming_it(untested, monkeypatch):
    # kvpool's BlockPool overrides free_blocks; a release giving vLLM's a new keyword
    # (with a default: vLLM's own callers may pass it) is refused.
    from vllm.v1.core import block_pool

    from kvpool import block_pool as kvpool_block_pool

    declared = _declaring_one_more(block_pool.BlockPool.free_blocks, "recycle", default=False)
    monkeypatch.setattr(block_pool.BlockPool, "free_blocks", declared)
    error = _refusal(monkeypatch)
    theirs = _unannotated(inspect.signature(declared))
    assert str(theirs).endswith(", recycle=False)")
    ours = _unannotated(inspect.signature(kvpool_block_pool.BlockPool.free_blocks))
    assert error.differences == (f"BlockPool.free_blocks: vLLM takes {theirs}, kvpool's takes {ours}",)


def test_a_changed_method_contract_is_refused_naming_the_step(untested, monkeypatch):
    # vLLM's free_blocks (which kvpool's pool replaces natively) now returns hashed
    # blocks to the front of the free queue: same signature, other free-queue order.
    from vllm.v1.core import block_pool

    def free_blocks(self, ordered_blocks, *args, **kwargs):
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        self.free_block_queue.prepend_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])

    free_blocks.__signature__ = inspect.signature(block_pool.BlockPool.free_blocks)
    monkeypatch.setattr(block_pool.BlockPool, "free_blocks", free_blocks)
    error = _refusal(monkeypatch)
    assert len(error.differences) == 1, error.differences
    assert error.differences[0].startswith(
        "contract: free_blocks(a reversed): vLLM's BlockPool gave (None, [3, 2, 1, 8,")
    assert "kvpool's gave (None, [8, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1]" in error.differences[0]


class _BlocksLayout:
    """Methods of a map keeping block objects in ``_cache`` (a ``{block_id: block}``
    dict where several blocks share a key): vLLM's layout up to 0.33.0."""

    def get_one_block(self, key):
        value = self._cache.get(key)
        return next(iter(value.values())) if type(value) is dict else value

    def contain(self, key, block_id):
        value = self._cache.get(key)
        return block_id in value if type(value) is dict else value is not None and value.block_id == block_id

    def insert(self, key, block):
        value = self._cache.setdefault(key, block)
        if value is not block:
            if type(value) is not dict:
                value = self._cache[key] = {value.block_id: value}
            value[block.block_id] = block

    def pop(self, key, block_id):
        value = self._cache.get(key)
        if type(value) is dict:
            block = value.pop(block_id, None)
            if not value:
                del self._cache[key]
            return block
        if value is None or value.block_id != block_id:
            return None
        del self._cache[key]
        return value


class _IdsLayout:
    """Methods of a map keeping block ids in ``_cache`` (all ids of a key several blocks
    share in ``_dup_ids``): vLLM's layout from 0.34.0."""

    def __init__(self, *args):
        super().__init__(*args)
        self._dup_ids, self._by_id = {}, {}

    def get_one_block(self, key):
        block_id = self._cache.get(key)
        return None if block_id is None else self._by_id[block_id]

    def contain(self, key, block_id):
        dup_ids = self._dup_ids.get(key)
        return block_id in dup_ids if dup_ids is not None else self._cache.get(key) == block_id

    def insert(self, key, block):
        self._by_id[block.block_id] = block
        block_id = self._cache.setdefault(key, block.block_id)
        if block_id != block.block_id:
            self._dup_ids.setdefault(key, {block_id: None})[block.block_id] = None

    def pop(self, key, block_id):
        dup_ids = self._dup_ids.get(key)
        if dup_ids is None:
            if self._cache.get(key) != block_id:
                return None
            del self._cache[key]
        else:
            if dup_ids.pop(block_id, False) is False:
                return None
            self._cache[key] = next(iter(dup_ids))
            if len(dup_ids) == 1:
                del self._dup_ids[key]
        return self._by_id[block_id]


def test_a_map_of_the_other_layout_is_refused_naming_it(untested, monkeypatch):
    # vLLM's map switches layout (block ids -> blocks on a release whose map stores ids,
    # blocks -> ids on one whose map stores blocks): kvpool's native code reads _cache.
    from vllm.v1.core import block_pool

    vanilla_map = block_pool.BlockHashToBlockMap
    if vllm_compat.release_traits().block_ids_map:
        layout, line = _BlocksLayout, ("BlockHashToBlockMap layout: vLLM's map stores KVCacheBlock values in _cache; "
                                       "kvpool's native code reads and writes block ids")
    else:
        layout, line = _IdsLayout, ("BlockHashToBlockMap layout: vLLM's map stores int values in _cache; kvpool's "
                                    "native code reads and writes KVCacheBlock objects "
                                    "(or {block_id: KVCacheBlock} dicts)")
    # (vLLM's own pool builds the simulated map; kvpool's map stays built for the installed one.)
    simulated = type("BlockHashToBlockMap", (layout, vanilla_map), {"__module__": vanilla_map.__module__})
    monkeypatch.setattr(block_pool, "BlockHashToBlockMap", simulated)
    error = _refusal(monkeypatch)
    assert error.differences == (line,)


def test_the_plugin_logs_a_failed_selfcheck_and_leaves_vllm_vanilla(compatible):
    # A new required parameter of the map's constructor (incompatible on every release).
    from vllm.v1.core import block_pool

    names = list(inspect.signature(block_pool.BlockHashToBlockMap.__init__).parameters)
    version = _untested_version()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import inspect
        from kvpool import vllm_compat
        vllm_compat.installed_vllm_version = lambda: {version!r}
        from vllm.v1.core import block_pool
        init = block_pool.BlockHashToBlockMap.__init__
        sig = inspect.signature(init)
        def __init__(*args):
            init(*args[:len(sig.parameters)])
        capacity = inspect.Parameter("capacity", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), capacity])
        block_pool.BlockHashToBlockMap.__init__ = __init__
        """) + _START_VLLM_PROCESS], capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "KVPOOL_ALLOW_UNTESTED_VLLM": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "INSTALLED False vllm.v1.core.block_pool" in proc.stdout
    out = proc.stdout + proc.stderr
    assert f"kvpool: not activated: kvpool 0.1.0 does not install into vLLM {version}: its self-check found" in out
    assert (f"BlockHashToBlockMap.__init__: vLLM takes ({', '.join([*names, 'capacity'])}), "
            f"kvpool's takes ({', '.join(names)})") in out


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
