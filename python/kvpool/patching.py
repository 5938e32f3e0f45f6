"""``install()`` / ``uninstall()``: bind kvpool's classes into vLLM, reversibly.

Two mechanisms, chosen per class:

* **Names are replaced** for ``KVCacheBlock``, ``FreeKVCacheBlockQueue``,
  ``BlockPool`` and ``BlockHashToBlockMap``: in every loaded ``vllm.*`` module, each
  global bound to vLLM's class is rebound to kvpool's. Modules imported later read
  the names from ``kv_cache_utils`` / ``block_pool``, which are rebound too. (A slots
  dataclass cannot be turned into an extension type in place.)
* **Subclasses are re-based**: classes that already inherit from vLLM's
  ``BlockPool`` (``SharedEventQueueBlockPool``, ``_LookupBlockPool``, ...; found with
  ``__subclasses__()``) get kvpool's ``BlockPool`` as their base, so their ``super()``
  calls reach the native paths.

Further patches live in the modules named in :data:`PATCH_MODULES` (the
coordinator's per-group reversed pop and the scheduler's fenced deferred-free queue,
the reorder API from ``LLM`` down); each exposes ``apply(patcher)`` and makes its
changes through the :class:`Patcher`, so every change is recorded and undone by
:func:`uninstall`.

On a vLLM release outside the supported list (``install(force=True)`` or
``KVPOOL_ALLOW_UNTESTED_VLLM=1``) ``install()`` first runs the self-check of
:mod:`kvpool.selfcheck` and raises :class:`~kvpool.errors.SelfCheckError`, before
anything is patched, when that release's classes differ from what kvpool's assume. Past
it, a patch module whose targets that release lacks is
rolled back and skipped, with one warning naming it, and the rest installs
(:func:`skipped_patches`); when the block classes themselves cannot be bound,
``install()`` raises :class:`~kvpool.vllm_compat.UnsupportedVLLMVersionError` before
changing anything.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from kvpool import envs
from kvpool.errors import PoolsBuiltBeforeInstallError, SelfCheckError
from kvpool.vllm_compat import (
    MissingPatchTargetError,
    UnsupportedVLLMVersionError,
    check_vllm_version,
    is_supported,
    release_traits,
)

# Under the "vllm" logger, so vLLM's logging configuration (handler, format, level,
# VLLM_LOGGING_CONFIG_PATH) applies to kvpool's lines as to vLLM's own.
logger = logging.getLogger("vllm.kvpool")

_lock = threading.RLock()
_MISSING = object()


@dataclass
class _InstallState:
    vllm_version: str
    vanilla: dict[str, Any]
    rebound: list[tuple[Any, str, Any]] = field(default_factory=list)  # (module, name, old)
    rebased: list[tuple[type, tuple[type, ...]]] = field(default_factory=list)
    attrs: list[tuple[Any, str, Any]] = field(default_factory=list)  # (owner, name, old or _MISSING)
    arguments: dict[str, Any] = field(default_factory=dict)  # install() arguments by variable name
    skipped: dict[str, str] = field(default_factory=dict)  # patch module -> why (untested vLLM)
    policy: str = "vllm"  # the allocation policy being installed


_state: _InstallState | None = None

#: Modules with an ``apply(patcher: Patcher) -> None`` run by ``install()`` after the
#: classes are bound, in this order.
PATCH_MODULES: tuple[str, ...] = (
    "kvpool.patches.manager_hooks",
    "kvpool.patches.manager_fast_path",
    "kvpool.patches.deferred_free",
    "kvpool.patches.metrics",
    "kvpool.patches.engine_api",
    "kvpool.patches.lazy_offload",
)


class Patcher:
    """Handed to registered patches: records every change so it can be undone."""

    def __init__(self, state: _InstallState):
        self._state = state

    @property
    def vanilla(self) -> dict[str, Any]:
        """vLLM's original classes by name."""
        return self._state.vanilla

    @property
    def policy(self) -> str:
        """The allocation policy being installed (``kvpool.allocation.POLICIES``)."""
        return self._state.policy

    def require(self, owner: type, *names: str) -> None:
        """Check that vLLM's ``owner`` has every attribute in ``names`` (what a patch
        replaces or what its replacement calls), before the patch changes anything.

        Raises:
            MissingPatchTargetError: one is missing (an untested vLLM release);
                ``install()`` then skips the patch module on a forced untested release.
        """
        missing = [n for n in names if not hasattr(owner, n)]
        if missing:
            raise MissingPatchTargetError(
                f"{owner.__module__}.{owner.__qualname__} has no {', '.join(missing)} (kvpool patches or calls it)")

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering the previous value."""
        if name == "__annotations__" and isinstance(owner, type):
            # A class's annotations may live outside its __dict__ (CPython 3.14, PEP
            # 649), and deleting them drops them for good: remember them by value.
            old = dict(inspect.get_annotations(owner))
        elif hasattr(owner, "__dict__"):
            old = owner.__dict__.get(name, _MISSING)
        else:
            old = getattr(owner, name, _MISSING)
        self._state.attrs.append((owner, name, old))
        setattr(owner, name, value)


def is_installed() -> bool:
    """True while kvpool's classes are bound in vLLM."""
    return _state is not None


