"""The free-queue reorder API, from ``LLM`` down to every ``BlockPool`` (RFC vLLM #40244).

kvpool's :class:`~kvpool.block_pool.BlockPool` offers both shapes the RFC proposes:
``reset_free_block_queue_order()`` (Option A) and
``reset_prefix_cache(reorder_free_queue=True)`` (Option B). This module plumbs them
through the chain vLLM 0.33.0 already uses for ``reset_prefix_cache``::

    LLM / LLMEngine / AsyncLLM (and the EngineClient protocol the HTTP server calls)
      └── EngineCoreClient: InprocClient (direct call),
                            SyncMPClient  (call_utility),
                            AsyncMPClient (call_utility_all_async; the data-parallel
                                           subclasses inherit it)
            └── EngineCore   (vLLM's utility dispatch: getattr(engine_core, name))
                  └── Scheduler (SchedulerInterface: a default that raises)
                        └── KVCacheManager
                              └── KVCacheCoordinator: every distinct BlockPool

plus ``POST /reset_free_block_queue_order`` and a ``reorder_free_queue`` query parameter
on ``POST /reset_prefix_cache`` among vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``).

Conventions, the same at every layer:

* ``reset_free_block_queue_order()`` returns True when every pool below was reordered,
  False (with a warning in the engine-core process) while any block other than a
  pool's null block is in use; then nothing is reordered anywhere.
* ``reset_prefix_cache(..., reorder_free_queue=False)`` keeps vLLM's parameters and
  defaults. The flag is keyword-only, except on ``EngineCore``, which receives it
  positionally from ``call_utility``. With the flag off each layer runs vLLM's own
  method unchanged, so a default call, and an engine core without kvpool, behave as in
  vLLM. With it on, the layer resets the prefix cache as vLLM does and, only if that
  returned True, reorders every pool.
* ``KVPOOL_REORDER_ON_RESET=1`` is read by each pool in the engine-core process at
  every reset; every path here ends in the pools' own ``reset_prefix_cache``, so the
  switch holds whichever layer is called.

The engine-core process gets these methods from the same ``install()``: vLLM loads
``vllm.general_plugins`` at the top of ``EngineCore.__init__``, before the scheduler
exists and before any utility call is read, and the utility dispatch looks methods
up on the instance, so a method set on the class is found.

Every change goes through :class:`kvpool.patching.Patcher`; ``kvpool.uninstall()``
removes the added methods and puts vLLM's back.
"""

# No ``from __future__ import annotations``: FastAPI reads the route handlers'
# annotations (``Request``, imported inside build_dev_cache_router) as objects.
import logging
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.kvpool")

#: Set by :func:`apply` from ``kvpool.vllm_compat``: the installed vLLM has
#: ``AsyncMPClient.call_utility_all_async`` (>= 0.32.0).
_ALL_ENGINE_UTILITY_CALL = True

#: The dev-mode route added beside vLLM's ``POST /reset_prefix_cache``.
REORDER_ROUTE = "/reset_free_block_queue_order"
RESET_ROUTE = "/reset_prefix_cache"


def _named(fn: Callable, owner: type, name: str) -> Callable:
    """A copy of ``fn`` named as a method of ``owner``, so tracebacks and ``help()``
    name the vLLM class it lives on (the module-level original stays as it is).

    No ``__wrapped__``: vLLM's utility dispatch reads ``inspect.signature(method)``,
    which would follow it to vLLM's signature.
    """
    method = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    method.__kwdefaults__ = fn.__kwdefaults__
    method.__doc__ = fn.__doc__
    method.__annotations__ = fn.__annotations__
    method.__dict__.update(fn.__dict__)  # __isabstractmethod__
    method.__qualname__ = f"{owner.__qualname__}.{name}"
    return method


def _vllm_method(owner: type, name: str) -> Callable:
    fn = owner.__dict__.get(name)
    if fn is None:
        from kvpool.vllm_compat import MissingPatchTargetError

        raise MissingPatchTargetError(f"{owner.__module__}.{owner.__qualname__} defines no {name}() to extend")
    return fn


# -- KVCacheCoordinator ------------------------------------------------------------------
def coordinator_block_pools(coordinator: Any) -> list[Any]:
    """The distinct ``BlockPool`` objects a ``KVCacheCoordinator`` allocates from.

    In vLLM 0.33.0 the coordinator builds one pool that all its single-type managers
    share (unitary and full + sliding-window hybrids alike); a HiSparse source group
    replaces its manager's pool by a private host pool (``bind_host_pool``), so a
    coordinator can hold two. This is the set ``KVCacheCoordinator.reset_prefix_cache``
    resets, plus ``coordinator.block_pool`` itself.

    Returns:
        ``list[BlockPool]``, each once, ``coordinator.block_pool`` first.
    """
    pools = dict.fromkeys([coordinator.block_pool, *(m.block_pool for m in coordinator.single_type_managers)])
    return list(pools)


