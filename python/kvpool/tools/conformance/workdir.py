"""Lay out the scratch directory the conformance runs use.

    <workdir>/src/tests/...          vLLM's test tree from the sdist, untouched, plus
    <workdir>/src/tests/v1/conftest.py   written here: the CPU-machine fixture override
    <workdir>/src/pyproject.toml     vLLM's (registers its pytest markers)
    <workdir>/hf_home/               offline Hugging Face cache (kvpool.tools.hf_offline)
    <workdir>/{vanilla,kvpool}.json  per-test outcomes; .log: each run's output

CPU-machine settings live here and in the runner's environment, never in vLLM's files:
the override conftest is a new file in a directory where the sdist has none.
"""

from __future__ import annotations

from pathlib import Path

from kvpool import envs
from kvpool.tools.hf_offline import OFFLINE_FLAGS, materialize_hf_cache, offline_env
from kvpool.vllm_compat import ALLOW_UNTESTED_ENV

#: Marker in every file the runner writes into the test tree.
WRITTEN_BY = "written by kvpool's conformance runner (kvpool/tools/conformance/workdir.py)"

#: vLLM's ``tests/conftest.py`` runs ``cleanup_dist_env_and_memory()`` after every test
#: (an autouse fixture) unless ``should_do_global_cleanup_after_test`` is False; that
#: cleanup calls ``torch.accelerator.empty_cache()`` on non-CPU platforms, which raises
#: without an accelerator, and costs ~0.3 s of gc and dynamo reset per test (a 10x
#: slowdown of tests/v1/core). vLLM's own CPU-only test folders override the fixture the
#: same way (e.g. tests/parser/engine/conftest.py). Tests that set up a distributed
#: environment tear it down themselves (the ``dist_init`` fixture does).
CLEANUP_OVERRIDE = f'''"""{WRITTEN_BY}: CPU-machine fixture override."""

import pytest


@pytest.fixture()
def should_do_global_cleanup_after_test() -> bool:
    return False
'''


def override_conftest_dir(tests_root: Path, suite: str) -> Path:
    """The directory to hold the override conftest for ``suite``.

    The shallowest directory below ``tests/`` on the path to the suite that has no
    ``conftest.py`` of vLLM's: a conftest there is closer to the tests than
    ``tests/conftest.py``, so its fixture wins, and no vLLM file is edited.

    Raises:
        ValueError: every directory on the way already has a conftest of vLLM's, or the
            suite lies directly in ``tests/``.
    """
    rel = Path(suite.split("::", 1)[0])
    parts = rel.parts
    if not parts or parts[0] != "tests":
        raise ValueError(f"suite {suite!r} is not under tests/")
    src_root = tests_root.parent
    for depth in range(2, len(parts) + 1):
        candidate = src_root.joinpath(*parts[:depth])
        if not candidate.is_dir():
            break
        conftest = candidate / "conftest.py"
        if not conftest.exists() or WRITTEN_BY in conftest.read_text(errors="replace"):
            return candidate
    raise ValueError(f"no directory on the way to {suite!r} is free for the fixture override conftest")


def write_overrides(src_root: Path, suites: list[str]) -> list[Path]:
    """Write the fixture override conftest for every suite; returns the files written."""
    written = []
    for suite in suites:
        directory = override_conftest_dir(src_root / "tests", suite)
        path = directory / "conftest.py"
        if not path.exists():
            path.write_text(CLEANUP_OVERRIDE)
            written.append(path)
    return written


def prepare_hf_home(workdir: Path) -> Path:
    """Lay every model config kvpool ships into ``workdir/hf_home``."""
    return materialize_hf_cache(workdir / "hf_home")


def run_environment(base: dict[str, str], hf_home: Path, mode: str) -> dict[str, str]:
    """Environment of one pytest subprocess.

    CPU platform (``KVPOOL_CPU_PLATFORM=1``, see :mod:`kvpool.cpu_platform`), offline
    Hugging Face cache; in the vanilla run ``KVPOOL_DISABLE=1`` so
    kvpool's ``vllm.general_plugins`` entry point leaves vLLM's classes alone in any
    process vLLM starts; in the kvpool run the variable is removed and
    ``KVPOOL_ALLOW_UNTESTED_VLLM=1`` is set (the run that validates a release).
    """
    env = {k: v for k, v in base.items() if k not in OFFLINE_FLAGS}
    env.update(offline_env(hf_home))
    # vLLM's CPU platform through kvpool's platform plugin (vLLM 0.34.0's own raises on an
    # x86 CPU without triton-cpu); VLLM_TARGET_DEVICE=cpu would bypass platform plugins.
    env[envs.CPU_PLATFORM] = "1"
    env.pop("VLLM_TARGET_DEVICE", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # Hugging Face token / endpoint settings must not send the offline run anywhere.
    env.pop("HF_ENDPOINT", None)
    if mode == "vanilla":
        env[envs.DISABLE] = "1"
    else:
        env.pop(envs.DISABLE, None)
        # This run is what validates a release for SUPPORTED_VLLM_VERSIONS, so kvpool
        # installs on a release of the matrix that is not (yet) listed there.
        env[ALLOW_UNTESTED_ENV] = "1"
    return env
