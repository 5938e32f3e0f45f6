"""vLLM's CPU offloading (``SimpleCPUOffloadConnector``) on kvpool's pools: the CPU tier
and the GPU prefix cache get vLLM's stores and hits, or the combination is refused.

Driven through the installed vLLM's own offloading code (0.33.0 and 0.34.0): the
scheduler-side manager (``vllm.v1.simple_kv_offload.manager.SimpleCPUOffloadScheduler``)
on a ``BlockPool``, built as vLLM's ``tests/v1/simple_kv_offload/test_scheduler.py``
builds it, and vLLM's ``Scheduler`` with the connector configured as a user configures
it (``kv_connector_extra_config={"lazy_offload": ...}``), the worker's completions
reported back as the worker reports them.

The lazy offloader walks the GPU free queue, so what it stores and what the GPU keeps
cached depend on the free queue's order, uncached blocks included: up to vLLM 0.33.0 it
walks from a saved cursor (``iter_blocks_after(cursor)``; the cursor and idle cases);
from 0.34.0 from the head, and it returns the stored blocks with
``free_blocks(..., evict_first=True)`` to the front, next to be evicted (the front
cases). The contiguous policy and ``KVPOOL_REORDER_ON_IDLE=1`` order the front of the
queue otherwise and are refused when the offloader binds the pool
(``kvpool.patches.lazy_offload``). The eager offloader stores from block tables and
gets vLLM's stores and hits under every policy.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvpool
from kvpool.patches.lazy_offload import LazyOffloadOrderError
from kvpool.vllm_compat import release_traits

# vLLM's modules are imported here, once, rather than first inside a helper: the first
# import of some of them (vllm.multimodal.inputs, through vllm.v1.core.kv_cache_utils)
# keeps the importing call's frames alive, and with them a helper's vLLM-built pools,
# which install() then refuses (PoolsBuiltBeforeInstallError) for the rest of the run.
import vllm.v1.core.block_pool  # noqa: E402,F401  isort: skip
import vllm.v1.core.sched.scheduler  # noqa: E402,F401  isort: skip
import vllm.v1.simple_kv_offload.manager  # noqa: E402,F401  isort: skip

#: vLLM >= 0.34.0: the lazy offloader walks from the free queue's head and returns its
#: stores with ``free_blocks(..., evict_first=True)`` (the front cases apply).
EVICT_FIRST = release_traits().free_blocks_evict_first

BS = 16  # tokens per block
MAX_BATCHED = 64  # the lazy offloader's target: 2 * cdiv(64, 16) = 8 free blocks per step

# -- building vLLM's offloader -------------------------------------------------------------


def _vllm_config(lazy: bool | None = None, num_cpu_blocks: int | None = None):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    extra = {}
    if lazy is not None:
        extra = {"lazy_offload": lazy, "num_cpu_blocks": num_cpu_blocks, "cpu_bytes_to_use_per_rank": 1 << 30}
    return VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0, skip_tokenizer_init=True,
                                 max_model_len=2048),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=MAX_BATCHED, max_model_len=2048,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))


def _kv_cache_config(num_blocks: int):
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float16)
    page = spec.page_size_bytes
    register_all_kvcache_specs(vllm_config=None)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=["layer0"], layer_stride=page * num_blocks,
                                        block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])


def _offloader(lazy: bool, num_gpu_blocks: int = 32, num_cpu_blocks: int = 16, bind=None):
    """vLLM's scheduler-side offload manager over a fresh GPU ``BlockPool`` (kvpool's
    when installed), bound with ``bind`` (default: vLLM's ``bind_gpu_block_pool``,
    kvpool's guard included when installed)."""
    from vllm.v1.core import block_pool
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    kv_cache_config = _kv_cache_config(num_gpu_blocks)
    page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    sched = SimpleCPUOffloadScheduler(vllm_config=_vllm_config(), kv_cache_config=kv_cache_config,
                                      cpu_capacity_bytes=page * num_cpu_blocks, scheduler_block_size=BS,
                                      hash_block_size=BS, lazy_offload=lazy)
    pool = block_pool.BlockPool(num_gpu_blocks=num_gpu_blocks, enable_caching=True, hash_block_size=BS)
    (bind or SimpleCPUOffloadScheduler.bind_gpu_block_pool)(sched, pool)
    assert sched.num_cpu_blocks == num_cpu_blocks
    return sched, pool


def _unguarded_bind(sched, pool):
    """vLLM's own ``bind_gpu_block_pool``, without kvpool's guard."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    method = SimpleCPUOffloadScheduler.bind_gpu_block_pool
    getattr(method, "__kvpool_wrapped__", method)(sched, pool)


def _request(request_id: str, seed: int, num_blocks: int):
    """``num_blocks`` full blocks + 1 token (so all full blocks can be hit)."""
    from kvpool.tools.replay.engine import block_hasher, make_request

    tokens = list(range(seed * 10000, seed * 10000 + num_blocks * BS + 1))
    return make_request(request_id, tokens, max_tokens=1, hasher=block_hasher(BS))


def _issue_stores(sched) -> tuple[list, int]:
    """One scheduler step of the offloader (no request scheduled): the stores it issues
    (the GPU blocks stay touched until the worker completes them). Returns the stored
    blocks' hashes and the store event (-1: none)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    output = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
                             scheduled_encoder_inputs={}, preempted_req_ids=set(), finished_req_ids=set(),
                             free_encoder_mm_hashes=[])
    meta = sched.build_connector_meta(output)
    return [sched._gpu_block_pool.blocks[b].block_hash for b in meta.store_gpu_blocks], meta.store_event


