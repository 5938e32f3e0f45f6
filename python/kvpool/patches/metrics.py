"""Block-pool fragmentation as Prometheus metrics on vLLM's own ``/metrics``.

vLLM 0.30.0–0.34.0 move metrics from the engine core to the API server in
``SchedulerStats``: ``Scheduler.make_stats()`` builds one per step (when stats are
logged), it travels inside ``EngineCoreOutputs`` (msgspec over ZMQ, or in process), and
the frontend's ``StatLoggerManager`` hands it to every stat logger's ``record()``,
``PrometheusStatLogger`` among them, whose gauges live in prometheus_client's registry
that vLLM's ``/metrics`` route serves. kvpool adds its numbers to that same path, as
vLLM would add a metric of its own (see docs/metrics.md):

- **engine core**: ``Scheduler.make_stats`` is wrapped to attach
  ``block_pool.fragmentation_stats()`` (kvpool's ``BlockPool``; any allocation policy)
  to the ``SchedulerStats`` as ``kvpool_fragmentation`` (``dict[str, float]``), at most
  once per ``KVPOOL_METRICS_INTERVAL_S`` seconds (default 1.0; the ``table_*`` values
  cover the tables extended since the previous attachment);
- **the message**: ``SchedulerStats`` gets a real dataclass field of that name
  (``init=False``, default ``None``), so msgspec encodes and decodes it. msgspec caches
  a type's layout when the first decoder for it is built, so the field must exist
  before the frontend builds its ``EngineCoreOutputs`` decoder: kvpool's plugin installs
  while vLLM parses its command line, long before that. Either side without kvpool
  ignores or leaves out the field;
- **frontend**: ``PrometheusStatLogger.__init__`` also creates kvpool's gauges (after
  vLLM has unregistered stale ``vllm:`` collectors), with vLLM's own labels
  (``model_name``, ``engine``) and gauge/counter classes (so the Ray subclass gets Ray
  metrics), and ``record()`` sets them from ``scheduler_stats.kvpool_fragmentation``.

Metrics (per engine):

=====================================  =================================================
``vllm:kvpool_free_blocks``            free blocks (gauge)
``vllm:kvpool_free_runs``              maximal runs of consecutive free block ids (gauge)
``vllm:kvpool_largest_free_run_blocks``  longest such run, blocks (gauge)
``vllm:kvpool_table_contiguity``       fraction of adjacent pairs of the block tables
                                       freed in the last interval with next id = previous + 1
``vllm:kvpool_descending_fraction``    same, next id = previous - 1
``vllm:kvpool_mean_run_length_blocks`` mean ascending run length of those tables
``vllm:kvpool_table_pairs_total``      adjacent pairs of the freed tables (counter)
``vllm:kvpool_table_ascending_pairs_total``  of which next id = previous + 1 (counter)
``vllm:kvpool_mean_descriptors_per_table``  KV transfer descriptors (ascending runs) per
                                       table freed in the last interval (gauge)
``vllm:kvpool_table_descriptors_total``  descriptors of the freed tables (counter)
``vllm:kvpool_tables_freed_total``     freed tables, one per request and KV cache group
=====================================  =================================================

The four table gauges keep their last value through intervals in which no table was
freed (the three pair-based ones: no table of two blocks or more); the counters give
the exact ratios over any PromQL window (descriptors per table:
``rate(..._table_descriptors_total) / rate(..._tables_freed_total)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from typing import Any

from kvpool import envs

logger = logging.getLogger("vllm.kvpool")

#: ``SchedulerStats`` attribute carrying ``BlockPool.fragmentation_stats()``.
STATS_FIELD = "kvpool_fragmentation"
#: Seconds between two reads of the pool in the engine core (float; 0: every step).
INTERVAL_ENV = envs.METRICS_INTERVAL_S
DEFAULT_INTERVAL_S = envs.VARIABLES[INTERVAL_ENV].default

#: (metric name, ``fragmentation_stats()`` key, help text, set only when tables grew)
GAUGES: tuple[tuple[str, str, str, bool], ...] = (
    ("vllm:kvpool_free_blocks", "free_blocks",
     "Free KV cache blocks in kvpool's block pool.", False),
    ("vllm:kvpool_free_runs", "free_runs",
     "Maximal runs of consecutive free KV cache block ids in kvpool's block pool.", False),
    ("vllm:kvpool_largest_free_run_blocks", "largest_free_run",
     "Longest run of consecutive free KV cache block ids, in blocks.", False),
    ("vllm:kvpool_table_contiguity", "table_contiguity",
     ("Fraction of the adjacent pairs of the block tables freed since the previous report "
      "whose next block id is the previous + 1."), True),
    ("vllm:kvpool_descending_fraction", "descending_fraction",
     ("Fraction of the adjacent pairs of the block tables freed since the previous report "
      "whose next block id is the previous - 1."), True),
    ("vllm:kvpool_mean_run_length_blocks", "mean_run_length",
     ("Mean length, in blocks, of the ascending runs of consecutive block ids of the "
      "request block tables freed since the previous report."), True),
    ("vllm:kvpool_mean_descriptors_per_table", "mean_descriptors_per_table",
     ("Mean KV transfer descriptors (ascending runs of consecutive block ids) per request "
      "block table (one per KV cache group) freed since the previous report."), True),
)
#: (metric name without ``_total``, help text); incremented by the pairs of each report.
COUNTERS: tuple[tuple[str, str], ...] = (
    ("vllm:kvpool_table_pairs", "Adjacent pairs of the request block tables freed."),
    ("vllm:kvpool_table_ascending_pairs",
     "Adjacent pairs of the request block tables freed whose next block id is the previous + 1."),
)
#: (metric name without ``_total``, ``fragmentation_stats()`` key, help text): counters
#: incremented by a key's value of each report (absent from an older engine's: 0).
TABLE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("vllm:kvpool_table_descriptors", "table_descriptors",
     ("KV transfer descriptors of the request block tables freed: maximal runs of block ids "
      "ascending by exactly 1 (what NIXL posts per memory region; vLLM PR #55841).")),
    ("vllm:kvpool_tables_freed", "tables_freed",
     "Request block tables freed (one per request and KV cache group, preemptions included)."),
)
#: A gauge of these keys is set when the report's tables count is positive (a table
#: of one block has no pair); the other ``tables_only`` gauges when it has pairs.
_SET_WHEN_TABLES = frozenset({"mean_descriptors_per_table"})


def _interval_s() -> float:
    # Checked by install() (kvpool.envs.validate), so a bad value stops the engine at
    # start-up rather than here, in a step.
    return envs.get(INTERVAL_ENV)


def pool_snapshot(scheduler, now: float | None = None) -> dict[str, float] | None:
    """``fragmentation_stats()`` of ``scheduler``'s block pool, at most once per interval.

    Args:
        scheduler: a vLLM ``Scheduler`` (any subclass).
        now: ``time.monotonic()`` (for tests).

    Returns:
        The stats (a new ``table_*`` window starts), or ``None`` when the pool has no
        ``fragmentation_stats`` (vLLM's own pool), is a ``BlockPool`` subclass that
        skipped kvpool's ``__init__`` (``NotAKvpoolPoolError``), or the interval has not
        elapsed.
    """
    # The interval first: make_stats runs every engine step, a snapshot once a second.
    now = time.monotonic() if now is None else now
    if now < scheduler.__dict__.get("_kvpool_metrics_due", 0.0):
        return None
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    read = getattr(pool, "fragmentation_stats", None)
    if read is None or not getattr(pool, "_kvpool_native", True):
        return None  # vLLM's pool, or a subclass kvpool did not build (runs vLLM's code)
    scheduler.__dict__["_kvpool_metrics_due"] = now + _interval_s()
    return {k: float(v) for k, v in read(reset=True).items()}


class KVPoolProm:
    """kvpool's Prometheus metrics for one ``PrometheusStatLogger``: built with its
    metric classes (``_gauge_cls``, ``_counter_cls``) and labelled with its
    ``per_engine_labelvalues`` (``model_name``, ``engine``), as vLLM's own are.

    An engine's children are created at its first report, so an engine whose pool is
    vLLM's own (no ``fragmentation_stats``) exports no kvpool samples rather than zeros.
    """

    def __init__(self, stat_logger) -> None:
        labelnames = ["model_name", "engine"]
        self.per_engine_labelvalues: dict[int, list[object]] = stat_logger.per_engine_labelvalues
        self.gauges = [
            (key, tables_only, stat_logger._gauge_cls(
                name=name, documentation=doc, multiprocess_mode="mostrecent", labelnames=labelnames))
            for name, key, doc, tables_only in GAUGES
        ]
        self.pairs, self.ascending_pairs = (
            stat_logger._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS
        )
        self.table_counters = [
            (key, stat_logger._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for name, key, doc in TABLE_COUNTERS
        ]
        self._children: dict[int, tuple[list[tuple[str, bool, Any]], Any, Any]] = {}
        self._table_children: dict[int, list[tuple[str, Any]]] = {}

    def _engine(self, engine_idx: int):
        children = self._children.get(engine_idx)
        if children is None:
            values = self.per_engine_labelvalues[engine_idx]
            children = (
                [(key, tables_only, gauge.labels(*values)) for key, tables_only, gauge in self.gauges],
                self.pairs.labels(*values),
                self.ascending_pairs.labels(*values),
            )
            self._children[engine_idx] = children
            self._table_children[engine_idx] = [(key, c.labels(*values)) for key, c in self.table_counters]
        return children

    def observe(self, stats: dict[str, float], engine_idx: int) -> None:
        """Record one ``fragmentation_stats()`` of engine ``engine_idx``'s pool."""
        if engine_idx not in self.per_engine_labelvalues:
            return
        gauges, pairs_total, ascending_total = self._engine(engine_idx)
        pairs = int(stats.get("table_pairs", 0))
        tables = int(stats.get("tables_freed", 0))
        for key, tables_only, gauge in gauges:
            grew = tables > 0 if key in _SET_WHEN_TABLES else pairs > 0
            if key in stats and (grew or not tables_only):
                gauge.set(stats[key])
        if pairs > 0:
            pairs_total.inc(pairs)
            ascending_total.inc(round(stats.get("table_contiguity", 0.0) * pairs))
        for key, counter in self._table_children[engine_idx]:
            n = int(stats.get(key, 0))
            if n > 0:
                counter.inc(n)


def _stats_field() -> dataclasses.Field:
    f = dataclasses.field(default=None, init=False, repr=False, compare=False)
    f.name = STATS_FIELD
    f.type = dict[str, float] | None
    f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]  # what @dataclass sets
    return f


