"""kvpool's ``BlockHashToBlockMap``: vLLM's prefix-cache map for kvpool's pool, in the
layout of the installed vLLM release (``kvpool.vllm_compat.VllmRelease.block_ids_map``).

kvpool's native caching, eviction and lookup (``src/kvpool/manager.pxi``, ``alloc.pxi``,
``lookup.pxi``) read and write the map's dicts directly when its type is this class and
its methods are these, so the layout here is the layout they are compiled for.
"""

from __future__ import annotations

from vllm.v1.core import block_pool as _vllm_block_pool

from kvpool.vllm_compat import release_traits

VllmBlockHashToBlockMap = _vllm_block_pool.BlockHashToBlockMap

#: The traits of the installed vLLM (the nearest release kvpool knows) that kvpool's
#: classes are set up with, once, at import (kvpool.block_pool reads them here too).
TRAITS = release_traits()
#: True when the installed vLLM's map stores block ids (vLLM >= 0.34.0).
BLOCK_IDS_MAP: bool = TRAITS.block_ids_map


class _ObjectsMap(VllmBlockHashToBlockMap):
    """vLLM 0.30.0-0.33.0's map (``{key: block}``, ``{key: {block_id: block}}`` for
    duplicates), told apart from its dict case by ``type(x) is dict``.

    vLLM's version tests ``isinstance(x, KVCacheBlock)`` against the name bound in
    ``block_pool``'s namespace, which is vLLM's dataclass unless kvpool is installed;
    this keeps a kvpool pool correct whether or not kvpool is installed.
    """

    def get_one_block(self, key):
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is dict:
            return next(iter(blocks.values()))
        return blocks

    def contain(self, key, block_id: int) -> bool:
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if type(blocks) is dict:
            return block_id in blocks
        return blocks.block_id == block_id

    def insert(self, key, block) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif type(blocks) is dict:
            blocks[block.block_id] = block
        else:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}

    def pop(self, key, block_id: int):
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if type(blocks) is dict:
            block = blocks.pop(block_id, None)
            if len(blocks) > 0:
                self._cache[key] = blocks
            return block
        if blocks.block_id == block_id:
            return blocks
        self._cache[key] = blocks
        return None


class _IdsMap(VllmBlockHashToBlockMap):
    """vLLM >= 0.34.0's map, vLLM's own methods: ``_cache`` ``{key: block_id}``,
    ``_dup_ids`` ``{key: {block_id: None}}`` (every id, in insertion order, of a key
    several blocks cache), ``_blocks`` the pool's block list (kvpool's ``BlockTable``),
    ``clear()`` in place. Its methods read no block type, so vLLM's serve kvpool's
    blocks as they are."""


#: kvpool's map class for the installed vLLM (the native code checks ``type(map) is``
#: this class).
BlockHashToBlockMap = _IdsMap if BLOCK_IDS_MAP else _ObjectsMap
BlockHashToBlockMap.__name__ = BlockHashToBlockMap.__qualname__ = "BlockHashToBlockMap"


def new_map(blocks) -> VllmBlockHashToBlockMap:
    """An empty map of kvpool's class for a pool whose block list is ``blocks``."""
    return BlockHashToBlockMap(blocks) if BLOCK_IDS_MAP else BlockHashToBlockMap()


__all__ = ["BLOCK_IDS_MAP", "TRAITS", "BlockHashToBlockMap", "VllmBlockHashToBlockMap", "new_map"]
