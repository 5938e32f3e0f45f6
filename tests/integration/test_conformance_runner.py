"""``python -m kvpool conformance``: comparison and report logic on synthetic outcomes,
the pytest plugins and the fixture override on a synthetic test tree, sdist lookup and
caching against an index on disk, and the offline Hugging Face cache of every shipped
model config.

The end-to-end tests run the command line on a synthetic "sdist" whose tests check
which block pool they see, so the runner's regression detection is exercised on a real
difference between the vanilla and the kvpool run without fetching vLLM's tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpool.cpu_platform import cpu_environment
from kvpool.tools.conformance import cli, report, sdist, suites, workdir
from kvpool.tools.conformance.report import RunResult
from kvpool.tools.conformance.suites import Exclusion
from kvpool.tools.hf_offline import CONFIG_ROOT, materialize_hf_cache, offline_env, shipped_models
from tests.support.paths import REPO
from tests.support.sdist import write_sdist


def run(mode: str, outcomes: dict[str, str], **kw) -> RunResult:
    kw.setdefault("collected", len(outcomes))
    kw.setdefault("kvpool_installed", mode == "kvpool")
    return RunResult(mode=mode, outcomes=dict(outcomes), **kw)


# -- comparison and report -------------------------------------------------------------


def test_regression_is_any_vanilla_pass_that_does_not_pass_with_kvpool():
    vanilla = run("vanilla", {"a": "passed", "b": "passed", "c": "passed", "d": "passed", "e": "passed"})
    kvpool = run("kvpool", {"a": "passed", "b": "failed", "c": "error", "d": "skipped"})  # e: not collected
    assert report.find_regressions(vanilla, kvpool) == ["b", "c", "d", "e"]


def test_tests_failing_or_skipped_in_vanilla_are_not_regressions():
    vanilla = run("vanilla", {"f": "failed", "s": "skipped", "x": "error"})
    kvpool = run("kvpool", {"f": "failed", "s": "skipped", "x": "passed"})
    assert report.find_regressions(vanilla, kvpool) == []
    assert report.find_fixed(vanilla, kvpool) == ["x"]


def test_counts_use_report_keys():
    result = run("vanilla", {"a": "passed", "b": "passed", "c": "failed", "d": "skipped", "e": "error"})
    assert report.counts(result) == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}


def _build(vanilla, kvpool, exclusions=()):
    return report.build_report(
        vllm_version="0.33.0",
        suites=["tests/v1/core"],
        vanilla=vanilla,
        kvpool=kvpool,
        exclusions=list(exclusions),
    )


def test_report_shape_and_exit_code_zero_when_conformant():
    r = _build(run("vanilla", {"a": "passed", "b": "failed"}), run("kvpool", {"a": "passed", "b": "failed"}))
    for key in ("vllm", "suites", "vanilla", "kvpool", "regressions", "excluded"):
        assert key in r
    assert r["vllm"] == "0.33.0"
    assert r["vanilla"] == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0}
    assert r["regressions"] == []
    assert r["exit_code"] == report.EXIT_OK == 0
    json.dumps(r)  # serialisable
    assert "OK: no regressions" in report.format_summary(r)


def test_exit_code_one_and_details_on_regression():
    kvpool = run(
        "kvpool",
        {"t::a": "failed"},
        messages={"t::a": "x = 1\n>   assert x == 2\nE   assert 1 == 2\nt.py:3: AssertionError"},
    )
    r = _build(run("vanilla", {"t::a": "passed"}), kvpool)
    assert r["regressions"] == ["t::a"]
    assert r["exit_code"] == report.EXIT_REGRESSIONS == 1
    assert r["regression_details"]["t::a"]["kvpool"] == "failed"
    assert "E   assert 1 == 2" in r["regression_details"]["t::a"]["message"]
    summary = report.format_summary(r)
    assert "REGRESSIONS (1)" in summary and "t::a" in summary


@pytest.mark.parametrize(
    "vanilla, kvpool, problem",
    [
        (run("vanilla", {}, collected=0), run("kvpool", {}), "collected no tests"),
        (
            run("vanilla", {"a": "passed"}, kvpool_installed=True),
            run("kvpool", {"a": "passed"}),
            "had kvpool installed",
        ),
        (run("vanilla", {"a": "passed"}), run("kvpool", {"a": "passed"}, kvpool_installed=False), "without kvpool"),
        (run("vanilla", {"a": "passed"}), RunResult("kvpool", problem="kvpool run wrote no outcomes"), "no outcomes"),
    ],
    ids=["vanilla-collected-nothing", "vanilla-ran-kvpool", "kvpool-ran-vanilla", "kvpool-crashed"],
)
def test_exit_code_two_when_runs_are_not_comparable(vanilla, kvpool, problem):
    r = _build(vanilla, kvpool)
    assert r["exit_code"] == report.EXIT_INVALID_RUN == 2
    assert any(problem in p for p in r["problems"]), r["problems"]


def test_crashed_kvpool_run_reports_every_vanilla_pass_as_regression():
    r = _build(run("vanilla", {"a": "passed", "b": "failed"}), RunResult("kvpool", problem="boom"))
    assert r["regressions"] == ["a"]
    assert r["exit_code"] != 0


def test_excluded_entries_count_deselected_tests_per_exclusion():
    exclusions = [
        Exclusion("tests/x/test_a.py::test_gpu", "needs a GPU"),
        Exclusion("tests/x/test_b.py", "needs model weights"),
    ]
    vanilla = run(
        "vanilla",
        {"a": "passed"},
        excluded={
            "tests/x/test_a.py::test_gpu[1]": "tests/x/test_a.py::test_gpu",
            "tests/x/test_a.py::test_gpu[2]": "tests/x/test_a.py::test_gpu",
        },
    )
    r = _build(vanilla, run("kvpool", {"a": "passed"}), exclusions)
    assert r["excluded"] == [
        {"nodeid": "tests/x/test_a.py::test_gpu", "reason": "needs a GPU", "matched": 2},
        {"nodeid": "tests/x/test_b.py", "reason": "needs model weights", "matched": None},
    ]


def test_key_lines_keep_the_raising_lines():
    text = "def test():\n    x = f()\n>   assert x\nE   AssertionError: boom\n\ntests/t.py:4: AssertionError"
    assert report.key_lines(text) == ">   assert x\nE   AssertionError: boom\ntests/t.py:4: AssertionError"


# -- exclusions as data ----------------------------------------------------------------


def test_exclusion_matches_its_cases_but_not_tests_sharing_a_prefix():
    e = Exclusion("tests/t.py::test_foo", "r")
    assert e.matches("tests/t.py::test_foo")
    assert e.matches("tests/t.py::test_foo[1-True]")
    assert not e.matches("tests/t.py::test_foo_bar")
    f = Exclusion("tests/t.py", "r")
    assert f.is_file and f.matches("tests/t.py::TestX::test_y") and not f.matches("tests/t.pyx::a")


def test_every_exclusion_has_a_reason_lies_in_a_default_suite_and_is_unique():
    nodeids = [e.nodeid for e in suites.EXCLUSIONS]
    assert len(nodeids) == len(set(nodeids))
    assert suites.exclusions_for(suites.DEFAULT_SUITES) == list(suites.EXCLUSIONS)
    for e in suites.EXCLUSIONS:
        assert e.reason.startswith(("needs a GPU", "needs model weights", "needs torchvision")), e
    assert suites.exclusions_for(["tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py"]) == []


def test_pytest_command_loads_install_plugin_first_only_in_kvpool_mode(tmp_path):
    excl = [Exclusion("tests/a.py", "r"), Exclusion("tests/b.py::t", "r")]
    vanilla = cli.pytest_command("vanilla", ["tests/v1"], tmp_path, tmp_path / "o", tmp_path / "e", excl, "k1")
    kvpool = cli.pytest_command("kvpool", ["tests/v1"], tmp_path, tmp_path / "o", tmp_path / "e", excl)
    assert "kvpool.tools.conformance.pytest_install" not in vanilla
    assert kvpool[3:5] == ["-p", "kvpool.tools.conformance.pytest_install"]
    assert "--ignore=tests/a.py" in vanilla and "--ignore=tests/b.py::t" not in vanilla
    assert vanilla[vanilla.index("-k") + 1] == "k1"


def test_run_environment_is_offline_cpu_and_disables_kvpool_only_in_vanilla(tmp_path):
    base = {"PATH": "/bin", "HF_HUB_OFFLINE": "0", "VLLM_TARGET_DEVICE": "cpu"}
    vanilla = workdir.run_environment(base, tmp_path, "vanilla")
    kvpool = workdir.run_environment({**base, "KVPOOL_DISABLE": "1"}, tmp_path, "kvpool")
    for env in (vanilla, kvpool):
        # kvpool's CPU platform plugin; VLLM_TARGET_DEVICE=cpu would keep vLLM from consulting it
        assert env["KVPOOL_CPU_PLATFORM"] == "1" and "VLLM_TARGET_DEVICE" not in env
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path)
    assert vanilla["KVPOOL_DISABLE"] == "1"
    assert "KVPOOL_DISABLE" not in kvpool


# -- plugins and fixture override on a synthetic test tree -----------------------------

VLLM_LIKE_CONFTEST = """
import pytest

