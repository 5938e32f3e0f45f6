"""``python -m kvpool replay``: a workload through vLLM's scheduler, vanilla vs kvpool.

See docs/replay.md for what is measured and the trace format.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.cpu_platform import cpu_environment
from kvpool.tools import cliargs
from kvpool.tools.replay import report
from kvpool.tools.replay.compare import compare
from kvpool.tools.replay.engine import PoolSpec
from kvpool.tools.replay.modes import MODES, get as get_mode
from kvpool.tools.replay.results import RunConfig
from kvpool.tools.replay.traces import from_trace, truncate_rounds
from kvpool.tools.replay.workloads import WORKLOADS, Workload, as_pd_serving


def _range(text: str) -> tuple[int, int]:
    parts = [int(p) for p in text.replace(":", ",").split(",") if p.strip()]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return parts[0], parts[1]


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _known_mode(name: str) -> bool:
    try:
        get_mode(name)
    except ValueError:
        return False
    return True


def default_modes(wl) -> tuple[str, ...]:
    """The modes a run without ``--modes`` compares: all of :data:`MODES`, less
    ``kvpool+reorder`` on a continuous workload (``serving``, ``pd-serving``, a continuous
    trace), which never idles between rounds, so no reorder runs and that mode is
    ``kvpool`` again (docs/replay.md, "Modes")."""
    if getattr(wl, "continuous", False):
        return tuple(m for m in MODES if m != "kvpool+reorder")
    return MODES


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))  # (once each)
    bad = [m for m in modes if not _known_mode(m)]
    if bad or not modes:
        what = f"unknown mode(s) {bad}" if bad else f"no mode in {text!r}"
        raise argparse.ArgumentTypeError(
            f"{what}; choose from {','.join(MODES)}, vanilla+immediate-order or kvpool+contiguous+wW (W blocks > 0)")
    return modes


#: Where a run without --json writes its report and plot (relative to the working folder).
DEFAULT_OUT_DIR = "replay-out"
#: Table width when stdout is not a terminal (and COLUMNS is not set).
PIPED_WIDTH = 120


DESCRIPTION = (
    "Drive vLLM's real Scheduler/KVCacheManager (no model) through a workload and "
    "report block-table contiguity, prefix-cache hits, evictions, preemptions and "
    "scheduler CPU per round, for vanilla vLLM, kvpool, kvpool with the canonical "
    "free-list reorder between rounds, and kvpool's contiguous allocation policy."
)


#: ``--num-blocks`` of the workloads whose default is not 85,000 blocks.
DEFAULT_NUM_BLOCKS = {"pd-serving": 24_000}


def _models() -> list[str]:
    from kvpool.tools.hf_offline import shipped_models

    return shipped_models()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvpool replay", description=DESCRIPTION)
    add_cli_args(p)
    return p


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The replay's options (docs/replay.md)."""
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="grpo",
                   help="built-in workload (default: grpo, the RFC's GRPO rollout shape; serving: "
                   "never idle, rounds are windows of engine steps; pd-serving: the same as P/D, both sides "
                   "continuous; with --trace: a continuous trace as pd-serving)")
    p.add_argument("--trace", metavar="FILE.jsonl",
                   help="replay a JSON-lines trace instead of a built-in workload (docs/replay.md)")
    p.add_argument("--modes", type=_modes, default=None,
                   help=f"comma-separated subset of {','.join(MODES)} (default: all; on a continuous workload, "
                   "serving, pd-serving or a continuous trace, all but kvpool+reorder, which equals kvpool there), "
                   "plus vanilla+immediate-order (the reference of deferred frees) or kvpool+contiguous+wW")
    p.add_argument("--rounds", type=cliargs.positive_int, help="number of rounds (trace: keep the first N)")
    p.add_argument("--window-steps", type=cliargs.positive_int, metavar="N",
                   help="serving and continuous traces: engine steps per round (default 1000)")
    p.add_argument("--in-flight", type=_range, metavar="LO,HI",
                   help="serving: requests in flight (default 32,64)")
    p.add_argument("--model", metavar="NAME",
                   help="the model whose KV cache the scheduler gets, resolved by vLLM's own code (groups, specs, "
                   f"block sizes, blocks; docs/replay.md, 'Model shapes'): one of {', '.join(_models())}. "
                   "Default: the workload's model (Qwen/Qwen3-0.6B) with one hand-built full-attention group")
    p.add_argument("--hf-overrides", type=_json_object, metavar="JSON",
                   help="with --model: vLLM's --hf-overrides for the shipped config, a JSON object, e.g. "
                   "'{\"num_hidden_layers\": 40}' (docs/replay.md, 'The GB10 case')")
    p.add_argument("--mamba-ssm-cache-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="with --model: vLLM's --mamba-ssm-cache-dtype, the Mamba/GDN temporal state's dtype, "
                   "which sets the page and block sizes (default float32, as Qwen3.5/3.6 configs set it; "
                   "'auto' is the model dtype on a GPU, but float32 under vLLM's CPU platform on an "
                   "AVX512-BF16 host)")
    p.add_argument("--max-model-len", type=cliargs.positive_int, metavar="N",
                   help="vLLM's --max-model-len (default: the workload's longest request, rounded up to 1024); "
                   "with --model it sizes a Mamba group's block when prefix caching is off")
    p.add_argument("--kv-memory-gib", type=cliargs.positive_float, metavar="X",
                   help="with --model: KV cache memory in GiB, which vLLM divides into blocks "
                   "(default: --num-blocks blocks)")
    p.add_argument("--num-blocks", type=cliargs.positive_int,
                   help="KV blocks in the pool (default 85000; pd-serving: 24000 on each side, so that both wrap)")
    p.add_argument("--block-size", type=cliargs.positive_int,
                   help="tokens per block (default 32; with --model: vLLM's --block-size, default the attention "
                   "backend's preferred size, raised by vLLM for hybrid models)")
    p.add_argument("--seed", type=int, default=0, help="seed for lengths and token ids (default 0)")
    p.add_argument("--scale", type=cliargs.positive_float, default=1.0,
                   help="multiply output lengths (a number > 0, e.g. 0.05)")
    p.add_argument("--prompt-len", type=_range, metavar="LO,HI",
                   help="override the workload's prompt length range (tokens)")
    p.add_argument("--output-len", type=_range, metavar="LO,HI",
                   help="override the workload's output length range (tokens, before --scale)")
    p.add_argument("--prefix-caching", choices=["on", "off"],
                   help="override the workload's prefix caching setting")
    p.add_argument("--json", metavar="PATH", type=cliargs.output_file,
                   help=f"write the full report as JSON here (default: {DEFAULT_OUT_DIR}/WORKLOAD.json); "
                   "written before the plot")
    p.add_argument("--plot", metavar="PATH.png", type=cliargs.plot_file,
                   help="write contiguity/CPU per round per mode (default: the JSON's path with .png)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--save-tables", action="store_true",
                   help="with --json: keep every round's per-request block tables (prompt and final) "
                   "in the JSON, for `python -m kvpool locality --replay-tables`")
    p.add_argument("--nixl", action="store_true",
                   help="--workload pd or pd-serving: also read every prompt prefill -> decode through the real NIXL "
                   "(two agents, UCX over loopback TCP) and report NIXL's descriptor count and posting "
                   "time (needs NIXL: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)")
    p.add_argument("--tables", "-v", action="store_true",
                   help="also print the per-round tables (one column per mode) before the summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no tables (implies --no-progress)")