def _coordinator_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-queue order of every pool this coordinator holds.

    All or nothing: every pool is checked before any is touched, so a refusal leaves
    all of them as they were. Prefix-cache hashes are kept (see
    ``BlockPool.reset_free_block_queue_order``).

    Returns:
        True if every pool was reordered; False, with a warning, while any pool has a
        block other than its null block in use.

    Raises:
        TypeError: a pool is not kvpool's (built before ``kvpool.install()``); it has
            no native free queue to reorder.
    """
    pools = coordinator_block_pools(self)
    foreign = [type(p).__qualname__ for p in pools if not hasattr(p, "reset_free_block_queue_order")]
    if foreign:
        raise TypeError(
            f"cannot reorder the free queue of {', '.join(foreign)}: the pool was built "
            "before kvpool.install(); build the engine after installing kvpool"
        )
    # The null block of each pool is always in use.
    in_use = [p.num_gpu_blocks - p.get_num_free_blocks() - 1 for p in pools]
    if any(in_use):
        logger.warning(
            "Failed to reset free_block_queue order because some blocks (%d) are not "
            "freed yet (per pool: %s)",
            sum(in_use),
            in_use,
        )
        return False
    return all([p.reset_free_block_queue_order() for p in pools])


def _coordinator_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(self, *, reorder_free_queue: bool = False) -> bool:
        """Reset each pool's prefix cache once (vLLM's ``KVCacheCoordinator.
        reset_prefix_cache``); with ``reorder_free_queue``, then restore every pool's
        canonical free-queue order.

        Returns:
            True if every pool was reset (and, with the flag, reordered).
        """
        ok = vllm_reset(self)
        if ok and reorder_free_queue:
            ok = self.reset_free_block_queue_order()
        return ok

    return reset_prefix_cache


# -- KVCacheManager ----------------------------------------------------------------------
def _manager_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-queue order of every KV cache group's pool.

    Mirrors ``KVCacheManager.reset_prefix_cache`` (vLLM 0.33.0): same precondition, no
    request may hold blocks. Prefix-cache hashes and stats are kept.

    Returns:
        True if every pool was reordered, False while any block is in use.
    """
    return self.coordinator.reset_free_block_queue_order()


def _manager_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(self, *, reorder_free_queue: bool = False) -> bool:
        """Reset prefix cache (vLLM's ``KVCacheManager.reset_prefix_cache``: for RLHF
        flows after a weight update, or between benchmark trials).

        Args:
            reorder_free_queue: after a successful reset, also restore every pool's
                canonical free-queue order (RFC vLLM #40244, Option B).

        Returns:
            bool: True if the prefix cache is successfully reset (and, with the flag,
            the free queues reordered), False otherwise.
        """
        ok = vllm_reset(self)
        if ok and reorder_free_queue:
            ok = self.reset_free_block_queue_order()
        return ok

    return reset_prefix_cache


