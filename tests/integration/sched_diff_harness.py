"""One side of the scheduler-level differential (tests/integration/test_scheduler_differential.py).

Run as a script, once with vLLM's own block pool (``--side vanilla``) and once with
kvpool installed before any scheduler exists (``--side kvpool``), same ``--seed``: each
process draws the same episodes and the same request stream, steps the installed vLLM's
(0.30.0-0.33.0) ``Scheduler`` / ``AsyncScheduler`` objects without a model, and prints one line per
engine step (JSON, keys sorted) of what the step shows:

- the ``SchedulerOutput``: new and cached requests with their block ids per KV cache
  group, tokens scheduled, spec tokens, preempted and finished ids, common prefix
  blocks, block ids to zero, block copies;
- the engine-core outputs (tokens, finish reasons, prefill stats) and the prefix-cache
  stats of ``make_stats``;
- the free block count and the whole free-queue order, every request's table and
  cached-block count per group, each request's status and token counts, the KV events
  published; the prefix-cache map every 32 steps and at the end of an episode;
- the results of the calls made between steps: adds, aborts (``finish_requests``),
  prefix-cache resets (refused ones too), prefix-cache lookups under a hit limit
  (``get_computed_blocks`` with ``max_cache_hit_length``), ``evict_blocks``.

The first line names the side's pool class and whether kvpool's native
``KVCacheManager.allocate_slots`` is bound (not compared); the last is ``{"end": ...}``
with the coverage counts. One deliberate difference of kvpool's is modelled on the
vanilla side: see :func:`build_scheduler` (``free_order.defer_by_group``).

Episodes (seeded) vary: block size, pool size (small: preemption and eviction wrap the
pool), 1-3 KV cache groups (full attention, sliding window, chunked local attention),
prefix caching on/off, KV events on/off, speculative tokens (the model accepts a random
prefix of the drafts), EAGLE-style lookahead slots (``num_lookahead_tokens`` and a
manager with ``use_eagle``), FCFS or priority scheduling, token budgets and long-prefill
thresholds (chunked prefill), admission watermarks, recorded block ids to zero, and
async scheduling with a KV consumer (two batches in flight, vLLM's deferred block
frees). Prompts are biased to exact block multiples and +-1, share prefixes, repeat
earlier prompts and continue finished conversations; requests carry cache salts,
``skip_reading_prefix_cache`` and priorities.

Usage: ``python tests/integration/sched_diff_harness.py --side {vanilla,kvpool}
--steps N --seed S [--perturb-at K]``. ``--perturb-at K`` (test only) takes the two
blocks at the free queue's head before step K (or the first step after it with two
free) and frees them again in reverse order (the pool's own ``get_new_blocks`` /
``free_blocks``): a different free-queue order, which the comparison must catch.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

EOS_TOKEN_ID = 50256
TOKEN_HI = 50000  # sampled and prompt token ids stay below opt-125m's EOS
MAP_EVERY = 32  # steps between two prints of the prefix-cache map
SALTS = (None, None, None, "salt-a", "salt-b")


@dataclass(frozen=True)
class Episode:
    block_size: int
    num_blocks: int
    num_groups: int
    window_blocks: int
    caching: bool
    events: bool
    spec_tokens: int
    eagle: bool
    priority: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill: int
    watermark: float
    async_consumer: bool
    zero_new_blocks: bool
    max_model_len: int
    steps: int


def draw_episode(rng: random.Random, steps_left: int) -> Episode:
    block_size = rng.choice((2, 4, 8, 16))
    num_groups = rng.choices((1, 2, 3), weights=(7, 2, 1))[0]
    async_consumer = rng.random() < 0.15
    spec_tokens = 0 if async_consumer else rng.choice((0, 0, 0, 1, 2, 3, 5))
    # vLLM 0.33.0 refuses EAGLE with chunked local attention (the third group).
    eagle = spec_tokens > 0 and num_groups < 3 and rng.random() < 0.5
    reserve = -(-(1 + 2 * spec_tokens) // block_size) + 1  # blocks for spec and lookahead slots
    per_group = rng.randint(reserve + 6, 72)
    num_blocks = 1 + num_groups * per_group
    max_model_len = (per_group - reserve) * block_size
    max_num_seqs = rng.randint(1, 8)
    budget_floor = max_num_seqs * (1 + spec_tokens)
    budget = max(budget_floor, rng.choice((block_size, 3 * block_size, 64, 256, 4096)))
    # A threshold below 1 + spec tokens trips an assertion of vLLM 0.33.0's own schedule()
    # (a one-token new request padded for spec decode, then cut to the threshold).
    long_prefill = rng.randint(1 + spec_tokens, 3 * block_size + spec_tokens) if rng.random() < 0.2 else 0
    return Episode(
        block_size=block_size, num_blocks=num_blocks, num_groups=num_groups,
        window_blocks=rng.randint(1, 4), caching=rng.random() < 0.8, events=rng.random() < 0.5,
        spec_tokens=spec_tokens, eagle=eagle, priority=rng.random() < 0.25, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, long_prefill=long_prefill, watermark=rng.choice((0.0, 0.0, 0.01, 0.05)),
        async_consumer=async_consumer, zero_new_blocks=rng.random() < 0.3, max_model_len=max_model_len,
        steps=min(steps_left, rng.randint(150, 900)),
    )


# --- the scheduler ------------------------------------------------------------------


def _vllm_config(ep: Episode):
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    from kvpool.tools.hf_offline import CONFIG_ROOT

    model_config = ModelConfig(model=str(CONFIG_ROOT / "facebook--opt-125m"), dtype="float16", seed=0,
                               skip_tokenizer_init=True, max_model_len=ep.max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=ep.max_num_seqs, max_num_batched_tokens=ep.max_num_batched_tokens,
        max_model_len=ep.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        long_prefill_token_threshold=ep.long_prefill, watermark=ep.watermark,
        policy="priority" if ep.priority else "fcfs", async_scheduling=ep.async_consumer,
    )
    cache_config = CacheConfig(block_size=ep.block_size, cache_dtype="auto", enable_prefix_caching=ep.caching)
    extra = {}
    if ep.spec_tokens:
        extra["speculative_config"] = SpeculativeConfig(model="ngram", num_speculative_tokens=ep.spec_tokens)
    if ep.async_consumer:
        extra["kv_transfer_config"] = KVTransferConfig(kv_connector="DecodeBenchConnector", kv_role="kv_consumer")
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, parallel_config=ParallelConfig(),
                             kv_events_config=KVEventsConfig(enable_kv_cache_events=ep.events, publisher="null"),
                             **extra)
    if ep.async_consumer:
        # CpuPlatform turns async scheduling off; a GPU keeps it (as the replay's pd-async).
        vllm_config.scheduler_config.async_scheduling = True
    return vllm_config


def _use_eagle(scheduler, lookahead: int) -> None:
    """What an EAGLE drafter changes in the scheduler: ``lookahead`` KV slots past the
    scheduled tokens, and a KV cache manager that drops the last block of a prefix hit
    (legacy block hashes, as with ``disable_lookahead_block_hashes``)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    old = scheduler.kv_cache_manager
    vc = scheduler.vllm_config
    scheduler.kv_cache_manager = KVCacheManager(
        kv_cache_config=scheduler.kv_cache_config, max_model_len=scheduler.max_model_len,
        max_in_flight_tokens=vc.max_in_flight_tokens, enable_caching=old.enable_caching, use_eagle=True,
        log_stats=scheduler.log_stats, enable_kv_cache_events=old.enable_kv_cache_events,
        scheduler_block_size=scheduler.block_size, hash_block_size=scheduler.hash_block_size,
        watermark=vc.scheduler_config.watermark,
    )
    scheduler.use_eagle = scheduler.use_eagle_block_drop = True
    scheduler.num_lookahead_tokens = lookahead
    tokens = 1 + scheduler.num_spec_tokens + lookahead
    scheduler._spec_decode_step_blocks = sum(
        cdiv(tokens, m.block_size) for m in scheduler.kv_cache_manager.coordinator.single_type_managers)