def vanilla_classes() -> dict[str, Any]:
    """vLLM's own ``KVCacheBlock``, ``FreeKVCacheBlockQueue``, ``BlockPool`` and
    ``BlockHashToBlockMap``, whether or not kvpool is installed."""
    if _state is not None:
        return dict(_state.vanilla)
    import vllm.v1.core.block_pool as bp
    import vllm.v1.core.kv_cache_utils as kcu

    return {
        "KVCacheBlock": kcu.KVCacheBlock,
        "FreeKVCacheBlockQueue": kcu.FreeKVCacheBlockQueue,
        "BlockPool": bp.BlockPool,
        "BlockHashToBlockMap": bp.BlockHashToBlockMap,
    }


def _replacements() -> dict[str, Any]:
    from kvpool import _core, block_pool as kp

    return {
        "KVCacheBlock": _core.KVCacheBlock,
        "FreeKVCacheBlockQueue": _core.FreeKVCacheBlockQueue,
        "BlockPool": kp.BlockPool,
        "BlockHashToBlockMap": kp.BlockHashToBlockMap,
    }


def _vllm_bindings():
    """``(module, attr, value)`` of every global of every imported vLLM module (a
    snapshot: the caller may rebind while it iterates)."""
    for modname, module in list(sys.modules.items()):
        if module is None or not (modname == "vllm" or modname.startswith("vllm.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if namespace:
            for attr, value in list(namespace.items()):
                yield module, attr, value


def _rebind_names(state: _InstallState, replacements: dict[str, Any]) -> None:
    by_id = {id(state.vanilla[name]): (name, new) for name, new in replacements.items()}
    for module, attr, value in _vllm_bindings():
        hit = by_id.get(id(value))
        if hit is not None and value is state.vanilla[hit[0]]:
            state.rebound.append((module, attr, value))
            setattr(module, attr, hit[1])


def _rebase_subclasses(state: _InstallState, replacements: dict[str, Any]) -> None:
    vanilla_pool = state.vanilla["BlockPool"]
    ours = replacements["BlockPool"]
    for cls in list(vanilla_pool.__subclasses__()):
        if cls is ours:
            continue
        old_bases = cls.__bases__
        cls.__bases__ = tuple(ours if base is vanilla_pool else base for base in old_bases)
        state.rebased.append((cls, old_bases))


def install(*, force: bool = False, allocation: str | None = None, lru_window: int | None = None,
            allow_vllm_built_pools: bool = False) -> bool:
    """Replace vLLM's block pool classes with kvpool's, in every vLLM module.

    Idempotent: a second call with the same policy does nothing and returns False.

    Args:
        force: patch a vLLM version that kvpool has not been validated against.
        allocation: the allocation policy of the pools built from now on:
            ``"vllm"`` (vLLM's exact order) or ``"contiguous"`` (opt-in, see
            :mod:`kvpool.allocation`); None: ``$KVPOOL_ALLOCATION``, else ``"vllm"``.
        lru_window: with ``allocation="contiguous"``: blocks W; an allocation that
            takes m blocks from the LRU segment may take any m of its m + W oldest
            when that makes fewer runs of consecutive ids (opt-in: which cached
            blocks are evicted then differs from vLLM's); None:
            ``$KVPOOL_LRU_WINDOW``, else 0 (vLLM's exact LRU).
        allow_vllm_built_pools: skip :func:`vllm_built_pools`' check, for a caller that
            steps such pools only while kvpool is uninstalled (the replay's modes).

    Returns:
        True if this call installed kvpool, False if it already was.

    Raises:
        TypeError: ``force`` is not a bool.
        kvpool.envs.InvalidSettingError: (a ``ValueError``) an unknown policy, an
            ``lru_window`` that is not a whole number >= 0 or is > 0 without the
            contiguous policy, or a ``KVPOOL_*`` variable with a value kvpool does not
            accept; checked before anything changes.
        ValueError: a policy (or LRU window) other than the installed one (call
            ``uninstall()`` first).
        PoolsBuiltBeforeInstallError: a pool vLLM built without kvpool is alive (an
            engine created before ``install()``); nothing is changed.
        UnsupportedVLLMVersionError: vLLM is missing or its version is not supported;
            or, on a forced untested version, vLLM's block classes cannot be bound
            (nothing is changed then).
        SelfCheckError: (an ``UnsupportedVLLMVersionError``) on a forced untested
            version, the self-check (:mod:`kvpool.selfcheck`: signatures, fields, the
            map's layout and a scripted run of vLLM's pool beside kvpool's) found a
            difference; the message names each one, and nothing is changed. Supported
            versions skip the self-check (their own test suites ran with kvpool).
        ImportError: kvpool's native core is not built.
    """
    global _state
    from kvpool import allocation as _allocation

    if not isinstance(force, bool):
        raise TypeError(f"install(force=...) takes True or False, got {force!r}")
    policy = _allocation.resolve(allocation)
    window = _allocation.resolve_lru_window(lru_window, policy)
    envs.validate()
    with _lock:
        if _state is not None:
            if (policy, window) != (_allocation.current(), _allocation.current_lru_window()):
                raise ValueError(
                    f"kvpool is installed with allocation={_allocation.current()!r}, "
                    f"lru_window={_allocation.current_lru_window()}; uninstall() before "
                    f"installing allocation={policy!r}, lru_window={window}")
            return False
        version = check_vllm_version(force=force)
        untested = not is_supported(version)
        if not allow_vllm_built_pools:
            _refuse_pools_built_before_install()
        state, replacements = _checked_state(version, untested)
        state.arguments = {envs.ALLOCATION: allocation, envs.LRU_WINDOW: lru_window,
                           envs.ALLOW_UNTESTED_VLLM: True if force else None}
        state.policy = policy
        try:
            _rebind_names(state, replacements)
            _rebase_subclasses(state, replacements)
            _apply_patch_modules(state, untested)
        except BaseException:
            _undo(state)
            raise
        _state = state
        _allocation.set_policy(policy, window)
        logger.debug("kvpool installed into vLLM %s (allocation=%s, lru_window=%d)", version, policy, window)
        return True


def _checked_state(version: str, untested: bool) -> tuple[_InstallState, dict[str, Any]]:
    """``install()``'s checks before it changes anything: vLLM's and kvpool's classes
    (an untested release that lacks what kvpool's bind to raises
    ``UnsupportedVLLMVersionError``), and on an untested release the self-check."""
    try:
        state = _InstallState(vllm_version=version, vanilla=vanilla_classes())
        replacements = _replacements()
    except (ImportError, AttributeError) as e:
        if not untested:
            raise
        raise UnsupportedVLLMVersionError(
            f"kvpool cannot bind its block classes into untested vLLM {version} ({e}); "
            "nothing was changed") from e
    if untested and not _selfcheck_bypassed:
        _require_selfcheck(state.vanilla, replacements, version)
    return state, replacements


#: Set only by :func:`selfcheck_bypassed` (the porting report's probe).
_selfcheck_bypassed = False


def _require_selfcheck(vanilla: dict[str, Any], replacements: dict[str, Any], version: str) -> None:
    """Run :func:`kvpool.selfcheck.run` (before anything is patched); raise
    :class:`SelfCheckError` naming each difference it finds."""
    from kvpool import selfcheck
    from kvpool._version import __version__

    try:
        result = selfcheck.run(vanilla, replacements)
    except Exception as e:  # a check that cannot run vouches for nothing
        raise SelfCheckError(version, [f"the self-check itself raised {type(e).__name__}: {e}"], __version__) from e
    logger.debug("kvpool: self-check of untested vLLM %s: %d difference(s) in %.1f ms", version,
                 len(result.differences), result.seconds * 1e3)
    if not result.ok:
        raise SelfCheckError(version, result.differences, __version__)


@contextlib.contextmanager
def selfcheck_bypassed():
    """Within the block, ``install()`` on an untested vLLM skips the self-check (for
    ``python -m kvpool porting``, which reports what each patch module does on a release
    the self-check refuses; never for serving)."""
    global _selfcheck_bypassed
    with _lock:
        _selfcheck_bypassed = True
        try:
            yield
        finally:
            _selfcheck_bypassed = False


def vllm_built_pools() -> list[Any]:
    """The live block pools whose blocks are vLLM's own ``KVCacheBlock`` (built while
    kvpool was not installed): ``list[BlockPool]``, empty when vLLM's block pool module
    was never imported.

    One pass of the garbage collector over its objects (``gc.get_referrers`` of the pool
    classes: about 0.1 s in a process with an engine), then a collection and a second
    pass only if any was found, so that unreachable pools awaiting collection do not
    count. Objects frozen with ``gc.freeze()`` (vLLM freezes its engine's) are unfrozen
    for the look and everything is frozen again after it, as at vLLM's next freeze."""
    module = sys.modules.get("vllm.v1.core.block_pool")
    utils = sys.modules.get("vllm.v1.core.kv_cache_utils")
    if module is None or utils is None:
        return []
    vanilla_pool = _original_class(module, "BlockPool")
    vanilla_block = _original_class(utils, "KVCacheBlock")

    def scan() -> list[Any]:
        # An instance of a heap type refers to its type (its tp_traverse visits it), so
        # the referrers of vLLM's pool class and its subclasses hold every live pool;
        # the collector finds them in C, without a Python loop over every object.
        classes = [vanilla_pool]
        for cls in classes:
            classes.extend(cls.__subclasses__())
        found = []
        for obj in gc.get_referrers(*classes):
            if type(obj) in classes and type(getattr(obj, "null_block", None)) is vanilla_block:
                found.append(obj)
        return found

    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        found = scan()
        if found:
            del found
            gc.collect()
            found = scan()
    finally:
        if frozen:
            gc.freeze()
    return found


def _original_class(module, name: str):
    """vLLM's own class ``module.name`` (the one kvpool replaces, also while installed)."""
    if _state is not None and name in _state.vanilla:
        return _state.vanilla[name]
    return getattr(module, name)


def _refuse_pools_built_before_install() -> None:
    """Raise :class:`PoolsBuiltBeforeInstallError` while a pool of vLLM's blocks is alive
    (before anything is patched). Up to vLLM 0.33.0 such a pool's ``BlockHashToBlockMap``
    asserts that its blocks are the ``KVCacheBlock`` its module names, which ``install()``
    rebinds to kvpool's: its next prefix-cache hit or eviction would raise inside vLLM's
    scheduler. From 0.34.0 (a map of block ids) it keeps working, as vLLM's own pool:
    ``install()`` would report success while that engine never runs kvpool's."""
    pools = vllm_built_pools()
    if not pools:
        return
    kinds = sorted({type(p).__qualname__ for p in pools})
    outcome = ("which stay vLLM's: that engine would never run kvpool's pool" if release_traits().block_ids_map
               else "which vLLM's code rejects once kvpool's are bound")
    raise PoolsBuiltBeforeInstallError(
        f"kvpool.install() must run before vLLM builds its KV cache: {len(pools)} block "
        f"pool(s) ({', '.join(kinds)}) built without kvpool are alive (an LLM, engine or "
        "Scheduler created before install()). Their blocks and prefix-cache map are vLLM's "
        f"own classes, {outcome}. Call "
        "kvpool.install() before building the engine (or let vLLM load kvpool's plugin, "
        "which installs it in every vLLM process first); nothing was changed.")


def _apply_patch_modules(state: _InstallState, untested: bool) -> None:
    """Run every module of :data:`PATCH_MODULES` through one :class:`Patcher`. On an
    untested vLLM (``untested``) a module whose targets are missing is taken back and
    skipped (``state.skipped``, one warning naming it); otherwise its error propagates
    (``install()`` then undoes everything)."""
    patcher = Patcher(state)
    for modname in PATCH_MODULES:
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue  # an optional patch module not shipped in this build
        mark = len(state.attrs)
        try:
            module.apply(patcher)
        except (MissingPatchTargetError, ImportError, AttributeError) as e:
            if not untested:
                raise
            # An untested release lacks what this module patches: take its changes
            # back and install the rest.
            _undo_attrs(state.attrs[mark:])
            del state.attrs[mark:]
            state.skipped[modname] = f"{type(e).__name__}: {e}"
            logger.warning(
                "kvpool: %s not patched into untested vLLM %s (%s: %s); the rest of kvpool "
                "is installed", modname, state.vllm_version, type(e).__name__, e)


def _undo_attrs(attrs: list[tuple[Any, str, Any]]) -> None:
    for owner, name, old in reversed(attrs):
        if old is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, old)


def _undo(state: _InstallState) -> None:
    _undo_attrs(state.attrs)
    for cls, old_bases in reversed(state.rebased):
        cls.__bases__ = old_bases
    for module, attr, old in reversed(state.rebound):
        setattr(module, attr, old)
    _unbind_late_imports(state)


def _unbind_late_imports(state: _InstallState) -> None:
    """vLLM modules first imported while kvpool was installed bound kvpool's classes
    (``from vllm.v1.core.block_pool import BlockPool`` then found kvpool's), and vLLM
    classes defined then subclass kvpool's ``BlockPool``: give them vLLM's back too,
    as if they had been imported before ``install()``."""
    if "BlockPool" not in state.vanilla:  # a state that bound no class (a patch module's own)
        return
    replacements = _replacements()
    vanilla_of = {id(new): (new, state.vanilla[name]) for name, new in replacements.items()}
    ours_pool, vanilla_pool = replacements["BlockPool"], state.vanilla["BlockPool"]
    for module, attr, value in _vllm_bindings():
        hit = vanilla_of.get(id(value))
        if hit is not None and value is hit[0]:
            setattr(module, attr, hit[1])
    for cls in list(ours_pool.__subclasses__()):
        if cls.__module__ == "vllm" or cls.__module__.startswith("vllm."):
            cls.__bases__ = tuple(vanilla_pool if base is ours_pool else base for base in cls.__bases__)


def uninstall() -> bool:
    """Put vLLM's own classes back everywhere ``install()`` replaced them.

    Objects created while installed (pools, blocks) keep kvpool's types; build new
    ones after uninstalling.

    Returns:
        True if kvpool was installed and has been removed, False otherwise.
    """
    global _state
    with _lock:
        if _state is None:
            return False
        _undo(_state)
        _state = None
        from kvpool import allocation as _allocation

        _allocation.set_policy("vllm")
        return True


def installed_vllm_version() -> str | None:
    """The vLLM version kvpool patched, or None when not installed."""
    return None if _state is None else _state.vllm_version


def installed_arguments() -> dict[str, Any]:
    """The ``install()`` arguments in force, by the ``KVPOOL_*`` variable each
    overrides (None: not given); ``{}`` when not installed."""
    return {} if _state is None else dict(_state.arguments)


def skipped_patches() -> dict[str, str]:
    """Patch modules skipped on an untested vLLM (module name -> why); ``{}`` otherwise."""
    return {} if _state is None else dict(_state.skipped)