def _complete_stores(sched, event: int) -> None:
    """The worker reports store ``event`` complete (vLLM 0.34.0 then frees its GPU
    blocks with ``evict_first=True``; earlier releases to the LRU tail)."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    if event >= 0:
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
            completed_store_events={event: sched._expected_worker_count})))


def _step(sched) -> list:
    """One scheduler step of the offloader, its stores completed by the worker in the
    same step. Returns the stored blocks' hashes."""
    hashes, event = _issue_stores(sched)
    _complete_stores(sched, event)
    return hashes


def _cache(pool, request, blocks) -> None:
    pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=0, num_full_blocks=len(blocks),
                           block_size=BS, kv_cache_group_id=0)


def _evict_everything_and_ask_again(sched, pool, seed: int) -> int:
    """Fill the GPU (evicting every cached block), free it, and ask the CPU tier for
    the 3-block prompt of ``seed``: the hit tokens."""
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    hit, _ = sched.get_num_new_matched_tokens(_request("again", seed, 3), 0)
    return hit


def cursor_case(bind=None) -> dict:
    """The cursor case of issue 16: a 3-block prompt's cached blocks wait at the LRU
    front while the offloader's cursor sits among the uncached blocks; 20 uncached
    blocks with higher ids are freed after the cursor was saved. vLLM prepends them
    (before the cursor), so the next walk reaches the prompt's blocks and stores them;
    a sorted uncached segment puts them behind the cursor, where the walk spends its
    8 blocks."""
    sched, pool = _offloader(lazy=True, bind=bind)
    prompt = _request("prompt", 1, 3)
    filler = pool.get_new_blocks(28)
    blocks = pool.get_new_blocks(3)
    _cache(pool, prompt, blocks)
    pool.free_blocks(filler[:8])
    stores = [_step(sched)]  # covers the 8 free blocks: the cursor is the 8th
    pool.free_blocks(reversed(blocks))  # the prompt finishes (tail first, as vLLM frees)
    pool.free_blocks(filler[8:])
    stores.append(_step(sched))
    return {"stores": stores, "hit_tokens": _evict_everything_and_ask_again(sched, pool, 1)}


