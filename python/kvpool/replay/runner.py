"""A workload through each mode: a fresh scheduler per mode, the calls between rounds.

Every mode calls ``scheduler.reset_prefix_cache()`` between the rounds of a round-based
workload (what the RFC's driver does after a weight update), ``kvpool+reorder`` then
``reset_free_block_queue_order()``. A continuous workload (``serving``) never drains:
its rounds are windows of engine steps, with no reset.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from kvpool.replay import metrics
from kvpool.replay import modes as _modes
from kvpool.replay.engine import PoolSpec, build_scheduler
from kvpool.replay.loop import run_round, run_stream
from kvpool.replay.modes import Mode, ModeUnavailable
from kvpool.replay.probe import RoundProbe
from kvpool.replay.results import ModeInfo, ModeResult, RoundResult
from kvpool.replay.workloads import Workload

_thread_time = time.thread_time


def _qualname(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _warmup(workload: Workload, pool: PoolSpec, seed: int) -> None:
    """Run a throwaway scheduler through a few short requests of the same engine shape,
    so that one-time costs (lazy imports, first-call paths, allocator growth) do not land
    in the first measured round of whichever mode runs first."""
    first = workload.round_requests(0)[:4]
    tiny = replace(
        workload,
        continuous=False,
        requests=[replace(r, prompt_len=min(r.prompt_len, 4 * pool.block_size + 1),
                          output_len=min(r.output_len, 2 * pool.block_size), arrival_step=0)
                  for r in first],
    )
    tiny_pool = PoolSpec(min(pool.num_blocks, 4096), pool.block_size)
    scheduler = build_scheduler(tiny, tiny_pool)
    run_round(scheduler, RoundProbe(scheduler), tiny, 0, seed, tiny_pool)


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


def run_mode(mode: str | Mode, workload: Workload, pool: PoolSpec, seed: int,
             on_round: Callable[[str, int], None] | None = None, save_tables: bool = False) -> ModeResult:
    """Run every round of ``workload`` in ``mode`` on a fresh scheduler.

    ``save_tables``: keep each round's per-request block tables (see :func:`~.loop.run_round`).

    Raises:
        ModeUnavailable: kvpool is needed but not importable, or has no reorder API.
    """
    mode = _modes.get(mode)
    _modes.set_mode(mode)
    wall0 = time.perf_counter()
    _warmup(workload, pool, seed)
    prefill_rounds = None
    if workload.prefill is not None:  # P/D: the prefill side first, on its own pool
        side = _modes.build_for_mode(mode, lambda: build_scheduler(workload.prefill, pool))
        side_reorder = _modes.reorder_api(side)[0] if mode.reorder else None
        prefill_rounds = _run_rounds(mode, workload.prefill, pool, seed, side, side_reorder, None, True)
    scheduler = _modes.build_for_mode(mode, lambda: build_scheduler(workload, pool))
    reorder, reorder_name = _modes.reorder_api(scheduler) if mode.reorder else (None, None)
    info = _mode_info(mode, scheduler, pool, reorder_name)
    if workload.continuous:
        rounds, info.drain = run_stream(
            scheduler, RoundProbe(scheduler), workload, seed, pool,
            on_round=None if on_round is None else (lambda rnd: on_round(mode.name, rnd)),
            save_tables=save_tables,
        )
    else:
        rounds = _run_rounds(mode, workload, pool, seed, scheduler, reorder, on_round,
                             save_tables or prefill_rounds is not None)
    if prefill_rounds is not None:
        rounds = [_with_prefill_side(d, p, save_tables) for d, p in zip(rounds, prefill_rounds)]
    info.wall_s = time.perf_counter() - wall0
    return ModeResult(info=info, rounds=rounds)


def _run_rounds(mode: Mode, workload: Workload, pool: PoolSpec, seed: int, scheduler,
                reorder: Callable[[], bool] | None, on_round: Callable[[str, int], None] | None,
                save_tables: bool) -> list[RoundResult]:
    """Every round of a (not continuous) workload on ``scheduler``."""
    probe = RoundProbe(scheduler)
    rounds: list[RoundResult] = []
    for rnd in range(workload.num_rounds):
        between = _between_rounds(scheduler, reorder) if rnd > 0 else {}
        result = run_round(scheduler, probe, workload, rnd, seed, pool, save_tables=save_tables)
        rounds.append(replace(result, **between))
        if on_round is not None:
            on_round(mode.name, rnd)
    return rounds


def _with_prefill_side(decode: RoundResult, prefill: RoundResult, save_tables: bool) -> RoundResult:
    """The decode side's round with the prefill side's figures and the P/D transfer's:
    each request's prompt table on both sides (the same requests, in request order)."""
    p_tables, d_tables = prefill.tables["prompt"], decode.tables["prompt"]
    if len(p_tables) != len(d_tables):
        raise RuntimeError(f"round {decode.round}: {len(p_tables)} prefill-side prompts, {len(d_tables)} decode-side")
    pd = metrics.spread([metrics.pd_descriptors(p, d) for p, d in zip(p_tables, d_tables)])
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
               save_tables: bool = False) -> dict[str, ModeResult]:
    """Run ``workload`` in each of ``modes``; kvpool is uninstalled afterwards.

    ``save_tables``: keep each round's per-request block tables (see :func:`~.loop.run_round`).

    Returns:
        mode name -> :class:`ModeResult`; a mode that cannot run
        (:class:`ModeUnavailable`) is reported as skipped, not raised.
    """
    results: dict[str, ModeResult] = {}
    try:
        for mode in modes:
            try:
                results[str(mode)] = run_mode(mode, workload, pool, seed, on_round, save_tables=save_tables)
            except ModeUnavailable as e:
                results[str(mode)] = ModeResult(skipped=str(e))
                if on_skip is not None:
                    on_skip(str(mode), str(e))
    finally:
        _modes.restore_vanilla()
    return results
