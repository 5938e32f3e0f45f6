"""Every method the native KV cache manager path skips (``kvpool.vllm_calls``), patched
after ``install()`` on its class or on the instance, is called exactly as vLLM's Python
manager calls it.

Each case runs one workload twice in this process, with the method patched by a
recording wrapper of vLLM's own function: once with kvpool installed and
``KVPOOL_PYTHON_MANAGER=1`` (vLLM's ``allocate_slots``, ``cache_blocks`` and
``get_computed_blocks`` over kvpool's pool, which tests/pool compares with vLLM's pool),
once with the native manager path bound. The recorded calls (method and arguments, block
ids for blocks), the returned tables and the final state must be the same.
"""

from __future__ import annotations

import inspect
import sys

import pytest

import kvpool
from kvpool import vllm_calls
from tests.integration.test_manager_fast_path import BLOCK_SIZE, _manager
from tests.support.scheduler import make_request

_MISSING = object()
CASES = (
    [("manager", n) for n in dict.fromkeys(vllm_calls.MANAGER_NAMES + vllm_calls.LOOKUP_MANAGER_NAMES)]
    + [("coordinator", n) for n in dict.fromkeys(vllm_calls.COORDINATOR_NAMES + vllm_calls.LOOKUP_COORDINATOR_NAMES)]
    + [("single_type", n) for n in dict.fromkeys(vllm_calls.SINGLE_TYPE_NAMES + vllm_calls.LOOKUP_SINGLE_TYPE_NAMES)]
    + [("pool", n) for n in vllm_calls.POOL_NAMES]
    + [("map", n) for n in vllm_calls.MAP_NAMES]
)


def _objects(manager) -> dict:
    coordinator = manager.coordinator
    return {"manager": manager, "coordinator": coordinator,
            "single_type": coordinator.single_type_managers[0], "pool": manager.block_pool,
            "map": manager.block_pool.cached_block_hash_to_block}


def _describe(value):
    if hasattr(value, "block_id") and hasattr(value, "ref_cnt"):
        return ("block", value.block_id)
    if hasattr(value, "request_id") and hasattr(value, "block_hashes"):
        return ("request", value.request_id)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if hasattr(value, "blocks") and hasattr(value, "get_block_ids"):
        return ("KVCacheBlocks", value.get_block_ids())
    if isinstance(value, (int, str, bytes, bool, type(None))):
        return value
    return type(value).__name__


def _workload(owner: str, name: str, where: str) -> tuple:
    """Requests sharing prefixes through a 40-block pool: lookups with hits, prefills,
    decodes that fill blocks (caching), evictions, frees; with ``name`` patched on
    ``owner``'s class or instance. Returns (calls, results, final state)."""
    manager = _manager(40, enable_kv_cache_events=False)
    objects = _objects(manager)
    calls: list = []
    if where == "module":
        namespace = sys.modules[owner].__dict__
        function = namespace[name]

        def recording_global(*args, **kwargs):
            calls.append((name, _describe(args), _describe(tuple(sorted(kwargs.items())))))
            return function(*args, **kwargs)

        namespace[name] = recording_global
        try:
            return _run_workload(manager, objects, [])[1:] + (calls,)
        finally:
            namespace[name] = function
    target = objects[owner]
    cls = type(target)
    raw = inspect.getattr_static(cls, name, None)
    while hasattr(raw, "__kvpool_wrapped__"):    # vLLM's function behind kvpool's binding
        raw = raw.__kvpool_wrapped__
    if raw is None:
        pytest.skip(f"this vLLM's {cls.__name__} has no {name}")

    def record(args, kwargs):
        calls.append((name, _describe(args), _describe(tuple(sorted(kwargs.items())))))

    patched_class = None
    if where == "module":
        # owner: a vLLM module's namespace (a function its mirrored methods call)
        pass
    elif where == "class":
        # The same kind of attribute as vLLM's (a classmethod stays one).
        if isinstance(raw, (classmethod, staticmethod)):
            func = raw.__func__

            def recording(*args, **kwargs):
                record(args[1:] if isinstance(raw, classmethod) else args, kwargs)
                return func(*args, **kwargs)

            replacement = type(raw)(recording)
        else:
            def replacement(self, *args, **kwargs):
                record(args, kwargs)
                return raw(self, *args, **kwargs)
        patched_class, old = cls, cls.__dict__.get(name, _MISSING)
        setattr(cls, name, replacement)
    else:
        bound = raw.__get__(target, cls) if hasattr(raw, "__get__") else raw

        def recording_bound(*args, **kwargs):
            record(args, kwargs)
            return bound(*args, **kwargs)

        setattr(target, name, recording_bound)
    try:
        return (calls,) + _run_workload(manager, objects, calls)[1:]
    finally:
        if patched_class is not None:
            if old is _MISSING:
                delattr(patched_class, name)
            else:
                setattr(patched_class, name, old)