# -- SchedulerInterface / Scheduler ------------------------------------------------------
def _interface_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical allocation order of the KV cache free-block queues.

    Call between rounds (RLHF rollouts, benchmark trials), when no request holds KV
    blocks: later allocations then get contiguous block ids again.

    Returns:
        True if the order was restored, False while requests hold KV blocks.

    Raises:
        NotImplementedError: this scheduler does not implement it (kvpool provides it
            for vLLM's ``Scheduler`` and its subclasses).
    """
    raise NotImplementedError


def _interface_reset_prefix_cache(
    self,
    reset_running_requests: bool = False,
    reset_connector: bool = False,
    *,
    reorder_free_queue: bool = False,
) -> bool:
    """Reset the prefix cache for KV cache.

    This is particularly required when the model weights are live-updated.

    Args:
        reset_running_requests: If True, all the running requests will be
            preempted and moved to the waiting queue. Otherwise, this method
            will only reset the KV prefix cache when there is no running request
            taking KV cache.
        reset_connector: If True, also reset any KV connector state.
        reorder_free_queue: after a successful reset, also restore the canonical
            free-block-queue order (kvpool; RFC vLLM #40244, Option B).
    """
    raise NotImplementedError


_interface_reset_prefix_cache.__isabstractmethod__ = True  # as vLLM declares it


def _scheduler_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical allocation order of the KV cache free-block queues.

    Same precondition as ``reset_prefix_cache()`` without ``reset_running_requests``:
    running requests (and frees a KV connector still defers) hold blocks, and then
    nothing changes. Prefix-cache hashes are kept.

    Returns:
        True if every pool was reordered, False (with a warning) otherwise.
    """
    return self.kv_cache_manager.reset_free_block_queue_order()


def _scheduler_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(
        self,
        reset_running_requests: bool = False,
        reset_connector: bool = False,
        *,
        reorder_free_queue: bool = False,
    ) -> bool:
        """Reset the KV prefix cache (vLLM 0.33.0 ``Scheduler.reset_prefix_cache``).

        If reset_running_requests is True, all the running requests will be
        preempted and moved to the waiting queue. Otherwise, this method will only
        reset the KV prefix cache when there is no running requests taking KV cache.

        Args:
            reset_running_requests: preempt running requests first.
            reset_connector: also reset the KV connector's cache.
            reorder_free_queue: if the reset returned True, also restore the
                canonical free-block-queue order (RFC vLLM #40244, Option B).

        Returns:
            True if the reset (and, with the flag, the reorder) succeeded.

        Raises:
            RuntimeError: as vLLM, when the reset fails although running requests
                were preempted.
        """
        ok = vllm_reset(self, reset_running_requests, reset_connector)
        if ok and reorder_free_queue:
            ok = self.reset_free_block_queue_order()
        return ok

    return reset_prefix_cache


# -- EngineCore --------------------------------------------------------------------------
def _engine_core_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-block-queue order of the scheduler's KV pools.

    Reached from the multi-process clients through ``call_utility(
    "reset_free_block_queue_order")``; runs in the busy loop between steps.

    Returns:
        True if every pool was reordered, False while requests hold KV blocks.
    """
    return self.scheduler.reset_free_block_queue_order()


def _engine_core_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(
        self,
        reset_running_requests: bool = False,
        reset_connector: bool = False,
        reorder_free_queue: bool = False,
    ) -> bool:
        """vLLM's ``EngineCore.reset_prefix_cache`` plus ``reorder_free_queue``.

        The flag is positional here because utility calls carry positional args; the
        clients send it only when it is True, so vLLM's own two-argument call (and a
        scheduler that predates the flag) is unchanged.

        Returns:
            True if the reset (and, with the flag, the reorder) succeeded.
        """
        if not reorder_free_queue:
            return vllm_reset(self, reset_running_requests, reset_connector)
        return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector, reorder_free_queue=True)

    return reset_prefix_cache


# -- EngineCoreClient variants -----------------------------------------------------------
def _client_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-block-queue order in the engine core.

    Returns:
        True if every pool was reordered, False while requests hold KV blocks.
    """
    raise NotImplementedError


async def _client_reset_free_block_queue_order_async(self) -> bool:
    """Async ``reset_free_block_queue_order()``.

    Returns:
        True if every pool of every engine was reordered.
    """
    raise NotImplementedError


def _client_reset_prefix_cache(
    self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
) -> bool:
    """Reset the prefix cache; with ``reorder_free_queue``, then restore the canonical
    free-block-queue order."""
    raise NotImplementedError


async def _client_reset_prefix_cache_async(
    self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
) -> bool:
    """Async ``reset_prefix_cache()``."""
    raise NotImplementedError


def _inproc_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-block-queue order of the in-process engine core.

    Returns:
        True if every pool was reordered, False while requests hold KV blocks.
    """
    return self.engine_core.reset_free_block_queue_order()


def _inproc_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
    ) -> bool:
        """vLLM's ``InprocClient.reset_prefix_cache`` plus ``reorder_free_queue``.

        Returns:
            True if the reset (and, with the flag, the reorder) succeeded.
        """
        if not reorder_free_queue:
            return vllm_reset(self, reset_running_requests, reset_connector)
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector, True)

    return reset_prefix_cache


def _sync_mp_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-block-queue order in the engine-core process
    (``call_utility("reset_free_block_queue_order")``).

    Returns:
        True if every pool was reordered, False while requests hold KV blocks.

    Raises:
        Exception: the engine core failed the call (vLLM raises the failure message
            it sends back), e.g. kvpool is not active in the engine-core process.
    """
    return self.call_utility("reset_free_block_queue_order")


def _sync_mp_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
    ) -> bool:
        """vLLM's ``SyncMPClient.reset_prefix_cache`` plus ``reorder_free_queue``,
        sent as a third ``call_utility`` argument only when True.

        Returns:
            True if the reset (and, with the flag, the reorder) succeeded.
        """
        if not reorder_free_queue:
            return vllm_reset(self, reset_running_requests, reset_connector)
        return self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector, True)

    return reset_prefix_cache


