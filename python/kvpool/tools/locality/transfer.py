"""The transfer phase of the locality measurement: what a block table costs to *move*.

A KV transfer (NIXL between prefill and decode machines, vLLM PR #55841, issue #55434;
CPU offloading, PR #35990) issues one copy per run of block ids ascending by exactly 1
(a *descriptor*): the ids are rows of the per-layer KV tensors, and two rows coalesce
only when they are adjacent and in the same order. This module replays the prompt tables
the replay recorded after the pool wrapped, one mode at a time, as device -> pinned-host
copies of each prompt's KV, one ``copy_`` per descriptor, per layer and per K/V, and
times them: vanilla vLLM's tables against the contiguous policy's, same bytes.

On a GPU that is the evidence (``bash scripts/locality-gpu.sh`` runs it after the
attention phase); on a CPU the same code runs as a smoke test, and its time is not.

The recording (``data/replay_serving_prompts.json``, made by ``python -m
kvpool.tools.locality.transfer --extract FULL.json OUT.json`` from ``python -m kvpool replay
--workload serving --save-tables --json FULL.json``) keeps, per mode and round, each
request's prompt table (the ``tables.prompt`` lists of the report) run-length coded as
in :mod:`kvpool.tools.locality.replay_tables`. Needs torch, not vLLM, numpy or kvpool's
extension.

    python -m kvpool.tools.locality.transfer [--device cuda] [--layers 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.tools import cliargs
from kvpool.tools.locality.replay_tables import decode_runs, encode_runs

# The copies a table costs: (first block id, blocks) per run of ids ascending by 1, null
# blocks dropped (kvpool.tools.replay.metrics, which imports neither vLLM nor numpy).
from kvpool.tools.replay.metrics import descriptor_runs as descriptors

FORMAT = "kvpool-replay-prompt-tables/1"
#: Shipped recording: the serving replay (85,000 blocks x 32 tokens), post-wrap windows.
DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "replay_serving_prompts.json"
#: Per device: geometry and repetitions (a GPU: one H200-sized layer of K and V per
#: layer, 8 KV heads x 128, bf16; a CPU: small blocks, a smoke test).
DEFAULTS = {
    "cuda": {"layers": 4, "block_size": 32, "num_kv_heads": 8, "head_size": 128, "warmup": 1, "reps": 5,
             "max_prompts": 0},
    "cpu": {"layers": 1, "block_size": 2, "num_kv_heads": 1, "head_size": 16, "warmup": 0, "reps": 1,
            "max_prompts": 40},
}


def extract(report: dict[str, Any], modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The compact recording from a ``replay --save-tables`` report: every round in which
    vanilla evicted cached blocks (the pool has wrapped), each request's prompt table.

    Raises:
        ValueError: the report has no prompt tables (run the replay with --save-tables).
    """
    base = report["modes"].get("vanilla", {}).get("rounds", [])
    wrapped = {r["round"] for r in base if r.get("evictions")}
    out: dict[str, Any] = {}
    for mode, res in report["modes"].items():
        if "rounds" not in res or (modes is not None and mode not in modes):
            continue
        rounds = {}
        for rnd in res["rounds"]:
            if wrapped and rnd["round"] not in wrapped:
                continue
            if "tables" not in rnd:
                raise ValueError(f"mode {mode} round {rnd['round']} has no tables: run the replay with --save-tables")
            rounds[str(rnd["round"])] = [encode_runs(t) for t in rnd["tables"]["prompt"]]
        out[mode] = {"rounds": rounds}
    cfg = report.get("config", {})
    return {"format": FORMAT,
            "source": {"workload": report.get("workload", {}).get("name"),
                       **{k: cfg.get(k) for k in ("num_blocks", "block_size", "seed", "vllm_version", "argv")}},
            "modes": out}