@pytest.fixture()
def should_do_global_cleanup_after_test(request) -> bool:
    return True

@pytest.fixture(autouse=True)
def cleanup_fixture(should_do_global_cleanup_after_test):
    yield
    if should_do_global_cleanup_after_test:
        raise RuntimeError("torch.accelerator.empty_cache() without an accelerator")
"""

SYNTHETIC_TESTS = """
import pytest

def test_pass():
    pass

def test_fail():
    assert 1 == 2

def test_skip():
    pytest.skip("no")

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_setup_error(broken):
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.mark.parametrize("n", [1, 2])
def test_gpu_only(n):
    assert False, "should have been excluded"

def test_gpu_only_but_longer_name():
    pass
"""


def _synthetic_tree(root: Path) -> Path:
    (root / "tests" / "v1" / "core").mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "v1" / "__init__.py").write_text("")
    (root / "tests" / "v1" / "core" / "__init__.py").write_text("")
    (root / "tests" / "conftest.py").write_text(VLLM_LIKE_CONFTEST)
    (root / "tests" / "v1" / "core" / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
    (root / "tests" / "v1" / "core" / "test_broken_import.py").write_text("import no_such_module_kvpool\n")
    (root / "tests" / "v1" / "core" / "test_excluded_file.py").write_text("import no_such_module_either\n")
    return root


def _run_plugin(root: Path, exclusions: list[Exclusion], override: bool) -> dict:
    if override:
        assert workdir.write_overrides(root, ["tests/v1/core"]) == [root / "tests" / "v1" / "conftest.py"]
    excl_path = root / "excl.json"
    excl_path.write_text(json.dumps([{"nodeid": e.nodeid, "reason": e.reason} for e in exclusions]))
    out = root / "out.json"
    cmd = cli.pytest_command("vanilla", ["tests/v1/core"], root, out, excl_path, exclusions)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_outcomes_plugin_folds_phases_applies_exclusions_and_override_wins(tmp_path):
    root = _synthetic_tree(tmp_path)
    exclusions = [
        Exclusion("tests/v1/core/test_synthetic.py::test_gpu_only", "needs a GPU"),
        Exclusion("tests/v1/core/test_excluded_file.py", "needs model weights"),
    ]
    data = _run_plugin(root, exclusions, override=True)
    outcomes = {k: v["outcome"] for k, v in data["outcomes"].items()}
    t = "tests/v1/core/test_synthetic.py::"
    assert outcomes == {
        t + "test_pass": "passed",
        t + "test_fail": "failed",
        t + "test_skip": "skipped",
        t + "test_setup_error": "error",
        t + "test_xfail": "skipped",
        t + "test_gpu_only_but_longer_name": "passed",
        "tests/v1/core/test_broken_import.py": "error",
    }
    assert data["excluded"] == {
        t + "test_gpu_only[1]": t + "test_gpu_only",
        t + "test_gpu_only[2]": t + "test_gpu_only",
    }
    assert "assert 1 == 2" in data["outcomes"][t + "test_fail"]["message"]
    assert data["kvpool_installed"] is False
    # The override conftest is new: vLLM's files are untouched.
    assert "should_do_global_cleanup_after_test" in (root / "tests" / "v1" / "conftest.py").read_text()
    assert (root / "tests" / "conftest.py").read_text() == VLLM_LIKE_CONFTEST


def test_without_the_override_vllms_cleanup_fixture_errors_every_test(tmp_path):
    data = _run_plugin(_synthetic_tree(tmp_path), [], override=False)
    assert data["outcomes"]["tests/v1/core/test_synthetic.py::test_pass"]["outcome"] == "error"


def test_override_goes_to_the_shallowest_directory_without_a_vllm_conftest(tmp_path):
    root = _synthetic_tree(tmp_path)
    (root / "tests" / "v1" / "conftest.py").write_text("# vLLM's own\n")
    assert workdir.override_conftest_dir(root / "tests", "tests/v1/core/test_synthetic.py") == root / "tests/v1/core"
    with pytest.raises(ValueError):
        workdir.override_conftest_dir(root / "tests", "tests/test_top_level.py")


@pytest.mark.parametrize(
    "patch, expected",
    [
        (
            "def broken(**kw):\n    raise RuntimeError('native core missing')\nkvpool.install = broken",
            "native core missing",
        ),
        ("kvpool.install = lambda **kw: True\nkvpool.is_installed = lambda: False", "is_installed() is False"),
    ],
    ids=["install-raises", "install-is-a-no-op"],
)
def test_install_plugin_import_fails_loudly(patch, expected):
    code = f"import kvpool\n{patch}\nimport kvpool.tools.conformance.pytest_install\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "KvpoolInstallError" in proc.stderr and expected in proc.stderr, proc.stderr[-2000:]


# -- sdist: index lookup, cache, verification, extraction ------------------------------


def _fake_sdist(path: Path, version: str = "0.33.0") -> Path:
    return write_sdist(path, version, {
        "tests/__init__.py": b"",
        "tests/v1/test_x.py": b"def test_x():\n    pass\n",
        "pyproject.toml": b"[tool.pytest.ini_options]\n",
        "vllm/__init__.py": b"raise RuntimeError('sdist code must not be extracted')\n",
        "setup.py": b"",
    })


def _disk_index(root: Path, tarball: Path, sha: str) -> str:
    page = root / "simple" / "vllm"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<html><body><a href="{tarball.as_uri()}#sha256={sha}">{tarball.name}</a></body></html>'
    )
    return (root / "simple").as_uri() + "/"


def test_fetch_sdist_verifies_sha256_caches_and_reuses_the_cache_offline(tmp_path):
    tarball = _fake_sdist(tmp_path / "vllm-0.33.0.tar.gz")
    sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
    index = _disk_index(tmp_path / "idx", tarball, sha)
    cache = tmp_path / "cache"
    got = sdist.fetch_sdist("0.33.0", index_url=index, cache=cache)
    assert got == cache / "sdists" / "vllm-0.33.0.tar.gz"
    assert sdist.sha256_of(got) == sha
    # Second run: no index needed.
    assert sdist.fetch_sdist("0.33.0", index_url="file:///nonexistent/simple/", cache=cache) == got


def test_fetch_sdist_rejects_a_sha256_mismatch(tmp_path):
    tarball = _fake_sdist(tmp_path / "vllm-0.33.0.tar.gz")
    index = _disk_index(tmp_path / "idx", tarball, "0" * 64)
    with pytest.raises(sdist.SdistError, match="sha256 mismatch"):
        sdist.fetch_sdist("0.33.0", index_url=index, cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / "sdists" / "vllm-0.33.0.tar.gz").exists()


def test_parse_project_page_reads_pep691_json_with_relative_urls():
    body = json.dumps(
        {
            "files": [
                {
                    "filename": "vllm-0.33.0.tar.gz",
                    "url": "../../files/vllm-0.33.0.tar.gz",
                    "hashes": {"sha256": "ab" * 32},
                },
                {"filename": "vllm-0.32.0.tar.gz", "url": "x", "hashes": {}},
                {"filename": "vllm-0.31.0.tar.gz", "url": "y", "hashes": {"sha256": "cd" * 32}, "yanked": True},
            ]
        }
    ).encode()
    files = sdist.parse_project_page(body, sdist.JSON_ACCEPT, "https://idx.example/simple/vllm/")
    assert files == [sdist.SdistFile("vllm-0.33.0.tar.gz", "https://idx.example/files/vllm-0.33.0.tar.gz", "ab" * 32)]


def test_index_url_is_pips_own_choice_unless_given(monkeypatch, tmp_path):
    # pip resolves it in the environment's interpreter: its variables, its config
    # files, its default; kvpool names no index of its own.
    monkeypatch.delenv("KVPOOL_INDEX_URL", raising=False)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                      "extra-index-url = https://extra.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert sdist.index_urls() == ["https://mirror.example/simple/", "https://extra.example/simple/"]
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    assert sdist.index_urls()[0] == "https://env.example/simple/"
    assert sdist.index_urls("https://cli.example/simple")[0] == "https://cli.example/simple/"
    monkeypatch.setenv("KVPOOL_INDEX_URL", "https://kvpool.example/simple")
    assert sdist.index_urls()[0] == "https://kvpool.example/simple/"
    monkeypatch.delenv("KVPOOL_INDEX_URL")
    monkeypatch.delenv("PIP_INDEX_URL")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    # pip's own default, asked in a child (importing pip here loads the stdlib's
    # distutils, which setuptools' import hook then refuses in later tests).
    default = subprocess.run([sys.executable, "-c", ("from pip._internal.models.index import PyPI; "
                               "print(PyPI.simple_url)")], capture_output=True, text=True, check=True).stdout.strip()
    assert sdist.index_urls() == [default.rstrip("/") + "/"]


def test_extract_tests_takes_only_tests_and_pyproject(tmp_path):
    tarball = _fake_sdist(tmp_path / "vllm-0.33.0.tar.gz")
    dest = sdist.extract_tests(tarball, tmp_path / "src")
    assert (dest / "tests" / "v1" / "test_x.py").is_file()
    assert (dest / "pyproject.toml").is_file()
    assert not (dest / "vllm").exists() and not (dest / "setup.py").exists()


# -- end to end on a synthetic sdist ---------------------------------------------------

E2E_TESTS = """
import kvpool
from vllm.v1.core.kv_cache_utils import KVCacheBlock


