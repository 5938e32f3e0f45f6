"""``python -m kvpool replay``: vLLM's real scheduler, no model, vanilla vs kvpool.

One room per job, in the order a run goes through them (docs/design.md, "The replay in rooms"):

- :mod:`.cli`: the command line: parses, calls :mod:`.runner`, hands the report to
  :mod:`.report`.
- :mod:`.workloads`: request shapes (GRPO rollout, long sequential, P/D async, serving
  without an idle moment; :mod:`.traces` reads a JSON-lines trace). No vLLM.
- :mod:`.modes`: the :class:`~.modes.Mode` values, installing or uninstalling kvpool.
- :mod:`.engine`: the model-less engine: scheduler, request factory, stand-in model
  (kvpool's tests build their schedulers with it too).
- :mod:`.probe`: per-round instrumentation of one scheduler (tables, hits, evictions,
  preemptions, deferred frees).
- :mod:`.loop`: the engine-step loops, a round to completion or a stream in windows.
- :mod:`.runner`: each mode on a fresh scheduler, the calls between rounds.
- :mod:`.results`: the result dataclasses, which define the ``--json`` schema.
- :mod:`.compare`: cross-mode checks against vanilla. :mod:`.metrics`: block-table
  contiguity definitions. :mod:`.report`: tables, verdict, JSON file and plot.

See docs/replay.md.
"""