async def _call_every_engine(client: Any, method: str, *args: Any) -> list[Any]:
    """One utility call per engine-core process ``client`` manages, one result each.

    vLLM >= 0.32.0 has this as ``AsyncMPClient.call_utility_all_async``; before, its
    ``reset_prefix_cache_async`` reached one engine (``call_utility_async``), so kvpool
    fans out over ``client.core_engines`` itself, as ``call_utility_all_async`` does
    (``kvpool.vllm_compat.VllmRelease.all_engine_utility_call``).
    """
    if _ALL_ENGINE_UTILITY_CALL:
        return await client.call_utility_all_async(method, *args)
    import asyncio

    return list(
        await asyncio.gather(*[client._call_utility_async(method, *args, engine=e) for e in client.core_engines])
    )


async def _async_mp_reset_free_block_queue_order_async(self) -> bool:
    """Restore the canonical free-block-queue order in every engine-core process
    this client manages (``call_utility_all_async``, as ``reset_prefix_cache_async``).

    Each data-parallel engine decides on its own; the result is True only if every
    engine reordered.

    Returns:
        True if every pool of every engine was reordered.
    """
    return all(await _call_every_engine(self, "reset_free_block_queue_order"))


def _async_mp_reset_prefix_cache_async(vllm_reset: Callable) -> Callable:
    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
    ) -> bool:
        """vLLM's ``AsyncMPClient.reset_prefix_cache_async`` plus
        ``reorder_free_queue``, sent as a third utility argument only when True.

        Returns:
            True if every engine reset (and, with the flag, reordered).
        """
        if not reorder_free_queue:
            return await vllm_reset(self, reset_running_requests, reset_connector)
        return all(
            await _call_every_engine(self, "reset_prefix_cache", reset_running_requests, reset_connector, True)
        )

    return reset_prefix_cache_async