def _add_stats_field(patcher, cls) -> None:
    """Give ``cls`` (vLLM's ``SchedulerStats``) the dataclass field :data:`STATS_FIELD`."""
    if STATS_FIELD in cls.__dataclass_fields__:
        return
    patcher.set_attr(cls, "__dataclass_fields__", {**cls.__dataclass_fields__, STATS_FIELD: _stats_field()})
    # inspect.get_annotations: on CPython 3.14 (PEP 649) a class's annotations are not
    # in its __dict__ until something reads them (the Patcher restores them by value).
    patcher.set_attr(cls, "__annotations__", {**inspect.get_annotations(cls),
                                              STATS_FIELD: dict[str, float] | None})
    patcher.set_attr(cls, STATS_FIELD, None)  # instances built by vLLM's __init__
    # msgspec caches a dataclass's layout on the class: drop it so the next decoder
    # sees the field; uninstall() puts back the cache that was there (or drops ours).
    patcher.set_attr(cls, "__msgspec_cache__", None)
    delattr(cls, "__msgspec_cache__")


def apply(patcher) -> None:
    """Patch vLLM 0.30.0–0.34.0 so kvpool's pool metrics reach ``/metrics`` (module docstring).

    Run by ``kvpool.install()`` (``patching.PATCH_MODULES``); every change goes through
    ``patcher`` and is undone by ``uninstall()``.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    _add_stats_field(patcher, SchedulerStats)

    make_stats = Scheduler.make_stats

    def kvpool_make_stats(self, *args, **kwargs):
        stats = make_stats(self, *args, **kwargs)
        if stats is not None:
            try:
                snapshot = pool_snapshot(self)
            except Exception:  # noqa: BLE001 - metrics must never stop a step
                logger.exception("kvpool: reading fragmentation_stats() failed")
                snapshot = None
            if snapshot is not None:
                setattr(stats, STATS_FIELD, snapshot)
        return stats

    kvpool_make_stats.__wrapped__ = make_stats  # type: ignore[attr-defined]
    kvpool_make_stats.__doc__ = make_stats.__doc__
    patcher.set_attr(Scheduler, "make_stats", kvpool_make_stats)

    prom_init = PrometheusStatLogger.__init__
    prom_record = PrometheusStatLogger.record

    def kvpool_prom_init(self, *args, **kwargs):
        prom_init(self, *args, **kwargs)  # unregisters stale vllm: collectors first
        self.kvpool_prom = KVPoolProm(self)

    def kvpool_prom_record(self, scheduler_stats, iteration_stats, *args, **kwargs):
        prom_record(self, scheduler_stats, iteration_stats, *args, **kwargs)
        snapshot = getattr(scheduler_stats, STATS_FIELD, None)
        prom = getattr(self, "kvpool_prom", None)
        if snapshot and prom is not None:
            engine_idx = kwargs.get("engine_idx", args[1] if len(args) > 1 else 0)
            prom.observe(snapshot, engine_idx)

    kvpool_prom_init.__wrapped__ = prom_init  # type: ignore[attr-defined]
    kvpool_prom_record.__wrapped__ = prom_record  # type: ignore[attr-defined]
    patcher.set_attr(PrometheusStatLogger, "__init__", kvpool_prom_init)
    patcher.set_attr(PrometheusStatLogger, "record", kvpool_prom_record)


__all__ = ["COUNTERS", "GAUGES", "INTERVAL_ENV", "STATS_FIELD", "TABLE_COUNTERS", "KVPoolProm", "apply",
           "pool_snapshot"]
