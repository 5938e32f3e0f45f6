"""Drop-in fidelity: what kvpool changes must be only what it was asked to change.

Log lines go through vLLM's logging exactly as vLLM's own block pool's do, and the
free queue refuses blocks that must never be free (the null block, blocks in use)
where vLLM's own code never puts them there. The deferred-free order and
``pop_blocks_for_free``'s return contract are in ``test_deferred_free.py``.
"""

from __future__ import annotations

import io
import logging
import re

import pytest
import vllm.logger
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

import kvpool
from kvpool import BlockStateError, FreeKVCacheBlockQueue, KVCacheBlock
from kvpool.block_pool import BlockPool


def _configure_vllm_logging_at_info(monkeypatch) -> None:
    try:
        from vllm.config.logging import LoggingConfig
    except ImportError:  # vLLM 0.30.0: configured from VLLM_LOGGING_LEVEL only
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
        vllm.logger._configure_vllm_root_logger()
        return
    vllm.logger.configure_logging(LoggingConfig(log_level="INFO", configure_logging=True))


@pytest.fixture
def vllm_log(monkeypatch):
    """vLLM's logging configured as its engine core configures it (level INFO), with
    the "vllm" handler's stream captured; the previous configuration is restored."""
    vllm_logger = logging.getLogger("vllm")
    saved = (vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate)
    _configure_vllm_logging_at_info(monkeypatch)
    (handler,) = vllm_logger.handlers
    stream = io.StringIO()
    handler.setStream(stream)
    try:
        yield stream
    finally:
        vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate = saved


def _lines(stream: io.StringIO) -> list[str]:
    # Strip what differs between two runs of the same call: time, pid, line number.
    text = stream.getvalue()
    stream.seek(0)
    stream.truncate()
    text = re.sub(r"pid=\d+", "pid=N", text)
    text = re.sub(r"\d\d-\d\d \d\d:\d\d:\d\d", "TIME", text)
    text = re.sub(r":\d+\]", ":N]", text)
    return text.splitlines()


def _reset_twice(pool) -> None:
    held = pool.get_new_blocks(2)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True


def test_block_pool_log_lines_go_through_vllm_logging_as_vllm_s_own(vllm_log, capsys):
    _reset_twice(VllmBlockPool(16, True, 16))
    vanilla = _lines(vllm_log)
    _reset_twice(BlockPool(16, True, 16))
    ours = _lines(vllm_log)
    assert len(vanilla) == 2 and "WARNING" in vanilla[0] and "INFO" in vanilla[1]
    assert "Failed to reset prefix cache because some blocks (2) are not freed yet" in vanilla[0]
    assert "Successfully reset prefix cache" in vanilla[1]
    assert ours == vanilla  # same logger, handler, format and level rules
    captured = capsys.readouterr()
    assert "reset prefix cache" not in captured.err + captured.out  # nothing outside vLLM's handler


def test_block_pool_log_lines_follow_vllm_s_per_logger_levels(vllm_log):
    """An operator who silences vLLM's block pool logger (a VLLM_LOGGING_CONFIG_PATH
    entry for it) silences kvpool's pool too."""
    block_pool_logger = logging.getLogger("vllm.v1.core.block_pool")
    old = block_pool_logger.level
    block_pool_logger.setLevel(logging.ERROR)
    try:
        pool = BlockPool(16, True, 16)
        held = pool.get_new_blocks(1)
        assert pool.reset_prefix_cache() is False
        assert pool.reset_free_block_queue_order() is False
        pool.free_blocks(held)
        assert pool.reset_prefix_cache() is True
    finally:
        block_pool_logger.setLevel(old)
    assert _lines(vllm_log) == []


def test_reorder_refusal_and_install_lines_use_vllm_logging(vllm_log, monkeypatch):
    pool = BlockPool(16, True, 16)
    held = pool.get_new_blocks(3)
    assert pool.reset_free_block_queue_order() is False
    pool.free_blocks(held)
    (line,) = _lines(vllm_log)
    assert "WARNING" in line and "[block_pool.py:N]" in line
    assert "Failed to reset free_block_queue order because some blocks (3) are not freed yet" in line

    from kvpool import plugin

    monkeypatch.delenv("KVPOOL_DISABLE", raising=False)
    plugin.register()
    try:
        assert kvpool.is_installed()
        lines = _lines(vllm_log)
        assert any(re.search(r"INFO TIME \[plugin\.py:N\] kvpool .* active: native block pool", ln) for ln in lines)
    finally:
        kvpool.uninstall()
    monkeypatch.setenv("KVPOOL_DISABLE", "1")
    plugin.register()
    assert not kvpool.is_installed()
    assert any("disabled by KVPOOL_DISABLE=1" in ln for ln in _lines(vllm_log))


@pytest.mark.parametrize("op", ["append", "append_n", "prepend_n"])
def test_free_queue_refuses_the_null_block_and_blocks_in_use(op):
    """vLLM's queue accepts both (the next allocation then hands out block 0, or a
    block a request still holds); vLLM's own code never inserts them. kvpool refuses
    them and leaves the queue as it was."""
    pool = BlockPool(16, True, 16)
    queue = pool.free_block_queue
    held = pool.get_new_blocks(3)
    fine = held[2]
    fine.ref_cnt = 0  # a block nobody holds, not in the free list (as free_blocks sees it)
    before = [b.block_id for b in queue.get_all_free_blocks()]

    def insert(block):
        if op == "append":
            queue.append(block)
        else:
            getattr(queue, op)([fine, block])  # the bad block after a good one

    for bad, what in ((pool.null_block, "null block"), (held[0], "ref_cnt 1")):
        with pytest.raises(BlockStateError, match=what):
            insert(bad)
        assert [b.block_id for b in queue.get_all_free_blocks()] == before
        assert queue.num_free_blocks == len(before)
        queue.check_invariants()
    getattr(queue, op)(fine if op == "append" else [fine])
    assert queue.num_free_blocks == len(before) + 1
    assert 0 not in [b.block_id for b in pool.get_new_blocks(queue.num_free_blocks)]


def test_queue_built_from_all_blocks_accepts_block_0_before_it_becomes_the_null_block():
    """vLLM builds the queue from every block, then pops block 0 as the null block."""
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    null_block = queue.popleft()
    null_block.is_null = True
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 3]
    with pytest.raises(BlockStateError):
        queue.prepend_n([null_block])
