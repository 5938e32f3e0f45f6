"""The extension's type stubs (kvpool/_core.pyi) match the compiled module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_stubs_match_the_extension_module(tmp_path):
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvpool._core", "--allowlist", str(HERE / "stubtest_allowlist.txt")],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_package_is_marked_typed():
    import kvpool

    assert (Path(kvpool.__file__).parent / "py.typed").exists()
    assert (Path(kvpool.__file__).parent / "_core.pyi").exists()
