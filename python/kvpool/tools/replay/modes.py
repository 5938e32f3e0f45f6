"""The replay's modes: which block pool a scheduler gets, and what runs between rounds.

- ``vanilla``: vLLM's own ``BlockPool``; kvpool is uninstalled first if it is installed.
- ``kvpool``: ``kvpool.install(allocation="vllm")``: vLLM's exact order; no reorder.
- ``kvpool+reorder``: as ``kvpool``; between rounds, after
  ``scheduler.reset_prefix_cache()``, ``reset_free_block_queue_order()`` (RFC Option A)
  on the scheduler, else the KV cache manager, else its block pool, whichever has it.
- ``kvpool+contiguous``: ``kvpool.install(allocation="contiguous")``: kvpool's
  contiguity-keeping allocation policy, no reset-time reorder.
- ``vanilla+immediate-order`` (not in the default set): vLLM's own classes, a deferred
  request's frees made as the immediate path's calls, one reversed ``free_blocks`` per
  KV cache group, when vLLM's drain frees them: the reference kvpool's deferred frees
  are checked against (:mod:`.free_order`).
- ``kvpool+contiguous+wW`` (W a whole number > 0, e.g. ``kvpool+contiguous+w64``; not
  in the default set): ``kvpool.install(allocation="contiguous", lru_window=W)``, the
  policy's opt-in relaxation of vLLM's LRU (hits and evictions may then differ from
  vanilla's, which the comparison reports).

A mode is switched by :func:`set_mode` before its scheduler is built: the allocation
policy is read when a pool is created, so each kvpool mode reinstalls kvpool.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.errors import ModeUnavailable  # (defined there, re-exported here)


@dataclass(frozen=True)
class Mode:
    """One way of running a workload.

    Attributes:
        name: the name on the command line and in the JSON (``"kvpool+reorder"``).
        allocation: ``kvpool.install(allocation=...)``; ``None``: vLLM's own classes.
        reorder: call ``reset_free_block_queue_order()`` after each
            ``reset_prefix_cache()`` between rounds.
        lru_window: ``kvpool.install(lru_window=...)`` (blocks; 0: vLLM's exact LRU).
        defer_by_group: vLLM's classes, deferred frees as the immediate path's calls
            (:func:`.free_order.defer_by_group`).
    """

    name: str
    allocation: str | None = None
    reorder: bool = False
    lru_window: int = 0
    defer_by_group: bool = False

    @property
    def uses_kvpool(self) -> bool:
        return self.allocation is not None

    def __str__(self) -> str:
        return self.name


VANILLA = Mode("vanilla")
KVPOOL = Mode("kvpool", allocation="vllm")
REORDER = Mode("kvpool+reorder", allocation="vllm", reorder=True)
CONTIGUOUS = Mode("kvpool+contiguous", allocation="contiguous")
ALL_MODES = (VANILLA, KVPOOL, REORDER, CONTIGUOUS)
#: The mode names, in the order a run takes them by default.
MODES = tuple(m.name for m in ALL_MODES)
#: The reference of deferred frees (asked for by name).
IMMEDIATE_ORDER = Mode("vanilla+immediate-order", defer_by_group=True)
_BY_NAME = {m.name: m for m in (*ALL_MODES, IMMEDIATE_ORDER)}


def get(mode: str | Mode) -> Mode:
    """The :class:`Mode` named ``mode`` (a :class:`Mode` is returned as is).

    Raises:
        ValueError: no mode of that name.
    """
    if isinstance(mode, Mode):
        return mode
    try:
        return _BY_NAME[mode]
    except (KeyError, TypeError):
        pass
    prefix = CONTIGUOUS.name + "+w"
    if isinstance(mode, str) and mode.startswith(prefix):
        window = mode[len(prefix):]
        if window.isascii() and window.isdigit() and 0 < int(window) < 2**31 and window[0] != "0":
            return Mode(mode, allocation="contiguous", lru_window=int(window))
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}, {IMMEDIATE_ORDER.name} "
                     f"or {prefix}W (W blocks > 0)")


def _kvpool_api():
    """``(install, uninstall, is_installed)`` of kvpool.

    ``kvpool`` itself imports without its extension (``install`` loads it later), so the
    built ``kvpool._core`` is imported here: a checkout whose extension was never built
    gives this clear error instead of an ``ImportError`` inside ``install()``.

    Raises:
        ModeUnavailable: kvpool or ``kvpool._core`` cannot be imported.
    """
    try:
        importlib.import_module("kvpool._core")
        from kvpool import introspect, is_installed, uninstall
    except ImportError as e:
        raise ModeUnavailable(
            f"kvpool is not importable ({e}); build it into the venv with "
            "`bash scripts/bootstrap.sh`"
        ) from e
    # The replay keeps each mode's scheduler between its rounds and steps it only while
    # its own mode is in force, so vanilla pools alive at an install are never used by
    # kvpool's code.
    return introspect.install_beside_vllm_pools, uninstall, is_installed


def kvpool_unavailable_reason() -> str | None:
    """``None`` when kvpool (with its built extension) can be imported, else why not."""
    try:
        _kvpool_api()
    except ModeUnavailable as e:
        return str(e)
    return None


def mode_unavailable_reason(mode: str | Mode) -> str | None:
    """``None`` when ``mode`` can run here, else why not."""
    return None if not get(mode).uses_kvpool else kvpool_unavailable_reason()


def kvpool_installed() -> bool | None:
    """Whether kvpool is installed; ``None`` when it cannot be imported."""
    try:
        _, _, is_installed = _kvpool_api()
    except ModeUnavailable:
        return None
    return bool(is_installed())


def set_mode(mode: str | Mode) -> None:
    """Install or uninstall kvpool for ``mode``.

    Raises:
        ValueError: unknown mode name.
        ModeUnavailable: a kvpool mode and kvpool cannot be imported.
    """
    mode = get(mode)
    if not mode.uses_kvpool:
        restore_vanilla()
        if kvpool_installed():
            raise RuntimeError("kvpool.uninstall() left kvpool installed")
        return
    install, uninstall, is_installed = _kvpool_api()
    # The allocation policy is read when a pool is created, from what the last
    # install() was given: reinstall so that a previous mode's choice does not linger.
    if is_installed():
        uninstall()
    install(allocation=mode.allocation, lru_window=mode.lru_window)
    if not is_installed():
        raise RuntimeError("kvpool.install() returned but kvpool.is_installed() is False")


def restore_vanilla() -> None:
    """Uninstall kvpool if it is importable and installed."""
    try:
        _, uninstall, is_installed = _kvpool_api()
    except ModeUnavailable:
        return
    if is_installed():
        uninstall()


def build_for_mode(mode: Mode, build: Callable[[], object]):
    """``build()`` a scheduler for ``mode`` (after :func:`set_mode`).

    A ``vllm.general_plugins`` entry point may install kvpool while vLLM builds the
    config; vanilla must run vLLM's own classes, so it is uninstalled and the scheduler
    built again.
    """
    scheduler = build()
    if not mode.uses_kvpool and kvpool_installed():
        restore_vanilla()
        scheduler = build()
    if mode.defer_by_group:
        from kvpool.tools.replay.free_order import defer_by_group

        defer_by_group(scheduler)
    return scheduler


def reorder_api(scheduler) -> tuple[Callable[[], bool], str]:
    """``reset_free_block_queue_order`` of the first of the scheduler, its KV cache
    manager and its block pool that has it, and ``"<Owner>.reset_free_block_queue_order"``.

    Raises:
        ModeUnavailable: none of them has it (kvpool not installed).
    """
    owners = (scheduler, scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool)
    for owner in owners:
        fn = getattr(owner, "reset_free_block_queue_order", None)
        if callable(fn):
            return fn, f"{type(owner).__name__}.reset_free_block_queue_order"
    raise ModeUnavailable(
        "no reset_free_block_queue_order on the Scheduler, KVCacheManager or "
        f"{type(owners[-1]).__qualname__} (is kvpool installed?)"
    )
