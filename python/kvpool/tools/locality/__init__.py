"""``python -m kvpool locality``: does block-table contiguity pay on this device?

Times paged attention over a KV cache laid out like vLLM's (one
``[num_blocks, block_size, num_kv_heads, head_size]`` tensor per K and V per layer) for
the same requests under several block-table layouts (canonical ascending runs,
descending runs, a random permutation of the pool, and the allocation order that
``python -m kvpool replay`` recorded), prefill and decode separately.

- :mod:`.layouts`: block tables per layout (pure Python).
- :mod:`.replay_tables`: the replay's recorded allocation order, compact JSON in ``data/``.
- :mod:`.kernels`: FlexAttention over the paged cache (vLLM's FlexAttention backend's
  block mask, the kernel reads the block table) and the gather + SDPA reference.
- :mod:`.bench`: timing. :mod:`.cli`: the command line.

Needs torch, not vLLM; importing this package imports neither. See docs/locality.md.
"""
