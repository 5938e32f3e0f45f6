#!/usr/bin/env bash
# kvpool under a debug CPython (Debian's python3.11-dbg: Py_DEBUG, interpreter asserts
# on, sys.gettotalrefcount()): builds kvpool against it into .venv-dbg and runs kvpool's
# suite plus the leak check (tests/native/test_leak_check.py: total reference count and live
# object counts flat across 10^5 random pool operations on every hot path).
#
#   bash scripts/test-debug-python.sh            # full suite + leak check at 10^5 ops
#   bash scripts/test-debug-python.sh --short    # CI: the pool/hot-path tests + 10^5-op leak check
#
# .venv-dbg reuses .venv's packages (vLLM, torch, numpy ...): since Python 3.8 a debug
# build has the release ABI, and Debian's python3.11-dbg also accepts the release
# extension suffix, so release wheels import. Their own C code does not count
# references (it is not built with Py_REF_DEBUG); kvpool's extension is rebuilt here
# against the debug headers, so every reference it takes or drops is counted.
# Details and results: docs/native-checks.md.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
short=0
[ "${1:-}" = "--short" ] && short=1
use_cpu_platform

if ! command -v python3.11-dbg >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3.11-dbg >/dev/null
fi
ensure_dev_venv

release_site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -x .venv-dbg/bin/python ]; then
  python3.11-dbg -m venv --without-pip .venv-dbg
fi
dbg_site="$(.venv-dbg/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# A plain path line: .venv's own .pth files (kvpool's editable finder) are not run, so
# `kvpool` resolves to the debug build in .venv-dbg, which comes first on sys.path.
echo "$release_site" > "$dbg_site/zz_kvpool_release_venv.pth"

# Debug build type: C asserts (CPython's header asserts included) stay on; -O1 keeps
# the suite's run time reasonable. -DPy_DEBUG: Debian's /usr/include/python3.11d holds
# symlinks into python3.11/, so Python.h's #include "pyconfig.h" finds the *release*
# pyconfig.h (the two differ only in Py_DEBUG, ALT_SOABI, WITH_VALGRIND); without it
# Py_INCREF/Py_DECREF in the extension would not count into sys.gettotalrefcount().
rm -rf build-native-checks/dbg
.venv-dbg/bin/python -m pip --disable-pip-version-check install -q --no-build-isolation --no-deps \
  --ignore-installed -C build-dir=build-native-checks/dbg -C cmake.build-type=Debug \
  -C cmake.define.CMAKE_CXX_FLAGS_DEBUG="-O1 -g -DPy_DEBUG" . 2>&1 | grep -v "^$" || true
nm -D .venv-dbg/lib/python3.11/site-packages/kvpool/_core.*.so | grep _Py_RefTotal >/dev/null \
  || { echo "kvpool._core was not compiled with Py_REF_DEBUG" >&2; exit 1; }
.venv-dbg/bin/python - <<'PY'
import sys, sysconfig, kvpool._core as core
assert hasattr(sys, "gettotalrefcount"), "not a Py_DEBUG interpreter"
assert core.__file__.startswith(sys.prefix), core.__file__
print(f"debug python {sys.version.split()[0]} (Py_DEBUG={sysconfig.get_config_var('Py_DEBUG')}), kvpool._core from {core.__file__}")
PY

py=.venv-dbg/bin/python
if [ "$short" = 1 ]; then
  # The test files marked `debug` (pyproject.toml). The hybrid step's differential at
  # 500 operations per case (at the Mamba test's 1,500 this run grew from 9 min 50 s to 14 min).
  KVPOOL_MANAGER_DIFF_OPS=6000 KVPOOL_HYBRID_DIFF_OPS=2000 "$py" -m pytest -q -p no:cacheprovider -s -m debug tests
else
  "$py" -m pytest -q -p no:cacheprovider -s tests/native/test_leak_check.py
  "$py" -m pytest -q -p no:cacheprovider tests --deselect tests/native/test_leak_check.py
fi
