"""The free-queue reorder API, from ``LLM`` down to every ``BlockPool`` (RFC vLLM #40244).

kvpool's :class:`~kvpool.block_pool.BlockPool` offers both shapes the RFC proposes:
``reset_free_block_queue_order()`` (Option A) and
``reset_prefix_cache(reorder_free_queue=True)`` (Option B). This module plumbs them
through the chain that vLLM 0.30.0–0.34.0 use for ``reset_prefix_cache``::

    LLM / LLMEngine / AsyncLLM (and the EngineClient protocol the HTTP server calls)
      └── EngineCoreClient: InprocClient (direct call),
                            SyncMPClient  (call_utility),
                            AsyncMPClient (call_utility_all_async; the data-parallel
                                           subclasses inherit it)
            └── EngineCore   (vLLM's utility dispatch: getattr(engine_core, name))
                  └── Scheduler (SchedulerInterface: a default that raises)
                        └── KVCacheManager
                              └── KVCacheCoordinator: every distinct BlockPool

one row of :data:`LAYERS` per class, plus ``POST /reset_free_block_queue_order`` and a
``reorder_free_queue`` query parameter on ``POST /reset_prefix_cache`` among vLLM's
dev-mode routes (``VLLM_SERVER_DEV_MODE=1``).

At every layer ``reset_free_block_queue_order()`` returns True when every pool below
was reordered, False (with a warning in the engine-core process) while any block other
than a pool's null block is in use, and then nothing is reordered anywhere.
``reset_prefix_cache(..., reorder_free_queue=False)`` keeps vLLM's parameters and
defaults; the flag is keyword-only, except on ``EngineCore``, which receives it
positionally from ``call_utility``. With the flag off each layer runs vLLM's own method
unchanged, so a default call, and an engine core without kvpool, behave as in vLLM; with
it on, the prefix cache is reset as vLLM does and, only if that returned True, every pool
reordered. ``KVPOOL_REORDER_ON_RESET=1`` is read by each pool at every reset, and every
path here ends in the pools' own ``reset_prefix_cache``, so it holds whichever layer is
called. The engine-core process gets these methods from the same ``install()``: vLLM
loads ``vllm.general_plugins`` at the top of ``EngineCore.__init__``, and the utility
dispatch looks methods up on the instance, so a method set on the class is found.

Every change goes through :class:`kvpool.patching.Patcher`; ``kvpool.uninstall()``
removes the added methods and puts vLLM's back.
"""

# No ``from __future__ import annotations``: FastAPI reads the route handlers'
# annotations (``Request``, imported inside build_dev_cache_router) as objects.
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.vllm_compat import MissingPatchTargetError, release_traits

logger = logging.getLogger("vllm.kvpool")

#: Set by :func:`apply` from ``kvpool.vllm_compat``: the installed vLLM has
#: ``AsyncMPClient.call_utility_all_async`` (>= 0.32.0).
_ALL_ENGINE_UTILITY_CALL = True

#: The dev-mode route added beside vLLM's ``POST /reset_prefix_cache``.
REORDER_ROUTE = "/reset_free_block_queue_order"
RESET_ROUTE = "/reset_prefix_cache"

REORDER = "reset_free_block_queue_order"
RESET = "reset_prefix_cache"


@dataclass(frozen=True)
class Layer:
    """One vLLM class and the two methods kvpool gives it: ``reset_free_block_queue_order``
    and ``reset_prefix_cache`` with the ``reorder_free_queue`` flag.

    Attributes:
        owner: the class, ``"module:QualName"``.
        fan_out: how both reach the layer below: ``"pools"`` (every pool of the
            coordinator, all or nothing) or ``"local"`` (``child``'s reorder): the reset
            is vLLM's, then this layer's reorder; ``"child"``: both call ``child``'s,
            with ``reorder_free_queue=True``; ``"utility"``: engine-core utility calls,
            the flag a third argument sent only when True; ``"every_engine"``: the same
            to every engine-core process, True only if all returned True;
            ``"abstract"``: the reorder raises ``NotImplementedError``, the reset runs
            vLLM's own (abstract) body.
        reorder_doc, reset_doc: what ``help()`` shows, without the Args and Returns
            sections every layer shares (:func:`_docs` adds them).
        child: the attribute holding the layer below.
        args: ``reset_prefix_cache``'s parameters before the flag: ``"none"``,
            ``"keyword"`` (vLLM's two; the flag keyword-only) or ``"positional"`` (the
            flag third, as ``call_utility`` sends it).
        is_async: both are coroutine functions. suffix / child_suffix: appended to the
            method names here / to those called on ``child``.
    """

    owner: str
    fan_out: str
    reorder_doc: str
    reset_doc: str
    child: str = ""
    args: str = "keyword"
    is_async: bool = False
    suffix: str = ""
    child_suffix: str = ""


