"""Timing of paged attention per layout and batch (``python -m kvpool locality``)."""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvpool.tools.locality import kernels
from kvpool.tools.locality.layouts import layout_tables
from kvpool.tools.replay import metrics

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Geometry:
    """The KV cache timed: per layer, K and V of ``[num_blocks, block_size, num_kv_heads, head_size]``."""

    num_blocks: int
    block_size: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    num_heads: int = 32
    num_layers: int = 1
    dtype: str = "bf16"

    def bytes_per_layer(self) -> int:
        """K + V bytes of one layer."""
        elem = torch.tensor([], dtype=DTYPES[self.dtype]).element_size()
        return 2 * self.num_blocks * self.block_size * self.num_kv_heads * self.head_size * elem


@dataclass(frozen=True)
class Batch:
    """``num_requests`` equal requests: ``context_len`` tokens in the cache, the last
    ``query_len`` of them queried (``phase`` ``"prefill"``: all; ``"decode"``: one)."""

    phase: str
    num_requests: int
    context_len: int

    @property
    def query_len(self) -> int:
        return self.context_len if self.phase == "prefill" else 1

    def blocks_per_request(self, block_size: int) -> int:
        return math.ceil(self.context_len / block_size)

    @property
    def name(self) -> str:
        what = "ISL" if self.phase == "prefill" else "context"
        return f"{self.phase} {self.num_requests} x {what} {self.context_len}"


@dataclass
class Timing:
    layout: str
    batch: Batch
    times_s: list[float] = field(default_factory=list)
    contiguity: float | None = None
    mean_run_length: float | None = None
    recorded_fraction: float = 1.0
    max_abs_diff_vs_reference: float | None = None


def _quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, total_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


class _Timer:
    """Wall time of one call; on CUDA, events around it after an L2 flush (so a batch
    whose K/V fits in L2 is not timed hot), the flush also hiding the launch."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            self.flush = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.int32, device=device)

    def __call__(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _kv_caches(g: Geometry, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, ``(num_blocks, block_size, num_kv_heads, head_size)``
    each, filled with finite random values (they do not matter for timing)."""
    caches = []
    for _ in range(g.num_layers):
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_size)
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty(shape, dtype=dtype, device=device)
        for t in (k, v):
            t.normal_()
        caches.append((k, v))
    return caches


def run(
    geometry: Geometry,
    batches: Sequence[Batch],
    layouts: Sequence[str],
    *,
    device: torch.device,
    kernel: str,
    warmup: int,
    reps: int,
    seed: int = 0,
    replay_orders: dict[str, list[list[int]]] | None = None,
    check: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> list[Timing]:
    """Time ``kernel`` (``"flex"`` or ``"reference"``) for every batch and layout.

    Per batch: the query is drawn once, every layout's tables are built, then ``reps``
    rounds each time one forward (all ``num_layers`` layers) per layout, layouts
    interleaved so that drift and other load hit them alike. ``warmup`` untimed calls per
    layout come first (on CUDA the first one compiles the kernel for the batch shape).

    Returns:
        one :class:`Timing` per (batch, layout), ``times_s`` in seconds per forward.

    Raises:
        kvpool.tools.locality.layouts.LayoutError: a batch does not fit the pool.
        ValueError: a prefill ISL that is not a multiple of 16 with the flex kernel.
    """
    g = geometry
    dtype = DTYPES[g.dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    log(f"filling {g.num_layers} layer(s) of K/V: {g.bytes_per_layer() / 2**30:.2f} GiB per layer")
    caches = _kv_caches(g, dtype, device)
    timer = _Timer(device)
    out: list[Timing] = []
    for batch in batches:
        n = batch.blocks_per_request(g.block_size)
        q = torch.randn((batch.num_requests * batch.query_len, g.num_heads, g.head_size),
                        generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        tables: dict[str, torch.Tensor] = {}
        timings: dict[str, Timing] = {}
        for layout in layouts:
            t, recorded = layout_tables(layout, batch.num_requests, n, g.num_blocks,
                                        seed=seed, replay_orders=replay_orders)
            tables[layout] = kernels.tables_tensor(t, device)
            timings[layout] = Timing(layout, batch, contiguity=metrics.contiguity(t),
                                     mean_run_length=metrics.mean_run_length(t), recorded_fraction=recorded)
        if kernel == "flex":
            flex = kernels.FlexPagedAttention(batch.num_requests, batch.query_len, batch.context_len,
                                              g.num_blocks, g.block_size, device)

            def select(layout: str, flex=flex, tables=tables, q=q) -> Callable[[], Any]:
                flex.set_block_table(tables[layout])
                return lambda: [flex(q, k, v) for k, v in caches]
        else:
            def select(layout: str, tables=tables, q=q, batch=batch) -> Callable[[], Any]:
                bt = tables[layout]
                return lambda: [kernels.reference_paged_attention(q, k, v, bt, batch.query_len, batch.context_len)
                                for k, v in caches]

        log(f"{batch.name}: {batch.num_requests * n} blocks, warm-up")
        t0 = time.perf_counter()
        for layout in layouts:
            fn = select(layout)
            for _ in range(warmup):
                timer(fn)
            if check:
                k, v = caches[0]
                got = fn()[0].float()
                want = kernels.reference_paged_attention(q, k, v, tables[layout], batch.query_len, batch.context_len)
                timings[layout].max_abs_diff_vs_reference = (got - want.float()).abs().max().item()
                del got, want
        log(f"{batch.name}: warm-up {time.perf_counter() - t0:.1f} s, timing {reps} x {len(layouts)} layouts")
        for _ in range(reps):
            for layout in layouts:
                timings[layout].times_s.append(timer(select(layout)))
        out.extend(timings.values())
    return out


def results_json(timings: Sequence[Timing]) -> list[dict[str, Any]]:
    """Result rows: ``median_s``, ``q1_s``/``q3_s``/``iqr_s`` (seconds per forward),
    ``ratio_vs_canonical`` (median over the canonical layout's median, same batch)."""
    base = {}
    for t in timings:
        if t.layout == "canonical":
            base[t.batch] = _quantiles(t.times_s)[1]
    rows = []
    for t in timings:
        q1, med, q3 = _quantiles(t.times_s)
        b = base.get(t.batch)
        rows.append({
            "layout": t.layout,
            "phase": t.batch.phase,
            "batch": t.batch.name,
            "num_requests": t.batch.num_requests,
            "context_tokens": t.batch.context_len,
            "query_tokens_per_request": t.batch.query_len,
            "median_s": med,
            "q1_s": q1,
            "q3_s": q3,
            "iqr_s": q3 - q1,
            "ratio_vs_canonical": med / b if b else None,
            "reps": len(t.times_s),
            "times_s": t.times_s,
            "contiguity": t.contiguity,
            "mean_run_length": t.mean_run_length,
            "recorded_fraction": t.recorded_fraction,
            "max_abs_diff_vs_reference": t.max_abs_diff_vs_reference,
        })
    return rows


def geometry_json(g: Geometry) -> dict[str, Any]:
    return {**asdict(g), "kv_bytes_per_layer": g.bytes_per_layer()}
