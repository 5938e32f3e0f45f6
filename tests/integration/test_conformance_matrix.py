"""``conformance --vllm-version X`` / ``--all``: argument hand-off, the table, and the
one place that knows each release (``kvpool.vllm_compat``)."""

from __future__ import annotations

from kvpool import vllm_compat
from kvpool.tools.conformance import cli, matrix
from tests.support.paths import REPO


def test_matrix_arguments_are_not_forwarded_to_each_release_run():
    argv = ["--all", "--vllm-version", "0.31.0", "--json=x.json", "--jobs", "1", "--json", "y.json", "-k", "pool"]
    assert cli._without_matrix_args(argv) == ["--jobs", "1", "-k", "pool"]


def test_unknown_release_is_refused_before_anything_is_built(capsys):
    assert cli.main(["--vllm-version", "0.29.0"]) == matrix.EXIT_SETUP_FAILED
    assert "not in kvpool's matrix" in capsys.readouterr().err


def test_every_release_has_its_pins_file():
    for version in vllm_compat.VLLM_RELEASES:
        pins = (REPO / "requirements" / f"vllm-{version}.txt").read_text()
        assert any(line.startswith("xgrammar==") for line in pins.splitlines()), version


def test_table_has_one_row_per_release_with_counts():
    report = {
        "vanilla": {"passed": 10, "failed": 0, "skipped": 1, "errors": 0},
        "kvpool": {"passed": 9, "failed": 1, "skipped": 1, "errors": 0},
        "regressions": ["t::a"],
        "excluded": [{"nodeid": "x", "reason": "r", "matched": 3}, {"nodeid": "y", "reason": "r", "matched": None}],
        "problems": [],
        "total_wall_s": 12.0,
    }
    rows = [matrix.table_row("0.31.0", 1, report), matrix.table_row("0.30.0", 3, None)]
    assert rows[0]["regressions"] == 1 and rows[0]["excluded"] == 3 and rows[0]["vanilla_passed"] == 10
    table = matrix.format_table(rows).splitlines()
    assert table[2].startswith("| 0.31.0 | 10 | 9 | 1 | 3 | 1 |")
    assert table[3].startswith("| 0.30.0 | - | - | - | - | 3 |")


def test_release_traits_are_one_row_per_release():
    traits = vllm_compat.release_traits()
    assert traits.version == vllm_compat._release(vllm_compat.installed_vllm_version())
    assert [r.all_engine_utility_call for r in vllm_compat.VLLM_RELEASES.values()] == [False, False, True, True, True]