_REORDER_RETURNS = """
    Returns:
        True if every pool below was reordered; False, with a warning in the
        engine-core process, while requests hold KV blocks (nothing changes then)."""
_RESET_ARGS = """
    Args:
        reset_running_requests: preempt running requests first (vLLM's).
        reset_connector: also reset the KV connector's cache (vLLM's)."""
_FLAG_ARG = """
        reorder_free_queue: after a successful reset, also restore the canonical
            free-block-queue order, as ``reset_free_block_queue_order()`` (RFC vLLM
            #40244, Option B)."""
_RESET_RETURNS = """
    Returns:
        True if the reset (and, with the flag, the reorder) succeeded (in every
        engine, on a client of several)."""
_NOT_IMPLEMENTED = """

    Raises:
        NotImplementedError: this class does not implement it (kvpool provides it
            for vLLM's own subclasses)."""


def _docs(layer: Layer) -> tuple[str, str]:
    """The two docstrings of ``layer``: its text with the shared Args and Returns
    sections inserted before its own Raises section, if any."""
    args = ("\n    Args:" if layer.args == "none" else _RESET_ARGS) + _FLAG_ARG
    docs = []
    for doc, sections in ((layer.reorder_doc, _REORDER_RETURNS), (layer.reset_doc, args + "\n" + _RESET_RETURNS)):
        text, raises, rest = doc.partition("\n\n    Raises:")
        docs.append(text + "\n" + sections + raises + rest)
    return docs[0], docs[1]