def build_scheduler(ep: Episode, side: str):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvpool.tools.replay import engine, free_order
    from tests.support.scheduler import kv_cache_groups

    groups = kv_cache_groups(ep.block_size, ep.num_groups, ep.window_blocks)
    scheduler = engine.scheduler_from_config(_vllm_config(ep), groups, ep.num_blocks, ep.block_size, log_stats=True,
                                             scheduler_cls=AsyncScheduler if ep.async_consumer else None)
    if ep.async_consumer and not scheduler.defer_block_free:
        raise RuntimeError("async episode without deferred block frees")
    if ep.async_consumer and ep.num_groups > 1 and side == "vanilla":
        # vLLM queues a deferred request's groups flattened (one reversed free_blocks call:
        # group B's blocks before group A's); kvpool frees as the immediate path does
        # (docs/design.md), so the vanilla side defers each group as an entry of its own:
        # the replay's vanilla+immediate-order reference.
        free_order.defer_by_group(scheduler)
    if ep.eagle:
        _use_eagle(scheduler, ep.spec_tokens)
    if ep.zero_new_blocks:
        # As for a model whose new blocks the worker zeroes (Mamba layers, mixed precision).
        scheduler.needs_kv_cache_zeroing = True
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            manager._record_new_block_ids = True
    return scheduler


