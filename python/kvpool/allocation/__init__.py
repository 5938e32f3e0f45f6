"""Allocation policies of kvpool's ``BlockPool``: which policy a pool gets, and the
policy objects themselves (one module each).

Policies (``kvpool.install(allocation=...)``, or ``KVPOOL_ALLOCATION`` for the plugin
and for ``install()`` without the argument):

* ``"vllm"`` (the default, :mod:`kvpool.allocation.vllm_order`): vLLM's exact order
  (``vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue``, vLLM 0.30.0-0.34.0). Blocks
  freed without a prefix-cache hash are prepended (LIFO), blocks freed with one appended
  (LRU). The null policy: no manager hook, no allocation context, nothing per call.
  ``KVPOOL_REORDER_ON_IDLE=1`` adds one thing: whenever the last held block is freed,
  the uncached segment is restored to ascending ``block_id`` order (the LRU segment
  keeps its order, so the prefix cache is untouched).
* ``"contiguous"`` (:mod:`kvpool.allocation.contiguous`): the *uncached* free blocks are
  kept sorted and served by position with per-request extents; the *LRU* segment keeps
  vLLM's exact order. Which cached blocks are hit or evicted, in which order, the KV
  events and the preemptions are vLLM's; only the ids of uncached allocations differ,
  and where the evicted blocks sit in the table (ascending by id; docs/design.md,
  "Allocation policies"). It is the one policy that needs the
  single-type managers' hooks (:mod:`kvpool.patches.manager_hooks`). Its one knob,
  ``lru_window`` (``install(allocation="contiguous", lru_window=W)`` /
  ``KVPOOL_LRU_WINDOW``, default 0 = exact), is an opt-in, bounded relaxation of
  vLLM's LRU: an allocation that takes m blocks from the LRU segment may take any m
  of its m + W oldest when that makes fewer runs of consecutive ids.

The interface every policy implements is :class:`~kvpool.allocation.base.AllocationPolicy`;
``BlockPool`` calls its hooks unconditionally (the null policy's do nothing).
"""

from __future__ import annotations

from typing import Any

from kvpool import envs
from kvpool.allocation.base import AllocationPolicy
from kvpool.allocation.contiguous import EXTENT_CAP_FRACTION, ContiguousPolicy
from kvpool.allocation.vllm_order import VllmOrder, VllmOrderRestoreOnIdle

#: The policies ``install(allocation=...)`` accepts.
POLICIES: tuple[str, ...] = envs.ALLOCATION_POLICIES
#: Environment variable naming the policy for the plugin and for ``install()``.
ALLOCATION_ENV = envs.ALLOCATION
#: ``KVPOOL_REORDER_ON_IDLE=1``: restore the uncached segment's order on idle.
REORDER_ON_IDLE_ENV = envs.REORDER_ON_IDLE

#: Policy classes by name (``POLICIES``).
POLICY_CLASSES: dict[str, type[AllocationPolicy]] = {"vllm": VllmOrder, "contiguous": ContiguousPolicy}

#: ``KVPOOL_LRU_WINDOW``: the contiguous policy's LRU window (blocks).
LRU_WINDOW_ENV = envs.LRU_WINDOW

_policy = "vllm"
_lru_window = 0


def resolve(allocation: str | None) -> str:
    """The policy to install: ``allocation``, else ``$KVPOOL_ALLOCATION``, else
    ``"vllm"``.

    Raises:
        kvpool.envs.InvalidSettingError: (a ``ValueError``) not one of :data:`POLICIES`
            (case-insensitive), or not a string; the message names the argument or
            the variable, the value and the policies.
    """
    if allocation is not None:
        return envs.check_argument(ALLOCATION_ENV, allocation)
    return envs.get(ALLOCATION_ENV)


