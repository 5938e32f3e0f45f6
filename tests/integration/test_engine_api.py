"""The free-queue reorder API at every layer of vLLM 0.33.0 (``kvpool.patches.engine_api``).

How real each layer is (see also docs/reorder-api.md):

* coordinator / ``KVCacheManager``: vLLM's own classes (unitary, full + sliding-window
  hybrid, HiSparse with a second host pool), kvpool's pools.
* ``Scheduler``: vLLM's, built as vLLM's ``create_scheduler`` builds it; requests
  run through ``schedule()`` / ``update_from_output()`` with a scripted model output.
* ``EngineCore`` + ``InprocClient``: a real ``EngineCore`` built in this process by
  vLLM's ``InprocClient`` over :class:`tests.support.scripted_engine.ScriptedExecutor` (no model).
* ``SyncMPClient`` / ``AsyncMPClient``: vLLM's clients start a real engine-core
  process (spawn) through ``launch_core_engines``; kvpool gets there only through the
  ``vllm.general_plugins`` entry point, and the reorder runs through vLLM's
  ``call_utility`` dispatch in that process.
* ``LLMEngine`` / ``AsyncLLM`` / ``LLM``: vLLM's classes made with ``object.__new__``
  (their constructors load a tokenizer and model) around the real clients above.
* HTTP: vLLM's ``register_vllm_dev_api_routers`` on a FastAPI app, served in-process
  (httpx ASGI transport) with ``AsyncLLM`` over the real engine-core process, and with
  a recording fake engine client.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
from contextlib import contextmanager

import pytest

from kvpool.cpu_platform import cpu_environment  # noqa: E402

cpu_environment(os.environ)

from kvpool import patching  # noqa: E402
from kvpool.block_pool import REORDER_ON_RESET_ENV  # noqa: E402
from tests.support.scripted_engine import (  # noqa: E402
    BLOCK_SIZE,
    ScriptedExecutor,
    make_engine_core_client,
    make_engine_core_request,
    make_request,
    make_scheduler,
    make_vllm_config,
    scripted_output,
)

REORDER = "reset_free_block_queue_order"
TOKEN_SPAN = 40_000  # prompt token ids stay inside opt-125m's vocabulary


# -- fixtures ----------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def kvpool_installed():
    """kvpool installed for each test (conftest uninstalls it after every test).

    Module-scoped engines are set up before this runs and install kvpool themselves
    before building their pools."""
    patching.install()
    yield


@pytest.fixture(autouse=True)
def no_env_switch(monkeypatch):
    monkeypatch.delenv(REORDER_ON_RESET_ENV, raising=False)


def _vllm_envs_uncached() -> None:
    # EngineCore.__init__ turns vLLM's env cache on for the process; tests that set
    # VLLM_* variables afterwards need it off.
    import vllm.envs

    vllm.envs.disable_envs_cache()


# -- helpers -----------------------------------------------------------------------------
_prompt_counter = iter(range(1, 10_000))


def fresh_prompt(num_tokens: int) -> list[int]:
    """Token ids no other prompt of this module shares (no prefix-cache hits)."""
    base = (next(_prompt_counter) * 997) % TOKEN_SPAN
    return [100 + (base + i) % TOKEN_SPAN for i in range(num_tokens)]


def canonical(num_blocks: int) -> list[int]:
    return list(range(1, num_blocks))


def free_ids(pool) -> list[int]:
    return pool.free_block_queue.free_block_ids()


def run_scheduler(scheduler, requests, *, max_steps: int = 500) -> dict[str, list[int]]:
    """Run ``requests`` to completion; return each request's first block table."""
    for req in requests:
        scheduler.add_request(req)
    tables: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return tables
        so = scheduler.schedule()
        for new in so.scheduled_new_reqs:
            tables.setdefault(new.req_id, list(new.block_ids[0]))
        scheduler.update_from_output(so, scripted_output(so))
    raise AssertionError("requests did not finish")


def scramble_round(prefix: str) -> list:
    """Four requests of 10 prompt blocks that finish in the order B, D, C, A: together
    they use 44 of a 48-block pool and leave the free queue out of id order."""
    return [
        make_request(f"{prefix}-{name}", fresh_prompt(10 * BLOCK_SIZE), max_tokens=n)
        for name, n in zip("ABCD", (12, 3, 9, 6))
    ]