# --- requests -----------------------------------------------------------------------


class RequestStream:
    """The requests of one episode, drawn from ``rng``: prompt lengths biased to block
    multiples and +-1, shared prefixes, exact repeats, continued conversations."""

    def __init__(self, rng: random.Random, ep: Episode, episode_index: int) -> None:
        from kvpool.tools.replay.engine import block_hasher

        self.rng = rng
        self.ep = ep
        self.hasher = block_hasher(ep.block_size)
        self.prefix = f"e{episode_index}-"
        self.count = 0
        self.prefixes = [self._tokens(self._length(ep.max_model_len - 1)) for _ in range(rng.randint(1, 4))]
        self.history: deque[list[int]] = deque(maxlen=16)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, TOKEN_HI) for _ in range(n)]

    def _length(self, cap: int) -> int:
        bs = self.ep.block_size
        if cap >= bs and self.rng.random() < 0.6:
            n = self.rng.randint(1, cap // bs) * bs + self.rng.choice((-1, 0, 0, 1))
        else:
            n = self.rng.randint(1, max(1, cap))
        return max(1, min(n, cap))

    def _prompt(self, cap: int) -> list[int]:
        rng = self.rng
        r = rng.random()
        if r < 0.15 and self.history:
            prompt = list(rng.choice(self.history))
        elif r < 0.3 and self.history:
            prompt = rng.choice(self.history) + self._tokens(self._length(max(1, cap // 4)))
        else:
            n = self._length(cap)
            shared = rng.choice(self.prefixes)[: self._length(n)] if r < 0.75 else []
            prompt = shared + self._tokens(n - len(shared))
        return prompt[:cap] or self._tokens(1)

    def make(self, prompt_cap: int | None = None):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        rng, ep = self.rng, self.ep
        prompt = self._prompt(prompt_cap or ep.max_model_len - 1)
        room = ep.max_model_len - len(prompt)
        max_tokens = self._length(min(room, 4 * ep.block_size + 1))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                skip_reading_prefix_cache=True if rng.random() < 0.08 else None)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        self.count += 1
        self.history.append(prompt)
        return Request(request_id=f"{self.prefix}{self.count}", prompt_token_ids=prompt, sampling_params=params,
                       pooling_params=None, block_hasher=self.hasher, cache_salt=rng.choice(SALTS),
                       priority=rng.randint(0, 3) if ep.priority else 0, arrival_time=float(self.count))

    def finished(self, request) -> None:
        """A finished request's tokens: a later prompt may continue the conversation."""
        tokens = list(request.all_token_ids)
        if len(tokens) < self.ep.max_model_len - 2:
            self.history.append(tokens)


# --- the stand-in model ---------------------------------------------------------------


def sampled_tokens(scheduler, so, rng: random.Random) -> dict[str, list[int]]:
    """What a model samples for ``so``, decided right after ``schedule()``: nothing for a
    prefill chunk, else a random prefix of the scheduled drafts (the rest rejected) and
    one token of its own."""
    out = {}
    for rid in so.num_scheduled_tokens:
        request = scheduler.requests.get(rid)
        if request is None or request.is_prefill_chunk:
            out[rid] = []
            continue
        drafts = so.scheduled_spec_decode_tokens.get(rid, ())
        accepted = rng.randint(0, len(drafts)) if drafts else 0
        out[rid] = [t if t >= 0 else rng.randrange(1, TOKEN_HI) for t in drafts[:accepted]]
        out[rid].append(rng.randrange(1, TOKEN_HI))
    return out


def model_output(so, tokens: dict[str, list[int]]):
    from kvpool.tools.replay.engine import model_runner_output

    ids = list(so.num_scheduled_tokens)
    return model_runner_output(ids, [tokens[rid] for rid in ids], logprobs=None, prompt_logprobs_dict={},
                               pooler_output=[])


def propose_drafts(scheduler, ep: Episode, rng: random.Random) -> list[str]:
    """Draft tokens for running decodes (``update_draft_token_ids``, as after a drafter
    step); the ids that got some."""
    from vllm.v1.outputs import DraftTokenIds

    ids, drafts = [], []
    for request in scheduler.running:
        if rng.random() < 0.75:
            ids.append(request.request_id)
            drafts.append([rng.randrange(1, TOKEN_HI) for _ in range(rng.randint(0, ep.spec_tokens))])
    if ids:
        scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))
    return ids


# --- what a step shows ----------------------------------------------------------------


def _sorted(ids) -> list[str] | None:
    return None if ids is None else sorted(ids)


def _groups(block_ids) -> list[list[int]] | None:
    return None if block_ids is None else [list(g) for g in block_ids]


def scheduler_output_view(so) -> dict:
    cached = so.scheduled_cached_reqs
    return {
        "new": [[r.req_id, _groups(r.block_ids), r.num_computed_tokens] for r in so.scheduled_new_reqs],
        "cached": [[rid, rid in getattr(cached, "resumed_req_ids", ()), _groups(b), n]
                   for rid, b, n in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)],
        "tokens": sorted(so.num_scheduled_tokens.items()),
        "total": so.total_num_scheduled_tokens,
        "spec": sorted((k, len(v)) for k, v in so.scheduled_spec_decode_tokens.items()),
        "finished": _sorted(so.finished_req_ids),
        "preempted": _sorted(so.preempted_req_ids),
        "common_prefix": list(getattr(so, "num_common_prefix_blocks", ())),  # (gone in vLLM 0.34.0)
        "zero": so.new_block_ids_to_zero,
        "copies": None if so.kv_cache_block_copies is None else [repr(c) for c in so.kv_cache_block_copies],
    }