def test_same_everywhere():
    assert KVCacheBlock(block_id=3).block_id == 3


def test_vllm_classes_bound_at_import_are_kvpools_in_kvpool_mode():
    # Fails in the kvpool run only if install came after this module's import.
    assert kvpool.is_installed() == ("kvpool" in KVCacheBlock.__module__)


def test_passes_only_on_vllms_own_block():
    assert not kvpool.is_installed()
"""


def _e2e_sdist(path: Path, replace: dict[str, str] | None = None) -> Path:
    files = {
        "tests/__init__.py": "",
        "tests/conftest.py": VLLM_LIKE_CONFTEST,
        "tests/v1/__init__.py": "",
        "tests/v1/core/__init__.py": "",
        "tests/v1/core/test_e2e.py": E2E_TESTS,
        **(replace or {}),
    }
    return write_sdist(path, "0.33.0", files)


def _kvpool_core_missing() -> str | None:
    try:
        import kvpool._core  # noqa: F401
    except ImportError as e:
        return f"kvpool's native core is not built: {e}"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_kvpool_core_missing() is not None, reason=str(_kvpool_core_missing()))
def test_cli_end_to_end_reports_the_regression_and_exits_one(tmp_path):
    tarball = _e2e_sdist(tmp_path / "vllm-0.33.0.tar.gz")
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool",
            "conformance",
            "--sdist",
            str(tarball),
            "--suite",
            "tests/v1/core",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert r["vanilla"] == {"passed": 3, "failed": 0, "skipped": 0, "errors": 0}
    assert r["kvpool"] == {"passed": 2, "failed": 1, "skipped": 0, "errors": 0}
    assert r["regressions"] == ["tests/v1/core/test_e2e.py::test_passes_only_on_vllms_own_block"]
    assert "REGRESSIONS (1)" in proc.stdout


def test_cli_exits_nonzero_when_vanilla_collects_nothing(tmp_path):
    tarball = _e2e_sdist(tmp_path / "vllm-0.33.0.tar.gz", {"tests/v1/core/test_e2e.py": "def test_a():\n    pass\n"})
    code = cli.main(
        [
            "--sdist",
            str(tarball),
            "--suite",
            "tests/v1/core",
            "--mode",
            "vanilla",
            "-k",
            "no_test_matches_this",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == report.EXIT_INVALID_RUN
    assert "the vanilla run collected no tests" in json.loads((tmp_path / "r.json").read_text())["problems"]


def test_cli_names_every_failed_test_in_both_modes_and_whether_it_failed_the_same_way(tmp_path, capsys):
    tests = E2E_TESTS + """

