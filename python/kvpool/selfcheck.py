"""The self-check ``install()`` runs on a vLLM release kvpool was not checked against,
before it patches anything.

A new vLLM release breaks kvpool where it changed what kvpool's classes assume of
vLLM's. The check looks at exactly that, on the installed vLLM, without patching:

* **Signatures.** ``KVCacheBlock`` and ``FreeKVCacheBlockQueue`` are replaced by
  kvpool's extension types: their constructors and every public method vLLM's class
  has must exist on kvpool's and accept what vLLM's accepts (kvpool's signatures are
  read from ``kvpool/_core.pyi``, which ``tests/native/test_type_stubs.py`` checks
  against the extension). ``BlockPool`` and ``BlockHashToBlockMap`` are subclassed:
  every method kvpool's class overrides must accept what vLLM's accepts, and the
  definitions kvpool inherits but calls with fixed arguments (:data:`INHERITED_CALLS`)
  must still take them.
* **Fields.** The ``KVCacheBlock`` fields kvpool's native code reads and writes
  (:data:`NATIVE_BLOCK_FIELDS`) must be fields of vLLM's block, vLLM's fields must
  exist on kvpool's block, and ``BlockPool.__init__`` must set no attribute that
  kvpool's does not.
* **The prefix-cache map's layout.** kvpool's native code reads and writes
  ``BlockHashToBlockMap._cache`` (a dict whose values are block objects, or dicts of
  them by ``block_id``; from vLLM 0.34.0 block ids, duplicates in ``_dup_ids``); vLLM's
  own pool, after caching blocks, must have the layout of the release whose traits
  kvpool applies.
* **Contracts.** vLLM's own ``BlockPool`` and kvpool's (16 blocks of 4 tokens, prefix
  caching and KV cache events on, kvpool not installed) run one scripted sequence
  (:func:`_script`: ``get_new_blocks``, ``cache_full_blocks`` of real ``Request``
  objects with SHA-256 block hashes, ``get_cached_block``, ``touch``, ``free_blocks``,
  eviction by reuse and by ``evict_blocks``, ``reset_prefix_cache`` refused and done,
  ``take_events``); after every step the result, the free queue's order, every block's
  ``ref_cnt`` and hash, and the events must be equal. Any exception is a difference.

The check builds two small pools and drops them; it changes no vLLM state (the block
hashes are computed here, not with vLLM's ``init_none_hash``; the pools' log lines are
held back while it runs). See docs/porting.md.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The traits kvpool's classes were set up with when kvpool.block_pool was imported (the
# installed release's, or the nearest below it that kvpool knows).
from kvpool.block_pool import _TRAITS

#: Fields of ``KVCacheBlock`` kvpool's extension reads and writes by name
#: (``src/kvpool/block.pxi``, ``alloc.pxi``, ``free.pxi``, ``manager.pxi``, ...), under the
#: names of the release whose traits kvpool applies (the nearest it knows).
NATIVE_BLOCK_FIELDS: tuple[str, ...] = (
    "block_id", "ref_cnt",
    *(("block_hash", "block_hash_num_tokens") if _TRAITS.public_block_hash
      else ("_block_hash", "_block_hash_num_tokens")),
    "prev_free_block", "next_free_block", "is_null",
)

#: vLLM definitions kvpool's classes inherit rather than define, with the arguments
#: kvpool's code calls them with: kvpool's ``BlockPool`` builds its prefix-cache map
#: as ``BlockHashToBlockMap()``, or ``BlockHashToBlockMap(blocks)`` where the map stores
#: block ids (``kvpool.block_hash_map.new_map``).
INHERITED_CALLS: dict[tuple[str, str], tuple[str, ...]] = {
    ("BlockHashToBlockMap", "__init__"): ("self", "blocks") if _TRAITS.block_ids_map else ("self",),
}

#: Classes kvpool replaces with its own types / subclasses.
REPLACED: tuple[str, ...] = ("KVCacheBlock", "FreeKVCacheBlockQueue")
SUBCLASSED: tuple[str, ...] = ("BlockPool", "BlockHashToBlockMap")

#: The contract run's pool: blocks, tokens per block.
NUM_BLOCKS = 16
BLOCK_SIZE = 4

_STUB = Path(__file__).with_name("_core.pyi")


@dataclass(frozen=True)
class SelfCheckResult:
    """What :func:`run` found.

    Attributes:
        differences: one line per difference, ``"What: vLLM ..., kvpool's ..."``;
            empty when the release passes.
        seconds: wall time of the check.
    """

    differences: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        """True when no difference was found."""
        return not self.differences


# -- signatures ----------------------------------------------------------------------
def _plain(sig: inspect.Signature) -> inspect.Signature:
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


@functools.lru_cache(maxsize=1)
def _stub_functions() -> dict[tuple[str, str], ast.arguments]:
    """``(class, function) -> arguments`` of every method ``_core.pyi`` declares
    (parsed once; empty when the stub is not shipped)."""
    found: dict[tuple[str, str], ast.arguments] = {}
    if not _STUB.is_file():
        return found
    for node in ast.parse(_STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[(node.name, item.name)] = item.args
    return found


def _stub_signature(cls_name: str, name: str) -> inspect.Signature | None:
    """The signature ``_core.pyi`` gives ``cls_name.name`` (defaults as written there),
    or None when the stub has no such definition."""
    args = _stub_functions().get((cls_name, name))
    return None if args is None else _from_ast(args)


class _Written:
    """A default as the stub writes it (its repr is that text)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _from_ast(args: ast.arguments) -> inspect.Signature:
    P = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if default is None else _Written(ast.unparse(default))))
    if args.vararg is not None:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        written = P.empty if default is None else _Written(ast.unparse(default))
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=written))
    if args.kwarg is not None:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _signature(cls: type, name: str) -> inspect.Signature | None:
    """``cls.name``'s signature (an extension type's from ``_core.pyi``), or None when
    it cannot be read."""
    if cls.__module__ == "kvpool._core":
        stub = _stub_signature(cls.__name__, name)
        if stub is not None:
            return stub
    try:
        sig = _plain(inspect.signature(inspect.getattr_static(cls, name)))
    except (TypeError, ValueError, AttributeError):
        return None
    P = inspect.Parameter
    rest = list(sig.parameters.values())[1:]
    if rest and all(p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in rest):
        return None  # a slot wrapper's (self, /, *args, **kwargs): says nothing
    return sig