def idle_case(bind=None) -> dict:
    """The pool empties while the offloader's cursor sits among uncached blocks freed
    last-in first-out: vLLM keeps that order, ``KVPOOL_REORDER_ON_IDLE=1`` relinks the
    uncached blocks by id, which puts 7 more of them behind the cursor."""
    sched, pool = _offloader(lazy=True, bind=bind)
    held = pool.get_new_blocks(1)
    prompt = _request("prompt", 1, 3)
    blocks = pool.get_new_blocks(3)
    _cache(pool, prompt, blocks)
    pool.free_blocks(blocks)
    filler = pool.get_new_blocks(16)
    pool.free_blocks(reversed(filler))
    more = pool.get_new_blocks(4)
    stores = [_step(sched)]
    pool.free_blocks(reversed(more))
    pool.free_blocks(held)  # idle: only the null block is held
    stores += [_step(sched) for _ in range(3)]
    return {"stores": stores, "hit_tokens": _evict_everything_and_ask_again(sched, pool, 1)}


def _gpu_hit_tokens(pool, request) -> int:
    """The GPU prefix-cache hit of ``request`` (tokens): its leading block hashes that
    ``pool.get_cached_block`` (vLLM's lookup) finds."""
    hit = 0
    for block_hash in request.block_hashes:
        if pool.get_cached_block(block_hash, [0]) is None:
            break
        hit += BS
    return hit


def _front_setup(bind):
    """A pool where every block is held but 2 uncached ones and a finished 3-block
    prompt: the lazy walk from the head covers them all and stores the prompt's blocks
    (on 0.33.0 too, the cursor starting at the head). Returns ``(sched, pool, prompt,
    held)``; the prompt's blocks have ids 3-5, the uncached ones 1-2, the held 6-31."""
    sched, pool = _offloader(lazy=True, bind=bind)
    low = pool.get_new_blocks(2)
    prompt = _request("prompt", 1, 3)
    blocks = pool.get_new_blocks(3)
    _cache(pool, prompt, blocks)
    held = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks(reversed(blocks))  # the prompt finishes (tail first, as vLLM frees)
    pool.free_blocks(low)
    return sched, pool, prompt, held


def front_case(bind=None) -> dict:
    """The front case: the walk stores the prompt's 3 blocks; vLLM 0.34.0 returns them
    to the front (``evict_first=True``), so the next 2-block allocation evicts 2 of
    them (tail first). The contiguous order keeps the front sorted by id and serves the
    lowest ids: the 2 uncached blocks, the prompt staying cached on the GPU."""
    sched, pool, prompt, _held = _front_setup(bind)
    stores = [_step(sched)]
    pool.get_new_blocks(2)
    return {"stores": stores, "gpu_hit_tokens": _gpu_hit_tokens(pool, prompt)}


def front_idle_case(bind=None) -> dict:
    """The front case with the pool becoming idle when the stores complete: the held
    blocks are freed while the copy still holds the prompt's blocks, whose
    ``evict_first`` free is then the last one. vLLM keeps them at the front;
    ``KVPOOL_REORDER_ON_IDLE=1`` relinks the front by id, behind the 2 uncached blocks."""
    sched, pool, prompt, held = _front_setup(bind)
    hashes, event = _issue_stores(sched)
    pool.free_blocks(held)
    _complete_stores(sched, event)  # idle: only the null block is held
    pool.get_new_blocks(2)
    return {"stores": [hashes], "gpu_hit_tokens": _gpu_hit_tokens(pool, prompt)}


def front_early_case(bind=None) -> dict:
    """The prompt's blocks have the lowest ids (1-3): stored and returned to the front,
    then a request frees 2 uncached blocks (ids 30-31), which vLLM prepends before them.
    The next 2-block allocation: vLLM takes the uncached ones, the contiguous order the
    lowest ids, evicting the prompt's first 2 blocks sooner than vLLM."""
    sched, pool = _offloader(lazy=True, bind=bind)
    prompt = _request("prompt", 1, 3)
    blocks = pool.get_new_blocks(3)
    _cache(pool, prompt, blocks)
    held = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks(reversed(blocks))
    stores = [_step(sched)]
    pool.free_blocks(held[-2:])
    pool.get_new_blocks(2)
    return {"stores": stores, "gpu_hit_tokens": _gpu_hit_tokens(pool, prompt)}


def _summary(result: dict) -> dict:
    """A case's result with the stores as counts per step."""
    return {**result, "stores": [len(s) for s in result["stores"]]}