def load(path: str | Path = DEFAULT_PATH) -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
    """``({mode: [prompt table, ...]}, source)`` from a compact file or a report.

    Raises:
        OSError: unreadable file. ValueError: neither format, or no tables.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or (data.get("format") != FORMAT and "modes" not in data):
        raise ValueError(f"{path}: neither a replay report nor a {FORMAT} file")
    try:
        if data.get("format") != FORMAT:
            data = extract(data)
        tables = {mode: [decode_runs(t) for r in sorted(e["rounds"], key=int) for t in e["rounds"][r]]
                  for mode, e in data["modes"].items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: a malformed {FORMAT} file ({type(e).__name__}: {e})") from None
    for mode, ts in tables.items():  # block ids: rows of a pool (up to 2**24 blocks here)
        bad = next((b for t in ts for b in t if not isinstance(b, int) or not 0 <= b < 2**24), None)
        if bad is not None:
            raise ValueError(f"{path}: mode {mode} has block id {bad!r} (expected ints in [0, 2**24))")
    return tables, data.get("source", {})


def measure(tables: dict[str, list[list[int]]], *, device: str, layers: int, block_size: int,
            num_kv_heads: int, head_size: int, dtype: str = "bf16", warmup: int = 1, reps: int = 5,
            num_blocks: int | None = None) -> dict[str, Any]:
    """Time one device -> pinned-host ``copy_`` per descriptor, per layer and K/V, for
    every prompt table of each mode (the same prompts in every mode: same bytes).

    Returns:
        ``{"geometry": ..., "modes": {mode: {"prompts", "blocks", "descriptors",
        "copies", "bytes", "median_s", "times_s", "gbps", "ratio_vs_first"}}}``; times
        in seconds, bytes per repetition, ``gbps`` = bytes / median / 1e9.

    Raises:
        RuntimeError: a mode's copies did not put its last prompt's blocks, in table
            order, into the host buffer (checked once per mode, before timing).
    """
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    need = 1 + max((b for ts in tables.values() for t in ts for b in t), default=0)
    num_blocks = max(num_blocks or 0, need)
    row = block_size * num_kv_heads * head_size  # elements of one block's K (or V)
    # vLLM's per-layer layout: [2 (K, V), num_blocks, block_size, heads, head] as rows.
    kv = [torch.zeros(2, num_blocks, row, dtype=torch_dtype, device=device) for _ in range(layers)]
    # Each row holds its block id (mod 256, exact in every dtype), so a copy can be checked.
    ids = (torch.arange(num_blocks, device=device) % 256).to(torch_dtype)
    for layer in kv:
        layer[:, :, 0] = ids
    longest = max((len(t) for ts in tables.values() for t in ts), default=1)
    host = torch.empty(2, longest, row, dtype=torch_dtype, pin_memory=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    plans = {m: [descriptors(t) for t in ts] for m, ts in tables.items()}

    def run(plan):
        for runs in plan:
            off = 0
            for start, n in runs:
                for layer in kv:
                    for side in (0, 1):
                        host[side, off:off + n].copy_(layer[side, start:start + n], non_blocking=True)
                off += n
        sync()

    out: dict[str, Any] = {}
    first = None
    for mode, plan in plans.items():
        run(plan)  # then check that the last prompt's blocks landed in order
        last = [b for b in tables[mode][-1] if b != 0] if tables[mode] else []
        got = host[1, :len(last), 0].float().cpu().tolist()
        if got != [float(b % 256) for b in last]:
            raise RuntimeError(f"transfer phase: {mode}'s copies did not reproduce its last prompt's blocks")
        for _ in range(warmup):
            run(plan)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(plan)
            times.append(time.perf_counter() - t0)
        blocks = sum(n for runs in plan for _, n in runs)
        descs = sum(len(runs) for runs in plan)
        median = statistics.median(times)
        nbytes = blocks * layers * 2 * row * kv[0].element_size()
        first = first or median
        out[mode] = {"prompts": len(plan), "blocks": blocks, "descriptors": descs,
                     "copies": descs * layers * 2, "bytes": nbytes, "median_s": median, "times_s": times,
                     "gbps": nbytes / median / 1e9 if median else None, "ratio_vs_first": median / first}
    return {"geometry": {"device": device, "layers": layers, "block_size": block_size, "num_kv_heads": num_kv_heads,
                         "head_size": head_size, "dtype": dtype, "num_blocks": num_blocks,
                         "block_bytes_per_layer": 2 * row * kv[0].element_size()},
            "modes": out}


def render(report: dict[str, Any]) -> str:
    g = report["geometry"]
    lines = [(f"transfer: {g['device']}, {g['layers']} layer(s) x K/V, {g['block_bytes_per_layer']:,} bytes "
              f"per block and layer, one copy_ per descriptor (device -> pinned host; checked)"),
             (f"{'mode':<26}{'prompts':>8}{'blocks':>9}{'descriptors':>12}{'copies':>10}{'median ms':>11}"
              f"{'GB/s':>8}{'vs first':>9}")]
    for mode, r in report["modes"].items():
        lines.append(f"{mode:<26}{r['prompts']:>8}{r['blocks']:>9}{r['descriptors']:>12}{r['copies']:>10}"
                     f"{r['median_s'] * 1e3:>11.2f}{r['gbps'] or 0:>8.2f}{r['ratio_vs_first']:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.tools.locality.transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", metavar="PATH", help="compact recording or replay report (default: the shipped one)")
    p.add_argument("--extract", nargs=2, metavar=("REPORT", "OUT"),
                   help="write the compact recording of a `replay --save-tables` report and exit")
    p.add_argument("--modes", help="comma-separated modes (default: every recorded mode)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    for name in ("layers", "block-size", "num-kv-heads", "head-size", "reps"):
        p.add_argument(f"--{name}", type=cliargs.positive_int,
                       help="(default per device: see kvpool.tools.locality.transfer.DEFAULTS)")
    for name in ("warmup", "max-prompts"):
        p.add_argument(f"--{name}", type=cliargs.non_negative_int, help="(default per device; max-prompts 0: all)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    modes = args.modes.split(",") if args.modes else None
    if args.extract:
        data = extract(json.loads(Path(args.extract[0]).read_text()), modes)
        Path(args.extract[1]).write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"wrote {args.extract[1]} ({Path(args.extract[1]).stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
        return 0
    try:
        import torch
    except ImportError:
        p.error("the transfer phase needs torch (pip install torch)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS[device].items()}
    try:
        tables, source = load(args.tables or DEFAULT_PATH)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if modes is not None and (not all(modes) or len(set(modes)) != len(modes)):
        p.error(f"--modes: expected distinct comma-separated mode names, got {args.modes!r}")
    if modes:
        missing = [m for m in modes if m not in tables]
        if missing:
            p.error(f"no recorded tables for {missing}; have {sorted(tables)}")
        tables = {m: tables[m] for m in modes}
    limit = opts.pop("max_prompts")
    if limit:  # the same first prompts in every mode
        tables = {m: ts[:limit] for m, ts in tables.items()}
    report = measure(tables, device=device, dtype=args.dtype, **opts)
    report["source"] = source
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
