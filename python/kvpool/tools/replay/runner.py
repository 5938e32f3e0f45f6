"""A workload through each mode: a fresh scheduler per mode, the modes' rounds interleaved,
the calls between rounds.

Every mode calls ``scheduler.reset_prefix_cache()`` between the rounds of a round-based
workload (what the RFC's driver does after a weight update), ``kvpool+reorder`` then
``reset_free_block_queue_order()``. A continuous workload (``serving``) never drains:
its rounds are windows of engine steps, with no reset.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from kvpool.tools.replay import metrics, modes as _modes
from kvpool.tools.replay.engine import PoolSpec, build_scheduler
from kvpool.tools.replay.loop import iter_stream, run_round
from kvpool.tools.replay.modes import Mode, ModeUnavailable
from kvpool.tools.replay.pd_stream import iter_pd_stream
from kvpool.tools.replay.probe import RoundProbe
from kvpool.tools.replay.results import ModeInfo, ModeResult, RoundResult
from kvpool.tools.replay.workloads import Workload

_thread_time = time.thread_time


def _qualname(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def warm_up(workload: Workload, pool: PoolSpec, seed: int) -> None:
    """Run a throwaway scheduler through a few short requests of the same engine shape,
    so that one-time costs (lazy imports, first-call paths, allocator growth) do not land
    in the first measured round of whichever mode runs first."""
    first = workload.round_requests(0)[:4]
    block = pool.smallest_block  # (not the scheduler's block: an LCM of the groups' with --model)
    # (a --model run keeps the workload's max_model_len: it sizes a Mamba group's block with
    # prefix caching off, and so the scheduler's block size, which the pool was resolved with;
    # the hand-built group's warm-up stays as it was)
    engine = replace(workload.engine, max_model_len=workload.max_model_len()) if pool.resolved else workload.engine
    tiny = replace(
        workload,
        engine=engine,
        continuous=False,
        requests=[replace(r, prompt_len=min(r.prompt_len, 4 * block + 1),
                          output_len=min(r.output_len, 2 * block), arrival_step=0)
                  for r in first],
    )
    tiny_pool = replace(pool, num_blocks=min(pool.num_blocks, 4096))
    scheduler = build_scheduler(tiny, tiny_pool)
    run_round(scheduler, RoundProbe(scheduler, per_group=pool.resolved), tiny, 0, seed, tiny_pool)


def _mode_info(mode: Mode, scheduler, pool: PoolSpec, reorder_name: str | None) -> ModeInfo:
    block_pool = scheduler.kv_cache_manager.block_pool
    info = ModeInfo(
        kvpool_installed=_modes.kvpool_installed(),
        scheduler_class=_qualname(scheduler),
        block_pool_class=_qualname(block_pool),
        free_block_queue_class=_qualname(getattr(block_pool, "free_block_queue", None)),
        defer_block_free=bool(scheduler.defer_block_free),
        reorder_api=reorder_name,
        num_blocks=pool.num_blocks,
    )
    if mode.uses_kvpool:
        # What was asked, and what the pool says it does (kvpool's BlockPool.allocation).
        info.allocation = mode.allocation
        info.pool_allocation = getattr(block_pool, "allocation", None)
        if mode.allocation != "vllm" and info.pool_allocation != mode.allocation:
            raise ModeUnavailable(
                f"kvpool.install(allocation={mode.allocation!r}) built a pool whose allocation is "
                f"{info.pool_allocation!r}")
        if mode.lru_window:
            info.lru_window = block_pool.free_block_queue.policy.lru_window
            if info.lru_window != mode.lru_window:
                raise ModeUnavailable(
                    f"kvpool.install(lru_window={mode.lru_window}) built a pool whose LRU window is "
                    f"{info.lru_window}")
    return info


def _between_rounds(scheduler, reorder: Callable[[], bool] | None) -> dict:
    """``reset_prefix_cache()``, then the reorder: their results and CPU seconds."""
    t0 = _thread_time()
    between = {"reset_ok": bool(scheduler.reset_prefix_cache()), "reset_cpu_s": _thread_time() - t0}
    if reorder is not None:
        t0 = _thread_time()
        between["reorder_ok"] = bool(reorder())
        between["reorder_cpu_s"] = _thread_time() - t0
    return between


class ModeRun:
    """One mode's scheduler (and P/D prefill-side scheduler), advanced one round at a
    time, so that :func:`run_replay` can interleave the modes (round 0 of every mode,
    then round 1, ...): a change of the machine's speed during a run then reaches every
    mode alike, as in ``benchmarks/test_replay_bench.py``.

    Built under its mode (:func:`~.modes.set_mode`, the warm-up, the schedulers); the
    caller sets the mode again before each :meth:`next_round` (kvpool's class patches
    are process-wide).

    Raises:
        ModeUnavailable: kvpool is needed but not importable, or has no reorder API.
    """

    def __init__(self, mode: str | Mode, workload: Workload, pool: PoolSpec, seed: int,
                 save_tables: bool = False, nixl=None) -> None:
        self.mode = mode = _modes.get(mode)
        self._nixl = nixl  # P/D: each prompt also read through this NixlTransfer
        self.rounds: list[RoundResult] = []
        _modes.set_mode(mode)
        wall0 = time.perf_counter()
        warm_up(workload, pool, seed)
        self._side = self._side_reorder = None
        if workload.prefill is not None:  # P/D: the prefill side, on its own pool
            self._side = _modes.build_for_mode(mode, lambda: build_scheduler(workload.prefill, pool))
            self._side_reorder = _modes.reorder_api(self._side)[0] if mode.reorder else None
        #: The (decode-side) scheduler the rounds run on.
        self.scheduler = scheduler = _modes.build_for_mode(mode, lambda: build_scheduler(workload, pool))
        reorder, reorder_name = _modes.reorder_api(scheduler) if mode.reorder else (None, None)
        self.info = _mode_info(mode, scheduler, pool, reorder_name)
        self._steps = self._run(workload, pool, seed, scheduler, reorder, save_tables)
        self.info.wall_s = time.perf_counter() - wall0

    def _run(self, workload: Workload, pool: PoolSpec, seed: int, scheduler,
             reorder: Callable[[], bool] | None, save_tables: bool) -> Iterator[RoundResult]:
        if workload.continuous and self._side is not None:  # pd-serving: both sides, one stream
            self.info.drain = yield from iter_pd_stream(self._side, scheduler, workload, seed, pool,
                                                        save_tables=save_tables, nixl=self._nixl)
            return
        probe = RoundProbe(scheduler, per_group=pool.resolved)
        if workload.continuous:
            self.info.drain = yield from iter_stream(scheduler, probe, workload, seed, pool,
                                                     save_tables=save_tables)
            return
        side_probe = RoundProbe(self._side, per_group=pool.resolved) if self._side is not None else None
        for rnd in range(workload.num_rounds):
            prefill = None
            if self._side is not None:
                if rnd > 0:
                    _between_rounds(self._side, self._side_reorder)
                prefill = run_round(self._side, side_probe, workload.prefill, rnd, seed, pool, save_tables=True)
            between = _between_rounds(scheduler, reorder) if rnd > 0 else {}
            result = run_round(scheduler, probe, workload, rnd, seed, pool,
                               save_tables=save_tables or prefill is not None)
            result = replace(result, **between)
            if prefill is not None:
                result = _with_prefill_side(result, prefill, save_tables, self._nixl)
            yield result

    def next_round(self) -> bool:
        """Run the next round (window; after the last window, a stream's drain) and
        append it to :attr:`rounds`; False, running nothing more, once all have run.

        As vLLM's engine core does once it has started (``freeze_gc_heap``), the objects
        alive before the round (every mode's schedulers and pools among them) are frozen
        out of the garbage collector while it runs, so that a collection's cost does not
        depend on how many modes the run holds."""
        wall0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        try:
            self.rounds.append(next(self._steps))
            return True
        except StopIteration:
            return False
        finally:
            gc.unfreeze()
            self.info.wall_s += time.perf_counter() - wall0

    def result(self) -> ModeResult:
        return ModeResult(info=self.info, rounds=self.rounds)


def run_mode(mode: str | Mode, workload: Workload, pool: PoolSpec, seed: int,
             on_round: Callable[[str, int], None] | None = None, save_tables: bool = False) -> ModeResult:
    """Run every round of ``workload`` in ``mode`` on a fresh scheduler (one
    :class:`ModeRun` to its end).

    ``save_tables``: keep each round's per-request block tables (see :func:`~.loop.run_round`).

    Raises:
        ModeUnavailable: kvpool is needed but not importable, or has no reorder API.
    """
    run = ModeRun(mode, workload, pool, seed, save_tables)
    while run.next_round():
        if on_round is not None:
            on_round(run.mode.name, len(run.rounds) - 1)
    return run.result()


def _with_prefill_side(decode: RoundResult, prefill: RoundResult, save_tables: bool, nixl=None) -> RoundResult:
    """The decode side's round with the prefill side's figures and the P/D transfer's:
    each request's prompt table on both sides (the same requests, in request order);
    with ``nixl`` (a :class:`kvpool.tools.replay.nixl.NixlTransfer`) each prompt is also read
    through it, NIXL's figures in the ``nixl_*`` fields."""
    p_tables, d_tables = prefill.tables["prompt"], decode.tables["prompt"]
    if len(p_tables) != len(d_tables):
        raise RuntimeError(f"round {decode.round}: {len(p_tables)} prefill-side prompts, {len(d_tables)} decode-side")
    pd = metrics.spread([metrics.pd_descriptors(p, d) for p, d in zip(p_tables, d_tables)])
    if nixl is not None:
        from kvpool.tools.replay.nixl import round_fields

        decode = replace(decode, **round_fields(nixl, p_tables, d_tables))
    return replace(
        decode,
        prefill_prompt_descriptors_median=prefill.prompt_descriptors_median,
        prefill_prompt_descriptors_total=prefill.prompt_descriptors_total,
        prefill_evictions=prefill.evictions, prefill_prefix_cache_hit_tokens=prefill.prefix_cache_hit_tokens,
        prefill_preemptions=prefill.preemptions, prefill_leaked_blocks=prefill.leaked_blocks,
        pd_descriptors_median=pd["median"], pd_descriptors_p90=pd["p90"], pd_descriptors_max=pd["max"],
        pd_descriptors_total=pd["total"],
        tables={**decode.tables, "prefill_prompt": p_tables} if save_tables else None,
    )


def run_replay(workload: Workload, pool: PoolSpec, modes: tuple[str, ...] = _modes.MODES, seed: int = 0,
               on_round: Callable[[str, int], None] | None = None,
               on_skip: Callable[[str, str], None] | None = None,
               save_tables: bool = False, nixl: bool = False) -> dict[str, ModeResult]:
    """Run ``workload`` in each of ``modes``, the modes' rounds interleaved (round 0 of
    every mode, then round 1, ...: :class:`ModeRun`); kvpool is uninstalled afterwards.

    ``save_tables``: keep each round's per-request block tables (see :func:`~.loop.run_round`).
    ``nixl``: a P/D workload's prompts are also read through the real NIXL, one agent
    pair shared by the modes (:mod:`kvpool.tools.replay.nixl`).

    Returns:
        mode name -> :class:`ModeResult`, in the order of ``modes``; a mode that cannot
        run (:class:`ModeUnavailable`) is reported as skipped, not raised.

    Raises:
        ValueError: ``nixl`` for a workload without a prefill side.
        kvpool.tools.replay.nixl.NixlUnavailable: ``nixl`` where NIXL does not import.
    """
    results: dict[str, ModeResult] = {}
    runs: dict[str, ModeRun] = {}
    transfer = None
    if nixl:
        if workload.prefill is None:
            raise ValueError("--nixl needs a P/D workload (--workload pd or pd-serving): the prompts it moves are "
                             "the prefill side's")
        from kvpool.tools.replay.nixl import NixlTransfer

        transfer = NixlTransfer(pool.num_blocks)
    try:
        for mode in modes:
            try:
                runs[str(mode)] = ModeRun(mode, workload, pool, seed, save_tables, transfer)
                results[str(mode)] = None  # (its place in the order of modes)
            except ModeUnavailable as e:
                results[str(mode)] = ModeResult(skipped=str(e))
                if on_skip is not None:
                    on_skip(str(mode), str(e))
        active = list(runs.items())
        while active:
            for name, run in list(active):
                _modes.set_mode(run.mode)
                if not run.next_round():
                    active.remove((name, run))
                elif on_round is not None:
                    on_round(name, len(run.rounds) - 1)
    finally:
        _modes.restore_vanilla()
        if transfer is not None:
            transfer.close()
    for name, run in runs.items():
        results[name] = run.result()
    return results