#: Bottom up, in the order :func:`apply` patches them.
LAYERS: tuple[Layer, ...] = (
    Layer("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", "pools", args="none",
          reorder_doc="""Restore the canonical free-queue order of every pool this coordinator holds.

    All or nothing: every pool is checked before any is touched, so a refusal leaves
    all of them as they were. Prefix-cache hashes are kept (see
    ``BlockPool.reset_free_block_queue_order``).

    Raises:
        TypeError: a pool is not kvpool's (built before ``kvpool.install()``); it has
            no native free queue to reorder.""",
          reset_doc="""Reset each pool's prefix cache once (vLLM's ``KVCacheCoordinator.
    reset_prefix_cache``); with ``reorder_free_queue``, then restore every pool's
    canonical free-queue order."""),
    Layer("vllm.v1.core.kv_cache_manager:KVCacheManager", "local", child="coordinator", args="none",
          reorder_doc="""Restore the canonical free-queue order of every KV cache group's pool.

    Same precondition as ``reset_prefix_cache``: no request may hold blocks.
    Prefix-cache hashes and stats are kept.""",
          reset_doc="""Reset prefix cache (vLLM's ``KVCacheManager.reset_prefix_cache``: for RLHF
    flows after a weight update, or between benchmark trials)."""),
    Layer("vllm.v1.core.sched.interface:SchedulerInterface", "abstract",
          reorder_doc="""Restore the canonical allocation order of the KV cache free-block queues.

    Call between rounds (RLHF rollouts, benchmark trials), when no request holds KV
    blocks: later allocations then get contiguous block ids again.""" + _NOT_IMPLEMENTED,
          reset_doc="""Reset the prefix cache for KV cache, e.g. after a live weight update
    (abstract, as vLLM declares it)."""),
    Layer("vllm.v1.core.sched.scheduler:Scheduler", "local", child="kv_cache_manager",
          reorder_doc="""Restore the canonical allocation order of the KV cache free-block queues.

    Same precondition as ``reset_prefix_cache()`` without ``reset_running_requests``:
    running requests (and frees a KV connector still defers) hold blocks, and then
    nothing changes. Prefix-cache hashes are kept.""",
          reset_doc="""Reset the KV prefix cache (vLLM's ``Scheduler.reset_prefix_cache``): only
    while no running request holds KV blocks, unless ``reset_running_requests``
    preempts them into the waiting queue first.

    Raises:
        RuntimeError: as vLLM, when the reset fails although running requests
            were preempted."""),
    Layer("vllm.v1.engine.core:EngineCore", "child", child="scheduler", args="positional",
          reorder_doc="""Restore the canonical free-block-queue order of the scheduler's KV pools.

    Reached from the multi-process clients through ``call_utility(
    "reset_free_block_queue_order")``; runs in the busy loop between steps.""",
          reset_doc="""vLLM's ``EngineCore.reset_prefix_cache`` plus ``reorder_free_queue``.

    The flag is positional here because utility calls carry positional args; the
    clients send it only when it is True, so vLLM's own two-argument call (and a
    scheduler that predates the flag) is unchanged."""),
    # Clients. The data-parallel async clients override neither reset method in
    # vLLM 0.30.0–0.34.0 and inherit AsyncMPClient's.
    Layer("vllm.v1.engine.core_client:EngineCoreClient", "abstract",
          reorder_doc="Restore the canonical free-block-queue order in the engine core." + _NOT_IMPLEMENTED,
          reset_doc="""Reset the prefix cache; with ``reorder_free_queue``, then restore the canonical
    free-block-queue order.""" + _NOT_IMPLEMENTED),
    Layer("vllm.v1.engine.core_client:EngineCoreClient", "abstract", is_async=True, suffix="_async",
          reorder_doc="Async ``reset_free_block_queue_order()``." + _NOT_IMPLEMENTED,
          reset_doc="Async ``reset_prefix_cache()``." + _NOT_IMPLEMENTED),
    Layer("vllm.v1.engine.core_client:InprocClient", "child", child="engine_core",
          reorder_doc="Restore the canonical free-block-queue order of the in-process engine core.",
          reset_doc="vLLM's ``InprocClient.reset_prefix_cache`` plus ``reorder_free_queue``."),
    Layer("vllm.v1.engine.core_client:SyncMPClient", "utility",
          reorder_doc="""Restore the canonical free-block-queue order in the engine-core process
    (``call_utility("reset_free_block_queue_order")``).

    Raises:
        Exception: the engine core failed the call (vLLM raises the failure message
            it sends back), e.g. kvpool is not active in the engine-core process.""",
          reset_doc="""vLLM's ``SyncMPClient.reset_prefix_cache`` plus ``reorder_free_queue``,
    sent as a third ``call_utility`` argument only when True."""),
    Layer("vllm.v1.engine.core_client:AsyncMPClient", "every_engine", is_async=True, suffix="_async",
          reorder_doc="""Restore the canonical free-block-queue order in every engine-core process
    this client manages (``call_utility_all_async``, as ``reset_prefix_cache_async``);
    each data-parallel engine decides on its own, True only if every engine reordered.""",
          reset_doc="""vLLM's ``AsyncMPClient.reset_prefix_cache_async`` plus
    ``reorder_free_queue``, sent as a third utility argument only when True."""),
    # Front ends.
    Layer("vllm.v1.engine.llm_engine:LLMEngine", "child", child="engine_core",
          reorder_doc="""Restore the canonical allocation order of the KV cache free-block queues
    (RFC vLLM #40244, Option A). Call when no request is running.""",
          reset_doc="Reset the prefix cache (vLLM's ``LLMEngine.reset_prefix_cache``)."),
    Layer("vllm.v1.engine.async_llm:AsyncLLM", "child", child="engine_core", is_async=True, child_suffix="_async",
          reorder_doc="""Restore the canonical allocation order of the KV cache free-block queues in
    every engine (RFC vLLM #40244, Option A). Call when no request is running.""",
          reset_doc="Reset the prefix cache (vLLM's ``AsyncLLM.reset_prefix_cache``)."),
    Layer("vllm.entrypoints.llm:LLM", "child", child="llm_engine",
          reorder_doc="""Restore the canonical allocation order of the KV cache free-block queues.

    Long-lived sessions scramble the free-block queue, so later prompts get
    scattered block ids and attention kernels lose locality in prefill (RFC vLLM
    #40244). Call between rounds, after ``generate()`` returned; typically right
    after ``reset_prefix_cache()``, or use ``reset_prefix_cache(reorder_free_queue=
    True)`` for both at once. Prefix-cache hashes are kept.""",
          reset_doc="Reset the prefix cache (vLLM's ``LLM.reset_prefix_cache``)."),
    Layer("vllm.engine.protocol:EngineClient", "abstract", is_async=True,
          reorder_doc="Restore the canonical free-block-queue order of the KV cache (kvpool)." + _NOT_IMPLEMENTED,
          reset_doc="""Reset the prefix cache and optionally any configured connector cache;
    ``reorder_free_queue`` also restores the free-block-queue order (kvpool)."""),
)


