"""The continuous P/D workload (``pd-serving``): a prefill stream and a decode stream in
lockstep, each on its own scheduler and pool, nothing reset between windows.

Every engine step runs one step of each side. The prefill side is a ``serving`` stream
whose requests stop after their first token (synchronous scheduling, prefix caching on, so
shared system prompts hit its cache). A prompt whose prefill completed in a step arrives on
the decode side in the same step, where vLLM's ``DecodeBenchConnector`` (``kv_consumer``)
supplies its KV as an external load under async scheduling (two batches in flight, deferred
block frees; ``EngineCore.step_with_batch_queue``, vLLM 0.34.0). The transfer of a prompt
pairs its prefill-side table with its decode-side table, from the first block the decode
side did not hit in its own prefix cache (vLLM's ``NixlConnector`` reads only those:
``get_num_new_matched_tokens`` counts from the local hit) to the end of the prompt.

Not modelled: the prefill side frees a prompt's blocks when its request finishes, where
vLLM's ``NixlConnector`` holds them until the decode side has read them
(``request_finished`` returns ``delay_free_blocks``).
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Generator
from dataclasses import replace
from typing import Any

from kvpool.tools.replay import metrics
from kvpool.tools.replay.engine import PoolSpec
from kvpool.tools.replay.loop import MAX_STALLED_STEPS, _stalled, _Stream, check_fits
from kvpool.tools.replay.probe import RoundProbe
from kvpool.tools.replay.results import DrainResult, RoundResult
from kvpool.tools.replay.workloads import Workload


class _DecodeStream(_Stream):
    """The decode side: its arrivals are the prefill side's completions (:meth:`arrive`),
    its steps keep two batches in flight (:meth:`engine_step`)."""

    def __init__(self, scheduler, probe: RoundProbe, workload: Workload, seed: int, pool: PoolSpec,
                 save_tables: bool) -> None:
        super().__init__(scheduler, probe, workload, seed, pool, save_tables)
        self.index = {rid: k for k, rid in enumerate(self.factory.request_ids)}
        self.queue: deque = deque()
        #: request id -> prompt tokens the decode side found in its own prefix cache: the
        #: local hit the scheduler hands ``KVConnectorBase_V1.get_num_new_matched_tokens``
        #: (block-aligned; the last call before the request was scheduled).
        self.local_hit: dict[str, int] = {}
        connector = scheduler.connector
        matched = connector.get_num_new_matched_tokens

        def get_num_new_matched_tokens(request, num_computed_tokens):
            self.local_hit[request.request_id] = num_computed_tokens
            return matched(request, num_computed_tokens)
        connector.get_num_new_matched_tokens = get_num_new_matched_tokens

    def arrive(self, request_ids: list[str]) -> None:
        """Add the requests whose prefill completed (ids of the prefill side's factory,
        the same ids, prompts and output lengths here)."""
        for rid in request_ids:
            k = self.index[rid]
            req = self.factory.make(k)
            self.scheduler.add_request(req)
            self.stepper.expect_prompt(req, self.factory.specs[k].prompt_len)
            self.window.arrivals += 1
            self.next_k += 1

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self.queue)

    def engine_step(self) -> None:
        """One engine step of ``step_with_batch_queue``: schedule when there is work (and
        return at once while the queue is not full), else process the oldest batch."""
        w, scheduler, queue = self.window, self.scheduler, self.queue
        w.steps += 1
        self.step += 1
        if scheduler.has_requests():
            in_flight = len(scheduler.requests)
            so, dt = self.stepper.schedule()
            w.saw(in_flight, len(scheduler.running))
            if so.total_num_scheduled_tokens == 0 and not queue:
                w.idle += 1
                self.stalled += 1
            else:
                self.stalled = 0
            if so.scheduled_new_reqs:
                w.prefill_cpu += dt
            w.sched_cpu += dt
            queue.appendleft(so)
            if len(queue) < 2 and (so.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                return
        if queue:
            w.sched_cpu += self.stepper.update(queue.pop())


class PdStream:
    """Both sides of ``pd-serving`` (see the module), advanced one engine step at a time.

    ``nixl``: a :class:`kvpool.tools.replay.nixl.NixlTransfer` through which every transferred
    prompt is also read (its ``nixl_*`` fields per window)."""

    def __init__(self, prefill_scheduler, scheduler, workload: Workload, seed: int, pool: PoolSpec,
                 save_tables: bool = False, nixl=None) -> None:
        self.prefill = _Stream(prefill_scheduler, RoundProbe(prefill_scheduler, per_group=pool.resolved),
                               workload.prefill, seed, pool, False)
        self.decode = _DecodeStream(scheduler, RoundProbe(scheduler, per_group=pool.resolved), workload, seed,
                                    pool, save_tables)
        self.nixl, self.pool, self.workload = nixl, pool, workload
        #: request id -> the prefill side's prompt table, until the decode side's is recorded.
        self.prefill_tables: dict[str, list[int]] = {}
        self.handed = 0  # prompts of the prefill side's current window already handed over
        self.rounds: list[RoundResult] = []
        self.step = 0

    def hand_over(self) -> None:
        """The prompts the prefill side completed since the last call arrive on the decode side."""
        tables = self.prefill.stepper.prompt_tables
        if len(tables) == self.handed:
            return
        new = list(tables)[self.handed:]
        self.handed = len(tables)
        for rid in new:
            self.prefill_tables[rid] = tables[rid]
        self.decode.arrive(new)

    def advance(self) -> bool:
        """One engine step of each side; False (nothing run) once both are done."""
        p, d = self.prefill, self.decode
        p.admit()
        if p.scheduler.has_requests():
            p.engine_step()
            self.hand_over()
        elif p.next_k < len(p.factory) or d.busy():
            p.idle_step()
        else:
            return False
        if d.busy():
            d.engine_step()
        else:
            d.idle_step()
        self.step += 1
        return True

    def _pairs(self, decode_tables: dict[str, list[int]]) -> list[tuple[list[int], list[int]]]:
        """Per prompt allocated on the decode side: ``(prefill blocks, decode blocks)`` the
        transfer moves (the blocks past the decode side's local prefix-cache hit)."""
        stepper = self.decode.stepper
        block_size = stepper.group_block_sizes[stepper.primary]
        out = []
        for rid, d_table in decode_tables.items():
            p_table = self.prefill_tables.pop(rid)
            skip = self.decode.local_hit.pop(rid, 0) // block_size
            out.append((p_table[skip:], d_table[skip:]))
        return out

    def close_window(self) -> RoundResult:
        self.prefill.close_window()
        self.handed = 0
        prefill = self.prefill.rounds[-1]
        pairs = self._pairs(self.decode.stepper.prompt_tables)
        probe = self.decode.probe  # (its deferred frees, before the window's close resets it)
        deferred = {"deferred_frees": probe.deferred_frees, "deferred_blocks": probe.deferred_blocks,
                    "drain_calls": probe.drain_calls, "drain_cpu_s": probe.drain_cpu}
        self.decode.close_window()
        result = self.decode.rounds[-1]
        pd = metrics.spread([metrics.pd_descriptors(p, d) for p, d in pairs])
        fields: dict[str, Any] = {}
        if self.nixl is not None:
            from kvpool.tools.replay.nixl import round_fields

            fields = round_fields(self.nixl, [p for p, _ in pairs], [d for _, d in pairs])
        result = replace(
            result, **fields, **deferred,
            prefill_prompt_descriptors_median=prefill.prompt_descriptors_median,
            prefill_prompt_descriptors_total=prefill.prompt_descriptors_total,
            prefill_evictions=prefill.evictions, prefill_prefix_cache_hit_tokens=prefill.prefix_cache_hit_tokens,
            prefill_preemptions=prefill.preemptions, prefill_leaked_blocks=prefill.leaked_blocks,
            pd_descriptors_median=pd["median"], pd_descriptors_p90=pd["p90"], pd_descriptors_max=pd["max"],
            pd_descriptors_total=pd["total"])
        self.rounds.append(result)
        return result

    def drain_result(self) -> DrainResult:
        """The decode side's drain; raises ``RuntimeError`` when the prefill side leaked."""
        side = self.prefill.drain_result(0)
        if side.leaked_blocks:
            raise RuntimeError(f"pd-serving: the prefill side's pool lost {side.leaked_blocks} blocks")
        return self.decode.drain_result(self.workload.num_rounds * self.workload.window_steps)


def iter_pd_stream(prefill_scheduler, scheduler, workload: Workload, seed: int, pool: PoolSpec,
                   save_tables: bool = False, nixl=None) -> Generator[RoundResult, None, DrainResult]:
    """:func:`~.loop.iter_stream` for a continuous P/D workload (``workload.prefill`` is
    the prefill side, run on ``prefill_scheduler``; ``workload`` the decode side, run on
    ``scheduler``): yields each window's decode-side :class:`RoundResult` with the
    prefill side's ``prefill_*`` fields, the transfer's ``pd_descriptors_*`` and, with
    ``nixl``, NIXL's ``nixl_*``; returns the decode side's :class:`DrainResult`.

    Raises:
        ValueError: at once: a request that does not fit the pool, or a workload that is
            not continuous or has no prefill side.
        RuntimeError: from ``next()``: a side stalled, a prompt was never fully allocated,
            or the prefill side's pool lost blocks.
    """
    if not workload.continuous or workload.prefill is None:
        raise ValueError("iter_pd_stream runs a continuous workload with a prefill side (pd-serving)")
    check_fits(workload.requests, pool, "pd-serving")
    return _pd_windows(PdStream(prefill_scheduler, scheduler, workload, seed, pool, save_tables, nixl))


def _pd_windows(s: PdStream) -> Generator[RoundResult, None, DrainResult]:
    window, num_rounds = s.workload.window_steps, s.workload.num_rounds
    gc.collect()
    s.prefill.new_window()
    s.decode.new_window()
    while True:
        if s.step == (len(s.rounds) + 1) * window and len(s.rounds) < num_rounds:
            yield s.close_window()
        for side, name in ((s.prefill, "prefill side"), (s.decode, "decode side")):
            if side.stalled > MAX_STALLED_STEPS:
                raise _stalled(f"{name}, step {s.step}", side.stalled, side.scheduler, s.pool,
                               "workload's requests in flight")
        if not s.advance():
            break
    while len(s.rounds) < num_rounds:  # a trace that ends before its last window
        yield s.close_window()
    for side in (s.prefill, s.decode):
        if side.stepper.awaiting_prompt:
            raise RuntimeError(f"prompts never fully allocated: {sorted(side.stepper.awaiting_prompt)[:5]}")
    return s.drain_result()