# What vLLM's own pool does in each case of this release (the test below checks it):
# the cases that show a policy's difference on this release, with vLLM's result.
if EVICT_FIRST:
    # The walk stores the prompt's 3 blocks at the first step; returned to the front,
    # 2 of them (the tail) are evicted by the next allocation: a 16-token GPU hit. In
    # the early case the allocation takes the freshly freed uncached blocks: 48.
    VLLM_RESULTS = {front_case: {"stores": [3], "gpu_hit_tokens": 16},
                    front_idle_case: {"stores": [3], "gpu_hit_tokens": 16},
                    front_early_case: {"stores": [3], "gpu_hit_tokens": 48}}
    # (mode, case, (vLLM's hit tokens, the policy's hit tokens past the guard))
    WHY_REFUSED = [("kvpool+contiguous", front_case, (16, 48)),
                   ("kvpool+contiguous", front_early_case, (48, 0)),
                   ("kvpool+reorder-on-idle", front_idle_case, (16, 48))]
    REFUSAL = r"other hits and evictions"
else:
    # The cursor case stores the prompt's 3 blocks at the second step and serves them
    # from the CPU tier (3 blocks of 16 tokens); the idle case stores its first one at
    # the third step.
    VLLM_RESULTS = {cursor_case: {"stores": [0, 3], "hit_tokens": 48},
                    idle_case: {"stores": [0, 0, 1, 0], "hit_tokens": 16}}
    WHY_REFUSED = [("kvpool+contiguous", cursor_case, (48, 0)),
                   ("kvpool+reorder-on-idle", idle_case, (16, 32))]
    REFUSAL = r"fewer hits"
ALL_CASES = [cursor_case, idle_case, front_case, front_idle_case, front_early_case]


# -- the modes -------------------------------------------------------------------------------

MODES = ["vanilla", "kvpool", "kvpool+contiguous", "kvpool+reorder-on-idle"]
REFUSED = {"kvpool+contiguous", "kvpool+reorder-on-idle"}


def _install(mode: str, monkeypatch) -> None:
    if mode == "kvpool":
        kvpool.install()
    elif mode == "kvpool+contiguous":
        kvpool.install(allocation="contiguous")
    elif mode == "kvpool+reorder-on-idle":
        monkeypatch.setenv("KVPOOL_REORDER_ON_IDLE", "1")
        kvpool.install()
    else:
        assert mode == "vanilla"


def _in_mode(mode: str, monkeypatch, fn, *args, **kwargs):
    _install(mode, monkeypatch)
    try:
        return fn(*args, **kwargs)
    finally:
        kvpool.uninstall()
        monkeypatch.delenv("KVPOOL_REORDER_ON_IDLE", raising=False)


# -- the offload manager on a pool ---------------------------------------------------------


@pytest.mark.parametrize("case", list(VLLM_RESULTS), ids=lambda case: case.__name__)
def test_the_cases_are_what_vllm_s_own_pool_does(case):
    # Without kvpool (VLLM_RESULTS: this release's cases and vLLM's results).
    assert _summary(case()) == VLLM_RESULTS[case]


@pytest.mark.parametrize("mode", ["kvpool"])
def test_kvpool_s_default_order_gets_vllm_s_lazy_stores_and_hits(mode, monkeypatch):
    # Every case (this release's and the other's): the same stores (hash for hash) and hits.
    for case in ALL_CASES:
        assert _in_mode(mode, monkeypatch, case) == case()


@pytest.mark.parametrize("mode", sorted(REFUSED))
def test_a_policy_with_its_own_free_order_refuses_the_lazy_offloader_when_it_binds(mode, monkeypatch):
    with pytest.raises(LazyOffloadOrderError, match=r"lazy_offload=True\) cannot run .* " + REFUSAL) as err:
        _in_mode(mode, monkeypatch, _offloader, lazy=True)
    assert isinstance(err.value, ValueError) and isinstance(err.value, kvpool.KvpoolError)
    assert kvpool.LazyOffloadOrderError is LazyOffloadOrderError
    setting = 'allocation="contiguous"' if mode == "kvpool+contiguous" else "KVPOOL_REORDER_ON_IDLE=1"
    assert setting in str(err.value)
    # The eager offloader binds (it stores from block tables, below).
    _in_mode(mode, monkeypatch, _offloader, lazy=False)