def scrambled_scheduler(num_blocks: int = 48, kv_cache_groups=None):
    scheduler = make_scheduler(make_vllm_config(num_blocks), kv_cache_groups, num_blocks)
    run_scheduler(scheduler, scramble_round("warm"))
    pool = scheduler.kv_cache_manager.block_pool
    assert free_ids(pool) != canonical(num_blocks), "precondition: the round scrambles the free queue"
    return scheduler, pool


def next_prompt_table(scheduler, num_prompt_blocks: int = 4) -> list[int]:
    req = make_request(
        f"probe-{next(_prompt_counter)}", fresh_prompt(num_prompt_blocks * BLOCK_SIZE), max_tokens=1
    )
    return run_scheduler(scheduler, [req])[req.request_id][:num_prompt_blocks]


def start_running_request(scheduler):
    """Schedule one long request for one step: it holds its prompt blocks."""
    req = make_request(f"running-{next(_prompt_counter)}", fresh_prompt(3 * BLOCK_SIZE), max_tokens=40)
    scheduler.add_request(req)
    so = scheduler.schedule()
    scheduler.update_from_output(so, scripted_output(so))
    assert scheduler.running, "precondition: the request is running"
    return req


def finish(scheduler) -> None:
    run_scheduler(scheduler, [])


# -- KVCacheCoordinator / KVCacheManager -------------------------------------------------
def _full_spec():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _manager(kv_cache_groups, num_blocks: int = 32, enable_caching: bool = True, **config_kwargs):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig

    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups, **config_kwargs)
    return KVCacheManager(
        config,
        max_model_len=256,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=enable_caching,
    )


def _scramble_pool(pool, rng: random.Random) -> None:
    blocks = pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    rng.shuffle(blocks)
    pool.free_blocks(blocks)
    assert free_ids(pool) != canonical(pool.num_gpu_blocks)


def test_unitary_coordinator_reorder_restores_block_id_order():
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvpool.patches.engine_api import coordinator_block_pools

    manager = _manager([KVCacheGroupSpec(["layer"], _full_spec())])
    assert type(manager.coordinator) is UnitaryKVCacheCoordinator
    pool = manager.block_pool
    assert coordinator_block_pools(manager.coordinator) == [pool]
    _scramble_pool(pool, random.Random(0))

    assert manager.coordinator.reset_free_block_queue_order() is True
    assert free_ids(pool) == canonical(32)
    assert [b.block_id for b in pool.get_new_blocks(5)] == [1, 2, 3, 4, 5]


def test_full_plus_sliding_window_hybrid_shares_one_pool_and_reorders_it():
    import torch
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    from kvpool.patches.engine_api import coordinator_block_pools

    swa = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=2 * BLOCK_SIZE
    )
    manager = _manager([KVCacheGroupSpec(["full"], _full_spec()), KVCacheGroupSpec(["swa"], swa)])
    coordinator = manager.coordinator
    assert type(coordinator) is HybridKVCacheCoordinator
    # vLLM 0.33.0: both groups allocate from the coordinator's single pool.
    assert len(coordinator.single_type_managers) == 2
    assert coordinator_block_pools(coordinator) == [manager.block_pool]
    _scramble_pool(manager.block_pool, random.Random(1))

    assert manager.reset_free_block_queue_order() is True
    assert free_ids(manager.block_pool) == canonical(32)


def _hisparse_manager():
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec, KVCacheGroupRole, KVCacheGroupSpec

    bs = BLOCK_SIZE
    # The group layout of vLLM 0.33.0's tests/v1/core/test_prefix_caching.py
    # make_hisparse_kv_cache_config: the source group moves to a private host pool.
    groups = [
        KVCacheGroupSpec(["source"], _full_spec(), role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        KVCacheGroupSpec(["indexer"], _full_spec(), role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=bs, page_size=bs * 4)),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=bs, page_size=bs * 4, blocks_per_request=2)),
    ]
    manager = _manager(groups, num_blocks=32, enable_caching=False, hisparse_host_num_blocks=16)
    get_hisparse_coordinator(manager)
    return manager


def test_hisparse_coordinator_reorders_device_and_host_pools():
    from kvpool.patches.engine_api import coordinator_block_pools

    manager = _hisparse_manager()
    device, host = coordinator_block_pools(manager.coordinator)
    assert (device.num_gpu_blocks, host.num_gpu_blocks) == (32, 16)
    rng = random.Random(2)
    _scramble_pool(device, rng)
    _scramble_pool(host, rng)

    assert manager.reset_free_block_queue_order() is True
    assert free_ids(device) == canonical(32)
    assert free_ids(host) == canonical(16)


