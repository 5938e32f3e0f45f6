"""pytest plugin that installs kvpool into vLLM before any test module is imported.

Loaded with ``-p kvpool.tools.conformance.pytest_install``: pytest imports ``-p`` plugins
while parsing its arguments, before it loads any ``conftest.py`` (vLLM's
``tests/conftest.py`` imports ``vllm.LLM`` and through it the block pool) and before
it imports a test module. Importing this module calls ``kvpool.install()``; if that
raises or leaves kvpool uninstalled, the import fails and pytest stops with the
error, so the kvpool run can never silently fall back to vLLM's own classes.
``pytest_sessionstart`` checks again once all conftests are loaded.
"""

from __future__ import annotations

import pytest

from kvpool.errors import KvpoolInstallError  # (defined there, re-exported here)


def _install() -> None:
    try:
        import kvpool

        kvpool.install()
    except Exception as e:
        raise KvpoolInstallError(f"kvpool.install() failed; the kvpool run cannot start: {e!r}") from e
    if not kvpool.is_installed():
        raise KvpoolInstallError("kvpool.install() returned but kvpool.is_installed() is False")


_install()


def pytest_sessionstart(session: pytest.Session) -> None:
    import kvpool

    if not kvpool.is_installed():
        raise pytest.UsageError("kvpool was uninstalled while pytest loaded its conftests")


def pytest_report_header(config: pytest.Config) -> str:
    import kvpool

    return f"kvpool {kvpool.__version__} installed into vLLM (conformance run)"
