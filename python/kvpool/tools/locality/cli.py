"""``python -m kvpool locality``: paged attention time per block-table layout.

See docs/locality.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvpool.tools import cliargs

#: Defaults per device: a real deployment's pool on a GPU (the GB10 report's 85,000 x 32
#: tokens); on CPU a pool and batches that time in about a minute on 2 cores.
DEFAULTS = {
    "cuda": {"num_blocks": 85_000, "prefill": "8192x8,1024x1", "decode": "4096x256", "warmup": 3, "reps": 20},
    "cpu": {"num_blocks": 16_384, "prefill": "2048x1,1024x1", "decode": "2048x64", "warmup": 1, "reps": 7},
}
LAYOUT_CHOICES = ("canonical", "descending", "random", "replay")


def _batches(text: str, phase: str):
    from kvpool.tools.locality.bench import Batch

    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        tokens, sep, num = part.lower().partition("x")
        if not sep or not tokens.isdigit() or not num.isdigit() or int(tokens) < 1 or int(num) < 1:
            raise argparse.ArgumentTypeError(f"expected TOKENSxREQUESTS (e.g. 8192x8), got {part!r}")
        out.append(Batch(phase, int(num), int(tokens)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvpool locality",
        description=(
            "Time paged attention over a vLLM-layout KV cache for the same requests under several "
            "block-table layouts (canonical, replay, descending, random), prefill and decode: does "
            "block-id contiguity pay on this device?"),
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default: cuda if available")
    p.add_argument("--kernel", choices=["auto", "flex", "reference"], default="auto",
                   help="flex: FlexAttention reading the block table (vLLM's FlexAttention backend's mask); "
                   "reference: gather + SDPA. Default: flex on cuda, reference on cpu")
    p.add_argument("--layouts", default=",".join(LAYOUT_CHOICES),
                   help="comma-separated of canonical,descending,random,replay,replay:MODE@ROUND "
                   "(replay: the last round of each mode in --replay-tables). Default: all four")
    p.add_argument("--replay-tables", metavar="PATH",
                   help="recorded tables: `python -m kvpool replay --save-tables --json` output or its "
                   "compact form (default: the shipped GRPO recording, 85,000 x 32-token blocks)")
    p.add_argument("--prefill", metavar="ISLxN,...",
                   help="prefill batches, ISL tokens x requests (cuda default 8192x8,1024x1; cpu 2048x1,1024x1); "
                   "'' for none")
    p.add_argument("--decode", metavar="CTXxN,...",
                   help="decode batches, context tokens x sequences (cuda default 4096x256; cpu 2048x64); '' for none")
    p.add_argument("--num-blocks", type=int, help="blocks in the pool (cuda default 85000, cpu 16384)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per block (default 32)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="default 8")
    p.add_argument("--head-size", type=int, default=128, help="default 128")
    p.add_argument("--num-heads", type=int, default=32, help="query heads (default 32, GQA over 8 KV heads)")
    p.add_argument("--layers", type=int, default=1, help="layers timed per forward, each its own K/V (default 1)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--warmup", type=int, help="untimed calls per layout and batch (cuda default 3, cpu 1)")
    p.add_argument("--reps", type=cliargs.positive_int,
                   help="timed calls per layout and batch (cuda default 20, cpu 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=cliargs.positive_int, help="torch CPU threads (default: torch's)")
    p.add_argument("--check", action="store_true",
                   help="compare each layout's output with the gather + SDPA reference before timing; "
                   "exit 1 if any differs by more than --check-tol")
    p.add_argument("--check-tol", type=float, default=0.03,
                   help="max abs difference allowed by --check (default 0.03, bf16 rounding)")
    p.add_argument("--json", metavar="PATH", type=cliargs.output_file, help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH.png", type=cliargs.plot_file,
                   help="write median time per layout and batch (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _layouts(text: str, replay_path: Path) -> list[str]:
    from kvpool.tools.locality import replay_tables

    out: list[str] = []
    for name in filter(None, (s.strip() for s in text.split(","))):
        if name == "replay":
            out += replay_tables.default_layouts(replay_path)
        elif name in LAYOUT_CHOICES or name.startswith("replay:"):
            out.append(name)
        else:
            raise ValueError(f"unknown layout {name!r}; choose from {', '.join(LAYOUT_CHOICES)} or replay:MODE@ROUND")
    if "canonical" in out:  # ratios are against canonical: time it first
        out.remove("canonical")
    return ["canonical", *dict.fromkeys(out)]


def render_table(report: dict[str, Any]) -> str:
    """The result table as text: one row per batch and layout."""
    g = report["geometry"]
    d = report["device"]
    lines = [
        f"device: {d.get('name')} ({d['type']}), torch {d['torch']}, kernel {report['kernel']}",
        (f"geometry: {g['num_blocks']} blocks x {g['block_size']} tokens, {g['num_kv_heads']} KV heads x "
         f"{g['head_size']}, {g['num_heads']} query heads, {g['dtype']}, {g['num_layers']} layer(s); "
         f"K+V {g['kv_bytes_per_layer'] / 2**30:.2f} GiB per layer"),
    ]
    head = ("batch", "layout", "median ms", "vs canonical", "IQR ms", "contiguity", "mean run")
    rows = []
    for r in report["results"]:
        rows.append((
            r["batch"], r["layout"], f"{r['median_s'] * 1e3:.3f}",
            "-" if r["ratio_vs_canonical"] is None else f"{r['ratio_vs_canonical']:.3f}x",
            f"{r['iqr_s'] * 1e3:.3f}",
            "-" if r["contiguity"] is None else f"{r['contiguity']:.3f}",
            "-" if r["mean_run_length"] is None else f"{r['mean_run_length']:.1f}",
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    lines += [fmt(head), fmt(["-" * w for w in widths])]
    prev = None
    for row in rows:
        if prev is not None and row[0] != prev:
            lines.append("")
        lines.append(fmt(row))
        prev = row[0]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Write a PNG: one panel per batch, median time per layout with IQR whiskers."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(report: dict[str, Any]):
    """The matplotlib ``Figure`` :func:`plot` writes. The layout names are written
    vertically under their bars, each panel wide enough that no two labels overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(dict.fromkeys(r["batch"] for r in report["results"]))
    per_panel = max(sum(r["batch"] == b for r in report["results"]) for b in batches)
    fig, axes = plt.subplots(1, len(batches), figsize=(max(4.5, 0.6 * per_panel) * len(batches), 5.6),
                             squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = [r for r in report["results"] if r["batch"] == b]
        x = range(len(rows))
        med = [r["median_s"] * 1e3 for r in rows]
        err = [[(r["median_s"] - r["q1_s"]) * 1e3 for r in rows], [(r["q3_s"] - r["median_s"]) * 1e3 for r in rows]]
        colors = ["tab:green" if r["layout"] == "canonical" else "tab:grey" for r in rows]
        ax.bar(x, med, yerr=err, capsize=3, color=colors)
        for i, r in enumerate(rows):
            if r["ratio_vs_canonical"] is not None:
                # Above the whisker, not through it.
                ax.annotate(f"{r['ratio_vs_canonical']:.2f}x", (i, r["q3_s"] * 1e3), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=8)
        # Upright names would overlap ("replay:kvpool+contiguous@19"): written vertically.
        ax.set_xticks(list(x), [r["layout"] for r in rows], fontsize=7, rotation=90)
        ax.set_title(b, fontsize=10)
        ax.set_ylabel("median ms per forward")
        ax.grid(axis="y", alpha=0.3)
    g, d = report["geometry"], report["device"]
    fig.suptitle(f"kvpool locality: {d.get('name')}, {report['kernel']} kernel, {g['num_blocks']} blocks x "
                 f"{g['block_size']} tokens, {g['num_kv_heads']}x{g['head_size']} KV, {g['dtype']}", fontsize=10)
    fig.tight_layout()
    return fig


def _report(bench, device, kernel: str, geometry, config: dict, timings) -> dict:
    """The JSON report of one run (docs/locality.md)."""
    return {
        "device": bench.device_info(device),
        "kernel": kernel,
        "geometry": bench.geometry_json(geometry),
        "config": config,
        "results": bench.results_json(timings),
    }


def _device_and_kernel(torch, device_arg: str, kernel_arg: str):
    """(torch.device, kernel name) for --device and --kernel; ValueError (a one-line message) where this
    machine cannot run them: --device cuda without a CUDA device, --kernel flex on a CPU without
    Inductor's flex kernel (kernels.flex_unsupported_reason)."""
    if device_arg == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_arg)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA device")
    kernel = kernel_arg if kernel_arg != "auto" else ("flex" if device.type == "cuda" else "reference")
    if kernel == "flex":
        from kvpool.tools.locality.kernels import flex_unsupported_reason

        reason = flex_unsupported_reason(device)
        if reason:
            raise ValueError(f"--kernel flex: {reason}")
    return device, kernel


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        print("python -m kvpool locality: error: needs torch (pip install 'kvpool[locality]' or torch itself)",
              file=sys.stderr)
        return 2
    from kvpool.tools.locality import bench, replay_tables
    from kvpool.tools.locality.layouts import LayoutError

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[locality {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    try:
        device, kernel = _device_and_kernel(torch, args.device, args.kernel)
    except ValueError as e:
        print(f"python -m kvpool locality: error: {e}", file=sys.stderr)
        return 2
    defaults = DEFAULTS[device.type]
    if args.threads:
        torch.set_num_threads(args.threads)
    geometry = bench.Geometry(
        num_blocks=args.num_blocks or defaults["num_blocks"], block_size=args.block_size,
        num_kv_heads=args.num_kv_heads, head_size=args.head_size, num_heads=args.num_heads,
        num_layers=args.layers, dtype=args.dtype)
    try:
        batches = _batches(defaults["prefill"] if args.prefill is None else args.prefill, "prefill")
        batches += _batches(defaults["decode"] if args.decode is None else args.decode, "decode")
        if not batches:
            raise ValueError("no batch to time (--prefill and --decode both empty)")
        if min(geometry.num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_size,
               geometry.num_layers) < 1 or geometry.num_heads % geometry.num_kv_heads:
            raise ValueError("sizes must be >= 1 and --num-heads a multiple of --num-kv-heads")
        replay_path = Path(args.replay_tables) if args.replay_tables else replay_tables.DEFAULT_PATH
        layouts = _layouts(args.layouts, replay_path)
        replay_orders = None
        if any(name.startswith("replay:") for name in layouts):
            recorded = replay_tables.load(replay_path)
            replay_orders = {name: replay_tables.orders_for(recorded, name)
                             for name in layouts if name.startswith("replay:")}
        warmup = defaults["warmup"] if args.warmup is None else args.warmup
        reps = defaults["reps"] if args.reps is None else args.reps
        if reps < 1 or warmup < 0:
            raise ValueError("--reps must be >= 1 and --warmup >= 0")
        log(f"{device.type}: kernel {kernel}, layouts {', '.join(layouts)}")
        timings = bench.run(geometry, batches, layouts, device=device, kernel=kernel, warmup=warmup, reps=reps,
                            seed=args.seed, replay_orders=replay_orders, check=args.check, log=log)
    except (argparse.ArgumentTypeError, LayoutError, ValueError, OSError) as e:
        print(f"python -m kvpool locality: error: {e}", file=sys.stderr)
        return 2
    config = {
        "layouts": layouts,
        "replay_tables": str(replay_path) if replay_orders else None,
        "warmup": warmup,
        "reps": reps,
        "seed": args.seed,
        "check_tol": args.check_tol if args.check else None,
        "argv": ["python", "-m", "kvpool", "locality", *(sys.argv[2:] if argv is None else argv)],
        "wall_s": time.perf_counter() - t_start,
    }
    report = _report(bench, device, kernel, geometry, config, timings)
    print(render_table(report))
    bad = [r for r in report["results"]
           if r["max_abs_diff_vs_reference"] is not None and not r["max_abs_diff_vs_reference"] <= args.check_tol]
    for r in bad:
        print(f"python -m kvpool locality: check failed: {r['batch']} {r['layout']}: max abs difference "
              f"{r['max_abs_diff_vs_reference']:.4g} vs the reference > {args.check_tol}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        log(f"wrote {args.plot}")
    return 1 if bad else 0