def test_coordinator_refuses_without_touching_any_pool_while_one_pool_holds_a_block():
    from kvpool.patches.engine_api import coordinator_block_pools

    manager = _hisparse_manager()
    device, host = coordinator_block_pools(manager.coordinator)
    rng = random.Random(3)
    _scramble_pool(device, rng)
    _scramble_pool(host, rng)
    held = host.get_new_blocks(1)
    device_before, host_before = free_ids(device), free_ids(host)

    assert manager.coordinator.reset_free_block_queue_order() is False
    assert manager.reset_free_block_queue_order() is False
    assert free_ids(device) == device_before, "the idle pool must not be reordered on refusal"
    assert free_ids(host) == host_before

    host.free_blocks(held)
    assert manager.reset_free_block_queue_order() is True
    assert free_ids(device) == canonical(32)
    assert free_ids(host) == canonical(16)


def test_coordinator_refuses_to_reorder_a_pool_built_before_install():
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    manager = _manager([KVCacheGroupSpec(["layer"], _full_spec())])
    vllm_pool = patching.vanilla_classes()["BlockPool"](num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    manager.coordinator.single_type_managers[0].block_pool = vllm_pool
    with pytest.raises(TypeError, match="before kvpool.install"):
        manager.coordinator.reset_free_block_queue_order()


def test_manager_reset_prefix_cache_reorders_only_with_the_flag():
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    manager = _manager([KVCacheGroupSpec(["layer"], _full_spec())])
    pool = manager.block_pool
    _scramble_pool(pool, random.Random(4))
    scrambled = free_ids(pool)

    assert manager.reset_prefix_cache() is True
    assert free_ids(pool) == scrambled
    assert manager.coordinator.reset_prefix_cache(reorder_free_queue=True) is True
    assert free_ids(pool) == canonical(32)
    _scramble_pool(pool, random.Random(5))
    assert manager.reset_prefix_cache(reorder_free_queue=True) is True
    assert free_ids(pool) == canonical(32)


# -- Scheduler ---------------------------------------------------------------------------
def test_scheduler_reorder_gives_the_next_prompt_contiguous_blocks():
    scheduler, pool = scrambled_scheduler()
    cached_before = len(pool.cached_block_hash_to_block)

    assert scheduler.reset_free_block_queue_order() is True
    assert free_ids(pool) == canonical(48)
    # Option A keeps the prefix cache.
    assert len(pool.cached_block_hash_to_block) == cached_before > 0
    assert next_prompt_table(scheduler) == [1, 2, 3, 4]


def test_scheduler_prompt_blocks_stay_scattered_without_a_reorder():
    scheduler, _ = scrambled_scheduler()
    assert next_prompt_table(scheduler) != [1, 2, 3, 4]


def test_scheduler_refuses_while_a_request_runs_and_changes_nothing():
    scheduler, pool = scrambled_scheduler()
    start_running_request(scheduler)
    before = free_ids(pool)

    assert scheduler.reset_free_block_queue_order() is False
    assert scheduler.reset_prefix_cache(reorder_free_queue=True) is False
    assert free_ids(pool) == before

    finish(scheduler)
    assert scheduler.reset_free_block_queue_order() is True
    assert free_ids(pool) == canonical(48)


def test_scheduler_reset_prefix_cache_flag_resets_and_reorders():
    scheduler, pool = scrambled_scheduler()
    assert scheduler.reset_prefix_cache(reorder_free_queue=True) is True
    assert free_ids(pool) == canonical(48)
    assert len(pool.cached_block_hash_to_block) == 0
    assert next_prompt_table(scheduler) == [1, 2, 3, 4]


def test_scheduler_reset_prefix_cache_without_flag_keeps_vllm_semantics():
    scheduler, pool = scrambled_scheduler()
    before = free_ids(pool)
    assert scheduler.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0
    assert free_ids(pool) == before


def test_scheduler_reset_running_requests_then_reorders():
    scheduler, pool = scrambled_scheduler()
    start_running_request(scheduler)
    assert scheduler.reset_prefix_cache(reset_running_requests=True, reorder_free_queue=True) is True
    assert not scheduler.running
    assert free_ids(pool) == canonical(48)


def test_env_switch_makes_a_plain_scheduler_reset_reorder(monkeypatch):
    scheduler, pool = scrambled_scheduler()
    monkeypatch.setenv(REORDER_ON_RESET_ENV, "1")
    assert scheduler.reset_prefix_cache() is True
    assert free_ids(pool) == canonical(48)


def test_scheduler_interface_default_raises_and_subclasses_inherit():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.core.sched.scheduler import Scheduler

    with pytest.raises(NotImplementedError):
        SchedulerInterface.reset_free_block_queue_order(object())
    assert SchedulerInterface.reset_prefix_cache.__isabstractmethod__
    assert "reorder_free_queue" in inspect.signature(SchedulerInterface.reset_prefix_cache).parameters
    assert AsyncScheduler.reset_free_block_queue_order is Scheduler.reset_free_block_queue_order
    assert AsyncScheduler.reset_prefix_cache is Scheduler.reset_prefix_cache


# -- EngineCore and InprocClient (a real EngineCore in this process) ---------------------
@pytest.fixture(scope="module")
def inproc_client():
    from vllm.v1.engine.core_client import InprocClient

    patching.install()
    client = make_engine_core_client(multiprocess_mode=False)
    assert type(client) is InprocClient
    yield client
    client.shutdown()
    _vllm_envs_uncached()


def run_client_round(client, requests) -> dict[str, list[int]]:
    """Send ``requests`` through a sync engine-core client and wait until all finished;
    return their block tables as the engine core's scheduler handed them out."""
    for req in requests:
        client.add_request(req)
    pending = {r.request_id for r in requests}
    while pending:
        for out in client.get_output().outputs:
            if out.finished:
                pending.discard(out.request_id)
    return {r.request_id: block_table(client, r.request_id) for r in requests}


def block_table(client, request_id: str) -> list[int]:
    # vLLM's collective_rpc utility reaches the ScriptedExecutor's worker.
    if hasattr(client, "call_utility"):
        (table,) = client.call_utility("collective_rpc", "block_table", None, (request_id,), None)
    else:
        (table,) = client.engine_core.collective_rpc("block_table", args=(request_id,))
    return table


def client_scramble(client) -> None:
    run_client_round(
        client,
        [
            make_engine_core_request(fresh_prompt(10 * BLOCK_SIZE), max_tokens=n)
            for n in (12, 3, 9, 6)
        ],
    )


def client_probe(client, num_prompt_blocks: int = 4) -> list[int]:
    req = make_engine_core_request(fresh_prompt(num_prompt_blocks * BLOCK_SIZE), max_tokens=1)
    return run_client_round(client, [req])[req.request_id][:num_prompt_blocks]


def start_client_request(client):
    """Add a long request and wait for its first token: it then holds blocks."""
    req = make_engine_core_request(fresh_prompt(3 * BLOCK_SIZE), max_tokens=400)
    client.add_request(req)
    while not any(o.request_id == req.request_id for o in client.get_output().outputs):
        pass
    return req


def abort_and_drain(client, req) -> None:
    client.abort_requests([req.request_id])
    if hasattr(client, "engine_core"):  # InprocClient: outputs only come from stepping
        while client.engine_core.scheduler.has_requests():
            client.get_output()
        return
    # The abort is processed before the next step; a utility call after it is answered
    # in order, once the request's blocks are freed.
    client.call_utility("get_supported_tasks")


def _llm_over(client):
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = object.__new__(LLMEngine)
    engine.engine_core = client
    llm = object.__new__(LLM)
    llm.llm_engine = engine
    return llm


def assert_each_layer_reorders(client, reorders) -> None:
    """Each of ``reorders`` (layers' ``reset_free_block_queue_order`` over ``client``)
    restores block-id order of the scrambled free queue behind ``client``."""
    for reorder in reorders:
        client_scramble(client)
        assert reorder() is True
        assert client_probe(client) == [1, 2, 3, 4]


def assert_llm_reset_prefix_cache_reorders_only_with_the_flag(client) -> None:
    """``LLM.reset_prefix_cache()`` over ``client`` leaves the free queue scrambled;
    with ``reorder_free_queue=True`` it restores block-id order."""
    llm = _llm_over(client)
    client_scramble(client)
    assert llm.reset_prefix_cache() is True
    assert client_probe(client) != [1, 2, 3, 4]
    client_scramble(client)
    assert llm.reset_prefix_cache(reorder_free_queue=True) is True
    assert client_probe(client) == [1, 2, 3, 4]


def test_engine_core_reorder_reaches_the_scheduler_pools(inproc_client):
    engine_core = inproc_client.engine_core
    client_scramble(inproc_client)
    assert client_probe(inproc_client) != [1, 2, 3, 4]
    assert engine_core.reset_free_block_queue_order() is True
    assert client_probe(inproc_client) == [1, 2, 3, 4]


def test_inproc_client_llm_engine_and_llm_reorder(inproc_client):
    llm = _llm_over(inproc_client)
    assert_each_layer_reorders(inproc_client, (inproc_client.reset_free_block_queue_order,
                                               llm.llm_engine.reset_free_block_queue_order,
                                               llm.reset_free_block_queue_order))


def test_inproc_layers_refuse_while_a_request_holds_blocks(inproc_client):
    llm = _llm_over(inproc_client)
    client_scramble(inproc_client)
    pool = inproc_client.engine_core.scheduler.kv_cache_manager.block_pool
    req = start_client_request(inproc_client)
    before = free_ids(pool)
    calls = {
        "EngineCore": inproc_client.engine_core.reset_free_block_queue_order,
        "InprocClient": inproc_client.reset_free_block_queue_order,
        "LLMEngine": llm.llm_engine.reset_free_block_queue_order,
        "LLM": llm.reset_free_block_queue_order,
        "LLM.reset_prefix_cache(reorder_free_queue=True)": lambda: llm.reset_prefix_cache(reorder_free_queue=True),
    }
    assert {name: call() for name, call in calls.items()} == dict.fromkeys(calls, False)
    assert free_ids(pool) == before
    abort_and_drain(inproc_client, req)
    assert llm.reset_free_block_queue_order() is True


def test_llm_reset_prefix_cache_flag_reorders_in_process(inproc_client):
    assert_llm_reset_prefix_cache_reorders_only_with_the_flag(inproc_client)


# -- SyncMPClient: a real engine-core process --------------------------------------------
@contextmanager
def engine_core_process_env():
    """The environment while vLLM starts an engine-core process (restored after): spawn,
    so the process imports vLLM afresh and gets kvpool only from the plugin entry point;
    the plugin neither disabled nor filtered out; no reorder switch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        mp.delenv("KVPOOL_DISABLE", raising=False)
        mp.delenv("VLLM_PLUGINS", raising=False)
        mp.delenv(REORDER_ON_RESET_ENV, raising=False)
        _vllm_envs_uncached()
        yield


@pytest.fixture(scope="module")
def mp_client():
    """vLLM's SyncMPClient with its engine-core process spawned by vLLM (spawn, so
    the process imports vLLM afresh and gets kvpool only from the plugin entry point)."""
    from vllm.v1.engine.core_client import SyncMPClient

    with engine_core_process_env():
        client = make_engine_core_client(multiprocess_mode=True)
    assert type(client) is SyncMPClient
    yield client
    client.shutdown()


@pytest.mark.slow  # starts an engine-core process
def test_engine_core_process_runs_the_reorder_through_call_utility(mp_client):
    # The engine-core process is a fresh interpreter: the method exists there only if
    # the plugin installed kvpool before the utility call was dispatched.
    client_scramble(mp_client)
    assert client_probe(mp_client) != [1, 2, 3, 4]
    assert mp_client.call_utility(REORDER) is True
    assert client_probe(mp_client) == [1, 2, 3, 4]


@pytest.mark.slow  # starts an engine-core process
def test_llm_over_sync_mp_client_reorders_the_engine_core_process(mp_client):
    llm = _llm_over(mp_client)
    assert_each_layer_reorders(mp_client, (mp_client.reset_free_block_queue_order,
                                           llm.llm_engine.reset_free_block_queue_order,
                                           llm.reset_free_block_queue_order))


@pytest.mark.slow  # starts an engine-core process
def test_sync_mp_layers_refuse_while_a_request_holds_blocks(mp_client):
    llm = _llm_over(mp_client)
    client_scramble(mp_client)
    req = start_client_request(mp_client)
    assert mp_client.reset_free_block_queue_order() is False
    assert llm.reset_free_block_queue_order() is False
    assert llm.reset_prefix_cache(reorder_free_queue=True) is False
    abort_and_drain(mp_client, req)
    # The refusals changed nothing: the free queue is still scrambled.
    assert client_probe(mp_client) != [1, 2, 3, 4]


@pytest.mark.slow  # starts an engine-core process
def test_llm_reset_prefix_cache_flag_reorders_the_engine_core_process(mp_client):
    assert_llm_reset_prefix_cache_reorders_only_with_the_flag(mp_client)


@pytest.mark.slow  # starts an engine-core process
def test_env_switch_in_the_engine_core_process_makes_a_plain_reset_reorder(mp_client):
    set_env = lambda value: mp_client.call_utility(  # noqa: E731
        "collective_rpc", "set_environ", None, (REORDER_ON_RESET_ENV, value), None
    )
    set_env("1")
    try:
        client_scramble(mp_client)
        assert _llm_over(mp_client).reset_prefix_cache() is True
        assert client_probe(mp_client) == [1, 2, 3, 4]
    finally:
        set_env(None)


def test_flag_off_sends_vllm_two_argument_utility_call():
    # An engine core without kvpool still accepts every default call.
    from vllm.v1.engine.core_client import SyncMPClient

    sent = []
    client = object.__new__(SyncMPClient)
    client.call_utility = lambda method, *args: sent.append((method, *args)) or True
    client.reset_prefix_cache()
    client.reset_prefix_cache(True, False)
    client.reset_prefix_cache(reorder_free_queue=True)
    assert sent == [
        ("reset_prefix_cache", False, False),
        ("reset_prefix_cache", True, False),
        ("reset_prefix_cache", False, False, True),
    ]


# -- AsyncMPClient / AsyncLLM / HTTP: a real engine-core process -------------------------
class AsyncEngine:
    """An AsyncMPClient (and AsyncLLM over it) living on one event loop."""

    def __init__(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.core_client import AsyncMPClient, EngineCoreClient

        self.loop = asyncio.new_event_loop()

        async def make():
            return EngineCoreClient.make_async_mp_client(
                vllm_config=make_vllm_config(48),
                executor_class=ScriptedExecutor,
                log_stats=False,
            )

        self.client = self.run(make())
        assert type(self.client) is AsyncMPClient
        self.llm = object.__new__(AsyncLLM)
        self.llm.engine_core = self.client

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def round(self, requests) -> dict[str, list[int]]:
        for req in requests:
            await self.client.add_request_async(req)
        pending = {r.request_id for r in requests}
        while pending:
            for out in (await self.client.get_output_async()).outputs:
                if out.finished:
                    pending.discard(out.request_id)
        tables = {}
        for r in requests:
            (table,) = await self.client.call_utility_async(
                "collective_rpc", "block_table", None, (r.request_id,), None)
            tables[r.request_id] = table
        return tables

    def scramble(self) -> None:
        reqs = [make_engine_core_request(fresh_prompt(10 * BLOCK_SIZE), max_tokens=n) for n in (12, 3, 9, 6)]
        self.run(self.round(reqs))

    def probe(self, num_prompt_blocks: int = 4) -> list[int]:
        req = make_engine_core_request(fresh_prompt(num_prompt_blocks * BLOCK_SIZE), max_tokens=1)
        return self.run(self.round([req]))[req.request_id][:num_prompt_blocks]

    def start_request(self):
        req = make_engine_core_request(fresh_prompt(3 * BLOCK_SIZE), max_tokens=400)

        async def go():
            await self.client.add_request_async(req)
            while not any(o.request_id == req.request_id for o in (await self.client.get_output_async()).outputs):
                pass

        self.run(go())
        return req

    def abort(self, req) -> None:
        async def go():
            await self.client.abort_requests_async([req.request_id])
            await self.client.call_utility_async("get_supported_tasks")

        self.run(go())

    def close(self) -> None:
        async def shutdown():
            # Inside the loop, as a server shuts AsyncLLM down: the client then closes
            # its sockets and cancels its output task at once (from outside it only
            # schedules that on the loop, and a later gc of the ZMQ context hangs).
            self.client.shutdown()
            await asyncio.sleep(0)

        self.run(shutdown())
        self.loop.close()


@pytest.fixture(scope="module")
def async_engine():
    with engine_core_process_env():
        engine = AsyncEngine()
    yield engine
    engine.close()


@pytest.mark.slow  # starts an engine-core process
def test_async_llm_and_async_mp_client_reorder_the_engine_core_process(async_engine):
    for reorder in (async_engine.client.reset_free_block_queue_order_async,
                    async_engine.llm.reset_free_block_queue_order):
        async_engine.scramble()
        assert async_engine.probe() != [1, 2, 3, 4]
        async_engine.scramble()
        assert async_engine.run(reorder()) is True
        assert async_engine.probe() == [1, 2, 3, 4]


@pytest.mark.slow  # starts an engine-core process
def test_async_layers_refuse_while_a_request_holds_blocks(async_engine):
    async_engine.scramble()
    req = async_engine.start_request()
    assert async_engine.run(async_engine.client.reset_free_block_queue_order_async()) is False
    assert async_engine.run(async_engine.llm.reset_free_block_queue_order()) is False
    assert async_engine.run(async_engine.llm.reset_prefix_cache(reorder_free_queue=True)) is False
    async_engine.abort(req)
    assert async_engine.probe() != [1, 2, 3, 4]


@pytest.mark.slow  # starts an engine-core process
def test_async_llm_reset_prefix_cache_flag_reorders(async_engine):
    async_engine.scramble()
    assert async_engine.run(async_engine.llm.reset_prefix_cache()) is True
    assert async_engine.probe() != [1, 2, 3, 4]
    async_engine.scramble()
    assert async_engine.run(async_engine.llm.reset_prefix_cache(reorder_free_queue=True)) is True
    assert async_engine.probe() == [1, 2, 3, 4]


def _dev_app(engine_client):
    from fastapi import FastAPI
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    # What vLLM's register_api_routers calls when VLLM_SERVER_DEV_MODE=1.
    app = FastAPI()
    register_vllm_dev_api_routers(app)
    app.state.engine_client = engine_client
    return app


@pytest.mark.slow  # starts an engine-core process
def test_http_routes_reorder_the_engine_core_process(async_engine):
    import httpx

    app = _dev_app(async_engine.llm)

    async def post(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dev") as http:
            return await http.post(path)

    async_engine.scramble()
    resp = async_engine.run(post("/reset_free_block_queue_order"))
    assert (resp.status_code, resp.json()) == (200, {"success": True})
    assert async_engine.probe() == [1, 2, 3, 4]

    async_engine.scramble()
    resp = async_engine.run(post("/reset_prefix_cache?reorder_free_queue=true"))
    assert (resp.status_code, resp.json()) == (200, {"success": True})
    assert async_engine.probe() == [1, 2, 3, 4]

    req = async_engine.start_request()
    resp = async_engine.run(post("/reset_free_block_queue_order"))
    assert (resp.status_code, resp.json()) == (200, {"success": False})
    async_engine.abort(req)


class RecordingEngineClient:
    """Stands in for AsyncLLM behind the HTTP routes; records each call."""

    def __init__(self, result: bool = True) -> None:
        self.calls: list[tuple] = []
        self.result = result

    async def reset_prefix_cache(self, *args, **kwargs):
        self.calls.append(("reset_prefix_cache", args, kwargs))
        return self.result

    async def reset_free_block_queue_order(self):
        self.calls.append((REORDER, (), {}))
        return self.result

    async def reset_mm_cache(self):
        self.calls.append(("reset_mm_cache", (), {}))


def test_http_reset_route_passes_the_reorder_flag_only_when_set():
    from fastapi.testclient import TestClient

    engine_client = RecordingEngineClient()
    http = TestClient(_dev_app(engine_client))
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert http.post("/reset_prefix_cache?reset_external=true&reorder_free_queue=true").json() == {"success": True}
    assert http.post("/reset_free_block_queue_order").json() == {"success": True}
    assert http.post("/reset_mm_cache").status_code == 200  # vLLM's other cache routes stay
    assert engine_client.calls == [
        ("reset_prefix_cache", (False, False), {}),
        ("reset_prefix_cache", (False, True), {"reorder_free_queue": True}),
        (REORDER, (), {}),
        ("reset_mm_cache", (), {}),
    ]
    paths = [r.path for r in http.app.routes]
    assert paths.count("/reset_prefix_cache") == 1


def test_http_reorder_route_reports_refusal_and_missing_support():
    from fastapi.testclient import TestClient

    assert TestClient(_dev_app(RecordingEngineClient(result=False))).post(
        "/reset_free_block_queue_order"
    ).json() == {"success": False}

    class OldEngineClient:
        async def reset_free_block_queue_order(self):
            raise NotImplementedError

    resp = TestClient(_dev_app(OldEngineClient())).post("/reset_free_block_queue_order")
    assert resp.status_code == 501


# -- data-parallel clients ---------------------------------------------------------------
@pytest.mark.parametrize("cls_name", ["AsyncMPClient", "DPAsyncMPClient", "DPLBAsyncMPClient"])
def test_async_clients_report_true_only_if_every_engine_reordered(cls_name):
    from vllm.v1.engine import core_client

    cls = getattr(core_client, cls_name)
    sent = []
    client = object.__new__(cls)
    results = {}
    engines = [b"engine-0", b"engine-1"]

    # One utility call per engine, as vLLM's clients send them; call_utility_all_async
    # (vLLM >= 0.32.0) is the same fan-out, which kvpool does itself before 0.32.0.
    async def _call_utility_async(method, *args, engine):
        sent.append((engine, method, *args))
        return results[method][engines.index(engine)]

    async def call_utility_all_async(method, *args):
        return [await _call_utility_async(method, *args, engine=e) for e in engines]

    client.core_engines = engines
    client._call_utility_async = _call_utility_async
    client.call_utility_all_async = call_utility_all_async
    results.update({REORDER: [True, False], "reset_prefix_cache": [True, True]})
    assert asyncio.run(client.reset_free_block_queue_order_async()) is False
    results[REORDER] = [True, True]
    assert asyncio.run(client.reset_free_block_queue_order_async()) is True
    assert asyncio.run(client.reset_prefix_cache_async(reorder_free_queue=True)) is True
    assert sorted(sent[-2:]) == [(e, "reset_prefix_cache", False, False, True) for e in engines]


# -- install / uninstall -----------------------------------------------------------------
def _owners():
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

    sync = [KVCacheCoordinator, KVCacheManager, SchedulerInterface, Scheduler, EngineCore,
            core_client.EngineCoreClient, core_client.InprocClient, core_client.SyncMPClient, LLMEngine, LLM]
    asynchronous = [core_client.EngineCoreClient, core_client.AsyncMPClient]
    return sync, asynchronous, [AsyncLLM, EngineClient]


def test_every_layer_has_both_options_while_installed():
    sync, asynchronous, async_front = _owners()
    for owner in sync:
        assert REORDER in owner.__dict__, owner
        assert "reorder_free_queue" in inspect.signature(owner.__dict__["reset_prefix_cache"]).parameters, owner
    for owner in asynchronous:
        assert inspect.iscoroutinefunction(owner.__dict__[REORDER + "_async"]), owner
        assert "reorder_free_queue" in inspect.signature(owner.__dict__["reset_prefix_cache_async"]).parameters
    for owner in async_front:
        assert inspect.iscoroutinefunction(owner.__dict__[REORDER]), owner
        assert "reorder_free_queue" in inspect.signature(owner.__dict__["reset_prefix_cache"]).parameters


def test_uninstall_removes_the_api_and_restores_vllm_methods():
    from fastapi.testclient import TestClient

    sync, asynchronous, async_front = _owners()
    installed = {o: dict(o.__dict__) for o in {*sync, *asynchronous, *async_front}}
    assert patching.uninstall() is True
    try:
        for owner in {*sync, *asynchronous, *async_front}:
            for name in (REORDER, REORDER + "_async"):
                assert name not in owner.__dict__, (owner, name)
            for name in ("reset_prefix_cache", "reset_prefix_cache_async"):
                fn = owner.__dict__.get(name)
                if fn is not None:
                    assert fn is not installed[owner][name]
                    assert "reorder_free_queue" not in inspect.signature(fn).parameters, (owner, name)
        http = TestClient(_dev_app(RecordingEngineClient()))
        assert http.post("/reset_free_block_queue_order").status_code == 404
    finally:
        assert patching.install() is True
    assert REORDER in sync[-1].__dict__


def test_help_shows_each_layers_own_docstring_on_the_vllm_class():
    import pydoc

    from kvpool.patches.engine_api import LAYERS, _owner

    for layer in LAYERS:
        owner = _owner(layer.owner)
        names = (REORDER + layer.suffix, "reset_prefix_cache" + layer.suffix)
        for name, doc in zip(names, (layer.reorder_doc, layer.reset_doc)):
            method = owner.__dict__[name]
            assert method.__qualname__ == f"{owner.__qualname__}.{name}"
            shown = pydoc.render_doc(method, renderer=pydoc.plaintext)
            assert inspect.cleandoc(doc).splitlines()[0] in shown, (owner, name)
            assert "Returns:" in shown, (owner, name)