def make_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        if args.prompt_len or args.output_len:
            raise SystemExit("replay: --prompt-len/--output-len apply to built-in workloads, not --trace")
        wl = from_trace(args.trace, scale=args.scale, window_steps=args.window_steps or 1000)
        if args.rounds is not None:
            wl = truncate_rounds(wl, args.rounds)
        if args.workload == "pd-serving":  # the trace's stream on both sides of P/D
            try:
                wl = as_pd_serving(wl)
            except ValueError as e:
                raise SystemExit(f"replay: --workload pd-serving --trace: {e} (a trace without 'round')") from None
    else:
        kwargs: dict[str, Any] = {"scale": args.scale, "seed": args.seed}
        if args.rounds is not None:
            kwargs["rounds"] = args.rounds
        if args.prompt_len:
            kwargs["prompt_len"] = args.prompt_len
        if args.output_len:
            kwargs["output_len"] = args.output_len
        serving_only = {"window_steps": args.window_steps, "in_flight": args.in_flight}
        for key, value in serving_only.items():
            if value is None:
                continue
            if args.workload not in ("serving", "pd-serving"):
                raise SystemExit(f"replay: --{key.replace('_', '-')} applies to --workload serving, pd-serving "
                                 "and traces")
            kwargs[key] = value
        wl = WORKLOADS[args.workload](**kwargs)
    engine_args = {"model": getattr(args, "model", None), "hf_overrides": getattr(args, "hf_overrides", None),
                   "max_model_len": getattr(args, "max_model_len", None),
                   "mamba_ssm_cache_dtype": getattr(args, "mamba_ssm_cache_dtype", None)}
    engine_args = {k: v for k, v in engine_args.items() if v is not None}
    if engine_args:
        longest = max((r.prompt_len + r.output_len for r in wl.requests), default=0)
        if engine_args.get("max_model_len", longest + 1) <= longest:
            raise SystemExit(f"replay: --max-model-len {args.max_model_len} is not longer than the workload's "
                             f"longest request ({longest} tokens)")
        wl = replace(wl, engine=replace(wl.engine, **engine_args))
        if wl.prefill is not None:  # P/D: both sides
            wl.prefill = replace(wl.prefill, engine=replace(wl.prefill.engine, **engine_args))
    if args.prefix_caching is not None:
        on = args.prefix_caching == "on"
        wl = replace(wl, engine=replace(wl.engine, enable_prefix_caching=on))
        if wl.prefill is not None:  # P/D: both sides
            wl.prefill = replace(wl.prefill, engine=replace(wl.prefill.engine, enable_prefix_caching=on))
        wl.description += f" [prefix caching {args.prefix_caching}]"
    if not wl.requests:
        raise SystemExit("replay: the workload has no requests (check --rounds)")
    return wl


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import vllm

        out["vllm_version"] = vllm.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["vllm_version"] = f"unavailable ({e})"
    try:
        import kvpool

        out["kvpool_version"] = getattr(kvpool, "__version__", None)
    except Exception:  # noqa: BLE001
        out["kvpool_version"] = None
    return out


