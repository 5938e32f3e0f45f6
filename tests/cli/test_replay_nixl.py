"""``python -m kvpool replay --nixl``: P/D transfers through the real NIXL (kvpool.tools.replay.nixl).

The descriptor indices are checked against vLLM's own ``_compute_desc_ids`` (the installed
release's NixlConnector), NIXL's ``descCount`` against the replay's own count (runs in which
both tables ascend by 1, times the KV regions) prompt by prompt, the bytes moved, the
failure paths (a transfer that never completes, bytes that differ), and the CLI without NIXL.
"""

from __future__ import annotations

import inspect
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

from kvpool.tools.replay import metrics, nixl
from kvpool.tools.replay.nixl import NixlTransfer, NixlTransferError, NixlUnavailable, desc_ids

NUM_BLOCKS = 4096


@pytest.fixture(scope="module")
def transfer():
    with NixlTransfer(NUM_BLOCKS, num_regions=3, block_bytes=32, timeout_s=20) as x:
        yield x


def _vllm_desc_ids(block_ids, num_blocks, num_regions):
    """vLLM's NixlBaseConnectorWorker._compute_desc_ids for one full-attention group, called
    with the arguments the release's pull worker passes (0.34.0: ``pairs``; before:
    ``region_group_ids``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    fn = NixlBaseConnectorWorker._compute_desc_ids
    worker = SimpleNamespace(_has_mamba=False, num_regions=num_regions,
                             block_len_per_layer=[64] * num_regions, _ssm_region_indices=None,
                             _transfer_layer_group_ids=None,   # (0.33.0: no layer-name routing)
                             region_group_ids=[0] * num_regions, _uses_region_group_mapping=False)
    params = inspect.signature(fn).parameters
    kwargs = dict(block_ids=(list(block_ids),), dst_num_blocks=num_blocks, block_size_ratio=None,
                  physical_blocks_per_logical=1)
    if "pairs" in params:
        kwargs["pairs"] = (list(range(num_regions)), [0] * num_regions)
    else:
        kwargs["region_group_ids"] = [0] * num_regions
        kwargs["uses_region_group_mapping"] = False
    return np.asarray(fn(worker, **kwargs))


@pytest.mark.parametrize("seed", range(5))
def test_descriptor_ids_are_vllms(seed):
    rng = random.Random(seed)
    ids = rng.sample(range(NUM_BLOCKS), rng.randrange(1, 300))
    regions = rng.choice([1, 2, 4])
    assert desc_ids(ids, NUM_BLOCKS, regions).tolist() == _vllm_desc_ids(ids, NUM_BLOCKS, regions).tolist()


def test_descriptor_ids_out_of_range():
    with pytest.raises(ValueError, match="block ids"):
        desc_ids([NUM_BLOCKS], NUM_BLOCKS, 2)


def _tables(rng: random.Random, n: int, shape: str) -> tuple[list[int], list[int]]:
    if shape == "contiguous":
        p0, d0 = rng.randrange(1, NUM_BLOCKS - n), rng.randrange(1, NUM_BLOCKS - n)
        return list(range(p0, p0 + n)), list(range(d0, d0 + n))
    if shape == "scrambled":
        return rng.sample(range(1, NUM_BLOCKS), n), rng.sample(range(1, NUM_BLOCKS), n)
    # runs of random lengths on both sides, some broken on one side only
    p, d = [], []
    pool_p, pool_d = list(range(1, NUM_BLOCKS, 64)), list(range(1, NUM_BLOCKS, 64))
    rng.shuffle(pool_p)
    rng.shuffle(pool_d)
    while len(p) < n:
        run = rng.randrange(1, 40)
        sp, sd = pool_p.pop(), pool_d.pop()
        p += list(range(sp, sp + run))
        d += list(range(sd, sd + run)) if rng.random() < 0.7 else rng.sample(range(sd, sd + 60), run)
    return p[:n], d[:n]


@pytest.mark.parametrize("shape", ["contiguous", "scrambled", "runs"])
def test_nixl_counts_what_the_replay_counts(transfer, shape):
    """NIXL's descCount for a prompt = the replay's paired-run count x the KV regions."""
    rng = random.Random(hash(shape) & 0xFFFF)
    for _ in range(20):
        p, d = _tables(rng, rng.randrange(1, 400), shape)
        stat = transfer.read(p, d)
        assert stat.descriptors == metrics.pd_descriptors(p, d) * transfer.num_regions, (p[:8], d[:8])
        assert stat.blocks == len(p) and stat.post_us >= 0 and stat.xfer_us >= 0


def test_bytes_that_differ_are_an_error(transfer):
    transfer.read([5, 6], [7, 8])
    transfer._decode_buf[:, 8] += 1
    with pytest.raises(NixlTransferError, match="bytes"):
        transfer._check([5, 6], [7, 8])
    transfer._decode_buf[:, [7, 8]] = 0


def test_a_transfer_that_never_completes_times_out(transfer, monkeypatch):
    monkeypatch.setattr(transfer, "timeout_s", 0.2)
    real = transfer._decode.transfer
    monkeypatch.setattr(transfer._decode, "transfer", lambda handle, *a: real(handle, *a) and "PROC")
    monkeypatch.setattr(transfer._decode, "check_xfer_state", lambda handle: "PROC")
    with pytest.raises(NixlTransferError, match="still running"):
        transfer.read([1, 2, 3], [4, 5, 6])


def test_an_error_inside_nixl_is_a_transfer_error(transfer, monkeypatch):
    def fail(*args, **kwargs):
        raise Exception("NIXL_ERR_BACKEND")   # what nixl's bindings raise: not a RuntimeError
    monkeypatch.setattr(transfer._decode, "check_xfer_state", fail)
    real = transfer._decode.transfer
    monkeypatch.setattr(transfer._decode, "transfer", lambda handle, *a: real(handle, *a) and "PROC")
    with pytest.raises(NixlTransferError, match="NIXL_ERR_BACKEND"):
        transfer.read([1], [2])
    monkeypatch.undo()
    assert transfer.read([1], [2]).descriptors == transfer.num_regions   # the pair still works


def test_tables_of_different_lengths(transfer):
    with pytest.raises(ValueError, match="different lengths"):
        transfer.read([1, 2], [3])


def test_a_pd_replay_through_nixl():
    """A small P/D replay: every round's NIXL descriptors are the replay's P/D descriptors
    times the regions, in every mode, and the prompts' tables read back equal."""
    from kvpool.tools.replay.engine import PoolSpec
    from kvpool.tools.replay.runner import run_replay
    from kvpool.tools.replay.workloads import pd

    wl = pd(rounds=2, requests_per_round=6, prompt_len=(200, 900), output_len=(8, 16), scale=1.0, seed=3)
    modes = run_replay(wl, PoolSpec(num_blocks=256, block_size=16), ("vanilla", "kvpool+contiguous"),
                       nixl=True, save_tables=True)
    for name, result in modes.items():
        assert result.skipped is None, name
        for r in result.rounds:
            assert r.nixl_regions == 2
            assert r.nixl_descriptors_total == r.pd_descriptors_total * 2, (name, r.round)
            assert r.nixl_post_us_total > 0 and r.nixl_xfer_us_median is not None
    with NixlTransfer(256) as x:
        r = modes["vanilla"].rounds[-1]
        for p, d in zip(r.tables["prefill_prompt"], r.tables["prompt"]):
            assert x.read(p, d).descriptors == metrics.pd_descriptors(p, d) * 2


