"""How much of a scheduler step is the KV cache manager: each call the scheduler makes on
``scheduler.kv_cache_manager``, timed, beside the step's CPU time, per mode.

    python benchmarks/manager_share.py [--workload grpo] [--rounds 6] [--modes vanilla,kvpool]

Runs ``python -m kvpool replay`` in this process with every mode's scheduler given a
:class:`TimedManager` in place of its ``kv_cache_manager``: an object whose methods are the
manager's own bound methods wrapped in a ``time.perf_counter()`` pair (the manager object
itself is unchanged, so kvpool's native path still sees vLLM's classes), every other
attribute read and written through to the manager. The replay's step CPU
(``Stepper.schedule`` + ``update``, ``time.thread_time``) is summed per mode beside it.

It prints per mode: the step's CPU per step, the time inside manager calls per step, the
rest (the scheduler's own Python: what no pool can make cheaper), and the manager methods
by time. For vanilla, ``rest / step`` is the ratio a zero-cost KV cache manager would give
(the floor under any pool's step ratio on that workload). The wrapper adds about 0.3 us
per call to both modes; read the ratios, not the absolute times. docs/performance.md,
"The step's floor on vLLM 0.34.0", gives a run.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any

_pc = time.perf_counter


class TimedManager:
    """``manager``'s methods (``callable`` class attributes not starting with ``__``) as
    wrappers adding their wall time and call count to ``acc[key()][name]``
    (``[seconds, calls]``); other attributes are the manager's (read and written)."""

    def __init__(self, manager: Any, acc: dict, key) -> None:
        object.__setattr__(self, "_manager", manager)
        for name in dir(type(manager)):
            if name.startswith("__"):
                continue
            attr = getattr(manager, name, None)
            if callable(attr) and not isinstance(attr, type):
                object.__setattr__(self, name, _timed(attr, name, acc, key))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._manager, name, value)


def _timed(method, name: str, acc: dict, key):
    def timed(*args, **kwargs):
        t0 = _pc()
        try:
            return method(*args, **kwargs)
        finally:
            entry = acc[key()][name]
            entry[0] += _pc() - t0
            entry[1] += 1
    return timed


def summary(calls: dict[str, list], step_s: float, steps: int) -> dict[str, Any]:
    """Per-step figures of one mode: ``{"step_us", "manager_us", "rest_us",
    "rest_share", "methods": [(name, us per step, calls per step), ...]}`` (methods by
    time, largest first). ``calls``: name -> ``[seconds, calls]``."""
    n = max(steps, 1)
    manager_s = sum(s for s, _ in calls.values())
    methods = sorted(((name, s / n * 1e6, c / n) for name, (s, c) in calls.items()), key=lambda m: -m[1])
    return {"step_us": step_s / n * 1e6, "manager_us": manager_s / n * 1e6,
            "rest_us": (step_s - manager_s) / n * 1e6,
            "rest_share": (step_s - manager_s) / step_s if step_s else 0.0, "methods": methods}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="grpo")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--modes", default="vanilla,kvpool")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)

    from kvpool.tools.replay import loop, modes as replay_modes, runner
    from kvpool.tools.replay.cli import main as replay

    acc: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    step: dict = collections.defaultdict(lambda: [0.0, 0])
    current = {"mode": None}
    set_mode, build = replay_modes.set_mode, runner.build_scheduler
    schedule, update = loop.Stepper.schedule, loop.Stepper.update

    def set_mode_named(mode):
        current["mode"] = str(getattr(mode, "name", mode))
        return set_mode(mode)

    def build_timed(*a, **k):
        scheduler = build(*a, **k)
        scheduler.kv_cache_manager = TimedManager(scheduler.kv_cache_manager, acc, lambda: current["mode"])
        return scheduler

    def schedule_counted(self):
        so, dt = schedule(self)
        step[current["mode"]][0] += dt
        step[current["mode"]][1] += 1
        return so, dt

    def update_counted(self, so):
        dt = update(self, so)
        step[current["mode"]][0] += dt
        return dt

    replay_modes.set_mode = runner._modes.set_mode = set_mode_named
    runner.build_scheduler = build_timed
    loop.Stepper.schedule, loop.Stepper.update = schedule_counted, update_counted
    try:
        replay(["--workload", args.workload, "--modes", args.modes, "--rounds", str(args.rounds),
                "--no-plot", "--quiet", "--json", "/dev/null"])
    finally:
        replay_modes.set_mode = runner._modes.set_mode = set_mode
        runner.build_scheduler = build
        loop.Stepper.schedule, loop.Stepper.update = schedule, update
    for mode in args.modes.split(","):
        s = summary(acc[mode], *step[mode])
        print(f"== {mode}: step {s['step_us']:.1f} us, in KV cache manager calls {s['manager_us']:.1f} us, "
              f"rest {s['rest_us']:.1f} us ({s['rest_share']:.2f} of the step)")
        for name, us, calls in s["methods"][: args.top]:
            print(f"   {us:7.2f} us/step  {calls:5.2f} calls/step  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