def output_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path, Path | None]:
    """The report's JSON path and the plot's (None: ``--no-plot``, or matplotlib is
    missing and no ``--plot`` was asked for), checked before any work starts.

    The defaults: ``replay-out/<workload or trace name>.json`` (with ``--model M``,
    ``<workload>-<M's last path part>.json``, so model runs keep their own files), the
    plot next to it.
    """
    if args.no_plot and args.plot:
        parser.error("--plot and --no-plot exclude each other")
    name = Path(args.trace).stem if args.trace else args.workload
    if getattr(args, "model", None):
        name = f"{name}-{Path(args.model).name}"
    json_path = args.json if args.json is not None else Path(DEFAULT_OUT_DIR) / f"{name}.json"
    try:
        cliargs.check_writable(json_path)
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --json: {e}")
    if args.no_plot:
        return json_path, None
    if args.plot is not None:
        if not cliargs.have_matplotlib():
            parser.error("argument --plot: matplotlib is not installed (pip install matplotlib)")
        return json_path, args.plot
    if not cliargs.have_matplotlib():
        return json_path, None
    plot_path = json_path.with_suffix(".png")
    try:
        cliargs.check_writable(plot_path)
    except argparse.ArgumentTypeError as e:
        parser.error(f"default plot path (next to --json): {e}; pass --plot PATH or --no-plot")
    return json_path, plot_path