# -- KVCacheCoordinator: the pools -------------------------------------------------------
def coordinator_block_pools(coordinator: Any) -> list[Any]:
    """The distinct ``BlockPool`` objects a ``KVCacheCoordinator`` allocates from.

    In vLLM 0.30.0–0.34.0 the coordinator builds one pool that all its single-type
    managers share (unitary and full + sliding-window hybrids alike); in 0.33.0 a
    HiSparse source group replaces its manager's pool by a private host pool
    (``bind_host_pool``), so a coordinator can hold two. This is the set ``KVCacheCoordinator.reset_prefix_cache``
    resets, plus ``coordinator.block_pool`` itself.

    Returns:
        ``list[BlockPool]``, each once, ``coordinator.block_pool`` first.
    """
    pools = dict.fromkeys([coordinator.block_pool, *(m.block_pool for m in coordinator.single_type_managers)])
    return list(pools)


def _reorder_pools(coordinator: Any) -> bool:
    pools = coordinator_block_pools(coordinator)
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


async def _every_engine(client: Any, method: str, *args: Any) -> bool:
    """One utility call per engine-core process ``client`` manages; True only if every
    engine returned True.

    vLLM >= 0.32.0 has the fan-out as ``AsyncMPClient.call_utility_all_async``; before,
    its ``reset_prefix_cache_async`` reached one engine (``call_utility_async``), so
    kvpool fans out over ``client.core_engines`` itself, as ``call_utility_all_async``
    does (``kvpool.vllm_compat.VllmRelease.all_engine_utility_call``).
    """
    if _ALL_ENGINE_UTILITY_CALL:
        return all(await client.call_utility_all_async(method, *args))
    import asyncio

    calls = [client._call_utility_async(method, *args, engine=e) for e in client.core_engines]
    return all(await asyncio.gather(*calls))


def _not_implemented(self: Any, *args: Any) -> Any:
    raise NotImplementedError


# -- one layer's two methods -------------------------------------------------------------
def _fan_out(layer: Layer, vllm_reset: Callable) -> tuple[Callable, Callable]:
    """``(reorder(self), reset_on(self, *vllm_args))``: how ``layer`` reorders, and how
    it resets with the flag on; either may return an awaitable on an async layer."""
    own_reorder = REORDER + layer.suffix
    reorder_below = REORDER + layer.child_suffix
    reset_below = RESET + layer.child_suffix
    child_reorder = lambda self: getattr(getattr(self, layer.child), reorder_below)()  # noqa: E731
    if layer.fan_out in ("pools", "local"):
        # Below the engine core the reset runs here, then this layer's own reorder.
        return (_reorder_pools if layer.fan_out == "pools" else child_reorder,
                lambda self, *a: vllm_reset(self, *a) and getattr(self, own_reorder)())
    if layer.fan_out == "child":
        return child_reorder, lambda self, *a: getattr(getattr(self, layer.child), reset_below)(
            *a, reorder_free_queue=True)
    if layer.fan_out == "utility":
        return lambda self: self.call_utility(REORDER), lambda self, *a: self.call_utility(RESET, *a, True)
    if layer.fan_out == "every_engine":
        return lambda self: _every_engine(self, REORDER), lambda self, *a: _every_engine(self, RESET, *a, True)
    assert layer.fan_out == "abstract", layer
    return _not_implemented, vllm_reset