def _run_workload(manager, objects, calls) -> tuple:
    from vllm.v1.request import RequestStatus

    results = []
    if True:
        prompts = ([list(range(1, 65)) + [500 + i] * 9 for i in range(4)]
                   + [list(range(900 + 100 * j, 990 + 100 * j)) for j in range(6)])
        live = []
        for i, prompt in enumerate(prompts * 2):
            rid = f"r{i}"
            req = make_request(rid, prompt, max_tokens=100, block_size=BLOCK_SIZE)
            blocks, hit, *_ = manager.get_computed_blocks(req)
            out = manager.allocate_slots(req, len(prompt) - hit, num_new_computed_tokens=hit,
                                         new_computed_blocks=blocks)
            results.append((rid, hit, None if out is None else out.get_block_ids()))
            if out is None:
                continue
            req.num_computed_tokens = len(prompt)
            req.status = RequestStatus.RUNNING
            req.append_output_token_ids(7)
            live.append(req)
            for _ in range(20):    # decode: fills a block (cached), may need new ones
                out = manager.allocate_slots(req, 1)
                results.append((rid, None if out is None else out.get_block_ids()))
                if out is None:
                    break
                req.num_computed_tokens += 1
                req.append_output_token_ids(7)
            if len(live) > 3:
                manager.free(live.pop(0))
        single = objects["single_type"]
        state = ({rid: [b.block_id for b in t] for rid, t in single.req_to_blocks.items()},
                 dict(single.num_cached_block), manager.block_pool.get_num_free_blocks(),
                 sorted(manager.block_pool.cached_block_hash_to_block._cache))
    return calls, results, state


@pytest.mark.parametrize("where", ["class", "instance"])
@pytest.mark.parametrize("owner,name", CASES, ids=[f"{o}-{n}" for o, n in CASES])
def test_a_skipped_method_patched_after_install_is_called_as_vllm_calls_it(monkeypatch, owner, name, where):
    from kvpool import _core

    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install()
    assert not _core.allocate_slots_fast_path_state()["enabled"]
    vanilla = _workload(owner, name, where)
    kvpool.uninstall()
    monkeypatch.delenv("KVPOOL_PYTHON_MANAGER")
    kvpool.install()
    assert _core.allocate_slots_fast_path_state()["enabled"]
    native = _workload(owner, name, where)
    assert native[1:] == vanilla[1:]
    assert native[0] == vanilla[0]


#: Methods that vLLM's mirrored functions call through ``self.`` but that vLLM never calls
#: for a call the native path takes, so the native path need not check them.
_UNREACHED = {
    "_remove_blocks_in_range": "full attention skips no token (get_num_skipped_tokens, "
                               "checked, returns 0 there)",
    "_apply_cow": "only for a request with a pending copy-on-write block, which the native "
                  "path leaves to vLLM",
    "_build_block_stored_event": "KV events only: the native caching runs with events off",
    "_generate_event_extra_keys": "KV events only",
    "_lookahead_token_ids": "KV events only",
    "generate_event_extra_keys": "KV events only (vLLM >= 0.34.0's name)",
    "get_lookahead_token_ids": "KV events only (vLLM >= 0.34.0's name)",
}


def test_the_lists_cover_every_self_call_of_the_mirrored_functions():
    """The lists this file patches are not the only source: every ``self.<method>(...)``
    in the source of the vLLM functions the native path mirrors is in the list of its
    owner (or unreachable for the native path's calls, with the reason above)."""
    import ast
    import textwrap

    from kvpool.patches import manager_fast_path as fp

    listed = {
        "KVCacheManager": vllm_calls.MANAGER_NAMES + vllm_calls.LOOKUP_MANAGER_NAMES,
        "UnitaryKVCacheCoordinator": vllm_calls.COORDINATOR_NAMES + vllm_calls.LOOKUP_COORDINATOR_NAMES,
        "FullAttentionManager": vllm_calls.SINGLE_TYPE_NAMES + vllm_calls.LOOKUP_SINGLE_TYPE_NAMES,
        "SingleTypeKVCacheManager": vllm_calls.SINGLE_TYPE_NAMES,
        "BlockPool": vllm_calls.POOL_NAMES,
    }
    classes = fp._classes()
    missing = []
    for cls_name, name in fp.MIRRORED:
        func = fp._vanilla(classes[cls_name], name) if cls_name in listed else None
        if func is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and node.func.attr not in listed[cls_name] and node.func.attr not in _UNREACHED):
                missing.append(f"{cls_name}.{name} calls self.{node.func.attr}")
    assert not missing, missing


def _global_cases():
    from kvpool.patches import manager_fast_path as fp

    kvpool.install()
    try:
        return [(d["__name__"], n) for d, n, _ in fp.mirrored_globals(fp._classes())]
    finally:
        kvpool.uninstall()


