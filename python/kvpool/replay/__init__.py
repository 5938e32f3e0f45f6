"""``python -m kvpool replay``: vLLM's real scheduler, no model, vanilla vs kvpool.

- :mod:`.workloads`: request shapes (GRPO rollout, long sequential, P/D async, trace).
- :mod:`.driver`: builds a ``Scheduler`` per mode, steps it, measures each round.
- :mod:`.metrics`: block-table contiguity definitions.
- :mod:`.report`: tables and plot. :mod:`.cli`: the command line.

See docs/replay.md.
"""