def test_fails_in_both_runs():
    assert 1 == 2, "the same in both runs"


def test_fails_differently():
    raise RuntimeError("kvpool installed" if kvpool.is_installed() else "vanilla")
"""
    tarball = _e2e_sdist(tmp_path / "vllm-0.33.0.tar.gz", {"tests/v1/core/test_e2e.py": tests})
    out = tmp_path / "r.json"
    code = cli.main(["--sdist", str(tarball), "--suite", "tests/v1/core", "--json", str(out)])
    assert code == report.EXIT_REGRESSIONS
    r = json.loads(out.read_text())
    both = "tests/v1/core/test_e2e.py::test_fails_in_both_runs"
    differently = "tests/v1/core/test_e2e.py::test_fails_differently"
    only_kvpool = "tests/v1/core/test_e2e.py::test_passes_only_on_vllms_own_block"
    by_mode = {mode: {e["nodeid"]: e for e in r["failed"][mode]} for mode in ("vanilla", "kvpool")}
    assert set(by_mode["vanilla"]) == {both, differently}
    assert set(by_mode["kvpool"]) == {both, differently, only_kvpool}
    assert by_mode["kvpool"][both]["same_in_other_mode"] is True
    assert by_mode["kvpool"][differently]["same_in_other_mode"] is False
    assert by_mode["kvpool"][only_kvpool]["other_outcome"] == "passed"
    text = capsys.readouterr().out
    assert "failed in the vanilla run (2):" in text and "failed in the kvpool run (3):" in text
    assert f"{both}  [failed; the same way in the vanilla run (not kvpool's doing)]" in text
    assert f"{differently}  [failed; vanilla run: failed, with a different error]" in text
    assert f"{only_kvpool}  [failed; vanilla run: passed]" in text


@pytest.mark.parametrize("argv,message", [
    (["--jobs", "0"], "argument --jobs: expected an integer >= 1"),
    (["--timeout", "-5"], "argument --timeout: expected a number > 0"),
    (["--json", "/nonexistent-dir/r.json"], "argument --json: cannot write '/nonexistent-dir/r.json'"),
    (["--sdist", "/nonexistent-dir/vllm-0.33.0.tar.gz"], "argument --sdist: no such file"),
])
def test_cli_rejects_bad_flags_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_a_suite_missing_from_the_sdist(tmp_path):
    tarball = _e2e_sdist(tmp_path / "vllm-0.33.0.tar.gz", {"tests/v1/core/test_e2e.py": ""})
    assert cli.main(["--sdist", str(tarball), "--suite", "tests/v1/nope"]) == cli.EXIT_SETUP_FAILED


# -- offline Hugging Face cache of the shipped model configs ---------------------------

RESOLVE_ALL = """
import json, sys
from transformers import AutoConfig
result = {}
for name in sys.argv[1:]:
    try:
        result[name] = AutoConfig.from_pretrained(name).model_type
    except Exception as e:
        result[name] = "ERROR " + type(e).__name__
