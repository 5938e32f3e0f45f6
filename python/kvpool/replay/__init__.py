"""``python -m kvpool replay``: vLLM's real scheduler, no model, vanilla vs kvpool.

- :mod:`.workloads`: request shapes (GRPO rollout, long sequential, P/D async, serving
  without an idle moment, trace).
- :mod:`.driver`: builds a ``Scheduler`` per mode, steps it, measures each round (or
  window of steps) including prefix-cache hits, evictions and preemptions.
- :mod:`.metrics`: block-table contiguity definitions.
- :mod:`.report`: tables and plot. :mod:`.cli`: the command line.

See docs/replay.md.
"""
