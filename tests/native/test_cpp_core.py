"""The plain C++ core (cpp/), compiled and run on its own, without Python headers."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.support.paths import REPO


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++17 compiler (g++)")
def test_cpp_core_unit_tests(tmp_path):
    exe = tmp_path / "test_core"
    sources = [REPO / "cpp/tests/test_core.cpp", REPO / "cpp/free_block_list.cpp", REPO / "cpp/fenced_free_queue.cpp"]
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
         "-I", str(REPO / "cpp"), *map(str, sources), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    # Without a preload an earlier in-process replay may have left in os.environ (vLLM's
    # CPU platform adds its libraries to LD_PRELOAD): ASan must come first.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "all checks passed" in proc.stdout