@pytest.mark.parametrize(("mode", "case", "hits"), WHY_REFUSED, ids=lambda v: getattr(v, "__name__", None))
def test_why_they_are_refused_their_order_would_give_other_stores_or_hits(mode, case, hits, monkeypatch):
    # Bound past the guard, the lazy offloader on these pools gives other results than
    # vLLM (should a policy become exact, this fails: lift its refusal). vLLM 0.30.0-
    # 0.33.0: other stores; in the cursor case none of the prompt's blocks, so the 48
    # tokens vLLM serves from the CPU tier become 0. vLLM 0.34.0: the same stores, but
    # the stored blocks, at the front, leave the GPU at other moments: later (the
    # prompt keeps a 48-token GPU hit where vLLM's keeps 16) or sooner (0 where 48).
    vanilla = case()
    ours = _in_mode(mode, monkeypatch, case, bind=_unguarded_bind)
    assert ours != vanilla
    key = "gpu_hit_tokens" if EVICT_FIRST else "hit_tokens"
    assert (vanilla[key], ours[key]) == hits
    if not EVICT_FIRST:
        assert ours["stores"] != vanilla["stores"]


# -- vLLM's scheduler with the connector, as a user configures it ------------------------------


def _scheduler(lazy: bool, num_blocks: int, num_cpu_blocks: int):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = _vllm_config(lazy=lazy, num_cpu_blocks=num_cpu_blocks)
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=config, kv_cache_config=_kv_cache_config(num_blocks),
                     structured_output_manager=StructuredOutputManager(config), block_size=BS, log_stats=False)


def _workload(seed: int, batches: int = 30) -> list[list[tuple[str, list[int], int]]]:
    """Batches of 1-2 requests: 40% repeat one of three prompts (2-4 blocks + 1 token),
    the rest 1-10 blocks of fresh tokens; 1-24 output tokens."""
    rng = random.Random(seed)
    tok = lambda n, s: [random.Random(s).randrange(1000, 30000) for _ in range(n)]  # noqa: E731
    prompts = [tok(rng.randint(2, 4) * BS + 1, seed * 100 + k) for k in range(3)]
    out, n = [], 0
    for _ in range(batches):
        batch = []
        for _ in range(rng.randint(1, 2)):
            n += 1
            prompt = rng.choice(prompts) if rng.random() < 0.4 else tok(rng.randint(1, 10) * BS + rng.randint(0, 15),
                                                                        seed * 1000 + n)
            batch.append((f"r{n}", prompt, rng.randint(1, 24)))
        out.append(batch)
    return out


