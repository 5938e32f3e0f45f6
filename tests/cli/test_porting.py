"""``python -m kvpool porting``: the parts that need no network, with small fixture
sources and the installed vLLM's own files (the wheel download is pip's)."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pytest

from kvpool import vllm_compat
from kvpool.__main__ import main as kvpool_main
from kvpool.errors import PortingError
from kvpool.tools.conformance import porting, porting_sources
from kvpool.tools.conformance.porting_sources import Sources, compare, find_definition

_UTILS = "vllm/v1/core/kv_cache_utils.py"
_POOL = "vllm/v1/core/block_pool.py"
_COORD = "vllm/v1/core/kv_cache_coordinator.py"


def _release(cache_body: str) -> Sources:
    return Sources({
        _UTILS: textwrap.dedent("""
            def make_block_hash_with_group_id(block_hash, group_id):
                return block_hash + bytes([group_id])

            class KVCacheBlock:
                block_id: int
            """),
        _POOL: textwrap.dedent("""
            from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

            class BlockPool:
                @staticmethod
                def get_num_free_blocks():
                    return 0
            """),
        _COORD: textwrap.dedent(f"""
            from abc import ABC

            class KVCacheCoordinator(ABC):
                def cache_blocks(self, request, num_computed_tokens):
                    {cache_body}

            class UnitaryKVCacheCoordinator(KVCacheCoordinator):
                pass
            """),
    })


OLD = _release("return None")
NEW = _release("return num_computed_tokens")


def test_a_method_is_found_through_the_class_s_bases():
    found = find_definition(OLD, "UnitaryKVCacheCoordinator", "cache_blocks")
    assert found.where == "vllm/v1/core/kv_cache_coordinator.py:KVCacheCoordinator.cache_blocks"
    assert found.source == "def cache_blocks(self, request, num_computed_tokens):\n    return None\n"


def test_a_module_function_is_found_through_the_module_s_imports():
    found = find_definition(OLD, "block_pool", "make_block_hash_with_group_id")
    assert found.where == "vllm/v1/core/kv_cache_utils.py:make_block_hash_with_group_id"
    assert found.source.startswith("def make_block_hash_with_group_id(block_hash, group_id):")


def test_decorators_and_whole_classes_are_part_of_the_source():
    assert find_definition(OLD, "BlockPool", "get_num_free_blocks").source.startswith("@staticmethod\n")
    assert find_definition(OLD, "KVCacheBlock", None).source == "class KVCacheBlock:\n    block_id: int\n"


def test_what_a_release_lacks_is_none():
    assert find_definition(OLD, "BlockPool", "cache_full_blocks") is None
    assert find_definition(OLD, "FreeKVCacheBlockQueue", None) is None
    assert find_definition(OLD, "KVCacheManager", "allocate_slots") is None  # module not in the release
    with pytest.raises(KeyError):
        find_definition(OLD, "NoSuchClass", "x")


def test_compare_labels_and_counts_the_diff():
    old = find_definition(OLD, "UnitaryKVCacheCoordinator", "cache_blocks")
    new = find_definition(NEW, "UnitaryKVCacheCoordinator", "cache_blocks")
    changed = compare("cache_blocks", old, new, "0.33.0", "0.34.0")
    assert (changed.status, changed.added, changed.removed) == ("changed", 1, 1)
    assert changed.diff.splitlines()[:2] == [
        "--- 0.33.0 vllm/v1/core/kv_cache_coordinator.py:KVCacheCoordinator.cache_blocks",
        "+++ 0.34.0 vllm/v1/core/kv_cache_coordinator.py:KVCacheCoordinator.cache_blocks"]
    assert "-    return None" in changed.diff and "+    return num_computed_tokens" in changed.diff
    assert compare("x", old, old, "a", "b").status == "same"
    assert compare("x", None, new, "a", "b").status == "added"
    assert compare("x", old, None, "a", "b").status == "removed"
    assert compare("x", None, None, "a", "b").status == "absent"


def test_the_installed_vllm_s_files_give_the_sources_the_fingerprint_reads():
    # The ast lookup finds, for every mirrored definition, the source that
    # manager_fast_path.mirrored_source() reads from the imported vLLM.
    import vllm

    from kvpool.patches import manager_fast_path

    sources = Sources(Path(vllm.__file__).parents[1])
    try:
        classes = manager_fast_path._classes()
    except (ImportError, AttributeError) as e:  # kvpool.block_pool does not import (0.29.0)
        pytest.skip(f"kvpool's block classes do not bind to this vLLM: {e}")
    for owner, name in manager_fast_path.MIRRORED:
        live = manager_fast_path._vanilla(classes[owner], name)
        found = find_definition(sources, owner, name)
        if live is None:
            assert found is None, (owner, name)
        else:
            assert found is not None and found.source == textwrap.dedent(inspect.getsource(live)), (owner, name)
    compared = porting_sources.compare_releases(sources, sources, "a", "a", manager_fast_path.MIRRORED)
    assert {c.status for c in compared} <= {"same", "absent"}
    assert sum(c.status == "same" for c in compared) >= len(manager_fast_path.MIRRORED)


@pytest.mark.parametrize(("version", "against"), [
    ("0.34.0", "0.33.0"), ("9.9.9", "0.34.0"), ("0.35.0", "0.34.0"), ("0.29.0", "0.30.0"),
    ("0.32.0", "0.31.0"), ("0.30.0", "0.31.0"),
    ("0.32.5", "0.32.0"),
])
def test_nearest_known_release(version, against):
    assert porting.nearest_known(version) == against


def test_an_unknown_version_is_one_error_line_not_a_traceback(monkeypatch, capsys, tmp_path):
    def not_on_the_index(version, dest):
        raise PortingError(f"vLLM {version} could not be downloaded from the package index (pip: ERROR: No "
                           f"matching distribution found for vllm=={version})")

    monkeypatch.setattr(porting_sources, "download_wheel", not_on_the_index)
    assert kvpool_main(["porting", "--vllm-version", "9.9.9", "--wheels", str(tmp_path)]) == porting.EXIT_SETUP_FAILED
    err = capsys.readouterr().err
    assert err.splitlines() == [("porting: vLLM 9.9.9 could not be downloaded from the package index (pip: ERROR: "
                                 "No matching distribution found for vllm==9.9.9)")]


def _probe(**over):
    found = {"vllm": "0.99.0", "bind_error": None, "install_error": None, "matching_release": None,
             "selfcheck": {"differences": [("BlockHashToBlockMap.__init__: vLLM takes (self, blocks), "
                                            "kvpool's takes (self)")],
                           "seconds": 0.004},
             "patch_modules": {"kvpool.patches.manager_hooks": None,
                               "kvpool.patches.engine_api": "MissingPatchTargetError: no reset_prefix_cache"}}
    return {**found, **over}


def test_the_report_gives_the_summary_first_then_the_diffs():
    mirrored = (("UnitaryKVCacheCoordinator", "cache_blocks"), ("block_pool", "make_block_hash_with_group_id"))
    compared = porting_sources.compare_releases(OLD, NEW, "0.33.0", "0.99.0", mirrored)
    text = porting.format_report("0.99.0", "0.33.0", compared, _probe(), ".venv-vllm-0.99.0")
    lines = text.splitlines()
    assert lines[0] == ("kvpool porting report: vLLM 0.99.0 (NOT supported), against vLLM 0.33.0, "
                        "the nearest release kvpool knows")
    assert "self-check: FAILS, 1 difference(s) (4 ms); install() refuses this release:" in lines
    assert "  - BlockHashToBlockMap.__init__: vLLM takes (self, blocks), kvpool's takes (self)" in lines
    assert "  kvpool.patches.manager_hooks: bound" in lines
    assert "  kvpool.patches.engine_api: skipped (MissingPatchTargetError: no reset_prefix_cache)" in lines
    assert ("native manager path (manager_fast_path.matching_release()): off, the mirrored sources match no "
            "release of KNOWN_SOURCES") in lines
    summary = "definitions kvpool mirrors or replaces: 6 compared with 0.33.0: 3 same, 1 changed, 2 absent"
    assert summary in lines
    assert "  changed  UnitaryKVCacheCoordinator.cache_blocks (+1 -1)" in lines
    assert lines.index(summary) < lines.index("=== UnitaryKVCacheCoordinator.cache_blocks (changed)")
    assert "=== " not in porting.format_report("0.99.0", "0.33.0", compared, _probe(), "x", diffs=False)


def test_the_report_without_an_environment_or_bindable_classes():
    text = porting.format_report("0.29.0", "0.30.0", [], None, "no environment with vLLM 0.29.0 (...)")
    assert "environment: not probed: no environment with vLLM 0.29.0 (...)" in text.splitlines()
    text = porting.format_report("0.29.0", "0.30.0", [], _probe(bind_error="AttributeError: no _notify_reuse"), "x")
    assert ("block classes: do NOT bind (AttributeError: no _notify_reuse); install() refuses before the "
            "self-check") in text.splitlines()


def test_the_probe_of_the_installed_release():
    # In this environment's vLLM, unpatched afterwards.
    import kvpool

    found = porting.probe()
    assert not kvpool.is_installed()
    assert found["vllm"] == vllm_compat.installed_vllm_version()
    if found["bind_error"]:  # a release whose classes kvpool cannot bind (0.29.0)
        return
    assert isinstance(found["selfcheck"]["differences"], list)
    if vllm_compat.is_supported(found["vllm"]):
        assert found["selfcheck"]["differences"] == []
        assert found["install_error"] is None
        assert found["patch_modules"] and all(why is None for why in found["patch_modules"].values())
        from kvpool.patches import manager_fast_path

        if found["vllm"] in manager_fast_path.KNOWN_SOURCES:
            assert found["matching_release"] == found["vllm"]
