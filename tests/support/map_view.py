"""A layout-free view of a prefix-cache map (``BlockHashToBlockMap``), for comparing
pools across vLLM releases: vLLM 0.30.0-0.33.0 store blocks (a dict of them for a key
several blocks cache), vLLM >= 0.34.0 block ids (every id of such a key in ``_dup_ids``)."""

from __future__ import annotations


def map_entries(hash_map) -> dict:
    """``{key: [block_id, ...]}``: the ids cached under each key, in insertion order
    (the first is what ``get_one_block`` returns)."""
    dup_ids = getattr(hash_map, "_dup_ids", None)
    out = {}
    for key, value in hash_map._cache.items():
        if dup_ids is not None:
            out[key] = list(dup_ids[key]) if key in dup_ids else [value]
        elif isinstance(value, dict):
            out[key] = list(value)
        else:
            out[key] = [value.block_id]
    return out