def accepts(vllm_sig: inspect.Signature, kvpool_sig: inspect.Signature) -> bool:
    """True when every call ``vllm_sig`` binds, ``kvpool_sig`` binds to the same
    parameter names: each of vLLM's parameters is kvpool's too, of a kind that takes
    it the same way (at the same position when it can be passed by position, by name
    when it can be passed by name; a defaulted positional parameter may have another
    name at that position when kvpool takes vLLM's name as a keyword-only alias), with a
    default where vLLM's has one; kvpool's other parameters have defaults."""
    P = inspect.Parameter
    ours = kvpool_sig.parameters
    our_positional = [p.name for p in ours.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    their_positional = [p.name for p in vllm_sig.parameters.values()
                        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if len(our_positional) < len(their_positional):
        return False
    for mine, theirs in zip(our_positional, their_positional):
        # A positional parameter under another name: accepted where both have defaults
        # and kvpool takes vLLM's name as a keyword alias (KVCacheBlock's
        # ``_block_hash`` / ``block_hash``, one release's name and the other's).
        if mine != theirs and not (ours[mine].default is not P.empty
                                   and vllm_sig.parameters[theirs].default is not P.empty
                                   and theirs in ours and ours[theirs].kind == P.KEYWORD_ONLY):
            return False
    for p in vllm_sig.parameters.values():
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if p.kind not in [q.kind for q in ours.values()]:
                return False
            continue
        q = ours.get(p.name)
        if q is None or (p.default is not P.empty and q.default is P.empty):
            return False
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and q.kind == P.POSITIONAL_ONLY:
            return False
    for q in ours.values():
        variadic = q.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
        if q.name not in vllm_sig.parameters and q.default is P.empty and not variadic:
            return False
    return True


def _compare(what: str, vllm_sig: inspect.Signature | None, kvpool_sig: inspect.Signature | None) -> list[str]:
    if vllm_sig is None or kvpool_sig is None:
        return []  # unreadable (a builtin): the contract run still calls it
    if accepts(vllm_sig, kvpool_sig):
        return []
    return [f"{what}: vLLM takes {vllm_sig}, kvpool's takes {kvpool_sig}"]


def _public_functions(cls: type) -> list[str]:
    names = ["__init__"]
    for name in dir(cls):
        if not name.startswith("_") and callable(inspect.getattr_static(cls, name)):
            names.append(name)
    return names


def check_signatures(vanilla: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The signature part of the check (see the module docstring): one line per
    definition whose arguments kvpool's classes do not take as vLLM's do."""
    found = []
    for cls_name in REPLACED:
        theirs, mine = vanilla[cls_name], ours[cls_name]
        for name in _public_functions(theirs):
            if name != "__init__" and not hasattr(mine, name):
                found.append(f"{cls_name}.{name}: vLLM's class has it, kvpool's has not")
                continue
            found += _compare(f"{cls_name}.{name}", _signature(theirs, name), _signature(mine, name))
    for cls_name in SUBCLASSED:
        theirs, mine = vanilla[cls_name], ours[cls_name]
        for name, value in vars(mine).items():
            if callable(value) and (name == "__init__" or not name.startswith("__")) and hasattr(theirs, name):
                found += _compare(f"{cls_name}.{name}", _signature(theirs, name), _signature(mine, name))
    P = inspect.Parameter
    for (cls_name, name), params in INHERITED_CALLS.items():
        called = inspect.Signature([P(p, P.POSITIONAL_OR_KEYWORD) for p in params])
        found += _compare(f"{cls_name}.{name}", _signature(vanilla[cls_name], name), called)
    return found


# -- fields --------------------------------------------------------------------------
def _field_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    slots = getattr(cls, "__slots__", None)
    if slots:
        return [slots] if isinstance(slots, str) else list(slots)
    return list(getattr(cls, "__annotations__", {}))


def check_fields(vanilla: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The block-field part of the check (see the module docstring)."""
    theirs, mine = vanilla["KVCacheBlock"], ours["KVCacheBlock"]
    fields = _field_names(theirs)
    found = [f"KVCacheBlock.{name}: kvpool's native code reads and writes it, vLLM's KVCacheBlock has "
             f"no such field (vLLM's: {', '.join(fields)})" for name in NATIVE_BLOCK_FIELDS if name not in fields]
    block = mine(0)
    for name in fields:
        if not hasattr(mine, name):
            found.append(f"KVCacheBlock.{name}: a field of vLLM's KVCacheBlock, not an attribute of kvpool's")
            continue
        try:  # vLLM's code may assign any field of its dataclass
            setattr(block, name, getattr(block, name))
        except (AttributeError, TypeError) as e:
            found.append(f"KVCacheBlock.{name}: a writable field of vLLM's KVCacheBlock, read-only on kvpool's ({e})")
    return found


# -- contracts -----------------------------------------------------------------------
def _block_hasher(block_size: int):
    """A ``Request`` block hasher: chained SHA-256 over each full block's tokens (real
    hash bytes, computed without vLLM's global ``NONE_HASH``)."""

    def hasher(request) -> list[bytes]:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        prev = hashes[-1] if hashes else b"kvpool-selfcheck"
        new = []
        start = len(hashes) * block_size
        while start + block_size <= len(tokens):
            prev = hashlib.sha256(prev + repr(list(tokens[start:start + block_size])).encode()).digest()
            new.append(prev)
            start += block_size
        return new

    return hasher


def _request(request_id: str, token_ids: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=_block_hasher(BLOCK_SIZE))


def _ids(blocks) -> list[int] | None:
    return None if blocks is None else [b.block_id for b in blocks]


def _snapshot(pool, result) -> tuple:
    """What one step is compared by: its result, the free queue, every block's
    ``ref_cnt`` and hash, and the events taken."""
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    blocks = [pool.blocks[i] for i in range(pool.num_gpu_blocks)]
    state = [(b.ref_cnt, b.block_hash, b.block_hash_num_tokens) for b in blocks]
    return (result, free, pool.get_num_free_blocks(), state, [repr(e) for e in pool.take_events()])


def _script(pool, requests: dict[str, Any]):
    """Yield ``(step, snapshot)`` for the scripted sequence on ``pool`` (a generator, so
    an exception names the step it happened in)."""
    a_req, b_req = requests["a"], requests["b"]
    a = pool.get_new_blocks(3)
    yield "get_new_blocks(3)", _snapshot(pool, _ids(a))
    yield "cache_full_blocks(a, 3 blocks)", _snapshot(pool, pool.cache_full_blocks(a_req, a, 0, 3, BLOCK_SIZE, 0))
    hits = [_ids(pool.get_cached_block(h, [0])) for h in a_req.block_hashes]
    yield "get_cached_block(a's hashes)", _snapshot(pool, hits)
    b = pool.get_new_blocks(4)
    yield "get_new_blocks(4)", _snapshot(pool, _ids(b))
    yield "free_blocks(a reversed)", _snapshot(pool, pool.free_blocks(list(reversed(a))))
    hit = [pool.get_cached_block(h, [0])[0] for h in b_req.block_hashes[:2]]
    yield "touch(b's 2-block prefix hit)", _snapshot(pool, pool.touch(hit))
    c = pool.get_new_blocks(1)
    yield "get_new_blocks(1)", _snapshot(pool, _ids(c))
    b_blocks = hit + c
    cached = pool.cache_full_blocks(b_req, b_blocks, 2, 3, BLOCK_SIZE, 0)
    yield "cache_full_blocks(b, 2 cached + 1)", _snapshot(pool, cached)
    yield "reset_prefix_cache() while blocks are held", _snapshot(pool, pool.reset_prefix_cache())
    pool.free_blocks(list(reversed(b_blocks)))
    yield "free_blocks(b's blocks reversed, then 4 unhashed)", _snapshot(pool, pool.free_blocks(b))
    every = pool.get_new_blocks(NUM_BLOCKS - 1)
    yield "get_new_blocks(all: evicts every cached block)", _snapshot(pool, _ids(every))
    yield "free_blocks(all)", _snapshot(pool, pool.free_blocks(every))
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a_req, a, 0, 3, BLOCK_SIZE, 0)
    pool.free_blocks(a)
    yield "get_new_blocks(3), cache_full_blocks(a), free_blocks", _snapshot(pool, _ids(a))
    yield "evict_blocks({a[1]})", _snapshot(pool, pool.evict_blocks({a[1].block_id}))
    hits = [_ids(pool.get_cached_block(h, [0])) for h in a_req.block_hashes]
    yield "get_cached_block(a's hashes) after evict", _snapshot(pool, hits)
    yield "reset_prefix_cache()", _snapshot(pool, pool.reset_prefix_cache())


def _run_script(cls, requests) -> tuple[list[tuple[str, Any]], Any]:
    """``(steps, pool)``: the ``(step, snapshot)`` list on a new ``cls`` pool; a step
    that raised ends it with ``(step, "raised ...")``; ``pool`` None if not built."""
    steps: list[tuple[str, Any]] = []
    try:
        pool = cls(NUM_BLOCKS, True, BLOCK_SIZE, enable_kv_cache_events=True)
    except Exception as e:
        return [("BlockPool(16, True, 4, enable_kv_cache_events=True)", f"raised {type(e).__name__}: {e}")], None
    gen = _script(pool, requests)
    step = "(start)"
    try:
        for step, snapshot in gen:
            steps.append((step, snapshot))
    except Exception as e:
        after = f" (after {step})" if steps else ""
        steps.append((f"the step{after}", f"raised {type(e).__name__}: {e}"))
    return steps, pool


def _layout(vanilla: dict[str, Any], request) -> list[str]:
    """kvpool's native code reads ``cached_block_hash_to_block._cache`` values as block
    objects or ``{block_id: block}`` dicts, or, where the map stores block ids
    (``VllmRelease.block_ids_map``), as ints beside a ``_dup_ids`` dict; vLLM's own pool,
    with three blocks of ``request`` cached, must keep them that way."""
    block_cls = vanilla["KVCacheBlock"]
    try:
        pool = vanilla["BlockPool"](NUM_BLOCKS, True, BLOCK_SIZE)
        pool.cache_full_blocks(request, pool.get_new_blocks(3), 0, 3, BLOCK_SIZE, 0)
    except Exception as e:
        return [f"BlockHashToBlockMap layout: vLLM's BlockPool could not cache 3 blocks ({type(e).__name__}: {e})"]
    hash_map = getattr(pool, "cached_block_hash_to_block", None)
    cache = getattr(hash_map, "_cache", None)
    if not isinstance(cache, dict):
        return [(f"BlockHashToBlockMap layout: vLLM's map has no dict _cache (a {type(cache).__name__}); "
                 "kvpool's native code reads and writes it")]
    if _TRAITS.block_ids_map:
        return _ids_layout(hash_map, cache)
    for value in cache.values():
        inner = list(value.items()) if type(value) is dict else [(None, value)]
        for key, block in inner:
            if not isinstance(block, block_cls) or (key is not None and key != block.block_id):
                return [f"BlockHashToBlockMap layout: vLLM's map stores {type(value).__name__} values in _cache"
                        + (f" ({{{type(key).__name__}: {type(block).__name__}}})" if key is not None else "")
                        + "; kvpool's native code reads and writes KVCacheBlock objects"
                        + " (or {block_id: KVCacheBlock} dicts)"]
    return []


def _ids_layout(hash_map, cache: dict) -> list[str]:
    """The block-ids layout (vLLM >= 0.34.0): int values, a dict ``_dup_ids``."""
    if type(getattr(hash_map, "_dup_ids", None)) is not dict or not hasattr(hash_map, "_blocks"):
        return [("BlockHashToBlockMap layout: vLLM's map has no dict _dup_ids or no _blocks; kvpool's native "
                 "code reads and writes _cache (block ids) and _dup_ids")]
    for value in cache.values():
        if type(value) is not int:
            return [(f"BlockHashToBlockMap layout: vLLM's map stores {type(value).__name__} values in _cache; "
                     "kvpool's native code reads and writes block ids")]
    return []


def _first_difference(theirs: list[tuple[str, Any]], mine: list[tuple[str, Any]]) -> list[str]:
    """The first step whose outcome differs between vLLM's pool (``theirs``) and
    kvpool's, or where either raised, as one line (``[]`` when none)."""
    for (step, expected), (my_step, got) in zip(theirs, mine):
        if isinstance(expected, str) and isinstance(got, str):
            return [f"contract: {step}: vLLM's BlockPool {expected}; kvpool's {got}"]
        if isinstance(got, str):
            return [f"contract: {my_step}: kvpool's BlockPool {got} (vLLM's did not)"]
        if isinstance(expected, str):
            return [f"contract: {step}: vLLM's BlockPool {expected} (kvpool's did not)"]
        if expected != got:
            return [f"contract: {step}: vLLM's BlockPool gave {_short(expected)}, kvpool's gave {_short(got)}"]
    return []


def check_contracts(vanilla: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The contract part of the check (see the module docstring): one line for the
    first step whose outcome differs, and the map layout and pool attributes."""
    try:
        requests = {"a": _request("a", list(range(12))), "b": _request("b", [*range(8), 50, 51, 52, 53])}
    except Exception as e:
        return [f"contract: vLLM's Request(...) could not be built for the scripted run ({type(e).__name__}: {e})"]
    theirs, vllm_pool = _run_script(vanilla["BlockPool"], requests)
    requests = {"a": _request("a", list(range(12))), "b": _request("b", [*range(8), 50, 51, 52, 53])}
    mine, kvpool_pool = _run_script(ours["BlockPool"], requests)
    found = _first_difference(theirs, mine)
    found += _layout(vanilla, _request("a", list(range(12))))
    if vllm_pool is not None and kvpool_pool is not None:
        extra = sorted(set(vars(vllm_pool)) - set(vars(kvpool_pool)))
        if extra:
            found.append(f"BlockPool.__init__: vLLM's sets {', '.join(extra)}, kvpool's does not")
    return found


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _Hold(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def run(vanilla: dict[str, Any], ours: dict[str, Any]) -> SelfCheckResult:
    """Run the whole check (signatures, fields, contracts; see the module docstring).

    Args:
        vanilla: vLLM's ``KVCacheBlock``, ``FreeKVCacheBlockQueue``, ``BlockPool`` and
            ``BlockHashToBlockMap`` (``kvpool.patching.vanilla_classes()``).
        ours: kvpool's classes of the same names.

    Returns:
        :class:`SelfCheckResult`; never raises for what it finds (an exception in a
        step is a difference).
    """
    started = time.perf_counter()
    found = check_signatures(vanilla, ours) + check_fields(vanilla, ours)
    pool_logger = logging.getLogger(vanilla["BlockPool"].__module__)
    hold = _Hold()
    pool_logger.addFilter(hold)  # the pools' reset lines are the check's, not the user's
    try:
        found += check_contracts(vanilla, ours)
    finally:
        pool_logger.removeFilter(hold)
    return SelfCheckResult(tuple(found), time.perf_counter() - started)


__all__ = ["INHERITED_CALLS", "NATIVE_BLOCK_FIELDS", "SelfCheckResult", "accepts", "check_contracts",
           "check_fields", "check_signatures", "run"]
