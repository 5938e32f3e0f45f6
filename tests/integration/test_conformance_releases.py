"""The conformance runner's per-release knowledge (``kvpool.tools.conformance.suites``' tables keyed
by release) and the native manager path probe each release's report carries
(``kvpool.tools.conformance.probe``), without running vLLM's suites."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpool.tools.conformance import cli, matrix, probe, report, sdist, suites, workdir
from kvpool.tools.hf_offline import materialize_hf_cache
from tests.support.sdist import write_sdist

LIFECYCLE = "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py"
VECTORS = "rust/src/engine-core-client/src/tests/prompt_block_hash_vectors.json"
PRESSURE = "tests/v1/core/test_scheduler.py::test_encoder_cache_pressure_respects_disabled_chunked_prefill"
PREFIX_HIT_INSIDE_ITEM = "tests/v1/core/test_scheduler.py::test_no_mm_input_chunking_after_prefix_cache_hit_inside_item"


def test_the_suite_list_of_a_release_leaves_out_what_vllm_removed_by_then():
    assert LIFECYCLE in suites.default_suites("0.30.0")
    assert LIFECYCLE in suites.default_suites("0.33.0")
    assert LIFECYCLE not in suites.default_suites("0.34.0")
    assert LIFECYCLE not in suites.default_suites("0.34.0+cpu")
    assert LIFECYCLE not in suites.default_suites("0.35.1")
    assert suites.default_suites("0.34.0") == [s for s in suites.DEFAULT_SUITES if s != LIFECYCLE]
    assert suites.default_suites("0.33.0") == list(suites.DEFAULT_SUITES)
    # Every removed suite is one of the default list (a typo would remove nothing).
    for removed in suites.REMOVED_SUITES.values():
        assert set(removed) <= set(suites.DEFAULT_SUITES)


def test_data_files_are_those_of_the_release_and_later():
    assert suites.data_files("0.33.0") == []
    assert suites.data_files("0.34.0") == [VECTORS]
    assert suites.data_files("0.34.1") == [VECTORS]


@pytest.mark.parametrize("nodeid", [PRESSURE, PREFIX_HIT_INSIDE_ITEM])
def test_the_llava_tests_new_in_0_34_are_excluded_with_the_llava_reason(nodeid):
    (exclusion,) = [e for e in suites.EXCLUSIONS if e.nodeid == nodeid]
    assert exclusion.reason == suites.LLAVA_0_34 and exclusion.reason.startswith(suites.LLAVA)
    assert "mistral_common" in exclusion.reason
    assert exclusion in suites.exclusions_for(suites.default_suites("0.34.0"))


def _sdist_with_vectors(path: Path) -> Path:
    files = {
        "tests/__init__.py": "",
        "tests/v1/core/test_vectors.py": "def test_v():\n    pass\n",
        "pyproject.toml": "",
        VECTORS: '{"vectors": []}\n',
        "rust/src/engine-core-client/src/lib.rs": "// not extracted\n",
    }
    return write_sdist(path, "0.34.0", files)


def test_the_data_file_lands_at_its_sdist_path_and_nothing_else_of_rust(tmp_path):
    tarball = _sdist_with_vectors(tmp_path / "vllm-0.34.0.tar.gz")
    src = tmp_path / "src"
    args = cli.build_parser().parse_args(["--sdist", str(tarball)])
    got, chosen = cli._extract_suites(args, "0.34.0", ["tests/v1/core"], src)
    assert chosen == ["tests/v1/core"]
    assert json.loads((src / VECTORS).read_text()) == {"vectors": []}
    assert not (src / "rust/src/engine-core-client/src/lib.rs").exists()
    # 0.33.0's list has no data file: the tree is tests/ and pyproject.toml only.
    cli._extract_suites(args, "0.33.0", ["tests/v1/core"], src)
    assert not (src / "rust").exists()


SDIST_0_34 = sdist.cache_dir() / "sdists" / "vllm-0.34.0.tar.gz"


@pytest.mark.skipif(not SDIST_0_34.is_file(),
                    reason="vLLM 0.34.0's sdist is not cached (python -m kvpool conformance fetches it)")
def test_vllm_0_34_sdist_holds_the_vector_file_its_test_reads(tmp_path):
    # The path the test computes: tests/v1/core/<file>.parents[3] / VECTORS, i.e. the sdist root.
    src = sdist.extract_tests(SDIST_0_34, tmp_path / "src",
                              (*sdist.EXTRACT_MEMBERS, *suites.data_files("0.34.0")))
    test = (src / "tests/v1/core/test_prompt_block_hash_vectors.py").read_text()
    assert '"prompt_block_hash_vectors.json"' in test and "parents[3]" in test
    assert isinstance(json.loads((src / VECTORS).read_text()), (dict, list))
    assert not (src / "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py").exists()


@pytest.mark.slow  # a child process imports vLLM and installs kvpool
def test_probe_reports_what_install_binds_in_this_environment(tmp_path):
    pytest.importorskip("kvpool._core")
    from kvpool.patches import manager_fast_path

    env = workdir.run_environment(dict(os.environ), materialize_hf_cache(tmp_path / "hf"), "kvpool")
    got = probe.native_manager_probe(env)
    assert got["error"] is None
    assert got["mirrored_fingerprint"] == manager_fast_path.source_fingerprint()
    # The native path binds exactly where the mirrored sources are a known release's.
    assert got["native_manager_path"] is (manager_fast_path.matching_release() is not None)
    # KVPOOL_PYTHON_MANAGER=1 keeps vLLM's Python allocate_slots: the probe must see it off.
    off = probe.native_manager_probe({**env, "KVPOOL_PYTHON_MANAGER": "1"})
    assert off["native_manager_path"] is False and off["mirrored_fingerprint"] == got["mirrored_fingerprint"]


def test_probe_failure_is_reported_not_raised(tmp_path):
    got = probe.native_manager_probe(dict(os.environ), python=str(tmp_path / "no-python"))
    assert got["native_manager_path"] is None and got["mirrored_fingerprint"] is None
    assert got["error"].startswith("probe did not run")
    bad = probe.native_manager_probe(dict(os.environ), python=str(_false(tmp_path)))
    assert bad["native_manager_path"] is None and bad["error"].startswith("probe exited 3")


def _false(tmp_path: Path) -> Path:
    script = tmp_path / "fails"
    script.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    script.chmod(0o755)
    return script


def _report(**extra) -> dict:
    empty = report.RunResult.from_plugin_json("vanilla", {"outcomes": {}, "exitstatus": 0})
    return report.build_report(vllm_version="0.34.0", suites=["tests/v1/core"], vanilla=empty,
                               kvpool=None, exclusions=[], extra=extra)


def test_text_report_and_matrix_table_show_the_native_path_and_fingerprint():
    on = _report(native_manager_path=True, mirrored_fingerprint="ab" * 32, native_manager_probe_error=None)
    assert f"native KV cache manager path: on; mirrored vLLM sources' fingerprint {'ab' * 32}" \
        in report.format_summary(on)
    off = _report(native_manager_path=False, mirrored_fingerprint="cd" * 32, native_manager_probe_error=None)
    assert "native KV cache manager path: off;" in report.format_summary(off)
    failed = _report(native_manager_path=None, mirrored_fingerprint=None, native_manager_probe_error="boom")
    assert "path: unknown; mirrored vLLM sources' fingerprint unknown (probe: boom)" in report.format_summary(failed)
    rows = [matrix.table_row("0.33.0", 0, on), matrix.table_row("0.34.0", 1, off), matrix.table_row("0.35.0", 3, None)]
    assert rows[1]["native_manager_path"] is False and rows[1]["mirrored_fingerprint"] == "cd" * 32
    table = matrix.format_table(rows).splitlines()
    assert table[0].endswith("| native manager path |")
    assert table[2].endswith(f"| on ({'ab' * 6}) |") and table[3].endswith(f"| off ({'cd' * 6}) |")
    assert table[4].endswith("| - |")
