"""Where a scheduler step's CPU goes: py-spy over the replay, one mode per process.

    python benchmarks/profile_step.py [--workload serving] [--rounds 4] [--rate 400]
        [--modes vanilla,kvpool,kvpool+contiguous] [--model NAME [--num-blocks N]] [--top 12] [--keep DIR]

For each mode, runs ``python -m kvpool replay --workload W --modes MODE --rounds R
--no-plot --quiet [--model NAME [--num-blocks N]]`` under ``py-spy record --format raw`` (py-spy from the package
index: ``pip install py-spy``), keeps only the samples inside vLLM's
``Scheduler.schedule()`` / ``Scheduler.update_from_output()`` (the engine step), and
prints per mode the share of those samples

* under ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager.*``: the coordinator,
  the single-type managers and the pool below it);
* whose leaf frame is kvpool's Python (Cython's frames are attributed to their Python
  caller, so the native pool calls count here; the replay's own probes, which run in
  every mode, do not);
* of the ``--top`` leaf functions.

Shares, not times, are compared (the machine may be shared). docs/performance.md,
"The scheduler step", gives the table this prints and the commit it was measured at.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")
STEP_FUNCS = {"schedule", "update_from_output"}


def parse_frame(frame: str) -> tuple[str, str]:
    """``"schedule (vllm/v1/core/sched/scheduler.py:412)"`` -> (function, file)."""
    m = FRAME.match(frame.strip())
    return (m["func"], m["file"]) if m else (frame.strip(), "")


def step_shares(raw_lines, top: int = 12) -> dict:
    """Shares of the step samples in py-spy's raw (collapsed) output.

    Args:
        raw_lines: lines ``frame;frame;...;leaf COUNT`` (root first).
        top: how many leaf frames ``"top"`` lists, largest share first.

    Returns:
        ``{"step_samples", "under_manager", "kvpool_leaf", "top": [(leaf, share)]}``,
        shares as fractions of the step samples.
    """
    step = manager = kvpool = 0
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [parse_frame(f) for f in stack.split(";")]
        n = int(count)
        # py-spy names methods by their qualified name (Scheduler.schedule).
        if not any(func.rpartition(".")[2] in STEP_FUNCS and file.endswith("sched/scheduler.py")
                   for func, file in frames):
            continue
        step += n
        if any(file.endswith("v1/core/kv_cache_manager.py") for _, file in frames):
            manager += n
        func, file = frames[-1]
        parts = Path(file).parts
        if "kvpool" in parts and "replay" not in parts:  # (the replay's probes run in every mode)
            kvpool += n
        leaves[f"{func} ({Path(file).name})"] += n
    share = (lambda k: k / step) if step else (lambda k: 0.0)
    return {
        "step_samples": step,
        "under_manager": share(manager),
        "kvpool_leaf": share(kvpool),
        "top": [(leaf, share(k)) for leaf, k in leaves.most_common(top)],
    }


def profile(mode: str, workload: str, rounds: int, rate: int, out: Path,
            model: str | None = None, num_blocks: int | None = None,
            replay_args: list[str] | None = None) -> Path:
    """Record one replay of ``mode`` (of ``model``'s KV cache shape; ``replay_args``: more of
    the replay's options) with py-spy; returns the raw file."""
    from kvpool.cpu_platform import cpu_environment  # vLLM's CPU platform via kvpool's plugin

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        sys.exit(f"py-spy not found (on PATH or beside {sys.executable}): "
                 f"{sys.executable} -m pip install py-spy")
    raw = out / f"{mode.replace('+', '_')}.txt"
    cmd = [py_spy, "record", "--rate", str(rate), "--format", "raw", "--output", str(raw), "--",
           sys.executable, "-m", "kvpool", "replay", "--workload", workload, "--modes", mode,
           "--rounds", str(rounds), "--no-plot", "--quiet"]
    if model:
        cmd += ["--model", model] + (["--num-blocks", str(num_blocks)] if num_blocks else [])
    cmd += replay_args or []
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                   env=cpu_environment(dict(os.environ)))
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="serving")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rate", type=int, default=400, help="samples per second")
    parser.add_argument("--modes", default="vanilla,kvpool,kvpool+contiguous")
    parser.add_argument("--model", help="the replay's --model (its KV cache shape)")
    parser.add_argument("--num-blocks", type=int, help="with --model: the replay's --num-blocks")
    parser.add_argument("--replay-args", default="",
                        help="more of the replay's options, one string (e.g. the replay benchmark's "
                             "serving row: '--scale 0.05 --num-blocks 12000 --block-size 32 "
                             "--window-steps 400')")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--keep", help="keep the raw profiles in this folder")
    args = parser.parse_args(argv)
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvpool-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes.split(","):
        raw = profile(mode, args.workload, args.rounds, args.rate, out, args.model, args.num_blocks,
                      shlex.split(args.replay_args))
        results[mode] = step_shares(raw.read_text().splitlines(), args.top)
    for mode, r in results.items():
        print(f"== {mode}: {r['step_samples']} step samples; under KVCacheManager "
              f"{r['under_manager']:.1%}; kvpool's Python as the leaf {r['kvpool_leaf']:.1%}")
        for leaf, share in r["top"]:
            print(f"   {share:6.1%}  {leaf}")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