@pytest.fixture
def in_process_cli(monkeypatch):
    """The replay's ``main`` in this process; the environment must be as it was after each
    call (``main`` sets vLLM's platform and log level for its run and puts them back), so
    later subprocesses of the suite still see vLLM's info lines."""
    from kvpool.tools.replay.cli import main

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # main sets it for its run

    def checked(argv):
        before = dict(os.environ)
        rc = main(argv)
        assert dict(os.environ) == before, "python -m kvpool replay's main left the environment changed"
        return rc

    return checked


def test_without_nixl_the_cli_names_the_install_command(monkeypatch, capsys, in_process_cli):
    main = in_process_cli

    def missing():
        raise NixlUnavailable(f"--nixl needs NIXL, which does not import here (no module); "
                              f"install it with: {nixl.INSTALL}")
    monkeypatch.setattr(nixl, "require_nixl", missing)
    rc = main(["--workload", "pd", "--nixl", "--rounds", "1", "--scale", "0.01", "--num-blocks", "2000",
               "--no-plot", "--quiet", "--json", "/dev/null"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1" in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_nixl_needs_a_pd_workload(capsys, in_process_cli):
    main = in_process_cli

    rc = main(["--workload", "grpo", "--nixl", "--rounds", "1", "--scale", "0.01",
               "--no-plot", "--quiet", "--json", "/dev/null"])
    assert rc == 2
    assert "--nixl needs a P/D workload" in capsys.readouterr().err