print(json.dumps(result))
"""

#: Every model vLLM 0.33.0's default suites name (found by grepping them).
MODELS_THE_SUITES_NAME = {
    "facebook/opt-125m",
    "facebook/opt-350m",
    "Qwen/Qwen1.5-7B",
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen2.5-VL-3B-Instruct",
    "llava-hf/llava-1.5-7b-hf",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "Qwen/Qwen3.5-0.8B",
}


def test_every_model_the_suites_name_is_shipped():
    assert set(shipped_models()) >= MODELS_THE_SUITES_NAME


def test_shipped_configs_are_json_with_architectures_and_model_type():
    for name in shipped_models():
        d = CONFIG_ROOT / name.replace("/", "--", 1)
        config = json.loads((d / "config.json").read_text())
        assert config["architectures"] and config["model_type"], name
        json.loads((d / "generation_config.json").read_text())


def test_every_shipped_config_resolves_offline_and_others_do_not(tmp_path):
    hf_home = materialize_hf_cache(tmp_path / "hf")
    layout = hf_home / "hub" / "models--facebook--opt-125m"
    revision = (layout / "refs" / "main").read_text()
    assert (layout / "snapshots" / revision / "config.json").is_file()
    env = {**os.environ, **offline_env(hf_home)}
    names = [*shipped_models(), "facebook/opt-1.3b"]
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE_ALL, *names], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in shipped_models():
        expected = json.loads((CONFIG_ROOT / name.replace("/", "--", 1) / "config.json").read_text())["model_type"]
        assert resolved[name] == expected, (name, resolved[name])
    assert resolved["facebook/opt-1.3b"].startswith("ERROR"), "the cache must be offline"


def test_text_model_configs_resolve_through_vllm_model_config(tmp_path):
    """vLLM's ModelConfig (what the scheduler tests build) accepts the text-only models."""
    hf_home = materialize_hf_cache(tmp_path / "hf")
    code = textwrap.dedent(
        """
        import sys
        from vllm.config import ModelConfig
        for name in sys.argv[1:]:
            m = ModelConfig(model=name, dtype="float16", seed=42, skip_tokenizer_init=True, max_model_len=2048)
            print(name, m.hf_config.model_type)
        """
    )
    names = ["facebook/opt-125m", "facebook/opt-350m", "Qwen/Qwen1.5-7B", "Qwen/Qwen3-0.6B"]
    env = cpu_environment({**os.environ, **offline_env(hf_home)})
    proc = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()][-4:] == names
