"""Paged attention over a vLLM-style KV cache: FlexAttention (reads the block table in
the kernel) and a gather + SDPA reference.

Cache layout, per layer: ``k_cache`` and ``v_cache`` of shape ``[num_blocks,
block_size, num_kv_heads, head_size]`` (vLLM's per-layer K and V). A batch is
``num_requests`` requests of equal length: each has ``context_len`` tokens of K/V in the
cache, in the blocks its row of ``block_table`` (``[num_requests, blocks_per_request]``
int32) names, and ``query_len`` query tokens, the last ``query_len`` positions of its
context (``query_len == context_len``: a prefill; ``1``: a decode step). ``query`` is
``[num_requests * query_len, num_heads, head_size]``, requests one after another, as
vLLM packs a batch; the output has the same shape. Attention is causal.

:class:`FlexPagedAttention` builds its block mask the way vLLM 0.33.0's FlexAttention
backend does with ``direct_build`` (``FlexAttentionMetadata._build_block_mask_direct``,
``vllm/v1/attention/backends/flex_attention.py``): the cache is viewed as one sequence
of ``num_blocks * block_size`` tokens, queries are grouped 16 at a time, and each
group's ``kv_indices`` are the physical blocks of its requests' tables, in table order,
so the kernel walks the pool the way the block table says. A ``mask_mod`` maps each
physical K/V position back to its request's logical position (vLLM's
``physical_to_logical``) for the causal mask. This is the backend the RFC measured its
5.7x prefill slowdown on.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: Query tokens per block-mask row, as vLLM's FlexAttention backend uses with paged KV.
Q_BLOCK_SIZE = 16


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                  query_len: int, context_len: int) -> tuple[int, int, int, int, int, int]:
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_size], "
                         f"got {tuple(k_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    num_requests, blocks_per_request = block_table.shape
    if not 1 <= query_len <= context_len:
        raise ValueError(f"need 1 <= query_len <= context_len, got {query_len}, {context_len}")
    if blocks_per_request * block_size < context_len:
        raise ValueError(f"{blocks_per_request} blocks of {block_size} tokens cannot hold {context_len} tokens")
    if query.dim() != 3 or query.shape[0] != num_requests * query_len or query.shape[2] != head_size:
        raise ValueError(f"query must be [{num_requests * query_len}, num_heads, {head_size}], "
                         f"got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_blocks, block_size, num_kv_heads, head_size, num_requests, blocks_per_request


def reference_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_len: int,
    context_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Gather each request's blocks, then ``scaled_dot_product_attention``.

    Shapes as in the module docstring. The gather (``k_cache[block_table]``) is where
    the layout shows: it copies ``num_requests * blocks_per_request`` blocks from
    wherever the table points.

    Returns:
        ``[num_requests * query_len, num_heads, head_size]``, ``query``'s dtype.

    Raises:
        ValueError: inconsistent shapes.
    """
    _, block_size, num_kv_heads, head_size, num_requests, n = _check_shapes(
        query, k_cache, block_table, query_len, context_len)
    idx = block_table.to(device=k_cache.device, dtype=torch.long)
    k = k_cache[idx].reshape(num_requests, n * block_size, num_kv_heads, head_size)[:, :context_len]
    v = v_cache[idx].reshape(num_requests, n * block_size, num_kv_heads, head_size)[:, :context_len]
    q = query.view(num_requests, query_len, -1, head_size).transpose(1, 2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    mask = None
    causal = False
    if query_len == context_len:
        causal = True
    elif query_len > 1:  # query = the last query_len positions of the context
        pos_q = torch.arange(context_len - query_len, context_len, device=q.device)
        mask = pos_q[:, None] >= torch.arange(context_len, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads)
    return out.transpose(1, 2).reshape(num_requests * query_len, -1, head_size)


_compiled_flex = None


def flex_unsupported_reason(device: torch.device | str) -> str | None:
    """Why the compiled ``flex_attention`` cannot run on ``device`` here, or None if it can.

    On CUDA it always can (Triton). On the CPU, Inductor's flex template generates AVX2 C++
    and refuses other machines (``torch._inductor.kernel.flex.flex_cpu.check_cpu_supported``,
    torch 2.5 and later: aarch64 hosts such as Grace, a CPU without AVX2,
    ``ATEN_CPU_CAPABILITY=default``); the compile then fails deep inside Inductor with a
    ``LoweringException``. A torch without that check is let through (the compile says
    for itself).
    """
    if torch.device(device).type != "cpu":
        return None
    try:
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    except ImportError:
        return None
    if check_cpu_supported():
        return None
    return (f"torch {torch.__version__} has no compiled flex_attention for this CPU "
            f"({platform.machine()}: Inductor's CPU flex kernel needs x86 AVX2); "
            "use --kernel reference, or a CUDA device")


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # One compile per batch shape (FlexPagedAttention instance); the default limit of 8
        # would drop later shapes to the slow eager path.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled_flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return _compiled_flex


class FlexPagedAttention:
    """Compiled ``flex_attention`` over the paged cache, for one batch shape.

    Buffers that the ``mask_mod`` reads (request of each query token, each request's
    physical-to-logical block map) and the block mask's ``kv_indices`` are allocated once
    and refilled by :meth:`set_block_table`, so switching layouts does not recompile.

    Args:
        num_requests, query_len, context_len: the batch (module docstring); ``query_len``
            must be ``1`` or a multiple of :data:`Q_BLOCK_SIZE`.
        num_blocks, block_size: the pool.
        device: where the cache lives.

    Raises:
        ValueError: a ``query_len`` the block-mask construction does not cover.
    """

    def __init__(self, num_requests: int, query_len: int, context_len: int,
                 num_blocks: int, block_size: int, device: torch.device | str) -> None:
        if query_len != 1 and query_len % Q_BLOCK_SIZE:
            raise ValueError(f"query_len must be 1 or a multiple of {Q_BLOCK_SIZE}, got {query_len}")
        if not 1 <= query_len <= context_len:
            raise ValueError(f"need 1 <= query_len <= context_len, got {query_len}, {context_len}")
        self.num_requests, self.query_len, self.context_len = num_requests, query_len, context_len
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        self.blocks_per_request = math.ceil(context_len / block_size)
        num_tokens = num_requests * query_len
        self.num_q_groups = math.ceil(num_tokens / Q_BLOCK_SIZE)
        n = self.blocks_per_request
        width = n if query_len > 1 else Q_BLOCK_SIZE * n
        if self.device.type == "cpu":
            # Inductor's CPU flex template asserts kv_indices covers the whole K/V length.
            width = max(width, num_blocks)
        dev = self.device
        # Request of each query token; padded rows point at the last request (never read).
        self.doc_ids = torch.full((self.num_q_groups * Q_BLOCK_SIZE,), num_requests - 1, dtype=torch.int32, device=dev)
        requests = torch.arange(num_requests, dtype=torch.int32, device=dev)
        self.doc_ids[:num_tokens] = requests.repeat_interleave(query_len)
        self.q_start = torch.arange(num_requests, dtype=torch.int32, device=dev) * query_len
        self.physical_to_logical = torch.full((num_requests, num_blocks), -1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros((1, 1, self.num_q_groups, width), dtype=torch.int32, device=dev)
        self.kv_num_blocks = torch.zeros((1, 1, self.num_q_groups), dtype=torch.int32, device=dev)
        self.block_mask = None
        self.mask_mod = self._make_mask_mod()

    def _make_mask_mod(self):
        doc_ids, q_start, p2l = self.doc_ids, self.q_start, self.physical_to_logical
        bs, offset, context_len = self.block_size, self.context_len - self.query_len, self.context_len

        def paged_causal_mask_mod(b, h, q_idx, physical_kv_idx):
            req = doc_ids[q_idx]
            logical_block = p2l[req, physical_kv_idx // bs]
            logical_kv = logical_block * bs + physical_kv_idx % bs
            logical_q = q_idx - q_start[req] + offset
            return (logical_block >= 0) & (logical_kv <= logical_q) & (logical_kv < context_len)

        return paged_causal_mask_mod

    def set_block_table(self, block_table: torch.Tensor) -> None:
        """Point the kernel at ``block_table`` (``[num_requests, blocks_per_request]``,
        distinct ids in ``1 .. num_blocks - 1``).

        Raises:
            ValueError: wrong shape.
        """
        from torch.nn.attention.flex_attention import BlockMask

        R, n, bs = self.num_requests, self.blocks_per_request, self.block_size
        if tuple(block_table.shape) != (R, n):
            raise ValueError(f"block_table must be [{R}, {n}], got {tuple(block_table.shape)}")
        table = block_table.to(device=self.device, dtype=torch.long)
        self.physical_to_logical.fill_(-1)
        self.physical_to_logical.scatter_(
            1, table, torch.arange(n, dtype=torch.int32, device=self.device).expand(R, n).contiguous())
        self.kv_indices.zero_()
        rows = self.kv_indices[0, 0]
        if self.query_len > 1:
            # Each group of 16 query tokens lies in one request; causal: it needs the
            # request's blocks up to the one holding its last query position.
            g = torch.arange(self.num_q_groups, device=self.device)
            req = (g * Q_BLOCK_SIZE) // self.query_len
            last_pos = (g * Q_BLOCK_SIZE) % self.query_len + Q_BLOCK_SIZE - 1 + self.context_len - self.query_len
            needed = torch.clamp(last_pos // bs + 1, max=n)
            rows[:, :n] = table[req].to(torch.int32)
            rows[:, :n].masked_fill_(torch.arange(n, device=self.device)[None, :] >= needed[:, None], 0)
            self.kv_num_blocks[0, 0] = needed.to(torch.int32)
        else:
            # Decode: 16 requests per group; the union of their tables, in table order
            # (tables are disjoint, so no deduplication is needed).
            padded = torch.zeros((self.num_q_groups * Q_BLOCK_SIZE, n), dtype=torch.int32, device=self.device)
            padded[:R] = table.to(torch.int32)
            rows[:, :Q_BLOCK_SIZE * n] = padded.view(self.num_q_groups, Q_BLOCK_SIZE * n)
            reqs_in_group = torch.clamp(
                R - torch.arange(self.num_q_groups, device=self.device) * Q_BLOCK_SIZE, max=Q_BLOCK_SIZE)
            self.kv_num_blocks[0, 0] = (reqs_in_group * n).to(torch.int32)
        kwargs: dict[str, Any] = {
            "BLOCK_SIZE": (Q_BLOCK_SIZE, bs),
            "mask_mod": self.mask_mod,
            "seq_lengths": (self.num_requests * self.query_len, self.num_blocks * bs),
        }
        try:  # forward only: skip the transposed (q-block) indices (torch >= 2.9)
            self.block_mask = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, compute_q_blocks=False, **kwargs)
        except TypeError:
            self.block_mask = BlockMask.from_kv_blocks(self.kv_num_blocks, self.kv_indices, **kwargs)

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
        """Attention of ``query`` over the cache through the current block table.

        Returns:
            ``[num_requests * query_len, num_heads, head_size]``.

        Raises:
            RuntimeError: :meth:`set_block_table` was not called.
        """
        if self.block_mask is None:
            raise RuntimeError("call set_block_table() first")
        num_blocks, bs, num_kv_heads, head_size = k_cache.shape
        num_tokens = self.num_requests * self.query_len
        q = query.view(1, num_tokens, -1, head_size).transpose(1, 2)
        # [num_blocks, block_size, H, D] viewed as one sequence of num_blocks * block_size tokens.
        k = k_cache.view(1, num_blocks * bs, num_kv_heads, head_size).transpose(1, 2)
        v = v_cache.view(1, num_blocks * bs, num_kv_heads, head_size).transpose(1, 2)
        kernel_options = None
        if k.device.type == "cuda":
            # vLLM's choice with direct_build: tiles equal to the mask's blocks, and the
            # flex kernel rather than flex-decoding for single-token queries.
            kernel_options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK_SIZE, "BLOCK_N": bs}
        out = _flex()(q, k, v, block_mask=self.block_mask, scale=scale,
                      enable_gqa=q.shape[1] != num_kv_heads, kernel_options=kernel_options)
        return out.transpose(1, 2).reshape(num_tokens, -1, head_size)


def tables_tensor(tables: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """``list[list[int]]`` of equal length -> ``[num_requests, blocks_per_request]`` int32."""
    return torch.tensor(tables, dtype=torch.int32, device=device)