def resolve_lru_window(lru_window: int | None, policy: str) -> int:
    """The LRU window to install with ``policy``: ``lru_window``, else
    ``$KVPOOL_LRU_WINDOW``, else 0 (blocks).

    Raises:
        kvpool.envs.InvalidSettingError: not a whole number >= 0; or a window > 0 with
            a policy other than ``"contiguous"`` (the message names the argument or
            the variable).
    """
    given = envs.check_argument(LRU_WINDOW_ENV, lru_window)
    window = envs.get(LRU_WINDOW_ENV) if given is None else given
    if window and policy != "contiguous":
        name = "lru_window" if given is not None else LRU_WINDOW_ENV
        raise envs.InvalidSettingError(
            name, lru_window if given is not None else str(window),
            f'0 with allocation={policy!r} (an LRU window needs allocation="contiguous")')
    return window


def current() -> str:
    """The policy pools built now get (``"vllm"`` while kvpool is not installed)."""
    return _policy


def current_lru_window() -> int:
    """The contiguous policy's LRU window pools built now get (blocks; 0: exact LRU)."""
    return _lru_window


def set_policy(name: str, lru_window: int = 0) -> None:
    """Set the policy (and the contiguous policy's LRU window, blocks) for pools built
    from now on (``install()`` / ``uninstall()``).

    Raises:
        kvpool.envs.InvalidSettingError: as :func:`resolve` / :func:`resolve_lru_window`.
    """
    global _policy, _lru_window
    policy = resolve(name)
    window = resolve_lru_window(lru_window, policy)
    _policy, _lru_window = policy, window


def reorder_on_idle() -> bool:
    """True when ``KVPOOL_REORDER_ON_IDLE`` is on (:mod:`kvpool.envs` switch rule).

    Raises:
        kvpool.envs.InvalidSettingError: a value that is neither on nor off.
    """
    return envs.get(REORDER_ON_IDLE_ENV)


def new_policy(num_gpu_blocks: int, name: str | None = None) -> AllocationPolicy:
    """The policy object for a new pool of ``num_gpu_blocks`` blocks: ``name`` (default
    :func:`current`), the ``"vllm"`` one with ``KVPOOL_REORDER_ON_IDLE`` on as
    :class:`VllmOrderRestoreOnIdle`. One object per pool (it holds the pool's policy
    state).

    Raises:
        kvpool.envs.InvalidSettingError: ``KVPOOL_REORDER_ON_IDLE`` or ``name`` invalid.
    """
    name = current() if name is None else resolve(name)
    if name == "vllm" and reorder_on_idle():
        return VllmOrderRestoreOnIdle(num_gpu_blocks)
    if name == "contiguous":
        return ContiguousPolicy(num_gpu_blocks, lru_window=current_lru_window())
    return POLICY_CLASSES[name](num_gpu_blocks)


#: ``(policy class, after_change, after_free)`` of kvpool's policies as defined here, read
#: at import: the hooks the native manager path runs after the pool's native loops, and
#: only while a pool's policy has these (a hook patched later keeps vLLM's Python, which
#: runs it inside the pool's methods).
NATIVE_HOOKS: tuple[tuple[type, Any, Any], ...] = tuple(
    (cls, cls.after_change, cls.after_free) for cls in (VllmOrder, VllmOrderRestoreOnIdle, ContiguousPolicy))


def needs_manager_hooks(name: str) -> bool:
    """True when policy ``name`` needs :mod:`kvpool.patches.manager_hooks`."""
    return POLICY_CLASSES[resolve(name)].manager_hooks


__all__ = [
    "ALLOCATION_ENV",
    "EXTENT_CAP_FRACTION",
    "LRU_WINDOW_ENV",
    "NATIVE_HOOKS",
    "POLICIES",
    "POLICY_CLASSES",
    "REORDER_ON_IDLE_ENV",
    "AllocationPolicy",
    "ContiguousPolicy",
    "VllmOrder",
    "VllmOrderRestoreOnIdle",
    "current",
    "current_lru_window",
    "needs_manager_hooks",
    "new_policy",
    "reorder_on_idle",
    "resolve",
    "resolve_lru_window",
    "set_policy",
]
