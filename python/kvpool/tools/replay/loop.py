"""The engine-step loops: a round run to completion, or a stream cut into windows.

No model runs. Each engine step is ``scheduler.schedule()``, the stand-in model
(:func:`~.engine.stand_in_model`) and ``scheduler.update_from_output()``, the two
scheduler halves timed by one :class:`Stepper`. With ``EngineSpec.async_scheduling``
:func:`run_round` keeps two batches in flight the way ``EngineCore.step_with_batch_queue``
does (step N+1 is scheduled before step N's output is processed), so vLLM's deferred
block frees (``defer_block_free``, ``deferred_frees``, ``_drain_deferred_frees``) run as
in a deployment. :func:`run_stream` (window by window: :func:`iter_stream`) runs a
continuous workload (``serving``): requests
arrive while others run and nothing is reset between windows.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

from kvpool.tools.replay import metrics
from kvpool.tools.replay.engine import PoolSpec, RequestFactory, stand_in_model
from kvpool.tools.replay.free_order import free_queue_figures
from kvpool.tools.replay.probe import (
    RoundProbe,
    by_request_index,
    cache_counts,
    group_kinds,
    primary_group,
    table_digest,
)
from kvpool.tools.replay.results import DrainResult, RoundResult
from kvpool.tools.replay.workloads import Workload

_thread_time = time.thread_time
#: Steps in a row that schedule nothing, with requests waiting, before a run gives up.
MAX_STALLED_STEPS = 1000


class Stepper:
    """The two halves of an engine step on one scheduler, timed in thread CPU seconds
    with the probe's own table reads subtracted.

    Records each request's prompt blocks (the first ``ceil(prompt_len / block_size)``
    table entries) in :attr:`prompt_tables` after the ``schedule()`` in which its whole
    prompt is computed, and the transfer descriptors of its prompt blocks per KV cache
    group in :attr:`prompt_descriptors`. :attr:`copies_per_step` gets, per engine step
    in which vLLM cached blocks that became full, the copies an offloading connector
    would issue for them (see :class:`~.probe.RoundProbe`).
    """

    def __init__(self, scheduler, probe: RoundProbe, model_output: Callable[[Any], Any], block_size: int,
                 per_group: bool = False) -> None:
        self.scheduler = scheduler
        self.probe = probe
        self.model_output = model_output
        self.block_size = block_size
        self.kv = scheduler.kv_cache_manager
        #: request id -> (request, prompt blocks) of prompts not yet fully allocated.
        self.awaiting_prompt: dict[str, tuple[Any, int]] = {}
        self.prompt_tables: dict[str, list[int]] = {}
        #: request id -> descriptors of its prompt blocks, one ``int`` per KV cache group.
        self.prompt_descriptors: dict[str, list[int]] = {}
        #: request id -> the same summed over groups with each group's blocks in ascending
        #: id order (:func:`~.metrics.sorted_descriptors`: the floor any placement can reach).
        self.prompt_descriptors_sorted: dict[str, int] = {}
        #: (blocks that became full, copies), one entry per step that cached a block.
        self.copies_per_step: list[tuple[int, int]] = []
        groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None) or []
        #: Tokens per block of each KV cache group (one group unless ``--model``).
        self.group_block_sizes = [g.kv_cache_spec.block_size for g in groups] or [block_size]
        #: The group of :attr:`prompt_tables` (:func:`~.probe.primary_group`).
        self.primary = primary_group(scheduler)
        #: With ``per_group``: ``prompt_by_group[g]``, request id -> group ``g``'s prompt blocks.
        self.prompt_by_group: list[dict[str, list[int]]] = [{} for _ in group_kinds(scheduler)] if per_group else []
        pool = self.kv.block_pool
        self.null_block_id = getattr(getattr(pool, "null_block", None), "block_id", metrics.NULL_BLOCK_ID)

    def expect_prompt(self, request, prompt_len: int) -> None:
        bs = self.group_block_sizes[self.primary] if self.primary < len(self.group_block_sizes) else self.block_size
        self.awaiting_prompt[request.request_id] = (request, math.ceil(prompt_len / bs))

    def end_step(self) -> None:
        """Close the step: the blocks cached since the previous call are one step's."""
        blocks, copies = self.probe.take_step()
        if blocks:
            self.copies_per_step.append((blocks, copies))

    def schedule(self) -> tuple[Any, float]:
        """Return ``(scheduler_output, CPU seconds of the call)``. Starts a step: the blocks
        cached before it (the previous step's ``update_from_output``) close the last."""
        self.end_step()
        probe = self.probe
        probe_before = probe.probe_cpu
        t0 = _thread_time()
        so = self.scheduler.schedule()
        dt = _thread_time() - t0 - (probe.probe_cpu - probe_before)
        probe.observe_full_blocks()
        awaiting = self.awaiting_prompt
        if awaiting:
            for rid in so.num_scheduled_tokens:
                entry = awaiting.get(rid)
                if entry is not None and entry[0].num_computed_tokens >= entry[0].num_prompt_tokens:
                    groups = self.kv.get_block_ids(rid)
                    self.prompt_tables[rid] = list(groups[self.primary][: entry[1]])
                    prompt_len = entry[0].num_prompt_tokens
                    prompts = [g[: -(-prompt_len // bs)] for g, bs in zip(groups, self.group_block_sizes)]
                    for tables, table in zip(self.prompt_by_group, prompts):
                        tables[rid] = list(table)
                    self.prompt_descriptors[rid] = [
                        metrics.transfer_descriptors(g, self.null_block_id) for g in prompts]
                    self.prompt_descriptors_sorted[rid] = sum(
                        metrics.sorted_descriptors(g, self.null_block_id) for g in prompts)
                    del awaiting[rid]
        return so, dt

    def update(self, so) -> float:
        """Run the stand-in model on ``so`` and ``update_from_output``; its CPU seconds."""
        mro = self.model_output(so)
        probe = self.probe
        probe_before = probe.probe_cpu
        t0 = _thread_time()
        self.scheduler.update_from_output(so, mro)
        dt = _thread_time() - t0 - (probe.probe_cpu - probe_before)
        probe.observe_full_blocks()
        return dt


def check_fits(specs: Sequence, pool: PoolSpec, where: str) -> None:
    """Raises ``ValueError`` when one request alone needs more blocks than the pool has.

    A ``--model`` pool (``pool.resolved``) is checked by vLLM itself when it is
    resolved (``get_kv_cache_configs``: one request of ``max_model_len`` tokens fits)."""
    if pool.resolved:
        return
    usable = pool.num_blocks - 1  # block 0 is the null block
    for spec in specs:
        need = math.ceil((spec.prompt_len + spec.output_len) / pool.block_size)
        if need > usable:
            raise ValueError(
                f"{where}: a request of {spec.prompt_len} prompt + {spec.output_len} output "
                f"tokens needs {need} blocks of {pool.block_size} tokens, but the pool has {usable} usable "
                f"blocks; raise --num-blocks or shorten the request (--scale)")


def _stalled(where: str, steps: int, scheduler, pool: PoolSpec, what: str) -> RuntimeError:
    return RuntimeError(
        f"{where}: the scheduler made no progress for {steps} steps with "
        f"{len(scheduler.waiting)} request(s) waiting; the pool ({pool.num_blocks} blocks of "
        f"{pool.smallest_block} tokens{'' if pool.smallest_block == pool.block_size else ' or more'}) is too small "
        f"for this {what}. Raise --num-blocks{' or --kv-memory-gib' if pool.resolved else ''}.")


def _table_stats(ptables: list[list[int]], ftables: list[list[int]]) -> dict[str, Any]:
    """The :class:`RoundResult` fields computed from a round's prompt and final tables."""
    all_ids = {b for t in ftables for b in t} | {b for t in ptables for b in t}
    return {
        "contiguity": metrics.contiguity(ptables),
        "table_contiguity": metrics.contiguity(ftables),
        "mean_run_length": metrics.mean_run_length(ptables),
        "prompt_descending": metrics.descending_fraction(ptables),
        "prompt_blocks": sum(len(t) for t in ptables),
        "distinct_blocks": len(all_ids),
        "max_block_id": max(all_ids, default=0),
    }


def _transfer_stats(stepper: Stepper, caches_blocks: bool) -> dict[str, Any]:
    """The :class:`RoundResult` transfer fields of the prompts allocated and the steps
    run since the stepper's lists were last cleared (docs/replay.md, "Transfer figures")."""
    per_prompt = list(stepper.prompt_descriptors.values())
    desc = metrics.spread([sum(d) for d in per_prompt])
    out: dict[str, Any] = {
        "prompts": len(per_prompt),
        "prompt_descriptors_median": desc["median"], "prompt_descriptors_p90": desc["p90"],
        "prompt_descriptors_max": desc["max"], "prompt_descriptors_total": desc["total"],
        "prompt_descriptors_by_group": [sum(d[g] for d in per_prompt) for g in range(len(stepper.group_block_sizes))],
    }
    floor = metrics.spread(list(stepper.prompt_descriptors_sorted.values()))
    out.update(prompt_descriptors_sorted_median=floor["median"], prompt_descriptors_sorted_total=floor["total"])
    if caches_blocks:
        steps = stepper.copies_per_step
        copies = metrics.spread([c for _, c in steps])
        out.update(offload_blocks=sum(b for b, _ in steps), offload_steps=len(steps),
                   offload_copies_per_step_median=copies["median"], offload_copies_per_step_p90=copies["p90"],
                   offload_copies_per_step_max=copies["max"], offload_copies_total=copies["total"])
    return out


def _group_stats(stepper: Stepper, probe: RoundProbe) -> dict[str, Any]:
    """``by_group`` of a round (window) when the stepper keeps per-group tables: per KV
    cache group its kind and :func:`~.metrics.group_figures`."""
    if not stepper.prompt_by_group:
        return {}
    out = []
    queue_digest, orders = free_queue_figures(stepper.scheduler, probe.finished_by_group, stepper.null_block_id)
    for g, kind in enumerate(group_kinds(stepper.scheduler)):
        prompts, finished = stepper.prompt_by_group[g], probe.finished_by_group[g]
        figures = metrics.group_figures([prompts[r] for r in sorted(prompts)], [finished[r] for r in sorted(finished)],
                                        stepper.null_block_id)
        out.append({"group": g, "kind": kind, "block_size": stepper.group_block_sizes[g], **figures,
                    "table_digest": table_digest(prompts, finished), **orders[g]})
    return {"by_group": out, "free_queue_digest": queue_digest}


def _saved_tables(prompt_tables: dict[str, list[int]], finished_tables: dict[str, list[int]]) -> dict:
    return {"prompt": by_request_index(prompt_tables), "finished": by_request_index(finished_tables)}


def _round_steps(stepper: Stepper, specs: list, requests: list, depth: int, rnd: int,
                 pool: PoolSpec) -> tuple[float, float, int]:
    """Step round ``rnd`` (``requests[i]`` added at ``specs[i].arrival_step``) until no
    request (and no batch in flight) is left; its ``(scheduler CPU s, prefill-admitting
    schedule() CPU s, steps)``."""
    scheduler = stepper.scheduler
    pending = deque(sorted(range(len(specs)), key=lambda i: specs[i].arrival_step))
    sched_cpu = prefill_cpu = 0.0
    num_steps = step_clock = idle_steps = 0  # idle: steps in a row with nothing scheduled or in flight
    batch_queue: deque = deque()
    while True:
        while pending and specs[pending[0]].arrival_step <= step_clock:
            scheduler.add_request(requests[pending.popleft()])
        if scheduler.has_requests():
            so, dt = stepper.schedule()
            if so.total_num_scheduled_tokens == 0 and not batch_queue:
                idle_steps += 1
                if idle_steps > MAX_STALLED_STEPS:
                    raise _stalled(f"round {rnd}", idle_steps, scheduler, pool, "round's concurrent requests")
            else:
                idle_steps = 0
            sched_cpu += dt
            num_steps += 1
            step_clock += 1
            if so.scheduled_new_reqs:
                prefill_cpu += dt
            batch_queue.appendleft(so)
            if len(batch_queue) < depth and (so.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                continue
        if not batch_queue:
            if pending:
                step_clock = specs[pending[0]].arrival_step  # idle until the next arrival
                continue
            return sched_cpu, prefill_cpu, num_steps
        sched_cpu += stepper.update(batch_queue.pop())


def run_round(scheduler, probe: RoundProbe, workload: Workload, rnd: int, seed: int, pool: PoolSpec,
              save_tables: bool = False) -> RoundResult:
    """Run round ``rnd`` to completion on ``scheduler``; its metrics (see docs/replay.md).

    With ``save_tables`` the result also holds ``tables``: ``{"prompt": [...],
    "finished": [...]}``, one ``list[int]`` of physical block ids per request of the round,
    in request order: the prompt's blocks after its prefill, and the whole table when the
    request finished (what ``python -m kvpool locality`` lays its requests out with).

    Raises:
        ValueError: a request does not fit the pool.
        RuntimeError: the scheduler stalled, or left requests or deferred frees behind.
    """
    check_fits(workload.round_requests(rnd), pool, f"round {rnd}")
    factory = RequestFactory.for_round(workload, rnd, seed, pool.hash_size)
    requests = [factory.make(i) for i in range(len(factory))]
    stepper = Stepper(scheduler, probe, stand_in_model(scheduler, *factory.targets()), pool.block_size,
                      per_group=bool(probe.num_groups))
    for spec, request in zip(factory.specs, requests):
        stepper.expect_prompt(request, spec.prompt_len)
    probe.reset()
    gc.collect()
    wall0 = time.perf_counter()
    sched_cpu, prefill_cpu, num_steps = _round_steps(
        stepper, factory.specs, requests, 2 if workload.engine.async_scheduling else 1, rnd, pool)
    wall = time.perf_counter() - wall0
    stepper.end_step()
    if scheduler.has_requests() or getattr(scheduler, "deferred_frees", None):
        raise RuntimeError(f"round {rnd}: requests or deferred frees left after the last step")
    if stepper.awaiting_prompt:
        raise RuntimeError(f"round {rnd}: prompts never fully allocated: {sorted(stepper.awaiting_prompt)[:5]}")
    prompt_tables, finished = stepper.prompt_tables, probe.finished_tables
    free_after = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    steps = max(num_steps, 1)
    return RoundResult(
        round=rnd, num_requests=len(factory), num_steps=num_steps,
        **_table_stats([prompt_tables[r] for r in sorted(prompt_tables)], [finished[r] for r in sorted(finished)]),
        sched_cpu_s_per_step=sched_cpu / steps, sched_cpu_s=sched_cpu, prefill_sched_cpu_s=prefill_cpu,
        **cache_counts(probe),
        deferred_frees=probe.deferred_frees, deferred_blocks=probe.deferred_blocks,
        drain_calls=probe.drain_calls, drain_cpu_s=probe.drain_cpu, drain_cpu_s_per_step=probe.drain_cpu / steps,
        defer_push_s=probe.push_cpu,
        deferred_free_s_per_block=(
            (probe.push_cpu + probe.drain_cpu) / probe.deferred_blocks if probe.deferred_blocks else None),
        free_blocks_after=free_after, leaked_blocks=pool.num_blocks - 1 - free_after,
        table_digest=table_digest(prompt_tables, finished), wall_s=wall,
        **_transfer_stats(stepper, probe.caches_blocks), **_group_stats(stepper, probe),
        tables=_saved_tables(prompt_tables, finished) if save_tables else None,
    )


class _Window:
    """Counters of one window of a stream."""

    def __init__(self) -> None:
        self.sched_cpu = self.prefill_cpu = 0.0
        self.steps = self.idle = self.arrivals = 0
        self.in_min: int | None = None
        self.in_max = self.in_sum = 0
        self.run_min: int | None = None
        self.run_max = 0
        self.wall0 = time.perf_counter()

    def saw(self, in_flight: int, running: int) -> None:
        """Requests in flight at a ``schedule()``, and running after it."""
        self.in_min = in_flight if self.in_min is None else min(self.in_min, in_flight)
        self.in_max = max(self.in_max, in_flight)
        self.in_sum += in_flight
        self.run_min = running if self.run_min is None else min(self.run_min, running)
        self.run_max = max(self.run_max, running)


class _Stream:
    """A continuous workload on one scheduler: arrivals, steps, windows (see :func:`run_stream`)."""

    def __init__(self, scheduler, probe: RoundProbe, workload: Workload, seed: int, pool: PoolSpec,
                 save_tables: bool) -> None:
        self.scheduler, self.probe, self.pool, self.save_tables = scheduler, probe, pool, save_tables
        self.factory = RequestFactory.for_stream(workload, seed, pool.hash_size)
        self.stepper = Stepper(scheduler, probe, stand_in_model(scheduler, *self.factory.targets()), pool.block_size,
                               per_group=bool(probe.num_groups))
        self.rounds: list[RoundResult] = []
        self.next_k = self.step = 0
        self.stalled = 0  # consecutive steps that scheduled nothing while requests were in flight
        self.window = self.new_window()

    def new_window(self) -> _Window:
        self.probe.reset()
        self.stepper.prompt_tables = {}
        self.stepper.prompt_descriptors = {}
        self.stepper.prompt_descriptors_sorted = {}
        self.stepper.copies_per_step = []
        self.stepper.prompt_by_group = [{} for _ in self.stepper.prompt_by_group]
        self.window = _Window()
        return self.window

    def close_window(self) -> None:
        self.stepper.end_step()
        w, probe, prompt_tables = self.window, self.probe, self.stepper.prompt_tables
        steps = max(w.steps, 1)
        self.rounds.append(RoundResult(
            round=len(self.rounds), num_requests=w.arrivals, window=True, arrivals=w.arrivals,
            finished=len(probe.finished_tables), num_steps=w.steps, idle_steps=w.idle,
            in_flight_min=w.in_min, in_flight_max=w.in_max, in_flight_mean=w.in_sum / steps,
            running_min=w.run_min, running_max=w.run_max,
            **_table_stats(list(prompt_tables.values()), list(probe.finished_tables.values())),
            sched_cpu_s_per_step=w.sched_cpu / steps, sched_cpu_s=w.sched_cpu, prefill_sched_cpu_s=w.prefill_cpu,
            **cache_counts(probe),
            free_blocks_after=self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            leaked_blocks=0,  # blocks are in use mid-stream; checked after the drain
            table_digest=table_digest(prompt_tables, probe.finished_tables),
            wall_s=time.perf_counter() - w.wall0,
            **_transfer_stats(self.stepper, probe.caches_blocks), **_group_stats(self.stepper, probe),
            tables=_saved_tables(prompt_tables, probe.finished_tables) if self.save_tables else None,
        ))
        self.new_window()

    def admit(self) -> None:
        """Add the requests whose ``arrival_step`` has come."""
        specs = self.factory.specs
        while self.next_k < len(specs) and specs[self.next_k].arrival_step <= self.step:
            req = self.factory.make(self.next_k)
            self.scheduler.add_request(req)
            self.stepper.expect_prompt(req, specs[self.next_k].prompt_len)
            self.window.arrivals += 1
            self.next_k += 1

    def engine_step(self) -> None:
        w, scheduler = self.window, self.scheduler
        in_flight = len(scheduler.requests)  # added and not finished
        so, dt = self.stepper.schedule()
        w.saw(in_flight, len(scheduler.running))  # after schedule(): it rebinds its running list
        if so.total_num_scheduled_tokens == 0:
            w.idle += 1
            self.stalled += 1
        else:
            self.stalled = 0
        if so.scheduled_new_reqs:
            w.prefill_cpu += dt
        w.sched_cpu += dt + self.stepper.update(so)
        w.steps += 1
        self.step += 1

    def idle_step(self) -> None:
        """Nothing in flight: an idle step (a serving workload should have none)."""
        w = self.window
        w.steps += 1
        w.idle += 1
        w.in_min = 0
        w.run_min = 0
        self.step += 1

    def drain_result(self, horizon: int) -> DrainResult:
        free_after = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        return DrainResult(steps=self.window.steps, sched_cpu_s=self.window.sched_cpu,
                           finished=len(self.probe.finished_tables), **cache_counts(self.probe),
                           free_blocks_after=free_after, leaked_blocks=self.pool.num_blocks - 1 - free_after,
                           horizon_steps=horizon)


def iter_stream(scheduler, probe: RoundProbe, workload: Workload, seed: int, pool: PoolSpec,
                save_tables: bool = False) -> Generator[RoundResult, None, DrainResult]:
    """:func:`run_stream` one window at a time: a generator that yields each window's
    :class:`RoundResult` as the window closes and returns the :class:`DrainResult`
    (``StopIteration.value``). Nothing runs between two ``next()`` calls, so a caller
    may do other work there (the replay benchmark runs the other modes' windows).

    Raises:
        ValueError: at once: an async workload, or a request that does not fit the pool.
        RuntimeError: from ``next()``: the scheduler stalled, or a prompt was never fully
            allocated.
    """
    if workload.engine.async_scheduling:
        raise ValueError("continuous workloads run synchronous scheduling only")
    check_fits(workload.requests, pool, "serving")
    return _stream_windows(_Stream(scheduler, probe, workload, seed, pool, save_tables), workload)


def _stream_windows(stream: _Stream, workload: Workload) -> Generator[RoundResult, None, DrainResult]:
    window, scheduler, pool = workload.window_steps, stream.scheduler, stream.pool
    gc.collect()
    stream.new_window()
    while True:
        if stream.step == (len(stream.rounds) + 1) * window and len(stream.rounds) < workload.num_rounds:
            stream.close_window()
            yield stream.rounds[-1]
        stream.admit()
        if stream.stalled > MAX_STALLED_STEPS:
            raise _stalled(f"step {stream.step}", stream.stalled, scheduler, pool,
                           "workload's requests in flight")
        if scheduler.has_requests():
            stream.engine_step()
        elif stream.next_k < len(stream.factory):
            stream.idle_step()
        else:
            break
    while len(stream.rounds) < workload.num_rounds:  # a trace that ends before its last window
        stream.close_window()
        yield stream.rounds[-1]
    if stream.stepper.awaiting_prompt:
        raise RuntimeError(f"prompts never fully allocated: {sorted(stream.stepper.awaiting_prompt)[:5]}")
    return stream.drain_result(workload.num_rounds * window)


def run_stream(scheduler, probe: RoundProbe, workload: Workload, seed: int, pool: PoolSpec,
               on_round: Callable[[int], None] | None = None,
               save_tables: bool = False) -> tuple[list[RoundResult], DrainResult]:
    """Run a continuous workload (``workload.continuous``): requests join at their
    ``arrival_step`` while others run, and round ``r`` is the window of engine steps
    ``[r * window_steps, (r + 1) * window_steps)``. Nothing is reset between windows.

    Each window reports the :class:`RoundResult` fields for what happened in it (prompts
    whose allocation completed, requests that finished, hits, evictions, preemptions,
    scheduler CPU) plus the *window* fields. After the last window the remaining
    requests run to completion (the drain, not a round).

    Returns:
        ``(rounds, drain)``.

    Raises:
        ValueError: an async workload, or a request that does not fit the pool.
        RuntimeError: the scheduler stalled, or a prompt was never fully allocated.
    """
    windows = iter_stream(scheduler, probe, workload, seed, pool, save_tables)
    rounds: list[RoundResult] = []
    while True:
        try:
            rounds.append(next(windows))
        except StopIteration as stop:
            return rounds, stop.value
        if on_round is not None:
            on_round(len(rounds) - 1)