def serve(workload, *, lazy: bool, num_blocks: int, num_cpu_blocks: int, steps_per_batch: int = 3) -> dict:
    """Run ``workload`` through vLLM's scheduler with the offloading connector: a batch
    every ``steps_per_batch`` steps, the worker completing every load and store in the
    step it was issued. Returns the stores (block hashes, per step) and the CPU-tier hit
    tokens per request."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    from kvpool.tools.replay.engine import block_hasher, make_request, model_runner_output

    sched = _scheduler(lazy, num_blocks, num_cpu_blocks)
    manager = sched.connector.scheduler_manager
    gpu_pool = sched.kv_cache_manager.block_pool
    hits: dict[str, list[int]] = {}
    matched = manager.get_num_new_matched_tokens

    def recording(request, num_computed_tokens):
        result = matched(request, num_computed_tokens)
        hits.setdefault(request.request_id, []).append(result[0])
        return result

    manager.get_num_new_matched_tokens = recording
    stores, hasher = [], block_hasher(BS)
    for i, batch in enumerate(workload + [[]]):
        for request_id, prompt, max_tokens in batch:
            sched.add_request(make_request(request_id, prompt, max_tokens=max_tokens, hasher=hasher))
        for _ in range(steps_per_batch if i < len(workload) else 1000):
            if not sched.has_requests():
                break
            output = sched.schedule()
            meta = output.kv_connector_metadata
            stores.append([gpu_pool.blocks[b].block_hash for b in meta.store_gpu_blocks])
            loaded = set(meta.load_event_to_reqs[meta.load_event]) if meta.load_event >= 0 else set()
            ids = list(output.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                req = sched.requests.get(rid)
                sampled.append([] if req is None or req.is_prefill_chunk else [100 + req.num_output_tokens])
            done = {meta.store_event: 1} if meta.store_event >= 0 else {}
            sched.update_from_output(output, model_runner_output(
                ids, sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_recving=loaded,
                    kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=done))))
        else:
            assert i < len(workload), "the workload did not finish"
    return {"stores": stores, "hits": hits}


@pytest.mark.parametrize("mode", MODES)
def test_lazy_offloading_through_vllm_s_scheduler_gets_vanilla_s_stores_and_hits_or_is_refused(mode, monkeypatch):
    workload = _workload(3)
    kwargs = dict(lazy=True, num_blocks=64, num_cpu_blocks=512)
    if mode in REFUSED:
        # Refused when vLLM's Scheduler binds its pool to the connector: before any step.
        with pytest.raises(LazyOffloadOrderError):
            _in_mode(mode, monkeypatch, _scheduler, True, 64, 512)
        return
    vanilla = serve(workload, **kwargs)
    # The CPU tier serves hits (vLLM's own result on this release's scheduler).
    assert _cpu_hit_tokens(vanilla) == (192 if EVICT_FIRST else 160)
    assert _in_mode(mode, monkeypatch, serve, workload, **kwargs) == vanilla


@pytest.mark.parametrize("mode", MODES)
def test_eager_offloading_gets_vanilla_s_stores_and_hits_under_every_policy(mode, monkeypatch):
    workload = _workload(0)
    kwargs = dict(lazy=False, num_blocks=48, num_cpu_blocks=32)
    vanilla = serve(workload, **kwargs)
    assert sum(map(sum, vanilla["hits"].values())) > 0 and sum(map(len, vanilla["stores"])) > 100
    assert _in_mode(mode, monkeypatch, serve, workload, **kwargs) == vanilla


def _cpu_hit_tokens(served: dict) -> int:
    """The CPU-tier hit tokens of a :func:`serve` run, all requests together."""
    return sum(map(sum, served["hits"].values()))


# (mode, workload seed, serve() arguments, (vLLM's CPU-tier hit tokens, the policy's)
# past the guard; None: the policy stores fewer blocks).
if EVICT_FIRST:
    # 0.34.0: the contiguous order keeps evict_first blocks cached on the GPU at other
    # moments; reorder-on-idle relinks them when the engine idles between batches.
    WHY_THROUGH_SCHEDULER = [("kvpool+contiguous", 3, {"num_blocks": 64, "steps_per_batch": 3}, (192, 160)),
                             ("kvpool+reorder-on-idle", 1, {"num_blocks": 64, "steps_per_batch": 30}, (112, 128))]
else:
    WHY_THROUGH_SCHEDULER = [("kvpool+contiguous", 1, {"num_blocks": 128, "steps_per_batch": 3}, None)]


@pytest.mark.parametrize(("mode", "seed", "kwargs", "hits"), WHY_THROUGH_SCHEDULER)
def test_why_through_vllm_s_scheduler_their_order_would_give_other_stores_or_hits(mode, seed, kwargs, hits,
                                                                                  monkeypatch):
    # The same, as a user meets it: past the guard, vLLM's scheduler with the lazy
    # connector on these policies stores fewer blocks than on vLLM's pool (0.30.0-
    # 0.33.0), or gets other CPU-tier hits (0.34.0).
    from kvpool.patches import lazy_offload

    workload = _workload(seed)
    kwargs = dict(lazy=True, num_cpu_blocks=512, **kwargs)
    vanilla = serve(workload, **kwargs)
    monkeypatch.setattr(lazy_offload, "check_lazy_offload_pool", lambda pool: None)
    ours = _in_mode(mode, monkeypatch, serve, workload, **kwargs)
    assert ours != vanilla
    if hits is None:
        assert sum(map(len, ours["stores"])) < sum(map(len, vanilla["stores"]))
    else:
        assert (_cpu_hit_tokens(vanilla), _cpu_hit_tokens(ours)) == hits