def _prefill_stats(stats) -> list | None:
    """A request's first-output prefill breakdown (prompt, computed, local and external
    cache hits, tokens written to the cache)."""
    return None if stats is None else sorted(asdict(stats).items())


def engine_outputs_view(outputs) -> dict:
    view = {"out": [], "stats": None}
    for client in sorted(outputs):
        eco = outputs[client]
        view["out"] += [[o.request_id, list(o.new_token_ids), None if o.finish_reason is None else int(o.finish_reason),
                         o.stop_reason, _prefill_stats(o.prefill_stats)] for o in eco.outputs]
        if eco.scheduler_stats is not None:
            s = eco.scheduler_stats
            p = s.prefix_cache_stats
            view["stats"] = [s.num_running_reqs, s.num_waiting_reqs, s.num_skipped_waiting_reqs,
                             round(s.kv_cache_usage, 9), p.reset, p.requests, p.queries, p.hits,
                             p.preempted_requests, p.preempted_queries, p.preempted_hits]
    return view


def _event(e) -> list:
    import msgspec

    return [type(e).__name__, json.loads(msgspec.json.encode(e))]


def _key(key) -> str:
    """A prefix-cache key: the block hash's first 8 bytes and the group id (last 4)."""
    return key[:8].hex() + ":" + key[-4:].hex() if isinstance(key, bytes) else repr(key)


