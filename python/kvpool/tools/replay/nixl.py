"""P/D transfers through the real NIXL: two agents in this process, over UCX on loopback.

The decode side reads each prompt's KV from the prefill side as vLLM's ``NixlConnector``
does (pull: ``NixlConnectorWorker._read_blocks``, ``vllm/distributed/kv_transfer/
kv_connector/v1/nixl/pull_worker.py``, vLLM 0.34.0): each side registers one DRAM pool per
KV region (``num_regions`` x ``num_blocks`` x ``block_bytes``) and prepares it once as a
strided descriptor list (one descriptor per block, region after region); a transfer names
descriptors by index, ``region * num_blocks + block_id`` for every region and block of the
prompt (:func:`desc_ids`: ``NixlBaseConnectorWorker._compute_desc_ids``, its
all-attention path, one KV cache group); ``make_prepped_xfer`` then merges descriptors
where both indices advance together inside a region, and ``transfer`` posts them.

What :meth:`NixlTransfer.read` reports is NIXL's own telemetry for the request:
``descCount`` (descriptors after NIXL's merging), ``postDuration`` and ``xferDuration``
(microseconds). UCX runs over ``UCX_TLS=tcp`` on ``lo`` so that posting returns before the
copy completes; completion times are loopback TCP, not RDMA. The bytes are checked: every
block of the decode pool that a transfer wrote must equal its prefill block.

NIXL is optional. Without it, :func:`require_nixl` raises :class:`NixlUnavailable` naming
the install command (``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``: NIXL's slim
set; ``pip install nixl`` pulls a CUDA torch). The agents run without NIXL's progress
thread (it busy-spins a core) and are driven by polling; every wait has a timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.errors import NixlTransferError, NixlUnavailable

#: The command that installs what ``--nixl`` needs (NIXL 1.5.1 without CUDA's packages).
INSTALL = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"

#: The backend the agents use: the only one that moves DRAM to DRAM between two agents.
BACKEND = "UCX"


@dataclass(frozen=True)
class TransferStat:
    """NIXL's telemetry of one transfer request (one prompt).

    Attributes:
        descriptors: ``descCount``: descriptors NIXL posted, after its merging.
        post_us: ``postDuration``: microseconds to post them.
        xfer_us: ``xferDuration``: microseconds from posting to completion (loopback).
        blocks: blocks moved per region.
    """

    descriptors: int
    post_us: float
    xfer_us: float
    blocks: int


def require_nixl():
    """NIXL's ``nixl_agent`` and ``nixl_agent_config``.

    Raises:
        NixlUnavailable: NIXL is not installed (or does not import).
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # (ImportError, or a broken install failing on import)
        raise NixlUnavailable(f"--nixl needs NIXL, which does not import here ({e}); "
                              f"install it with: {INSTALL}") from e
    return nixl_agent, nixl_agent_config