class _Progress:
    """The progress bar on stderr (none with ``--no-progress`` or ``--quiet``), and the
    runner's ``on_round`` / ``on_skip`` callbacks that move it."""

    def __init__(self, args: argparse.Namespace, wl: Workload, err) -> None:
        self.err, self.wl, self.bar = err, wl, None
        if args.no_progress or args.quiet:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=err, transient=False)
        self.task = self.bar.add_task(f"replay {wl.name}", total=wl.num_rounds * len(args.modes))

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    @property
    def on_round(self):
        if self.bar is None:
            return None
        return lambda mode, rnd: self.bar.update(
            self.task, advance=1, description=f"replay {self.wl.name} [{mode}] round {rnd}")

    def on_skip(self, mode: str, why: str) -> None:
        self.err.print(f"[bold red]replay: mode {mode} skipped:[/] {why}")
        if self.bar is not None:
            self.bar.update(self.task, advance=self.wl.num_rounds)


def build_report(args: argparse.Namespace, argv: list[str], wl: Workload, pool: PoolSpec,
                 modes: dict[str, Any], wall: float, geometry: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` report (docs/replay.md, "JSON layout"): ``modes`` is the runner's
    mode name -> :class:`~.results.ModeResult`; ``geometry`` the resolved
    ``KvGeometry.to_json()`` of a ``--model`` run."""
    modes_json = {m: r.to_json() for m, r in modes.items()}
    out = {
        "workload": wl.to_json(),
        "config": RunConfig(
            num_blocks=pool.num_blocks, block_size=pool.block_size, seed=args.seed, scale=args.scale,
            model=wl.engine.model, max_model_len=wl.max_model_len(), modes_requested=list(args.modes),
            argv=["python", "-m", "kvpool", "replay", *argv], wall_s=wall, versions=_versions(),
            kv_cache_geometry=geometry,
        ).to_json(),
        "modes": modes_json,
        "comparison": compare(modes_json),
    }
    out["verdict"] = report.verdict(out)
    return out


def _write_outputs(out: dict[str, Any], args: argparse.Namespace, json_path: Path, plot_path: Path | None,
                   console, err) -> None:
    # The results first: nothing that can fail after this loses them.
    report.write_json(json_path, out)
    if not args.quiet:
        report.render_tables(out, console, per_round=args.tables)
        console.print(f"wall time {out['config']['wall_s']:.1f} s")
    err.print(f"wrote {json_path}")
    if plot_path is not None:
        report.plot(out, plot_path)
        err.print(f"wrote {plot_path}")
    for line in out["verdict"]:
        console.print(line, highlight=False)


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject contradicting options and unwritable outputs before any work starts; sets
    ``args.json_path`` and ``args.plot_path``."""
    if args.num_blocks is None:
        args.num_blocks = DEFAULT_NUM_BLOCKS.get(getattr(args, "workload", None), 85_000)
    if args.num_blocks < 2:
        parser.error("argument --num-blocks: expected an integer >= 2")
    if getattr(args, "model", None) is None:
        if getattr(args, "kv_memory_gib", None) is not None:
            parser.error("--kv-memory-gib needs --model (the default model's pool is --num-blocks x --block-size)")
        if getattr(args, "hf_overrides", None) is not None:
            parser.error("--hf-overrides needs --model (the default model's pool is built by hand)")
        if getattr(args, "mamba_ssm_cache_dtype", None) is not None:
            parser.error("--mamba-ssm-cache-dtype needs --model (the default model has no Mamba layers)")
    elif args.model not in _models():
        parser.error(f"argument --model: kvpool ships no config for {args.model!r}; choose from {', '.join(_models())}")
    if args.save_tables and not args.json:
        parser.error("--save-tables needs --json PATH (the tables go into the JSON)")
    args.json_path, args.plot_path = output_paths(args, parser)


def _resolve(args: argparse.Namespace, wl: Workload):
    """``(PoolSpec, KvGeometry)`` of a ``--model`` run (:func:`~.engine.resolve_pool`)."""
    from kvpool.tools.replay.engine import resolve_pool

    memory = None if args.kv_memory_gib is None else int(args.kv_memory_gib * (1 << 30))
    return resolve_pool(wl, kv_memory_bytes=memory, num_blocks=args.num_blocks, user_block_size=args.block_size)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """``python -m kvpool replay``: parse (``args`` a list, or ``None`` for
    ``sys.argv``; a parsed namespace as is), run every mode, write and render the report.
    The environment variables the run sets (vLLM's platform and log level, NIXL's
    transport) are put back as they were when it returns, for in-process callers.

    Returns:
        0; 1 when a requested mode was skipped; 2 on a bad workload or a failed run.
    """
    saved = dict(os.environ)
    try:
        return _main(args)
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _main(args: argparse.Namespace | list[str] | None) -> int:
    argv = sys.argv[2:] if args is None else args
    if not isinstance(args, argparse.Namespace):
        args = build_parser().parse_args(argv)
        args.argv = list(argv)
    _check(args, build_parser())
    # The replay never touches a device; vLLM still needs to know which platform it is on:
    # its CPU platform, through kvpool's platform plugin (kvpool.cpu_platform).
    cpu_environment(os.environ)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        wl = make_workload(args)
    except (OSError, ValueError) as e:  # unreadable or malformed trace, bad ranges
        print(f"python -m kvpool replay: error: {e}", file=sys.stderr)
        return 2
    pool = PoolSpec(num_blocks=args.num_blocks, block_size=args.block_size or 32)
    args.modes = args.modes or default_modes(wl)

    from rich.console import Console

    # A terminal: its width. Piped or redirected: COLUMNS if set, else a readable 120.
    console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH)
    err = Console(stderr=True)

    from kvpool.tools.hf_offline import offline_hf_cache

    # Enter the offline cache before vLLM/transformers/huggingface_hub are imported:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import time.
    with offline_hf_cache([wl.engine.model]):
        from kvpool.tools.replay.runner import run_replay

        t0 = time.perf_counter()
        geometry = None
        try:
            if getattr(args, "model", None):
                pool, geo = _resolve(args, wl)
                geometry = geo.to_json()
            if not args.quiet:   # (before the work: a redirected run shows what it runs)
                err.print(f"replay {wl.name}: {wl.num_rounds} round(s) x {', '.join(args.modes)}; pool "
                          f"{pool.num_blocks} blocks x {pool.block_size} tokens"
                          f"{f', model {args.model}' if getattr(args, 'model', None) else ''}",
                          highlight=False, markup=False, soft_wrap=True)
            with _Progress(args, wl, err) as progress:
                modes = run_replay(wl, pool, args.modes, seed=args.seed, on_round=progress.on_round,
                                   on_skip=progress.on_skip, save_tables=args.save_tables,
                                   nixl=getattr(args, "nixl", False))
        except (ValueError, RuntimeError) as e:  # doesn't fit the pool, no progress, no NIXL
            err.print(f"python -m kvpool replay: error: {e}", soft_wrap=True, markup=False)
            return 2
        out = build_report(args, getattr(args, "argv", sys.argv[2:]), wl, pool, modes, time.perf_counter() - t0,
                           geometry)
        _write_outputs(out, args, args.json_path, args.plot_path, console, err)
    return 1 if any(r.skipped is not None for r in modes.values()) else 0