# -- LLMEngine / AsyncLLM / LLM / EngineClient -------------------------------------------
def _llm_engine_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical allocation order of the KV cache free-block queues
    (RFC vLLM #40244, Option A). Call when no request is running.

    Returns:
        True if the order was restored, False while requests hold KV blocks.
    """
    return self.engine_core.reset_free_block_queue_order()


def _llm_engine_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
    ) -> bool:
        """Reset the prefix cache (vLLM's ``LLMEngine.reset_prefix_cache``).

        Args:
            reorder_free_queue: after a successful reset, also restore the canonical
                free-block-queue order (RFC vLLM #40244, Option B).

        Returns:
            True if the reset (and, with the flag, the reorder) succeeded.
        """
        if not reorder_free_queue:
            return vllm_reset(self, reset_running_requests, reset_connector)
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector, reorder_free_queue=True)

    return reset_prefix_cache


async def _async_llm_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical allocation order of the KV cache free-block queues in
    every engine (RFC vLLM #40244, Option A). Call when no request is running.

    Returns:
        True if every engine restored it, False while requests hold KV blocks.
    """
    return await self.engine_core.reset_free_block_queue_order_async()


def _async_llm_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
    ) -> bool:
        """Reset the prefix cache (vLLM's ``AsyncLLM.reset_prefix_cache``).

        Args:
            reorder_free_queue: after a successful reset, also restore the canonical
                free-block-queue order (RFC vLLM #40244, Option B).

        Returns:
            True if every engine reset (and, with the flag, reordered).
        """
        if not reorder_free_queue:
            return await vllm_reset(self, reset_running_requests, reset_connector)
        return await self.engine_core.reset_prefix_cache_async(
            reset_running_requests, reset_connector, reorder_free_queue=True
        )

    return reset_prefix_cache


def _llm_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical allocation order of the KV cache free-block queues.

    Long-lived sessions scramble the free-block queue, so later prompts get
    scattered block ids and attention kernels lose locality in prefill (RFC vLLM
    #40244). Call between rounds, after ``generate()`` returned; typically right
    after ``reset_prefix_cache()``, or use ``reset_prefix_cache(reorder_free_queue=
    True)`` for both at once. Prefix-cache hashes are kept.

    Returns:
        True if the order was restored, False (and a warning in the engine-core
        log) while requests hold KV blocks; nothing changes then.
    """
    return self.llm_engine.reset_free_block_queue_order()


def _llm_reset_prefix_cache(vllm_reset: Callable) -> Callable:
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
    ) -> bool:
        """Reset the prefix cache (vLLM's ``LLM.reset_prefix_cache``).

        Args:
            reset_running_requests: preempt running requests first.
            reset_connector: also reset the KV connector's cache.
            reorder_free_queue: after a successful reset, also restore the canonical
                free-block-queue order, as ``reset_free_block_queue_order()`` (RFC
                vLLM #40244, Option B).

        Returns:
            True if the reset (and, with the flag, the reorder) succeeded.
        """
        if not reorder_free_queue:
            return vllm_reset(self, reset_running_requests, reset_connector)
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector, reorder_free_queue=True)

    return reset_prefix_cache


async def _engine_client_reset_free_block_queue_order(self) -> bool:
    """Restore the canonical free-block-queue order of the KV cache (kvpool).

    Returns:
        True if the order was restored, False while requests hold KV blocks.

    Raises:
        NotImplementedError: this engine client does not implement it.
    """
    raise NotImplementedError


async def _engine_client_reset_prefix_cache(
    self, reset_running_requests: bool = False, reset_connector: bool = False, *, reorder_free_queue: bool = False
) -> bool:
    """Reset the prefix cache and optionally any configured connector cache;
    ``reorder_free_queue`` also restores the free-block-queue order (kvpool)."""
    ...


_engine_client_reset_prefix_cache.__isabstractmethod__ = True  # as vLLM declares it


# -- dev-mode HTTP routes ----------------------------------------------------------------
def build_dev_cache_router(vllm_router: Any, engine_client: Callable) -> Any:
    """vLLM's dev-mode cache router with kvpool's reorder routes.

    Holds every route of ``vllm_router`` except ``POST /reset_prefix_cache``, which is
    replaced by the same route plus a ``reorder_free_queue`` query parameter, and adds
    ``POST /reset_free_block_queue_order``.

    Args:
        vllm_router: ``vllm.entrypoints.serve.dev.cache.api_router.router``.
        engine_client: ``request -> EngineClient`` (that module's ``engine_client``).

    Returns:
        A new ``fastapi.APIRouter``; ``vllm_router`` is not modified.
    """
    from fastapi import APIRouter, Query, Request
    from fastapi.responses import JSONResponse

    router = APIRouter()
    router.routes.extend(
        r for r in vllm_router.routes if not (getattr(r, "path", None) == RESET_ROUTE and "POST" in r.methods)
    )

    @router.post(RESET_ROUTE)
    async def reset_prefix_cache(
        raw_request: Request,
        reset_running_requests: bool = Query(default=False),
        reset_external: bool = Query(default=False),
        reorder_free_queue: bool = Query(default=False),
    ):
        """Reset the local prefix cache.

        Optionally, if the query parameter `reset_external=true`
        also resets the external (connector-managed) prefix cache.
        With `reorder_free_queue=true` a successful reset also restores the
        canonical free-block-queue order (kvpool).

        Returns `{"success": bool}`. The reset fails (`success=false`) while
        blocks are still held, e.g. by running requests or in-flight async KV
        offload transfers; callers may retry.

        Example:
           POST /reset_prefix_cache?reorder_free_queue=true
        """
        logger.info("Resetting prefix cache (reorder_free_queue=%s)...", reorder_free_queue)
        client = engine_client(raw_request)
        if reorder_free_queue:
            success = await client.reset_prefix_cache(reset_running_requests, reset_external, reorder_free_queue=True)
        else:
            success = await client.reset_prefix_cache(reset_running_requests, reset_external)
        return JSONResponse(content={"success": bool(success)})

    @router.post(REORDER_ROUTE)
    async def reset_free_block_queue_order(raw_request: Request):
        """Restore the canonical free-block-queue order of the KV cache (kvpool;
        RFC vLLM #40244). Prefix-cache entries are kept.

        Returns `{"success": bool}`: false while requests hold KV blocks (retry once
        they finished). 501 if the engine client does not implement it.
        """
        logger.info("Resetting free block queue order...")
        try:
            success = await engine_client(raw_request).reset_free_block_queue_order()
        except NotImplementedError:
            return JSONResponse(
                status_code=501,
                content={"error": "the engine client does not implement reset_free_block_queue_order"},
            )
        return JSONResponse(content={"success": bool(success)})

    return router


def _patch_dev_cache_router(patcher: Any) -> None:
    try:
        from vllm.entrypoints.serve.dev.cache import api_router
    except ImportError as e:  # fastapi is an optional dependency of vLLM's server
        logger.debug("kvpool: dev-mode cache routes not patched: %s", e)
        return

    def attach_router(app) -> None:
        """vLLM's ``attach_router`` for the dev-mode cache routes, with kvpool's
        reorder routes (``kvpool.engine_api.build_dev_cache_router``)."""
        app.include_router(build_dev_cache_router(api_router.router, api_router.engine_client))

    attach_router.__module__ = __name__
    # register_vllm_dev_api_routers() imports attach_router from the module when the
    # server builds its app (VLLM_SERVER_DEV_MODE=1), after plugins are loaded.
    patcher.set_attr(api_router, "attach_router", attach_router)


# -- apply -------------------------------------------------------------------------------
def apply(patcher: Any) -> None:
    """Add the reorder API at every layer of vLLM 0.33.0 (see the module docstring).

    Args:
        patcher: the :class:`kvpool.patching.Patcher` of the running ``install()``.
    """
    from vllm.engine.protocol import EngineClient
    from vllm.entrypoints.llm import LLM
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import core_client
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.llm_engine import LLMEngine

    from kvpool.vllm_compat import release_traits

    global _ALL_ENGINE_UTILITY_CALL
    _ALL_ENGINE_UTILITY_CALL = release_traits().all_engine_utility_call
    reorder = "reset_free_block_queue_order"
    reset = "reset_prefix_cache"

    def add(owner: type, name: str, fn: Callable) -> None:
        patcher.set_attr(owner, name, _named(fn, owner, name))

    def extend_reset(owner: type, factory: Callable, name: str = reset) -> None:
        add(owner, name, factory(_vllm_method(owner, name)))

    # Engine-core side, bottom up.
    add(KVCacheCoordinator, reorder, _coordinator_reset_free_block_queue_order)
    extend_reset(KVCacheCoordinator, _coordinator_reset_prefix_cache)
    add(KVCacheManager, reorder, _manager_reset_free_block_queue_order)
    extend_reset(KVCacheManager, _manager_reset_prefix_cache)
    add(SchedulerInterface, reorder, _interface_reset_free_block_queue_order)
    add(SchedulerInterface, reset, _interface_reset_prefix_cache)
    add(Scheduler, reorder, _scheduler_reset_free_block_queue_order)
    extend_reset(Scheduler, _scheduler_reset_prefix_cache)
    add(EngineCore, reorder, _engine_core_reset_free_block_queue_order)
    extend_reset(EngineCore, _engine_core_reset_prefix_cache)

    # Clients. The data-parallel async clients override neither reset method in
    # 0.33.0 and inherit AsyncMPClient's.
    base = core_client.EngineCoreClient
    add(base, reorder, _client_reset_free_block_queue_order)
    add(base, reorder + "_async", _client_reset_free_block_queue_order_async)
    add(base, reset, _client_reset_prefix_cache)
    add(base, reset + "_async", _client_reset_prefix_cache_async)
    add(core_client.InprocClient, reorder, _inproc_reset_free_block_queue_order)
    extend_reset(core_client.InprocClient, _inproc_reset_prefix_cache)
    add(core_client.SyncMPClient, reorder, _sync_mp_reset_free_block_queue_order)
    extend_reset(core_client.SyncMPClient, _sync_mp_reset_prefix_cache)
    add(core_client.AsyncMPClient, reorder + "_async", _async_mp_reset_free_block_queue_order_async)
    extend_reset(core_client.AsyncMPClient, _async_mp_reset_prefix_cache_async, reset + "_async")

    # Front ends.
    add(LLMEngine, reorder, _llm_engine_reset_free_block_queue_order)
    extend_reset(LLMEngine, _llm_engine_reset_prefix_cache)
    add(AsyncLLM, reorder, _async_llm_reset_free_block_queue_order)
    extend_reset(AsyncLLM, _async_llm_reset_prefix_cache)
    add(LLM, reorder, _llm_reset_free_block_queue_order)
    extend_reset(LLM, _llm_reset_prefix_cache)
    add(EngineClient, reorder, _engine_client_reset_free_block_queue_order)
    add(EngineClient, reset, _engine_client_reset_prefix_cache)

    _patch_dev_cache_router(patcher)


__all__ = ["REORDER_ROUTE", "RESET_ROUTE", "apply", "build_dev_cache_router", "coordinator_block_pools"]
