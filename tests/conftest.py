"""Shared fixtures: every test runs on CPU, offline, and leaves vLLM uninstalled."""

from __future__ import annotations

import os

from kvpool.cpu_platform import cpu_environment

# vLLM's CPU platform through kvpool's opt-in platform plugin (vLLM 0.34.0's own raises on
# an x86 CPU without triton-cpu); child processes inherit it.
cpu_environment(os.environ)

import pytest  # noqa: E402  (after the platform environment above)

from kvpool.tools.hf_offline import materialize_hf_cache, offline_env  # noqa: E402

_HF_HOME = None


def pytest_configure(config):
    # Model configs come from the files kvpool ships, never from the hub.
    global _HF_HOME
    import tempfile

    _HF_HOME = tempfile.mkdtemp(prefix="kvpool-tests-hf-")
    materialize_hf_cache(_HF_HOME)
    os.environ.update(offline_env(_HF_HOME))


def pytest_collection_modifyitems(config, items):
    # Only on an xdist worker: a plain run keeps pytest's order.
    if not hasattr(config, "workerinput"):
        return
    from tests.support.ordering import LONGEST_FIRST

    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


@pytest.fixture
def installed():
    """kvpool installed for the test, uninstalled afterwards."""
    import kvpool

    kvpool.install()
    try:
        yield
    finally:
        kvpool.uninstall()


@pytest.fixture(autouse=True)
def _always_uninstall():
    yield
    import kvpool

    if kvpool.is_installed():
        kvpool.uninstall()


@pytest.fixture
def quiet_pool_logs():
    """Refused resets log a warning per call on vLLM's pool and kvpool's; keeps a long
    differential's output short."""
    import logging

    loggers = [logging.getLogger(n) for n in ("vllm.v1.core.block_pool", "kvpool.block_pool")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


@pytest.fixture(params=[True, False], ids=["small-int-fast-path", "slow-path"])
def small_int_path(request):
    """Run the test with the block loops' small-int fast path on, then off (every
    ref_cnt then takes the checked slow path)."""
    from kvpool._core import _set_small_int_fast_path

    if not request.param:
        _set_small_int_fast_path(False)
    try:
        yield request.param
    finally:
        assert _set_small_int_fast_path(True)