@pytest.mark.parametrize("module,name", _global_cases())
def test_a_module_function_patched_after_install_is_called_as_vllm_calls_it(monkeypatch, module, name):
    """The functions the mirrored methods read from their modules' namespaces
    (``manager_fast_path.mirrored_globals``: ``cdiv``, ``resolve_block_hashes``, ...)."""
    monkeypatch.setenv("KVPOOL_PYTHON_MANAGER", "1")
    kvpool.install()
    vanilla = _workload(module, name, "module")
    kvpool.uninstall()
    monkeypatch.delenv("KVPOOL_PYTHON_MANAGER")
    kvpool.install()
    native = _workload(module, name, "module")
    # kv_cache_manager.cdiv: allocate_slots uses it only for a prefix hit with retained
    # hit groups (new_computed_blocks given), which the native path leaves to vLLM.
    assert vanilla[-1] or (module, name) == ("vllm.v1.core.kv_cache_manager", "cdiv"), \
        f"vLLM's manager did not call {module}.{name}: the workload misses it"
    assert native == vanilla


def _decoding_request(manager):
    """A request whose 39-token prompt is allocated on ``manager`` and that decodes: its
    next ``allocate_slots(req, 1)`` calls allocate nothing."""
    from vllm.v1.request import RequestStatus

    req = make_request("r0", list(range(1, 40)), max_tokens=100, block_size=BLOCK_SIZE)
    assert manager.allocate_slots(req, 39) is not None
    req.num_computed_tokens = 39
    req.status = RequestStatus.RUNNING
    req.append_output_token_ids(7)
    return req


@pytest.mark.parametrize("owner,name", [("coordinator", "get_num_blocks_to_allocate"),
                                        ("single_type", "get_num_blocks_to_allocate"),
                                        ("pool", "get_num_free_blocks")])
def test_an_instance_patched_between_native_calls_is_seen_at_the_next_call(owner, name):
    """The native path remembers instance dicts found without the skipped methods (by the
    dict's version tag): a method set on an instance after many native calls on it is
    still seen at the very next call, which is vLLM's and calls it."""
    from kvpool import _core

    kvpool.install()
    try:
        manager = _manager(40, enable_kv_cache_events=False)
        target = _objects(manager)[owner]
        req = _decoding_request(manager)
        fast0 = _core.allocate_slots_fast_path_state()["fast_calls"]
        for _ in range(5):    # decode steps that allocate nothing: native, the dicts remembered
            assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert _core.allocate_slots_fast_path_state()["fast_calls"] == fast0 + 5
        calls = []
        bound = getattr(target, name)

        def recording(*args, **kwargs):
            calls.append(args)
            return bound(*args, **kwargs)

        setattr(target, name, recording)
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert calls, "the instance's method was not called: the native path answered"
        # (a patched get_num_free_blocks the native step calls itself, as vLLM's does;
        # the other two send the call to vLLM's code)
        native = owner == "pool"
        assert _core.allocate_slots_fast_path_state()["fast_calls"] == fast0 + 5 + native
        delattr(target, name)   # the dict changes again: native once more
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert _core.allocate_slots_fast_path_state()["fast_calls"] == fast0 + 6 + native
    finally:
        kvpool.uninstall()


def test_a_key_whose_eq_changes_its_answer_is_looked_up_at_every_call():
    """A dict holding a key that is not an exact str is not remembered: its ``__eq__``
    may start to match a skipped method's name without changing the dict (found by an
    adversarial run against the version-tag memory), and ``self.name`` then finds what
    it maps to, so the next call must be vLLM's."""
    from kvpool import _core

    name = "get_num_blocks_to_allocate"
    state = {"match": False}

    class Key:
        def __hash__(self):
            return hash(name)

        def __eq__(self, other):
            return state["match"] and other == name

    kvpool.install()
    try:
        manager = _manager(40, enable_kv_cache_events=False)
        coordinator = manager.coordinator
        req = _decoding_request(manager)
        calls = []
        bound = getattr(coordinator, name)

        def recording(*args, **kwargs):
            calls.append(args)
            return bound(*args, **kwargs)

        coordinator.__dict__[Key()] = recording
        fast0 = _core.allocate_slots_fast_path_state()["fast_calls"]
        for _ in range(3):    # the key matches nothing yet: native
            assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert _core.allocate_slots_fast_path_state()["fast_calls"] == fast0 + 3 and not calls
        state["match"] = True    # the dict unchanged; coordinator.<name> is now the recording
        assert getattr(coordinator, name) is recording
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        assert calls, "the native path answered, although vLLM's code would call the recording"
        assert _core.allocate_slots_fast_path_state()["fast_calls"] == fast0 + 3
    finally:
        kvpool.uninstall()