def state_view(scheduler, events: list, with_map: bool) -> dict:
    """The pool and the managers after a step: free count and free-queue order, tables
    and cached-block counts per group, requests, KV events published since the last view."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    singles = manager.coordinator.single_type_managers
    tables: dict[str, list] = {}
    for g, single in enumerate(singles):
        for rid, blocks in single.req_to_blocks.items():
            tables.setdefault(rid, [[] for _ in singles])[g] = [b.block_id for b in blocks]
    view = {
        "free": pool.get_num_free_blocks(),
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "tables": sorted(tables.items()),
        "num_cached": [sorted(s.num_cached_block.items()) for s in singles],
        "reqs": sorted([rid, int(r.status), r.num_computed_tokens, r.num_tokens,
                        r.num_output_placeholders, r.num_preemptions] for rid, r in scheduler.requests.items()),
        "deferred": bool(getattr(scheduler, "deferred_frees", None)),
        "events": [_event(e) for batch in events for e in batch.events],
    }
    events.clear()
    if with_map:
        from tests.support.map_view import map_entries

        view["map"] = sorted([_key(k), sorted(ids)]
                             for k, ids in map_entries(pool.cached_block_hash_to_block).items())
    return view


# --- the episode ----------------------------------------------------------------------


class EpisodeRun:
    """One scheduler stepped ``ep.steps`` times: the calls between steps (adds, aborts,
    resets, lookups), then the engine step (sync, or two batches in flight)."""

    def __init__(self, ep: Episode, index: int, rng: random.Random, counts: Counter, side: str) -> None:
        self.ep, self.index, self.rng, self.counts = ep, index, rng, counts
        self.scheduler = build_scheduler(ep, side)
        self.stream = RequestStream(rng, ep, index)
        self.requests: dict[str, object] = {}
        self.events: list = []
        self.scheduler.kv_event_publisher.publish = self.events.append
        self.batches: deque = deque()  # (scheduler output, sampled tokens), newest first
        self.concurrency = rng.randint(1, 12)

    def _add(self, acts: dict) -> None:
        rng = self.rng
        if len(self.scheduler.requests) >= self.concurrency or rng.random() < 0.4:
            return
        for _ in range(rng.choices((1, 2, 3), weights=(6, 3, 1))[0]):
            request = self.stream.make()
            self.requests[request.request_id] = request
            self.scheduler.add_request(request)
            acts.setdefault("add", []).append([request.request_id, request.num_prompt_tokens, request.max_tokens])
            self.counts["requests"] += 1

    def _abort(self, acts: dict) -> None:
        from vllm.v1.request import RequestStatus

        rng = self.rng
        live = sorted(self.scheduler.requests)
        ids = rng.sample(live, min(len(live), rng.randint(1, 2)))
        if rng.random() < 0.3:
            ids.append(rng.choice(sorted(self.requests)) if self.requests else "unknown")
        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        acts["abort"] = [ids, sorted(r.request_id for r in aborted)]
        self.counts["aborted"] += len(aborted)

    def _reset(self, acts: dict) -> None:
        running = not self.batches and self.rng.random() < 0.25
        ok = self.scheduler.reset_prefix_cache(reset_running_requests=running)
        acts["reset"] = [running, ok]
        self.counts["reset_ok" if ok else "reset_refused"] += 1

    def _lookup(self, acts: dict) -> None:
        """``get_computed_blocks`` of a request never added, under a hit limit."""
        probe = self.stream.make()
        limit = self.rng.choice((None, self.rng.randint(0, probe.num_tokens)))
        manager = self.scheduler.kv_cache_manager
        # (vLLM's own signature, kvpool's bound function included: before 0.33.0 there is
        # no max_cache_hit_length, and the lookup is the scheduler's, without a limit)
        if "max_cache_hit_length" in inspect.signature(manager.get_computed_blocks).parameters:
            blocks, num_tokens, boundary = manager.get_computed_blocks(probe, limit)
        else:
            limit = None
            blocks, num_tokens, boundary = manager.get_computed_blocks(probe)
        acts["lookup"] = [probe.num_tokens, limit, _groups(blocks.get_block_ids()), num_tokens, boundary]
        self.counts["lookup_hit" if num_tokens else "lookup_miss"] += 1

    def _evict(self, acts: dict) -> None:
        """``evict_blocks`` (what the scheduler calls for blocks a KV load failed to fill):
        a few ids, cached or not, held or free; the null block never."""
        ids = sorted({self.rng.randrange(1, self.ep.num_blocks) for _ in range(self.rng.randint(1, 4))})
        self.scheduler.kv_cache_manager.evict_blocks(set(ids))
        acts["evict"] = ids
        self.counts["evict"] += 1

    def _between_steps(self) -> dict:
        acts: dict = {}
        rng = self.rng
        self._add(acts)
        if self.scheduler.requests and rng.random() < 0.04:
            self._abort(acts)
        if rng.random() < 0.012:
            self._reset(acts)
        if self.ep.caching and rng.random() < 0.03:
            self._lookup(acts)
        if self.ep.caching and rng.random() < 0.01:
            self._evict(acts)
        if self.batches:  # frees of requests whose step is in flight wait for it
            acts["deferred"] = bool(self.scheduler.deferred_frees)
            self.counts["deferred"] += acts["deferred"]
        return acts

    def _update(self, view: dict) -> None:
        so, tokens = self.batches.pop()
        outputs = self.scheduler.update_from_output(so, model_output(so, tokens))
        view.update(engine_outputs_view(outputs))
        for rid, _, reason, *_ in view["out"]:
            if reason is not None and rid in self.requests:
                self.stream.finished(self.requests[rid])
        if self.ep.spec_tokens:
            view["drafts"] = propose_drafts(self.scheduler, self.ep, self.rng)

    def step(self, k: int) -> dict:
        view = {"acts": self._between_steps()}
        scheduler = self.scheduler
        so = scheduler.schedule()
        self.batches.appendleft((so, sampled_tokens(scheduler, so, self.rng)))
        view["so"] = scheduler_output_view(so)
        depth = 2 if self.ep.async_consumer else 1
        if len(self.batches) >= depth or not scheduler.has_requests():
            self._update(view)
        view["state"] = state_view(scheduler, self.events, with_map=k % MAP_EVERY == 0)
        self._count(so, view)
        return view

    def _count(self, so, view: dict) -> None:
        c = self.counts
        c["steps"] += 1
        c["preempted"] += len(so.preempted_req_ids or ())
        c["spec_tokens"] += sum(len(v) for v in so.scheduled_spec_decode_tokens.values())
        c["events"] += len(view["state"]["events"])
        c["zeroed"] += len(so.new_block_ids_to_zero or ())
        stats = view.get("stats")
        if stats:
            c["hit_tokens"] += stats[7]

    def finish(self) -> dict:
        """Drain the batches in flight, abort whatever is left, the final state."""
        from vllm.v1.request import RequestStatus

        view: dict = {"drained": []}
        while self.batches:
            sub: dict = {}
            self._update(sub)
            view["drained"].append(sub)
        aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        view["aborted"] = sorted(r.request_id for r in aborted)
        view["state"] = state_view(self.scheduler, self.events, with_map=True)
        view["unpublished_events"] = [_event(e) for e in self.scheduler.kv_cache_manager.take_events()]
        self.scheduler.shutdown()
        return view


def perturb(scheduler) -> bool:
    """Test only: the two blocks at the free queue's head taken and freed again in
    reverse order (evicted if cached, so both go back to the head, swapped); False
    when fewer than two blocks are free."""
    pool = scheduler.kv_cache_manager.block_pool
    if pool.get_num_free_blocks() < 2:
        return False
    pool.free_blocks(pool.get_new_blocks(2)[::-1])
    return True


def run(side: str, steps: int, seed: int, perturb_at: int | None, emit) -> Counter:
    rng = random.Random(seed)
    counts: Counter = Counter()
    done = index = 0
    while done < steps:
        ep = draw_episode(rng, steps - done)
        episode = EpisodeRun(ep, index, rng, counts, side)
        emit({"episode": index, "spec": asdict(ep)})
        for k in range(ep.steps):
            if perturb_at is not None and done + k >= perturb_at and perturb(episode.scheduler):
                perturb_at = None
            emit({"step": done + k, **episode.step(k)})
        emit({"episode_end": index, **episode.finish()})
        counts["episodes"] += 1
        counts["async_episodes"] += ep.async_consumer
        done += ep.steps
        index += 1
    return counts


def _prepare(side: str) -> dict:
    """Offline configs, quiet logs, the side's pool classes; which pool and
    ``allocate_slots`` it runs."""
    sys.path.insert(0, str(REPO))
    from kvpool.tools.hf_offline import OFFLINE_FLAGS

    os.environ.update(OFFLINE_FLAGS)
    import logging

    import kvpool

    if side == "kvpool":
        kvpool.install()
    elif kvpool.is_installed():
        raise RuntimeError("vanilla side with kvpool installed")
    logging.disable(logging.WARNING)
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    cls = kv_cache_coordinator.BlockPool
    native = type(KVCacheManager.allocate_slots).__name__ != "function"  # kvpool's native step bound
    return {"pool": f"{cls.__module__}.{cls.__qualname__}", "native_allocate_slots": native}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=("vanilla", "kvpool"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--perturb-at", type=int)
    args = parser.parse_args(argv)
    out = sys.stdout
    # stdout carries the step lines alone: vLLM's log handler (bound to sys.stdout when
    # vLLM is imported; 0.30.0 logs at INFO before kvpool's install returns) and any
    # print go to stderr.
    sys.stdout = sys.stderr
    classes = _prepare(args.side)
    dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode

    def emit(obj) -> None:
        out.write(dumps(obj))
        out.write("\n")

    emit({"side": args.side, "pid": os.getpid(), **classes})
    counts = run(args.side, args.steps, args.seed, args.perturb_at, emit)
    emit({"end": dict(sorted(counts.items()))})
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