def _methods(layer: Layer, owner: type) -> dict[str, Callable]:
    """The two methods of ``layer`` on ``owner`` by name, vLLM's reset extended."""
    reset_name = RESET + layer.suffix
    vllm_reset = owner.__dict__.get(reset_name)
    if vllm_reset is None:
        if layer.fan_out != "abstract":
            raise MissingPatchTargetError(
                f"{owner.__module__}.{owner.__qualname__} defines no {reset_name}() to extend")
        vllm_reset = _not_implemented
    reorder, reset_on = _fan_out(layer, vllm_reset)

    if layer.is_async:
        async def reorder_method(self) -> bool:
            return await reorder(self)

        async def reset_method(
            self, reset_running_requests: bool = False, reset_connector: bool = False, *,
            reorder_free_queue: bool = False
        ) -> bool:
            return await (reset_on if reorder_free_queue else vllm_reset)(self, reset_running_requests, reset_connector)
    else:
        def reorder_method(self) -> bool:
            return reorder(self)

        if layer.args == "none":
            def reset_method(self, *, reorder_free_queue: bool = False) -> bool:
                return (reset_on if reorder_free_queue else vllm_reset)(self)
        elif layer.args == "positional":
            def reset_method(
                self, reset_running_requests: bool = False, reset_connector: bool = False,
                reorder_free_queue: bool = False
            ) -> bool:
                return (reset_on if reorder_free_queue else vllm_reset)(self, reset_running_requests, reset_connector)
        else:
            def reset_method(
                self, reset_running_requests: bool = False, reset_connector: bool = False, *,
                reorder_free_queue: bool = False
            ) -> bool:
                return (reset_on if reorder_free_queue else vllm_reset)(self, reset_running_requests, reset_connector)

    methods = dict(zip((REORDER + layer.suffix, reset_name), zip((reorder_method, reset_method), _docs(layer))))
    for name, (fn, doc) in methods.items():
        # Named as methods of the vLLM class, so tracebacks and help() name where they
        # live. No __wrapped__: vLLM's utility dispatch reads inspect.signature(method).
        fn.__name__, fn.__qualname__, fn.__doc__ = name, f"{owner.__qualname__}.{name}", doc
    if getattr(vllm_reset, "__isabstractmethod__", False):
        reset_method.__isabstractmethod__ = True  # as vLLM declares it
    return {name: fn for name, (fn, _) in methods.items()}


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
        reorder routes (``kvpool.patches.engine_api.build_dev_cache_router``)."""
        app.include_router(build_dev_cache_router(api_router.router, api_router.engine_client))

    attach_router.__module__ = __name__
    # register_vllm_dev_api_routers() imports attach_router from the module when the
    # server builds its app (VLLM_SERVER_DEV_MODE=1), after plugins are loaded.
    patcher.set_attr(api_router, "attach_router", attach_router)


# -- apply -------------------------------------------------------------------------------
def _owner(path: str) -> type:
    module, _, qualname = path.partition(":")
    return getattr(importlib.import_module(module), qualname)


def apply(patcher: Any) -> None:
    """Add the reorder API at every layer of :data:`LAYERS` (vLLM 0.30.0–0.34.0; see the
    module docstring).

    Args:
        patcher: the :class:`kvpool.patching.Patcher` of the running ``install()``.

    Raises:
        MissingPatchTargetError: a class below ``EngineClient`` defines no
            ``reset_prefix_cache`` to extend (an untested vLLM release).
    """
    global _ALL_ENGINE_UTILITY_CALL
    _ALL_ENGINE_UTILITY_CALL = release_traits().all_engine_utility_call
    owners = [_owner(layer.owner) for layer in LAYERS]  # every import before any change
    for layer, owner in zip(LAYERS, owners):
        for name, method in _methods(layer, owner).items():
            patcher.set_attr(owner, name, method)
    _patch_dev_cache_router(patcher)


__all__ = ["LAYERS", "REORDER_ROUTE", "RESET_ROUTE", "Layer", "apply", "build_dev_cache_router",
           "coordinator_block_pools"]