def desc_ids(block_ids: Sequence[int], num_blocks: int, num_regions: int) -> np.ndarray:
    """Descriptor indices of ``block_ids`` in every region, as vLLM's
    ``NixlBaseConnectorWorker._compute_desc_ids`` computes them for one full-attention
    KV cache group (``nixl/base_worker.py``, vLLM 0.30.0-0.34.0): region ``r``'s
    descriptors start at ``r * num_blocks``; the ids of region 0, then of region 1, ...
    (``int32``, as ``make_prepped_xfer`` takes them).

    Raises:
        ValueError: a block id outside ``[0, num_blocks)``.
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    offsets = np.arange(num_regions, dtype=np.int64) * num_blocks
    return (offsets[:, None] + ids[None, :]).ravel().astype(np.int32)


class NixlTransfer:
    """A prefill agent and a decode agent with their registered pools (see the module).

    Args:
        num_blocks: blocks per region on each side (the replay's pool size).
        num_regions: KV regions per side (vLLM registers one per layer's K and V, or one
            per layer when they share a tensor; the count multiplies the descriptors).
        block_bytes: bytes per block in each region (small: only the count matters).
        timeout_s: seconds any one transfer may take before :class:`NixlTransferError`.

    Raises:
        NixlUnavailable: NIXL does not import.
        NixlTransferError: the agents or the warm-up transfer fail.
    """

    def __init__(self, num_blocks: int, num_regions: int = 2, block_bytes: int = 64,
                 timeout_s: float = 30.0) -> None:
        if num_blocks < 1 or num_regions < 1 or block_bytes < 8 or block_bytes % 8:
            raise ValueError("num_blocks and num_regions must be >= 1, block_bytes a multiple of 8")
        nixl_agent, nixl_agent_config = require_nixl()
        # UCX reads these when an agent creates its backend: TCP on loopback only.
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.num_blocks, self.num_regions, self.block_bytes = num_blocks, num_regions, block_bytes
        self.timeout_s = timeout_s
        words = block_bytes // 8
        self._prefill_buf = np.empty((num_regions, num_blocks, words), dtype=np.uint64)
        # Every word of block b of region r holds r * num_blocks + b: a block read from
        # the wrong place is seen.
        self._prefill_buf[:] = (np.arange(num_regions, dtype=np.uint64)[:, None, None] * num_blocks
                                + np.arange(num_blocks, dtype=np.uint64)[None, :, None])
        self._decode_buf = np.zeros_like(self._prefill_buf)
        suffix = f"{os.getpid()}-{id(self):x}"
        self.prefill_name = f"kvpool-prefill-{suffix}"

        def config():
            return nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                     capture_telemetry=True, backends=[BACKEND])
        try:
            self._prefill = nixl_agent(self.prefill_name, config())
            self._decode = nixl_agent(f"kvpool-decode-{suffix}", config())
            self._registered = [(a, a.register_memory(a.get_reg_descs(self._regions(buf), "DRAM")))
                                for a, buf in ((self._prefill, self._prefill_buf),
                                               (self._decode, self._decode_buf))]
            self._decode.add_remote_agent(self._prefill.get_agent_metadata())
            self._prefill.add_remote_agent(self._decode.get_agent_metadata())
            self._local = self._decode.prep_xfer_dlist("NIXL_INIT_AGENT", self._strided(self._decode_buf),
                                                       mem_type="DRAM")
            self._remote = self._decode.prep_xfer_dlist(self.prefill_name, self._strided(self._prefill_buf),
                                                        mem_type="DRAM")
        except NixlUnavailable:
            raise
        except Exception as e:
            raise NixlTransferError(f"NIXL agents could not be set up: {e}") from e
        # The first transfer connects the agents (make_connection() would wait on a peer
        # that nothing drives).
        self.read([0], [0])

    def _regions(self, buf: np.ndarray) -> list[tuple[int, int, int, str]]:
        return [(int(buf[r].ctypes.data), int(buf[r].nbytes), 0, "") for r in range(self.num_regions)]

    def _strided(self, buf: np.ndarray) -> np.ndarray:
        """One strided descriptor per region (address, block bytes, device 0, stride,
        blocks): one descriptor per block, as vLLM's connector prepares its regions."""
        return np.array([[int(buf[r].ctypes.data), self.block_bytes, 0, self.block_bytes, self.num_blocks]
                         for r in range(self.num_regions)], dtype=np.int64)

    def read(self, prefill_ids: Sequence[int], decode_ids: Sequence[int]) -> TransferStat:
        """Read the prefill side's blocks ``prefill_ids`` into the decode side's
        ``decode_ids`` (position by position, in every region) as one NIXL request, and
        check the bytes.

        Raises:
            ValueError: the tables differ in length, or an id is out of range.
            NixlTransferError: NIXL reports an error, the transfer does not complete
                within ``timeout_s``, or a block holds other bytes than its source's.
        """
        if len(prefill_ids) != len(decode_ids):
            raise ValueError(f"P/D tables of different lengths ({len(prefill_ids)} and {len(decode_ids)})")
        remote = desc_ids(prefill_ids, self.num_blocks, self.num_regions)
        local = desc_ids(decode_ids, self.num_blocks, self.num_regions)
        decode = self._decode
        try:
            handle = decode.make_prepped_xfer("READ", self._local, local, self._remote, remote,
                                              notif_msg=b"kvpool")
        except Exception as e:  # (NIXL's own exception types)
            raise NixlTransferError(f"NIXL could not prepare a transfer of {len(decode_ids)} blocks: {e}") from e
        try:
            state = decode.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state == "PROC":
                self._prefill.get_new_notifs()   # drives the prefill agent's side
                state = decode.check_xfer_state(handle)
                if state == "PROC" and time.monotonic() > deadline:
                    raise NixlTransferError(f"transfer of {len(decode_ids)} blocks still running after "
                                            f"{self.timeout_s} s")
            if state != "DONE":
                raise NixlTransferError(f"NIXL reported {state} for a transfer of {len(decode_ids)} blocks")
            telemetry = decode.get_xfer_telemetry(handle)
        except NixlTransferError:
            raise
        except Exception as e:  # (NIXL's own exception types)
            raise NixlTransferError(f"NIXL failed a transfer of {len(decode_ids)} blocks: {e}") from e
        finally:
            decode.release_xfer_handle(handle)
        self._prefill.get_new_notifs()   # (consume the completion notification)
        self._check(prefill_ids, decode_ids)
        return TransferStat(descriptors=int(telemetry.descCount), post_us=float(telemetry.postDuration),
                            xfer_us=float(telemetry.xferDuration), blocks=len(decode_ids))

    def _check(self, prefill_ids: Sequence[int], decode_ids: Sequence[int]) -> None:
        p = np.asarray(prefill_ids, dtype=np.int64)
        d = np.asarray(decode_ids, dtype=np.int64)
        if not np.array_equal(self._decode_buf[:, d], self._prefill_buf[:, p]):
            raise NixlTransferError("the decode side's blocks do not hold the prefill side's bytes")
        self._decode_buf[:, d] = 0   # the next transfer into these blocks is checked afresh

    def close(self) -> None:
        """Release the prepared lists and the registrations (idempotent)."""
        registered, self._registered = getattr(self, "_registered", []), []
        for handle in (getattr(self, "_local", None), getattr(self, "_remote", None)):
            if handle is not None:
                self._decode.release_dlist_handle(handle)
        self._local = self._remote = None
        for agent, reg in registered:
            agent.deregister_memory(reg)

    def __enter__(self) -> NixlTransfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def round_fields(nixl: NixlTransfer, prefill_tables: Sequence[Sequence[int]],
                 decode_tables: Sequence[Sequence[int]]) -> dict[str, float | int | None]:
    """Read every prompt of a round (``prefill_tables[i]`` into ``decode_tables[i]``, the
    null block left out on either side, as :func:`kvpool.tools.replay.metrics.pd_descriptors`
    leaves it out) through ``nixl``; the round's ``nixl_*`` fields (median and p90 by
    nearest rank, totals). Raises what :meth:`NixlTransfer.read` raises."""
    from kvpool.tools.replay.metrics import spread

    stats = []
    for p_table, d_table in zip(prefill_tables, decode_tables, strict=True):
        pairs = [(p, d) for p, d in zip(p_table, d_table, strict=True) if p != 0 and d != 0]
        if pairs:
            stats.append(nixl.read([p for p, _ in pairs], [d for _, d in pairs]))
    descs = spread([s.descriptors for s in stats])
    posts = spread([s.post_us for s in stats])
    xfers = spread([s.xfer_us for s in stats])
    return {"nixl_descriptors_median": descs["median"], "nixl_descriptors_p90": descs["p90"],
            "nixl_descriptors_total": descs["total"], "nixl_post_us_median": posts["median"],
            "nixl_post_us_total": posts["total"], "nixl_xfer_us_median": xfers["median"],
            "nixl_xfer_us_total": xfers["total"], "nixl_regions": nixl.num_regions}


__all__ = ["BACKEND", "INSTALL", "NixlTransfer", "NixlTransferError", "NixlUnavailable", "TransferStat",
           "desc_ids", "require_nixl", "round_fields"]
